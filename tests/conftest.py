"""Shared test helpers: the backends every collective test runs on, and ``run``.

Collective tests take the backend name as a parameter (the ``backend`` fixture, or
``@pytest.mark.parametrize("backend", BACKENDS)``) and hand it to ``run``, so a new
transport joins the whole suite by being appended to ``BACKENDS``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

import asynccoll
from asynccoll import Communicator
from asynccoll.tuning import RING, TREE, Tuning

T = TypeVar("T")

#: Backends that run several ranks in one event loop (``asynccoll.run_local``).
BACKENDS = ["memory", "tcp"]

#: Per-collective timeout of the communicators ``run`` builds: short, so that a test that
#: would hang fails with CollectiveTimeout long before pytest's own per-test timeout.
DEFAULT_TIMEOUT = 20.0


async def run_world(fn: Callable[[Communicator], Awaitable[T]], world_size: int, backend: str,
                    **kw: Any) -> list[T]:
    """``asynccoll.run_local(fn, world_size, backend, **kw)`` with a short default timeout."""
    kw.setdefault("timeout", DEFAULT_TIMEOUT)
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
