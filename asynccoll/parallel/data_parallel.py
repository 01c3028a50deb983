"""Data-parallel training: DDP and ZeRO stages 1, 2 and 3 (FSDP) over any Communicator.

Every rank holds the same model and trains on its own share of each batch; the wrappers make
the ranks take identical optimizer steps on the *average* gradient. The strategies trade memory
for communication (Ψ = bytes of the parameters, K = optimizer state per parameter byte, W =
ranks; bytes each rank holds between steps):

============  ======================  =========================================  ============
strategy      parameters              gradients                                   optimizer
============  ======================  =========================================  ============
``ddp``       Ψ (replicated)          Ψ, all-reduced per bucket                   KΨ
``zero1``     Ψ                       Ψ, all-reduced per bucket                   KΨ/W
``zero2``     Ψ                       Ψ/W, reduce-scattered per bucket             KΨ/W
``zero3``     Ψ/W, all-gathered per   Ψ/W, reduce-scattered per bucket             KΨ/W
              bucket just in time
============  ======================  =========================================  ============

ZeRO-1/2 all-gather the updated parameters after each step; ZeRO-3 never holds them whole, but
gathers each bucket (by default: each unit, i.e. layer) right before it runs, forwards and
backwards, prefetching the next one while the current one computes, and frees it after use.

Buffers (``Model.buffer_specs``: BatchNorm's running statistics...) follow torch's DDP with
``broadcast_buffers=True``: rank 0's buffers are broadcast to every rank at the start of a
forward pass, in one collective for all of them (packed as bytes), whenever the previous pass
was a training pass that exchanged gradients (not under ``no_sync``, not ``loss``), and at the
first pass. ``broadcast_buffers=False`` leaves every rank its own.

Communication starts from the model's hooks, so a bucket's gradients travel while the backward
pass computes the earlier units (as far as the model yields to the event loop between units).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..collectives import Communicator
from ..ops import ReduceOp
from ._failure import break_comm
from .clip import (
    SquareSum,
    check_max_norm,
    clip_coefficient,
    counted,
    excluded_ranges,
    global_sum,
    nonfinite_error,
)
from .compression import Compression, NoCompression, make_compression
from .layout import Bucket, FlatLayout
from .model import BufferSpec, Model, ModelParallelGroup
from .optim import Optimizer, step_keeping

Strategy = Literal["ddp", "zero1", "zero2", "zero3"]
STRATEGIES: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3")

#: Default bucket size, as torch's DDP (ZeRO-3 defaults to one unit per bucket instead).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport:
    """Bytes a rank holds for training, by the wrapper's own accounting.

    ``params``, ``grads`` and ``optimizer`` are what stays allocated between steps;
    ``gathered_peak`` is the most ZeRO-3 held in gathered (whole) buckets at once, and
    ``grad_buffers_peak`` the most ZeRO-2/3 held in whole-bucket gradient buffers at once
    (both since the wrapper was made or ``DistributedModel.reset_peaks``).
    """

    params: int
    grads: int
    optimizer: int
    gathered_peak: int
    grad_buffers_peak: int

    @property
    def held(self) -> int:
        return self.params + self.grads + self.optimizer


class _Hooks:
    """The model hooks a strategy needs; they forward to the wrapper's handlers."""

    def __init__(self, owner: DistributedModel, *, backward: bool) -> None:
        self._o = owner
        self._backward = backward

    async def before_forward(self, unit: int) -> None:
        await self._o._before_forward(unit, self._backward)

    async def after_forward(self, unit: int) -> None:
        await self._o._after_forward(unit, self._backward)

    async def before_backward(self, unit: int) -> None:
        await self._o._before_backward(unit)

    async def after_backward(self, unit: int) -> None:
        await self._o._after_backward(unit)


