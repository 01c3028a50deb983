"""Reduction operators: which dtypes they accept and how they combine arrays in place."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' arrays, element by element."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"  #: float and complex dtypes only
    BAND = "band"  #: integer and bool dtypes only
    BOR = "bor"
    BXOR = "bxor"

    # members are singletons: identity hashing is exact, and C-fast (Enum's own __hash__ is
    # Python code, paid on every dict lookup of the per-call reduction path)
    __hash__ = object.__hash__


_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.AVG: np.add,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


_AVG = ReduceOp.AVG
_BITWISE = frozenset((ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR))


def check_op(op: Any, dtype: np.dtype[Any]) -> ReduceOp:
    """Validate ``op`` for ``dtype``; return it as a ``ReduceOp``.

    Raises:
        TypeError: ``op`` is not a ReduceOp, or does not fit the dtype.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be an asynccoll.ReduceOp, got {op!r}")
    if op is _AVG and dtype.kind not in "fc":
        raise TypeError(f"ReduceOp.AVG needs a float or complex dtype, got {dtype}")
    if op in _BITWISE and dtype.kind not in "biu":
        raise TypeError(f"ReduceOp.{op.name} needs an integer or bool dtype, got {dtype}")
    return op


def combine(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
    """``dst = dst (op) src``, in place, no temporary."""
    _UFUNCS[op](dst, src, out=dst)


def combine_ordered(dst: np.ndarray, left: np.ndarray, right: np.ndarray, op: ReduceOp) -> None:
    """``dst = left (op) right`` with a fixed operand order.

    Vectorised kernels are not always bit-for-bit commutative (complex multiply is not), so
    two ranks that must end with identical bits combine their operands in the same order.
    """
    _UFUNCS[op](left, right, out=dst)


def finish(a: np.ndarray, op: ReduceOp, n: int) -> None:
    """Last step of a reduction over ``n`` ranks (divides by ``n`` for AVG)."""
    if op is _AVG and n > 1:
        np.divide(a, n, out=a)
