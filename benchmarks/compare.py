"""asynccoll against torch.distributed (gloo) and Open MPI's TCP transport, in one run.

    python benchmarks/compare.py                  # 2 and 4 ranks, the default ops and sizes
    python benchmarks/compare.py -n 2 --ops all_reduce --sizes 8,16M --json out.json
    python benchmarks/compare.py -n 2 --ops all_gather,broadcast --sizes 1M,64M --rounds 5
    python benchmarks/compare.py --rounds 3 --json out.json --plot busbw.png
    python benchmarks/compare.py --rounds 5 --per-op          # noise spread op by op
    python benchmarks/compare.py --rounds 5 --per-op --targets --json out.json
    python benchmarks/compare.py --load out.json --targets    # a saved run, nothing runs

Each framework runs the same ops and sizes on this machine, one after the other (see
``benchmarks/workers.py`` for the timing method). Peers are optional: gloo needs
``torch`` (``pip install torch==2.13.0`` gives the CPU build), MPI needs ``mpi4py`` and an
``mpirun`` (Open MPI is forced onto TCP: ``--mca pml ob1 --mca btl tcp,self``). What is missing
is skipped with a note. Ratios: time is asynccoll / peer (lower is better for asynccoll);
busbw is asynccoll / peer (higher is better). Every row also carries ``probe_us``, how fast
the slowest rank's core was around that size's calls (``workers.CoreProbe``: lower is
faster), and the run prints each framework's median probe: on a machine whose cores change
speed, it shows when a framework drew slower cores. ``--targets`` checks the performance
issue's targets (docs/performance.md) against the run's rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from workers import parse_size  # benchmarks/ is on sys.path as a script

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = str(HERE / "workers.py")
DEFAULT_OPS = "all_reduce,barrier,all_gather,broadcast"
#: every op each framework's worker runs (benchmarks/workers.py)
ALL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier")
DEFAULT_SIZES = "8,64K,1M,16M,64M"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = f"{ROOT}{os.pathsep}{e['PYTHONPATH']}" if e.get("PYTHONPATH") else str(ROOT)
    e["OMP_NUM_THREADS"] = "1"
    return e


def collect(output: str) -> list[dict[str, Any]]:
    rows = []
    for line in output.splitlines():
        _, sep, rest = line.partition("RESULT ")
        if sep:
            rows.append(json.loads(rest))
    return rows


#: the framework runs that failed (a command and its exit status): main's exit status is 1
FAILED: list[str] = []


def run(cmd: list[str], timeout: float, extra_env: dict[str, str] | None = None
        ) -> list[dict[str, Any]]:
    e = env()
    e.update(extra_env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=e)
    try:
        out, err = proc.communicate(timeout=timeout)
        status = str(proc.returncode)
    except subprocess.TimeoutExpired:
        # the launcher (asynccoll run, mpirun) stops the ranks it started on SIGTERM; a
        # SIGKILL would leave them running on, loading the cores the next framework is timed on
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        status = f"timed out after {timeout:g} s"
    if status != "0":
        FAILED.append(f"{' '.join(cmd[:6])} ... ({status})")
        sys.stderr.write(f"{' '.join(cmd[:6])} ... failed ({status}):\n"
                         f"{out[-2000:]}\n{err[-2000:]}\n")
    return collect(out)


def bench_asynccoll(n: int, args: list[str], timeout: float) -> list[dict[str, Any]]:
    return run([sys.executable, "-m", "asynccoll", "run", "-n", str(n), WORKER, "asynccoll",
                *args], timeout)


def bench_gloo(n: int, args: list[str], timeout: float) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    for rank in range(n):
        e = env()
        e.update({"RANK": str(rank), "WORLD_SIZE": str(n)})
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, "gloo", *args, "--port", str(port)], env=e,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                FAILED.append(f"gloo ({n} ranks, timed out after {timeout:g} s)")
                sys.stderr.write(f"gloo ({n} ranks) timed out after {timeout:g} s\n")
                break
            if p.returncode != 0:
                FAILED.append(f"gloo rank {rank} ({p.returncode})")
                sys.stderr.write(f"gloo rank {rank} failed ({p.returncode}): {err[-2000:]}\n")
            rows += collect(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return rows


def bench_mpi(n: int, args: list[str], timeout: float) -> list[dict[str, Any]]:
    mpirun = shutil.which("mpirun")
    assert mpirun is not None
    cmd = [mpirun, "-n", str(n), "--oversubscribe", "--mca", "pml", "ob1", "--mca", "btl",
           "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return run([*cmd, sys.executable, WORKER, "mpi", *args], timeout)


def available() -> dict[str, str | None]:
    """Peer name -> None when it can run, else why not."""
    why: dict[str, str | None] = {}
    why["gloo"] = None if importlib.util.find_spec("torch") else "torch is not installed"
    if importlib.util.find_spec("mpi4py") is None:
        why["mpi"] = "mpi4py is not installed"
    elif shutil.which("mpirun") is None:
        why["mpi"] = "no mpirun on PATH"
    else:
        why["mpi"] = None
    return why


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (framework, op, ranks, size): the one of median time (rounds > 1)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["framework"], r["op"], r["ranks"], r["size"]), []).append(r)
    out = []
    for group in groups.values():
        group.sort(key=lambda r: r["time_us"])
        out.append({**group[(len(group) - 1) // 2], "rounds": len(group)})
    return out


def fmt_size(n: int) -> str:
    for unit, m in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def table(rows: list[dict[str, Any]], peers: list[str]) -> str:
    by = {(r["framework"], r["op"], r["ranks"], r["size"]): r for r in rows}
    keys = sorted({(r["op"], r["ranks"], r["size"]) for r in rows if r["framework"] == "asynccoll"},
                  key=lambda k: (k[1], k[0], k[2]))
    head = f"{'op':<14} {'ranks':>5} {'size':>6} {'asynccoll us':>13} {'busbw':>7}"
    for p in peers:
        head += f" | {p + ' us':>10} {'busbw':>7} {'time x':>7} {'busbw x':>7}"
    lines = [head, "-" * len(head)]
    for op, n, size in keys:
        a = by[("asynccoll", op, n, size)]
        line = f"{op:<14} {n:>5} {fmt_size(size):>6} {a['time_us']:>13.1f} {a['busbw']:>7.3f}"
        for p in peers:
            r = by.get((p, op, n, size))
            if r is None:
                line += f" | {'-':>10} {'-':>7} {'-':>7} {'-':>7}"
                continue
            tx = a["time_us"] / r["time_us"] if r["time_us"] else float("nan")
            bx = a["busbw"] / r["busbw"] if r["busbw"] else float("nan")
            line += f" | {r['time_us']:>10.1f} {r['busbw']:>7.3f} {tx:>7.2f} {bx:>7.2f}"
        lines.append(line)
    return "\n".join(lines)


#: the performance issue's targets over TCP: (op, bytes, peer, what, goal); ``busbw``: asynccoll's
#: busbw at least ``goal`` x the peer's, ``time``: asynccoll's time at most ``goal`` x the peer's;
#: each for 2 and 4 ranks (docs/performance.md, "Against the targets of the performance issue")
TARGETS = [
    ("all_reduce", 16 << 20, "gloo", "busbw", 1.3), ("all_reduce", 64 << 20, "gloo", "busbw", 1.3),
    ("all_reduce", 16 << 20, "mpi", "busbw", 1.0), ("all_reduce", 64 << 20, "mpi", "busbw", 1.0),
    ("all_reduce", 8, "gloo", "time", 0.25), ("all_reduce", 8, "mpi", "time", 3.0),
    ("barrier", 0, "gloo", "time", 0.25), ("barrier", 0, "mpi", "time", 3.0),
    ("all_gather", 1 << 20, "mpi", "busbw", 1.0), ("all_gather", 64 << 20, "mpi", "busbw", 1.0),
    ("broadcast", 1 << 20, "mpi", "busbw", 1.0), ("broadcast", 64 << 20, "mpi", "busbw", 1.0),
]


def check_targets(rows: list[dict[str, Any]]) -> str:
    """The targets whose rows the run has, one line each (the ratio, met or MISSED, both
    times and both probes), then how many were met."""
    by = {(r["framework"], r["op"], r["ranks"], r["size"]): r for r in rows}
    lines, met, checked = [], 0, 0
    for op, size, peer, what, goal in TARGETS:
        parts = []
        for n in (2, 4):
            a, p = by.get(("asynccoll", op, n, size)), by.get((peer, op, n, size))
            if a is None or p is None or not a["time_us"] or not p["time_us"]:
                continue
            # equal bytes: busbw's ratio is the inverse of time's
            x = p["time_us"] / a["time_us"] if what == "busbw" else a["time_us"] / p["time_us"]
            ok = x >= goal if what == "busbw" else x <= goal
            checked += 1
            met += ok
            probe = (f", probes {a['probe_us']:.0f}/{p['probe_us']:.0f}"
                     if a.get("probe_us") and p.get("probe_us") else "")
            parts.append(f"{n}r {x:.3f} {'met' if ok else 'MISSED'} "
                         f"({a['time_us']:.1f} vs {p['time_us']:.1f} us{probe})")
        if parts:
            rel = ">=" if what == "busbw" else "<="
            unit = "" if size >= 1024 else " B"
            lines.append(f"{op} {fmt_size(size)}{unit} vs {peer}, {what} x {rel} {goal}: "
                         + " | ".join(parts))
    if not checked:
        return "# targets: none of their rows are in this run"
    left = 2 * len(TARGETS) - checked
    rest = f" ({left} of the {2 * len(TARGETS)} not in this run)" if left else ""
    return "\n".join(["# the performance issue's targets", *lines,
                      f"# met {met} of {checked}{rest}"])


def probes(rows: list[dict[str, Any]]) -> str:
    """One line: per framework and world size, the median over its rows of ``probe_us`` (the
    slowest rank's core speed probe around each size's calls, see ``workers.CoreProbe``;
    lower is faster). Frameworks whose probes differ ran on cores of different speed."""
    groups: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r.get("probe_us"):
            groups.setdefault((r["framework"], r["ranks"]), []).append(r["probe_us"])
    if not groups:
        return ""
    parts = [f"{fw} {n}r {statistics.median(v):.0f}" for (fw, n), v in sorted(groups.items())]
    return "# cores' speed probe (median us, lower is faster): " + ", ".join(parts)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """busbw against size, one panel per (ranks, op), one line per framework (needs
    matplotlib); barrier, which moves no bytes, is left out."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("--plot needs matplotlib (pip install matplotlib)\n")
        return
    ranks = sorted({r["ranks"] for r in rows})
    ops = list(dict.fromkeys(r["op"] for r in rows if r["size"]))
    if not ranks or not ops:
        sys.stderr.write("--plot: nothing to plot\n")
        return
    fig, axes = plt.subplots(len(ranks), len(ops), figsize=(3.6 * len(ops), 3.0 * len(ranks)),
                             squeeze=False, sharex=True)
    for i, n in enumerate(ranks):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for fw in dict.fromkeys(r["framework"] for r in rows):
                pts = sorted((r for r in rows if r["framework"] == fw and r["op"] == op
                              and r["ranks"] == n and r["size"]), key=lambda r: r["size"])
                if pts:
                    ax.plot([r["size"] for r in pts], [r["busbw"] for r in pts], marker="o",
                            label=fw)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, {n} ranks", fontsize=10)
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("busbw (GB/s)")
            if i == len(ranks) - 1:
                ax.set_xlabel("bytes")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ops", default=DEFAULT_OPS)
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--peers", default="gloo,mpi", help="comma-separated: gloo, mpi")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per framework run")
    p.add_argument("--json", metavar="FILE", help="also write every row as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also plot busbw against size per framework (needs matplotlib)")
    p.add_argument("--replot", metavar="JSON",
                   help="only plot the rows of an earlier --json file (with --plot)")
    p.add_argument("--load", metavar="JSON",
                   help="run nothing: print the table (and --targets, --plot) of an earlier "
                        "--json file")
    p.add_argument("--targets", action="store_true",
                   help="after the table, check the performance issue's targets (those whose "
                        "rows the run has: default ops and sizes, both peers, 2 and 4 ranks)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the frameworks one after the other this many times, alternating, "
                        "and report each figure's median over the rounds (on a shared, noisy "
                        "machine this keeps a burst of load from landing on one framework only)")
    p.add_argument("--per-op", action="store_true",
                   help="launch every framework once per op (not once for all ops), "
                        "alternating the frameworks op by op and rotating which goes first "
                        "each round: a burst of load then spreads over the frameworks at the "
                        "scale of one op, not of a whole run")
    a = p.parse_args(argv)

    def saved_rows(path: str) -> list[dict[str, Any]]:
        try:
            rows = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            p.error(f"cannot read the rows of {path}: {exc}")
        if not isinstance(rows, list) or not all(
                isinstance(r, dict) and {"framework", "op", "ranks", "size", "time_us"} <= set(r)
                for r in rows):
            p.error(f"{path} is not the --json file of a compare.py run")
        return rows

    if a.replot:
        if not a.plot:
            p.error("--replot needs --plot FILE.png")
        plot(saved_rows(a.replot), a.plot)
        return 0
    if a.load:
        saved = saved_rows(a.load)
        report(saved, sorted({r["framework"] for r in saved} - {"asynccoll"}), a)
        return 0
    unknown = [op for op in a.ops.split(",") if op not in ALL_OPS]
    if unknown:
        p.error(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(ALL_OPS)}")
    if min(a.ranks) < 1:
        p.error(f"-n must be >= 1, got {min(a.ranks)}")
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    try:
        sizes = ",".join(str(parse_size(s)) for s in a.sizes.split(","))
    except ValueError:
        p.error(f"--sizes {a.sizes!r}: give sizes such as 8,64K,1M")
    if any(int(s) < 0 for s in sizes.split(",")):
        p.error(f"--sizes {a.sizes!r}: a size must be >= 0")
    if a.timeout <= 0:
        p.error(f"--timeout must be > 0, got {a.timeout:g}")
    # (both are written after the whole run: a mistake here would cost it)
    for option, path in (("--json", a.json), ("--plot", a.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            p.error(f"{option} {path}: there is no directory {Path(path).resolve().parent}")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib)")
    why = available()
    peers = []
    for peer in [x for x in a.peers.split(",") if x]:
        if why.get(peer, "unknown peer"):
            print(f"# skipping {peer}: {why.get(peer, 'unknown peer')}")
        else:
            peers.append(peer)
    benches = {"asynccoll": bench_asynccoll, "gloo": bench_gloo, "mpi": bench_mpi}
    frameworks = ["asynccoll", *peers]
    batches = a.ops.split(",") if a.per_op else [a.ops]
    rows: list[dict[str, Any]] = []
    for n in a.ranks:
        for round_ in range(a.rounds):
            for ops in batches:
                args = ["--ops", ops, "--sizes", sizes]
                first = round_ % len(frameworks) if a.per_op else 0
                for fw in frameworks[first:] + frameworks[:first]:
                    rows += benches[fw](n, args, a.timeout)
    rows = median_rows(rows)
    rounds = f", median of {a.rounds} alternating rounds" if a.rounds > 1 else ""
    rounds += ", frameworks alternating op by op" if a.per_op else ""
    print(f"# {os.cpu_count()} CPUs, loopback TCP, float32, median per call, slowest rank{rounds}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    report(rows, peers, a)
    if FAILED:  # the table lacks their rows: not a run to take the figures of
        sys.stderr.write(f"compare.py: {len(FAILED)} run(s) failed: {'; '.join(FAILED)}\n")
        return 1
    return 0


def report(rows: list[dict[str, Any]], peers: list[str], a: argparse.Namespace) -> None:
    """The table, the probes' line, the targets (``--targets``) and the plot (``--plot``)."""
    print(table(rows, peers))
    if line := probes(rows):
        print(line)
    if a.targets:
        print(check_targets(rows))
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    sys.exit(main())
