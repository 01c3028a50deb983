"""Gradient clipping by global norm (torch's ``clip_grad_norm_``) in the training wrappers:
every data-parallel strategy, with compression and accumulation, frozen parameters, pipeline,
tensor and hybrid parallelism, against a one-process NumPy reference (``np.linalg.norm`` of
the whole-batch gradient) or torch itself; parameters and norms identical on every rank."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import run_world

from asynccoll import Communicator
from asynccoll.parallel import (
    MLP,
    SGD,
    STRATEGIES,
    Adam,
    DistributedModel,
    FlatLayout,
    Hybrid,
    Mesh,
    Optimizer,
    PipelineParallel,
    TensorParallelMLP,
    as_distributed,
    split_batch,
    split_mlp,
)

SIZES = [5, 7, 4, 3]        # 3 layers: column, row, replicated when tensor parallel
BATCH = 12
STEPS = 4
CLIPS = 0.05                # below every gradient norm of these runs: every step clips
KEEPS = 1e3                 # above all of them: nothing is clipped

Batch = tuple[np.ndarray, np.ndarray]


def make_data(steps: int = STEPS, accum: int = 1, seed: int = 1, sizes: list[int] = SIZES
              ) -> list[list[Batch]]:
    """``steps`` steps of ``accum`` whole micro-batches each."""
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal((BATCH, sizes[0])), rng.standard_normal((BATCH, sizes[-1])))
             for _ in range(accum)] for _ in range(steps)]


def sgd() -> Optimizer:
    return SGD(lr=0.1, momentum=0.9)


async def reference(data: list[list[Batch]], max_norm: float, make_opt: Callable[[], Optimizer]
                    = sgd, sizes: list[int] = SIZES, seed: int = 3
                    ) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process on whole batches, clipped by hand: the norm of the summed whole-batch
    gradients, scaled by max_norm / (norm + 1e-6) when that is below 1."""
    model = MLP(sizes, seed=seed)
    lay = FlatLayout(model.param_specs(), 1, 0)
    params = np.concatenate([model.parameters()[s.name].reshape(-1) for s in lay.specs])
    grads = np.zeros_like(params)
    model.bind(params=lay.views(params), grads=lay.views(grads))
    opt, norms = make_opt(), []
    for micro in data:
        grads.fill(0)
        for batch in micro:
            await model.forward_backward(batch)
        norm = float(np.linalg.norm(grads))
        norms.append(norm)
        if max_norm / (norm + 1e-6) < 1:
            grads *= max_norm / (norm + 1e-6)
        opt.step(params, grads)
    return norms, {k: v.copy() for k, v in lay.views(params).items()}


def check_clipping(norms: list[float], max_norm: float) -> None:
    """The case tests what it says: every step clipped, or none did."""
    if max_norm == CLIPS:
        assert min(norms) > 2 * max_norm, norms
    else:
        assert max(norms) < max_norm, norms


def assert_identical(results: list[tuple[list[float], dict[str, np.ndarray]]]) -> None:
    """Bitwise the same norms and parameters on every rank."""
    norms0, params0 = results[0]
    for norms, params in results[1:]:
        assert norms == norms0
        assert params.keys() == params0.keys()
        for k in params0:
            assert np.array_equal(params[k], params0[k]), k


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-12, err_msg=k)


