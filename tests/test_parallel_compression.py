"""Gradient compression hooks (``asynccoll.parallel.compression``).

* correctness: every method against the exact mean computed here in float64, within the
  method's quantisation error; exact where the method is lossless (NoCompression, TopK with
  ratio 1, Int8 on integers of a block whose max is 127); every rank bit-identical;
* bytes on the wire: ``comm.transport.bytes_sent`` around one call on a 1M-element bucket,
  against NoCompression, and against the hook's own ``bytes_sent``;
* convergence: distributed least squares with SGD through each hook;
* error feedback bookkeeping, checkpoints, misuse and bad specs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from asynccoll import Communicator, ReduceOp
from asynccoll.parallel.compression import (
    ACCEPTED_SPECS,
    Cast,
    Compression,
    Int8,
    NoCompression,
    PowerSGD,
    TopK,
    bf16_decode,
    bf16_encode,
    make_compression,
)
from asynccoll.tuning import DIRECT, RING

BACKENDS = ["memory", "tcp"]
WORLD_SIZES = [2, 3]

#: Hooks of the correctness tests: name -> factory.
HOOKS: dict[str, Callable[[], Compression]] = {
    "none": NoCompression,
    "fp16": lambda: Cast("float16"),
    "bf16": lambda: Cast("bfloat16"),
    "topk1": lambda: TopK(ratio=1.0),
    "int8": Int8,
}


def grad_of(rank: int, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Deterministic normal gradient of ``rank``."""
    return np.random.default_rng([seed, rank]).standard_normal(n).astype(dtype)


