"""The NumPy reference MLP: finite-difference gradients, the hook order of model.py, adding into
bound arrays, and releasing parameters between units as ZeRO-3 does."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest

from asynccoll.parallel.mlp import MLP
from asynccoll.parallel.model import Model, split_batch

SIZES = [4, 6, 5, 3]


class Recorder:
    """Hooks that record their calls (and let a test act in them)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def before_forward(self, unit: int) -> None:
        self.calls.append(("before_forward", unit))

    async def after_forward(self, unit: int) -> None:
        self.calls.append(("after_forward", unit))

    async def before_backward(self, unit: int) -> None:
        self.calls.append(("before_backward", unit))

    async def after_backward(self, unit: int) -> None:
        self.calls.append(("after_backward", unit))


def expected_calls(n: int, *, backward: bool = True) -> list[tuple[str, int]]:
    calls = [c for u in range(n) for c in (("before_forward", u), ("after_forward", u))]
    if backward:
        calls += [c for u in reversed(range(n))
                  for c in (("before_backward", u), ("after_backward", u))]
    return calls


def make_batch(loss: str, n: int = 7, seed: int = 1, sizes: list[int] = SIZES
               ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, sizes[0]))
    if loss == "mse":
        return x, rng.standard_normal((n, sizes[-1]))
    return x, rng.integers(0, sizes[-1], size=n)


def flat_bound(model: Model) -> tuple[np.ndarray, np.ndarray]:
    """Bind the model to views of one flat parameter and one flat gradient buffer."""
    specs = model.param_specs()
    params = np.concatenate([model.parameters()[s.name].ravel() for s in specs])
    grads = np.zeros_like(params)
    pviews, gviews, at = {}, {}, 0
    for s in specs:
        pviews[s.name] = params[at:at + s.size].reshape(s.shape)
        gviews[s.name] = grads[at:at + s.size].reshape(s.shape)
        at += s.size
    model.bind(params=pviews, grads=gviews)
    return params, grads


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
async def test_gradient_matches_finite_differences(activation: str, loss: str) -> None:
    model = MLP(SIZES, activation=activation, loss=loss, seed=5)
    batch = make_batch(loss)
    params, grads = flat_bound(model)
    value = await model.forward_backward(batch)
    assert value == pytest.approx(await model.loss(batch), rel=1e-14)
    eps = 1e-6
    numeric = np.empty_like(params)
    for i in range(params.size):
        keep = params[i]
        params[i] = keep + eps
        up = await model.loss(batch)
        params[i] = keep - eps
        down = await model.loss(batch)
        params[i] = keep
        numeric[i] = (up - down) / (2 * eps)
    np.testing.assert_allclose(grads, numeric, rtol=1e-6, atol=1e-8)


async def test_losses_follow_the_documented_convention() -> None:
    model = MLP([2, 2], seed=0)
    w, b = model.parameters()["layers.0.weight"], model.parameters()["layers.0.bias"]
    w[...] = [[1.0, 0.0], [0.0, 1.0]]
    b[...] = 0.0
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    y = np.array([[0.0, 0.0], [3.0, 2.0]])
    # mean over samples of 0.5 * sum of squares: (0.5*(1+4) + 0.5*(0+4)) / 2
    assert await model.loss((x, y)) == pytest.approx(2.25)
    ce = MLP([2, 2], loss="cross_entropy", seed=0)
    ce.bind(params={"layers.0.weight": w, "layers.0.bias": b})
    labels = np.array([1, 0])
    logp = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    assert await ce.loss((x, labels)) == pytest.approx(-(logp[0, 1] + logp[1, 0]) / 2)
    assert np.isfinite(await ce.loss((x * 1e4, labels)))       # no overflow in softmax


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
async def test_mean_of_equal_shares_is_the_full_batch_gradient(loss: str) -> None:
    model = MLP(SIZES, loss=loss, seed=2)
    batch = make_batch(loss, n=12)
    _, full = flat_bound(model)
    await model.forward_backward(batch)
    want = full.copy()
    shares = np.zeros_like(full)
    for rank in range(3):
        full.fill(0)
        await model.forward_backward(split_batch(batch, rank, 3))
        shares += full
    np.testing.assert_allclose(shares / 3, want, rtol=1e-12, atol=1e-15)


async def test_hooks_are_called_in_the_documented_order() -> None:
    model, rec = MLP(SIZES), Recorder()
    await model.forward_backward(make_batch("mse"), rec)
    assert rec.calls == expected_calls(3)
    rec.calls.clear()
    await model.loss(make_batch("mse"), rec)
    assert rec.calls == expected_calls(3, backward=False)
    await model.forward_backward(make_batch("mse"))          # hooks=None: NoHooks


