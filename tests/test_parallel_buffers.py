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
from asynccoll.parallel.mesh import Mesh
from asynccoll.parallel.pipeline import SCHEDULES, PipelineParallel, split_sequential
from asynccoll.rendezvous import RendezvousServer

torch = pytest.importorskip("torch")
nn = torch.nn

from asynccoll.parallel.pipeline import TorchStage  # noqa: E402
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


def copy_first_buffers(copies: list[Any]) -> None:
    """Copy the first network's buffers into the others (DDP's broadcast_buffers)."""
    for c in copies[1:]:
        for (_, mine), (_, root) in zip(c.named_buffers(), copies[0].named_buffers(),
                                        strict=True):
            mine.copy_(root)


def reference(world: int, steps: int, *, broadcast: bool) -> list[dict[str, np.ndarray]]:
    """One process, plain torch: a copy of the network per rank, each on its share of every
    batch; the averaged gradient applied to all (torch.optim.SGD); with ``broadcast``, copy 0's
    buffers copied into the others before every forward (DDP's broadcast_buffers).
    Returns every copy's buffers after the last step."""
    copies = [net() for _ in range(world)]
    opts = [torch.optim.SGD(c.parameters(), lr=LR, momentum=MOMENTUM) for c in copies]
    for batch in batches(steps):
        if broadcast:
            copy_first_buffers(copies)
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


# ------------------------------------------------------------------ pipeline stages' buffers

MICRO = 2           # micro-batches of a pipeline pass
PIPE_CUTS = [4]     # stage 0: Linear, BatchNorm1d, Count, Tanh; stage 1: Linear, BatchNorm1d...


def pipe_net(seed: int = 0) -> Any:
    """Two BatchNorms, one per stage once cut at PIPE_CUTS; float64."""
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), Count(), nn.Tanh(),
                           nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(),
                           nn.Linear(5, 3)).double()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.7, 0.7, size=tuple(p.shape))))
    return module


def pipe_reference(data: int, steps: int, *, broadcast: bool) -> list[Any]:
    """One process, plain torch, the network unsplit: a copy per data replica, each running
    its share of every batch as MICRO micro-batches in turn (loss weighted by their sizes),
    the averaged gradient applied to all; with ``broadcast``, copy 0's buffers copied into
    the others before every step. Returns the copies."""
    copies = [pipe_net() for _ in range(data)]
    opts = [torch.optim.SGD(c.parameters(), lr=LR, momentum=MOMENTUM) for c in copies]
    for batch in batches(steps):
        if broadcast:
            copy_first_buffers(copies)
        for r, c in enumerate(copies):
            x, y = split_batch(batch, r, data)
            for xm, ym in zip(np.array_split(x, MICRO), np.array_split(y, MICRO), strict=True):
                loss = nn.MSELoss()(c(torch.from_numpy(xm)), torch.from_numpy(ym))
                (loss * len(xm) / len(x)).backward()
        for params in zip(*(c.parameters() for c in copies), strict=True):
            mean = sum(p.grad for p in params) / data
            for p in params:
                p.grad = mean.clone()
        for o in opts:
            o.step()
            o.zero_grad()
    return copies


async def pipe_train(comm: Communicator, *, data: int, strategy: str | None, steps: int,
                     schedule: str = "1f1b", broadcast: bool = True, seed: int = 0
                     ) -> tuple[Mesh, TorchStage, PipelineParallel, DistributedModel | None]:
    """``data x 2`` ranks: the network cut in two TorchStages, under a DistributedModel over
    the data group (``strategy``), or stepped by the pipeline alone (``None``)."""
    mesh = await Mesh.create(comm, data=data, pipe=2)
    p = mesh.coords.pipe
    part = split_sequential(pipe_net(seed), cuts=PIPE_CUTS)[p]
    stage = TorchStage(part, nn.MSELoss() if p == 1 else None, input_grad=p > 0)
    pp = PipelineParallel(stage, mesh.pipe, micro_batches=MICRO, schedule=schedule)
    dist = None if strategy is None else DistributedModel(
        pp, mesh.data, SGD(lr=LR, momentum=MOMENTUM), strategy=strategy,
        broadcast_buffers=broadcast)
    opt = SGD(lr=LR, momentum=MOMENTUM)
    for batch in batches(steps):
        if dist is None:
            await pp.step(batch, opt)
        else:
            await dist.step(split_batch(batch, mesh.coords.data, data))
    return mesh, stage, pp, dist


@pytest.mark.parametrize(("data", "strategy", "schedule", "broadcast"), [
    (1, None, "1f1b", True), (2, "ddp", "1f1b", True), (2, "zero3", "gpipe", True),
    (2, "zero2", "1f1b", False)])
