"""CuPy arrays on any backend: device-array helpers and staging through pinned host memory.

The ``"nccl"`` backend (``asynccoll.transport.nccl``) moves CuPy arrays GPU to GPU. The
other backends move NumPy arrays; ``HostStaged`` lets them take CuPy arrays too, by
copying each one into pinned (page-locked) host memory, running the collective on that, and
copying the result back to the GPU:

    comm = await asynccoll.init(backend="tcp", gpu_staging=True)    # or run_local(...)
    await comm.all_reduce(cupy_array)        # in place on the GPU, through host memory

CuPy is imported only when a CuPy array is actually seen (``import asynccoll`` never imports
it); without it, the error names the extra to install.

Nothing here has run on a GPU in this repository's CI: see ``docs/backends/nccl.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .collectives import Communicator
from .ops import ReduceOp
from .tuning import Tuning

GPU_REQUIRED = "CuPy with a CUDA GPU is required"
_INSTALL_HINT = f'{GPU_REQUIRED}: pip install "asynccoll[gpu]" (the cupy-cuda12x wheel)'


def import_cupy() -> Any:
    """The ``cupy`` module, or an ImportError naming the extra to install."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return cupy


def is_device_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked without importing CuPy)."""
    cls = type(x)
    return (getattr(cls, "__module__", "").partition(".")[0] == "cupy"
            and hasattr(cls, "__cuda_array_interface__"))


def check_device_array(x: Any, what: str = "array") -> Any:
    """``x`` if it is a C-contiguous CuPy array of a supported dtype, else TypeError."""
    from .wire import dtype_code

    if not is_device_array(x):
        raise TypeError(f"{what} must be a cupy.ndarray, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise TypeError(f"{what} must be C-contiguous (use cupy.ascontiguousarray)")
    dtype_code(x.dtype)  # TypeError for unsupported dtypes
    if not x.dtype.isnative:
        raise TypeError(f"{what} has non-native byte order ({x.dtype.str})")
    return x


def to_host(x: Any, what: str = "array") -> np.ndarray:
    """A copy of CuPy array ``x`` in pinned host memory (waits for the copy)."""
    check_device_array(x, what)
    import_cupy()
    import cupyx

    host = cupyx.empty_pinned(x.shape, dtype=x.dtype)
    x.get(out=host)  # blocking: ``host`` holds the data on return
    return np.asarray(host)


def to_device(host: np.ndarray, like: Any = None) -> Any:
    """``host`` copied to the GPU (``like``'s device when given, else the current one)."""
    cupy = import_cupy()
    with like.device if like is not None else contextlib.nullcontext():
        return cupy.asarray(host)


class DelegatingCommunicator(Communicator):
    """A ``Communicator`` that forwards to another one (``inner``) every call
    it does not override. Subclasses change how some arrays travel; rank, size, timeout and
    lifetime are the inner communicator's."""

    def __init__(self, inner: Communicator, *, backend: str | None = None) -> None:
        # Not Communicator.__init__: this object owns no transport, ``inner`` does.
        self._inner = inner
        self._closed = False
        self.backend = backend if backend is not None else inner.backend

    # -- what the inner communicator knows ----------------------------------------------

    @property
    def inner(self) -> Communicator:
        """The communicator calls are forwarded to."""
        return self._inner

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    @property
    def transport(self) -> Any:
        return self._inner.transport

    @property  # type: ignore[override]
    def timeout(self) -> float:
        return self._inner.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._inner.timeout = value  # (checked there, as on every backend)

    @property  # type: ignore[override]
    def tuning(self) -> Tuning:
        return self._inner.tuning

    @tuning.setter
    def tuning(self, value: Tuning) -> None:
        self._inner.tuning = value

    @property
    def effective_tuning(self) -> Tuning:
        return self._inner.effective_tuning

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend} rank {self.rank}/{self.world_size}>"

    def _wrap(self, inner: Communicator) -> DelegatingCommunicator:
        """The communicator ``new_group`` returns around the inner one's subgroup."""
        return type(self)(inner, backend=self.backend)

    # -- forwarded ----------------------------------------------------------------------

    async def broadcast(self, array: Any, root: int = 0) -> Any:
        return await self._inner.broadcast(array, root)

    async def reduce(self, array: Any, root: int = 0, op: ReduceOp = ReduceOp.SUM) -> Any:
        return await self._inner.reduce(array, root, op)

    async def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        return await self._inner.all_reduce(array, op)

    async def reduce_scatter(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        return await self._inner.reduce_scatter(array, op)

    async def all_gather(self, array: Any, *, out: Any = None) -> Any:
        return await self._inner.all_gather(array, out=out)

    async def gather(self, array: Any, root: int = 0) -> Any:
        return await self._inner.gather(array, root)

    async def scatter(self, arrays: Sequence[Any] | None, root: int = 0) -> Any:
        return await self._inner.scatter(arrays, root)

    async def all_to_all(self, arrays: Sequence[Any]) -> list[Any]:
        return await self._inner.all_to_all(arrays)

    async def barrier(self) -> None:
        await self._inner.barrier()

    async def send(self, array: Any, dst: int, tag: int = 0) -> None:
        await self._inner.send(array, dst, tag)

    async def recv(self, src: int, tag: int = 0) -> Any:
        return await self._inner.recv(src, tag)

    async def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        return await self._inner.broadcast_object(obj, root)

    async def all_gather_object(self, obj: Any) -> list[Any]:
        return await self._inner.all_gather_object(obj)

    async def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        sub = await self._inner.new_group(ranks)
        return None if sub is None else self._wrap(sub)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._inner.close()


class HostStaged(DelegatingCommunicator):
    """Lets a NumPy backend (``"tcp"``, ``"memory"``) take CuPy arrays: each is copied to
    pinned host memory, the inner communicator runs the collective, and results go back to
    the GPU (in place where the API says so, else as new CuPy arrays).

    NumPy arrays pass straight through. ``scatter`` (on non-roots) and ``recv`` return NumPy
    arrays: nothing tells the receiver where the sender's data lived.
    """

    async def broadcast(self, array: Any, root: int = 0) -> Any:
        if not is_device_array(array):
            return await self._inner.broadcast(array, root)
        host = to_host(array)
        await self._inner.broadcast(host, root)
        array.set(host)
        return array

    async def reduce(self, array: Any, root: int = 0, op: ReduceOp = ReduceOp.SUM) -> Any:
        if not is_device_array(array):
            return await self._inner.reduce(array, root, op)
        host = to_host(array)
        if await self._inner.reduce(host, root, op) is None:
            return None
        array.set(host)
        return array

    async def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        if not is_device_array(array):
            return await self._inner.all_reduce(array, op)
        host = to_host(array)
        await self._inner.all_reduce(host, op)
        array.set(host)
        return array

    async def reduce_scatter(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> Any:
        if not is_device_array(array):
            return await self._inner.reduce_scatter(array, op)
        return to_device(await self._inner.reduce_scatter(to_host(array), op), array)

    async def all_gather(self, array: Any, *, out: Any = None) -> Any:
        if not is_device_array(array):
            return await self._inner.all_gather(array, out=out)
        if out is not None:  # checked before anything is sent, as the inner one checks
            check_device_array(out, "out")
            if out.dtype != array.dtype or out.shape[1:] != array.shape[1:]:
                raise ValueError(f"out must have dtype {array.dtype} and shape (rows, "
                                 f"*{array.shape[1:]}), got {out.dtype} {out.shape}")
        got = await self._inner.all_gather(to_host(array))
        if out is None:
            return to_device(got, array)
        if out.shape != got.shape or out.dtype != got.dtype:
            raise ValueError(f"out must be {got.dtype} {got.shape}, got {out.dtype} {out.shape}")
        out.set(got)
        return out

    async def gather(self, array: Any, root: int = 0) -> Any:
        if not is_device_array(array):
            return await self._inner.gather(array, root)
        got = await self._inner.gather(to_host(array), root)
        return None if got is None else [to_device(x, array) for x in got]

    async def scatter(self, arrays: Sequence[Any] | None, root: int = 0) -> Any:
        if (arrays is None or self.rank != root  # ignored off root (API.md)
                or not any(is_device_array(x) for x in arrays)):
            return await self._inner.scatter(arrays, root)
        device = next(x for x in arrays if is_device_array(x))
        host = [to_host(x, f"arrays[{j}]") if is_device_array(x) else x
                for j, x in enumerate(arrays)]
        got = await self._inner.scatter(host, root)
        return to_device(got, device)

    async def all_to_all(self, arrays: Sequence[Any]) -> list[Any]:
        if arrays is None or not any(is_device_array(x) for x in arrays):
            return await self._inner.all_to_all(arrays)
        device = next(x for x in arrays if is_device_array(x))
        host = [to_host(x, f"arrays[{j}]") if is_device_array(x) else x
                for j, x in enumerate(arrays)]
        return [to_device(x, device) for x in await self._inner.all_to_all(host)]

    async def send(self, array: Any, dst: int, tag: int = 0) -> None:
        await self._inner.send(to_host(array) if is_device_array(array) else array, dst, tag)


__all__ = [
    "GPU_REQUIRED",
    "DelegatingCommunicator",
    "HostStaged",
    "check_device_array",
    "import_cupy",
    "is_device_array",
    "to_device",
    "to_host",
]