async def test_gradients_are_final_at_after_backward() -> None:
    model = MLP(SIZES, seed=4)
    batch = make_batch("mse")
    snapshots: dict[int, dict[str, np.ndarray]] = {}

    class Snap(Recorder):
        async def after_backward(self, unit: int) -> None:
            snapshots[unit] = {k: v.copy() for k, v in model.grads().items()
                               if k.startswith(f"layers.{unit}.")}

    await model.forward_backward(batch, Snap())
    final = model.grads()
    assert sorted(snapshots) == [0, 1, 2]
    for unit_grads in snapshots.values():
        for name, g in unit_grads.items():
            np.testing.assert_array_equal(g, final[name])


async def test_gradients_are_added_not_assigned() -> None:
    model = MLP(SIZES, seed=1)
    batch = make_batch("mse")
    _, grads = flat_bound(model)
    await model.forward_backward(batch)
    once = grads.copy()
    assert np.abs(once).sum() > 0
    await model.forward_backward(batch)
    np.testing.assert_allclose(grads, 2 * once, rtol=1e-14)


async def test_owns_zeroed_gradients_until_bound() -> None:
    model = MLP(SIZES)
    assert all(not g.any() for g in model.grads().values())
    before = model.grads()
    await model.forward_backward(make_batch("mse"))
    assert all(model.grads()[k] is before[k] for k in before)
    assert any(g.any() for g in before.values())


async def test_reads_parameters_from_bound_arrays() -> None:
    model = MLP(SIZES, seed=3)
    x, _ = make_batch("mse")
    params, _ = flat_bound(model)
    out = model.predict(x)
    params *= 0.5                     # an in-place change of the bound buffer is seen
    assert not np.allclose(model.predict(x), out)
    params[:] = 0.0
    np.testing.assert_array_equal(model.predict(x), np.zeros((x.shape[0], SIZES[-1])))
    assert model.parameters()["layers.0.weight"].base is params


async def test_seed_makes_initialisation_deterministic() -> None:
    a, b, c = MLP(SIZES, seed=7), MLP(SIZES, seed=7), MLP(SIZES, seed=8)
    for name, p in a.parameters().items():
        np.testing.assert_array_equal(p, b.parameters()[name])
        assert not np.array_equal(p, c.parameters()[name])
    bound = 1 / np.sqrt(SIZES[0])
    assert np.abs(a.parameters()["layers.0.weight"]).max() <= bound


async def test_param_specs_describe_layers_as_units() -> None:
    model = MLP([3, 5, 2], dtype=np.float32)
    specs = model.param_specs()
    assert [(s.name, s.shape, s.unit) for s in specs] == [
        ("layers.0.weight", (5, 3), 0), ("layers.0.bias", (5,), 0),
        ("layers.1.weight", (2, 5), 1), ("layers.1.bias", (2,), 1)]
    assert all(s.dtype == np.float32 for s in specs) and model.num_units == 2
    assert all(p.dtype == np.float32 for p in model.parameters().values())
    assert all(g.dtype == np.float32 for g in model.grads().values())


async def test_float32_gradients_close_to_float64() -> None:
    m64, m32 = MLP(SIZES, seed=9), MLP(SIZES, seed=9, dtype=np.float32)
    batch = make_batch("mse")
    l64 = await m64.forward_backward(batch)
    l32 = await m32.forward_backward(batch)
    assert l32 == pytest.approx(l64, rel=1e-5)
    for name, g in m32.grads().items():
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, m64.grads()[name], rtol=1e-4, atol=1e-6)


