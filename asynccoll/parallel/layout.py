"""Where every parameter lives in the wrappers' flat buffers, and which rank owns what.

A model's parameters (one dtype) are laid end to end in one flat array, in the order of
``param_specs`` (units ascending). Consecutive units are
grouped into *buckets*, the unit of communication: DDP all-reduces a bucket's gradients once
its last gradient is final; ZeRO reduce-scatters them, and ZeRO-3 all-gathers a bucket's
parameters just before it runs. Buckets are filled from the last unit backwards (the order the
backward pass produces gradients in) until they hold ``bucket_bytes``.

Sharding splits *every bucket* the way ``numpy.array_split`` splits it over the ranks, so a
reduce-scatter of a bucket hands each rank exactly its block, and an all-gather of the blocks
rebuilds the bucket. A rank's shard is its blocks of all buckets, stored end to end; when sizes
do not divide, the first ranks hold one element more per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .model import ParamSpec


def split_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` of each part of ``numpy.array_split(range(length), parts)``."""
    q, rem = divmod(length, parts)
    out = []
    start = 0
    for i in range(parts):
        stop = start + q + (1 if i < rem else 0)
        out.append((start, stop))
        start = stop
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """Units ``first_unit..last_unit`` (inclusive), flat range ``[start, stop)``."""

    index: int
    first_unit: int
    last_unit: int
    start: int
    stop: int
    #: per rank, the ``(start, stop)`` of its block, relative to the bucket
    blocks: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


class FlatLayout:
    """Offsets of every parameter, the buckets, and every rank's shard of them."""

    def __init__(self, specs: Sequence[ParamSpec], world_size: int, bucket_bytes: int) -> None:
        if not specs:
            raise ValueError("the model has no parameters")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
        dtypes = {s.dtype for s in specs}
        if len(dtypes) != 1:
            raise TypeError("the data-parallel wrappers need every parameter in one dtype, got "
                            + ", ".join(sorted(str(d) for d in dtypes)))
        self.dtype: np.dtype[Any] = next(iter(dtypes))
        if self.dtype.kind not in "fc":
            raise TypeError(f"parameters must be floating point, got {self.dtype}")
        self.specs = list(specs)
        self.world_size = world_size
        self.offsets: dict[str, tuple[int, int]] = {}
        num_units = max(s.unit for s in specs) + 1
        unit_start = [-1] * num_units
        unit_stop = [-1] * num_units
        pos = 0
        last_unit = -1
        for s in self.specs:
            if s.name in self.offsets:
                raise ValueError(f"duplicate parameter name {s.name!r}")
            if s.unit < last_unit:
                raise ValueError("param_specs must list units in ascending order")
            last_unit = s.unit
            self.offsets[s.name] = (pos, pos + s.size)
            if unit_start[s.unit] < 0:
                unit_start[s.unit] = pos
            pos += s.size
            unit_stop[s.unit] = pos
        missing = [u for u in range(num_units) if unit_start[u] < 0]
        if missing:
            raise ValueError(f"units {missing} have no parameters")
        self.size = pos
        self.num_units = num_units
        self.unit_ranges = list(zip(unit_start, unit_stop, strict=True))

        # buckets, filled from the last unit backwards
        groups: list[list[int]] = []
        current: list[int] = []
        nbytes = 0
        for u in reversed(range(num_units)):
            current.append(u)
            nbytes += (unit_stop[u] - unit_start[u]) * self.dtype.itemsize
            if nbytes >= bucket_bytes:
                groups.append(current)
                current, nbytes = [], 0
        if current:
            groups.append(current)
        groups.reverse()
        self.buckets: list[Bucket] = []
        self.unit_bucket = [0] * num_units
        for i, g in enumerate(groups):
            first, last = min(g), max(g)
            start, stop = unit_start[first], unit_stop[last]
            self.buckets.append(Bucket(index=i, first_unit=first, last_unit=last, start=start,
                                       stop=stop,
                                       blocks=tuple(split_bounds(stop - start, world_size))))
            for u in g:
                self.unit_bucket[u] = i

        # every rank's shard: its block of each bucket, end to end
        self.shard_offsets: list[list[int]] = []
        self.shard_sizes: list[int] = []
        for r in range(world_size):
            offs, pos = [], 0
            for b in self.buckets:
                offs.append(pos)
                pos += b.blocks[r][1] - b.blocks[r][0]
            self.shard_offsets.append(offs)
            self.shard_sizes.append(pos)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def views(self, flat: np.ndarray, start: int = 0) -> dict[str, np.ndarray]:
        """Per-parameter views of ``flat``, which holds the flat range starting at ``start``
        (only the parameters entirely inside it)."""
        out = {}
        for s in self.specs:
            a, b = self.offsets[s.name]
            if a >= start and b <= start + flat.size:
                out[s.name] = flat[a - start:b - start].reshape(s.shape)
        return out

    def unit_names(self, units: range) -> list[str]:
        return [s.name for s in self.specs if s.unit in units]

    def bucket_units(self, b: Bucket) -> range:
        return range(b.first_unit, b.last_unit + 1)

    def shard_block(self, shard: np.ndarray, rank: int, bucket: Bucket) -> np.ndarray:
        """The view of ``rank``'s shard array that holds its block of ``bucket``."""
        a = self.shard_offsets[rank][bucket.index]
        lo, hi = bucket.blocks[rank]
        return shard[a:a + hi - lo]

    def global_ranges(self, rank: int) -> list[tuple[int, int]]:
        """The flat ``(start, stop)`` ranges that ``rank``'s shard holds, in shard order."""
        return [(b.start + b.blocks[rank][0], b.start + b.blocks[rank][1]) for b in self.buckets]

    def shard_of(self, flat: np.ndarray, rank: int) -> np.ndarray:
        """``rank``'s shard cut out of a full flat array (a copy)."""
        return np.concatenate([flat[a:b] for a, b in self.global_ranges(rank)])

    def frozen_ranges(self, specs: Sequence[ParamSpec]) -> list[tuple[int, int]]:
        """The flat ``(start, stop)`` ranges of the parameters of ``specs`` (the model's
        current ones: ``trainable`` may change) that are frozen, adjacent ones merged."""
        out: list[tuple[int, int]] = []
        for spec in specs:
            if not spec.trainable:
                first, stop = self.offsets[spec.name]
                if out and out[-1][1] == first:
                    first = out.pop()[0]
                out.append((first, stop))
        return out

    def describe(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly description (what a checkpoint records)."""
        return {
            "dtype": self.dtype.str,
            "size": self.size,
            "world_size": self.world_size,
            "params": [{"name": s.name, "shape": list(s.shape), "unit": s.unit,
                        "range": list(self.offsets[s.name])} for s in self.specs],
            "shards": [[list(r) for r in self.global_ranges(k)] for k in range(self.world_size)],
        }
