"""The NumPy math of the reference MLP, written once for every model built on it.

``MLP``, ``TensorParallelMLP``,
``MLPStage`` and
``TensorParallelStage`` all compute a layer as
``z = a @ W.T + b``, an activation after every layer but the last, and the loss as a mean over
the samples; these pure functions are that math, plus the checks of a batch. The order of the
floating-point operations is part of the contract: a model that calls them computes the same
bits as the others.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Literal, overload

import numpy as np

ACTIVATIONS = ("tanh", "relu")
LOSSES = ("mse", "cross_entropy")


# ------------------------------------------------------------------------------ configuration


def check_config(sizes: Sequence[int], activation: str, loss: str, dtype: Any
                 ) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """The layer widths (as ints) and the dtype of an MLP; raises ``ValueError`` for fewer
    than two or non-positive widths, an unknown activation or loss, ``TypeError`` for a
    dtype that is not a float dtype."""
    widths = tuple(operator.index(s) for s in sizes)
    if len(widths) < 2:
        raise ValueError(f"an MLP needs an input and an output size, got {list(widths)}")
    if any(w < 1 for w in widths):
        raise ValueError(f"layer sizes must be positive, got {list(widths)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    dt: np.dtype[Any] = np.dtype(dtype)
    if dt.kind != "f":
        raise TypeError(f"dtype must be a float dtype, got {dt}")
    return widths, dt


def initial_layers(widths: Sequence[int], dtype: np.dtype[Any], seed: int
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The initial ``(weight, bias)`` of every layer, ``(out, in)`` and ``(out,)`` arrays of
    ``dtype``: uniform in ``±1/sqrt(in)`` as torch's ``nn.Linear``, drawn from
    ``numpy.random.default_rng(seed)`` layer by layer, weight first."""
    rng = np.random.default_rng(seed)
    for fan_in, fan_out in itertools.pairwise(widths):
        bound = 1.0 / math.sqrt(fan_in)
        weight = rng.uniform(-bound, bound, size=(fan_out, fan_in)).astype(dtype)
        bias = rng.uniform(-bound, bound, size=(fan_out,)).astype(dtype)
        yield weight, bias


# ---------------------------------------------------------------------------------- checks


def check_inputs(x: Any, width: int, dtype: np.dtype[Any], what: str = "inputs"
                 ) -> np.ndarray:
    """``x`` as a ``(batch, width)`` array of ``dtype``; ``ValueError`` for another shape."""
    x = np.asarray(x, dtype=dtype)
    if x.ndim != 2 or x.shape[1] != width:
        raise ValueError(f"{what} must have shape (batch, {width}), got {x.shape}")
    return x


def check_targets(loss: str, target: Any, n: int, out: int, dtype: np.dtype[Any]
                  ) -> np.ndarray:
    """The targets of ``n`` samples for the loss ``loss``, as an array: ``"mse"``, floats of
    shape ``(n, out)`` (converted to ``dtype``); ``"cross_entropy"``, integer labels of shape
    ``(n,)`` in ``[0, out)``. Raises ``ValueError`` otherwise."""
    if loss == "mse":
        y = np.asarray(target, dtype=dtype)
        if y.shape != (n, out):
            raise ValueError(f"targets must have shape {(n, out)}, got {y.shape}")
        return y
    y = np.asarray(target)
    if y.shape != (n,) or y.dtype.kind not in "iu":
        raise ValueError(f"labels must be integers of shape {(n,)}, got {y.dtype} {y.shape}")
    if n and (y.min() < 0 or y.max() >= out):
        raise ValueError(f"labels must lie in [0, {out}), got {y.min()}..{y.max()}")
    return y


def check_batch(batch: Any, sizes: Sequence[int], loss: str, dtype: np.dtype[Any]
                ) -> tuple[np.ndarray, np.ndarray]:
    """``batch = (inputs, targets)`` of an MLP of widths ``sizes`` checked and converted:
    inputs ``(n, sizes[0])`` of ``dtype``, targets as ``check_targets`` says. Raises
    ``ValueError`` for anything else, and for an empty batch (its mean loss is undefined)."""
    try:
        x, y = batch
    except (TypeError, ValueError):
        raise ValueError("batch must be a pair (inputs, targets)") from None
    x = check_inputs(x, sizes[0], dtype)
    n = x.shape[0]
    if n == 0:
        raise ValueError("empty batch: the mean loss over zero samples is undefined")
    return x, check_targets(loss, y, n, sizes[-1], dtype)


