"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_``, for the wrappers.

The norm is the L2 norm of the averaged gradient of every trainable parameter of the whole
model, however the wrappers split it: ZeRO-2/3 ranks hold a shard of it, pipeline stages and
tensor shards parts of the model. Each rank sums the squares of the part only it holds (in
float64, deterministically), and one scalar all-gather per group of ranks that hold distinct
parts adds them up; the sum is exact (``math.fsum``), so every rank gets the same bits
whatever the order. A parameter every rank of a tensor group holds whole (a row-parallel
bias, a replicated layer) is counted by the group's rank 0 only.

Then, as torch: ``coef = max_norm / (total_norm + 1e-6)``, and the gradients are multiplied
by ``coef`` when it is below 1. A non-finite norm (NaN, inf) scales them by NaN (or 0) as
torch's default ``error_if_nonfinite=False`` does; ``error_if_nonfinite=True`` raises
``FloatingPointError`` instead, leaving them as they were.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .model import ModelParallelGroup, ParamSpec

if TYPE_CHECKING:
    from ..collectives import Communicator
    from .layout import FlatLayout

#: What torch adds to the norm before dividing (``clip_grad_norm_``).
EPS = 1e-6

#: Elements squared at a time (into a float64 scratch array: 512 KiB).
_CHUNK = 1 << 16


def check_max_norm(max_norm: Any) -> float:
    """``max_norm`` as a float; ``ValueError`` unless it is a number > 0 (``inf`` allowed:
    the norm without clipping)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float, np.floating,
                                                                np.integer)):
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    value = float(max_norm)
    if not value > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    return value


def _aligned_scratch(n: int) -> np.ndarray:
    """A float64 array of ``n`` elements starting on a 64-byte boundary: NumPy's summation
    then runs the same way on every rank, whatever address the allocator returned."""
    raw = np.empty(n + 8, np.float64)
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip:skip + n]


class SquareSum:
    """The sum of the squares of the elements of the arrays ``add`` is given, in float64.

    The result depends only on the values and on how they were cut into arrays (not on
    memory addresses), so ranks that hold the same gradient get the same bits."""

    def __init__(self) -> None:
        self._parts: list[float] = []
        self._scratch: np.ndarray | None = None
        self._imag: np.ndarray | None = None

    def add(self, array: np.ndarray) -> None:
        flat = array.reshape(-1)
        if flat.size == 0:
            return
        if self._scratch is None:
            self._scratch = _aligned_scratch(_CHUNK)
        for i in range(0, flat.size, _CHUNK):
            part = flat[i:i + _CHUNK]
            s = self._scratch[:part.size]
            if part.dtype.kind == "c":
                if self._imag is None:
                    self._imag = _aligned_scratch(_CHUNK)
                t = self._imag[:part.size]
                np.multiply(part.real, part.real, out=s, dtype=np.float64)
                np.multiply(part.imag, part.imag, out=t, dtype=np.float64)
                s += t
            else:
                np.multiply(part, part, out=s, dtype=np.float64)
            self._parts.append(float(s.sum()))

    @property
    def total(self) -> float:
        return math.fsum(self._parts)


def excluded_ranges(layout: FlatLayout, specs: Sequence[ParamSpec],
                    groups: Sequence[ModelParallelGroup]) -> list[tuple[int, int]]:
    """The flat ranges this rank leaves out of the norm: frozen parameters, and replicated
    ones of groups where it is not rank 0; sorted and merged."""
    ranges = list(layout.frozen_ranges(specs))
    for g in groups:
        if g.comm.rank != 0:
            ranges.extend(layout.offsets[n] for n in g.replicated if n in layout.offsets)
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def counted(start: int, stop: int, excluded: Sequence[tuple[int, int]]
            ) -> Iterator[tuple[int, int]]:
    """The parts of the flat range ``[start, stop)`` outside the ``excluded`` ranges
    (sorted, merged)."""
    pos = start
    for a, b in excluded:
        if b <= pos:
            continue
        if a >= stop:
            break
        if a > pos:
            yield pos, a
        pos = max(pos, b)
    if pos < stop:
        yield pos, stop


async def global_sum(partial: float, comms: Iterable[Communicator]) -> float:
    """``partial`` summed over every rank of each of ``comms`` in turn (one scalar
    all-gather per group of more than one rank), exactly: the same on every rank."""
    for comm in comms:
        if comm.world_size > 1:
            got = await comm.all_gather(np.array([partial], np.float64))
            partial = math.fsum(float(v) for v in got.reshape(-1))
    return partial


def clip_coefficient(max_norm: float, total_norm: float) -> float | None:
    """What to multiply the gradients by, or None when nothing changes (torch's
    ``clamp(max_norm / (total_norm + 1e-6), max=1)``; NaN or 0 for a non-finite norm)."""
    coef = max_norm / (total_norm + EPS)
    return None if coef >= 1.0 else coef


def nonfinite_error(total_norm: float) -> FloatingPointError:
    return FloatingPointError(
        f"the total norm of the gradients is {total_norm}, so they cannot be clipped; "
        f"nothing was changed (pass error_if_nonfinite=False to scale them by it anyway, "
        f"as torch's clip_grad_norm_ does)")


__all__ = ["EPS", "SquareSum", "check_max_norm", "clip_coefficient",
           "counted", "excluded_ranges", "global_sum", "nonfinite_error"]
