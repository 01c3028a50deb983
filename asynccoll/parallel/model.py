"""What a model is to the training wrappers: named parameter arrays grouped into units, and an
async forward/backward pass that reports, through hooks, when it enters and leaves each unit.

The wrappers own the memory: they allocate flat buffers, cut them into per-parameter views, and
``Model.bind`` makes the model read its parameters from (and accumulate its gradients into)
those views. That is what lets them communicate few large arrays instead of many small ones,
and, for ZeRO-3, materialise a unit's parameters only while the unit runs.

A *unit* is the granularity of that schedule: a layer of the reference MLP, a child module of a
torch model. Units are numbered in forward order; every parameter belongs to exactly one unit.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from ..collectives import Communicator


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """One parameter array: its name, shape, dtype and the unit it belongs to.

    ``trainable=False`` marks a frozen parameter (torch's ``requires_grad=False``): it gets no
    gradient, and the training wrappers' optimizers leave it as it is (no weight decay).
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    unit: int
    trainable: bool = True

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferSpec:
    """One buffer: state the forward pass reads and may update in place, but that no
    gradient trains (torch's module buffers: BatchNorm's ``running_mean``, ``running_var``,
    ``num_batches_tracked``, anything ``register_buffer`` made).

    ``persistent=False`` marks a buffer that is not part of the model's saved state (torch's
    ``register_buffer(..., persistent=False)``): the data-parallel wrappers keep it
    consistent across ranks like the others, but checkpoints leave it out.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    persistent: bool = True

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelParallelGroup:
    """Ranks that hold the other parts of a model split over them (a pipe group, a tensor
    group), for the global gradient norm.

    ``replicated`` names this rank's parameters that every rank of the group holds whole,
    with the same gradient (a row-parallel layer's bias, a replicated layer): the norm counts
    them once, on the group's rank 0.
    """

    comm: Communicator
    replicated: frozenset[str] = frozenset()


class Hooks(Protocol):
    """Called by ``Model.forward_backward`` around every unit, in this order per unit:
    ``before_forward(u)`` / ``after_forward(u)`` for u = 0..n-1, then ``before_backward(u)`` /
    ``after_backward(u)`` for u = n-1..0. ``after_backward(u)`` means the gradients of unit u
    are final for this pass (a wrapper may start communicating them). Hooks may await
    communication; the pass waits for them."""

    async def before_forward(self, unit: int) -> None: ...
    async def after_forward(self, unit: int) -> None: ...
    async def before_backward(self, unit: int) -> None: ...
    async def after_backward(self, unit: int) -> None: ...


class NoHooks:
    """Hooks that do nothing (a plain single-process pass)."""

    async def before_forward(self, unit: int) -> None:
        return None

    async def after_forward(self, unit: int) -> None:
        return None

    async def before_backward(self, unit: int) -> None:
        return None

    async def after_backward(self, unit: int) -> None:
        return None


class Model(abc.ABC):
    """The interface the training wrappers program against.

    Contract:

    * ``param_specs`` is fixed for the model's life (but for ``trainable``, which may follow
      the model's own freezing, as torch's ``requires_grad``); names are unique; units are
      numbered ``0..num_units-1`` in forward order and every unit has at least one parameter.
    * ``bind`` replaces the arrays the model uses, without copying: after
      ``bind(params={"w": view})`` the model reads ``w`` from ``view`` (and sees later in-place
      changes to it). Partial mappings rebind only the names given. A wrapper may bind a
      zero-size array to a parameter that is not needed until a hook says otherwise (ZeRO-3).
    * ``forward_backward`` computes the loss of ``batch`` as a *mean over its samples*
      and **adds** d(loss)/d(param) into the bound gradient arrays (the caller zeroes them;
      adding is what makes gradient accumulation work).
    * ``buffer_specs`` / ``buffers`` (optional; none by default) describe the model's
      buffers: names, shapes and dtypes fixed for the model's life, and the arrays the model
      currently uses (no copies: writing into them changes the model). The wrappers own no
      memory for buffers; they read and overwrite these arrays between passes (rank 0's
      buffers reach every rank, checkpoints save them).
    """

    @abc.abstractmethod
    def param_specs(self) -> list[ParamSpec]:
        """The parameters, in a fixed order (units ascending, then within each unit)."""

    @property
    def num_units(self) -> int:
        return max(s.unit for s in self.param_specs()) + 1

    @abc.abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """The arrays the model currently reads its parameters from (no copies)."""

    def buffer_specs(self) -> list[BufferSpec]:
        """The buffers, in a fixed order; none unless the model has some."""
        return []

    def buffers(self) -> dict[str, np.ndarray]:
        """The arrays the model currently keeps its buffers in (no copies; writable), by
        name, as ``buffer_specs`` lists them; none unless the model has some. Read afresh
        for every use: a model may replace a buffer's array (torch modules may reassign
        one)."""
        return {}

    def model_parallel_groups(self) -> list[ModelParallelGroup]:
        """For a model split over ranks (pipeline stages, tensor shards), the groups of ranks
        that hold its other parts, innermost first: the global gradient norm
        (``DistributedModel.clip_grad_norm``) sums over them. None for a model that is whole
        on every rank (the default)."""
        return []

    @abc.abstractmethod
    def bind(self, params: Mapping[str, np.ndarray] | None = None,
             grads: Mapping[str, np.ndarray] | None = None) -> None:
        """Make the model use these arrays (of the spec's shape and dtype, or zero-size for
        parameters that are released) for parameters and gradients, without copying."""

    @abc.abstractmethod
    async def forward_backward(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch`` (mean over samples); adds the gradients into the bound arrays."""

    @abc.abstractmethod
    async def loss(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch`` without gradients (evaluation); calls only the forward hooks."""


def split_batch(batch: Sequence[np.ndarray], rank: int, world_size: int) -> tuple[np.ndarray, ...]:
    """This rank's share of a batch of arrays split along axis 0 (``numpy.array_split``)."""
    return tuple(np.array_split(a, world_size)[rank] for a in batch)
