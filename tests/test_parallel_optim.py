"""Flat-array optimizers: torch.optim's numbers, elementwise state (so ZeRO can shard it by
index range), state dicts, validation."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from asynccoll.parallel.optim import SGD, Adam, AdamW, Optimizer

N = 37
STEPS = 12

#: name -> (our constructor kwargs, torch class name); the same kwargs build both.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1}),
    "sgd-wd": ("SGD", {"lr": 0.1, "weight_decay": 0.05}),
    "sgd-momentum": ("SGD", {"lr": 0.05, "momentum": 0.9}),
    "sgd-dampening": ("SGD", {"lr": 0.05, "momentum": 0.8, "dampening": 0.3,
                              "weight_decay": 0.01}),
    "sgd-nesterov": ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "sgd-nesterov-wd": ("SGD", {"lr": 0.05, "momentum": 0.7, "nesterov": True,
                                "weight_decay": 0.1}),
    "adam": ("Adam", {"lr": 0.01}),
    "adam-wd": ("Adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    "adam-low-beta1": ("Adam", {"lr": 0.02, "betas": (0.3, 0.9)}),   # lerp weight >= 0.5
    "adamw": ("AdamW", {"lr": 0.01}),
    "adamw-wd": ("AdamW", {"lr": 0.01, "betas": (0.85, 0.995), "weight_decay": 0.2}),
}
CLASSES: dict[str, Callable[..., Optimizer]] = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}


def make(config: str) -> Optimizer:
    cls, kw = CONFIGS[config]
    return CLASSES[cls](**kw)


def data(n: int = N, steps: int = STEPS, seed: int = 0,
         dtype: Any = np.float64) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n).astype(dtype),
            [rng.standard_normal(n).astype(dtype) for _ in range(steps)])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_torch_optim(config: str) -> None:
    torch = pytest.importorskip("torch")
    cls, kw = CONFIGS[config]
    p0, grads = data()
    ours, opt = p0.copy(), make(config)
    theirs = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    topt = getattr(torch.optim, cls)([theirs], **kw)
    for i, g in enumerate(grads):
        if i == STEPS // 2:                      # a learning-rate schedule takes effect
            opt.lr = opt.lr / 3
            for group in topt.param_groups:
                group["lr"] = group["lr"] / 3
        opt.step(ours, g)
        theirs.grad = torch.tensor(g)
        topt.step()
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-12, atol=1e-14,
                                   err_msg=f"step {i + 1}")
    assert opt.steps == STEPS
    state = topt.state[theirs]
    for name, buf in opt.state_dict()["buffers"].items():
        np.testing.assert_allclose(buf, state[name].numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sharded_by_index_range_equals_whole(config: str) -> None:
    """ZeRO's premise: state is elementwise, so shards stepped apart equal the whole."""
    p0, grads = data(n=20)
    bounds = [(0, 7), (7, 8), (8, 20)]          # uneven, one of a single element
    whole, opt = p0.copy(), make(config)
    sharded = p0.copy()
    shard_opts = [opt.clone() for _ in bounds]
    for g in grads:
        opt.step(whole, g)
        for (a, b), o in zip(bounds, shard_opts, strict=True):
            o.step(sharded[a:b], g[a:b])
    np.testing.assert_array_equal(sharded, whole)
    want = opt.state_dict()["buffers"]
    got = [o.state_dict()["buffers"] for o in shard_opts]
    assert all(set(s) == set(want) for s in got)
    for name, buf in want.items():
        np.testing.assert_array_equal(np.concatenate([s[name] for s in got]), buf)
    assert sum(o.state_nbytes for o in shard_opts) == opt.state_nbytes


@pytest.mark.parametrize("config", ["sgd-momentum", "adam", "adamw-wd"])
def test_empty_shard_steps(config: str) -> None:
    """A rank may own nothing of a bucket: a zero-length step is allowed and does nothing."""
    opt = make(config)
    p = np.empty(0)
    opt.step(p, np.empty(0))
    assert opt.state_nbytes == 0 and opt.steps == 1


