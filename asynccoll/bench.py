"""``asynccoll bench``: an nccl-tests-style table per collective.

Columns, as nccl-tests defines them: size (bytes of the op's full buffer: all_reduce's and
broadcast's array, all_gather's gathered output, reduce_scatter's input, all_to_all's input,
the last three whole blocks of every rank), count (elements: of the array for all_reduce and
broadcast, of one rank's block for all_gather and reduce_scatter, of one peer's block for
all_to_all; 0 for barrier), dtype, time (us, the slowest rank's median operation), algbw =
size / time and busbw = algbw x the op's bus factor (all_reduce 2(n-1)/n; all_gather,
reduce_scatter, all_to_all (n-1)/n; broadcast 1), in GB/s.

``--json`` prints one JSON object a line (rank 0), a row per (op, size), with the keys of
``JSON_KEYS``: op, size, count, dtype, time_us, algbw, busbw (GB/s), ranks, backend.

Runs its ranks itself (``-n N``: processes through the launcher for ``tcp``, coroutines for
``memory``) or joins a world started by ``asynccoll run`` (``mpi``: by ``mpirun``). On
``nccl`` the buffers are CuPy arrays on the rank's GPU (NumPy arrays would take the TCP world
underneath).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier")
#: the keys of every ``--json`` row, in order (a stable schema: see the module's docstring)
JSON_KEYS = ("op", "size", "count", "dtype", "time_us", "algbw", "busbw", "ranks", "backend")


def _size(text: str) -> int:
    """Bytes from ``8``, ``64K``, ``1.5MB``, ``1G``."""
    upper = text.strip().upper()
    try:
        for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
            if upper.endswith(suffix) or upper.endswith(suffix + "B"):
                n = int(float(upper.rstrip("B")[:-1]) * mult)
                break
        else:
            n = int(upper.rstrip("B"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 1M)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return n


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` (a one-line message), before any rank starts; ``None``
    when nothing is."""
    from .wire import dtype_code

    if args.n is not None and args.n < 1:
        return f"-n must be >= 1, got {args.n}"
    if args.op != "all":
        unknown = [o for o in (x.strip() for x in args.op.split(",")) if o not in OPS]
        if unknown:
            return f"unknown op {unknown[0]!r}; choose from all, {', '.join(OPS)}"
    try:
        dt = np.dtype(args.dtype)
        dtype_code(dt)
    except TypeError as exc:  # not a dtype, or not one asynccoll moves
        return f"--dtype {args.dtype!r}: {exc}"
    if not dt.isnative:  # the collectives take arrays in this machine's byte order only
        return (f"--dtype {args.dtype!r}: not this machine's byte order; asynccoll moves "
                f"native arrays (--dtype {dt.newbyteorder('=').name})")
    for name in ("iters", "warmup"):
        if getattr(args, name) < 0:
            return f"--{name} must be >= 0, got {getattr(args, name)}"
    if args.factor < 2:
        return f"--factor must be >= 2, got {args.factor}"
    if args.min_bytes > args.max_bytes:
        return f"--min-bytes ({args.min_bytes}) is larger than --max-bytes ({args.max_bytes})"
    if args.n is not None and args.backend != "mpi" and _under_launcher():
        return ("-n starts ranks of its own, but this process is a rank of a launcher "
                "(ASYNCCOLL_RANK or RANK is set): leave -n out to join its world")
    if args.plot is not None:
        return _plot_problem(args.plot, args.op)
    if args.backend == "nccl":
        from .transport.nccl import import_nccl

        try:
            import_nccl()
        except ImportError as exc:
            return str(exc)
    return None


def _under_launcher() -> bool:
    return "ASYNCCOLL_RANK" in os.environ or "RANK" in os.environ


