"""Closing communicators and subgroups: what the other members see, calls in flight, and the
errors of calls made after the world broke (docs/concepts.md, "Closing").

Memory and TCP (``run_local(..., backend="tcp")``: real loopback sockets); MPI's side is in
tests/mpi_world.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import asynccoll
from asynccoll import (
    CollectiveError,
    CollectiveTimeout,
    Communicator,
    CommunicatorClosedError,
    PeerLostError,
)

BACKENDS = ["memory", "tcp"]


def _prompt(exc: BaseException, closer: int) -> None:
    """``exc`` is the error of a member whose group another member closed."""
    assert type(exc) is CollectiveError, repr(exc)
    assert f"world rank {closer} closed the group" in str(exc), str(exc)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_closing_a_group_fails_the_members_waiting_in_it_at_once(backend: str) -> None:
    """Ranks 0 and 1 wait in an all_reduce of the group [2, 0, 1] that rank 2 never calls:
    rank 2 closes the group instead. Their call raises CollectiveError naming rank 2 at once
    (it used to wait for the timeout, 20 s here), and the world, and another group over
    the same connections, go on undisturbed."""
    async def fn(comm: Communicator) -> float:
        group = await comm.new_group([2, 0, 1])
        other = await comm.new_group([0, 1])
        assert group is not None
        if comm.rank == 2:
            await asyncio.sleep(0.2)
            await group.close()
            await group.close()  # idempotent
            elapsed = 0.0
        else:
            start = time.monotonic()
            with pytest.raises(CollectiveError) as raised:
                await group.all_reduce(np.ones(5))
            elapsed = time.monotonic() - start
            _prompt(raised.value, 2)
            assert "all_reduce(" in str(raised.value)  # (the call it ended)
            with pytest.raises(CollectiveError) as again:  # later calls: at once too
                await group.barrier()
            _prompt(again.value, 2)
            assert other is not None
            assert (await other.all_reduce(np.full(3, comm.rank + 1.0))).tolist() == [3.0] * 3
        got = await comm.all_reduce(np.ones(4))
        assert got.tolist() == [3.0] * 4
        return elapsed

    async with asyncio.timeout(10):
        got = await asynccoll.run_local(fn, 3, backend, timeout=20.0)
    assert all(t < 2 for t in got), got


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_member_closing_with_its_calls_in_flight_lets_them_finish(backend: str
                                                                          ) -> None:
    """Rank 0 starts two all_reduces of a group and closes it before they complete: they
    complete (the others call them too), and the others' third call, which rank 0 never
    makes, raises naming rank 0 instead of waiting for the timeout."""
    async def fn(comm: Communicator) -> list[float]:
        group = await comm.new_group([0, 1, 2])
        assert group is not None
        if comm.rank == 0:
            calls = [asyncio.ensure_future(group.all_reduce(np.full(3, 1.0 + k)))
                     for k in range(2)]
            await asyncio.sleep(0)
            await group.close()
            return [float((await c)[0]) for c in calls]
        await asyncio.sleep(0.1)
        got = [float((await group.all_reduce(np.full(3, 1.0 + k)))[0]) for k in range(2)]
        with pytest.raises(CollectiveError) as raised:
            await group.all_reduce(np.ones(3))
        _prompt(raised.value, 0)
        return got

    async with asyncio.timeout(10):
        got = await asynccoll.run_local(fn, 3, backend, timeout=20.0)
    assert got == [[3.0, 6.0]] * 3


@pytest.mark.parametrize("backend", BACKENDS)
async def test_messages_sent_before_a_group_closed_are_received(backend: str) -> None:
    """Rank 1 sends two messages to rank 0 on a group (one small, one large: on tcp they
    travel on different connections) and closes the group: rank 0 receives both, then its
    next recv from rank 1 raises at once, and its send to rank 1 too."""
    big = np.arange(300_000, dtype=np.float64)

    async def fn(comm: Communicator) -> None:
        group = await comm.new_group([0, 1])
        assert group is not None
        if comm.rank == 1:
            await group.send(np.arange(3), 0, tag=1)
            await group.send(big, 0, tag=2)
            await group.close()
            await comm.barrier()
            return
        await comm.barrier()  # rank 1 closed the group by now
        assert (await group.recv(1, tag=2)).tolist() == big.tolist()
        assert (await group.recv(1, tag=1)).tolist() == [0, 1, 2]
        start = time.monotonic()
        with pytest.raises(CollectiveError) as raised:
            await group.recv(1, tag=1)
        _prompt(raised.value, 1)
        with pytest.raises(CollectiveError) as refused:
            await group.send(np.ones(2), 1)
        _prompt(refused.value, 1)
        assert time.monotonic() - start < 2

    async with asyncio.timeout(10):
        await asynccoll.run_local(fn, 2, backend, timeout=20.0)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_closing_a_group_fails_the_closers_own_receives_in_flight(backend: str
                                                                         ) -> None:
    """A recv of this rank in flight on a group it closes raises CommunicatorClosedError at
    once (nothing will ever come for it), and the member that later sends to it gets a
    CollectiveError naming the closer instead of a message nobody reads."""
    async def fn(comm: Communicator) -> str:
        group = await comm.new_group([0, 1])
        assert group is not None
        if comm.rank == 0:
            waiting = asyncio.ensure_future(group.recv(1))
            await asyncio.sleep(0.05)
            await group.close()
            async with asyncio.timeout(2):
                with pytest.raises(CommunicatorClosedError):
                    await waiting
            await comm.barrier()
            return "closed"
        await comm.barrier()
        with pytest.raises(CollectiveError) as raised:
            await group.send(np.ones(2), 0)
        _prompt(raised.value, 0)
        return "refused"

    async with asyncio.timeout(10):
        assert await asynccoll.run_local(fn, 2, backend, timeout=20.0) == ["closed", "refused"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_closing_the_world_fails_its_groups_calls(backend: str) -> None:
    """A rank closes its world communicator while a group of it is open: the group's calls
    there raise CommunicatorClosedError, in flight and later; the group's other members get
    PeerLostError naming it, at once; closing the group after its world is a no-op."""
    async def fn(comm: Communicator) -> str:
        group = await comm.new_group([0, 1, 2])
        assert group is not None
        await group.barrier()
        if comm.rank == 0:
            waiting = asyncio.ensure_future(group.all_reduce(np.ones(3)))
            await asyncio.sleep(0.05)
            await comm.close()
            async with asyncio.timeout(2):
                with pytest.raises(CommunicatorClosedError):
                    await waiting
                with pytest.raises(CommunicatorClosedError):
                    await group.barrier()
                await group.close()
            return "closed"
        await asyncio.sleep(0.2)  # (rank 0 closed its world by now)
        start = time.monotonic()
        with pytest.raises(PeerLostError) as raised:
            await group.all_reduce(np.ones(3))
        assert raised.value.rank == 0
        assert time.monotonic() - start < 2
        return "lost"

    async with asyncio.timeout(10):
        assert await asynccoll.run_local(fn, 3, backend, timeout=20.0) == [
            "closed", "lost", "lost"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_close_from_another_task_fails_the_calls_in_flight(backend: str) -> None:
    """One task of rank 0 awaits a collective (that rank 1 calls late) and another closes
    the world communicator: the collective raises CommunicatorClosedError at once, and rank
    1's PeerLostError naming rank 0."""
    async def fn(comm: Communicator) -> str:
        if comm.rank == 0:
            call = asyncio.create_task(comm.all_gather(np.ones(2)))
            closer = asyncio.create_task(comm.close())
            await asyncio.sleep(0.05)
            await closer
            async with asyncio.timeout(2):
                with pytest.raises(CommunicatorClosedError):
                    await call
            return "closed"
        await asyncio.sleep(0.2)
        with pytest.raises(PeerLostError) as raised:
            await comm.all_gather(np.ones(2))
        assert raised.value.rank == 0
        return "lost"

    async with asyncio.timeout(10):
        assert await asynccoll.run_local(fn, 2, backend, timeout=20.0) == ["closed", "lost"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_async_with_closes_on_an_exception(backend: str) -> None:
    """An ``async with group`` body that raises: the group is closed on the way out, the
    exception goes on unchanged, and the other member's call on it raises naming the rank
    that left, at once."""
    async def fn(comm: Communicator) -> str:
        group = await comm.new_group([0, 1])
        assert group is not None
        if comm.rank == 0:
            with pytest.raises(KeyError):
                async with group:
                    raise KeyError("boom")
            with pytest.raises(CommunicatorClosedError):
                await group.barrier()
            return "left"
        with pytest.raises(CollectiveError) as raised:
            await group.barrier()
        _prompt(raised.value, 0)
        return "told"

    async with asyncio.timeout(10):
        assert await asynccoll.run_local(fn, 2, backend, timeout=20.0) == ["left", "told"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_close_racing_new_group(backend: str) -> None:
    """Rank 2 closes the world while ranks 0 and 1 call new_group: theirs raises
    PeerLostError naming rank 2, at once, never a group that half exists."""
    async def fn(comm: Communicator) -> str:
        if comm.rank == 2:
            await comm.close()
            return "closed"
        with pytest.raises(PeerLostError) as raised:
            await comm.new_group([0, 1])
        assert raised.value.rank == 2
        return "lost"

    async with asyncio.timeout(10):
        assert await asynccoll.run_local(fn, 3, backend, timeout=20.0) == [
            "lost", "lost", "closed"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_call_refused_by_a_broken_world_names_itself(backend: str) -> None:
    """A call started after the world broke says which call was refused ("all_reduce: the
    communicator is broken ..."), as a call in flight does; the exception classes stay."""
    async def fn(comm: Communicator) -> tuple[str, str, str]:
        if comm.rank == 1:
            await comm.close()
            return "", "", ""
        with pytest.raises(PeerLostError):
            await comm.barrier()
        with pytest.raises(PeerLostError) as first:
            await comm.all_reduce(np.ones(3))
        with pytest.raises(PeerLostError) as second:
            await comm.send(np.ones(3), 1)
        with pytest.raises(PeerLostError) as third:
            await comm.new_group([0])
        assert first.value.rank == second.value.rank == third.value.rank == 1
        return str(first.value), str(second.value), str(third.value)

    async with asyncio.timeout(10):
        got = (await asynccoll.run_local(fn, 2, backend, timeout=20.0))[0]
    assert got[0].startswith("all_reduce: the communicator is broken"), got[0]
    assert got[1].startswith("send: the communicator is broken"), got[1]
    assert got[2].startswith("new_group: the communicator is broken"), got[2]
    assert all("world rank 1" in text for text in got), got


async def test_a_group_closed_under_a_timeout_still_times_out_elsewhere() -> None:
    """Closing a group tells its members only: a member of the world that is not in the
    group and waits for the closer in a world call still times out as before (the close
    says nothing about the world)."""
    async def fn(comm: Communicator) -> str:
        group = await comm.new_group([0, 1])
        if comm.rank == 0:
            assert group is not None
            await group.close()
            await asyncio.sleep(0.6)
            return "idle"
        if comm.rank == 2:
            with pytest.raises(CollectiveTimeout):
                await comm.barrier()  # rank 0 never calls it
            return "timeout"
        assert group is not None
        with pytest.raises(CollectiveError) as raised:
            await group.barrier()
        _prompt(raised.value, 0)
        with pytest.raises(CollectiveError):  # (rank 2's timeout broke the world)
            await comm.barrier()
        return "told"

    async with asyncio.timeout(10):
        got = await asynccoll.run_local(fn, 3, "memory", timeout=0.3)
    assert got == ["idle", "told", "timeout"]


_PROGRAM = '''
import asyncio, time
import numpy as np
import asynccoll

async def main():
    comm = await asynccoll.init(timeout=20.0)
    group = await comm.new_group([2, 0, 1])
    if comm.rank == 2:
        await asyncio.sleep(0.2)
        await group.close()
    else:
        start = time.monotonic()
        try:
            await group.all_reduce(np.ones(5))
            print("rank", comm.rank, "returned")
        except asynccoll.CollectiveError as exc:
            print("rank", comm.rank, type(exc).__name__, round(time.monotonic() - start, 1),
                  exc)
    print("rank", comm.rank, "world", (await comm.all_reduce(np.ones(2))).tolist())
    await comm.barrier()
    await comm.close()

asyncio.run(main())
'''


def test_a_group_closed_in_a_world_of_processes(tmp_path: Path) -> None:
    """The same under ``asynccoll run`` (a process per rank, the rendezvous, TCP): ranks 0
    and 1 learn at once that rank 2 closed the group, and the world goes on."""
    program = tmp_path / "close_group.py"
    program.write_text(_PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCCOLL_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run([sys.executable, "-m", "asynccoll", "run", "-n", "3", str(program)],
                          env=env, capture_output=True, text=True, timeout=40, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in (0, 1):
        line = next(x for x in out.splitlines() if f"rank {r} CollectiveError" in x)
        assert "world rank 2 closed the group" in line, out
        assert float(line.split("CollectiveError")[1].split()[0]) < 2, line
    for r in range(3):
        assert f"rank {r} world [3.0, 3.0]" in out, out
