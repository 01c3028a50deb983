"""``asynccoll run --nnodes M --node-rank K``: one launcher per node, here two launchers on
127.0.0.1 standing for two machines. Node 0's launcher hosts the rendezvous; every launcher
starts its node's ranks, and a rank that fails on any node stops the ranks of every node."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_launcher import (
    HELPERS,
    Proc,
    assert_all_gone,
    clean_env,
    free_fixed_port,
    launcher,
    rank_lines,
    reaper,
)

__all__ = ["reaper"]  # (the fixture, imported for the tests below)

SCRIPT = str(HELPERS / "nodes.py")
#: elastic training that ends only once the test creates the file GATE names
GATED = str(HELPERS / "elastic_gated.py")


def node(start: Callable[..., Proc], k: int, port: int, mode: str, *extra: str,
         nnodes: int = 2, n: int = 2, **env: str) -> Proc:
    return start(launcher("-n", str(n), "--nnodes", str(nnodes), "--node-rank", str(k),
                          "--port", str(port), *extra, SCRIPT, mode),
                 clean_env(ASYNCCOLL_TOKEN="two-node-secret", **env))


def sleeping_nodes(start: Callable[..., Proc], port: int) -> list[Proc]:
    """Nodes 0 and 1, their two ranks each in one world and sleeping (all READY)."""
    procs = [node(start, k, port, "sleep") for k in (0, 1)]
    for proc in procs:
        assert proc.wait_for(lambda lines: sum(line.endswith("] READY") for line in lines)
                             == 2, 45), proc.output
    return procs


def test_two_nodes_make_one_world(reaper: Callable[..., Proc]) -> None:
    """Node 1's launcher starts first and waits for node 0's rendezvous; the four ranks form
    one world of 4, ranks 0-1 on node 0 and 2-3 on node 1, each told its local rank."""
    port = free_fixed_port()
    second = node(reaper, 1, port, "check")
    time.sleep(1.0)
    first = node(reaper, 0, port, "check")
    assert first.finish(60) == 0, first.output
    assert second.finish(60) == 0, second.output
    for proc, k in ((first, 0), (second, 1)):
        out = proc.output
        for local in range(2):
            r = 2 * k + local
            assert rank_lines(out, r, f"OK rank {r} of 4"), out
            assert rank_lines(out, r, f"ENV rank={r} local={local} node={k} world=4 "
                                      "local_world=2"), out
        others = {int(m) for m in re.findall(r"^\[(\d+)\]", out, re.M)} - {2 * k, 2 * k + 1}
        assert not others, out   # each launcher shows its own ranks only
        assert_all_gone(proc.child_pids())


def test_a_rank_failing_on_one_node_stops_every_node(reaper: Callable[..., Proc]) -> None:
    """Rank 3 (node 1) exits with code 3 while every other rank computes (no collective
    would tell them): node 1's launcher stops its ranks, and node 0's stops its own at once,
    naming the rank and node; both exit with the rank's code."""
    port = free_fixed_port()
    first = node(reaper, 0, port, "fail")
    second = node(reaper, 1, port, "fail")
    began = time.monotonic()
    assert second.finish(45) == 3, second.output
    assert first.finish(45) == 3, first.output
    assert time.monotonic() - began < 30       # not the 60 s the ranks sleep
    assert "rank 3 exited with code 3; stopping the others" in second.output, second.output
    assert ("rank 3 (node 1) exited with code 3; stopping this node's ranks"
            in first.output), first.output
    assert_all_gone(first.child_pids() + second.child_pids())


@pytest.mark.parametrize(("which", "sig", "code"), [(1, signal.SIGINT, 130),
                                                    (0, signal.SIGTERM, 143)],
                         ids=["node-1-ctrl-c", "node-0-sigterm"])
def test_interrupting_one_node_stops_every_node(reaper: Callable[..., Proc], which: int,
                                                sig: signal.Signals, code: int) -> None:
    """Ctrl-C (or SIGTERM) to one launcher stops every node's ranks, 128 + the signal
    everywhere (130, 143); node 0's launcher keeps its rendezvous up until node 1's heard
    of it."""
    port = free_fixed_port()
    procs = sleeping_nodes(reaper, port)
    procs[which].popen.send_signal(sig)
    assert procs[which].finish(30) == code, procs[which].output
    other = procs[1 - which]
    assert other.finish(15) == code, other.output
    assert (f"the launcher of node {which} was interrupted; stopping this node's ranks"
            in other.output), other.output
    assert_all_gone(procs[0].child_pids() + procs[1].child_pids())


