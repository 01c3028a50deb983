"""Small frames both ways on one TCP connection per pair (asynccoll.transport.tcp).

A world connects its pairs at start-up, the lower rank dialling; the higher rank sends small
frames on the connection it accepted and large ones on one it dials itself. Messages that
take both connections, or the two of ranks that dialled each other at once, still arrive in
order; a rank whose lower peer never dials dials it itself; and the side that accepted may
send right behind the handshake's last frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from conftest import settle_until

from asynccoll import Communicator, PeerLostError
from asynccoll.handshake import ServerHandshake
from asynccoll.transport.base import frame_key
from asynccoll.transport.tcp import (
    MESH_RANKS,
    TcpTransport,
    _Connection,
    startup_peers,
    tcp_local_world,
)
from asynccoll.wire import Frame, FrameDecoder, FrameHeader, FrameKind, encode_frame_bytes

TOKEN = "pairs"


def _connections(t: TcpTransport, peer: int) -> list[_Connection]:
    return [c for c in t._open if c.peer == peer and c.authenticated and not c.closed]


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_a_world_forms_with_one_connection_per_pair(world_size: int) -> None:
    comms = await tcp_local_world(world_size, token=TOKEN)
    try:
        ts = [c.transport for c in comms]
        assert all(isinstance(t, TcpTransport) for t in ts)
        for t in ts:  # every pair connected at start-up, once
            for p in range(world_size):
                if p != t.rank:
                    (conn,) = _connections(t, p)
                    assert conn.outgoing == (t.rank < p)  # the lower rank dialled
        data = [np.arange(1000, dtype=np.float64) * (r + 1) for r in range(world_size)]
        await asyncio.gather(*(c.all_reduce(d) for c, d in zip(comms, data, strict=True)))
        total = sum(range(1, world_size + 1))
        for d in data:
            np.testing.assert_array_equal(d, np.arange(1000) * total)
        await asyncio.gather(*(c.barrier() for c in comms))
        # point to point both ways between every pair
        sends = [c.send(np.full(3, 10 * c.rank + p), dst=p, tag=1)
                 for c in comms for p in range(world_size) if p != c.rank]
        recvs = [c.recv(src=p, tag=1) for c in comms for p in range(world_size) if p != c.rank]
        got = await asyncio.gather(*recvs, *sends)
        k = 0
        for c in comms:
            for p in range(world_size):
                if p != c.rank:
                    np.testing.assert_array_equal(got[k], np.full(3, 10 * p + c.rank))
                    k += 1
        for t in ts:  # still one connection per pair, sent and read on both ways
            for p in range(world_size):
                if p != t.rank:
                    (conn,) = _connections(t, p)
                    sends_on = t._out if t.rank < p else t._pair
                    assert sends_on[p] is conn and t._in[p] is conn
        # large frames: the higher rank of a pair sends them on a connection of its own
        big = [np.full(1 << 16, float(r)) for r in range(world_size)]
        await asyncio.gather(*(c.all_gather(b) for c, b in zip(comms, big, strict=True)))
        for t in ts:
            for p in range(world_size):
                if p < t.rank:  # it dialled one of its own; the peer's come on the pair's
                    assert len(_connections(t, p)) == 2 and t._out[p].outgoing
                    assert t._in_large[p] is t._pair[p]
                elif p > t.rank:  # the peer's come on the peer's own
                    assert len(_connections(t, p)) == 2
                    assert t._in_large[p] is not t._out[p] and t._in[p] is t._out[p]
    finally:
        for c in comms:
            await c.close()


async def test_a_crowded_world_sends_on_connections_it_dialled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With more ranks than cores every rank dials every peer at start-up and sends on its
    own connections (the shared one cost time there); collectives and messages work alike."""
    monkeypatch.setenv("ASYNCCOLL_LOCAL_WORLD_SIZE", str(4 * (os.cpu_count() or 1)))
    comms = await tcp_local_world(3, token=TOKEN)
    try:
        ts = [c.transport for c in comms]
        assert all(isinstance(t, TcpTransport) and t.crowded for t in ts)
        data = [np.full(100, r + 1.0) for r in range(3)]
        await asyncio.gather(*(c.all_reduce(d) for c, d in zip(comms, data, strict=True)))
        assert all((d == 6).all() for d in data)
        await asyncio.gather(*(c.barrier() for c in comms))
        for t in ts:
            assert not t._pair  # type: ignore[attr-defined]
            for p in range(3):
                if p != t.rank:
                    assert len(_connections(t, p)) == 2  # type: ignore[arg-type]
                    assert t._out[p].outgoing and t._in[p] is not t._out[p]  # type: ignore[attr-defined]
    finally:
        for c in comms:
            await c.close()


