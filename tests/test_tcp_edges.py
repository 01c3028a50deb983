"""The TCP data path at its edges: real loopback worlds, every result compared exactly.

Collectives of different sizes run back to back without awaiting in between, on the world
and on subgroups that share its connections; sizes sit on the thresholds the readers and
writers switch at (and one byte either side); uneven blocks mix tiny and large; messages
with many tags interleave with collectives; a peer lags in the middle of a batch so that
direct reads hand frames back; crowded worlds; sequence numbers and tags at every msgpack
width; one collective cancelled beside another, then the world closed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import asynccoll
from asynccoll import CollectiveError, Communicator
from asynccoll.transport import tcp as tcp_module
from asynccoll.transport.tcp import (
    PAIR_FRAME_BYTES,
    POOLED_PAYLOAD_BYTES,
    SMALL_WRITE_BYTES,
    tcp_local_world,
)
from asynccoll.tuning import Tuning
from asynccoll.wire import BufferedFrameReader

_T = Tuning()
#: payload sizes (bytes) where the TCP path changes behaviour, and one byte either side
EDGES = sorted({max(0, e + d) for e in (0, SMALL_WRITE_BYTES, PAIR_FRAME_BYTES,
                                         POOLED_PAYLOAD_BYTES, _T.poll_max_bytes,
                                         _T.small_bytes, BufferedFrameReader.STAGE_BYTES)
                for d in (-1, 0, 1)})


def data(tag: Any, rank: int, n: int, dtype: Any = np.uint8) -> np.ndarray:
    """Deterministic data of rank ``rank`` for call ``tag``: any rank can rebuild it."""
    rng = np.random.default_rng([hash(tag) & 0xFFFFFFFF, rank, n])
    return rng.integers(0, 200, n).astype(dtype)


async def groups(comm: Communicator) -> list[tuple[Communicator | None, list[int]]]:
    """The world, its reverse and a subgroup of every other rank from the top."""
    w = comm.world_size
    out: list[tuple[Communicator | None, list[int]]] = [(comm, list(range(w)))]
    for members in (list(range(w))[::-1], list(range(w - 1, -1, -2))):
        out.append((await comm.new_group(members), members))
    return out


async def check_op(kind: str, sub: Communicator, members: list[int], tag: Any, n: int) -> None:
    """Run one collective of ``n`` bytes per rank on ``sub``, compare with NumPy."""
    w, r = sub.world_size, sub.rank
    if kind == "all_reduce":  # uint8 sums wrap the same way in NumPy
        a = data(tag, r, n)
        exp = np.sum([data(tag, j, n) for j in range(w)], axis=0, dtype=np.uint8)
        np.testing.assert_array_equal(await sub.all_reduce(a), exp)
    elif kind == "all_gather":
        got = await sub.all_gather(data(tag, r, n))
        np.testing.assert_array_equal(got, np.concatenate([data(tag, j, n) for j in range(w)]))
    elif kind == "broadcast":
        a = data(tag, r, n)
        await sub.broadcast(a, root=w - 1)
        np.testing.assert_array_equal(a, data(tag, w - 1, n))
    elif kind == "reduce_scatter":
        rows = max(1, n // 8)
        tot = np.sum([data(tag, j, rows, np.int64) for j in range(w)], axis=0)
        got = await sub.reduce_scatter(data(tag, r, rows, np.int64))
        np.testing.assert_array_equal(got, np.array_split(tot, w)[r])
    elif kind == "reduce":
        a = data(tag, r, n // 8, np.int64)
        got = await sub.reduce(a, root=0)
        if r == 0:
            np.testing.assert_array_equal(
                got, np.sum([data(tag, j, n // 8, np.int64) for j in range(w)], axis=0))
    else:
        raise AssertionError(kind)


KINDS = ["all_reduce", "all_gather", "broadcast", "reduce_scatter", "reduce"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world_size", "crowded"), [(2, False), (3, False), (5, True)])
async def test_threshold_sizes_interleaved_on_shared_connections(
        world_size: int, crowded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if crowded:  # more ranks than cores: own connections, yielding polls, larger segments
        monkeypatch.setenv("ASYNCCOLL_LOCAL_WORLD_SIZE", "64")

    async def fn(comm: Communicator) -> None:
        subs = await groups(comm)
        for i, n in enumerate(EDGES):
            # five collectives on three groups sharing the connections, none awaited alone
            await asyncio.gather(*(
                check_op(kind, *subs[(i + k) % len(subs)], (i, k), n)
                for k, kind in enumerate(KINDS) if subs[(i + k) % len(subs)][0] is not None))

    await asynccoll.run_local(fn, world_size, "tcp", timeout=20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
async def test_direct_all_gather_around_a_whole_frame_read(
        world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames of HEAD_READ_BYTES in all are read head and payload at once by take_direct,
    one byte more in two parts: blocks on both sides of the boundary, into a reused out=."""
    totals: list[int] = []
    init = tcp_module._Direct.__init__

    def spy(self: Any, index: int, conn: Any, key: Any, head: bytes, into: memoryview) -> None:
        totals.append(len(head) + into.nbytes)
        init(self, index, conn, key, head, into)

    monkeypatch.setattr(tcp_module._Direct, "__init__", spy)

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        outs: dict[int, np.ndarray] = {}
        for n in range(3990, 4070):
            for rep in range(2):
                out = outs.setdefault(n, np.empty(w * n, np.uint8))
                got = await comm.all_gather(data((n, rep), r, n), out=out)
                assert got is out
                np.testing.assert_array_equal(
                    got, np.concatenate([data((n, rep), j, n) for j in range(w)]))

    await asynccoll.run_local(fn, world_size, "tcp", timeout=20)
    limit = BufferedFrameReader.HEAD_READ_BYTES
    assert {limit - 1, limit, limit + 1} <= set(totals)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [3, 6])