def _plot_problem(path: str, ops: str) -> str | None:
    """Why ``--plot path`` could not be drawn at the end of the run (``None``: it can)."""
    if ops != "all" and {o.strip() for o in ops.split(",")} == {"barrier"}:
        return "--plot: barrier moves no bytes, there is no busbw to plot"
    try:
        import matplotlib
        from matplotlib.backend_bases import get_registered_canvas_class
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib)"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--plot {path!r}: there is no directory {folder!r}"
    if not os.access(folder, os.W_OK):
        return f"--plot {path!r}: cannot write in {folder!r}"
    fmt = os.path.splitext(path)[1][1:].lower() or str(matplotlib.rcParams["savefig.format"])
    if get_registered_canvas_class(fmt) is None:
        return f"--plot {path!r}: matplotlib cannot write {fmt!r} files (try FILE.png)"
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="tcp", choices=("tcp", "memory", "nccl", "mpi"))
    p.add_argument("-n", "--nproc", dest="n", type=int, default=None,
                   help="ranks to start (omit under `asynccoll run`)")
    p.add_argument("--op", default="all_reduce",
                   help=f"comma-separated ops or 'all' ({', '.join(OPS)})")
    p.add_argument("--min-bytes", type=_size, default=8, help="smallest size (e.g. 8, 64K)")
    p.add_argument("--max-bytes", type=_size, default=64 << 20, help="largest size (e.g. 64M)")
    p.add_argument("--factor", type=int, default=8, help="size multiplier between rows")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=0, help="timed iterations (0: by size)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true",
                   help="print JSON lines instead of a table: one object per row, with the "
                        f"keys {', '.join(JSON_KEYS)} (time in us, algbw and busbw in GB/s)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also plot busbw against size (needs matplotlib)")


