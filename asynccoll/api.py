"""Entry points: ``init`` (one process per rank) and ``run_local`` (ranks as coroutines)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ._aio import uncancelled
from .collectives import Communicator, check_int, check_timeout
from .errors import CollectiveError
from .tuning import Tuning, check_tuning

T = TypeVar("T")
log = logging.getLogger("asynccoll")

BACKENDS = ("memory", "tcp", "nccl", "mpi")


async def _memory_world(world_size: int, *, timeout: float, tuning: Tuning | None
                        ) -> list[Communicator]:
    from .transport.memory import MemoryWorld

    world = MemoryWorld(world_size)
    return [Communicator(t, timeout=timeout, tuning=tuning, backend="memory")
            for t in world.transports]


def _check_options(where: str, options: dict[str, Any], *takers: Callable[..., Any]) -> None:
    """A ``TypeError`` naming ``where`` (not an internal function) and the options it takes
    when ``options`` holds one that none of ``takers`` (the functions they go to) accepts."""
    known = {name for fn in takers for name, p in inspect.signature(fn).parameters.items()
             if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{where} got unexpected option{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))}; it takes "
                        f"{', '.join(sorted(known)) or 'none'}")


def _gpu_staging(options: dict[str, Any]) -> bool:
    """The option ``gpu_staging`` (taken out of ``options``): a bool, else a TypeError (the
    string ``"no"`` was taken as true)."""
    value = options.pop("gpu_staging", False)
    if not isinstance(value, bool):
        raise TypeError(f"gpu_staging must be a bool, got {value!r}")
    return value


def _staged(comms: list[Communicator], gpu_staging: bool) -> list[Communicator]:
    """With ``gpu_staging``, communicators that also take CuPy arrays (through pinned host
    memory, ``asynccoll.gpu.HostStaged``)."""
    if not gpu_staging:
        return comms
    from .gpu import HostStaged

    return [HostStaged(c) for c in comms]


async def local_world(world_size: int, backend: str = "memory", *, timeout: float = 60.0,
                      tuning: Tuning | None = None, **options: Any) -> list[Communicator]:
    """Communicators for ``world_size`` ranks living in this event loop (one per rank).

    Option ``gpu_staging=True`` (memory and tcp): the communicators also take CuPy arrays,
    staged through pinned host memory.
    """
    world_size = check_int(world_size, "world_size")  # (as init's: NumPy's integers too)
    if world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_timeout(timeout)  # before anything is opened
    check_tuning(tuning)
    gpu_staging = _gpu_staging(options)
    if backend == "memory":
        if options:
            raise TypeError(f"unexpected options for the memory backend: {sorted(options)}")
        return _staged(await _memory_world(world_size, timeout=timeout, tuning=tuning),
                       gpu_staging)
    if backend == "tcp":
        from .transport.tcp_world import tcp_local_world

        _check_options(f"backend {backend!r}", options, tcp_local_world)
        return _staged(await tcp_local_world(world_size, timeout=timeout, tuning=tuning,
                                             **options), gpu_staging)
    if backend in BACKENDS:
        raise ValueError(f"backend {backend!r} cannot run several ranks in one event loop; "
                         f"use 'memory' or 'tcp'")
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")


async def run_local(fn: Callable[[Communicator], Awaitable[T]], world_size: int,
                    backend: str = "memory", *, timeout: float = 60.0,
                    tuning: Tuning | None = None, **options: Any) -> list[T]:
    """Run ``await fn(comm)`` once per rank, concurrently, in this event loop.

    Returns the results in rank order. If a rank raises, the others are unblocked (their
    pending collectives fail) and cancelled, and the first error is re-raised: a
    ``CancelledError`` that ``fn`` raises itself (not one of cancelling ``run_local``) too.

    Args:
        fn: coroutine function taking the rank's ``Communicator``.
        world_size: number of ranks.
        backend: ``"memory"`` (queues in this process) or ``"tcp"`` (real loopback sockets and
            a real rendezvous server).
        timeout: per-collective timeout of every communicator.
        tuning: algorithm thresholds (default ``Tuning``).
        **options: ``gpu_staging=True`` (memory and tcp: the communicators also take CuPy
            arrays, staged through pinned host memory); for ``"tcp"`` also ``token``,
            ``max_payload``, ``peer_loss`` and ``handshake_timeout``, as for ``init``. An
            option the backend does not take is a ``TypeError``.
    """
    comms = await local_world(world_size, backend, timeout=timeout, tuning=tuning, **options)
    failures: list[BaseException] = []

    async def one(comm: Communicator) -> T:
        try:
            return await fn(comm)
        except BaseException as exc:
            # a CancelledError is this rank's failure too unless its task was cancelled (by
            # run_local, or with run_local): fn raised it, or awaited something cancelled
            task = asyncio.current_task()
            if not isinstance(exc, asyncio.CancelledError) or (
                    task is not None and not task.cancelling()):
                failures.append(exc)
                comm.transport.abort(CollectiveError(
                    f"rank {comm.rank} raised {type(exc).__name__}: {exc}"))
            raise

    tasks = [asyncio.create_task(one(c), name=f"asynccoll-rank-{c.rank}") for c in comms]
    try:
        pending: set[asyncio.Task[T]] = set(tasks)
        while pending and not failures:  # a rank ended cancelled fails the world, too
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if failures:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise failures[0]
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        # every one closed, even if run_local is cancelled now (also while it waits for the
        # rank tasks to end: cancelled there, it would never close the world)
        await uncancelled(_end_all(tasks, comms))


async def _end_all(tasks: list[asyncio.Task[Any]], comms: list[Communicator]) -> None:
    """Wait for the (cancelled) rank tasks to end, then close every communicator."""
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

    Backends:
        ``"tcp"``: the rendezvous and a ring of TCP connections. Options:
        ``handshake_timeout`` (seconds a connection may take to finish its handshake, for
        this rank and the rendezvous it hosts; default ``ASYNCCOLL_HANDSHAKE_TIMEOUT``, else
        5 s: raise it on a loaded machine or with hundreds of ranks),
        ``max_payload`` (bytes one frame may carry, default 4 GiB, at least 512), ``peer_loss``
        (``"abort"``, the default, or ``"isolate"``), ``rendezvous`` (``host:port`` of a
        standalone rendezvous, default ``ASYNCCOLL_RENDEZVOUS``), ``bind`` (the address this
        rank listens on, default ``ASYNCCOLL_BIND``, else the one it reaches the rendezvous
        from), ``host_rendezvous`` (default: rank 0 hosts it unless ``rendezvous`` is set),
        ``job`` (default ``ASYNCCOLL_JOB_ID``), ``gpu_staging=True`` (also take CuPy arrays,
        staged through pinned host memory).
        ``"mpi"``: mpi4py under ``mpirun``/``mpiexec``; rank and size come from MPI (``addr``,
        ``port`` and ``token`` do not apply). Options: ``comm`` (an mpi4py communicator,
        default ``COMM_WORLD``), ``check_signatures`` (default ``True``).
        ``"nccl"``: CuPy arrays through NCCL, bootstrapped over the TCP world (same arguments
        and environment as ``"tcp"``). Options: ``device`` (CUDA device id, default the local
        rank), ``check_signatures`` (default ``True``), and the TCP options.
    """
    check_tuning(tuning)
    if backend == "tcp":
        from .transport.tcp_world import tcp_init

        gpu_staging = _gpu_staging(options)
        _check_options("init(backend='tcp')", options, tcp_init)
        comm = await tcp_init(rank=rank, world_size=world_size, addr=addr, port=port,
                              timeout=timeout, token=token, tuning=tuning, **options)
        return _staged([comm], gpu_staging)[0]
    if backend == "memory":
        raise ValueError("the memory backend runs all ranks in one event loop: "
                         "use asynccoll.run_local(fn, world_size)")
    if backend == "mpi":
        given = [n for n, v in (("addr", addr), ("port", port), ("token", token)) if v is not None]
        if given:
            raise ValueError(f"the mpi backend takes its world from MPI (mpirun/mpiexec); "
                             f"{' and '.join(given)} {'does' if len(given) == 1 else 'do'} "
                             f"not apply to it")
        from .transport.mpi import mpi_init

        _check_options("init(backend='mpi')", options, mpi_init)
        return await mpi_init(rank=rank, world_size=world_size, timeout=timeout, tuning=tuning,
                              **options)
    if backend == "nccl":
        from .transport.nccl import nccl_init
        from .transport.tcp_world import tcp_init

        _check_options("init(backend='nccl')", options, nccl_init, tcp_init)
        return await nccl_init(rank=rank, world_size=world_size, addr=addr, port=port,
                               timeout=timeout, token=token, tuning=tuning, **options)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
