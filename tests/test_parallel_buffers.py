"""Model buffers (BatchNorm's running statistics...) under the data-parallel wrappers: rank 0's
reach every rank as torch's DDP broadcasts them (``broadcast_buffers=True``), or every rank
keeps its own; checkpoints save rank 0's and load them on every rank."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_world

from asynccoll import Communicator
from asynccoll.elastic import ElasticGroup
from asynccoll.parallel import (
    SGD,
    STRATEGIES,
    DistributedModel,
    as_distributed,
    load_checkpoint,
    load_parameters,
    save_checkpoint,
    split_batch,
)
from asynccoll.parallel.checkpoint import read_buffers
from asynccoll.parallel.elastic import ElasticTrainer
from asynccoll.rendezvous import RendezvousServer

torch = pytest.importorskip("torch")
nn = torch.nn

from asynccoll.parallel.torch_model import TorchModel  # noqa: E402

LR, MOMENTUM = 0.1, 0.9
BATCH = 12


class Count(nn.Module):
    """Counts the samples it saw in training mode, in a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64), persistent=False)

    def forward(self, x: Any) -> Any:
        if self.training:
            self.seen += x.shape[0]
        return x


def net(seed: int = 0, *, track: bool = True) -> Any:
    """Linear, BatchNorm1d, a counter, Tanh, Linear; float64, deterministic parameters."""
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, track_running_stats=track),
                           Count(), nn.Tanh(), nn.Linear(6, 3)).double()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.7, 0.7, size=tuple(p.shape))))
    return module


