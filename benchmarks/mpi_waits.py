"""The ``"mpi"`` backend's all_reduce against mpi4py's own calls, each call after a barrier.

    mpirun -n 2 python benchmarks/mpi_waits.py
    mpirun -n 2 python benchmarks/mpi_waits.py --spin 2e-4     # the waits before this version

A training step computes, then all-reduces: the ranks arrive at each collective together, as
after the barrier here, and MPI moves the data only while the ranks call into it. The
backend's waits test their requests on every turn of the event loop for ``--spin`` seconds
(default: ``asynccoll.transport.mpi.WAIT_SPIN_SECONDS``), then sleep between tests; this
shows what that costs against mpi4py's blocking ``Allreduce`` and ``Iallreduce`` + ``Wait``
(median us of ``--iters`` calls, rank 0 prints).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np
from workers import parse_size  # benchmarks/ is on sys.path when run as a script


def raw(comm: Any, mpi: Any, a: np.ndarray, blocking: bool, iters: int) -> float:
    times = []
    for i in range(iters + 3):
        comm.Barrier()
        t0 = time.perf_counter()
        if blocking:
            comm.Allreduce(mpi.IN_PLACE, a)
        else:
            comm.Iallreduce(mpi.IN_PLACE, a).Wait()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def main(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import asynccoll
    from asynccoll.transport import mpi as backend

    if args.spin is not None:
        backend.WAIT_SPIN_SECONDS = args.spin
    world = MPI.COMM_WORLD
    async with await asynccoll.init(backend="mpi") as comm:
        if comm.rank == 0:
            print(f"# {comm.world_size} ranks, {MPI.Get_library_version().split(',')[0]}, "
                  f"wait spin {backend.WAIT_SPIN_SECONDS:g} s; median us")
            print(f"{'bytes':>10} {'dtype':>8} {'Allreduce':>10} {'Iallreduce':>11} "
                  f"{'asynccoll':>10}")
        for nbytes in args.sizes:
            for dtype in ("float32", "int32"):
                a = np.ones(nbytes // 4, dtype)
                blocking = raw(world, MPI, a, True, args.iters)
                nonblocking = raw(world, MPI, a, False, args.iters)
                times = []
                for i in range(args.iters + 3):
                    await comm.barrier()
                    t0 = time.perf_counter()
                    await comm.all_reduce(a)
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                if comm.rank == 0:
                    print(f"{nbytes:>10} {dtype:>8} {blocking:>10.1f} {nonblocking:>11.1f} "
                          f"{statistics.median(times) * 1e6:>10.1f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda t: [parse_size(x) for x in t.split(",")],
                   default=[1 << 18, 1 << 21], help="bytes, comma-separated (e.g. 256K,2M)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--spin", type=float, default=None, help="override the waits' spin (s)")
    asyncio.run(main(p.parse_args()))
