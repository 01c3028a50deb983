"""A small ``max_payload`` (the largest frame payload a TCP rank accepts) against the
frame sizes of ``Tuning``: the segmented collectives (all_reduce, reduce, reduce_scatter,
broadcast) carry arrays of any size with any ``max_payload`` from 512 bytes, with the values
a world with the default ``max_payload`` computes; calls that send a whole array still refuse
one larger than a frame."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import pytest

import asynccoll
from asynccoll import CollectiveError, Communicator, ReduceOp, Tuning
from asynccoll.transport import tcp as tcp_module
from asynccoll.tuning import fit_frames

KiB, MiB = 1 << 10, 1 << 20

#: a dtype of every item size (bool: 1 byte too, but no SUM)
DTYPES = [np.uint8, np.float16, np.int32, np.float64, np.complex128]


def _data(n: int, dtype: Any, rank: int) -> np.ndarray:
    """Small integers: their sums, in any order and any dtype, are exact."""
    return ((np.arange(n) % 7) + rank).astype(dtype)


def _cases(limit: int, largest: int) -> list[tuple[Any, int]]:
    """(dtype, element count) around the thresholds a frame size cuts: every item size at
    ``max_payload`` itself and at the tuning's ``small_bytes`` (128 KiB), one item below, at
    and above each; up to ``largest`` bytes, one item above the ring's segments (1 MiB)
    and the chain broadcast's threshold (4 MiB), an item size each (large arrays are slow
    over loopback in small frames)."""
    out = []
    for dtype in DTYPES:
        itemsize = np.dtype(dtype).itemsize
        for edge in (limit, 128 * KiB):
            out += [(dtype, n) for n in (edge // itemsize - 1, edge // itemsize,
                                         edge // itemsize + 1)]
    for k, edge in enumerate((1 * MiB, 4 * MiB)):
        dtype = DTYPES[2 * k + 1]
        if edge < largest:
            out.append((dtype, edge // np.dtype(dtype).itemsize + 1))
    return out


async def _every_collective(comm: Communicator, limit: int, largest: int) -> int:
    """all_reduce, reduce, reduce_scatter and broadcast of every dtype size at every size
    around the thresholds, each checked against NumPy; returns how many calls ran."""
    w, r = comm.world_size, comm.rank
    ran = 0
    for dtype, n in _cases(limit, largest):
        want = sum(_data(n, dtype, j) for j in range(w)).astype(dtype)
        a = _data(n, dtype, r)
        got = await comm.all_reduce(a)
        np.testing.assert_array_equal(got, want, err_msg=f"all_reduce {dtype} {n}")
        root = w - 1
        got = await comm.reduce(_data(n, dtype, r), root=root)
        if r == root:
            np.testing.assert_array_equal(got, want, err_msg=f"reduce {dtype} {n}")
        block = await comm.reduce_scatter(_data(n, dtype, r))
        np.testing.assert_array_equal(block, np.array_split(want, w)[r],
                                      err_msg=f"reduce_scatter {dtype} {n}")
        b = _data(n, dtype, r) if r == 1 % w else np.zeros(n, dtype)
        await comm.broadcast(b, root=1 % w)
        np.testing.assert_array_equal(b, _data(n, dtype, 1 % w),
                                      err_msg=f"broadcast {dtype} {n}")
        ran += 4
    return ran


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("world_size", "limit", "largest"), [
    (2, 512, 160 * KiB),
    (2, 4096, 5 * MiB),
    (3, 1000, 160 * KiB),  # not a multiple of the item sizes
    (3, 64 * KiB, 5 * MiB),
    (4, 4096, 1 * MiB + 16),
    (4, 1 * MiB, 5 * MiB),
])
async def test_segmented_collectives_carry_any_size(world_size: int, limit: int,
                                                    largest: int) -> None:
    """Every segmented collective, every item size, sizes around max_payload, small_bytes,
    the ring's segments and the chain broadcast's threshold. Arrays above max_payload used
    to fail (ValueError 'an array of N bytes is larger than one frame may carry') wherever a
    frame size of the tuning was above it: recursive doubling's whole arrays (small_bytes),
    the ring's segments (segment_bytes, and MAX_SEGMENTS for blocks of more than 64 frames),
    the reduce's blocks sent to the root, the broadcast's tree (2 ranks, or below
    chain_broadcast_bytes)."""
    async def fn(comm: Communicator) -> int:
        return await _every_collective(comm, limit, largest)

    ran = await asynccoll.run_local(fn, world_size, "tcp", timeout=10, max_payload=limit)
    assert ran[0] > 0 and len(set(ran)) == 1


@pytest.mark.timeout(30)
async def test_crowded_world_fits_max_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crowded world (ranks share cores): its ring and chain segments are at least
    crowded_segment_bytes (4 MiB) and its broadcast always takes the tree, both larger than
    a 64 KiB frame; they fit it."""
    monkeypatch.setattr(tcp_module, "_ranks_per_core", lambda: 2.0)

    async def fn(comm: Communicator) -> int:
        assert comm.transport.crowded
        return await _every_collective(comm, 64 * KiB, 1 * MiB + 16)

    assert (await asynccoll.run_local(fn, 3, "tcp", timeout=10, max_payload=64 * KiB))[0] > 0


