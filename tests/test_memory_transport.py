"""The memory transport: lending large collective payloads (to receivers that come late, and to
receives that only read them), and running large reductions in the world's worker threads."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_array_equal

import asynccoll
from asynccoll import Communicator, ReduceOp, ops
from asynccoll.transport.memory import LEND_MIN_BYTES, MemoryWorld, _Workers
from asynccoll.tuning import Tuning
from asynccoll.wire import FrameKind, dtype_code, encode_data_head


async def test_late_receivers_get_the_data_and_senders_wait_for_the_copy() -> None:
    n = 4 * LEND_MIN_BYTES // 8  # float64 elements: every ring segment is lent

    async def fn(comm: asynccoll.Communicator) -> list[float]:
        await asyncio.sleep(0.01 * comm.rank)  # later ranks post their receives late
        a = np.arange(n, dtype=np.float64) * (comm.rank + 1)
        await comm.all_reduce(a)
        b = np.full(n, float(comm.rank))
        await comm.broadcast(b, root=comm.world_size - 1)
        return [float(a[1]), float(a[-1]), float(b[0]), float(b[-1])]

    w = 4
    scale = sum(range(1, w + 1))
    for got in await asynccoll.run_local(fn, w):
        assert got == [scale * 1.0, scale * (n - 1.0), w - 1.0, w - 1.0]


async def test_large_point_to_point_sends_never_wait_for_the_receive() -> None:
    big = LEND_MIN_BYTES * 4

    async def fn(comm: asynccoll.Communicator) -> float:
        peer = 1 - comm.rank
        await comm.send(np.full(big // 8, float(comm.rank)), peer)  # both send first
        got = await comm.recv(peer)
        return float(got.sum())

    results = await asynccoll.run_local(fn, 2, timeout=5)
    assert results == [float(big // 8), 0.0]


async def test_a_lent_frame_is_released_when_the_world_breaks() -> None:
    async def fn(comm: asynccoll.Communicator) -> str:
        if comm.rank == 0:
            try:  # rank 1 never takes part: the lent payload must not pin rank 0 forever
                await comm.broadcast(np.zeros(LEND_MIN_BYTES), root=0)
            except asynccoll.CollectiveError as exc:
                return type(exc).__name__
            return "returned"
        await asyncio.sleep(0.2)
        await comm.close()
        return "closed"

    results = await asynccoll.run_local(fn, 2, timeout=1)
    assert results[1] == "closed"
    assert results[0] in ("PeerLostError", "CollectiveTimeout", "CollectiveError")


@pytest.mark.parametrize("world_size", [2, 3])
async def test_a_sender_cancelled_while_its_payload_is_lent(world_size: int) -> None:
    """A non-root of a large reduce lends its block to the root and is cancelled while it
    waits for the copy: the root, taking the frame after that, raises ``CollectiveError``
    (the sender took its memory back), not asyncio's ``InvalidStateError``."""
    n = 4 * LEND_MIN_BYTES // 8 * world_size

    async def fn(comm: asynccoll.Communicator) -> str:
        try:
            if comm.rank == comm.world_size - 1:
                await asyncio.sleep(0.05)  # the others are waiting already
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.0):
                        await comm.reduce(np.ones(n), root=0)
                return "cancelled"
            await comm.reduce(np.ones(n), root=0)
        except asynccoll.CollectiveError:
            return "failed"
        return "returned"

    results = await asynccoll.run_local(fn, world_size, timeout=5)
    assert results[-1] == "cancelled"
    assert results[0] == "failed"


# ------------------------------------------------------- borrowed payloads and worker threads

