"""The network services against hostile or broken clients, as an operator exposing them on a
cluster network sees them: the rendezvous server (``asynccoll rendezvous``, a real process
where the point is its memory) and a rank's peer listener, over loopback sockets.

What docs/backends/tcp.md ("Security", "Limits") promises: a stranger costs a few KiB and a
log line; an authenticated client that abuses the store meets a documented limit with a clear
error, not memory growth.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from conftest import LogWatch

from asynccoll.errors import AuthenticationError, RendezvousError
from asynccoll.handshake import ClientHandshake, client_handshake, read_frame, write_frame
from asynccoll.rendezvous import RendezvousClient, RendezvousServer
from asynccoll.transport import tcp
from asynccoll.transport.tcp import TcpTransport
from asynccoll.transport.tcp_world import tcp_init
from asynccoll.wire import MAGIC, PREFIX, VERSION, Frame, FrameHeader, FrameKind, encode_frame_bytes

TOKEN = "hostile-test-token"
VECTORS = Path(__file__).resolve().parents[1] / "protocol" / "vectors" / "rendezvous.json"


SERVE_ON_ASYNCIO = """
import asyncio, os
from asynccoll.rendezvous import RendezvousServer
async def main():
    async with RendezvousServer(token=os.environ["ASYNCCOLL_TOKEN"]) as server:
        print(f"listening on 127.0.0.1:{server.port}", flush=True)
        await asyncio.get_running_loop().create_future()
