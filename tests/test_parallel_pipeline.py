"""Pipeline parallelism: any number of stages, either schedule and any number of micro-batches
train exactly like one process on the whole batch; 1F1B holds fewer activations than GPipe;
data parallel over pipeline parallel works through the Model interface; failures reach every
stage; stages are cut as asked."""

from __future__ import annotations

import asyncio
import itertools
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import BACKENDS, run_world
from test_launcher import REPO, clean_env

from asynccoll import CollectiveError, Communicator
from asynccoll.parallel import (
    MLP,
    SGD,
    Adam,
    DistributedModel,
    Optimizer,
    split_batch,
    train_locally,
)
from asynccoll.parallel.mesh import Mesh
from asynccoll.parallel.pipeline import (
    SCHEDULES,
    MLPStage,
    PipelineParallel,
    balanced_cuts,
    schedule_ops,
    split_mlp,
    split_sequential,
    timeline,
)

SIZES = [5, 8, 7, 6, 4, 3]        # 5 layers: up to 5 stages
BATCH = 10                        # 3 and 8 micro-batches are uneven, 2 x 2 even
STEPS = 3

OPTIMIZERS: dict[str, Callable[[], Optimizer]] = {
    "sgd": lambda: SGD(lr=0.05, momentum=0.9),
    "adam": lambda: Adam(lr=0.01),
}


def batches(steps: int = STEPS, seed: int = 1, sizes: list[int] = SIZES
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, sizes[0])), rng.standard_normal((BATCH, sizes[-1])))
            for _ in range(steps)]