def _head(src: int, step: int, nbytes: int) -> bytes:
    return encode_data_head(FrameKind.DATA, 0, 0, step, 0, src, dtype_code(np.dtype("f8")),
                            (nbytes // 8,), None, nbytes)


async def test_a_borrowing_receive_reads_the_senders_memory_until_released() -> None:
    world = MemoryWorld(2, threads=0)
    sender, receiver = world.transports
    data = np.arange(LEND_MIN_BYTES // 8, dtype=np.float64)
    scratch = np.zeros_like(data)
    key = (0, int(FrameKind.DATA), 0, 0, 0, 0)
    fut = receiver.post_recv(key, memoryview(scratch).cast("B"), borrow=True)
    pending = sender.post(1, _head(0, 0, data.nbytes), memoryview(data).cast("B"))
    frame = await fut
    assert np.shares_memory(np.frombuffer(frame.payload, np.float64), data)  # not copied
    assert not scratch.any()
    assert pending is not None and not pending.done()  # the sender must wait ...
    receiver.release(key)
    await asyncio.wait_for(pending, 1)  # ... until the receiver is done
    # a frame that came before its borrowing receive is lent the same way
    early = sender.post(1, _head(0, 1, data.nbytes), memoryview(data).cast("B"))
    key1 = (0, int(FrameKind.DATA), 0, 0, 1, 0)
    frame = await receiver.post_recv(key1, memoryview(scratch).cast("B"), borrow=True)
    assert np.shares_memory(np.frombuffer(frame.payload, np.float64), data)
    assert early is not None and not early.done()
    receiver.release(key1)
    await asyncio.wait_for(early, 1)
    for t in world.transports:
        await t.close()


async def test_a_failure_gives_borrowed_payloads_back() -> None:
    world = MemoryWorld(2, threads=0)
    sender, receiver = world.transports
    data = np.ones(LEND_MIN_BYTES // 8)
    key = (0, int(FrameKind.DATA), 0, 0, 0, 0)
    fut = receiver.post_recv(key, memoryview(np.empty_like(data)).cast("B"), borrow=True)
    pending = sender.post(1, _head(0, 0, data.nbytes), memoryview(data).cast("B"))
    await fut
    assert pending is not None and not pending.done()
    receiver.abort(asynccoll.CollectiveError("the receiver failed"))
    await asyncio.wait_for(pending, 1)
    for t in world.transports:
        await t.close()


def _memory_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asynccoll-memory")]


@pytest.mark.parametrize("threads", [0, 2])
async def test_large_reductions_run_in_the_worlds_threads(threads: int) -> None:
    n = 1 << 18  # 2 MiB of float64: the direct algorithm, blocks above offload_bytes
    world = MemoryWorld(4, threads=threads)
    comms = [Communicator(t) for t in world.transports]
    seen: list[str] = []
    real = np.add

    def add(*args: object, **kw: object) -> object:
        seen.append(threading.current_thread().name)
        return real(*args, **kw)

    async def one(comm: Communicator) -> np.ndarray:
        a = np.arange(n, dtype=np.float64) * (comm.rank + 1)
        return await comm.all_reduce(a)

    ops._UFUNCS[ReduceOp.SUM] = add  # type: ignore[assignment]
    try:
        results = await asyncio.gather(*(one(c) for c in comms))
    finally:
        ops._UFUNCS[ReduceOp.SUM] = real
    for got in results:
        assert_array_equal(got, np.arange(n, dtype=np.float64) * 10)
    workers = {name for name in seen if name.startswith("asynccoll-memory")}
    if threads:
        assert workers and len(seen) > 0, "no reduction ran in a worker thread"
        assert _memory_threads()
    else:
        assert not workers and seen
    for c in comms:
        await c.close()
    assert not _memory_threads(), "closing the world must stop its threads"


async def test_a_cancelled_collective_returns_only_after_its_worker_job() -> None:
    world = MemoryWorld(2, threads=2)
    t0, t1 = world.transports
    target = np.zeros(LEND_MIN_BYTES // 8)
    state: list[str] = []
    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def slow(lo: int, hi: int) -> None:
        state.append("started")
        loop.call_soon_threadsafe(started.set)
        time.sleep(0.2)
        state.append("done")

    key = (0, int(FrameKind.DATA), 0, 0, 0, 0)
    recv = t1.post_recv(key, memoryview(target).cast("B"))
    src = np.ones_like(target)
    work = [(slow, src.nbytes, [(1, _head(0, 0, src.nbytes), memoryview(src).cast("B"))])]
    task = asyncio.ensure_future(t0.compute_and_post(work, src.nbytes))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state == ["started", "done"], "cancellation returned while the job still ran"
    assert not recv.done()  # the frame of a cancelled job is not delivered
    for t in world.transports:
        await t.close()


def test_tuning_picks_the_direct_all_reduce_on_lending_transports() -> None:
    big = 1 << 20
    assert Tuning().all_reduce(big, 4, lends=True) == "direct"
    assert Tuning().all_reduce(big, 4) == "ring"
    assert Tuning().all_reduce(8, 4, lends=True) == "recursive_doubling"
    assert Tuning(direct_all_reduce="never").all_reduce(big, 4, lends=True) == "ring"
    assert Tuning(direct_all_reduce="always").all_reduce(big, 4) == "direct"
    with pytest.raises(ValueError, match="direct_all_reduce"):
        Tuning(direct_all_reduce="sometimes")
    with pytest.raises(ValueError, match="reduce_chunk_bytes"):
        Tuning(reduce_chunk_bytes=0)


# ------------------------------------------------------------ the workers share out the chunks

def _chunked_job(log: list[tuple[str, int]], chunks: int, chunk: int,
                 delay: float, fail_at: int | None = None
                 ) -> tuple[np.ndarray, list[tuple[Callable[[int, int], None], int, list[Any]]]]:
    """Work for ``compute_and_post``: ``chunks`` chunks of ``chunk`` bytes, each logged with
    its thread and ``lo``, filling the payload with its chunk number (after ``delay`` s)."""
    src = np.zeros(chunks * chunk, np.uint8)

    def fill(lo: int, hi: int) -> None:
        log.append((threading.current_thread().name, lo))
        time.sleep(delay)
        if fail_at is not None and lo == fail_at * chunk:
            raise ValueError("chunk failed")
        src[lo:hi] = lo // chunk

    return src, [(fill, src.nbytes, [])]


async def test_the_workers_share_one_jobs_chunks() -> None:
    world = MemoryWorld(2, threads=2)
    log: list[tuple[str, int]] = []
    chunk = LEND_MIN_BYTES
    src, work = _chunked_job(log, 8, chunk, 0.02)
    assert await world.transports[0].compute_and_post(work, chunk) == []
    assert sorted(lo for _, lo in log) == [k * chunk for k in range(8)]
    assert_array_equal(src, np.repeat(np.arange(8, dtype=np.uint8), chunk))
    # one job, yet both threads ran some of its chunks
    assert len({name for name, _ in log}) == 2, log
    for t in world.transports:
        await t.close()
    assert not _memory_threads()


async def test_a_failing_chunk_fails_its_job_only() -> None:
    world = MemoryWorld(2, threads=2)
    t0, t1 = world.transports
    chunk = LEND_MIN_BYTES
    bad_log: list[tuple[str, int]] = []
    good_log: list[tuple[str, int]] = []
    _, bad = _chunked_job(bad_log, 8, chunk, 0.01, fail_at=1)
    good_src, good = _chunked_job(good_log, 8, chunk, 0.01)
    results = await asyncio.gather(t0.compute_and_post(bad, chunk),
                                   t1.compute_and_post(good, chunk), return_exceptions=True)
    assert isinstance(results[0], ValueError) and results[1] == []
    assert len(bad_log) < 8, "the failed job's other chunks should have been skipped"
    assert_array_equal(good_src, np.repeat(np.arange(8, dtype=np.uint8), chunk))
    for t in world.transports:
        await t.close()


async def test_a_cancelled_job_skips_the_chunks_not_started() -> None:
    world = MemoryWorld(2, threads=2)
    chunk = LEND_MIN_BYTES
    log: list[tuple[str, int]] = []
    _, work = _chunked_job(log, 40, chunk, 0.05)
    task = asyncio.ensure_future(world.transports[0].compute_and_post(work, chunk))
    await asyncio.sleep(0.08)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    started = len(log)
    await asyncio.sleep(0.15)
    assert len(log) == started < 40, "chunks ran after the cancelled call returned"
    for t in world.transports:
        await t.close()


async def test_jobs_queued_as_the_world_closes_run_in_the_loops_thread() -> None:
    workers = _Workers(2)
    ran: list[str] = []
    job = workers.run([lambda: ran.append(threading.current_thread().name)] * 3)
    workers.shutdown()  # before the end of this turn, when the job would have started
    await asyncio.wait_for(job.future, 5)
    assert ran == [threading.current_thread().name] * 3
    assert not _memory_threads()


async def test_work_of_no_bytes_returns_at_once() -> None:
    world = MemoryWorld(2, threads=2)
    calls: list[tuple[int, int]] = []
    work: list[tuple[Callable[[int, int], None], int, list[Any]]] = [
        (lambda lo, hi: calls.append((lo, hi)), 0, [])]
    assert await asyncio.wait_for(world.transports[0].compute_and_post(work, 1024), 5) == []
    assert calls == []
    for t in world.transports:
        await t.close()


async def test_a_cancelled_ranks_buffers_are_not_written_after_it_returns() -> None:
    """A peer's worker job copies its reduced block into the cancelled rank's array: the
    cancellation must stop it (and wait for its running chunk) before returning."""
    n = 1 << 21  # 16 MiB of float64: blocks of 8 MiB, 8 chunks per job
    world = MemoryWorld(2, threads=2)
    comms = [Communicator(t, timeout=10) for t in world.transports]
    loop = asyncio.get_running_loop()
    started = asyncio.Event()
    real = np.add

    def slow_add(*args: Any, **kw: Any) -> Any:
        if threading.current_thread().name.startswith("asynccoll-memory"):
            loop.call_soon_threadsafe(started.set)
            time.sleep(0.01)
        return real(*args, **kw)

    async def victim(comm: Communicator) -> str:
        a = np.ones(n)
        task = asyncio.ensure_future(comm.all_reduce(a))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        a[:] = -1.0  # reused at once
        await asyncio.sleep(0.3)
        return "intact" if (a == -1.0).all() else f"overwritten: {(a != -1).sum()}"

    async def other(comm: Communicator) -> str:
        try:
            await comm.all_reduce(np.ones(n))
        except asynccoll.CollectiveError:
            return "failed"
        return "returned"

    ops._UFUNCS[ReduceOp.SUM] = slow_add  # type: ignore[assignment]
    try:
        results = await asyncio.wait_for(asyncio.gather(other(comms[0]), victim(comms[1])), 20)
    finally:
        ops._UFUNCS[ReduceOp.SUM] = real
        for c in comms:
            await c.close()
    assert results == ["failed", "intact"]
    assert not _memory_threads()


@pytest.mark.parametrize("how", ["seterr", "errstate"])
async def test_the_worlds_threads_reduce_under_the_callers_numpy_error_state(how: str) -> None:
    """NumPy's error state (``np.seterr``, ``np.errstate``) is a context variable: the
    world's worker threads had NumPy's defaults, so a large all_reduce that overflowed under
    ``over="raise"`` returned inf with a RuntimeWarning (a small one raised
    FloatingPointError), and under ``over="ignore"`` warned once per chunk. The chunks run
    in the caller's context now, as a reduction in the event loop's thread does."""
    world = MemoryWorld(2, threads=2)
    comms = [Communicator(t, timeout=10) for t in world.transports]
    ran_in: set[str] = set()
    real = np.add

    def add(*args: Any, **kw: Any) -> Any:
        ran_in.add(threading.current_thread().name)
        return real(*args, **kw)

    async def one(comm: Communicator) -> BaseException | np.ndarray:
        x = np.full(1 << 20, 3e38, np.float32)  # 4 MiB: reduced by the worker threads
        try:
            return await comm.all_reduce(x)
        except Exception as exc:
            return exc

    ops._UFUNCS[ReduceOp.SUM] = add  # type: ignore[assignment]
    try:
        async with asyncio.timeout(20):
            if how == "seterr":
                saved = np.seterr(over="raise")
                try:
                    raised = await asyncio.gather(*(one(c) for c in comms))
                finally:
                    np.seterr(**saved)
            else:
                with np.errstate(over="raise"):
                    raised = await asyncio.gather(*(one(c) for c in comms))
            assert any(n.startswith("asynccoll-memory") for n in ran_in), ran_in
            assert all(isinstance(r, FloatingPointError) for r in raised), raised
            for c in comms:
                await c.close()

            world = MemoryWorld(2, threads=2)
            comms = [Communicator(t, timeout=10) for t in world.transports]
            with warnings.catch_warnings(), np.errstate(over="ignore"):
                warnings.simplefilter("error")  # a RuntimeWarning would fail the call
                ignored = await asyncio.gather(*(one(c) for c in comms))
            for got in ignored:
                assert isinstance(got, np.ndarray) and np.isinf(got).all(), got
    finally:
        ops._UFUNCS[ReduceOp.SUM] = real
        for c in comms:
            await c.close()