# ------------------------------------------------------------------------ data parallel


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("max_norm", [CLIPS, KEEPS], ids=["clips", "keeps"])
async def test_max_grad_norm_equals_one_process(world_size: int, strategy: str,
                                                max_norm: float) -> None:
    data = make_data()
    want_norms, want = await reference(data, max_norm)
    check_clipping(want_norms, max_norm)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        model = MLP(SIZES, seed=3 if comm.rank == 0 else 50 + comm.rank)
        dist = as_distributed(model, comm, sgd(), strategy=strategy, max_grad_norm=max_norm,
                              bucket_bytes=200 if world_size == 3 else None)
        assert dist.last_grad_norm is None
        norms = []
        for (batch,) in data:
            await dist.step(split_batch(batch, comm.rank, comm.world_size))
            assert dist.last_grad_norm is not None
            norms.append(dist.last_grad_norm)
        return norms, await dist.full_parameters()

    results = await run_world(rank, world_size, "memory")
    assert_identical(results)
    norms, params = results[0]
    np.testing.assert_allclose(norms, want_norms, rtol=1e-10)
    assert_close(params, want)


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_clip_with_gradient_accumulation(strategy: str) -> None:
    """Several passes then one clipped step: the norm of the summed, averaged gradient
    (ddp/zero1 exchange once, under no_sync before; zero2/3 every pass)."""
    data = make_data(accum=3)
    want_norms, want = await reference(data, CLIPS)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        dist = DistributedModel(MLP(SIZES, seed=3), comm, sgd(), strategy=strategy)
        norms = []
        for micro in data:
            for i, batch in enumerate(micro):
                mine = split_batch(batch, comm.rank, comm.world_size)
                if i < len(micro) - 1 and strategy in ("ddp", "zero1"):
                    with dist.no_sync():
                        await dist.forward_backward(mine)
                else:
                    await dist.forward_backward(mine)
            norms.append(await dist.clip_grad_norm(CLIPS))
            assert dist.last_grad_norm == norms[-1]
            await dist.optimizer_step()
        return norms, await dist.full_parameters()

    results = await run_world(rank, 3, "memory")
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], want_norms, rtol=1e-10)
    assert_close(results[0][1], want)


async def test_clip_over_tcp() -> None:
    data = make_data()
    want_norms, want = await reference(data, CLIPS, lambda: Adam(lr=0.01))

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        dist = as_distributed(MLP(SIZES, seed=3), comm, Adam(lr=0.01), strategy="zero2",
                              max_grad_norm=CLIPS, bucket_bytes=200)
        norms = []
        for (batch,) in data:
            await dist.step(split_batch(batch, comm.rank, comm.world_size))
            assert dist.last_grad_norm is not None
            norms.append(dist.last_grad_norm)
        return norms, await dist.full_parameters()

    results = await run_world(rank, 3, "tcp")
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], want_norms, rtol=1e-10)
    assert_close(results[0][1], want)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
