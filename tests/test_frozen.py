"""Peers that are frozen (SIGSTOP) rather than dead: their sockets stay open and their kernel
keeps acknowledging, so nothing but the collective timeout and the ABORT frames of the ranks
that time out can tell the others. Real processes on 127.0.0.1 (``helpers/frozen.py``), one
per rank, started by the test; every frozen process is continued (or killed) in a finally."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class World:
    """``n`` processes running ``helpers/frozen.py``, their output collected per rank."""

    def __init__(self, n: int, *args: str) -> None:
        port = _free_port()
        self.lines: list[list[str]] = [[] for _ in range(n)]
        self._cond = threading.Condition()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._threads: list[threading.Thread] = []
        for r in range(n):
            env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCCOLL_")}
            env.update(ASYNCCOLL_RANK=str(r), ASYNCCOLL_WORLD_SIZE=str(n),
                       ASYNCCOLL_ADDR="127.0.0.1", ASYNCCOLL_PORT=str(port),
                       PYTHONPATH=os.pathsep.join(
                           p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
            proc = subprocess.Popen([sys.executable, str(HELPERS / "frozen.py"), *args],
                                    cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.procs.append(proc)
            thread = threading.Thread(target=self._pump, args=(r, proc), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _pump(self, r: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with proc.stdout as out:
            for raw in out:
                with self._cond:
                    self.lines[r].append(raw.decode("utf-8", "replace").rstrip("\n"))
                    self._cond.notify_all()

    def line(self, r: int, prefix: str) -> str | None:
        with self._cond:
            return next((line for line in self.lines[r] if line.startswith(prefix)), None)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(f"[{r}] {line}" for r, lines in enumerate(self.lines)
                             for line in lines)

    def end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(10)
        for thread in self._threads:
            thread.join(10)


@pytest.fixture
def world() -> Iterator[Callable[..., World]]:
    made: list[World] = []

    def make(n: int, *args: str) -> World:
        w = World(n, *args)
        made.append(w)
        return w

    yield make
    for w in made:
        w.end()


ERR = re.compile(r"ERR (\d+\.\d+) (\w+) (.*)")


@pytest.mark.timeout(60)
def test_ranks_blocked_sending_to_a_frozen_rank_take_the_abort_at_once(
        world: Callable[..., World]) -> None:
    """Rank 1 freezes in the middle of large ring all_reduces. Rank 2 (waiting for its data)
    times out and sends ABORT frames; rank 0 was blocked writing to rank 1 (its socket full)
    and ignored the ABORT until its own timeout, 1.25 x timeout later: every survivor must
    raise within a moment of the first. Once continued, rank 1 raises too, at once."""
    timeout = 2.0
    w = world(3, "all_reduce", str(16 << 20), f"{timeout},{timeout},{timeout}")
    victim = w.procs[1]
    try:
        assert w.wait_for(lambda: all(w.line(r, "READY") for r in range(3)), 30), w.output
        time.sleep(0.3)  # all_reduces of 64 MiB in flight
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert w.wait_for(lambda: all(w.line(r, "ERR") for r in (0, 2)), 4 * timeout), w.output
        victim.send_signal(signal.SIGCONT)
        continued = time.monotonic()
    finally:
        victim.send_signal(signal.SIGCONT)
    assert w.wait_for(lambda: all(w.line(r, "LATER") for r in range(3)), 15), w.output
    for proc in w.procs:
        assert proc.wait(15) == 3, w.output
    out = w.output
    print(f"\n{out}")
    raised = {}
    for r in range(3):
        m = ERR.match(w.line(r, "ERR") or "")
        assert m is not None, out
        raised[r] = float(m.group(1))
        assert m.group(2) in ("CollectiveError", "CollectiveTimeout", "PeerLostError"), out
        assert w.line(r, "LATER") != "LATER returned", out
    assert "CORRUPT" not in out
    survivors = [raised[0] - stopped, raised[2] - stopped]
    assert max(survivors) - min(survivors) < timeout / 2, (survivors, out)
    assert max(survivors) < 1.25 * timeout + 1.5, (survivors, out)
    assert raised[1] - continued < 1.5, out


@pytest.mark.timeout(60)
def test_a_send_stuck_on_a_frozen_rank_ends_with_the_abort_of_another(
        world: Callable[..., World]) -> None:
    """Rank 1 is frozen; ranks 0 and 2 gather 64 MiB on it, so both sit waiting for their
    sends to drain. Rank 2 (timeout 2 s) times out and sends ABORT frames; rank 0 (timeout
    20 s) must raise with it at once: it waited until its own timeout, 20-25 s later."""
    w = world(3, "gather", str(16 << 20), "20,2,2")
    victim = w.procs[1]
    try:
        assert w.wait_for(lambda: all(w.line(r, "READY") for r in (0, 2)), 30), w.output
        assert w.wait_for(lambda: w.line(2, "ERR") is not None, 10), w.output
        assert w.wait_for(lambda: w.line(0, "ERR") is not None, 3), w.output
    finally:
        victim.send_signal(signal.SIGCONT)
    assert w.wait_for(lambda: all(w.line(r, "LATER") for r in range(3)), 15), w.output
    for proc in w.procs:
        assert proc.wait(15) == 3, w.output
    out = w.output
    m0, m2 = ERR.match(w.line(0, "ERR") or ""), ERR.match(w.line(2, "ERR") or "")
    assert m0 is not None and m2 is not None, out
    assert m2.group(2) == "CollectiveTimeout", out
    assert m0.group(2) == "CollectiveError" and "world rank 2 aborted" in m0.group(3), out
    assert float(m0.group(1)) - float(m2.group(1)) < 1.0, out
    m1 = ERR.match(w.line(1, "ERR") or "")
    assert m1 is not None and m1.group(2) in ("CollectiveError", "PeerLostError"), out
