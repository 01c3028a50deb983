"""A rank of a training wrapper that fails mid-step: every other rank raises the
Communicator's errors (``CollectiveError`` / ``PeerLostError``), at once, never an
``ExceptionGroup`` and never only at its timeout."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from conftest import run_world

from asynccoll import CollectiveError, Communicator
from asynccoll.parallel import MLP, SGD, DistributedModel, Hooks
from asynccoll.parallel.mesh import Mesh
from asynccoll.parallel.tensor import TensorParallelMLP

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


@pytest.mark.parametrize("backend", ["memory", "tcp"])
async def test_a_failed_pass_breaks_the_model_parallel_groups(backend: str) -> None:
    """``DistributedModel`` over a tensor-parallel model with a data group of one rank
    (``Mesh.create(comm, tensor=2)``): a rank whose model raised broke only its data group,
    which has no peer, and the other tensor rank waited in its all_reduce for the timeout
    while the failed rank went on living (it caught the error)."""

    async def rank(comm: Communicator) -> tuple[str, float]:
        mesh = await Mesh.create(comm, tensor=2)
        tp = TensorParallelMLP(SIZES, mesh.tensor, seed=0)
        dist = DistributedModel(tp, mesh.data, SGD(lr=0.1))
        await dist.step(_batch(0))
        start = time.monotonic()
        if comm.rank == 1:
            async def fail(x: np.ndarray, hooks: Hooks | None = None) -> list[np.ndarray]:
                raise RuntimeError("the model failed")
            tp.forward = fail  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="the model failed"):
                await dist.step(_batch(1))
            await asyncio.sleep(TIMEOUT * 0.75)   # alive, its communicator open
            return "caught", 0.0
        try:
            await dist.step(_batch(1))
        except CollectiveError as exc:
            return type(exc).__name__, time.monotonic() - start
        return "no error", time.monotonic() - start

    (name, took), caught = await run_world(rank, 2, backend, timeout=TIMEOUT)
    assert caught[0] == "caught"
    assert name == "CollectiveError", (name, took)
    assert took < TIMEOUT / 2, (name, took)