@pytest.mark.timeout(30)
async def test_direct_all_reduce_fits_max_payload() -> None:
    """The direct all_reduce over TCP (``direct_all_reduce="always"``): its segments
    (direct_segment_bytes, 1 MiB) fit a 4 KiB frame."""
    async def fn(comm: Communicator) -> None:
        for n in (4095, 300 * KiB // 8, 3 * MiB // 8):
            a = _data(n, np.float64, comm.rank)
            want = sum(_data(n, np.float64, j) for j in range(comm.world_size))
            np.testing.assert_array_equal(await comm.all_reduce(a), want)

    await asynccoll.run_local(fn, 3, "tcp", timeout=10, max_payload=4096,
                              tuning=Tuning(direct_all_reduce="always"))


async def _float_results(world_size: int, **options: Any) -> list[list[np.ndarray]]:
    """all_reduce, reduce (onto rank 0), reduce_scatter of random floats whose sums round,
    and AVG, at sizes above max_payload: every rank's results."""
    sizes = [(np.float32, 300 * KiB // 4), (np.float64, 3 * MiB // 8 + 1)]
    if world_size == 2:  # two ranks add in one order whatever the algorithm
        sizes += [(np.float32, 40 * KiB // 4), (np.float64, 1000)]

    async def fn(comm: Communicator) -> list[np.ndarray]:
        out = []
        for dtype, n in sizes:
            a = np.random.default_rng([comm.rank, n]).standard_normal(n).astype(dtype)
            out.append(await comm.all_reduce(a.copy()))
            out.append(await comm.all_reduce(a.copy(), op=ReduceOp.AVG))
            got = await comm.reduce(a.copy(), root=0)
            out.append(got if got is not None else np.zeros(0, dtype))
            out.append(await comm.reduce_scatter(a))
        return out

    return await asynccoll.run_local(fn, world_size, "tcp", timeout=10, **options)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [2, 4])
async def test_results_are_bit_identical_to_the_default_max_payload(world_size: int) -> None:
    """Segmenting changes no bits: the same random floats reduce to the same bits with a
    4 KiB frame as with the default 4 GiB, on every rank (the algorithm is the same; see
    docs/collectives.md for the sizes where a small frame changes it)."""
    small = await _float_results(world_size, max_payload=4096)
    default = await _float_results(world_size)
    for rank, (mine, theirs) in enumerate(zip(small, default, strict=True)):
        for k, (x, y) in enumerate(zip(mine, theirs, strict=True)):
            assert x.tobytes() == y.tobytes(), (rank, k)


@pytest.mark.timeout(30)
async def test_gather_of_arrays_that_fit_gathers_more_than_a_frame() -> None:
    """A gather whose arrays each fit a frame but whose gathered bytes do not: it used to
    relay blocks along recursive doubling's pairs in bundles larger than a frame (up to
    small_bytes gathered) and failed; it now goes straight to the root."""
    async def fn(comm: Communicator) -> list[np.ndarray] | None:
        return await comm.gather(np.full(4096 // 8, comm.rank, np.float64), root=0)

    got = await asynccoll.run_local(fn, 4, "tcp", timeout=10, max_payload=4096)
    assert got[1:] == [None] * 3
    assert got[0] is not None
    for j, block in enumerate(got[0]):
        np.testing.assert_array_equal(block, np.full(512, j, np.float64))


@pytest.mark.timeout(30)
async def test_whole_array_calls_still_refuse_an_array_larger_than_a_frame() -> None:
    """scatter, all_to_all, gather, all_gather and send carry each array in one frame: one
    larger than max_payload is still a ValueError on the rank that sends it (CollectiveError
    on the others, for a collective)."""
    big = np.ones(4097, np.uint8)
    calls = {
        "scatter": lambda c: c.scatter([big] * c.world_size if c.rank == 0 else None),
        "all_to_all": lambda c: c.all_to_all([big] * c.world_size),
        "gather": lambda c: c.gather(big),
        "all_gather": lambda c: c.all_gather(big),
    }
    for name, call in calls.items():
        async def fn(comm: Communicator, call: Any = call) -> str:
            try:
                await call(comm)
            except ValueError as exc:
                assert "max_payload" in str(exc)
                return "ValueError"
            except CollectiveError:
                return "CollectiveError"
            return "returned"

        got = await asynccoll.run_local(fn, 3, "tcp", timeout=10, max_payload=4096)
        assert "ValueError" in got and "returned" not in got, (name, got)

    async def p2p(comm: Communicator) -> None:
        if comm.rank == 0:
            with pytest.raises(ValueError, match="max_payload"):
                await comm.send(big, 1)

    await asynccoll.run_local(p2p, 2, "tcp", timeout=10, max_payload=4096)


# ----------------------------------------------------------------------- the effective tuning

FRAME_FIELDS = ("small_bytes", "segment_bytes", "crowded_segment_bytes", "chain_segment_bytes",
                "direct_segment_bytes")


def test_fit_frames_lowers_only_the_frame_sizes_above_the_limit() -> None:
    """``fit_frames``: the tuning itself where every frame size fits (no copy: the default
    tuning and max_payload cost nothing per call), else a copy with those above the limit
    lowered to it and every other field as set."""
    default = Tuning()
    assert fit_frames(default, 4 << 30) is default
    assert fit_frames(default, 4 * MiB) is default
    custom = Tuning(small_bytes=-1, segment_bytes=100, chain_segment_bytes=5000,
                    crowded_segment_bytes=200, direct_segment_bytes=300, poll_us=7)
    fitted = fit_frames(custom, 1000)
    assert fitted == Tuning(small_bytes=-1, segment_bytes=100, chain_segment_bytes=1000,
                            crowded_segment_bytes=200, direct_segment_bytes=300, poll_us=7)
    small = fit_frames(default, 512)
    for f in fields(Tuning):
        want = min(getattr(default, f.name), 512) if f.name in FRAME_FIELDS \
            else getattr(default, f.name)
        assert getattr(small, f.name) == want, f.name
    assert fit_frames(small, 512) is small


async def test_comm_tuning_returns_what_was_set_and_runs_it_fitted() -> None:
    """``comm.tuning`` returns the tuning as set, at construction or later; the collectives
    run it fitted to max_payload (the object itself with the default max_payload), and
    new_group's communicators get the tuning as set too."""
    mine = Tuning(poll_us=10)

    async def fn(comm: Communicator) -> None:
        assert comm.tuning is mine
        assert comm._tuning == fit_frames(mine, 4096) and comm._tuning.small_bytes == 4096
        other = Tuning(segment_bytes=2 * MiB, chain_segment_bytes=100)
        comm.tuning = other
        assert comm.tuning is other
        assert comm._tuning == Tuning(small_bytes=4096, segment_bytes=4096,
                                      crowded_segment_bytes=4096, chain_segment_bytes=100,
                                      direct_segment_bytes=4096)
        group = await comm.new_group([0, 1])
        assert group is not None and group.tuning is other
        await group.close()
        a = np.ones(100_000)
        np.testing.assert_array_equal(await comm.all_reduce(a), np.full(100_000, 2.0))

    await asynccoll.run_local(fn, 2, "tcp", timeout=10, max_payload=4096, tuning=mine)

    async def plain(comm: Communicator) -> None:
        assert comm.tuning is mine and comm._tuning is mine

    await asynccoll.run_local(plain, 2, "tcp", timeout=10, tuning=mine)
    await asynccoll.run_local(plain, 2, "memory", timeout=10, tuning=mine)


@pytest.mark.parametrize("backend", ["memory", "tcp"])
async def test_setting_a_tuning_that_is_no_tuning_is_a_type_error_at_once(backend: str) -> None:
    """``comm.tuning = "x"`` (or None, or a dict) was taken and failed at the next collective
    (AttributeError: 'str' object has no attribute 'all_reduce'); it is a TypeError at once,
    and the communicator keeps its tuning and works."""
    mine = Tuning(poll_us=5)

    async def fn(comm: Communicator) -> None:
        for bad in ("x", None, {"small_bytes": 1}, Tuning):
            with pytest.raises(TypeError, match=r"tuning must be an asynccoll\.Tuning"):
                comm.tuning = bad  # type: ignore[assignment]
            assert comm.tuning is mine
        np.testing.assert_array_equal(await comm.all_reduce(np.ones(3)), np.full(3, 2.0))

    await asynccoll.run_local(fn, 2, backend, timeout=10, tuning=mine)


# ------------------------------------------------------------------- ranks per machine

@pytest.mark.parametrize(("asynccoll_var", "plain_var", "named"), [
    ("abc", None, "ASYNCCOLL_LOCAL_WORLD_SIZE"),
    ("0", None, "ASYNCCOLL_LOCAL_WORLD_SIZE"),
    ("2.5", "4", "ASYNCCOLL_LOCAL_WORLD_SIZE"),
    (None, "four", "LOCAL_WORLD_SIZE"),
    (None, "-3", "LOCAL_WORLD_SIZE"),
])
async def test_a_local_world_size_that_is_no_count_is_refused(
        monkeypatch: pytest.MonkeyPatch, asynccoll_var: str | None, plain_var: str | None,
        named: str) -> None:
    """ASYNCCOLL_LOCAL_WORLD_SIZE (else LOCAL_WORLD_SIZE), the ranks on this machine, sets
    whether a TCP rank polls, spins and hands its core over, and whether the world is
    crowded (larger segments). A value that is no positive integer was taken as 1 in
    silence; it is a ValueError naming the variable, before a TCP world forms."""
    for name, value in (("ASYNCCOLL_LOCAL_WORLD_SIZE", asynccoll_var),
                        ("LOCAL_WORLD_SIZE", plain_var)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{named} must be a positive integer"):
        tcp_module.TcpTransport(0, 2)
    with pytest.raises(ValueError, match=f"^{named} must be a positive integer"):
        await asynccoll.run_local(lambda c: c.barrier(), 2, "tcp", timeout=5)


async def test_a_valid_local_world_size_wins_over_a_bad_plain_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ASYNCCOLL_LOCAL_WORLD_SIZE wins: a LOCAL_WORLD_SIZE of another launcher beside it is
    not read, good or bad."""
    monkeypatch.setenv("ASYNCCOLL_LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "abc")
    assert not tcp_module.TcpTransport(0, 2).yields
    assert await asynccoll.run_local(lambda c: c.barrier(), 2, "tcp", timeout=5) == [None] * 2


async def test_init_refuses_a_bad_local_world_size_before_hosting_the_rendezvous(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``init`` on rank 0 raises before it hosts the rendezvous (other ranks would otherwise
    find it, connect, and wait for a rank that is gone)."""
    from asynccoll.rendezvous import RendezvousServer

    async def hosted(self: Any) -> None:
        raise AssertionError("the rendezvous was started")

    monkeypatch.setattr(RendezvousServer, "start", hosted)
    monkeypatch.setenv("ASYNCCOLL_LOCAL_WORLD_SIZE", "x8")
    with pytest.raises(ValueError, match=r"^ASYNCCOLL_LOCAL_WORLD_SIZE must be a positive"):
        await asynccoll.init(backend="tcp", rank=0, world_size=2, addr="127.0.0.1", port=0,
                             timeout=5)
