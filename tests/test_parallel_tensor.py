"""Tensor parallelism: column/row-parallel layers and TensorParallelMLP train exactly like the
unsplit MLP in one process (even and uneven splits, odd layer counts), with one all_reduce per
column+row pair forward and one backward; data x tensor parallel equals one process; failures
propagate; the torch layers match an unsplit nn.Sequential."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BACKENDS, run_world

from asynccoll import CollectiveTimeout, Communicator, ReduceOp
from asynccoll.parallel import MLP, SGD, Adam, DistributedModel, FlatLayout, Optimizer, split_batch
from asynccoll.parallel.model import Model
from asynccoll.parallel.tensor import (
    ColumnParallel,
    LoopBridge,
    Replicated,
    RowParallel,
    TensorParallelMLP,
    megatron_layers,
)

ROOT = Path(__file__).resolve().parents[1]

#: column 7, row 7, column 5, row 5: uneven over 2, 3 and 4 ranks
SIZES_EVEN = [5, 7, 6, 5, 3]
#: column 7, row 7, then an odd last layer (replicated)
SIZES_ODD = [5, 7, 4, 3]
SIZES = {"even": SIZES_EVEN, "odd": SIZES_ODD}
BATCH = 8
STEPS = 3
SEED = 3

OPTIMIZERS: dict[str, Callable[[], Optimizer]] = {
    "sgd": lambda: SGD(lr=0.1, momentum=0.9),
    "adam": lambda: Adam(lr=0.02),
}


def batches(sizes: list[int], steps: int = STEPS, seed: int = 1
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, sizes[0])), rng.standard_normal((BATCH, sizes[-1])))
            for _ in range(steps)]


def bind_flat(model: Model) -> tuple[np.ndarray, np.ndarray]:
    """Bind the model to one flat parameter and one flat gradient buffer (as the wrappers do),
    so that one flat optimizer updates every (local) parameter."""
    lay = FlatLayout(model.param_specs(), 1, 0)
    params = np.concatenate([model.parameters()[s.name].reshape(-1) for s in lay.specs])
    grads = np.zeros(lay.size, lay.dtype)
    model.bind(params=lay.views(params), grads=lay.views(grads))
    return params, grads


async def train(model: Model, opt: Optimizer, data: list[tuple[np.ndarray, np.ndarray]]
                ) -> list[float]:
    params, grads = bind_flat(model)
    losses = []
    for batch in data:
        grads.fill(0)
        losses.append(await model.forward_backward(batch))
        opt.step(params, grads)
    return losses


async def reference(sizes: list[int], opt: Optimizer, data: list[Any], **kw: Any
                    ) -> tuple[list[float], dict[str, np.ndarray]]:
    """The unsplit MLP, whole batches, one process."""
    model = MLP(sizes, seed=SEED, **kw)
    losses = await train(model, opt, data)
    return losses, {k: v.copy() for k, v in model.parameters().items()}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-12, err_msg=name)


# ----------------------------------------------------------------------------- the split


async def test_layers_alternate_and_split_like_array_split() -> None:
    async def rank(comm: Communicator) -> Any:
        layers = megatron_layers(SIZES_EVEN, comm)
        odd = megatron_layers(SIZES_ODD, comm)
        model = TensorParallelMLP(SIZES_EVEN, comm)
        return ([type(x) for x in layers], [type(x) for x in odd],
                [(s.name, s.shape, s.unit) for s in model.param_specs()])

    got = await run_world(rank, 3, "memory")
    for kinds, odd_kinds, _ in got:
        assert kinds == [ColumnParallel, RowParallel, ColumnParallel, RowParallel]
        assert odd_kinds == [ColumnParallel, RowParallel, Replicated]
    rows7 = [len(a) for a in np.array_split(np.arange(7), 3)]      # [3, 2, 2]
    rows5 = [len(a) for a in np.array_split(np.arange(5), 3)]      # [2, 2, 1]
    for r, (_, _, specs) in enumerate(got):
        assert specs == [
            ("layers.0.weight", (rows7[r], 5), 0), ("layers.0.bias", (rows7[r],), 0),
            ("layers.1.weight", (6, rows7[r]), 1), ("layers.1.bias", (6,), 1),
            ("layers.2.weight", (rows5[r], 6), 2), ("layers.2.bias", (rows5[r],), 2),
            ("layers.3.weight", (3, rows5[r]), 3), ("layers.3.bias", (3,), 3),
        ]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_from_mlp_shards_and_gathers_back(backend: str) -> None:
    mlp = MLP(SIZES_ODD, seed=11)

    async def rank(comm: Communicator) -> Any:
        tp = TensorParallelMLP.from_mlp(mlp, comm)
        same_seed = TensorParallelMLP(SIZES_ODD, comm, seed=11)
        full = await tp.full_parameters()
        return full, same_seed.parameters(), tp.parameters()

    for full, seeded, local in await run_world(rank, 4, backend):
        assert_same(full, mlp.parameters())
        assert all(np.array_equal(seeded[k], local[k]) for k in local)


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("layers", list(SIZES))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
async def test_equivalent_to_one_process(backend: str, world_size: int, layers: str,
                                         opt: str) -> None:
    sizes = SIZES[layers]
    data = batches(sizes)
    want_losses, want = await reference(sizes, OPTIMIZERS[opt](), data)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        model = TensorParallelMLP(sizes, comm, seed=SEED)
        losses = await train(model, OPTIMIZERS[opt](), data)
        return losses, await model.full_parameters()

    got = await run_world(rank, world_size, backend)
    for losses, params in got:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        assert_same(params, want)
    first = got[0][1]
    assert all(np.array_equal(first[k], p[k]) for _, p in got for k in first), "ranks disagree"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_empty_shards_cross_entropy_relu(backend: str) -> None:
    """Widths smaller than the group: ranks 2 and 3 hold no rows of layer 0 (no columns of
    layer 1), and still compute the same loss and gradients."""
    sizes = [3, 2, 5, 4]
    rng = np.random.default_rng(5)
    batch = (rng.standard_normal((6, 3)), rng.integers(0, 4, size=6))
    mlp = MLP(sizes, activation="relu", loss="cross_entropy", seed=2)
    want_loss = await mlp.forward_backward(batch)

    async def rank(comm: Communicator) -> tuple[float, float, dict[str, np.ndarray], Any]:
        tp = TensorParallelMLP(sizes, comm, activation="relu", loss="cross_entropy", seed=2)
        loss = await tp.forward_backward(batch)
        grads = await tp.full_parameters(tp.grads())
        return loss, await tp.loss(batch), grads, tp.parameters()["layers.0.weight"].shape

    got = await run_world(rank, 4, backend)
    assert [g[3] for g in got] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    for loss, eval_loss, grads, _ in got:
        assert loss == pytest.approx(want_loss, rel=1e-12)
        assert eval_loss == pytest.approx(want_loss, rel=1e-12)
        assert_same(grads, mlp.grads())


# ----------------------------------------------------------------------------- communication


class CountingComm:
    """A Communicator that records its collectives (and the hooks' events) in one log."""

    def __init__(self, comm: Communicator, log: list[tuple[str, Any]]) -> None:
        self._comm = comm
        self.log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    async def all_reduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
        self.log.append(("all_reduce", array.shape))
        return await self._comm.all_reduce(array, op)

    async def all_gather(self, array: np.ndarray, **kw: Any) -> np.ndarray:
        self.log.append(("all_gather", array.shape))
        return await self._comm.all_gather(array, **kw)


class LogHooks:
    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    async def before_forward(self, unit: int) -> None:
        self.log.append(("before_forward", unit))

    async def after_forward(self, unit: int) -> None:
        self.log.append(("after_forward", unit))

    async def before_backward(self, unit: int) -> None:
        self.log.append(("before_backward", unit))

    async def after_backward(self, unit: int) -> None:
        self.log.append(("after_backward", unit))


def collectives_by_unit(log: list[tuple[str, Any]]) -> dict[tuple[str, int], list[Any]]:
    """Which collectives ran inside which hook bracket: ``{("forward", u): [...], ...}``."""
    where: tuple[str, int] | None = None
    out: dict[tuple[str, int], list[Any]] = {}
    for event, arg in log:
        if event.startswith("before_"):
            where = (event.removeprefix("before_"), arg)
            out.setdefault(where, [])
        elif event.startswith("after_"):
            where = None
        else:
            assert where is not None, f"{event} outside a unit"
            out[where].append((event, arg))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
async def test_one_all_reduce_per_pair_each_way(backend: str) -> None:
    data = batches(SIZES_EVEN, 1)[0]

    async def rank(comm: Communicator) -> Any:
        log: list[tuple[str, Any]] = []
        counting = CountingComm(comm, log)
        model = TensorParallelMLP(SIZES_EVEN, counting, seed=SEED)  # type: ignore[arg-type]
        await model.forward_backward(data, LogHooks(log))
        plain = collectives_by_unit(log)
        log.clear()
        acts = await model.forward(data[0], LogHooks(log))
        dx = await model.backward(acts, np.ones_like(acts[-1]), LogHooks(log), input_grad=True)
        with_input = collectives_by_unit(log)
        log.clear()
        odd = TensorParallelMLP(SIZES_ODD, counting, seed=SEED)     # type: ignore[arg-type]
        await odd.forward_backward(batches(SIZES_ODD, 1)[0], LogHooks(log))
        return plain, with_input, collectives_by_unit(log), dx

    ar = "all_reduce"
    for plain, with_input, odd, dx in await run_world(rank, 2, backend):
        # forward: the row layers (1, 3) sum their (batch, out) partial outputs
        # backward: the column layer 2 sums its (batch, in) input gradient; layer 0's input
        # is the data, whose gradient nobody needs
        assert plain == {
            ("forward", 0): [], ("forward", 1): [(ar, (BATCH, 6))],
            ("forward", 2): [], ("forward", 3): [(ar, (BATCH, 3))],
            ("backward", 3): [], ("backward", 2): [(ar, (BATCH, 6))],
            ("backward", 1): [], ("backward", 0): []}
        # asked for the input gradient, the first pair's backward all_reduce comes back
        assert with_input[("backward", 0)] == [(ar, (BATCH, 5))]
        assert sum(len(v) for k, v in with_input.items() if k[0] == "backward") == 2
        assert dx is not None and dx.shape == (BATCH, 5)
        # an odd last layer is replicated: no communication of its own
        assert odd == {("forward", 0): [], ("forward", 1): [(ar, (BATCH, 4))],
                       ("forward", 2): [], ("backward", 2): [], ("backward", 1): [],
                       ("backward", 0): []}


async def test_input_grad_matches_unsplit() -> None:
    """backward(input_grad=True), what a pipeline stage needs, gives d(loss)/dx whole."""
    x = np.random.default_rng(0).standard_normal((4, 5))
    mlp = MLP(SIZES_EVEN, seed=1)
    eps = 1e-6
    # finite differences of sum(output) of the reference along one input coordinate
    bumped = x.copy()
    bumped[2, 3] += eps
    want = (mlp.predict(bumped).sum() - mlp.predict(x).sum()) / eps

    async def rank(comm: Communicator) -> np.ndarray:
        tp = TensorParallelMLP.from_mlp(mlp, comm)
        acts = await tp.forward(x)
        dx = await tp.backward(acts, np.ones_like(acts[-1]), input_grad=True)
        assert dx is not None
        return dx

    for dx in await run_world(rank, 3, "memory"):
        assert dx[2, 3] == pytest.approx(want, rel=1e-4)


async def test_two_stages_compose_like_a_pipeline() -> None:
    """Layers 0-1 (with output_activation) then layers 2-3, chained by forward/backward with
    the input gradient, give the whole MLP's loss and gradients: what a pipeline of
    tensor-parallel stages does."""
    mlp = MLP(SIZES_EVEN, seed=4)
    x, y = batches(SIZES_EVEN, 1)[0]
    want_loss = await mlp.forward_backward((x, y))
    full = mlp.parameters()

    def renamed(first: int, count: int) -> dict[str, np.ndarray]:
        return {f"layers.{i}.{k}": full[f"layers.{first + i}.{k}"]
                for i in range(count) for k in ("weight", "bias")}

    async def rank(comm: Communicator) -> tuple[float, dict[str, np.ndarray]]:
        stage0 = TensorParallelMLP(SIZES_EVEN[:3], comm, output_activation=True)
        stage1 = TensorParallelMLP(SIZES_EVEN[2:], comm)
        stage0.load_full_parameters(renamed(0, 2))
        stage1.load_full_parameters(renamed(2, 2))
        acts0 = await stage0.forward(x)
        acts1 = await stage1.forward(acts0[-1])
        out = acts1[-1]
        loss = 0.5 * float(np.sum((out - y) ** 2)) / len(x)
        dmid = await stage1.backward(acts1, (out - y) / len(x), input_grad=True)
        assert dmid is not None
        assert await stage0.backward(acts0, dmid) is None
        g0, g1 = (await stage0.full_parameters(stage0.grads()),
                  await stage1.full_parameters(stage1.grads()))
        grads = {f"layers.{int(k.split('.')[1]) + off}.{k.split('.')[2]}": v
                 for off, g in ((0, g0), (2, g1)) for k, v in g.items()}
        return loss, grads

    for loss, grads in await run_world(rank, 3, "memory"):
        assert loss == pytest.approx(want_loss, rel=1e-12)
        assert_same(grads, mlp.grads())


# ----------------------------------------------------------------------------- data x tensor


async def mesh_2x2(comm: Communicator) -> tuple[Communicator, Communicator]:
    """Tensor groups {0,1},{2,3} and data groups {0,2},{1,3}, made in the same order on every
    rank."""
    groups = {}
    for ranks in ([0, 1], [2, 3], [0, 2], [1, 3]):
        groups[tuple(ranks)] = await comm.new_group(ranks)
    r = comm.rank
    tensor = groups[(0, 1)] if r < 2 else groups[(2, 3)]
    data = groups[(0, 2)] if r % 2 == 0 else groups[(1, 3)]
    assert tensor is not None and data is not None
    return tensor, data


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("strategy", "opt"), [("ddp", "sgd"), ("zero3", "adam")])
async def test_data_x_tensor_parallel_equals_one_process(backend: str, strategy: str,
                                                         opt: str) -> None:
    data = batches(SIZES_EVEN)
    want_losses, want = await reference(SIZES_EVEN, OPTIMIZERS[opt](), data)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        tensor, dp = await mesh_2x2(comm)
        assert (tensor.rank, dp.rank) == (comm.rank % 2, comm.rank // 2)
        model = TensorParallelMLP(SIZES_EVEN, tensor, seed=SEED)
        dist = DistributedModel(model, dp, OPTIMIZERS[opt](), strategy=strategy)
        losses = []
        for batch in data:
            loss = await dist.step(split_batch(batch, dp.rank, dp.world_size))
            losses.append(np.array([loss]))
        # the whole-batch loss is the mean of the two replicas' (equal halves)
        mean_losses = [float((await dp.all_reduce(v, op=ReduceOp.AVG))[0]) for v in losses]
        local = await dist.full_parameters()           # this tensor rank's shards
        return mean_losses, await model.full_parameters(local)

    for losses, params in await run_world(rank, 4, backend):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        assert_same(params, want)


# ----------------------------------------------------------------------------- failures


class FailingHooks(LogHooks):
    async def after_forward(self, unit: int) -> None:
        if unit == 0:
            raise RuntimeError("boom on rank 1")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_failing_rank_does_not_hang_the_group(backend: str) -> None:
    data = batches(SIZES_EVEN, 1)[0]

    async def rank(comm: Communicator) -> float:
        model = TensorParallelMLP(SIZES_EVEN, comm)
        hooks = FailingHooks([]) if comm.rank == 1 else None
        return await model.forward_backward(data, hooks)     # the others wait in layer 1

    async with asyncio.timeout(15):
        with pytest.raises(RuntimeError, match="boom on rank 1"):
            await run_world(rank, 3, backend)


async def test_bad_arguments() -> None:
    async def rank(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="input and an output"):
            TensorParallelMLP([4], comm)
        with pytest.raises(TypeError, match="float"):
            TensorParallelMLP([4, 2], comm, dtype=np.int32)
        model = TensorParallelMLP([4, 6, 2], comm)
        with pytest.raises(ValueError, match="shape"):
            model.bind(params={"layers.0.weight": np.zeros((6, 4))})    # the whole, not a shard
        with pytest.raises(ValueError, match="targets"):
            await model.forward_backward((np.zeros((3, 4)), np.zeros((3, 3))))
        with pytest.raises(KeyError):
            model.load_full_parameters({"layers.0.weight": np.zeros((6, 4))})

    await run_world(rank, 2, "memory")


async def test_loop_bridge_from_a_thread_and_its_errors() -> None:
    """The torch layers' bridge: collectives from a worker thread; a collective timeout
    reaches the thread (it is also a TimeoutError, not to be taken for a poll timeout)."""

    async def rank(comm: Communicator) -> float:
        bridge = LoopBridge(comm)
        with pytest.raises(RuntimeError, match="event loop's thread"):
            bridge.all_reduce(np.ones(3))
        got = await asyncio.to_thread(bridge.all_reduce, np.full(3, comm.rank + 1.0))
        if comm.rank == 1:
            await asyncio.sleep(5)          # silent: rank 0's next collective times out
            return 0.0
        await asyncio.to_thread(bridge.all_reduce, np.ones(3))
        return float(got[0])

    async with asyncio.timeout(15):
        with pytest.raises(CollectiveTimeout):
            await run_world(rank, 2, "memory", timeout=1.0)


def test_importing_tensor_does_not_import_torch() -> None:
    code = "import sys, asynccoll.parallel.tensor\nprint('torch' in sys.modules)\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# ----------------------------------------------------------------------------- torch


def torch_mse(out: Any, y: Any) -> Any:
    """The MLP's loss: the mean over samples of half the summed squared error."""
    return 0.5 * ((out - y) ** 2).sum() / out.shape[0]


def torch_chain() -> Any:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    gen = torch.Generator().manual_seed(0)
    full = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(),
                         nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        for p in full.parameters():
            p.uniform_(-0.6, 0.6, generator=gen)
    return full


async def torch_train(module: Any, data: list[Any], opt: Callable[[], Optimizer]
                      ) -> list[float]:
    from asynccoll.parallel.torch_model import TorchModel

    with TorchModel(module, torch_mse) as model:
        opts = {name: opt() for name in model.parameters()}
        losses = []
        for batch in data:
            for g in model.grads().values():
                g.fill(0)
            losses.append(await model.forward_backward(batch))
            params, grads = model.parameters(), model.grads()
            for name, o in opts.items():
                o.step(params[name].reshape(-1), grads[name].reshape(-1))
    return losses


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
async def test_torch_layers_match_unsplit_sequential(backend: str, world_size: int) -> None:
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    full = torch_chain()
    data = batches([5, 3])
    ref = copy.deepcopy(full)
    want_losses = await torch_train(ref, data, OPTIMIZERS["adam"])

    async def rank(comm: Communicator) -> Any:
        log: list[tuple[str, Any]] = []
        counting = CountingComm(comm, log)
        src = copy.deepcopy(full)
        tp = torch.nn.Sequential(
            ColumnParallelLinear.from_linear(src[0], counting), torch.nn.Tanh(),
            RowParallelLinear.from_linear(src[2], counting), torch.nn.Tanh(),
            ColumnParallelLinear.from_linear(src[4], counting), torch.nn.Tanh(),
            RowParallelLinear.from_linear(src[6], counting))
        losses = await torch_train(tp, data, OPTIMIZERS["adam"])
        reduces = len(log)
        gathered = {}
        for i in (0, 2, 4, 6):
            for kind, array in (await tp[i].full_parameters()).items():
                gathered[f"{i}.{kind}"] = array
        return losses, gathered, reduces

    want = {k: v.detach().numpy() for k, v in ref.named_parameters()}
    for losses, gathered, reduces in await run_world(rank, world_size, backend):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
        assert_same(gathered, want)
        # per step: two forward (the row layers), one backward (the second column layer)
        assert reduces == 3 * len(data)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
async def test_torch_layer_narrower_than_the_group_under_every_strategy(strategy: str) -> None:
    """A column layer of 2 features over 3 tensor ranks leaves rank 2 an empty shard. Under
    ZeRO-3 (a bucket per unit) its empty bucket's views had zero strides, and torch's
    gradient accumulation warned 'grad and param do not obey the gradient layout contract'
    at every step (an error where warnings are: this suite, python -W error)."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.mesh import Mesh
    from asynccoll.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from asynccoll.parallel.torch_model import TorchModel

    gen = torch.Generator().manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2),
                               torch.nn.Tanh(), torch.nn.Linear(2, 3)).double()
    with torch.no_grad():
        for param in full.parameters():
            param.uniform_(-0.6, 0.6, generator=gen)
    data = batches([5, 3])

    async def one(comm: Communicator) -> dict[str, np.ndarray]:
        with TorchModel(copy.deepcopy(full), torch_mse) as model:
            dist = DistributedModel(model, comm, SGD(lr=0.1), strategy=strategy)
            for batch in data:
                await dist.step(batch)
            return await dist.full_parameters()

    want = (await run_world(one, 1, "memory"))[0]

    async def rank(world: Communicator) -> dict[str, np.ndarray]:
        mesh = await Mesh.create(world, tensor=3)
        src = copy.deepcopy(full)
        t = mesh.tensor
        net = torch.nn.Sequential(src[0], torch.nn.Tanh(),
                                  ColumnParallelLinear.from_linear(src[2], t), torch.nn.Tanh(),
                                  RowParallelLinear.from_linear(src[4], t))
        assert net[2].weight.shape[0] == (0 if mesh.coords.tensor == 2 else 1)
        with TorchModel(net, torch_mse) as model:
            dist = DistributedModel(model, mesh.data, SGD(lr=0.1), strategy=strategy)
            for batch in data:
                await dist.step(batch)
            model.bind(params=dist.layout.views(np.concatenate(
                [a.reshape(-1) for a in (await dist.full_parameters()).values()])))
            got = {f"0.{k}": v.detach().numpy().copy() for k, v in net[0].named_parameters()}
            for i in (2, 4):
                got.update({f"{i}.{k}": v for k, v in (await net[i].full_parameters()).items()})
            return got

    for got in await run_world(rank, 3, "memory"):
        assert_same(got, want)


async def test_torch_layer_needs_the_worker_thread() -> None:
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.tensor import RowParallelLinear

    async def rank(comm: Communicator) -> None:
        layer = RowParallelLinear(4, 2, comm, dtype=torch.float64)
        assert tuple(layer.weight.shape) == (2, 2) and tuple(layer.bias.shape) == (2,)
        with pytest.raises(RuntimeError, match="event loop's thread"):
            layer(torch.zeros(3, 2, dtype=torch.float64))

    await run_world(rank, 2, "memory")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_torch_failure_propagates(backend: str) -> None:
    torch = pytest.importorskip("torch")
    from asynccoll.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from asynccoll.parallel.torch_model import TorchModel

    full = torch_chain()
    data = batches([5, 3], 1)[0]

    def failing(out: Any, y: Any) -> Any:
        raise RuntimeError("loss failed on rank 1")

    async def rank(comm: Communicator) -> float:
        src = copy.deepcopy(full)
        tp = torch.nn.Sequential(
            ColumnParallelLinear.from_linear(src[0], comm), torch.nn.Tanh(),
            RowParallelLinear.from_linear(src[2], comm), torch.nn.Tanh(),
            ColumnParallelLinear.from_linear(src[4], comm), torch.nn.Tanh(),
            RowParallelLinear.from_linear(src[6], comm))
        with TorchModel(tp, failing if comm.rank == 1 else torch_mse) as model:
            return await model.forward_backward(data)     # rank 0 waits in a backward

    async with asyncio.timeout(15):
        with pytest.raises(RuntimeError, match="loss failed on rank 1"):
            await run_world(rank, 2, backend)
