"""Time (and optionally profile) one collective in a loop; run it under the launcher.

    asynccoll run -n 2 benchmarks/profile_collective.py all_reduce 8 --iters 3000
    asynccoll run -n 2 benchmarks/profile_collective.py all_reduce 16M --iters 20 --profile
    asynccoll run -n 4 benchmarks/profile_collective.py all_reduce 8 --profile --sort ncalls
    asynccoll run -n 2 benchmarks/profile_collective.py barrier 0 --no-poll
    asynccoll run -n 2 benchmarks/profile_collective.py all_gather 1M --iters 1024 --blocks 16 \
        --all-ranks

Rank 0 prints the mean time per call (and its calls' median, 10th and 90th percentiles and
CPU time per call, split into user and system time from ``os.times``, whose 10 ms ticks want a
second or more of calls) and, with ``--profile``, the top ``--top`` rows (in
``--sort`` order) of a cProfile of the timed loop. ``--no-poll`` sets ``Tuning(poll_us=0)``
(the profile then shows work, not polling). ``--blocks N`` also prints, per block of
``--iters / N`` calls, the block's median time and the rank's core speed probe after it
(``workers.CoreProbe``, us: lower is a faster core) as ``median/probe``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

from workers import (  # benchmarks/ is on sys.path as a script
    CoreProbe,
    asynccoll_op,
    parse_size,
    run_event_loop,
    tuning_fields,
)

import asynccoll


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=("all_reduce", "barrier", "all_gather", "broadcast",
                                  "reduce_scatter"))
    p.add_argument("nbytes", type=parse_size)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sort", default="tottime",
                   help="the profile's order (a pstats key: tottime, cumtime, ncalls, ...)")
    p.add_argument("--top", type=int, default=20, help="the profile's number of rows")
    p.add_argument("--no-poll", action="store_true")
    p.add_argument("--tuning", action="append", default=[], metavar="NAME=VALUE",
                   help="a Tuning field to set (repeatable), e.g. segment_bytes=256K")
    p.add_argument("--all-ranks", action="store_true", help="every rank prints its figures")
    p.add_argument("--blocks", type=int, default=0,
                   help="also print each of this many blocks' median and core speed probe")
    p.add_argument("--pin", choices=("spread", "pack"),
                   help="pin rank r to core r %% cores (spread) or r // (ranks / cores) (pack)")
    args = p.parse_args()
    comm = await asynccoll.init(backend="tcp")
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, comm.world_size // len(cores))
        r = comm.rank
        os.sched_setaffinity(0, {cores[r % len(cores)] if args.pin == "spread"
                                 else cores[min(r // per, len(cores) - 1)]})
    fields = tuning_fields(args.tuning)
    if args.no_poll:
        fields.setdefault("poll_us", 0)
    if fields:
        comm.tuning = asynccoll.Tuning(**fields)
    # all_gather's size is the gathered output (as in benchmarks/workers.py)
    once = asynccoll_op(comm, args.op, args.nbytes)

    for _ in range(min(100, args.iters)):
        await once()
    await comm.barrier()
    prof = cProfile.Profile() if args.profile and comm.rank == 0 else None
    if prof:
        prof.enable()
    probe = CoreProbe() if args.blocks > 0 else None
    per_block = max(1, args.iters // args.blocks) if args.blocks > 0 else 0
    probes: list[float] = []
    spent = spent_cpu = 0.0  # in the probes, left out of the mean and CPU figures
    t = time.perf_counter()
    cpu = time.process_time()
    times = os.times()
    calls = []
    for i in range(args.iters):
        c = time.perf_counter()
        await once()
        calls.append(time.perf_counter() - c)
        if probe is not None and (i + 1) % per_block == 0:
            p0, c0 = time.perf_counter(), time.process_time()
            probes.append(probe())  # ~0.5 ms between two calls, outside the timed ones
            spent += time.perf_counter() - p0
            spent_cpu += time.process_time() - c0
    dt = (time.perf_counter() - t - spent) / args.iters
    cpu = (time.process_time() - cpu - spent_cpu) / args.iters
    after = os.times()
    user = (after.user - times.user) / args.iters  # the probes' share left in: ~0.5 ms each
    system = (after.system - times.system) / args.iters
    blocks = [sorted(calls[k * per_block:(k + 1) * per_block])[per_block // 2]
              for k in range(len(probes))]
    calls.sort()
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    if comm.rank == 0 or args.all_ranks:
        p10, p50, p90 = (calls[min(len(calls) - 1, len(calls) * q // 10)] * 1e6
                         for q in (1, 5, 9))
        print(f"{args.op} {args.nbytes} B x {comm.world_size} ranks: {dt * 1e6:.1f} us per call "
              f"(median {p50:.1f} us, p10 {p10:.1f}, p90 {p90:.1f}, CPU {cpu * 1e6:.1f} us: "
              f"user {user * 1e6:.1f}, system {system * 1e6:.1f})")
        if probes:
            pairs = zip(blocks, probes, strict=True)
            print("blocks (median/probe us): "
                  + " ".join(f"{b * 1e6:.0f}/{q * 1e6:.0f}" for b, q in pairs), flush=True)
    await comm.close()


if __name__ == "__main__":
    run_event_loop(main())
