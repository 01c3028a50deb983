"""Lifecycle of ``run_local`` worlds and of the process around them: which error a failed world
re-raises, and what a call leaves behind for later ones."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import asynccoll
from asynccoll import Communicator

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("backend", ["memory", "tcp"])
@pytest.mark.timeout(30)
async def test_a_rank_that_raises_cancelled_error_unblocks_the_others(backend: str) -> None:
    """A CancelledError that ``fn`` raises itself (or gets from awaiting something cancelled)
    is that rank's failure: the ranks waiting on it are unblocked at once, not after their
    timeout, and it is what ``run_local`` re-raises."""
    gone = asyncio.get_running_loop().create_future()
    gone.cancel()

    async def fn(comm: Communicator) -> int:
        if comm.rank == 1:
            await gone  # raises CancelledError, though nobody cancelled this rank
        await comm.barrier()
        return comm.rank

    start = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await asynccoll.run_local(fn, 3, backend, timeout=20.0)
    assert time.monotonic() - start < 10.0


@pytest.mark.timeout(30)
async def test_a_rank_that_raises_cancelled_error_cancels_ranks_not_in_a_collective() -> None:
    gone = asyncio.get_running_loop().create_future()
    gone.cancel()
    cancelled: list[int] = []

    async def fn(comm: Communicator) -> None:
        if comm.rank == 0:
            await gone
        try:
            await asyncio.sleep(20)
        except asyncio.CancelledError:
            cancelled.append(comm.rank)
            raise

    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asynccoll.run_local(fn, 2), 10)
    assert cancelled == [1]


def _mpi_importable() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _mpi_importable(), reason="mpi4py is not installed")
@pytest.mark.timeout(90)
def test_info_report_leaves_mpi_to_initialise_as_usual() -> None:
    """``asynccoll.info.report()`` in a process that later uses the mpi backend: MPI still
    initialises when ``mpi4py.MPI`` is imported (report() must not reconfigure mpi4py)."""
    code = ("import mpi4py\n"
            "before = (mpi4py.rc.initialize, mpi4py.rc.finalize)\n"
            "from asynccoll.info import report\n"
            "line = [ln for ln in report().splitlines() if ln.strip().startswith('mpi')][0]\n"
            "if 'unavailable' in line:\n"
            "    print('SKIP', line)\n"
            "else:\n"
            "    from mpi4py import MPI\n"
            "    after = (mpi4py.rc.initialize, mpi4py.rc.finalize)\n"
            "    print(after == before, MPI.Is_initialized())\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=80, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.split() == ["True", "True"], proc.stdout + proc.stderr[-4000:]


def _listening() -> int:
    """How many TCP sockets this process holds open in the LISTEN state (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                count += fields[3] == "0A" and fields[9] in inodes  # 0A: LISTEN
    return count


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc")
@pytest.mark.timeout(60)
async def test_cancelling_a_tcp_world_while_it_forms_leaks_nothing() -> None:
    """``run_local(..., "tcp")`` cancelled while its ranks connect (or close): the ranks
    formed so far, their listeners and the rendezvous server are closed, and no task is left
    pending. (Each delay lands in another phase: rendezvous, listeners, dialling, the run,
    the closes.)"""
    async def fn(comm: Communicator) -> int:
        return comm.rank

    await asynccoll.run_local(fn, 3, "tcp")
    listening = _listening()
    for delay_ms in (0, 0.5, 1, 1.5, 2, 3, 4, 6, 10, 20):
        task = asyncio.ensure_future(asynccoll.run_local(fn, 3, "tcp"))
        await asyncio.sleep(delay_ms / 1000)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0.2)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not others, others
    assert _listening() <= listening
    with warnings.catch_warnings():  # anything left is finalised here, not in a later test
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.parametrize("backend", ["memory", "tcp"])
@pytest.mark.parametrize("timeout", [float("nan"), -1.0, None, "5"])
async def test_a_bad_timeout_is_refused(backend: str, timeout: object) -> None:
    async def fn(comm: Communicator) -> None:
        raise AssertionError("no world should form")

    with pytest.raises((TypeError, ValueError), match="timeout"):
        await asynccoll.run_local(fn, 2, backend, timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["memory", "tcp"])
@pytest.mark.parametrize("gpu_staging", [False, True])
async def test_setting_a_bad_timeout_is_refused_at_once(backend: str, gpu_staging: bool
                                                        ) -> None:
    """``comm.timeout = None`` (meaning "no timeout") or ``"5"`` was taken, and every later
    call raised "unsupported operand type(s) for /: 'NoneType' and 'int'"; ``-1`` and NaN
    were taken silently. The attribute is checked as ``run_local(timeout=...)`` is: the bad
    value is refused where it is set, and the communicator goes on with its timeout."""
    async def fn(comm: Communicator) -> float:
        for bad, error in ((None, TypeError), ("5", TypeError), (True, TypeError),
                           (-1.0, ValueError), (float("nan"), ValueError)):
            with pytest.raises(error, match="timeout"):
                comm.timeout = bad  # type: ignore[assignment]
            assert comm.timeout == 5.0
        sub = await comm.new_group([1, 0])
        assert sub is not None
        with pytest.raises(TypeError, match="timeout"):
            sub.timeout = None  # type: ignore[assignment]
        sub.timeout = float("inf")
        comm.timeout = np.float32(2.5)  # type: ignore[assignment]
        assert comm.timeout == 2.5 and type(comm.timeout) is float
        await sub.barrier()
        return float((await comm.all_reduce(np.ones(1)))[0])

    # (gpu_staging: the wrapper's setter converted with float() first, so "5" was taken)
    assert await asynccoll.run_local(fn, 2, backend, timeout=5.0,
                                     gpu_staging=gpu_staging) == [2.0, 2.0]