def test_state_nbytes_counts_buffers() -> None:
    p, (g, *_) = data(n=10)
    sgd, mom, adam = SGD(lr=0.1), SGD(lr=0.1, momentum=0.9), Adam()
    assert sgd.state_nbytes == mom.state_nbytes == adam.state_nbytes == 0   # lazy
    for opt in (sgd, mom, adam):
        opt.step(p.copy(), g)
    assert (sgd.state_nbytes, mom.state_nbytes, adam.state_nbytes) == (0, 80, 160)
    f32 = Adam()
    f32.step(p.astype(np.float32), g.astype(np.float32))
    assert f32.state_nbytes == 80
    assert f32.state_dict()["buffers"]["exp_avg"].dtype == np.float32


@pytest.mark.parametrize("config", ["sgd-nesterov-wd", "adam-wd", "adamw"])
def test_state_dict_round_trip_resumes_exactly(config: str) -> None:
    p0, grads = data()
    straight, opt = p0.copy(), make(config)
    for g in grads:
        opt.step(straight, g)

    resumed, first = p0.copy(), make(config)
    for g in grads[:5]:
        first.step(resumed, g)
    state = first.state_dict()
    # through JSON and back for the hyperparameters, as a checkpoint stores them
    state["hyper"] = json.loads(json.dumps(state["hyper"]))
    second = CLASSES[CONFIGS[config][0]](lr=123.0)
    second.load_state_dict(state)
    assert second.hyper == first.hyper and second.steps == 5
    for g in grads[5:]:
        second.step(resumed, g)
    np.testing.assert_array_equal(resumed, straight)


def test_state_dict_is_a_copy_and_load_copies() -> None:
    p, (g, *_) = data()
    opt = SGD(lr=0.1, momentum=0.9)
    opt.step(p, g)
    state = opt.state_dict()
    state["buffers"]["momentum_buffer"][:] = 0
    assert np.array_equal(opt.state_dict()["buffers"]["momentum_buffer"], g)
    other = SGD(lr=0.1, momentum=0.9)
    other.load_state_dict(state)
    state["buffers"]["momentum_buffer"][:] = 7
    assert not other.state_dict()["buffers"]["momentum_buffer"].any()


def test_clone_has_same_hyper_and_no_state() -> None:
    p, (g, *_) = data()
    opt = AdamW(lr=0.02, betas=(0.5, 0.9), eps=1e-7, weight_decay=0.3)
    opt.step(p, g)
    twin = opt.clone()
    assert type(twin) is AdamW and twin.hyper == opt.hyper
    assert twin.steps == 0 and twin.state_nbytes == 0
    twin.step(np.zeros(3), np.ones(3))            # a different length: its own state
    assert opt.state_nbytes == 2 * N * 8


def test_load_state_dict_validates() -> None:
    p, (g, *_) = data()
    opt = Adam()
    opt.step(p, g)
    state = opt.state_dict()
    fresh = Adam()
    with pytest.raises(ValueError, match="expected optimizer buffers"):
        fresh.load_state_dict({**state, "buffers": {"exp_avg": state["buffers"]["exp_avg"]}})
    with pytest.raises(ValueError, match="one length"):
        fresh.load_state_dict({**state, "buffers": {"exp_avg": np.zeros(3),
                                                    "exp_avg_sq": np.zeros(4)}})
    with pytest.raises(ValueError, match="Invalid beta"):
        fresh.load_state_dict({**state, "hyper": {**state["hyper"], "betas": [1.0, 0.9]}})
    with pytest.raises(ValueError, match="step"):
        fresh.load_state_dict({**state, "step": -1})
    assert fresh.steps == 0 and fresh.state_nbytes == 0       # nothing changed
    # plain SGD has no buffers: a state dict of a later step still loads
    sgd = SGD(lr=0.1)
    sgd.load_state_dict({"step": 4, "hyper": {"lr": 0.2}, "buffers": {}})
    assert sgd.steps == 4 and sgd.lr == 0.2


