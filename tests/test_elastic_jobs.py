"""Elastic jobs and job ids: each elastic job keeps its membership in its own namespace of the
rendezvous (docs/backends/tcp.md, "A shared rendezvous"; asynccoll.elastic, "Job ids"). Real
processes, loopback sockets: a standalone ``asynccoll rendezvous`` shared by elastic jobs, and
``asynccoll run --elastic``, whose launcher holds a connection of its job for the whole run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import test_launcher
import test_rendezvous_service
from test_launcher import Proc, clean_env, launcher
from test_rendezvous_service import TOKEN, Standalone

standalone = test_rendezvous_service.standalone  # (the fixture: a server in a process)
reaper = test_launcher.reaper

MEMBER = Path(__file__).parent / "helpers" / "elastic_member.py"


class Members:
    """Members of elastic jobs of exactly two processes at ``server``; every one still running
    is killed at the end of the ``async with``."""

    def __init__(self, server: Standalone) -> None:
        self.server = server
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, job: str, tag: float, **env: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(MEMBER), stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "ASYNCCOLL_RENDEZVOUS": self.server.address,
                 "ASYNCCOLL_TOKEN": TOKEN, "ASYNCCOLL_JOB_ID": job, "ASYNCCOLL_MIN_NODES": "2",
                 "ASYNCCOLL_MAX_NODES": "2", "TAG": str(tag), **env})
        self.procs.append(proc)
        return proc

    async def __aenter__(self) -> Members:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
            await proc.communicate()


async def ready(proc: asyncio.subprocess.Process) -> None:
    """Until ``proc`` connected to the rendezvous."""
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode()
    assert line.strip() == "READY", line


async def result(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """The JSON line ``proc`` prints once its generation formed (or failed to)."""
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode()
    if line.strip() == "READY":
        line = (await proc.stdout.readline()).decode()
    assert line, f"member exited {await proc.wait()} without a result"
    got: dict[str, Any] = json.loads(line)
    return got


async def test_two_elastic_jobs_at_once_with_their_own_job_ids_never_mix(
        standalone: Standalone) -> None:
    """Elastic jobs a (tag 1) and b (tag 10), two processes each, on one standalone server at
    the same time; a0 and b0 connect first. Elastic members announced no job id, so both jobs
    shared one ``elastic/`` membership: a0 and b0 formed generation 0 together (each summed
    11), and a1 and b1, finding it full, waited as spares until their timeout. With their job
    ids each job forms with its own members only."""
    async with asyncio.timeout(30), Members(standalone) as members:
        first = [await members.start("a", 1.0), await members.start("b", 10.0)]
        for p in first:
            await ready(p)
        await asyncio.sleep(0.3)   # (a0 and b0 join their generations first)
        second = [await members.start("a", 1.0), await members.start("b", 10.0)]
        a0, b0, a1, b1 = [await result(p) for p in first + second]
        assert [await p.wait() for p in first + second] == [0] * 4
    assert a0 == a1 == {"gen": 0, "size": 2, "sum": 2.0}, (a0, a1)
    assert b0 == b1 == {"gen": 0, "size": 2, "sum": 20.0}, (b0, b1)


async def test_a_crashed_elastic_jobs_membership_does_not_reach_the_next_of_its_id(
        standalone: Standalone) -> None:
    """An elastic job of two processes (at most two) formed and was SIGKILLed. Its
    generation 0, closed and full, stayed in the server; the next job of the same id found it
    full without its members, so both waited as spares and gave up ('found no place') after
    their timeout. Now the job's keys go with its last connection: the next one forms anew."""
    async with asyncio.timeout(30), Members(standalone) as members:
        crashed = [await members.start("x", 1.0, HOLD="1") for _ in range(2)]
        assert [await result(p) for p in crashed] == [{"gen": 0, "size": 2, "sum": 2.0}] * 2
        for p in crashed:
            p.send_signal(signal.SIGKILL)
            await p.wait()
        # (until the server saw both connections go: a client of the job finds it empty)
        for _ in range(250):
            async with await standalone.client("x") as watcher:
                if await watcher.num_keys() == 0:
                    break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the crashed job's keys are still there after 5 s")
        after = [await members.start("x", 5.0, TIMEOUT="3") for _ in range(2)]
        got = [await result(p) for p in after]
        assert [await p.wait() for p in after] == [0, 0]
    assert got == [{"gen": 0, "size": 2, "sum": 10.0}] * 2, got


@pytest.mark.timeout(30)
def test_launcher_sees_the_last_member_leave_although_it_closed_the_jobs_last_connection(
        reaper: Any) -> None:
    """``asynccoll run --elastic -n 1``: the only member leaves the job (``leave`` writes
    ``elastic/left/0``) and exits. Its connection was the job's last, so the server would drop
    the job's keys, the leaver's record with them, before the launcher read it, and count
    the leaver among the processes that succeeded (exit 0). The launcher holds a connection
    of the job until the end: it sees the leaver, as when other members remain."""
    job: Proc = reaper(launcher("-n", "1", "--elastic", str(MEMBER)),
                       clean_env(TAG="1", LEAVE="1", ASYNCCOLL_JOB_ID="leavers"))
    code = job.finish(25)
    out = job.output
    assert '{"gen": 0, "size": 1, "sum": 1.0}' in out, out
    assert "rank 0 left the job" in out, out
    assert "only 0 processes succeeded" in out and "(1 left the job)" in out, out
    assert code == 1, out
