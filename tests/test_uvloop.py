"""The TCP backend on uvloop's event loop as on asyncio's.

The async tests of this module and of the modules in ``conftest.BOTH_LOOPS_MODULES`` run
twice, as ``[asyncio]`` and ``[uvloop]`` (``pytest_asyncio_loop_factories`` in conftest.py);
``pytest --event-loop=uvloop`` runs every async test of the suite on uvloop. Below: that the
cases get the loop they name, worlds of real processes on uvloop and on both loops at once,
and what differs between the loops that asynccoll must not depend on.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import asynccoll
from asynccoll import _progress

HELPERS = Path(__file__).parent / "helpers"
REPO = Path(__file__).parent.parent

uvloop = pytest.importorskip("uvloop")


def on_uvloop() -> bool:
    return type(asyncio.get_running_loop()).__module__.split(".")[0] == "uvloop"


async def test_each_case_runs_on_the_loop_it_is_given(request: pytest.FixtureRequest) -> None:
    factory = request.node.callspec.params["_asyncio_loop_factory"]
    assert on_uvloop() == (factory.__module__.split(".")[0] == "uvloop")


async def test_a_tcp_world_on_this_loop() -> None:
    """run_local over TCP on the test's loop: results exact, every connection closed."""
    import numpy as np

    async def fn(comm: asynccoll.Communicator) -> list[float]:
        big = np.full(300_000, comm.rank + 1.0)  # above PAIR_FRAME_BYTES: its own connection
        await comm.all_reduce(big)
        small = await comm.all_gather(np.array([comm.rank], np.int64))
        return [float(big[0]), float(big[-1]), *map(float, small)]

    results = await asynccoll.run_local(fn, 3, backend="tcp", timeout=10)
    assert results == [[6.0, 6.0, 0.0, 1.0, 2.0]] * 3


async def test_a_long_poll_sleeps_between_tests() -> None:
    """``_progress.poll`` (the MPI and NCCL backends' waits) sleeps ``POLL_SLEEP`` between
    tests once its spin is over. uvloop rounds a timer's delay to whole milliseconds and runs
    one that rounds to 0 at once: a sleep of less than half a millisecond there does not
    sleep, and the wait spun on the core (thousands of tests in 50 ms, not ~50)."""
    loop = asyncio.get_running_loop()
    calls = 0
    ends = loop.time() + 0.05

    def done() -> bool:
        nonlocal calls
        calls += 1
        return loop.time() > ends

    await _progress.poll(done, deadline=loop.time() + 10, check=lambda: None,
                         on_timeout=lambda: TimeoutError("poll"), spin=0)
    assert calls < 0.05 / 1e-3 + 50, calls


def _launch(loops: str, ranks: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCCOLL_")}
    env.pop("PYTEST_CURRENT_TEST", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(HELPERS),
                                                    os.environ.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "asynccoll", "run", "-n", str(ranks),
         str(HELPERS / "loop_check.py"), loops],
        env=env, capture_output=True, text=True, timeout=40, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("loops", "ranks"), [("uvloop", 2), ("mixed", 3)])
def test_ranks_in_processes_on_uvloop(loops: str, ranks: int) -> None:
    """Ranks in processes of their own (``asynccoll run``), their scripts on uvloop (every
    rank, or ranks on both loops in one world): direct all_gathers with point-to-point frames
    and late ranks between them, then all_reduce, all_gather and broadcast, all exact; every
    rank read some blocks straight off the wire (``take_direct``) and others the usual way."""
    proc = _launch(loops, ranks)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in range(ranks):
        want = "uvloop" if loops == "uvloop" or r % 2 else "asyncio"
        assert f"[{r}] LOOP {want} rank {r}" in out, out
        assert out.count(f"[{r}] OK rank {r}") == 2, out  # both checks
        (line,) = [x for x in out.splitlines() if x.startswith(f"[{r}] direct ")]
        direct, usual = (int(x) for x in re.findall(r"\d+", line.split("] ", 1)[1])[:2])
        assert direct > 0 and usual > 0, line
