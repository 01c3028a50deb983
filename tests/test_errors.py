"""Errors, never hangs: bad arguments, disagreeing ranks, timeouts, cancellation, closing.

Every test runs on each backend of ``conftest.BACKENDS`` (the ``backend`` fixture). Where a
bound on time is asserted, the communicator timeout is far above it (30 s), so only the
mechanism under test can meet it, and an outer guard turns a hang into a quick failure
instead of a frozen test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_array_equal

import asynccoll
from asynccoll import (
    CollectiveError,
    CollectiveTimeout,
    Communicator,
    CommunicatorClosedError,
    PeerLostError,
    ReduceOp,
)

LONG_TIMEOUT = 30.0  # communicator timeout where something else must fire first
PROMPT = 1.0  # seconds within which a failure must reach every rank
GUARD = 2.5  # a world still blocked after this long is reported as a hang


@dataclass
class Outcome:
    """What one rank's call ended with, and when."""

    value: Any = None
    error: BaseException | None = None
    elapsed: float = 0.0


async def outcome(aw: Awaitable[Any]) -> Outcome:
    t0 = time.monotonic()
    try:
        value = await aw
    except (Exception, asyncio.CancelledError) as exc:
        return Outcome(error=exc, elapsed=time.monotonic() - t0)
    return Outcome(value=value, elapsed=time.monotonic() - t0)


async def guarded(fn: Callable[[Communicator], Awaitable[Any]], world_size: int, backend: str,
                  *, guard: float = GUARD, **kw: Any) -> list[Any]:
    """``run_local`` that fails the test (instead of waiting for the communicator timeout)
    when the world is still blocked after ``guard`` seconds (``GUARD``)."""
    kw.setdefault("timeout", LONG_TIMEOUT)
    try:
        async with asyncio.timeout(guard) as cm:
            return await asynccoll.run_local(fn, world_size, backend, **kw)
    except TimeoutError:
        if not cm.expired():  # a CollectiveTimeout (a TimeoutError too) of the ranks' own
            raise
        pytest.fail(f"ranks still blocked after {guard} s (hang until the communicator timeout)")


# ------------------------------------------------------------------------- bad arguments

Call = Callable[[Communicator], Coroutine[Any, Any, Any]]


@dataclass
class Bad:
    """A call with a bad argument: ``who`` makes it ("all" ranks or only rank "0")."""

    id: str
    call: Call
    exc: type[Exception]
    who: str = "all"
    min_ws: int = 1


def _right(comm: Communicator) -> int:
    return (comm.rank + 1) % comm.world_size


def _ro(shape: tuple[int, ...] = (4,)) -> np.ndarray:
    a = np.zeros(shape)
    a.flags.writeable = False
    return a


STRIDED = np.arange(20.0)[::2]
FORTRAN = np.asfortranarray(np.ones((3, 4)))
UNSUPPORTED = {"object": np.array([1, "a"], dtype=object),
               "datetime64": np.array(["2024-01-01"], dtype="datetime64[D]"),
               "str": np.array(["abc"]),
               "structured": np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])}
if hasattr(np, "float128") and np.dtype(np.longdouble).itemsize > 8:
    UNSUPPORTED["float128"] = np.zeros(3, dtype=np.longdouble)