async def test_released_parameters_are_gathered_by_hooks() -> None:
    """ZeRO-3's pattern: parameters bound only between before_X(u) and after_X(u)."""
    model = MLP(SIZES, seed=6)
    batch = make_batch("mse")
    reference = MLP(SIZES, seed=6)
    await reference.forward_backward(batch)
    store = {k: v.copy() for k, v in model.parameters().items()}
    empty = np.empty(0)
    names = {u: [f"layers.{u}.weight", f"layers.{u}.bias"] for u in range(3)}
    model.bind(params=dict.fromkeys(store, empty))

    class Gather(Recorder):
        async def _gather(self, unit: int) -> None:
            await asyncio.sleep(0)                       # as if communicating
            model.bind(params={n: store[n].copy() for n in names[unit]})

        def _release(self, unit: int) -> None:
            model.bind(params=dict.fromkeys(names[unit], empty))

        async def before_forward(self, unit: int) -> None:
            await self._gather(unit)

        async def after_forward(self, unit: int) -> None:
            self._release(unit)

        async def before_backward(self, unit: int) -> None:
            await self._gather(unit)

        async def after_backward(self, unit: int) -> None:
            self._release(unit)

    loss = await model.forward_backward(batch, Gather())
    assert loss == await reference.loss(batch)
    for name, g in model.grads().items():
        np.testing.assert_array_equal(g, reference.grads()[name])
    assert all(p.size == 0 for p in model.parameters().values())
    with pytest.raises(RuntimeError, match="released"):
        await model.forward_backward(batch)


async def test_released_gradient_raises() -> None:
    model = MLP(SIZES)
    model.bind(grads={"layers.2.bias": np.empty(0)})
    with pytest.raises(RuntimeError, match=r"gradient 'layers\.2\.bias' is released"):
        await model.forward_backward(make_batch("mse"))


async def test_bind_validates() -> None:
    model = MLP(SIZES)
    with pytest.raises(KeyError, match="nope"):
        model.bind(params={"nope": np.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        model.bind(grads={"layers.0.bias": np.zeros(5)})
    with pytest.raises(TypeError, match="float64"):
        model.bind(params={"layers.0.bias": np.zeros(6, np.float32)})
    with pytest.raises(TypeError, match="numpy array"):
        model.bind(params={"layers.0.bias": [0.0] * 6})  # type: ignore[dict-item]
    good = np.zeros(6)
    with pytest.raises(KeyError):                # all or nothing
        model.bind(params={"layers.0.bias": good, "nope": good})
    assert model.parameters()["layers.0.bias"] is not good


@pytest.mark.parametrize(("kw", "error"), [
    ({"sizes": [3]}, ValueError), ({"sizes": [3, 0, 2]}, ValueError),
    ({"sizes": [3, 2.5]}, TypeError), ({"activation": "gelu"}, ValueError),
    ({"loss": "hinge"}, ValueError), ({"dtype": np.int32}, TypeError),
])
def test_constructor_validates(kw: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        MLP(**{"sizes": SIZES, **kw})


@pytest.mark.parametrize(("loss", "batch", "match"), [
    ("mse", (np.zeros((2, 3)), np.zeros((2, 3))), "inputs must have shape"),
    ("mse", (np.zeros((2, 4)), np.zeros((2, 2))), "targets must have shape"),
    ("mse", (np.zeros((0, 4)), np.zeros((0, 3))), "empty batch"),
    ("mse", (np.zeros((2, 4)),), "pair"),
    ("cross_entropy", (np.zeros((2, 4)), np.array([0.0, 1.0])), "integers"),
    ("cross_entropy", (np.zeros((2, 4)), np.array([0, 3])), r"\[0, 3\)"),
    ("cross_entropy", (np.zeros((2, 4)), np.array([-1, 0])), r"\[0, 3\)"),
])
async def test_bad_batches_raise_before_any_hook(loss: str, batch: Any, match: str) -> None:
    model, rec = MLP(SIZES, loss=loss), Recorder()
    with pytest.raises(ValueError, match=match):
        await model.forward_backward(batch, rec)
    assert rec.calls == []


async def test_hook_exception_propagates_and_later_units_untouched() -> None:
    model = MLP(SIZES)

    class Fail(Recorder):
        async def after_backward(self, unit: int) -> None:
            if unit == 1:
                raise OSError("link down")

    with pytest.raises(OSError, match="link down"):
        await model.forward_backward(make_batch("mse"), Fail())
    grads = model.grads()
    assert grads["layers.2.weight"].any() and grads["layers.1.weight"].any()
    assert not grads["layers.0.weight"].any()


async def test_yields_to_the_event_loop_between_units() -> None:
    model = MLP([2] * 6)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = ticks
    await model.forward_backward((np.ones((2, 2)), np.ones((2, 2))))
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert ticks - start >= 2 * 5          # a tick per unit forward and per unit backward


async def test_predict_matches_loss_convention() -> None:
    model = MLP(SIZES, seed=2)
    x, y = make_batch("mse")
    pred = model.predict(x)
    assert pred.shape == (x.shape[0], SIZES[-1])
    got = await model.loss((x, y))
    assert got == pytest.approx(0.5 * ((pred - y) ** 2).sum() / x.shape[0])