def test_step_rejects_mismatched_arrays() -> None:
    opt = SGD(lr=0.1, momentum=0.5)
    with pytest.raises(ValueError, match="1-D"):
        opt.step(np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="same length"):
        opt.step(np.zeros(3), np.zeros(4))
    with pytest.raises(TypeError, match="float dtype"):
        opt.step(np.zeros(3), np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="float dtype"):
        opt.step(np.zeros(3, np.int64), np.zeros(3, np.int64))
    opt.step(np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="3 elements"):
        opt.step(np.zeros(4), np.ones(4))
    with pytest.raises(ValueError, match="3 elements"):
        opt.step(np.zeros(3, np.float32), np.ones(3, np.float32))
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        opt.step(frozen, np.ones(3))
    assert opt.steps == 1


@pytest.mark.parametrize(("make_bad", "message"), [
    (lambda: SGD(lr=-0.1), "Invalid learning rate"),
    (lambda: SGD(lr=float("nan")), "Invalid learning rate"),
    (lambda: SGD(lr=0.1, momentum=-1), "Invalid momentum value"),
    (lambda: SGD(lr=0.1, weight_decay=-1), "Invalid weight_decay value"),
    (lambda: SGD(lr=0.1, nesterov=True), "Nesterov momentum requires"),
    (lambda: SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
     "Nesterov momentum requires"),
    (lambda: Adam(lr=-1), "Invalid learning rate"),
    (lambda: Adam(eps=-1e-8), "Invalid epsilon value"),
    (lambda: Adam(betas=(1.0, 0.999)), "Invalid beta parameter at index 0"),
    (lambda: Adam(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    (lambda: AdamW(weight_decay=-0.01), "Invalid weight_decay value"),
])
def test_invalid_hyperparameters(make_bad: Callable[[], Optimizer], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_bad()


def test_lr_setter_validates() -> None:
    opt = Adam()
    opt.lr = 0.5
    assert opt.lr == 0.5 and opt.hyper["lr"] == 0.5
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.lr = -1.0
    assert opt.lr == 0.5


def test_grads_are_only_read() -> None:
    p, grads = data()
    kept = [g.copy() for g in grads]
    for config in CONFIGS:
        opt, q = make(config), p.copy()
        for g in grads:
            opt.step(q, g)
    assert all(np.array_equal(a, b) for a, b in zip(grads, kept, strict=True))


def test_defaults_and_repr() -> None:
    assert AdamW().hyper == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                             "weight_decay": 1e-2}
    assert Adam().hyper["weight_decay"] == 0.0
    assert repr(SGD(lr=0.5)) == ("SGD(lr=0.5, momentum=0.0, dampening=0.0, "
                                 "weight_decay=0.0, nesterov=False)")


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_set_after_steps_without_it_matches_torch(nesterov: bool) -> None:
    """Momentum turned on mid-run (as a param_group change in torch): its buffer starts at
    that step's update (it raised KeyError: the buffer was only made at the first step)."""
    torch = pytest.importorskip("torch")
    p0, grads = data()
    ours, opt = p0.copy(), SGD(lr=0.1, weight_decay=0.01)
    theirs = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    topt = torch.optim.SGD([theirs], lr=0.1, weight_decay=0.01)
    for i, g in enumerate(grads):
        if i == STEPS // 2:
            opt.momentum, opt.nesterov = 0.9, nesterov
            for group in topt.param_groups:
                group["momentum"], group["nesterov"] = 0.9, nesterov
        opt.step(ours, g)
        theirs.grad = torch.tensor(g)
        topt.step()
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-12, atol=1e-14,
                                   err_msg=f"step {i + 1}")
    np.testing.assert_allclose(opt.state_dict()["buffers"]["momentum_buffer"],
                               topt.state[theirs]["momentum_buffer"].numpy(), rtol=1e-12)
