"""Shared test helpers: the backends every collective test runs on, and ``run``.

Collective tests take the backend name as a parameter (the ``backend`` fixture, or
``@pytest.mark.parametrize("backend", BACKENDS)``) and hand it to ``run``, so a new
transport joins the whole suite by being appended to ``BACKENDS``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

import asynccoll
from asynccoll import CollectiveError, Communicator
from asynccoll.tuning import RING, TREE, Tuning

T = TypeVar("T")

#: Backends that run several ranks in one event loop (``asynccoll.run_local``).
BACKENDS = ["memory", "tcp"]

#: Per-collective timeout of the communicators ``run`` builds: short, so that a test that
#: would hang fails with CollectiveTimeout long before pytest's own per-test timeout.
DEFAULT_TIMEOUT = 20.0


def _mpi_world_size() -> int | None:
    """The size of the MPI job this pytest is one process of (``mpirun -n N python -m pytest``),
    read from the launcher's environment (Open MPI, MPICH/Intel MPI/PMI), or None."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


#: Under an MPI launcher, every process runs the same tests in the same order, and the
#: ``"mpi"`` backend joins BACKENDS: ``run_world(fn, n, "mpi")`` runs ``fn`` on this process's
#: rank when ``n`` is the MPI world size (tests/test_mpi.py starts such a run).
MPI_WORLD_SIZE = _mpi_world_size()
if MPI_WORLD_SIZE is not None:
    BACKENDS.append("mpi")

#: Tests of the shared suites that cannot run on the mpi backend, and why.
MPI_INCOMPATIBLE = {
    "test_barrier_nobody_leaves_before_everyone_entered":
        "it shares Python lists between the ranks, which separate MPI processes cannot; "
        "tests/mpi_world.py checks barrier ordering across processes instead",
}


#: The event loops an async test can run on, by the name its id shows.
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
try:
    import uvloop
except ImportError:  # uvloop comes with asynccoll on Linux only
    pass
else:
    LOOPS["uvloop"] = uvloop.new_event_loop

#: Modules whose async tests run on both loops by default, each case as ``[asyncio]`` and
#: ``[uvloop]``: the TCP backend's core and the rendezvous, a representative subset (about
#: 190 tests, ~45 s more on 2 cores); ``--event-loop=uvloop`` runs every async test on uvloop.
BOTH_LOOPS_MODULES = {"test_tcp.py", "test_tcp_pairs.py", "test_tcp_edges.py",
                      "test_peer_loss.py", "test_closing.py", "test_concurrency_stress.py",
                      "test_rendezvous.py", "test_uvloop.py"}