async def reference(opt: Optimizer, data: list[Any], **mlp_kw: Any
                    ) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process, whole batches: the losses and the final parameters."""
    model = MLP(mlp_kw.pop("sizes", SIZES), seed=3, **mlp_kw)
    losses, _ = await train_locally(model, opt, data)
    return losses, {k: v.copy() for k, v in model.parameters().items()}


def check_against(results: list[tuple[list[float], dict[str, np.ndarray]]],
                  want_losses: list[float], want: dict[str, np.ndarray]) -> None:
    merged: dict[str, np.ndarray] = {}
    for losses, params in results:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        assert not set(merged) & set(params), "two stages own one parameter"
        merged.update(params)
    assert set(merged) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(merged[name], value, rtol=1e-6, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 8])
async def test_equivalent_to_one_process(backend: str, stages: int, schedule: str,
                                         micro_batches: int) -> None:
    opt = "adam" if micro_batches in (3, 8) and stages != 3 else "sgd"
    data = batches()
    want_losses, want = await reference(OPTIMIZERS[opt](), data)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        stage = split_mlp(MLP(SIZES, seed=3), comm.world_size)[comm.rank]
        pp = PipelineParallel(stage, comm, micro_batches=micro_batches, schedule=schedule)
        optimizer = OPTIMIZERS[opt]()
        losses = [await pp.step(batch, optimizer) for batch in data]
        assert pp.held_activations == 0 and stage.held == 0
        return losses, {k: v.copy() for k, v in pp.parameters().items()}

    check_against(await run_world(rank, stages, backend), want_losses, want)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_cross_entropy_relu_and_partial_batches(backend: str) -> None:
    """Other loss and activation; each stage is given only the part of the batch it reads."""
    sizes = [6, 9, 8, 5]
    rng = np.random.default_rng(4)
    data = [(rng.standard_normal((BATCH, 6)), rng.integers(0, 5, BATCH)) for _ in range(STEPS)]
    kw = {"activation": "relu", "loss": "cross_entropy"}
    want_losses, want = await reference(OPTIMIZERS["sgd"](), data, sizes=sizes, **kw)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        stage = split_mlp(MLP(sizes, seed=3, **kw), cuts=[1, 2])[comm.rank]
        pp = PipelineParallel(stage, comm, micro_batches=3)
        optimizer = OPTIMIZERS["sgd"]()
        losses = []
        for x, y in data:
            part = (x, None) if pp.is_first else (None, y) if pp.is_last else None
            losses.append(await pp.step(part, optimizer))
        return losses, {k: v.copy() for k, v in pp.parameters().items()}

    check_against(await run_world(rank, 3, backend), want_losses, want)


class CountingStage(MLPStage):
    """Records the most micro-batches the stage itself held activations for."""

    most = 0

    async def forward(self, mb: int, x: np.ndarray, *, grad: bool = True) -> np.ndarray:
        y = await super().forward(mb, x, grad=grad)
        self.most = max(self.most, self.held)
        return y


@pytest.mark.parametrize("backend", BACKENDS)
async def test_1f1b_holds_fewer_activations_than_gpipe(backend: str) -> None:
    async def rank(comm: Communicator, schedule: str) -> tuple[int, int, list[str]]:
        mlp = MLP(SIZES, seed=3)
        a, b = [(0, 2), (2, 3), (3, 4), (4, 5)][comm.rank]
        stage = CountingStage(mlp, a, b)
        pp = PipelineParallel(stage, comm, micro_batches=8, schedule=schedule)
        for batch in batches(2):
            await pp.forward_backward(batch)
        return pp.peak_activations, stage.most, pp.trace

    gpipe = await run_world(lambda c: rank(c, "gpipe"), 4, backend)
    fused = await run_world(lambda c: rank(c, "1f1b"), 4, backend)
    assert [peak for peak, _, _ in gpipe] == [8, 8, 8, 8]
    assert [peak for peak, _, _ in fused] == [4, 3, 2, 1]
    for schedule, results in (("gpipe", gpipe), ("1f1b", fused)):
        for s, (peak, most, trace) in enumerate(results):
            assert peak == most, "the pipeline's count is what the stage held"
            assert trace == [f"{k}{j}" for k, j in schedule_ops(schedule, s, 4, 8)]
    assert all(f[0] < g[0] for f, g in zip(fused, gpipe, strict=True))


class RecordingHooks:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def before_forward(self, unit: int) -> None:
        self.log.append(f"bf{unit}")

    async def after_forward(self, unit: int) -> None:
        self.log.append(f"af{unit}")

    async def before_backward(self, unit: int) -> None:
        self.log.append(f"bb{unit}")

    async def after_backward(self, unit: int) -> None:
        self.log.append(f"ab{unit}")


@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_hooks_at_pass_granularity(schedule: str) -> None:
    async def rank(comm: Communicator) -> tuple[list[str], list[str], list[str]]:
        stage = split_mlp(MLP(SIZES, seed=3), cuts=[3])[comm.rank]   # 3 and 2 units
        pp = PipelineParallel(stage, comm, micro_batches=4, schedule=schedule)
        log: list[str] = []
        await pp.forward_backward(batches(1)[0], RecordingHooks(log))
        train = pp.trace
        evaluation: list[str] = []
        await pp.loss(batches(1)[0], RecordingHooks(evaluation))
        return log, train, evaluation

    for r, (log, trace, evaluation) in enumerate(await run_world(rank, 2, "memory")):
        k = 3 if r == 0 else 2
        forward = [f"bf{u}" for u in range(k)]
        switch = [f"af{u}" for u in range(k)] + [f"bb{u}" for u in reversed(range(k))]
        end = [f"ab{u}" for u in reversed(range(k))]
        assert log == forward + switch + end, log
        assert evaluation == forward + [f"af{u}" for u in range(k)]
        first_backward = trace.index("B0")
        assert all(op.startswith("F") for op in trace[:first_backward])
        # with 1F1B, forwards after the switch run inside the backward window
        assert any(op.startswith("F") for op in trace[first_backward:]) == (schedule == "1f1b")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_data_parallel_over_pipeline(backend: str, strategy: str, schedule: str) -> None:
    """4 ranks as data=2 x pipe=2: DistributedModel(PipelineParallel) == one process."""
    data = batches()
    want_losses, want = await reference(OPTIMIZERS["sgd"](), data)

    async def rank(comm: Communicator) -> tuple[int, list[float], dict[str, np.ndarray]]:
        mesh = await Mesh.create(comm, data=2, pipe=2)
        stage = split_mlp(MLP(SIZES, seed=3 if mesh.coords.data == 0 else 7), 2)[
            mesh.coords.pipe]                       # replica 0's initial parameters win
        pp = PipelineParallel(stage, mesh.pipe, micro_batches=2, schedule=schedule)
        dist = DistributedModel(pp, mesh.data, OPTIMIZERS["sgd"](), strategy=strategy)
        losses = [await dist.step(split_batch(batch, mesh.coords.data, 2)) for batch in data]
        return mesh.coords.data, losses, await dist.full_parameters()

    got = await run_world(rank, 4, backend)
    halves = [np.array(losses) for d, losses, _ in got if d == 0][:1] + \
             [np.array(losses) for d, losses, _ in got if d == 1][:1]
    np.testing.assert_allclose((halves[0] + halves[1]) / 2, want_losses, rtol=1e-6)
    for d in (0, 1):
        check_against([(want_losses, p) for dd, _, p in got if dd == d], want_losses, want)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_failing_stage_fails_every_stage(backend: str) -> None:
    """The failing stage gets its own error; the others a CollectiveError at once, though
    the failing rank stays alive (it broke the pipe group, nobody waits for a timeout)."""
    class Faulty(MLPStage):
        fail = False

        async def forward(self, mb: int, x: np.ndarray, *, grad: bool = True) -> np.ndarray:
            if self.fail and mb == 2:
                raise RuntimeError("boom")
            return await super().forward(mb, x, grad=grad)

    async def rank(comm: Communicator) -> tuple[str, str, float]:
        mlp = MLP(SIZES, seed=3)
        a, b = [(0, 2), (2, 3), (3, 5)][comm.rank]
        stage = Faulty(mlp, a, b)
        pp = PipelineParallel(stage, comm, micro_batches=4)
        await pp.step(batches(1)[0], SGD(lr=0.1))
        stage.fail = comm.rank == 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await pp.step(batches(1)[0], SGD(lr=0.1))
        except Exception as exc:
            elapsed = loop.time() - start
            await asyncio.sleep(0.5 if comm.rank == 1 else 0)      # stay alive a while
            return type(exc).__name__, str(exc), elapsed
        raise AssertionError("the pass should have failed")

    got = await run_world(rank, 3, backend, timeout=20)
    assert got[1][:2] == ("RuntimeError", "boom")
    for name, _, elapsed in (got[0], got[2]):
        assert name in ("CollectiveError", "PeerLostError"), got
        assert elapsed < 5, got


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_cancelled_stage_fails_every_stage(backend: str) -> None:
    """A pass cancelled on one stage while it computes (no operation of its own pending)
    breaks the pipe group too: the others raise at once, not after the timeout."""
    class Slow(MLPStage):
        slow = False

        async def forward(self, mb: int, x: np.ndarray, *, grad: bool = True) -> np.ndarray:
            if self.slow and mb == 1:
                await asyncio.sleep(30)
            return await super().forward(mb, x, grad=grad)

    async def rank(comm: Communicator) -> tuple[str, float]:
        mlp = MLP(SIZES, seed=3)
        a, b = [(0, 2), (2, 3), (3, 5)][comm.rank]
        stage = Slow(mlp, a, b)
        pp = PipelineParallel(stage, comm, micro_batches=4)
        await pp.step(batches(1)[0], SGD(lr=0.1))
        stage.slow = comm.rank == 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            async with asyncio.timeout(0.3 if comm.rank == 1 else None):
                await pp.step(batches(1)[0], SGD(lr=0.1))
        except Exception as exc:
            elapsed = loop.time() - start
            await asyncio.sleep(0.5 if comm.rank == 1 else 0)      # stay alive a while
            return type(exc).__name__, elapsed
        raise AssertionError("the pass should have failed")

    got = await run_world(rank, 3, backend, timeout=20)
    assert got[1][0] == "TimeoutError", got
    for name, elapsed in (got[0], got[2]):
        assert name in ("CollectiveError", "PeerLostError"), got
        assert elapsed < 5, got


async def test_batches_and_stages_that_do_not_fit() -> None:
    async def rank(comm: Communicator) -> list[str]:
        stages = split_mlp(MLP(SIZES, seed=3), 3)
        with pytest.raises(ValueError, match="micro_batches"):
            PipelineParallel(stages[comm.rank], comm, micro_batches=0)
        with pytest.raises(ValueError, match="schedule"):
            PipelineParallel(stages[comm.rank], comm, micro_batches=2, schedule="zb-h1")
        # stage 2 is not a last stage on rank 1: every rank refuses, at the first pass
        wrong = PipelineParallel(stages[2 - comm.rank], comm, micro_batches=2)
        with pytest.raises(ValueError, match="loss; only the last stage"):
            await wrong.forward_backward(batches(1)[0])
        mismatched = PipelineParallel(stages[comm.rank], comm, micro_batches=2 + comm.rank)
        with pytest.raises(ValueError, match="disagree"):
            await mismatched.forward_backward(batches(1)[0])
        # 3 samples, 4 micro-batches: the stages that read data refuse, the middle one
        # learns it from the broken group
        pp = PipelineParallel(stages[comm.rank], comm, micro_batches=4)
        x, y = batches(1)[0]
        try:
            await pp.forward_backward((x[:3], y[:3]))
        except (ValueError, CollectiveError) as exc:
            return [type(exc).__name__, str(exc)]
        return []

    got = await run_world(rank, 3, "memory")
    assert got[0][0] == got[2][0] == "ValueError" and "cannot be split" in got[0][1], got
    assert got[1][0] == "CollectiveError", got


def test_balanced_cuts_are_optimal() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 8))
        costs = [float(c) for c in rng.integers(0, 20, n)]
        for stages in range(1, n + 1):
            cuts = balanced_cuts(costs, stages)
            edges = [0, *cuts, n]
            got = max(sum(costs[a:b]) for a, b in itertools.pairwise(edges))
            best = min(max(sum(costs[a:b]) for a, b in itertools.pairwise([0, *c, n]))
                       for c in itertools.combinations(range(1, n), stages - 1))
            assert got == best and len(cuts) == stages - 1
            assert all(a < b for a, b in itertools.pairwise(edges))


def test_split_mlp() -> None:
    mlp = MLP([10, 40, 40, 2, 2, 2], seed=0)          # layer 0: 440, 1: 1640, 2..4: 82, 6, 6
    stages = split_mlp(mlp, 2)
    assert [(s.start, s.stop) for s in stages] == [(0, 1), (1, 5)]
    assert [(s.start, s.stop) for s in split_mlp(mlp, 2, balance="layers")] == [(0, 2), (2, 5)]
    assert [(s.start, s.stop) for s in split_mlp(mlp, cuts=[1, 4])] == [(0, 1), (1, 4), (4, 5)]
    assert stages[1].parameters()["layers.1.weight"] is mlp.parameters()["layers.1.weight"]
    assert [s.unit for s in stages[1].param_specs()] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert stages[1].computes_loss and not stages[0].computes_loss
    for bad in ([2, 2], [0, 2], [1, 5], [3, 1]):
        with pytest.raises(ValueError, match="cut points"):
            split_mlp(mlp, cuts=bad)
    with pytest.raises(ValueError, match="non-empty"):
        split_mlp(mlp, 6)
    with pytest.raises(ValueError, match="3 stages need 2"):
        split_mlp(mlp, 3, cuts=[2])
    with pytest.raises(ValueError, match="balance"):
        split_mlp(mlp, 2, balance="flops")


def test_timeline_shows_the_bubble_and_the_peaks() -> None:
    text = timeline("gpipe", 4, 4)
    assert text.splitlines()[0].startswith("stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0")
    assert [int(m) for m in re.findall(r"peak (\d+)", timeline("1f1b", 4, 8))] == [4, 3, 2, 1]
    assert [int(m) for m in re.findall(r"peak (\d+)", timeline("gpipe", 4, 8))] == [8] * 4


def torch_net(seed: int) -> Any:
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6),
                               torch.nn.ReLU(), torch.nn.Linear(6, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 3)).double()


def torch_reference(data: list[Any]) -> tuple[list[float], dict[str, np.ndarray]]:
    """Plain torch on the whole network and batches (SGD, momentum 0.9): the losses and the
    final parameters."""
    import torch

    net = torch_net(0)
    ref = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        ref.zero_grad()
        loss = torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        ref.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().numpy().copy() for k, v in net.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_torch_stages_equal_plain_torch(backend: str, schedule: str) -> None:
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.pipeline import TorchStage

    data = batches(sizes=[5, 3])
    want_losses, want = torch_reference(data)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        parts = split_sequential(torch_net(0), comm.world_size)
        last = comm.rank == comm.world_size - 1
        with TorchStage(parts[comm.rank], torch.nn.functional.mse_loss if last else None,
                        input_grad=comm.rank > 0) as stage:
            pp = PipelineParallel(stage, comm, micro_batches=3, schedule=schedule)
            optimizer = SGD(lr=0.05, momentum=0.9)
            losses = [await pp.step(batch, optimizer) for batch in data]
            return losses, {k: v.copy() for k, v in pp.parameters().items()}

    got = await run_world(rank, 3, backend)
    assert [sorted(p) for _, p in got] == [["0.bias", "0.weight"], ["2.bias", "2.weight"],
                                           ["4.bias", "4.weight", "6.bias", "6.weight"]]
    check_against(got, want_losses, want)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("schedule", SCHEDULES)
async def test_data_parallel_over_torch_stages(strategy: str, schedule: str) -> None:
    """4 ranks as data=2 x pipe=2 of TorchStages under a DistributedModel == plain torch on
    the whole batch. ZeRO-3 used to fail at construction: releasing a parameter (an empty
    ``.data``) kept its ``.grad`` of the full shape, which torch refuses."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.pipeline import TorchStage

    data = batches(sizes=[5, 3])
    want_losses, want = torch_reference(data)

    async def rank(comm: Communicator) -> tuple[int, list[float], dict[str, np.ndarray]]:
        mesh = await Mesh.create(comm, data=2, pipe=2)
        p = mesh.coords.pipe
        with TorchStage(split_sequential(torch_net(0), 2)[p],
                        torch.nn.functional.mse_loss if p == 1 else None,
                        input_grad=p > 0) as stage:
            pp = PipelineParallel(stage, mesh.pipe, micro_batches=2, schedule=schedule)
            dist = DistributedModel(pp, mesh.data, SGD(lr=0.05, momentum=0.9),
                                    strategy=strategy)
            losses = [await dist.step(split_batch(b, mesh.coords.data, 2)) for b in data]
            return mesh.coords.data, losses, await dist.full_parameters()

    got = await run_world(rank, 4, "memory")
    means = np.mean([losses for _, losses, _ in got], axis=0)   # each replica's twice
    np.testing.assert_allclose(means, want_losses, rtol=1e-9)
    params: dict[str, np.ndarray] = {}
    for _, _, mine in got:
        params.update(mine)
    assert sorted(params) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


