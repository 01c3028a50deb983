"""Pipeline parallelism: a sequential model cut into stages, one per rank of a pipe group.

Stage ``i`` of ``P`` runs on rank ``i`` of the pipeline communicator. A batch is cut into ``M``
micro-batches (``numpy.array_split`` along axis 0); activations travel forward from stage to
stage with ``comm.send``/``comm.recv``, gradients travel back, and the stages work on different
micro-batches at the same time. Two schedules decide the order of a stage's work:

* ``"gpipe"``: every forward, then every backward. Simple, but a stage holds the saved
  activations of all ``M`` micro-batches at the peak.
* ``"1f1b"`` (PipeDream-flush, Megatron's default): ``P - i - 1`` warm-up forwards, then one
  forward and one backward in turn, then the remaining backwards. The same bubble as GPipe,
  but stage ``i`` never holds more than ``P - i`` micro-batches: memory bounded by the depth
  of the pipeline, not by ``M``.

The loss is the mean over the whole batch: micro-batch ``j`` of ``n_j`` samples out of ``N``
contributes its mean loss times ``n_j / N``, so the gradients equal those of one pass over the
batch even when the micro-batches differ in size.

``PipelineParallel`` is itself a ``Model`` (the stage's
parameters, the whole schedule as one pass), so data parallelism composes on top of it:

    mesh = await Mesh.create(comm, data=2, pipe=2)
    stage = split_mlp(mlp, mesh.shape.pipe)[mesh.coords.pipe]
    pp = PipelineParallel(stage, mesh.pipe, micro_batches=4)
    dist = DistributedModel(pp, mesh.data, Adam(lr=1e-3), strategy="zero2")
    loss = await dist.step(split_batch(batch, mesh.coords.data, mesh.shape.data))

>>> print(timeline("1f1b", stages=2, micro_batches=3))
stage 0 | F0 F1 .  B0 F2 B1 .  B2 | peak 2
stage 1 | .  F0 B0 F1 B1 F2 B2 .  | peak 1
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from ..collectives import Communicator
from ._failure import break_comm, first_error
from ._mlp_math import (
    activation_grad,
    add_dense_grads,
    check_inputs,
    check_targets,
    dense,
    mean_loss,
)
from .clip import (
    SquareSum,
    check_max_norm,
    clip_coefficient,
    counted,
    excluded_ranges,
    global_sum,
)
from .layout import FlatLayout
from .mlp import MLP, _BoundArrays, _LayerArrays
from .model import BufferSpec, Hooks, Model, ModelParallelGroup, NoHooks, ParamSpec
from .optim import Optimizer, step_keeping

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
BALANCES: tuple[str, ...] = ("params", "layers")

#: Point-to-point tags of the pipeline: ``TAG_BASE + 2 * micro_batch`` carries an activation
#: forward, ``+ 1`` its gradient backward (the pass order keeps passes apart: messages with
#: one tag arrive in the order they were sent).
TAG_BASE = 1 << 40


def _tag(micro_batch: int, backward: bool) -> int:
    return TAG_BASE + 2 * micro_batch + int(backward)


# ------------------------------------------------------------------------------ schedules


def schedule_ops(schedule: str, stage: int, stages: int, micro_batches: int
                 ) -> list[tuple[str, int]]:
    """The order in which ``stage`` (of ``stages``) runs ``("F", j)`` forwards and
    ``("B", j)`` backwards of micro-batches ``j = 0..micro_batches-1``.

    >>> schedule_ops("1f1b", 0, 3, 4)
    [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is out of range for {stages} stages")
    m = micro_batches
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(stages - stage - 1, m)
    ops = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        ops += [("F", warm + j), ("B", j)]
    ops += [("B", j) for j in range(m - warm, m)]
    return ops


def timeline(schedule: str, stages: int, micro_batches: int, *, backward_cost: int = 1) -> str:
    """An ASCII diagram of the schedule: one row per stage, one column per time slot, when a
    forward takes one slot and a backward ``backward_cost`` slots and every op starts as soon
    as its input has arrived (``.`` = idle). Each row ends with the most micro-batches that
    stage holds activations for at once."""
    ops = [schedule_ops(schedule, s, stages, micro_batches) for s in range(stages)]
    done: dict[tuple[str, int, int], int] = {}          # (kind, stage, j) -> finish time
    rows: list[list[str]] = [[] for _ in range(stages)]
    pos = [0] * stages
    while any(pos[s] < len(ops[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(ops[s]):
                continue
            kind, j = ops[s][pos[s]]
            dep = ("F", s - 1, j) if kind == "F" and s > 0 else \
                  ("B", s + 1, j) if kind == "B" and s < stages - 1 else None
            if dep is not None and dep not in done:
                continue
            start = max(len(rows[s]), done[dep] if dep is not None else 0)
            cost = 1 if kind == "F" else backward_cost
            rows[s] += ["."] * (start - len(rows[s])) + [f"{kind}{j}"] * cost
            done[(kind, s, j)] = len(rows[s])
            pos[s] += 1
            progressed = True
        if not progressed:                   # impossible for the schedules above
            raise RuntimeError("the schedule deadlocks")
    width = max(len(c) for row in rows for c in row)
    end = max(len(r) for r in rows)
    lines = []
    for s, row in enumerate(rows):
        held = peak = 0
        for kind, _ in ops[s]:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        cells = " ".join(c.ljust(width) for c in row + ["."] * (end - len(row)))
        lines.append(f"stage {s} | {cells} | peak {peak}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ splitting


def balanced_cuts(costs: Sequence[float], stages: int) -> list[int]:
    """Where to cut ``len(costs)`` layers into ``stages`` non-empty contiguous stages so that
    the costliest stage costs as little as possible (exact, by dynamic programming). Ties go
    to the partition whose later stages hold more. Returns the ``stages - 1`` cut points:
    stage ``i`` holds layers ``[cuts[i-1], cuts[i])``.

    >>> balanced_cuts([4, 1, 1, 1, 1], 2)
    [1]
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"layer costs must be non-negative, got {c}")
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], arg[k][i] = v, j
    cuts = []
    i = n
    for k in range(stages, 1, -1):
        i = arg[k][i]
        cuts.append(i)
    return cuts[::-1]


def stage_bounds(num_layers: int, stages: int | None = None, cuts: Sequence[int] | None = None,
                 costs: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """The ``[start, stop)`` layer range of every stage: from ``cuts`` (validated: strictly
    increasing, inside ``(0, num_layers)``, ``stages - 1`` of them when both are given), or
    else ``balanced_cuts`` of ``costs`` (default: one per layer) into ``stages``."""
    if cuts is None:
        if stages is None:
            raise ValueError("give the number of stages or the cut points")
        weights = [1.0] * num_layers if costs is None else list(costs)
        if len(weights) != num_layers:
            raise ValueError(f"{len(weights)} costs for {num_layers} layers")
        cuts = balanced_cuts(weights, operator.index(stages))
    points = [operator.index(c) for c in cuts]
    if stages is not None and len(points) != stages - 1:
        raise ValueError(f"{stages} stages need {stages - 1} cut points, got {points}")
    edges = [0, *points, num_layers]
    if any(a >= b for a, b in itertools.pairwise(edges)):
        raise ValueError(f"cut points must increase strictly inside (0, {num_layers}) so that "
                         f"no stage is empty, got {points}")
    return list(itertools.pairwise(edges))


def mlp_partition(mlp: MLP, stages: int | None = None, *, cuts: Sequence[int] | None = None,
                  balance: str = "params") -> list[tuple[int, int]]:
    """The layer ranges of ``split_mlp``, without building stages."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    costs = [float(sum(s.size for s in mlp.param_specs() if s.unit == u))
             for u in range(mlp.num_units)] if balance == "params" else None
    return stage_bounds(mlp.num_units, stages, cuts, costs)


def split_mlp(mlp: MLP, stages: int | None = None, *, cuts: Sequence[int] | None = None,
              balance: str = "params") -> list[MLPStage]:
    """Cut ``mlp`` into ``MLPStage`` s: at ``cuts`` (the first layer of every stage but
    the first), or into ``stages`` stages balanced by parameter count (``balance="params"``:
    the largest stage as small as possible) or by number of layers (``"layers"``).

    Raises ``ValueError`` for cut points that are not strictly increasing inside
    ``(0, num_layers)``, or more stages than layers.
    """
    return [MLPStage(mlp, a, b) for a, b in mlp_partition(mlp, stages, cuts=cuts,
                                                          balance=balance)]


def split_sequential(module: torch.nn.Sequential, stages: int | None = None, *,
                     cuts: Sequence[int] | None = None, balance: str = "params"
                     ) -> list[torch.nn.Sequential]:
    """Cut an ``nn.Sequential`` into slices (sharing its modules; parameter names keep the
    original indices, ``"2.weight"``). ``cuts`` are child indices; balancing keeps every
    parameter-free child (an activation) with the child before it."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(BALANCES)}, got {balance!r}")
    children = list(module)
    sizes = [sum(p.numel() for p in c.parameters()) for c in children]
    if cuts is None:
        heads = [i for i, n in enumerate(sizes) if n] or [0]
        heads[0] = 0                             # leading parameter-free children join
        ends = [*heads[1:], len(children)]
        costs = [float(sum(sizes[a:b])) if balance == "params" else 1.0
                 for a, b in zip(heads, ends, strict=True)]
        blocks = stage_bounds(len(heads), stages, None, costs)
        cuts = [heads[a] for a, _ in blocks[1:]]
    return [cast("torch.nn.Sequential", module[a:b])
            for a, b in stage_bounds(len(children), stages, cuts)]


# ---------------------------------------------------------------------------------- stages


class _Saved(dict[int, T]):
    """What a stage keeps from each micro-batch's forward for its backward, by micro-batch."""

    def check_free(self, mb: int) -> None:
        """Raise ``ValueError`` if micro-batch ``mb`` already has saved state."""
        if mb in self:
            raise ValueError(f"micro-batch {mb} was forwarded and not yet backwarded")

    def take(self, mb: int) -> T:
        """Remove and return micro-batch ``mb``'s state (``ValueError`` if it has none)."""
        if mb not in self:
            raise ValueError(f"micro-batch {mb} has no saved forward state")
        return self.pop(mb)


def _layer_range(mlp: MLP, start: int, stop: int) -> tuple[int, int]:
    """``(start, stop)`` as ints, checked to be a non-empty range of ``mlp``'s layers."""
    start, stop = operator.index(start), operator.index(stop)
    if not 0 <= start < stop <= mlp.num_units:
        raise ValueError(f"a stage needs layers [start, stop) with 0 <= start < stop <= "
                         f"{mlp.num_units}, got [{start}, {stop})")
    return start, stop


class Stage(abc.ABC):
    """A contiguous slice of a sequential model, run one micro-batch at a time.

    The parameter side is the ``Model`` contract
    (``param_specs`` with units numbered ``0..k-1`` within the stage, ``parameters``,
    ``bind``), so a data-parallel wrapper can own a stage's memory. The compute side is
    per micro-batch: ``forward`` keeps what ``backward`` of the same micro-batch
    needs; several micro-batches may be in flight. Activations are NumPy arrays. The methods
    are coroutines so that a stage may communicate inside them (a tensor-parallel stage) or
    compute in a thread (``TorchStage``).
    """

    @abc.abstractmethod
    def param_specs(self) -> list[ParamSpec]:
        """The stage's parameters, units ``0..num_units-1`` in forward order."""

    @abc.abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """The arrays the stage reads its parameters from (no copies)."""

    @abc.abstractmethod
    def bind(self, params: Mapping[str, np.ndarray] | None = None,
             grads: Mapping[str, np.ndarray] | None = None) -> None:
        """Read parameters from / add gradients into these arrays (as ``Model.bind``)."""

    @property
    def num_units(self) -> int:
        return max(s.unit for s in self.param_specs()) + 1

    def buffer_specs(self) -> list[BufferSpec]:
        """The stage's buffers (as ``Model.buffer_specs``); none by default."""
        return []

    def buffers(self) -> dict[str, np.ndarray]:
        """The arrays the stage keeps its buffers in (as ``Model.buffers``: no copies,
        writable, read afresh for every use); none by default."""
        return {}

    @property
    def computes_loss(self) -> bool:
        """Whether this is a last stage (it implements ``loss_grad``)."""
        return False

    @abc.abstractmethod
    async def forward(self, mb: int, x: np.ndarray, *, grad: bool = True) -> np.ndarray:
        """The stage's output for input ``x`` of micro-batch ``mb``; with ``grad`` it keeps
        what ``backward`` needs (``ValueError`` if ``mb`` already has saved state)."""

    @abc.abstractmethod
    async def backward(self, mb: int, dy: np.ndarray) -> np.ndarray | None:
        """Add micro-batch ``mb``'s parameter gradients into the bound gradient arrays, free
        its saved state, and return d(loss)/d(input) (``None`` allowed on a first stage)."""

    async def loss_grad(self, mb: int, y: np.ndarray, target: Any, weight: float, *,
                        grad: bool = True) -> tuple[float, np.ndarray | None]:
        """Last stage: ``weight`` times micro-batch ``mb``'s mean loss of output ``y`` against
        ``target``, and its gradient w.r.t. ``y`` (``None`` without ``grad``)."""
        raise NotImplementedError(f"{type(self).__name__} is not a last stage: it computes "
                                  f"no loss")

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget the saved state of every micro-batch (after a failed pass)."""

    def model_parallel_groups(self) -> list[ModelParallelGroup]:
        """As ``Model.model_parallel_groups``, for a stage itself split over ranks (a
        tensor-parallel stage); none by default."""
        return []


class MLPStage(_LayerArrays, Stage):
    """Layers ``[start, stop)`` of an ``MLP``, with its math.

    The stage shares the MLP's parameter arrays until ``bind`` replaces them, and owns
    zero-filled gradient arrays. Parameter names are the MLP's (``layers.{i}.weight``); layer
    ``i`` is unit ``i - start``. The input of a stage after the first is the previous stage's
    output *after* its activation, and ``backward`` returns the gradient w.r.t. it (so
    the stage that applied an activation also applies its derivative). The last stage
    (``stop == mlp.num_units``) computes the MLP's loss.
    """

    def __init__(self, mlp: MLP, start: int, stop: int) -> None:
        start, stop = _layer_range(mlp, start, stop)
        self.start, self.stop = start, stop
        self.sizes = mlp.sizes
        self.activation = mlp.activation
        self.loss_kind = mlp.loss_kind
        self.dtype = mlp.dtype
        self._layers = mlp.num_units
        self._own([ParamSpec(name=s.name, shape=s.shape, dtype=s.dtype, unit=s.unit - start)
                   for s in mlp.param_specs() if start <= s.unit < stop], mlp.parameters())
        self._saved: _Saved[list[np.ndarray]] = _Saved()

    def __repr__(self) -> str:
        return f"MLPStage(layers {self.start}..{self.stop - 1} of {self._layers})"

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def computes_loss(self) -> bool:
        return self.stop == self._layers

    @property
    def held(self) -> int:
        """Micro-batches whose activations the stage holds now."""
        return len(self._saved)

    @property
    def num_units(self) -> int:
        return self.stop - self.start

    def clear(self) -> None:
        self._saved.clear()

    async def forward(self, mb: int, x: np.ndarray, *, grad: bool = True) -> np.ndarray:
        if grad:
            self._saved.check_free(mb)
        a = check_inputs(x, self.sizes[self.start], self.dtype, "stage input")
        acts = [a]                                  # acts[k]: input of layer start + k
        for u in range(self.start, self.stop):
            acts.append(self._layer(u, acts[-1]))
            await asyncio.sleep(0)
        if grad:       # the output is needed for the derivative of the activation it went through
            self._saved[mb] = acts if not self.computes_loss else acts[:-1]
        return acts[-1]

    async def backward(self, mb: int, dy: np.ndarray) -> np.ndarray | None:
        acts = self._saved.take(mb)
        n = acts[0].shape[0]
        out = self.sizes[self.stop]
        dz = np.asarray(dy, dtype=self.dtype)
        if dz.shape != (n, out):
            raise ValueError(f"output gradient must have shape {(n, out)}, got {dz.shape}")
        if not self.computes_loss:
            dz = dz * activation_grad(acts[-1], self.activation)
        dx = None
        for u in reversed(range(self.start, self.stop)):
            a_in = acts[u - self.start]
            w = self._param(u, "weight")
            add_dense_grads(a_in, dz, self._grad(u, "weight"), self._grad(u, "bias"))
            if u > self.start:
                dz = dz @ w
                dz *= activation_grad(a_in, self.activation)
            elif not self.is_first:
                dx = dz @ w
            await asyncio.sleep(0)
        return dx

    async def loss_grad(self, mb: int, y: np.ndarray, target: Any, weight: float, *,
                        grad: bool = True) -> tuple[float, np.ndarray | None]:
        if not self.computes_loss:
            return await super().loss_grad(mb, y, target, weight, grad=grad)
        out = np.array(y, dtype=self.dtype)         # a copy: the gradient is computed in it
        n, k = out.shape
        t = check_targets(self.loss_kind, target, n, k, self.dtype)
        # weight x the mean over the micro-batch
        return mean_loss(self.loss_kind, out, t, grad=grad, weight=weight)

    # ------------------------------------------------------------------------ internals

    def _layer(self, u: int, a: np.ndarray) -> np.ndarray:
        return dense(a, self._param(u, "weight"), self._param(u, "bias"),
                     self.activation if u < self._layers - 1 else None)

    def _needed_by(self, u: int, what: str) -> str:
        return "the stage runs"


class TorchStage(_BoundArrays, Stage):
    """A slice of a torch ``nn.Sequential`` (any ``nn.Module`` taking and returning one
    tensor) as a pipeline stage, on CPU.

    Args:
        module: the stage's layers (e.g. one of ``split_sequential``'s slices).
        loss_fn: on the last stage, ``loss_fn(output, targets)``: the *mean* loss over a
            micro-batch (``nn.MSELoss()``...); ``None`` on the others.
        input_grad: whether ``backward`` returns the gradient w.r.t. the input; pass
            ``False`` on the first stage (its input is data).

    Units are the children of ``module`` that have parameters. ``forward`` keeps each
    micro-batch's autograd graph; ``backward`` runs ``torch.autograd.backward(y, dy)``,
    which adds the parameter gradients in place into the bound arrays (``.grad`` tensors are
    views of them), and returns ``x.grad``. The torch work runs in a worker thread of the
    stage (torch releases the GIL), so that the event loop keeps sending and receiving the
    other micro-batches meanwhile; ``close`` stops it.
    """

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[Any, Any], Any] | None = None,
                 *, input_grad: bool = True) -> None:
        from .torch_model import cpu_numpy_dtype, import_torch, module_buffer_specs

        torch = import_torch()
        self._torch = torch
        self.module = module
        self.loss_fn = loss_fn
        self.input_grad = input_grad
        units = [m for m in (list(module.children()) or [module])
                 if any(True for _ in m.parameters())]
        if not units:
            raise ValueError("the stage has no parameters")
        names = {id(p): n for n, p in module.named_parameters()}
        specs: list[ParamSpec] = []
        self._tparams: dict[str, Any] = {}
        for u, m in enumerate(units):
            for p in m.parameters():
                name = names[id(p)]
                dtype = cpu_numpy_dtype(p, "parameter", name, "TorchStage")
                specs.append(ParamSpec(name=name, shape=tuple(p.shape), dtype=dtype, unit=u))
                self._tparams[name] = p
        if len(specs) != len(names):
            raise ValueError("every parameter must belong to a child of the module")
        self._own(specs, {name: p.detach().numpy() for name, p in self._tparams.items()})
        self._buffer_specs = module_buffer_specs(module, "TorchStage")
        for name in self._by_name:
            self._attach(name)
        self._saved: _Saved[tuple[Any, Any]] = _Saved()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def computes_loss(self) -> bool:
        return self.loss_fn is not None

    def param_specs(self) -> list[ParamSpec]:
        """The parameters; ``trainable`` is each one's ``requires_grad`` now (a frozen one
        is left as it is by the optimizer steps of the pipeline and of the wrappers)."""
        return [s if s.trainable == self._tparams[s.name].requires_grad
                else dataclasses.replace(s, trainable=bool(self._tparams[s.name].requires_grad))
                for s in self._specs]

    def buffer_specs(self) -> list[BufferSpec]:
        """The module's buffers (BatchNorm's running statistics...), in
        ``module.named_buffers()`` order, named as there (``"1.running_mean"`` for a slice
        of ``split_sequential``), as a ``TorchModel``'s."""
        return list(self._buffer_specs)

    def buffers(self) -> dict[str, np.ndarray]:
        """NumPy views (no copies) of the buffer tensors the module holds now (``RuntimeError``
        if one was removed or changed shape or dtype since the stage was made)."""
        from .torch_model import module_buffers

        return module_buffers(self.module, self._buffer_specs)

    def model_parallel_groups(self) -> list[ModelParallelGroup]:
        """The tensor group of the module's ``ColumnParallelLinear``/``RowParallelLinear``
        layers, if it has some (see ``tensor.torch_model_parallel_groups``)."""
        from .tensor import torch_model_parallel_groups

        return torch_model_parallel_groups(self.module)

    @property
    def held(self) -> int:
        """Micro-batches whose autograd graphs the stage holds now."""
        return len(self._saved)

    def _rebind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        for name, array in {**params, **grads}.items():
            if array.size and not array.flags.writeable:
                raise ValueError(f"bind: {name!r} is read-only; torch needs writable memory")
        super()._rebind(params, grads)
        for name in {**params, **grads}:
            self._attach(name)

    def clear(self) -> None:
        self._saved.clear()

    async def forward(self, mb: int, x: np.ndarray, *, grad: bool = True) -> np.ndarray:
        if grad:
            self._saved.check_free(mb)
        return await self._in_worker(self._forward, mb, x, grad)

    async def backward(self, mb: int, dy: np.ndarray) -> np.ndarray | None:
        return await self._in_worker(self._backward, self._saved.take(mb), dy)

    async def loss_grad(self, mb: int, y: np.ndarray, target: Any, weight: float, *,
                        grad: bool = True) -> tuple[float, np.ndarray | None]:
        if self.loss_fn is None:
            return await super().loss_grad(mb, y, target, weight, grad=grad)
        out = self._saved[mb][1] if grad and mb in self._saved else self._tensor(y)
        return await self._in_worker(self._loss, out, target, weight, grad)

    def close(self) -> None:
        """Stop the worker thread (waits for it). Idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> TorchStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals

    def _forward(self, mb: int, x: np.ndarray, grad: bool) -> np.ndarray:
        torch = self._torch
        xt = self._tensor(x)
        if not grad:
            with torch.no_grad():
                return np.asarray(self.module(xt).numpy())
        with torch.enable_grad():
            if self.input_grad:
                xt.requires_grad_(True)
            y = self.module(xt)
        self._saved[mb] = (xt, y)
        return np.asarray(y.detach().numpy())

    def _backward(self, saved: tuple[Any, Any], dy: np.ndarray) -> np.ndarray | None:
        xt, y = saved
        # an output that needs no gradient: every parameter is frozen and the input is data
        # (a frozen first stage), or does not depend on them
        if y.requires_grad:
            self._torch.autograd.backward(y, self._tensor(dy))
        for name, p in self._tparams.items():       # torch adds in place; make sure it did
            grad = self._grads[name]
            if p.grad is not None and grad.size and p.grad.data_ptr() != grad.ctypes.data:
                np.copyto(grad, p.grad.detach().numpy())
                self._attach(name)
        if not self.input_grad:
            return None
        if xt.grad is None:                         # the output does not depend on the input
            return np.zeros_like(xt.detach().numpy())
        return np.asarray(xt.grad.numpy())

    def _loss(self, out: Any, target: Any, weight: float, grad: bool
              ) -> tuple[float, np.ndarray | None]:
        torch = self._torch
        assert self.loss_fn is not None
        target_t = self._tensor(target)
        if not grad:
            with torch.no_grad():
                return float(self._scalar(self.loss_fn(out, target_t))) * weight, None
        leaf = out.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = self._scalar(self.loss_fn(leaf, target_t)) * weight
        loss.backward()
        return float(loss.detach()), np.asarray(leaf.grad.numpy())

    def _scalar(self, loss: Any) -> Any:
        if not isinstance(loss, self._torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor (the mean loss over the "
                             "micro-batch)")
        return loss

    def _tensor(self, value: Any) -> Any:
        if isinstance(value, self._torch.Tensor):
            return value
        array = np.asarray(value)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, copy=True)       # torch.from_numpy wants writable memory
        return self._torch.from_numpy(array)

    def _attach(self, name: str) -> None:
        torch, spec, p = self._torch, self._by_name[name], self._tparams[name]
        array, grad = self._params[name], self._grads[name]
        full = array.shape == spec.shape
        p.data = torch.from_numpy(array) if full else torch.empty(0, dtype=p.dtype)
        # a released parameter (ZeRO-3 between passes) holds no gradient: torch refuses a
        # .grad of another shape than .data; binding the parameter back attaches it again
        p.grad = torch.from_numpy(grad) if full and grad.shape == spec.shape else None

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the stage's thread; if cancelled, wait for it to stop (it
        touches the bound arrays) and re-raise."""
        if self._closed:
            raise RuntimeError("TorchStage is closed")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="asynccoll-stage")
            weakref.finalize(self, self._pool.shutdown, False)
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            if not future.cancelled():
                future.exception()
            raise


