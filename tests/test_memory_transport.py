"""The memory transport's lending of large collective payloads to receivers that come late."""

from __future__ import annotations

import asyncio

import numpy as np

import asynccoll
from asynccoll.transport.memory import LEND_MIN_BYTES


async def test_late_receivers_get_the_data_and_senders_wait_for_the_copy() -> None:
    n = 4 * LEND_MIN_BYTES // 8  # float64 elements: every ring segment is lent

    async def fn(comm: asynccoll.Communicator) -> list[float]:
        await asyncio.sleep(0.01 * comm.rank)  # later ranks post their receives late
        a = np.arange(n, dtype=np.float64) * (comm.rank + 1)
        await comm.all_reduce(a)
        b = np.full(n, float(comm.rank))
        await comm.broadcast(b, root=comm.world_size - 1)
        return [float(a[1]), float(a[-1]), float(b[0]), float(b[-1])]

    w = 4
    scale = sum(range(1, w + 1))
    for got in await asynccoll.run_local(fn, w):
        assert got == [scale * 1.0, scale * (n - 1.0), w - 1.0, w - 1.0]


async def test_large_point_to_point_sends_never_wait_for_the_receive() -> None:
    big = LEND_MIN_BYTES * 4

    async def fn(comm: asynccoll.Communicator) -> float:
        peer = 1 - comm.rank
        await comm.send(np.full(big // 8, float(comm.rank)), peer)  # both send first
        got = await comm.recv(peer)
        return float(got.sum())

    results = await asynccoll.run_local(fn, 2, timeout=5)
    assert results == [float(big // 8), 0.0]


async def test_a_lent_frame_is_released_when_the_world_breaks() -> None:
    async def fn(comm: asynccoll.Communicator) -> str:
        if comm.rank == 0:
            try:  # rank 1 never takes part: the lent payload must not pin rank 0 forever
                await comm.broadcast(np.zeros(LEND_MIN_BYTES), root=0)
            except asynccoll.CollectiveError as exc:
                return type(exc).__name__
            return "returned"
        await asyncio.sleep(0.2)
        await comm.close()
        return "closed"

    results = await asynccoll.run_local(fn, 2, timeout=1)
    assert results[1] == "closed"
    assert results[0] in ("PeerLostError", "CollectiveTimeout", "CollectiveError")
