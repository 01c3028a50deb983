"""Optimizers over flat 1-D arrays, updating the parameters in place.

The training wrappers keep parameters and gradients in flat buffers, so an optimizer here sees
one 1-D ``params`` array and one 1-D ``grads`` array of the same length and dtype. Every state
buffer is *elementwise*: element ``i`` of a buffer depends only on element ``i`` of the
parameters and gradients. An optimizer run on the slice ``[a:b]`` therefore gives exactly the
slice ``[a:b]`` of what it gives on the whole array, which is how ZeRO shards the optimizer
state by index range: every rank runs a ``Optimizer.clone`` on its own range.

The update rules are those of ``torch.optim`` (``SGD``, ``Adam``, ``AdamW``, without the
``amsgrad``, ``maximize`` and ``foreach`` variants), written with in-place NumPy ufuncs: a step
allocates a few temporaries the size of ``params`` (Adam two at most), never per-element
Python work.

>>> import numpy as np
>>> opt = SGD(lr=0.5, momentum=0.9)
>>> p, g = np.ones(3), np.full(3, 0.2)
>>> opt.step(p, g)
>>> p.tolist()
[0.9, 0.9, 0.9]
>>> sorted(opt.state_dict()["buffers"]), opt.state_nbytes
(['momentum_buffer'], 24)
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from typing import Any, Self

import numpy as np


def _check_lr(lr: float) -> float:
    lr = float(lr)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    return lr


def _check_nonnegative(what: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value:
        raise ValueError(f"Invalid {what} value: {value}")
    return value


class Optimizer(abc.ABC):
    """An optimizer over one flat parameter array.

    State is allocated lazily by the first ``step``, for that length and dtype; later steps
    must pass arrays of the same length and dtype. ``lr`` may be changed between steps
    (a learning-rate schedule).
    """

    def __init__(self, lr: float) -> None:
        self._lr = _check_lr(lr)
        self._step = 0
        self._buffers: dict[str, np.ndarray] = {}
        self._size: int | None = None
        self._dtype: np.dtype[Any] | None = None

    # ------------------------------------------------------------------ hyperparameters

    @property
    def lr(self) -> float:
        """The learning rate (settable; a negative or NaN value raises ``ValueError``)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = _check_lr(value)

    @property
    @abc.abstractmethod
    def hyper(self) -> dict[str, Any]:
        """The hyperparameters, as keyword arguments of the constructor (JSON-friendly)."""

    @abc.abstractmethod
    def _configure(self, hyper: Mapping[str, Any]) -> None:
        """Validate and set every hyperparameter of ``hyper`` (the keys of ``hyper``)."""

    @abc.abstractmethod
    def _buffer_names(self) -> tuple[str, ...]:
        """Names of the state buffers the current hyperparameters need."""

    @abc.abstractmethod
    def _update(self, params: np.ndarray, grads: np.ndarray) -> None:
        """One update of ``params`` in place; ``self._step`` already counts this step."""

    def clone(self) -> Self:
        """A fresh optimizer of the same class and hyperparameters, with no state."""
        return type(self)(**self.hyper)

    # ------------------------------------------------------------------------ stepping

    @property
    def steps(self) -> int:
        """Steps taken (or loaded with ``load_state_dict``)."""
        return self._step

    @property
    def state_nbytes(self) -> int:
        """Bytes held by the state buffers (0 before the first step)."""
        return sum(b.nbytes for b in self._buffers.values())

    def step(self, params: np.ndarray, grads: np.ndarray) -> None:
        """Update ``params`` in place from ``grads`` (both 1-D, same length and float dtype).

        ``grads`` is only read. Raises ``ValueError`` for arrays of another shape or dtype
        than this optimizer's state, and ``TypeError`` for non-float arrays. When it raises,
        neither ``params`` nor the state has changed.
        """
        if not isinstance(params, np.ndarray) or not isinstance(grads, np.ndarray):
            raise TypeError("params and grads must be numpy arrays")
        if params.ndim != 1 or grads.shape != params.shape:
            raise ValueError(f"params and grads must be 1-D of the same length, got shapes "
                             f"{params.shape} and {grads.shape}")
        if params.dtype != grads.dtype or params.dtype.kind != "f":
            raise TypeError(f"params and grads must share one float dtype, got {params.dtype} "
                            f"and {grads.dtype}")
        if not params.flags.writeable:
            raise ValueError("params is read-only")
        n = params.shape[0]
        if self._size is None:
            self._buffers = {name: np.zeros(n, params.dtype) for name in self._buffer_names()}
            self._size, self._dtype = n, params.dtype
        elif n != self._size or params.dtype != self._dtype:
            raise ValueError(f"this optimizer's state is for {self._size} elements of "
                             f"{self._dtype}, got {n} of {params.dtype}")
        self._step += 1
        self._update(params, grads)

    # ------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """``{"step": int, "hyper": {...}, "buffers": {name: 1-D array}}``.

        The buffers are copies, aligned elementwise with the parameters (empty before the
        first step, and for optimizers without state, like plain SGD).
        """
        return {"step": self._step, "hyper": self.hyper,
                "buffers": {name: b.copy() for name, b in self._buffers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (the buffers are copied).

        ``hyper`` may be missing (keep the current hyperparameters). ``buffers`` must be empty,
        or hold exactly the buffers these hyperparameters need, all 1-D of one length and
        float dtype. Raises ``ValueError`` otherwise; nothing changes then.
        """
        step = int(state.get("step", 0))
        if step < 0:
            raise ValueError(f"invalid step count {step}")
        trial = self.clone()
        if "hyper" in state:
            trial._configure(state["hyper"])
        buffers = {str(k): np.asarray(v) for k, v in dict(state.get("buffers", {})).items()}
        if buffers:
            want = set(trial._buffer_names())
            if set(buffers) != want:
                raise ValueError(f"expected optimizer buffers {sorted(want)}, "
                                 f"got {sorted(buffers)}")
            shapes = {b.shape for b in buffers.values()}
            dtypes = {b.dtype for b in buffers.values()}
            if len(shapes) != 1 or len(next(iter(shapes))) != 1:
                raise ValueError(f"optimizer buffers must be 1-D of one length, got {shapes}")
            if len(dtypes) != 1 or next(iter(dtypes)).kind != "f":
                raise ValueError(f"optimizer buffers must share a float dtype, got {dtypes}")
        self._configure(trial.hyper)
        self._step = step
        self._buffers = {name: np.array(b, copy=True) for name, b in buffers.items()}
        if buffers:
            first = next(iter(self._buffers.values()))
            self._size, self._dtype = first.shape[0], first.dtype
        else:
            self._size = self._dtype = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyper.items())
        return f"{type(self).__name__}({args})"