async def test_torch_stage_refuses_what_it_cannot_run() -> None:
    """As a TorchModel: a parameter NumPy has no dtype for is a TypeError naming it, one off
    the CPU a ValueError, a loss_fn that is not a scalar a ValueError naming loss_fn (they
    were torch's and NumPy's own messages: 'Got unsupported ScalarType BFloat16', 'grad can
    be implicitly created only for scalar outputs')."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.pipeline import TorchStage

    with pytest.raises(TypeError, match=r"parameter 'weight' has dtype torch.bfloat16"):
        TorchStage(torch.nn.Linear(2, 2).bfloat16())
    with pytest.raises(ValueError, match=r"parameter 'weight' is on meta; TorchStage needs CPU"):
        TorchStage(torch.nn.Linear(2, 2, device="meta"))

    async def rank(comm: Communicator) -> list[str]:
        errors = []
        with TorchStage(torch.nn.Linear(2, 2).double(), torch.nn.MSELoss(reduction="none"),
                        input_grad=False) as stage:
            batch = (np.ones((4, 2)), np.zeros((4, 2)))
            for train in (True, False):
                pp = PipelineParallel(stage, comm, micro_batches=2)
                with pytest.raises(ValueError, match="loss_fn must return a scalar") as info:
                    await (pp.step(batch, SGD(lr=0.1)) if train else pp.loss(batch))
                errors.append(str(info.value))
        return errors

    assert len((await run_world(rank, 1, "memory"))[0]) == 2


@pytest.mark.parametrize("wrapped", ["step", "zero3"])
async def test_a_frozen_first_torch_stage(wrapped: str) -> None:
    """Fine-tuning with the first stage frozen whole (requires_grad=False): its output needs
    no gradient, its backward has nothing to do, and the later stages train as in torch (it
    raised torch's 'element 0 of tensors does not require grad' and broke the pipeline)."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.pipeline import TorchStage

    data = batches(sizes=[5, 3])

    def frozen_net() -> Any:
        net = torch_net(0)
        net[0].requires_grad_(False)
        return net

    net = frozen_net()
    ref = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05,
                          momentum=0.9)
    want_losses = []
    for x, y in data:
        ref.zero_grad()
        loss = torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        ref.step()
        want_losses.append(float(loss.detach()))
    want = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        mesh = await Mesh.create(comm, pipe=3)
        p = mesh.coords.pipe
        with TorchStage(split_sequential(frozen_net(), 3)[p],
                        torch.nn.functional.mse_loss if p == 2 else None,
                        input_grad=p > 0) as stage:
            pp = PipelineParallel(stage, mesh.pipe, micro_batches=2)
            optimizer = SGD(lr=0.05, momentum=0.9)
            if wrapped == "step":
                losses = [await pp.step(batch, optimizer) for batch in data]
                return losses, {k: v.copy() for k, v in pp.parameters().items()}
            dist = DistributedModel(pp, mesh.data, optimizer, strategy=wrapped)
            losses = [await dist.step(batch) for batch in data]
            return losses, await dist.full_parameters()

    got = await run_world(rank, 3, "memory")
    assert sorted(got[0][1]) == ["0.bias", "0.weight"]
    check_against(got, want_losses, want)


