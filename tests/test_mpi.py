"""The ``"mpi"`` backend, from an ordinary (non-MPI) pytest run.

When ``mpirun``/``mpiexec`` and mpi4py are available, this starts MPI jobs as subprocesses:

* the shared collective suite (tests/test_collectives.py, its ``mpi`` cases) under
  ``mpirun -n N`` for N = 1, 2, 3, 4: each process runs the same tests in the same order, and
  ``conftest.run_world(fn, n, "mpi")`` runs the cases whose world size is N (the others skip);
* with N = 3, also the MPI-specific checks of tests/mpi_world.py (timeouts, cancellation,
  signature mismatches, large sends, NumPy reduction semantics, barrier across processes);
* a DDP / ZeRO-3 training run under ``mpirun -n 2`` (tests/helpers/mpi_ddp.py).

Every process writes a JUnit report; the test asserts that every rank passed and ran a
reasonable number of cases. Without MPI these tests skip, saying what is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import MPI_WORLD_SIZE

import asynccoll

ROOT = Path(__file__).resolve().parents[1]
#: seconds one mpirun job may take (on 2 busy cores the suites take ~5-20 s each)
JOB_TIMEOUT = 420


def _launcher() -> str | None:
    return shutil.which("mpirun") or shutil.which("mpiexec")


def _why_no_mpi() -> str | None:
    """None when MPI jobs can run here, else what is missing."""
    if MPI_WORLD_SIZE is not None:
        return "this pytest already runs inside an MPI job (no nested mpirun)"
    if _launcher() is None:
        return ("no mpirun/mpiexec on PATH (install Open MPI: apt-get install openmpi-bin "
                "libopenmpi-dev)")
    if importlib.util.find_spec("mpi4py") is None:
        return 'mpi4py is not installed (pip install "asynccoll[mpi]")'
    return None


WHY_NO_MPI = _why_no_mpi()
needs_mpi = pytest.mark.skipif(WHY_NO_MPI is not None, reason=f"MPI unavailable: {WHY_NO_MPI}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # Open MPI: allow root (containers, CI), more processes than cores, and no CMA single-copy
    # (ptrace is often forbidden in containers); other MPIs ignore these
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"):
        env.pop(var, None)  # never inherit an enclosing job's identity
    return env


def _mpirun(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    launcher = _launcher()
    assert launcher is not None
    try:
        return subprocess.run([launcher, "-n", str(n), sys.executable, *args], cwd=ROOT,
                              env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(
            errors="replace")
        pytest.fail(f"mpirun -n {n} {' '.join(args)} ran past {JOB_TIMEOUT} s:\n{out[-4000:]}")


def _counts(report: Path) -> dict[str, int]:
    suite = ET.parse(report).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    return {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}


# (processes, extra test files, least number of cases that must have passed on each rank)
SUITES = [(1, (), 20), (2, (), 30), (3, ("tests/mpi_world.py",), 40), (4, (), 30)]


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize(("n", "extra", "least"), SUITES, ids=[f"n{s[0]}" for s in SUITES])
def test_collective_suite_under_mpirun(tmp_path: Path, n: int, extra: tuple[str, ...],
                                       least: int) -> None:
    proc = _mpirun(n, "tests/helpers/mpi_pytest.py", str(tmp_path), "-q", "-p",
                   "no:cacheprovider", "--color=no", "-o", "addopts=",
                   "tests/test_collectives.py", *extra, "-k", "mpi")
    tail = (proc.stdout + proc.stderr)[-6000:]
    reports = sorted(tmp_path.glob("rank*.xml"))
    assert len(reports) == n, f"expected {n} reports, got {reports}:\n{tail}"
    for report in reports:
        counts = _counts(report)
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        assert counts["failures"] == counts["errors"] == 0, f"{report.name}: {counts}\n{tail}"
        assert passed >= least, f"{report.name}: only {passed} cases ran: {counts}\n{tail}"
    assert proc.returncode == 0, tail


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_ddp_and_zero3_train_under_mpirun() -> None:
    proc = _mpirun(2, "tests/helpers/mpi_ddp.py", "ddp", "zero3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for strategy in ("ddp", "zero3"):
        for r in range(2):
            assert f"OK rank {r} {strategy}" in proc.stdout, out[-6000:]


@needs_mpi
@pytest.mark.timeout(150)
def test_buffers_of_a_failed_collective_outlive_the_interpreter() -> None:
    """MPI_Finalize runs after Python freed its objects and still moves the data of requests
    failed collectives left pending: their buffers were freed by then, and the job hung in
    MPI_Finalize ('writev error ... Bad address') or a rank segfaulted at exit, in about two
    runs of three (hence three runs, giving up at different moments)."""
    launcher = _launcher()
    assert launcher is not None
    gave_up = 0
    for give_up in ("0.003", "0.006", "0.012"):
        try:
            proc = subprocess.run([launcher, "-n", "2", "--mca", "btl", "tcp,self",
                                   sys.executable, "tests/helpers/mpi_exit_after_failure.py",
                                   give_up], cwd=ROOT, env=_env(), capture_output=True,
                                  text=True, timeout=40, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the MPI job hung at exit (MPI_Finalize moving data of freed "
                        f"buffers), giving up after {give_up} s")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "OK rank 0" in proc.stdout and "OK rank 1" in proc.stdout, out[-4000:]
        assert "Bad address" not in out and "Segmentation" not in out, out[-4000:]
        # what could still complete did before MPI_Finalize (else: a rare deadlock in there)
        for r in range(2):
            assert f"pending at finalize rank {r}: 0" in proc.stdout, out[-4000:]
        gave_up += "gave up rank 1" in proc.stdout
    assert gave_up, "rank 1 never gave up: the case this is about did not happen"


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["close", "noclose", "group"])
def test_a_message_nobody_received_does_not_crash_the_job(mode: str) -> None:
    """The payload of a message that arrived but that no recv asked for, and the sender's
    copy, were freed with their communicator (closed, dropped, or at exit) while MPI still
    moved them: a segfault, or a hang in MPI_Finalize."""
    launcher = _launcher()
    assert launcher is not None
    try:
        proc = subprocess.run([launcher, "-n", "2", "--mca", "btl", "tcp,self", sys.executable,
                               "tests/helpers/mpi_unreceived.py", mode], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the MPI job hung at exit (MPI_Finalize moving data of freed buffers)")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "OK rank 0" in proc.stdout and "OK rank 1" in proc.stdout, out[-4000:]
    assert "Bad address" not in out and "Segmentation" not in out, out[-4000:]


@needs_mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "code"), [("raise", 1), ("exit", 3), ("drop", 0)])
def test_a_rank_that_ends_without_closing_fails_the_others_at_once(mode: str, code: int
                                                                   ) -> None:
    """Rank 1 ends (an uncaught exception, sys.exit, or drops its world unclosed) while rank
    0 waits in an all_reduce rank 1 never calls: rank 0 raises PeerLostError naming it at
    once, as on tcp, and mpirun exits with rank 1's code. Rank 0 used to wait for its whole
    timeout (30 s) while rank 1 hung in MPI_Finalize."""
    launcher = _launcher()
    assert launcher is not None
    try:
        proc = subprocess.run([launcher, "-n", "2", sys.executable,
                               "tests/helpers/mpi_exit_unclosed.py", mode], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the MPI job hung")
    out = proc.stdout + proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), "")
    name, rank, took, text = [*line.split(" ", 4), "", "", "", ""][1:5]
    assert (name, rank) == ("PeerLostError", "1"), out[-4000:]
    assert float(took) < 5.0, line
    assert "world rank 1 ended without closing its communicator" in text, line
    assert proc.returncode == code, out[-4000:]


@needs_mpi
@pytest.mark.timeout(120)
def test_a_plain_python_process_is_a_world_of_one() -> None:
    """No launcher: MPI's singleton initialisation gives a world of one rank."""
    code = ("import asyncio, numpy as np, asynccoll\n"
            "async def main():\n"
            "    async with await asynccoll.init(backend='mpi') as comm:\n"
            "        a = await comm.all_reduce(np.arange(3.0))\n"
            "        print(comm.rank, comm.world_size, a.tolist(),\n"
            "              await comm.all_gather_object((1, 'x')))\n"
            "asyncio.run(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split("\n")[0] == "0 1 [0.0, 1.0, 2.0] [[1, 'x']]"


@needs_mpi
@pytest.mark.timeout(120)
def test_info_reports_mpi() -> None:
    proc = subprocess.run([sys.executable, "-m", "asynccoll", "info"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith("mpi"))
    assert "available" in line and "unavailable" not in line, line


# ------------------------------------------------------------------ without an MPI job

async def test_mpi_backend_without_mpi4py_names_the_extra(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(ImportError, match=r"asynccoll\[mpi\]"):
        await asynccoll.init(backend="mpi")


@pytest.mark.parametrize(("timeout", "error"), [(-1, ValueError), (float("nan"), ValueError),
                                              ("5", TypeError), (None, TypeError),
                                              (True, TypeError)])
async def test_mpi_init_checks_timeout_as_tcp_does(monkeypatch: pytest.MonkeyPatch,
                                                   timeout: object, error: type) -> None:
    """Checked before MPI is touched (mpi4py blocked here): -1 used to fail MPI's start-up
    with a CollectiveTimeout 'within -1 s', NaN was taken (no wait ever timed out), '5' and
    None were TypeErrors from an addition."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(error, match="timeout must be"):
        await asynccoll.init(backend="mpi", timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["no", 0, None])
async def test_mpi_init_checks_check_signatures_is_a_bool(monkeypatch: pytest.MonkeyPatch,
                                                          value: object) -> None:
    """Checked before MPI is touched, as the bool options of the other backends are: "no"
    used to turn the checks on (bool("no")), None and 0 off."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(TypeError, match="check_signatures must be a bool"):
        await asynccoll.init(backend="mpi", check_signatures=value)  # type: ignore[arg-type]


async def test_mpi_backend_cannot_run_ranks_as_coroutines() -> None:
    async def fn(comm: asynccoll.Communicator) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ValueError, match="one event loop"):
        await asynccoll.run_local(fn, 2, backend="mpi")


def test_importing_the_mpi_backend_does_not_start_mpi() -> None:
    code = ("import sys, asynccoll.transport.mpi as m\n"
            "print(m.mpi_launched(), 'mpi4py.MPI' in sys.modules)\n")
    env = _env()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False False"


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_bench_runs_under_mpirun() -> None:
    proc = _mpirun(2, "-m", "asynccoll", "bench", "--backend", "mpi", "--op",
                   "all_reduce,barrier", "--max-bytes", "4K", "--json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["op"], r["size"]) for r in rows] == [
        ("all_reduce", 8), ("all_reduce", 64), ("all_reduce", 512), ("all_reduce", 4096),
        ("barrier", 0)]
    assert all(r["backend"] == "mpi" and r["ranks"] == 2 and r["time_us"] > 0 for r in rows)


def test_bench_mpi_refuses_to_start_its_own_ranks() -> None:
    proc = subprocess.run([sys.executable, "-m", "asynccoll", "bench", "--backend", "mpi",
                           "-n", "2"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert "mpirun -n N asynccoll bench --backend mpi" in proc.stderr


@needs_mpi
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_mpi_waits_benchmark_compares_with_mpi4py() -> None:
    proc = _mpirun(2, "benchmarks/mpi_waits.py", "--sizes", "4096", "--iters", "3")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("4096", "float32"), ("4096", "int32")]
    assert all(float(x) > 0 for r in rows for x in r[2:])