BAD: list[Bad] = [
    # TypeError: arrays that cannot travel
    Bad("all_reduce-strided", lambda c: c.all_reduce(STRIDED.copy()[::2]), TypeError),
    Bad("all_reduce-fortran", lambda c: c.all_reduce(FORTRAN.copy(order="F")), TypeError),
    Bad("broadcast-strided", lambda c: c.broadcast(np.arange(10.0)[::3]), TypeError),
    Bad("reduce-strided", lambda c: c.reduce(np.arange(10.0)[::3]), TypeError),
    Bad("all_gather-strided", lambda c: c.all_gather(STRIDED), TypeError),
    Bad("reduce_scatter-fortran", lambda c: c.reduce_scatter(FORTRAN), TypeError),
    Bad("gather-strided", lambda c: c.gather(STRIDED), TypeError),
    Bad("scatter-strided", lambda c: c.scatter([STRIDED] * c.world_size), TypeError, who="0"),
    Bad("all_to_all-strided", lambda c: c.all_to_all([STRIDED] * c.world_size), TypeError),
    Bad("send-strided", lambda c: c.send(STRIDED, _right(c)), TypeError, min_ws=2),
    Bad("all_reduce-list", lambda c: c.all_reduce([1.0, 2.0]), TypeError),
    Bad("broadcast-list", lambda c: c.broadcast([1, 2]), TypeError),
    Bad("all_gather-tuple", lambda c: c.all_gather((1, 2)), TypeError),
    Bad("send-list", lambda c: c.send([1, 2], _right(c)), TypeError, min_ws=2),
    Bad("all_reduce-scalar", lambda c: c.all_reduce(np.float64(1.0)), TypeError),
    *(Bad(f"all_reduce-{name}", lambda c, a=a: c.all_reduce(a.copy()), TypeError)
      for name, a in UNSUPPORTED.items()),
    *(Bad(f"all_gather-{name}", lambda c, a=a: c.all_gather(a), TypeError)
      for name, a in UNSUPPORTED.items()),
    Bad("send-object", lambda c: c.send(UNSUPPORTED["object"], _right(c)), TypeError, min_ws=2),
    # TypeError: ops that do not fit
    Bad("avg-int", lambda c: c.all_reduce(np.ones(3, np.int32), ReduceOp.AVG), TypeError),
    Bad("avg-bool", lambda c: c.all_reduce(np.ones(3, bool), ReduceOp.AVG), TypeError),
    Bad("band-float", lambda c: c.all_reduce(np.ones(3), ReduceOp.BAND), TypeError),
    Bad("bor-complex", lambda c: c.all_reduce(np.ones(3, np.complex64), ReduceOp.BOR),
        TypeError),
    Bad("bxor-float16", lambda c: c.reduce(np.ones(3, np.float16), op=ReduceOp.BXOR),
        TypeError),
    Bad("avg-int-reduce_scatter",
        lambda c: c.reduce_scatter(np.ones(4, np.int64), ReduceOp.AVG), TypeError),
    Bad("op-string", lambda c: c.all_reduce(np.ones(3), "sum"), TypeError),
    Bad("op-ufunc", lambda c: c.all_reduce(np.ones(3), np.add), TypeError),
    Bad("op-int", lambda c: c.reduce(np.ones(3), 0, 0), TypeError),
    Bad("op-none", lambda c: c.reduce_scatter(np.ones(3), None), TypeError),
    # ValueError: ranks out of range
    Bad("broadcast-root-high", lambda c: c.broadcast(np.ones(3), root=c.world_size), ValueError),
    Bad("broadcast-root-negative", lambda c: c.broadcast(np.ones(3), root=-1), ValueError),
    Bad("reduce-root-high", lambda c: c.reduce(np.ones(3), root=c.world_size + 5), ValueError),
    Bad("gather-root-negative", lambda c: c.gather(np.ones(3), root=-1), ValueError),
    Bad("scatter-root-high", lambda c: c.scatter(None, root=c.world_size), ValueError),
    Bad("broadcast_object-root-high",
        lambda c: c.broadcast_object("x", root=c.world_size), ValueError),
    Bad("send-dst-high", lambda c: c.send(np.ones(3), c.world_size), ValueError),
    Bad("send-dst-negative", lambda c: c.send(np.ones(3), -1), ValueError),
    Bad("recv-src-high", lambda c: c.recv(c.world_size), ValueError),
    Bad("recv-src-negative", lambda c: c.recv(-1), ValueError),
    # ValueError: tags
    Bad("send-tag-negative", lambda c: c.send(np.ones(3), _right(c), tag=-1), ValueError,
        min_ws=2),
    Bad("send-tag-huge", lambda c: c.send(np.ones(3), _right(c), tag=1 << 63), ValueError,
        min_ws=2),
    # a tag of the wrong type is a TypeError, as a rank of the wrong type is
    Bad("send-tag-str", lambda c: c.send(np.ones(3), _right(c), tag="a"), TypeError, min_ws=2),
    Bad("recv-tag-float", lambda c: c.recv(_right(c), tag=1.0), TypeError, min_ws=2),
    Bad("send-tag-bool", lambda c: c.send(np.ones(3), _right(c), tag=True), TypeError,
        min_ws=2),
    Bad("recv-tag-negative", lambda c: c.recv(_right(c), tag=-5), ValueError, min_ws=2),
    # ValueError: sequences of the wrong length, shapes, read-only buffers, groups
    Bad("scatter-too-many", lambda c: c.scatter([np.ones(2)] * (c.world_size + 1)), ValueError,
        who="0"),
    Bad("scatter-too-few", lambda c: c.scatter([np.ones(2)] * (c.world_size - 1)), ValueError,
        who="0"),
    Bad("scatter-none-on-root", lambda c: c.scatter(None), ValueError, who="0"),
    Bad("all_to_all-too-many", lambda c: c.all_to_all([np.ones(2)] * (c.world_size + 1)),
        ValueError),
    Bad("all_to_all-empty", lambda c: c.all_to_all([]), ValueError),
    Bad("all_gather-0d", lambda c: c.all_gather(np.array(1.0)), ValueError),
    Bad("reduce_scatter-0d", lambda c: c.reduce_scatter(np.array(1.0)), ValueError),
    Bad("all_reduce-readonly", lambda c: c.all_reduce(_ro()), ValueError),
    Bad("broadcast-readonly-off-root",
        lambda c: c.broadcast(_ro((2, 2)), root=c.world_size - 1), ValueError, who="0",
        min_ws=2),
    Bad("reduce-readonly-on-root", lambda c: c.reduce(_ro(), root=0), ValueError, who="0"),
    Bad("new_group-duplicates", lambda c: c.new_group([0, 0]), ValueError),
    Bad("new_group-out-of-range", lambda c: c.new_group([0, c.world_size]), ValueError),
    Bad("new_group-negative", lambda c: c.new_group([-1]), ValueError),
    Bad("new_group-empty", lambda c: c.new_group([]), ValueError),
]


@pytest.mark.parametrize(
    ("world_size", "bad"),
    [pytest.param(w, bad, id=f"{w}-{bad.id}")
     for w, bad in itertools.product([1, 2, 3], BAD) if w >= bad.min_ws])
async def test_bad_argument_raises_before_sending_and_comm_stays_usable(backend, world_size,
                                                                        bad):
    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        if bad.who == "all" or r == 0:
            sent = comm.transport.bytes_sent
            with pytest.raises(bad.exc):
                await bad.call(comm)
            assert comm.transport.bytes_sent == sent, "bytes were sent before the error"
        # still usable: collectives, groups and point to point all line up
        assert_array_equal(await comm.all_reduce(np.ones(3)), np.full(3, float(w)))
        sub = await comm.new_group(list(range(w)))
        assert sub is not None
        assert_array_equal(await sub.all_gather(np.array([r])), np.arange(w))
        if w > 1:
            await comm.send(np.array([r]), (r + 1) % w, tag=5)
            assert_array_equal(await comm.recv((r - 1) % w, tag=5), np.array([(r - 1) % w]))
            await comm.send(np.array([r]), (r + 1) % w)
            assert_array_equal(await comm.recv((r - 1) % w), np.array([(r - 1) % w]))

    await guarded(fn, world_size, backend)


# ---------------------------------------------------------------- ranks that disagree

@dataclass
class Mismatch:
    """``call(comm, odd, keep)``: ``odd`` is True on the one rank that disagrees with the
    others; arrays passed through ``keep`` must hold their contents after the failure.
    ``names``: for each side, strings of which the error message must contain one."""

    id: str
    call: Callable[[Communicator, bool, Callable[[np.ndarray], np.ndarray]],
                   Coroutine[Any, Any, Any]]
    names: tuple[tuple[str, ...], ...] = ()


def _bcast_input(comm: Communicator, shape: tuple[int, ...], dtype: Any = np.float64
                 ) -> np.ndarray:
    return np.full(shape, 7 if comm.rank == 0 else -1, dtype)


def _root(odd: bool) -> int:
    return 0 if odd else 1


MISMATCHES: list[Mismatch] = [
    Mismatch("all_reduce-shape", lambda c, odd, keep: c.all_reduce(np.ones(10 if odd else 12)),
             (("(10,)",), ("(12,)",))),
    Mismatch("all_reduce-shape-same-nbytes",
             lambda c, odd, keep: c.all_reduce(np.ones((2, 3) if odd else (3, 2))),
             (("(2, 3)",), ("(3, 2)",))),
    Mismatch("all_reduce-dtype",
             lambda c, odd, keep: c.all_reduce(np.ones(8, np.float32 if odd else np.float64)),
             (("float32", "f4"), ("float64", "f8"))),
    Mismatch("all_reduce-dtype-same-nbytes",
             lambda c, odd, keep: c.all_reduce(np.ones(8, np.int64 if odd else np.float64)),
             (("int64", "i8"), ("float64", "f8"))),
    Mismatch("all_reduce-op",
             lambda c, odd, keep: c.all_reduce(np.ones(8), ReduceOp.MAX if odd else ReduceOp.SUM),
             (("max", "MAX"), ("sum", "SUM"))),
    Mismatch("all_reduce-threshold-straddle",  # 80 B vs 800 kB: tree on one side, ring on other
             lambda c, odd, keep: c.all_reduce(np.ones(10 if odd else 100_000)),
             (("(10,)",), ("(100000,)",))),
    Mismatch("all_reduce-vs-all_gather",
             lambda c, odd, keep: (c.all_reduce(np.ones(10)) if odd
                                   else c.all_gather(np.ones(10))),
             (("all_reduce",), ("all_gather",))),
    Mismatch("all_gather-trailing-shape",
             lambda c, odd, keep: c.all_gather(np.ones((2, 3) if odd else (2, 4))),
             (("3",), ("4",))),
    Mismatch("reduce_scatter-shape",
             lambda c, odd, keep: c.reduce_scatter(np.ones(9 if odd else 11)),
             (("(9,)",), ("(11,)",))),
    Mismatch("broadcast-shape-same-nbytes",
             lambda c, odd, keep: c.broadcast(keep(_bcast_input(c, (2, 3) if odd else (3, 2)))),
             (("(2, 3)",), ("(3, 2)",))),
    Mismatch("broadcast-dtype-same-nbytes",
             lambda c, odd, keep: c.broadcast(
                 keep(_bcast_input(c, (4,), np.int64 if odd else np.float64))),
             (("int64", "i8"), ("float64", "f8"))),
    Mismatch("broadcast-root",
             lambda c, odd, keep: c.broadcast(np.ones(4), root=_root(odd))),
    Mismatch("reduce-root", lambda c, odd, keep: c.reduce(np.ones(4), root=_root(odd))),
    Mismatch("gather-root", lambda c, odd, keep: c.gather(np.ones(4), root=_root(odd))),
    Mismatch("scatter-root",
             lambda c, odd, keep: c.scatter([np.ones(2)] * c.world_size, root=_root(odd))),
    Mismatch("gather-shape", lambda c, odd, keep: c.gather(np.ones(3 if odd else 4)),
             (("(3,)",), ("(4,)",))),
    Mismatch("barrier-vs-all_reduce",
             lambda c, odd, keep: c.barrier() if odd else c.all_reduce(np.ones(1)),
             (("barrier",), ("all_reduce",))),
]


