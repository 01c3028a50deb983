"""A CPU stand-in for the parts of CuPy and ``cupy.cuda.nccl`` that asynccoll uses.

NOT a GPU test bed: it lets tests/test_gpu_logic.py run the ``"nccl"`` backend's own logic
(reduction plans, pointer arithmetic, grouped send/recv, the TCP signature and header exchange,
the host staging) on a machine without CUDA. What it cannot show: real CUDA streams and events,
NCCL's own semantics and performance (see docs/backends/nccl.md).

* ``ndarray`` is a NumPy subclass whose class claims to live in ``cupy`` and has a
  ``__cuda_array_interface__`` (so :func:`asynccoll.gpu.is_device_array` accepts it), with
  ``.data.ptr`` (the real address of its memory), ``.get()``, ``.set()`` and ``.device``
  (the thread's current device when it was made, as ``cupy.cuda.Device`` sets it).
* Work "enqueued on a stream" runs at once; events are always done.
* ``NcclCommunicator`` ranks are threads of this process (each rank runs its own event loop in
  its own thread): a collective blocks its caller until every rank has called it, then the last
  one computes it through the raw pointers. ``send``/``recv`` inside a group post their sends
  first and then wait for the matching ones (per ordered pair of ranks, in call order).
"""

from __future__ import annotations

import ctypes
import secrets
import sys
import threading
import time
import types
from collections import deque
from typing import Any

import numpy as np

#: seconds a fake collective waits for the other ranks before raising NcclError
WAIT = 20.0

NCCL_TYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
              6: np.float16, 7: np.float32, 8: np.float64}
#: NCCL's MAX and MIN return the number where one operand is NaN (seen with NCCL 2.28 on an
#: H200), as np.fmax / np.fmin do
NCCL_UFUNCS = {0: np.add, 1: np.multiply, 2: np.fmax, 3: np.fmin}


class _Ptr:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


#: the current device of each thread (CuPy's is per thread too); arrays are made on it
_current = threading.local()


def _current_device() -> int:
    return int(getattr(_current, "id", 0))


class Device:
    def __init__(self, device: int | None = None) -> None:
        self.id = _current_device() if device is None else device
        self._outer: list[int] = []

    def __enter__(self) -> Device:
        self._outer.append(_current_device())
        _current.id = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _current.id = self._outer.pop()

    def use(self) -> None:
        _current.id = self.id


class ndarray(np.ndarray):  # the name CuPy uses
    """A NumPy array that passes for a CuPy one."""

    __module__ = "cupy"

    def __array_finalize__(self, obj: Any) -> None:
        # a view keeps its base's device; a new array is on the thread's current device
        self._device_id = getattr(obj, "_device_id", _current_device())

    @property  # type: ignore[override]
    def data(self) -> _Ptr:
        return _Ptr(int(self.__array_interface__["data"][0]))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.data.ptr, False)}

    @property
    def device(self) -> Device:
        return Device(self._device_id)

    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None,
            blocking: bool = True) -> np.ndarray:
        if out is None:
            return np.array(self, copy=True, subok=False)
        np.copyto(out, self.view(np.ndarray))
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        np.copyto(self.view(np.ndarray), arr)


def asarray(a: Any) -> ndarray:
    return np.array(a, copy=True, subok=False).view(ndarray)


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return np.empty(shape, dtype).view(ndarray)


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    return np.zeros(shape, dtype).view(ndarray)


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    return np.full(shape, fill_value, dtype).view(ndarray)


def empty_like(a: Any) -> ndarray:
    return np.empty_like(np.asarray(a)).view(ndarray)


class Stream:
    #: seconds ``synchronize`` waits for events that never end (a kernel waiting for a peer
    #: that never calls: real CUDA waits forever) before it raises instead
    sync_limit = 5.0

    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = id(self)
        self._events: list[Event] = []

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait_event(self, event: Event) -> None:
        return None

    def synchronize(self) -> None:
        """Block until every event recorded on this stream is done (as CUDA blocks until the
        stream's work ended)."""
        deadline = time.monotonic() + Stream.sync_limit
        while not all(e.done for e in self._events):
            if time.monotonic() > deadline:
                raise RuntimeError("fake CUDA: synchronize on work that never ends")
            time.sleep(0.01)

    def launch_host_func(self, callback: Any, arg: Any) -> None:
        Stream.host_funcs += 1
        callback(arg)  # the fake's work is done as it is enqueued

    #: host functions launched (on any fake stream)
    host_funcs = 0


class Event:
    #: queries of ``done`` that answer False before it tells the truth (a test sets it to
    #: make waits outlast their spin, like long GPU work)
    lag = 0

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self._done = False
        self._lag = Event.lag

    @property
    def done(self) -> bool:
        if self._lag > 0:
            self._lag -= 1
            return False
        return self._done

    def record(self, stream: Any = None) -> None:
        self._done = True  # the fake runs everything as it is enqueued
        if isinstance(stream, Stream):
            stream._events.append(self)


