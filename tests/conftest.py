"""Shared test helpers: the backends every collective test runs on, and ``run``.

Collective tests take the backend name as a parameter (the ``backend`` fixture, or
``@pytest.mark.parametrize("backend", BACKENDS)``) and hand it to ``run``, so a new
transport joins the whole suite by being appended to ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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