@pytest.mark.parametrize("odd_rank", ["first", "last"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", MISMATCHES, ids=[m.id for m in MISMATCHES])
async def test_mismatch_fails_on_every_rank_promptly(backend, tuning, case, world_size,
                                                     odd_rank):
    odd = 0 if odd_rank == "first" else world_size - 1
    buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    async def fn(comm: Communicator) -> Outcome:
        def keep(a: np.ndarray) -> np.ndarray:
            buffers[comm.rank] = (a, a.copy())
            return a

        return await outcome(case.call(comm, comm.rank == odd, keep))

    results = await guarded(fn, world_size, backend, tuning=tuning)
    for r, (a, before) in buffers.items():  # nobody received corrupt data
        if (r == odd) != (odd == 0):  # disagrees with the root (rank 0): must stay as it was
            assert a.tobytes() == before.tobytes(), f"rank {r}'s array was modified"
        else:  # agrees with the root: its old contents or exactly the root's
            root_data = buffers[0][1]
            assert a.tobytes() in (before.tobytes(), root_data.tobytes()), (
                f"rank {r}'s array holds neither its data nor the root's")
    for r, res in enumerate(results):
        assert isinstance(res.error, CollectiveError), (
            f"rank {r} got {res.error!r} / returned {type(res.value).__name__} "
            f"after {res.elapsed:.2f} s, not a CollectiveError")
        assert res.elapsed < PROMPT, f"rank {r} took {res.elapsed:.2f} s to fail"
        msg = str(res.error)
        for side in case.names:
            assert any(s in msg for s in side), f"rank {r}: {msg!r} does not name {side}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_broken_communicator_fails_every_later_call_at_once(backend, tuning, world_size):
    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        sub = await comm.new_group(list(range(w)))
        assert sub is not None
        with pytest.raises(CollectiveError):
            await comm.all_reduce(np.ones(5 if r == 0 else 6))
        later: list[Callable[[], Coroutine[Any, Any, Any]]] = [
            lambda: comm.all_reduce(np.ones(5)),
            lambda: comm.barrier(),
            lambda: comm.broadcast(np.ones(3), root=0),
            lambda: comm.all_gather(np.ones(2)),
            lambda: comm.broadcast_object({"a": 1}),
            lambda: comm.new_group([0]),
            lambda: comm.send(np.ones(2), (r + 1) % w),
            lambda: comm.recv((r - 1) % w),
            lambda: sub.all_reduce(np.ones(5)),
            lambda: comm.all_reduce(np.ones(5)),
        ]
        for make in later:
            res = await outcome(make())
            assert isinstance(res.error, CollectiveError), f"{make}: {res.error!r}"
            assert not isinstance(res.error, CommunicatorClosedError)
            assert res.elapsed < 0.2

    await guarded(fn, world_size, backend, tuning=tuning)


# ----------------------------------------------------------------------------- timeouts

@pytest.mark.parametrize("world_size", [2, 3])
async def test_skipped_collective_times_out(backend, tuning, world_size):
    timeout = 0.5

    async def fn(comm: Communicator) -> Outcome | None:
        if comm.rank == 0:
            return None  # skips the collective (and stays alive)
        return await outcome(comm.all_reduce(np.ones(100)))

    results = await guarded(fn, world_size, backend, tuning=tuning, timeout=timeout)
    errors = [res.error for res in results[1:]]
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert any(isinstance(e, CollectiveTimeout) for e in errors), errors
    for res in results[1:]:
        assert timeout * 0.8 <= res.elapsed <= timeout + PROMPT, res.elapsed


def test_timeout_already_due_under_uvloop(backend):
    """uvloop runs a timer due within its resolution (1 ms) as a plain ``Handle``, which has
    no ``when()``: the collectives after one armed such a timer must still time out as
    ``CollectiveTimeout``, not fail inside the watchdog."""
    uvloop = pytest.importorskip("uvloop")

    async def fn(comm: Communicator) -> list[BaseException]:
        comm.timeout = 0.0
        errors: list[BaseException] = []
        for _ in range(3):
            try:
                await comm.all_reduce(np.ones(3))
            except Exception as exc:
                errors.append(exc)
        return errors

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results = runner.run(asynccoll.run_local(fn, 2, backend, timeout=LONG_TIMEOUT))
    errors = [e for errs in results for e in errs]
    assert errors, "a timeout of 0 s never fired"
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert any(isinstance(e, CollectiveTimeout) for e in errors), errors


@pytest.mark.parametrize("world_size", [2, 3])
async def test_recv_without_send_times_out(backend, world_size):
    async def fn(comm: Communicator) -> Outcome | None:
        if comm.rank != 1:
            return None
        return await outcome(comm.recv(0, tag=3))

    results = await guarded(fn, world_size, backend, timeout=0.5)
    assert isinstance(results[1].error, CollectiveTimeout), results[1].error
    assert 0.4 <= results[1].elapsed <= 1.5


async def test_watchdog_waits_while_bytes_move_and_fires_once_they_stop() -> None:
    """The timeout is one of no progress: a call whose transport keeps receiving is not
    cancelled however long it runs; once the bytes stop, it is within (1 + 1/CHECKS) x the
    timeout. (Unit test of the watchdog, with a stand-in transport.)"""
    from asynccoll.collectives import _Watchdog

    class Counters:
        bytes_received = 0
        received_from = [0, 0]

        def unsent_bytes(self, dst: int | None = None) -> int:
            return 0

        def outgoing_bytes(self, dst: int | None = None) -> int:
            return 0

        def check_loop(self, loop: asyncio.AbstractEventLoop) -> None:
            pass

    counters = Counters()
    dog = _Watchdog(counters)  # type: ignore[arg-type]
    timeout = 0.1

    async def call() -> None:
        dog.watch(dog.current_task(), timeout)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            assert dog.expired(dog.current_task())
            raise
        finally:
            dog.unwatch(dog.current_task())

    async def stream(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            counters.bytes_received += 1
            await asyncio.sleep(0.01)

    t0 = time.monotonic()
    task = asyncio.ensure_future(call())
    await stream(0.5)  # five timeouts' worth of progress
    assert not task.done()
    stopped = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    now = time.monotonic()
    assert stopped - t0 >= 0.45
    assert timeout * 0.9 <= now - stopped <= timeout * (1 + 1 / _Watchdog.CHECKS) + 0.1


async def test_a_long_transfer_that_keeps_moving_does_not_time_out() -> None:
    """A 128 MiB all_reduce between two TCP ranks lasts several times its timeout, but bytes
    keep moving: it completes, correct, well past the point where a timeout that progress did
    not extend cancels a call (``timeout * (1 + 1 / CHECKS)``).

    The timeout is a fifth of what the same all_reduce took just before (at least 50 ms):
    0.7 s on 2 idle slow cores, over 5 s on busy ones. A fixed 50 ms failed there under load:
    a process kept off the CPU that long moves no bytes, which the watchdog rightly counts as
    no progress. The guard against a hang is generous for the same reason."""
    from asynccoll.collectives import _Watchdog

    async def fn(comm: Communicator) -> tuple[float, float]:
        x = np.full(32 << 20, comm.rank + 1, np.float32)
        t0 = time.monotonic()
        await comm.all_reduce(x)  # the communicator's long timeout: how long it takes here
        took = np.array([time.monotonic() - t0])
        await comm.all_reduce(took, ReduceOp.MAX)
        comm.timeout = max(0.05, float(took[0]) / 5)
        x = np.full(32 << 20, comm.rank + 1, np.float32)
        t0 = time.monotonic()
        await comm.all_reduce(x)
        assert x[0] == 3 and x[-1] == 3
        return comm.timeout, time.monotonic() - t0

    results = await guarded(fn, 2, "tcp", guard=50.0)
    for timeout, elapsed in results:
        # it outlived its timeout: only progress can have kept the watchdog off
        assert elapsed > timeout * (1 + 1 / _Watchdog.CHECKS) + 0.05, results


@pytest.mark.parametrize("backend", ["memory", "tcp"])
async def test_recv_from_a_silent_peer_times_out_while_another_streams(backend: str) -> None:
    """A point-to-point receive counts only its own peer's bytes as progress: another rank
    sending to the same rank all along does not keep it waiting."""
    timeout = 0.3

    async def fn(comm: Communicator) -> Outcome | None:
        if comm.rank == 1:
            await asyncio.sleep(2 * timeout + PROMPT)  # never sends
            return None
        if comm.rank == 2:
            with contextlib.suppress(CollectiveError):
                for _ in range(100):
                    await comm.send(np.ones(1000), 0, tag=5)
                    await asyncio.sleep(0.01)
            return None

        async def drain() -> None:
            with contextlib.suppress(CollectiveError):
                for _ in range(100):
                    await comm.recv(2, tag=5)

        drainer = asyncio.ensure_future(drain())
        res = await outcome(comm.recv(1, tag=3))
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
        return res

    results = await guarded(fn, 3, backend, timeout=timeout)
    res = results[0]
    assert isinstance(res.error, CollectiveTimeout), res.error
    assert timeout * 0.9 <= res.elapsed <= timeout * 1.25 + PROMPT, res.elapsed


# ------------------------------------------------------------- failures and cancellation

@pytest.mark.parametrize("blocked_in", ["all_reduce", "barrier", "recv"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_run_local_reraises_user_error_promptly(backend, world_size, blocked_in):
    async def fn(comm: Communicator) -> None:
        if comm.rank == 0:
            await asyncio.sleep(0.1)
            raise ValueError("boom in user code")
        if blocked_in == "all_reduce":
            await comm.all_reduce(np.ones(10))
        elif blocked_in == "barrier":
            await comm.barrier()
        else:
            await comm.recv(0)

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom in user code"):
        await guarded(fn, world_size, backend)
    assert time.monotonic() - t0 < 0.1 + PROMPT


@pytest.mark.parametrize("how", ["asyncio.timeout", "task.cancel"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_cancelled_collective_breaks_the_world_promptly(backend, tuning, world_size, how):
    async def fn(comm: Communicator) -> Outcome:
        r, w = comm.rank, comm.world_size
        if r == 0:
            if how == "asyncio.timeout":
                async def under_timeout() -> None:
                    async with asyncio.timeout(0.2):
                        await comm.all_reduce(np.ones(1000))
                res = await outcome(under_timeout())
            else:
                task = asyncio.ensure_future(comm.all_reduce(np.ones(1000)))
                await asyncio.sleep(0.2)
                task.cancel()
                res = await outcome(task)
            after = await outcome(comm.all_reduce(np.ones(3)))
            assert isinstance(after.error, CollectiveError), after
            return res
        if r == w - 1:  # never sent: blocks until the world breaks
            return await outcome(comm.recv(0, tag=9))
        return await outcome(comm.all_reduce(np.ones(1000)))

    results = await guarded(fn, world_size, backend, tuning=tuning)
    mine = results[0]
    if how == "asyncio.timeout":
        assert isinstance(mine.error, TimeoutError), mine
    else:
        assert isinstance(mine.error, asyncio.CancelledError), mine
    assert not isinstance(mine.error, CollectiveError), mine
    assert mine.elapsed < 0.2 + PROMPT
    for r, res in enumerate(results[1:], 1):
        assert isinstance(res.error, CollectiveError), f"rank {r}: {res}"
        assert res.elapsed < 0.2 + PROMPT, f"rank {r} took {res.elapsed:.2f} s"


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_peer_that_closes_is_reported_as_lost(backend, world_size):
    lost = world_size - 1

    async def fn(comm: Communicator) -> Outcome | None:
        await comm.barrier()
        if comm.rank == lost:
            await comm.close()
            return None
        return await outcome(comm.all_reduce(np.ones(10)))

    results = await guarded(fn, world_size, backend)
    for r, res in enumerate(results[:lost]):
        assert isinstance(res.error, PeerLostError), f"rank {r}: {res.error!r}"
        assert res.error.rank == lost
        assert res.elapsed < PROMPT


# ------------------------------------------------------------------------------ closing

@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_close_is_idempotent_and_closed_comm_refuses(backend, world_size):
    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        await comm.barrier()
        await comm.close()
        await comm.close()
        calls: list[Coroutine[Any, Any, Any]] = [
            comm.all_reduce(np.ones(2)), comm.barrier(), comm.broadcast(np.ones(2)),
            comm.all_gather(np.ones(2)), comm.broadcast_object(1), comm.new_group([0])]
        if w > 1:
            calls += [comm.send(np.ones(2), (r + 1) % w), comm.recv((r - 1) % w)]
        for coro in calls:
            with pytest.raises(CommunicatorClosedError):
                await coro

    await guarded(fn, world_size, backend)


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_async_with_closes(backend, world_size):
    async def fn(comm: Communicator) -> None:
        async with comm as c:
            assert c is comm
            assert_array_equal(await comm.all_reduce(np.ones(2)), np.full(2, world_size))
            await comm.barrier()
        with pytest.raises(CommunicatorClosedError):
            await comm.all_reduce(np.ones(2))

    await guarded(fn, world_size, backend)


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_closing_a_subgroup_leaves_the_world_usable(backend, world_size):
    async def fn(comm: Communicator) -> None:
        sub = await comm.new_group(list(range(world_size)))
        assert sub is not None
        await sub.close()
        await sub.close()
        with pytest.raises(CommunicatorClosedError):
            await sub.all_reduce(np.ones(2))
        assert_array_equal(await comm.all_reduce(np.ones(2)), np.full(2, world_size))

    await guarded(fn, world_size, backend)


# ----------------------------------------------------------------- independent worlds

async def test_two_worlds_in_one_event_loop_do_not_interfere(run, backend):
    async def world(comm: Communicator, scale: int) -> list[np.ndarray]:
        out = []
        for k in range(10):
            a = np.full(7, scale * (comm.rank + 1) + k, np.int64)
            out.append((await comm.all_reduce(a)).copy())
            out.append(await comm.all_gather(np.array([scale, comm.rank])))
            await comm.barrier()
            await asyncio.sleep(0)
        return out

    async def a(comm: Communicator) -> list[np.ndarray]:
        return await world(comm, 1)

    async def b(comm: Communicator) -> list[np.ndarray]:
        return await world(comm, 1000)

    res_a, res_b = await asyncio.gather(run(a, 3, backend), run(b, 4, backend))
    for res, scale, w in ((res_a, 1, 3), (res_b, 1000, 4)):
        for rank_out in res:
            for k in range(10):
                total = scale * sum(range(1, w + 1)) + k * w
                assert_array_equal(rank_out[2 * k], np.full(7, total))
                assert_array_equal(rank_out[2 * k + 1],
                                   np.array([[scale, j] for j in range(w)]).reshape(-1))


async def test_a_failing_world_leaves_another_world_alone(run, backend):
    async def failing(comm: Communicator) -> None:
        await comm.all_reduce(np.ones(3 if comm.rank == 0 else 4))

    async def healthy(comm: Communicator) -> list[float]:
        out = []
        for _ in range(20):
            out.append(float((await comm.all_reduce(np.ones(1)))[0]))
            await asyncio.sleep(0.001)
        return out

    bad, good = await asyncio.gather(run(failing, 3, backend), run(healthy, 3, backend),
                                     return_exceptions=True)
    assert isinstance(bad, CollectiveError), bad
    assert good == [[3.0] * 20] * 3


# ------------------------------------------------------------------ no corrupt data

BIG_ENDIAN = np.dtype(">f8")


BASE = np.array([1.5, 2.0, -3.25])


def _be(values: np.ndarray) -> np.ndarray:
    """``values`` stored big-endian (arithmetic on such arrays gives native ones again)."""
    out = np.asarray(values, dtype=BIG_ENDIAN)
    assert out.dtype.byteorder == ">"
    return out


@pytest.mark.parametrize("what", ["send_recv", "all_reduce", "all_gather", "broadcast",
                                  "scatter", "all_to_all"])
async def test_non_native_byte_order_is_handled_or_refused(backend, what):
    """An array in big-endian order is float64 too: it must arrive as the same numbers, or be
    refused with TypeError; never reinterpreted byte-swapped on the other side."""
    async def fn(comm: Communicator) -> Any:
        r = comm.rank
        mine = _be(BASE + r) if r == 0 else BASE + r
        if what == "send_recv":
            if r == 0:
                await comm.send(mine, 1)
                return None
            return await comm.recv(0)
        if what == "all_reduce":
            return await comm.all_reduce(mine)
        if what == "all_gather":
            return await comm.all_gather(mine)
        if what == "broadcast":
            return await comm.broadcast(mine, root=0)
        if what == "scatter":
            return await comm.scatter([_be(BASE + j) for j in range(2)] if r == 0 else None)
        return await comm.all_to_all([mine, mine])

    try:
        results = await guarded(fn, 2, backend)
    except TypeError:
        return  # refused: fine
    base = BASE
    expected = {
        "send_recv": [None, base],
        "all_reduce": [2 * base + 1] * 2,
        "all_gather": [np.concatenate([base, base + 1])] * 2,
        "broadcast": [base, base],
        "scatter": [base, base + 1],
        "all_to_all": [[base, base + 1]] * 2,
    }[what]
    for r, (got, exp) in enumerate(zip(results, expected, strict=True)):
        if exp is None:
            continue
        if isinstance(exp, list):
            for g, e in zip(got, exp, strict=True):
                assert_array_equal(np.asarray(g, np.float64), e, err_msg=f"rank {r}")
        else:
            assert_array_equal(np.asarray(got, np.float64), exp, err_msg=f"rank {r}")



async def test_init_mpi_names_the_arguments_that_do_not_apply() -> None:
    with pytest.raises(ValueError, match=r"; addr does not apply to it$"):
        await asynccoll.init(backend="mpi", addr="127.0.0.1")
    with pytest.raises(ValueError, match=r"; addr and port do not apply to it$"):
        await asynccoll.init(backend="mpi", addr="127.0.0.1", port=1234)


@pytest.mark.parametrize(("given", "message"), [
    ({"rank": "0"}, "rank must be an int, got '0'"),
    ({"rank": True}, "rank must be an int, got True"),
    ({"world_size": 1.0}, "world_size must be an int, got 1.0"),
])
async def test_init_mpi_refuses_a_rank_or_size_that_is_no_int(given: dict[str, Any],
                                                             message: str) -> None:
    """``init("mpi", rank="0")`` said "rank=0 was given but MPI says this process is rank 0"
    (and ``rank=True`` passed as rank 1): a ``TypeError`` naming the argument, before MPI is
    touched, as on tcp."""
    with pytest.raises(TypeError) as info:
        await asynccoll.init(backend="mpi", **given)
    assert str(info.value) == message


@pytest.mark.parametrize("backend", ["memory", "tcp"])
async def test_run_local_takes_world_size_as_init_does(backend: str) -> None:
    """``run_local(fn, np.int64(2))`` said "world_size must be a positive int, got
    np.int64(2)" and ``run_local(fn, "2")`` raised ``ValueError``, while ``init`` takes NumPy
    integers and raises ``TypeError`` for what is no int: the same check now (one helper)."""
    async def fn(comm: Communicator) -> int:
        return comm.world_size

    assert await asynccoll.run_local(fn, np.int64(2), backend, timeout=5.0) == [2, 2]
    for bad in ("2", True, 2.0):
        with pytest.raises(TypeError) as info:
            await asynccoll.run_local(fn, bad, backend)  # type: ignore[arg-type]
        assert str(info.value) == f"world_size must be an int, got {bad!r}"
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        await asynccoll.run_local(fn, 0, backend)


def test_abort_with_a_bool_for_the_lost_rank_names_no_rank() -> None:
    from asynccoll.transport.base import error_from_abort
    from asynccoll.wire import Frame, FrameHeader, FrameKind

    def lost(value: Any) -> int | None:
        meta = {"reason": "gone", "error": "PeerLostError", "lost": value}
        exc, _ = error_from_abort(Frame(FrameKind.ABORT, FrameHeader(src=1, meta=meta), b""))
        assert isinstance(exc, asynccoll.PeerLostError)
        return exc.rank

    assert lost(3) == 3
    assert lost(True) is None  # a bool is not a rank (True would read as rank 1)
    assert lost("3") is None


@pytest.mark.parametrize("backend", ["tcp", "mpi", "nccl"])
async def test_init_names_an_unknown_option_and_the_known_ones(backend: str) -> None:
    with pytest.raises(TypeError, match=rf"init\(backend='{backend}'\) got unexpected option "
                                        r"'bogus'; it takes .*timeout"):
        await asynccoll.init(backend, rank=0, world_size=1, bogus=1)


async def test_run_local_names_an_unknown_option() -> None:
    async def fn(comm: Communicator) -> None:
        raise AssertionError("not reached")

    with pytest.raises(TypeError, match=r"backend 'tcp' got unexpected options 'a', 'b'; "
                                        r"it takes .*peer_loss"):
        await asynccoll.run_local(fn, 2, "tcp", a=1, b=2)


@pytest.mark.parametrize("in_group", [False, True])
async def test_a_timeout_names_the_call_and_the_rank_it_waited_for(backend, in_group):
    """An on-call engineer reading a CollectiveTimeout learns which call of which group
    stalled (its sequence number) and which rank never sent its part: the one to look at."""
    timeout = 0.4

    async def fn(comm: Communicator) -> Outcome | None:
        group = comm
        if in_group:  # world ranks 2 and 0, renumbered 0 and 1; world rank 1 stays out
            group = await comm.new_group([2, 0])
            if group is None:
                return None
        group.timeout = timeout
        await group.all_reduce(np.ones(5))  # sequence number 0: completes
        if comm.rank == 2 or (not in_group and comm.rank == 1):
            await asyncio.sleep(timeout * 1.25 + PROMPT)  # alive, but never calls
            return None
        return await outcome(group.all_reduce(np.ones((2, 3), np.float32)))

    results = await guarded(fn, 3 if in_group else 2, backend)
    err = results[0].error
    assert isinstance(err, CollectiveTimeout), err
    text = str(err)
    assert "all_reduce(<f4, (2, 3), sum" in text, text
    assert "sequence number 1 " in text, text
    if in_group:
        assert "group of world ranks [2, 0]" in text, text
        assert "waiting for group rank 0 (world rank 2)" in text, text
    else:
        assert "of the world" in text, text
        assert "waiting for world rank 1" in text, text


async def test_a_mismatch_names_the_sequence_number_of_the_call(backend):
    """Ranks that disagree deep into a job learn which call it was (its sequence number),
    not only the two signatures, which a loop repeats call after call."""
    async def fn(comm: Communicator) -> Outcome:
        for _ in range(3):  # sequence numbers 0-2 agree
            await comm.all_reduce(np.ones(4))
        dtype = np.float32 if comm.rank == 1 else np.float64
        return await outcome(comm.all_reduce(np.ones(4, dtype)))

    results = await guarded(fn, 2, backend)
    for res in results:
        assert isinstance(res.error, CollectiveError), res.error
        assert "collective mismatch" in str(res.error), res.error
        assert "sequence number 3 of the world" in str(res.error), res.error


async def test_a_timeout_relayed_to_a_rank_says_what_that_rank_waited_for(backend):
    """A rank that never calls stalls its direct peers first, and the first timer to fire
    may be another rank's: 3 ranks, world rank 2 absent, rank 1 (the shortest timeout)
    times out waiting for rank 0, which waits for rank 2. Rank 0's error, relayed from rank 1,
    must still say whom rank 0 itself waited for, so that the lines of the ranks together
    lead to rank 2."""
    async def fn(comm: Communicator) -> Outcome | None:
        await comm.all_reduce(np.ones(4))
        if comm.rank == 2:
            await asyncio.sleep(1.5)  # alive, but never calls
            return None
        comm.timeout = 0.3 if comm.rank == 1 else 5.0
        return await outcome(comm.all_reduce(np.ones(4)))

    results = await guarded(fn, 3, backend)
    first, relayed = results[1].error, results[0].error
    assert isinstance(first, CollectiveTimeout), first
    assert "waiting for world rank 0" in str(first), first
    assert isinstance(relayed, CollectiveError), relayed
    # (rank 0's own call first, then what rank 1 said of its call of the same signature)
    assert re.match(r"all_reduce\(<f8, \(4,\), sum, \w+\) on group rank 0 \(sequence number 1 "
                    r"of the world\): world rank 1 aborted: ", str(relayed)), relayed
    assert str(relayed).endswith("; world rank 0 was waiting for world rank 2"), relayed