def get_current_stream() -> Stream:
    return Stream()


# ------------------------------------------------------------------------------ fake NCCL

class NcclError(RuntimeError):
    pass


def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
    dt = np.dtype(NCCL_TYPES[datatype])
    if count == 0:
        return np.empty(0, dt)
    raw = (ctypes.c_uint8 * (count * dt.itemsize)).from_address(ptr)
    return np.ctypeslib.as_array(raw).view(dt)


class _World:
    """What the ranks of one fake NCCL communicator share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.joined = 0
        self.calls: dict[int, dict[int, Any]] = {}
        self.done: set[int] = set()
        self.pipes: dict[tuple[int, int], deque[np.ndarray]] = {}
        self.aborted = False


class _Registry:
    """Worlds by unique id (guarded by one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worlds: dict[Any, _World] = {}


class _Groups(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.calls: list[tuple[Any, str, tuple[Any, ...]]] = []


def make_nccl() -> types.ModuleType:
    """A fresh ``cupy.cuda.nccl`` stand-in (its own registry of worlds)."""
    mod = types.ModuleType("cupy.cuda.nccl")
    registry = _Registry()
    groups = _Groups()
    names = ["NCCL_INT8", "NCCL_UINT8", "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64",
             "NCCL_UINT64", "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64"]
    for code, name in enumerate(names):
        setattr(mod, name, code)
    mod.NCCL_SUM, mod.NCCL_PROD, mod.NCCL_MAX, mod.NCCL_MIN = 0, 1, 2, 3
    mod.available = True
    mod.NcclError = NcclError
    mod.get_version = lambda: 21805
    mod.get_unique_id = lambda: tuple(b - 128 for b in secrets.token_bytes(128))

    def group_start() -> None:
        groups.depth += 1

    def group_end() -> None:
        groups.depth -= 1
        if groups.depth == 0 and groups.calls:
            calls, groups.calls = groups.calls, []
            comm = calls[0][0]
            if any(kind in ("send", "recv") for _, kind, _ in calls):
                comm._p2p(calls)
            else:
                comm._collective("group", tuple((kind, args) for _, kind, args in calls))

    mod.groupStart = group_start
    mod.groupEnd = group_end

    class NcclCommunicator:
        def __init__(self, ndev: int, commId: Any, rank: int) -> None:
            with registry.lock:
                world = registry.worlds.setdefault(tuple(commId), _World(ndev))
            self._world, self._rank, self._calls = world, rank, 0
            with world.cond:
                world.joined += 1
                world.cond.notify_all()
                if not world.cond.wait_for(lambda: world.joined >= world.size, WAIT):
                    raise NcclError("fake ncclCommInitRank: not every rank joined")

        # -- plumbing --------------------------------------------------------------------

        def _enqueue(self, kind: str, args: tuple[Any, ...]) -> None:
            if groups.depth:
                groups.calls.append((self, kind, args))
            else:
                self._collective(kind, args)

        def _collective(self, kind: str, args: Any) -> None:
            world = self._world
            k = self._calls
            self._calls += 1
            with world.cond:
                if world.aborted:
                    raise NcclError("fake NCCL: communicator aborted")
                slot = world.calls.setdefault(k, {})
                slot[self._rank] = (kind, args)
                if len(slot) == world.size:
                    _execute(world, slot)
                    world.done.add(k)
                    world.cond.notify_all()
                elif not world.cond.wait_for(lambda: k in world.done or world.aborted, WAIT):
                    raise NcclError(f"fake NCCL: not every rank called {kind} #{k}")
                if world.aborted and k not in world.done:
                    raise NcclError("fake NCCL: communicator aborted")

        def _p2p(self, calls: list[tuple[Any, str, tuple[Any, ...]]]) -> None:
            world = self._world
            with world.cond:
                for _, kind, (ptr, count, datatype, peer, _stream) in calls:
                    if kind == "send":
                        data = _view(ptr, count, datatype).copy()
                        world.pipes.setdefault((self._rank, peer), deque()).append(data)
                world.cond.notify_all()
                for _, kind, (ptr, count, datatype, peer, _stream) in calls:
                    if kind != "recv":
                        continue
                    pipe = world.pipes.setdefault((peer, self._rank), deque())
                    if not world.cond.wait_for(lambda p=pipe: bool(p), WAIT):
                        raise NcclError(f"fake NCCL: rank {peer} never sent to {self._rank}")
                    data = pipe.popleft()
                    dst = _view(ptr, count, datatype)
                    if data.nbytes != dst.nbytes:
                        raise NcclError(f"fake NCCL: {data.nbytes} bytes sent, {dst.nbytes} "
                                        f"expected")
                    dst[...] = data.view(dst.dtype)

        # -- the API asynccoll calls -----------------------------------------------------

        def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                      op: int, stream: int) -> None:
            self._enqueue("allReduce", (sendbuf, recvbuf, count, datatype, op))

        def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                   root: int, stream: int) -> None:
            self._enqueue("reduce", (sendbuf, recvbuf, count, datatype, op, root))

        def broadcast(self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int,
                      stream: int) -> None:
            self._enqueue("broadcast", (sendbuf, recvbuf, count, datatype, root))

        def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int,
                          datatype: int, op: int, stream: int) -> None:
            self._enqueue("reduceScatter", (sendbuf, recvbuf, recvcount, datatype, op))

        def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                      stream: int) -> None:
            self._enqueue("allGather", (sendbuf, recvbuf, count, datatype))

        def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
            if not groups.depth:
                raise NcclError("fake NCCL: asynccoll always groups send/recv")
            groups.calls.append((self, "send", (sendbuf, count, datatype, peer, stream)))

        def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
            if not groups.depth:
                raise NcclError("fake NCCL: asynccoll always groups send/recv")
            groups.calls.append((self, "recv", (recvbuf, count, datatype, peer, stream)))

        def check_async_error(self) -> None:
            return None

        def abort(self) -> None:
            with self._world.cond:
                self._world.aborted = True
                self._world.cond.notify_all()

        def destroy(self) -> None:
            return None

        def rank_id(self) -> int:
            return self._rank

        def size(self) -> int:
            return self._world.size

        def device_id(self) -> int:
            return 0

    mod.NcclCommunicator = NcclCommunicator
    return mod


