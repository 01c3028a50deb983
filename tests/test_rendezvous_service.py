"""A standalone rendezvous (``asynccoll rendezvous``) that serves job after job, and jobs at
the same time, as an operator runs it: real processes, loopback sockets.

What the operator's documentation (docs/backends/tcp.md, "A shared rendezvous") promises:
each job id has its own keys and roster, dropped when the job's last connection closes; a
server killed or restarted under a running job does not touch its collectives, one killed
under a forming world is a clear error; a rank that never comes is a timeout naming it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynccoll import CollectiveTimeout, Communicator
from asynccoll.errors import AuthenticationError, RendezvousError
from asynccoll.handshake import client_handshake
from asynccoll.rendezvous import RendezvousClient, RendezvousServer
from asynccoll.transport.tcp_world import tcp_init

TOKEN = "shared-rendezvous-token"
RANK_SCRIPT = Path(__file__).parent / "helpers" / "rdzv_rank.py"


class Standalone:
    """``python -m asynccoll rendezvous`` in a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self.address = f"127.0.0.1:{port}"

    @classmethod
    async def start(cls, port: int = 0) -> Standalone:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asynccoll", "rendezvous", "--host", "127.0.0.1",
            "--port", str(port), stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "ASYNCCOLL_TOKEN": TOKEN})
        assert proc.stdout is not None
        async with asyncio.timeout(10):
            line = (await proc.stdout.readline()).decode()
        assert "listening on" in line, line
        return cls(proc, int(line.rsplit(":", 1)[1]))

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    async def client(self, job: str = "") -> RendezvousClient:
        return await RendezvousClient.connect("127.0.0.1", self.port, token=TOKEN, job=job,
                                              timeout=5.0)


@pytest.fixture
async def standalone() -> AsyncIterator[Standalone]:
    server = await Standalone.start()
    try:
        yield server
    finally:
        await server.kill()


async def start_rank(server: Standalone, rank: int, world_size: int, tag: float,
                     **env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, str(RANK_SCRIPT), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "ASYNCCOLL_RENDEZVOUS": server.address, "ASYNCCOLL_TOKEN": TOKEN,
             "ASYNCCOLL_RANK": str(rank), "ASYNCCOLL_WORLD_SIZE": str(world_size),
             "TAG": str(tag), **env})


async def outcome(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    out, _ = await proc.communicate()
    lines = out.decode().strip().splitlines()
    assert lines, f"rank exited {proc.returncode} without a word"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


async def roster_size(client: RendezvousClient) -> int:
    return len((await client.roster(timeout=0))["members"])


async def until_joined(watchers: list[RendezvousClient], count: int) -> None:
    """Poll until the rosters ``watchers`` see hold ``count`` members in all (5 s at most)."""
    for _ in range(250):
        if sum([await roster_size(w) for w in watchers]) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} ranks did not join within 5 s")


async def test_two_jobs_at_once_with_their_own_job_ids_never_mix(
        standalone: Standalone) -> None:
    """Jobs a (tag 1) and b (tag 10), two ranks each, on one server at the same time, started
    a0 and b1 first, then a1 and b0. Without job ids in the rendezvous, a0 and b1 filled the
    one roster and formed a world together (each summed 11), and a1 with b0 another; with
    ``ASYNCCOLL_JOB_ID`` each job meets only its own ranks."""
    async with asyncio.timeout(25):
        first = [await start_rank(standalone, 0, 2, 1.0, ASYNCCOLL_JOB_ID="a"),
                 await start_rank(standalone, 1, 2, 10.0, ASYNCCOLL_JOB_ID="b")]
        watchers = [await standalone.client(job) for job in ("a", "b", "")]
        await until_joined(watchers, 2)
        for w in watchers:
            await w.close()
        second = [await start_rank(standalone, 1, 2, 1.0, ASYNCCOLL_JOB_ID="a"),
                  await start_rank(standalone, 0, 2, 10.0, ASYNCCOLL_JOB_ID="b")]
        a0, b1, a1, b0 = [await outcome(p) for p in first + second]
    assert (a0, a1) == ({"rank": 0, "sum": 2.0}, {"rank": 1, "sum": 2.0}), (a0, a1)
    assert (b0, b1) == ({"rank": 0, "sum": 20.0}, {"rank": 1, "sum": 20.0}), (b0, b1)


