"""Gradient compression: a pluggable hook on the data-parallel gradient exchange.

A data-parallel wrapper hands each gradient bucket (a flat float32 or float64 array) to
``await hook.all_reduce_mean(comm, grad, key)``; the hook replaces ``grad``, in place, by the
mean over the group of every rank's compressed-then-decompressed bucket. Every rank ends with
bit-identical values: either the reduction is a collective that guarantees it
(``all_reduce``), or every rank gathers every rank's compressed payload and decodes and sums
them itself, in rank order, with the same NumPy operations.

Error feedback (``error_feedback=True``): what compression dropped from a bucket, ``(grad +
residual) - decompressed``, is kept per ``key`` and added to the next gradient of that bucket,
so that nothing is lost for good, only delayed. With plain SGD it is what makes aggressive
sparsification converge (with momentum it may not help: see docs/training.md);
``Compression.state_dict`` / ``Compression.load_state_dict`` carry it through
checkpoints. Non-finite values (an overflowed step under loss scaling) propagate to the result
as they would uncompressed, and are never stored in a residual.

What a rank puts on the wire per element of a bucket of ``n`` elements, with ``W`` ranks
(``itemsize`` 4 for float32; all_reduce rows assume the ring that large arrays use, or the
direct all_reduce, which sends as many bytes in all, while arrays of at most the
communicator's ``effective_tuning.small_bytes`` go by recursive doubling, about ``log2 W``
copies; ``hook.bytes_sent`` adds up the payload bytes of the algorithm that ran, matching
``comm.transport.bytes_sent``):

============================  ============================  ====================  ==============
method                        collective                    bytes / element       W=2, float32
============================  ============================  ====================  ==============
``NoCompression`` ("none")    all_reduce(AVG), grad dtype   itemsize * 2(W-1)/W   4
``Cast("float16")`` ("fp16")  all_reduce(SUM), float16      2 * 2(W-1)/W          2
``Cast("bfloat16")`` ("bf16") all_gather, uint16            2 * (W-1)             2
``TopK(ratio)`` ("topk")      all_gather values + indices   ratio*(itemsize+4)    0.08 (1%)
                                                            * (W-1)
``Int8(block=1024)`` ("int8") all_gather int8 + f32 scales  (1 + 4/block)*(W-1)   1.004
``PowerSGD(rank)``            all_reduce P (m x r), Q       4r(m+c)/n * log2 W    ~8r/sqrt(n)
("powersgd")                  (c x r), float32 (small)
============================  ============================  ====================  ==============

(Indices are int32 while the bucket has fewer than 2**31 elements, else int64. Gather-based
methods send ``W-1`` times their payload, so their advantage over a ring all_reduce shrinks
as the group grows: Int8 sends ``W/8`` of what an uncompressed float32 all_reduce sends.)
"""

from __future__ import annotations

import abc
import asyncio
import math
import weakref
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from ..algorithms import power_of_two_fold
from ..collectives import Communicator
from ..errors import CollectiveError
from ..ops import ReduceOp
from ._failure import first_error

#: The ``make_compression`` spellings, for error messages.
ACCEPTED_SPECS = ("none", "fp16", "bf16", "topk", "topk:RATIO", "int8", "int8:BLOCK",
                  "powersgd", "powersgd:RANK")

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# ----------------------------------------------------------------------------- wire bytes

def _all_reduce_wire_bytes(comm: Communicator, n: int, itemsize: int) -> int:
    """Payload bytes this rank sends in ``comm.all_reduce`` of ``n`` elements.

    The algorithm is the one ``Communicator.all_reduce`` picks: from the tuning it runs
    (``effective_tuning``: with a small ``max_payload``, larger arrays than the tuning as set
    says take the ring), with the same arguments (whether the transport lends payloads).
    Ring (large arrays): the reduce-scatter half forwards every block but this rank's own,
    the all-gather half every block but the right neighbour's. Direct (large arrays where
    the transport lends, or ``Tuning.direct_all_reduce="always"``): every block but its own
    to the rank that owns it, then its own reduced block to every other rank. Recursive
    doubling (small arrays): one full array per round, plus the fold-in/fold-out of
    non-power-of-two sizes.
    """
    w, r = comm.world_size, comm.rank
    if w == 1:
        return 0
    nbytes = n * itemsize
    # (MPI's world has no ``lends``: its all_reduce is MPI's, and counted as handed over)
    lends = bool(getattr(comm.transport, "lends", False))
    algo = comm.effective_tuning.all_reduce(nbytes, w, lends=lends)
    if algo == "recursive_doubling":
        p, folded, rounds = power_of_two_fold(w)
        if r >= p:
            return nbytes
        return nbytes * (rounds + (1 if r < folded else 0))
    base, longer = divmod(n, w)  # blocks as numpy.array_split cuts them
    sizes = [base + (1 if j < longer else 0) for j in range(w)]
    if algo == "direct":
        return (n - sizes[r] + (w - 1) * sizes[r]) * itemsize
    return (2 * n - sizes[r] - sizes[(r + 1) % w]) * itemsize


