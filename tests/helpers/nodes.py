"""For the multi-node launcher tests (``asynccoll run --nnodes``): ``nodes.py MODE``.

Every rank prints ``PID <pid>``, then ``ENV ...`` (what the launcher told it), and ``READY``
once the world formed (after a barrier).

MODE
    check   all_reduce the ranks and check the sum; print ``OK rank R of N``.
    fail    the last rank exits with code 3; the others sleep (in no collective, so only
            their launcher can stop them).
    fail-first  the same, with rank 0 (on node 0) failing.
    sleep   every rank sleeps, until stopped.
"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

import asynccoll


async def main(mode: str) -> None:
    print(f"PID {os.getpid()}", flush=True)
    env = os.environ
    print(f"ENV rank={env['ASYNCCOLL_RANK']} local={env['LOCAL_RANK']} "
          f"node={env['GROUP_RANK']} world={env['WORLD_SIZE']} "
          f"local_world={env['LOCAL_WORLD_SIZE']}", flush=True)
    async with await asynccoll.init(backend="tcp", timeout=30.0) as comm:
        await comm.barrier()
        print("READY", flush=True)
        r, n = comm.rank, comm.world_size
        if mode == "check":
            x = np.array([float(r)])
            await comm.all_reduce(x)
            assert x[0] == n * (n - 1) / 2, x
            print(f"OK rank {r} of {n}", flush=True)
        elif (mode, r) in (("fail", n - 1), ("fail-first", 0)):
            os._exit(3)
        elif mode in ("fail", "fail-first", "sleep"):
            await asyncio.sleep(60)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
