"""MPI-specific checks of the ``"mpi"`` backend, run by every process of an MPI job.

Not collected by a plain ``pytest`` (the name does not match ``test_*.py``):
``tests/test_mpi.py`` starts ``mpirun -n 3 python -m pytest tests/mpi_world.py ...``. Each test
runs its ``fn`` on this process's rank through ``conftest.run_world(fn, 3, "mpi")``, which
all-gathers the per-rank results, so the assertions after it see every rank's outcome. Outside
an MPI job every test here skips.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from conftest import MPI_WORLD_SIZE, run_world

import asynccoll
from asynccoll import (
    CollectiveError,
    CollectiveTimeout,
    Communicator,
    CommunicatorClosedError,
    ReduceOp,
)

pytestmark = pytest.mark.skipif(MPI_WORLD_SIZE != 3,
                                reason="runs in a 3-process MPI job (tests/test_mpi.py starts it)")

W = 3


async def test_mpi_init_takes_the_world_from_mpi() -> None:
    from mpi4py import MPI

    async def fn(comm: Communicator) -> tuple[int, int, str]:
        return comm.rank, comm.world_size, comm.backend

    got = await run_world(fn, W, "mpi")
    assert got == [(r, W, "mpi") for r in range(W)]
    me = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(ValueError, match="rank"):
        await asynccoll.init(backend="mpi", rank=me + 1)
    with pytest.raises(ValueError, match="world_size"):
        await asynccoll.init(backend="mpi", world_size=W + 1)
    with pytest.raises(ValueError, match="addr"):
        await asynccoll.init(backend="mpi", addr="127.0.0.1")
    # not an intracommunicator: a TypeError naming it (an AttributeError, an MPI error before)
    for comm in (5, MPI.COMM_NULL, MPI.COMM_WORLD.Get_group()):
        with pytest.raises(TypeError, match="comm must be an mpi4py intracommunicator"):
            await asynccoll.init(backend="mpi", comm=comm)


async def test_mpi_many_collectives_in_flight_issue_in_call_order() -> None:
    """Forty collectives of mixed kinds (one and two MPI stages, some with a size exchange)
    gathered at once: MPI sees them in the same order on every rank."""
    def inputs(r: int) -> list[Any]:
        rng = np.random.default_rng(r)
        return [rng.standard_normal(1000 + 37 * k) for k in range(10)]

    async def fn(comm: Communicator) -> list[Any]:
        r = comm.rank
        coros: list[Any] = []
        for k, a in enumerate(inputs(r)):
            coros += [comm.all_reduce(a),                       # float: two stages
                      comm.all_reduce(np.full(k + 1, r, np.int64)),
                      comm.all_gather(np.full((r + k, 2), r, np.int16)),
                      comm.broadcast_object({"k": k, "from": r}, root=k % W)]
        return await asyncio.gather(*coros)

    got = await run_world(fn, W, "mpi")
    per_rank = [inputs(r) for r in range(W)]
    for k in range(10):
        total = sum(per_rank[r][k] for r in range(W))
        for r in range(W):
            res = got[r][4 * k:4 * k + 4]
            np.testing.assert_allclose(res[0], total, rtol=1e-12)
            assert res[0].tobytes() == got[0][4 * k].tobytes(), "ranks differ"
            np.testing.assert_array_equal(res[1], np.full(k + 1, sum(range(W))))
            np.testing.assert_array_equal(
                res[2], np.concatenate([np.full((j + k, 2), j, np.int16) for j in range(W)]))
            assert res[3] == {"k": k, "from": k % W}


async def test_mpi_barrier_nobody_leaves_before_everyone_entered() -> None:
    """Across processes: CLOCK_MONOTONIC is one clock for the processes of one machine."""
    rounds = 4

    async def fn(comm: Communicator) -> list[tuple[float, float]]:
        out = []
        for k in range(rounds):
            await asyncio.sleep(0.05 * ((comm.rank + k) % W == 0))  # a different straggler
            entered = time.monotonic()
            await comm.barrier()
            out.append((entered, time.monotonic()))
        return out

    got = await run_world(fn, W, "mpi")
    for k in range(rounds):
        assert min(got[r][k][1] for r in range(W)) >= max(got[r][k][0] for r in range(W))


async def test_mpi_mismatched_signatures_fail_everywhere_before_data_moves() -> None:
    async def fn(comm: Communicator) -> tuple[str, bool]:
        a = np.full(4 + (comm.rank == 1), 7.0)
        before = a.copy()
        try:
            await comm.all_reduce(a)
        except CollectiveError as exc:
            return str(exc), bool(np.array_equal(a, before))
        return "no error", False

    for r, (msg, untouched) in enumerate(await run_world(fn, W, "mpi")):
        assert "all_reduce" in msg and "(4,)" in msg and "(5,)" in msg, f"rank {r}: {msg}"
        assert untouched, f"rank {r}: the buffer was written"


async def test_mpi_mismatched_collectives_and_roots_fail_everywhere() -> None:
    async def fn(comm: Communicator) -> list[str]:
        out = []
        sub = await comm.new_group([0, 1, 2])
        assert sub is not None
        try:
            await sub.broadcast(np.zeros(3), root=0 if sub.rank else 1)
        except CollectiveError as exc:
            out.append(str(exc))
        try:
            await comm.barrier()
        except CollectiveError as exc:
            out.append(str(exc))
        return out

    for r, msgs in enumerate(await run_world(fn, W, "mpi")):
        assert len(msgs) == 2, f"rank {r}: {msgs}"
        assert "broadcast" in msgs[0]
        assert "broken" in msgs[1], "a later call on the broken world must fail at once"


async def test_mpi_timeout_and_the_others_learn_promptly() -> None:
    """Ranks 1 and 2 wait for rank 0, who never comes: CollectiveTimeout after ``timeout``
    (or, on one of them, the CollectiveError the other's abort message brings just before);
    rank 0's next collective fails at once instead of waiting for its own timeout."""
    async def fn(comm: Communicator) -> tuple[str, float]:
        t0 = time.monotonic()
        try:
            if comm.rank == 0:
                await asyncio.sleep(2.5)
                await comm.barrier()
            else:
                await comm.all_reduce(np.ones(3))
        except CollectiveError as exc:
            return type(exc).__name__, time.monotonic() - t0
        return "no error", 0.0

    got = await run_world(fn, W, "mpi", timeout=1.0)
    # both time out at about the same moment: one may learn of the other's failure first
    assert "CollectiveTimeout" in (got[1][0], got[2][0]), got
    for r in (1, 2):
        assert got[r][0] in ("CollectiveTimeout", "CollectiveError"), got
        assert 0.9 < got[r][1] < 2.4, got
    assert got[0][0] == "CollectiveError" and got[0][1] < 3.4, got


async def test_mpi_cancelled_collective_breaks_the_communicator_for_everyone() -> None:
    async def fn(comm: Communicator) -> tuple[str, float]:
        t0 = time.monotonic()
        a = np.ones(100_000)
        try:
            if comm.rank == 0:
                async with asyncio.timeout(0.3):
                    await comm.all_reduce(a)
            else:
                await asyncio.sleep(1.0)
                await comm.all_reduce(a)
        except TimeoutError:
            return "cancelled", time.monotonic() - t0
        except CollectiveError as exc:
            return type(exc).__name__ + ": " + str(exc), time.monotonic() - t0
        return "no error", 0.0

    got = await run_world(fn, W, "mpi", timeout=15.0)
    assert got[0][0] == "cancelled" and got[0][1] < 1.0, got
    for r in (1, 2):
        assert got[r][0].startswith("CollectiveError") and "cancelled" in got[r][0], got
        assert got[r][1] < 5.0, "the peers must not wait for their own timeout"


async def test_mpi_send_recv_large_messages_never_wait_for_the_receiver() -> None:
    """Everybody sends 8 MB to the right before anybody receives (MPI's rendezvous protocol
    would block a plain MPI_Send here); tags reorder; 64-bit tags; 0-d and empty arrays."""
    big = 1 << 20

    async def fn(comm: Communicator) -> list[np.ndarray]:
        r = comm.rank
        right, left = (r + 1) % W, (r - 1) % W
        await comm.send(np.arange(big, dtype=np.float64) + r, right, tag=1)
        await comm.send(np.array(r + 0.5), right, tag=(1 << 63) - 1)
        await comm.send(np.zeros((0, 3), np.complex64), right, tag=2)
        a = np.full(5, r)
        await comm.send(a, right, tag=3)
        a[:] = -1  # the send took a copy
        return [await comm.recv(left, tag=3), await comm.recv(left, tag=2),
                await comm.recv(left, tag=(1 << 63) - 1), await comm.recv(left, tag=1)]

    got = await run_world(fn, W, "mpi")
    for r in range(W):
        left = (r - 1) % W
        np.testing.assert_array_equal(got[r][0], np.full(5, left))
        assert got[r][1].shape == (0, 3) and got[r][1].dtype == np.complex64
        assert got[r][2].shape == () and got[r][2] == left + 0.5
        np.testing.assert_array_equal(got[r][3], np.arange(big, dtype=np.float64) + left)


async def test_mpi_recv_timeout() -> None:
    async def fn(comm: Communicator) -> str:
        if comm.rank == 1:
            try:
                await comm.recv(0, tag=9)
            except CollectiveTimeout as exc:
                return str(exc)
        await asyncio.sleep(1.2)
        return ""

    got = await run_world(fn, W, "mpi", timeout=0.5)
    assert "recv from group rank 0 (tag 9)" in got[1]


async def test_mpi_reductions_follow_numpy_semantics() -> None:
    """NaN propagates through MIN/MAX as in NumPy; 8/16-bit sums wrap; float16 and complex
    MIN/MAX work (user-defined ops); results are bit-identical on every rank."""
    def data(r: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([5, r])
        return {
            "nan": np.array([1.0, np.nan if r == 1 else 2.0, -np.inf, 0.0]),
            "i8": np.full(100, 100, np.int8),
            "u16": np.full(100, 40000, np.uint16),
            "f16": rng.uniform(-1, 1, 257).astype(np.float16),
            "c64": (rng.standard_normal(9) + 1j * rng.standard_normal(9)).astype(np.complex64),
        }

    async def fn(comm: Communicator) -> list[np.ndarray]:
        d = data(comm.rank)
        return [await comm.all_reduce(d["nan"].copy(), ReduceOp.MIN),
                await comm.all_reduce(d["nan"].copy(), ReduceOp.MAX),
                await comm.all_reduce(d["i8"]), await comm.all_reduce(d["u16"]),
                await comm.all_reduce(d["f16"].copy(), ReduceOp.SUM),
                await comm.all_reduce(d["c64"].copy(), ReduceOp.MAX),
                await comm.all_reduce(d["c64"].copy(), ReduceOp.PROD)]

    got = await run_world(fn, W, "mpi")
    every = [data(r) for r in range(W)]
    expect = [np.minimum.reduce([e["nan"] for e in every]),
              np.maximum.reduce([e["nan"] for e in every]),
              np.add.reduce([e["i8"] for e in every], dtype=np.int8),
              np.add.reduce([e["u16"] for e in every], dtype=np.uint16),
              None,
              np.maximum.reduce([e["c64"] for e in every]),
              None]
    for r in range(W):
        for k, want in enumerate(expect):
            assert got[r][k].tobytes() == got[0][k].tobytes(), f"case {k}: ranks differ"
            if want is not None:
                np.testing.assert_array_equal(got[r][k], want, err_msg=f"case {k}")
        np.testing.assert_allclose(got[r][4], sum(e["f16"].astype(np.float64) for e in every),
                                   atol=0.02)
        np.testing.assert_allclose(got[r][6], np.multiply.reduce([e["c64"] for e in every]),
                                   rtol=1e-5)


async def test_mpi_closed_communicator_and_bytes_sent() -> None:
    async def fn(comm: Communicator) -> tuple[int, int]:
        before = comm.transport.bytes_sent
        await comm.all_reduce(np.ones(10))
        after = comm.transport.bytes_sent
        sub = await comm.new_group([2, 0])
        if sub is not None:
            await sub.close()
            await sub.close()  # idempotent
            with pytest.raises(CommunicatorClosedError):
                await sub.barrier()
        return before, after

    for before, after in await run_world(fn, W, "mpi"):
        assert after - before == 80


async def test_mpi_closing_a_group_lets_its_calls_in_flight_finish() -> None:
    """As on memory and tcp, a subgroup closed while one of its collectives waits for a late
    peer does not cut it short: the call completes (here a float all_reduce, whose second MPI
    stage is issued after the close) and the world stays usable. It used to issue on the freed
    communicator: MPI_ERR_COMM, and the whole world broken."""
    async def fn(comm: Communicator) -> tuple[Any, Any, list[float]]:
        sub = await comm.new_group([2, 0, 1])
        assert sub is not None
        a = np.full(5, comm.rank + 1.0)
        b = np.full(3, comm.rank, np.int64)
        if comm.rank == 0:
            calls = asyncio.gather(sub.all_reduce(a), sub.all_gather(b))
            await asyncio.sleep(0.3)
            await sub.close()
            got = await calls
        else:
            await asyncio.sleep(0.8)
            got = await asyncio.gather(sub.all_reduce(a), sub.all_gather(b))
            await sub.close()
        world = await comm.all_reduce(np.ones(2))
        return got[0], got[1], world.tolist()

    for r, (reduced, gathered, world) in enumerate(await run_world(fn, W, "mpi", timeout=10.0)):
        np.testing.assert_array_equal(reduced, np.full(5, 6.0), err_msg=f"rank {r}")
        np.testing.assert_array_equal(gathered, np.repeat([2, 0, 1], 3), err_msg=f"rank {r}")
        assert world == [3.0, 3.0], f"rank {r}"


async def test_mpi_closing_the_world_fails_calls_in_flight_and_tells_the_others() -> None:
    """As on memory and tcp, closing the world communicator while calls wait (on it, on a
    subgroup, a recv) makes them raise CommunicatorClosedError at once, and a subgroup of the
    closed world is closed too; the other ranks' calls raise CollectiveError promptly. They
    used to wait for their whole timeout (CollectiveTimeout), and the subgroup kept working."""
    async def fn(comm: Communicator) -> list[tuple[str, float]]:
        sub = await comm.new_group([1, 0, 2])
        assert sub is not None
        t0 = time.monotonic()
        out = []
        if comm.rank == 0:
            calls = [asyncio.ensure_future(c) for c in (
                comm.all_reduce(np.ones(4)), sub.broadcast(np.ones(3), root=2),
                comm.recv(1, tag=5))]
            await asyncio.sleep(0.3)
            await comm.close()
            for call in calls:
                try:
                    await call
                    out.append(("no error", 0.0))
                except CollectiveError as exc:
                    out.append((type(exc).__name__, time.monotonic() - t0))
            try:
                await sub.barrier()
            except CollectiveError as exc:
                out.append((type(exc).__name__, 0.0))
        else:
            await asyncio.sleep(0.6)
            try:
                await comm.all_reduce(np.ones(4))
                out.append(("no error", 0.0))
            except CollectiveError as exc:
                out.append((type(exc).__name__ + ": " + str(exc), time.monotonic() - t0))
        return out

    got = await run_world(fn, W, "mpi", timeout=8.0)
    assert [name for name, _ in got[0]] == ["CommunicatorClosedError"] * 4, got[0]
    assert all(dt < 1.5 for _, dt in got[0]), got[0]
    for r in (1, 2):
        (msg, dt), = got[r]
        assert msg.startswith("CollectiveError") and "closed" in msg, f"rank {r}: {msg}"
        assert dt < 3.0, f"rank {r} waited {dt:.1f} s: its timeout, not the abort message"


async def test_mpi_timeout_counts_from_the_last_progress_as_on_tcp() -> None:
    """The last rank calls six all_reduces 0.3 s apart; the others call all six at once. With
    timeout=1.0 the last one completes 1.8 s after it was called, but the world never went
    more than 0.3 s without progress: as on memory and tcp, no CollectiveTimeout. The mpi
    backend used to count each call's timeout from its call (CollectiveTimeout at 1.0 s)."""
    async def fn(comm: Communicator) -> tuple[list[float], float]:
        t0 = time.monotonic()
        if comm.rank == W - 1:
            out = []
            for k in range(6):
                await asyncio.sleep(0.3)
                out.append(await comm.all_reduce(np.full(4, k, np.float64)))
        else:
            out = await asyncio.gather(*(comm.all_reduce(np.full(4, k, np.float64))
                                         for k in range(6)))
        return [float(a[0]) for a in out], time.monotonic() - t0

    for r, (sums, took) in enumerate(await run_world(fn, W, "mpi", timeout=1.0)):
        assert sums == [W * k for k in range(6)], f"rank {r}: {sums}"
        assert took > 1.5, f"rank {r}: took {took:.2f} s: the calls were not held up"


async def test_mpi_overlapping_subgroups_made_one_after_another() -> None:
    """Pairs of ranks made into groups over and over ([0, 1], then [0, 2], then [1, 2]), all
    kept: the ranks then hold different numbers of communicators, so MPI needs several rounds
    to agree on each new one's context id. The group's duplicates (MPI_Comm_idup) used to be
    issued all at once, and Open MPI 4.1 matches the rounds of concurrent idups on one
    communicator in whatever order each rank progresses them: one rank's new_group now and
    then never completed (CollectiveTimeout 'MPI communicator creation made no progress',
    about one job in six for three pairs; here 36 pairs)."""
    pairs = [[0, 1], [0, 2], [1, 2]]

    async def fn(comm: Communicator) -> list[float]:
        made = []
        sums = []
        for _ in range(12):
            for members in pairs:
                sub = await comm.new_group(members)
                if sub is not None:
                    made.append(sub)
                    sums.append(float((await sub.all_reduce(np.full(2, comm.rank + 1.0)))[0]))
        for sub in made:
            await sub.close()
        return sums

    got = await run_world(fn, W, "mpi", timeout=5.0)
    for r, sums in enumerate(got):
        want = [float(sum(m + 1 for m in p)) for _ in range(12) for p in pairs if r in p]
        assert sums == want, f"rank {r}: {sums}"


async def test_mpi_a_rank_that_gave_up_leaves_the_next_world_working() -> None:
    """Rank 1's recv times out (it breaks the world and sends the others its abort message)
    while ranks 0 and 2, which never look, close the world. The next world's communicators
    used to hang (new_group: CollectiveTimeout, every time): the world's ``ctrl``
    communicator was freed on 0 and 2 with the abort on its way, and Open MPI handed that
    message to the next communicator given the freed context id, in place of a real one."""
    from mpi4py import MPI

    first = await asynccoll.init(backend="mpi", timeout=0.3)
    if first.rank == 1:
        with pytest.raises(CollectiveTimeout):
            await first.recv(0, tag=9)
    await asyncio.sleep(0.8)
    await first.close()
    MPI.COMM_WORLD.Barrier()

    async def fn(comm: Communicator) -> list[float]:
        made, sums = [], []
        for _ in range(12):
            for members in ([0, 1], [0, 2], [1, 2]):
                sub = await comm.new_group(members)
                if sub is not None:
                    made.append(sub)
                    sums.append(float((await sub.all_reduce(np.ones(2)))[0]))
        for sub in made:
            await sub.close()
        return sums

    for r, sums in enumerate(await run_world(fn, W, "mpi", timeout=5.0)):
        assert sums == [2.0] * 24, f"rank {r}: {sums}"



@pytest.mark.parametrize("in_group", [False, True])
async def test_mpi_a_timeout_names_the_call_and_its_group(in_group: bool) -> None:
    """As on memory and tcp, a timeout names the call's sequence number and its group, so
    the ranks' lines can be matched call by call. The mpi backend said only
    'all_reduce(...) on group rank 1 made no progress within 0.5 s'."""
    timeout = 0.5

    async def fn(comm: Communicator) -> tuple[str, str] | None:
        group = comm
        if in_group:  # world ranks 2 and 0, renumbered 0 and 1; world rank 1 stays out
            sub = await comm.new_group([2, 0])
            if sub is None:
                return None
            group = sub
        group.timeout = timeout
        await group.all_reduce(np.ones(5))  # sequence number 0: completes
        if group.rank == 0:
            await asyncio.sleep(timeout * 2.5)  # alive, but never calls
            return None
        try:
            await group.all_reduce(np.ones((2, 3), np.float32))
        except CollectiveError as exc:
            return type(exc).__name__, str(exc)
        return "no error", ""

    got = await run_world(fn, W, "mpi", timeout=10.0)
    where = "of the group of world ranks [2, 0]" if in_group else "of the world"
    waited = [res for res in got if res is not None]
    assert len(waited) == (1 if in_group else 2), got
    assert "CollectiveTimeout" in [name for name, _ in waited], got
    for _, text in waited:  # (or the other's timeout, relayed just before its own)
        assert "all_reduce(<f4, (2, 3), sum) on group rank " in text, text
        assert "made no progress within 0.5 s" in text, text
        assert f"(sequence number 1 {where})" in text, text


async def test_mpi_a_relayed_failure_names_the_call_it_ended() -> None:
    """As on memory and tcp, a failure of another rank that ends a call in flight starts
    with that call (its signature, group rank and sequence number): the world closed by
    rank 0 (a recv in flight) under the others' all_reduce used to read only 'the
    communicator is broken: world rank 0 failed: ...', not which call of theirs it ended."""
    async def fn(comm: Communicator) -> str:
        sub = await comm.new_group([1, 2])
        await comm.barrier()  # sequence numbers 0 (new_group) and 1 of the world
        if comm.rank == 0:
            waiting = asyncio.ensure_future(comm.recv(1, tag=5))  # a call in flight
            await asyncio.sleep(0.3)
            await comm.close()
            with pytest.raises(CommunicatorClosedError):
                await waiting
            return ""
        assert sub is not None
        await sub.barrier()  # sequence number 0 of the group
        try:
            await sub.all_reduce(np.ones(3, np.int64))  # rank 0 is not in it: completes
            await comm.all_reduce(np.ones(4))  # rank 0 never calls it
        except CollectiveError as exc:
            return type(exc).__name__ + ": " + str(exc)
        return "no error"

    got = await run_world(fn, W, "mpi", timeout=8.0)
    for r in (1, 2):
        assert got[r].startswith(f"CollectiveError: all_reduce(<f8, (4,), sum) on group rank "
                                 f"{r} (sequence number 2 of the world): "), got[r]
        assert "closed" in got[r], got[r]


async def test_mpi_a_call_in_flight_names_itself_when_another_rank_cancelled_the_same_call(
        ) -> None:
    """Rank 0's barrier is cancelled while rank 1 waits in its own barrier (rank 2 comes
    later). Rank 1's error relays 'world rank 0 failed: barrier() was cancelled on group
    rank 0', which names a call of the same signature: it used to be left at that, without
    rank 1's group rank and sequence number; it now starts with rank 1's own call."""
    async def fn(comm: Communicator) -> str:
        await comm.barrier()  # sequence number 0: completes
        if comm.rank == 0:
            waiting = asyncio.ensure_future(comm.barrier())
            await asyncio.sleep(0.2)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            return ""
        if comm.rank == 2:
            await asyncio.sleep(0.8)  # comes after the world broke
            with pytest.raises(CollectiveError):
                await comm.barrier()
            return ""
        with pytest.raises(CollectiveError) as raised:
            await comm.barrier()
        return str(raised.value)

    text = (await run_world(fn, W, "mpi", timeout=8.0))[1]
    assert text.startswith("barrier() on group rank 1 (sequence number 1 of the world): the "
                           "communicator is broken: world rank 0 failed: barrier() was "
                           "cancelled on group rank 0"), text


async def test_mpi_a_call_refused_by_a_broken_world_names_itself() -> None:
    """A call started after the world broke starts with its name ("all_reduce: the
    communicator is broken: ..."), as on memory and tcp; it used to say only 'the communicator
    is broken: ...'. The class stays CollectiveError."""
    async def fn(comm: Communicator) -> list[str]:
        if comm.rank == 0:
            waiting = asyncio.ensure_future(comm.all_gather(np.ones(2)))
            await asyncio.sleep(0.1)
            waiting.cancel()  # breaks the world, and tells the others
            with pytest.raises(asyncio.CancelledError):
                await waiting
        else:
            await asyncio.sleep(0.3)
            with pytest.raises(CollectiveError):  # (in flight or refused: as MPI progresses)
                await comm.barrier()
        texts = []
        for call in (comm.all_reduce(np.ones(2)),
                     comm.send(np.ones(2), (comm.rank + 1) % comm.world_size)):
            with pytest.raises(CollectiveError) as raised:
                await call
            assert type(raised.value) is CollectiveError
            texts.append(str(raised.value))
        return texts

    got = await run_world(fn, W, "mpi", timeout=8.0)
    for texts in got:
        if texts is None:
            continue
        for name, text in zip(("all_reduce", "send"), texts, strict=True):
            assert text.startswith(f"{name}: the communicator is broken: "), text
            assert "all_gather(" in text, text  # (what broke it)


async def test_mpi_a_rank_that_closed_the_world_fails_the_others_calls_at_once() -> None:
    """As on tcp, a rank that closed its world communicator with nothing in flight tells the
    others: their calls that need it from then on (a collective it never started, a recv
    beyond the messages it sent, a send to it) raise PeerLostError naming it at once, while
    what it took part in (a broadcast it rooted, a message it sent) still completes. They used
    to wait for their whole timeout (CollectiveTimeout)."""
    async def fn(comm: Communicator) -> list[tuple[str, str, Any, float]]:
        await comm.barrier()
        out: list[tuple[str, str, Any, float]] = []
        if comm.rank == 2:
            await comm.broadcast(np.full(3, 7.0), root=2)  # (done here before the others call)
            await comm.send(np.arange(3.0), 0, tag=4)
            await comm.close()
            return out
        await asyncio.sleep(0.3)

        async def record(call: Any) -> None:
            t0 = time.monotonic()
            try:
                got = await call
                out.append(("ok", str(np.asarray(got).tolist()), None, time.monotonic() - t0))
            except CollectiveError as exc:
                out.append((type(exc).__name__, str(exc), getattr(exc, "rank", None),
                            time.monotonic() - t0))

        await record(comm.broadcast(np.zeros(3), root=2))
        if comm.rank == 0:
            await record(comm.recv(2, tag=4))
            await record(comm.recv(2, tag=4))  # (these two fail without breaking the world)
            await record(comm.send(np.ones(2), 2))
        else:
            await asyncio.sleep(0.3)  # (rank 0's all_reduce breaks the world: after those)
        await record(comm.all_reduce(np.ones(2)))
        return out

    got = await run_world(fn, W, "mpi", timeout=8.0)
    assert got[2] == []
    assert got[0][0][:2] == got[1][0][:2] == ("ok", "[7.0, 7.0, 7.0]"), got
    assert got[0][1][:2] == ("ok", "[0.0, 1.0, 2.0]"), got[0]
    for r, results in ((0, got[0][2:]), (1, got[1][1:])):
        assert len(results) == (3 if r == 0 else 1), results
        for name, text, rank, dt in results:
            assert name == "PeerLostError" and rank == 2, f"rank {r}: {name}: {text}"
            assert "world rank 2 has closed its communicator" in text, f"rank {r}: {text}"
            assert dt < 1.5, f"rank {r} waited {dt:.1f} s: {text}"


async def test_mpi_a_group_closed_by_a_member_fails_the_others_calls_at_once() -> None:
    """As on memory and tcp, a member that closed a group tells the other members: their
    collectives of the group that it never started raise CollectiveError naming it at once,
    and so do their recvs from it beyond what it sent and their sends to it; its own recv in
    flight raises CommunicatorClosedError; the world goes on. The others used to wait for
    their timeout, which broke the world, and the recv waited on."""
    async def fn(comm: Communicator) -> tuple[list[tuple[str, str, float]], list[float]]:
        sub = await comm.new_group([2, 0, 1])  # world rank 2 is group rank 0
        assert sub is not None
        await comm.barrier()
        out: list[tuple[str, str, float]] = []

        async def record(call: Any) -> None:
            t0 = time.monotonic()
            try:
                got = await call
                out.append(("ok", str(np.asarray(got).tolist()), time.monotonic() - t0))
            except CollectiveError as exc:
                out.append((type(exc).__name__, str(exc), time.monotonic() - t0))

        if comm.rank == 2:
            await sub.broadcast(np.full(2, 5.0), root=0)
            await sub.send(np.arange(2.0), 1, tag=3)  # to world rank 0
            waiting = asyncio.ensure_future(sub.recv(2, tag=9))  # world rank 1 never sends
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await sub.close()
            try:
                await waiting
            except CollectiveError as exc:
                out.append((type(exc).__name__, str(exc), time.monotonic() - t0))
        else:
            await asyncio.sleep(0.3)
            await record(sub.broadcast(np.zeros(2), root=0))
            if comm.rank == 0:
                await record(sub.recv(0, tag=3))
                await record(sub.recv(0, tag=3))
                await record(sub.send(np.ones(2), 0))
            await record(sub.barrier())
            await record(sub.all_reduce(np.ones(2)))
            await sub.close()
        world = await comm.all_reduce(np.ones(2))
        return out, world.tolist()

    got = await run_world(fn, W, "mpi", timeout=8.0)
    for r in range(W):
        assert got[r][1] == [3.0, 3.0], f"rank {r}: the world is not usable: {got[r]}"
    (name, text, dt), = got[2][0]
    assert name == "CommunicatorClosedError" and dt < 0.5, got[2][0]
    assert got[0][0][0][:2] == got[1][0][0][:2] == ("ok", "[5.0, 5.0]"), got
    assert got[0][0][1][:2] == ("ok", "[0.0, 1.0]"), got[0]
    for r, results in ((0, got[0][0][2:]), (1, got[1][0][1:])):
        assert len(results) == (4 if r == 0 else 2), results
        for name, text, dt in results:
            assert name == "CollectiveError", f"rank {r}: {name}: {text}"
            assert text.endswith("world rank 2 closed the group"), f"rank {r}: {text}"
            assert dt < 1.5, f"rank {r} waited {dt:.1f} s: {text}"
        barrier, reduce = results[-2:]
        where = "of the group of world ranks [2, 0, 1]): "
        assert barrier[1].startswith(f"barrier() on group rank {r + 1} (sequence number 1 "
                                     f"{where}"), barrier[1]
        assert reduce[1].startswith(f"all_reduce(<f8, (2,), sum) on group rank {r + 1} "
                                    f"(sequence number 2 {where}"), reduce[1]


async def test_mpi_what_a_world_keeps_of_its_groups_stays_bounded(monkeypatch: Any) -> None:
    """A long job that makes and closes groups keeps nothing of them: what the other members
    said as they closed a group goes once this rank closed it too (it used to stay, one entry
    per group), and records of groups dropped unclosed are capped (MAX_RECORDS)."""
    import asynccoll.transport.mpi as mpi_backend

    monkeypatch.setattr(mpi_backend, "MAX_RECORDS", 5)

    async def fn(comm: Communicator) -> tuple[int, list[str], int]:
        world: Any = comm.transport
        for k in range(12):
            sub = await comm.new_group([(k + j) % W for j in range(W)])
            assert sub is not None
            await sub.all_reduce(np.ones(2))
            if comm.rank == k % W:
                await asyncio.sleep(0.02)  # (the others' notices come before this close)
            await sub.close()
            await comm.barrier()  # (and the notices of those who closed after are read)
        left = len(world.left)
        closed_all = sorted(world.records)
        for _ in range(8):  # dropped unclosed
            await comm.new_group(list(range(W)))
        return left, closed_all, len(world.records)

    for r, (left, records, dropped) in enumerate(await run_world(fn, W, "mpi", timeout=8.0)):
        assert left == 0 and records == ["w"], f"rank {r}: {left}, {records}"
        assert dropped <= 5, f"rank {r}: {dropped} records"


async def test_mpi_close_does_not_wait_for_sends_to_a_rank_that_closed() -> None:
    """Rank 0 sent rank 1 a message (8 MiB: it waits for its receiver) that rank 1 never
    takes before it closes. Rank 0's close then returned only after its whole timeout (8 s,
    'closing with 1 send(s) no rank received'); as on tcp, it returns at once: that send is
    never going to be received."""
    from mpi4py import MPI

    comm = await asynccoll.init(backend="mpi", timeout=8.0)
    await comm.barrier()
    if comm.rank == 0:
        await comm.send(np.ones(1 << 20), 1, tag=1)
    await comm.barrier()
    took = 0.0
    if comm.rank == 0:
        await asyncio.sleep(0.5)  # (the others closed)
        t0 = time.monotonic()
        await comm.close()
        took = time.monotonic() - t0
    else:
        await comm.close()
    every = MPI.COMM_WORLD.allgather(took)
    assert every[0] < 2.0, f"rank 0's close took {every[0]:.1f} s"