def test_a_rank_failing_on_node_0_stops_every_node(reaper: Callable[..., Proc]) -> None:
    """Rank 0 (node 0) exits with code 3 while the others sleep. Node 0's launcher hosts the
    rendezvous through which node 1's learns of it: it keeps it up until node 1 stopped its
    ranks (it closed it at once, and node 1's ranks went on: 'lost the rendezvous of node 0;
    this node's ranks go on')."""
    port = free_fixed_port()
    first = node(reaper, 0, port, "fail-first")
    second = node(reaper, 1, port, "fail-first")
    assert first.finish(45) == 3, first.output
    assert second.finish(15) == 3, second.output
    assert "rank 0 exited with code 3; stopping the others" in first.output, first.output
    assert ("rank 0 (node 0) exited with code 3; stopping this node's ranks"
            in second.output), second.output
    assert "lost the rendezvous" not in first.output + second.output
    assert_all_gone(first.child_pids() + second.child_pids())


def test_a_launcher_killed_takes_its_ranks_and_the_job_with_it(
        reaper: Callable[..., Proc]) -> None:
    """SIGKILL to node 0's launcher, which can stop nothing: the kernel kills its ranks
    (they slept on, unseen), and node 1's launcher, which lost the rendezvous, stops its own
    and exits 1 (its ranks went on)."""
    port = free_fixed_port()
    first, second = sleeping_nodes(reaper, port)
    first.popen.kill()
    assert first.finish(10) == -signal.SIGKILL
    assert_all_gone(first.child_pids())
    assert second.finish(15) == 1, second.output
    assert "lost the rendezvous of node 0" in second.output, second.output
    assert "stopping this node's ranks" in second.output, second.output
    assert_all_gone(second.child_pids())


def test_a_launcher_killed_while_node_0s_ranks_run_stops_node_0_promptly(
        reaper: Callable[..., Proc]) -> None:
    """SIGKILL to node 1's launcher while every rank sleeps (no collective in flight that
    would tell node 0's ranks). The kernel kills node 1's ranks with it; node 0's launcher
    watched the other launchers' heartbeats only once its own ranks ended, so its ranks slept
    on (60 s here, for ever in a job that waits on something else). It now stops them within
    a few heartbeats of the launcher's connection closing, exits 1, and names the lost
    node."""
    port = free_fixed_port()
    first, second = sleeping_nodes(reaper, port)
    second.popen.kill()
    assert second.finish(10) == -signal.SIGKILL
    assert_all_gone(second.child_pids())
    began = time.monotonic()
    assert first.finish(20) == 1, first.output
    assert time.monotonic() - began < 15, first.output
    assert ("asynccoll run: node 1's launcher is gone (its connection to node 0 closed, and "
            "it gave no sign of life for 3 s: killed, or crashed); stopping this node's ranks"
            ) in first.output, first.output
    assert_all_gone(first.child_pids())


def test_a_launcher_stopped_a_while_does_not_stop_the_job(reaper: Callable[..., Proc]) -> None:
    """Node 1's launcher stopped for 8 s while every rank sleeps (Ctrl-Z, a pager that does
    not read its output, a busy machine): it gives no sign of life meanwhile, but its
    process, and its connection to node 0's rendezvous, are still there. Node 0 stopped the
    job as for a killed launcher (5 s without a heartbeat, 6fb2b56). A launcher whose
    connection is open is only counted lost after 30 s (its machine gone); the job goes on,
    and ends as usual (here: Ctrl-C to node 1, once it runs again)."""
    port = free_fixed_port()
    first, second = sleeping_nodes(reaper, port)
    second.popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(8.0)
        assert first.popen.poll() is None, first.output
        assert "no sign of life" not in first.output, first.output
    finally:
        second.popen.send_signal(signal.SIGCONT)
    time.sleep(1.0)
    second.popen.send_signal(signal.SIGINT)
    assert second.finish(30) == 130, second.output
    assert first.finish(30) == 130, first.output
    assert "the launcher of node 1 was interrupted" in first.output, first.output
    assert_all_gone(first.child_pids() + second.child_pids())


def test_a_second_launcher_for_a_node_rank_is_refused(reaper: Callable[..., Proc]) -> None:
    """A launcher started with the --node-rank of one that runs is refused at once, starts
    nothing, and leaves the job alone (its ranks joined the job's rendezvous and waited
    there until node 0 gave up: 'closed the connection')."""
    port = free_fixed_port()
    first, second = sleeping_nodes(reaper, port)
    again = node(reaper, 1, port, "check")
    assert again.finish(20) == 2, again.output
    assert "--node-rank 1 is taken: another launcher (127.0.0.1, pid " in again.output, \
        again.output
    assert "PID" not in again.output
    assert first.popen.poll() is None and second.popen.poll() is None
    second.popen.send_signal(signal.SIGINT)
    assert second.finish(30) == 130, second.output
    assert first.finish(30) == 130, first.output