# ------------------------------------------------------------------------------------ math


def dense(a: np.ndarray, weight: np.ndarray, bias: np.ndarray, activation: str | None = None
          ) -> np.ndarray:
    """``act(a @ weight.T + bias)`` as a new array (no activation when ``activation`` is
    ``None``)."""
    z = a @ weight.T
    z += bias
    if activation is not None:
        activate(z, activation)
    return z


def activate(z: np.ndarray, activation: str) -> None:
    """Apply ``"tanh"`` or ``"relu"`` to ``z`` in place."""
    if activation == "tanh":
        np.tanh(z, out=z)
    else:
        np.maximum(z, 0, out=z)


def activation_grad(a: np.ndarray, activation: str) -> np.ndarray:
    """d act / dz from the activation's output ``a``, as a new array to multiply the
    gradient by: ``1 - a**2`` for tanh, the mask ``a > 0`` (booleans) for relu."""
    if activation == "tanh":
        return 1.0 - a * a
    return a > 0


def add_dense_grads(a: np.ndarray, dz: np.ndarray, grad_weight: np.ndarray,
                    grad_bias: np.ndarray) -> None:
    """Add d(loss)/dW and d(loss)/db of ``z = a @ W.T + b`` into ``grad_weight`` and
    ``grad_bias``, from ``dz`` = d(loss)/dz."""
    grad_weight += dz.T @ a
    grad_bias += dz.sum(axis=0)


@overload
def mean_loss(loss: str, out: np.ndarray, target: np.ndarray, *, grad: Literal[True],
              weight: float | None = None) -> tuple[float, np.ndarray]: ...
@overload
def mean_loss(loss: str, out: np.ndarray, target: np.ndarray, *, grad: bool,
              weight: float | None = None) -> tuple[float, np.ndarray | None]: ...
def mean_loss(loss: str, out: np.ndarray, target: np.ndarray, *, grad: bool,
              weight: float | None = None) -> tuple[float, np.ndarray | None]:
    """The mean over the ``n`` samples (rows of ``out``) of the loss ``loss``, and, with
    ``grad``, its gradient w.r.t. ``out`` (``None`` without).

    ``"mse"``: ``0.5 * sum((out - target) ** 2)`` per sample; ``"cross_entropy"``:
    ``-log softmax(out)[label]``, with ``target`` the integer labels. The targets are not
    checked (see ``check_targets``). With ``grad`` the gradient is computed in ``out``,
    which is overwritten; without, ``out`` is not changed.

    Without ``weight`` the sums are divided by ``n``. With it both the loss and the gradient
    are multiplied by ``weight / n`` instead: a pipeline micro-batch's share of the mean over
    the whole batch (the two orders of operations differ in the last bits).
    """
    n = out.shape[0]
    scale = None if weight is None else float(weight) / n
    if loss == "mse":
        diff = np.subtract(out, target, out=out if grad else None)
        half = 0.5 * float(np.vdot(diff, diff))
        value = half / n if scale is None else half * scale
        if not grad:
            return value, None
        _mean_of_sum(diff, n, scale)
        return value, diff
    rows = np.arange(n)
    shifted = np.subtract(out, out.max(axis=1, keepdims=True), out=out if grad else None)
    picked = shifted[rows, target]                    # a copy: the labels' logits
    np.exp(shifted, out=shifted)                      # unnormalised softmax
    total = shifted.sum(axis=1, keepdims=True)
    losses = np.log(total[:, 0]) - picked
    value = float(np.mean(losses)) if scale is None else float(np.sum(losses)) * scale
    if not grad:
        return value, None
    shifted /= total                                  # softmax
    shifted[rows, target] -= 1.0
    _mean_of_sum(shifted, n, scale)
    return value, shifted


def _mean_of_sum(grad: np.ndarray, n: int, scale: float | None) -> None:
    if scale is None:
        grad /= n
    else:
        grad *= scale
