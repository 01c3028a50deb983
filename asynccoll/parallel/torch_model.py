"""A ``torch.nn.Module`` as a ``Model``.

PyTorch is optional: it is imported when a ``TorchModel`` is built, not when this module
is imported (``pip install "asynccoll[torch]"``). CPU tensors only.

How it maps onto the ``Model`` contract:

* **Memory.** ``TorchModel.bind`` makes every parameter's ``.data`` and ``.grad`` tensors
  views of the given NumPy arrays (``torch.from_numpy``, no copy). During backward torch adds
  into an existing ``.grad`` in place (``AccumulateGrad`` does ``grad += new`` when no graph of
  the gradient is recorded), so the gradients land in the bound arrays. After each
  accumulation the data pointer is checked; were torch to put a new tensor in ``.grad``
  (old + new), it is copied into the bound array and the binding restored.
* **Buffers.** The module's buffers (``module.named_buffers()``: BatchNorm's running
  statistics, anything ``register_buffer`` made) are the model's ``buffer_specs`` /
  ``buffers``; ``buffers()`` gives NumPy views of the tensors the module holds at the time
  (a module that reassigns a buffer is seen), so a wrapper writing into them changes the
  module. Non-persistent buffers (not in ``state_dict()``) are marked ``persistent=False``.
* **Threads.** The forward and backward pass runs in a worker thread (one per model, started
  on first use, stopped by ``TorchModel.close``), so the event loop keeps running
  communication while torch computes. Hooks are coroutines on the event loop; the worker
  calls them with ``asyncio.run_coroutine_threadsafe(...).result()`` and waits.
* **Forward hooks** come from forward pre-hooks on the unit modules. ``before_forward(u)`` is
  called when unit ``u`` is entered, ``after_forward(u)`` when the next unit is entered or the
  module's forward returns, so a unit may be called several times in a row. Units the
  forward skips get both calls when a later unit starts. A unit entered after a later one
  raises ``RuntimeError``: units must be listed in the order the forward pass runs them.
  Units run again after the forward (recomputed by activation checkpointing during
  backward) call no hook.
* **Backward hooks** are driven by ``register_post_accumulate_grad_hook`` on the parameters.
  Before backward the autograd graph of the loss is walked to find the parameters that will
  get a gradient. ``before_backward(u)`` is called as soon as unit ``u + 1`` is done (for the
  last unit: before backward starts), and ``after_backward(u)`` once every parameter of ``u``
  that will get a gradient has accumulated it. Units that get no gradient are done at once.
  The calls are thus always in the documented order, deferred when torch's order differs.
  Full backward pre-hooks are *not* used: they warn when the first unit's inputs need no
  gradient, break on in-place ops after a unit, and add nothing to this order.

Where torch's order is not the reverse of the units' order (units whose backward does not run
as a chain), ``before_backward(u)`` can come after torch used unit ``u``'s parameters; a
wrapper that releases parameters between units (ZeRO-3) needs a chain of units.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .mlp import _BoundArrays
from .model import BufferSpec, Hooks, Model, ModelParallelGroup, NoHooks, ParamSpec

if TYPE_CHECKING:
    import torch

#: Seconds between the worker's checks for a cancelled pass or a closed event loop while it
#: waits for a hook.
POLL_INTERVAL = 0.25


def _strided_like_torch(array: np.ndarray) -> np.ndarray:
    """``array``, or for a zero-size one (a tensor-parallel shard of a layer narrower than
    the group, in a bucket of its own) a new empty array of its shape: NumPy gives views of
    empty buckets zero strides, which torch's gradient accumulation warns about
    ('grad and param do not obey the gradient layout contract'). It holds no data."""
    return np.empty(array.shape, array.dtype) if array.size == 0 else array


def import_torch() -> Any:
    """``import torch``, or an ImportError that says which extra to install."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError('TorchModel needs PyTorch: pip install "asynccoll[torch]"') from exc
    return torch


