"""Waiting on work that another library progresses (MPI requests, CUDA events) from asyncio.

Backends whose operations complete outside the event loop (mpi4py non-blocking requests, CUDA
events behind NCCL calls) share two small tools:

* ``poll`` awaits a completion test without blocking the loop: it yields to the loop
  (``asyncio.sleep(0)``) for a short spin period, then sleeps ``POLL_SLEEP`` between
  tests, so a long idle wait costs about a thousand cheap tests a second instead of a core.
* ``Turns`` makes operations that must be *issued* in the same order on every rank (MPI
  collectives on one communicator, NCCL kernels on one stream) wait for the operations that were
  called before them, when something asynchronous (a signature check, a header exchange)
  happens between the call and the issue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: seconds a wait spins on ``asyncio.sleep(0)`` before it starts sleeping between tests
SPIN_SECONDS = 2e-4
#: seconds between tests once spinning is over (asyncio timers have ~1 ms resolution anyway)
POLL_SLEEP = 5e-4


async def poll(done: Callable[[], bool], *, deadline: float,
               check: Callable[[], None], on_timeout: Callable[[], BaseException]) -> None:
    """Return once ``done()`` is true.

    Args:
        done: the completion test (cheap, non-blocking; it may raise).
        deadline: ``loop.time()`` after which ``on_timeout()`` is raised.
        check: called between tests; raises when the wait must end early (a peer aborted).
        on_timeout: builds the exception raised at the deadline.
    """
    if done():
        return
    loop = asyncio.get_running_loop()
    spin_until = loop.time() + SPIN_SECONDS
    while True:
        check()
        now = loop.time()
        if now >= deadline:
            raise on_timeout()
        await asyncio.sleep(0 if now < spin_until else POLL_SLEEP)
        if done():
            return


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


__all__ = ["POLL_SLEEP", "SPIN_SECONDS", "Turns", "poll"]
