"""A rank of a training wrapper that fails mid-step: every other rank raises the
Communicator's errors (``CollectiveError`` / ``PeerLostError``), at once, never an
``ExceptionGroup`` and never only at its timeout."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from conftest import run_world

from asynccoll import Communicator
from asynccoll.parallel import MLP, SGD, DistributedModel, Hooks

SIZES = [5, 7, 4, 3]
#: the communicators' timeout: a rank that raised only at it was not told of the failure
TIMEOUT = 4.0


class _Raising(MLP):
    """An MLP whose forward raises once ``armed`` (on the rank that fails)."""

    armed = False

    async def forward_backward(self, batch: Any, hooks: Hooks | None = None) -> float:
        if self.armed:
            raise RuntimeError("the model failed")
        return await super().forward_backward(batch, hooks)


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((6, SIZES[0])), rng.standard_normal((6, SIZES[-1]))


async def _fail_second_step(dist: DistributedModel, model: _Raising, comm: Communicator,
                            bad_rank: int) -> tuple[str, float]:
    """One good step, then rank ``bad_rank``'s model raises in the next one: what each rank
    raised, and how long it took."""
    await dist.step(_batch(0))
    model.armed = comm.rank == bad_rank
    start = time.monotonic()
    try:
        await dist.step(_batch(1))
    except BaseException as exc:  # (an ExceptionGroup is what this looks for)
        return type(exc).__name__, time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("backend", ["memory", "tcp"])
@pytest.mark.parametrize("method", ["int8", "bf16", "topk:0.3"])
async def test_compressed_exchange_raises_collective_error_not_a_group(backend: str,
                                                                     method: str) -> None:
    """int8, bf16 and top-k gather two arrays at once; when a rank failed, both gathers
    raised and the other ranks got ``ExceptionGroup`` (which ``except CollectiveError``
    does not catch) instead of ``CollectiveError``."""

    async def rank(comm: Communicator) -> tuple[str, float]:
        model = _Raising(SIZES, seed=1)
        dist = DistributedModel(model, comm, SGD(lr=0.1), compression=method)
        return await _fail_second_step(dist, model, comm, bad_rank=0)

    got = await run_world(rank, 3, backend, timeout=TIMEOUT)
    assert got[0][0] == "RuntimeError"
    for name, took in got[1:]:
        assert name == "CollectiveError", got
        assert took < TIMEOUT / 2, got