def batches(steps: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    # shifted inputs: every rank's share has its own statistics
    return [(rng.standard_normal((BATCH, 4)) * 2 + np.arange(BATCH)[:, None] / 3,
             rng.standard_normal((BATCH, 3))) for _ in range(steps)]


def files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def buffers_of(module: Any) -> dict[str, np.ndarray]:
    return {n: b.detach().numpy().copy() for n, b in module.named_buffers()}


def reference(world: int, steps: int, *, broadcast: bool) -> list[dict[str, np.ndarray]]:
    """One process, plain torch: a copy of the network per rank, each on its share of every
    batch; the averaged gradient applied to all (torch.optim.SGD); with ``broadcast``, copy 0's
    buffers copied into the others before every forward (DDP's broadcast_buffers).
    Returns every copy's buffers after the last step."""
    copies = [net() for _ in range(world)]
    opts = [torch.optim.SGD(c.parameters(), lr=LR, momentum=MOMENTUM) for c in copies]
    for batch in batches(steps):
        if broadcast:
            for c in copies[1:]:
                for (_, mine), (_, root) in zip(c.named_buffers(), copies[0].named_buffers(),
                                                strict=True):
                    mine.copy_(root)
        for r, c in enumerate(copies):
            x, y = split_batch(batch, r, world)
            nn.MSELoss()(c(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        for params in zip(*(c.parameters() for c in copies), strict=True):
            mean = sum(p.grad for p in params) / world
            for p in params:
                p.grad = mean.clone()
        for o in opts:
            o.step()
            o.zero_grad()
    return [buffers_of(c) for c in copies]


async def train(comm: Communicator, strategy: str, steps: int, *,
                broadcast: bool = True) -> tuple[DistributedModel, TorchModel]:
    model = TorchModel(net(), nn.MSELoss())
    dist = as_distributed(model, comm, SGD(lr=LR, momentum=MOMENTUM), strategy=strategy,
                          broadcast_buffers=broadcast)
    for batch in batches(steps):
        await dist.step(split_batch(batch, comm.rank, comm.world_size))
    return dist, model


def assert_buffers_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("world", [2, 3])
async def test_buffers_follow_torch_ddp_broadcast_rule(strategy: str, world: int) -> None:
    steps = 4

    async def rank(comm: Communicator) -> tuple[dict[str, np.ndarray], ...]:
        dist, model = await train(comm, strategy, steps)
        trained = buffers_of(model.module)
        model.module.eval()                 # no more updates: the broadcast is all that acts
        await dist.loss(batches(1, seed=9)[0])
        after_loss = buffers_of(model.module)
        model.close()
        return trained, after_loss

    got = await run_world(rank, world, "memory")
    want = reference(world, steps, broadcast=True)
    for r in range(world):
        assert_buffers_equal(got[r][0], want[r])
    # the shares differ: right after its own forward, a rank's statistics are not rank 0's
    assert not np.allclose(got[1][0]["1.running_mean"], got[0][0]["1.running_mean"])
    # the next forward (here an evaluation) starts from rank 0's buffers on every rank
    for r in range(world):
        for name, value in got[0][1].items():
            np.testing.assert_array_equal(got[r][1][name], value, err_msg=name)
    np.testing.assert_array_equal(got[0][1]["1.running_mean"], got[0][0]["1.running_mean"])
    assert int(got[0][1]["1.num_batches_tracked"]) == steps
    assert float(got[0][1]["2.seen"]) == steps * len(split_batch(batches(1)[0], 0, world)[0])


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
async def test_broadcast_buffers_false_leaves_each_rank_its_own(strategy: str) -> None:
    world, steps = 3, 4

    async def rank(comm: Communicator) -> dict[str, np.ndarray]:
        dist, model = await train(comm, strategy, steps, broadcast=False)
        model.module.eval()
        await dist.loss(batches(1, seed=9)[0])          # would broadcast, were it on
        model.close()
        return buffers_of(model.module)

    got = await run_world(rank, world, "memory")
    want = reference(world, steps, broadcast=False)
    for r in range(world):
        assert_buffers_equal(got[r], want[r])
    assert not np.allclose(got[1]["1.running_mean"], got[0]["1.running_mean"])
    # the rule matters: with broadcasting, the buffers come out differently
    assert not np.allclose(want[1]["1.running_mean"],
                           reference(world, steps, broadcast=True)[1]["1.running_mean"])
    assert float(got[1]["2.seen"]) == steps * 4


async def test_buffers_broadcast_over_tcp() -> None:
    world, steps = 2, 3

    async def rank(comm: Communicator) -> dict[str, np.ndarray]:
        _, model = await train(comm, "zero2", steps)
        model.close()
        return buffers_of(model.module)

    got = await run_world(rank, world, "tcp")
    want = reference(world, steps, broadcast=True)
    for r in range(world):
        assert_buffers_equal(got[r], want[r])


class CountingBroadcasts:
    """Wraps ``comm.broadcast`` to record the size of what every call sends."""

    def __init__(self, comm: Communicator) -> None:
        self.calls: list[int] = []
        inner = comm.broadcast

        async def broadcast(array: np.ndarray, root: int = 0) -> np.ndarray:
            self.calls.append(array.nbytes)
            return await inner(array, root=root)

        comm.broadcast = broadcast      # type: ignore[method-assign]

    def take(self) -> int:
        n, self.calls = len(self.calls), []
        return n


async def test_one_broadcast_per_forward_as_ddp_decides() -> None:
    """DDP's rule (require_forward_param_sync): broadcast before a forward that follows a
    training forward outside no_sync (or the first); not after no_sync or an evaluation."""
    batch = batches(1)[0]

    async def rank(comm: Communicator) -> list[int]:
        model = TorchModel(net(), nn.MSELoss())
        dist = as_distributed(model, comm, SGD(lr=LR))
        counter = CountingBroadcasts(comm)
        await dist.start()
        seen = [counter.take()]                          # the parameters
        mine = split_batch(batch, comm.rank, comm.world_size)
        with dist.no_sync():
            await dist.forward_backward(mine)            # first forward: due
            seen.append(counter.take())
        await dist.forward_backward(mine)                # after no_sync: not due
        seen.append(counter.take())
        await dist.optimizer_step()
        await dist.forward_backward(mine)                # after a synced pass: due
        seen.append(counter.take())
        await dist.optimizer_step()
        await dist.loss(mine)                            # due
        seen.append(counter.take())
        await dist.loss(mine)                            # after an evaluation: not due
        seen.append(counter.take())
        await dist.step(mine)                            # not due
        seen.append(counter.take())
        await dist.step(mine)                            # due
        seen.append(counter.take())
        model.close()
        return seen

    assert await run_world(rank, 3, "memory") == [[1, 1, 0, 1, 1, 0, 0, 1]] * 3


async def test_a_model_without_buffers_broadcasts_nothing_more() -> None:
    async def rank(comm: Communicator) -> int:
        module = nn.Sequential(nn.Linear(4, 3)).double()
        dist = as_distributed(TorchModel(module, nn.MSELoss()), comm, SGD(lr=LR))
        counter = CountingBroadcasts(comm)
        for batch in batches(3):
            await dist.step(split_batch(batch, comm.rank, comm.world_size))
        return counter.take()

    assert await run_world(rank, 2, "memory") == [1, 1]     # the parameters, at the start


@pytest.mark.parametrize(("saved", "loaded"), [("zero2", "ddp"), ("ddp", "zero3")])
async def test_checkpoint_round_trip_restores_buffers(tmp_path: Path, saved: str,
                                                      loaded: str) -> None:
    x = batches(1, seed=5)[0][0]

    async def save(comm: Communicator) -> np.ndarray:
        dist, model = await train(comm, saved, 3)
        model.module.eval()
        before = model.predict(x)
        await save_checkpoint(dist, tmp_path)
        model.close()
        return before

    before = (await run_world(save, 3, "memory"))[0]      # rank 0's model is what is saved

    async def load(comm: Communicator) -> tuple[np.ndarray, np.ndarray]:
        model = TorchModel(net(seed=7), nn.MSELoss())
        model.module.eval()
        fresh = model.predict(x)
        dist = as_distributed(model, comm, SGD(lr=LR, momentum=MOMENTUM), strategy=loaded)
        await load_checkpoint(dist, tmp_path)
        if loaded == "zero3":
            # the parameters live in shards: gather them into the module to predict
            for name, value in (await dist.full_parameters()).items():
                model.bind(params={name: value})
        after = model.predict(x)
        model.close()
        return fresh, after

    for fresh, after in await run_world(load, 2, "memory"):
        assert not np.allclose(fresh, before)
        np.testing.assert_array_equal(after, before)

    # one process, no communicator: the same model
    plain = net(seed=7)
    load_parameters(tmp_path, TorchModel(plain, nn.MSELoss()))
    plain.eval()
    with torch.no_grad():
        np.testing.assert_array_equal(plain(torch.from_numpy(x)).numpy(), before)
    saved_buffers = read_buffers(tmp_path)
    assert saved_buffers is not None
    assert sorted(saved_buffers) == ["1.num_batches_tracked", "1.running_mean",
                                     "1.running_var"]     # not the non-persistent counter


async def test_checkpoint_saves_rank0s_buffers_once(tmp_path: Path) -> None:
    async def rank(comm: Communicator) -> dict[str, np.ndarray]:
        dist, model = await train(comm, "zero1", 2, broadcast=False)
        await save_checkpoint(dist, tmp_path)
        model.close()
        return buffers_of(model.module)

    got = await run_world(rank, 3, "memory")
    saved = read_buffers(tmp_path)
    assert saved is not None
    for name, value in saved.items():
        np.testing.assert_array_equal(value, got[0][name])
    assert not np.allclose(saved["1.running_mean"], got[1]["1.running_mean"])
    tag = json.loads((tmp_path / "meta.json").read_text())["files"]
    assert [n for n in files(tmp_path) if "buffer" in n] == [f"buffers-{tag}.npz"]


async def test_checkpoint_without_buffers_loads_and_leaves_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def save(comm: Communicator) -> None:
        dist, model = await train(comm, "ddp", 2)
        await save_checkpoint(dist, tmp_path)
        model.close()

    await run_world(save, 2, "memory")
    # as an older asynccoll wrote it: no buffers in meta.json, no buffers.npz
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["buffers"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / f"buffers-{meta['files']}.npz").unlink()
    assert read_buffers(tmp_path) is None

    async def load(comm: Communicator) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        model = TorchModel(net(seed=7), nn.MSELoss())
        mine = buffers_of(model.module)
        dist = as_distributed(model, comm, SGD(lr=LR, momentum=MOMENTUM))
        await load_checkpoint(dist, tmp_path)
        model.close()
        return mine, buffers_of(model.module)

    with caplog.at_level(logging.WARNING, "asynccoll.parallel.checkpoint"):
        got = await run_world(load, 2, "memory")
    for before, after in got:
        for name in before:
            np.testing.assert_array_equal(after[name], before[name])
    assert sum("holds no model buffers" in r.getMessage() for r in caplog.records) == 1


async def test_checkpoint_buffers_must_fit_the_model(tmp_path: Path) -> None:
    async def save(comm: Communicator) -> None:
        dist, model = await train(comm, "ddp", 1)
        await save_checkpoint(dist, tmp_path)
        model.close()

    await run_world(save, 2, "memory")

    async def load(comm: Communicator) -> None:
        # the same parameters, but a BatchNorm without running statistics
        model = TorchModel(net(track=False), nn.MSELoss())
        before = copy.deepcopy(model.parameters())
        dist = as_distributed(model, comm, SGD(lr=LR, momentum=MOMENTUM))
        try:
            with pytest.raises(ValueError, match=r"unexpected.*running_mean"):
                await load_checkpoint(dist, tmp_path)
            for name, value in model.parameters().items():     # nothing was loaded
                np.testing.assert_array_equal(value, before[name])
        finally:
            model.close()

    await run_world(load, 2, "memory")


def test_buffer_specs_of_a_torch_model() -> None:
    model = TorchModel(net(), nn.MSELoss())
    specs = {s.name: s for s in model.buffer_specs()}
    assert sorted(specs) == ["1.num_batches_tracked", "1.running_mean", "1.running_var",
                             "2.seen"]
    assert specs["1.running_mean"].shape == (6,) and specs["1.running_mean"].persistent
    assert specs["1.num_batches_tracked"].dtype == np.int64
    assert not specs["2.seen"].persistent
    # views, not copies: writing into them changes the module
    model.buffers()["1.running_mean"][:] = 3.0
    assert float(model.module[1].running_mean.sum()) == 18.0
    model.close()


@pytest.mark.timeout(60)
async def test_elastic_join_restores_the_committed_buffers() -> None:
    """A process joining a running job gets the job's buffers (rank 0's at the commit), not
    its fresh model's: whichever rank it becomes, the statistics go on from where they were."""
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    total, join_after = 10, 4
    reached = asyncio.Event()
    first_seen: dict[str, tuple[int, dict[str, np.ndarray]]] = {}

    def build(comm: Communicator) -> DistributedModel:
        return as_distributed(TorchModel(net(), nn.MSELoss()), comm, SGD(lr=LR))

    async def member(name: str) -> None:
        group = await ElasticGroup.connect(min_nodes=2, max_nodes=3, rendezvous=rdv,
                                           token="t", settle=0.2, timeout=20)

        async def step_fn(dist: DistributedModel, step: int) -> float:
            if name not in first_seen:
                first_seen[name] = (step, dist.local_buffers())
            batch = batches(1, seed=step)[0]
            return await dist.step(split_batch(batch, dist.comm.rank, dist.comm.world_size))

        try:
            trainer = ElasticTrainer(group, build, commit_every=3)
            await trainer.start()
            while trainer.step < total:
                await trainer.run_step(step_fn)
                if trainer.step >= join_after:
                    reached.set()
                await asyncio.sleep(0)
            assert trainer.dist is not None
            trainer.dist.model.close()          # type: ignore[attr-defined]
        finally:
            await group.close()

    async def late() -> None:
        await asyncio.wait_for(reached.wait(), 30)
        await member("late")

    try:
        await asyncio.gather(member("a"), member("b"), late())
    finally:
        await server.close()
    step, bufs = first_seen["late"]
    assert step >= join_after
    assert int(bufs["1.num_batches_tracked"]) == step       # rank 0's forwards so far
    assert not np.allclose(bufs["1.running_mean"], 0.0)      # not a fresh BatchNorm's
