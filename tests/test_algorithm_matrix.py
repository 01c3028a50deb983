"""A property-style matrix of every collective against NumPy, over algorithms and edge sizes.

Every collective (broadcast and reduce from every root, all_reduce with every op of the
dtype, reduce_scatter and all_gather with even and uneven blocks, gather and scatter from
every root, all_to_all, barrier) runs in one world per case, where a case is a world size
(1..9: the non powers of two exercise the folds of recursive doubling and halving), a tuning
(the presets, and random ones with tiny, odd segment and chunk sizes, so that rings and chains
cut arrays into many segments that do not divide them, nor even the item size), a dtype and
an element count (0, 1, 7, 1000, 100003). Integer results are compared exactly, floats to a
tolerance; inputs that must stay unchanged (reduce on non-roots, reduce_scatter, all_gather,
gather, scatter, all_to_all) are checked, and so are results that must not alias another
rank's memory (in-process, the memory backend lends payloads).

The full product is far too large for a test run: the cases are sampled with a fixed seed
(when exploring, ``ASYNCCOLL_MATRIX_CASES`` and ``ASYNCCOLL_MATRIX_SEED`` widen or move
the sample, ``ASYNCCOLL_MATRIX_TUNINGS`` and ``ASYNCCOLL_MATRIX_TUNING_SEED`` draw more
random tunings, ``ASYNCCOLL_MATRIX_WIDE`` runs tcp over every world size and size; run this
file with ``python`` to print every case).
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pytest

import asynccoll
from asynccoll import Communicator, ReduceOp
from asynccoll.tuning import DIRECT, RING, TREE, Tuning

pytestmark = pytest.mark.timeout(120)

WORLD_SIZES = list(range(1, 10))
SIZES = [0, 1, 7, 1000, 100003]
DTYPES = ["int32", "float64", "bool", "complex64", "float16"]

OPS: dict[str, list[ReduceOp]] = {
    "int32": [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX,
              ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR],
    "float64": [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG],
    "bool": [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR, ReduceOp.MIN, ReduceOp.MAX],
    "complex64": [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG],
    "float16": [ReduceOp.AVG, ReduceOp.SUM, ReduceOp.MAX],
}

UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}

TOLERANCE = {"float64": 1e-12, "complex64": 1e-5, "float16": 2e-3}


def random_tuning(rng: random.Random) -> Tuning:
    """Tiny, odd segment and chunk sizes (not multiples of any item size), thresholds that
    pick each algorithm by chance."""
    tiny = [1, 3, 5, 7, 13, 64, 97, 1000]
    return Tuning(
        small_bytes=rng.choice([-1, 0, 8, 4000, 1 << 62]),
        chain_broadcast_bytes=rng.choice([0, 1, 4000, 1 << 62]),
        segment_bytes=rng.choice(tiny),
        min_segment_bytes=rng.choice(tiny),
        ring_segments=rng.choice([1, 2, 3, 5, 7]),
        chain_segment_bytes=rng.choice(tiny),
        crowded_segment_bytes=rng.choice(tiny),
        crowded_chain_broadcast_bytes=rng.choice([0, 4000, 1 << 62]),
        direct_all_gather_ranks=rng.choice([0, 1, 3, 5, 1 << 30]),
        hand_over_bytes=rng.choice([0, 100, 1 << 62]),
        direct_all_reduce=rng.choice(["lending", "always", "never"]),
        direct_segment_bytes=rng.choice(tiny),
        reduce_chunk_bytes=rng.choice(tiny),
        offload_bytes=rng.choice([0, 1, 64, 1 << 62]),
        reduce_on_read_bytes=rng.choice([0, 1, 64, 1 << 62]),
        doubling_reduce_scatter_bytes=rng.choice([-1, 0, 4000, 1 << 62]),
    )


_rng = random.Random(int(os.environ.get("ASYNCCOLL_MATRIX_TUNING_SEED", "20240517")))
PRESETS: dict[str, Tuning | None] = {"default": None, "ring": RING, "tree": TREE,
                                     "direct": DIRECT}
PRESETS.update({f"random{i}": random_tuning(_rng)
                for i in range(int(os.environ.get("ASYNCCOLL_MATRIX_TUNINGS", "6")))})


@dataclass(frozen=True)
class Case:
    backend: str
    world_size: int
    preset: str
    dtype: str
    size: int

    def __str__(self) -> str:
        return f"{self.backend}-w{self.world_size}-{self.preset}-{self.dtype}-n{self.size}"


def make(dtype: str, shape: tuple[int, ...] | int, *key: int, op: ReduceOp | None = None
         ) -> np.ndarray:
    """Deterministic data for ``key`` (case seed, rank, what)."""
    rng = np.random.default_rng([abs(k) for k in key])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind == "i":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    if dtype == "float16":  # small integers: exact sums in float16
        return rng.integers(-8, 9, size=shape).astype(dt)
    if op is ReduceOp.PROD:  # factors near 1: no overflow over 9 ranks
        real = rng.uniform(0.5, 1.5, size=shape)
        imag = rng.uniform(-0.3, 0.3, size=shape)
    else:
        real = rng.uniform(-10, 10, size=shape)
        imag = rng.uniform(-10, 10, size=shape)
    a = real + 1j * imag if dt.kind == "c" else real
    return np.asarray(a, dtype=dt)


def reference(op: ReduceOp, arrays: list[np.ndarray]) -> np.ndarray:
    dt = arrays[0].dtype
    wide = np.complex128 if dt.kind == "c" else np.float64 if dt.kind == "f" else dt
    stacked = np.stack([a.astype(wide) for a in arrays])
    out = UFUNCS[op].reduce(stacked, axis=0, dtype=wide)
    if op is ReduceOp.AVG:
        out = out / len(arrays)
    return np.asarray(out).astype(dt)


def close(actual: Any, expected: np.ndarray) -> str | None:
    """None when ``actual`` matches, else why not."""
    if not isinstance(actual, np.ndarray):
        return f"got {type(actual).__name__}"
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"got {actual.dtype}{actual.shape}, expected {expected.dtype}{expected.shape}"
    tol = TOLERANCE.get(expected.dtype.name)
    if tol is None:
        bad = actual != expected
    else:
        bad = ~np.isclose(actual, expected, rtol=tol, atol=tol)
    if bad.any():
        idx = np.flatnonzero(bad.reshape(-1))
        return (f"{idx.size} of {bad.size} elements differ, first at {idx[0]}: "
                f"{actual.reshape(-1)[idx[0]]!r} != {expected.reshape(-1)[idx[0]]!r}")
    return None


def uneven_rows(size: int, rank: int) -> int:
    return (size * (rank + 1)) // 3 + rank % 2  # 0 rows on some ranks when size is small


async def all_collectives(comm: Communicator, case: Case, seed: int) -> dict[str, Any]:
    """Run every collective; return what each produced (and copies of inputs)."""
    w, r, dt, n = comm.world_size, comm.rank, case.dtype, case.size
    out: dict[str, Any] = {}
    for root in range(w):
        a = make(dt, n, seed, r, 1, root)
        res = await comm.broadcast(a, root=root)
        out[f"broadcast root={root}"] = (res is a, a.copy())
    ops = OPS[dt]
    for root in range(w):
        op = ops[root % len(ops)]
        a = make(dt, n, seed, r, 2, root, op=op)
        before = a.copy()
        res = await comm.reduce(a, root=root, op=op)
        out[f"reduce root={root} {op.name}"] = (res is a if r == root else res is None,
                                                a.copy(), before)
    for i, op in enumerate(ops):
        a = make(dt, (n,) if i % 2 else (n, 1), seed, r, 3, i, op=op)
        res = await comm.all_reduce(a, op=op)
        out[f"all_reduce {op.name}"] = (res is a, a.copy())
    for kind, rows in (("even", w * max(1, n // w)), ("uneven", n)):
        for i, op in enumerate(ops[:2]):
            a = make(dt, (rows, 2) if i else rows, seed, r, 4, i, op=op)
            before = a.copy()
            res = await comm.reduce_scatter(a, op=op)
            out[f"reduce_scatter {kind} {op.name}"] = (res, a, before)
    a = make(dt, (n, 3), seed, r, 5)
    before = a.copy()
    out["all_gather even"] = (await comm.all_gather(a), a, before)
    a = make(dt, (uneven_rows(n, r), 2), seed, r, 6)
    before = a.copy()
    out["all_gather uneven"] = (await comm.all_gather(a), a, before)
    for root in range(w):
        a = make(dt, n, seed, r, 7, root)
        before = a.copy()
        out[f"gather root={root}"] = (await comm.gather(a, root=root), a, before)
    for root in range(w):
        arrays = ([make(dt if j % 2 else "int32", (uneven_rows(n, j),), seed, r, 8, root, j)
                   for j in range(w)] if r == root else None)
        before = [x.copy() for x in arrays] if arrays is not None else None
        out[f"scatter root={root}"] = (await comm.scatter(arrays, root=root), arrays, before)
    arrays = [make(dt, (uneven_rows(n, r + j), 1 + j % 2), seed, r, 9, j) for j in range(w)]
    before = [x.copy() for x in arrays]
    out["all_to_all"] = (await comm.all_to_all(arrays), arrays, before)
    await comm.barrier()
    out["barrier"] = True
    # Scribble over every input: a result that aliases another rank's (or this rank's) input
    # would change under the checks below.
    await comm.barrier()
    for key, value in out.items():
        if key.startswith(("reduce_scatter", "all_gather", "gather", "scatter", "all_to_all")):
            inputs = value[1]
            for x in inputs if isinstance(inputs, list) else [inputs] if inputs is not None else []:
                x[...] = np.ones((), dtype=x.dtype)
    await comm.barrier()
    return out


def check(case: Case, seed: int, results: list[dict[str, Any]]) -> list[str]:
    """Every mismatch, as ``collective rank: why``."""
    w, dt, n = case.world_size, case.dtype, case.size
    errors: list[str] = []

    def expect(what: str, r: int, actual: Any, expected: np.ndarray) -> None:
        why = close(actual, expected)
        if why:
            errors.append(f"{what} rank {r}: {why}")

    ops = OPS[dt]
    for root in range(w):
        key = f"broadcast root={root}"
        for r in range(w):
            same, got = results[r][key]
            if not same:
                errors.append(f"{key} rank {r}: did not return its input")
            expect(key, r, got, make(dt, n, seed, root, 1, root))
    for root in range(w):
        op = ops[root % len(ops)]
        key = f"reduce root={root} {op.name}"
        inputs = [make(dt, n, seed, r, 2, root, op=op) for r in range(w)]
        for r in range(w):
            ok, got, before = results[r][key]
            if not ok:
                errors.append(f"{key} rank {r}: wrong return value")
            expect(key, r, got, reference(op, inputs) if r == root else before)
    for i, op in enumerate(ops):
        key = f"all_reduce {op.name}"
        shape = (n,) if i % 2 else (n, 1)
        exp = reference(op, [make(dt, shape, seed, r, 3, i, op=op) for r in range(w)])
        for r in range(w):
            same, got = results[r][key]
            if not same:
                errors.append(f"{key} rank {r}: did not return its input")
            expect(key, r, got, exp)
            if got.tobytes() != results[0][key][1].tobytes():
                errors.append(f"{key} rank {r}: not bit-identical to rank 0")
    for kind, rows in (("even", w * max(1, n // w)), ("uneven", n)):
        for i, op in enumerate(ops[:2]):
            key = f"reduce_scatter {kind} {op.name}"
            shape = (rows, 2) if i else (rows,)
            inputs = [make(dt, shape, seed, r, 4, i, op=op) for r in range(w)]
            blocks = np.array_split(reference(op, inputs), w)
            for r in range(w):
                got, _, before = results[r][key]
                expect(key, r, got, blocks[r])
                expect(key + " (input unchanged)", r, before, inputs[r])
    full = np.concatenate([make(dt, (n, 3), seed, r, 5) for r in range(w)])
    for r in range(w):
        expect("all_gather even", r, results[r]["all_gather even"][0], full)
        expect("all_gather even (input unchanged)", r, results[r]["all_gather even"][2],
               make(dt, (n, 3), seed, r, 5))
    full = np.concatenate([make(dt, (uneven_rows(n, r), 2), seed, r, 6) for r in range(w)])
    for r in range(w):
        expect("all_gather uneven", r, results[r]["all_gather uneven"][0], full)
    for root in range(w):
        key = f"gather root={root}"
        for r in range(w):
            got = results[r][key][0]
            if r != root:
                if got is not None:
                    errors.append(f"{key} rank {r}: expected None")
            elif not isinstance(got, list) or len(got) != w:
                errors.append(f"{key} rank {r}: expected a list of {w}")
            else:
                for j in range(w):
                    expect(f"{key} [{j}]", r, got[j], make(dt, n, seed, j, 7, root))
            expect(key + " (input unchanged)", r, results[r][key][2],
                   make(dt, n, seed, r, 7, root))
    for root in range(w):
        key = f"scatter root={root}"
        for r in range(w):
            exp = make(dt if r % 2 else "int32", (uneven_rows(n, r),), seed, root, 8, root, r)
            expect(key, r, results[r][key][0], exp)
        for j, x in enumerate(results[root][key][2]):
            expect(key + f" (root's input [{j}] unchanged)", root, x,
                   make(dt if j % 2 else "int32", (uneven_rows(n, j),), seed, root, 8, root, j))
    for r in range(w):
        got = results[r]["all_to_all"][0]
        if not isinstance(got, list) or len(got) != w:
            errors.append(f"all_to_all rank {r}: expected a list of {w}")
            continue
        for j in range(w):
            expect(f"all_to_all [{j}]", r, got[j],
                   make(dt, (uneven_rows(n, j + r), 1 + r % 2), seed, j, 9, r))
    return errors


async def run_case(case: Case, seed: int = 7) -> list[str]:
    tuning = PRESETS[case.preset]

    async def fn(comm: Communicator) -> dict[str, Any]:
        return await all_collectives(comm, case, seed)

    results = await asynccoll.run_local(fn, case.world_size, case.backend, tuning=tuning,
                                        timeout=30.0)
    return check(case, seed, results)


def sample(backend: str, count: int, seed: int, sizes: list[int], worlds: list[int]
           ) -> list[Case]:
    """``count`` cases of the product, with a fixed seed; every world size, preset, dtype
    and size appears when ``count`` allows (the first picks cycle through each axis)."""
    rng = random.Random(seed)
    presets = list(PRESETS)
    cases: list[Case] = []
    for i in range(count):
        cases.append(Case(backend,
                          worlds[i % len(worlds)] if i < 3 * len(worlds) else rng.choice(worlds),
                          presets[i % len(presets)] if i < 2 * len(presets)
                          else rng.choice(presets),
                          DTYPES[i % len(DTYPES)] if i < 2 * len(DTYPES) else rng.choice(DTYPES),
                          rng.choice(sizes)))
    return cases


_SEED = int(os.environ.get("ASYNCCOLL_MATRIX_SEED", "1"))
_COUNT = int(os.environ.get("ASYNCCOLL_MATRIX_CASES", "0"))
# 100003 elements cost the most: a few of them, many small cases.
MEMORY_CASES = (sample("memory", _COUNT or 140, _SEED, SIZES[:4], WORLD_SIZES)
                + sample("memory", _COUNT // 4 or 12, _SEED + 1, SIZES[4:], WORLD_SIZES))
_WIDE = bool(os.environ.get("ASYNCCOLL_MATRIX_WIDE"))  # tcp: every world size and size too
TCP_CASES = (sample("tcp", _COUNT // 2 or 30, _SEED + 2, SIZES if _WIDE else SIZES[:4],
                    WORLD_SIZES if _WIDE else [1, 2, 3, 4, 5, 6, 7])
             + sample("tcp", _COUNT // 8 or 3, _SEED + 3, SIZES[4:], [3, 5, 9]))


@pytest.mark.parametrize("case", MEMORY_CASES + TCP_CASES, ids=str)
async def test_every_collective_matches_numpy(case: Case) -> None:
    errors = await run_case(case)
    assert not errors, f"{case}: {len(errors)} mismatches:\n" + "\n".join(errors[:20])


@pytest.mark.parametrize("backend", ["memory", "tcp"])
@pytest.mark.parametrize("preset", ["ring", "direct", "random0", "random3"])
@pytest.mark.parametrize("world_size", [3, 6])
async def test_collectives_in_flight_together_do_not_mix(backend: str, preset: str,
                                                        world_size: int) -> None:
    """Several collectives of many tiny segments in flight at once (legal, API.md)."""
    n = 1001

    async def fn(comm: Communicator) -> list[Any]:
        r = comm.rank
        a, b = make("int32", n, 1, r), make("float64", (n, 2), 2, r)
        c, d = make("int32", n, 3, r), make("int32", (n,), 4, r)
        return list(await asyncio.gather(
            comm.all_reduce(a, op=ReduceOp.BXOR), comm.all_reduce(b),
            comm.reduce_scatter(c, op=ReduceOp.MAX), comm.broadcast(d, root=world_size - 1),
            comm.all_gather(make("int32", uneven_rows(n, r), 5, r))))

    results = await asynccoll.run_local(fn, world_size, backend, tuning=PRESETS[preset],
                                        timeout=30.0)
    w = world_size
    xor = reference(ReduceOp.BXOR, [make("int32", n, 1, r) for r in range(w)])
    total = reference(ReduceOp.SUM, [make("float64", (n, 2), 2, r) for r in range(w)])
    blocks = np.array_split(reference(ReduceOp.MAX, [make("int32", n, 3, r) for r in range(w)]),
                            w)
    gathered = np.concatenate([make("int32", uneven_rows(n, r), 5, r) for r in range(w)])
    for r, (x, s, blk, bc, ag) in enumerate(results):
        for what, got, exp in (("all_reduce BXOR", x, xor), ("all_reduce SUM", s, total),
                               ("reduce_scatter MAX", blk, blocks[r]),
                               ("broadcast", bc, make("int32", (n,), 4, w - 1)),
                               ("all_gather", ag, gathered)):
            assert close(got, exp) is None, f"{what} rank {r}: {close(got, exp)}"


# ---------------------------------------------------------------------------- Tuning checks

_INT_FIELDS = [f.name for f in fields(Tuning) if f.type in ("int", int)]


@pytest.mark.parametrize("name", ["segment_bytes", "min_segment_bytes", "ring_segments",
                                  "chain_segment_bytes", "crowded_segment_bytes",
                                  "direct_segment_bytes", "reduce_chunk_bytes"])
@pytest.mark.parametrize("value", [0, -1])
def test_tuning_rejects_empty_segments(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=name):
        Tuning(**{name: value})


@pytest.mark.parametrize("name", ["poll_us", "poll_max_bytes", "spin_us", "spin_max_bytes",
                                  "hand_over_bytes", "offload_bytes", "reduce_on_read_bytes"])
def test_tuning_rejects_negative_sizes_and_times(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Tuning(**{name: -1})
    Tuning(**{name: 0})  # zero is meaningful (off, or always)


@pytest.mark.parametrize("name", _INT_FIELDS)
@pytest.mark.parametrize("value", ["64", 64.0, None, True, np.float64(3.0)])
def test_tuning_rejects_wrong_types(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=name):
        Tuning(**{name: value})


def test_tuning_accepts_numpy_integers_and_thresholds_that_never_or_always_fire() -> None:
    t = Tuning(segment_bytes=np.int64(64), small_bytes=-1, chain_broadcast_bytes=0,
               direct_all_gather_ranks=0)
    assert t.ring_segment(1 << 20) == 64
    assert t.all_reduce(0, 4) == "ring"
    assert RING.small_bytes == -1 and TREE.small_bytes == 1 << 62 and DIRECT.small_bytes == -1


def test_tuning_rejects_bad_direct_all_reduce() -> None:
    with pytest.raises(ValueError, match="direct_all_reduce"):
        Tuning(direct_all_reduce="sometimes")
    with pytest.raises(TypeError, match="direct_all_reduce"):
        Tuning(direct_all_reduce=1)  # type: ignore[arg-type]


def test_presets_are_valid_and_random_tunings_construct() -> None:
    for t in PRESETS.values():
        assert t is None or isinstance(t, Tuning)


if __name__ == "__main__":  # exploring: python tests/test_algorithm_matrix.py
    import sys
    import time

    async def _main() -> None:
        failed = 0
        for case in MEMORY_CASES + TCP_CASES:
            t0 = time.monotonic()
            try:
                errors = await run_case(case)
            except Exception as e:
                errors = [f"raised {type(e).__name__}: {e}"]
            print(f"{time.monotonic() - t0:6.2f}s {case} {'FAIL' if errors else 'ok'}",
                  flush=True)
            for e in errors[:8]:
                print("    ", e, flush=True)
            failed += bool(errors)
        print("failed cases:", failed)
        sys.exit(bool(failed))

    asyncio.run(_main())
