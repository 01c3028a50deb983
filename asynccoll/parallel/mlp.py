"""A NumPy multi-layer perceptron with a hand-written backward: the reference :class:`Model`.

Layer ``i`` computes ``z = a @ W.T + b`` and, except for the last layer, ``a' = act(z)``; the
last layer is linear (predictions for ``"mse"``, logits for ``"cross_entropy"``). Each layer is
one unit, so the hooks see ``len(sizes) - 1`` units.

>>> import asyncio, numpy as np
>>> model = MLP([3, 4, 2], seed=0)
>>> [(s.name, s.shape) for s in model.param_specs()][:2]
[('layers.0.weight', (4, 3)), ('layers.0.bias', (4,))]
>>> x, y = np.ones((5, 3)), np.zeros((5, 2))
>>> loss = asyncio.run(model.forward_backward((x, y)))
>>> model.grads()["layers.1.bias"].shape
(2,)
"""

from __future__ import annotations

import asyncio
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .model import Hooks, Model, NoHooks, ParamSpec

ACTIVATIONS = ("tanh", "relu")
LOSSES = ("mse", "cross_entropy")


def validate_bindings(specs: Mapping[str, ParamSpec], arrays: Mapping[str, np.ndarray] | None,
                      what: str) -> dict[str, np.ndarray]:
    """Check arrays given to :meth:`Model.bind`: known names, numpy arrays of the spec's dtype
    and of its shape or of size 0 (released). Returns them as a dict; raises ``KeyError`` for
    an unknown name and ``TypeError`` / ``ValueError`` for a wrong array. Shared by the
    :class:`Model` implementations of this package."""
    out: dict[str, np.ndarray] = {}
    for name, array in (arrays or {}).items():
        spec = specs.get(name)
        if spec is None:
            raise KeyError(f"bind: no parameter named {name!r}")
        if not isinstance(array, np.ndarray):
            raise TypeError(f"bind: {what} {name!r} must be a numpy array, "
                            f"got {type(array).__name__}")
        if array.dtype != spec.dtype:
            raise TypeError(f"bind: {what} {name!r} must be {spec.dtype}, got {array.dtype}")
        if array.shape != spec.shape and array.size != 0:
            raise ValueError(f"bind: {what} {name!r} must have shape {spec.shape} (or size 0 "
                             f"to release it), got {array.shape}")
        out[name] = array
    return out