def module_buffer_specs(module: Any, owner: str) -> list[BufferSpec]:
    """The ``BufferSpec`` s of a torch module's buffers, in ``module.named_buffers()`` order
    (``persistent=False`` for those not in ``state_dict()``). ``owner`` names the wrapper in
    the errors: ``ValueError`` for a buffer not on the CPU, ``TypeError`` for a dtype NumPy
    lacks (bfloat16)."""
    persistent = set(module.state_dict(keep_vars=True))
    return [BufferSpec(name=name, shape=tuple(buf.shape),
                       dtype=cpu_numpy_dtype(buf, "buffer", name, owner),
                       persistent=name in persistent)
            for name, buf in module.named_buffers()]


def cpu_numpy_dtype(tensor: Any, what: str, name: str, owner: str) -> np.dtype[Any]:
    """The NumPy dtype of ``tensor`` (the ``what`` called ``name`` of a module that ``owner``
    wraps): ``ValueError`` if it is not on the CPU, ``TypeError`` for a dtype NumPy lacks
    (bfloat16)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} {name!r} is on {tensor.device}; {owner} needs CPU tensors")
    try:
        return np.dtype(import_torch().empty(0, dtype=tensor.dtype).numpy().dtype)
    except TypeError:
        raise TypeError(f"{what} {name!r} has dtype {tensor.dtype}, which NumPy does not "
                        f"have") from None


def module_buffers(module: Any, specs: Sequence[BufferSpec]) -> dict[str, np.ndarray]:
    """NumPy views (no copies) of the buffer tensors ``module`` holds now, as ``specs`` (from
    ``module_buffer_specs``) list them. ``RuntimeError`` if one was removed or replaced by one
    of another shape, dtype or device."""
    current = dict(module.named_buffers())
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        buf = current.get(spec.name)
        if buf is None or tuple(buf.shape) != spec.shape or buf.device.type != "cpu":
            raise RuntimeError(f"buffer {spec.name!r} is no longer a CPU tensor of shape "
                               f"{spec.shape}: buffers must keep their shape and dtype")
        array = buf.detach().numpy()
        if array.dtype != spec.dtype:
            raise RuntimeError(f"buffer {spec.name!r} changed dtype from {spec.dtype} to "
                               f"{array.dtype}")
        out[spec.name] = array
    return out


class _PassCancelled(Exception):
    """Raised in the worker when the coroutine awaiting its pass was cancelled."""


class _Pass:
    """One forward (and backward) pass: the hook sequencing, run in the worker thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hooks: Hooks | None,
                 num_units: int) -> None:
        self.loop = loop
        self.hooks: Hooks = NoHooks() if hooks is None else hooks
        self.bridge = type(self.hooks) is not NoHooks
        self.n = num_units
        self.thread: int | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self._waiting: concurrent.futures.Future[None] | None = None
        # forward: the highest unit entered, whether after_forward is still due, and
        # whether the module's forward has returned
        self.fw_unit = -1
        self.fw_open = False
        self.fw_done = False
        # backward: the next unit to finish, whether its before_backward was called, the
        # parameters each unit still waits for, and units that can only finish at the end
        self.in_backward = False
        self.bw_next = num_units - 1
        self.bw_open = False
        self.pending: list[set[str]] = [set() for _ in range(num_units)]
        self.blocked = [False] * num_units

    # -------------------------------------------------------------- calling the hooks

    def cancel(self) -> None:
        """Called from the event loop: make the worker stop at its next hook."""
        with self._lock:
            self._cancelled = True
            if self._waiting is not None:
                self._waiting.cancel()

    def call(self, name: str, unit: int) -> None:
        """Run ``hooks.<name>(unit)`` on the event loop and wait for it (worker thread)."""
        if self._cancelled:
            raise _PassCancelled
        if not self.bridge:
            return
        coro = getattr(self.hooks, name)(unit)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:                         # the loop is closed
            coro.close()
            raise
        with self._lock:
            self._waiting = fut
            if self._cancelled:
                fut.cancel()
        try:
            while not fut.done():
                concurrent.futures.wait([fut], timeout=POLL_INTERVAL)
                if fut.done():
                    break
                if self._cancelled:
                    fut.cancel()
                    raise _PassCancelled
                if self.loop.is_closed() or not self.loop.is_running():
                    if not self.loop.is_closed():
                        fut.cancel()
                    raise RuntimeError(f"the event loop stopped while hook {name}({unit}) "
                                       f"was pending")
            if fut.cancelled() and self._cancelled:
                raise _PassCancelled
            fut.result()
        finally:
            with self._lock:
                self._waiting = None

    # ------------------------------------------------------------------------ forward

    def enter_unit(self, unit: int) -> None:
        """A unit module is about to run."""
        if self.fw_done or (unit == self.fw_unit and self.fw_open):
            return              # called again, consecutively, or recomputed by a checkpoint
        if unit <= self.fw_unit:
            raise RuntimeError(
                f"unit {unit} ran after unit {self.fw_unit}: TorchModel units must be listed "
                f"in the order the forward pass runs them (pass units=[...])")
        self._close_forward(unit)
        self.call("before_forward", unit)
        self.fw_unit, self.fw_open = unit, True

    def end_forward(self) -> None:
        """The module's forward returned."""
        self._close_forward(self.n)
        self.fw_done = True

    def _close_forward(self, upto: int) -> None:
        if self.fw_open:
            self.fw_open = False
            self.call("after_forward", self.fw_unit)
        for v in range(self.fw_unit + 1, upto):          # units the forward skipped
            self.fw_unit = v
            self.call("before_forward", v)
            self.call("after_forward", v)

    # ----------------------------------------------------------------------- backward

    def begin_backward(self, pending: list[set[str]], blocked: list[bool]) -> None:
        self.pending, self.blocked = pending, blocked
        self.in_backward = True
        self._advance(final=False)

    def accumulated(self, unit: int, name: str) -> None:
        """Parameter ``name`` of ``unit`` has its gradient for this pass."""
        if unit > self.bw_next:
            raise RuntimeError(
                f"the gradient of {name!r} changed after after_backward({unit}); its unit was "
                f"thought complete (is it used inside a reentrant checkpoint?)")
        self.pending[unit].discard(name)
        if unit == self.bw_next:
            self._advance(final=False)

    def end_backward(self) -> None:
        self.in_backward = False
        self._advance(final=True)

    def _advance(self, *, final: bool) -> None:
        while self.bw_next >= 0:
            u = self.bw_next
            if not self.bw_open:
                self.bw_open = True
                self.call("before_backward", u)
            if not final and (self.pending[u] or self.blocked[u]):
                return
            self.bw_open = False
            self.bw_next = u - 1
            self.call("after_backward", u)