@pytest.mark.parametrize("nodes", [[], ["--nnodes", "2", "--node-rank", "0"]],
                         ids=["one-node", "node-0"])
def test_a_launcher_on_a_port_in_use_says_what_to_change(reaper: Callable[..., Proc],
                                                         nodes: list[str]) -> None:
    """``--port`` of a port where another program listens (node 0's launcher started twice,
    another job's): the launcher said asyncio's 'error while attempting to bind on address
    ('127.0.0.1', P): address already in use', with neither what listens there may be nor
    what to change. One line that says both; exit 1, nothing started."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = reaper(launcher("-n", "1", *nodes, "--port", str(port), SCRIPT, "check"),
                      clean_env(ASYNCCOLL_TOKEN="two-node-secret"))
        assert proc.finish(20) == 1, proc.output
    which = ("node 0's launcher of this job started twice, or another job's; give another "
             "--port" if nodes else "give another --port, or none (a free one)")
    assert proc.lines == [
        f"asynccoll run: cannot start the rendezvous server on 127.0.0.1:{port}: address "
        f"already in use (another program listens there: {which})"], proc.output


def test_a_node_started_with_other_sizes_is_refused(reaper: Callable[..., Proc]) -> None:
    """Node 1's launcher with -n 3 where node 0's has -n 2: refused before it starts a rank,
    naming both (its ranks failed on a world size that did not match)."""
    port = free_fixed_port()
    first = node(reaper, 0, port, "check")
    second = node(reaper, 1, port, "check", n=3)
    assert second.finish(30) == 2, second.output
    assert ("node 1's launcher was started with -n 3 --nnodes 2 (not elastic), node 0's "
            "with -n 2 --nnodes 2 (not elastic)" in second.output), second.output
    assert "PID" not in second.output
    assert first.popen.poll() is None, first.output


def test_a_node_started_with_another_job_id_is_refused(reaper: Callable[..., Proc]) -> None:
    """An elastic job across two nodes whose node 1 launcher has ASYNCCOLL_JOB_ID=other
    and node 0's none: its processes would keep their membership in another namespace of
    node 0's rendezvous than node 0's (job id 'elastic'), forming a job of their own. It
    started them; it is now refused before it starts one, naming both job ids."""
    port = free_fixed_port()
    first = node(reaper, 0, port, "check", "--elastic")
    second = node(reaper, 1, port, "check", "--elastic", ASYNCCOLL_JOB_ID="other")
    assert second.finish(30) == 2, second.output
    assert ("node 1's launcher was started with -n 2 --nnodes 2 --min-nodes 1 --max-nodes 4 "
            "(job id 'other'), node 0's with -n 2 --nnodes 2 --min-nodes 1 --max-nodes 4 "
            "(job id 'elastic')" in second.output), second.output
    assert "PID" not in second.output
    assert first.popen.poll() is None, first.output


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--nnodes", "2", "--port", "29500"], {}, "needs --node-rank"),
    (["--nnodes", "2", "--node-rank", "2", "--port", "29500"], {}, "--node-rank must be 0-1"),
    (["--nnodes", "2", "--node-rank", "1"], {}, "needs --port"),
    (["--nnodes", "2", "--node-rank", "1", "--port", "29500"], {"ASYNCCOLL_TOKEN": ""},
     "needs a token shared by every node"),
    (["--nnodes", "2", "--node-rank", "0", "--port", "29500", "--max-nodes", "3"], {},
     "-n (2) x --nnodes (2) <= --max-nodes"),
    (["--nnodes", "0"], {}, "--nnodes must be >= 1"),
    (["--node-rank", "1"], {}, "--node-rank must be 0 with one node"),
])
def test_bad_node_arguments_are_refused(reaper: Callable[..., Proc], args: list[str],
                                        env: dict[str, str], message: str) -> None:
    base = {"ASYNCCOLL_TOKEN": "t"}
    base.update(env)
    if not base["ASYNCCOLL_TOKEN"]:
        del base["ASYNCCOLL_TOKEN"]
    proc = reaper(launcher("-n", "2", *args, SCRIPT, "check"), clean_env(**base))
    assert proc.finish(30) == 2, proc.output
    assert message in proc.output, proc.output
    assert "PID" not in proc.output        # nothing started


def pid_of(proc: Proc, label: int) -> int:
    (pid,) = [int(m.group(1)) for line in proc.lines
              if (m := re.match(rf"^\[{label}\] PID (\d+)$", line))]
    return pid


@pytest.mark.timeout(120)
def test_an_elastic_job_across_two_nodes(reaper: Callable[..., Proc], tmp_path: Path) -> None:
    """--elastic with --nnodes 2: a process of node 1 killed mid-training is replaced there
    (labelled after every node's ranks: [5]), another of node 1 leaves (SIGTERM), and the
    job trains to the end in a world of 3 with the same parameters everywhere. Node 1's
    launcher knows its process left (the store is node 0's) and judges the job by every
    node's processes: 3 succeeded, though only one of them on node 1.

    The training ends only once the test opens its gate (GATE), after all that: with a fixed
    number of steps it could end before the replacement joined or the leaver was told to go
    (a loaded machine). World rank 0 reports the steps, on either node (the first process
    to join)."""
    port, gate = free_fixed_port(), tmp_path / "gate"
    args = ["--min-nodes", "2", "--max-nodes", "4", GATED, "60"]
    env = clean_env(ASYNCCOLL_TOKEN="two-node-secret", GATE=str(gate))
    first = reaper(
        launcher("-n", "2", "--nnodes", "2", "--node-rank", "0", "--port", str(port), *args),
        env)
    second = reaper(launcher("-n", "2", "--nnodes", "2", "--node-rank", "1", "--port",
                             str(port), "--max-restarts", "1", *args), env)
    for _ in range(600):   # (each launcher shows its own ranks' lines only)
        if any(re.search(r"\] STEP 50$", line) for line in first.lines + second.lines):
            break
        assert first.popen.poll() is None and second.popen.poll() is None, \
            first.output + second.output
        time.sleep(0.1)
    else:
        raise AssertionError("no STEP 50 within 60 s:\n" + first.output + second.output)
    os.kill(pid_of(second, 3), signal.SIGKILL)
    assert second.wait_for(lambda lines: any(re.match(r"\[5\] WORLD gen=\d+ size=4", line)
                                             for line in lines), 60), second.output
    os.kill(pid_of(second, 2), signal.SIGTERM)
    assert second.wait_for(lambda lines: "asynccoll run: rank 2 left the job; the others go on"
                           in lines, 60), second.output
    gate.touch()
    assert second.finish(60) == 0, first.output + second.output
    assert first.finish(30) == 0, first.output + second.output
    out = first.output + "\n" + second.output
    assert "rank 3 exited with code -9; starting a replacement as [5]" in second.output, out
    got = re.findall(r"^\[(\d+)\] FINAL steps=(\d+) size=3 rank=\d+ digest=(\w+)$", out, re.M)
    assert sorted(int(label) for label, _, _ in got) == [0, 1, 5], out
    assert len({(steps, d) for _, steps, d in got}) == 1, got


async def test_node_0_fails_a_job_whose_other_launcher_vanished(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """Node 0's ranks succeed; node 1's launcher gave one sign of life and no more (killed,
    or its machine gone): node 0 stops waiting for it, and exits 1, saying that node 1's
    ranks may not have succeeded (it exited 0)."""
    from asynccoll import cli
    from asynccoll.rendezvous import RendezvousClient

    monkeypatch.setattr(cli, "NODES_STALE_SECONDS", 1.0)
    port = free_fixed_port()
    first = cli._Launcher(1, [sys.executable, "-c", "pass"], addr="127.0.0.1", port=port,
                          token="t", bind="127.0.0.1", nnodes=2, node_rank=0)
    job = asyncio.ensure_future(first.main())
    try:
        async with await RendezvousClient.connect("127.0.0.1", port, token="t",
                                                  timeout=10) as client:
            await client.set("launch/alive/1", "1")
            assert await asyncio.wait_for(asyncio.shield(job), 20) == 1
    finally:
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
    err = capfd.readouterr().err
    assert "node 1's launcher gave no sign of life for 1 s; not waiting for it" in err, err
    assert "those of node(s) 1, whose launcher vanished, may not have" in err, err


def test_the_culprit_on_another_node_is_blamed_not_a_victim(
        reaper: Callable[..., Proc]) -> None:
    """Rank 3 (node 1) fails in its own code and exits with code 7 after a slow clean-up;
    ranks 0 and 1 (node 0), whose all_reduce raised PeerLostError naming it, exit first.
    Node 0's launcher published 'rank 0 (node 0) exited with code 1' as the job's failure,
    and both launchers blamed rank 0; both now name rank 3, with its code."""
    port = free_fixed_port()
    env = clean_env(ASYNCCOLL_TOKEN="two-node-secret")
    first, second = (reaper(launcher("-n", "2", "--nnodes", "2", "--node-rank", str(k),
                                     "--port", str(port), str(HELPERS / "blame.py"), "slow",
                                     "3"), env) for k in (0, 1))
    assert second.finish(45) == 7, second.output
    assert first.finish(15) == 7, first.output
    assert "rank 3 exited with code 7; stopping the others" in second.output, second.output
    assert ("rank 3 (node 1) exited with code 7; stopping this node's ranks"
            in first.output), first.output
    said = [line for proc in (first, second) for line in proc.lines
            if line.startswith("asynccoll run:")]
    assert not [line for line in said if "rank 3" not in line], said
    assert_all_gone(first.child_pids() + second.child_pids())


def test_a_culprit_known_after_a_victim_was_blamed_is_blamed_on_every_node(
        reaper: Callable[..., Proc]) -> None:
    """Rank 3 (node 1) fails in its own code and exits with code 7 after a slow clean-up;
    ranks 0 and 1 (node 0) fail because of it at once. Node 1's launcher is stopped (SIGSTOP:
    a slow or busy machine) until rank 3 exited, so node 0 waits for word of the culprit in
    vain and publishes its victim as the job's failure. Once node 1 sees rank 3's own
    failure, its record replaced the victim's: node 0 exited with the victim's code naming
    rank 0 or 1, and node 1 with 7 naming rank 3 (or with 1, if it read node 0's record
    first). Both now name rank 3 and exit with its code."""
    port = free_fixed_port()
    env = clean_env(ASYNCCOLL_TOKEN="two-node-secret")
    first, second = (reaper(launcher("-n", "2", "--nnodes", "2", "--node-rank", str(k),
                                     "--port", str(port), str(HELPERS / "blame.py"), "slow",
                                     "3"), env) for k in (0, 1))
    for proc in (first, second):
        assert proc.wait_for(lambda lines: sum(line.endswith("] READY") for line in lines)
                             == 2, 45), proc.output
    culprit = pid_of(second, 3)
    second.popen.send_signal(signal.SIGSTOP)
    try:
        blamed = re.compile(r"^asynccoll run: rank [01] exited with code 1 \(its error came "
                            r"from rank 3\); stopping the others$")
        assert first.wait_for(lambda lines: any(blamed.match(line) for line in lines), 30), \
            first.output
        assert_all_gone([culprit], grace=15)   # (its exit, which node 1 has not seen yet)
    finally:
        second.popen.send_signal(signal.SIGCONT)
    assert second.finish(30) == 7, second.output
    assert first.finish(30) == 7, first.output
    assert "rank 3 exited with code 7" in second.output, second.output
    assert "rank 3 (node 1) exited with code 7" in first.output, first.output
    said = [line for proc in (first, second) for line in proc.lines
            if line.startswith("asynccoll run:")]
    assert not [line for line in said if "rank 3" not in line], said
    assert_all_gone(first.child_pids() + second.child_pids())


def test_a_node_waiting_for_node_0_says_what_it_waits_for(reaper: Callable[..., Proc]) -> None:
    """Node 1's launcher pointed at an address where nothing listens (a wrong --addr, or
    node 0 not started yet) retried for 120 s without a word. It says at once what it
    waits for, and reminds of it while it waits."""
    port = free_fixed_port()  # (nothing listens there)
    began = time.monotonic()
    proc = node(reaper, 1, port, "check")
    waiting = f"asynccoll run: node 1 waiting for node 0's rendezvous at 127.0.0.1:{port}"
    assert proc.wait_for(lambda lines: any(line.startswith(waiting) for line in lines), 5), \
        proc.output
    assert time.monotonic() - began < 5
    assert proc.popen.poll() is None, proc.output  # (still waiting)
    proc.kill()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_a_launcher_interrupted_while_it_waits_for_node_0(reaper: Callable[..., Proc],
                                                           sig: signal.Signals,
                                                           code: int) -> None:
    """Ctrl-C to a launcher waiting for node 0's rendezvous ended it with a KeyboardInterrupt
    traceback (SIGTERM: killed by the signal, without a word). It says it was interrupted
    and exits 128 + the signal (130, 143), as it does once its ranks run."""
    port = free_fixed_port()
    proc = node(reaper, 1, port, "check")
    assert proc.wait_for(lambda lines: any("waiting for node 0's" in line for line in lines),
                         5), proc.output
    proc.popen.send_signal(sig)
    assert proc.finish(5) == code, proc.output
    assert "Traceback" not in proc.output, proc.output
    assert proc.lines[-1] == "asynccoll run: interrupted before this node's ranks started", \
        proc.output