class MLP(Model):
    """A multi-layer perceptron in NumPy (the reference model of the parallel wrappers).

    Args:
        sizes: layer widths, input first: ``[in, hidden..., out]`` (two at least).
        activation: ``"tanh"`` or ``"relu"``, after every layer but the last.
        loss: ``"mse"``: the mean over samples of ``0.5 * sum((pred - y) ** 2)`` over the
            outputs, with ``y`` a float array ``(B, out)``; ``"cross_entropy"``: the mean
            over samples of ``-log softmax(logits)[label]``, with integer labels ``(B,)``.
        dtype: a float dtype for parameters, gradients and the computation.
        seed: the initialisation is ``numpy.random.default_rng(seed)``: weights and biases of
            layer i uniform in ``±1/sqrt(sizes[i])``, as torch's ``nn.Linear``.

    Parameters are ``layers.{i}.weight`` ``(out, in)`` and ``layers.{i}.bias`` ``(out,)``,
    unit ``i``. Until :meth:`bind` replaces them the model owns its parameter arrays and
    zero-filled gradient arrays.
    """

    def __init__(self, sizes: Sequence[int], *, activation: str = "tanh", loss: str = "mse",
                 dtype: Any = np.float64, seed: int = 0) -> None:
        widths = tuple(operator.index(s) for s in sizes)
        if len(widths) < 2:
            raise ValueError(f"an MLP needs an input and an output size, got {list(widths)}")
        if any(w < 1 for w in widths):
            raise ValueError(f"layer sizes must be positive, got {list(widths)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise TypeError(f"dtype must be a float dtype, got {self.dtype}")
        self.sizes = widths
        self.activation = activation
        self.loss_kind = loss
        rng = np.random.default_rng(seed)
        specs: list[ParamSpec] = []
        params: dict[str, np.ndarray] = {}
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
            bound = 1.0 / math.sqrt(fan_in)
            for kind, shape in (("weight", (fan_out, fan_in)), ("bias", (fan_out,))):
                name = f"layers.{i}.{kind}"
                specs.append(ParamSpec(name=name, shape=shape, dtype=self.dtype, unit=i))
                params[name] = rng.uniform(-bound, bound, size=shape).astype(self.dtype)
        self._specs = specs
        self._by_name = {s.name: s for s in specs}
        self._params = params
        self._grads = {name: np.zeros_like(p) for name, p in params.items()}

    # ------------------------------------------------------------------ Model interface

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    @property
    def num_units(self) -> int:
        return len(self.sizes) - 1

    def parameters(self) -> dict[str, np.ndarray]:
        return dict(self._params)

    def grads(self) -> dict[str, np.ndarray]:
        """The arrays the gradients are added into (no copies)."""
        return dict(self._grads)

    def bind(self, params: Mapping[str, np.ndarray] | None = None,
             grads: Mapping[str, np.ndarray] | None = None) -> None:
        """Read parameters from / add gradients into these arrays from now on (no copies).

        Raises ``KeyError``, ``TypeError`` or ``ValueError`` for an unknown name or an array
        of the wrong dtype or shape; nothing is rebound then.
        """
        new_params = validate_bindings(self._by_name, params, "parameter")
        new_grads = validate_bindings(self._by_name, grads, "gradient")
        self._params.update(new_params)
        self._grads.update(new_grads)

    async def forward_backward(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch = (x, y)`` (mean over samples); adds the gradients into the bound
        gradient arrays, unit by unit, calling the hooks in the order :class:`Hooks` gives.

        Raises ``ValueError`` for a malformed batch (before any hook is called) and
        ``RuntimeError`` when a parameter or gradient it needs is released (zero-size). If
        it raises or is cancelled midway, the gradients of the units already passed
        backward hold their additions and the others are untouched.
        """
        hooks = NoHooks() if hooks is None else hooks
        x, y = self._check_batch(batch)
        acts = await self._forward(x, hooks)
        loss, dz = self._loss_and_grad(acts[-1], y)
        for u in reversed(range(self.num_units)):
            await hooks.before_backward(u)
            w = self._param(u, "weight")
            gw, gb = self._grad(u, "weight"), self._grad(u, "bias")
            a_in = acts[u]
            gw += dz.T @ a_in
            gb += dz.sum(axis=0)
            if u > 0:                   # needs W of unit u: before after_backward(u)
                dz = dz @ w
                if self.activation == "tanh":
                    dz *= 1.0 - a_in * a_in
                else:
                    dz *= a_in > 0
            await hooks.after_backward(u)
            await asyncio.sleep(0)
        return loss

    async def loss(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch`` (mean over samples) without gradients; calls the forward hooks."""
        hooks = NoHooks() if hooks is None else hooks
        x, y = self._check_batch(batch)
        acts = await self._forward(x, hooks)
        return self._loss_and_grad(acts[-1], y, grad=False)[0]

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The network's output for ``x`` (B, in): predictions, or logits for cross-entropy."""
        a = self._check_inputs(x)
        for u in range(self.num_units):
            a = self._layer(u, a)
        return a

    # ------------------------------------------------------------------------ internals

    async def _forward(self, x: np.ndarray, hooks: Hooks) -> list[np.ndarray]:
        acts = [x]                                  # acts[u] is unit u's input
        for u in range(self.num_units):
            await hooks.before_forward(u)
            acts.append(self._layer(u, acts[-1]))
            await hooks.after_forward(u)
            await asyncio.sleep(0)
        return acts

    def _layer(self, u: int, a: np.ndarray) -> np.ndarray:
        z = a @ self._param(u, "weight").T
        z += self._param(u, "bias")
        if u < self.num_units - 1:
            if self.activation == "tanh":
                np.tanh(z, out=z)
            else:
                np.maximum(z, 0, out=z)
        return z

    def _param(self, u: int, kind: str) -> np.ndarray:
        name = f"layers.{u}.{kind}"
        array = self._params[name]
        if array.shape != self._by_name[name].shape:
            raise RuntimeError(f"parameter {name!r} is released (bound to a zero-size array); "
                               f"a hook must bind it before unit {u} runs")
        return array

    def _grad(self, u: int, kind: str) -> np.ndarray:
        name = f"layers.{u}.{kind}"
        array = self._grads[name]
        if array.shape != self._by_name[name].shape:
            raise RuntimeError(f"gradient {name!r} is released (bound to a zero-size array); "
                               f"a hook must bind it before unit {u} runs backward")
        return array

    def _check_inputs(self, x: Any) -> np.ndarray:
        x = np.asarray(x, dtype=self.dtype)
        if x.ndim != 2 or x.shape[1] != self.sizes[0]:
            raise ValueError(f"inputs must have shape (batch, {self.sizes[0]}), got {x.shape}")
        return x

    def _check_batch(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
        try:
            x, y = batch
        except (TypeError, ValueError):
            raise ValueError("batch must be a pair (inputs, targets)") from None
        x = self._check_inputs(x)
        n = x.shape[0]
        if n == 0:
            raise ValueError("empty batch: the mean loss over zero samples is undefined")
        out = self.sizes[-1]
        if self.loss_kind == "mse":
            y = np.asarray(y, dtype=self.dtype)
            if y.shape != (n, out):
                raise ValueError(f"targets must have shape {(n, out)}, got {y.shape}")
        else:
            y = np.asarray(y)
            if y.shape != (n,) or y.dtype.kind not in "iu":
                raise ValueError(f"labels must be integers of shape {(n,)}, got {y.dtype} "
                                 f"{y.shape}")
            if n and (y.min() < 0 or y.max() >= out):
                raise ValueError(f"labels must lie in [0, {out}), got {y.min()}..{y.max()}")
        return x, y

    def _loss_and_grad(self, out: np.ndarray, y: np.ndarray, *, grad: bool = True
                       ) -> tuple[float, np.ndarray]:
        """The mean loss and d(loss)/d(out) (``out`` is overwritten when ``grad``)."""
        n = out.shape[0]
        if self.loss_kind == "mse":
            diff = np.subtract(out, y, out=out if grad else None)
            loss = 0.5 * float(np.vdot(diff, diff)) / n
            diff /= n
            return loss, diff
        rows = np.arange(n)
        shifted = np.subtract(out, out.max(axis=1, keepdims=True), out=out if grad else None)
        picked = shifted[rows, y]                         # a copy: the labels' logits
        np.exp(shifted, out=shifted)                      # unnormalised softmax
        total = shifted.sum(axis=1, keepdims=True)
        loss = float(np.mean(np.log(total[:, 0]) - picked))
        shifted /= total                                  # softmax
        shifted[rows, y] -= 1.0
        shifted /= n
        return loss, shifted


__all__ = ["MLP", "validate_bindings"]