async def test_a_jobs_keys_and_roster_go_with_its_last_connection() -> None:
    """A standalone server serving job after job kept every key they wrote (a checkpoint
    marker, a crashed job's half-written state) in one store: 40 jobs of 10 keys left 400,
    and a job that crashed midway left its keys to the next job of the same name. Now
    a job id's keys and roster are dropped once its last connection closes; the keys of
    clients without a job id are kept as before (a store that outlives its writers)."""
    async with RendezvousServer(token=TOKEN) as server:
        async def connect(job: str) -> RendezvousClient:
            return await RendezvousClient.connect(server.host, server.port, token=TOKEN,
                                                  job=job, timeout=5.0)

        async with asyncio.timeout(10):
            async with await connect("") as anonymous:
                await anonymous.set("kept", b"1")
            # a job that crashed midway: its process died, the kernel reset its connection
            crashed = await connect("train")
            await crashed.set("ckpt/step", b"5")
            await crashed.join(0, "127.0.0.1", 1)
            crashed._writer.transport.abort()
            await crashed.close()
            for i in range(40):
                clients = [await connect(f"job-{i}") for _ in range(2)]
                for r, c in enumerate(clients):
                    await c.join(r, "127.0.0.1", 1000 + r)
                    for k in range(5):
                        await c.set(f"job/{i}/{r}/{k}", b"x")
                for c in clients:
                    await c.close()
            async with await connect("train") as again, await connect("") as anonymous:
                await asyncio.sleep(0.05)  # (the server has seen the last closes by now)
                assert await again.num_keys() == 0
                with pytest.raises(KeyError):
                    await again.get("ckpt/step", wait=False)
                assert await roster_size(again) == 0
                assert await anonymous.get("kept", wait=False) == b"1"
                assert await anonymous.num_keys() == 1
                assert set(server.jobs) == {"", "train"}
            await asyncio.sleep(0.05)
            assert server.jobs == [""]


async def test_a_server_killed_while_the_world_forms_is_a_prompt_clear_error() -> None:
    """Rank 0 of 2 waits in the standalone rendezvous for rank 1; the server is killed. The
    rank raised at once, but blamed 'a rendezvous that rank 0 hosts' (there is none here).
    It now names the standalone rendezvous; and one restarted on the same port serves the
    next world."""
    server = await Standalone.start()
    port = server.port
    try:
        async with asyncio.timeout(20):
            rank0 = asyncio.create_task(tcp_init(
                rank=0, world_size=2, rendezvous=server.address, token=TOKEN, timeout=8.0))
            async with await server.client() as c:
                await until_joined([c], 1)
            t0 = time.monotonic()
            await server.kill()
            with pytest.raises(RendezvousError) as info:
                await rank0
            assert time.monotonic() - t0 < 2.0
            message = str(info.value)
            assert "rank 0 hosts" not in message, message
            assert f"the standalone rendezvous at {server.address}" in message, message
            assert "rank 0 waited for 2 ranks to join the roster" in message, message

            server = await Standalone.start(port)
            pair = await asyncio.gather(*(tcp_init(
                rank=r, world_size=2, rendezvous=server.address, token=TOKEN, timeout=8.0)
                for r in range(2)))
            got = await asyncio.gather(*(c.all_reduce(np.ones(2)) for c in pair))
            for g in got:
                np.testing.assert_array_equal(g, [2.0, 2.0])
            for c in pair:
                await c.close()
    finally:
        await server.kill()


async def test_a_server_killed_under_a_running_world_does_not_touch_its_collectives(
        standalone: Standalone) -> None:
    """The ranks talk peer to peer once the world formed: killing the standalone rendezvous
    leaves their collectives and their close as they were."""
    async with asyncio.timeout(20):
        pair = await asyncio.gather(*(tcp_init(
            rank=r, world_size=2, rendezvous=standalone.address, token=TOKEN, timeout=5.0)
            for r in range(2)))
        try:
            await standalone.kill()
            await asyncio.sleep(0.1)
            for _ in range(3):
                got = await asyncio.gather(*(c.all_reduce(np.full(4, c.rank + 1.0))
                                             for c in pair))
                for g in got:
                    np.testing.assert_array_equal(g, np.full(4, 3.0))
        finally:
            t0 = time.monotonic()
            for c in pair:
                await c.close()
            assert time.monotonic() - t0 < 2.0