def _all_gather_wire_bytes(comm: Communicator, nbytes: int) -> int:
    """Payload bytes this rank sends in an ``all_gather`` where every rank passes ``nbytes``
    (ring: W-1 forwards; direct: W-1 copies of its own block)."""
    return (comm.world_size - 1) * nbytes


async def _gather_pair(comm: Communicator, a: np.ndarray, b: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Two all_gathers in flight at once (a failure in one cancels the other).

    Raises the error of the first one that failed, as one all_gather would (a
    ``CollectiveError``...), never the ``ExceptionGroup`` of both: when a rank fails, both
    gathers usually fail on the others."""
    try:
        async with asyncio.TaskGroup() as tg:
            ta = tg.create_task(comm.all_gather(a))
            tb = tg.create_task(comm.all_gather(b))
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return ta.result(), tb.result()


def _split_gathered(got: np.ndarray, world_size: int, each: int, what: str) -> np.ndarray:
    """``got`` (an all_gather result) as ``(world_size, each)``; CollectiveError when the ranks
    passed buckets of different sizes."""
    if got.size != world_size * each:
        raise CollectiveError(f"{what}: ranks passed buckets of different sizes (gathered "
                              f"{got.size} elements, expected {world_size} x {each})")
    return got.reshape(world_size, each)


def _check_fraction(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise TypeError(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{what} must be in (0, 1], got {value}")
    return value


def _check_positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return int(value)


def _check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} must be a bool, got {value!r}")
    return bool(value)


# ------------------------------------------------------------------------------- the hook

class Compression(abc.ABC):
    """A gradient-exchange hook: compress, exchange, decompress, average.

    Attributes:
        name: the ``make_compression`` spelling of this method.
        bytes_sent: payload bytes this hook's collectives have made this rank send (what the
            transport counts for them), cumulative; the module docstring has the formula per
            method.
    """

    name: str = "abstract"
    #: the gradient dtypes the method takes
    dtypes: tuple[np.dtype[Any], ...] = _FLOAT_DTYPES

    def __init__(self, *, error_feedback: bool = False) -> None:
        self.error_feedback = _check_bool(error_feedback, "error_feedback")
        self.bytes_sent = 0
        self._layouts: dict[Hashable, tuple[int, np.dtype[Any]]] = {}
        self._residuals: dict[Hashable, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, error_feedback={self.error_feedback})"

    async def all_reduce_mean(self, comm: Communicator, grad: np.ndarray, key: Hashable
                              ) -> None:
        """Replace ``grad``, in place, by the mean over ``comm``'s ranks of each rank's
        compressed-then-decompressed ``grad`` (plus its residual, with error feedback).

        Every rank of ``comm`` calls it with a bucket of the same size and dtype; every rank
        ends with bit-identical values.

        Args:
            grad: 1-D, C-contiguous, writable float32 or float64 array (``NoCompression``
                also takes float16).
            key: names the bucket: error-feedback state is kept per key, and a key must
                always come with the same size and dtype.

        Raises:
            TypeError: ``grad`` is not a 1-D contiguous writable array of a dtype in
                ``dtypes``.
            ValueError: ``key`` was used before with another size or dtype.
            CollectiveError: ranks passed buckets of different sizes; a peer was lost or no
                progress was made. ``grad`` then holds undefined values, and this bucket's
                residual is unchanged.
        """
        if not isinstance(grad, np.ndarray):
            raise TypeError(f"grad must be a numpy array, got {type(grad).__name__}")
        if grad.dtype not in self.dtypes:
            raise TypeError(f"{self.name} compression needs a "
                            f"{' or '.join(str(d) for d in self.dtypes)} grad, got {grad.dtype}")
        if grad.ndim != 1 or not grad.flags.c_contiguous or not grad.flags.writeable:
            raise TypeError(f"grad must be a 1-D, C-contiguous, writable array, got shape "
                            f"{grad.shape} (contiguous={grad.flags.c_contiguous}, "
                            f"writable={grad.flags.writeable})")
        layout = (grad.size, grad.dtype)
        known = self._layouts.setdefault(key, layout)
        if known != layout:
            raise ValueError(f"bucket key {key!r} was used with {known[0]} x {known[1]}, now "
                             f"with {layout[0]} x {layout[1]}")
        await self._exchange(comm, grad, key)

    @abc.abstractmethod
    async def _exchange(self, comm: Communicator, grad: np.ndarray, key: Hashable) -> None:
        """The method itself, on a validated bucket."""

    # -- error feedback -----------------------------------------------------------------

    def _with_residual(self, grad: np.ndarray, key: Hashable) -> np.ndarray:
        """A new array: ``grad`` plus the stored residual of ``key`` (with error feedback)."""
        residual = self._residuals.get(key) if self.error_feedback else None
        return grad + residual if residual is not None else grad.copy()

    def _keep_residual(self, key: Hashable, residual: np.ndarray) -> None:
        """Store ``residual`` (taken over, not copied) for ``key``, non-finite entries zeroed."""
        if self.error_feedback:
            residual[~np.isfinite(residual)] = 0
            self._residuals[key] = residual

    def state_dict(self) -> dict[str, Any]:
        """The error-feedback state (copies): ``{"name": ..., "residuals": {key: array}}``."""
        return {"name": self.name,
                "residuals": {k: v.copy() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (arrays are copied).

        Raises:
            ValueError: the state is from another method, or malformed.
            TypeError: a residual is not a 1-D float32/float64 array.
        """
        if state.get("name") != self.name:
            raise ValueError(f"state is for compression {state.get('name')!r}, "
                             f"not {self.name!r}")
        residuals = state.get("residuals")
        if not isinstance(residuals, Mapping):
            raise ValueError("state['residuals'] must be a mapping of key -> array")
        loaded: dict[Hashable, np.ndarray] = {}
        for k, v in residuals.items():
            a = np.array(v, copy=True, order="C")
            if a.ndim != 1 or a.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"residual {k!r} must be a 1-D float32/float64 array, "
                                f"got {a.dtype} {a.shape}")
            loaded[k] = a
        self._load_extra(state)
        self._residuals = loaded
        for k, a in loaded.items():
            self._layouts[k] = (a.size, a.dtype)

    def _load_extra(self, state: Mapping[str, Any]) -> None:
        """Method-specific state of ``load_state_dict`` (none by default)."""
        return None

    def reset(self) -> None:
        """Drop all error-feedback state (and the remembered bucket layouts)."""
        self._residuals.clear()
        self._layouts.clear()


