"""``asynccoll run --nnodes M --node-rank K``: one launcher per node, here two launchers on
127.0.0.1 standing for two machines. Node 0's launcher hosts the rendezvous; every launcher
starts its node's ranks, and a rank that fails on any node stops the ranks of every node."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable

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


def node(start: Callable[..., Proc], k: int, port: int, mode: str, *extra: str,
         nnodes: int = 2, n: int = 2) -> Proc:
    return start(launcher("-n", str(n), "--nnodes", str(nnodes), "--node-rank", str(k),
                          "--port", str(port), *extra, SCRIPT, mode),
                 clean_env(ASYNCCOLL_TOKEN="two-node-secret"))


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


def test_interrupting_one_node_stops_every_node(reaper: Callable[..., Proc]) -> None:
    port = free_fixed_port()
    first = node(reaper, 0, port, "sleep")
    second = node(reaper, 1, port, "sleep")
    for proc in (first, second):
        assert proc.wait_for(lambda lines: sum(line.endswith("] READY") for line in lines)
                             == 2, 45), proc.output
    second.popen.send_signal(signal.SIGINT)
    assert second.finish(30) == 130, second.output
    assert first.finish(30) == 130, first.output
    assert "the launcher of node 1 was interrupted" in first.output, first.output
    assert_all_gone(first.child_pids() + second.child_pids())


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--nnodes", "2", "--port", "29500"], {}, "needs --node-rank"),
    (["--nnodes", "2", "--node-rank", "2", "--port", "29500"], {}, "--node-rank must be 0-1"),
    (["--nnodes", "2", "--node-rank", "1"], {}, "needs --port"),
    (["--nnodes", "2", "--node-rank", "1", "--port", "29500"], {"ASYNCCOLL_TOKEN": ""},
     "needs a token shared by every node"),
    (["--nnodes", "2", "--node-rank", "0", "--port", "29500", "--elastic"], {},
     "--elastic does not support --nnodes > 1"),
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