asyncio.run(main())
"""


class Standalone:
    """``python -m asynccoll rendezvous`` in a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port

    @classmethod
    async def start(cls, loop: str = "uvloop") -> Standalone:
        """``loop``: ``"uvloop"``, the command (on uvloop when installed), or ``"asyncio"``,
        a process that serves on the standard event loop, as a rank 0 hosting it does."""
        command = (["-m", "asynccoll", "rendezvous", "--host", "127.0.0.1", "--port", "0"]
                   if loop == "uvloop" else ["-c", SERVE_ON_ASYNCIO])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *command, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "ASYNCCOLL_TOKEN": TOKEN})
        assert proc.stdout is not None
        async with asyncio.timeout(10):
            line = (await proc.stdout.readline()).decode()
        assert "listening on" in line, line
        return cls(proc, int(line.rsplit(":", 1)[1]))

    def memory_mib(self, field: str) -> float:
        """``VmRSS`` (now) or ``VmHWM`` (peak) of the server process, in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()


@pytest.fixture(params=["uvloop", "asyncio"])
async def standalone(request: pytest.FixtureRequest) -> AsyncIterator[Standalone]:
    server = await Standalone.start(request.param)
    try:
        yield server
    finally:
        await server.kill()


def request(rid: int, op: str, payload: bytes = b"", **args: Any) -> Frame:
    return Frame(FrameKind.REQUEST, FrameHeader(meta={"id": rid, "op": op, **args}), payload)


def meta_of(frame: Frame) -> dict[str, Any]:
    assert frame.header.meta is not None
    return frame.header.meta


async def raw_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An authenticated connection that sends and reads frames as the test says."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await client_handshake(reader, writer, TOKEN, role="client", timeout=5.0)
    return reader, writer


async def roundtrip(port: int, frame: Frame) -> Frame:
    reader, writer = await raw_client(port)
    try:
        write_frame(writer, frame)
        response = await read_frame(reader, 1 << 30)
        assert response is not None
        return response
    finally:
        writer.transport.abort()


# ------------------------------------------------------------------------ the rendezvous

@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
async def test_requests_waiting_for_one_large_value_cost_one_copy_of_it(
        standalone: Standalone) -> None:
    """A client that does not read sends 48 ``get``s waiting for one key, then sets it to
    8 MiB: the server answers them one at a time as the client reads, holding one copy of
    the value, not 48 (384 MiB; 100 such requests for 16 MiB took 1.6 GB). Read, every
    answer arrives whole."""
    waiting, size = 48, 8 << 20
    async with asyncio.timeout(20):
        reader, writer = await raw_client(standalone.port)
        for rid in range(waiting):
            write_frame(writer, request(rid, "get", key="big", timeout=30))
        await writer.drain()
        before = standalone.memory_mib("VmRSS")
        raw = cast(asyncio.Transport, writer.transport)  # (uvloop's is no subclass)
        raw.pause_reading()  # (this side reads nothing until told)
        write_frame(writer, request(waiting, "set", b"x" * size, key="big"))
        await writer.drain()
        # until another connection sees the key, then a little longer: the server has run
        # the requests the set woke
        for _ in range(250):
            if meta_of(await roundtrip(standalone.port, request(1, "num_keys")))["count"] == 1:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        grown = standalone.memory_mib("VmHWM") - before
        assert grown < 5 * size / (1 << 20), f"the server grew by {grown:.0f} MiB"
        raw.resume_reading()
        answers = [await read_frame(reader, 1 << 30) for _ in range(waiting + 1)]
        got = {meta_of(f)["id"]: f for f in answers if f is not None}
        assert sorted(got) == list(range(waiting + 1))
        assert all(meta_of(got[rid])["found"] and len(got[rid].payload) == size
                   for rid in range(waiting))
        writer.transport.abort()


@pytest.fixture
async def limited() -> AsyncIterator[RendezvousServer]:
    """A server with small limits: 4 keys and roster entries, 1000 bytes, 2 waiting."""
    async with RendezvousServer(token=TOKEN, max_keys=4, max_store_bytes=1000,
                                max_waiting=2) as server:
        yield server


async def connect(server: RendezvousServer, job: str = "") -> RendezvousClient:
    return await RendezvousClient.connect("127.0.0.1", server.port, token=TOKEN, job=job,
                                          timeout=5.0)


async def test_keys_past_max_keys_are_refused_clearly_and_change_nothing(
        limited: RendezvousServer) -> None:
    """Every job's keys and roster entries count together against ``max_keys``: past it a
    new key (set, add, compare_set) or rank is refused with an error naming the limit, the
    store is as it was and the connection goes on; a key that exists may still change, and
    a key deleted or a job's last connection closed makes room."""
    async with asyncio.timeout(10):
        async with await connect(limited, "other-job") as other:
            await other.set("o1", b"x")
            await other.join(0, "127.0.0.1", 1)
            async with await connect(limited) as client:
                await client.set("a", b"1")
                await client.add("n", 1)
                for refused in (client.set("b", b"2"), client.add("m", 1),
                                client.compare_set("c", None, b"3"),
                                client.join(1, "127.0.0.1", 2)):
                    with pytest.raises(RendezvousError, match=r"max_keys=4"):
                        await refused
                assert await client.num_keys() == 2
                with pytest.raises(KeyError):
                    await client.get("b", wait=False)
                await client.set("a", b"changed")  # (not a new key)
                assert await client.add("n", 1) == 2
                await client.delete("a")
                await client.set("b", b"2")
        # the empty job's keys stay with the server; the other job's go with it
        for _ in range(100):
            if limited.jobs == [""]:
                break
            await asyncio.sleep(0.02)
        async with await connect(limited) as client:
            await client.set("c", b"3")
            await client.set("d", b"4")
            with pytest.raises(RendezvousError, match=r"max_keys=4"):
                await client.set("e", b"5")
            assert [await client.get(k) for k in "bcdn"] == [b"2", b"3", b"4", b"2"]


async def test_bytes_past_max_store_bytes_are_refused_clearly(
        limited: RendezvousServer) -> None:
    """Keys, values and roster entries (host and meta) count against ``max_store_bytes``:
    a value that would pass it is refused with an error naming the limit, whatever the
    number of keys; a smaller value for the same key is taken."""
    async with asyncio.timeout(10), await connect(limited) as client:
        await client.set("a", b"x" * 900)
        with pytest.raises(RendezvousError, match=r"max_store_bytes=1000"):
            await client.set("b", b"x" * 100)
        with pytest.raises(RendezvousError, match=r"max_store_bytes=1000"):
            await client.join(0, "h" * 50, 1, meta={"pad": "x" * 50})
        with pytest.raises(RendezvousError, match=r"max_store_bytes=1000"):
            await client.set("a", b"x" * 1000)  # (1 + 1000 bytes)
        assert await client.get("a") == b"x" * 900
        await client.set("a", b"x" * 10)
        await client.set("b", b"x" * 900)
        await client.join(0, "127.0.0.1", 1)


async def test_requests_past_max_waiting_are_refused_at_once(
        limited: RendezvousServer) -> None:
    """``max_waiting`` bounds the requests waiting at once, every connection's together: the
    next one (get, wait or roster) is refused at once, naming the limit, while those that
    do not wait are served; once a wait is answered there is room again."""
    async with asyncio.timeout(10):
        async with await connect(limited) as first, await connect(limited, "j") as second:
            waits = [asyncio.create_task(first.get("k", timeout=5)),
                     asyncio.create_task(second.wait(["k2"], timeout=5))]
            await asyncio.sleep(0.1)
            for refused in (first.get("k3", timeout=5), second.wait(["k"], timeout=5),
                            first.roster(world_size=2, timeout=5)):
                with pytest.raises(RendezvousError, match=r"max_waiting=2"):
                    await refused
            with pytest.raises(KeyError):  # (does not wait)
                await first.get("k", wait=False)
            await first.set("k", b"v")
            assert await waits[0] == b"v"
            third = asyncio.create_task(first.get("k3", timeout=5))
            await second.set("k2", b"w")
            await first.set("k3", b"z")
            await waits[1]
            assert await third == b"z"


async def test_the_limits_vectors_replayed_byte_for_byte() -> None:
    """protocol/vectors/rendezvous.json, ``limits``: the vector bytes sent to a fresh server
    with the limits of ``limits_server`` get the vector's responses, byte for byte."""
    vectors = json.loads(VECTORS.read_text())
    assert {s["response"]["meta"].get("code") for s in vectors["limits"]} == {None, "limit"}
    async with asyncio.timeout(10), RendezvousServer(
            token=vectors["token"], **vectors["limits_server"]) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            await client_handshake(reader, writer, vectors["token"], role="client",
                                   timeout=5)
            for step in vectors["limits"]:
                writer.write(bytes.fromhex(step["request_hex"]))
                response = await read_frame(reader, 1 << 20)
                assert response is not None, step["name"]
                assert encode_frame_bytes(response).hex() == step["response_hex"], step["name"]
        finally:
            writer.transport.abort()


async def test_waits_of_a_client_that_hung_up_give_their_room_back(
        limited: RendezvousServer) -> None:
    """Clients that send two waiting requests and hang up at once, the requests still being
    read or their waits just started, over and over: every one of them is given back to
    ``max_waiting``, so that a client after them may still wait."""
    async with asyncio.timeout(10):
        for i in range(20):
            _, writer = await raw_client(limited.port)
            write_frame(writer, request(1, "get", key=f"never-{i}", timeout=30))
            write_frame(writer, request(2, "wait", keys=["never"], timeout=30))
            if i % 2:
                await asyncio.sleep(0.01)
            writer.close()
            await writer.wait_closed()
        for _ in range(100):  # (the server sees the last ones close)
            if limited.jobs == [""] and not limited._waiters:
                break
            await asyncio.sleep(0.02)
        async with await connect(limited) as client:
            waits = [asyncio.create_task(client.get(k, timeout=5)) for k in ("x", "y")]
            await asyncio.sleep(0.1)
            await client.set("x", b"1")
            await client.set("y", b"2")
            assert await asyncio.gather(*waits) == [b"1", b"2"]


# ------------------------------------------------------------------------ decoding bombs

def _hello_nested(depth: int) -> bytes:
    """A HELLO whose header holds ``depth`` nested arrays under ``c``: past msgpack's own
    stack at 2000."""
    body = (b"\x86\xa1g\x00\xa1q\x00\xa1s\x00\xa1t\x00\xa1r\x00\xa1c"
            + b"\x91" * depth + b"\xc0")
    return PREFIX.pack(MAGIC, VERSION, int(FrameKind.HELLO), 0, len(body), 0) + body


@pytest.mark.parametrize("depth", [40, 2000])
async def test_a_nesting_bomb_before_authentication_is_one_clear_log_line(
        depth: int, logs: LogWatch) -> None:
    """A stranger's HELLO nested 40 or 2000 levels deep, at a rank's listener and at the
    rendezvous: each drops the connection with a WARNING that says the header nests too
    deep (past msgpack's own stack, 2000 levels, the line said only 'header is not valid
    msgpack: ', its error having no message)."""
    transport = TcpTransport(1, 2, token=TOKEN, handshake_timeout=5.0)
    async with asyncio.timeout(10), RendezvousServer(token=TOKEN) as server:
        try:
            rank_port = (await transport.listen("127.0.0.1", 0))[1]
            for port in (rank_port, server.port):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(_hello_nested(depth))
                assert await reader.read() == b""  # closed, no reply
                writer.transport.abort()
            for _ in range(100):
                if len(logs.messages()) >= 2:
                    break
                await asyncio.sleep(0.02)
            warnings = logs.messages()
            assert len(warnings) == 2, warnings
            for line in warnings:
                assert "dropped" in line and "header nests deeper than 32 levels" in line, line
        finally:
            await transport.close()


# ------------------------------------------------------------------------ floods

async def test_a_flood_of_silent_connections_holds_max_handshakes_sockets(
        logs: LogWatch) -> None:
    """100 connections that never speak, against a rendezvous that takes 8 in their
    handshake at once: each one past 8 drops the oldest (a WARNING each, naming the limit),
    so the server holds 8 of them, not 100, until the handshake timeout; a client that
    comes meanwhile is served."""
    async with asyncio.timeout(10), RendezvousServer(
            token=TOKEN, max_handshakes=8, handshake_timeout=5.0) as server:
        flood = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(100)]
        async with await connect(server) as client:
            await client.set("k", b"v")
            assert await client.get("k") == b"v"

        def dropped(reader: asyncio.StreamReader) -> bool:
            return reader.at_eof() or reader.exception() is not None

        for _ in range(100):
            if sum(not dropped(r) for r, _ in flood) <= 8:
                break
            await asyncio.sleep(0.02)
        assert sum(not dropped(r) for r, _ in flood) <= 8
        assert all(dropped(r) for r, _ in flood[:90])  # the oldest went
        lines = [m for m in logs.messages() if "max_handshakes" in m]
        assert len(lines) >= 92, len(lines)
        for _, w in flood:
            w.transport.abort()


async def test_a_flood_at_a_ranks_listener_holds_a_bounded_number_of_sockets(
        monkeypatch: pytest.MonkeyPatch, logs: LogWatch) -> None:
    """100 silent connections at rank 0's peer listener, which takes 8 in their handshake
    at once here (``MAX_HANDSHAKES`` beyond twice the world size of 2): it holds at most 8 of
    them (the oldest went, a WARNING each), and the world goes on, rank 1 dialling rank 0
    a connection of its own for a large send after the flood."""
    monkeypatch.setattr(tcp, "MAX_HANDSHAKES", 4, raising=False)
    async with asyncio.timeout(15), RendezvousServer(token=TOKEN) as server:
        comms = await asyncio.gather(*(
            tcp_init(rank=r, world_size=2, addr="127.0.0.1", port=server.port, token=TOKEN,
                     timeout=10.0, host_rendezvous=False) for r in range(2)))
        try:
            transport = comms[0].transport
            assert isinstance(transport, TcpTransport)
            host, port = transport.addresses[0]
            flood = [await asyncio.open_connection(host, port) for _ in range(100)]
            for _ in range(100):
                if sum(not (r.at_eof() or r.exception()) for r, _ in flood) <= 8:
                    break
                await asyncio.sleep(0.02)
            assert sum(not (r.at_eof() or r.exception()) for r, _ in flood) <= 8
            big = np.arange(1 << 18, dtype=np.float64)
            got, _ = await asyncio.gather(comms[0].recv(1), comms[1].send(big, 0))
            assert np.array_equal(got, big)
            sums = await asyncio.gather(*(c.all_reduce(np.ones(4)) for c in comms))
            assert all(np.array_equal(s, np.full(4, 2.0)) for s in sums)
            lines = [m for m in logs.messages() if "the most it takes at once" in m]
            assert len(lines) >= 92, len(lines)
            for _, w in flood:
                w.transport.abort()
        finally:
            for c in comms:
                await c.close()


# ------------------------------------------------------------------------ pretenders

async def replay(port: int, frames: list[bytes]) -> list[Frame]:
    """Send ``frames`` one at a time, each after the server's answer to the one before;
    return what the server sent before it closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got: list[Frame] = []
    try:
        for data in frames:
            writer.write(data)
            frame = await read_frame(reader, 0)
            if frame is None:
                break
            got.append(frame)
        assert await reader.read() == b""
    finally:
        writer.transport.abort()
    return got


async def test_a_replayed_handshake_and_false_ranks_are_refused_and_the_world_goes_on(
        logs: LogWatch) -> None:
    """A stranger that recorded a whole handshake (HELLO and PROOF, made with the token)
    replays it to the rendezvous and to a rank: the server's fresh nonce makes the old
    proof wrong, 'authentication failed', nothing served. Clients that know the token and
    claim a rank out of range or the rank's own are refused with their reason (one that
    claims a connected rank: tests/test_tcp.py). Meanwhile the world of two works on."""
    async with asyncio.timeout(15), RendezvousServer(token=TOKEN) as server:
        comms = await asyncio.gather(*(
            tcp_init(rank=r, world_size=2, addr="127.0.0.1", port=server.port, token=TOKEN,
                     timeout=10.0, host_rendezvous=False) for r in range(2)))
        try:
            transport = comms[0].transport
            assert isinstance(transport, TcpTransport)
            rank_port = transport.addresses[0][1]
            # a legitimate exchange, as a listener on the wire would record it
            hs = ClientHandshake(TOKEN, role="peer", rank=1, job=transport.job)
            hello = encode_frame_bytes(hs.hello())
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(hello)
            challenge = await read_frame(reader, 0)
            assert challenge is not None
            proof = encode_frame_bytes(hs.on_challenge(challenge))
            writer.write(proof)
            welcome = await read_frame(reader, 0)
            assert welcome is not None and hs.on_result(welcome) == {"max_value_bytes": 64 << 20}
            writer.transport.abort()
            for port in (server.port, rank_port):
                got = await replay(port, [hello, proof])
                assert [f.kind for f in got] == [FrameKind.CHALLENGE, FrameKind.REJECT]
                assert got[1].header.meta == {"reason": "authentication failed"}
            for rank, reason in ((2, "rank 2 is not a peer of this world"),
                                 ((1 << 32) - 1, "rank 4294967295 is not a peer of this world"),
                                 (0, "rank 0 is not a peer of this world")):
                reader, writer = await asyncio.open_connection("127.0.0.1", rank_port)
                with pytest.raises(AuthenticationError, match=reason):
                    await client_handshake(reader, writer, TOKEN, role="peer", rank=rank,
                                           job=transport.job, timeout=5)
                writer.transport.abort()
            sums = await asyncio.gather(*(c.all_reduce(np.ones(3)) for c in comms))
            assert all(np.array_equal(s, np.full(3, 2.0)) for s in sums)
            assert sum("authentication failed" in m for m in logs.messages()) >= 2
        finally:
            for c in comms:
                await c.close()


def test_the_store_counts_what_it_holds_exactly() -> None:
    """Random set, add, compare_set, delete, join, leave and bump on two stores sharing one
    ``Usage``: what it counts is always what they hold (keys and roster entries; bytes of
    keys, values, hosts and packed metas), refused changes change nothing, and releasing
    both stores gives everything back."""
    import random

    import msgpack

    from asynccoll.rendezvous._common import _OpError
    from asynccoll.rendezvous.store import Store, Usage

    usage = Usage(max_keys=40, max_bytes=600)
    stores = [Store(usage=usage), Store(usage=usage)]
    rng = random.Random(7)

    def held() -> tuple[int, int]:
        keys = sum(len(s.data) + len(s.members) for s in stores)
        nbytes = sum(sum(len(k.encode()) + len(v) for k, v in s.data.items())
                     + sum(len(m.host.encode()) + len(msgpack.packb(m.meta))
                           for m in s.members.values()) for s in stores)
        return keys, nbytes

    refused = 0
    for _ in range(3000):
        store = rng.choice(stores)
        key = rng.choice("abcdefghijklmnopqrstuvwxyz") * rng.randint(1, 3)
        before = held(), {k: dict(s.data) for k, s in enumerate(stores)}
        try:
            op = rng.randrange(7)
            if op == 0:
                store.set(key, b"v" * rng.randint(0, 40))
            elif op == 1:
                store.add(key, rng.randint(-5, 5))
            elif op == 2:
                store.compare_set(key, store.data.get(key), b"w" * rng.randint(0, 20))
            elif op == 3:
                store.delete(key)
            elif op == 4:
                store.join(rng.randint(0, 9), "h" * rng.randint(1, 15), 1,
                           {"x": "y" * rng.randint(0, 10)}, owner=rng.randint(1, 3),
                           live={1, 2} if rng.random() < 0.5 else None)
            elif op == 5:
                store.leave(rng.randint(0, 9))
            else:
                store.bump(None)
        except _OpError as exc:
            assert exc.code in ("limit", "not_integer"), exc
            refused += exc.code == "limit"
            if op != 4:  # (a join may clear the roster of a world that is over, then fail)
                assert (held(), {k: dict(s.data) for k, s in enumerate(stores)}) == before
        assert (usage.keys, usage.nbytes) == held()
        assert usage.keys <= 40 and usage.nbytes <= 600
    assert refused > 50  # (the limits were met, often)
    for store in stores:
        store.release()
    assert (usage.keys, usage.nbytes) == (0, 0)


async def test_clients_that_come_with_a_flood_connect(logs: LogWatch) -> None:
    """20 clients connect while 300 silent connections pour in, at a rendezvous that takes
    4 in their handshake at once: a client dropped as the oldest (its task not started yet)
    is hung up on, and connects again, so every one is served in a few seconds. (A task
    cancelled before it started never closed its socket: the client waited for its
    CHALLENGE until its timeout, and the server kept the socket.)"""
    async with asyncio.timeout(9), RendezvousServer(
            token=TOKEN, max_handshakes=4, handshake_timeout=5.0) as server:

        async def flood() -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
            conns = []
            for i in range(300):
                conns.append(await asyncio.open_connection("127.0.0.1", server.port))
                if i % 10 == 0:
                    await asyncio.sleep(0)
            return conns

        async def client(i: int) -> bytes:
            async with await RendezvousClient.connect(
                    "127.0.0.1", server.port, token=TOKEN, timeout=4.0) as c:
                await c.set(f"k{i}", str(i))
                return await c.get(f"k{i}")

        flooding = asyncio.create_task(flood())
        got = await asyncio.gather(*(client(i) for i in range(20)))
        assert got == [str(i).encode() for i in range(20)]
        for _, w in await flooding:
            w.transport.abort()
