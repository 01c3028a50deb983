"""TorchModel: torch's own gradients, landing in bound NumPy memory without copies, hooks in the
order of model.py (also where torch's order differs), a worker thread that leaves the event
loop free, errors and cancellation that reach the caller, and a clean shutdown."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from asynccoll.parallel.model import Model  # noqa: E402
from asynccoll.parallel.torch_model import TorchModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def init_(module: Any, seed: int) -> Any:
    """Deterministic float64 parameters without touching torch's global RNG."""
    module.double()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.7, 0.7, size=tuple(p.shape))))
    return module


def chain(seed: int = 0) -> Any:
    return init_(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                               nn.Linear(5, 3)), seed)


def make_batch(n: int = 8, seed: int = 1, out: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)), rng.standard_normal((n, out))


def autograd_grads(module: Any, batch: tuple[np.ndarray, np.ndarray],
                   loss_fn: Any = None) -> tuple[float, dict[str, np.ndarray]]:
    """Plain torch: the loss and gradients of a fresh copy of ``module``."""
    ref = copy.deepcopy(module)
    ref.zero_grad()
    loss = (loss_fn or nn.MSELoss())(ref(torch.tensor(batch[0])), torch.tensor(batch[1]))
    loss.backward()
    return float(loss.detach()), {n: (p.grad.numpy().copy() if p.grad is not None
                             else np.zeros(tuple(p.shape)))
                         for n, p in ref.named_parameters()}


def flat_bound(model: Model) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
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
    return params, grads, gviews


class Recorder:
    """Hooks that record their calls; ``sleep`` makes each one really wait on the loop."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.calls: list[tuple[str, int]] = []
        self.sleep = sleep

    async def _record(self, name: str, unit: int) -> None:
        self.calls.append((name, unit))
        await asyncio.sleep(self.sleep)

    async def before_forward(self, unit: int) -> None:
        await self._record("before_forward", unit)

    async def after_forward(self, unit: int) -> None:
        await self._record("after_forward", unit)

    async def before_backward(self, unit: int) -> None:
        await self._record("before_backward", unit)

    async def after_backward(self, unit: int) -> None:
        await self._record("after_backward", unit)


def expected_calls(n: int, *, backward: bool = True) -> list[tuple[str, int]]:
    calls = [c for u in range(n) for c in (("before_forward", u), ("after_forward", u))]
    if backward:
        calls += [c for u in reversed(range(n))
                  for c in (("before_backward", u), ("after_backward", u))]
    return calls


class Snapshots(Recorder):
    """Also copies unit u's gradients when after_backward(u) says they are final."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.model = model
        self.taken: dict[str, np.ndarray] = {}

    async def after_backward(self, unit: int) -> None:
        await super().after_backward(unit)
        grads = self.model.grads()  # type: ignore[attr-defined]
        for s in self.model.param_specs():
            if s.unit == unit:
                self.taken[s.name] = grads[s.name].copy()

    def assert_final(self) -> None:
        final = self.model.grads()  # type: ignore[attr-defined]
        assert set(self.taken) == set(final)
        for name, g in self.taken.items():
            np.testing.assert_array_equal(g, final[name], err_msg=name)


async def test_gradients_are_torchs_and_land_in_the_bound_arrays() -> None:
    module = chain()
    batch = make_batch()
    want_loss, want = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    _, grads, gviews = flat_bound(model)
    pointers = {n: p.grad.data_ptr() for n, p in module.named_parameters()}
    assert pointers == {n: v.ctypes.data for n, v in gviews.items()}
    x, y = batch
    x.flags.writeable = False                  # read-only inputs are fine (copied)
    hooks = Snapshots(model)
    loss = await model.forward_backward((x, y), hooks)
    assert loss == pytest.approx(want_loss, rel=1e-14)
    assert hooks.calls == expected_calls(3)
    hooks.assert_final()
    for name, g in want.items():
        np.testing.assert_allclose(gviews[name], g, rtol=1e-13, atol=1e-15, err_msg=name)
    # torch added into our memory in place: same tensors, same pointers
    assert {n: p.grad.data_ptr() for n, p in module.named_parameters()} == pointers
    assert grads.any()
    model.close()


async def test_gradients_are_added() -> None:
    model = TorchModel(chain(), nn.MSELoss())
    _, grads, _ = flat_bound(model)
    batch = make_batch()
    await model.forward_backward(batch)
    once = grads.copy()
    model.module.zero_grad()               # set_to_none: the binding comes back by itself
    await model.forward_backward(batch)
    np.testing.assert_allclose(grads, 2 * once, rtol=1e-14)
    model.close()