@contextlib.asynccontextmanager
async def _two_ranks(**kwargs: Any) -> AsyncIterator[tuple[Communicator, Communicator]]:
    """Two TCP ranks that know each other's address and have not connected yet."""
    t0 = TcpTransport(0, 2, token=TOKEN, **kwargs)
    t1 = TcpTransport(1, 2, token=TOKEN, **kwargs)
    c0 = Communicator(t0, timeout=20.0, backend="tcp")
    c1 = Communicator(t1, timeout=20.0, backend="tcp")
    try:
        for t in (t0, t1):
            t.addresses[t.rank] = await t.listen("127.0.0.1", 0)
        t0.addresses[1] = t1.addresses[1]
        t1.addresses[0] = t0.addresses[0]
        yield c0, c1
    finally:
        await c0.close()
        await c1.close()


async def test_ranks_that_dial_each_other_at_once_keep_frames_in_order() -> None:
    """Both ranks dial at once: two connections. Same-tag messages, small and large (which
    go on different connections), arrive in the order they were sent, both ways."""
    async with _two_ranks() as (c0, c1):
        t0, t1 = c0.transport, c1.transport
        assert isinstance(t0, TcpTransport) and isinstance(t1, TcpTransport)
        await asyncio.gather(t0.connect(1), t1.connect(0))
        assert len(_connections(t0, 1)) == 2 and len(_connections(t1, 0)) == 2
        assert t1._pair[0] is not t1._out[0]

        async def stream(src: Communicator, dst: Communicator) -> None:
            n = 120
            sizes = [1 + (i * 7919) % 5000 if i % 3 else 20_000 + i for i in range(n)]
            sent = asyncio.gather(*(src.send(np.full(s, i, np.int32), dst=dst.rank, tag=3)
                                    for i, s in enumerate(sizes)))
            for i, s in enumerate(sizes):
                got = await dst.recv(src=src.rank, tag=3)
                assert got.shape == (s,) and (got == i).all()
            await sent

        await asyncio.gather(stream(c0, c1), stream(c1, c0))
        a, b = np.ones(1 << 16), np.full(1 << 16, 2.0)
        await asyncio.gather(c0.all_reduce(a), c1.all_reduce(b))
        assert (a == 3).all() and (b == 3).all()


async def test_a_rank_whose_lower_peer_never_dials_dials_it_itself() -> None:
    async with _two_ranks(handshake_timeout=0.3) as (c0, c1):
        t1 = c1.transport
        assert isinstance(t1, TcpTransport)
        start = time.monotonic()
        await t1.connect_peers([0])  # rank 0 never calls connect_peers
        assert 0.25 < time.monotonic() - start < 3.0
        assert t1._out[0].outgoing
        x, y = np.ones(8), np.ones(8)
        await asyncio.gather(c0.all_reduce(x), c1.all_reduce(y))
        assert (x == 2).all() and (y == 2).all()


async def test_connect_peers_fails_fast_and_leaves_nothing_running() -> None:
    """A peer above that cannot be reached fails start-up at once; the wait for the peer
    below is cancelled with it."""
    t = TcpTransport(1, 3, token=TOKEN, handshake_timeout=5.0)
    try:
        t.addresses[1] = await t.listen("127.0.0.1", 0)
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        t.addresses[2] = dead.getsockname()  # bound, not listening: refused
        dead.close()
        start = time.monotonic()
        with pytest.raises(PeerLostError):
            await t.connect_peers([0, 2])
        assert time.monotonic() - start < 2.0
        assert not t._arrivals
    finally:
        await t.close()


async def test_writes_on_an_accepted_connection_count_in_flushed() -> None:
    """The higher rank's small frames go on the connection it accepted; bytes waiting there
    for the event loop count in ``flushed`` as on a connection it dialled."""
    comms = await tcp_local_world(2, token=TOKEN)
    try:
        c0, c1 = comms
        t1 = c1.transport
        assert isinstance(t1, TcpTransport)
        piece = np.arange(30_000, dtype=np.uint8)  # small: on the accepted connection
        sent = asyncio.gather(*(c1.send(piece, 0) for _ in range(600)))
        await settle_until(lambda: not t1.flushed())  # more than the socket buffers hold
        assert t1._pair[0]._paused and 0 not in t1._out
        for _ in range(600):
            np.testing.assert_array_equal(await c0.recv(1), piece)
        await sent
        await settle_until(t1.flushed)
    finally:
        for c in comms:
            await c.close()


