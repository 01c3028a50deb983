"""Elastic training in one process: members of an ElasticGroup as tasks over real loopback
TCP worlds and a real rendezvous server; one crashes, one joins later."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from test_peer_loss import crash

from asynccoll import Communicator
from asynccoll.elastic import ElasticGroup
from asynccoll.parallel import (
    MLP,
    Adam,
    DistributedModel,
    as_distributed,
    train_locally,
)
from asynccoll.parallel.elastic import ElasticTrainer
from asynccoll.rendezvous import RendezvousServer

SIZES = [6, 10, 3]
BATCH = 12


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1]))


def my_share(step: int, comm: Communicator) -> tuple[np.ndarray, ...]:
    return tuple(np.array_split(a, comm.world_size)[comm.rank] for a in batch(step))


async def replay(steps: int, make_opt: Any) -> np.ndarray:
    _, params = await train_locally(MLP(SIZES, seed=0), make_opt(),
                                    (batch(step) for step in range(steps)))
    return params


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
async def test_crash_then_join(strategy: str) -> None:
    total = 90
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    make_opt = lambda: Adam(lr=0.01)  # noqa: E731
    reached = asyncio.Event()

    def build(comm: Communicator) -> DistributedModel:
        return as_distributed(MLP(SIZES, seed=0), comm, make_opt(), strategy=strategy)

    async def step_fn(dist: DistributedModel, step: int) -> float:
        return await dist.step(my_share(step, dist.comm))

    async def member(name: str, crash_at: int | None = None) -> dict[str, Any]:
        group = await ElasticGroup.connect(min_nodes=2, max_nodes=4, rendezvous=rdv, token="t",
                                           settle=0.2, timeout=20)
        try:
            trainer = ElasticTrainer(group, build, commit_every=7)
            await trainer.start()
            while trainer.step < total:
                if crash_at is not None and trainer.step == crash_at:
                    await crash(trainer.comm)
                    return {"name": name, "crashed": True}
                await trainer.run_step(step_fn)
                if trainer.comm.world_size == 2 and trainer.step >= 55:
                    reached.set()
                await asyncio.sleep(0)
            assert trainer.dist is not None
            params, _, _ = await trainer.dist.full_state()
            return {"name": name, "params": params, "history": trainer.history}
        finally:
            await group.close()

    async def late() -> dict[str, Any]:
        await asyncio.wait_for(reached.wait(), 30)
        return await member("late")

    try:
        results = await asyncio.gather(member("a"), member("b"), member("c", crash_at=30),
                                       late())
    finally:
        await server.close()
    want = await replay(total, make_opt)
    finished = [r for r in results if "params" in r]
    assert [r["name"] for r in finished] == ["a", "b", "late"]
    for r in finished:
        np.testing.assert_allclose(r["params"], want, rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(r["params"], finished[0]["params"])
    print({r["name"]: r["history"] for r in finished})
    sizes = [size for _, size, _ in finished[0]["history"]]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, finished[0]["history"]
    # after the crash at step 30 the survivors resumed from the commit of step 28
    assert any(size == 2 and step == 28 for _, size, step in finished[0]["history"]), \
        finished[0]["history"]
    late_hist = finished[2]["history"]
    assert late_hist[0][1] == 3 and late_hist[0][2] >= 55      # joined the running job


async def test_bad_sizes() -> None:
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        with pytest.raises(ValueError, match="min_nodes"):
            await ElasticGroup.connect(min_nodes=3, max_nodes=2,
                                       rendezvous=f"127.0.0.1:{server.port}")
    finally:
        await server.close()
    with pytest.raises(ValueError, match="rendezvous"):
        await ElasticGroup.connect(rendezvous="nohost")