@pytest.mark.parametrize("timeout", [float("inf"), 1e6])
async def test_tcp_takes_no_timeout_or_a_long_one(timeout: float) -> None:
    """``timeout=inf`` (no timeout, as on the memory backend) or one longer than a day: a
    TCP world failed to form with "timeout must be a number in [0, 86400.0], got inf" (the
    rendezvous' bound of a wait), from ``run_local`` and ``init`` alike; the world's
    formation now waits at most that day, and the collectives have the timeout given."""
    async def fn(comm: Communicator) -> float:
        assert comm.timeout == timeout
        return float((await comm.all_reduce(np.ones(1)))[0])

    assert await asynccoll.run_local(fn, 2, "tcp", timeout=timeout) == [2.0, 2.0]
    comm = await asynccoll.init("tcp", rank=0, world_size=1, port=0, timeout=timeout)
    async with comm:
        assert await fn(comm) == 1.0


async def test_a_closed_communicator_keeps_no_timer() -> None:
    """The watchdog's timer goes with the communicator (no world kept alive by it)."""
    async def fn(comm: Communicator) -> Communicator:
        await comm.barrier()
        return comm

    for comm in await asynccoll.run_local(fn, 2, "memory", timeout=600):
        assert comm._watchdog._handle is None  # run_local closed it


@pytest.mark.parametrize("backend", ["memory", "tcp"])
@pytest.mark.timeout(30)
async def test_a_group_closed_under_its_collective_keeps_its_timeout(backend: str) -> None:
    """A group closed while one of its collectives waits for a peer that never comes: the
    collective still raises CollectiveTimeout after the group's timeout (closing the group
    stopped its watchdog, and the collective waited for ever), and the timer goes after it."""
    async def fn(comm: Communicator) -> float | None:
        group = await comm.new_group([0, 1])
        if comm.rank == 1:
            await asyncio.sleep(1.5)  # never calls the group's all_reduce in time
            return None
        assert group is not None
        start = time.monotonic()
        call = asyncio.ensure_future(group.all_reduce(np.ones(4)))
        await asyncio.sleep(0.05)
        await group.close()
        with pytest.raises(asynccoll.CollectiveTimeout):
            await asyncio.wait_for(call, 1.2)
        await asyncio.sleep(0.3)
        assert group._watchdog._handle is None
        return time.monotonic() - start

    comms = await asynccoll.api.local_world(2, backend, timeout=0.5)
    try:
        took, _ = await asyncio.gather(*(fn(c) for c in comms))
    finally:
        for c in comms:
            await c.close()
    assert took is not None and took < 1.5


@pytest.mark.parametrize(("backend", "timeout"), [("memory", float("inf")), ("memory", 600.0),
                                                  ("tcp", 600.0)])
async def test_a_dropped_subgroup_keeps_no_world_alive(backend: str, timeout: float) -> None:
    """Worlds formed and closed one after another, each with a subgroup that is used and
    then dropped without a close (as new_group in a loop does): once the world closed, its
    transports are freed at once. The subgroup's watchdog timer, left armed after its last
    call, held the world for timeout / 4 (for good without a timeout: 3 transports a world)."""
    import weakref

    transports: list[weakref.ref[object]] = []

    async def fn(comm: Communicator) -> None:
        transports.append(weakref.ref(comm.transport))
        sub = await comm.new_group([0, 1])
        if sub is not None:
            await sub.all_reduce(np.ones(10))
        await comm.barrier()

    for _ in range(3):
        await asynccoll.run_local(fn, 3, backend, timeout=timeout)
    gc.collect()
    alive = [ref for ref in transports if ref() is not None]
    assert not alive, f"{len(alive)} of {len(transports)} transports of closed worlds alive"
    loop = asyncio.get_running_loop()
    assert not [h for h in loop._scheduled  # type: ignore[attr-defined]
                if not h.cancelled() and h.when() == float("inf")]