async def test_bind_shares_memory_both_ways() -> None:
    module = chain()
    model = TorchModel(module, nn.MSELoss())
    params, _, _ = flat_bound(model)
    x, _ = make_batch()
    before = model.predict(x)
    assert isinstance(before, np.ndarray) and before.shape == (8, 3)
    params *= 0.5                                  # seen by torch
    assert not np.allclose(model.predict(x), before)
    with torch.no_grad():
        module[0].bias.fill_(3.0)                  # seen by numpy
    assert (model.parameters()["0.bias"] == 3.0).all()
    assert model.parameters()["0.bias"].base is params


def test_default_units_are_children_with_parameters() -> None:
    model = TorchModel(init_(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), 0),
                       nn.MSELoss())
    assert [(s.name, s.shape, s.unit, s.dtype) for s in model.param_specs()] == [
        ("0.weight", (4, 3), 0, np.float64), ("0.bias", (4,), 0, np.float64),
        ("2.weight", (2, 4), 1, np.float64), ("2.bias", (2,), 1, np.float64)]
    assert model.num_units == 2
    single = TorchModel(nn.Linear(2, 2), nn.MSELoss())     # no children: the module itself
    assert single.num_units == 1 and single.param_specs()[0].dtype == np.float32
    assert all(not g.any() for g in single.grads().values())


class WithOwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: Any) -> Any:
        return self.body(x) * self.scale


def test_every_parameter_in_exactly_one_unit() -> None:
    with pytest.raises(ValueError, match="'scale' belongs to no unit"):
        TorchModel(WithOwnParameter(), nn.MSELoss())
    m = WithOwnParameter()
    TorchModel(m, nn.MSELoss(), units=[m])                          # the whole module: fine
    with pytest.raises(ValueError, match=r"'body\.weight' belongs to units 0 and 1"):
        TorchModel(m, nn.MSELoss(), units=[m, m.body])
    with pytest.raises(ValueError, match="has no parameters"):
        TorchModel(m, nn.MSELoss(), units=[m, nn.Tanh()])
    with pytest.raises(ValueError, match="not a parameter of the module"):
        TorchModel(m, nn.MSELoss(), units=[m, nn.Linear(1, 1)])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        TorchModel(object(), nn.MSELoss())  # type: ignore[arg-type]


class Reversed(nn.Module):
    """Declares its layers in the opposite order of their use."""

    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(5, 3)
        self.first = nn.Linear(4, 5)

    def forward(self, x: Any) -> Any:
        return self.second(torch.tanh(self.first(x)))


async def test_units_must_follow_the_forward_order() -> None:
    module = init_(Reversed(), 2)
    batch = make_batch()
    with pytest.raises(RuntimeError, match="unit 0 ran after unit 1"):
        await TorchModel(module, nn.MSELoss()).forward_backward(batch)
    model = TorchModel(module, nn.MSELoss(), units=[module.first, module.second])
    hooks = Recorder()
    await model.forward_backward(batch, hooks)
    assert hooks.calls == expected_calls(2)
    assert [s.name for s in model.param_specs()] == [
        "first.weight", "first.bias", "second.weight", "second.bias"]


class Twice(nn.Module):
    """Runs one block twice in a row (weights shared across steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.block = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: Any) -> Any:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))
        return self.out(h)


async def test_a_unit_called_twice_in_a_row_is_one_unit() -> None:
    module = init_(Twice(), 3)
    batch = make_batch()
    _, want = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    hooks = Snapshots(model)
    await model.forward_backward(batch, hooks)
    assert hooks.calls == expected_calls(3)
    hooks.assert_final()
    for name, g in want.items():
        np.testing.assert_allclose(model.grads()[name], g, rtol=1e-13, atol=1e-15)


async def test_frozen_and_unused_units_keep_the_order() -> None:
    module = chain(4)
    for p in module[2].parameters():
        p.requires_grad_(False)
    batch = make_batch()
    _, want = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    hooks = Snapshots(model)
    await model.forward_backward(batch, hooks)
    assert hooks.calls == expected_calls(3)
    hooks.assert_final()
    assert not model.grads()["2.weight"].any()
    for name, g in want.items():
        np.testing.assert_allclose(model.grads()[name], g, rtol=1e-13, atol=1e-15)


class LateBias(nn.Module):
    """Unit 1's bias is also used before unit 0 runs, so torch finishes unit 0's gradients
    before unit 1's: the hooks of unit 0 must be deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: Any) -> Any:
        early = (self.b.bias * self.b.bias).sum()
        return self.b(torch.tanh(self.a(x))) + early


async def test_hooks_are_deferred_when_torchs_order_differs() -> None:
    module = init_(LateBias(), 5)
    batch = make_batch()
    _, want = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    raw: list[str] = []                        # torch's own accumulation order
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: raw.append(name))
    hooks = Snapshots(model)
    await model.forward_backward(batch, hooks)
    assert raw.index("a.weight") < raw.index("b.bias")          # torch: unit 0 first
    assert hooks.calls == expected_calls(2)                      # hooks: documented order
    hooks.assert_final()
    for name, g in want.items():
        np.testing.assert_allclose(model.grads()[name], g, rtol=1e-13, atol=1e-15)


async def test_parameters_released_between_units_as_zero3_does() -> None:
    module = chain(6)
    batch = make_batch()
    want_loss, want = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    store = {k: v.copy() for k, v in model.parameters().items()}
    grads = {k: np.zeros_like(v) for k, v in store.items()}
    names = {u: [s.name for s in model.param_specs() if s.unit == u] for u in range(3)}
    empty = np.empty(0)
    model.bind(params=dict.fromkeys(store, empty), grads=dict.fromkeys(store, empty))
    assert all(p.numel() == 0 and p.grad is None for p in module.parameters())

    class Gather(Recorder):
        async def before_forward(self, unit: int) -> None:
            await asyncio.sleep(0)
            model.bind(params={n: store[n].copy() for n in names[unit]})

        async def after_forward(self, unit: int) -> None:
            model.bind(params=dict.fromkeys(names[unit], empty))

        async def before_backward(self, unit: int) -> None:
            await asyncio.sleep(0)
            model.bind(params={n: store[n].copy() for n in names[unit]},
                       grads={n: grads[n] for n in names[unit]})

        async def after_backward(self, unit: int) -> None:
            model.bind(params=dict.fromkeys(names[unit], empty),
                       grads=dict.fromkeys(names[unit], empty))

    loss = await model.forward_backward(batch, Gather())
    assert loss == pytest.approx(want_loss, rel=1e-14)
    for name, g in want.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-13, atol=1e-15, err_msg=name)
    assert all(p.numel() == 0 for p in module.parameters())


async def test_a_released_gradient_that_torch_computes_raises() -> None:
    model = TorchModel(chain(), nn.MSELoss())
    model.bind(grads={"4.bias": np.empty(0)})
    with pytest.raises(RuntimeError, match=r"'4\.bias' .* released"):
        await model.forward_backward(make_batch())


async def test_a_replaced_grad_tensor_is_copied_into_the_bound_array() -> None:
    """Should torch ever store a new .grad (old + new) instead of adding in place."""
    module = chain()
    batch = make_batch()
    _, want = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    _, grads, gviews = flat_bound(model)
    grads.fill(1.0)

    class Replace(Recorder):
        async def before_backward(self, unit: int) -> None:
            if unit == 2:
                for p in module[4].parameters():
                    p.grad = p.grad.clone()          # same values, other memory

    await model.forward_backward(batch, Replace())
    for name, g in want.items():
        np.testing.assert_allclose(gviews[name], 1.0 + g, rtol=1e-13, err_msg=name)
    assert module[4].weight.grad.data_ptr() == gviews["4.weight"].ctypes.data


async def test_the_event_loop_runs_while_torch_computes() -> None:
    released = threading.Event()

    def loss_fn(out: Any, y: Any) -> Any:
        # blocks the worker until a task on the event loop has run: would deadlock if the
        # pass ran on the event loop's thread
        assert released.wait(10), "the event loop did not run during the pass"
        return nn.functional.mse_loss(out, y)

    model = TorchModel(chain(), loss_fn)

    async def release() -> None:
        await asyncio.sleep(0.01)
        released.set()

    loss, _ = await asyncio.gather(model.forward_backward(make_batch()), release())
    assert loss > 0
    model.close()


async def test_two_models_concurrently_on_one_loop() -> None:
    batches = [make_batch(seed=10), make_batch(seed=11)]
    modules = [chain(7), chain(8)]
    wants = [autograd_grads(m, b)[1] for m, b in zip(modules, batches, strict=True)]
    models = [TorchModel(m, nn.MSELoss()) for m in modules]
    recorders = [Recorder(sleep=0.002), Recorder(sleep=0.002)]
    for _ in range(2):
        await asyncio.gather(*(m.forward_backward(b, r) for m, b, r in
                               zip(models, batches, recorders, strict=True)))
    for model, want, rec in zip(models, wants, recorders, strict=True):
        assert rec.calls == expected_calls(3) * 2
        for name, g in want.items():
            np.testing.assert_allclose(model.grads()[name], 2 * g, rtol=1e-13, atol=1e-15)
        model.close()


async def test_loss_calls_only_forward_hooks_and_predict_none() -> None:
    module = chain()
    batch = make_batch()
    want, _ = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    hooks = Recorder()
    assert await model.loss(batch, hooks) == pytest.approx(want, rel=1e-14)
    assert hooks.calls == expected_calls(3, backward=False)
    assert all(not g.any() for g in model.grads().values())
    out = model.predict(torch.tensor(batch[0]))       # a tensor or an array, no hooks
    np.testing.assert_array_equal(out, model.predict(batch[0]))
    assert float(((out - batch[1]) ** 2).mean()) == pytest.approx(want, rel=1e-14)
    assert hooks.calls == expected_calls(3, backward=False)
    model.close()