@pytest.mark.parametrize("wrapped", ["step", "zero2"])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
async def test_frozen_torch_stage_parameters_stay_as_they_are(wrapped: str, opt: str) -> None:
    """Parameters of a TorchStage with requires_grad=False are left as they are, state
    included, as torch.optim leaves them, by ``PipelineParallel.step`` and by a data-parallel
    wrapper over the pipeline, under a weight decay that would shrink them (AdamW's default);
    they used to decay. Unfrozen halfway (SGD, whose state has no step count), they train
    from then on, as in torch."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel import AdamW
    from asynccoll.parallel.pipeline import TorchStage

    hyper = {"lr": 0.05, "weight_decay": 0.5}
    if opt == "sgd":
        hyper["momentum"] = 0.9
    ours = {"adamw": AdamW, "sgd": SGD}[opt]
    theirs = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[opt]
    data = batches(steps=4, sizes=[5, 3])
    unfreeze_at = 2 if opt == "sgd" else -1

    def frozen_net() -> Any:
        net = torch_net(0)
        net[2].requires_grad_(False)            # a whole unit, and
        net[4].weight.requires_grad_(False)     # a weight beside a trained bias
        return net

    net = frozen_net()
    ref = theirs(net.parameters(), **hyper)
    for i, (x, y) in enumerate(data):
        if i == unfreeze_at:
            net[4].weight.requires_grad_(True)
        ref.zero_grad()
        torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        ref.step()
    want = {k: v.detach().numpy().copy() for k, v in net.named_parameters()}

    async def rank(comm: Communicator) -> dict[str, np.ndarray]:
        mesh = await Mesh.create(comm, pipe=3)
        net = frozen_net()
        parts = split_sequential(net, 3)
        last = comm.rank == 2
        with TorchStage(parts[comm.rank], torch.nn.functional.mse_loss if last else None,
                        input_grad=comm.rank > 0) as stage:
            pp = PipelineParallel(stage, mesh.pipe, micro_batches=2)
            optimizer = ours(**hyper)
            dist = None
            if wrapped != "step":
                dist = DistributedModel(pp, mesh.data, optimizer, strategy=wrapped)
            for i, batch in enumerate(data):
                if i == unfreeze_at:
                    net[4].weight.requires_grad_(True)
                if dist is None:
                    await pp.step(batch, optimizer)
                else:
                    await dist.step(batch)
            if dist is not None:
                return await dist.full_parameters()
            return {k: v.copy() for k, v in pp.parameters().items()}

    got: dict[str, np.ndarray] = {}
    for params in await run_world(rank, 3, "memory"):
        got.update(params)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.timeout(120)
def test_train_pipeline_example() -> None:
    res = subprocess.run([sys.executable, "-m", "asynccoll", "run", "-n", "2",
                          "examples/train_pipeline.py", "--steps", "60"], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=100,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    losses = [float(m) for m in re.findall(r"step +\d+ +loss ([0-9.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0] / 2, out
    peaks = re.findall(r"stage (\d) of 2: 1f1b x(\d+), held at most (\d+) micro-batches", out)
    assert sorted(peaks) == [("0", "8", "2"), ("1", "8", "1")], out