class DistributedModel:
    """A model trained data-parallel over ``comm`` with one of ``STRATEGIES``.

    Typical loop (every rank runs it on its own share of each batch):

        dist = DistributedModel(model, comm, Adam(lr=1e-3), strategy="zero2")
        for batch in my_batches:
            loss = await dist.step(batch)     # forward, backward, exchange, optimizer step

    Gradient accumulation: call ``forward_backward`` several times, then
    ``optimizer_step``; under ``no_sync`` the DDP and ZeRO-1 strategies skip the
    gradient exchange (it happens, on the sum, at the next pass outside ``no_sync``). ZeRO-2/3
    keep only their gradient shard, so they exchange every pass and accumulate the shards.

    Args:
        model: the ``Model`` (every rank builds the same one;
            rank 0's initial parameters win, they are broadcast at the first pass).
        comm: the communicator whose ranks share the work.
        optimizer: applied to this rank's parameters (``ddp``) or to its shard (ZeRO);
            optional, but ``optimizer_step`` needs one.
        strategy: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        bucket_bytes: gradients (and, for ZeRO-3, parameters) travel in buckets of whole units
            of at least this many bytes; default 25 MiB, and 0 (one unit per bucket) for ZeRO-3.
        compression: a gradient compression hook or its name (see
            ``make_compression``); it replaces the averaging
            all-reduce, so only ``ddp`` and ``zero1`` accept it.
        prefetch: ZeRO-3 gathers the next bucket while the current one computes.
        broadcast_buffers: keep the model's buffers (BatchNorm statistics...) the same on
            every rank as torch's DDP does by default: rank 0's reach every rank at the start
            of each forward pass that follows a training pass with gradient exchange (and at
            the first one). ``False``: every rank keeps its own. Must be the same on every rank.
        max_grad_norm: clip the averaged gradient to this global L2 norm in every
            ``optimizer_step`` (and so ``step``) before the optimizer runs, as
            ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm)`` after backward; the
            norm is then in ``last_grad_norm``. See ``clip_grad_norm``. Default ``None``: no
            clipping.
    """

    def __init__(self, model: Model, comm: Communicator, optimizer: Optimizer | None = None, *,
                 strategy: str = "ddp", bucket_bytes: int | None = None,
                 compression: Compression | str | None = None, prefetch: bool = True,
                 broadcast_buffers: bool = True, max_grad_norm: float | None = None) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        hook = make_compression(compression)     # a bad spec is reported as such
        if not isinstance(hook, NoCompression) and strategy not in ("ddp", "zero1"):
            raise ValueError(f"gradient compression replaces the gradient all-reduce, which only "
                             f"ddp and zero1 use; strategy {strategy!r} reduce-scatters")
        if bucket_bytes is None:
            bucket_bytes = 0 if strategy == "zero3" else DEFAULT_BUCKET_BYTES
        self.model = model
        self.comm = comm
        self.strategy = strategy
        self.compression = hook
        self.prefetch = prefetch
        self.broadcast_buffers = bool(broadcast_buffers)
        self.max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
        self.last_grad_norm: float | None = None
        """The global gradient norm the last clipping found (``max_grad_norm`` in
        ``optimizer_step``, or ``clip_grad_norm``), before clipping and the same on every
        rank; None before any."""
        #: the smallest max_norm clip_grad_norm clipped to since the last pass or step
        self._clipped: float | None = None
        self._norm_groups: list[ModelParallelGroup] | None = None
        self.rank, self.world_size = comm.rank, comm.world_size
        self.layout = lay = FlatLayout(model.param_specs(), comm.world_size, bucket_bytes)
        if lay.dtype not in hook.dtypes:
            # found here, not at the first exchange (after a pass, breaking the communicator)
            raise TypeError(f"{hook.name} compression needs float32 or float64 parameters, "
                            f"the model's are {lay.dtype}")
        self._sync = True
        self._started = False
        self._pending: list[asyncio.Task[Any]] = []
        self._optimizer: Optimizer | None = None
        self._opts: list[Optimizer] = []
        self._steps = 0
        #: flat ranges of frozen parameters (``ParamSpec.trainable`` False), merged; read from
        #: the model at every optimizer step, as a torch parameter may be (un)frozen anytime
        self._frozen: list[tuple[int, int]] = []

        initial = np.empty(lay.size, lay.dtype)
        current = model.parameters()
        for s in lay.specs:
            a, b = lay.offsets[s.name]
            initial[a:b] = np.asarray(current[s.name], lay.dtype).reshape(-1)
        self._sharded_params = strategy == "zero3"
        self._sharded_grads = strategy in ("zero2", "zero3")
        self._params: np.ndarray | None = None
        self._shard_params: np.ndarray | None = None
        self._initial: np.ndarray | None = None
        if self._sharded_params:
            self._initial = initial               # until the first pass broadcasts it
            self._release_units(range(lay.num_units), grads=False)
        else:
            self._params = initial
            model.bind(params=lay.views(initial))
        shard = lay.shard_sizes[self.rank]
        self._grads: np.ndarray | None = None
        self._shard_grads: np.ndarray | None = None
        if self._sharded_grads:
            self._shard_grads = np.zeros(shard, lay.dtype)
            self._release_units(range(lay.num_units), params=False)
        else:
            self._grads = np.zeros(lay.size, lay.dtype)
            model.bind(grads=lay.views(self._grads))
        # whole buckets that exist only for a while (ZeRO-3 parameters, ZeRO-2/3 gradients)
        self._gathered: dict[int, np.ndarray] = {}
        self._gathering: dict[int, asyncio.Task[None]] = {}
        self._grad_buffers: dict[int, np.ndarray] = {}
        self._gathered_bytes = self._gathered_peak = 0
        self._grad_bytes = self._grad_peak = 0
        # buffers: packed end to end as bytes (offsets aligned to 8) for one broadcast
        self._buffer_specs = list(model.buffer_specs())
        self._buffer_ranges: list[tuple[int, int]] = []
        pos = 0
        for spec in self._buffer_specs:
            self._buffer_ranges.append((pos, pos + spec.nbytes))
            pos += -(-spec.nbytes // 8) * 8
        self._buffer_pack = np.zeros(pos, np.uint8)
        #: torch DDP's ``require_forward_param_sync``: the next pass broadcasts the buffers
        self._buffers_due = True
        if optimizer is not None:
            self.set_optimizer(optimizer)

    # ----------------------------------------------------------------------- set-up

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Use ``optimizer`` (its hyperparameters; ZeRO gives each bucket's shard a clone,
        which takes the optimizer's hyperparameters again at every step, so that changing
        ``optimizer.lr`` works under every strategy)."""
        self._optimizer = optimizer
        if self.strategy == "ddp":
            self._opts = [optimizer]
        else:
            self._opts = [optimizer.clone() for _ in self.layout.buckets]

    @property
    def optimizer(self) -> Optimizer | None:
        return self._optimizer

    @property
    def lr(self) -> float:
        if self._optimizer is None:
            raise RuntimeError("no optimizer set")
        return float(self._optimizer.lr)

    @lr.setter
    def lr(self, value: float) -> None:
        if self._optimizer is None:
            raise RuntimeError("no optimizer set")
        self._optimizer.lr = value
        for opt in self._opts:
            opt.lr = value

    async def start(self) -> None:
        """Make every rank's parameters rank 0's (runs by itself at the first pass)."""
        if self._started:
            return
        self._started = True
        if self._params is not None:
            await self.comm.broadcast(self._params, root=0)
        else:
            assert self._initial is not None
            full, self._initial = self._initial, None
            await self.comm.broadcast(full, root=0)
            self._shard_params = self.layout.shard_of(full, self.rank)

    # ----------------------------------------------------------------------- training

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (``ddp``, ``zero1``): passes inside skip the exchange."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    async def step(self, batch: Any) -> float:
        """One training step on this rank's ``batch``: forward, backward, gradient exchange,
        optimizer step. Returns this rank's loss (the mean over its batch)."""
        loss = await self.forward_backward(batch)
        await self.optimizer_step()
        return loss

    async def forward_backward(self, batch: Any) -> float:
        """Forward and backward on ``batch``, adding to the gradients, exchanging them unless
        under ``no_sync``. Returns this rank's loss."""
        await self.start()
        await self._before_pass()
        self._buffers_due = self._sync
        self._clipped = None
        return await self._pass(self.model.forward_backward(batch, _Hooks(self, backward=True)))

    async def loss(self, batch: Any) -> float:
        """The loss of ``batch`` without gradients (ZeRO-3 gathers parameters for it)."""
        await self.start()
        await self._before_pass()
        self._buffers_due = False
        return await self._pass(self.model.loss(batch, _Hooks(self, backward=False)))

    async def _before_pass(self) -> None:
        """Broadcast rank 0's buffers if they are due (torch DDP's rule)."""
        if self._buffers_due and self.broadcast_buffers and self._buffer_specs:
            await self.sync_buffers()

    async def sync_buffers(self) -> None:
        """Make every rank's buffers rank 0's now: one broadcast of all of them, packed.
        A collective (every rank calls it); the passes call it themselves when due."""
        if not self._buffer_specs or self.world_size == 1:
            return
        arrays = self._buffer_arrays()
        await self._broadcast_buffers(arrays)
        if self.rank != 0:
            for array, value in zip(arrays, self._unpacked_buffers(), strict=True):
                np.copyto(array, value)

    async def _broadcast_buffers(self, arrays: list[np.ndarray]) -> None:
        """Rank 0's ``arrays`` (its buffers) packed into ``_buffer_pack`` on every rank."""
        pack = self._buffer_pack
        if self.rank == 0:
            for array, (a, b) in zip(arrays, self._buffer_ranges, strict=True):
                pack[a:b] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        await self.comm.broadcast(pack, root=0)

    def _unpacked_buffers(self) -> list[np.ndarray]:
        """Views of ``_buffer_pack`` as the buffers, in ``buffer_specs`` order."""
        return [self._buffer_pack[a:b].view(spec.dtype).reshape(spec.shape)
                for spec, (a, b) in zip(self._buffer_specs, self._buffer_ranges, strict=True)]

    async def _pass(self, work: Awaitable[float]) -> float:
        try:
            loss = await work
            for task in self._pending:
                await task
        except (Exception, asyncio.CancelledError):
            # this rank failed, perhaps outside any exchange (its model raised, or the pass
            # was cancelled while it computed): the other ranks would wait for its gradients
            # until the timeout, so the communicator is broken for them to raise at once;
            # and the groups holding the model's other parts (pipe, tensor), whose ranks wait
            # for its activations: the data group alone has no peer when it has one rank
            await break_comm(self.comm)
            for group in self.model.model_parallel_groups():
                await break_comm(group.comm)
            raise
        finally:
            pending, self._pending = self._pending, []
            tasks = [*pending, *self._gathering.values()]
            for t in tasks:
                if t.done() and not t.cancelled():
                    t.exception()   # retrieved: the pass reports a failure, not asyncio's log
            leftovers = [t for t in tasks if not t.done()]
            for t in leftovers:
                t.cancel()
            if leftovers:
                await asyncio.gather(*leftovers, return_exceptions=True)
            self._gathering.clear()
            for b in list(self._gathered):
                self._release_bucket(b)
            for b in list(self._grad_buffers):
                self._drop_grad_buffer(b)
        return float(loss)

    async def optimizer_step(self) -> None:
        """Apply the optimizer to the averaged gradients, share the result, zero the gradients."""
        if self._optimizer is None:
            raise RuntimeError("no optimizer: pass one to the wrapper or call set_optimizer()")
        await self.start()
        lay, r = self.layout, self.rank
        hyper = self._optimizer.hyper
        for opt in self._opts:
            # ZeRO steps clones: a schedule that sets the optimizer it was given (its ``lr``,
            # say) reaches them, as it reaches DDP's, which is that optimizer itself
            if opt is not self._optimizer and opt.hyper != hyper:
                opt._configure(hyper)
        self._frozen = lay.frozen_ranges(self.model.param_specs())
        if self.max_grad_norm is not None and (self._clipped is None
                                               or self._clipped > self.max_grad_norm):
            # not clipped yet, or to a larger norm (clip_grad_norm(math.inf) to measure it):
            # clip to max_grad_norm as torch's second clip_grad_norm_ would; the norm the
            # caller's clip_grad_norm returned stays in last_grad_norm
            measured = self.last_grad_norm if self._clipped is not None else None
            await self._clip(self.max_grad_norm, False)
            if measured is not None:
                self.last_grad_norm = measured
        self._clipped = None
        if self.strategy == "ddp":
            assert self._params is not None and self._grads is not None
            self._opt_step(self._opts[0], self._params, self._grads, 0)
            self._grads.fill(0)
        elif self.strategy == "zero3":
            assert self._shard_params is not None and self._shard_grads is not None
            for b, opt in zip(lay.buckets, self._opts, strict=True):
                self._opt_step(opt, lay.shard_block(self._shard_params, r, b),
                               lay.shard_block(self._shard_grads, r, b),
                               b.start + b.blocks[r][0])
            self._shard_grads.fill(0)
        else:
            params = self._params
            assert params is not None
            for b, opt in zip(lay.buckets, self._opts, strict=True):
                lo, hi = b.blocks[r]
                mine = params[b.start + lo:b.start + hi]
                if self._shard_grads is not None:
                    grads = lay.shard_block(self._shard_grads, r, b)
                else:
                    assert self._grads is not None
                    grads = self._grads[b.start + lo:b.start + hi]
                self._opt_step(opt, mine, grads, b.start + lo)
            tasks = [asyncio.ensure_future(self.comm.all_gather(
                params[b.start + b.blocks[r][0]:b.start + b.blocks[r][1]].copy(),
                out=params[b.start:b.stop])) for b in lay.buckets]
            await _all(tasks)
            if self._shard_grads is not None:
                self._shard_grads.fill(0)
            else:
                assert self._grads is not None
                self._grads.fill(0)
        self._steps += 1
        self._template_follows()

    def _template_follows(self) -> None:
        """ZeRO steps clones of the optimizer it was given: that optimizer's step count
        follows theirs, so that a schedule reading ``opt.steps`` works under every strategy
        (DDP steps the optimizer itself)."""
        opt = self._optimizer
        if opt is not None and self._opts and self._opts[0] is not opt:
            opt.load_state_dict({"step": self._opts[0].steps})

    def _opt_step(self, opt: Optimizer, params: np.ndarray, grads: np.ndarray,
                  start: int) -> None:
        """``opt.step(params, grads)`` on the flat range ``[start, start + params.size)``,
        leaving the frozen parameters in it, and their optimizer state, as they were (as
        torch.optim skips them)."""
        step_keeping(opt, params, grads, start, self._frozen)

    def zero_grad(self) -> None:
        """Forget the accumulated gradients (``optimizer_step`` does this itself)."""
        self._clipped = None
        for g in (self._grads, self._shard_grads):
            if g is not None:
                g.fill(0)

    async def clip_grad_norm(self, max_norm: float, *,
                             error_if_nonfinite: bool = False) -> float:
        """Clip the averaged gradient (after the passes, before ``optimizer_step``) to the
        global L2 norm ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``: the norm over
        every trainable parameter (frozen ones left out) of the whole model, whatever this
        rank holds of it; the gradients are multiplied by ``max_norm / (norm + 1e-6)`` when
        that is below 1. Returns the norm before clipping (also in ``last_grad_norm``), the
        same on every rank. ``max_norm=math.inf`` only measures it.

        A collective when the gradient is split over ranks (every rank calls it): ZeRO-2/3
        sum their shards' squares with one scalar all-gather over ``comm``, and a model split
        over ranks (``Model.model_parallel_groups``: pipeline stages, tensor shards) with one
        over each of its groups; ``ddp`` and ``zero1`` hold the whole averaged gradient and
        communicate nothing. Call it outside ``no_sync`` (the gradients must be averaged).
        With ``max_grad_norm`` on the wrapper, ``optimizer_step`` then clips again only if
        ``max_norm`` was larger (so measuring with ``math.inf`` keeps the option's clipping;
        ``last_grad_norm`` keeps the norm returned here).

        A non-finite norm scales the gradients by NaN (or 0), as torch's default does: check
        the returned norm and call ``zero_grad`` instead of ``optimizer_step`` to skip such
        a step. With ``error_if_nonfinite``, it raises ``FloatingPointError`` (on every
        rank) and leaves the gradients as they were.
        """
        max_norm = check_max_norm(max_norm)
        await self.start()
        self._frozen = self.layout.frozen_ranges(self.model.param_specs())
        total = await self._clip(max_norm, error_if_nonfinite)
        self._clipped = max_norm if self._clipped is None else min(self._clipped, max_norm)
        return total

    async def _clip(self, max_norm: float, error_if_nonfinite: bool) -> float:
        """Clip the gradients the optimizer steps (``self._frozen`` up to date)."""
        lay, r = self.layout, self.rank
        if self._norm_groups is None:
            self._norm_groups = self.model.model_parallel_groups()
        groups = self._norm_groups
        specs = self.model.param_specs()
        excluded = excluded_ranges(lay, specs, groups) if groups else self._frozen
        squares = SquareSum()
        if self._shard_grads is not None:
            for b in lay.buckets:
                first = b.start + b.blocks[r][0]
                block = lay.shard_block(self._shard_grads, r, b)
                for a, e in counted(first, first + block.size, excluded):
                    squares.add(block[a - first:e - first])
            comms = [self.comm, *(g.comm for g in groups)]
        else:
            assert self._grads is not None
            for a, e in counted(0, lay.size, excluded):
                squares.add(self._grads[a:e])
            comms = [g.comm for g in groups]
        total = math.sqrt(await global_sum(squares.total, comms))
        self.last_grad_norm = total
        if error_if_nonfinite and not math.isfinite(total):
            raise nonfinite_error(total)
        coef = clip_coefficient(max_norm, total)
        if coef is not None:
            for g in (self._grads, self._shard_grads):
                if g is not None:
                    g *= coef
        return total

    async def should_stop(self, stop: bool) -> bool:
        """True on every rank if any rank passed True (early-stopping consensus)."""
        return await agree_to_stop(self.comm, stop)

    # ----------------------------------------------------------------------- state

    def memory(self) -> MemoryReport:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        item = self.layout.dtype.itemsize
        shard = self.layout.shard_sizes[self.rank] * item
        return MemoryReport(
            params=shard if self._sharded_params else self.layout.nbytes,
            grads=shard if self._sharded_grads else self.layout.nbytes,
            optimizer=sum(o.state_nbytes for o in self._opts),
            gathered_peak=self._gathered_peak,
            grad_buffers_peak=self._grad_peak)

    def reset_peaks(self) -> None:
        self._gathered_peak = self._gathered_bytes
        self._grad_peak = self._grad_bytes

    def local_parameters(self) -> np.ndarray:
        """The flat parameters this rank holds: all of them, or (ZeRO-3) its shard."""
        if self._params is not None:
            return self._params
        if self._shard_params is None:
            assert self._initial is not None
            return self.layout.shard_of(self._initial, self.rank)
        return self._shard_params

    async def full_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter, whole, as new arrays (ZeRO-3 gathers them: call on every rank)."""
        await self.start()
        if self._params is not None:
            flat = self._params.copy()
        else:
            assert self._shard_params is not None
            flat = np.empty(self.layout.size, self.layout.dtype)
            for b in self.layout.buckets:
                await self.comm.all_gather(
                    self.layout.shard_block(self._shard_params, self.rank, b).copy(),
                    out=flat[b.start:b.stop])
        return {k: v.copy() for k, v in self.layout.views(flat).items()}

    def _buffer_arrays(self) -> list[np.ndarray]:
        """The model's buffer arrays now, in ``buffer_specs`` order, checked against them."""
        current = self.model.buffers()
        out = []
        for spec in self._buffer_specs:
            array = current.get(spec.name)
            if array is None or array.shape != spec.shape or array.dtype != spec.dtype:
                raise RuntimeError(f"the model's buffer {spec.name!r} is no longer "
                                   f"{spec.dtype} {spec.shape}")
            out.append(array)
        return out

    def local_buffers(self, *, persistent_only: bool = False) -> dict[str, np.ndarray]:
        """Copies of this rank's buffers by name (with ``persistent_only``: those a
        checkpoint holds)."""
        return {s.name: np.array(a, copy=True)
                for s, a in zip(self._buffer_specs, self._buffer_arrays(), strict=True)
                if s.persistent or not persistent_only}

    async def full_buffers(self, *, persistent_only: bool = False) -> dict[str, np.ndarray]:
        """Rank 0's buffers on every rank, as new arrays (a collective: every rank calls it;
        this rank's own buffers are left as they are). What a checkpoint saves and elastic
        training commits."""
        if self.world_size == 1 or not self._buffer_specs:
            return self.local_buffers(persistent_only=persistent_only)
        await self._broadcast_buffers(self._buffer_arrays())
        return {s.name: np.array(value, copy=True)
                for s, value in zip(self._buffer_specs, self._unpacked_buffers(), strict=True)
                if s.persistent or not persistent_only}

    def check_buffers(self, buffers: dict[str, np.ndarray], *, strict: bool = True
                      ) -> dict[str, BufferSpec]:
        """The ``ValueError`` ``load_buffers`` would raise for ``buffers``, if any (nothing
        is copied); else the model's buffer specs by name."""
        specs = {s.name: s for s in self._buffer_specs}
        unknown = sorted(set(buffers) - set(specs))
        missing = sorted(s.name for s in self._buffer_specs
                         if s.persistent and s.name not in buffers) if strict else []
        if unknown or missing:
            raise ValueError(f"buffers do not match the model's: missing {missing[:4]}, "
                             f"unexpected {unknown[:4]}")
        for name, value in buffers.items():
            if np.shape(value) != specs[name].shape:
                raise ValueError(f"buffer {name!r}: shape {np.shape(value)}, the model's "
                                 f"{specs[name].shape}")
        return specs

    def load_buffers(self, buffers: dict[str, np.ndarray], *, strict: bool = True) -> None:
        """Copy ``buffers`` (by name) into the model's buffers on this rank.

        With ``strict`` (the default), ``buffers`` must hold exactly the model's persistent
        buffers (non-persistent ones may be given too); otherwise names the model lacks are an
        error and buffers not given are left as they are. Raises ``ValueError`` for a missing
        or unknown name or a shape that does not fit; nothing is copied then.
        """
        specs = self.check_buffers(buffers, strict=strict)
        arrays = dict(zip(specs, self._buffer_arrays(), strict=True))
        for name, value in buffers.items():
            np.copyto(arrays[name], np.asarray(value).astype(specs[name].dtype, copy=False))

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self._steps

    def shard_state(self) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """This rank's shard of the parameters and of every optimizer buffer (flat, in shard
        order), and the optimizer's step count: what a checkpoint stores per rank."""
        lay, r = self.layout, self.rank
        ranges = lay.global_ranges(r)
        if self._params is not None:
            params = np.concatenate([self._params[a:b] for a, b in ranges])
        else:
            params = self.local_parameters().copy()
        buffers: dict[str, np.ndarray] = {}
        step = 0
        if self._opts:
            states = [o.state_dict() for o in self._opts]
            step = int(states[0].get("step", 0))
            names = list(states[0].get("buffers", {}))
            for name in names:
                if self.strategy == "ddp":
                    whole = states[0]["buffers"][name]
                    buffers[name] = np.concatenate([whole[a:b] for a, b in ranges])
                else:
                    buffers[name] = np.concatenate([s["buffers"][name] for s in states])
        return params, buffers, step

    async def full_state(self) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Whole flat parameters and optimizer buffers on every rank (a collective: the shards
        are all-gathered), and the optimizer's step count: what ``load_full_state`` takes,
        with any number of ranks and any strategy. Elastic training commits this."""
        await self.start()
        lay = self.layout
        params, buffers, step = self.shard_state()

        async def whole(shard: np.ndarray) -> np.ndarray:
            got = await self.comm.all_gather(shard)
            flat = np.empty(lay.size, lay.dtype)
            pos = 0
            for r in range(self.world_size):
                for a, b in lay.global_ranges(r):
                    flat[a:b] = got[pos:pos + b - a]
                    pos += b - a
            return flat

        full = await whole(params)
        return full, {k: await whole(v) for k, v in sorted(buffers.items())}, step

    def load_full_state(self, params: np.ndarray, buffers: dict[str, np.ndarray],
                        step: int, hyper: dict[str, Any] | None = None) -> None:
        """Take whole flat parameters and optimizer buffers (every rank the same) and keep
        this rank's part: what loading a checkpoint saved with any number of ranks does.
        Gradient compression's error-feedback residuals restart at zero. Arrays of another
        dtype are converted to the model's (whatever the strategy); ``ValueError`` for a
        length that does not fit (nothing is loaded then)."""
        lay, r = self.layout, self.rank
        params = np.asarray(params, dtype=lay.dtype)
        buffers = {k: np.asarray(v, dtype=lay.dtype) for k, v in buffers.items()}
        for what, given in (("parameters", params), *buffers.items()):
            if given.shape != (lay.size,):
                raise ValueError(f"expected {lay.size} {what}, got shape {given.shape}")
        self._started = True            # the loaded state is the same on every rank
        self._initial = None
        # residuals of gradient compression are not part of the state: they restart at zero
        # (not at what this wrapper dropped from the gradients it trained on before)
        self.compression.reset()
        if self._params is not None:
            self._params[...] = params
        else:
            self._shard_params = lay.shard_of(params, r)
        if not self._opts:
            return
        if self.strategy == "ddp":
            parts = [(0, lay.size)]
            targets = [self._opts[0]]
        else:
            parts = [(b.start + b.blocks[r][0], b.start + b.blocks[r][1]) for b in lay.buckets]
            targets = self._opts
        for opt, (a, b) in zip(targets, parts, strict=True):
            state = opt.state_dict()
            state["step"] = step
            if hyper:
                state["hyper"] = dict(hyper)
            state["buffers"] = {k: v[a:b].copy() for k, v in buffers.items()}
            opt.load_state_dict(state)
        if hyper and self._optimizer is not None and self.strategy != "ddp":
            # ZeRO steps clones: the template (``lr``, what a checkpoint records) follows them
            self._optimizer.load_state_dict({"step": step, "hyper": dict(hyper)})
        self._template_follows()
        self._steps = step

    # ----------------------------------------------------------------------- hooks

    def _launch(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._pending.append(task)
        return task

    async def _before_forward(self, unit: int, backward: bool) -> None:
        if not self._sharded_params:
            return
        b = self.layout.buckets[self.layout.unit_bucket[unit]]
        if unit == b.first_unit:
            await self._ensure_gathered(b.index)
            if self.prefetch and b.index + 1 < len(self.layout.buckets):
                self._start_gather(b.index + 1)

    async def _after_forward(self, unit: int, backward: bool) -> None:
        if not self._sharded_params:
            return
        b = self.layout.buckets[self.layout.unit_bucket[unit]]
        # the last bucket is the first one backward needs: keep it
        if unit == b.last_unit and not (backward and b.index == len(self.layout.buckets) - 1):
            self._release_bucket(b.index)

    async def _before_backward(self, unit: int) -> None:
        b = self.layout.buckets[self.layout.unit_bucket[unit]]
        if unit != b.last_unit:
            return
        if self._sharded_params:
            await self._ensure_gathered(b.index)
            if self.prefetch and b.index > 0:
                self._start_gather(b.index - 1)
        if self._sharded_grads:
            buf = np.zeros(b.size, self.layout.dtype)
            self._grad_buffers[b.index] = buf
            self._grad_bytes += buf.nbytes
            self._grad_peak = max(self._grad_peak, self._grad_bytes)
            self.model.bind(grads=self.layout.views(buf, b.start))

    async def _after_backward(self, unit: int) -> None:
        b = self.layout.buckets[self.layout.unit_bucket[unit]]
        if unit != b.first_unit:
            return                              # the bucket still has units to go
        if self._sharded_params:
            self._release_bucket(b.index)
        if self._sharded_grads:
            self._launch(self._reduce_scatter(b))
        elif self._sync:
            assert self._grads is not None
            self._launch(self.compression.all_reduce_mean(
                self.comm, self._grads[b.start:b.stop], b.index))

    async def _reduce_scatter(self, b: Bucket) -> None:
        buf = self._grad_buffers[b.index]
        mine = await self.comm.reduce_scatter(buf, op=ReduceOp.AVG)
        assert self._shard_grads is not None
        self.layout.shard_block(self._shard_grads, self.rank, b)[...] += mine
        self._drop_grad_buffer(b.index)

    def _drop_grad_buffer(self, index: int) -> None:
        buf = self._grad_buffers.pop(index, None)
        if buf is not None:
            self._grad_bytes -= buf.nbytes
            self._release_units(self.layout.bucket_units(self.layout.buckets[index]),
                                params=False)

    def _start_gather(self, index: int) -> None:
        if index not in self._gathered and index not in self._gathering:
            self._gathering[index] = asyncio.ensure_future(self._gather(index))

    async def _ensure_gathered(self, index: int) -> None:
        self._start_gather(index)
        task = self._gathering.get(index)
        if task is not None:
            await task
            self._gathering.pop(index, None)

    async def _gather(self, index: int) -> None:
        lay, b = self.layout, self.layout.buckets[index]
        assert self._shard_params is not None
        buf = np.empty(b.size, lay.dtype)
        self._gathered_bytes += buf.nbytes
        self._gathered_peak = max(self._gathered_peak, self._gathered_bytes)
        try:
            await self.comm.all_gather(lay.shard_block(self._shard_params, self.rank, b),
                                       out=buf)
        except BaseException:
            self._gathered_bytes -= buf.nbytes
            raise
        self._gathered[index] = buf
        self.model.bind(params=lay.views(buf, b.start))

    def _release_bucket(self, index: int) -> None:
        buf = self._gathered.pop(index, None)
        if buf is not None:
            self._gathered_bytes -= buf.nbytes
            self._release_units(self.layout.bucket_units(self.layout.buckets[index]),
                                grads=False)

    def _release_units(self, units: range, *, params: bool = True, grads: bool = True) -> None:
        empty = np.empty(0, self.layout.dtype)
        names = self.layout.unit_names(units)
        self.model.bind(params={n: empty for n in names} if params else None,
                        grads={n: empty for n in names} if grads else None)


async def _all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Await every task; on the first failure cancel the rest and re-raise it."""
    try:
        for t in tasks:
            await t
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
            elif not t.cancelled():
                t.exception()       # retrieved: the first failure is the one re-raised


async def agree_to_stop(comm: Communicator, stop: bool) -> bool:
    """Early-stopping consensus: True on every rank if any rank passed True."""
    flag = np.array([bool(stop)])
    await comm.all_reduce(flag, op=ReduceOp.BOR)
    return bool(flag[0])


__all__ = ["DEFAULT_BUCKET_BYTES", "STRATEGIES", "DistributedModel", "MemoryReport",
           "agree_to_stop"]
