"""The rendezvous server and client (asynccoll.rendezvous) over real sockets on 127.0.0.1.

Every op, concurrency on one connection and across many, the roster and its generations, and a
server under attack (garbage, truncated and oversized frames, wrong magic, silent clients)
that keeps serving its legitimate client.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import re
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LogWatch, settle_until

from asynccoll.errors import AuthenticationError, ProtocolError, RendezvousError
from asynccoll.handshake import client_handshake, read_frame, server_handshake, write_frame
from asynccoll.rendezvous import RendezvousClient, RendezvousServer, serve
from asynccoll.wire import Frame, FrameHeader, FrameKind, decode_frames, encode_frame_bytes

TOKEN = "s3cr3t-rendezvous-token-value"
PREFIX = struct.Struct("!4sBBHIQ")
MAX_VALUE = 1 << 20


# ----------------------------------------------------------------------------------- fixtures

@pytest.fixture
async def server() -> AsyncIterator[RendezvousServer]:
    async with RendezvousServer(token=TOKEN, handshake_timeout=0.5,
                                max_value_bytes=MAX_VALUE) as srv:
        yield srv


@pytest.fixture
async def client(server: RendezvousServer) -> AsyncIterator[RendezvousClient]:
    async with await connect(server) as c:
        yield c


async def connect(server: RendezvousServer, **kwargs: Any) -> RendezvousClient:
    kwargs.setdefault("token", TOKEN)
    kwargs.setdefault("timeout", 5.0)
    return await RendezvousClient.connect(server.host, server.port, **kwargs)


async def raw_open(server: RendezvousServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(server.host, server.port)


async def raw_close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


async def closed_by_server(reader: asyncio.StreamReader, within: float = 3.0) -> bytes:
    """Read until the server closes the connection (EOF or reset); return what it sent."""
    received = bytearray()
    async with asyncio.timeout(within):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionError:
                return bytes(received)
            if not chunk:
                return bytes(received)
            received += chunk


def request(rid: int, op: str, payload: bytes = b"", **args: Any) -> bytes:
    return encode_frame_bytes(Frame(FrameKind.REQUEST, FrameHeader(meta={"id": rid, "op": op,
                                                                         **args}), payload))


async def authenticated_raw(server: RendezvousServer
                            ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await raw_open(server)
    await client_handshake(reader, writer, TOKEN, role="client", timeout=2)
    return reader, writer


# ----------------------------------------------------------------------------------- key-value

async def test_set_get(client: RendezvousClient) -> None:
    await client.set("a", b"\x00\x01binary")
    await client.set("s", "text é")
    await client.set("empty", b"")
    assert await client.get("a") == b"\x00\x01binary"
    assert await client.get("s") == "text é".encode()
    assert await client.get("empty") == b""
    await client.set("a", b"overwritten")
    assert await client.get("a") == b"overwritten"


async def test_large_value_roundtrip(client: RendezvousClient) -> None:
    value = bytes(range(256)) * (MAX_VALUE // 256)
    await client.set("big", value)
    assert await client.get("big") == value


async def test_value_over_limit_refused_before_sending(client: RendezvousClient) -> None:
    with pytest.raises(ValueError, match="max_value_bytes"):
        await client.set("big", bytes(MAX_VALUE + 1))
    # (a client configured with a larger limit gets dropped: see test_attacks)


async def test_get_without_wait(client: RendezvousClient) -> None:
    with pytest.raises(KeyError):
        await client.get("missing", wait=False)
    await client.set("k", b"v")
    assert await client.get("k", wait=False) == b"v"


async def test_get_timeout_is_server_error(client: RendezvousClient) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(RendezvousError, match=r"timed out after 0\.1 s waiting for key 'nope'"):
        await client.get("nope", timeout=0.1)
    assert loop.time() - start < 2
    await client.set("after", b"ok")  # the connection is fine
    assert await client.get("after") == b"ok"


async def test_concurrent_waiters_woken_by_one_set(server: RendezvousServer) -> None:
    clients = [await connect(server) for _ in range(3)]
    try:
        getters = [asyncio.create_task(c.get("go", timeout=5)) for c in clients for _ in range(4)]
        waiters = [asyncio.create_task(c.wait(["go", "also"], timeout=5)) for c in clients]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in (*getters, *waiters))
        await clients[0].set("go", b"now")
        assert await asyncio.gather(*getters) == [b"now"] * 12
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in waiters)  # still waiting for "also"
        await clients[1].set("also", b"1")
        assert await asyncio.gather(*waiters) == [None] * 3
    finally:
        for c in clients:
            await c.close()


async def test_blocking_get_does_not_block_the_connection(client: RendezvousClient) -> None:
    pending = asyncio.create_task(client.get("later", timeout=5))
    await asyncio.sleep(0.05)
    await client.set("other", b"x")
    assert await client.get("other") == b"x"
    assert await client.add("counter") == 1
    assert not pending.done()
    await client.set("later", b"done")
    assert await pending == b"done"


async def test_huge_key_in_error_message(client: RendezvousClient) -> None:
    key = "k" * 60_000  # fits a request header; echoed in full it would not fit the response's
    with pytest.raises(RendezvousError, match="timed out") as info:
        await client.get(key, timeout=0.05)
    assert len(str(info.value)) < 1100
    await client.set(key, b"v")
    assert await client.get(key) == b"v"


async def test_a_key_that_cannot_be_sent_is_the_callers_error(client: RendezvousClient) -> None:
    """A key over the 64 KiB header, or one that is not UTF-8 text (a lone surrogate from
    os.fsdecode), raised ProtocolError 'header of 70039 bytes exceeds 65536', the error of a
    peer that breaks the protocol, naming neither the call nor the key. Now a ValueError
    that names the call; nothing is sent and the connection stays usable."""
    for key, why in (("k" * 70_000, "65536"), ("bad-\udcff", "utf-8")):
        with pytest.raises(ValueError) as info:
            await client.set(key, b"v")
        assert not isinstance(info.value, ProtocolError), repr(info.value)
        assert str(info.value).startswith("rendezvous set: the request cannot be sent"), info.value
        assert why in str(info.value), info.value
        with pytest.raises(ValueError, match="rendezvous wait: the request cannot be sent"):
            await client.wait([key], timeout=1)
    assert not client.closed
    await client.set("fine", b"v")
    assert await client.get("fine") == b"v"
    assert await client.num_keys() == 1


async def test_wait(client: RendezvousClient) -> None:
    await client.wait([], timeout=0.1)
    await client.set("x", b"1")
    await client.wait("x", timeout=0.1)
    with pytest.raises(RendezvousError, match=re.escape("['y']")):
        await client.wait(["x", "y"], timeout=0.1)


async def test_wait_sees_a_key_written_and_deleted_before_it_woke(
        server: RendezvousServer, client: RendezvousClient) -> None:
    # wait() promises that each key existed at some moment: a set and a delete that the server
    # runs back to back (here pipelined on one connection) must still release the waiter.
    waiter = asyncio.create_task(client.wait(["flash"], timeout=2))
    await asyncio.sleep(0.05)
    reader, writer = await authenticated_raw(server)
    try:
        writer.write(request(1, "set", b"v", key="flash") + request(2, "delete", key="flash"))
        for _ in range(2):
            frame = await read_frame(reader, MAX_VALUE)
            assert frame is not None and frame.header.meta is not None
            assert frame.header.meta["ok"]
        await waiter  # released, not "timed out"
    finally:
        waiter.cancel()
        await raw_close(writer)


async def test_add(client: RendezvousClient) -> None:
    assert await client.add("n", 5) == 5
    assert await client.add("n", -7) == -2
    assert await client.get("n") == b"-2"  # decimal ASCII, like TCPStore
    await client.set("m", b"41")
    assert await client.add("m") == 42
    await client.set("text", b"abc")
    with pytest.raises(RendezvousError, match="not a decimal integer"):
        await client.add("text", 1)
    await client.set("top", str((1 << 63) - 1))
    with pytest.raises(RendezvousError, match="overflow"):
        await client.add("top", 1)
    with pytest.raises(TypeError):
        await client.add("n", 1.5)  # type: ignore[arg-type]


async def test_add_from_20_concurrent_clients(server: RendezvousServer) -> None:
    clients = await asyncio.gather(*(connect(server) for _ in range(20)))
    try:
        results = await asyncio.gather(*(c.add("counter", 1) for c in clients for _ in range(5)))
        assert sorted(results) == list(range(1, 101))
        assert await clients[0].get("counter") == b"100"
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_compare_set(client: RendezvousClient) -> None:
    # expected None: set only if absent
    assert await client.compare_set("k", None, b"first") == (True, b"first")
    assert await client.compare_set("k", None, b"second") == (False, b"first")
    # wrong expected value: unchanged, current returned
    assert await client.compare_set("k", b"nope", b"second") == (False, b"first")
    assert await client.get("k") == b"first"
    # right expected value: swapped
    assert await client.compare_set("k", b"first", b"second") == (True, b"second")
    assert await client.get("k") == b"second"
    # absent key with an expected value: nothing happens, current is None
    assert await client.compare_set("absent", b"x", b"y") == (False, None)
    assert await client.num_keys() == 1
    # empty bytes is a value, not absence
    await client.set("e", b"")
    assert await client.compare_set("e", None, b"z") == (False, b"")
    assert await client.compare_set("e", b"", b"z") == (True, b"z")


async def test_compare_set_wakes_waiters(client: RendezvousClient) -> None:
    waiter = asyncio.create_task(client.get("cas", timeout=5))
    await asyncio.sleep(0.02)
    await client.compare_set("cas", None, b"won")
    assert await waiter == b"won"


async def test_delete_and_num_keys(client: RendezvousClient) -> None:
    assert await client.num_keys() == 0
    await client.set("a", b"1")
    await client.add("b", 1)
    assert await client.num_keys() == 2
    assert await client.delete("a") is True
    assert await client.delete("a") is False
    assert await client.num_keys() == 1
    with pytest.raises(KeyError):
        await client.get("a", wait=False)


# ----------------------------------------------------------------------------------- roster

async def test_roster_waits_for_world_size(server: RendezvousServer) -> None:
    clients = [await connect(server) for _ in range(3)]
    try:
        waiter = asyncio.create_task(clients[0].roster(world_size=3, timeout=5))
        assert await clients[0].join(0, "10.0.0.1", 5000, {"gpu": 0}) == 0
        assert await clients[1].join(1, "10.0.0.2", 5001) == 0
        await asyncio.sleep(0.05)
        assert not waiter.done()
        snapshot = await clients[2].roster()  # no world size: returns at once
        assert snapshot == {"generation": 0, "members": {0: ["10.0.0.1", 5000, {"gpu": 0}],
                                                         1: ["10.0.0.2", 5001, {}]}}
        await clients[2].join(2, "10.0.0.3", 5002, {"host": "c"})
        roster = await waiter
        assert roster["generation"] == 0
        assert roster["members"] == {0: ["10.0.0.1", 5000, {"gpu": 0}],
                                     1: ["10.0.0.2", 5001, {}],
                                     2: ["10.0.0.3", 5002, {"host": "c"}]}
        assert await clients[1].leave(1) is True
        assert await clients[1].leave(1) is False
        assert set((await clients[1].roster())["members"]) == {0, 2}
        # rejoining replaces the entry
        await clients[2].join(2, "10.0.0.9", 6000)
        assert (await clients[0].roster())["members"][2] == ["10.0.0.9", 6000, {}]
    finally:
        for c in clients:
            await c.close()


async def test_a_finished_worlds_roster_is_cleared_by_the_next_join(
        server: RendezvousServer) -> None:
    a, b = await connect(server), await connect(server)
    await a.join(0, "10.0.0.1", 5000)
    await b.join(1, "10.0.0.2", 5001)
    await a.close()
    await asyncio.sleep(0.1)
    c = await connect(server)
    try:
        # b's connection is open: its world may still be forming, the roster is kept
        await c.join(2, "10.0.0.3", 5002)
        assert set((await c.roster())["members"]) == {0, 1, 2}
    finally:
        await b.close()
        await c.close()
    await asyncio.sleep(0.1)
    d = await connect(server)
    try:
        # every member's connection closed: that world is over, the next join starts anew
        await d.join(0, "10.0.0.4", 5003)
        assert (await d.roster())["members"] == {0: ["10.0.0.4", 5003, {}]}
    finally:
        await d.close()


async def test_large_roster(client: RendezvousClient) -> None:
    # far more than a 64 KiB header could hold: the members travel in the payload
    n = 3000
    await asyncio.gather(*(client.join(r, f"node-{r:05d}.cluster.example.org", 20000 + r,
                                       {"gpus": [0, 1, 2, 3], "zone": "eu-west"})
                           for r in range(n)))
    roster = await client.roster(world_size=n, timeout=5)
    assert len(roster["members"]) == n
    assert roster["members"][n - 1] == ["node-02999.cluster.example.org", 22999,
                                        {"gpus": [0, 1, 2, 3], "zone": "eu-west"}]


async def test_roster_timeout(client: RendezvousClient) -> None:
    await client.join(0, "h", 1)
    with pytest.raises(RendezvousError, match="2 ranks to join the roster"):
        await client.roster(world_size=2, timeout=0.1)


async def test_generation_bump(server: RendezvousServer) -> None:
    a, b = await connect(server), await connect(server)
    try:
        assert await a.generation() == 0
        await a.join(0, "h", 1)
        await b.join(1, "h", 2)
        # a waiter that names its generation wakes up on the bump and sees the new one
        stale = asyncio.create_task(a.roster(world_size=3, timeout=5, generation=0))
        # a waiter that does not keeps waiting for the new generation to fill up
        fresh = asyncio.create_task(b.roster(world_size=3, timeout=5))
        await asyncio.sleep(0.05)
        assert await b.bump_generation() == 1
        seen = await stale
        assert seen == {"generation": 1, "members": {}}
        assert await a.generation() == 1
        assert not fresh.done()
        assert await a.join(0, "h", 1) == 1
        assert await b.join(1, "h", 2) == 1
        await asyncio.sleep(0.02)
        assert not fresh.done()
        assert await b.join(2, "h", 3) == 1
        assert await fresh == {"generation": 1, "members": {0: ["h", 1, {}], 1: ["h", 2, {}],
                                                            2: ["h", 3, {}]}}
        # a conditional bump happens once even if two ranks ask for it
        assert await a.bump_generation(expected=1) == 2
        assert await b.bump_generation(expected=1) == 2
        assert await a.generation() == 2
        assert (await a.roster())["members"] == {}
        # a roster call naming an old generation returns at once
        assert (await a.roster(world_size=5, timeout=5, generation=0))["generation"] == 2
    finally:
        await a.close()
        await b.close()


async def test_roster_arguments_checked_before_sending(client: RendezvousClient) -> None:
    with pytest.raises(ValueError):
        await client.join(-1, "h", 1)
    with pytest.raises(ValueError):
        await client.join(0, "h", 70000)
    with pytest.raises(TypeError):
        await client.join(0, "h", 1, {1: "int key"})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        await client.roster(world_size=0)
    with pytest.raises(ValueError):
        await client.get("k", timeout=-1)


# ----------------------------------------------------------------------------------- auth

async def test_wrong_token_cannot_connect(server: RendezvousServer, logs: LogWatch) -> None:
    wrong = "wrong-token-do-not-leak"
    with pytest.raises(AuthenticationError) as info:
        await connect(server, token=wrong)
    assert wrong not in str(info.value) and TOKEN not in str(info.value)
    with pytest.raises(AuthenticationError):
        await connect(server, token=None)
    await logs.wait_for("dropped connection")  # the server logs the drop, without tokens
    assert wrong not in logs.text and TOKEN not in logs.text


async def test_an_authentication_error_names_the_rendezvous_it_came_from() -> None:
    """A rank started with another token read only 'the server failed to prove it knows the
    token (...)': not that it was the rendezvous (a rank's own refusals name the peer and its
    address), nor which one (ASYNCCOLL_RENDEZVOUS, rank 0's). The message names it."""
    async with RendezvousServer(token=TOKEN, job="job-1") as srv:
        where = f"rendezvous server at {srv.host}:{srv.port}"
        with pytest.raises(AuthenticationError, match="failed to prove") as info:
            await connect(srv, token="another")
        assert where in str(info.value), info.value
        with pytest.raises(AuthenticationError, match="job mismatch") as info:
            await connect(srv, job="job-2")
        assert where in str(info.value), info.value


async def test_the_server_log_says_a_client_with_another_token_left(
        server: RendezvousServer, logs: LogWatch) -> None:
    """A rank given another token leaves after the CHALLENGE without a word (SPEC,
    Handshake): the server's log read only 'connection closed during the handshake (waiting
    for PROOF)', so whoever watched rank 0's rendezvous learnt neither which rank failed nor
    that its token was the likely cause. The line names the client's claim and says so."""
    with pytest.raises(AuthenticationError):
        await connect(server, token="another-token", rank=3)
    match = await logs.wait_for(r"dropped connection from 127\.0\.0\.1:\d+: (.*)")
    assert "client (role='client', rank=3)" in match.group(1), match.group(1)
    assert "without a PROOF, as a client with another token does" in match.group(1)
    assert "another-token" not in logs.text and TOKEN not in logs.text


async def test_a_token_with_surrogate_escapes_works_end_to_end(logs: LogWatch) -> None:
    """A server given ASYNCCOLL_TOKEN with bytes that are not UTF-8 (a str with surrogate
    escapes) failed every connection with 'internal error' and a traceback; it is refused at
    construction only when no environment could have produced it."""
    token = "tok-\udcff\udcfe"
    async with RendezvousServer(token=token) as srv:
        for client_token in (token, b"tok-\xff\xfe"):
            async with await connect(srv, token=client_token) as c:
                await c.set("k", b"v")
        with pytest.raises(AuthenticationError):
            await connect(srv, token="tok-")
    assert not [r for r in logs.records if r.levelno >= logging.ERROR], logs.text
    with pytest.raises(ValueError, match="UTF-8"):
        RendezvousServer(token="tok-\ud800")


async def test_a_client_token_that_cannot_be_a_key_is_refused_before_connecting(
        server: RendezvousServer, logs: LogWatch) -> None:
    """A client given a str token no environment gives (a lone surrogate) or one of another
    type connected first and raised only in the handshake: the server logged a WARNING for a
    client that 'closed the connection during the handshake', and with no server listening
    the error was 'could not connect', not the token. It is refused before any connection."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]  # (closed at once: nothing listens there)
    for bad, error in (("tok-\ud800", ValueError), (12345, TypeError)):
        with pytest.raises(error, match="token"):
            await RendezvousClient.connect("127.0.0.1", nobody, token=bad,  # type: ignore
                                           timeout=2)
        with pytest.raises(error, match="token"):
            await connect(server, token=bad)
    async with await connect(server) as c:  # (after the server handled what it was sent)
        await c.set("k", b"v")
        assert await c.get("k") == b"v"
    assert "dropped connection" not in logs.text, logs.text


async def test_job_mismatch_cannot_connect() -> None:
    async with RendezvousServer(token=TOKEN, job="job-1") as srv:
        with pytest.raises(AuthenticationError, match="job mismatch"):
            await connect(srv, job="job-2")
        async with await connect(srv, job="job-1") as c:
            await c.set("k", b"v")


async def test_client_without_token_reaches_server_without_token() -> None:
    async with RendezvousServer() as srv:
        async with await RendezvousClient.connect(srv.host, srv.port, timeout=2) as c:
            await c.set("k", b"v")
            assert await c.get("k") == b"v"


# ----------------------------------------------------------------------------------- attacks

async def test_attacks_are_dropped_while_legit_client_works(
        server: RendezvousServer, client: RendezvousClient, logs: LogWatch) -> None:
    stop = asyncio.Event()
    done = 0

    async def legit_work() -> None:
        nonlocal done
        while not stop.is_set():
            await client.set(f"k{done}", b"v")
            assert await client.get(f"k{done}") == b"v"
            await client.add("ops", 1)
            done += 1
            await asyncio.sleep(0.005)

    hello_prefix = PREFIX.pack(b"ACOL", 1, FrameKind.HELLO, 0, 40, 0)

    async def attack(name: str, data: bytes, eof: bool, authenticate: bool = False) -> str:
        if authenticate:
            reader, writer = await authenticated_raw(server)
        else:
            reader, writer = await raw_open(server)
        try:
            writer.write(data)
            if eof:
                writer.write_eof()
            await closed_by_server(reader)
        finally:
            await raw_close(writer)
        return name

    attacks = [
        ("garbage", b"\x16\x03\x01\x02\x00" + bytes(range(256)) * 4, False, False),
        ("http", b"GET / HTTP/1.1\r\nHost: rendezvous\r\n\r\n", False, False),
        ("wrong magic", PREFIX.pack(b"NCCL", 1, 16, 0, 0, 0), False, False),
        ("wrong version", PREFIX.pack(b"ACOL", 9, 16, 0, 0, 0), False, False),
        ("oversized payload prefix", PREFIX.pack(b"ACOL", 1, 16, 0, 10, 1 << 39), False, False),
        ("oversized header prefix", PREFIX.pack(b"ACOL", 1, 16, 0, 1 << 30, 0), False, False),
        ("truncated frame then eof", hello_prefix + b"\x86\xa1g", True, False),
        ("truncated frame, held open", hello_prefix + b"\x86\xa1g", False, False),
        ("silent", b"", False, False),
        ("prefix only, held open", hello_prefix, False, False),
        ("request before handshake", request(1, "num_keys"), False, False),
        # after a successful handshake
        ("oversized value", PREFIX.pack(b"ACOL", 1, 32, 0, 10, MAX_VALUE + 1), False, True),
        ("garbage after auth", b"\xff" * 100, False, True),
        ("request without id", encode_frame_bytes(Frame(FrameKind.REQUEST, FrameHeader(
            meta={"op": "get", "key": "k"}))), False, True),
        ("request with bool id", request(True, "num_keys"), False, True),  # type: ignore[arg-type]
        ("response frame from a client", encode_frame_bytes(Frame(FrameKind.RESPONSE, FrameHeader(
            meta={"id": 1, "ok": True}))), False, True),
        ("truncated request then eof", request(1, "set", b"value", key="k")[:-2], True, True),
    ]
    worker = asyncio.create_task(legit_work())
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with asyncio.timeout(5):
            names = await asyncio.gather(*(attack(*a) for a in attacks))
    finally:
        stop.set()
        await worker
    assert names == [a[0] for a in attacks]
    assert loop.time() - start < 3  # the silent ones go at handshake_timeout=0.5
    assert done > 0
    # the legitimate client is unharmed
    assert await client.get("ops") == str(done).encode()
    assert await client.num_keys() == done + 1
    dropped = [r for r in logs.records if "dropped connection" in r.getMessage()]
    assert len(dropped) >= len(attacks)
    assert all(r.levelno == logging.WARNING for r in dropped)


async def test_handshake_timeout_drops_slowloris(logs: LogWatch) -> None:
    async with RendezvousServer(token=TOKEN, handshake_timeout=0.2) as srv:
        reader, writer = await raw_open(srv)
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            for byte in encode_frame_bytes(Frame(FrameKind.HELLO, FrameHeader()))[:3]:
                writer.write(bytes([byte]))  # one byte at a time, never finishing
                await asyncio.sleep(0.04)
            await closed_by_server(reader, within=2)
            assert 0.15 < loop.time() - start < 2
        finally:
            await raw_close(writer)
    assert "did not complete the handshake within 0.2 s" in logs.text


async def test_bad_arguments_answered_connection_kept(server: RendezvousServer) -> None:
    reader, writer = await authenticated_raw(server)
    try:
        cases = [
            request(1, "get", key=5),
            request(2, "set"),
            request(3, "add", key="k", delta="1"),
            request(4, "wait", keys="k"),
            request(5, "join", rank=-1, host="h", port=1),
            request(6, "get", b"payload", key="k"),
            request(7, "no_such_op"),
            request(8, "get", key="k", timeout=-5),
        ]
        for data in cases:
            writer.write(data)
        writer.write(request(9, "num_keys"))
        await writer.drain()
        answers = {}
        async with asyncio.timeout(2):
            while len(answers) < len(cases) + 1:
                frame = await read_frame(reader, MAX_VALUE)
                assert frame is not None and frame.kind == FrameKind.RESPONSE
                assert frame.header.meta is not None
                answers[frame.header.meta["id"]] = frame.header.meta
        for rid in range(1, 9):
            assert answers[rid]["ok"] is False, answers[rid]
            assert answers[rid]["code"] == ("unknown_op" if rid == 7 else "bad_request")
            assert isinstance(answers[rid]["error"], str)
        assert answers[9] == {"id": 9, "ok": True, "count": 0}
    finally:
        await raw_close(writer)


async def test_unknown_op_from_client_is_rendezvous_error(client: RendezvousClient) -> None:
    with pytest.raises(RendezvousError, match="unknown op 'frobnicate'"):
        await client._call("frobnicate", {})
    assert await client.num_keys() == 0


async def test_client_that_does_not_read_is_dropped(logs: LogWatch, gather_writes: str) -> None:
    async with RendezvousServer(token=TOKEN, send_timeout=0.3,
                                max_value_bytes=4 << 20) as srv:
        async with await connect(srv, max_value_bytes=4 << 20) as c:
            await c.set("big", bytes(4 << 20))
            _, writer = await authenticated_raw(srv)
            try:
                for rid in range(64):  # 256 MiB of answers it never reads
                    writer.write(request(rid, "get", key="big"))
                await writer.drain()
                await logs.wait_for("did not read its responses", within=5)
            finally:
                writer.transport.abort()
                await raw_close(writer)
            assert await c.get("big", timeout=1) == bytes(4 << 20)


# ----------------------------------------------------------------------------------- lifecycle

async def test_server_close_fails_pending_calls_promptly() -> None:
    srv = RendezvousServer(token=TOKEN)
    await srv.start()
    c = await connect(srv, timeout=30)
    try:
        pending = [asyncio.create_task(c.get("never", timeout=30)),
                   asyncio.create_task(c.wait(["never"], timeout=30)),
                   asyncio.create_task(c.roster(world_size=8, timeout=30))]
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await srv.close()
        for task in pending:
            with pytest.raises(RendezvousError, match="closed the connection"):
                await task
        assert loop.time() - start < 1
        assert c.closed
        with pytest.raises(RendezvousError):
            await c.set("k", b"v")
        await srv.close()  # idempotent
    finally:
        await c.close()
        await srv.close()


async def test_client_close_fails_its_pending_calls(client: RendezvousClient) -> None:
    pending = asyncio.create_task(client.get("never", timeout=30))
    await asyncio.sleep(0.02)
    await client.close()
    with pytest.raises(RendezvousError, match="closed"):
        await pending
    with pytest.raises(RendezvousError):
        await client.num_keys()
    await client.close()  # idempotent


async def test_client_times_out_when_server_never_answers() -> None:
    finished = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await server_handshake(reader, writer, TOKEN, timeout=2)
            await reader.read()  # swallows requests, answers nothing
        finally:
            await raw_close(writer)
            finished.set()

    fake = await asyncio.start_server(mute, "127.0.0.1", 0)
    try:
        port = fake.sockets[0].getsockname()[1]
        async with await RendezvousClient.connect("127.0.0.1", port, token=TOKEN,
                                                  timeout=0.2) as c:
            with pytest.raises(RendezvousError, match="no answer"):
                await c.num_keys()
        async with asyncio.timeout(2):
            await finished.wait()
    finally:
        fake.close()
        await fake.wait_closed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _late_server(port: int) -> RendezvousServer:
    """A server on ``port`` that starts only after 0.3 s."""
    await asyncio.sleep(0.3)
    srv = RendezvousServer(port=port, token=TOKEN)
    await srv.start()
    return srv


async def test_connect_retries_until_server_starts() -> None:
    port = _free_port()

    starter = asyncio.create_task(_late_server(port))
    c = await RendezvousClient.connect("127.0.0.1", port, token=TOKEN, timeout=5)
    srv = await starter
    try:
        await c.set("k", b"v")
    finally:
        await c.close()
        await srv.close()


async def test_connect_retries_a_host_with_several_addresses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # "localhost" often resolves to ::1 and 127.0.0.1; while nobody listens yet, asyncio raises
    # one combined OSError for both refusals, which must be retried like a single refusal.
    port, unused = _free_port(), _free_port()
    loop = asyncio.get_running_loop()
    resolve = loop.getaddrinfo

    async def two_addresses(host: str, p: int, **kwargs: Any) -> Any:
        if host == "rendezvous.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", a))
                    for a in (unused, p)]
        return await resolve(host, p, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", two_addresses)

    starter = asyncio.create_task(_late_server(port))
    try:
        async with await RendezvousClient.connect("rendezvous.test", port, token=TOKEN,
                                                  timeout=5) as c:
            await c.set("k", b"v")
    finally:
        await (await starter).close()


async def test_connect_retries_a_server_that_closes_during_the_handshake() -> None:
    """A server going away as the client connects (the previous world's rendezvous closing
    on the port the next world's rank 0 is about to bind) closes the connection before
    WELCOME, without REJECT: that is retried as a refused connection is, within the
    timeout. Without retry, or past the timeout, it is the same clear error as before."""
    port = _free_port()
    closing: list[int] = []
    came = asyncio.Event()

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        closing.append(1)
        came.set()
        await reader.read(1)           # the client's HELLO, then gone
        writer.close()

    dying = await asyncio.start_server(hang_up, "127.0.0.1", port)

    async def replace() -> RendezvousServer:
        await came.wait()
        await asyncio.sleep(0.2)
        dying.close()
        await dying.wait_closed()
        return await _late_server(port)

    starter = asyncio.create_task(replace())
    try:
        async with await RendezvousClient.connect("127.0.0.1", port, token=TOKEN,
                                                  timeout=5) as c:
            await c.set("k", b"v")
            assert await c.get("k") == b"v"
    finally:
        await (await starter).close()
    assert len(closing) >= 2     # (the first connections were hung up on: retried)

    dying = await asyncio.start_server(hang_up, "127.0.0.1", port)
    try:
        with pytest.raises(RendezvousError, match="closed during the handshake"):
            await RendezvousClient.connect("127.0.0.1", port, token=TOKEN,
                                           connect_retry=False, timeout=5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RendezvousError, match="closed during the handshake"):
            await RendezvousClient.connect("127.0.0.1", port, token=TOKEN, timeout=0.5)
        assert loop.time() - start < 2.0
    finally:
        dying.close()
        await dying.wait_closed()


async def test_connect_without_retry_or_past_timeout() -> None:
    port = _free_port()
    with pytest.raises(RendezvousError, match="could not connect"):
        await RendezvousClient.connect("127.0.0.1", port, connect_retry=False, timeout=5)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(RendezvousError, match="could not connect"):
        await RendezvousClient.connect("127.0.0.1", port, timeout=0.3)
    assert loop.time() - start < 1.5


async def test_two_servers_are_independent() -> None:
    async with RendezvousServer(token="a") as s1, RendezvousServer(token="b") as s2:
        assert s1.port != s2.port
        async with await RendezvousClient.connect(s1.host, s1.port, token="a") as c1, \
                await RendezvousClient.connect(s2.host, s2.port, token="b") as c2:
            await c1.set("k", b"one")
            await c2.set("k", b"two")
            await c1.join(0, "h", 1)
            await c2.bump_generation()
            assert await c1.get("k") == b"one"
            assert await c2.get("k") == b"two"
            assert await c1.generation() == 0
            assert (await c2.roster())["members"] == {}
        with pytest.raises(AuthenticationError):
            await RendezvousClient.connect(s2.host, s2.port, token="a", timeout=2)


async def test_server_properties_and_double_start() -> None:
    srv = RendezvousServer()
    with pytest.raises(RuntimeError):
        _ = srv.port
    await srv.close()  # closing a server that never started is fine
    async with RendezvousServer() as srv:
        assert srv.host == "127.0.0.1" and srv.port > 0
        with pytest.raises(RuntimeError):
            await srv.start()


async def test_bad_job_refused_at_construction() -> None:
    # checked once, up front, not by every handshake (which reset each client's connection)
    with pytest.raises(TypeError, match="job must be a str"):
        RendezvousServer(token=TOKEN, job=None)  # type: ignore[arg-type]


async def test_bad_client_max_value_bytes_refused_before_connecting() -> None:
    # checked before any connection is tried (port 9 on loopback: nothing is dialled)
    with pytest.raises(TypeError, match="max_value_bytes"):
        await RendezvousClient.connect("127.0.0.1", 9, token=TOKEN,
                                       max_value_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_value_bytes"):
        await RendezvousClient.connect("127.0.0.1", 9, token=TOKEN, max_value_bytes=-1)


async def test_close_writer_cancelled_aborts_the_connection() -> None:
    # a graceful close waiting on a peer that does not read, cancelled: the socket is
    # aborted, not left half closed
    from asynccoll.rendezvous._common import _close_writer

    accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def on_client(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(writer)

    srv = await asyncio.start_server(on_client, "127.0.0.1", 0)
    peer: asyncio.StreamWriter | None = None
    try:
        port = srv.sockets[0].getsockname()[1]
        _, peer = await asyncio.open_connection("127.0.0.1", port)
        writer = await asyncio.wait_for(accepted.get(), 5)
        writer.transport.set_write_buffer_limits(high=1 << 30)
        writer.write(b"x" * (32 << 20))  # the peer reads none of it: the close must wait
        task = asyncio.create_task(_close_writer(writer))
        await asyncio.sleep(0.1)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert writer.transport.is_closing()
        # aborted: the data dropped (at once on asyncio's loop; uvloop's drops it when the
        # socket closes, an iteration of the loop later)
        await settle_until(lambda: writer.transport.get_write_buffer_size() == 0, 2.0)
    finally:
        if peer is not None:
            peer.close()
        srv.close()
        await srv.wait_closed()


async def test_serve_logs_address_and_runs_until_cancelled(logs: LogWatch) -> None:
    task = asyncio.create_task(serve("127.0.0.1", 0, TOKEN))
    try:
        match = await logs.wait_for(r"listening on 127\.0\.0\.1:(\d+)")
        port = int(match.group(1))
        async with await RendezvousClient.connect("127.0.0.1", port, token=TOKEN,
                                                  timeout=2) as c:
            await c.set("k", b"v")
            assert await c.get("k") == b"v"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises(RendezvousError):
        await RendezvousClient.connect("127.0.0.1", port, token=TOKEN, connect_retry=False)


async def test_many_clients_barrier_pattern(server: RendezvousServer) -> None:
    """The TCPStore barrier idiom: add, then wait for the last arrival's key."""
    n = 8

    async def rank(r: int) -> int:
        async with await connect(server) as c:
            await c.join(r, "127.0.0.1", 10000 + r)
            if await c.add("arrived", 1) == n:
                await c.set("all-here", b"1")
            await c.wait(["all-here"], timeout=5)
            roster = await c.roster(world_size=n, timeout=5)
            return len(roster["members"])

    assert await asyncio.gather(*(rank(r) for r in range(n))) == [n] * n


async def test_write_frame_requests_are_demultiplexed(server: RendezvousServer) -> None:
    # responses come back tagged by id even when they complete out of order
    reader, writer = await authenticated_raw(server)
    try:
        write_frame(writer, Frame(FrameKind.REQUEST, FrameHeader(
            meta={"id": 10, "op": "get", "key": "slow", "timeout": 5})))
        write_frame(writer, Frame(FrameKind.REQUEST, FrameHeader(
            meta={"id": 11, "op": "set", "key": "slow"}), b"val"))
        await writer.drain()
        got = []
        async with asyncio.timeout(2):
            for _ in range(2):
                frame = await read_frame(reader, MAX_VALUE)
                assert frame is not None
                got.append((frame.header.meta["id"], bytes(frame.payload)))
        assert got == [(11, b""), (10, b"val")]
    finally:
        await raw_close(writer)


# ----------------------------------------------------------------------------------- vectors

RDV_VECTORS_PATH = Path(__file__).resolve().parents[1] / "protocol" / "vectors" / "rendezvous.json"
RDV_VECTORS = json.loads(RDV_VECTORS_PATH.read_text())


def test_rendezvous_vectors_are_up_to_date() -> None:
    path = RDV_VECTORS_PATH.parents[1] / "make_rendezvous_vectors.py"
    spec = importlib.util.spec_from_file_location("make_rendezvous_vectors", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == RDV_VECTORS_PATH.read_text(), \
        "run protocol/make_rendezvous_vectors.py"


def _vector_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, dict):
        return {k: _vector_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_vector_json(v) for v in value]
    return value


def test_rendezvous_vectors_cover_every_op_and_error_code() -> None:
    ops = {s["request"]["meta"]["op"] for s in RDV_VECTORS["session"]}
    assert ops >= {"set", "get", "wait", "add", "compare_set", "delete", "num_keys", "join",
                   "leave", "roster", "generation", "bump_generation"}
    codes = {s["response"]["meta"].get("code") for s in RDV_VECTORS["session"]}
    assert codes == {None, "bad_request", "unknown_op", "timeout", "not_integer", "overflow"}


async def test_rendezvous_vectors_replayed_byte_for_byte() -> None:
    """The vector bytes as they are (not re-encoded) sent to a fresh server: every response is
    the vector's, byte for byte, and means what its JSON says; every 'closing' frame makes the
    server close the connection without a response."""
    async with RendezvousServer(token=RDV_VECTORS["token"]) as srv:
        reader, writer = await raw_open(srv)
        try:
            await client_handshake(reader, writer, RDV_VECTORS["token"], role="client",
                                   timeout=5)
            for step in RDV_VECTORS["session"]:
                request = decode_frames(bytes.fromhex(step["request_hex"]))[0]
                assert _vector_json(request.header.meta) == step["request"]["meta"]
                assert bytes(request.payload).hex() == step["request"]["payload_hex"]
                writer.write(bytes.fromhex(step["request_hex"]))
                async with asyncio.timeout(5):
                    response = await read_frame(reader, 1 << 26)
                assert response is not None, step["name"]
                assert encode_frame_bytes(response).hex() == step["response_hex"], step["name"]
                assert _vector_json(response.header.meta) == step["response"]["meta"]
                assert bytes(response.payload).hex() == step["response"]["payload_hex"]
        finally:
            await raw_close(writer)
        for case in RDV_VECTORS["closing"]:
            reader, writer = await raw_open(srv)
            try:
                await client_handshake(reader, writer, RDV_VECTORS["token"], role="client",
                                       timeout=5)
                writer.write(bytes.fromhex(case["hex"]))
                async with asyncio.timeout(5):
                    assert await reader.read() == b"", case["name"]
            finally:
                await raw_close(writer)


HS_VECTORS = json.loads((Path(__file__).resolve().parents[1] / "protocol" / "vectors"
                         / "handshake.json").read_text())


@pytest.mark.parametrize("name", ["rendezvous_client_with_job", "rendezvous_client_empty_job",
                                  "rendezvous_of_rank_0_accepts_its_job",
                                  "rendezvous_of_rank_0_refuses_another_job",
                                  "rendezvous_of_rank_0_refuses_the_empty_job"])
async def test_handshake_vectors_of_job_ids_against_a_live_rendezvous(name: str) -> None:
    """The handshake vectors of job ids at the rendezvous (a client with a job id and with
    none on a shared server; rank 0's server, configured with its job id, accepting it and
    refusing another or none), replayed against a running ``RendezvousServer``: the HELLO,
    and the server's WELCOME or REJECT, byte for byte (the CHALLENGE carries the server's
    random nonce), and an accepted client's requests act on its job's namespace."""
    from asynccoll.handshake import ClientHandshake

    (ex,) = [e for e in HS_VECTORS["exchanges"] if e["name"] == name]
    c, s, frames = ex["client"], ex["server"], ex["frames"]
    async with RendezvousServer(token=s["token"], job=s["job"]) as srv:
        reader, writer = await raw_open(srv)
        try:
            client = ClientHandshake(c["token"], role=c["role"], rank=c["rank"], job=c["job"],
                                     nonce=bytes.fromhex(c["nonce_hex"]))
            hello = encode_frame_bytes(client.hello())
            assert hello.hex() == frames[0]["hex"]
            writer.write(hello)
            async with asyncio.timeout(5):
                challenge = await read_frame(reader, 0)
                assert challenge is not None and challenge.kind == FrameKind.CHALLENGE
                writer.write(encode_frame_bytes(client.on_challenge(challenge)))
                result = await read_frame(reader, 0)
            assert result is not None
            assert encode_frame_bytes(result).hex() == frames[3]["hex"], result
            if ex["outcome"]["server"] == "accepted":
                writer.write(request(1, "set", b"v", key=f"k-{name}"))
                async with asyncio.timeout(5):
                    answer = await read_frame(reader, 1 << 20)
                assert answer is not None and answer.header.meta["ok"] is True
                assert c["job"] in srv.jobs, srv.jobs
                held = srv._stores[c["job"]].data  # (its job's namespace, and none other)
                assert held == {f"k-{name}": b"v"}, held
            else:
                assert result.kind == FrameKind.REJECT
                assert result.header.meta == {"reason": ex["outcome"]["reason"]}
                async with asyncio.timeout(5):
                    assert await reader.read() == b""
        finally:
            await raw_close(writer)


async def test_response_over_the_clients_own_limit_names_that_limit(
        server: RendezvousServer, client: RendezvousClient) -> None:
    # a value the server holds that is larger than a second client accepts: that client's
    # error says which limit it was (not only that the server "broke the protocol")
    await client.set("big", bytes(4096))
    async with await connect(server, max_value_bytes=1024) as small:
        with pytest.raises(RendezvousError, match="max_value_bytes is 1024"):
            await small.get("big")


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.2", False), ("127.0.0.1", False),
                                              ("0.0.0.0", True)])
async def test_a_server_without_token_warns_only_beyond_loopback(
        host: str, warned: bool, logs: LogWatch) -> None:
    """All of 127.0.0.0/8 is loopback (the server compared the host with three strings, so
    127.0.0.2 warned that anyone could reach it)."""
    async with RendezvousServer(host, 0):
        pass
    said = [m for m in logs.messages() if "has no token" in m]
    assert bool(said) == warned, said


def test_loopback_addresses() -> None:
    from asynccoll._aio import is_loopback

    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "10.0.0.1", "::", "example.org", "::ffff:10.0.0.1"):
        assert not is_loopback(host), host


# ----------------------------------------------------------------------------------- init

async def test_every_rank_of_a_world_rank_0_hosts_times_out_alike() -> None:
    """A world of four whose rank 3 never comes, on the rendezvous rank 0 hosts. Rank 0
    joined first, so its wait ended first: it raised ``RendezvousTimeout`` ('never joined:
    rank 3') and closed the rendezvous; ranks 1 and 2, still waiting there, raised a plain
    ``RendezvousError`` (the server closed the connection), not a ``CollectiveTimeout``,
    though the cause was the same. Every rank now raises ``RendezvousTimeout`` saying what it
    waited for and which rank never joined, promptly (well before their own timeouts)."""
    from asynccoll import Communicator
    from asynccoll.errors import CollectiveTimeout, RendezvousTimeout
    from asynccoll.transport.tcp import tcp_init

    port = _free_port()

    async def rank(r: int, delay: float) -> Communicator:
        await asyncio.sleep(delay)
        return await tcp_init(rank=r, world_size=4, addr="127.0.0.1", port=port, token=TOKEN,
                              timeout=1.0 if r == 0 else 8.0)

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with asyncio.timeout(20):
        results = await asyncio.gather(rank(0, 0.0), rank(1, 0.3), rank(2, 0.6),
                                       return_exceptions=True)
    elapsed = loop.time() - t0
    for c in results:
        if isinstance(c, Communicator):
            await c.close()
    for r, exc in enumerate(results):
        assert isinstance(exc, RendezvousTimeout), (r, results)
        assert isinstance(exc, CollectiveTimeout) and isinstance(exc, RendezvousError)
        message = str(exc)
        assert "waiting for 4 ranks to join the roster (have 3)" in message, (r, message)
        assert "never joined: rank 3" in message, (r, message)
        if r:
            assert f"rank {r} waited for 4 ranks to join the roster" in message, message
            assert "rank 0, which hosts the rendezvous, gave up waiting" in message, message
    # the others' own waits would have ended after 8 s: told by rank 0, at about 1 s
    assert elapsed < 5.0, elapsed


async def test_a_rank_that_never_reaches_the_rendezvous_of_rank_0_times_out() -> None:
    """Rank 1 comes after rank 0 gave up and closed the rendezvous it hosted (or rank 0
    never started): it retried the port until its timeout and raised a plain
    ``RendezvousError`` ('could not connect ...: connection refused'), no
    ``CollectiveTimeout``, though the world did not form in time, as on every other rank.
    It is a ``RendezvousTimeout`` saying what it waited for, and which rendezvous."""
    from asynccoll.errors import CollectiveTimeout, RendezvousTimeout
    from asynccoll.transport.tcp import tcp_init

    port = _free_port()  # (nobody listens there)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(RendezvousTimeout) as info:
        await tcp_init(rank=1, world_size=3, addr="127.0.0.1", port=port, token=TOKEN,
                       timeout=0.5)
    assert loop.time() - t0 < 3.0
    assert isinstance(info.value, CollectiveTimeout)
    message = str(info.value)
    assert f"rank 1 could not reach the rendezvous at 127.0.0.1:{port} within 0.5 s" in \
        message, message
    assert "rank 0 hosts it" in message, message
    # a standalone one (ASYNCCOLL_RENDEZVOUS) that does not run there, named as such
    with pytest.raises(RendezvousTimeout, match="the standalone rendezvous"):
        await tcp_init(rank=0, world_size=3, rendezvous=f"127.0.0.1:{port}", token=TOKEN,
                       timeout=0.5)
    # refused at once (no retry): not a timeout
    with pytest.raises(RendezvousError) as refused:
        await RendezvousClient.connect("127.0.0.1", port, connect_retry=False, timeout=5)
    assert not isinstance(refused.value, CollectiveTimeout)
