"""The benchmarks stay runnable: `asynccoll bench` and benchmarks/compare.py, small sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    extra = os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    env["PYTHONPATH"] = str(ROOT) + extra
    return env


def test_bench_memory_prints_a_row_per_size() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asynccoll", "bench", "--backend", "memory", "-n", "3",
         "--op", "all", "--min-bytes", "8", "--max-bytes", "4K", "--json"],
        capture_output=True, text=True, timeout=120, env=_env(), check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ops = {r["op"] for r in rows}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
                   "barrier"}
    for r in rows:
        assert r["ranks"] == 3 and r["time_us"] > 0
        if r["op"] == "all_reduce" and r["size"]:
            assert r["busbw"] == pytest.approx(r["algbw"] * 4 / 3)



@pytest.mark.parametrize("args, message", [
    (["-n", "0"], "-n must be >= 1, got 0"),            # exited 0 having printed nothing
    (["--backend", "memory", "-n", "-2"], "-n must be >= 1, got -2"),
    (["-n", "2", "--dtype", "foo"], "--dtype 'foo'"),   # a traceback from every rank
    (["--backend", "memory", "--dtype", "object"], "dtype object is not supported"),
    (["-n", "2", "--op", "all_reduce,bogus"], "unknown op 'bogus'"),  # from every rank
    (["--backend", "memory", "--iters", "-1"], "--iters must be >= 0, got -1"),
    (["--backend", "memory", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--backend", "memory", "--factor", "1"], "--factor must be >= 2, got 1"),
    (["--min-bytes", "1M", "--max-bytes", "1K"], "--min-bytes (1048576) is larger"),
    (["--min-bytes", "-5"], "a size must be >= 0"),
    (["--max-bytes", "1x"], "not a size: '1x'"),
    # a traceback from every rank (arrays of another byte order are not taken)
    (["--backend", "memory", "--dtype", ">f4"], "not this machine's byte order"),
    # these failed (a traceback, or a note and exit 0) only once every size had run
    (["--backend", "memory", "--plot", "/nonexistent-dir/b.png"], "there is no directory"),
    (["-n", "2", "--plot", "bench.txt"], "matplotlib cannot write 'txt' files"),
    (["--backend", "memory", "--op", "barrier", "--plot", "b.png"], "barrier moves no bytes"),
])
def test_bench_bad_arguments_are_one_line_errors(args: list[str], message: str) -> None:
    """Checked before any rank starts: one line (argparse's usage aside), no traceback,
    exit 2."""
    res = subprocess.run([sys.executable, "-m", "asynccoll", "bench", *args],
                         capture_output=True, text=True, timeout=60, env=_env(), check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and message in res.stderr, res.stderr
    assert not res.stdout, res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert message in last and last.startswith("asynccoll bench"), res.stderr


@pytest.mark.timeout(120)
def test_bench_tcp_processes_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asynccoll", "bench", "-n", "2", "--op", "all_reduce,barrier",
         "--min-bytes", "8", "--max-bytes", "64K"],
        capture_output=True, text=True, timeout=110, env=_env(), check=True)
    assert "busbw" in proc.stdout
    assert "# barrier, 2 ranks, backend tcp" in proc.stdout


@pytest.mark.timeout(120)
def test_compare_runs_asynccoll_alone(tmp_path: Path) -> None:
    out_json = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "-n", "2", "--peers", "",
         "--ops", "all_reduce,all_gather", "--sizes", "8,64K", "--json", str(out_json),
         "--plot", str(tmp_path / "run.png")],
        capture_output=True, text=True, timeout=110, env=_env(), check=True)
    rows = json.loads(out_json.read_text())
    assert {(r["op"], r["size"]) for r in rows} == {
        ("all_reduce", 8), ("all_reduce", 65536), ("all_gather", 8), ("all_gather", 65536)}
    assert "all_reduce" in proc.stdout
    # every row says how fast the slowest rank's core was around its calls
    assert all(0 < r["probe_us"] < 1e6 for r in rows)
    assert re.search(r"cores' speed probe .*: asynccoll 2r \d+", proc.stdout), proc.stdout
    assert _is_png(tmp_path / "run.png")
    # the rows of a run plot again without running anything
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--replot",
                    str(out_json), "--plot", str(tmp_path / "again.png")],
                   capture_output=True, text=True, timeout=60, env=_env(), check=True)
    assert _is_png(tmp_path / "again.png")


@pytest.mark.timeout(120)
def test_compare_per_op_rounds(tmp_path: Path) -> None:
    """--per-op launches a framework once per op and round; a figure is the median over the
    rounds (each row says how many it had)."""
    out_json = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "-n", "2", "--peers", "",
         "--ops", "barrier,all_reduce", "--sizes", "8", "--rounds", "2", "--per-op",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=110, env=_env(), check=True)
    rows = json.loads(out_json.read_text())
    assert sorted((r["op"], r["size"], r["rounds"]) for r in rows) == [
        ("all_reduce", 8, 2), ("barrier", 0, 2)]
    assert all(r["time_us"] > 0 for r in rows)
    assert "frameworks alternating op by op" in proc.stdout


def test_compare_checks_the_targets_of_a_saved_run(tmp_path: Path) -> None:
    """--load prints an earlier run's table without running; --targets checks the
    performance issue's targets that the run has rows for."""
    def row(fw: str, n: int, us: float, probe: float) -> dict[str, object]:
        return {"framework": fw, "op": "all_gather", "ranks": n, "size": 1 << 20,
                "time_us": us, "algbw": 1.0, "busbw": 1.0, "probe_us": probe}

    saved = tmp_path / "run.json"
    saved.write_text(json.dumps([row("asynccoll", 2, 150.0, 85.0), row("mpi", 2, 180.0, 86.0),
                                 row("asynccoll", 4, 1300.0, 130.0), row("mpi", 4, 1100.0, 90.0)]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--load", str(saved),
         "--targets"], capture_output=True, text=True, timeout=60, env=_env(), check=True)
    assert ("all_gather 1M vs mpi, busbw x >= 1.0: 2r 1.200 met (150.0 vs 180.0 us, probes 85/86)"
            " | 4r 0.846 MISSED (1300.0 vs 1100.0 us, probes 130/90)") in proc.stdout, proc.stdout
    # 'met 1 of 2' alone read as every target checked: it says how many the run lacks
    assert "# met 1 of 2 (22 of the 24 not in this run)" in proc.stdout, proc.stdout
    assert "asynccoll 2r 85, asynccoll 4r 130, mpi 2r 86, mpi 4r 90" in proc.stdout


def test_core_speed_probes_every_core() -> None:
    """benchmarks/core_speed.py prints one line per core it may run on."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "core_speed.py"), "--seconds", "0.5",
         "--every", "0.05"], capture_output=True, text=True, timeout=60, env=_env(), check=True)
    lines = [line for line in proc.stdout.splitlines()
             if re.match(r"core \d+: \d+ probes, min \d+, .* fast in \d+%", line)]
    assert len(lines) == len(os.sched_getaffinity(0)), proc.stdout


def test_receive_and_add_compares_both_ways() -> None:
    """benchmarks/receive_and_add.py runs both receive paths over a real socket."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "receive_and_add.py"), "--mib", "2",
         "--segment-mib", "1", "--chunk-kib", "64", "--reps", "3", "--launches", "1"],
        capture_output=True, text=True, timeout=60, env=_env(), check=True)
    assert re.search(r"as-you-go / scratch: wall [\d.]+ x, CPU [\d.]+ x", proc.stdout), \
        proc.stdout


