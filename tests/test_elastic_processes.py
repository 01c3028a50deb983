"""Elastic training with real processes: ``asynccoll run --min-nodes 2 --max-nodes 4`` and
``examples/elastic.py``; one worker is SIGKILLed mid-training, a new process joins later."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import test_launcher
from test_launcher import REPO, Proc, clean_env, free_fixed_port, launcher

reaper = test_launcher.reaper   # the fixture: every process started is killed at teardown

EXAMPLE = str(REPO / "examples" / "elastic.py")
#: elastic training that ends only once the test creates the file GATE names
GATED = str(REPO / "tests" / "helpers" / "elastic_gated.py")
PID = re.compile(r"^\[(\d+)\] PID (\d+)$")


def finals(output: str) -> list[tuple[int, int, str]]:
    return [(int(m.group(1)), int(m.group(2)), m.group(3)) for m in re.finditer(
        r"FINAL steps=(\d+) size=(\d+) rank=\d+ digest=(\w+)", output)]


def has(pattern: str) -> Callable[[list[str]], bool]:
    rx = re.compile(pattern)
    return lambda lines: any(rx.search(line) for line in lines)


@pytest.mark.timeout(120)
def test_kill_one_then_a_new_process_joins(reaper: Callable[..., Proc], tmp_path: Path) -> None:
    """One of three workers is SIGKILLed, the two survivors go on from their last commit, a
    process started by hand joins them, and the three end with the parameters of one process
    that trained as many steps alone. The training ends only once the test opens its gate
    (GATE), after the newcomer joined: with a fixed number of steps, the survivors could
    finish before a newcomer slow to start (a loaded machine) had joined."""
    port, token, gate = free_fixed_port(), "elastic-test", tmp_path / "gate"
    env = {"GATE": str(gate), "OUT": str(tmp_path)}
    job = reaper(launcher("-n", "3", "--min-nodes", "2", "--max-nodes", "4", "--port",
                          str(port), "--token", token, GATED, "60"), clean_env(**env))
    assert job.wait_for(has(r"STEP 50$"), 60), job.output
    victim = next(int(m.group(2)) for line in job.lines if (m := PID.match(line))
                  and m.group(1) == "2")
    os.kill(victim, signal.SIGKILL)
    assert job.wait_for(has(r"WORLD gen=1 size=2"), 30), job.output

    newcomer = reaper([sys.executable, GATED, "60"], clean_env(
        ASYNCCOLL_RENDEZVOUS=f"127.0.0.1:{port}", ASYNCCOLL_TOKEN=token,
        ASYNCCOLL_MIN_NODES="2", ASYNCCOLL_MAX_NODES="4", **env))
    assert newcomer.wait_for(has(r"WORLD gen=\d+ size=3"), 60), newcomer.output + job.output
    gate.touch()
    assert newcomer.finish(60) == 0, newcomer.output
    assert job.finish(60) == 0, job.output

    out = job.output + "\n" + newcomer.output
    got = finals(out)
    assert len(got) == 3, out                       # two survivors and the newcomer
    steps = got[0][0]
    assert steps >= 60 and {(s, n) for s, n, _ in got} == {(steps, 3)}, got
    assert len({d for _, _, d in got}) == 1, got    # identical parameters everywhere
    resumed = [int(m) for m in re.findall(r"WORLD gen=1 size=2 rank=\d resumed_at=(\d+)", out)]
    assert len(resumed) == 2 and all(r % 10 == 0 and 50 <= r <= steps for r in resumed), out

    replay = Proc([sys.executable, GATED, "--replay", str(steps)], clean_env(OUT=str(tmp_path)))
    assert replay.finish(60) == 0, replay.output
    want = np.load(tmp_path / "replay.npy")
    saved = sorted(tmp_path.glob("final-*.npy"))
    assert len(saved) == 3
    for f in saved:
        np.testing.assert_allclose(np.load(f), want, rtol=1e-8, atol=1e-10)


@pytest.mark.timeout(120)
def test_a_worker_sent_sigterm_leaves_without_costing_a_step(reaper: Callable[..., Proc],
                                                             tmp_path: Path) -> None:
    port, token, steps = free_fixed_port(), "elastic-test", 300
    job = reaper(launcher("-n", "3", "--min-nodes", "2", "--max-nodes", "3", "--port",
                          str(port), "--token", token, EXAMPLE, "--steps", str(steps),
                          "--step-delay", "0.01", "--settle", "0.3", "--commit-every", "10",
                          "--out", str(tmp_path)))
    assert job.wait_for(has(r"STEP 50 "), 60), job.output
    leaver = next(int(m.group(2)) for line in job.lines if (m := PID.match(line))
                  and m.group(1) == "1")
    os.kill(leaver, signal.SIGTERM)
    assert job.finish(90) == 0, job.output
    out = job.output
    left = re.search(r"^\[1\] LEFT at step (\d+)$", out, re.M)
    assert left, out
    # the survivors went on from the very step it left at, not from an earlier commit
    resumed = re.findall(r"WORLD gen=1 size=2 rank=\d resumed_at=(\d+)", out)
    assert resumed == [left.group(1)] * 2, out
    got = finals(out)
    assert len(got) == 2 and {(s, n) for s, n, _ in got} == {(steps, 2)}, out
    assert len({d for _, _, d in got}) == 1, got
    assert "exited with code" not in out and "replacement" not in out, out

    replay = Proc([sys.executable, EXAMPLE, "--replay", "--steps", str(steps), "--out",
                   str(tmp_path)], clean_env())
    assert replay.finish(60) == 0, replay.output
    want = np.load(tmp_path / "replay.npy")
    for f in sorted(tmp_path.glob("final-*.npy")):
        np.testing.assert_allclose(np.load(f), want, rtol=1e-8, atol=1e-10)


@pytest.mark.timeout(120)
def test_workers_that_left_do_not_count_as_finished(reaper: Callable[..., Proc]) -> None:
    """Two of three workers sent SIGTERM leave; the third, alone below --min-nodes 2, gives up
    with RendezvousTimeout. No process finished the training: the launcher must not exit 0
    because the two that left exited 0."""
    port = free_fixed_port()
    job = reaper(launcher("-n", "3", "--min-nodes", "2", "--max-nodes", "3", "--port",
                          str(port), "--token", "elastic-test", EXAMPLE, "--steps", "300",
                          "--step-delay", "0.01", "--settle", "0.3", "--timeout", "3"))
    assert job.wait_for(has(r"STEP 50 "), 60), job.output
    pids = {m.group(1): int(m.group(2)) for line in job.lines if (m := PID.match(line))}
    os.kill(pids["0"], signal.SIGTERM)
    os.kill(pids["1"], signal.SIGTERM)
    code = job.finish(60)
    out = job.output
    assert len(re.findall(r"^\[[01]\] LEFT at step \d+$", out, re.M)) == 2, out
    assert "RendezvousTimeout" in out and "FINAL" not in out, out
    assert code == 1, out
    assert "rank 0 left the job" in out and "rank 1 left the job" in out, out
    assert "only 0 processes succeeded" in out and "2 left the job" in out, out


@pytest.mark.timeout(120)
def test_launcher_restarts_a_failed_worker(reaper: Callable[..., Proc], tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed mid-training; the launcher starts a replacement ([3]), which
    joins the two survivors, and the three train to the end with the same parameters. The
    training ends only once the test opens its gate (GATE), after the replacement joined: with
    a fixed number of steps, the survivors could finish before a replacement slow to start
    (a loaded machine) had joined."""
    gate = tmp_path / "gate"
    job = reaper(launcher("-n", "3", "--min-nodes", "2", "--max-nodes", "3", "--max-restarts",
                          "1", GATED, "60"), clean_env(GATE=str(gate)))
    assert job.wait_for(has(r"STEP 50$"), 60), job.output
    victim = next(int(m.group(2)) for line in job.lines if (m := PID.match(line))
                  and m.group(1) == "1")
    os.kill(victim, signal.SIGKILL)
    assert job.wait_for(has(r"^\[3\] WORLD gen=\d+ size=3"), 60), job.output  # it joined
    gate.touch()
    assert job.finish(60) == 0, job.output
    out = job.output
    assert "rank 1 exited with code -9; starting a replacement as [3]" in out, out
    got = re.findall(r"^\[(\d+)\] FINAL steps=(\d+) size=3 rank=\d+ digest=(\w+)$", out, re.M)
    assert sorted(int(label) for label, _, _ in got) == [0, 2, 3], out
    assert len({(s, d) for _, s, d in got}) == 1, got


