"""The ``"nccl"`` backend: CuPy arrays GPU to GPU through ``cupy.cuda.nccl``.

``nccl_init`` (``asynccoll.init(backend="nccl")``) first forms the TCP world exactly as
``backend="tcp"`` does (same arguments, same environment, so ``asynccoll run -n N`` launches
it), then rank 0 creates the NCCL unique id and broadcasts it over TCP, and every rank creates
its ``ncclComm`` on its GPU (``device``: default the local rank modulo the GPUs it sees).

The ``NcclCommunicator`` it returns has the ``Communicator`` API:

* **CuPy arrays** go through NCCL: each collective is enqueued on the communicator's own CUDA
  stream (after an event that orders it behind the work already queued on the caller's current
  stream), then a CUDA event is recorded and polled (``event.done``) on every turn of the
  event loop for up to ``WAIT_SPIN_SECONDS``; work still running after it gets a host function
  (on a side stream that waits for the event) that wakes the loop as it ends. The wait never
  blocks other coroutines and is bounded by ``timeout``.
* **NumPy arrays** and objects go through the TCP world underneath (also ``barrier``).
* NCCL has no gather, scatter, all-to-all or uneven all-gather: they are NCCL send/recv (or
  broadcasts) inside ``ncclGroupStart``/``ncclGroupEnd``. Reductions NCCL lacks (bitwise ops,
  complex PROD/MIN/MAX, 16-bit integers) are done by widening (int16/uint16 through 32 bits) or
  by an all-gather followed by a local reduction in rank order, identical on every rank.
* ``send``/``recv`` of CuPy arrays are staged through pinned host memory over TCP: NCCL's
  send/recv match by call order, have no tags and block the stream until the peer's matching
  call, which the API's tagged, any-order point-to-point cannot promise to avoid deadlocking.
  ``recv`` returns a CuPy array when the sender sent one.

Ordering: NCCL, like MPI, requires every rank to enqueue a communicator's collectives in the
same order. A collective takes a ticket when called; when it needs the TCP world first (the
signature check, ``all_gather`` row counts, ``scatter``/``all_to_all`` headers: one
``all_gather_object`` started at call time), it enqueues on NCCL only once every earlier ticket
has (``Turns``).

Failures: a timeout, a cancellation or an NCCL error aborts the NCCL communicator
(``ncclCommAbort``) and the TCP world, whose abort messages make the other ranks' waits fail
promptly. Not run in this repository's CI (no GPU there): see ``docs/backends/nccl.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .._progress import Turns, poll, signal_from_thread
from ..collectives import Communicator, _check_array
from ..errors import CollectiveError, CollectiveTimeout, CommunicatorClosedError, PeerLostError
from ..gpu import (
    DelegatingCommunicator,
    check_device_array,
    is_device_array,
    to_device,
    to_host,
)
from ..ops import ReduceOp, check_op
from ..tuning import Tuning
from ..wire import dtype_code
from ._native import (
    Failures,
    check_arrays,
    check_axis,
    check_gather_out,
    check_ndim,
    digest,
    gather_alone,
    gather_mismatch,
    no_progress,
    offsets,
    scatter_blocks,
    signature_mismatch,
)
from .base import describe_sig, refused

T = TypeVar("T")
log = logging.getLogger("asynccoll.nccl")

#: seconds a wait for a device collective tests its event on every turn of the event loop
#: (other coroutines run between tests) before a host function is queued to wake the loop when
#: the work ends (``_signal_after``). The host function's wake-up costs ~0.1-0.3 ms, which the
#: spin saves every collective shorter than it: on an H200, two ranks through NCCL's socket
#: transport (benchmarks/nccl_overhead.py), all_reduce without signature checks took 1.54-1.68x
#: raw NCCL's time at 1 MiB with a 0.2 ms spin, 1.12-1.24x with 2 ms, 1.08x with 10 ms. A
#: blocking ``cudaStreamSynchronize`` spins for the whole wait; this stops after 10 ms.
WAIT_SPIN_SECONDS = 0.01

_INSTALL_HINT = ('the "nccl" backend needs CuPy built with NCCL and a CUDA GPU: '
                 'pip install "asynccoll[gpu]"')

#: NCCL datatypes of the dtypes NCCL reduces natively
_NCCL_TYPES = {"|i1": "NCCL_INT8", "|u1": "NCCL_UINT8", "<i4": "NCCL_INT32",
               "<u4": "NCCL_UINT32", "<i8": "NCCL_INT64", "<u8": "NCCL_UINT64",
               "<f2": "NCCL_FLOAT16", "<f4": "NCCL_FLOAT32", "<f8": "NCCL_FLOAT64"}
_NCCL_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.AVG: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD",
             ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX"}
#: bytes per element -> (NCCL datatype, elements of it per element) to *move* any dtype
_MOVE_UNITS = {1: ("NCCL_INT8", 1), 2: ("NCCL_FLOAT16", 1), 4: ("NCCL_INT32", 1),
               8: ("NCCL_INT64", 1), 16: ("NCCL_INT64", 2)}
_UFUNC_NAMES = {ReduceOp.SUM: "add", ReduceOp.AVG: "add", ReduceOp.PROD: "multiply",
                ReduceOp.MIN: "minimum", ReduceOp.MAX: "maximum", ReduceOp.BAND: "bitwise_and",
                ReduceOp.BOR: "bitwise_or", ReduceOp.BXOR: "bitwise_xor"}


def import_nccl() -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)``, or an ImportError naming the extra to install."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    if not getattr(nccl, "available", True):
        raise ImportError(f"{_INSTALL_HINT} (this CuPy was built without NCCL)")
    return cupy, nccl


@dataclass(frozen=True, slots=True)
class _Plan:
    """How to reduce one dtype with one op on NCCL.

    ``native``: view the array as ``view`` and reduce it with (``nccl_type``, ``nccl_op``);
    ``widen``: the same on a copy converted to ``view`` (16-bit integers through 32 bits:
    the low bits of a 32-bit sum or product are the 16-bit result); ``gather``: all-gather
    every rank's array and reduce locally, in rank order. ``parity``: keep the low bit
    afterwards (bool XOR is the parity of the sum). ``nans``: NCCL's MIN and MAX return the
    number where one operand is NaN (as ``fmin``/``fmax``), so a mask of NaNs is reduced
    (MAX) beside the data and put back, giving NumPy's (and every other backend's) answer.
    """

    kind: str
    nccl_type: str = ""
    nccl_op: str = ""
    view: str = ""
    parity: bool = False
    nans: bool = False

    def operand(self, flat: Any) -> Any:
        """What NCCL reduces of the 1-D ``flat`` (``native`` / ``widen`` plans): ``flat``
        viewed as ``view``, or a copy converted to it."""
        return flat.view(self.view) if self.kind == "native" else flat.astype(self.view)

    def nccl_args(self, nccl: Any) -> tuple[Any, Any]:
        """The NCCL datatype and op."""
        return getattr(nccl, self.nccl_type), getattr(nccl, self.nccl_op)

    def narrow(self, cupy: Any, result: Any, into: Any) -> None:
        """Make NCCL's ``result`` (of ``operand``'s dtype) the reduction of ``into``'s
        dtype: keep its low bit (``parity``), and copy a widened result back into ``into``."""
        if self.parity:
            cupy.bitwise_and(result, 1, out=result)
        if self.kind == "widen":
            cupy.copyto(into, result, casting="unsafe")


def _plan(dtype: np.dtype[Any], op: ReduceOp) -> _Plan:
    code, kind = dtype_code(dtype), dtype.kind
    if kind == "b":
        if op is ReduceOp.BXOR:
            return _Plan("native", "NCCL_UINT8", "NCCL_SUM", "|u1", parity=True)
        nop = ("NCCL_MAX" if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR)
               else "NCCL_MIN")
        return _Plan("native", "NCCL_UINT8", nop, "|u1")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return _Plan("gather")
    if kind == "c":
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            part = "<f4" if code == "<c8" else "<f8"
            return _Plan("native", _NCCL_TYPES[part], "NCCL_SUM", part)
        return _Plan("gather")
    if code in ("<i2", "<u2"):
        wide = "<i4" if code == "<i2" else "<u4"
        return _Plan("widen", _NCCL_TYPES[wide], _NCCL_OPS[op], wide)
    return _Plan("native", _NCCL_TYPES[code], _NCCL_OPS[op], code,
                 nans=kind == "f" and op in (ReduceOp.MIN, ReduceOp.MAX))


def _head(x: Any) -> list[Any]:
    """What a receiver needs to allocate ``x``: [dtype code, shape, on the GPU]."""
    check_ndim(x, "array")
    return [dtype_code(x.dtype), list(x.shape), is_device_array(x)]


def _local_rank() -> int | None:
    for var in ("ASYNCCOLL_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID", "SLURM_LOCALID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def _make_comm(cupy: Any, nccl: Any, device: int, size: int, uid: Any, rank: int) -> Any:
    """ncclCommInitRank on ``device`` (blocks until every rank called it; run in a thread)."""
    with cupy.cuda.Device(device):
        return nccl.NcclCommunicator(size, uid, rank)


async def _init_comm(inner: Communicator, cupy: Any, nccl: Any, device: int, uid: Any) -> Any:
    """The NCCL communicator over ``inner``'s ranks, or a ``CollectiveError`` on every rank.

    ncclCommInitRank blocks until every rank called it, without a timeout and without a way
    to abort it: it runs in a daemon thread (one left blocked must not keep the process from
    exiting, as a thread of asyncio's executor would: ``asyncio.run`` and the interpreter
    join those), while the TCP world is watched. A rank whose init fails, times out or is
    cancelled aborts the TCP world, so the others' waits end at once naming it.
    """
    loop = asyncio.get_running_loop()
    signal, fire = signal_from_thread(loop)
    lock = threading.Lock()
    state: dict[str, Any] = {}

    def work() -> None:
        try:
            comm = _make_comm(cupy, nccl, device, inner.world_size, uid, inner.rank)
        except BaseException as exc:  # handed to the waiting coroutine
            with lock:
                state["error"] = exc
        else:
            with lock:
                if "gave_up" not in state:
                    state["comm"] = comm
                    comm = None
            if comm is not None:  # nobody waits for it any more
                with contextlib.suppress(Exception):
                    comm.abort()
        fire(None)

    threading.Thread(target=work, name=f"asynccoll-nccl-init-{inner.rank}", daemon=True).start()
    transport = inner.transport
    timeout = inner.timeout
    try:
        await poll(signal.done, deadline=loop.time() + timeout, check=transport.check_usable,
                   on_timeout=lambda: CollectiveTimeout(
                       f"ncclCommInitRank on group rank {inner.rank} did not complete within "
                       f"{timeout:g} s (not every rank called it)"),
                   arm=lambda: signal, spin=0.0)
        error = state.get("error")
        if error is not None:
            raise CollectiveError(f"ncclCommInitRank failed on group rank {inner.rank} "
                                  f"(GPU {device}): {error}") from error
        return state["comm"]
    except BaseException as exc:
        with lock:
            state["gave_up"] = True
            late = state.pop("comm", None)
        if late is not None:
            with contextlib.suppress(Exception):
                late.abort()
        err = (exc if isinstance(exc, CollectiveError) else
               CollectiveError(f"ncclCommInitRank was cancelled on group rank {inner.rank}"))
        transport.abort(err)  # the others stop waiting for this rank
        raise


class NcclCommunicator(DelegatingCommunicator):
    """A ``Communicator`` whose CuPy arrays travel through NCCL.

    NumPy arrays, objects and ``barrier`` are forwarded to the TCP communicator underneath
    (``inner``). See the module docstring for how calls map onto NCCL.

    Attributes:
        device: the CUDA device id this rank's arrays must live on.
        check_signatures: whether device collectives first check (over TCP) that every rank
            called the same thing; equal on all ranks.
    """

    def __init__(self, inner: Communicator, *, cupy: Any, nccl: Any, comm: Any, device: int,
                 flags: Communicator, check_signatures: bool = True,
                 backend: str = "nccl") -> None:
        super().__init__(inner, backend=backend)
        self._cupy = cupy
        self._nccl = nccl
        self._comm = comm
        self.device = device
        self._flags = flags
        self.check_signatures = bool(check_signatures)
        self._tickets = 0
        self._turns = Turns()
        self._broken: CollectiveError | None = None
        self._abandoned: list[Any] = []
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
            #: runs nothing but the host functions that wake long waits (``_signal_after``)
            self._waker = cupy.cuda.Stream(non_blocking=True)

    @property  # type: ignore[override]
    def timeout(self) -> float:
        return self._inner.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        # the device flags of send/recv travel through ``_flags``: it keeps the same timeout
        # (the inner communicator checks the value, as on every backend)
        self._inner.timeout = value
        self._flags.timeout = self._inner.timeout

    @property
    def nccl_comm(self) -> Any:
        """The ``cupy.cuda.nccl.NcclCommunicator`` (do not start collectives on it)."""
        return self._comm

    # -- machinery -----------------------------------------------------------------------

    def _check(self, what: str = "") -> None:
        """Raise if this communicator (or the TCP world under it) is broken: an error whose
        message starts with ``what``, the call refused (``base.refused``), when given."""
        if self._closed:
            raise CommunicatorClosedError("the communicator was closed")
        try:
            self._check_broken()
        except CollectiveError as exc:
            raise refused(exc, what) from exc.__cause__

    def _check_broken(self) -> None:
        broken = self._broken
        if broken is not None:
            message = f"the communicator is broken: {broken}"
            if isinstance(broken, PeerLostError):  # (the class stays, as on every backend)
                raise PeerLostError(message, rank=broken.rank) from broken
            raise CollectiveError(message) from broken
        try:
            self._inner.transport.check_usable()
            self._comm.check_async_error()
        except CollectiveError as exc:
            # the TCP world's own error is kept (not 'the communicator is broken by an
            # earlier error: ...', which the next call would say twice)
            cause = exc.__cause__
            self._break(cause if isinstance(cause, CollectiveError) else exc, notify=False)
            raise
        except self._nccl.NcclError as exc:
            err = CollectiveError(f"NCCL failed on group rank {self.rank}: {exc}")
            self._break(err)
            raise err from exc

    def _break(self, err: CollectiveError, *, notify: bool = True) -> None:
        """Abort NCCL (in-flight kernels stop) and, with ``notify``, the TCP world."""
        if self._broken is not None:
            return
        self._broken = err
        with contextlib.suppress(Exception):  # aborting a failed communicator may fail too
            self._comm.abort()
        if notify:
            self._inner.transport.abort(err)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[Any]:
        """Work enqueued inside runs on our stream, after what the caller already queued."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(cupy.cuda.get_current_stream())
            self._stream.wait_event(ready)
            with self._stream:
                yield self._stream

    async def _device_collective(self, sig: tuple[Any, ...],
                                 enqueue: Callable[[list[Any] | None], T], *,
                                 meta: Any = None, need_meta: bool = False,
                                 keep: Sequence[Any] = ()) -> T:
        """One collective on device arrays (``world_size > 1``).

        ``meta``: this rank's contribution to the TCP exchange (``need_meta``: always run it);
        ``enqueue(metas)`` enqueues the NCCL work on our stream and returns the result (the
        list of every rank's ``[digest, description, meta]`` when exchanged, else None).
        """
        self._check(str(sig[0]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        ticket = self._tickets
        self._tickets += 1
        done_event = None
        held: list[Any] = list(keep)
        try:
            with Failures(sig, self.rank, "NCCL", self._nccl.NcclError,
                          functools.partial(self._fail, held), self._where, ticket):
                metas = None
                if self.check_signatures or need_meta:
                    mine = [digest(sig) if self.check_signatures else 0, describe_sig(sig),
                            meta]
                    metas = await self._inner.all_gather_object(mine)
                    if self.check_signatures:
                        other = next((j for j, m in enumerate(metas) if m[0] != mine[0]), None)
                        if other is not None:
                            raise signature_mismatch(self.rank, mine[1], other,
                                                     metas[other][1], self._where(ticket))
                if not self._turns.ready(ticket):
                    try:
                        async with asyncio.timeout_at(deadline):
                            await self._turns.wait(ticket)
                    except TimeoutError:
                        raise self._timeout(sig, ticket) from None
                self._check()
                with self._on_stream() as stream:
                    result = enqueue(metas)
                    done_event = self._cupy.cuda.Event(disable_timing=True)
                    done_event.record(stream)
                self._turns.done(ticket)
                held.append(result)
                event = done_event
                await poll(lambda: bool(event.done), deadline=deadline, check=self._check,
                           on_timeout=lambda: self._timeout(sig, ticket),
                           arm=lambda: self._signal_after(event, loop),
                           spin=WAIT_SPIN_SECONDS)
                return result
        finally:
            self._turns.done(ticket)

    def _signal_after(self, event: Any, loop: asyncio.AbstractEventLoop
                      ) -> asyncio.Future[None] | None:
        """A future completed (from CUDA's callback thread) once ``event`` has happened: a
        host function queued on a side stream that waits for it, so our stream never waits
        for the callback. None where streams cannot run host functions (the event is polled
        then)."""
        launch = getattr(self._waker, "launch_host_func", None)
        if launch is None:
            return None
        signal, fire = signal_from_thread(loop)
        with self._cupy.cuda.Device(self.device):
            self._waker.wait_event(event)
            launch(fire, None)
        return signal

    def _timeout(self, sig: tuple[Any, ...], ticket: int) -> CollectiveTimeout:
        return no_progress(sig, self.rank, self.timeout, self._where(ticket))

    def _where(self, seq: int) -> str:
        """Which call of which group device collective ``seq`` is (calls on host arrays go to
        the inner communicator, which numbers them itself)."""
        return f"{self._inner._where(seq)}, counting calls on GPU arrays"

    def _fail(self, held: list[Any], err: CollectiveError) -> None:
        self._abandoned.append(held)  # GPU memory NCCL may still touch is never reused
        self._break(err)

    def _check_device(self, x: Any, what: str = "array") -> Any:
        check_device_array(x, what)
        if x.device.id != self.device:
            raise ValueError(f"{what} is on GPU {x.device.id} but this communicator uses GPU "
                             f"{self.device}")
        return x

    def _check_item(self, x: Any, what: str) -> Any:
        """One array of a scatter or all-to-all: CuPy on our GPU, or NumPy."""
        return self._check_device(x, what) if is_device_array(x) else _check_array(x, what)

    def _move(self, x: Any) -> tuple[Any, int]:
        """(NCCL datatype, count) that moves ``x``'s bytes."""
        name, per = _MOVE_UNITS[x.dtype.itemsize]
        return getattr(self._nccl, name), x.size * per

    def _stage_in(self, x: Any, what: str) -> Any:
        """``x`` as a device array on our GPU (NumPy arrays are uploaded)."""
        if is_device_array(x):
            return self._check_device(x, what)
        _check_array(x, what)
        with self._cupy.cuda.Device(self.device):
            return self._cupy.asarray(x)

    def _reduce_locally(self, gathered: Any, op: ReduceOp, into: Any) -> None:
        """``into = gathered[0] op gathered[1] op ...`` in rank order (same bits everywhere)."""
        ufunc = getattr(self._cupy, _UFUNC_NAMES[op])
        into[...] = gathered[0]
        for j in range(1, gathered.shape[0]):
            ufunc(into, gathered[j], out=into)

    def _all_gather_rows(self, flat: Any) -> Any:
        """(world_size, n) array of every rank's flat ``flat`` (enqueued on our stream)."""
        every = self._cupy.empty((self.world_size, flat.size), flat.dtype)
        dtype, count = self._move(flat)
        self._comm.allGather(flat.data.ptr, every.data.ptr, count, dtype, self._stream.ptr)
        return every

    def _reducer(self, a: Any, op: ReduceOp, root: int | None
                 ) -> Callable[[list[Any] | None], Any]:
        """The ``enqueue`` of a reduction of ``a`` in place onto ``root``, or onto every rank
        when ``root`` is None (an all-reduce). It returns what NCCL may still touch."""
        plan = _plan(a.dtype, op)
        gets_result = root is None or self.rank == root

        def reduce(x: Any, dtype: Any, nop: Any) -> None:
            ptr, stream = x.data.ptr, self._stream.ptr
            if root is None:
                self._comm.allReduce(ptr, ptr, x.size, dtype, nop, stream)
            else:
                self._comm.reduce(ptr, ptr, x.size, dtype, nop, root, stream)

        def enqueue(metas: list[Any] | None) -> Any:
            nccl, cupy = self._nccl, self._cupy
            flat = a.reshape(-1)
            if plan.kind == "gather":
                held = self._all_gather_rows(flat)
                if gets_result:
                    self._reduce_locally(held, op, flat)
            else:
                # NaN positions, taken before the data is reduced in place (``nans`` plans)
                nans = cupy.isnan(flat).view(np.uint8) if plan.nans else None
                held = plan.operand(flat)
                reduce(held, *plan.nccl_args(nccl))
                if nans is not None:
                    reduce(nans, nccl.NCCL_UINT8, nccl.NCCL_MAX)
                if gets_result:
                    plan.narrow(cupy, held, flat)
                    if nans is not None:
                        cupy.copyto(flat, cupy.nan, where=nans.view(bool))
                held = (held, nans)
            if gets_result and op is ReduceOp.AVG:  # never a "gather" plan
                cupy.divide(flat, self.world_size, out=flat)
            return held

        return enqueue

    # -- collectives on device arrays ----------------------------------------------------

    async def broadcast(self, array: Any, root: int = 0) -> Any:
        """Root's ``array`` on every rank, in place (CuPy: through NCCL)."""
        if not is_device_array(array):
            return await self._inner.broadcast(array, root)
        a = self._check_device(array)
        root = self._check_rank(root, "root")
        if self.world_size == 1:
            self._check("broadcast")
            return a

        def enqueue(metas: list[Any] | None) -> Any:
            dtype, count = self._move(a)
            self._comm.broadcast(a.data.ptr, a.data.ptr, count, dtype, root, self._stream.ptr)
            return a

        return await self._device_collective(
            ("broadcast", dtype_code(a.dtype), a.shape, root), enqueue)

    async def reduce(self, array: Any, root: int = 0, op: ReduceOp = ReduceOp.SUM) -> Any:
        """Reduce onto ``root`` in place; returns ``array`` on root, ``None`` elsewhere."""
        if not is_device_array(array):
            return await self._inner.reduce(array, root, op)
        a = self._check_device(array)
        root = self._check_rank(root, "root")
        rop = check_op(op, a.dtype)
        if self.world_size == 1:
            self._check("reduce")
            return a
        await self._device_collective(("reduce", dtype_code(a.dtype), a.shape, rop.value, root),
                                      self._reducer(a, rop, root))
        return a if self.rank == root else None

    async def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        """Reduce over all ranks in place; bit-identical on every rank (CuPy: NCCL)."""
        if not is_device_array(array):
            return await self._inner.all_reduce(array, op)
        a = self._check_device(array)
        rop = check_op(op, a.dtype)
        if self.world_size == 1:
            self._check("all_reduce")
            return a
        await self._device_collective(("all_reduce", dtype_code(a.dtype), a.shape, rop.value),
                                      self._reducer(a, rop, None))
        return a

    async def reduce_scatter(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        """This rank's ``numpy.array_split`` block (axis 0) of the reduced ``array`` (new)."""
        if not is_device_array(array):
            return await self._inner.reduce_scatter(array, op)
        a = self._check_device(array)
        check_axis(a, "reduce_scatter")
        rop = check_op(op, a.dtype)
        me, w = self.rank, self.world_size
        rows, counts = scatter_blocks(a, w)
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            out = cupy.empty((rows[me], *a.shape[1:]), a.dtype)
        if w == 1:
            self._check("reduce_scatter")
            out[...] = a
            return out
        plan = _plan(a.dtype, rop)
        starts = offsets(counts)

        def scatter_reduce(src: Any, dst: Any, per: int, dtype: Any, nop: Any) -> None:
            """Reduce ``src`` (``per`` NCCL elements per element) and leave this rank's
            block in ``dst``."""
            nccl, stream = self._nccl, self._stream.ptr
            item = src.dtype.itemsize
            if len(set(counts)) == 1:
                self._comm.reduceScatter(src.data.ptr, dst.data.ptr, counts[me] * per,
                                         dtype, nop, stream)
                return
            nccl.groupStart()  # uneven blocks: one reduce per block, rooted at its owner
            try:
                for j in range(w):
                    if counts[j]:
                        block = src.data.ptr + starts[j] * per * item
                        self._comm.reduce(block, dst.data.ptr if j == me else block,
                                          counts[j] * per, dtype, nop, j, stream)
            finally:
                nccl.groupEnd()

        def enqueue(metas: list[Any] | None) -> Any:
            nccl = self._nccl
            flat, mine = a.reshape(-1), out.reshape(-1)
            if plan.kind == "gather":
                every = self._all_gather_rows(flat)
                self._reduce_locally(every[:, starts[me]:starts[me] + counts[me]], rop, mine)
                held: Any = every
            else:
                nans = cupy.isnan(flat).view(np.uint8) if plan.nans else None
                src = plan.operand(flat)
                dst = (mine.view(plan.view) if plan.kind == "native"
                       else cupy.empty(mine.size, plan.view))
                per = src.size // max(flat.size, 1)  # 2 for complex viewed as float pairs
                scatter_reduce(src, dst, per, *plan.nccl_args(nccl))
                plan.narrow(cupy, dst, mine)
                held = (src, dst)
                if nans is not None:
                    mine_nans = cupy.empty(mine.size, np.uint8)
                    scatter_reduce(nans, mine_nans, 1, nccl.NCCL_UINT8, nccl.NCCL_MAX)
                    cupy.copyto(mine, cupy.nan, where=mine_nans.view(bool))
                    held = (src, dst, nans, mine_nans)
            if rop is ReduceOp.AVG:
                cupy.divide(out, w, out=out)
            return held

        await self._device_collective(
            ("reduce_scatter", dtype_code(a.dtype), a.shape, rop.value), enqueue, keep=[out])
        return out

    async def all_gather(self, array: Any, *, out: Any = None) -> Any:
        """Every rank's ``array`` concatenated along axis 0 (axis-0 lengths may differ)."""
        if not is_device_array(array):
            return await self._inner.all_gather(array, out=out)
        a = self._check_device(array)
        check_axis(a, "all_gather")
        if out is not None:
            check_gather_out(a, self._check_device(out, "out"))
        cupy, w, me = self._cupy, self.world_size, self.rank
        row = a.size // a.shape[0] if a.shape[0] else int(np.prod(a.shape[1:], dtype=np.int64))
        if w == 1:
            self._check("all_gather")
            return gather_alone(a, out)

        def enqueue(metas: list[Any] | None) -> Any:
            assert metas is not None
            rows = [int(m[2]) for m in metas]
            total = sum(rows)
            # a wrong ``out`` is found after the others enqueued: gather anyway, raise after
            dest = (out if out is not None and out.shape[0] == total
                    else cupy.empty((total, *a.shape[1:]), a.dtype))
            flat, every = a.reshape(-1), dest.reshape(-1)
            dtype, _ = self._move(flat)
            per = _MOVE_UNITS[a.dtype.itemsize][1]
            counts = [n * row for n in rows]
            starts = offsets(counts)
            stream, item = self._stream.ptr, a.dtype.itemsize
            if not any(counts):
                return dest
            if len(set(counts)) == 1:
                self._comm.allGather(flat.data.ptr, every.data.ptr, counts[me] * per, dtype,
                                     stream)
            else:  # uneven: every rank broadcasts its block
                self._nccl.groupStart()
                try:
                    for j in range(w):
                        if counts[j]:
                            dst = every.data.ptr + starts[j] * item
                            src = flat.data.ptr if j == me else dst
                            self._comm.broadcast(src, dst, counts[j] * per, dtype, j, stream)
                finally:
                    self._nccl.groupEnd()
            return dest

        got = await self._device_collective(
            ("all_gather", dtype_code(a.dtype), a.shape[1:]), enqueue, meta=a.shape[0],
            need_meta=True)
        if out is not None and got is not out:
            err = gather_mismatch(got.shape[0], out)
            self._break(err)
            raise err
        return got

    def _group_send_recv(self, sends: Sequence[tuple[Any, int]],
                         recvs: Sequence[tuple[Any, int]]) -> None:
        """NCCL sends and receives of whole arrays, inside one group (no deadlock whatever
        the order); empty arrays are skipped on both sides."""
        nccl, stream = self._nccl, self._stream.ptr
        nccl.groupStart()
        try:
            for x, peer in sends:
                if x.size:
                    dtype, count = self._move(x)
                    self._comm.send(x.data.ptr, count, dtype, peer, stream)
            for x, peer in recvs:
                if x.size:
                    dtype, count = self._move(x)
                    self._comm.recv(x.data.ptr, count, dtype, peer, stream)
        finally:
            nccl.groupEnd()

    async def gather(self, array: Any, root: int = 0) -> Any:
        """On root, every rank's ``array`` (a list of new CuPy arrays); ``None`` elsewhere."""
        if not is_device_array(array):
            return await self._inner.gather(array, root)
        a = self._check_device(array)
        root = self._check_rank(root, "root")
        cupy, w, me = self._cupy, self.world_size, self.rank
        if w == 1:
            self._check("gather")
            return [a.copy()]

        def enqueue(metas: list[Any] | None) -> Any:
            if me != root:
                self._group_send_recv([(a, root)], [])
                return None
            got = [a.copy() if j == me else cupy.empty_like(a) for j in range(w)]
            self._group_send_recv([], [(got[j], j) for j in range(w) if j != me])
            return got

        return await self._device_collective(("gather", dtype_code(a.dtype), a.shape, root),
                                             enqueue)

    async def scatter(self, arrays: Sequence[Any] | None, root: int = 0) -> Any:
        """The array root put at this rank's position of ``arrays`` (read on root only).

        On this backend the data travels through NCCL whatever root passed (NumPy arrays are
        uploaded); the result is a CuPy array when root's array for this rank was one, else
        a NumPy array.
        """
        root = self._check_rank(root, "root")
        cupy, w, me = self._cupy, self.world_size, self.rank
        items: list[Any] = []
        heads = None
        if me == root:
            items = check_arrays(arrays, w, "scatter on root", self._check_item)
            heads = [_head(x) for x in items]
        if w == 1:
            self._check("scatter")
            return items[0].copy()

        def enqueue(metas: list[Any] | None) -> tuple[Any, bool, Any]:
            assert metas is not None
            code, shape, on_device = metas[root][2][me]
            if me == root:
                sends = [(self._stage_in(x, f"arrays[{j}]"), j) for j, x in enumerate(items)
                         if j != me]
                self._group_send_recv(sends, [])
                return items[me].copy(), True, sends
            with cupy.cuda.Device(self.device):
                got = cupy.empty(tuple(shape), np.dtype(code))
            self._group_send_recv([], [(got, root)])
            return got, on_device, None

        got, on_device, _ = await self._device_collective(("scatter", root), enqueue,
                                                          meta=heads, need_meta=True)
        return got if on_device else got.get()

    async def all_to_all(self, arrays: Sequence[Any]) -> list[Any]:
        """Element ``j`` is what rank ``j`` put at position ``rank`` of its ``arrays``.

        Through NCCL (NumPy arrays are uploaded); element ``j`` is a CuPy array when rank
        ``j`` sent one, else a NumPy array.
        """
        w, me, cupy = self.world_size, self.rank, self._cupy
        items = check_arrays(arrays, w, "all_to_all", self._check_item)
        heads = [_head(x) for x in items]
        if w == 1:
            self._check("all_to_all")
            return [items[0].copy()]

        def enqueue(metas: list[Any] | None) -> tuple[list[Any], list[bool], Any]:
            assert metas is not None
            sends = [(self._stage_in(items[j], f"arrays[{j}]"), j) for j in range(w) if j != me]
            with cupy.cuda.Device(self.device):
                got = [items[me].copy() if j == me else
                       cupy.empty(tuple(metas[j][2][me][1]), np.dtype(metas[j][2][me][0]))
                       for j in range(w)]
            self._group_send_recv(sends, [(got[j], j) for j in range(w) if j != me])
            on_device = [True if j == me else bool(metas[j][2][me][2]) for j in range(w)]
            return got, on_device, sends

        got, on_device, _ = await self._device_collective(("all_to_all",), enqueue, meta=heads,
                                                          need_meta=True)
        return [x if dev else x.get() for x, dev in zip(got, on_device, strict=True)]

    async def barrier(self) -> None:
        """Return once every rank has entered (over TCP; enqueued GPU work is not waited for)."""
        await self._inner.barrier()

    # -- point to point: staged through pinned host memory over TCP ----------------------

    async def send(self, array: Any, dst: int, tag: int = 0) -> None:
        """Send ``array`` (NumPy, or CuPy through pinned host memory) to group rank ``dst``."""
        device = is_device_array(array)
        # checked before the flag goes out: a refused array must send nothing
        host = to_host(self._check_device(array)) if device else _check_array(array)
        await asyncio.gather(self._flags.send(np.array([device], np.uint8), dst, tag),
                             self._inner.send(host, dst, tag))

    async def recv(self, src: int, tag: int = 0) -> Any:
        """The next array ``src`` sent with ``tag``: a CuPy array if it sent one."""
        flag, data = await asyncio.gather(self._flags.recv(src, tag),
                                          self._inner.recv(src, tag))
        if int(flag[0]):
            with self._cupy.cuda.Device(self.device):
                return to_device(data)
        return data

    # -- groups and lifetime -------------------------------------------------------------

    async def new_group(self, ranks: Sequence[int]) -> NcclCommunicator | None:
        """A communicator over ``ranks`` (renumbered in the given order): a TCP subgroup and
        a new NCCL communicator over its members; ``None`` on other ranks."""
        sub = await self._inner.new_group(ranks)
        if sub is None:
            return None
        return await _nccl_over(sub, device=self.device, check_signatures=self.check_signatures)

    async def close(self) -> None:
        """Destroy the NCCL communicator and close the TCP communicator. Idempotent.

        Work still queued on the communicator's stream is waited for without blocking the
        event loop (collectives in flight see the close and fail), within ``timeout``; when
        it cannot end (a peer never called it, or the world broke), NCCL is aborted instead.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._broken is None:
                await self._drain()
        except CollectiveError as exc:
            log.debug("rank %d aborts NCCL on close: %s", self.rank, exc)
            self._break(exc, notify=False)
        except BaseException:
            self._break(CollectiveError(f"close was cancelled on group rank {self.rank}"),
                        notify=False)
            raise
        finally:
            if self._broken is None:
                with contextlib.suppress(Exception):
                    self._comm.destroy()
            await self._flags.close()
            await self._inner.close()

    async def _drain(self) -> None:
        """Return once the work queued on our stream ended; ``CollectiveError`` when the TCP
        world broke or ``timeout`` passed first."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            idle = cupy.cuda.Event(disable_timing=True)
            idle.record(self._stream)
        loop = asyncio.get_running_loop()
        timeout = self.timeout
        await poll(lambda: bool(idle.done), deadline=loop.time() + timeout,
                   check=self._inner.transport.check_usable,
                   on_timeout=lambda: CollectiveTimeout(
                       f"close on group rank {self.rank}: the NCCL work queued before it did "
                       f"not end within {timeout:g} s"),
                   arm=lambda: self._signal_after(idle, loop), spin=WAIT_SPIN_SECONDS)


async def _nccl_over(inner: Communicator, *, device: int | None,
                     check_signatures: bool) -> NcclCommunicator:
    """An NcclCommunicator over the ranks of the TCP communicator ``inner``."""
    cupy, nccl = import_nccl()
    count = int(cupy.cuda.runtime.getDeviceCount())
    if device is None:
        local = _local_rank()
        device = (local if local is not None else inner.rank) % max(count, 1)
    if not 0 <= device < count:
        raise ValueError(f"device {device} does not exist ({count} GPU(s) visible)")
    uid = nccl.get_unique_id() if inner.rank == 0 else None
    if isinstance(uid, tuple):
        uid = list(uid)
    # rank 0's unique id, and a check that every rank checks signatures or none does (a rank
    # that checks waits over TCP for one that went straight to NCCL: a timeout, much later)
    every = await inner.all_gather_object([uid, bool(check_signatures)])
    checks = [bool(m[1]) for m in every]
    if len(set(checks)) > 1:
        raise ValueError("check_signatures must be equal on every rank: True on ranks "
                         f"{[j for j, c in enumerate(checks) if c]}, False on ranks "
                         f"{[j for j, c in enumerate(checks) if not c]}")
    uid = every[0][0]
    uid = tuple(uid) if isinstance(uid, list) else uid
    flags = await inner.new_group(range(inner.world_size))
    assert flags is not None
    try:
        comm = await _init_comm(inner, cupy, nccl, device, uid)
    except BaseException:
        await flags.close()
        raise
    return NcclCommunicator(inner, cupy=cupy, nccl=nccl, comm=comm, device=device,
                            flags=flags, check_signatures=check_signatures)


async def nccl_init(*, rank: int | None = None, world_size: int | None = None,
                    addr: str | None = None, port: int | None = None, timeout: float = 60.0,
                    token: str | bytes | None = None, tuning: Tuning | None = None,
                    device: int | None = None, check_signatures: bool = True,
                    **tcp_options: Any) -> NcclCommunicator:
    """Join a world whose CuPy arrays travel through NCCL; see ``asynccoll.init``.

    Args:
        device: the CUDA device of this rank (default: the local rank from ``LOCAL_RANK``,
            ``ASYNCCOLL_LOCAL_RANK``, Open MPI's or Slurm's variables, else the rank, modulo
            the number of visible GPUs); made the calling thread's current CuPy device.
        check_signatures: check (over TCP) before each device collective that every rank
            called the same thing.
        The other arguments are ``asynccoll.init``'s for ``backend="tcp"``.
    """
    import_nccl()  # fail before touching the network when CuPy/NCCL is missing
    from .tcp_world import tcp_init

    inner = await tcp_init(rank=rank, world_size=world_size, addr=addr, port=port,
                           timeout=timeout, token=token, tuning=tuning, **tcp_options)
    try:
        comm = await _nccl_over(inner, device=device, check_signatures=check_signatures)
    except BaseException:
        await inner.close()
        raise
    cupy, _ = import_nccl()
    cupy.cuda.Device(comm.device).use()  # arrays made after init are on this rank's GPU
    return comm


__all__ = ["NcclCommunicator", "import_nccl", "nccl_init"]