_BARE_LINE = (r"^\[(\d)\] mean [\d.]+ us, median [\d.]+ us, CPU per call: user [\d.]+ us, "
              r"system [\d.]+ us")


def test_bare_all_gather_bound() -> None:
    """benchmarks/bare_all_gather.py (the bare-socket bound docs/performance.md quotes) runs
    its ranks over loopback, checks what they gathered, and every rank reports."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bare_all_gather.py"), "-n", "3", "--size",
         "1M", "--iters", "30", "--warmup", "5"],
        capture_output=True, text=True, timeout=60, env=_env(), check=True)
    ranks = sorted(m.group(1) for line in proc.stdout.splitlines()
                   if (m := re.match(_BARE_LINE + r"; sends [\d.]+ us, the rest", line)))
    assert ranks == ["0", "1", "2"], proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpirun and mpi4py")
def test_bare_all_gather_mpi() -> None:
    """Its ``--mpi`` mode times Open MPI's Allgather under mpirun, the same figures per rank."""
    cmd = ["mpirun", "-n", "2", "--oversubscribe", "--mca", "btl", "tcp,self"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    proc = subprocess.run(
        [*cmd, sys.executable, str(ROOT / "benchmarks" / "bare_all_gather.py"), "--mpi",
         "--size", "64K", "--iters", "30", "--warmup", "5"],
        capture_output=True, text=True, timeout=60, env=_env(), check=True)
    ranks = sorted(m.group(1) for line in proc.stdout.splitlines()
                   if (m := re.match(_BARE_LINE + "$", line)))
    assert ranks == ["0", "1"], proc.stdout + proc.stderr


def _is_png(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 1000 and path.read_bytes()[:8] == \
        b"\x89PNG\r\n\x1a\n"


def test_bench_plot(tmp_path: Path) -> None:
    """`asynccoll bench --plot` draws busbw against size (matplotlib is in the test extra)."""
    png = tmp_path / "bench.png"
    subprocess.run(
        [sys.executable, "-m", "asynccoll", "bench", "--backend", "memory", "-n", "2",
         "--op", "all_reduce,all_gather", "--min-bytes", "8", "--max-bytes", "64K", "--plot",
         str(png)], capture_output=True, text=True, timeout=120, env=_env(), check=True)
    assert _is_png(png)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, args, expect", [
    ("profile_collective.py", ["all_reduce", "8", "--iters", "50", "--all-ranks", "--tuning",
                               "poll_us=100"],
     r"all_reduce 8 B x 2 ranks: .* CPU [\d.]+ us: user [\d.]+, system [\d.]+\)"),
    ("profile_collective.py", ["barrier", "0", "--iters", "50", "--pin", "spread"],
     r"barrier 0 B x 2 ranks"),
    ("profile_collective.py", ["all_reduce", "8", "--iters", "50", "--profile", "--sort",
                               "ncalls", "--top", "5"],
     r"Ordered by: call count"),
    ("profile_collective.py", ["all_gather", "64K", "--iters", "40", "--blocks", "4"],
     r"blocks \(median/probe us\): \d+/\d+ \d+/\d+ \d+/\d+ \d+/\d+$"),
    ("timeline.py", ["--iters", "200"], r"rank \d, \d+ calls polled .* total [\d.]+"),
    ("tuning_ab.py", ["all_reduce", "256K", "off:spin_us=0", "on:", "--calls", "5",
                      "--blocks", "2"],
     r"on: median [\d.]+ us, [\d.]+ x off \(faster in \d of 2 blocks\)"),
    ("tuning_ab.py", ["reduce_scatter", "4M", "a:", "b:small_bytes=8M", "--calls", "5",
                      "--blocks", "2"],
     r"b: median [\d.]+ us, [\d.]+ x a \(faster in \d of 2 blocks\)"),
    ("profile_collective.py", ["reduce_scatter", "64K", "--iters", "40"],
     r"reduce_scatter 65536 B x 2 ranks"),
])
def test_profiling_scripts_run(script: str, args: list[str], expect: str) -> None:
    """The scripts docs/performance.md quotes figures from keep working."""
    proc = subprocess.run(
        [sys.executable, "-m", "asynccoll", "run", "-n", "2",
         str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=110, env=_env(), check=True)
    lines = [line for line in proc.stdout.splitlines() if re.search(expect, line)]
    assert lines, proc.stdout
    if "--all-ranks" in args or script == "timeline.py":
        assert len(lines) == 2, proc.stdout


def test_nccl_overhead_benchmark_parses_its_arguments_without_a_gpu() -> None:
    """benchmarks/nccl_overhead.py needs GPUs to run (docs/backends/nccl.md has its figures);
    here: it imports without CuPy and reads its options."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "nccl_overhead.py"), "--help"],
        capture_output=True, text=True, timeout=60, env=_env(), check=True)
    assert "--split-hosts" in proc.stdout and "--poll-only" in proc.stdout


def _workers():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import workers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return workers


def _reported(capsys: pytest.CaptureFixture[str], op: str, nbytes: int, n: int) -> dict:
    _workers().report("x", op, nbytes, n, 1e-3)
    return json.loads(capsys.readouterr().out.partition("RESULT ")[2])


def test_harness_rows_follow_nccl_tests(capsys: pytest.CaptureFixture[str]) -> None:
    """algbw = size / time, size the larger of input and output (all_gather: the gathered
    output as moved; reduce_scatter: the input); busbw = algbw x the op's factor."""
    for op, nbytes, n, size, factor in [
            ("all_reduce", 1 << 20, 4, 1 << 20, 1.5), ("broadcast", 1 << 20, 4, 1 << 20, 1.0),
            ("all_gather", 1 << 20, 4, 1 << 20, 0.75),
            ("reduce_scatter", 1 << 20, 4, 1 << 20, 0.75),
            ("all_to_all", 1 << 20, 4, 1 << 20, 0.75),
            ("reduce_scatter", 64 << 10, 3, 65532, 2 / 3),  # whole blocks of every rank
            ("all_gather", 8, 4, 16, 0.75),  # one float32 per rank: 16 bytes gathered
            ("barrier", 0, 2, 0, 1.0)]:
        row = _reported(capsys, op, nbytes, n)
        assert row["size"] == size, (op, row)
        assert row["algbw"] == pytest.approx(size / 1e-3 / 1e9), (op, row)
        assert row["busbw"] == pytest.approx(row["algbw"] * factor), (op, row)


def test_harness_synchronises_between_warmup_and_timed_calls() -> None:
    """Every framework: untimed calls, a barrier, then the timed calls (as the asynccoll
    worker and nccl-tests do)."""
    calls: list[str] = []
    _workers().median_time(lambda: calls.append("call"), 2, 3, lambda: calls.append("sync"))
    assert calls == ["call"] * 3 + ["sync"] + ["call"] * 2


def test_harness_checks_what_a_collective_produced() -> None:
    """Each framework's result is checked once per op and size (inputs rank + 1)."""
    verify = _workers().verify
    n = 3
    verify("x", "all_reduce", n, np.full(5, 6.0, np.float32))
    verify("x", "reduce_scatter", n, np.full(2, 6.0, np.float32))
    verify("x", "broadcast", n, np.full(5, 1.0, np.float32))
    verify("x", "all_gather", n, np.repeat(np.arange(1, 4, dtype=np.float32), 2))
    verify("x", "all_to_all", n, np.repeat(np.arange(1, 4, dtype=np.float32), 2))
    verify("x", "barrier", n, None)
    for op, got in [("all_reduce", np.zeros(5, np.float32)),
                    ("broadcast", np.full(5, 2.0, np.float32)),
                    ("all_gather", np.repeat(np.arange(3, 0, -1, dtype=np.float32), 2)),
                    ("all_to_all", np.full(6, 2.0, np.float32))]:
        with pytest.raises(RuntimeError, match=f"x {op}"):
            verify("x", op, n, got)


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or shutil.which("mpirun") is None
                    or importlib.util.find_spec("mpi4py") is None, reason="needs gloo and MPI")
