"""``peer_loss="isolate"``: losing one peer fails only what involves it; the rest of the world
goes on (what parameter servers and elastic training need). The default, ``"abort"``, breaks
the whole world, as collectives require."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from conftest import settle_until

import asynccoll
from asynccoll import Communicator, PeerLostError
from asynccoll._aio import close_server


async def crash(comm: Communicator) -> None:
    """Drop every connection of ``comm``'s rank without a goodbye, as a killed process would."""
    t = comm.transport
    if t._server is not None:  # type: ignore[attr-defined]
        await close_server(t._server)  # type: ignore[attr-defined]
    for conn in list(t._open):  # type: ignore[attr-defined]
        conn._abort()


async def test_isolate_keeps_the_survivors_talking() -> None:
    async def rank(comm: Communicator) -> str:
        pair = await comm.new_group([0, 1])
        await comm.barrier()
        if comm.rank == 2:
            await crash(comm)
            return "crashed"
        if comm.rank == 0:
            with pytest.raises(PeerLostError) as info:
                await comm.recv(src=2)
            assert info.value.rank == 2
            with pytest.raises(PeerLostError):
                await comm.send(np.ones(3), dst=2)
                await asyncio.sleep(0.1)
                await comm.send(np.ones(3), dst=2)
        assert pair is not None
        got = await pair.all_reduce(np.array([comm.rank + 1.0]))
        if comm.rank == 0:
            await comm.send(np.arange(3.0), dst=1, tag=5)
        else:
            assert (await comm.recv(src=0, tag=5)).tolist() == [0.0, 1.0, 2.0]
        return f"sum {got[0]:g}"

    got = await asynccoll.run_local(rank, 3, "tcp", timeout=10, peer_loss="isolate")
    assert got == ["sum 3", "sum 3", "crashed"]


async def test_abort_is_the_default() -> None:
    async def rank(comm: Communicator) -> str:
        await comm.barrier()
        if comm.rank == 2:
            await crash(comm)
            return "crashed"
        with pytest.raises(PeerLostError):
            await comm.recv(src=2)
        with pytest.raises(PeerLostError):       # the world is broken for everyone
            await comm.all_reduce(np.ones(2))
        return "broken"

    got = await asynccoll.run_local(rank, 3, "tcp", timeout=10)
    assert got == ["broken", "broken", "crashed"]


async def test_isolated_recv_timeout_gives_up_on_that_peer_only() -> None:
    async def rank(comm: Communicator) -> str:
        if comm.rank == 1:
            await asyncio.sleep(0.6)      # never sends; rank 0 stops waiting for it
            await comm.send(np.ones(1), dst=2)
            return "late"
        if comm.rank == 0:
            comm.timeout = 0.3
            with pytest.raises(asynccoll.CollectiveTimeout):
                await comm.recv(src=1)
            with pytest.raises(PeerLostError):   # given up on: fails at once from now on
                await comm.recv(src=1)
            comm.timeout = 10
            await comm.send(np.full(1, 7.0), dst=2)
            return "gave up on 1"
        a = await comm.recv(src=0)
        b = await comm.recv(src=1)
        return f"{a[0]:g} {b[0]:g}"

    got = await asynccoll.run_local(rank, 3, "tcp", timeout=10, peer_loss="isolate")
    assert got == ["gave up on 1", "late", "7 1"]


async def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="peer_loss"):
        await asynccoll.run_local(lambda c: asyncio.sleep(0), 2, "tcp", peer_loss="ignore")


async def test_a_lost_peer_is_reported_once_in_a_crowded_world(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """In a crowded world every rank dials its own connection to each peer, so a peer that
    dies drops two connections: the WARNING "lost connection to rank 1" came twice."""
    from asynccoll.api import local_world

    monkeypatch.setenv("ASYNCCOLL_LOCAL_WORLD_SIZE", "100000")  # more ranks than cores
    c0, c1 = await local_world(2, "tcp", timeout=10)
    try:
        assert c0.transport.crowded
        await asyncio.gather(c0.barrier(), c1.barrier())
        assert len(c1.transport._open) == 2  # type: ignore[attr-defined]  # one each way
        with caplog.at_level(logging.WARNING, logger="asynccoll"):
            await crash(c1)
            with pytest.raises(PeerLostError):
                async with asyncio.timeout(5):
                    await c0.all_reduce(np.ones(4))
            await settle_until(lambda: not c0.transport._open)  # type: ignore[attr-defined]
    finally:
        await c0.close()
        await c1.close()
    lost = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("rank 0: lost connection to rank 1")]
    assert len(lost) == 1, lost


async def test_a_lost_peer_error_names_the_call_each_survivor_was_in() -> None:
    """Each survivor's PeerLostError says which of its calls the loss cut short (signature,
    sequence number), not only which rank was lost: what an on-call engineer lines up
    across the ranks' logs."""
    async def rank(comm: Communicator) -> PeerLostError | None:
        await comm.barrier()  # sequence number 0
        if comm.rank == 2:
            await asyncio.sleep(0.2)
            await crash(comm)
            return None
        with pytest.raises(PeerLostError) as info:
            async with asyncio.timeout(5):
                await comm.all_reduce(np.ones((2, 3), np.float32))
        return info.value

    got = await asynccoll.run_local(rank, 3, "tcp", timeout=10)
    for err in got[:2]:
        assert err is not None and err.rank == 2, err
        assert "all_reduce(<f4, (2, 3), sum" in str(err), err
        assert "sequence number 1 of the world" in str(err), err
        assert "world rank 2" in str(err), err