@pytest.mark.timeout(120)
def test_two_join_at_once_into_a_full_world_keep_every_survivor(
        reaper: Callable[..., Proc], tmp_path: Path) -> None:
    """3 running, --max-nodes 4, two processes ask to join together: the new generation must
    keep all three survivors (they come first) and take one newcomer; the other waits as a
    spare. No survivor may be left out because newcomers reached the store first. The
    training ends only once the test opens its gate (GATE), after the world of 4 formed: with
    a fixed number of steps, it could end before newcomers slow to start had joined."""
    port, token, gate = free_fixed_port(), "elastic-test", tmp_path / "gate"
    job = reaper(launcher("-n", "3", "--min-nodes", "2", "--max-nodes", "4", "--port",
                          str(port), "--token", token, GATED, "60"),
                 clean_env(GATE=str(gate), TIMEOUT="10"))
    assert job.wait_for(has(r"STEP 50$"), 60), job.output
    env = clean_env(ASYNCCOLL_RENDEZVOUS=f"127.0.0.1:{port}", ASYNCCOLL_TOKEN=token,
                    ASYNCCOLL_MIN_NODES="2", ASYNCCOLL_MAX_NODES="4", GATE=str(gate),
                    TIMEOUT="10")
    newcomers = [reaper([sys.executable, GATED, "60"], env) for _ in range(2)]
    joined = job.wait_for(has(r"WORLD gen=\d+ size=4"), 60)
    gate.touch()
    assert joined, job.output + "".join(p.output for p in newcomers)
    assert job.finish(60) == 0, job.output + "".join(p.output for p in newcomers)
    out = job.output
    got = finals(out)
    assert len(got) == 3, out                       # every survivor trained to the end
    assert len({s for s, _, _ in got}) == 1 and got[0][0] >= 60, got
    assert "exited with code" not in out, out
    codes = sorted(p.finish(60) for p in newcomers)
    assert codes[0] == 0, "".join(p.output for p in newcomers)   # one newcomer got the place


@pytest.mark.timeout(60)
def test_ctrl_c_starts_no_replacements(reaper: Callable[..., Proc]) -> None:
    # the ranks a Ctrl-C stops have not failed: --max-restarts must not replace them
    job = reaper(launcher("-n", "2", "--elastic", "--max-restarts", "2", EXAMPLE,
                          "--steps", "100000", "--step-delay", "0.01", "--settle", "0.3"))
    assert job.wait_for(has(r"STEP 50 "), 40), job.output
    os.kill(job.popen.pid, signal.SIGINT)
    assert job.finish(30) == 130, job.output
    assert "replacement" not in job.output, job.output