class _FakeTransport:
    """Enough of an asyncio transport for a ``_Connection`` driven by hand."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close


def _feed(conn: _Connection, data: bytes) -> None:
    while data:
        buf = conn.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


def _frames(raw: bytearray) -> list[Frame]:
    decoder = FrameDecoder(max_payload=1 << 20)
    decoder.feed(bytes(raw))
    raw.clear()
    frames = []
    while isinstance(frame := decoder.next_frame(), Frame):
        frames.append(frame)
    return frames


async def test_frames_right_behind_the_welcome_are_read_as_an_established_connections() -> None:
    """The side that accepted a connection may send on it as soon as it sent WELCOME; the
    dialler may then read WELCOME and those frames at once, and must read the frames with
    the payload limit and sink of an established connection (not the handshake's)."""
    t = TcpTransport(0, 2, token=TOKEN)
    try:
        conn = _Connection(t, dst=1)
        fake = _FakeTransport()
        conn.connection_made(fake)
        server = ServerHandshake(TOKEN)
        (hello,) = _frames(fake.written)
        challenge = server.on_hello(hello)
        _feed(conn, encode_frame_bytes(challenge))
        (proof,) = _frames(fake.written)
        welcome = server.on_proof(proof)
        assert welcome.kind == FrameKind.WELCOME
        payload = np.arange(6, dtype=np.float32)
        header = FrameHeader(group=0, seq=0, step=0, src=1, tag=9, dtype="<f4", shape=(6,))
        data = Frame(FrameKind.P2P, header, payload.tobytes())
        _feed(conn, encode_frame_bytes(welcome) + encode_frame_bytes(data) * 2)
        assert conn.authenticated and not fake.closing
        key = frame_key(FrameKind.P2P, header)
        got = t.mailbox.take(key, None)
        assert got is not None
        np.testing.assert_array_equal(np.frombuffer(got.payload, np.float32), payload)
    finally:
        await t.close()


@pytest.mark.parametrize("world_size", range(1, 70))
def test_startup_peers_are_symmetric(world_size: int) -> None:
    """A rank waits for the peers below it that it expects to dial it: every pair must agree,
    or start-up waits out the handshake timeout."""
    w = world_size
    peers = [set(startup_peers(r, w)) for r in range(w)]
    for r in range(w):
        assert r not in peers[r] and all(0 <= p < w for p in peers[r])
        for p in peers[r]:
            assert r in peers[p]
        if w <= MESH_RANKS:
            assert peers[r] == set(range(w)) - {r}
        else:
            assert {(r + 1) % w, (r - 1) % w} <= peers[r]
            assert len(peers[r]) <= 4 * w.bit_length()


async def test_a_world_beyond_the_mesh_connects_other_pairs_on_first_use() -> None:
    """Above MESH_RANKS a world connects only the pairs its algorithms use at start-up;
    any other pair connects when it first exchanges frames, in either order, and messages
    that start on one connection and go on over another still arrive in order."""
    w = MESH_RANKS + 2
    comms = await tcp_local_world(w, token=TOKEN, timeout=60.0)
    try:
        ts = [c.transport for c in comms]
        hi, lo = next((h, low) for h in range(w - 1, 0, -1) for low in range(h)
                      if low not in startup_peers(h, w))
        assert not _connections(ts[hi], lo)  # type: ignore[arg-type]
        x = [np.full(1000, float(r)) for r in range(w)]
        await asyncio.gather(*(c.all_reduce(a) for c, a in zip(comms, x, strict=True)))
        assert all((a == sum(range(w))).all() for a in x)
        await asyncio.gather(*(c.barrier() for c in comms))
        # the higher rank sends first (on a connection it dials), then the lower one (which
        # dials its own; the higher rank's later small frames go on that one)
        first = [np.full(10, i) for i in range(5)]
        await asyncio.gather(*(comms[hi].send(a, lo, tag=4) for a in first))
        await comms[lo].send(np.arange(3), hi, tag=4)
        np.testing.assert_array_equal(await comms[hi].recv(lo, tag=4), np.arange(3))
        await settle_until(lambda: lo in ts[hi]._pair)  # type: ignore[attr-defined]
        later = [np.full(10, i) for i in range(5, 10)]
        await asyncio.gather(*(comms[hi].send(a, lo, tag=4) for a in later))
        for i in range(10):
            np.testing.assert_array_equal(await comms[lo].recv(hi, tag=4), np.full(10, i))
    finally:
        for c in comms:
            await c.close()
