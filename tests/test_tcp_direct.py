"""Frames read straight off the wire (``TcpTransport.take_direct``, the direct all_gather).

A frame whose bytes are exactly the head the receiver expects, followed by its payload, is
read into the receiver's array without the mailbox; anything else (another frame first, a
different shape, what is not there in time, half a frame) is handed back to the
connection's reader and completes the usual way. The unit tests below drive one connection
of a real two-rank world through a socket pair the test writes to by hand.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from helpers.all_gather_check import counting
from numpy.testing import assert_array_equal

from asynccoll import CollectiveError, Communicator, ReduceOp, Tuning
from asynccoll.algorithms import Call, bytes_view
from asynccoll.transport import tcp as tcp_module
from asynccoll.transport.tcp import TcpTransport, _Connection, tcp_local_world
from asynccoll.wire import FrameKind, dtype_code

DATA = int(FrameKind.DATA)
SIG = ("all_gather", "<f4", (), "direct")
SEQ = 10_000  # far from the sequence numbers of the world's own collectives


class Wire:
    """Rank 1's connection from rank 0, its direct reads rerouted to a socket pair whose
    other end (``feed``) the test writes rank 0's frames into (at most ~64 KiB ahead of the
    reads, well within a socket pair's buffer, so that the writes never block)."""

    def __init__(self, comms: list[Communicator]) -> None:
        t = comms[1].transport
        assert isinstance(t, TcpTransport)
        self.t = t
        (conn,) = [c for c in t._open if c.peer == 0 and c.authenticated and not c.closed]
        self.conn: _Connection = conn
        self.saved = (conn.raw, t._in.get(0), t._in_large.get(0))
        mine, self.feed = socket.socketpair()
        mine.setblocking(False)
        conn.raw = mine
        t._in[0] = t._in_large[0] = conn
        self.heads = comms[0].transport.heads  # rank 0's encoder: the bytes it would send

    def head(self, shape: tuple[int, ...], *, step: int = 0, seq: int = SEQ) -> bytes:
        nbytes = int(np.prod(shape)) * 4
        return self.heads.data_head(DATA, 0, seq, step, 0, 0, dtype_code(np.dtype(np.float32)),
                                    shape, SIG, nbytes)

    def want(self, into: np.ndarray, *, step: int = 0) -> tuple[Any, bytes, memoryview]:
        """What rank 1's ``Call.take_direct`` would pass for a frame into ``into``."""
        key = (0, DATA, 0, SEQ, step, 0)
        head = self.t.heads.data_head(DATA, 0, SEQ, step, 0, 0, dtype_code(into.dtype),
                                      into.shape, SIG, into.nbytes)
        return key, head, bytes_view(into)

    def frame(self, data: np.ndarray, *, step: int = 0) -> bytes:
        return self.head(data.shape, step=step) + data.tobytes()

    async def pump_until(self, fut: asyncio.Future[Any]) -> Any:
        """Read the socket pair (as a polled receive does) until ``fut`` resolves."""
        for _ in range(2000):
            if fut.done():
                return fut.result()
            self.t.pump(0, 1 << 20)
            await asyncio.sleep(0.001)
        raise AssertionError("the handed-back receive never completed")

    def restore(self) -> None:
        raw, small, large = self.saved
        assert self.conn.raw is not None
        self.conn.raw.close()
        self.feed.close()
        self.conn.raw = raw
        for table, conn in ((self.t._in, small), (self.t._in_large, large)):
            if conn is None:
                table.pop(0, None)
            else:
                table[0] = conn


@pytest.fixture
async def wire() -> AsyncIterator[Wire]:
    comms = await tcp_local_world(2)
    w = Wire(comms)
    try:
        yield w
    finally:
        w.restore()
        await asyncio.gather(*(c.close() for c in comms))


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


#: a frame read head first, then its payload straight into the array; and one small enough
#: to be read whole in one go (``_Direct.whole``) and its payload copied over
SIZES = [12_000, 500]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", SIZES)
async def test_an_expected_frame_lands_without_the_mailbox(wire: Wire, n: int) -> None:
    data = _data(n, 1)
    wire.feed.sendall(wire.frame(data))
    into = np.zeros_like(data)
    (got,) = await wire.t.take_direct([wire.want(into)], SIG, 0.5)
    assert got is None
    assert_array_equal(into, data)
    assert wire.conn.reader.idle
    assert not wire.t.mailbox._posted and not wire.t.mailbox._early