# ---------------------------------------------------------------------------- the pipeline


class PipelineParallel(Model):
    """Pipeline-parallel training of ``stage`` over the pipe group ``comm`` (stage ``i`` is
    ``comm.rank == i``; the last rank's stage computes the loss).

    A pass (``forward_backward``) runs the whole schedule over ``micro_batches``
    micro-batches. Every rank may be given the whole batch ``(inputs, targets)``: the first
    stage reads only ``inputs``, the last only ``targets`` (``batch[0]`` and ``batch[1]``;
    the others read nothing and may be given ``None``). Both are split along axis 0 with
    ``numpy.array_split`` into ``micro_batches`` parts, so a batch needs at least
    ``micro_batches`` samples. The loss, the mean over the batch, is returned on every stage
    (broadcast from the last one).

    Sends run as background tasks, so a stage computes its next micro-batch while its
    activations travel; every send is awaited before the pass returns. If a stage fails (or
    its pass is cancelled), the pass breaks the pipe group: it cancels a receive, which by
    the Communicator's contract makes the peers' pending and later operations raise
    ``CollectiveError``
    (on every group of the world, which share their connections), so no stage waits for a
    message that will not come. A failed or cancelled pass leaves the gradients partial and
    the communicators unusable: as with any failed collective, start over.

    As a ``Model`` its parameters are the stage's, with the
    stage's units, and a pass calls the hooks once per unit: ``before_forward`` (ascending)
    before the first micro-batch; ``after_forward`` (ascending) then ``before_backward``
    (descending) just before the first backward (with 1F1B the remaining forwards run inside
    the backward window, where a wrapper has bound the parameters for backward anyway);
    ``after_backward`` (descending) after the last backward, when the gradients, summed over
    the micro-batches, are final. ``loss`` calls only the forward hooks.

    Attributes:
        peak_activations: the most micro-batches whose forward state this stage held at once
            (since construction or ``reset_peaks``).
        trace: this stage's ops in the last pass, in order (``"F0"``, ``"B0"``...).
    """

    def __init__(self, stage: Stage, comm: Communicator, *, micro_batches: int,
                 schedule: str = "1f1b") -> None:
        if isinstance(micro_batches, bool) or operator.index(micro_batches) < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        specs = stage.param_specs()
        units = {s.unit for s in specs}
        if not specs or units != set(range(len(units))):
            raise ValueError(f"a stage needs parameters in units numbered 0..k-1, got units "
                             f"{sorted(units)}")
        self.stage = stage
        self.comm = comm
        self.micro_batches = operator.index(micro_batches)
        self.schedule = schedule
        self.stage_index, self.num_stages = comm.rank, comm.world_size
        self.peak_activations = 0
        self.trace: list[str] = []
        self._held = 0
        self._started = False
        self._busy = False
        self._local: tuple[np.ndarray, np.ndarray, FlatLayout] | None = None
        #: what the last stage multiplies the loss (and so every gradient) by: ``Hybrid``
        #: sets it to ``data * n / N`` for a replica's share of ``n`` of ``N`` samples, so
        #: that the plain mean of the replicas' gradients is that of the whole batch
        self._loss_scale = 1.0
        self.last_grad_norm: float | None = None
        """The global gradient norm (before clipping, the same on every stage) that the last
        ``step(..., max_grad_norm=)`` found, or None before any."""

    def __repr__(self) -> str:
        return (f"<PipelineParallel stage {self.stage_index}/{self.num_stages} {self.schedule} "
                f"x{self.micro_batches} {self.stage!r}>")

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def held_activations(self) -> int:
        """Micro-batches whose forward state the stage holds now (0 between passes)."""
        return self._held

    def reset_peaks(self) -> None:
        self.peak_activations = self._held

    # ------------------------------------------------------------------ Model interface

    def param_specs(self) -> list[ParamSpec]:
        return self.stage.param_specs()

    def parameters(self) -> dict[str, np.ndarray]:
        return self.stage.parameters()

    def buffer_specs(self) -> list[BufferSpec]:
        """The stage's buffers (a ``TorchStage``'s BatchNorm statistics...): a data-parallel
        wrapper over the pipeline keeps them as a ``TorchModel``'s (rank 0's reach the other
        replicas of this stage), and its checkpoints save them."""
        return self.stage.buffer_specs()

    def buffers(self) -> dict[str, np.ndarray]:
        return self.stage.buffers()

    def model_parallel_groups(self) -> list[ModelParallelGroup]:
        """The stage's own groups (a tensor-parallel stage's), then the pipe group: the
        global gradient norm sums over every stage."""
        pipe = [ModelParallelGroup(comm=self.comm)] if self.num_stages > 1 else []
        return [*self.stage.model_parallel_groups(), *pipe]

    def bind(self, params: Mapping[str, np.ndarray] | None = None,
             grads: Mapping[str, np.ndarray] | None = None) -> None:
        self.stage.bind(params, grads)

    async def forward_backward(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Run the schedule on ``batch``: the mean loss over it (on every stage); adds the
        stage's gradients, summed over the micro-batches, into the bound arrays.

        Raises:
            ValueError: a malformed batch, or stages that disagree about the schedule or the
                number of micro-batches (on every rank, at the first pass).
            CollectiveError: another stage failed, or the pipe group broke.
        """
        return await self._pass(batch, hooks, train=True)

    async def loss(self, batch: Any, hooks: Hooks | None = None) -> float:
        """The mean loss over ``batch`` without gradients (forwards only, nothing kept)."""
        return await self._pass(batch, hooks, train=False)

    async def step(self, batch: Any, optimizer: Optimizer, *,
                   max_grad_norm: float | None = None) -> float:
        """Pipeline-only training: one pass, then ``optimizer`` steps this stage's parameters
        (each stage its own; the optimizers are elementwise, so this is the optimizer of the
        whole model; frozen parameters, ``ParamSpec.trainable`` False, are left as they
        are) and the gradients are zeroed. Returns the loss.

        ``max_grad_norm`` clips the gradient to that global L2 norm first, as torch's
        ``clip_grad_norm_`` over the whole model's trainable parameters: every stage sums its
        squares, one scalar all-gather over the pipe group (and one over a tensor-parallel
        stage's group) adds them up. The norm, the same on every stage, is then in
        ``last_grad_norm``; a non-finite one scales the gradients by NaN (or 0), as torch's
        default does.

        The first call moves the stage's parameters into one flat array and binds the stage
        to it; do not mix with a data-parallel wrapper (use ``DistributedModel(pp,
        mesh.data, optimizer)`` there, which does the same through its own buffers).
        """
        if self._local is None:
            lay = FlatLayout(self.param_specs(), 1, 0)
            flat = np.empty(lay.size, lay.dtype)
            current = self.parameters()
            for s in lay.specs:
                a, b = lay.offsets[s.name]
                flat[a:b] = current[s.name].reshape(-1)
            grads = np.zeros(lay.size, lay.dtype)
            self.bind(params=lay.views(flat), grads=lay.views(grads))
            self._local = flat, grads, lay
        params, grads, lay = self._local
        if max_grad_norm is not None:
            max_grad_norm = check_max_norm(max_grad_norm)
        loss = await self.forward_backward(batch)
        specs = self.param_specs()
        if max_grad_norm is not None:
            groups = self.model_parallel_groups()
            squares = SquareSum()
            for a, b in counted(0, lay.size, excluded_ranges(lay, specs, groups)):
                squares.add(grads[a:b])
            total = math.sqrt(await global_sum(squares.total, [g.comm for g in groups]))
            self.last_grad_norm = total
            coef = clip_coefficient(max_grad_norm, total)
            if coef is not None:
                grads *= coef
        # frozen parameters (a TorchStage's requires_grad=False) stay as they are
        step_keeping(optimizer, params, grads, 0, lay.frozen_ranges(specs))
        grads.fill(0)
        return loss

    # ---------------------------------------------------------------------- the passes

    async def start(self) -> None:
        """Check once that the stages agree (runs by itself at the first pass): the same
        schedule and number of micro-batches, and a loss on the last stage only."""
        if self._started:
            return
        problem = None
        if self.stage.computes_loss != self.is_last:
            problem = (f"stage {self.stage_index} of {self.num_stages} "
                       f"{'computes no' if self.is_last else 'computes a'} loss; only the "
                       f"last stage must")
        views = await self.comm.all_gather_object([self.micro_batches, self.schedule, problem])
        errors = [p for _, _, p in views if p]
        if len({(m, s) for m, s, _ in views}) > 1:
            errors.append("stages disagree about the schedule: " + ", ".join(
                f"stage {i}: {s} x{m}" for i, (m, s, _) in enumerate(views)))
        if errors:
            raise ValueError("; ".join(errors))
        self._started = True

    async def _pass(self, batch: Any, hooks: Hooks | None, *, train: bool) -> float:
        hooks = NoHooks() if hooks is None else hooks
        if self._busy:
            raise RuntimeError("a pass of this pipeline is already running; passes run one at "
                               "a time")
        self._busy = True
        try:
            return await self._guarded_pass(batch, hooks, train=train)
        finally:
            self._busy = False

    async def _guarded_pass(self, batch: Any, hooks: Hooks, *, train: bool) -> float:
        await self.start()
        try:
            inputs, targets, weights = self._split(batch)
            try:
                total = await self._run(inputs, targets, weights, hooks, train=train)
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            return await self._share_loss(total)
        except BaseException as exc:
            self.stage.clear()
            self._held = 0
            # a cancellation too: it breaks the group only if it hit one of this stage's
            # operations, and may have come while the stage computed
            if isinstance(exc, Exception | asyncio.CancelledError):
                log.debug("pipeline stage %d failed: %r", self.stage_index, exc)
                await break_comm(self.comm)
            raise

    def _split(self, batch: Any) -> tuple[list[Any], list[Any], list[float]]:
        m = self.micro_batches
        inputs: list[Any] = []
        targets: list[Any] = []
        weights: list[float] = []
        if not (self.is_first or self.is_last):
            return inputs, targets, weights
        try:
            x, y = batch
        except (TypeError, ValueError):
            raise ValueError("batch must be a pair (inputs, targets)") from None
        for take, value, out in ((self.is_first, x, inputs), (self.is_last, y, targets)):
            if take:
                array = np.asarray(value)
                if array.ndim == 0 or len(array) < m:
                    raise ValueError(f"a batch of {array.shape} cannot be split into {m} "
                                     f"micro-batches along axis 0")
                out.extend(np.array_split(array, m))
        if self.is_last:
            n = sum(len(t) for t in targets)
            weights = [len(t) / n * self._loss_scale for t in targets]
        return inputs, targets, weights

    async def _run(self, inputs: list[Any], targets: list[Any], weights: list[float],
                   hooks: Hooks, *, train: bool) -> float:
        comm, stage, i = self.comm, self.stage, self.stage_index
        m = self.micro_batches
        ops = schedule_ops(self.schedule, i, self.num_stages, m) if train else \
            [("F", j) for j in range(m)]
        units = range(self.num_units)
        trace: list[str] = []
        self.trace = trace
        total = 0.0
        grads_out: dict[int, np.ndarray] = {}        # last stage: d(loss)/d(output) per mb
        forwards_left = m
        in_backward = False
        async with asyncio.TaskGroup() as sends:
            for u in units:
                await hooks.before_forward(u)
            for kind, j in ops:
                if kind == "F":
                    x = inputs[j] if self.is_first else \
                        await comm.recv(i - 1, tag=_tag(j, False))
                    y = await stage.forward(j, x, grad=train)
                    if train:
                        self._held += 1
                        self.peak_activations = max(self.peak_activations, self._held)
                    if self.is_last:
                        loss, dy = await stage.loss_grad(j, y, targets[j], weights[j],
                                                         grad=train)
                        total += loss
                        if dy is not None:
                            grads_out[j] = dy
                    else:
                        sends.create_task(comm.send(np.ascontiguousarray(y), i + 1,
                                                    tag=_tag(j, False)))
                    forwards_left -= 1
                    if not train and forwards_left == 0:
                        for u in units:
                            await hooks.after_forward(u)
                else:
                    if not in_backward:
                        in_backward = True
                        for u in units:
                            await hooks.after_forward(u)
                        for u in reversed(units):
                            await hooks.before_backward(u)
                    dy = grads_out.pop(j) if self.is_last else \
                        await comm.recv(i + 1, tag=_tag(j, True))
                    dx = await stage.backward(j, dy)
                    self._held -= 1
                    if not self.is_first:
                        if dx is None:
                            raise RuntimeError(f"stage {i} returned no input gradient")
                        sends.create_task(comm.send(np.ascontiguousarray(dx), i - 1,
                                                    tag=_tag(j, True)))
                trace.append(f"{kind}{j}")
            if train:
                for u in reversed(units):
                    await hooks.after_backward(u)
        return total

    async def _share_loss(self, total: float) -> float:
        if self.num_stages == 1:
            return total
        buf = np.array([total if self.is_last else 0.0])
        await self.comm.broadcast(buf, root=self.num_stages - 1)
        return float(buf[0])


__all__ = ["BALANCES", "SCHEDULES", "TAG_BASE", "MLPStage", "PipelineParallel", "Stage",
           "TorchStage", "balanced_cuts", "mlp_partition", "schedule_ops", "split_mlp",
           "split_sequential", "stage_bounds", "timeline"]
