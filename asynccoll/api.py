"""Entry points: :func:`init` (one process per rank) and :func:`run_local` (ranks as coroutines)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .collectives import Communicator
from .errors import CollectiveError
from .tuning import Tuning

T = TypeVar("T")
log = logging.getLogger("asynccoll")

BACKENDS = ("memory", "tcp", "nccl", "mpi")


async def _memory_world(world_size: int, *, timeout: float, tuning: Tuning | None
                        ) -> list[Communicator]:
    from .transport.memory import MemoryWorld

    world = MemoryWorld(world_size)
    return [Communicator(t, timeout=timeout, tuning=tuning, backend="memory")
            for t in world.transports]


async def local_world(world_size: int, backend: str = "memory", *, timeout: float = 60.0,
                      tuning: Tuning | None = None, **options: Any) -> list[Communicator]:
    """Communicators for ``world_size`` ranks living in this event loop (one per rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend == "memory":
        if options:
            raise TypeError(f"unexpected options for the memory backend: {sorted(options)}")
        return await _memory_world(world_size, timeout=timeout, tuning=tuning)
    if backend == "tcp":
        from .transport.tcp import tcp_local_world

        return await tcp_local_world(world_size, timeout=timeout, tuning=tuning, **options)
    if backend in BACKENDS:
        raise ValueError(f"backend {backend!r} cannot run several ranks in one event loop; "
                         f"use 'memory' or 'tcp'")
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


async def run_local(fn: Callable[[Communicator], Awaitable[T]], world_size: int,
                    backend: str = "memory", *, timeout: float = 60.0,
                    tuning: Tuning | None = None, **options: Any) -> list[T]:
    """Run ``await fn(comm)`` once per rank, concurrently, in this event loop.

    Returns the results in rank order. If a rank raises, the others are unblocked (their
    pending collectives fail) and cancelled, and the first error is re-raised.

    Args:
        fn: coroutine function taking the rank's :class:`Communicator`.
        world_size: number of ranks.
        backend: ``"memory"`` (queues in this process) or ``"tcp"`` (real loopback sockets and
            a real rendezvous server).
        timeout: per-collective timeout of every communicator.
        tuning: algorithm thresholds (default :class:`~asynccoll.tuning.Tuning`).
    """
    comms = await local_world(world_size, backend, timeout=timeout, tuning=tuning, **options)
    failures: list[BaseException] = []

    async def one(comm: Communicator) -> T:
        try:
            return await fn(comm)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                failures.append(exc)
                comm.transport.abort(CollectiveError(
                    f"rank {comm.rank} raised {type(exc).__name__}: {exc}"))
            raise

    tasks = [asyncio.create_task(one(c), name=f"asynccoll-rank-{c.rank}") for c in comms]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if failures:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise failures[0]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in comms:
            await c.close()


async def init(backend: str = "tcp", *, rank: int | None = None, world_size: int | None = None,
               addr: str | None = None, port: int | None = None, timeout: float = 60.0,
               token: str | None = None, tuning: Tuning | None = None, **options: Any
               ) -> Communicator:
    """Join a world of processes and return its world communicator.

    Arguments left ``None`` are read from the environment (``ASYNCCOLL_RANK``/``RANK``,
    ``ASYNCCOLL_WORLD_SIZE``/``WORLD_SIZE``, ``ASYNCCOLL_ADDR``/``MASTER_ADDR``,
    ``ASYNCCOLL_PORT``/``MASTER_PORT``, ``ASYNCCOLL_TOKEN``).
    """
    if backend == "tcp":
        from .transport.tcp import tcp_init

        return await tcp_init(rank=rank, world_size=world_size, addr=addr, port=port,
                              timeout=timeout, token=token, tuning=tuning, **options)
    if backend == "memory":
        raise ValueError("the memory backend runs all ranks in one event loop: "
                         "use asynccoll.run_local(fn, world_size)")
    if backend in ("nccl", "mpi"):
        raise NotImplementedError(f"the {backend!r} backend is not available in this version "
                                  f"yet; use 'tcp' (processes) or run_local (one process)")
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
