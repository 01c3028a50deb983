"""Scratch memory of collectives, kept between calls.

A pipelined ring all_reduce receives every partial sum into scratch memory before adding it:
(W-1)/W of the array per call, 32 MiB for a 64 MiB all_reduce over 2 ranks. Allocated afresh
on every call, memory of that size comes from ``mmap`` (glibc serves requests above its mmap
threshold, at most 32 MiB, that way) and goes back to the kernel when freed, so every call
page-faults it in again and the kernel zeroes each page first: ~10% of a 64 MiB all_reduce
over 2 ranks and ~17% over 4 ranks on two cores (``docs/performance.md``). A ``ScratchPool``
keeps the buffers of finished collectives for the next ones, as gloo keeps the buffers of
its algorithm instances and NCCL its own.

The TCP transport also reads large frames that arrive before their receive is posted into
buffers of the pool (a peer that runs ahead sends the first segments of the next call while
this rank finishes the last one: with 2 ranks, half of every 16 MiB all_reduce arrived that
way). Such a buffer returns to the pool once its payload was copied to where the receive
wanted it, or once a borrowing receive (the ring's reduce steps, which only read it) released
it; a payload handed out as a new array is simply not given back.

One pool per transport (per rank endpoint): collectives running at once, on one
communicator or on several sharing the transport, each take their own buffer. A buffer goes
back only after its collective succeeded; after a failure a receive may still hold a view
of it, and it is left to the garbage collector.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

#: bytes of free buffers a pool keeps at most (larger or further buffers are freed)
LIMIT_BYTES = 256 << 20
#: free buffers a pool keeps at most
LIMIT_BUFFERS = 64


class ScratchPool:
    """Free scratch buffers, best fit first; see the module doc.

    Only the exact arrays ``take`` returned go back (``give``, ``reclaim``): a pool never
    mistakes memory it did not lend (a caller's array, a slice of a buffer) for its own.
    """

    __slots__ = ("_free", "_lent", "limit")

    def __init__(self, limit: int = LIMIT_BYTES) -> None:
        #: bytes of free buffers kept at most
        self.limit = limit
        self._free: list[np.ndarray] = []  # uint8 buffers that own their memory
        # arrays handed out by take, by id; one that nobody gives back simply dies
        self._lent: weakref.WeakValueDictionary[int, np.ndarray] = (
            weakref.WeakValueDictionary())

    @property
    def kept(self) -> int:
        """Bytes of free buffers held now."""
        return sum(buf.nbytes for buf in self._free)

    def take(self, count: int, dtype: np.dtype[Any]) -> np.ndarray:
        """A 1-d array of ``count`` items of ``dtype`` (contents undefined), from a free
        buffer of at most twice the size if there is one; ``give`` it back once nothing
        refers to it any more (or let it go: it is freed as usual)."""
        nbytes = count * dtype.itemsize
        free = self._free
        best = -1
        for i, buf in enumerate(free):
            size = buf.nbytes
            if nbytes <= size <= 2 * nbytes and (best < 0 or size < free[best].nbytes):
                best = i
        owner = free.pop(best) if best >= 0 else np.empty(nbytes, np.uint8)
        arr = owner[:nbytes].view(dtype)
        self._lent[id(arr)] = arr
        return arr

    def give(self, arr: np.ndarray) -> None:
        """Take back an array ``take`` returned; its memory may be reused at once."""
        if self._lent.get(id(arr)) is not arr:
            raise ValueError("give() takes back only arrays that take() returned, once")
        del self._lent[id(arr)]
        owner = arr.base
        assert isinstance(owner, np.ndarray)
        if owner.nbytes > self.limit:
            return
        free = self._free
        free.append(owner)
        # over a limit: free the smallest buffers first (large ones save the most per call)
        free.sort(key=lambda buf: buf.nbytes, reverse=True)
        kept = self.kept
        while len(free) > LIMIT_BUFFERS or kept > self.limit:
            kept -= free.pop().nbytes

    def reclaim(self, payload: Any) -> bool:
        """``give`` back ``payload`` (an array or a memoryview of one) if it is an array
        ``take`` returned and did not get back yet; whether it was."""
        arr = payload.obj if isinstance(payload, memoryview) else payload
        if not isinstance(arr, np.ndarray) or self._lent.get(id(arr)) is not arr:
            return False
        self.give(arr)
        return True

    def clear(self) -> None:
        """Free every buffer kept."""
        self._free.clear()


__all__ = ["LIMIT_BUFFERS", "LIMIT_BYTES", "ScratchPool"]