class NoCompression(Compression):
    """The plain exchange: ``comm.all_reduce(grad, op=ReduceOp.AVG)`` in grad's dtype."""

    name = "none"
    dtypes = (np.dtype(np.float16), *_FLOAT_DTYPES)

    def __init__(self) -> None:
        super().__init__(error_feedback=False)

    def __repr__(self) -> str:
        return "NoCompression()"

    async def _exchange(self, comm: Communicator, grad: np.ndarray, key: Hashable) -> None:
        await comm.all_reduce(grad, op=ReduceOp.AVG)
        self.bytes_sent += _all_reduce_wire_bytes(comm, grad.size, grad.itemsize)


# ------------------------------------------------------------------------------ casting

def bf16_encode(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of ``x``: the upper 16 bits of its float32 value, rounded
    to nearest, ties to even; NaN stays a (quiet) NaN of the same sign, overflow gives inf."""
    with np.errstate(over="ignore"):
        f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_decode(u: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """The float32 (then ``dtype``) values of bfloat16 bit patterns ``u`` (exact)."""
    f = (np.asarray(u, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return f if np.dtype(dtype) == np.float32 else f.astype(dtype)


class Cast(Compression):
    """Send 16-bit floats.

    ``"float16"``: every rank divides by the world size first (so the sum cannot overflow
    where the mean does not), casts to float16, all_reduces (SUM) in float16, casts back.
    Values below float16's range (~6e-8 after the division) flush to zero: error feedback
    keeps them for later.

    ``"bfloat16"`` (not a NumPy dtype): every rank encodes ``grad`` as bfloat16 bit patterns
    (uint16, round to nearest even), all_gathers them, and decodes and sums them in float32
    (float64 for float64 buckets) in rank order, then divides by the world size.
    """

    def __init__(self, dtype: str = "float16", error_feedback: bool = False) -> None:
        super().__init__(error_feedback=error_feedback)
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"Cast dtype must be 'float16' or 'bfloat16', got {dtype!r}")
        self.dtype = dtype
        self.name = "fp16" if dtype == "float16" else "bf16"

    def __repr__(self) -> str:
        return f"Cast({self.dtype!r}, error_feedback={self.error_feedback})"

    async def _exchange(self, comm: Communicator, grad: np.ndarray, key: Hashable) -> None:
        w = comm.world_size
        x = self._with_residual(grad, key)
        if self.dtype == "float16":
            with np.errstate(over="ignore"):
                h = (x / w).astype(np.float16)
            if self.error_feedback:
                with np.errstate(invalid="ignore"):
                    x -= h.astype(grad.dtype) * w
            await comm.all_reduce(h, op=ReduceOp.SUM)
            self.bytes_sent += _all_reduce_wire_bytes(comm, h.size, h.itemsize)
            grad[...] = h
        else:
            u = bf16_encode(x)
            if self.error_feedback:
                with np.errstate(invalid="ignore"):
                    x -= bf16_decode(u, grad.dtype)
            got = _split_gathered(await comm.all_gather(u), w, u.size, "bf16")
            self.bytes_sent += _all_gather_wire_bytes(comm, u.nbytes)
            acc = bf16_decode(got[0], grad.dtype).copy()
            for r in range(1, w):
                acc += bf16_decode(got[r], grad.dtype)
            np.divide(acc, w, out=grad)
        self._keep_residual(key, x)


# ------------------------------------------------------------------------- sparsification

class TopK(Compression):
    """Send only the ``k`` largest-magnitude entries of ``grad`` (plus residual): their values
    (grad's dtype) and indices (int32, or int64 for buckets of 2**31 elements or more).

    ``k`` is ``ceil(ratio * n)`` for a bucket of ``n`` elements unless given (at most ``n``).
    Values and indices are all_gathered; every rank scatter-adds them into zeros in rank
    order, and divides by the world size. With error feedback (the default, and what makes
    small ratios converge under plain SGD) the unsent entries carry over to the next step.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, k: int | None = None,
                 error_feedback: bool = True) -> None:
        super().__init__(error_feedback=error_feedback)
        self.ratio = _check_fraction(ratio, "ratio")
        self.k = None if k is None else _check_positive_int(k, "k")

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio}, k={self.k}, error_feedback={self.error_feedback})"

    def k_for(self, n: int) -> int:
        """How many entries a bucket of ``n`` elements sends."""
        k = self.k if self.k is not None else math.ceil(self.ratio * n)
        return max(1, min(k, n)) if n else 0

    async def _exchange(self, comm: Communicator, grad: np.ndarray, key: Hashable) -> None:
        w, n = comm.world_size, grad.size
        k = self.k_for(n)
        index_dtype = np.int32 if n <= np.iinfo(np.int32).max else np.int64
        x = self._with_residual(grad, key)
        if k == n:
            idx = np.arange(n, dtype=index_dtype)
        else:
            idx = np.argpartition(np.abs(x), n - k)[n - k:].astype(index_dtype)
            idx.sort()  # ascending indices: a cache-friendly scatter
        values = x[idx]
        x[idx] = 0  # what is left is the residual: (grad + residual) - sent
        got_v, got_i = await _gather_pair(comm, values, idx)
        self.bytes_sent += _all_gather_wire_bytes(comm, values.nbytes + idx.nbytes)
        all_v = _split_gathered(got_v, w, k, "topk values")
        all_i = _split_gathered(got_i, w, k, "topk indices")
        if k and (all_i.min() < 0 or all_i.max() >= n):
            raise CollectiveError("topk: ranks passed buckets of different sizes "
                                  "(an index is out of range)")
        grad[...] = 0
        for r in range(w):  # indices are unique within a rank: += is a scatter-add
            grad[all_i[r]] += all_v[r]
        grad /= w
        self._keep_residual(key, x)