async def test_pipeline_stage_buffers_follow_the_ddp_rule(
        data: int, strategy: str | None, schedule: str, broadcast: bool) -> None:
    """The buffers of TorchStages (each updated once per micro-batch) are those of the unsplit
    network run on the micro-batches in turn; under a DistributedModel over the data group,
    replica 0's reach the other replicas of the same stage as under torch's DDP (they used
    to drift apart: every replica kept its own)."""
    steps = 3
    assert schedule in SCHEDULES

    async def rank(comm: Communicator) -> tuple[int, dict[str, np.ndarray],
                                                dict[str, np.ndarray], dict[str, np.ndarray]]:
        mesh, stage, pp, dist = await pipe_train(comm, data=data, strategy=strategy,
                                                 steps=steps, schedule=schedule,
                                                 broadcast=broadcast)
        with stage:
            trained = buffers_of(stage.module)
            params = {k: v.copy() for k, v in pp.parameters().items()} if dist is None \
                else await dist.full_parameters()
            stage.module.eval()
            batch = batches(1, seed=9)[0]
            await (pp.loss(batch) if dist is None else dist.loss(batch))
            return mesh.coords.data, trained, params, buffers_of(stage.module)

    got = await run_world(rank, 2 * data, "memory")
    copies = pipe_reference(data, steps, broadcast=broadcast)
    for d, trained, params, _ in got:
        want = buffers_of(copies[d])
        assert_buffers_equal(trained, {n: want[n] for n in trained})
        want_params = {n: p.detach().numpy() for n, p in copies[d].named_parameters()}
        for name, value in params.items():
            np.testing.assert_allclose(value, want_params[name], rtol=1e-9, atol=1e-12)
    stage0 = {d: (trained, evaluated) for d, trained, _, evaluated in got if "1.running_mean"
              in trained}
    assert int(stage0[0][0]["1.num_batches_tracked"]) == steps * MICRO
    assert float(stage0[0][0]["2.seen"]) == steps * BATCH / data
    if data > 1:
        # the shares differ: after the steps, replica 1's statistics are not replica 0's...
        assert not np.allclose(stage0[1][0]["1.running_mean"], stage0[0][0]["1.running_mean"])
        # ...and the next pass starts from replica 0's, or from each replica's own
        if broadcast:
            for name, value in stage0[0][1].items():
                np.testing.assert_array_equal(stage0[1][1][name], value, err_msg=name)
        else:
            assert not np.allclose(stage0[1][1]["1.running_mean"],
                                   stage0[0][1]["1.running_mean"])


async def test_buffer_specs_of_torch_stages() -> None:
    """A TorchStage's buffers are its slice's, named as in the whole network; the pipeline
    over it has the same; a stage without buffers has none."""
    parts = split_sequential(pipe_net(), cuts=PIPE_CUTS)
    with TorchStage(parts[0]) as first, TorchStage(parts[1], nn.MSELoss()) as last:

        async def one(comm: Communicator) -> list[str]:
            pp = PipelineParallel(last, comm, micro_batches=1)
            assert pp.buffers().keys() == last.buffers().keys()
            return [s.name for s in pp.buffer_specs()]

        assert await run_world(one, 1, "memory") == [[s.name for s in last.buffer_specs()]]
        specs = {s.name: s for s in first.buffer_specs()}
        assert sorted(specs) == ["1.num_batches_tracked", "1.running_mean", "1.running_var",
                                 "2.seen"]
        assert not specs["2.seen"].persistent and specs["1.running_var"].persistent
        assert [s.name for s in last.buffer_specs()] == [
            "5.running_mean", "5.running_var", "5.num_batches_tracked"]
        first.buffers()["1.running_var"][:] = 2.0          # views: the module changes
        assert float(parts[0][1].running_var.sum()) == 12.0
    with TorchStage(nn.Sequential(nn.Linear(2, 2))) as plain:
        assert plain.buffer_specs() == [] and plain.buffers() == {}


async def test_pipeline_checkpoint_round_trip_restores_stage_buffers(tmp_path: Path) -> None:
    """A checkpoint per stage (save_checkpoint of the DistributedModel over the pipeline)
    holds the stage's persistent buffers, replica 0's; it loads into a pipeline of another
    shape and strategy, and the stages' checkpoints together into the unsplit network (they
    used to hold no buffers: a resumed run restarted BatchNorm's statistics)."""
    steps = 3

    async def save(comm: Communicator) -> tuple[int, dict[str, np.ndarray]]:
        mesh, stage, _, dist = await pipe_train(comm, data=2, strategy="zero2", steps=steps,
                                                broadcast=False)
        assert dist is not None
        with stage:
            await save_checkpoint(dist, tmp_path / f"stage{mesh.coords.pipe}")
            return mesh.coords.data, buffers_of(stage.module)

    replica0 = {n: v for d, bufs in await run_world(save, 4, "memory") if d == 0
                for n, v in bufs.items()}
    assert sorted(read_buffers(tmp_path / "stage0") or {}) == [
        "1.num_batches_tracked", "1.running_mean", "1.running_var"]  # not the counter
    assert sorted(read_buffers(tmp_path / "stage1") or {}) == [
        "5.num_batches_tracked", "5.running_mean", "5.running_var"]

    async def load(comm: Communicator) -> dict[str, np.ndarray]:
        mesh, stage, _, dist = await pipe_train(comm, data=1, strategy="ddp", steps=0,
                                                 seed=7)
        assert dist is not None
        with stage:
            await load_checkpoint(dist, tmp_path / f"stage{mesh.coords.pipe}")
            return buffers_of(stage.module)

    for bufs in await run_world(load, 2, "memory"):
        for name, value in bufs.items():
            if name != "2.seen":
                np.testing.assert_array_equal(value, replica0[name], err_msg=name)

    # one process, no communicator: both stages' checkpoints into the unsplit network
    want = pipe_reference(2, steps, broadcast=False)[0].eval()
    plain = pipe_net(seed=7)
    model = TorchModel(plain, nn.MSELoss())
    for p in (0, 1):
        load_parameters(tmp_path / f"stage{p}", model)
    model.close()
    plain.eval()
    x = torch.from_numpy(batches(1, seed=5)[0][0])
    with torch.no_grad():
        np.testing.assert_allclose(plain(x).numpy(), want(x).numpy(), rtol=1e-9, atol=1e-12)