def step_keeping(opt: Optimizer, params: np.ndarray, grads: np.ndarray, start: int,
                 frozen: Sequence[tuple[int, int]]) -> None:
    """``opt.step(params, grads)`` on the flat range ``[start, start + params.size)``,
    leaving the parameters of the ``frozen`` flat ranges in it, and their optimizer state, as
    they were (as torch.optim skips a parameter without a gradient): what every training
    wrapper steps with."""
    stop = start + params.size
    keep = [(max(a, start) - start, min(b, stop) - start)
            for a, b in frozen if a < stop and b > start]
    if not keep:
        opt.step(params, grads)
        return
    saved = [(params[a:b].copy(), {k: v[a:b].copy() for k, v in opt._buffers.items()})
             for a, b in keep]
    opt.step(params, grads)
    for (a, b), (value, buffers) in zip(keep, saved, strict=True):
        params[a:b] = value
        for name, buf in opt._buffers.items():     # state made by this step starts at 0
            buf[a:b] = buffers[name] if name in buffers else 0


class SGD(Optimizer):
    """Stochastic gradient descent with optional momentum, as ``torch.optim.SGD``.

    With ``g = grad + weight_decay * param``: the first step sets ``buf = g``, later ones
    ``buf = momentum * buf + (1 - dampening) * g``; the update uses ``buf`` (or, with
    ``nesterov``, ``g + momentum * buf``): ``param -= lr * update``. Without momentum there is
    no state.
    """

    def __init__(self, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(lr)
        self.momentum = self.dampening = self.weight_decay = 0.0
        self.nesterov = False
        self._configure({"momentum": momentum, "dampening": dampening,
                         "weight_decay": weight_decay, "nesterov": nesterov})

    @property
    def hyper(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}

    def _configure(self, hyper: Mapping[str, Any]) -> None:
        h = {**self.hyper, **hyper}
        lr = _check_lr(h["lr"])
        momentum = _check_nonnegative("momentum", h["momentum"])
        weight_decay = _check_nonnegative("weight_decay", h["weight_decay"])
        dampening, nesterov = float(h["dampening"]), bool(h["nesterov"])
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self._lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov

    def _buffer_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def _update(self, params: np.ndarray, grads: np.ndarray) -> None:
        scratch: np.ndarray | None = None      # a temporary this step may overwrite
        d = grads
        if self.weight_decay != 0:
            scratch = np.multiply(params, self.weight_decay)
            scratch += grads
            d = scratch
        if self.momentum != 0:
            buf = self._buffers.get("momentum_buffer")
            if buf is None:  # momentum set after steps without it: it starts here (as torch's)
                buf = self._buffers["momentum_buffer"] = np.array(d, copy=True)
            elif self._step == 1:
                np.copyto(buf, d)
            else:
                buf *= self.momentum
                if self.dampening == 0:
                    buf += d
                else:
                    tmp = np.multiply(d, 1.0 - self.dampening)
                    buf += tmp
            if self.nesterov:
                if scratch is None:
                    scratch = np.multiply(buf, self.momentum)
                    scratch += grads
                else:
                    scratch += np.multiply(buf, self.momentum)
                d = scratch
            else:
                d = buf
        # params -= lr * d, through the scratch array when there is one (d may be it)
        scratch = np.multiply(d, self.lr, out=scratch)
        params -= scratch


class Adam(Optimizer):
    """Adam, as ``torch.optim.Adam``: ``weight_decay`` is an L2 term added to the gradient.

    ``m = lerp(m, g, 1 - beta1)``, ``v = beta2 * v + (1 - beta2) * g * g``, and
    ``param -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``.
    Buffers: ``exp_avg`` and ``exp_avg_sq``.
    """

    #: True for AdamW: the weight decay shrinks the parameters, it is not part of the gradient.
    decoupled_weight_decay = False

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(lr)
        self.betas = (0.9, 0.999)
        self.eps = 1e-8
        self.weight_decay = 0.0
        self._configure({"betas": betas, "eps": eps, "weight_decay": weight_decay})

    @property
    def hyper(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay}

    def _configure(self, hyper: Mapping[str, Any]) -> None:
        h = {**self.hyper, **hyper}
        lr = _check_lr(h["lr"])
        eps = float(h["eps"])
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        raw = tuple(h["betas"])
        if len(raw) != 2:
            raise ValueError(f"betas must be a pair, got {raw!r}")
        betas = (float(raw[0]), float(raw[1]))
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        weight_decay = _check_nonnegative("weight_decay", h["weight_decay"])
        self._lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay

    def _buffer_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _update(self, params: np.ndarray, grads: np.ndarray) -> None:
        beta1, beta2 = self.betas
        lr, wd, t = self.lr, self.weight_decay, self._step
        exp_avg, exp_avg_sq = self._buffers["exp_avg"], self._buffers["exp_avg_sq"]
        g = grads
        if wd != 0:
            if self.decoupled_weight_decay:
                params *= 1.0 - lr * wd
            else:
                g = np.multiply(params, wd)
                g += grads
        tmp = np.subtract(g, exp_avg)
        # exp_avg.lerp_(g, w), computed the way torch does on either side of w = 0.5
        w = 1.0 - beta1
        if w < 0.5:
            tmp *= w
            exp_avg += tmp
        else:
            tmp *= 1.0 - w
            np.subtract(g, tmp, out=exp_avg)
        exp_avg_sq *= beta2
        np.multiply(g, g, out=tmp)
        tmp *= 1.0 - beta2
        exp_avg_sq += tmp
        step_size = lr / (1.0 - beta1**t)
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**t)
        np.sqrt(exp_avg_sq, out=tmp)
        tmp /= bias_correction2_sqrt
        tmp += self.eps
        np.divide(exp_avg, tmp, out=tmp)
        tmp *= step_size
        params -= tmp


class AdamW(Adam):
    """AdamW, as ``torch.optim.AdamW``: Adam whose weight decay is decoupled from the
    gradient, ``param *= 1 - lr * weight_decay`` before the Adam update."""

    decoupled_weight_decay = True

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(lr, betas, eps, weight_decay)


__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