# -------------------------------------------------------------------------- quantisation

class Int8(Compression):
    """Symmetric per-block int8 quantisation.

    The bucket is cut into blocks of ``block`` elements (the last may be shorter; ``None``:
    one block for the whole bucket). Each block has scale ``max|x| / 127`` (float32) and values
    ``round(x / scale)`` in [-127, 127]. The int8 values and float32 scales are all_gathered;
    every rank dequantises and sums them in rank order in grad's dtype, and divides by the
    world size. Default 1024: scales cost 4/1024 bytes per element, and one outlier only
    coarsens its own block. A block holding a non-finite value decodes as NaN.
    """

    name = "int8"

    def __init__(self, error_feedback: bool = True, block: int | None = 1024) -> None:
        super().__init__(error_feedback=error_feedback)
        self.block = None if block is None else _check_positive_int(block, "block")

    def __repr__(self) -> str:
        return f"Int8(error_feedback={self.error_feedback}, block={self.block})"

    def _blocking(self, n: int) -> tuple[int, int]:
        """(block length, number of blocks) for a bucket of ``n`` elements."""
        b = max(1, n if self.block is None else min(self.block, n))
        return b, -(-n // b)

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(int8 values (n,), float32 scales (blocks,))`` of the 1-D float array ``x``."""
        n = x.size
        b, nb = self._blocking(n)
        m = np.zeros(nb * b, x.dtype)
        m[:n] = x
        m = m.reshape(nb, b)
        with np.errstate(over="ignore", invalid="ignore"):
            scales = (np.max(np.abs(m), axis=1) / 127).astype(np.float32)
        s = scales.astype(x.dtype)[:, None]
        usable = (s > 0) & np.isfinite(s)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(usable, np.rint(m / np.where(usable, s, 1)), 0)
        np.clip(q, -127, 127, out=q)
        return q.astype(np.int8).reshape(-1)[:n], scales

    def decode(self, q: np.ndarray, scales: np.ndarray, dtype: Any) -> np.ndarray:
        """The values that ``encode``'s ``(q, scales)`` stand for, as ``dtype``."""
        n = q.size
        b, nb = self._blocking(n)
        out = np.zeros(nb * b, dtype)
        out[:n] = q
        with np.errstate(invalid="ignore"):
            out.reshape(nb, b)[...] *= scales.astype(dtype)[:, None]
        return out[:n]

    async def _exchange(self, comm: Communicator, grad: np.ndarray, key: Hashable) -> None:
        w, n = comm.world_size, grad.size
        x = self._with_residual(grad, key)
        q, scales = self.encode(x)
        if self.error_feedback:
            with np.errstate(invalid="ignore"):
                x -= self.decode(q, scales, grad.dtype)
        got_q, got_s = await _gather_pair(comm, q, scales)
        self.bytes_sent += _all_gather_wire_bytes(comm, q.nbytes + scales.nbytes)
        all_q = _split_gathered(got_q, w, n, "int8 values")
        all_s = _split_gathered(got_s, w, scales.size, "int8 scales")
        grad[...] = self.decode(all_q[0], all_s[0], grad.dtype)
        for r in range(1, w):
            grad += self.decode(all_q[r], all_s[r], grad.dtype)
        grad /= w
        self._keep_residual(key, x)


# ----------------------------------------------------------------------------- low rank

class PowerSGD(Compression):
    """Rank-``rank`` approximation by one step of power iteration (Vogels et al., 2019).

    The bucket (plus residual) is laid out as a near-square ``m x c`` float32 matrix ``M``
    (zero-padded). With ``Q`` (``c x rank``) kept per bucket from the previous step (random,
    from ``seed``, at first): ``P = M Q``, all_reduce(SUM) ``P``, orthonormalise its columns;
    ``Q = M^T P``, all_reduce(SUM) ``Q``; the mean is ``P Q^T / W``. Every rank computes it
    from the same reduced ``P`` and ``Q``. The first ``warmup`` calls of each bucket are
    uncompressed (AVG all_reduce in grad's dtype), while ``Q`` is not yet worth anything.
    A step whose ``Q`` is not finite (a NaN or inf gradient) keeps the previous ``Q``, and a
    column of ``Q`` that came out zero (a zero gradient) starts again from ``seed``.

    A bucket's second all_reduce depends on its first, so buckets exchanged at once on one
    communicator (a wrapper's buckets overlapping the backward pass) take turns, in the
    order their calls started: every rank then issues the collectives in the same order.
    """

    name = "powersgd"

    def __init__(self, rank: int = 2, error_feedback: bool = True, warmup: int = 10,
                 seed: int = 0) -> None:
        super().__init__(error_feedback=error_feedback)
        self.rank = _check_positive_int(rank, "rank")
        if isinstance(warmup, bool) or not isinstance(warmup, int | np.integer):
            raise TypeError(f"warmup must be an int, got {warmup!r}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.warmup = int(warmup)
        self.seed = int(seed)
        self._q: dict[Hashable, np.ndarray] = {}
        self._steps: dict[Hashable, int] = {}
        #: one lock per communicator: a bucket's P and Q all_reduces run before the next
        #: bucket's (concurrent buckets issued Q when their own P completed, in an order
        #: that differed between ranks: a collective mismatch)
        self._turns: weakref.WeakKeyDictionary[Communicator, asyncio.Lock] = (
            weakref.WeakKeyDictionary())

    def __repr__(self) -> str:
        return (f"PowerSGD(rank={self.rank}, error_feedback={self.error_feedback}, "
                f"warmup={self.warmup})")

    @staticmethod
    def matrix_shape(n: int) -> tuple[int, int]:
        """The ``(rows, cols)`` a bucket of ``n`` elements is laid out as (near square)."""
        rows = math.isqrt(n - 1) + 1 if n > 0 else 1
        return rows, max(1, -(-n // rows))

    async def _exchange(self, comm: Communicator, grad: np.ndarray, key: Hashable) -> None:
        turn = self._turns.get(comm)
        if turn is None:
            turn = self._turns[comm] = asyncio.Lock()
        async with turn:
            await self._exchange_in_turn(comm, grad, key)

    async def _exchange_in_turn(self, comm: Communicator, grad: np.ndarray, key: Hashable
                                ) -> None:
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        if step < self.warmup:
            await comm.all_reduce(grad, op=ReduceOp.AVG)
            self.bytes_sent += _all_reduce_wire_bytes(comm, grad.size, grad.itemsize)
            return
        w, n = comm.world_size, grad.size
        rows, cols = self.matrix_shape(n)
        r = min(self.rank, rows, cols)
        x = self._with_residual(grad, key)
        flat = np.zeros(rows * cols, np.float32)
        q = self._q.get(key)
        if q is None or q.shape != (cols, r):
            q = self._initial_q(cols, r)
        # non-finite values propagate (inf - inf is NaN), quietly as the other methods do
        with np.errstate(invalid="ignore", over="ignore"):
            flat[:n] = x
            m = flat.reshape(rows, cols)
            p = np.ascontiguousarray(m @ q)
        await comm.all_reduce(p, op=ReduceOp.SUM)
        p = _orthonormal_columns(p)
        with np.errstate(invalid="ignore", over="ignore"):
            q = np.ascontiguousarray(m.T @ p)
        await comm.all_reduce(q, op=ReduceOp.SUM)
        self.bytes_sent += (_all_reduce_wire_bytes(comm, p.size, p.itemsize)
                            + _all_reduce_wire_bytes(comm, q.size, q.itemsize))
        self._keep_q(key, q)
        with np.errstate(invalid="ignore", over="ignore"):
            approx_sum = (p @ q.T).reshape(-1)[:n]
            if self.error_feedback:
                # this rank's own contribution is its projection P P^T M
                mine = (p @ (p.T @ m)).reshape(-1)[:n]
                x -= mine.astype(grad.dtype)
            np.divide(approx_sum, w, out=grad, casting="unsafe")
        self._keep_residual(key, x)

    def _initial_q(self, cols: int, r: int) -> np.ndarray:
        """The ``Q`` a bucket starts from: random, from ``seed`` (the same on every rank)."""
        return np.random.default_rng(self.seed).standard_normal((cols, r)).astype(np.float32)

    def _keep_q(self, key: Hashable, q: np.ndarray) -> None:
        """Keep the reduced ``q`` (the same on every rank) for the next step of ``key``.

        A ``Q`` with a non-finite entry (an overflowed step) is not kept: the next step starts
        from the previous one. A zero column (a zero gradient, or one of lower rank) gives
        ``P = M Q`` a zero column at every later step, so it is started afresh from ``seed``.
        Either would otherwise stay for good: NaN (or nothing) sent from then on."""
        if not np.isfinite(q).all():
            return
        q = q.copy()
        dead = ~q.any(axis=0)
        if dead.any():
            q[:, dead] = self._initial_q(*q.shape)[:, dead]
        self._q[key] = q

    def state_dict(self) -> dict[str, Any]:
        """Residuals, plus each bucket's ``Q`` and call count."""
        state = super().state_dict()
        state["q"] = {k: v.copy() for k, v in self._q.items()}
        state["steps"] = dict(self._steps)
        return state

    def _load_extra(self, state: Mapping[str, Any]) -> None:
        qs, steps = state.get("q", {}), state.get("steps", {})
        if not isinstance(qs, Mapping) or not isinstance(steps, Mapping):
            raise ValueError("state['q'] and state['steps'] must be mappings")
        self._q = {k: np.array(v, dtype=np.float32, order="C") for k, v in qs.items()}
        self._steps = {k: int(v) for k, v in steps.items()}

    def reset(self) -> None:
        """Drop residuals, ``Q`` matrices and call counts (warm-up starts over)."""
        super().reset()
        self._q.clear()
        self._steps.clear()


def _orthonormal_columns(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt on the columns of ``p`` (a new array); a column that vanishes stays zero.

    Plain NumPy column operations, so every rank computes the same bits from the same ``p``;
    non-finite columns stay non-finite (an overflow reaches the result)."""
    out = p.astype(np.float32, copy=True)
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(out.shape[1]):
            col = out[:, j]
            for i in range(j):
                col -= np.dot(out[:, i], col) * out[:, i]
            norm = float(np.sqrt(np.dot(col, col)))
            if math.isfinite(norm) and norm <= 1e-12:
                col[...] = 0
            else:
                col /= norm
    return out


# ------------------------------------------------------------------------------- factory

def make_compression(spec: str | Compression | None) -> Compression:
    """A hook from a short name: ``None``/``"none"``, ``"fp16"``, ``"bf16"``, ``"topk"`` or
    ``"topk:RATIO"``, ``"int8"`` or ``"int8:BLOCK"``, ``"powersgd"`` or ``"powersgd:RANK"``
    (defaults of the classes otherwise). A ``Compression`` is returned as it is.

    Raises:
        ValueError: an unknown name or a bad parameter (the message lists the accepted names).
        TypeError: ``spec`` is neither a string, a Compression nor None.
    """
    if spec is None:
        return NoCompression()
    if isinstance(spec, Compression):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"compression spec must be a str, a Compression or None, "
                        f"got {type(spec).__name__}")
    name, sep, arg = spec.strip().lower().partition(":")
    accepted = ", ".join(ACCEPTED_SPECS)
    try:
        if not sep:
            if name == "none":
                return NoCompression()
            if name == "fp16":
                return Cast("float16")
            if name == "bf16":
                return Cast("bfloat16")
            if name == "topk":
                return TopK()
            if name == "int8":
                return Int8()
            if name == "powersgd":
                return PowerSGD()
        elif name == "topk":
            return TopK(ratio=float(arg))
        elif name == "int8":
            return Int8(block=int(arg))
        elif name == "powersgd":
            return PowerSGD(rank=int(arg))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad compression spec {spec!r} ({exc}); accepted: {accepted}"
                         ) from None
    raise ValueError(f"unknown compression spec {spec!r}; accepted: {accepted}")


__all__ = [
    "ACCEPTED_SPECS",
    "Cast",
    "Compression",
    "Int8",
    "NoCompression",
    "PowerSGD",
    "TopK",
    "bf16_decode",
    "bf16_encode",
    "make_compression",
]
