"""What a long job holds after many calls, groups and worlds: nothing grows after a warm-up.

A training job runs for days: millions of collectives, subgroups created and closed, worlds
closed and formed again in one process, failures caught and retried. Each test here runs a
scenario for a warm-up, takes stock of what the process holds (open file descriptors,
asyncio tasks and pending timers, threads, objects of asynccoll's classes, the memory
tracemalloc traces, and the per-rank state of the communicators and transports: pending
receives, early frames, sequence-number tables, scratch buffers, caches), runs it again, and
checks that nothing grew beyond noise (the bounded caches are given small limits where the
scenario would fill them slowly: docs/concepts.md, "Long jobs: what is kept").

Scaled down to a few seconds each; ``ASYNCCOLL_SOAK=N`` runs every scenario N times longer
(``ASYNCCOLL_SOAK=50 pytest tests/test_resources.py``), with the same thresholds.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

import asynccoll
from asynccoll import CollectiveError, Communicator, PeerLostError, wire_stream
from asynccoll.api import local_world
from asynccoll.transport import base

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ["memory", "tcp"]

#: how many times longer every scenario runs (ASYNCCOLL_SOAK=N; 1 by default)
SOAK = max(1, int(os.environ.get("ASYNCCOLL_SOAK") or 1))


def _scaled(n: int) -> int:
    return n * SOAK


#: the limits of the bounded caches in these tests: small, so that a warm-up fills them
#: (a header memo holds a header per distinct tag, an encoded-head cache one per group)
SMALL_CACHE = 32


@pytest.fixture(autouse=True)
def small_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worlds formed in a test have caches of ``SMALL_CACHE`` entries."""
    monkeypatch.setattr(wire_stream.HeaderMemo.__init__, "__defaults__", (SMALL_CACHE,))
    monkeypatch.setattr(wire_stream.HeadCache.__init__, "__defaults__", (SMALL_CACHE,))
    monkeypatch.setattr(base, "MAX_CLOSED_GROUPS", SMALL_CACHE // 2, raising=False)


# ----------------------------------------------------------------------------- taking stock

def _asynccoll_objects() -> Counter[str]:
    """Live objects of asynccoll's own classes, by class name."""
    found: Counter[str] = Counter()
    for obj in gc.get_objects():
        module = getattr(type(obj), "__module__", None)
        if isinstance(module, str) and module.startswith("asynccoll"):
            found[type(obj).__qualname__] += 1
    return found


def _state(comms: Sequence[Communicator]) -> dict[str, int]:
    """Entries of the per-rank tables that must go back to what they were between calls
    (pending receives, early frames, tables per collective or peer ...), summed over ranks."""
    out: Counter[str] = Counter()
    transports = {id(c.transport): c.transport for c in comms}.values()
    for t in transports:
        mb = t.mailbox
        for name in ("_posted", "_early", "_active", "_early_sig", "_lost", "_cut", "_lent",
                     "_borrowed", "_kept", "_guarded"):
            out[f"mailbox.{name}"] += len(getattr(mb, name))
        for name in ("_queued", "_dialing", "_arrivals", "_background", "_writers"):
            if hasattr(t, name):
                out[f"transport.{name}"] += len(getattr(t, name))
    for c in comms:
        for name in ("_p2p_kept", "_p2p_pulling"):
            out[f"comm.{name}"] += len(getattr(c, name))
        out["comm.watched"] += len(c._watchdog._calls) + len(c._watchdog._expired)
    return dict(out)


def _caches(comms: Sequence[Communicator]) -> dict[str, int]:
    """Sizes of the bounded caches, summed over ranks (they may grow up to their limits)."""
    out: Counter[str] = Counter()
    for t in {id(c.transport): c.transport for c in comms}.values():
        out["heads"] += len(t.heads._parts)
        out["scratch buffers"] += len(t.scratch._free)
        out["scratch bytes"] += t.scratch.kept
        out["closed groups"] += len(t.mailbox._left)
    for c in comms:
        out["plans"] += len(c._plans)
    return dict(out)


def _timers(loop: asyncio.AbstractEventLoop) -> int:
    scheduled = getattr(loop, "_scheduled", [])
    return sum(1 for h in scheduled if not h.cancelled())


class Stock:
    """What the process holds at one moment (``take``)."""

    def __init__(self, comms: Sequence[Communicator] = ()) -> None:
        gc.collect()
        self.fds = len(os.listdir("/proc/self/fd"))
        self.tasks = len(asyncio.all_tasks())
        self.timers = _timers(asyncio.get_running_loop())
        self.threads = threading.active_count()
        self.objects = _asynccoll_objects()
        self.memory = tracemalloc.get_traced_memory()[0]
        self.state = _state(comms)
        self.caches = _caches(comms)

    def grew(self, before: Stock, *, memory: int, objects: int = 0) -> list[str]:
        """What grew since ``before``: any file descriptor, task, timer, thread or entry of
        the per-rank tables; more than ``objects`` asynccoll objects of any class; more
        than ``memory`` bytes of traced memory."""
        grown = [f"{what}: {a} -> {b}" for what, a, b in (
            ("open file descriptors", before.fds, self.fds),
            ("asyncio tasks", before.tasks, self.tasks),
            ("pending timers", before.timers, self.timers),
            ("threads", before.threads, self.threads)) if b > a]
        grown += [f"{name}: {before.state.get(name, 0)} -> {n}"
                  for name, n in self.state.items() if n > before.state.get(name, 0)]
        grown += [f"{name} objects: {before.objects[name]} -> {n}"
                  for name, n in self.objects.items() if n > before.objects[name] + objects]
        if self.memory - before.memory > memory:
            grown.append(f"traced memory: +{self.memory - before.memory} bytes "
                         f"(allowed {memory})")
        return grown


@contextmanager
def _traced() -> Iterator[None]:
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        yield
    finally:
        if started:
            tracemalloc.stop()


async def _flat(run: Callable[[int], Awaitable[object]], warm: int, rounds: int, *,
                memory: int, comms: Sequence[Communicator] = (), objects: int = 0) -> Stock:
    """Run ``run(warm)``, take stock, run ``run(rounds)``, and check that nothing grew;
    returns the last stock."""
    with _traced():
        await run(warm)
        before = Stock(comms)
        await run(rounds)
        after = Stock(comms)
    grown = after.grew(before, memory=memory, objects=objects)
    assert not grown, "after the warm-up, grew: " + "; ".join(grown)
    return after


# ------------------------------------------------------------------------------- scenarios

async def _every_kind(c: Communicator, n: int, tag_base: int) -> None:
    """``n`` rounds of every collective (2 ranks), sends with a new tag each time and the
    object collectives."""
    x = np.ones(4, np.float32)
    peer = 1 - c.rank
    for i in range(n):
        await c.all_reduce(x.copy())
        await c.broadcast(x.copy())
        await c.reduce(x.copy())
        await c.all_gather(x)
        await c.reduce_scatter(np.ones(4, np.float32))
        await c.gather(x)
        await c.scatter([x, x] if c.rank == 0 else None)
        await c.all_to_all([x, x])
        await c.barrier()
        await c.broadcast_object({"step": i})
        await c.all_gather_object([i, "x"])
        tag = tag_base + i
        if c.rank == 0:
            await c.send(x, peer, tag=tag)
            await c.send(x, peer, tag=tag + 1)
        else:  # taken out of order: the first waits in the kept messages for a moment
            await c.recv(peer, tag=tag + 1)
            await c.recv(peer, tag=tag)
        tag_base += 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_many_small_collectives_leave_nothing_behind(backend: str) -> None:
    comms = await local_world(2, backend, timeout=20)
    tags = iter(range(0, 1 << 40, 1 << 20))
    try:
        async def run(n: int) -> None:
            base_tag = next(tags)
            await asyncio.gather(*(_every_kind(c, n, base_tag) for c in comms))

        # ~12 calls a round: a leak of 16 bytes a call (or one object in a hundred) shows
        rounds = _scaled(120 if backend == "memory" else 60)
        await _flat(run, 30, rounds, memory=12 * rounds * 16 + 8192, comms=comms)
    finally:
        for c in comms:
            await c.close()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_many_groups_created_and_closed_leave_nothing_behind(backend: str) -> None:
    comms = await local_world(3, backend, timeout=20)
    x = np.ones(4, np.float32)
    try:
        async def cycles(c: Communicator, n: int) -> None:
            for i in range(n):
                g = await c.new_group([0, 1] if i % 2 else [2, 1, 0])
                if g is None:
                    continue
                await g.all_reduce(x.copy())
                if g.rank == 0:
                    await g.send(x, 1, tag=i)
                elif g.rank == 1:
                    await g.recv(0, tag=i)
                await g.all_gather_object(i)
                await g.close()

        async def run(n: int) -> None:
            await asyncio.gather(*(cycles(c, n) for c in comms))

        rounds = _scaled(150)
        after = await _flat(run, 60, rounds, memory=rounds * 64 + 16384, comms=comms)
        assert after.caches["closed groups"] <= 3 * SMALL_CACHE // 2, after.caches
    finally:
        for c in comms:
            await c.close()


async def _ok(c: Communicator) -> None:
    await c.all_reduce(np.ones(4, np.float32))
    await c.broadcast_object({"rank": c.rank})


async def _mismatch(c: Communicator) -> None:
    await c.all_reduce(np.ones(4 + c.rank, np.float32))


async def _timeout(c: Communicator) -> None:
    c.timeout = 0.05
    if c.rank == 0:  # rank 1 never comes
        await c.all_reduce(np.ones(4, np.float32))


async def _cancelled(c: Communicator) -> None:
    call = asyncio.ensure_future(c.all_reduce(np.ones(4, np.float32)))
    await asyncio.sleep(0)
    if c.rank == 0:
        call.cancel()
    await call


@pytest.mark.parametrize("backend", BACKENDS)
async def test_worlds_formed_again_and_again_leave_nothing_behind(backend: str) -> None:
    """run_local worlds one after the other: some succeed, some fail (a shape mismatch, a
    timeout, a cancelled collective) and are followed by new worlds."""
    bodies = [_ok, _mismatch, _ok, _timeout, _ok, _cancelled]

    async def run(n: int) -> None:
        for i in range(n):
            body = bodies[i % len(bodies)]
            try:
                await asynccoll.run_local(body, 2, backend, timeout=10)
            except (CollectiveError, asyncio.CancelledError):
                assert body is not _ok
            else:
                assert body is _ok

    rounds = _scaled(60 if backend == "memory" else 36)
    # (tcp: the interpreter's own memory grows by some 30 KiB over the first ~1000 worlds,
    # then stays flat: nothing of asynccoll's, none of its objects; leaked objects show
    # below whatever the memory allowance)
    await _flat(run, 18, rounds, memory=24576 if backend == "memory" else 65536)


async def test_a_rendezvous_serving_many_short_worlds_of_two_processes_keeps_nothing(
        unused_tcp_port: int) -> None:
    """Two real processes form, use and close a TCP world again and again through one
    standalone rendezvous (a job id per world); neither the ranks nor the server keep
    anything of the worlds that ended."""
    from asynccoll.rendezvous import RendezvousServer

    warm, rounds = 8, _scaled(24)
    server = RendezvousServer("127.0.0.1", unused_tcp_port)
    await server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCCOLL_")}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WORLDS, "1", str(unused_tcp_port), str(warm), str(rounds),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async def cycles(n: int, first: int) -> None:
            for i in range(first, first + n):
                comm = await asynccoll.init(
                    "tcp", rank=0, world_size=2, addr="127.0.0.1", port=unused_tcp_port,
                    rendezvous=f"127.0.0.1:{unused_tcp_port}", job=f"world-{i}", timeout=10)
                async with comm:
                    await _use_world(comm, i)
            # the other rank's last connection to the server may still be closing (for up
            # to a second, asynccoll.rendezvous._common._close_writer)
            for _ in range(300):
                if server.jobs == [""] and not any(
                        t.get_coro().__qualname__.endswith("_serve_connection")
                        for t in asyncio.all_tasks()):
                    break
                await asyncio.sleep(0.01)

        starts = iter([0, warm])

        async def run(n: int) -> None:
            await cycles(n, next(starts))

        await _flat(run, warm, rounds, memory=rounds * 400 + 16384)
        out, err = await asyncio.wait_for(child.communicate(), 20)
        assert child.returncode == 0, err.decode()
        grown = json.loads(out.decode().strip().splitlines()[-1])
        assert not grown, f"rank 1 (another process), after the warm-up, grew: {grown}"
        assert server.jobs == [""]
        assert not server.store.data and not server.store.members, server.store
        assert not server._live and not server._waiters
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await server.close()


async def _use_world(comm: Communicator, i: int) -> None:
    x = np.ones(8, np.float32)
    await comm.all_reduce(x)
    assert x[0] == 2
    assert await comm.broadcast_object(i) == i
    await comm.barrier()


#: rank 1 of the test above, in its own process: prints what grew after the warm-up (JSON)
_WORLDS = """
import asyncio, json, sys, tracemalloc
import asynccoll
from tests.test_resources import Stock, _use_world
rank, port, warm, rounds = map(int, sys.argv[1:])
async def cycles(n, first):
    for i in range(first, first + n):
        comm = await asynccoll.init("tcp", rank=rank, world_size=2, addr="127.0.0.1",
                                    port=port, rendezvous=f"127.0.0.1:{port}",
                                    job=f"world-{i}", timeout=10)
        async with comm:
            await _use_world(comm, i)
async def main():
    tracemalloc.start()
    await cycles(warm, 0)
    before = Stock()
    await cycles(rounds, warm)
    print(json.dumps(Stock().grew(before, memory=rounds * 400 + 16384)))
asyncio.run(main())
"""


@pytest.mark.parametrize("backend", BACKENDS)
async def test_calls_of_many_distinct_sizes_stay_within_the_caches_limits(backend: str
                                                                          ) -> None:
    """Every call of a new size may add to the caches (plans, encoded heads, scratch
    buffers), never beyond their limits, and the tables between calls stay empty."""
    from asynccoll import collectives, scratch

    comms = await local_world(2, backend, timeout=20)
    try:
        async def sizes(c: Communicator, counts: range) -> None:
            for n in counts:
                x = np.ones(n, np.float32)
                await c.all_reduce(x)
                await c.all_gather(x)
                await c.broadcast(x)
                if c.rank == 0:
                    await c.send(x, 1, tag=n)
                else:
                    await c.recv(0, tag=n)

        first = Stock(comms)
        await asyncio.gather(*(sizes(c, range(1, _scaled(700))) for c in comms))
        # large ones fill the scratch pool
        big = range(1 << 16, (1 << 16) + _scaled(40) * 4096, 4096)
        await asyncio.gather(*(sizes(c, big) for c in comms))
        after = Stock(comms)
        assert after.caches["plans"] <= 2 * collectives._MAX_PLANS, after.caches
        assert after.caches["heads"] <= 2 * SMALL_CACHE, after.caches
        assert after.caches["scratch buffers"] <= 2 * scratch.LIMIT_BUFFERS, after.caches
        assert after.caches["scratch bytes"] <= 2 * scratch.LIMIT_BYTES, after.caches
        grown = [f"{k}: {first.state.get(k, 0)} -> {v}" for k, v in after.state.items()
                 if v > first.state.get(k, 0)]
        assert not grown, grown
    finally:
        for c in comms:
            await c.close()


def _traceback_length(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_error_raised_again_and_again_does_not_grow(backend: str) -> None:
    """Calls refused for the same reason again and again (a send to, or a recv from, a
    member that closed the group; a recv from a lost peer) raise an error whose traceback
    stays short: one error object kept and raised on every call gathered the frames of
    every raise (and the arrays they held) until the world closed."""
    comms = await local_world(3, backend, timeout=20)
    try:
        groups = await asyncio.gather(*(c.new_group([0, 1]) for c in comms))
        await groups[1].close()
        for _ in range(100):
            if comms[0].transport.mailbox.left_group(groups[0]._group) is not None:
                break
            await asyncio.sleep(0.01)
        g = groups[0]
        comms[0].transport.mailbox.peer_lost(2, PeerLostError("world rank 2 is gone", rank=2))
        last: list[BaseException] = []

        async def refused(n: int) -> None:
            for _ in range(n):
                for call in (lambda: g.send(np.ones(4096), 1), lambda: g.recv(1),
                             lambda: comms[0].recv(2)):
                    with pytest.raises(CollectiveError) as info:
                        await call()
                    last.append(info.value)
                    del info
                del last[:-3]

        await _flat(refused, 20, _scaled(300), memory=32768, comms=comms)
        assert max(map(_traceback_length, last)) < 20, [_traceback_length(e) for e in last]
    finally:
        for c in comms:
            await c.close()