@pytest.mark.parametrize("where", ["before_forward", "after_backward", "loss_fn"])
async def test_errors_reach_the_caller_and_the_model_stays_usable(where: str) -> None:
    class Boom(Exception):
        pass

    def loss_fn(out: Any, y: Any) -> Any:
        if where == "loss_fn":
            raise Boom("in the worker")
        return nn.functional.mse_loss(out, y)

    class Fail(Recorder):
        async def _record(self, name: str, unit: int) -> None:
            if name == where and unit == 1:
                raise Boom(f"{name}({unit})")

    model = TorchModel(chain(), loss_fn)
    with pytest.raises(Boom):
        await model.forward_backward(make_batch(), Fail())
    where = "nowhere"
    model.module.zero_grad()
    await model.forward_backward(make_batch(), Recorder())     # the worker is free again
    model.close()


async def test_cancelled_pass_stops_the_worker() -> None:
    model = TorchModel(chain(), nn.MSELoss())
    entered, never = asyncio.Event(), asyncio.Event()

    class Stuck(Recorder):
        async def before_backward(self, unit: int) -> None:
            entered.set()
            await never.wait()

    task = asyncio.create_task(model.forward_backward(make_batch(), Stuck()))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert model._active is None                         # the worker left the pass
    hooks = Recorder()
    await asyncio.wait_for(model.forward_backward(make_batch(), hooks), 10)
    assert hooks.calls == expected_calls(3)
    model.close()


async def test_close_stops_the_worker_thread() -> None:
    def workers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("asynccoll-torch")]

    before = set(workers())
    with TorchModel(chain(), nn.MSELoss()) as model:
        await model.forward_backward(make_batch())
        started = set(workers()) - before
        assert len(started) == 1
    assert not (set(workers()) & started)
    with pytest.raises(RuntimeError, match="closed"):
        await model.forward_backward(make_batch())
    model.close()                                         # idempotent


def test_bind_validates() -> None:
    model = TorchModel(chain(), nn.MSELoss())
    with pytest.raises(KeyError):
        model.bind(params={"nope": np.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        model.bind(grads={"0.bias": np.zeros(5)})
    with pytest.raises(TypeError, match="float64"):
        model.bind(params={"0.bias": np.zeros(6, np.float32)})
    frozen = np.zeros(6)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        model.bind(params={"0.bias": frozen})


async def test_bad_loss_and_batch() -> None:
    model = TorchModel(chain(), lambda out, y: (out - y) ** 2)
    with pytest.raises(ValueError, match="scalar"):
        await model.forward_backward(make_batch())
    with pytest.raises(ValueError, match="pair"):
        await model.forward_backward(make_batch()[0])
    frozen = chain()
    frozen.requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires_grad"):
        await TorchModel(frozen, nn.MSELoss()).forward_backward(make_batch())


def test_lazy_import_and_exit_without_close() -> None:
    """Importing the module does not import torch; building a model without torch says what
    to install; a model never closed does not keep the interpreter from exiting."""
    code = """
import asyncio, sys
import numpy as np
import asynccoll.parallel.model, asynccoll.parallel.torch_model as tm
assert "torch" not in sys.modules, "importing torch_model imported torch"
sys.modules["torch"] = None
try:
    tm.TorchModel(object(), None)
except ImportError as exc:
    assert 'pip install "asynccoll[torch]"' in str(exc), exc
else:
    raise AssertionError("no ImportError")
del sys.modules["torch"]
import torch
m = tm.TorchModel(torch.nn.Linear(3, 2).double(), torch.nn.MSELoss())
print(asyncio.run(m.forward_backward((np.ones((4, 3)), np.zeros((4, 2))))) >= 0)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


class Checkpointed(nn.Module):
    """The middle unit's activations are recomputed during backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 5)
        self.c = nn.Linear(5, 3)

    def forward(self, x: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=False)
        return self.c(h)


async def test_activation_checkpointing_recomputes_without_hooks() -> None:
    module = init_(Checkpointed(), 9)
    batch = make_batch()
    _, want = autograd_grads(module, batch)
    model = TorchModel(module, nn.MSELoss())
    hooks = Snapshots(model)
    await model.forward_backward(batch, hooks)
    assert hooks.calls == expected_calls(3)
    hooks.assert_final()
    for name, g in want.items():
        np.testing.assert_allclose(model.grads()[name], g, rtol=1e-13, atol=1e-15)