def test_compare_times_every_framework_on_the_same_rows(tmp_path: Path) -> None:
    """The three frameworks run (and pass their result checks) on the same rows."""
    out_json = tmp_path / "rows.json"
    env = _env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "-n", "2",
         "--ops", "all_reduce,all_gather,broadcast,barrier", "--sizes", "8,64K",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=110, env=env, check=True)
    rows = json.loads(out_json.read_text())
    keys = {fw: sorted((r["op"], r["size"]) for r in rows if r["framework"] == fw)
            for fw in ("asynccoll", "gloo", "mpi")}
    assert keys["asynccoll"] == keys["gloo"] == keys["mpi"] and len(keys["mpi"]) == 7, \
        proc.stdout + proc.stderr


@pytest.mark.timeout(180)
def test_compare_runs_every_op_on_every_framework_here(tmp_path: Path) -> None:
    """reduce_scatter and all_to_all run on gloo and Open MPI as on asynccoll (each result
    checked by the worker); an unknown op is a one-line error."""
    peers = [p for p, ok in (("gloo", importlib.util.find_spec("torch") is not None),
                             ("mpi", shutil.which("mpirun") is not None
                              and importlib.util.find_spec("mpi4py") is not None)) if ok]
    env = _env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out_json = tmp_path / "rows.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "-n", "3", "--peers",
         ",".join(peers), "--ops", "reduce_scatter,all_to_all", "--sizes", "8,64K",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=170, env=env, check=True)
    rows = json.loads(out_json.read_text())
    assert {(r["framework"], r["op"]) for r in rows} == {
        (fw, op) for fw in ("asynccoll", *peers) for op in ("reduce_scatter", "all_to_all")}
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--ops",
                          "all_reduce,alltoall"], capture_output=True, text=True, timeout=60,
                         env=_env(), check=False)
    assert bad.returncode == 2 and "unknown op(s) alltoall" in bad.stderr, bad.stderr


