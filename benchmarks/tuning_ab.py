"""Compare Tuning variants of one collective in one world, blocks of calls alternating.

    asynccoll run -n 4 benchmarks/tuning_ab.py all_reduce 1M off:spin_us=0 on:
    asynccoll run -n 4 benchmarks/tuning_ab.py all_gather 1M a: b:poll_max_bytes=1M --calls 100
    asynccoll run -n 4 benchmarks/tuning_ab.py all_reduce 16M a: b:min_segment_bytes=4M --calls 20
    asynccoll run -n 4 benchmarks/tuning_ab.py reduce_scatter 4M ring: direct:small_bytes=8M

Each variant is ``NAME:FIELD=VALUE,...`` (sizes take K and M; an empty list is the default
``Tuning``). Every block sets the variant on all ranks (``Communicator.tuning``), runs a
barrier, ``--calls`` / 5 untimed calls, then ``--calls`` timed ones; the variants take turns
block by block, in reversed order every other time, for ``--blocks`` blocks each. Rank 0
prints each variant's block medians (of its own calls), the median of those, and against the
first variant the ratio of medians and in how many blocks the variant was faster.

Launch-to-launch differences (where the scheduler puts the ranks, the machine's state) move
figures by more than many changes are worth; in one world they are shared by the variants.
"""

from __future__ import annotations

import argparse
import statistics
import time

from workers import (  # benchmarks/ is on sys.path as a script
    asynccoll_op,
    parse_size,
    run_event_loop,
    tuning_fields,
)

import asynccoll


def variant(text: str) -> tuple[str, asynccoll.Tuning]:
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:FIELD=VALUE,...")
    return name, asynccoll.Tuning(**tuning_fields(list(filter(None, rest.split(",")))))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op", choices=("all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                  "barrier"))
    p.add_argument("nbytes", type=parse_size, help="all_gather: the gathered size")
    p.add_argument("variants", type=variant, nargs="+")
    p.add_argument("--calls", type=int, default=200, help="timed calls per block")
    p.add_argument("--blocks", type=int, default=12, help="blocks per variant")
    args = p.parse_args()
    comm = await asynccoll.init(backend="tcp")
    once = asynccoll_op(comm, args.op, args.nbytes)
    medians: dict[str, list[float]] = {name: [] for name, _ in args.variants}
    for _ in range(max(50, args.calls)):
        await once()
    for block in range(args.blocks):
        for name, tuning in (args.variants if block % 2 == 0 else args.variants[::-1]):
            comm.tuning = tuning
            await comm.barrier()
            for _ in range(args.calls // 5):
                await once()
            times = []
            for _ in range(args.calls):
                t = time.perf_counter()
                await once()
                times.append(time.perf_counter() - t)
            medians[name].append(statistics.median(times) * 1e6)
    if comm.rank == 0:
        first = args.variants[0][0]
        base = statistics.median(medians[first])
        print(f"# {args.op} {args.nbytes} B x {comm.world_size} ranks, {args.blocks} blocks of "
              f"{args.calls} calls per variant")
        for name, values in medians.items():
            faster = sum(x < y for x, y in zip(values, medians[first], strict=True))
            print(f"{name}: median {statistics.median(values):.1f} us, "
                  f"{statistics.median(values) / base:.3f} x {first} (faster in {faster} of "
                  f"{len(values)} blocks); blocks {' '.join(f'{x:.0f}' for x in values)}")
    await comm.close()


if __name__ == "__main__":
    run_event_loop(main())