#: Async tests that run on asyncio's loop only, whatever ``--event-loop`` says: they rely on
#: what asyncio's loop does and uvloop's does not, not on asynccoll's behaviour.
ASYNCIO_ONLY = {
    "test_connect_retries_a_host_with_several_addresses":
        "it patches loop.getaddrinfo, which uvloop's create_connection does not call",
    "test_ring_reduce_scatter_reads_its_blocks_directly":
        "with every rank in one loop, only asyncio's runs a coroutine woken by sleep(0) "
        "before the loop reads the socket (uvloop reads first, so the frames go the usual "
        "way: correct, not direct); tests/test_uvloop.py checks direct reads across processes",
    "test_a_dropped_subgroup_keeps_no_world_alive":
        "it counts the timers in asyncio's loop._scheduled, which uvloop's loop has not",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--event-loop", choices=["asyncio", "uvloop", "both"], default=None,
        help="the event loop of every async test: asyncio's, uvloop's, or both (default: "
             "both for the modules of BOTH_LOOPS_MODULES and tests marked both_loops, "
             "asyncio's for the others)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "both_loops: run this async test on asyncio's event loop and on uvloop's "
                   "(each its own case, [asyncio] and [uvloop])")
    if config.getoption("--event-loop") in ("uvloop", "both") and "uvloop" not in LOOPS:
        raise pytest.UsageError("--event-loop: uvloop is not installed")
    # Ctrl-C as at a terminal, whatever started the suite: a shell starts a background job
    # (`pytest ... &` in a script, in a subshell) with SIGINT ignored, which the processes the
    # tests start would inherit, so the tests that press Ctrl-C on them (the launcher, the
    # rendezvous, the bench) would see it ignored. Python's own handler here; the children,
    # after exec, get the default, as from a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_asyncio_loop_factories(
        config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """The loops an async test runs on (pytest-asyncio parametrizes it over them): see
    ``--event-loop``, ``BOTH_LOOPS_MODULES``, ``ASYNCIO_ONLY`` and the ``both_loops`` marker."""
    chosen = config.getoption("--event-loop")
    if getattr(item, "originalname", item.name) in ASYNCIO_ONLY:
        chosen = "asyncio"
    elif chosen is None:
        both = (item.path.name in BOTH_LOOPS_MODULES
                or item.get_closest_marker("both_loops") is not None)
        chosen = "both" if both and "uvloop" in LOOPS else "asyncio"
    if chosen == "both":
        return dict(LOOPS)
    return {chosen: LOOPS[chosen]}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under MPI: skip the mpi cases whose world size is not the job's, the tuning presets
    other than the default (they choose asynccoll's algorithms; MPI picks its own, so each
    case runs once), and MPI_INCOMPATIBLE tests."""
    if MPI_WORLD_SIZE is None:
        return
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend") != "mpi":
            continue
        name = getattr(item, "originalname", item.name)
        world_size = params.get("world_size", MPI_WORLD_SIZE)
        if world_size != MPI_WORLD_SIZE:
            reason = (f"the mpi backend runs on the mpirun world ({MPI_WORLD_SIZE} processes); "
                      f"this case needs {world_size}")
        elif params.get("tuning", "default") != "default":
            reason = ("tuning presets choose asynccoll's own algorithms; MPI chooses its own, "
                      "so the mpi backend runs each case once, with the default preset")
        elif name in MPI_INCOMPATIBLE:
            reason = MPI_INCOMPATIBLE[name]
        else:
            continue
        item.add_marker(pytest.mark.skip(reason=reason))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _pickled(value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception:  # an unpicklable result: its repr still tells what went wrong
        return pickle.dumps(repr(value))


async def _run_mpi(fn: Callable[[Communicator], Awaitable[T]], world_size: int,
                   **kw: Any) -> list[T]:
    """``run_world`` on the mpi backend: ``fn`` on this process's rank only, then every rank's
    result all-gathered (pickled, through mpi4py), so that every process sees the whole list
    as ``run_local`` returns it. If a rank raised, every rank raises (its own error, or the
    first rank's)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world_size != world.Get_size():
        pytest.skip(f"the mpi backend runs on the mpirun world ({world.Get_size()} processes); "
                    f"this case needs {world_size}")
    timeout = kw["timeout"]
    comm = await asynccoll.init(backend="mpi", **kw)
    value: Any = None
    error: BaseException | None = None
    try:
        value = await fn(comm)
    except BaseException as exc:  # pytest.fail raises a BaseException
        if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
            raise
        error = exc
        comm.transport.abort(CollectiveError(f"rank {comm.rank} raised {_describe(exc)}"))
    finally:
        await comm.close()
    # meet the other ranks without blocking the loop, then exchange outcomes (blocking is fine)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2 * timeout + 10
    req = world.Ibarrier()
    while not req.Test():
        if loop.time() > deadline:
            sys.stderr.write(f"rank {world.Get_rank()}: the other ranks never finished the test; "
                             f"aborting the MPI job\n")
            sys.stderr.flush()
            world.Abort(1)
        await asyncio.sleep(0.001)
    mine = (error is None, _pickled(value if error is None else error),
            "" if error is None else _describe(error))
    outcomes = world.allgather(mine)
    failed = [j for j, (ok, _, _) in enumerate(outcomes) if not ok]
    if failed:
        if error is not None and not isinstance(error, CollectiveError):
            raise error
        # the root cause: the first rank whose error is not a consequence of another's
        first = next((j for j in failed if "CollectiveError" not in outcomes[j][2]
                      and "Timeout" not in outcomes[j][2]), failed[0])
        if error is not None and first == world.Get_rank():
            raise error
        raise AssertionError(f"rank {first} raised {outcomes[first][2]}") from error
    return [pickle.loads(data) for _, data, _ in outcomes]


async def run_world(fn: Callable[[Communicator], Awaitable[T]], world_size: int, backend: str,
                    **kw: Any) -> list[T]:
    """``asynccoll.run_local(fn, world_size, backend, **kw)`` with a short default timeout.

    ``backend="mpi"`` (under mpirun only) runs ``fn`` once, on this process's rank, and skips
    the test unless ``world_size`` is the MPI world size.
    """
    kw.setdefault("timeout", DEFAULT_TIMEOUT)
    if backend == "mpi":
        return await _run_mpi(fn, world_size, **kw)
    return await asynccoll.run_local(fn, world_size, backend, **kw)


@pytest.fixture
def run() -> Callable[..., Awaitable[list[Any]]]:
    """The ``run(fn, world_size, backend, **kw)`` helper (see :func:`run_world`)."""
    return run_world


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Every backend of ``BACKENDS`` in turn."""
    return str(request.param)


#: Algorithm presets: the default thresholds, then all bandwidth (ring / chain with 64-byte
#: segments) and all latency (tree / recursive doubling / direct) algorithms.
TUNINGS = {"default": None, "ring": RING, "tree": TREE}


@pytest.fixture(params=list(TUNINGS), ids=list(TUNINGS))
def tuning(request: pytest.FixtureRequest) -> Tuning | None:
    """Every preset of ``TUNINGS`` in turn (``None`` is the default :class:`Tuning`)."""
    return TUNINGS[request.param]


async def settle_until(check: Callable[[], Any], seconds: float = 5.0) -> None:
    """Let the event loop run until ``check()`` holds; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


class LogWatch(logging.Handler):
    """Collects the records of the ``asynccoll`` loggers; lets a test await a message."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._changed.set()

    @property
    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)

    def messages(self, level: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]

    async def wait_for(self, pattern: str, within: float = 3.0) -> re.Match[str]:
        async with asyncio.timeout(within):
            while not (match := re.search(pattern, self.text)):
                self._changed.clear()
                await self._changed.wait()
        return match


@pytest.fixture
def logs() -> Iterator[LogWatch]:
    """Every record of the ``asynccoll`` loggers during the test, DEBUG and up."""
    logger = logging.getLogger("asynccoll")
    watch, level = LogWatch(), logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.DEBUG)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


@pytest.fixture(params=["as installed", "without pause"])
def gather_writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the stdlib selector transports' ``writelines`` as installed, and as
    CPython 3.12 and 3.13.0 ship it on any version: a gather write that leaves bytes in the
    loop's buffer without pausing the protocol (so ``drain()`` returns at once)."""
    if request.param == "without pause":
        import asyncio.selector_events as selector_events

        cls = selector_events._SelectorSocketTransport
        original = cls.writelines

        def writelines_without_pause(self: Any, parts: Any) -> None:
            self._maybe_pause_protocol = lambda: None  # (shadows the method for this call)
            try:
                original(self, parts)
            finally:
                del self._maybe_pause_protocol

        monkeypatch.setattr(cls, "writelines", writelines_without_pause)
    return str(request.param)
