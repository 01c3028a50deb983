"""Many direct all_gathers over TCP between real processes, checked; print ``OK rank N``.

Started by the launcher tests (``asynccoll run -n N``). Sizes from one element to 1 MiB
blocks, some calls with blocks of different lengths, some with a point-to-point message to
the next rank sent right before the all_gather (so that the frame a rank reads off the wire
first is not the block it expects), some with a rank that arrives late (its peers' blocks
wait in its sockets, or in its mailbox). Prints how many blocks were read straight off the
wire (``Call.take_direct``) and how many went the usual way, then ``OK rank N``. Exits
non-zero (an AssertionError traceback) when a result is wrong.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import numpy as np

import asynccoll
from asynccoll.algorithms import Call


def counting(counts: list[int]) -> Callable[..., Any]:
    """``Call.take_direct`` adding to ``counts`` the blocks it read directly (``counts[0]``)
    and those it left to the usual receives (``counts[1]``); to patch in place of it."""
    take = Call.take_direct

    async def counted(self: Call, *args: Any, **kwargs: Any) -> Any:
        got = await take(self, *args, **kwargs)
        counts[0] += sum(r is None for r in got)
        counts[1] += sum(r is not None for r in got)
        return got

    return counted


def block(rank: int, rows: int, i: int) -> np.ndarray:
    return (np.arange(rows, dtype=np.float32) + 1000.0 * rank + 7.0 * i).astype(np.float32)


async def main() -> None:
    print(f"PID {os.getpid()}", flush=True)
    counts = [0, 0]
    Call.take_direct = counting(counts)  # type: ignore[method-assign]
    async with await asynccoll.init(backend="tcp", timeout=30.0) as comm:
        r, n = comm.rank, comm.world_size
        i = 0
        for rows in (1, 100, 4096, 65_536, 262_144):
            out = np.empty(rows * n, np.float32)
            for k in range(40):
                i += 1
                uneven = k % 10 == 9
                mine_rows = rows + (r if uneven else 0)
                if k % 7 == 3:  # a message to the next rank right before the all_gather
                    await comm.send(np.full(3, i + r, np.int64), (r + 1) % n, tag=i)
                if k % 11 == 5 and r == i % n:  # this rank arrives late
                    await asyncio.sleep(0.02)
                mine = block(r, mine_rows, i)
                if uneven:
                    got = await comm.all_gather(mine)
                else:
                    got = await comm.all_gather(mine, out=out)
                    assert got is out
                expect = np.concatenate([block(j, rows + (j if uneven else 0), i)
                                         for j in range(n)])
                np.testing.assert_array_equal(got, expect)
                if k % 7 == 3:
                    msg = await comm.recv((r - 1) % n, tag=i)
                    np.testing.assert_array_equal(msg, np.full(3, i + (r - 1) % n, np.int64))
        await comm.barrier()
        print(f"direct {counts[0]} usual {counts[1]} rank {r}", flush=True)
        print(f"OK rank {r}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