@pytest.mark.timeout(30)
async def test_an_empty_payload(wire: Wire) -> None:
    """A frame of 0 bytes (an all_gather block of no rows) is whole with its head."""
    wire.feed.sendall(wire.frame(np.zeros(0, np.float32)))
    (got,) = await wire.t.take_direct([wire.want(np.zeros(0, np.float32))], SIG, 0.5)
    assert got is None
    assert wire.conn.reader.idle


@pytest.mark.timeout(30)
async def test_two_frames_on_one_connection(wire: Wire) -> None:
    """Frames awaited from one connection are read one at a time: the first directly, the
    second the usual way (here it arrives first: the direct read hands it to the reader,
    which gives it to its receive)."""
    first, second = _data(3000, 2), _data(2000, 9)
    wire.feed.sendall(wire.frame(second, step=1) + wire.frame(first, step=0))
    into, into2 = np.zeros_like(first), np.zeros_like(second)
    got = await wire.t.take_direct([wire.want(into), wire.want(into2, step=1)], SIG, 0.5)
    assert got[1] is not None
    for fut in got:
        if fut is not None:
            await wire.pump_until(fut)
    assert_array_equal(into, first)
    assert_array_equal(into2, second)
    assert wire.conn.reader.idle


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cut", [7, 40, "head", "half"])
async def test_half_a_frame_goes_back_to_the_reader(wire: Wire, cut: Any, n: int) -> None:
    """What is not there in time is handed back mid-head or mid-payload: the reader takes
    over where the direct reads stopped, and the rest of the frame completes the posted
    receive, into the same array."""
    data = _data(n, 3)
    raw = wire.frame(data)
    head_len = len(wire.head(data.shape))
    split = {"head": head_len, "half": head_len + data.nbytes // 2}.get(cut, cut)
    assert isinstance(split, int)
    wire.feed.sendall(raw[:split])
    into = np.zeros_like(data)
    (fut,) = await wire.t.take_direct([wire.want(into)], SIG, 0.02)
    assert fut is not None and not fut.done()
    assert not wire.conn.reader.idle  # the reader holds the part read
    wire.feed.sendall(raw[split:])
    frame = await wire.pump_until(fut)
    assert frame.payload is not None
    assert_array_equal(into, data)  # read into the array, by the direct reads and the reader
    assert wire.conn.reader.idle


@pytest.mark.timeout(30)
async def test_a_world_that_breaks_mid_frame_keeps_the_stream(
        wire: Wire, monkeypatch: pytest.MonkeyPatch) -> None:
    """The world breaks while half a payload was read directly: the receive handed back
    fails, and the bytes still go to the reader, so the rest of that frame and the frames
    behind it are read in step (no protocol error, the connection stays up)."""
    data = _data(12_000, 10)
    raw = wire.frame(data)
    half = len(raw) // 2
    wire.feed.sendall(raw[:half])
    read = tcp_module._Direct.read

    def read_then_break(self: Any) -> object:
        got = read(self)
        if self.payload_got and wire.t.mailbox.error is None:
            wire.t.mailbox.fail(CollectiveError("broken on purpose"))
        return got

    monkeypatch.setattr(tcp_module._Direct, "read", read_then_break)
    into = np.zeros_like(data)
    (fut,) = await wire.t.take_direct([wire.want(into)], SIG, 0.02)
    assert fut is not None and fut.done()
    with pytest.raises(CollectiveError, match="broken on purpose"):
        fut.result()
    wire.feed.sendall(raw[half:] + wire.frame(_data(10, 11), step=1))
    for _ in range(200):
        wire.t.pump(0, 1 << 20)
        if wire.conn.reader.idle:
            break
        await asyncio.sleep(0.001)
    assert wire.conn.reader.idle and not wire.conn.closed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n", SIZES)
async def test_another_frame_first(wire: Wire, n: int) -> None:
    """A frame other than the expected one (here the next step's) is not taken: its bytes
    go to the reader, it reaches the mailbox as an early frame, and the expected one behind
    it completes the receive handed back."""
    first, second = _data(n, 4), _data(n, 5)
    wire.feed.sendall(wire.frame(first, step=1) + wire.frame(second, step=0))
    into = np.zeros_like(second)
    (fut,) = await wire.t.take_direct([wire.want(into)], SIG, 0.5)
    assert fut is not None
    await wire.pump_until(fut)
    assert_array_equal(into, second)
    early = wire.t.mailbox.take((0, DATA, 0, SEQ, 1, 0), None)
    assert early is not None
    assert_array_equal(np.frombuffer(early.payload, np.float32), first)


@pytest.mark.timeout(30)
async def test_a_block_of_another_shape_goes_the_usual_way(wire: Wire) -> None:
    """An all_gather block with more rows than expected: the head differs, and the usual
    receive gets the frame with its own payload (the caller resizes)."""
    data = _data(5000, 6)
    wire.feed.sendall(wire.frame(data))
    into = np.zeros(4000, np.float32)
    (fut,) = await wire.t.take_direct([wire.want(into)], SIG, 0.5)
    assert fut is not None
    frame = await wire.pump_until(fut)
    assert frame.header.shape == (5000,)
    assert_array_equal(np.frombuffer(frame.payload, np.float32), data)
    assert not into.any()


@pytest.mark.timeout(30)
async def test_nothing_there_posts_the_receive(wire: Wire) -> None:
    into = np.zeros(100, np.float32)
    (fut,) = await wire.t.take_direct([wire.want(into)], SIG, 0.001)
    assert fut is not None and not fut.done()
    assert wire.t.mailbox.waiting((0, DATA, 0, SEQ, 0, 0))
    data = _data(100, 7)
    wire.feed.sendall(wire.frame(data))
    await wire.pump_until(fut)
    assert_array_equal(into, data)


@pytest.mark.timeout(30)
async def test_a_frame_already_read_by_the_event_loop(wire: Wire) -> None:
    """A frame the mailbox holds already (read by the event loop) is not looked for on the
    wire: the posted receive takes it."""
    data = _data(1000, 8)
    wire.feed.sendall(wire.frame(data))
    for _ in range(100):
        wire.t.pump(0, 4000)
        if wire.t.mailbox._early:
            break
        await asyncio.sleep(0.001)
    into = np.zeros_like(data)
    (fut,) = await wire.t.take_direct([wire.want(into)], SIG, 0.5)
    assert fut is not None and fut.done()
    assert_array_equal(into, data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6])
