"""What the backends that hand collectives to a native library share (``.mpi``, ``.nccl``).

Both check a collective's signature by exchanging a digest of it, number their calls with
tickets, turn every failure of a collective into a ``CollectiveError`` that
breaks the communicator, and check arguments as ``Communicator`` does (whose
messages these are). Importing it imports neither MPI nor CUDA.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import msgpack

from ..errors import CollectiveError, CollectiveTimeout
from ..wire import MAX_NDIM
from .base import describe_sig, name_call

# ------------------------------------------------------------------------------ signatures


def digest(sig: tuple[Any, ...]) -> int:
    """A 64-bit digest of a collective's signature."""
    raw = hashlib.blake2b(msgpack.packb(sig, use_bin_type=True), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def signature_mismatch(rank: int, mine: str, other: int, theirs: str, where: str
                       ) -> CollectiveError:
    """The error of ranks that called different collectives (``mine`` and ``theirs`` are
    ``describe_sig`` texts; ``where``: ``Communicator._where`` of the call)."""
    return CollectiveError(f"ranks called different collectives: group rank {rank} called "
                           f"{mine}, group rank {other} called {theirs} ({where})")


# -------------------------------------------------------------------------------- failures


def no_progress(sig: tuple[Any, ...], rank: int, timeout: float, where: str
                ) -> CollectiveTimeout:
    """The error of a collective that timed out on group rank ``rank`` (``where``:
    ``Communicator._where`` of the call; which ranks it still waited for, the native
    library does not tell)."""
    return CollectiveTimeout(f"{describe_sig(sig)} on group rank {rank} made no progress "
                             f"within {timeout:g} s ({where})")


def failed_in(library: str, sig: tuple[Any, ...], rank: int, exc: BaseException
              ) -> CollectiveError:
    """The error of a collective whose native ``library`` call raised ``exc``."""
    return CollectiveError(f"{describe_sig(sig)} failed in {library} on group rank {rank}: "
                           f"{exc}")


class Failures:
    """Wraps the body of one collective: whatever escapes it breaks the communicator.

    On the way out, ``fail(err)`` is called with a ``CollectiveError``
    describing what happened, and the exception goes on: a cancellation unchanged, a
    ``CollectiveError`` as ``base.name_call`` names it (``where(seq)``: ``Communicator._where``),
    an exception of the native library (``library_error``) replaced by ``err`` (chained),
    any other exception unchanged.
    """

    def __init__(self, sig: tuple[Any, ...], rank: int, library: str,
                 library_error: type[BaseException], fail: Callable[[CollectiveError], None],
                 where: Callable[[int], str], seq: int) -> None:
        self.sig = sig
        self.rank = rank
        self.library = library
        self.library_error = library_error
        self.fail = fail
        self.where = where
        self.seq = seq

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, asyncio.CancelledError):
            self.fail(CollectiveError(f"{describe_sig(self.sig)} was cancelled on group rank "
                                      f"{self.rank}"))
        elif isinstance(exc, CollectiveError):
            self.fail(exc)
            named = name_call(exc, self.sig, self.rank, self.where(self.seq))
            if named is not exc:
                raise named from None
        elif isinstance(exc, self.library_error):
            err = failed_in(self.library, self.sig, self.rank, exc)
            self.fail(err)
            raise err from exc
        elif isinstance(exc, Exception):
            self.fail(CollectiveError(f"{describe_sig(self.sig)} failed on group rank "
                                      f"{self.rank}: {exc!r}"))


# ------------------------------------------------------------------------ arguments, blocks


def check_ndim(a: Any, what: str) -> Any:
    """``a``, if it has at most the dimensions the wire format supports."""
    if a.ndim > MAX_NDIM:
        raise ValueError(f"{what} has {a.ndim} dimensions; asynccoll supports {MAX_NDIM}")
    return a


def check_arrays(arrays: Sequence[Any] | None, world_size: int, what: str,
                 check: Callable[[Any, str], Any]) -> list[Any]:
    """The arrays of a scatter or all-to-all (``what``): one per rank, each as
    ``check(array, "arrays[j]")`` returns it. ``ValueError`` for another number of them."""
    if arrays is None or len(arrays) != world_size:
        raise ValueError(f"{what} needs a sequence of {world_size} arrays")
    return [check(x, f"arrays[{j}]") for j, x in enumerate(arrays)]


def check_axis(a: Any, what: str) -> None:
    """Raise ``ValueError`` if ``a`` has no axis 0 for collective ``what`` to split along."""
    if a.ndim == 0:
        raise ValueError(f"{what} needs an array with at least one dimension")


def check_gather_out(a: Any, out: Any) -> None:
    """Raise ``ValueError`` unless ``out`` (an all-gather's destination, already checked as
    an array) has ``a``'s dtype and trailing axes."""
    if out.dtype != a.dtype or out.shape[1:] != a.shape[1:]:
        raise ValueError(f"out must have dtype {a.dtype} and shape (rows, "
                         f"*{a.shape[1:]}), got {out.dtype} {out.shape}")


def gather_mismatch(rows: int, out: Any) -> CollectiveError:
    """The error of an all-gather of ``rows`` rows into an ``out`` of another length."""
    return CollectiveError(f"all_gather gathered {rows} rows but out has {out.shape[0]}")


def gather_alone(a: Any, out: Any) -> Any:
    """An all-gather over one rank: a copy of ``a``, or ``out`` filled with it."""
    if out is None:
        return a.copy()
    if out.shape[0] != a.shape[0]:
        raise gather_mismatch(a.shape[0], out)
    out[...] = a
    return out


def block_sizes(n: int, w: int) -> list[int]:
    """Sizes of ``numpy.array_split(range(n), w)``'s blocks."""
    q, rem = divmod(n, w)
    return [q + 1 if j < rem else q for j in range(w)]


def offsets(counts: Sequence[int]) -> list[int]:
    """Where consecutive blocks of ``counts`` start (MPI's displacements)."""
    out, pos = [], 0
    for c in counts:
        out.append(pos)
        pos += c
    return out


def scatter_blocks(a: Any, w: int) -> tuple[list[int], list[int]]:
    """A reduce-scatter's blocks of ``a`` over ``w`` ranks: ``numpy.array_split`` along axis
    0. Returns the rows and the elements of each rank's block."""
    rows = block_sizes(a.shape[0], w)
    row = a.size // a.shape[0] if a.shape[0] else 0
    return rows, [n * row for n in rows]


__all__ = ["Failures", "block_sizes", "check_arrays", "check_axis", "check_gather_out",
           "check_ndim", "digest", "failed_in", "gather_alone", "gather_mismatch",
           "no_progress", "offsets", "scatter_blocks", "signature_mismatch"]