def all_grads(world_size: int, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    return np.stack([grad_of(r, n, dtype, seed).astype(np.float64) for r in range(world_size)])


def assert_bit_identical(results: list[np.ndarray]) -> None:
    for r, got in enumerate(results[1:], 1):
        assert got.dtype == results[0].dtype
        assert_array_equal(got.view(np.uint8), results[0].view(np.uint8),
                           err_msg=f"rank {r} differs from rank 0")


# ------------------------------------------------------------------------ correctness

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("method", list(HOOKS))
async def test_mean_within_quantisation_error(run, backend, world_size, dtype, method):
    n = 3000  # not a multiple of Int8's block: a short last block

    async def fn(comm: Communicator) -> np.ndarray:
        g = grad_of(comm.rank, n, dtype)
        await HOOKS[method]().all_reduce_mean(comm, g, key="bucket")
        return g

    results = await run(fn, world_size, backend)
    assert_bit_identical(results)
    got = results[0].astype(np.float64)
    xs = all_grads(world_size, n, dtype)
    ref = xs.mean(axis=0)
    spread = np.abs(xs).mean(axis=0)  # mean of |x_r|: scale of each element's terms
    err = np.abs(got - ref)
    if method in ("none", "topk1"):
        eps = 1e-6 if dtype == "float32" else 1e-14
        assert np.all(err <= eps * spread + 1e-30)
    elif method == "fp16":  # W roundings of at most 2^-11 relative each (terms and sums)
        assert np.all(err <= 2.0**-9 * spread + 1e-7)
    elif method == "bf16":  # one rounding of 2^-9 relative per term
        assert np.all(err <= 2.0**-8 * spread + 1e-30)
    else:  # int8: half a step of the block scale max|x|/127 per term
        blocks = np.array_split(np.arange(n), -(-n // 1024))
        bound = np.empty(n)
        for b in blocks:
            bound[b] = np.abs(xs[:, b]).max(axis=1).mean() / 254
        assert np.all(err <= bound * 1.0001)
        assert err.max() > 0  # it did quantise


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_lossless_cases_are_exact(run, backend, world_size):
    """Integer-valued data: sums are exact in any order, so lossless methods match bit for bit;
    Int8 on integers of blocks whose max is 127 has scale 1 and is lossless too."""
    n = 2048

    async def fn(comm: Communicator) -> list[np.ndarray]:
        out = []
        for hook in (NoCompression(), TopK(ratio=1.0), Int8(block=1024), Cast("bfloat16")):
            g = ints_of(comm.rank, n)
            await hook.all_reduce_mean(comm, g, key=0)
            out.append(g)
        return out

    results = await run(fn, world_size, backend)
    ref = np.stack([ints_of(r, n) for r in range(world_size)]).sum(axis=0) / world_size
    for per_rank in results:
        for got in per_rank:
            assert_array_equal(got, ref.astype(np.float32))


def ints_of(rank: int, n: int) -> np.ndarray:
    g = np.random.default_rng([7, rank]).integers(-127, 128, n).astype(np.float32)
    g[::1024] = 127.0  # every block's max|x| is exactly 127
    return g


@pytest.mark.parametrize("backend", BACKENDS)
async def test_topk_sends_only_largest_entries_and_keeps_the_rest(run, backend):
    n, k = 100, 3

    async def fn(comm: Communicator) -> tuple[np.ndarray, np.ndarray]:
        hook = TopK(k=k)
        g = grad_of(comm.rank, n, "float64")
        await hook.all_reduce_mean(comm, g, key="b")
        return g, hook.state_dict()["residuals"]["b"]

    results = await run(fn, 2, backend)
    xs = all_grads(2, n, "float64")
    expected = np.zeros(n)
    for r in range(2):
        top = np.argsort(np.abs(xs[r]))[-k:]
        expected[top] += xs[r][top]
        residual = xs[r].copy()
        residual[top] = 0
        assert_array_equal(results[r][1], residual)
    for got, _ in results:
        assert_array_equal(got, expected / 2)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_powersgd_recovers_low_rank_and_warms_up_exactly(run, backend):
    rows = cols = 40  # n = 1600 is laid out as 40 x 40

    def low_rank(rank: int) -> np.ndarray:
        rng = np.random.default_rng([3, rank])
        return np.outer(rng.standard_normal(rows), rng.standard_normal(cols)).reshape(-1)

    async def fn(comm: Communicator) -> tuple[np.ndarray, np.ndarray]:
        hook = PowerSGD(rank=comm.world_size, warmup=1)
        assert hook.matrix_shape(rows * cols) == (rows, cols)
        warm = grad_of(comm.rank, rows * cols, "float64")
        await hook.all_reduce_mean(comm, warm, key=0)  # warm-up: uncompressed
        g = low_rank(comm.rank)
        await hook.all_reduce_mean(comm, g, key=0)
        return warm, g

    results = await run(fn, 3, backend)
    assert_bit_identical([w for w, _ in results])
    assert_bit_identical([g for _, g in results])
    assert_allclose(results[0][0], all_grads(3, rows * cols, "float64").mean(axis=0),
                    rtol=1e-12, atol=1e-14)
    ref = np.mean([low_rank(r) for r in range(3)], axis=0)
    assert_allclose(results[0][1], ref, atol=1e-4 * np.abs(ref).max())


# --------------------------------------------------------------------- bytes on the wire

def count_bytes(factories: dict[str, Callable[[], Compression]], n: int
                ) -> Callable[[Communicator], Any]:
    """A rank function: for each hook, one all_reduce_mean of an ``n``-element float32
    gradient; returns name -> (bytes the transport counted, bytes the hook counted)."""
    async def fn(comm: Communicator) -> dict[str, tuple[int, int]]:
        counted = {}
        for name, factory in factories.items():
            hook = factory()
            g = grad_of(comm.rank, n, "float32")
            before = comm.transport.bytes_sent
            await hook.all_reduce_mean(comm, g, key=name)
            counted[name] = (comm.transport.bytes_sent - before, hook.bytes_sent)
        return counted
    return fn


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_bytes_on_the_wire(run, world_size):
    """What the tcp transport counted, per rank: the hook's own count agrees, and the ratios
    to NoCompression are those of the module docstring's table."""
    n = 1 << 20  # a 4 MiB float32 bucket
    factories: dict[str, Callable[[], Compression]] = {
        "none": NoCompression, "fp16": lambda: Cast("float16"),
        "bf16": lambda: Cast("bfloat16"), "topk": lambda: TopK(ratio=0.01), "int8": Int8,
        "powersgd": lambda: PowerSGD(warmup=0)}

    results = await run(count_bytes(factories, n), world_size, "tcp")
    w = world_size
    for counted in results:
        for name, (wire, own) in counted.items():
            assert abs(own - wire) <= 0.01 * wire, (name, own, wire)
        base = counted["none"][0]
        ratio = {name: wire / base for name, (wire, _) in counted.items()}
        assert 0.49 < ratio["fp16"] < 0.51
        # gathers send W-1 payloads where the ring all_reduce sends 2(W-1)/W of the array
        assert abs(ratio["bf16"] - w / 4) < 0.01
        assert ratio["topk"] < 1 / 3.5
        assert abs(ratio["topk"] - 0.01 * 8 / 4 * w / 2) < 0.001
        assert abs(ratio["int8"] - w / 8 * (1 + 4 / 1024)) < 0.001
        if w == 2:
            assert ratio["int8"] < 0.3
        assert ratio["powersgd"] < 0.01


async def test_topk_k_overrides_ratio(run):
    async def fn(comm: Communicator) -> list[int]:
        sent = []
        for hook in (TopK(ratio=0.5), TopK(ratio=0.5, k=10)):
            await hook.all_reduce_mean(comm, grad_of(comm.rank, 1000, "float32"), key=0)
            sent.append(hook.bytes_sent)
        return sent

    for sent in await run(fn, 2, "memory"):
        assert sent == [500 * 8, 10 * 8]  # float32 value + int32 index each


# --------------------------------------------------------------------------- convergence

DIM, SAMPLES, STEPS, LR = 500, 1000, 150, 0.1


def shard(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's least-squares data: y = X w* + noise, w* shared by all ranks."""
    w_true = np.random.default_rng(1234).standard_normal(DIM) / np.sqrt(DIM)
    rng = np.random.default_rng([99, rank])
    x = rng.standard_normal((SAMPLES, DIM))
    return x, x @ w_true + 0.1 * rng.standard_normal(SAMPLES)


async def train(comm: Communicator, hook: Compression) -> tuple[float, np.ndarray]:
    """SGD on the mean squared error over all shards; returns (global loss, weights)."""
    x, y = shard(comm.rank)
    w = np.zeros(DIM)
    for _ in range(STEPS):
        g = x.T @ (x @ w - y) / SAMPLES
        await hook.all_reduce_mean(comm, g, key="w")
        w -= LR * g
    loss = np.array([0.5 * np.mean((x @ w - y) ** 2)])
    await comm.all_reduce(loss, op=ReduceOp.AVG)
    return float(loss[0]), w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_convergence_with_error_feedback(run, backend, world_size):
    hooks: dict[str, Callable[[], Compression]] = {
        "none": NoCompression,
        "topk": lambda: TopK(ratio=0.05),
        "topk_no_ef": lambda: TopK(ratio=0.05, error_feedback=False),
        "int8": Int8,
    }
    loss = {}
    for name, factory in hooks.items():
        results = await run(lambda comm, f=factory: train(comm, f()), world_size, backend)
        assert_bit_identical([w for _, w in results])
        loss[name] = results[0][0]
    start = 0.5 * np.mean([np.mean(shard(r)[1] ** 2) for r in range(world_size)])
    assert loss["none"] < 0.02 * start  # converged: ~0.004 from ~0.5
    assert loss["topk"] < 1.05 * loss["none"]  # ~0.0040/0.0044 vs 0.0038/0.0043
    assert loss["int8"] < 1.001 * loss["none"]
    assert loss["topk_no_ef"] > 4 * loss["topk"]  # ~0.035/0.027: error feedback matters


# ------------------------------------------------------------------------ error feedback

async def test_error_feedback_loses_nothing(run):
    """With error feedback, what was averaged plus the mean residual is the mean of all the
    gradients ever given."""
    n, steps = 257, 5

    async def fn(comm: Communicator) -> tuple[np.ndarray, np.ndarray]:
        hook = TopK(ratio=0.05)
        total_out = np.zeros(n)
        for t in range(steps):
            g = grad_of(comm.rank, n, "float64", seed=t)
            await hook.all_reduce_mean(comm, g, key="k")
            total_out += g
        residual = hook.state_dict()["residuals"]["k"]
        return total_out, await comm.all_reduce(residual.copy(), op=ReduceOp.AVG)

    results = await run(fn, 3, "memory")
    total_in = sum(all_grads(3, n, "float64", seed=t).mean(axis=0) for t in range(steps))
    out, mean_residual = results[0]
    assert_allclose(out + mean_residual, total_in, rtol=1e-12, atol=1e-12)
    assert np.abs(mean_residual).max() > 0.1


@pytest.mark.parametrize("spec", ["topk:0.1", "int8", "fp16", "bf16", "powersgd"])
async def test_state_dict_round_trip_and_reset(run, spec):
    n = 1000

    def fresh() -> Compression:
        hook = make_compression(spec)
        if isinstance(hook, PowerSGD):
            hook.warmup = 0
        if isinstance(hook, Cast):
            hook.error_feedback = True
        return hook

    async def fn(comm: Communicator) -> list[np.ndarray]:
        g1, g2 = grad_of(comm.rank, n, "float32", 1), grad_of(comm.rank, n, "float32", 2)
        straight, resumed, reset = fresh(), fresh(), fresh()
        outs = []
        for hook in (straight, resumed, reset):
            await hook.all_reduce_mean(comm, g1.copy(), key=("layer", 0))
        state = resumed.state_dict()
        assert set(state["residuals"]) == {("layer", 0)}
        resumed = fresh()
        resumed.load_state_dict(state)
        reset.reset()
        assert reset.state_dict()["residuals"] == {}
        for hook in (straight, resumed, reset, fresh()):
            g = g2.copy()
            await hook.all_reduce_mean(comm, g, key=("layer", 0))
            outs.append(g)
        return outs

    for straight, resumed, reset, new in await run(fn, 2, "memory"):
        assert_array_equal(resumed, straight)
        assert_array_equal(reset, new)
        assert not np.array_equal(reset, straight)


async def test_int8_block_size_matters(run):
    """One outlier coarsens only its own block with per-block scales."""
    n = 4096

    async def fn(comm: Communicator) -> list[float]:
        errors = []
        for hook in (Int8(block=256, error_feedback=False), Int8(block=None,
                                                                   error_feedback=False)):
            g = grad_of(comm.rank, n, "float32")
            g[0] = 1000.0
            ref = await comm.all_reduce(g.copy(), op=ReduceOp.AVG)
            await hook.all_reduce_mean(comm, g, key=0)
            errors.append(float(np.abs(g[256:] - ref[256:]).max()))
        return errors

    per_block, whole = (await run(fn, 2, "memory"))[0]
    assert per_block < 0.02 < 1.0 < whole


@pytest.mark.parametrize("backend", BACKENDS)
async def test_concurrent_buckets_do_not_mix(run, backend):
    sizes = [100, 3000, 70_000]

    async def fn(comm: Communicator) -> list[list[np.ndarray]]:
        out = []
        for concurrent in (False, True):
            hook = TopK(ratio=0.1)
            grads = [grad_of(comm.rank, n, "float32", seed=i) for i, n in enumerate(sizes)]
            if concurrent:
                await asyncio.gather(*(hook.all_reduce_mean(comm, g, key=i)
                                       for i, g in enumerate(grads)))
            else:
                for i, g in enumerate(grads):
                    await hook.all_reduce_mean(comm, g, key=i)
            out.append(grads)
        return out

    for sequential, concurrent in await run(fn, 3, backend):
        for a, b in zip(sequential, concurrent, strict=True):
            assert_array_equal(a, b)


class _SlowAfter:
    """``comm``, but an ``all_reduce`` of an array of ``rows`` rows returns 0.2 s late."""

    def __init__(self, comm: Communicator, rows: int) -> None:
        self._comm, self._rows = comm, rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    async def all_reduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
        out = await self._comm.all_reduce(array, op=op)
        if array.shape[0] == self._rows:
            await asyncio.sleep(0.2)
        return out


@pytest.mark.parametrize("backend", BACKENDS)
async def test_powersgd_concurrent_buckets_issue_in_one_order(run, backend):
    """PowerSGD's second all_reduce of a bucket (Q) waits for its first (P). With buckets in
    flight at once (a wrapper's, overlapping backward), each used to issue its Q when its own
    P completed: ranks that saw the Ps complete in another order called the Qs in another
    order, a collective mismatch (CollectiveError). The buckets now take turns."""
    sizes = [70_000, 3000]          # P has 265 and 55 rows
    hook_rows = [PowerSGD.matrix_shape(n)[0] for n in sizes]

    async def fn(comm: Communicator) -> list[np.ndarray]:
        # rank 0 sees bucket 0's P late, the others bucket 1's
        slow = _SlowAfter(comm, hook_rows[0] if comm.rank == 0 else hook_rows[1])
        hook = PowerSGD(rank=2, warmup=0)
        grads = [grad_of(comm.rank, n, "float32", seed=i) for i, n in enumerate(sizes)]
        await asyncio.gather(*(hook.all_reduce_mean(slow, g, key=i)  # type: ignore[arg-type]
                               for i, g in enumerate(grads)))
        alone = [grad_of(comm.rank, n, "float32", seed=i) for i, n in enumerate(sizes)]
        for i, g in enumerate(alone):
            await PowerSGD(rank=2, warmup=0).all_reduce_mean(comm, g, key=i)
        return [*grads, *alone]

    async with asyncio.timeout(30):
        results = await run(fn, 3, backend)
    for got in results:
        for a, b in zip(got[:2], got[2:], strict=True):
            assert_array_equal(a, b)
    assert_bit_identical([np.concatenate(got) for got in results])


@pytest.mark.parametrize("bad", ["zero", "nan", "inf"])
async def test_powersgd_recovers_after_a_zero_or_non_finite_step(run, bad):
    """PowerSGD keeps each bucket's Q for the next step. After one all-zero gradient (a
    frozen layer's, a step with no signal) Q was zero, so every later P = M Q was zero: the
    bucket sent nothing ever again (its residual grew without end). After one NaN/inf
    gradient (an overflowed step under loss scaling) Q was NaN: every later step was NaN.
    Now the step after behaves as a fresh hook's first step."""
    n = 400
    fill = {"zero": 0.0, "nan": np.nan, "inf": np.inf}[bad]

    async def fn(comm: Communicator) -> tuple[list[np.ndarray], list[np.ndarray]]:
        hook, fresh = PowerSGD(rank=2, warmup=0), PowerSGD(rank=2, warmup=0)
        first = np.full(n, fill, np.float32)
        await hook.all_reduce_mean(comm, first, key=0)
        got, want = [], []
        for step in range(1, 4):
            g = grad_of(comm.rank, n, "float32", seed=step)
            h = g.copy()
            await hook.all_reduce_mean(comm, g, key=0)
            await fresh.all_reduce_mean(comm, h, key=0)
            got.append(g)
            want.append(h)
        return got, want

    for got, want in await run(fn, 2, "memory"):
        for g, w in zip(got, want, strict=True):
            assert np.isfinite(g).all() and np.abs(g).max() > 0.1
            assert_array_equal(g, w)


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk", "int8", "powersgd"])
async def test_non_finite_values_propagate_but_never_reach_the_residual(run, spec):
    async def fn(comm: Communicator) -> tuple[np.ndarray, dict[Any, np.ndarray]]:
        hook = make_compression(spec)
        if isinstance(hook, PowerSGD):
            hook.warmup = 0
        g = grad_of(comm.rank, 2000, "float32")
        if comm.rank == 0:
            g[5] = np.inf
        await hook.all_reduce_mean(comm, g, key=0)
        return g, hook.state_dict()["residuals"]

    for g, residuals in await run(fn, 2, "memory"):
        assert not np.isfinite(g[5])
        for r in residuals.values():
            assert np.isfinite(r).all()


# --------------------------------------------------------------------- misuse and specs

async def test_same_key_with_another_layout_is_a_value_error(run):
    async def fn(comm: Communicator) -> None:
        hook = TopK(ratio=0.5)
        await hook.all_reduce_mean(comm, np.ones(10, np.float32), key="a")
        with pytest.raises(ValueError, match="'a'"):
            await hook.all_reduce_mean(comm, np.ones(20, np.float32), key="a")
        with pytest.raises(ValueError, match="'a'"):
            await hook.all_reduce_mean(comm, np.ones(10, np.float64), key="a")
        await hook.all_reduce_mean(comm, np.ones(20, np.float32), key="b")  # still usable

    await run(fn, 2, "memory")


@pytest.mark.parametrize("bad", [np.ones(4, np.int32), np.ones(4, np.float16),
                                 np.ones((2, 2), np.float32), np.ones(8, np.float32)[::2],
                                 [1.0, 2.0]], ids=["int32", "float16", "2d", "strided", "list"])
async def test_bad_gradients_are_type_errors(run, bad):
    async def fn(comm: Communicator) -> None:
        hooks: list[Compression] = [TopK(), Int8(), Cast("bfloat16")]
        if getattr(bad, "dtype", None) != np.float16:    # the plain average takes float16
            hooks.append(NoCompression())
        for hook in hooks:
            with pytest.raises(TypeError):
                await hook.all_reduce_mean(comm, bad, key=0)

    await run(fn, 2, "memory")


async def test_no_compression_averages_float16(run):
    async def fn(comm: Communicator) -> np.ndarray:
        g = np.full(5, comm.rank + 1, np.float16)
        await NoCompression().all_reduce_mean(comm, g, key=0)
        return g

    for got in await run(fn, 2, "memory"):
        assert got.dtype == np.float16
        assert_array_equal(got, np.full(5, 1.5, np.float16))


def test_bad_arguments():
    with pytest.raises(ValueError):
        TopK(ratio=0)
    with pytest.raises(ValueError):
        TopK(ratio=1.5)
    with pytest.raises(TypeError):
        TopK(ratio="0.1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TopK(k=0)
    with pytest.raises(TypeError):
        TopK(k=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Int8(block=0)
    with pytest.raises(ValueError):
        Cast("int8")
    with pytest.raises(ValueError):
        PowerSGD(rank=0)
    with pytest.raises(ValueError):
        PowerSGD(warmup=-1)
    with pytest.raises(TypeError):
        Int8(error_feedback="yes")  # type: ignore[arg-type]


def test_make_compression_specs():
    assert isinstance(make_compression(None), NoCompression)
    hook = TopK(ratio=0.2)
    assert make_compression(hook) is hook
    made = {spec: make_compression(spec) for spec in
            ["none", "fp16", "bf16", "topk", "topk:0.05", "int8", "int8:256", "powersgd",
             "powersgd:4", " TopK:0.5 "]}
    assert [type(h).__name__ for h in made.values()] == [
        "NoCompression", "Cast", "Cast", "TopK", "TopK", "Int8", "Int8", "PowerSGD",
        "PowerSGD", "TopK"]
    assert made["fp16"].name == "fp16" and made["bf16"].name == "bf16"
    assert isinstance(made["topk:0.05"], TopK) and made["topk:0.05"].ratio == 0.05
    assert isinstance(made["int8:256"], Int8) and made["int8:256"].block == 256
    assert isinstance(made["powersgd:4"], PowerSGD) and made["powersgd:4"].rank == 4
    for bad in ["gzip", "topk:0", "topk:2", "topk:abc", "fp16:2", "int8:0", ""]:
        with pytest.raises(ValueError, match="accepted") as info:
            make_compression(bad)
        assert all(name in str(info.value) for name in ("none", "fp16", "topk", "int8"))
    with pytest.raises(TypeError):
        make_compression(3)  # type: ignore[arg-type]
    assert "topk:RATIO" in ACCEPTED_SPECS


def test_load_state_dict_rejects_other_methods():
    with pytest.raises(ValueError, match="int8"):
        TopK().load_state_dict(Int8().state_dict())


# ------------------------------------------------------------------------ bfloat16 codec

def test_bf16_encoding_rounds_to_nearest_even():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    x = np.concatenate([
        rng.standard_normal(10_000).astype(np.float32) * np.float32(1e3),
        # exact ties: halfway between two bfloat16 values, both parities
        (np.arange(0x3F800000, 0x3F800000 + 64 * 0x10000, 0x8000, dtype=np.uint32)
         ).view(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-45],
                 np.float32)])
    ours = bf16_encode(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert_array_equal(ours, theirs)
    assert_array_equal(bf16_decode(ours), torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    nan = bf16_encode(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(bf16_decode(nan)).all()


#: (backend, options, elements): buckets whose all_reduce runs another algorithm than the
#: tuning as set predicts. max_payload 4 KiB: the communicator lowers small_bytes to it, so
#: a 16 KiB bucket takes the ring, not recursive doubling (3 ranks: they send different
#: bytes); memory lends, so above small_bytes the default tuning runs the direct all_reduce,
#: whose bytes per rank differ from the ring's where the blocks are uneven
_PREDICTIONS = [
    ("tcp", {"max_payload": 4096}, 4096),
    ("tcp", {"max_payload": 4096}, 1000),
    ("memory", {}, (1 << 15) + 2),
    ("tcp", {}, (1 << 15) + 2),
    ("memory", {"tuning": DIRECT}, 1001),
    ("tcp", {"tuning": DIRECT}, 1001),
    ("memory", {"tuning": RING}, 1001),
]


@pytest.mark.parametrize(("backend", "options", "n"), _PREDICTIONS,
                         ids=["tcp-max_payload-ring", "tcp-max_payload-doubling",
                              "memory-direct", "tcp-ring", "memory-DIRECT", "tcp-DIRECT",
                              "memory-RING"])
async def test_bytes_counted_are_the_transports_whatever_algorithm_runs(
        run: Any, backend: str, options: dict[str, Any], n: int) -> None:
    """The all_reduce hooks count what the transport counts, exactly, on every rank: they
    predict the algorithm from the tuning the communicator runs (comm.effective_tuning, fitted
    to max_payload) and the arguments it passes (whether the transport lends), not from the
    tuning as set."""
    factories: dict[str, Callable[[], Compression]] = {
        "none": NoCompression, "fp16": lambda: Cast("float16")}

    for rank, counted in enumerate(await run(count_bytes(factories, n), 3, backend,
                                             **options)):
        for name, (wire, own) in counted.items():
            assert own == wire, (rank, name, own, wire)


async def test_the_effective_tuning_is_what_the_collectives_run(run: Any) -> None:
    """comm.effective_tuning: the tuning as set with its frame sizes lowered to max_payload
    (read-only); the tuning itself where every frame fits."""
    from asynccoll.tuning import Tuning, fit_frames

    async def fn(comm: Communicator) -> tuple[Tuning, Tuning]:
        with pytest.raises(AttributeError):
            comm.effective_tuning = Tuning()  # type: ignore[misc]
        return comm.tuning, comm.effective_tuning

    for tuning, effective in await run(fn, 2, "tcp", max_payload=4096):
        assert effective == fit_frames(tuning, 4096) != tuning
        assert effective.small_bytes == 4096
    for tuning, effective in await run(fn, 2, "memory"):
        assert effective is tuning
