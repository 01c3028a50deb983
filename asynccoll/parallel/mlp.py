"""A NumPy multi-layer perceptron with a hand-written backward: the reference ``Model``.

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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._mlp_math import ACTIVATIONS as ACTIVATIONS
from ._mlp_math import LOSSES as LOSSES
from ._mlp_math import (
    activation_grad,
    add_dense_grads,
    check_batch,
    check_config,
    check_inputs,
    dense,
    initial_layers,
    mean_loss,
)
from .model import Hooks, Model, NoHooks, ParamSpec


def validate_bindings(specs: Mapping[str, ParamSpec], arrays: Mapping[str, np.ndarray] | None,
                      what: str) -> dict[str, np.ndarray]:
    """Check arrays given to ``Model.bind``: known names, numpy arrays of the spec's dtype
    and of its shape or of size 0 (released). Returns them as a dict; raises ``KeyError`` for
    an unknown name and ``TypeError`` / ``ValueError`` for a wrong array. Shared by the
    ``Model`` implementations of this package."""
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


class _BoundArrays:
    """The parameter side of a ``Model`` (or pipeline stage) that keeps its parameters
    and gradients in NumPy arrays ``bind`` can replace: ``_specs``, ``_by_name`` and the
    ``_params`` / ``_grads`` dicts, set by ``_own``."""

    _specs: list[ParamSpec]
    _by_name: dict[str, ParamSpec]
    _params: dict[str, np.ndarray]
    _grads: dict[str, np.ndarray]

    def _own(self, specs: Iterable[ParamSpec], params: Mapping[str, np.ndarray]) -> None:
        """Start with these specs and parameter arrays, and zero-filled gradient arrays."""
        self._specs = list(specs)
        self._by_name = {s.name: s for s in self._specs}
        self._params = {s.name: params[s.name] for s in self._specs}
        self._grads = {s.name: np.zeros(s.shape, s.dtype) for s in self._specs}

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def parameters(self) -> dict[str, np.ndarray]:
        """The arrays the parameters are read from (no copies)."""
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
        self._rebind(validate_bindings(self._by_name, params, "parameter"),
                     validate_bindings(self._by_name, grads, "gradient"))

    def _rebind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """Use these (checked) arrays from now on."""
        self._params.update(params)
        self._grads.update(grads)


class _LayerArrays(_BoundArrays):
    """``_BoundArrays`` of MLP layers (``layers.{u}.weight`` / ``layers.{u}.bias``), with
    accessors that refuse released (zero-size) arrays."""

    def _param(self, u: int, kind: str) -> np.ndarray:
        return self._bound(self._params, u, kind, "parameter")

    def _grad(self, u: int, kind: str) -> np.ndarray:
        return self._bound(self._grads, u, kind, "gradient")

    def _bound(self, arrays: dict[str, np.ndarray], u: int, kind: str, what: str
               ) -> np.ndarray:
        name = f"layers.{u}.{kind}"
        array = arrays[name]
        if array.shape != self._by_name[name].shape:
            raise RuntimeError(f"{what} {name!r} is released (bound to a zero-size array); "
                               f"a hook must bind it before {self._needed_by(u, what)}")
        return array

    def _needed_by(self, u: int, what: str) -> str:
        """When a hook must have bound the ``what`` of layer ``u`` (for the error)."""
        return f"unit {u} runs backward" if what == "gradient" else f"unit {u} runs"


class MLP(_LayerArrays, Model):
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
    unit ``i``. Until ``bind`` replaces them the model owns its parameter arrays and
    zero-filled gradient arrays.
    """

    def __init__(self, sizes: Sequence[int], *, activation: str = "tanh", loss: str = "mse",
                 dtype: Any = np.float64, seed: int = 0) -> None:
        self.sizes, self.dtype = check_config(sizes, activation, loss, dtype)
        self.activation = activation
        self.loss_kind = loss
        specs: list[ParamSpec] = []
        params: dict[str, np.ndarray] = {}
        for i, arrays in enumerate(initial_layers(self.sizes, self.dtype, seed)):
            for kind, array in zip(("weight", "bias"), arrays, strict=True):
                name = f"layers.{i}.{kind}"
                specs.append(ParamSpec(name=name, shape=array.shape, dtype=self.dtype, unit=i))
                params[name] = array
        self._own(specs, params)

    # ------------------------------------------------------------------ Model interface

    @property
    def num_units(self) -> int:
        return len(self.sizes) - 1

    async def forward_backward(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch = (x, y)`` (mean over samples); adds the gradients into the bound
        gradient arrays, unit by unit, calling the hooks in the order ``Hooks`` gives.

        Raises ``ValueError`` for a malformed batch (before any hook is called) and
        ``RuntimeError`` when a parameter or gradient it needs is released (zero-size). If
        it raises or is cancelled midway, the gradients of the units already passed
        backward hold their additions and the others are untouched.
        """
        hooks = NoHooks() if hooks is None else hooks
        x, y = check_batch(batch, self.sizes, self.loss_kind, self.dtype)
        acts = await self._forward(x, hooks)
        loss, dz = mean_loss(self.loss_kind, acts[-1], y, grad=True)
        for u in reversed(range(self.num_units)):
            await hooks.before_backward(u)
            w = self._param(u, "weight")
            a_in = acts[u]
            add_dense_grads(a_in, dz, self._grad(u, "weight"), self._grad(u, "bias"))
            if u > 0:                   # needs W of unit u: before after_backward(u)
                dz = dz @ w
                dz *= activation_grad(a_in, self.activation)
            await hooks.after_backward(u)
            await asyncio.sleep(0)
        return loss

    async def loss(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch`` (mean over samples) without gradients; calls the forward hooks."""
        hooks = NoHooks() if hooks is None else hooks
        x, y = check_batch(batch, self.sizes, self.loss_kind, self.dtype)
        acts = await self._forward(x, hooks)
        return mean_loss(self.loss_kind, acts[-1], y, grad=False)[0]

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The network's output for ``x`` (B, in): predictions, or logits for cross-entropy."""
        a = check_inputs(x, self.sizes[0], self.dtype)
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
        return dense(a, self._param(u, "weight"), self._param(u, "bias"),
                     self.activation if u < self.num_units - 1 else None)


__all__ = ["MLP", "validate_bindings"]