def _bench_json(*args: str, env: dict[str, str] | None = None) -> list[dict[str, object]]:
    """Every line ``asynccoll bench --json`` prints on stdout, read as JSON."""
    out = subprocess.run([sys.executable, "-m", "asynccoll", "bench", "--json", *args],
                         capture_output=True, text=True, timeout=110, env=env or _env(),
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.timeout(120)
def test_bench_json_over_tcp_is_json_lines_of_the_documented_keys() -> None:
    """`asynccoll bench -n 2 --json` (tcp) printed each row behind the launcher's '[0] '
    (no line was JSON); every line is now an object with the keys --help names."""
    rows = _bench_json("-n", "2", "--op", "all_reduce,barrier", "--max-bytes", "64",
                       "--iters", "3")
    from asynccoll.bench import JSON_KEYS

    assert [(r["op"], r["size"]) for r in rows] == [
        ("all_reduce", 8), ("all_reduce", 64), ("barrier", 0)]
    assert all(tuple(r) == JSON_KEYS and r["backend"] == "tcp" for r in rows), rows
    usage = subprocess.run([sys.executable, "-m", "asynccoll", "bench", "--help"],
                           capture_output=True, text=True, timeout=60, env=_env(),
                           check=True).stdout
    assert all(key in " ".join(usage.split()) for key in JSON_KEYS), usage


def test_bench_sizes_and_counts_follow_nccl_tests() -> None:
    """nccl-tests: all_gather, reduce_scatter and all_to_all move whole blocks of every rank
    (size: the full buffer), count is one block's (sendcount, recvcount, per peer); 3 ranks,
    64 bytes of float32 is 5 elements a rank. reduce_scatter reported 64 B and 16 elements
    (an uneven split) and all_to_all 15 elements; barrier 1 element of 0 bytes."""
    rows = _bench_json("--backend", "memory", "-n", "3", "--op", "all", "--min-bytes", "64",
                       "--max-bytes", "64", "--iters", "2", "--warmup", "0")
    got = {r["op"]: (r["size"], r["count"]) for r in rows}
    assert got == {"all_reduce": (64, 16), "broadcast": (64, 16), "all_gather": (60, 5),
                   "reduce_scatter": (60, 5), "all_to_all": (60, 5), "barrier": (0, 0)}
    factor = {"all_reduce": 4 / 3, "broadcast": 1.0, "all_gather": 2 / 3,
              "reduce_scatter": 2 / 3, "all_to_all": 2 / 3}
    for r in rows:
        if r["size"]:
            assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3), r
            assert r["busbw"] == pytest.approx(r["algbw"] * factor[r["op"]]), r


