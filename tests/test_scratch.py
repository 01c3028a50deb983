"""ScratchPool (asynccoll.scratch) and the mailbox's use of it for early payloads."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from asynccoll.errors import CollectiveError
from asynccoll.scratch import LIMIT_BUFFERS, ScratchPool
from asynccoll.transport.base import Mailbox, frame_key
from asynccoll.wire import Frame, FrameHeader, FrameKind

F4 = np.dtype(np.float32)
U1 = np.dtype(np.uint8)


def test_take_gives_an_array_of_the_size_and_type_asked() -> None:
    pool = ScratchPool()
    arr = pool.take(1000, F4)
    assert arr.shape == (1000,) and arr.dtype == F4 and arr.flags.writeable
    assert arr.ctypes.data % 16 == 0
    assert pool.take(0, F4).shape == (0,)


def test_given_back_memory_is_reused_for_a_similar_size_only() -> None:
    pool = ScratchPool()
    a = pool.take(1 << 20, U1)
    owner = a.base
    pool.give(a)
    assert pool.kept == 1 << 20
    b = pool.take(600_000, U1)  # within twice the size: the same memory
    assert b.base is owner and pool.kept == 0
    pool.give(b)
    small = pool.take(1000, U1)  # a tiny request does not take a large buffer
    assert small.base is not owner and pool.kept == 1 << 20
    big = pool.take(2 << 20, U1)  # nor does a larger one fit in it
    assert big.base is not owner


def test_best_fit_among_free_buffers() -> None:
    pool = ScratchPool()
    taken = [pool.take(n, U1) for n in (4000, 3000, 5000)]
    owners = [t.base for t in taken]
    for t in taken:
        pool.give(t)
    assert pool.take(2900, U1).base is owners[1]
    assert pool.take(2900, U1).base is owners[0]


def test_limits_free_the_smallest_buffers_first() -> None:
    pool = ScratchPool(limit=10_000)
    a, b, c = pool.take(6000, U1), pool.take(3000, U1), pool.take(2000, U1)
    pool.give(a)
    pool.give(b)
    pool.give(c)  # 11000 > 10000: the smallest (2000) goes
    assert sorted(buf.nbytes for buf in pool._free) == [3000, 6000]
    huge = pool.take(20_000, U1)
    pool.give(huge)  # above the limit on its own: freed, not kept
    assert pool.kept == 9000
    many = ScratchPool()
    arrays = [many.take(100 + i, U1) for i in range(LIMIT_BUFFERS + 5)]
    for arr in arrays:
        many.give(arr)
    assert len(many._free) == LIMIT_BUFFERS
    many.clear()
    assert many.kept == 0


def test_only_arrays_it_lent_go_back() -> None:
    pool = ScratchPool()
    mine = pool.take(100, F4)
    with pytest.raises(ValueError, match="only arrays that take"):
        pool.give(np.empty(100, np.uint8)[:40].view(F4))  # looks alike, is not ours
    with pytest.raises(ValueError, match="only arrays that take"):
        pool.give(mine[:50])  # a slice of ours: its owner is still in use
    pool.give(mine)
    with pytest.raises(ValueError, match="once"):
        pool.give(mine)
    # reclaim: the same rule, silently
    other = pool.take(100, F4)
    assert not pool.reclaim(memoryview(other[:10]))
    assert not pool.reclaim(np.empty(100, np.float32))
    assert not pool.reclaim(b"bytes")
    assert pool.reclaim(memoryview(other))
    assert not pool.reclaim(memoryview(other))


def test_an_array_never_given_back_is_simply_freed() -> None:
    pool = ScratchPool()
    arr = pool.take(1000, U1)
    key = id(arr)
    del arr
    gc.collect()
    assert key not in pool._lent and pool.kept == 0


# --------------------------------------------------------------- the mailbox's early payloads

SIG = ("all_reduce", "<f4", (256,))


def _early(pool: ScratchPool, seq: int, values: np.ndarray) -> tuple[tuple, Frame]:
    """A DATA frame whose payload was read into a pooled buffer (as the TCP sink does)."""
    header = FrameHeader(group=0, seq=seq, step=0, tag=0, src=1, dtype="<f4",
                         shape=values.shape, sig=SIG)
    buf = pool.take(values.nbytes, U1)
    buf[:] = values.view(np.uint8)
    return frame_key(FrameKind.DATA, header), Frame(FrameKind.DATA, header, memoryview(buf))


def _mailbox(pool: ScratchPool) -> Mailbox:
    errors: list[CollectiveError] = []
    mailbox = Mailbox(0, lambda exc, scope: errors.append(exc))
    mailbox.reclaim = pool.reclaim
    return mailbox


async def test_an_early_payload_copied_out_goes_back_to_the_pool() -> None:
    pool = ScratchPool()
    mailbox = _mailbox(pool)
    values = np.arange(256, dtype=np.float32)
    key, frame = _early(pool, 1, values)
    mailbox.deliver(key, frame)  # nobody posted yet: kept as an early frame
    assert pool.kept == 0
    into = np.zeros(256, np.float32)
    got = mailbox.take(key, memoryview(into).cast("B"))
    assert got is not None and got.payload is not frame.payload
    np.testing.assert_array_equal(into, values)
    assert pool.kept == values.nbytes  # copied out: the buffer is free again


async def test_a_payload_read_before_its_receive_is_copied_then_reclaimed() -> None:
    """The receive is posted while the payload is being read into a pooled buffer."""
    pool = ScratchPool()
    mailbox = _mailbox(pool)
    values = np.arange(256, dtype=np.float32) * 2
    key, frame = _early(pool, 1, values)
    into = np.zeros(256, np.float32)
    fut = mailbox.post(key, memoryview(into).cast("B"), SIG)
    mailbox.deliver(key, frame)
    assert (await fut).payload is not frame.payload
    np.testing.assert_array_equal(into, values)
    assert pool.kept == values.nbytes


@pytest.mark.parametrize("posted_first", [False, True])
async def test_a_borrowing_receive_reads_the_early_payload_in_place(posted_first: bool) -> None:
    """The ring's reduce steps only read what they receive: no copy into their scratch, and
    the buffer goes back to the pool when they release it, not before."""
    pool = ScratchPool()
    mailbox = _mailbox(pool)
    values = np.arange(256, dtype=np.float32) + 7
    key, frame = _early(pool, 1, values)
    into = np.zeros(256, np.float32)
    if posted_first:
        fut = mailbox.post(key, memoryview(into).cast("B"), SIG, borrow=True)
        mailbox.deliver(key, frame)
        got = await fut
    else:
        mailbox.deliver(key, frame)
        got = mailbox.take(key, memoryview(into).cast("B"), borrow=True)
    assert got is not None and got.payload is frame.payload
    assert not into.any()  # not copied
    assert pool.kept == 0  # still in use
    mailbox.release(key)
    assert pool.kept == values.nbytes


async def test_a_failed_collective_does_not_recycle_what_it_may_still_read() -> None:
    pool = ScratchPool()
    mailbox = _mailbox(pool)
    values = np.ones(256, np.float32)
    key, frame = _early(pool, 1, values)
    mailbox.deliver(key, frame)
    got = mailbox.take(key, memoryview(np.zeros(256, np.float32)).cast("B"), borrow=True)
    assert got is not None
    mailbox.fail(CollectiveError("boom"))
    mailbox.release(key)
    assert pool.kept == 0  # left to the garbage collector
    assert not mailbox._kept


async def test_a_payload_handed_out_as_a_new_array_is_never_reclaimed() -> None:
    pool = ScratchPool()
    mailbox = _mailbox(pool)
    values = np.full(256, 3.0, np.float32)
    key, frame = _early(pool, 1, values)
    mailbox.deliver(key, frame)
    got = mailbox.take(key, None)  # no buffer: the receiver keeps the payload itself
    assert got is not None and got.payload is frame.payload
    mailbox.release(key)
    await asyncio.sleep(0)
    assert pool.kept == 0
    np.testing.assert_array_equal(np.frombuffer(got.payload, np.float32), values)