@pytest.mark.timeout(60)
def test_a_tcp_world_used_from_another_event_loop_says_so() -> None:
    """A TCP world formed in one event loop and used from a later asyncio.run(): a small
    all_reduce went through by chance, a larger one raised 'Event loop is closed' from inside
    the transport (with "coroutine '_dial_and_flush' was never awaited") and broke the world.
    Every call now raises a RuntimeError saying so before it takes its number, and the world
    goes on in its own loop; the memory backend, bound to no loop, works in either."""
    async def use(comms: list[Communicator], n: int) -> list[np.ndarray]:
        async with asyncio.timeout(10):
            return await asyncio.gather(*(c.all_reduce(np.ones(n)) for c in comms))

    async def send(comms: list[Communicator]) -> None:
        async with asyncio.timeout(10):
            await comms[0].send(np.ones(3), 1)

    home = asyncio.new_event_loop()
    try:
        comms = home.run_until_complete(asynccoll.api.local_world(2, "tcp", timeout=5))
        try:
            for n in (10, 100_000):
                with pytest.raises(RuntimeError, match="formed in another event loop"):
                    asyncio.run(use(comms, n))
            with pytest.raises(RuntimeError, match="formed in another event loop"):
                asyncio.run(send(comms))
            # closing it there ('async with comm:' in the later asyncio.run) said 'Event loop
            # is closed' from inside the transport, and left the world half closed
            with pytest.raises(RuntimeError, match="formed in another event loop"):
                asyncio.run(comms[0].close())
            for got in home.run_until_complete(use(comms, 100_000)):
                assert (got == 2).all()
        finally:
            for c in comms:
                home.run_until_complete(c.close())
        comms = home.run_until_complete(asynccoll.api.local_world(2, "memory", timeout=5))
        for got in asyncio.run(use(comms, 100_000)):
            assert (got == 2).all()
        for c in comms:
            home.run_until_complete(c.close())
    finally:
        home.close()


@pytest.mark.timeout(30)
async def test_calls_pending_in_a_dropped_memory_world_still_time_out() -> None:
    """A memory world dropped without a close while some ranks' collectives wait for a rank
    that never calls (a notebook cell's background tasks, their references overwritten):
    nothing but the watchdog's timer refers to them in process, and it refers weakly, so the
    garbage collector destroyed the tasks ('Task was destroyed but it is pending!'), their
    done callbacks never ran and their timeout never raised. They raise CollectiveTimeout
    (and CollectiveError) after the timeout, as on tcp, where the sockets keep a world."""
    ended: list[BaseException | None] = []

    def on_end(task: asyncio.Task[object]) -> None:
        ended.append(None if task.cancelled() else task.exception())

    async def start() -> None:
        comms = await asynccoll.api.local_world(3, "memory", timeout=0.5)
        for comm in comms[:2]:  # rank 2 never calls
            asyncio.ensure_future(comm.all_reduce(np.ones(8))).add_done_callback(on_end)
        await asyncio.sleep(0.05)

    await start()
    gc.collect()
    deadline = time.monotonic() + 10
    while len(ended) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        gc.collect()
    assert len(ended) == 2, f"the pending calls ended {len(ended)} of 2 times: collected"
    assert all(isinstance(e, asynccoll.CollectiveError) for e in ended), ended
    assert any(isinstance(e, asynccoll.CollectiveTimeout) for e in ended), ended


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc")
@pytest.mark.timeout(60)
async def test_cancelling_a_tcp_world_as_its_ranks_return_closes_it() -> None:
    """``run_local(..., "tcp")`` cancelled in the turns after every rank returned (while it
    collects the rank tasks, before it closes the world): the world is closed all the same
    (it was left open, with its listeners, connections and rendezvous server, about once in
    a few hundred cancels at random delays)."""
    returned: list[int] = []
    all_returned = asyncio.Event()

    async def fn(comm: Communicator) -> int:
        returned.append(comm.rank)
        if len(returned) == 2:
            all_returned.set()
        return comm.rank

    await asynccoll.run_local(fn, 2, "tcp")
    listening = _listening()
    for turns in range(8):
        returned.clear()
        all_returned.clear()
        task = asyncio.ensure_future(asynccoll.run_local(fn, 2, "tcp"))
        await all_returned.wait()
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert _listening() <= listening, f"a world left open when cancelled {turns} turns after"
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not others, others
    with warnings.catch_warnings():  # anything left is finalised here, not in a later test
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc")
@pytest.mark.timeout(60)
async def test_cancelling_a_forming_tcp_world_twice_leaks_nothing() -> None:
    """``run_local(..., "tcp")`` cancelled while its ranks connect, and cancelled again while
    it cleans up (a second Ctrl-C, a task group shutting down): every clean-up still runs to
    its end (the second cancel used to stop it halfway, leaving rendezvous servers, clients
    and listeners open about every other time)."""
    async def fn(comm: Communicator) -> int:
        return comm.rank

    await asynccoll.run_local(fn, 3, "tcp")
    listening = _listening()
    for delay_ms in (0, 1, 2, 3, 5, 8):
        for turns in (1, 3, 6):
            task = asyncio.ensure_future(asynccoll.run_local(fn, 3, "tcp"))
            await asyncio.sleep(delay_ms / 1000)
            task.cancel()
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            assert not others, (delay_ms, turns, others)
            assert _listening() <= listening, (delay_ms, turns)
    with warnings.catch_warnings():  # anything left is finalised here, not in a later test
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