@pytest.mark.parametrize("compression", ["fp16", "int8", "topk"])
async def test_clip_the_decompressed_gradient(world_size: int, strategy: str,
                                              compression: str) -> None:
    """With compression, what is clipped is the gradient the optimizer applies (the
    decompressed average), and max_grad_norm= does what clip_grad_norm does."""
    data = make_data(steps=3)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray],
                                                dict[str, np.ndarray]]:
        dist = DistributedModel(MLP(SIZES, seed=3), comm, sgd(), strategy=strategy,
                                compression=compression)
        norms = []
        for (batch,) in data:
            await dist.forward_backward(split_batch(batch, comm.rank, comm.world_size))
            assert dist._grads is not None
            before = dist._grads.copy()
            norm = await dist.clip_grad_norm(0.1)
            norms.append(norm)
            assert norm == pytest.approx(float(np.linalg.norm(before)), rel=1e-12)
            assert norm > 0.1
            np.testing.assert_allclose(dist._grads, before * (0.1 / (norm + 1e-6)), rtol=1e-14)
            await dist.optimizer_step()
        by_option = DistributedModel(MLP(SIZES, seed=3), comm, sgd(), strategy=strategy,
                                     compression=compression, max_grad_norm=0.1)
        for (batch,) in data:
            await by_option.step(split_batch(batch, comm.rank, comm.world_size))
        return norms, await dist.full_parameters(), await by_option.full_parameters()

    results = await run_world(rank, world_size, "memory")
    assert_identical([(n, p) for n, p, _ in results])
    for _, by_method, by_option in results:
        for k in by_method:
            assert np.array_equal(by_method[k], by_option[k]), k


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_frozen_parameters_as_torch(strategy: str) -> None:
    """Against torch: clip_grad_norm_ over the parameters that have gradients (the frozen
    first layer has none), then the step; the frozen layer's gradient, made large here on
    purpose, counts for nothing."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel import TorchModel

    def net(seed: int) -> Any:
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(),
                                     torch.nn.Linear(6, 4), torch.nn.Tanh(),
                                     torch.nn.Linear(4, 3)).double()
        module[0].requires_grad_(False)
        return module

    data = make_data(steps=4)
    ref = net(0)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)
    want_norms = []
    for ((x, y),) in data:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        trainable = [p for p in ref.parameters() if p.requires_grad]
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIPS)))
        ref_opt.step()
    want = {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}
    check_clipping(want_norms, CLIPS)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        with TorchModel(net(0 if comm.rank == 0 else 9), torch.nn.functional.mse_loss) as model:
            dist = as_distributed(model, comm, SGD(lr=0.1, momentum=0.9), strategy=strategy,
                                  max_grad_norm=CLIPS,
                                  bucket_bytes=1 if strategy != "zero3" else None)
            norms = []
            for (batch,) in data:
                await dist.forward_backward(split_batch(batch, comm.rank, comm.world_size))
                # a gradient on the frozen layer (a model that writes one) must not count
                if dist._grads is not None:
                    a, b = dist.layout.offsets["0.weight"]
                    dist._grads[a:b] = 1e6
                await dist.optimizer_step()
                assert dist.last_grad_norm is not None
                norms.append(dist.last_grad_norm)
            return norms, await dist.full_parameters()

    results = await run_world(rank, 3, "memory")
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], want_norms, rtol=1e-10)
    assert_close(results[0][1], want)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
async def test_nonfinite_norm(strategy: str) -> None:
    """A NaN gradient: error_if_nonfinite raises FloatingPointError on every rank and changes
    nothing; by default the norm is NaN and the gradients are scaled by it, as torch does."""
    x, y = make_data(steps=1)[0][0]
    x[0, 0] = np.nan

    async def rank(comm: Communicator) -> tuple[str, float, bool]:
        dist = DistributedModel(MLP(SIZES, seed=3), comm, sgd(), strategy=strategy)
        await dist.forward_backward(split_batch((x, y), comm.rank, comm.world_size))
        grads = dist._grads if dist._grads is not None else dist._shard_grads
        assert grads is not None
        before = grads.copy()
        with pytest.raises(FloatingPointError, match="nan") as info:
            await dist.clip_grad_norm(1.0, error_if_nonfinite=True)
        unchanged = np.array_equal(grads, before, equal_nan=True)
        norm = await dist.clip_grad_norm(1.0)
        await dist.optimizer_step()
        params = dist.local_parameters()
        return str(info.value), norm, unchanged and bool(np.isnan(params).all())

    for message, norm, ok in await run_world(rank, 2, "memory"):
        assert "cannot be clipped" in message
        assert math.isnan(norm) and ok


async def test_clip_once_per_step_and_bad_max_norms() -> None:
    """clip_grad_norm before a step of a wrapper with max_grad_norm is not undone by a second
    clipping (last_grad_norm stays the norm before clipping); bad values raise ValueError."""
    (batch,), = make_data(steps=1)

    async def rank(comm: Communicator) -> tuple[float, float | None]:
        dist = DistributedModel(MLP(SIZES, seed=3), comm, sgd(), max_grad_norm=CLIPS)
        await dist.forward_backward(split_batch(batch, comm.rank, comm.world_size))
        norm = await dist.clip_grad_norm(CLIPS)
        await dist.optimizer_step()
        for bad in (0, -1.0, math.nan, True, "1", None):
            with pytest.raises(ValueError, match="max_norm must be a positive number"):
                await dist.clip_grad_norm(bad)  # type: ignore[arg-type]
        return norm, dist.last_grad_norm

    for norm, last in await run_world(rank, 2, "memory"):
        assert norm == last and norm > 2 * CLIPS
    for bad in (0, -1.0, math.nan, False, "x"):
        with pytest.raises(ValueError, match="max_norm"):
            DistributedModel(MLP(SIZES), _FakeComm(), sgd(), max_grad_norm=bad)


class _FakeComm:
    rank, world_size = 0, 1


async def test_inf_max_norm_only_measures() -> None:
    (batch,), = make_data(steps=1)
    want = float(np.linalg.norm(np.concatenate([g.reshape(-1) for g in (
        await _whole_grads(batch)).values()])))

    async def rank(comm: Communicator) -> tuple[float, np.ndarray]:
        dist = DistributedModel(MLP(SIZES, seed=3), comm, sgd(), strategy="zero3")
        await dist.forward_backward(split_batch(batch, comm.rank, comm.world_size))
        assert dist._shard_grads is not None
        before = dist._shard_grads.copy()
        norm = await dist.clip_grad_norm(math.inf)
        assert np.array_equal(dist._shard_grads, before)
        return norm, before

    for norm, _ in await run_world(rank, 3, "memory"):
        assert norm == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
async def test_measuring_the_norm_keeps_max_grad_norm(strategy: str) -> None:
    """clip_grad_norm(math.inf), to log the norm, before the step of a wrapper with
    max_grad_norm: the step used to skip the option's clipping (a 'clip' already ran), so the
    update was that of the unclipped gradient. It clips as torch's second clip_grad_norm_
    would; last_grad_norm keeps the measured norm."""
    data = make_data(steps=2)
    want_norms, want = await reference(data, CLIPS)
    check_clipping(want_norms, CLIPS)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        dist = DistributedModel(MLP(SIZES, seed=3), comm, sgd(), strategy=strategy,
                                max_grad_norm=CLIPS)
        norms = []
        for (batch,) in data:
            await dist.forward_backward(split_batch(batch, comm.rank, comm.world_size))
            measured = await dist.clip_grad_norm(math.inf)
            await dist.optimizer_step()
            assert dist.last_grad_norm == measured
            norms.append(measured)
        return norms, await dist.full_parameters()

    results = await run_world(rank, 2, "memory")
    assert_identical(results)
    assert results[0][0] == pytest.approx(want_norms, rel=1e-12)
    assert_close(results[0][1], want)


async def _whole_grads(batch: Batch) -> dict[str, np.ndarray]:
    model = MLP(SIZES, seed=3)
    grads = {s.name: np.zeros(s.shape) for s in model.param_specs()}
    model.bind(grads=grads)
    await model.forward_backward(batch)
    return grads


# ----------------------------------------------------------------------- model parallel


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("max_norm", [CLIPS, KEEPS], ids=["clips", "keeps"])
async def test_pipeline_step_clips_over_every_stage(stages: int, max_norm: float) -> None:
    data = make_data()
    want_norms, want = await reference(data, max_norm)
    check_clipping(want_norms, max_norm)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        stage = split_mlp(MLP(SIZES, seed=3), comm.world_size)[comm.rank]
        pp = PipelineParallel(stage, comm, micro_batches=2)
        opt, norms = sgd(), []
        for (batch,) in data:
            await pp.step(batch, opt, max_grad_norm=max_norm)
            assert pp.last_grad_norm is not None
            norms.append(pp.last_grad_norm)
        return norms, {k: v.copy() for k, v in pp.parameters().items()}

    results = await run_world(rank, stages, "memory")
    got: dict[str, np.ndarray] = {}
    for norms, params in results:
        assert norms == results[0][0]
        got.update(params)
    np.testing.assert_allclose(results[0][0], want_norms, rtol=1e-10)
    assert_close(got, want)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
async def test_data_x_tensor_parallel_counts_replicated_parameters_once(strategy: str) -> None:
    """2 data x 2 tensor ranks: the row layer's bias and the replicated last layer are whole
    on both tensor ranks; the norm counts them once."""
    data = make_data()
    want_norms, want = await reference(data, CLIPS)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        mesh = await Mesh.create(comm, data=2, tensor=2)
        model = TensorParallelMLP(SIZES, mesh.tensor, seed=3)
        dist = DistributedModel(model, mesh.data, sgd(), strategy=strategy,
                                max_grad_norm=CLIPS)
        norms = []
        for (batch,) in data:
            await dist.step(split_batch(batch, mesh.data.rank, mesh.data.world_size))
            assert dist.last_grad_norm is not None
            norms.append(dist.last_grad_norm)
        full = await model.full_parameters(await dist.full_parameters())
        await mesh.close()
        return norms, full

    results = await run_world(rank, 4, "memory")
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], want_norms, rtol=1e-10)
    assert_close(results[0][1], want)


@pytest.mark.parametrize(("data_size", "pipe", "tensor", "strategy"),
                         [(2, 2, 1, "zero3"), (1, 2, 2, "ddp"), (2, 2, 2, "zero2")])
async def test_hybrid_clips_over_the_whole_model(data_size: int, pipe: int, tensor: int,
                                                 strategy: str) -> None:
    sizes = [6, 9, 7, 5, 8, 3]
    data = make_data(steps=3, sizes=sizes)
    want_norms, want = await reference(data, CLIPS, sizes=sizes, seed=2)
    check_clipping(want_norms, CLIPS)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        hybrid = await Hybrid.create(comm, MLP(sizes, seed=2), data=data_size, pipe=pipe,
                                     tensor=tensor, optimizer=sgd(), strategy=strategy,
                                     micro_batches=2, max_grad_norm=CLIPS)
        norms = []
        for (batch,) in data:
            await hybrid.step(batch)
            assert hybrid.dist.last_grad_norm is not None
            norms.append(hybrid.dist.last_grad_norm)
        return norms, await hybrid.full_parameters()

    results = await run_world(rank, data_size * pipe * tensor, "memory")
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], want_norms, rtol=1e-10)
    assert_close(results[0][1], want)


async def test_torch_tensor_parallel_layers_as_torch() -> None:
    """A TorchModel of ColumnParallelLinear / RowParallelLinear layers (and a plain one every
    tensor rank holds whole) clips as torch's clip_grad_norm_ does on the unsplit net."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel import TorchModel
    from asynccoll.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4),
                               torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()
    data = make_data()
    ref = copy.deepcopy(full)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want_norms = []
    for ((x, y),) in data:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIPS)))
        ref_opt.step()
    want = {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}
    check_clipping(want_norms, CLIPS)

    async def rank(comm: Communicator) -> tuple[list[float], dict[str, np.ndarray]]:
        mesh = await Mesh.create(comm, tensor=2)
        src = copy.deepcopy(full)
        tp = torch.nn.Sequential(ColumnParallelLinear.from_linear(src[0], mesh.tensor),
                                 torch.nn.Tanh(),
                                 RowParallelLinear.from_linear(src[2], mesh.tensor),
                                 torch.nn.Tanh(), src[4])
        with TorchModel(tp, torch.nn.functional.mse_loss) as model:
            dist = DistributedModel(model, mesh.data, SGD(lr=0.1, momentum=0.9),
                                    max_grad_norm=CLIPS)
            norms = []
            for (batch,) in data:
                await dist.step(batch)
                assert dist.last_grad_norm is not None
                norms.append(dist.last_grad_norm)
            got = {f"4.{k}": v.detach().numpy().copy() for k, v in tp[4].named_parameters()}
            for i in (0, 2):
                got.update({f"{i}.{k}": v for k, v in (await tp[i].full_parameters()).items()})
        await mesh.close()
        return norms, got

    results = await run_world(rank, 2, "memory")
    assert_identical(results)
    np.testing.assert_allclose(results[0][0], want_norms, rtol=1e-10)
    assert_close(results[0][1], want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64])
def test_square_sum_is_float64_and_independent_of_addresses(dtype: Any) -> None:
    """The squares are summed in float64 (complex: |z|^2) whatever the gradient dtype, and a
    copy of the same values at another address sums to the same bits."""
    from asynccoll.parallel.clip import SquareSum

    rng = np.random.default_rng(0)
    x = rng.standard_normal(150_001)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(x.size)
    x = x.astype(dtype)
    wide = x.astype(np.complex128 if np.dtype(dtype).kind == "c" else np.float64)
    want = math.fsum((np.abs(wide) ** 2).tolist())
    sums = []
    for shift in range(3):
        moved = np.empty(x.size + shift, dtype)[shift:]
        moved[...] = x
        squares = SquareSum()
        squares.add(moved[:70_000])
        squares.add(moved[70_000:])
        sums.append(squares.total)
    assert sums[0] == pytest.approx(want, rel=1e-13)
    assert sums == [sums[0]] * 3