class _Resources:
    """What a TorchModel must give back: its worker thread and its hooks on the module."""

    def __init__(self) -> None:
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.handles: list[Any] = []

    def release(self, wait: bool = False) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=wait)


def _on_forward_pre(ref: weakref.ref[TorchModel], unit: int, module: Any, args: Any) -> None:
    model = ref()
    if model is not None:
        state = model._active
        if state is not None and state.thread == threading.get_ident():
            state.enter_unit(unit)


def _on_accumulated(ref: weakref.ref[TorchModel], unit: int, name: str, param: Any) -> None:
    model = ref()
    if model is not None:
        state = model._active
        if state is not None and state.in_backward and state.thread == threading.get_ident():
            model._adopt_grad(name, param)
            state.accumulated(unit, name)


class TorchModel(_BoundArrays, Model):
    """A ``torch.nn.Module`` and a loss function as a ``Model`` (CPU tensors).

    Args:
        module: the network. Its parameters become the model's, named as in
            ``module.named_parameters()``; they must be CPU tensors of a dtype NumPy has.
        loss_fn: ``loss_fn(output, targets)`` returns a scalar tensor: the *mean* over the
            batch's samples (e.g. ``nn.MSELoss()``, ``nn.CrossEntropyLoss()``).
        units: the modules that are the units, in forward order. By default the children of
            ``module`` that have parameters (``module`` itself when it has no children).
            Every parameter must belong to exactly one unit.

    Raises:
        ImportError: torch is not installed.
        ValueError: a parameter belongs to no unit or to two, a unit has no parameters or is
            not part of ``module``, or a parameter is not a CPU tensor.
        TypeError: a parameter's or buffer's dtype has no NumPy equivalent (bfloat16).

    At construction the gradients are bound to zero-filled arrays the model owns (any
    ``.grad`` already set is dropped). A batch is ``(inputs, targets)``, each a NumPy array
    (wrapped with ``torch.from_numpy``, read-only arrays copied) or a tensor;
    ``module(inputs)`` is the output. Passes of one model run one at a time.
    """

    def __init__(self, module: torch.nn.Module, loss_fn: Callable[[Any, Any], Any], *,
                 units: Sequence[torch.nn.Module] | None = None) -> None:
        torch = import_torch()
        self._torch = torch
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.loss_fn = loss_fn
        if units is None:
            candidates = list(module.children()) or [module]
            unit_list = [m for m in candidates if any(True for _ in m.parameters())]
            if not unit_list:
                raise ValueError("the module has no parameters")
        else:
            unit_list = list(units)
            for u, m in enumerate(unit_list):
                if not isinstance(m, torch.nn.Module):
                    raise TypeError(f"unit {u} is not a torch.nn.Module: {type(m).__name__}")
                if not any(True for _ in m.parameters()):
                    raise ValueError(f"unit {u} ({type(m).__name__}) has no parameters")
        self.units = unit_list
        named = dict(module.named_parameters())
        names = {id(p): n for n, p in named.items()}
        owner: dict[int, int] = {}
        for u, m in enumerate(unit_list):
            for p in m.parameters():
                if id(p) not in names:
                    raise ValueError(f"unit {u} ({type(m).__name__}) has a parameter that is "
                                     f"not a parameter of the module")
                if owner.setdefault(id(p), u) != u:
                    raise ValueError(f"parameter {names[id(p)]!r} belongs to units "
                                     f"{owner[id(p)]} and {u}; every parameter must belong "
                                     f"to exactly one unit")
        specs: list[ParamSpec] = []
        for name, p in named.items():
            if id(p) not in owner:
                raise ValueError(f"parameter {name!r} belongs to no unit; pass units= that "
                                 f"cover every parameter")
            if p.device.type != "cpu":
                raise ValueError(f"parameter {name!r} is on {p.device}; TorchModel needs CPU "
                                 f"tensors")
            dtype = self._numpy_dtype(p, "parameter", name)
            specs.append(ParamSpec(name=name, shape=tuple(p.shape), dtype=dtype,
                                   unit=owner[id(p)], trainable=bool(p.requires_grad)))
        specs.sort(key=lambda s: s.unit)                # stable: module order within a unit
        self._buffer_specs = module_buffer_specs(module, "TorchModel")
        self._tparams: dict[str, Any] = {s.name: named[s.name] for s in specs}
        self._own(specs, {s.name: named[s.name].detach().numpy() for s in specs})
        self._bind_lock = threading.Lock()
        for s in specs:
            self._attach(s.name)
        self._active: _Pass | None = None
        self._running = 0
        self._closed = False
        self._resources = _Resources()
        ref = weakref.ref(self)
        handles = self._resources.handles
        for u, m in enumerate(unit_list):
            handles.append(m.register_forward_pre_hook(functools.partial(_on_forward_pre,
                                                                         ref, u)))
        self._hooked: set[str] = set()
        for s in specs:
            p = self._tparams[s.name]
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(
                    functools.partial(_on_accumulated, ref, s.unit, s.name)))
                self._hooked.add(s.name)
        weakref.finalize(self, self._resources.release)

    # ------------------------------------------------------------------ Model interface

    @property
    def num_units(self) -> int:
        return len(self.units)

    def param_specs(self) -> list[ParamSpec]:
        """The parameters; ``trainable`` is each one's ``requires_grad`` now."""
        return [s if s.trainable == self._tparams[s.name].requires_grad
                else dataclasses.replace(s, trainable=bool(self._tparams[s.name].requires_grad))
                for s in self._specs]

    def model_parallel_groups(self) -> list[ModelParallelGroup]:
        """The tensor group of the module's ``ColumnParallelLinear``/``RowParallelLinear``
        layers, if it has some: the global gradient norm sums the shards over it (every
        other parameter is taken to be the same on every rank of the group, as in a
        Megatron-style model)."""
        from .tensor import torch_model_parallel_groups

        return torch_model_parallel_groups(self.module)

    def buffer_specs(self) -> list[BufferSpec]:
        """The module's buffers, in ``module.named_buffers()`` order."""
        return list(self._buffer_specs)

    def buffers(self) -> dict[str, np.ndarray]:
        """NumPy views (no copies) of the buffer tensors the module holds now.

        Raises ``RuntimeError`` if a buffer was removed or replaced by one of another shape
        or dtype since the model was made.
        """
        return module_buffers(self.module, self._buffer_specs)

    def bind(self, params: Mapping[str, np.ndarray] | None = None,
             grads: Mapping[str, np.ndarray] | None = None) -> None:
        """Make each parameter's ``.data`` / ``.grad`` a view of these arrays (no copy); a
        zero-size array releases it (``.data`` becomes an empty tensor, ``.grad`` None).

        May be called from a hook, or from the event loop during a pass for parameters of
        units that are not running. Raises ``KeyError`` / ``TypeError`` / ``ValueError`` for
        an unknown name, a wrong dtype or shape, or a read-only array; nothing is rebound
        then.
        """
        super().bind(params, grads)

    def _rebind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        for what, arrays in (("parameter", params), ("gradient", grads)):
            for name, array in arrays.items():
                if array.size and not array.flags.writeable:
                    raise ValueError(f"bind: {what} {name!r} is read-only; torch needs "
                                     f"writable memory")
        with self._bind_lock:
            super()._rebind(params, grads)
            for name in {**params, **grads}:
                self._attach(name)

    async def forward_backward(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch = (inputs, targets)``; adds the gradients into the bound arrays.

        Runs in the model's worker thread; calls the hooks on this event loop in the order
        ``Hooks`` documents. Exceptions of the module, the loss function or a hook are
        raised here. If it is cancelled, the worker stops at its next hook call and this
        waits for it; gradients then hold a partial sum.
        """
        inputs, targets = self._tensors(batch)
        state = _Pass(asyncio.get_running_loop(), hooks, self.num_units)
        return await self._run(state, self._forward_backward_sync, state, inputs, targets)

    async def loss(self, batch: Any, hooks: Hooks | None = None) -> float:
        """Loss of ``batch`` (under ``torch.no_grad``); calls only the forward hooks."""
        inputs, targets = self._tensors(batch)
        state = _Pass(asyncio.get_running_loop(), hooks, self.num_units)
        return await self._run(state, self._loss_sync, state, inputs, targets)

    def predict(self, x: Any) -> np.ndarray:
        """``module(x)`` under ``torch.no_grad``, as a NumPy array (in the calling thread,
        no hooks)."""
        with self._torch.no_grad():
            out = self.module(self._tensor(x))
        return np.asarray(out.detach().numpy())

    # ---------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop the worker thread and remove the hooks from the module. Idempotent.

        Raises ``RuntimeError`` while a pass is running (await or cancel it first). The
        parameters and gradients stay bound to their arrays.
        """
        if self._running:
            raise RuntimeError("TorchModel.close() while a pass is running")
        self._closed = True
        self._resources.release(wait=True)

    def __enter__(self) -> TorchModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals

    def _attach(self, name: str) -> None:
        """Point parameter ``name``'s ``.data`` and ``.grad`` at the bound arrays."""
        torch, spec, p = self._torch, self._by_name[name], self._tparams[name]
        array, grad = self._params[name], self._grads[name]
        full = array.shape == spec.shape
        if full:
            if p.data.data_ptr() != array.ctypes.data or tuple(p.data.shape) != spec.shape:
                p.data = torch.from_numpy(_strided_like_torch(array))
        elif p.data.numel() or tuple(p.data.shape) != (0,):
            p.data = torch.empty(0, dtype=p.dtype)
        if full and grad.shape == spec.shape:
            if (p.grad is None or p.grad.data_ptr() != grad.ctypes.data
                    or tuple(p.grad.shape) != spec.shape):
                p.grad = torch.from_numpy(_strided_like_torch(grad))
        else:
            p.grad = None

    def _numpy_dtype(self, tensor: Any, what: str, name: str) -> np.dtype[Any]:
        try:
            return np.dtype(self._torch.empty(0, dtype=tensor.dtype).numpy().dtype)
        except TypeError:
            raise TypeError(f"{what} {name!r} has dtype {tensor.dtype}, which NumPy does "
                            f"not have") from None

    def _adopt_grad(self, name: str, param: Any) -> None:
        """After torch accumulated ``name``: make sure the sum is in the bound array."""
        spec, grad = self._by_name[name], self._grads[name]
        if grad.shape != spec.shape:
            raise RuntimeError(f"the gradient of {name!r} was computed but its gradient array "
                               f"is released (zero-size); bind it in before_backward"
                               f"({spec.unit})")
        tensor = param.grad
        if tensor is None or grad.size == 0 or tensor.data_ptr() == grad.ctypes.data:
            return
        # torch stored a new tensor (old + new) instead of adding in place: adopt it
        np.copyto(grad, tensor.detach().numpy())
        with self._bind_lock:
            param.grad = self._torch.from_numpy(grad)

    def _tensor(self, value: Any) -> Any:
        torch = self._torch
        if isinstance(value, torch.Tensor):
            return value
        array = np.asarray(value)
        if not array.flags.writeable or any(s < 0 for s in array.strides):
            array = array.copy()               # torch.from_numpy wants writable memory
        return torch.from_numpy(array)

    def _tensors(self, batch: Any) -> tuple[Any, Any]:
        try:
            inputs, targets = batch
        except (TypeError, ValueError):
            raise ValueError("batch must be a pair (inputs, targets)") from None
        return self._tensor(inputs), self._tensor(targets)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._closed:
            raise RuntimeError("TorchModel is closed")
        res = self._resources
        if res.executor is None:
            res.executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="asynccoll-torch")
        return res.executor

    async def _run(self, state: _Pass, fn: Callable[..., float], *args: Any) -> float:
        """Run ``fn(*args)`` in the worker; on cancellation stop it and wait for it."""
        future = self._executor().submit(self._in_worker, state, fn, *args)
        self._running += 1
        try:
            waiter = asyncio.wrap_future(future)
            try:
                return await asyncio.shield(waiter)
            except asyncio.CancelledError:
                state.cancel()
                if not future.cancel():
                    # the worker touches the bound arrays until it stops: wait for that
                    await asyncio.wait([waiter])
                    if not waiter.cancelled():
                        waiter.exception()          # the pass stopped; the cancel wins
                raise
        finally:
            self._running -= 1

    def _in_worker(self, state: _Pass, fn: Callable[..., float], *args: Any) -> float:
        state.thread = threading.get_ident()
        self._active = state
        try:
            return fn(*args)
        finally:
            self._active = None

    def _forward_backward_sync(self, state: _Pass, inputs: Any, targets: Any) -> float:
        torch = self._torch
        with torch.enable_grad():
            output = self.module(inputs)
            state.end_forward()
            loss = self._scalar(self.loss_fn(output, targets))
        if not loss.requires_grad:
            raise RuntimeError("the loss needs no gradient: no parameter it depends on has "
                               "requires_grad")
        pending, blocked = self._backward_plan(loss)
        with self._bind_lock:              # .grad may have been reset (zero_grad): re-attach
            for name in self._hooked:
                self._attach(name)
        state.begin_backward(pending, blocked)
        loss.backward()
        state.end_backward()
        return float(loss.detach())

    def _loss_sync(self, state: _Pass, inputs: Any, targets: Any) -> float:
        with self._torch.no_grad():
            output = self.module(inputs)
            state.end_forward()
            return float(self._scalar(self.loss_fn(output, targets)))

    def _scalar(self, loss: Any) -> Any:
        if not isinstance(loss, self._torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        return loss

    def _backward_plan(self, loss: Any) -> tuple[list[set[str]], list[bool]]:
        """Per unit: the hooked parameters that will get a gradient from ``loss``, and
        whether one will get it without a hook to say so (the unit finishes at the end)."""
        reached = {id(v) for v in _leaves(loss.grad_fn)}
        pending: list[set[str]] = [set() for _ in self.units]
        blocked = [False] * len(self.units)
        for s in self._specs:
            if id(self._tparams[s.name]) in reached:
                if s.name in self._hooked:
                    pending[s.unit].add(s.name)
                else:
                    blocked[s.unit] = True
        return pending, blocked


def _leaves(root: Any) -> Iterable[Any]:
    """The tensors whose ``AccumulateGrad`` nodes are reachable from autograd node ``root``."""
    seen: set[Any] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            yield variable
        stack.extend(nxt for nxt, _ in node.next_functions)


__all__ = ["TorchModel", "import_torch"]

