"""Waiting on work that another library progresses (MPI requests, CUDA events) from asyncio.

Backends whose operations complete outside the event loop (mpi4py non-blocking requests, CUDA
events behind NCCL calls) share these small tools:

* ``poll`` awaits a completion test without blocking the loop: it yields to the loop
  (``asyncio.sleep(0)``) for a short spin period, then sleeps ``POLL_SLEEP`` between
  tests, so a long idle wait costs about a thousand cheap tests a second instead of a core.
  The event loop's timers are coarse (uvloop's are whole milliseconds), so work that ends
  during a sleep is seen up to about a millisecond late. Work that can say when it is done
  (a CUDA host function behind it) passes ``arm``: once the spin is over, ``poll`` asks it for
  a future completed from another thread (``signal_from_thread``) and awaits that instead of
  sleeping, waking as the work ends and checking for failures every ``CHECK_EVERY``.
* ``Turns`` makes operations that must be *issued* in the same order on every rank (MPI
  collectives on one communicator, NCCL kernels on one stream) wait for the operations that were
  called before them, when something asynchronous (a signature check, a header exchange)
  happens between the call and the issue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

#: seconds a wait spins on ``asyncio.sleep(0)`` before it starts sleeping between tests
SPIN_SECONDS = 2e-4
#: seconds between tests once spinning is over: a millisecond, the timers' resolution
#: (asyncio's sleeps at least that long in epoll; uvloop rounds delays to whole milliseconds
#: and runs one that rounds to 0, as 0.5 ms did, at once: the wait then spun on the core)
POLL_SLEEP = 1e-3
#: seconds between failure checks while ``poll`` awaits a signal
CHECK_EVERY = 0.01


async def poll(done: Callable[[], bool], *, deadline: float,
               check: Callable[[], None], on_timeout: Callable[[], BaseException],
               arm: Callable[[], asyncio.Future[None] | None] | None = None,
               spin: float = SPIN_SECONDS) -> None:
    """Return once ``done()`` is true.

    Args:
        done: the completion test (cheap, non-blocking; it may raise).
        deadline: ``loop.time()`` after which ``on_timeout()`` is raised.
        check: called between tests; raises when the wait must end early (a peer aborted).
        on_timeout: builds the exception raised at the deadline.
        arm: called once, when the spin is over and the work is not done: a future that
            another thread completes when the work is done (``signal_from_thread``), awaited
            from then on instead of sleeping between tests; None from it means "cannot",
            and the wait sleeps between tests as without ``arm``. Short work never arms
            anything (a signal has a cost: a host function, a thread waking the loop).
        spin: seconds of testing on every turn of the loop before the sleeps (or the
            signal) begin.
    """
    if done():
        return
    loop = asyncio.get_running_loop()
    spin_until = loop.time() + spin
    signal: asyncio.Future[None] | None = None
    while True:
        check()
        now = loop.time()
        if now >= deadline:
            raise on_timeout()
        if now < spin_until:
            await asyncio.sleep(0)
        else:
            if arm is not None:
                signal, arm = arm(), None
            if signal is None:
                await asyncio.sleep(POLL_SLEEP)
            else:
                await asyncio.wait([signal], timeout=min(CHECK_EVERY, deadline - now))
                if signal.done():
                    return
        if done():
            return


def signal_from_thread(loop: asyncio.AbstractEventLoop
                       ) -> tuple[asyncio.Future[None], Callable[[object], None]]:
    """A future of ``loop`` and a function that completes it from any thread (its argument
    is ignored: it fits ``cupy.cuda.Stream.launch_host_func``). Calling it after the loop
    closed does nothing."""
    fut: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    def fire(_arg: object = None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle)

    return fut, fire


class Turns:
    """Tickets in call order; ticket ``t`` may issue once every earlier ticket is done.

    Every ticket taken must eventually be passed to ``done`` (idempotent), whether or not
    its owner issued anything, or later tickets wait forever (until their own timeout).
    """

    __slots__ = ("_done", "_now", "_waiters")

    def __init__(self) -> None:
        self._now = 0
        self._done: set[int] = set()
        self._waiters: dict[int, asyncio.Future[None]] = {}

    def ready(self, ticket: int) -> bool:
        """Whether every ticket before ``ticket`` is done (``wait`` would return at once;
        callers skip setting up a timeout for it then)."""
        return ticket <= self._now

    async def wait(self, ticket: int) -> None:
        """Return once every ticket before ``ticket`` is done."""
        if ticket <= self._now:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = fut
        try:
            await fut
        finally:
            self._waiters.pop(ticket, None)

    def done(self, ticket: int) -> None:
        """``ticket`` issued all it had to issue here (or gave up)."""
        if ticket < self._now or ticket in self._done:
            return
        self._done.add(ticket)
        while self._now in self._done:
            self._done.remove(self._now)
            self._now += 1
        fut = self._waiters.get(self._now)
        if fut is not None and not fut.done():
            fut.set_result(None)


__all__ = ["CHECK_EVERY", "POLL_SLEEP", "SPIN_SECONDS", "Turns", "poll", "signal_from_thread"]