def _sizes(args: argparse.Namespace) -> list[int]:
    sizes, s = [], max(1, args.min_bytes)
    while s <= args.max_bytes:
        sizes.append(s)
        s *= max(2, args.factor)
    return sizes


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _iters_for(nbytes: int, fixed: int) -> int:
    if fixed:
        return fixed
    return max(3, min(200, (256 << 20) // max(nbytes, 1 << 16)))


def _zeros(comm: Any, count: int, dt: np.dtype[Any]) -> Any:
    """A zeroed buffer of the kind ``comm``'s backend moves: CuPy on the rank's GPU for
    ``nccl``, NumPy elsewhere."""
    device = getattr(comm, "device", None)
    if comm.backend != "nccl" or device is None:
        return np.zeros(count, dt)
    import cupy

    with cupy.cuda.Device(device):
        return cupy.zeros(count, dt)


def shapes(op: str, nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """(elements of the op's full buffer, the row's count), as nccl-tests sizes them:
    all_gather, reduce_scatter and all_to_all move whole blocks of every rank (at least one
    element each), and their count is one block's (all_gather's sendcount, reduce_scatter's
    recvcount, all_to_all's count per peer); barrier moves nothing."""
    if op == "barrier":
        return 0, 0
    count = max(1, nbytes // itemsize)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        block = max(1, count // n)
        return block * n, block
    return count, count


async def measure(comm: Any, op: str, nbytes: int, dtype: str, iters: int, warmup: int
                  ) -> dict[str, Any]:
    """Time ``op`` on ``nbytes`` (the op's full buffer, see ``shapes``); every rank must call
    it. Returns a table row (the keys of ``JSON_KEYS``)."""
    n = comm.world_size
    dt = np.dtype(dtype)
    total, count = shapes(op, nbytes, dt.itemsize, n)
    block = total // n
    a = _zeros(comm, block if op == "all_gather" else total, dt) if total else None
    parts = [_zeros(comm, block, dt) for _ in range(n)] if op == "all_to_all" else []
    # all_gather into a buffer kept across calls, as nccl-tests (and compare.py's workers) do
    gathered = _zeros(comm, total, dt) if op == "all_gather" and total else None

    async def once() -> None:
        if op == "all_reduce":
            await comm.all_reduce(a)
        elif op == "all_gather":
            await comm.all_gather(a, out=gathered)
        elif op == "reduce_scatter":
            await comm.reduce_scatter(a)
        elif op == "broadcast":
            await comm.broadcast(a, root=0)
        elif op == "all_to_all":
            await comm.all_to_all(parts)
        elif op == "barrier":
            await comm.barrier()
        else:
            raise ValueError(f"unknown op {op!r}")

    for _ in range(warmup):
        await once()
    await comm.barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await once()
        times.append(time.perf_counter() - t0)
    worst = np.array([statistics.median(times)])
    from .ops import ReduceOp

    await comm.all_reduce(worst, op=ReduceOp.MAX)
    t = float(worst[0])
    size = total * dt.itemsize
    algbw = size / t / 1e9 if t > 0 else 0.0
    return {"op": op, "size": size, "count": count, "dtype": dt.name, "time_us": t * 1e6,
            "algbw": algbw, "busbw": algbw * bus_factor(op, n), "ranks": n,
            "backend": comm.backend}


def format_row(row: dict[str, Any]) -> str:
    return (f"{row['size']:>12} {row['count']:>11} {row['dtype']:>8} {row['time_us']:>11.1f}"
            f" {row['algbw']:>8.3f} {row['busbw']:>8.3f}")


HEADER = (f"{'size(B)':>12} {'count':>11} {'type':>8} {'time(us)':>11} {'algbw':>8} "
          f"{'busbw':>8}   (GB/s)")


async def run_all(comm: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    ops = OPS if args.op == "all" else tuple(o.strip() for o in args.op.split(","))
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    rows = []
    for op in ops:
        if comm.rank == 0 and not args.json:
            print(f"# {op}, {comm.world_size} ranks, backend {comm.backend}", flush=True)
            print(HEADER, flush=True)
        for nbytes in (_sizes(args) if op != "barrier" else [0]):
            row = await measure(comm, op, nbytes, args.dtype, _iters_for(nbytes, args.iters),
                                args.warmup)
            rows.append(row)
            if comm.rank == 0:
                print(json.dumps(row) if args.json else format_row(row), flush=True)
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("--plot needs matplotlib (pip install matplotlib)\n")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = [r for r in rows if r["op"] == op and r["size"]]
        if pts:
            ax.plot([r["size"] for r in pts], [r["busbw"] for r in pts], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


async def _in_world(args: argparse.Namespace) -> int:
    import asynccoll

    comm = await asynccoll.init(backend=args.backend)
    async with comm:
        rows = await run_all(comm, args)
    if comm.rank == 0 and args.plot:
        plot(rows, args.plot)
    return 0


async def _local(args: argparse.Namespace) -> int:
    import asynccoll

    results = await asynccoll.run_local(lambda c: run_all(c, args), args.n, args.backend,
                                        timeout=600)
    if args.plot:
        plot(results[0], args.plot)
    return 0


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The command line of a rank that ``-n`` starts: these options, without ``-n``, so
    that it joins the launcher's world (every option of ``add_arguments`` but ``-n``)."""
    argv = ["-v"] * getattr(args, "verbose", 0)
    argv += ["bench", f"--backend={args.backend}", f"--op={args.op}",
             f"--min-bytes={args.min_bytes}", f"--max-bytes={args.max_bytes}",
             f"--factor={args.factor}", f"--dtype={args.dtype}", f"--iters={args.iters}",
             f"--warmup={args.warmup}"]
    if args.json:
        argv.append("--json")
    if args.plot is not None:
        argv.append(f"--plot={os.path.abspath(args.plot)}")
    return argv


def _launcher(n: int, command: list[str]) -> Any:
    """The launcher of ``asynccoll run`` for the ranks of ``-n``, but for their standard
    output: that is the bench's own (rank 0's table or JSON lines), passed on as it is,
    without the ``[rank]`` before each line (which no JSON reader takes)."""
    from .cli import _Launcher

    class BenchLauncher(_Launcher):
        async def _pump(self, rank: int, stream: Any, out: Any) -> None:
            if out is not sys.stdout:
                return await super()._pump(rank, stream, out)
            while chunk := await stream.read(1 << 16):
                self._write(out, chunk)
            return None

    return BenchLauncher(n, command, addr="127.0.0.1", port=0, token=os.urandom(16).hex(),
                         bind="127.0.0.1")


def main(args: argparse.Namespace) -> int:
    problem = check_arguments(args)
    if problem is not None:
        sys.stderr.write(f"asynccoll bench: {problem}\n")
        return 2
    try:
        return _start(args)
    except KeyboardInterrupt:  # Ctrl-C: the rows so far stand; no traceback
        sys.stderr.write("asynccoll bench: interrupted\n")
        return 130


def _start(args: argparse.Namespace) -> int:
    from .cli import _run_loop

    if args.backend == "mpi":  # MPI's launcher makes the world
        if args.n is not None:
            sys.stderr.write("asynccoll bench: the mpi backend takes its ranks from MPI; "
                             "run `mpirun -n N asynccoll bench --backend mpi`\n")
            return 2
        return int(_run_loop(_in_world(args)))
    if args.backend == "memory":
        if args.n is None:
            args.n = 2
        return int(_run_loop(_local(args)))
    if args.n is None:
        if _under_launcher():
            return int(_run_loop(_in_world(args)))
        sys.stderr.write("asynccoll bench: give -n N, or start it with `asynccoll run`\n")
        return 2
    launcher = _launcher(args.n, [sys.executable, "-m", "asynccoll", *_rank_argv(args)])
    return int(_run_loop(launcher.main()))
