"""One rank of a side-by-side collective benchmark: asynccoll, torch.distributed (gloo) or mpi4py.

Started by ``benchmarks/compare.py``; every framework is timed the same way so the ratios mean
something: per size, untimed warm-up calls (``warmup_for``), then each of ``iters`` calls timed
on its own;
a rank's figure is the median call, and the reported time is the slowest rank's (max over
ranks). Ops: all_reduce, all_gather, reduce_scatter, broadcast (from rank 0), all_to_all,
barrier. Sizes follow nccl-tests: all_gather's size is the gathered output, reduce_scatter's
and all_to_all's the input (whole blocks of float32 per rank).

Each rank 0 prints one ``RESULT {json}`` line per (op, size). Beside the time, a row carries
``probe_us``: how long a fixed piece of work (``CoreProbe``) took on the slowest rank's core
around that size's calls, so that a run shows when a framework drew slow cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np


def iters_for(nbytes: int) -> int:
    return max(5, min(1000, (64 << 20) // max(nbytes, 1 << 12)))


def warmup_for(nbytes: int, least: int) -> int:
    """Untimed calls before the timed ones: as many as will be timed (up to 1000 for small
    sizes, 5 for the largest), at least ``least``; every framework alike. A run's first
    thousand-odd calls are slower while the scheduler settles the ranks on the cores: medians
    of successive blocks of 250 4-rank 8-byte all_reduces of one run went 217, 173, 146, 124,
    113 us, then 84-112 us, and the harness measured 120-142 us after 100 warm-up calls
    against 88-95 us after 1000. The OSU micro-benchmarks skip 100-200 iterations of small
    messages; measuring the steady state needs about as many as are timed."""
    return max(least, min(1000, iters_for(nbytes)))


#: the ops whose result is a separate output buffer
OUT_OPS = ("all_gather", "reduce_scatter", "all_to_all")


def shapes(op: str, nbytes: int, n: int) -> tuple[int, int]:
    """(elements of the input, elements of the output) of float32 buffers."""
    count = max(1, nbytes // 4)
    per = max(1, count // n)  # a block of every rank's
    if op == "all_gather":
        return per, per * n
    if op == "reduce_scatter":
        return per * n, per
    if op == "all_to_all":
        return per * n, per * n
    return count, count


def report(framework: str, op: str, nbytes: int, n: int, seconds: float,
           probe: float = 0.0) -> None:
    # nccl-tests: the larger of the buffers as moved (all_gather: the gathered output)
    size = 0 if op == "barrier" else 4 * max(shapes(op, nbytes, n))
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}.get(op, 1.0)
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    row = {"framework": framework, "op": op, "ranks": n, "size": size,
           "time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * factor,
           "probe_us": probe * 1e6}
    print("RESULT " + json.dumps(row), flush=True)


class CoreProbe:
    """How fast this rank's core is now: the best of ``reps`` runs of a fixed piece of work
    (a Python loop and a 512 KiB copy that stays in cache), in seconds.

    The machine's virtual cores do not run at one speed: the same probe takes ~85 us on a
    core in one stretch and ~125-140 us in another (the host runs something beside them),
    and a 2-rank 1 MiB all_gather takes ~150 us with both ranks on fast cores, ~200 with one
    on a slow core and ~230-270 with both. A rank's figure is only comparable with another
    framework's when their probes are alike. The workers call it before and after a size's
    calls and report the larger, over ranks the largest: a core's speed changes between
    stretches of seconds.
    """

    def __init__(self, reps: int = 5) -> None:
        self.reps = reps
        self._src = np.ones(1 << 17, np.float32)
        self._dst = np.empty_like(self._src)

    def __call__(self) -> float:
        best = float("inf")
        for _ in range(self.reps):
            t = time.perf_counter()
            x = 0
            for i in range(2000):
                x += i
            np.copyto(self._dst, self._src)
            best = min(best, time.perf_counter() - t)
        return best


def verify(framework: str, op: str, n: int, got: Any) -> None:
    """Check one call's result, every rank's input filled with its rank + 1: all_reduce and
    reduce_scatter give n(n+1)/2, broadcast from rank 0 gives 1, all_gather and all_to_all rank
    r's block r + 1."""
    if op == "barrier":
        return
    got = np.asarray(got)
    if op in ("all_gather", "all_to_all"):
        want = np.repeat(np.arange(1, n + 1, dtype=np.float32), got.size // n)
    else:
        want = np.full(got.size, 1.0 if op == "broadcast" else n * (n + 1) / 2, np.float32)
    if got.size == 0 or not np.array_equal(got.ravel(), want):
        raise RuntimeError(f"{framework} {op} of {got.size} float32 over {n} ranks gave a wrong "
                           "result")


def median_time(fn: Callable[[], Any], iters: int, warmup: int,
                sync: Callable[[], Any] | None = None) -> float:
    """``warmup`` untimed calls, ``sync()`` (a barrier), then the median of ``iters`` calls."""
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---------------------------------------------------------------------------------- gloo

def run_gloo(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=n)
    probe = CoreProbe()
    for op in args.ops:
        for nbytes in (args.sizes if op != "barrier" else [0]):
            cin, cout = shapes(op, nbytes, n)

            def gloo_op(fill: float, op: str = op, cin: int = cin, cout: int = cout
                        ) -> tuple[Callable[[], Any], torch.Tensor]:
                a = torch.full((cin,), fill, dtype=torch.float32)
                out = torch.zeros(cout, dtype=torch.float32)
                return {
                    "all_reduce": lambda: dist.all_reduce(a),
                    "all_gather": lambda: dist.all_gather_into_tensor(out, a),
                    "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, a),
                    "all_to_all": lambda: dist.all_to_all_single(out, a),
                    "broadcast": lambda: dist.broadcast(a, 0),
                    "barrier": lambda: dist.barrier(),
                }[op], out if op in OUT_OPS else a

            check, got = gloo_op(rank + 1)
            check()
            verify("gloo", op, n, got.numpy())
            call, _ = gloo_op(0.0)
            before = probe()
            seconds = median_time(call, iters_for(nbytes), warmup_for(nbytes, args.warmup),
                                  dist.barrier)
            t = torch.tensor([seconds, max(before, probe())], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                report("gloo", op, nbytes, n, float(t[0]), float(t[1]))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------- mpi

def run_mpi(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    probe = CoreProbe()
    for op in args.ops:
        for nbytes in (args.sizes if op != "barrier" else [0]):
            cin, cout = shapes(op, nbytes, n)

            def mpi_op(fill: float, op: str = op, cin: int = cin, cout: int = cout
                       ) -> tuple[Callable[[], Any], np.ndarray]:
                a = np.zeros(cin, np.float32)
                if fill:
                    a.fill(fill)
                out = np.zeros(cout, np.float32)
                return {
                    "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, a),
                    "all_gather": lambda: comm.Allgather(a, out),
                    "reduce_scatter": lambda: comm.Reduce_scatter_block(a, out),
                    "all_to_all": lambda: comm.Alltoall(a, out),
                    "broadcast": lambda: comm.Bcast(a, 0),
                    "barrier": lambda: comm.Barrier(),
                }[op], out if op in OUT_OPS else a

            check, got = mpi_op(rank + 1)
            check()
            verify("mpi", op, n, got)
            call, _ = mpi_op(0.0)
            before = probe()
            seconds = median_time(call, iters_for(nbytes), warmup_for(nbytes, args.warmup),
                                  comm.Barrier)
            t = np.array([seconds, max(before, probe())])
            comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
            if rank == 0:
                report("mpi", op, nbytes, n, float(t[0]), float(t[1]))


# ------------------------------------------------------------------------------ asynccoll

def parse_size(text: str) -> int:
    """Bytes from ``8``, ``64K``, ``1M``, ``1.5G`` (a trailing ``B`` is allowed)."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def tuning_fields(items: list[str]) -> dict[str, Any]:
    """``asynccoll.Tuning`` keyword arguments from ``NAME=VALUE`` items (sizes as in
    ``parse_size``; ``direct_all_reduce`` takes its word)."""
    fields: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        fields[name] = value if name == "direct_all_reduce" else parse_size(value)
    return fields


def asynccoll_op(comm: Any, op: str, nbytes: int, fill: float = 0.0
                 ) -> Callable[[], Awaitable[Any]]:
    """One call of ``op`` (all_reduce, reduce_scatter, all_gather, broadcast from rank 0,
    all_to_all, barrier) on ``comm`` over float32 buffers of ``nbytes`` (reduce_scatter: the input;
    all_gather: the gathered output, written into a preallocated buffer as the peers' are),
    the buffers allocated once, here, the input filled with ``fill``."""
    cin, cout = shapes(op, nbytes, comm.world_size)
    a = np.zeros(cin, np.float32)
    if fill:
        a.fill(fill)
    out = np.zeros(cout, np.float32)
    if op == "all_reduce":
        return lambda: comm.all_reduce(a)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(a)
    if op == "all_gather":
        return lambda: comm.all_gather(a, out=out)
    if op == "broadcast":
        return lambda: comm.broadcast(a, 0)
    if op == "all_to_all":
        blocks = np.split(a, comm.world_size)  # (the results are new arrays: no out=)
        return lambda: comm.all_to_all(blocks)
    return lambda: comm.barrier()


async def _asynccoll(args: argparse.Namespace) -> None:
    import asynccoll

    comm = await asynccoll.init(backend="tcp")
    n = comm.world_size
    probe = CoreProbe()
    async with comm:
        for op in args.ops:
            for nbytes in (args.sizes if op != "barrier" else [0]):
                verify("asynccoll", op, n, await asynccoll_op(comm, op, nbytes, comm.rank + 1)())
                call = asynccoll_op(comm, op, nbytes)
                before = probe()
                for _ in range(warmup_for(nbytes, args.warmup)):
                    await call()
                await comm.barrier()
                times = []
                for _ in range(iters_for(nbytes)):
                    t = time.perf_counter()
                    await call()
                    times.append(time.perf_counter() - t)
                worst = np.array([statistics.median(times), max(before, probe())])
                await comm.all_reduce(worst, op=asynccoll.ReduceOp.MAX)
                if comm.rank == 0:
                    report("asynccoll", op, nbytes, n, float(worst[0]), float(worst[1]))


def run_event_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(coro)``, on uvloop when it is installed (as ``asynccoll bench`` does); the
    benchmark scripts that run under the launcher use it too (the launcher leaves a script's
    event loop to the script)."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def run_asynccoll(args: argparse.Namespace) -> None:
    run_event_loop(_asynccoll(args))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=("asynccoll", "gloo", "mpi"))
    p.add_argument("--ops", type=lambda s: s.split(","), required=True)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True)
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size, at least")
    p.add_argument("--port", type=int, default=0, help="gloo's TCP store port")
    args = p.parse_args(argv)
    try:
        {"asynccoll": run_asynccoll, "gloo": run_gloo, "mpi": run_mpi}[args.framework](args)
    except KeyboardInterrupt:  # stopped (compare.py's --timeout): no traceback per rank
        sys.stderr.write(f"{args.framework} worker: interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    sys.exit(main())