async def test_uneven_blocks_p2p_tags_and_a_lagging_peer(world_size: int) -> None:
    """Uneven all_gather (into a reused out=, including a rank whose length is the mean, so
    out is split evenly on it), all_to_all of tiny and large blocks and messages on several
    tags, all at once; one rank lags between launching them (its peers' direct reads give
    up and hand frames back to the event loop)."""
    sizes = [0, 1, 4000, PAIR_FRAME_BYTES + 1, 70_000, 300_000]

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        outs: dict[int, np.ndarray] = {}
        for it in range(6):
            rows = [(j + it) % 3 + 1 for j in range(w)]  # lengths 1, 2, 3: 2 is the mean
            width = sizes[(it + 3) % len(sizes)] // 3 + 1
            mine = data(("ag", it), r, rows[r] * width).reshape(rows[r], width)
            out = outs.setdefault(width, np.empty((sum(rows), width), np.uint8))
            lens = [[sizes[(i * 7 + j * 3 + it) % len(sizes)] for j in range(w)]
                    for i in range(w)]
            dst, src = (r + 1) % w, (r - 1) % w
            tags = [it, 7, 1 << 40, 7]
            ops: list[Any] = [comm.all_gather(mine, out=out)]
            ops += [comm.send(data(("p", it, k), r, sizes[(k + it) % len(sizes)]), dst, tag=t)
                    for k, t in enumerate(tags)]
            tasks = [asyncio.ensure_future(op) for op in ops]
            if r == it % w:
                await asyncio.sleep(0.003)
            tasks.append(asyncio.ensure_future(comm.all_to_all(
                [data(("a2a", it, j), r, lens[r][j]) for j in range(w)])))
            tasks += [asyncio.ensure_future(comm.recv(src, tag=t)) for t in tags]
            got = await asyncio.gather(*tasks)
            np.testing.assert_array_equal(got[0], np.concatenate(
                [data(("ag", it), j, rows[j] * width).reshape(rows[j], width)
                 for j in range(w)]))
            for j, block in enumerate(got[len(ops)]):
                np.testing.assert_array_equal(block, data(("a2a", it, r), j, lens[j][r]))
            for k, msg in enumerate(got[len(ops) + 1:]):
                np.testing.assert_array_equal(
                    msg, data(("p", it, k), src, sizes[(k + it) % len(sizes)]))

    await asynccoll.run_local(fn, world_size, "tcp", timeout=20)