def _execute(world: _World, slot: dict[int, Any]) -> None:
    """Compute one collective every rank called (reads everything before writing)."""
    kinds = {slot[r][0] for r in slot}
    if len(kinds) != 1:
        raise NcclError(f"fake NCCL: ranks called different collectives {kinds}")
    kind = kinds.pop()
    if kind == "group":
        for i in range(len(slot[0][1])):
            _execute(world, {r: slot[r][1][i] for r in slot})
        return
    n = world.size
    args = [slot[r][1] for r in range(n)]
    if kind in ("allReduce", "reduce"):
        count, datatype, op = args[0][2], args[0][3], args[0][4]
        sends = [_view(a[0], count, datatype).copy() for a in args]
        total = sends[0].copy()
        for x in sends[1:]:
            NCCL_UFUNCS[op](total, x, out=total)
        targets = range(n) if kind == "allReduce" else [args[0][5]]
        for r in targets:
            _view(args[r][1], count, datatype)[...] = total
    elif kind == "broadcast":
        count, datatype, root = args[0][2], args[0][3], args[0][4]
        data = _view(args[root][0], count, datatype).copy()
        for r in range(n):
            _view(args[r][1], count, datatype)[...] = data
    elif kind == "reduceScatter":
        rc, datatype, op = args[0][2], args[0][3], args[0][4]
        sends = [_view(a[0], rc * n, datatype).copy() for a in args]
        total = sends[0].copy()
        for x in sends[1:]:
            NCCL_UFUNCS[op](total, x, out=total)
        for r in range(n):
            _view(args[r][1], rc, datatype)[...] = total[r * rc:(r + 1) * rc]
    elif kind == "allGather":
        count, datatype = args[0][2], args[0][3]
        every = np.concatenate([_view(a[0], count, datatype) for a in args])
        for r in range(n):
            _view(args[r][1], count * n, datatype)[...] = every
    else:
        raise NcclError(f"fake NCCL: unknown call {kind}")


def modules() -> dict[str, types.ModuleType]:
    """Fresh ``cupy``, ``cupy.cuda``, ``cupy.cuda.nccl``, ``cupy.cuda.runtime`` and ``cupyx``
    modules, to put into ``sys.modules`` (``monkeypatch.setitem``)."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")
    nccl = make_nccl()
    cupyx = types.ModuleType("cupyx")
    runtime.getDeviceCount = lambda: 1
    for name, value in (("Device", Device), ("Stream", Stream), ("Event", Event),
                        ("get_current_stream", get_current_stream), ("runtime", runtime),
                        ("nccl", nccl)):
        setattr(cuda, name, value)
    cupy.__version__ = "0.0-fake"
    cupy.cuda = cuda
    cupy.ndarray = ndarray
    cupy.asarray = asarray
    cupy.empty = empty
    cupy.zeros = zeros
    cupy.full = full
    cupy.empty_like = empty_like
    cupy.nan = np.nan
    cupy.isnan = lambda a: np.isnan(a).view(ndarray)
    for name in ("copyto", "add", "multiply", "minimum", "maximum", "bitwise_and",
                 "bitwise_or", "bitwise_xor", "divide"):
        setattr(cupy, name, getattr(np, name))
    cupyx.empty_pinned = lambda shape, dtype=float: np.empty(shape, dtype)
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl,
            "cupy.cuda.runtime": runtime, "cupyx": cupyx}


def install(monkeypatch: Any) -> dict[str, types.ModuleType]:
    """Put the fake modules into ``sys.modules`` for one test."""
    mods = modules()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods
