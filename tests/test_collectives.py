"""Every collective of API.md against an independent NumPy computation.

Parametrised over backends (``conftest.BACKENDS``), world sizes and algorithm presets
(default thresholds, ``RING``: ring / chain with 64-byte segments, ``TREE``: recursive doubling
/ doubling broadcast / direct), so each algorithm of a collective runs at every world size. Inputs
are derived deterministically from (seed, rank); the expected value is computed here with NumPy
over all ranks' inputs. Integer-valued floats keep reductions exact, whatever the order the
algorithm combines in, so results are compared bit for bit.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from asynccoll import CollectiveError, Communicator, ReduceOp
from asynccoll import call as call_module
from asynccoll.algorithms import Call, Recv, poll_window
from asynccoll.transport import tcp as tcp_module
from asynccoll.transport.tcp import TcpTransport, tcp_local_world, tcp_store_world, world_crowded
from asynccoll.tuning import DIRECT, RING, Tuning

WORLD_SIZES = [1, 2, 3, 4, 5, 8]
MULTI = [2, 3, 4, 5, 8]  # world sizes for calls that need a peer

INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
COMPLEX_DTYPES = ["complex64", "complex128"]
ALL_DTYPES = ["bool", *INT_DTYPES, *FLOAT_DTYPES, *COMPLEX_DTYPES]

UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.AVG: np.add,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


# ----------------------------------------------------------------------------------- helpers

def ops_for(dtype: str) -> list[ReduceOp]:
    """The ops the contract allows for ``dtype``."""
    kind = np.dtype(dtype).kind
    ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
    if kind in "fc":
        ops.append(ReduceOp.AVG)
    if kind in "biu":
        ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    return ops


def make_input(dtype: str, shape: tuple[int, ...], seed: int, rank: int,
               op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Deterministic input of ``rank``: full-range integers (wrap-around arithmetic is exact
    in any order), small integer-valued floats (exact sums; PROD factors in +-1, +-2)."""
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        a = rng.integers(0, 2, size=shape).astype(bool)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    else:
        if op is ReduceOp.PROD:
            real = rng.choice([-2.0, -1.0, 1.0, 2.0], size=shape)
            imag = rng.choice([-1.0, 0.0, 1.0], size=shape)
        else:
            real = rng.integers(-8, 9, size=shape).astype(np.float64)
            imag = rng.integers(-8, 9, size=shape).astype(np.float64)
        a = real + 1j * imag if dt.kind == "c" else real
    return np.array(a, dtype=dt)


def reference(op: ReduceOp, arrays: list[np.ndarray]) -> np.ndarray:
    """``op`` over the stacked rank inputs, in their dtype."""
    dt, shape = arrays[0].dtype, arrays[0].shape
    stacked = np.stack([a.reshape(-1) for a in arrays])
    out = UFUNCS[op].reduce(stacked, axis=0, dtype=dt)
    out = np.array(out, dtype=dt)
    if op is ReduceOp.AVG:
        np.divide(out, len(arrays), out=out)
    return out.reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_exact(actual: Any, expected: np.ndarray, what: str = "") -> None:
    assert isinstance(actual, np.ndarray), f"{what}: got {type(actual).__name__}"
    assert_array_equal(actual, expected, err_msg=what, strict=True)


# ------------------------------------------------------------------------------- all_reduce

@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_reduce_every_op_and_dtype(run, backend, tuning, world_size, dtype):
    shape = (5, 7)  # 35 elements: not divisible by most world sizes
    ops = ops_for(dtype)

    async def fn(comm: Communicator) -> list[np.ndarray]:
        out = []
        for i, op in enumerate(ops):
            a = make_input(dtype, shape, 100 + i, comm.rank, op)
            res = await comm.all_reduce(a, op)
            assert res is a, f"{op}: all_reduce must return its (in-place) input"
            out.append(a)
        return out

    results = await run(fn, world_size, backend, tuning=tuning)
    for i, op in enumerate(ops):
        expected = reference(op, [make_input(dtype, shape, 100 + i, r, op)
                                  for r in range(world_size)])
        for r in range(world_size):
            assert_exact(results[r][i], expected, f"{op} {dtype} rank {r}")
            assert same_bits(results[r][i], results[0][i]), f"{op}: ranks 0 and {r} differ"


def shapes_for(world_size: int) -> list[tuple[int, ...]]:
    return [(), (0,), (0, 3), (1,), (7,), (1001,), (3, 5, 2), (4 * world_size + 1,),
            # 64 KiB of float64 (the largest polled receive), 128 KiB and just above: both
            # sides of small_bytes
            (8192,), (16384,), (16385,)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_reduce_shapes(run, backend, tuning, world_size):
    cases = [("int64", ReduceOp.SUM), ("float32", ReduceOp.MAX), ("float64", ReduceOp.AVG)]
    shapes = shapes_for(world_size)

    async def fn(comm: Communicator) -> list[np.ndarray]:
        out = []
        for (k, shape), (dtype, op) in itertools.product(enumerate(shapes), cases):
            a = make_input(dtype, shape, k, comm.rank, op)
            assert await comm.all_reduce(a, op) is a
            out.append(a)
        return out

    results = await run(fn, world_size, backend, tuning=tuning)
    for i, ((k, shape), (dtype, op)) in enumerate(itertools.product(enumerate(shapes), cases)):
        expected = reference(op, [make_input(dtype, shape, k, r, op) for r in range(world_size)])
        for r in range(world_size):
            assert_exact(results[r][i], expected, f"{op} {dtype} {shape} rank {r}")
            assert same_bits(results[r][i], results[0][i])


@pytest.mark.parametrize("world_size", MULTI)
@pytest.mark.parametrize("preset", ["direct", "direct-large-segments"])
async def test_direct_all_reduce(run, backend, world_size, preset):
    """The direct all_reduce (the in-process default) on every transport: every op, sizes
    around the segment and chunk sizes, blocks that differ by one element."""
    tuning = DIRECT if preset == "direct" else Tuning(
        small_bytes=-1, direct_all_reduce="always", direct_segment_bytes=4096,
        reduce_chunk_bytes=1000, offload_bytes=1)
    cases = [(dtype, op) for dtype in ("int32", "float64", "complex64", "bool")
             for op in ops_for(dtype)]
    sizes = [1, world_size - 1, 17, 4 * world_size + 1, 600]

    async def fn(comm: Communicator) -> list[np.ndarray]:
        out = []
        for (k, n), (dtype, op) in itertools.product(enumerate(sizes), cases):
            a = make_input(dtype, (n,), k, comm.rank, op)
            assert await comm.all_reduce(a, op) is a
            out.append(a)
        return out

    results = await run(fn, world_size, backend, tuning=tuning)
    for i, ((k, n), (dtype, op)) in enumerate(itertools.product(enumerate(sizes), cases)):
        expected = reference(op, [make_input(dtype, (n,), k, r, op) for r in range(world_size)])
        for r in range(world_size):
            assert_exact(results[r][i], expected, f"{op} {dtype} ({n},) rank {r}")
            assert same_bits(results[r][i], results[0][i])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_reduce_random_floats_bit_identical_on_every_rank(run, backend, tuning,
                                                                    world_size):
    cases = [("float64", ReduceOp.SUM), ("float64", ReduceOp.PROD), ("float64", ReduceOp.MIN),
             ("float64", ReduceOp.AVG), ("float32", ReduceOp.SUM), ("complex128", ReduceOp.SUM),
             ("complex128", ReduceOp.PROD)]

    def data(k: int, dtype: str, rank: int) -> np.ndarray:
        rng = np.random.default_rng([7, k, rank])
        a = rng.uniform(0.5, 1.5, 1001) + (1j * rng.uniform(-1, 1, 1001) if dtype[0] == "c" else 0)
        return np.array(a, dtype=dtype)

    async def fn(comm: Communicator) -> list[np.ndarray]:
        return [await comm.all_reduce(data(k, dtype, comm.rank), op)
                for k, (dtype, op) in enumerate(cases)]

    results = await run(fn, world_size, backend, tuning=tuning)
    for k, (dtype, op) in enumerate(cases):
        expected = reference(op, [data(k, dtype, r) for r in range(world_size)])
        for r in range(world_size):
            assert_allclose(results[r][k], expected, rtol=1e-5 if dtype == "float32" else 1e-12)
            assert same_bits(results[r][k], results[0][k]), f"{dtype} {op}: rank {r} differs"


@pytest.mark.parametrize("world_size", [2, 3, 5])
async def test_large_arrays_with_default_thresholds(run, backend, world_size):
    """Ring all_reduce / reduce_scatter / all_gather and chain broadcast at default settings."""
    n = (1 << 20) // 8 + 3  # a little over 1 MiB of float64: chain broadcast, several ring blocks

    def data(rank: int) -> np.ndarray:
        return np.arange(n, dtype=np.float64) % 97 + rank

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        total = sum(data(j) for j in range(w))
        a = data(r)
        assert_exact(await comm.all_reduce(a), total)
        assert_exact(await comm.reduce_scatter(data(r)), np.array_split(total, w)[r])
        got = await comm.all_gather(data(r)[: 10000 * (r + 1)])
        assert_exact(got, np.concatenate([data(j)[: 10000 * (j + 1)] for j in range(w)]))
        b = data(r) if r == 1 else np.zeros(n)
        assert_exact(await comm.broadcast(b, root=1), data(1))
        c = data(r)
        res = await comm.reduce(c, root=w - 1, op=ReduceOp.MAX)
        if r == w - 1:
            assert_exact(res, data(w - 1))
        else:
            assert res is None
            assert_exact(c, data(r))

    await run(fn, world_size, backend)


@pytest.mark.parametrize("world_size", [2, 3])
async def test_frames_of_several_mib(run, backend, world_size):
    """Payloads written in chunks and then in one piece (TCP), lent or copied (memory):
    all_gather blocks and a broadcast segment of a few MiB, odd sizes."""
    n = (3 << 20) // 8 + 5
    tuning = Tuning(chain_segment_bytes=4 << 20)

    def data(rank: int) -> np.ndarray:
        return np.arange(n, dtype=np.float64) * (rank + 1)

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        out = np.empty(w * n)
        assert await comm.all_gather(data(r), out=out) is out
        assert_exact(out, np.concatenate([data(j) for j in range(w)]))
        b = data(r) if r == w - 1 else np.zeros(n)
        assert_exact(await comm.broadcast(b, root=w - 1), data(w - 1))
        c = data(r)
        assert_exact(await comm.all_reduce(c), sum(data(j) for j in range(w)))

    await run(fn, world_size, backend, tuning=tuning)


async def test_all_reduce_plans_recheck_every_call(run, backend):
    """A call like an earlier one reuses its plan (signature, algorithm) but still checks
    what can change between calls: the array's layout and writability, the op's fitness,
    and a tuning set in between (which may change the algorithm)."""
    async def fn(comm: Communicator) -> None:
        w = comm.world_size
        a = np.ones(6, np.float32)
        assert_exact(await comm.all_reduce(a), np.full(6, w, np.float32))  # plan made
        ro = np.ones(6, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="is read-only but"):
            await comm.all_reduce(ro)
        strided = np.ones(12, np.float32)[::2]
        with pytest.raises(TypeError, match="C-contiguous"):
            await comm.all_reduce(strided)
        with pytest.raises(TypeError, match="op must be"):
            await comm.all_reduce(a, "sum")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="BAND needs an integer"):
            await comm.all_reduce(a, ReduceOp.BAND)
        # the same dtype and shape after a tuning that sends 24 bytes through the ring
        comm.tuning = Tuning(small_bytes=0, segment_bytes=8, min_segment_bytes=8)
        b = np.arange(6, dtype=np.float32) + comm.rank
        assert_exact(await comm.all_reduce(b), np.arange(6, dtype=np.float32) * w
                     + sum(range(w)))
        comm.tuning = Tuning()
        c = np.full(6, 2, np.float32)
        assert_exact(await comm.all_reduce(c, ReduceOp.PROD), np.full(6, 2.0 ** w, np.float32))

    await run(fn, 3, backend)


async def test_broadcast_and_all_gather_plans_recheck_every_call(run, backend):
    """broadcast and all_gather keep plans too (per dtype, shape and root or out); a call
    like an earlier one still checks the arrays' layout and writability, and a tuning set in
    between takes effect."""
    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        a = np.arange(8, dtype=np.float32) + r
        assert_exact(await comm.broadcast(a, root=1), np.arange(8, dtype=np.float32) + 1)
        ro = np.zeros(8, np.float32)
        ro.flags.writeable = False
        if r != 1:  # (a read-only array is fine on the root, which only reads it)
            with pytest.raises(ValueError, match="is read-only but"):
                await comm.broadcast(ro, root=1)
        with pytest.raises(TypeError, match="C-contiguous"):
            await comm.broadcast(np.zeros(16, np.float32)[::2], root=1)
        with pytest.raises(TypeError, match="root must be an int"):
            await comm.broadcast(a, root=True)  # type: ignore[arg-type]
        b = np.arange(8, dtype=np.float32) + r  # a NumPy integer root, then a chain
        assert_exact(await comm.broadcast(b, root=np.int64(0)), np.arange(8, dtype=np.float32))
        comm.tuning = Tuning(chain_broadcast_bytes=0, chain_segment_bytes=8)
        c = np.arange(8, dtype=np.float32) + r
        assert_exact(await comm.broadcast(c, root=1), np.arange(8, dtype=np.float32) + 1)
        comm.tuning = Tuning()

        mine = np.full((2, 3), r, np.int32)
        out = np.empty((2 * w, 3), np.int32)
        expected = np.repeat(np.arange(w, dtype=np.int32), 2)[:, None] * np.ones(3, np.int32)
        for _ in range(2):  # plan made, then used
            assert await comm.all_gather(mine, out=out) is out
            assert_exact(out, expected)
        assert_exact(await comm.all_gather(mine), expected)
        ro_out = np.empty((2 * w, 3), np.int32)
        ro_out.flags.writeable = False
        with pytest.raises(ValueError, match="is read-only but"):
            await comm.all_gather(mine, out=ro_out)
        with pytest.raises(TypeError, match="C-contiguous"):
            await comm.all_gather(mine, out=np.empty((2 * w, 6), np.int32)[:, ::2])
        with pytest.raises(TypeError, match="C-contiguous"):
            await comm.all_gather(np.full((2, 6), r, np.int32)[:, ::2], out=out)
        comm.tuning = Tuning(direct_all_gather_ranks=0)  # the ring now
        out[...] = -1
        assert_exact(await comm.all_gather(mine, out=out), expected)

    await run(fn, 3, backend)


async def test_all_reduce_plans_are_bounded(run):
    async def fn(comm: Communicator) -> int:
        for n in range(1, 300):
            a = np.ones(n, np.int32)
            await comm.all_reduce(a)
            assert int(a[0]) == comm.world_size
        return len(comm._plans)

    for kept in await run(fn, 2, "memory"):
        assert 0 < kept <= 256


# ---------------------------------------------------------------------- reduce / broadcast

REDUCE_CASES = [("float64", ReduceOp.SUM, (11,)), ("int32", ReduceOp.MAX, (3, 4)),
                ("float32", ReduceOp.AVG, (1001,)), ("uint8", ReduceOp.BXOR, ()),
                ("complex64", ReduceOp.PROD, (0,)), ("bool", ReduceOp.BOR, (9,)),
                ("int16", ReduceOp.MIN, (2, 3, 5))]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_reduce_every_root(run, backend, tuning, world_size):
    async def fn(comm: Communicator) -> None:
        for root, (k, (dtype, op, shape)) in itertools.product(range(comm.world_size),
                                                               enumerate(REDUCE_CASES)):
            seed = 1000 * root + k
            a = make_input(dtype, shape, seed, comm.rank, op)
            before = a.copy()
            res = await comm.reduce(a, root=root, op=op)
            what = f"reduce {dtype} {op} root {root} rank {comm.rank}"
            if comm.rank == root:
                assert res is a, what
                expected = reference(op, [make_input(dtype, shape, seed, j, op)
                                          for j in range(comm.world_size)])
                assert_exact(a, expected, what)
            else:
                assert res is None, what
                assert same_bits(a, before), f"{what}: non-root input was modified"

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_broadcast_every_root(run, backend, tuning, world_size):
    dtypes = ["bool", "int8", "uint64", "float16", "float64", "complex128"]
    shapes = [(), (0,), (1001,), (3, 5, 2)]  # (1001,) takes ~16-250 segments of 64 B on RING

    async def fn(comm: Communicator) -> None:
        for root, (k, (dtype, shape)) in itertools.product(
                range(comm.world_size), enumerate(itertools.product(dtypes, shapes))):
            seed = 100 * root + k
            mine = make_input(dtype, shape, seed, comm.rank)
            expected = make_input(dtype, shape, seed, root)
            res = await comm.broadcast(mine, root=root)
            assert res is mine
            assert_exact(mine, expected, f"broadcast {dtype} {shape} root {root}")

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_broadcast_reads_a_read_only_array_on_the_root(run, backend, tuning, world_size,
                                                             tmp_path):
    """Root's array is only read: one that is read-only (over a bytes object, a memmap opened
    'r', a view with flags.writeable off) is broadcast, from every root, by every algorithm,
    and the plan kept for the call still refuses one on a non-root."""
    shape = (37, 3)  # 888 bytes: 14 segments of 64 B on RING
    path = tmp_path / "root.bin"

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        for root in range(w):
            expected = make_input("float64", shape, root, root)
            if r == root:
                path.with_suffix(f".{root}").write_bytes(expected.tobytes())
                sources = [np.frombuffer(expected.tobytes(), np.float64).reshape(shape),
                           np.memmap(path.with_suffix(f".{root}"), np.float64, "r", shape=shape)]
                view = expected.copy()
                view.flags.writeable = False
                sources.append(view)
            for k in range(3):
                mine = sources[k] if r == root else np.zeros(shape)
                assert await comm.broadcast(mine, root=root) is mine
                assert_exact(np.asarray(mine), expected, f"broadcast from root {root}, "
                                                         f"source {k}")
            if r != root:
                ro = np.zeros(shape)
                ro.flags.writeable = False
                with pytest.raises(ValueError, match="is read-only but"):
                    await comm.broadcast(ro, root=root)

    await run(fn, world_size, backend, tuning=tuning)


# ------------------------------------------------------------------ reduce_scatter / gathers

@pytest.mark.parametrize("world_size", [3, 5])
async def test_broadcast_large_below_the_chain(run, backend, world_size):
    """Default tuning: an array above the polled size and below the chain's threshold goes
    along recursive doubling's pairs straight into the non-roots' arrays, from every root
    (a root beyond the largest power of two folds its data onto a partner first)."""
    n = 300_000  # 2.4 MB of float64

    async def fn(comm: Communicator) -> None:
        assert comm.tuning.broadcast(n * 8, comm.world_size) == "doubling"
        for root in range(comm.world_size):
            mine = np.full(n, comm.rank, np.float64)
            mine[::7] = -comm.rank
            await comm.broadcast(mine, root=root)
            expected = np.full(n, root, np.float64)
            expected[::7] = -root
            assert_exact(mine, expected, f"broadcast root {root}")

    await run(fn, world_size, backend)


def test_broadcast_algorithm_choice():
    t = Tuning()
    assert t.broadcast(8, 4) == "doubling"
    assert t.broadcast(t.chain_broadcast_bytes - 1, 4) == "doubling"
    assert t.broadcast(t.chain_broadcast_bytes, 3) == "chain"
    assert t.broadcast(64 << 20, 8) == "chain"
    # two ranks: a chain would be one hop; the tree needs no agreement round beside it
    assert t.broadcast(64 << 20, 2) == "doubling"
    assert Tuning(chain_broadcast_bytes=0).broadcast(0, 3) == "chain"


def test_ring_segment_sizes():
    """A ring step's block is cut into ring_segments segments, within [min_segment_bytes,
    segment_bytes]; a segment_bytes below the minimum wins (the RING test preset)."""
    t = Tuning()
    mib = 1 << 20
    assert t.ring_segment(256 << 10) == mib  # small blocks: one segment of the minimum
    assert t.ring_segment(4 * mib) == mib
    assert t.ring_segment(8 * mib) == 2 * mib
    assert t.ring_segment(16 * mib) == 4 * mib
    assert t.ring_segment(64 * mib) == 4 * mib  # capped at segment_bytes
    assert Tuning(segment_bytes=64).ring_segment(64 * mib) == 64
    with pytest.raises(ValueError, match="ring_segments"):
        Tuning(ring_segments=0)


def test_crowded_segment_sizes():
    """Where ranks outnumber cores, ring and chain segments are at least
    crowded_segment_bytes (a smaller block is one segment); elsewhere nothing changes."""
    t = Tuning()
    mib = 1 << 20
    assert t.ring_segment(4 * mib, crowded=True) == 4 * mib
    assert t.ring_segment(2 * mib, crowded=True) == 4 * mib  # one segment per block
    assert t.ring_segment(64 * mib, crowded=True) == 4 * mib
    assert t.chain_segment() == mib
    assert t.chain_segment(crowded=True) == 4 * mib
    big = Tuning(crowded_segment_bytes=16 * mib)
    assert big.ring_segment(64 * mib, crowded=True) == 16 * mib  # above segment_bytes
    assert big.ring_segment(64 * mib) == 4 * mib
    assert Tuning(chain_segment_bytes=8 * mib).chain_segment(crowded=True) == 8 * mib
    with pytest.raises(ValueError, match="crowded_segment_bytes"):
        Tuning(crowded_segment_bytes=0)


def test_crowded_broadcast_keeps_to_the_tree():
    """Where ranks outnumber cores, broadcast runs along recursive doubling's pairs at
    every size unless crowded_chain_broadcast_bytes says otherwise."""
    t = Tuning()
    assert t.broadcast(64 << 20, 4) == "chain"
    assert t.broadcast(64 << 20, 4, crowded=True) == "doubling"
    assert t.broadcast(1 << 40, 8, crowded=True) == "doubling"
    forced = Tuning(crowded_chain_broadcast_bytes=1 << 20)
    assert forced.broadcast(1 << 20, 3, crowded=True) == "chain"
    assert forced.broadcast(1 << 20, 2, crowded=True) == "doubling"  # two ranks: one hop
    assert forced.broadcast(1 << 20, 3) == "doubling"  # chain_broadcast_bytes: 4 MiB


async def test_crowded_world_broadcasts_along_the_tree(monkeypatch):
    """A crowded TCP world's large broadcast runs the doubling algorithm (its signature
    says so on every rank) and delivers the root's data."""
    monkeypatch.setattr(tcp_module, "_ranks_per_core", lambda: 2.0)
    comms = await tcp_local_world(3)
    try:
        n = (5 << 20) // 4 + 3

        async def fn(comm: Communicator) -> None:
            assert comm.transport.crowded
            b = make_input("float32", (n,), 2, comm.rank)
            assert_exact(await comm.broadcast(b, root=1), make_input("float32", (n,), 2, 1))
            plans = [p for p in comm._plans.values() if p[0][0] == "broadcast"]
            assert [algo for _, algo in plans] == ["doubling"]

        await asyncio.gather(*(fn(c) for c in comms))
    finally:
        for c in comms:
            await c.close()


def test_poll_window():
    """How long a posted receive polls before it sleeps: poll_us, except with more ranks than
    cores, where receives above poll_max_bytes poll only in symmetric algorithms (spin_us)."""
    t = Tuning(poll_us=200, poll_max_bytes=64 << 10, spin_us=3000)
    poll = 200e-6
    big = 256 << 10
    for nbytes in (0, 64 << 10, big, None):  # cores to spare: every receive polls
        assert poll_window(t, poll, False, nbytes, False) == poll
    assert poll_window(t, poll, True, 64 << 10, False) == poll
    assert poll_window(t, poll, True, None, False) == poll  # size unknown: a small frame
    assert poll_window(t, poll, True, big, False) == 0.0  # rooted: sleeps at once
    assert poll_window(t, poll, True, big, True) == pytest.approx(3000e-6)
    assert poll_window(Tuning(spin_us=0), poll, True, big, True) == 0.0
    for yields, spin in itertools.product((False, True), repeat=2):  # a transport that
        assert poll_window(t, 0.0, yields, big, spin) == 0.0  # does not poll never does
    with pytest.raises(ValueError, match="spin_us"):
        Tuning(spin_us=-1)
    with pytest.raises(ValueError, match="spin_max_bytes"):
        Tuning(spin_max_bytes=-1)
    with pytest.raises(ValueError, match="reduce_on_read_bytes"):
        Tuning(reduce_on_read_bytes=-1)


async def test_symmetric_collectives_mark_their_receives_spin(run, monkeypatch):
    """Ring and direct all_gather receives spin up to Tuning.spin_max_bytes per rank;
    rooted collectives' receives never do."""
    seen: list[tuple[str, int, bool]] = []
    frame = Recv.frame
    label = ["?"]

    async def recorded(self: Recv) -> Any:
        nbytes = -1 if self.into is None else self.into.nbytes
        seen.append((label[0], nbytes, self.spin))
        return await frame(self)

    monkeypatch.setattr(Recv, "frame", recorded)
    tuning = Tuning(spin_max_bytes=1 << 20)

    async def fn(comm: Communicator) -> None:
        for what, call in (
                ("all_reduce 1 MiB", lambda: comm.all_reduce(np.ones(1 << 18, np.float32))),
                ("all_reduce 2 MiB", lambda: comm.all_reduce(np.ones(1 << 19, np.float32))),
                ("all_gather 1 MiB", lambda: comm.all_gather(np.ones(1 << 16, np.float32))),
                ("broadcast 1 MiB", lambda: comm.broadcast(np.ones(1 << 18, np.float32)))):
            label[0] = what
            await call()
            await comm.barrier()

    await run(fn, 4, "tcp", tuning=tuning)
    marks = {(what, spin) for what, nbytes, spin in seen if nbytes > tuning.poll_max_bytes}
    assert marks == {("all_reduce 1 MiB", True), ("all_reduce 2 MiB", False),
                     ("all_gather 1 MiB", True), ("broadcast 1 MiB", False)}


def test_hand_over_yields_only_where_cores_are_shared(monkeypatch):
    """Call.hand_over gives the core away (one sched_yield) only on a transport that
    hands_over (two or more ranks per core) and for sends of at least
    Tuning.hand_over_bytes (by default every send)."""
    yielded = []
    monkeypatch.setattr(call_module.os, "sched_yield", lambda: yielded.append(1))
    for hands_over, threshold, nbytes, expected in [
            (False, 0, 1 << 20, 0), (True, 0, 0, 1), (True, 0, 8, 1),
            (True, 64 << 10, (64 << 10) - 1, 0), (True, 64 << 10, 64 << 10, 1),
            (True, 1 << 62, 1 << 40, 0)]:
        transport = SimpleNamespace(rank=0, polls=True, hands_over=hands_over)
        call = Call(transport, (0, 1), 0, 0, 1, (), Tuning(hand_over_bytes=threshold))
        yielded.clear()
        call.hand_over(nbytes)
        assert len(yielded) == expected, (hands_over, threshold, nbytes)
    assert Tuning().hand_over_bytes == 0
    with pytest.raises(ValueError, match="hand_over_bytes"):
        Tuning(hand_over_bytes=-1)


def _record_hand_overs(monkeypatch: pytest.MonkeyPatch, ranks: int
                       ) -> tuple[list[tuple[str, int, int]], list[str]]:
    """Two ranks per core for the TCP worlds made next, and every ``Call.hand_over``
    recorded as ``(label, group rank, nbytes)`` in the list returned first, the label being
    what that rank last wrote into the list returned second (one entry per rank)."""
    monkeypatch.setattr(tcp_module, "_ranks_per_core", lambda: 2.0)
    seen: list[tuple[str, int, int]] = []
    label = ["?"] * ranks  # what each rank is in
    hand_over = Call.hand_over

    def recorded(self: Call, nbytes: int) -> None:
        assert self.t.hands_over
        seen.append((label[self.rank], self.rank, nbytes))
        hand_over(self, nbytes)

    monkeypatch.setattr(Call, "hand_over", recorded)
    return seen, label


@pytest.mark.timeout(60)
async def test_shared_cores_hand_over_after_each_steps_sends(monkeypatch):
    """With two ranks per core, a rank hands its core over after posting each step's sends:
    the direct all_gather once per call (its block), the barrier after each round's token,
    recursive doubling after each pair's swap, the doubling broadcast in each round (the
    array where a rank sends or receives it, a token where it swaps tokens). Results stay
    exact."""
    seen, label = _record_hand_overs(monkeypatch, 4)
    comms = await tcp_local_world(4)
    n = 1 << 14
    try:
        async def fn(comm: Communicator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            r = comm.rank
            label[r] = "all_gather"
            gathered = await comm.all_gather(np.full(n, r, np.float32))
            await comm.barrier()
            label[r] = "all_reduce"
            summed = np.full(2, r + 1, np.int64)
            await comm.all_reduce(summed)
            await comm.barrier()
            label[r] = "broadcast"
            a = (np.arange(4 * n, dtype=np.float32) if comm.rank == 0
                 else np.zeros(4 * n, np.float32))
            await comm.broadcast(a)
            return gathered, summed, a

        results = await asyncio.gather(*(fn(c) for c in comms))
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    for gathered, summed, a in results:
        assert_array_equal(gathered, np.repeat(np.arange(4, dtype=np.float32), n))
        assert_array_equal(summed, [10, 10])
        assert_array_equal(a, np.arange(4 * n, dtype=np.float32))

    def of(what: str) -> list[tuple[int, int]]:
        return sorted((rank, nbytes) for w, rank, nbytes in seen if w == what)

    # all_gather: one per rank with its 64 KiB block, then the barrier's 2 rounds' tokens
    assert of("all_gather") == sorted([(r, 4 * n) for r in range(4)]
                                      + [(r, 0) for r in range(4) for _ in range(2)])
    # all_reduce: 2 swaps of 16 bytes per rank, then the barrier's tokens
    assert of("all_reduce") == sorted([(r, 16) for r in range(4) for _ in range(2)]
                                      + [(r, 0) for r in range(4) for _ in range(2)])
    # broadcast: round 1, 0 sends to 1 while 2 and 3 swap tokens; round 2, 0 -> 2, 1 -> 3
    assert of("broadcast") == sorted([(r, 16 * n) for r in (0, 0, 1, 1, 2, 3)]
                                     + [(2, 0), (3, 0)])


@pytest.mark.timeout(60)
async def test_shared_cores_ring_hands_over_once_per_call(monkeypatch):
    """The ring (all_reduce, all_gather) hands the core over once per call, after its first
    sends (the block each rank starts with), where every core is shared."""
    seen, label = _record_hand_overs(monkeypatch, 4)
    comms = await tcp_local_world(4, tuning=RING)
    try:
        async def fn(comm: Communicator) -> tuple[np.ndarray, np.ndarray]:
            r = comm.rank
            label[r] = "all_reduce"
            a = np.arange(40, dtype=np.float32) * (r + 1)
            await comm.all_reduce(a)
            label[r] = "all_gather"
            return a, await comm.all_gather(np.full(6, r, np.int32))

        results = await asyncio.gather(*(fn(c) for c in comms))
    finally:
        await asyncio.gather(*(c.close() for c in comms))
    for a, gathered in results:
        assert_array_equal(a, np.arange(40, dtype=np.float32) * 10)
        assert_array_equal(gathered, np.repeat(np.arange(4, dtype=np.int32), 6))
    # 40 floats over 4 ranks: 10 a block; the all_gather's block is 6 int32
    assert sorted(x for x in seen if x[0] == "all_reduce") == [
        ("all_reduce", r, 40) for r in range(4)]
    assert sorted(x for x in seen if x[0] == "all_gather") == [
        ("all_gather", r, 24) for r in range(4)]


@pytest.mark.parametrize(("local", "yields", "spins", "hands_over"),
                         [(None, False, False, False), ("2", False, False, False),
                          ("3", True, True, False), ("4", True, True, True),
                          ("5", True, False, True), ("8", True, False, True)])
async def test_tcp_ranks_per_core(monkeypatch, local, yields, spins, hands_over):
    """On 2 cores: polls yield the core with more ranks than cores, symmetric collectives'
    larger receives spin with at most two ranks per core, and ranks hand their core over
    after a step's sends with two or more per core."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("ASYNCCOLL_LOCAL_WORLD_SIZE", raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    t = TcpTransport(0, 2)
    assert (t.yields, t.spins, t.hands_over) == (yields, spins, hands_over)


def test_world_crowded_from_the_roster():
    """A world is crowded when any rank's roster entry says so; entries without meta (or
    with other meta) count as not crowded."""
    assert not world_crowded([])
    assert not world_crowded([["h", 1], ["h", 2, None], ["h", 3, {}], ["h", 4, {"x": 1}]])
    assert not world_crowded([["h", 1, {"crowded": False}], ["h", 2, {"crowded": 1}]])
    assert world_crowded([["h", 1, {"crowded": False}], ["h", 2, {"crowded": True}]])


@pytest.mark.timeout(60)
async def test_crowded_world_agrees_and_uses_larger_segments(monkeypatch):
    """One rank of a TCP world shares a core: every rank's transport learns it from the
    roster, and the ring then sends one segment per block where it sent two (a 6 MiB
    all_reduce over 3 ranks: 2 MiB blocks, 1 MiB segments otherwise), the chain broadcast
    (forced) 4 MiB segments; results stay exact."""
    told = []

    def ranks_per_core() -> float:  # the first transport made says 2 ranks per core
        told.append(None)
        return 2.0 if len(told) == 1 else 0.5

    monkeypatch.setattr(tcp_module, "_ranks_per_core", ranks_per_core)
    comms = await tcp_local_world(3, tuning=Tuning(crowded_chain_broadcast_bytes=0))
    try:
        assert [c.transport.crowded for c in comms] == [True] * 3
        assert sum(c.transport.yields for c in comms) == 1
        n = (6 << 20) // 4
        posts = [0] * 3

        async def fn(comm: Communicator) -> None:
            t = comm.transport
            post = t.post

            def counting(dst, head, payload):
                posts[comm.rank] += 1
                return post(dst, head, payload)

            t.post = counting  # type: ignore[method-assign]
            x = make_input("float32", (n,), 0, comm.rank)
            got = await comm.all_reduce(x)
            expected = reference(ReduceOp.SUM, [make_input("float32", (n,), 0, j)
                                                for j in range(3)])
            assert_allclose(got, expected, rtol=1e-6)
            posts[comm.rank] *= 100  # then the chain broadcast's frames
            b = make_input("float32", (n,), 1, comm.rank)
            assert_exact(await comm.broadcast(b, root=0), make_input("float32", (n,), 1, 0))
            t.post = post  # type: ignore[method-assign]

        await asyncio.gather(*(fn(c) for c in comms))
        # all_reduce: 2 reduce + 2 gather steps, one segment each; broadcast: the 6 MiB
        # in 4 MiB segments along the chain 0 -> 1 -> 2, and two frames of its agreement round
        assert posts == [404, 404, 402]
        for c in comms:
            c.transport.crowded = False
            c.tuning = Tuning(crowded_chain_broadcast_bytes=0)  # drops the plans made
        posts[:] = [0, 0, 0]
        await asyncio.gather(*(fn(c) for c in comms))
        assert posts == [808, 808, 802]
    finally:
        for c in comms:
            await c.close()


@pytest.mark.timeout(60)
async def test_store_world_agrees_on_crowding(monkeypatch):
    """Worlds formed through rendezvous keys (elastic generations) agree as well: one rank
    that shares a core makes every rank's transport crowded; none, none."""
    from asynccoll.rendezvous import RendezvousClient, RendezvousServer

    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    clients = [await RendezvousClient.connect("127.0.0.1", server.port) for _ in range(3)]
    try:
        for gen, first in ((0, 2.0), (1, 0.5)):
            told: list[None] = []

            def ranks_per_core(first: float = first, told: list[None] = told) -> float:
                told.append(None)
                return first if len(told) == 1 else 0.5

            monkeypatch.setattr(tcp_module, "_ranks_per_core", ranks_per_core)
            comms = await asyncio.gather(*(
                tcp_store_world(c, f"test/{gen}", r, 3, job=f"j{gen}")
                for r, c in enumerate(clients)))
            try:
                assert [c.transport.crowded for c in comms] == [first > 1] * 3
                x = [np.full(5, c.rank + 1.0) for c in comms]
                await asyncio.gather(*(c.all_reduce(a) for c, a in zip(comms, x, strict=True)))
                assert all((a == 6.0).all() for a in x)
            finally:
                for c in comms:
                    await c.close()
    finally:
        for c in clients:
            await c.close()
        await server.close()


@pytest.mark.parametrize("world_size", [3, 4])
async def test_spinning_receives_with_more_ranks_than_cores(run, world_size):
    """The spinning path (a TCP world that yields its core between polls) delivers exact
    results, whatever the order frames arrive in."""
    async def fn(comm: Communicator) -> None:
        comm.transport.yields = comm.transport.spins = True
        for k, n in enumerate((1 << 15, (1 << 17) + 3, 1 << 18)):
            x = make_input("float64", (n,), k, comm.rank)
            expected = reference(ReduceOp.SUM, [make_input("float64", (n,), k, j)
                                                for j in range(comm.world_size)])
            got = await comm.all_reduce(x.copy())
            assert_allclose(got, expected, rtol=1e-12)
            rows = await comm.all_gather(x)
            for j in range(comm.world_size):
                assert_exact(rows[j * n:(j + 1) * n], make_input("float64", (n,), k, j))

    await run(fn, world_size, "tcp", tuning=Tuning(small_bytes=1 << 10))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_reduce_scatter(run, backend, tuning, world_size):
    w = world_size
    shapes = [(0,), (1, 3), (max(w - 1, 1), 2), (2 * w + 1, 3), (17,), (5, 0), (3 * w,),
              (w + 1, 2, 2)]
    cases = [("int64", ReduceOp.SUM), ("float64", ReduceOp.AVG), ("float32", ReduceOp.MIN),
             ("uint16", ReduceOp.BXOR)]

    async def fn(comm: Communicator) -> None:
        for (k, shape), (dtype, op) in itertools.product(enumerate(shapes), cases):
            a = make_input(dtype, shape, k, comm.rank, op)
            before = a.copy()
            got = await comm.reduce_scatter(a, op)
            full = reference(op, [make_input(dtype, shape, k, j, op) for j in range(w)])
            what = f"reduce_scatter {dtype} {op} {shape} rank {comm.rank}"
            assert_exact(got, np.array_split(full, w)[comm.rank], what)
            assert same_bits(a, before), f"{what}: input was modified"
            assert got.flags.writeable

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("algo", ["doubling", "direct"])
async def test_small_reduce_scatter_both_ways(run, backend, world_size, algo):
    """The two small reduce_scatters: the whole array all-reduced along recursive doubling's
    pairs (this rank's block kept), and every rank sending each peer its block."""
    tuning = Tuning(doubling_reduce_scatter_bytes=1 << 62 if algo == "doubling" else -1)
    assert tuning.reduce_scatter(1000, world_size) == algo
    w = world_size
    shapes = [(0,), (1, 3), (2 * w + 1, 3), (17,), (w + 1, 2, 2)]
    cases = [("int32", ReduceOp.SUM), ("float64", ReduceOp.AVG), ("float32", ReduceOp.MAX),
             ("bool", ReduceOp.BOR), ("complex64", ReduceOp.PROD)]

    async def fn(comm: Communicator) -> None:
        for (k, shape), (dtype, op) in itertools.product(enumerate(shapes), cases):
            a = make_input(dtype, shape, k, comm.rank, op)
            before = a.copy()
            got = await comm.reduce_scatter(a, op)
            full = reference(op, [make_input(dtype, shape, k, j, op) for j in range(w)])
            what = f"{algo} reduce_scatter {dtype} {op} {shape} rank {comm.rank}"
            want = np.array_split(full, w)[comm.rank]
            if dtype == "complex64":
                np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=what)
            else:
                assert_exact(got, want, what)
            assert got.shape == want.shape and got.dtype == want.dtype, what
            assert same_bits(a, before), f"{what}: input was modified"

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_gather(run, backend, tuning, world_size):
    # (dtype, rows of rank r, trailing axes)
    cases: list[tuple[str, Callable[[int], int], tuple[int, ...]]] = [
        ("int32", lambda r: 4, ()),
        ("float64", lambda r: 3, (2, 2)),
        ("float32", lambda r: r % 3, (2, 3)),  # zero rows on every third rank
        ("complex64", lambda r: 2 * (r + 1), ()),
        ("bool", lambda r: (r * 5) % 4, (3,)),
        ("uint8", lambda r: 0, (3,)),  # nobody has rows
        ("int16", lambda r: 1000 * (r % 2), ()),  # big and empty blocks mixed
    ]

    async def fn(comm: Communicator) -> None:
        for k, (dtype, rows, trailing) in enumerate(cases):
            def block(j: int) -> np.ndarray:
                return make_input(dtype, (rows(j), *trailing), k, j)  # noqa: B023
            got = await comm.all_gather(block(comm.rank))
            expected = np.concatenate([block(j) for j in range(comm.world_size)], axis=0)
            assert_exact(got, expected, f"all_gather {dtype} case {k} rank {comm.rank}")

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("rows", [[3, 2, 1], [4, 1, 2, 1], [3, 2, 2, 1]],
                         ids=lambda rows: "-".join(map(str, rows)))
async def test_all_gather_into_out_with_uneven_rows(run, backend, tuning, rows):
    """Uneven blocks gathered into ``out``: where this rank's rows times the world size happen
    to equal the total, the blocks are first received into ``out`` at even offsets, and must
    not be overwritten as they are moved to their real places."""
    async def fn(comm: Communicator) -> None:
        a = np.full((rows[comm.rank], 2), comm.rank, np.int32)
        out = np.full((sum(rows), 2), -1, np.int32)
        got = await comm.all_gather(a, out=out)
        expected = np.concatenate([np.full((k, 2), j, np.int32) for j, k in enumerate(rows)])
        assert got is out
        assert_exact(got, expected, f"all_gather into out, rank {comm.rank}")

    await run(fn, len(rows), backend, tuning=tuning)


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_all_gather_zero_size_trailing_axis(run, backend, tuning, world_size):
    """Different axis-0 lengths of arrays that hold no bytes: the shape must still add up."""
    async def fn(comm: Communicator) -> tuple[int, ...]:
        got = await comm.all_gather(np.empty((comm.rank + 1, 0), np.float64))
        return got.shape

    shapes = await run(fn, world_size, backend, tuning=tuning)
    total = sum(range(1, world_size + 1))
    assert shapes == [(total, 0)] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_gather_every_root(run, backend, tuning, world_size):
    cases = [("float64", (3, 2)), ("int8", (2,)), ("complex128", ()), ("bool", (0, 4))]

    async def fn(comm: Communicator) -> None:
        for root, (k, (dtype, shape)) in itertools.product(range(comm.world_size),
                                                           enumerate(cases)):
            seed = 10 * root + k
            got = await comm.gather(make_input(dtype, shape, seed, comm.rank), root=root)
            if comm.rank != root:
                assert got is None
                continue
            assert isinstance(got, list) and len(got) == comm.world_size
            for j, x in enumerate(got):
                assert_exact(x, make_input(dtype, shape, seed, j), f"gather root {root} from {j}")

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", [6, 7])
async def test_doubling_gather_relays_folded_blocks(run, backend, world_size):
    # 6 and 7 ranks fold 2 and 3 ranks onto the first four, so the collectors' bundles carry
    # folded blocks from more than one rank; 24 KB per rank makes the larger bundles go the
    # posted-receive way (over poll_max_bytes) and the small ones the polled way
    cases = [("float64", (3000,)), ("int16", (2, 3)), ("uint8", (0,))]

    async def fn(comm: Communicator) -> None:
        for root, (k, (dtype, shape)) in itertools.product(range(comm.world_size),
                                                           enumerate(cases)):
            seed = 100 + 10 * root + k
            got = await comm.gather(make_input(dtype, shape, seed, comm.rank), root=root)
            if comm.rank != root:
                assert got is None
                continue
            assert got is not None and len(got) == comm.world_size
            for j, x in enumerate(got):
                assert_exact(x, make_input(dtype, shape, seed, j), f"gather root {root} from {j}")

    await run(fn, world_size, backend, tuning=Tuning(small_bytes=1 << 20))


@pytest.mark.parametrize(("world_size", "frames"), [(2, [1, 1]), (4, [2, 2, 2, 2]),
                                                      (5, [3, 2, 2, 2, 1])])
async def test_small_gather_sends_one_frame_per_round(run, world_size, frames):
    # no agreement round beside the data: a frame per round and rank (and one more for each
    # rank a folded rank leans on), where the direct gather with its dissemination barrier
    # needed up to three per rank
    posted: dict[int, int] = {}

    async def fn(comm: Communicator) -> None:
        t = comm.transport
        post = t.post

        def counted(dst: int, head: bytes, payload: Any) -> Any:
            posted[comm.rank] = posted.get(comm.rank, 0) + 1
            return post(dst, head, payload)

        t.post = counted  # type: ignore[method-assign]
        got = await comm.gather(np.full(2, comm.rank, np.float32), root=1)
        t.post = post  # type: ignore[method-assign]
        if comm.rank == 1:
            assert got is not None
            assert_array_equal(np.stack(got), np.repeat(np.arange(comm.world_size), 2)
                               .reshape(-1, 2).astype(np.float32))

    await run(fn, world_size, "memory")
    assert [posted.get(r, 0) for r in range(world_size)] == frames


SCATTER_DTYPES = ["int16", "float64", "complex64", "uint16", "bool", "float16", "int64"]


def p2p_array(src: int, dst: int, salt: int = 0) -> np.ndarray:
    """A distinct array for the pair (src, dst): shape, dtype and values all depend on it."""
    dtype = SCATTER_DTYPES[(src + 2 * dst + salt) % len(SCATTER_DTYPES)]
    shape = (src + 1, dst) if (src + dst + salt) % 2 else (dst + salt % 3,)
    values = (np.arange(int(np.prod(shape))) + 100 * src + 10 * dst + salt) % 120
    return values.reshape(shape).astype(dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_scatter_every_root(run, backend, tuning, world_size):
    async def fn(comm: Communicator) -> None:
        w = comm.world_size
        for root in range(w):
            if comm.rank == root:
                arrays: Any = [p2p_array(root, j) for j in range(w)]
            else:
                arrays = None if root % 2 else []  # ignored on non-roots, whatever it is
            got = await comm.scatter(arrays, root=root)
            assert_exact(got, p2p_array(root, comm.rank), f"scatter root {root}")

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_to_all(run, backend, tuning, world_size):
    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        for salt in range(3):
            got = await comm.all_to_all([p2p_array(r, j, salt) for j in range(w)])
            assert isinstance(got, list) and len(got) == w
            for j in range(w):
                assert_exact(got[j], p2p_array(j, r, salt), f"all_to_all {j} -> {r}")

    await run(fn, world_size, backend, tuning=tuning)


# ------------------------------------------------------------------------ barrier and p2p

@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_barrier_nobody_leaves_before_everyone_entered(run, backend, world_size):
    rounds = 4
    entered: list[list[float]] = [[] for _ in range(rounds)]
    left: list[list[float]] = [[] for _ in range(rounds)]

    async def fn(comm: Communicator) -> None:
        for k in range(rounds):
            # a different straggler every round
            await asyncio.sleep(0.03 * ((comm.rank + k) % comm.world_size == 0))
            await asyncio.sleep(0.002 * ((comm.rank * 3 + k) % comm.world_size))
            entered[k].append(time.monotonic())
            await comm.barrier()
            left[k].append(time.monotonic())
            assert len(entered[k]) == comm.world_size, (
                f"rank {comm.rank} left barrier {k} while only {len(entered[k])} had entered")

    await run(fn, world_size, backend)
    for k in range(rounds):
        assert min(left[k]) >= max(entered[k])


@pytest.mark.parametrize("world_size", MULTI)
async def test_send_recv(run, backend, world_size):
    big_tag = (1 << 63) - 1

    def typed(src: int) -> list[np.ndarray]:
        return [np.array(1.5 - 2j * src, np.complex64),  # 0-d
                np.arange(6, dtype=np.float16).reshape(2, 3) + src,
                np.zeros((0, 4), bool),
                np.arange(1001, dtype=np.uint64) * 3 + src]

    def ordered(src: int, k: int) -> np.ndarray:
        return np.full(k + 1, 10 * src + k, np.int64)

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        right, left = (r + 1) % w, (r - 1) % w
        # several messages with one tag arrive in order; different tags are independent
        for k in range(5):
            assert await comm.send(ordered(r, k), right) is None
        for k, a in enumerate(typed(r)):
            await comm.send(a, right, tag=7 + k)
        await comm.send(np.array([r]), right, tag=big_tag)
        got = await comm.recv(left, tag=big_tag)  # the last one sent, received first
        assert_exact(got, np.array([left]))
        for k in reversed(range(len(typed(left)))):
            assert_exact(await comm.recv(left, tag=np.int64(7 + k)), typed(left)[k])
        for k in range(5):
            assert_exact(await comm.recv(left), ordered(left, k))
        # receives posted before the matching sends
        recvs = asyncio.gather(*(comm.recv(left, tag=3) for _ in range(4)))
        await asyncio.sleep(0.01)
        for k in range(4):
            await comm.send(ordered(r, k), right, tag=3)
        for k, got in enumerate(await recvs):
            assert_exact(got, ordered(left, k))
        # a pair talks both ways with the same tag
        if r == 0:
            await comm.send(np.arange(3.0), w - 1, tag=11)
            assert_exact(await comm.recv(w - 1, tag=11), np.arange(3.0) + 1)
        elif r == w - 1:
            await comm.send((await comm.recv(0, tag=11)) + 1, 0, tag=11)

    await run(fn, world_size, backend)


async def test_tags_used_once_leave_nothing_behind(run, backend):
    """A training loop that tags each message with its step number: 3000 tags, each used
    once, keep no per-tag state (it grew by ~500 bytes a tag, per rank, for good); and a
    large message on one tag, then a small one on another (TCP: different connections),
    received in the opposite order, each get their own data."""
    import tracemalloc

    from asynccoll import collectives
    from asynccoll.transport import mpi as mpi_module

    files = [collectives.__file__, mpi_module.__file__]
    grown: list[int] = []

    async def fn(comm: Communicator) -> None:
        peer = 1 - comm.rank
        a = np.arange(4.0) + comm.rank
        big = np.arange(300_000.0) + comm.rank

        async def burst(lo: int, hi: int) -> None:
            for tag in range(lo, hi):
                got, _ = await asyncio.gather(comm.recv(peer, tag=tag),
                                              comm.send(a, peer, tag=tag))
                assert_exact(got, np.arange(4.0) + peer)

        await burst(0, 200)
        await comm.barrier()
        if comm.rank == 0:
            tracemalloc.start()
        await comm.barrier()
        await burst(200, 3200)
        await comm.barrier()
        if comm.rank == 0:
            snap = tracemalloc.take_snapshot()
            tracemalloc.stop()
            kept = snap.filter_traces([tracemalloc.Filter(True, f) for f in files])
            grown.append(sum(stat.size for stat in kept.statistics("filename")))
        await comm.send(big, peer, tag=1 << 40)
        await comm.send(a, peer, tag=5)
        assert_exact(await comm.recv(peer, tag=5), np.arange(4.0) + peer)
        assert_exact(await comm.recv(peer, tag=1 << 40), np.arange(300_000.0) + peer)

    await run(fn, 2, backend)
    if grown:
        assert grown[0] < 64 << 10, f"{grown[0]} bytes kept for 3000 tags used once"


# -------------------------------------------------------------------------------- objects

OBJECTS: list[Any] = [
    {"a": [1, 2.5, None, "x", True], "nested": {"b": [{"c": None}, []], "k": -3}},
    None,
    "a string with ünïcødé",
    [1, [2, [3, [4, {}]]]],
    {"blob": b"\x00\x01\xff", "n": 2**40, "f": -0.25},
    "x" * 200_000,  # bigger than the default small_bytes
    [],
    {},
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_broadcast_object(run, backend, tuning, world_size):
    async def fn(comm: Communicator) -> None:
        for root, obj in itertools.product(range(comm.world_size), OBJECTS):
            mine = obj if comm.rank == root else {"ignored": comm.rank}
            got = await comm.broadcast_object(mine, root=root)
            assert got == obj
        assert await comm.broadcast_object(root=comm.world_size - 1) is None

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_gather_object(run, backend, tuning, world_size):
    def obj(k: int, rank: int) -> Any:
        if k == 0:
            return {"rank": rank, "data": list(range(rank)), "name": "r" * rank,
                    "nested": {"none": None, "ok": rank % 2 == 0}}
        if k == 1:
            return None
        if k == 2:
            return OBJECTS[rank % len(OBJECTS)]  # very different sizes
        return f"rank {rank}"

    async def fn(comm: Communicator) -> None:
        for k in range(4):
            got = await comm.all_gather_object(obj(k, comm.rank))
            assert got == [obj(k, j) for j in range(comm.world_size)]

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_object_that_packs_but_does_not_unpack(run, backend, world_size):
    """A dict with tuple keys packs (the key becomes an array) but cannot be unpacked (a list
    is no key): a ``TypeError`` on every rank, as for an object that does not pack, and the
    communicator goes on."""
    async def fn(comm: Communicator) -> None:
        with pytest.raises(TypeError, match="msgpack"):
            await comm.broadcast_object({(1, 2): 3} if comm.rank == 0 else None)
        with pytest.raises(TypeError, match="msgpack"):
            await comm.all_gather_object({(1, 2): 3} if comm.rank == world_size - 1 else 1)
        assert await comm.broadcast_object({"ok": 1}) == {"ok": 1}
        assert await comm.all_gather_object(comm.rank) == list(range(world_size))
        assert_array_equal(await comm.all_reduce(np.ones(2)), np.full(2, float(world_size)))

    await run(fn, world_size, backend)


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_object_that_does_not_pack_raises_on_every_rank(run, backend, world_size):
    """An object that does not pack (a set, a NumPy integer or array: a rank's metrics, say)
    on one rank: a ``TypeError`` naming that rank and the type on every rank, at once, and
    the communicator goes on. The other ranks waited for that rank until their timeout broke
    the world (the failing rank raised before it sent anything)."""
    last = world_size - 1

    async def fn(comm: Communicator) -> None:
        t0 = time.monotonic()
        bad = "group rank {} is not msgpack-serialisable: can not serialize '{}'"
        with pytest.raises(TypeError, match=bad.format(last, "set")):
            await comm.broadcast_object({1, 2} if comm.rank == last else None, root=last)
        with pytest.raises(TypeError, match=bad.format(last, r"numpy\.int64")):
            await comm.all_gather_object({"loss": np.int64(3)} if comm.rank == last else 1.0)
        with pytest.raises(TypeError, match=bad.format(0, r"numpy\.ndarray")):
            await comm.all_gather_object([np.zeros(2)])  # every rank: the first one named
        assert time.monotonic() - t0 < 2.0
        assert await comm.broadcast_object({"ok": 1}, root=last) == {"ok": 1}
        assert await comm.all_gather_object(comm.rank) == list(range(world_size))
        assert_array_equal(await comm.all_reduce(np.ones(2)), np.full(2, float(world_size)))

    await run(fn, world_size, backend, timeout=5)


@pytest.mark.parametrize("world_size", [2, 3])
async def test_object_larger_than_a_frame_raises_value_error_on_every_rank(run, world_size):
    """An object that packs to more than ``max_payload``: ``ValueError`` on every rank saying
    so (docs/collectives.md), and the communicator goes on. The sender raised "an array of N
    bytes is larger than one frame may carry" (no array in sight) and every other rank a
    ``CollectiveError``: the world was broken."""
    last = world_size - 1

    async def fn(comm: Communicator) -> None:
        big = "x" * 5000
        with pytest.raises(ValueError, match=f"object of group rank {last} packs to 5003 "
                                             f"bytes, more than one frame may carry"):
            await comm.broadcast_object(big if comm.rank == last else None, root=last)
        with pytest.raises(ValueError, match="object of group rank 0 packs to 5003 bytes"):
            await comm.all_gather_object(big if comm.rank == 0 else "small")
        assert await comm.all_gather_object("x" * 900) == ["x" * 900] * world_size
        assert await comm.broadcast_object({"ok": 1}, root=last) == {"ok": 1}

    await run(fn, world_size, "tcp", timeout=5, max_payload=1000)


# ---------------------------------------------------------------------------------- groups

def some_members(world_size: int) -> list[int]:
    """A permuted proper subset when there is one: [w-1, 1, 2, ..., w-2] (rank 0 left out)."""
    if world_size == 1:
        return [0]
    if world_size == 2:
        return [1]
    return [world_size - 1, *range(1, world_size - 1)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_new_group_renumbers_and_works(run, backend, tuning, world_size):
    members = some_members(world_size)

    async def fn(comm: Communicator) -> None:
        sub = await comm.new_group(members)
        if comm.rank not in members:
            assert sub is None
        else:
            assert isinstance(sub, Communicator)
            assert sub.rank == members.index(comm.rank)
            assert sub.world_size == len(members)
            a = np.array([comm.rank + 1.0, 2.0 ** comm.rank])
            assert_exact(await sub.all_reduce(a),
                         np.array([sum(m + 1.0 for m in members),
                                   sum(2.0 ** m for m in members)]))
            got = await sub.all_gather(np.array([comm.rank]))
            assert_exact(got, np.array(members))  # in the new numbering's order
            b = np.array([comm.rank, -1])
            assert_exact(await sub.broadcast(b, root=0), np.array([members[0], -1]))
            assert await sub.all_gather_object(comm.rank) == members
            await sub.barrier()
        # the world goes on, and a second group over everyone in reverse works too
        assert_exact(await comm.all_reduce(np.array([1])), np.array([world_size]))
        rev = await comm.new_group(list(reversed(range(world_size))))
        assert rev is not None and rev.rank == world_size - 1 - comm.rank
        assert_exact(await rev.all_gather(np.array([comm.rank])),
                     np.arange(world_size)[::-1].copy())

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", MULTI)
async def test_disjoint_subgroups_run_concurrently(run, backend, tuning, world_size):
    evens, odds = list(range(0, world_size, 2)), list(range(1, world_size, 2))

    async def fn(comm: Communicator) -> None:
        g_even = await comm.new_group(evens)
        g_odd = await comm.new_group(odds)
        mine_members = evens if comm.rank % 2 == 0 else odds
        sub = g_even if comm.rank % 2 == 0 else g_odd
        other = g_odd if comm.rank % 2 == 0 else g_even
        assert other is None and sub is not None
        for k in range(5):
            a = np.full(50 * (k + 1), comm.rank + k, np.int64)
            expected = np.full(50 * (k + 1), sum(m + k for m in mine_members), np.int64)
            got, gathered, _ = await asyncio.gather(
                sub.all_reduce(a), sub.all_gather(np.array([comm.rank, k])), sub.barrier())
            assert_exact(got, expected)
            assert_exact(gathered, np.array([[m, k] for m in mine_members]).reshape(-1))
        assert_exact(await comm.all_reduce(np.array([1.0])), np.array([float(world_size)]))

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", [3, 4, 5, 8])
async def test_nested_subgroup(run, backend, tuning, world_size):
    outer = list(range(world_size - 1, 0, -1))  # [w-1, ..., 1]: rank 0 is not a member
    inner = [len(outer) - 1, 0]  # numbered in `outer`: world ranks [1, w-1]
    inner_world = [outer[i] for i in inner]

    async def fn(comm: Communicator) -> None:
        sub = await comm.new_group(outer)
        if sub is None:
            assert comm.rank == 0
        else:
            assert sub.rank == outer.index(comm.rank)
            subsub = await sub.new_group(inner)
            if comm.rank not in inner_world:
                assert subsub is None
            else:
                assert subsub is not None
                assert subsub.rank == inner_world.index(comm.rank)
                assert subsub.world_size == 2
                assert_exact(await subsub.all_gather(np.array([comm.rank])),
                             np.array(inner_world))
                assert_exact(await subsub.all_reduce(np.array([comm.rank])),
                             np.array([sum(inner_world)]))
            assert_exact(await sub.all_reduce(np.array([comm.rank])), np.array([sum(outer)]))
        assert_exact(await comm.all_reduce(np.array([comm.rank])),
                     np.array([sum(range(world_size))]))

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_new_group_with_different_member_lists_fails_everywhere(run, backend,
                                                                      world_size):
    async def fn(comm: Communicator) -> BaseException | None:
        members = list(range(world_size))
        if comm.rank == 0:
            members.reverse()
        try:
            await comm.new_group(members)
        except CollectiveError as exc:
            return exc
        return None

    results = await run(fn, world_size, backend, timeout=30)
    for r, exc in enumerate(results):
        assert isinstance(exc, CollectiveError), f"rank {r} got {exc!r}"


# ---------------------------------------------------------------- many collectives at once

def _mixed_collectives(comm: Communicator) -> list[tuple[Coroutine[Any, Any, Any],
                                                          Callable[[Any], None]]]:
    """20 collectives (and p2p pairs) with their checks, the same sequence on every rank."""
    w, r = comm.world_size, comm.rank
    right, left = (r + 1) % w, (r - 1) % w
    ranks = range(w)
    items: list[tuple[Coroutine[Any, Any, Any], Callable[[Any], None]]] = []

    def add(coro: Coroutine[Any, Any, Any], check: Callable[[Any], None]) -> None:
        items.append((coro, check))

    def eq(expected: Any) -> Callable[[Any], None]:
        return lambda got: assert_exact(got, expected)

    add(comm.all_reduce(np.full(7, r + 1.0)), eq(np.full(7, sum(j + 1.0 for j in ranks))))
    add(comm.all_reduce(np.arange(1000, dtype=np.int32) + r, ReduceOp.MAX),
        eq(np.arange(1000, dtype=np.int32) + w - 1))
    add(comm.all_gather(np.full((r + 1, 2), r, np.int16)),
        eq(np.concatenate([np.full((j + 1, 2), j, np.int16) for j in ranks])))
    add(comm.broadcast(np.full(5, r, np.float32), root=1 % w), eq(np.full(5, 1 % w, np.float32)))
    add(comm.barrier(), lambda got: None)
    add(comm.send(np.array([r, 3]), right, tag=3), lambda got: None)
    add(comm.recv(left, tag=3), eq(np.array([left, 3])))
    add(comm.all_reduce(np.array(1 + 1j * r)), eq(np.array(w + 1j * sum(ranks))))
    add(comm.reduce_scatter(np.arange(3 * w + 1, dtype=np.int64) * (r + 1)),
        eq(np.array_split(np.arange(3 * w + 1, dtype=np.int64) * sum(j + 1 for j in ranks),
                          w)[r]))
    add(comm.broadcast(np.array([r % 2 == 0, True, r == w - 1]), root=w - 1),
        eq(np.array([(w - 1) % 2 == 0, True, True])))
    add(comm.all_reduce(np.full(33, float(r), np.float16)),
        eq(np.full(33, float(sum(ranks)), np.float16)))
    add(comm.gather(np.array([r, -r]), root=0),
        lambda got: (assert_exact(np.stack(got), np.array([[j, -j] for j in ranks]))
                     if r == 0 else None))
    add(comm.all_gather_object({"r": r}), lambda got: None if got == [{"r": j} for j in ranks]
        else pytest.fail(f"all_gather_object got {got}"))
    add(comm.broadcast_object(f"from {r}", root=w // 2),
        lambda got: None if got == f"from {w // 2}" else pytest.fail(f"got {got!r}"))
    add(comm.all_to_all([np.array([r, j]) for j in ranks]),
        lambda got: [assert_exact(got[j], np.array([j, r])) for j in ranks])
    add(comm.scatter([np.array([j * 10]) for j in ranks] if r == 0 else None, root=0),
        eq(np.array([r * 10])))
    add(comm.all_reduce(np.full(100, 1 << (r % 8), np.uint8), ReduceOp.BXOR),
        eq(np.full(100, np.bitwise_xor.reduce([1 << (j % 8) for j in ranks]), np.uint8)))
    add(comm.send(np.arange(r + 2.0), right, tag=4), lambda got: None)
    add(comm.recv(left, tag=4), eq(np.arange(left + 2.0)))
    add(comm.reduce(np.full(3, r + 1), root=w - 1),
        lambda got: (assert_exact(got, np.full(3, sum(j + 1 for j in ranks)))
                     if r == w - 1 else None if got is None else pytest.fail("not None")))
    add(comm.all_reduce(np.arange(20000.0) * r),  # ring above the default small_bytes
        eq(np.arange(20000.0) * sum(ranks)))
    return items


@pytest.mark.parametrize("world_size", MULTI)
async def test_many_collectives_in_flight(run, backend, tuning, world_size):
    async def fn(comm: Communicator) -> None:
        for _ in range(2):
            items = _mixed_collectives(comm)
            assert len(items) >= 20
            results = await asyncio.gather(*(coro for coro, _ in items))
            for (_, check), got in zip(items, results, strict=True):
                check(got)

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", MULTI)
async def test_world_and_subgroup_collectives_in_flight_together(run, backend, tuning,
                                                                 world_size):
    members = list(range(world_size - 1, -1, -2))  # every other rank, from the top

    async def fn(comm: Communicator) -> None:
        sub = await comm.new_group(members)
        r = comm.rank
        world_coros = [comm.all_reduce(np.full(10, r + 1)), comm.barrier(),
                       comm.all_gather(np.array([r])), comm.all_reduce(np.arange(5000.0) + r)]
        sub_coros = []
        if sub is not None:
            sub_coros = [sub.all_reduce(np.full(10, 100 + r)), sub.barrier(),
                         sub.all_gather(np.array([r, r])), sub.broadcast(np.array([r]), root=0),
                         sub.all_reduce(np.arange(5000.0) * r)]
        got = await asyncio.gather(*world_coros, *sub_coros)
        w = comm.world_size
        assert_exact(got[0], np.full(10, sum(range(1, w + 1))))
        assert_exact(got[2], np.arange(w))
        assert_exact(got[3], np.arange(5000.0) * w + sum(range(w)))
        if sub is not None:
            assert_exact(got[4], np.full(10, sum(100 + m for m in members)))
            assert_exact(got[6], np.repeat(np.array(members), 2))
            assert_exact(got[7], np.array([members[0]]))
            assert_exact(got[8], np.arange(5000.0) * sum(members))

    await run(fn, world_size, backend, tuning=tuning)


# ----------------------------------------------------------------- fresh, unaliased results

@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_ring_reduce_scatter_result_outlives_later_calls(run, backend, world_size):
    """The ring reduce_scatter's partial sums pass through the transport's scratch pool,
    which later calls reuse; the block it returns does not: it stays intact."""
    tuning = Tuning(small_bytes=-1, segment_bytes=4096, min_segment_bytes=1,
                    crowded_segment_bytes=1)

    async def fn(comm: Communicator) -> None:
        w, r = comm.world_size, comm.rank
        n = 10_001
        first = await comm.reduce_scatter(np.full(n, r + 1, np.int64))
        kept = first.copy()
        assert_exact(first, np.full(np.array_split(np.empty(n), w)[r].size, w * (w + 1) // 2))
        for k in range(1, 4):
            again = await comm.reduce_scatter(np.full(n, 100 * k + r, np.int64))
            assert not np.shares_memory(first, again)
            assert_exact(again, np.full(first.size, 100 * k * w + w * (w - 1) // 2))
            assert_exact(first, kept)
        pool = getattr(comm.transport, "scratch", None)  # the MPI backend reduces natively
        assert pool is None or not any(np.shares_memory(first, buf) for buf in pool._free)

    await run(fn, world_size, backend, tuning=tuning)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_returned_arrays_are_writable_and_do_not_alias(run, backend, tuning, world_size):
    async def fn(comm: Communicator) -> tuple[list[np.ndarray], list[np.ndarray]]:
        w, r = comm.world_size, comm.rank
        inputs: list[np.ndarray] = []
        outputs: list[np.ndarray] = []

        def inp(a: np.ndarray) -> np.ndarray:
            inputs.append(a)
            return a

        outputs.append(await comm.all_gather(inp(np.full((2, 3), r, np.float64))))
        outputs.append(await comm.all_gather(inp(np.full((r + 1, 3), r, np.float64))))
        outputs.append(await comm.reduce_scatter(inp(np.ones((2 * w, 2), np.int32))))
        outputs.append(await comm.scatter(
            [inp(np.full(4, j, np.int64)) for j in range(w)] if r == 0 else None, root=0))
        outputs += await comm.all_to_all([inp(np.full(3, 10 * r + j, np.int32))
                                          for j in range(w)])
        gathered = await comm.gather(inp(np.full(3, r, np.float32)), root=w - 1)
        if gathered is not None:
            outputs += gathered
        if w > 1:
            await comm.send(inp(np.full(5, r, np.int16)), (r + 1) % w)
            outputs.append(await comm.recv((r - 1) % w))
        return inputs, outputs

    results = await run(fn, world_size, backend, tuning=tuning)
    inputs = [a for ins, _ in results for a in ins]
    outputs = [a for _, outs in results for a in outs]
    for a in outputs:
        assert isinstance(a, np.ndarray) and a.flags.writeable and a.flags.c_contiguous
        a[...] = a  # writing works
    for i, a in enumerate(outputs):
        for b in inputs:
            assert not np.shares_memory(a, b), "a result aliases an input array"
        for b in outputs[i + 1:]:
            assert not np.shares_memory(a, b), "two results share memory"


# ------------------------------------------------------ partial sums reduced as they are read

@pytest.mark.parametrize("dtype, op", [("float64", ReduceOp.SUM), ("int32", ReduceOp.PROD),
                                       ("complex128", ReduceOp.SUM), ("int16", ReduceOp.MAX),
                                       ("float32", ReduceOp.AVG)])
async def test_ring_reduces_partial_sums_as_it_reads(monkeypatch, dtype, op):
    """Over TCP the ring's partial sums (from Tuning.reduce_on_read_bytes) are combined into
    the array as they are read, a piece at a time, elements split between reads included:
    the results are bit-identical to reading each segment into scratch first, on every
    rank, and the receives say they were reduced that way."""
    # 1001-byte pieces: elements of every size straddle reads
    monkeypatch.setattr(tcp_module.BufferedFrameReader, "REDUCE_READ_BYTES", 1001)
    ring = dict(small_bytes=-1, direct_all_reduce="never", segment_bytes=24_000,
                min_segment_bytes=1, crowded_segment_bytes=1)
    on, off = Tuning(reduce_on_read_bytes=1, **ring), Tuning(reduce_on_read_bytes=1 << 62, **ring)
    flags: list[bool] = []
    get = Recv.get

    async def spying(self: Recv, **kw: Any) -> np.ndarray:
        got = await get(self, **kw)
        flags.append(self.reduced)
        return got

    monkeypatch.setattr(Recv, "get", spying)
    comms = await tcp_local_world(3, tuning=on)
    try:
        n = 100_003  # blocks and segments of uneven sizes
        for tuning in (on, off):
            flags.clear()
            results = {}

            async def fn(comm: Communicator, tuning: Tuning, results: dict) -> None:
                comm.tuning = tuning
                x = make_input(dtype, (n,), 3, comm.rank, op)
                results[comm.rank] = (await comm.all_reduce(x, op)).copy()

            await asyncio.gather(*(fn(c, tuning, results) for c in comms))
            if tuning is on:
                first = results
                # every partial sum that arrived after its receive was posted was reduced
                # as it was read (one that came earlier is read into scratch and added)
                assert sum(flags) >= 3 and len(flags) > sum(flags) >= len(flags) // 4
            else:
                assert not any(flags)
            expected = reference(op, [make_input(dtype, (n,), 3, j, op) for j in range(3)])
            for r in range(3):
                assert same_bits(results[r], results[0])
                if np.dtype(dtype).kind in "iu" or op is not ReduceOp.AVG:
                    assert_exact(results[r], expected, f"rank {r}")
        for r in range(3):
            assert same_bits(first[r], results[r])  # on and off: the same bits
    finally:
        await asyncio.gather(*(c.close() for c in comms))
