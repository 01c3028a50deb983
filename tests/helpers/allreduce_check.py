"""Run a few collectives over TCP and check every result against NumPy; print ``OK rank N``.

Started by the launcher tests (``asynccoll run -n N``) or by hand with the rendezvous
environment (``ASYNCCOLL_*`` or torchrun-style ``RANK``/``WORLD_SIZE``/``MASTER_*``).
Exits non-zero (an AssertionError traceback) when a result is wrong.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

import asynccoll
from asynccoll import ReduceOp


async def main() -> None:
    print(f"PID {os.getpid()}", flush=True)
    async with await asynccoll.init(backend="tcp", timeout=30.0) as comm:
        r, n = comm.rank, comm.world_size

        # all_reduce, several sizes (small ones take the latency path, large ones the ring)
        for size in (1, 7, 1000, 100_003, 1 << 20):
            base = np.arange(size, dtype=np.int64)
            a = base * (r + 1)
            out = await comm.all_reduce(a)
            assert out is a
            np.testing.assert_array_equal(a, base * (n * (n + 1) // 2))

            f = np.linspace(0.0, 1.0, size, dtype=np.float32) + r
            await comm.all_reduce(f)
            expected = sum(np.linspace(0.0, 1.0, size, dtype=np.float32) + k for k in range(n))
            np.testing.assert_allclose(f, expected, rtol=1e-5)

        m = np.array([r, -r, 10 * r], dtype=np.float64)
        await comm.all_reduce(m, op=ReduceOp.MAX)
        np.testing.assert_array_equal(m, [n - 1, 0, 10 * (n - 1)])

        # all_gather with axis-0 lengths that differ between ranks
        mine = np.full((r + 1, 3), r, dtype=np.int32)
        gathered = await comm.all_gather(mine)
        expected_g = np.concatenate([np.full((k + 1, 3), k, dtype=np.int32) for k in range(n)])
        np.testing.assert_array_equal(gathered, expected_g)

        # broadcast from every root
        for root in range(n):
            b = np.arange(50_000, dtype=np.float64) * (root + 1) if r == root else np.zeros(50_000)
            await comm.broadcast(b, root=root)
            np.testing.assert_array_equal(b, np.arange(50_000, dtype=np.float64) * (root + 1))

        await comm.barrier()
        print(f"OK rank {r}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