@pytest.mark.parametrize("argv", [["-n", "2"], ["-n=2"], ["--nproc=2"], ["--npro", "2"],
                                  ["--n=2"], ["-n2"]])
def test_bench_ranks_it_starts_get_its_options_without_n(argv: list[str]) -> None:
    """The ranks that -n starts ran `asynccoll bench` with the command line less '-n N' as
    spelt exactly so: '-n=2', '--npro 2' (argparse's abbreviation) or '--n=2' went on to every
    rank, which started ranks of its own, without end. They now get the parsed options."""
    from asynccoll import bench, cli

    parser = cli.build_parser()
    args = parser.parse_args(["-v", "bench", *argv, "--op", "all_gather,broadcast",
                              "--min-bytes", "1K", "--max-bytes", "4K", "--factor", "2",
                              "--dtype", "float64", "--iters", "7", "--warmup", "1",
                              "--json", "--plot", "out.png"])
    assert args.n == 2
    again = parser.parse_args(bench._rank_argv(args))
    assert again.n is None and again.verbose == 1
    expect = {**vars(args), "n": None, "plot": os.path.abspath("out.png")}
    assert vars(again) == expect


def test_bench_n_under_a_launcher_is_an_error() -> None:
    """-n inside a rank of `asynccoll run` started a second world per rank (tables printed
    twice, each over ranks of its own); now a one-line error."""
    env = _env()
    env.update(ASYNCCOLL_RANK="0", ASYNCCOLL_WORLD_SIZE="2")
    res = subprocess.run([sys.executable, "-m", "asynccoll", "bench", "-n", "2", "--max-bytes",
                          "8", "--iters", "2"], capture_output=True, text=True, timeout=60,
                         env=env, check=False)
    assert res.returncode == 2 and not res.stdout, res.stdout + res.stderr
    assert res.stderr.startswith("asynccoll bench: -n starts ranks of its own"), res.stderr