async def test_all_gather_reads_blocks_directly(world_size: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The all_gather over TCP, direct (up to 4 ranks) or along the ring (beyond), takes
    blocks straight off the wire (some of them: in one event loop a rank may find its peers'
    frames read by the loop already) and gathers exactly, uneven blocks included."""
    direct = [0, 0]  # frames read directly, frames received the usual way
    monkeypatch.setattr(Call, "take_direct", counting(direct))
    comms = await tcp_local_world(world_size)
    try:
        async def fn(comm: Communicator) -> list[np.ndarray]:
            r = comm.rank
            out = []
            for i in range(20):
                rows = 3000 + (r * 7 if i % 5 == 4 else 0)  # every fifth call uneven
                out.append(await comm.all_gather(np.full(rows, r * 100 + i, np.float32)))
            return out

        results = await asyncio.gather(*(fn(c) for c in comms))
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    for per_rank in results:
        for i, got in enumerate(per_rank):
            expect = np.concatenate([
                np.full(3000 + (r * 7 if i % 5 == 4 else 0), r * 100 + i, np.float32)
                for r in range(world_size)])
            assert_array_equal(got, expect)
    assert direct[0] > 0, direct
    assert sum(direct) == 20 * world_size * (world_size - 1)


RING_CASES = [(np.float64, ReduceOp.SUM, 20_001), (np.float32, ReduceOp.MAX, 50_001),
              (np.int64, ReduceOp.SUM, 16_385), (np.float64, ReduceOp.AVG, 100_000),
              (np.int32, ReduceOp.MIN, 40_000)]


def ring_input(rank: int, i: int, dtype: Any, n: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * i + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


async def ring_all_reduces(comms: list[Communicator]) -> list[list[np.ndarray]]:
    async def fn(comm: Communicator) -> list[np.ndarray]:
        return [await comm.all_reduce(ring_input(comm.rank, i, dtype, n), op)
                for i, (dtype, op, n) in enumerate(RING_CASES)]

    try:
        return list(await asyncio.gather(*(fn(c) for c in comms)))
    finally:
        await asyncio.gather(*(c.close() for c in comms))


def check_ring_results(results: list[list[np.ndarray]]) -> None:
    w = len(results)
    for i, (dtype, op, n) in enumerate(RING_CASES):
        xs = np.stack([ring_input(r, i, dtype, n) for r in range(w)])
        expect = {ReduceOp.SUM: xs.sum(0), ReduceOp.MAX: xs.max(0), ReduceOp.MIN: xs.min(0),
                  ReduceOp.AVG: xs.sum(0) / w}[op]
        for r in range(w):
            assert results[r][i].tobytes() == results[0][i].tobytes(), \
                f"case {i}: ranks 0 and {r} differ"
        np.testing.assert_allclose(results[0][i], expect, rtol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_ring_all_reduce_reads_its_blocks_directly(
        world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An all_reduce above small_bytes whose ring blocks are one frame each reads every
    step's block straight off the wire (direct_ring): exact, bit-identical on all
    ranks, odd lengths (uneven blocks) and several dtypes and ops included."""
    direct = [0, 0]  # frames read directly, frames received the usual way
    monkeypatch.setattr(Call, "take_direct", counting(direct))
    check_ring_results(await ring_all_reduces(await tcp_local_world(world_size)))
    # every rank, every case, 2(W-1) steps
    assert sum(direct) == world_size * len(RING_CASES) * 2 * (world_size - 1)
    assert direct[0] > 0, direct


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
async def test_direct_ring_pairs_with_the_ring(world_size: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same frames as the ring's: a rank that does not poll (so runs the ring, posting
    its receives) and ranks that read directly reduce together; where the ring would cut the
    blocks into several segments, no rank takes the direct path."""
    direct = [0, 0]
    monkeypatch.setattr(Call, "take_direct", counting(direct))
    comms = await tcp_local_world(world_size)
    comms[0].tuning = Tuning(poll_us=0)
    check_ring_results(await ring_all_reduces(comms))
    assert sum(direct) == (world_size - 1) * len(RING_CASES) * 2 * (world_size - 1)
    direct[:] = [0, 0]
    comms = await tcp_local_world(world_size)
    for c in comms:
        c.tuning = Tuning(segment_bytes=16 << 10, min_segment_bytes=16 << 10)
    check_ring_results(await ring_all_reduces(comms))
    assert direct == [0, 0]


RS_CASES = [((20_001,), np.float64, ReduceOp.SUM), ((19_999, 3), np.float32, ReduceOp.MAX),
            ((16_387,), np.int64, ReduceOp.SUM), ((40_000, 2), np.float64, ReduceOp.AVG)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_ring_reduce_scatter_reads_its_blocks_directly(
        world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reduce_scatter above small_bytes whose ring blocks are one frame each reads every
    step's partial sum straight off the wire (direct_ring): each rank gets
    its rows of the reduction exactly (uneven rows, rows of several elements, several dtypes
    and ops), and a rank that does not poll (running the ring) pairs with those that do."""
    direct = [0, 0]  # frames read directly, frames received the usual way
    monkeypatch.setattr(Call, "take_direct", counting(direct))

    def data(rank: int, i: int) -> np.ndarray:
        shape, dtype, _ = RS_CASES[i]
        return ring_input(rank, i, dtype, int(np.prod(shape))).reshape(shape)

    async def fn(comm: Communicator) -> list[np.ndarray]:
        return [await comm.reduce_scatter(data(comm.rank, i), op)
                for i, (_, _, op) in enumerate(RS_CASES)]

    for slow in (False, True):
        comms = await tcp_local_world(world_size)
        if slow:
            comms[0].tuning = Tuning(poll_us=0)
        try:
            results = await asyncio.gather(*(fn(c) for c in comms))
        finally:
            await asyncio.gather(*(c.close() for c in comms))
        for i, (_, _, op) in enumerate(RS_CASES):
            xs = np.stack([data(r, i) for r in range(world_size)])
            full = {ReduceOp.SUM: xs.sum(0), ReduceOp.MAX: xs.max(0),
                    ReduceOp.AVG: xs.sum(0) / world_size}[op]
            for r, part in enumerate(np.array_split(full, world_size)):
                np.testing.assert_allclose(results[r][i], part, rtol=1e-5)
        readers = world_size - 1 if slow else world_size
        assert sum(direct) == readers * len(RS_CASES) * (world_size - 1)
        assert direct[0] > 0, direct
        direct[:] = [0, 0]
