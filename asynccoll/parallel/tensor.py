"""Tensor parallelism, Megatron style: each linear layer's weight split over a tensor group.

A linear layer ``z = x @ W.T + b`` with ``W`` of shape ``(out, in)`` is split one of two ways
over the ``T`` ranks of a tensor-parallel communicator:

* **column parallel** (``ColumnParallel``): rank ``t`` holds the rows ``out_t`` of ``W``
  and the matching slice of ``b``. The input is whole on every rank, the output stays sharded
  along its features: no communication forward. Backward, every rank's part of the input
  gradient ``dz_t @ W_t`` is a partial sum: one ``all_reduce`` gives the whole one.
* **row parallel** (``RowParallel``): rank ``t`` holds the columns ``in_t`` of ``W`` and
  the *whole* bias. The input is sharded along its features (it is what a column layer
  produced), each rank computes a partial output ``x_t @ W_t.T``: one ``all_reduce`` sums
  them, and the bias is added once, after it. Backward, the input gradient ``dz @ W_t`` is
  this rank's shard already: no communication.

A column layer, an elementwise activation (which needs no communication on a sharded tensor)
and a row layer thus cost one ``all_reduce`` forward and one backward per pair, of a
``(batch, features)`` activation. Splits follow ``numpy.array_split``: when the size does not
divide ``T``, the first ranks hold one row (column) more, and a rank may hold none.

``TensorParallelMLP`` is the reference ``MLP`` split this way
(layers alternate column, row, column, row, ...; an odd last layer is replicated) and is a
``Model``, so ``DistributedModel(tp_model, data_comm, ...)``
trains it data parallel over tensor parallel.

With torch installed, ``ColumnParallelLinear`` and ``RowParallelLinear`` are the
same layers as torch modules, for a ``TorchModel``: their
autograd functions run the collectives from TorchModel's worker thread on the event loop
(``LoopBridge``). The classes are built when first used, so importing this module does
not import torch.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import itertools
import math
import operator
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ._mlp_math import (
    activate,
    activation_grad,
    add_dense_grads,
    check_batch,
    check_config,
    check_inputs,
    dense,
    initial_layers,
    mean_loss,
)
from .layout import split_bounds
from .mlp import MLP, _LayerArrays
from .model import Hooks, Model, ModelParallelGroup, NoHooks, ParamSpec

if TYPE_CHECKING:
    from ..collectives import Communicator

    #: built on first use (see ``_torch_layers``)
    ColumnParallelLinear: Any
    RowParallelLinear: Any

#: Seconds between a torch layer's checks that the event loop still runs while it waits for a
#: collective (as ``asynccoll.parallel.torch_model.POLL_INTERVAL``).
POLL_INTERVAL = 0.25


# ---------------------------------------------------------------------------------- layers


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelLinear(abc.ABC):
    """How one linear layer ``z = x @ W.T + b`` (``W``: ``(out, in)``) is split over the
    tensor group ``comm``, and its forward and backward passes on this rank's shard.

    The layer holds no arrays: the weights and gradients are passed in, so that a
    ``Model`` can keep them in the arrays a training wrapper
    binds. Every rank of ``comm`` calls the coroutines in the same order (they may run
    collectives on ``comm``).
    """

    in_features: int
    out_features: int
    comm: Communicator = field(repr=False, compare=False)

    #: ``"column"``, ``"row"`` or ``"replicated"``
    kind: ClassVar[str]
    #: whether the layer takes / gives activations sharded along the features
    input_sharded: ClassVar[bool]
    output_sharded: ClassVar[bool]

    def __post_init__(self) -> None:
        for what in ("in_features", "out_features"):
            value = operator.index(getattr(self, what))
            if value < 1:
                raise ValueError(f"{what} must be positive, got {value}")

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rows(self) -> tuple[int, int]:
        """The ``(start, stop)`` of ``W``'s rows (output features) this rank holds."""
        return (0, self.out_features)

    @property
    def cols(self) -> tuple[int, int]:
        """The ``(start, stop)`` of ``W``'s columns (input features) this rank holds."""
        return (0, self.in_features)

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The shape of this rank's weight shard."""
        (r0, r1), (c0, c1) = self.rows, self.cols
        return (r1 - r0, c1 - c0)

    @property
    def bias_shape(self) -> tuple[int]:
        """The shape of this rank's bias (a slice for column layers, whole otherwise)."""
        return (self.rows[1] - self.rows[0],)

    def shard(self, weight: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's slices of the whole ``weight`` ``(out, in)`` and ``bias`` ``(out,)``,
        as new arrays. Raises ``ValueError`` for arrays of another shape."""
        weight, bias = np.asarray(weight), np.asarray(bias)
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"weight must have shape {(self.out_features, self.in_features)},"
                             f" got {weight.shape}")
        if bias.shape != (self.out_features,):
            raise ValueError(f"bias must have shape {(self.out_features,)}, got {bias.shape}")
        (r0, r1), (c0, c1) = self.rows, self.cols
        return weight[r0:r1, c0:c1].copy(), bias[r0:r1].copy()

    async def gather(self, weight: np.ndarray, bias: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The whole weight and bias, as new arrays, from every rank's shard (``weight``
        and ``bias`` are this rank's). Runs collectives: call it on every rank."""
        return weight.copy(), bias.copy()

    @abc.abstractmethod
    async def forward(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """``z = x @ W.T + b`` for this rank: a new ``(batch, features)`` array, sharded or
        whole as ``output_sharded`` says. ``x`` is sharded as ``input_sharded``
        says."""

    @abc.abstractmethod
    async def input_grad(self, grad: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """d(loss)/dx (sharded as the input is) from ``grad`` = d(loss)/dz (sharded as the
        output is): a new array."""

    def add_weight_grads(self, x: np.ndarray, grad: np.ndarray, grad_weight: np.ndarray,
                         grad_bias: np.ndarray) -> None:
        """Add d(loss)/dW and d(loss)/db of this rank's shard into ``grad_weight`` and
        ``grad_bias`` (no communication for any split)."""
        add_dense_grads(x, grad, grad_weight, grad_bias)


@dataclass(frozen=True, slots=True, kw_only=True)
class ColumnParallel(ParallelLinear):
    """Weight split along the output features: rank ``t`` holds rows ``out_t`` of ``W`` and
    of ``b``. Input whole, output sharded; no communication forward, one ``all_reduce`` of
    the ``(batch, in)`` input gradient backward."""

    kind: ClassVar[str] = "column"
    input_sharded: ClassVar[bool] = False
    output_sharded: ClassVar[bool] = True

    @property
    def rows(self) -> tuple[int, int]:
        return split_bounds(self.out_features, self.world_size)[self.rank]

    async def gather(self, weight: np.ndarray, bias: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        w = await self.comm.all_gather(np.ascontiguousarray(weight))
        b = await self.comm.all_gather(np.ascontiguousarray(bias))
        return w, b

    async def forward(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        return dense(x, weight, bias)

    async def input_grad(self, grad: np.ndarray, weight: np.ndarray) -> np.ndarray:
        dx = np.ascontiguousarray(grad @ weight)       # this rank's partial sum
        return await self.comm.all_reduce(dx)


@dataclass(frozen=True, slots=True, kw_only=True)
class RowParallel(ParallelLinear):
    """Weight split along the input features: rank ``t`` holds columns ``in_t`` of ``W`` and
    the whole bias. Input sharded, output whole; one ``all_reduce`` of the ``(batch, out)``
    partial outputs forward, no communication backward."""

    kind: ClassVar[str] = "row"
    input_sharded: ClassVar[bool] = True
    output_sharded: ClassVar[bool] = False

    @property
    def cols(self) -> tuple[int, int]:
        return split_bounds(self.in_features, self.world_size)[self.rank]

    async def gather(self, weight: np.ndarray, bias: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        # all_gather concatenates along axis 0: gather the transposed shards
        w = await self.comm.all_gather(np.ascontiguousarray(weight.T))
        return np.ascontiguousarray(w.T), bias.copy()

    async def forward(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        z = np.ascontiguousarray(x @ weight.T)          # this rank's partial sum
        await self.comm.all_reduce(z)
        z += bias                                       # once, after the sum
        return z

    async def input_grad(self, grad: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return grad @ weight


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicated(ParallelLinear):
    """Not split: every rank holds the whole layer and computes the same thing (no
    communication; its gradients come out identical on every rank)."""

    kind: ClassVar[str] = "replicated"
    input_sharded: ClassVar[bool] = False
    output_sharded: ClassVar[bool] = False

    async def forward(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
        return dense(x, weight, bias)

    async def input_grad(self, grad: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return grad @ weight


def replicated_params(layer: ParallelLinear) -> tuple[str, ...]:
    """Which of ``weight``/``bias`` every rank of the group holds whole: a row-parallel
    layer's bias, a replicated layer's both (their gradients are the same on every rank)."""
    if isinstance(layer, Replicated):
        return ("weight", "bias")
    return ("bias",) if isinstance(layer, RowParallel) else ()


def torch_model_parallel_groups(module: Any) -> list[ModelParallelGroup]:
    """The tensor group of a torch module's ``ColumnParallelLinear``/``RowParallelLinear``
    layers, for the global gradient norm: every parameter but the layers' shards (their
    weights, a column layer's bias) is taken to be held whole by every rank of the group,
    as Megatron-style models hold it. None when the module has no such layer (over more
    than one rank); ``ValueError`` when its layers use different groups."""
    groups: dict[int, Communicator] = {}
    sharded: set[str] = set()
    for prefix, m in module.named_modules():
        split = getattr(m, "split", None)
        if isinstance(split, ParallelLinear) and split.comm.world_size > 1:
            groups[id(split.comm)] = split.comm
            sharded.update(f"{prefix}.{kind}" if prefix else kind for kind in ("weight", "bias")
                           if kind not in replicated_params(split))
    if not groups:
        return []
    if len(groups) > 1:
        raise ValueError("the module's tensor-parallel layers use different communicators; "
                         "the global gradient norm needs them all over one tensor group")
    names = [n for n, _ in module.named_parameters()]
    return [ModelParallelGroup(comm=next(iter(groups.values())),
                               replicated=frozenset(n for n in names if n not in sharded))]


def megatron_layers(sizes: Sequence[int], comm: Communicator) -> list[ParallelLinear]:
    """The layers of an MLP of widths ``sizes`` split over ``comm``: column, row, column,
    row, ...; when the number of layers is odd the last one is ``Replicated``. Every
    activation between layers is then whole after a row layer and sharded after a column
    layer, and the network's input and output are whole."""
    widths = [operator.index(s) for s in sizes]
    n = len(widths) - 1
    layers: list[ParallelLinear] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        cls: type[ParallelLinear]
        if i % 2 == 1:
            cls = RowParallel
        elif i == n - 1:
            cls = Replicated
        else:
            cls = ColumnParallel
        layers.append(cls(in_features=fan_in, out_features=fan_out, comm=comm))
    return layers


# ---------------------------------------------------------------------------------- model


class TensorParallelMLP(_LayerArrays, Model):
    """The reference ``MLP``, tensor parallel over ``comm``.

    Layers alternate ``ColumnParallel`` and ``RowParallel`` (see
    ``megatron_layers``); with an odd number of layers the last one is
    ``Replicated``, which costs no communication (its input, a row layer's output, is
    whole on every rank) at the price of holding and computing it on every rank. Each
    column+row pair runs one ``all_reduce`` forward (in the row layer) and one backward (in
    the column layer; none for the first layer, whose input gradient nobody needs).

    Every rank of ``comm`` gets the *whole* batch and computes the same loss. Parameters are
    named as the MLP's (``layers.{i}.weight`` / ``layers.{i}.bias``, unit ``i``), with this
    rank's shard shapes; sizes that do not divide ``comm.world_size`` are split as
    ``numpy.array_split`` splits them (a rank may hold an empty shard).

    Args:
        sizes, activation, loss, dtype, seed: as ``MLP``; the initial parameters are
            this rank's slices of those of ``MLP(sizes, ..., seed=seed)``.
        comm: the tensor-parallel group (e.g. a mesh's tensor sub-communicator).
        output_activation: apply the activation after the last layer too (for a pipeline
            stage that is not the last one).
    """

    def __init__(self, sizes: Sequence[int], comm: Communicator, *, activation: str = "tanh",
                 loss: str = "mse", dtype: Any = np.float64, seed: int = 0,
                 output_activation: bool = False) -> None:
        self.sizes, self.dtype = check_config(sizes, activation, loss, dtype)
        self.activation = activation
        self.loss_kind = loss
        self.output_activation = bool(output_activation)
        self.comm = comm
        self.layers = megatron_layers(self.sizes, comm)
        specs: list[ParamSpec] = []
        params: dict[str, np.ndarray] = {}
        # the same draws as MLP, keeping this rank's slices
        full = initial_layers(self.sizes, self.dtype, seed)
        for i, (layer, (full_w, full_b)) in enumerate(zip(self.layers, full, strict=True)):
            for kind, array in zip(("weight", "bias"), layer.shard(full_w, full_b),
                                   strict=True):
                name = f"layers.{i}.{kind}"
                specs.append(ParamSpec(name=name, shape=array.shape, dtype=self.dtype, unit=i))
                params[name] = array
        self._own(specs, params)

    @classmethod
    def from_mlp(cls, mlp: MLP, comm: Communicator, *, output_activation: bool = False
                 ) -> TensorParallelMLP:
        """The tensor-parallel version of ``mlp``, starting from its current parameters (this
        rank keeps its slices; ``mlp`` is not changed). Every rank passes the same ``mlp``."""
        model = cls(mlp.sizes, comm, activation=mlp.activation, loss=mlp.loss_kind,
                    dtype=mlp.dtype, output_activation=output_activation)
        model.load_full_parameters(mlp.parameters())
        return model

    # ------------------------------------------------------------------ Model interface

    @property
    def num_units(self) -> int:
        return len(self.layers)

    def model_parallel_groups(self) -> list[ModelParallelGroup]:
        """The tensor group (the global gradient norm sums the shards over it, counting
        the parameters every rank holds whole once)."""
        if self.comm.world_size == 1:
            return []
        return [ModelParallelGroup(comm=self.comm, replicated=frozenset(
            f"layers.{i}.{kind}" for i, layer in enumerate(self.layers)
            for kind in replicated_params(layer)))]

    async def forward_backward(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of the whole ``batch = (x, y)`` (mean over samples, the same on every rank
        of the group); adds this rank's gradient shards into the bound arrays, calling the
        hooks in the order ``Hooks`` gives.

        Every rank of the group must call it with the same batch. Raises ``ValueError`` for
        a malformed batch (before any hook or collective), ``RuntimeError`` when a
        parameter or gradient it needs is released, and the communicator's errors
        (``CollectiveError``) when a peer fails; gradients then hold a
        partial sum (units already passed backward have their additions).
        """
        hooks = NoHooks() if hooks is None else hooks
        x, y = check_batch(batch, self.sizes, self.loss_kind, self.dtype)
        acts = await self.forward(x, hooks)
        loss, grad = mean_loss(self.loss_kind, acts[-1], y, grad=True)
        await self.backward(acts, grad, hooks)
        return loss

    async def loss(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of the whole ``batch`` without gradients; calls the forward hooks (and runs
        the forward collectives)."""
        hooks = NoHooks() if hooks is None else hooks
        x, y = check_batch(batch, self.sizes, self.loss_kind, self.dtype)
        acts = await self.forward(x, hooks)
        return mean_loss(self.loss_kind, acts[-1], y, grad=False)[0]

    # ------------------------------------------------------------- composable passes

    async def forward(self, x: np.ndarray, hooks: Hooks | None = None) -> list[np.ndarray]:
        """Forward through every layer. Returns the activations: element ``u`` is unit
        ``u``'s input (this rank's shard when the unit is row parallel) and the last
        element is the output, whole on every rank. Calls the forward hooks."""
        hooks = NoHooks() if hooks is None else hooks
        x = check_inputs(x, self.sizes[0], self.dtype)
        acts = [x]
        last = self.num_units - 1
        for u, layer in enumerate(self.layers):
            await hooks.before_forward(u)
            z = await layer.forward(acts[-1], self._param(u, "weight"), self._param(u, "bias"))
            if u < last or self.output_activation:
                activate(z, self.activation)
            acts.append(z)
            await hooks.after_forward(u)
            await asyncio.sleep(0)
        return acts

    async def backward(self, acts: Sequence[np.ndarray], grad_output: np.ndarray,
                       hooks: Hooks | None = None, *, input_grad: bool = False
                       ) -> np.ndarray | None:
        """Backward from d(loss)/d(output) (whole, ``(batch, out)``; overwritten) through the
        activations ``forward`` returned, adding this rank's gradient shards into the
        bound arrays and calling the backward hooks. Returns d(loss)/d(input) (whole, on
        every rank: one more ``all_reduce``) when ``input_grad``, else ``None``."""
        hooks = NoHooks() if hooks is None else hooks
        if len(acts) != self.num_units + 1:
            raise ValueError(f"expected {self.num_units + 1} activations, got {len(acts)}")
        dz = grad_output
        if self.output_activation:
            dz = dz * activation_grad(acts[-1], self.activation)
        for u in reversed(range(self.num_units)):
            layer = self.layers[u]
            await hooks.before_backward(u)
            w = self._param(u, "weight")
            layer.add_weight_grads(acts[u], dz, self._grad(u, "weight"), self._grad(u, "bias"))
            if u > 0 or input_grad:          # needs W of unit u: before after_backward(u)
                dz = await layer.input_grad(dz, w)
                if u > 0:
                    dz *= activation_grad(acts[u], self.activation)
            await hooks.after_backward(u)
            await asyncio.sleep(0)
        return dz if input_grad else None

    async def predict(self, x: np.ndarray) -> np.ndarray:
        """The network's output for ``x`` ``(batch, in)``, whole on every rank (runs the
        forward collectives: call it on every rank of the group)."""
        return (await self.forward(x))[-1]

    # ---------------------------------------------------------- whole parameters

    async def full_parameters(self, params: Mapping[str, np.ndarray] | None = None
                              ) -> dict[str, np.ndarray]:
        """The unsplit parameters, named and shaped as ``MLP``'s, as new arrays on every
        rank. ``params`` are the local shards to gather (default: the bound parameters;
        pass e.g. ``DistributedModel.full_parameters()`` of a ZeRO-3 wrapper, or gradient
        shards). Runs collectives: call it on every rank of the group."""
        local = self._params if params is None else params
        out: dict[str, np.ndarray] = {}
        for i, layer in enumerate(self.layers):
            names = f"layers.{i}.weight", f"layers.{i}.bias"
            for name in names:
                if local[name].shape != self._by_name[name].shape:
                    raise RuntimeError(f"parameter {name!r} is released (zero-size); gather "
                                       f"through the training wrapper")
            out[names[0]], out[names[1]] = await layer.gather(local[names[0]], local[names[1]])
        return out

    def shard_parameters(self, full: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's slices (new arrays) of whole, MLP-named parameters."""
        out: dict[str, np.ndarray] = {}
        for i, layer in enumerate(self.layers):
            names = f"layers.{i}.weight", f"layers.{i}.bias"
            missing = [n for n in names if n not in full]
            if missing:
                raise KeyError(f"no parameter named {missing[0]!r}")
            w, b = layer.shard(full[names[0]], full[names[1]])
            out[names[0]], out[names[1]] = w.astype(self.dtype), b.astype(self.dtype)
        return out

    def load_full_parameters(self, full: Mapping[str, np.ndarray]) -> None:
        """Copy this rank's slices of whole, MLP-named parameters into the bound arrays
        (none is changed when one is missing or of the wrong shape)."""
        shards = self.shard_parameters(full)
        for name, shard in shards.items():
            if self._params[name].shape != shard.shape:
                raise RuntimeError(f"parameter {name!r} is released (zero-size)")
        for name, shard in shards.items():
            np.copyto(self._params[name], shard)


# ---------------------------------------------------------------------------------- torch


class LoopBridge:
    """Runs a communicator's collectives on its event loop from another thread (the
    ``TorchModel`` worker), waiting for the result.

    ``loop`` must be the loop the communicator runs on; by default the running loop when the
    bridge is made (so make it inside a coroutine). Calling from the loop's own thread is a
    ``RuntimeError`` (it would block the loop that has to run the collective).
    """

    def __init__(self, comm: Communicator, loop: asyncio.AbstractEventLoop | None = None
                 ) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError("make tensor-parallel torch layers inside a coroutine on the "
                                   "communicator's event loop, or pass loop=") from None
        self.comm = comm
        self.loop = loop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and wait for its result (from a worker thread)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise RuntimeError("a tensor-parallel torch layer ran in the event loop's thread, "
                               "which its collective needs: run the module through "
                               "TorchModel (forward_backward / loss), not predict()")
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:                            # the loop is closed
            coro.close()
            raise
        # wait() rather than result(timeout=): a CollectiveTimeout is also a TimeoutError
        while not concurrent.futures.wait([fut], timeout=POLL_INTERVAL).done:
            if self.loop.is_closed() or not self.loop.is_running():
                fut.cancel()
                raise RuntimeError("the event loop stopped while a tensor-parallel "
                                   "collective was pending")
        return fut.result()

    def all_reduce(self, array: np.ndarray) -> np.ndarray:
        """``comm.all_reduce(array)`` (sum, in place), from a worker thread."""
        return self.run(self.comm.all_reduce(array))  # type: ignore[no-any-return]


@functools.cache
def _torch_layers() -> tuple[type, type]:
    """Build the torch layer classes (once; functools' cache plays the part ``sys.modules``
    plays for an imported module)."""
    from .torch_model import import_torch

    torch = import_torch()
    nn, F = torch.nn, torch.nn.functional
    Function: Any = torch.autograd.Function
    Module: Any = nn.Module

    def _reduced(tensor: Any, bridge: LoopBridge) -> Any:
        buf = np.array(tensor.detach().numpy(), order="C", copy=True)
        bridge.all_reduce(buf)
        return torch.from_numpy(buf)

    class _CopyToTensorParallel(Function):
        """Identity forward; the gradient is summed over the tensor group backward."""

        @staticmethod
        def forward(ctx: Any, x: Any, bridge: LoopBridge) -> Any:
            ctx.bridge = bridge
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return _reduced(grad, ctx.bridge), None

    class _ReduceFromTensorParallel(Function):
        """Sum over the tensor group forward; identity backward."""

        @staticmethod
        def forward(ctx: Any, x: Any, bridge: LoopBridge) -> Any:
            return _reduced(x, bridge)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad, None

    def _init(module: Any, fan_in: int) -> None:
        bound = 1.0 / math.sqrt(fan_in) if fan_in else 0.0
        with torch.no_grad():
            module.weight.uniform_(-bound, bound)
            if module.bias is not None:
                module.bias.uniform_(-bound, bound)

    class _ShardedLinear(Module):
        """What both torch layers share: ``nn.Linear``'s parameters, this rank's shard of
        them as ``_split_type`` splits them, and the loop bridge."""

        _split_type: ClassVar[type[ParallelLinear]]
        #: the property of ``split`` (the shard this rank holds) that ``extra_repr`` shows
        _held: ClassVar[str]

        def __init__(self, in_features: int, out_features: int, comm: Communicator, *,
                     bias: bool = True, dtype: Any = None,
                     loop: asyncio.AbstractEventLoop | None = None) -> None:
            super().__init__()
            self.split = self._split_type(in_features=in_features, out_features=out_features,
                                          comm=comm)
            self.bridge = LoopBridge(comm, loop)
            rows, cols = self.split.weight_shape
            self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype))
            self.bias = nn.Parameter(torch.empty(rows, dtype=dtype)) if bias else None
            _init(self, in_features)

        @classmethod
        def from_linear(cls, linear: Any, comm: Communicator, *,
                        loop: asyncio.AbstractEventLoop | None = None) -> Any:
            """This rank's shard of a whole ``nn.Linear`` (copied)."""
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"expected a torch.nn.Linear, got {type(linear).__name__}")
            module: Any = cls(linear.in_features, linear.out_features, comm,
                              bias=linear.bias is not None, dtype=linear.weight.dtype,
                              loop=loop)
            (r0, r1), (c0, c1) = module.split.rows, module.split.cols
            with torch.no_grad():
                module.weight.copy_(linear.weight[r0:r1, c0:c1])
                if linear.bias is not None:
                    module.bias.copy_(linear.bias[r0:r1])
            return module

        async def full_parameters(self) -> dict[str, np.ndarray]:
            """The whole ``weight`` (and ``bias``) as NumPy arrays (call on every rank)."""
            w = self.weight.detach().numpy()
            if self.bias is not None:
                b = self.bias.detach().numpy()
            else:
                b = np.zeros(self.split.bias_shape, w.dtype)
            full_w, full_b = await self.split.gather(w, b)
            return {"weight": full_w} if self.bias is None else {"weight": full_w,
                                                                 "bias": full_b}

        def extra_repr(self) -> str:
            return (f"in_features={self.split.in_features}, out_features="
                    f"{self.split.out_features}, {self._held}={getattr(self.split, self._held)}")

    class ColumnParallelLinear(_ShardedLinear):
        """``nn.Linear`` split along the output features over the tensor group ``comm``:
        holds rows ``out_t`` of the weight (and bias). Input whole, output sharded; the
        input gradient is all-reduced backward (only when the input needs a gradient).

        Run it through ``TorchModel`` (its worker
        thread); make it inside a coroutine on ``comm``'s loop, or pass ``loop=``. Weights
        are initialised as ``nn.Linear`` initialises the shard (use ``from_linear`` to
        start from a whole layer).
        """

        _split_type = ColumnParallel
        _held = "rows"

        def forward(self, x: Any) -> Any:
            if x.requires_grad:
                x = _CopyToTensorParallel.apply(x, self.bridge)
            return F.linear(x, self.weight, self.bias)

    class RowParallelLinear(_ShardedLinear):
        """``nn.Linear`` split along the input features over the tensor group ``comm``:
        holds columns ``in_t`` of the weight and the whole bias. Input sharded (a
        ``ColumnParallelLinear``'s output), output whole: the partial outputs are
        all-reduced forward, the bias added after; nothing is communicated backward.
        Same threading rules as ``ColumnParallelLinear``.
        """

        _split_type = RowParallel
        _held = "cols"

        def forward(self, x: Any) -> Any:
            z = _ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.bridge)
            return z if self.bias is None else z + self.bias

    return ColumnParallelLinear, RowParallelLinear


def __getattr__(name: str) -> Any:
    if name == "ColumnParallelLinear":
        return _torch_layers()[0]
    if name == "RowParallelLinear":
        return _torch_layers()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ColumnParallel", "ColumnParallelLinear", "LoopBridge", "ParallelLinear",
           "Replicated", "RowParallel", "RowParallelLinear", "TensorParallelMLP",
           "megatron_layers"]