def test_bench_plot_without_matplotlib_fails_before_the_run(tmp_path: Path) -> None:
    """--plot without matplotlib ran every size, then wrote a note and exited 0 with no plot;
    it is now an error before any rank starts."""
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path / 'site'}{os.pathsep}{env['PYTHONPATH']}"
    for backend in ("memory", "tcp"):
        res = subprocess.run([sys.executable, "-m", "asynccoll", "bench", "--backend", backend,
                              "-n", "2", "--max-bytes", "8", "--iters", "2", "--plot",
                              str(tmp_path / "b.png")],
                             capture_output=True, text=True, timeout=60, env=env, check=False)
        assert res.returncode == 2 and not res.stdout, (backend, res.stdout + res.stderr)
        assert res.stderr == "asynccoll bench: --plot needs matplotlib (pip install " \
                             "matplotlib)\n", res.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["memory", "tcp"])
def test_bench_ctrl_c_ends_without_tracebacks(backend: str) -> None:
    """Ctrl-C during a run printed a KeyboardInterrupt/CancelledError traceback (some 50
    lines from the process, 150 over two ranks); now one line each and exit status 130, the
    rows measured so far printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynccoll", "bench", "--backend", backend, "-n", "2", "--op",
         "all_reduce", "--max-bytes", "64K", "--iters", "100000", "--warmup", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout is not None
        lines = []
        while not any(line.split()[:1] == ["8"] for line in lines):  # the first row is out
            line = proc.stdout.readline()
            assert line, "the bench ended before its first row"
            lines.append(line)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "asynccoll bench: interrupted" in err, err


def _workers_running(marker: str) -> list[int]:
    """The pids of benchmark workers whose command line holds ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "workers.py" in cmdline and marker in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(120)
def test_compare_timeout_stops_the_ranks_and_fails() -> None:
    """A framework run past --timeout crashed compare.py (TimeoutExpired, the other
    frameworks' rows lost) and SIGKILLed the launcher, whose ranks ran on, orphaned, loading
    the cores the next framework was timed on. Now the launcher is stopped with its ranks,
    the run goes on and compare.py exits 1 naming the run."""
    size = 65536 + 4 * (os.getpid() % 1000)  # marks this test's workers
    # far more 64 KiB all_reduces than 2.5 s allow on any machine (40 sizes finished within
    # the timeout now and then on a quiet one)
    sizes = ",".join([str(size)] * 400)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "-n", "2", "--peers", "",
         "--ops", "all_reduce", "--sizes", sizes, "--timeout", "2.5"],
        capture_output=True, text=True, timeout=100, env=_env(), check=False)
    left = _workers_running(f"--sizes {sizes}")
    for pid in left:  # (before the fix) not to leave them to the next tests
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks left running: {left}"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "1 run(s) failed" in proc.stderr and "timed out after 2.5 s" in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--sizes", "8,1x"], "--sizes '8,1x': give sizes such as 8,64K,1M"),
    (["--sizes", "8,,16"], "--sizes '8,,16'"),
    (["-n", "0"], "-n must be >= 1, got 0"),  # an empty table, exit 0
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),  # an empty table, exit 0
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--json", "/nonexistent-dir/rows.json"], "--json /nonexistent-dir/rows.json: there is no"),
    (["--load", "/nonexistent-dir/rows.json"], "cannot read the rows of /nonexistent-dir"),
])
def test_compare_bad_arguments_are_one_line_errors(args: list[str], message: str) -> None:
    """Tracebacks (a bad size, a missing file) or a run of nothing, before; now argparse's
    error, exit 2, before anything runs."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--peers",
                          "", *args], capture_output=True, text=True, timeout=60, env=_env(),
                         check=False)
    assert res.returncode == 2 and not res.stdout, res.stdout + res.stderr
    assert "Traceback" not in res.stderr and message in res.stderr.splitlines()[-1], res.stderr


def test_compare_load_of_a_bench_json_is_an_error(tmp_path: Path) -> None:
    """--load of `asynccoll bench --json` lines (not compare.py's --json) was a traceback."""
    rows = tmp_path / "bench.json"
    rows.write_text(json.dumps({"op": "all_reduce", "size": 8, "count": 2, "dtype": "float32",
                                "time_us": 10.0, "algbw": 0.0, "busbw": 0.0, "ranks": 2,
                                "backend": "tcp"}) + "\n")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--load",
                          str(rows), "--targets"], capture_output=True, text=True, timeout=60,
                         env=_env(), check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "is not the --json file of a compare.py run" in res.stderr, res.stderr
