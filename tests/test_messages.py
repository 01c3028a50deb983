"""Error messages that tell the truth: every call in flight that a failure ends names
itself (its signature, this rank's group rank, its sequence number), whatever the failure
says of other calls; refused calls name themselves on every backend.

Memory and TCP (``run_local(..., backend="tcp")``: real loopback sockets).
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

import asynccoll
from asynccoll import CollectiveError, CollectiveTimeout, Communicator

BACKENDS = ["memory", "tcp"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_call_in_flight_names_itself_when_another_rank_cancelled_the_same_call(
        backend: str) -> None:
    """World rank 0's barrier is cancelled while world rank 1 waits in its own barrier
    (rank 2 has not called yet). Rank 1's error relays rank 0's reason ('barrier() was
    cancelled on group rank 0'), which names a call of the same signature: it must still
    say which call of rank 1 it ended ('barrier() on group rank 1 (sequence number 1 of
    the world): world rank 0 aborted: ...'), once."""
    async def fn(comm: Communicator) -> str:
        await comm.barrier()  # sequence number 0: completes
        if comm.rank == 0:
            task = asyncio.ensure_future(comm.barrier())
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return ""
        if comm.rank == 2:
            await asyncio.sleep(0.6)  # comes after the world broke
            return ""
        with pytest.raises(CollectiveError) as raised:
            await comm.barrier()
        return str(raised.value)

    async with asyncio.timeout(8):
        text = (await asynccoll.run_local(fn, 3, backend, timeout=5.0))[1]
    assert text.startswith("barrier() on group rank 1 (sequence number 1 of the world): "
                           "world rank 0 aborted: barrier() was cancelled on group rank 0"), text
    assert text.count("group rank 1") == 1, text


@pytest.mark.parametrize("backend", BACKENDS)
async def test_calls_in_flight_in_a_group_name_their_group_rank_and_sequence_number(
        backend: str) -> None:
    """The same in a group [2, 1, 0]: world rank 2 (group rank 0) cancels its all_reduce,
    and world rank 1 (group rank 1) waiting in the same all_reduce (world rank 0 has not
    called it) says its own group rank and the group's sequence number, not only what
    rank 2 said of its call."""
    async def fn(comm: Communicator) -> str:
        group = await comm.new_group([2, 1, 0])
        assert group is not None
        await group.all_reduce(np.ones(3))  # the group's sequence number 0
        if comm.rank == 0:
            await asyncio.sleep(0.6)  # comes after the group broke
            return ""
        if comm.rank == 2:
            task = asyncio.ensure_future(group.all_reduce(np.ones(3)))
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return ""
        with pytest.raises(CollectiveError) as raised:
            await group.all_reduce(np.ones(3))
        return str(raised.value)

    async with asyncio.timeout(8):
        text = (await asynccoll.run_local(fn, 3, backend, timeout=5.0))[1]
    assert re.match(r"all_reduce\(<f8, \(3,\), sum, \w+\) on group rank 1 \(sequence number "
                    r"1 of the group of world ranks \[2, 1, 0\]\): world rank 2 aborted: "
                    r"all_reduce\(.*\) was cancelled on group rank 0", text), text


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_call_ended_by_another_call_of_this_rank_names_its_own_sequence_number(
        backend: str) -> None:
    """Two all_reduce calls of the same signature in flight on rank 0; rank 1 never calls.
    The one whose watchdog fires first raises its timeout (naming its sequence number); the
    other, ended by that failure, must name its own sequence number, not pass for the
    call that timed out."""
    async def fn(comm: Communicator) -> list[str]:
        if comm.rank == 1:
            await asyncio.sleep(1.0)  # alive, but never calls
            return []
        comm.timeout = 0.3
        got = await asyncio.gather(comm.all_reduce(np.ones(4)), comm.all_reduce(np.ones(4)),
                                   return_exceptions=True)
        assert all(isinstance(e, CollectiveError) for e in got), got
        return [str(e) for e in got]

    async with asyncio.timeout(8):
        texts = (await asynccoll.run_local(fn, 2, backend, timeout=5.0))[0]
    for seq, text in enumerate(texts):
        assert text.startswith("all_reduce(<f8, (4,), sum, "), text
        first = re.search(r"sequence number (\d+)", text)  # (the call it names first)
        assert first is not None and first[1] == str(seq), (seq, texts)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_mismatch_found_here_is_not_named_twice(backend: str) -> None:
    """A mismatch this rank's mailbox found in its own call names that call, this rank and
    the sequence number already: it is raised as it is. A rank that learnt of it from the
    other (memory: one rank finds it) names its own call before what the other said."""
    async def fn(comm: Communicator) -> str:
        await comm.barrier()
        with pytest.raises(CollectiveError) as raised:
            await comm.all_reduce(np.ones(4 + comm.rank))
        return str(raised.value)

    async with asyncio.timeout(8):
        texts = await asynccoll.run_local(fn, 2, backend, timeout=5.0)
    found = [text for text in texts if text.startswith("collective mismatch: ")]
    assert found, texts
    for rank, text in enumerate(texts):
        if text in found:
            assert text.count("sequence number 1 of the world") == 1, text
            assert f"world rank {rank} called all_reduce(<f8, ({4 + rank},)" in text, text
        else:
            assert re.match(rf"all_reduce\(<f8, \({4 + rank},\), sum, \w+\) on group rank "
                            rf"{rank} \(sequence number 1 of the world\): world rank "
                            rf"{1 - rank} aborted: collective mismatch: ", text), text


async def test_a_timeout_here_is_not_named_twice() -> None:
    """This rank's own timeout names its call already."""
    async def fn(comm: Communicator) -> str:
        if comm.rank == 1:
            await asyncio.sleep(0.8)
            return ""
        comm.timeout = 0.3
        with pytest.raises(CollectiveTimeout) as raised:
            await comm.all_reduce(np.ones(2))
        return str(raised.value)

    async with asyncio.timeout(8):
        text = (await asynccoll.run_local(fn, 2, "memory", timeout=5.0))[0]
    assert text.startswith("all_reduce(<f8, (2,), sum, "), text
    assert text.count("all_reduce(") == 1 and text.count("sequence number 0") == 1, text