async def test_a_rank_that_never_comes_is_a_collective_timeout_naming_it() -> None:
    """Ranks 0 and 1 of 3 wait; rank 2 never comes. Each raises within its timeout a
    ``CollectiveTimeout`` (it was a plain RendezvousError) naming rank 2; a rank that joins
    late, within the others' timeout, is waited for."""
    async with RendezvousServer(token=TOKEN) as server:
        async def rank(r: int, size: int, delay: float, timeout: float) -> Communicator:
            await asyncio.sleep(delay)
            return await tcp_init(rank=r, world_size=size, rendezvous=f"127.0.0.1:{server.port}",
                                  token=TOKEN, timeout=timeout)

        async with asyncio.timeout(20):
            late = await asyncio.gather(rank(0, 2, 0.0, 5.0), rank(1, 2, 1.0, 5.0))
            for c in late:
                await c.close()
            t0 = time.monotonic()
            results = await asyncio.gather(rank(0, 3, 0.0, 1.0), rank(1, 3, 0.0, 1.0),
                                           return_exceptions=True)
        assert time.monotonic() - t0 < 3.0
        for exc in results:
            assert isinstance(exc, CollectiveTimeout), results
            assert isinstance(exc, RendezvousError), results
            assert "never joined: rank 2" in str(exc), exc


async def test_the_server_serves_a_world_through_silent_garbage_and_crowds(
        standalone: Standalone) -> None:
    """While a world of two forms through the standalone server: 32 clients connected at once
    (each setting a key of its own job), a connection that never speaks, one that
    authenticated and stays silent, one sending garbage, one with a wrong token. The world
    forms and works; the crowd's keys are gone once it leaves."""
    async with asyncio.timeout(20):
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", standalone.port)
        quiet_reader, quiet = await asyncio.open_connection("127.0.0.1", standalone.port)
        await client_handshake(quiet_reader, quiet, TOKEN, role="client", timeout=2)
        _, garbage = await asyncio.open_connection("127.0.0.1", standalone.port)
        garbage.write(os.urandom(4096))
        with pytest.raises(AuthenticationError):
            await RendezvousClient.connect("127.0.0.1", standalone.port, token="wrong",
                                           timeout=2.0)
        crowd = await asyncio.gather(*(standalone.client(f"crowd-{i}") for i in range(32)))
        await asyncio.gather(*(c.set("k", str(i)) for i, c in enumerate(crowd)))
        ranks = [await start_rank(standalone, r, 2, 1.0, ASYNCCOLL_JOB_ID="w")
                 for r in range(2)]
        assert [await outcome(p) for p in ranks] == [{"rank": 0, "sum": 2.0},
                                                     {"rank": 1, "sum": 2.0}]
        assert [await c.get("k") for c in crowd] == [str(i).encode() for i in range(32)]
        for c in crowd:
            await c.close()
        for w in (silent, quiet, garbage):
            w.transport.abort()
        async with await standalone.client("crowd-0") as c:
            assert await c.num_keys() == 0
        del silent_reader


async def test_a_rendezvous_rank_0_hosts_admits_its_own_job_only() -> None:
    """With a job id, rank 0's rendezvous refuses a rank of another job (a stray pointed at
    the wrong port) with 'job mismatch', and forms its own world."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with asyncio.timeout(15):
        rank0 = asyncio.create_task(tcp_init(rank=0, world_size=2, port=port, token=TOKEN,
                                             timeout=5.0, job="mine"))
        with pytest.raises(AuthenticationError, match="job mismatch"):
            await tcp_init(rank=1, world_size=2, port=port, token=TOKEN, timeout=5.0,
                           job="theirs")
        rank1 = await tcp_init(rank=1, world_size=2, port=port, token=TOKEN, timeout=5.0,
                               job="mine")
        pair = [await rank0, rank1]
        got = await asyncio.gather(*(c.all_reduce(np.ones(1)) for c in pair))
        assert [float(g[0]) for g in got] == [2.0, 2.0]
        for c in pair:
            await c.close()