@pytest.mark.timeout(60)
async def test_eight_crowded_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 ranks on 2 cores' worth of settings: ring all_gather, 4 MiB segments, direct
    rings, doubling with folded ranks, subgroups of odd sizes."""
    monkeypatch.setenv("ASYNCCOLL_LOCAL_WORLD_SIZE", "64")

    async def fn(comm: Communicator) -> None:
        subs = await groups(comm)
        for i, n in enumerate([1, 4096, PAIR_FRAME_BYTES + 1, _T.small_bytes + 1,
                               (1 << 20) + 8, 3 << 20]):
            await asyncio.gather(*(
                check_op(kind, *subs[(i + k) % len(subs)], (i, k), n)
                for k, kind in enumerate(KINDS) if subs[(i + k) % len(subs)][0] is not None))

    await asynccoll.run_local(fn, 8, "tcp", timeout=20)


@pytest.mark.timeout(60)
async def test_sequence_numbers_and_tags_at_every_msgpack_width() -> None:
    """Heads are predicted byte for byte (HeadCache, take_direct, take_staged): sequence
    numbers and tags crossing 7, 8, 16, 32 and 64-bit encodings still match."""

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        for seq in (126, 254, 65534, (1 << 32) - 2, (1 << 63) - 4):
            comm._seq = seq  # every rank alike
            for i in range(3):
                for n in (0, 8, 4000, 40_000, 200_000):
                    await check_op(KINDS[i], comm, list(range(w)), (seq, i, n), n)
                await comm.barrier()
        dst, src = (r + 1) % w, (r - 1) % w
        for tag in (127, 128, 65536, 1 << 32, (1 << 63) - 1):
            comm._p2p_sent[dst] = comm._p2p_next[src] = 254
            for k in range(3):
                got, _ = await asyncio.gather(
                    comm.recv(src, tag=tag),
                    comm.send(data((tag, k), r, 20_000 * k), dst, tag=tag))
                np.testing.assert_array_equal(got, data((tag, k), src, 20_000 * k))

    await asynccoll.run_local(fn, 3, "tcp", timeout=20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [10, 5000, 300_000])
@pytest.mark.parametrize("delay", [0.0, 0.002])
async def test_cancelling_the_later_of_two_collectives_then_closing(n: int,
                                                                    delay: float) -> None:
    """Rank 0 cancels the second of two collectives in flight: the first still completes
    with exact data everywhere; the second raises CancelledError there and CollectiveError
    on the others, promptly; then rank 0 closes and the others' next call fails at once."""
    w = 3
    comms = await tcp_local_world(w, timeout=20)
    start = time.monotonic()

    async def rank(c: Communicator) -> tuple[str, float]:
        a = data("a", c.rank, n)
        b = np.full(n, c.rank + 1, np.int64)
        first = asyncio.ensure_future(c.all_gather(a))
        second = asyncio.ensure_future(c.all_reduce(b))
        if c.rank == 0:
            await asyncio.sleep(delay)
            second.cancel()
        got, late = await asyncio.gather(first, second, return_exceptions=True)
        np.testing.assert_array_equal(got, np.concatenate([data("a", j, n) for j in range(w)]))
        if c.rank == 0:
            if not isinstance(late, asyncio.CancelledError):  # it finished before the cancel
                np.testing.assert_array_equal(late, np.full(n, 6))
            await c.close()
            return "closed", 0.0
        if isinstance(late, BaseException):
            assert isinstance(late, CollectiveError), repr(late)
        with pytest.raises(CollectiveError):
            await c.all_reduce(np.ones(4))
        return type(late).__name__, time.monotonic() - start

    try:
        outcomes = await asyncio.gather(*(rank(c) for c in comms))
    finally:
        for c in comms:
            await c.close()
    assert all(seconds < 5 for _, seconds in outcomes), outcomes


async def test_an_array_larger_than_one_frame_fails_on_the_sender_too() -> None:
    """An array that a call would send whole in one frame larger than ``max_payload`` (4 GiB
    by default; 1 MiB here) is refused where it is sent: ``send`` raises ValueError before
    anything is sent and the communicator stays usable; a collective raises ValueError on the
    sending rank and CollectiveError on the others. The frame used to go out: the receiver
    dropped the connection as a protocol violation (PeerLostError, 'sent an invalid frame')
    while the root of a scatter returned as if it had succeeded. (A broadcast, which took
    the tree between 2 ranks and sent the array whole, now takes the chain: segments.)"""
    big = np.ones((3 << 20) // 8)  # 3 MiB
    small = np.ones(4)
    calls = {
        "scatter": lambda c, a: c.scatter([a, a] if c.rank == 0 else None),
        "gather": lambda c, a: c.gather(a),
        "all_gather": lambda c, a: c.all_gather(a),
        "all_to_all": lambda c, a: c.all_to_all([a, a]),
    }

    async def p2p(comm: Communicator) -> None:
        if comm.rank == 0:
            sent = comm.transport.bytes_sent
            with pytest.raises(ValueError, match="max_payload"):
                await comm.send(big, 1)
            assert comm.transport.bytes_sent == sent
            await comm.send(small, 1)
        else:
            np.testing.assert_array_equal(await comm.recv(0), small)
        # segmented collectives carry arrays of any size
        np.testing.assert_array_equal(await comm.all_reduce(big.copy()), big * 2)
        got = await comm.broadcast(big.copy() if comm.rank == 0 else np.zeros_like(big))
        np.testing.assert_array_equal(got, big)

    await asynccoll.run_local(p2p, 2, "tcp", timeout=10, max_payload=1 << 20)
    for name, call in calls.items():
        async def fn(comm: Communicator, call: Any = call) -> str:
            try:
                await call(comm, big)
            except ValueError as exc:
                assert "max_payload" in str(exc)
                return "ValueError"
            except CollectiveError as exc:
                assert "max_payload" in str(exc), exc
                return "CollectiveError"
            return "returned"

        got = await asynccoll.run_local(fn, 2, "tcp", timeout=10, max_payload=1 << 20)
        assert "ValueError" in got and "returned" not in got, (name, got)
