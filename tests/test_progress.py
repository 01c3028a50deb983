"""Waiting on work progressed outside the event loop (asynccoll._progress)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asynccoll import _progress
from asynccoll._progress import poll, signal_from_thread


class Boom(Exception):
    pass


def _timeout() -> BaseException:
    return TimeoutError("no progress")


async def test_a_signal_from_another_thread_wakes_the_wait_at_once() -> None:
    loop = asyncio.get_running_loop()
    signal, fire = signal_from_thread(loop)
    checks = 0

    def check() -> None:
        nonlocal checks
        checks += 1

    armed = 0

    def arm() -> asyncio.Future[None]:
        nonlocal armed
        armed += 1
        return signal

    timer = threading.Timer(0.05, fire, args=(None,))
    t0 = time.monotonic()
    timer.start()
    await poll(lambda: False, deadline=loop.time() + 10, check=check, on_timeout=_timeout,
               arm=arm)
    elapsed = time.monotonic() - t0
    assert 0.045 <= elapsed < 0.05 + 5 * _progress.CHECK_EVERY, elapsed
    assert armed == 1 and checks >= 1
    fire(None)  # twice is harmless


async def test_short_work_is_seen_while_spinning_and_arms_nothing() -> None:
    loop = asyncio.get_running_loop()
    calls = iter([False, False, True])

    def arm() -> asyncio.Future[None]:
        raise AssertionError("armed for work done within the spin")

    await poll(lambda: next(calls), deadline=loop.time() + 10, check=lambda: None,
               on_timeout=_timeout, arm=arm)


async def test_an_arm_that_cannot_signal_falls_back_to_sleeping_between_tests() -> None:
    loop = asyncio.get_running_loop()
    ends = loop.time() + 0.03
    await poll(lambda: loop.time() > ends, deadline=loop.time() + 10, check=lambda: None,
               on_timeout=_timeout, arm=lambda: None)
    assert loop.time() > ends


async def test_the_wait_ends_at_its_deadline_and_when_a_check_fails() -> None:
    loop = asyncio.get_running_loop()
    signal, _ = signal_from_thread(loop)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no progress"):
        await poll(lambda: False, deadline=loop.time() + 0.1, check=lambda: None,
                   on_timeout=_timeout, arm=lambda: signal)
    assert 0.09 <= time.monotonic() - t0 < 1.0
    failing = loop.time() + 0.1

    def check() -> None:
        if loop.time() > failing:
            raise Boom("a peer aborted")

    with pytest.raises(Boom):
        await poll(lambda: False, deadline=loop.time() + 10, check=check, on_timeout=_timeout,
                   arm=lambda: signal)


def test_firing_after_the_loop_closed_does_nothing() -> None:
    loop = asyncio.new_event_loop()
    signal, fire = signal_from_thread(loop)
    loop.close()
    fire(None)
    assert not signal.done()


async def test_a_longer_spin_tests_on_every_turn_of_the_loop() -> None:
    """``spin``: how long the wait tests on every loop turn before sleeping between tests
    (the MPI backend spins long: MPI moves data only while it is called)."""
    loop = asyncio.get_running_loop()

    async def tests_in(seconds: float, **kw: float) -> int:
        calls = 0
        ends = loop.time() + seconds

        def done() -> bool:
            nonlocal calls
            calls += 1
            return loop.time() > ends

        await poll(done, deadline=loop.time() + 10, check=lambda: None, on_timeout=_timeout,
                   **kw)
        return calls

    short = await tests_in(0.05)
    long = await tests_in(0.05, spin=1.0)
    assert short < 0.05 / _progress.POLL_SLEEP + 200  # mostly asleep between tests
    assert long > 3 * short, (short, long)


async def test_turns_ready_says_when_wait_would_return_at_once() -> None:
    from asynccoll._progress import Turns

    turns = Turns()
    assert turns.ready(0) and not turns.ready(1)
    waiter = asyncio.ensure_future(turns.wait(2))
    turns.done(1)  # out of order: ticket 2 still waits for 0
    await asyncio.sleep(0)
    assert not turns.ready(2) and not waiter.done()
    turns.done(0)
    await asyncio.wait_for(waiter, 1)
    assert turns.ready(2) and not turns.ready(3)
