"""Time (and optionally profile) one collective in a loop; run it under the launcher.

    asynccoll run -n 2 benchmarks/profile_collective.py all_reduce 8 --iters 3000
    asynccoll run -n 2 benchmarks/profile_collective.py all_reduce 16M --iters 20 --profile
    asynccoll run -n 2 benchmarks/profile_collective.py barrier 0 --no-poll

Rank 0 prints the mean time per call and, with ``--profile``, the top of a cProfile of the timed
loop. ``--no-poll`` sets ``Tuning(poll_us=0)`` (the profile then shows work, not polling).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time

import numpy as np

import asynccoll


def size(text: str) -> int:
    text = text.upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=("all_reduce", "barrier", "all_gather", "broadcast"))
    p.add_argument("nbytes", type=size)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-poll", action="store_true")
    args = p.parse_args()
    comm = await asynccoll.init(backend="tcp")
    if args.no_poll:
        comm.tuning = asynccoll.Tuning(poll_us=0)
    # all_gather's size is the gathered output, written into a preallocated buffer (as in
    # benchmarks/workers.py)
    per = max(1, args.nbytes // 4 // (comm.world_size if args.op == "all_gather" else 1))
    a = np.zeros(per, np.float32)
    out = np.zeros(per * comm.world_size, np.float32)

    async def once() -> None:
        if args.op == "all_reduce":
            await comm.all_reduce(a)
        elif args.op == "all_gather":
            await comm.all_gather(a, out=out)
        elif args.op == "broadcast":
            await comm.broadcast(a)
        else:
            await comm.barrier()

    for _ in range(min(100, args.iters)):
        await once()
    await comm.barrier()
    prof = cProfile.Profile() if args.profile and comm.rank == 0 else None
    if prof:
        prof.enable()
    t = time.perf_counter()
    for _ in range(args.iters):
        await once()
    dt = (time.perf_counter() - t) / args.iters
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    if comm.rank == 0:
        print(f"{args.op} {args.nbytes} B x {comm.world_size} ranks: {dt * 1e6:.1f} us per call")
    await comm.close()


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
