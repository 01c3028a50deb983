"""ElasticAsyncSGD: parameter-server training whose workers join and leave a running job.
Members are ElasticGroups in one process (tasks over real loopback TCP worlds and a real
rendezvous server), as in test_elastic.py; a worker crashes (its connections dropped without a
goodbye, as a killed process's are), a newcomer joins mid-run, a server dies."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import test_launcher
from test_launcher import REPO, Proc, clean_env, free_fixed_port, launcher
from test_peer_loss import crash

from asynccoll.elastic import ElasticGroup
from asynccoll.errors import CollectiveError
from asynccoll.parallel import MLP, SGD, ElasticAsyncSGD, ElasticServerStats, ServerLostError
from asynccoll.rendezvous import RendezvousServer

SIZES = [4, 16, 1]
W_TRUE = np.random.default_rng(0).standard_normal((SIZES[0], 1))
TIMEOUT = 20.0


def regression(seed: int, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((n, SIZES[0]))
    return x, np.sin(x @ W_TRUE)


TEST_SET = regression(12345, 512)

reaper = test_launcher.reaper   # the fixture: every process started is killed at teardown


async def connect(rdv: str, *, max_nodes: int = 8, min_nodes: int = 2) -> ElasticGroup:
    return await ElasticGroup.connect(min_nodes=min_nodes, max_nodes=max_nodes, rendezvous=rdv,
                                      token="t", settle=0.2, timeout=TIMEOUT, job="asgd")


def make(group: ElasticGroup, **kw: Any) -> ElasticAsyncSGD:
    return ElasticAsyncSGD(group, MLP(SIZES, seed=0), optimizer=SGD(lr=0.1),
                           max_staleness=8, stale="scale", check_interval=0.05, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_servers", [1, 2])
async def test_a_worker_joins_and_one_dies_and_training_goes_on(num_servers: int) -> None:
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    started = asyncio.Event()       # a worker is well into training: time for the newcomer
    slowest: list[float] = []       # the longest step of every worker

    victim: list[str] = []          # the first worker at step 30 crashes there

    async def member(name: str, steps: int) -> dict[str, Any]:
        group = await connect(rdv, min_nodes=num_servers + 1)
        try:
            opt = make(group, num_servers=num_servers)
            await opt.start()
            if opt.is_server:
                return {"name": name, "stats": await opt.serve()}
            longest = 0.0
            for s in range(steps):
                if s == 30 and name != "late" and not victim:
                    victim.append(name)
                    await crash(opt.comm)
                    return {"name": name, "id": group.id, "crashed": True}
                t0 = time.monotonic()
                await opt.step(regression(1000 * len(name) + 7 * s + ord(name[0])))
                longest = max(longest, time.monotonic() - t0)
                if s == 20:
                    started.set()
                await asyncio.sleep(0.01)
            slowest.append(longest)
            await opt.parameters()          # (pulls into the model)
            loss = await opt.model.loss(TEST_SET)
            await opt.finish()
            return {"name": name, "id": group.id, "steps": opt.steps, "dropped": opt.dropped,
                    "history": opt.history, "loss": loss}
        finally:
            await group.close()

    async def late() -> dict[str, Any]:
        await asyncio.wait_for(started.wait(), 30)
        return await member("late", 40)

    t0 = time.monotonic()
    initial = await MLP(SIZES, seed=0).loss(TEST_SET)
    try:
        results = await asyncio.gather(*(member(n, 90) for n in "pqrst"[:3 + num_servers]),
                                       late())
    finally:
        await server.close()
    elapsed = time.monotonic() - t0
    servers = [r for r in results if "stats" in r]
    assert len(servers) == num_servers, results
    stats: ElasticServerStats = servers[0]["stats"]
    # every server counted every push of every worker
    for other in servers[1:]:
        assert {i: (w.state, w.pushes) for i, w in other["stats"].workers.items()} == {
            i: (w.state, w.pushes) for i, w in stats.workers.items()}
    workers = {r["name"]: r for r in results if "stats" not in r}
    print({n: (r.get("steps"), r.get("dropped"), r.get("history")) for n, r in workers.items()},
          stats.generations, stats.version)
    # the newcomer's pushes were applied, under its member id; it finished
    newcomer = stats.workers[workers["late"]["id"]]
    assert newcomer.accepted + newcomer.scaled > 0 and newcomer.state == "done", stats
    assert workers["late"]["steps"] == 40
    # the crashed worker is lost, the others finished every step
    assert len(victim) == 1 and workers[victim[0]].get("crashed"), victim
    assert stats.workers[workers[victim[0]]["id"]].state == "lost", stats
    done = [r for n, r in workers.items() if n != victim[0]]
    assert all(r["steps"] in (90, 40) for r in done), done
    assert set(stats.done) == {r["id"] for r in done}
    assert stats.version == stats.accepted + stats.scaled >= 90
    assert stats.generations >= 3      # the first world, without x, with the newcomer
    # it trained, and nothing waited for the timeout
    assert all(r["loss"] < initial / 3 for r in done), (initial, done)
    assert max(slowest) < TIMEOUT / 4, slowest
    assert elapsed < 2 * TIMEOUT, elapsed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_servers", [1, 2])
async def test_a_lost_server_is_a_clear_error_for_every_member_quickly(
        num_servers: int) -> None:
    """The last server crashes (its connections dropped without a goodbye) while the workers
    train: every worker, and the other server, raise ServerLostError naming it, well before
    the timeout; a process that comes later raises it at once."""
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    crashed_at: list[float] = []
    victim = num_servers - 1
    want = f"parameter server {victim} was lost"

    async def member(name: str) -> tuple[str, Any, float]:
        group = await connect(rdv, min_nodes=num_servers + 1)
        try:
            opt = make(group, num_servers=num_servers)
            await opt.start()
            try:
                if opt.is_server and opt.server == victim:
                    await asyncio.sleep(0.5)            # the workers push for a while
                    await crash(opt.comm)
                    crashed_at.append(time.monotonic())
                    return name, "crashed", 0.0
                if opt.is_server:
                    await opt.serve()
                else:
                    for s in range(10_000):
                        await opt.step(regression(s))
                        await asyncio.sleep(0.005)
            except CollectiveError as exc:
                return name, exc, time.monotonic()
            return name, "no error", 0.0
        finally:
            await group.close()

    try:
        # a process that comes later (while the job's keys live: this connection holds them,
        # as asynccoll run's launcher does) hears of it at once
        group = await connect(rdv, min_nodes=num_servers + 1)
        try:
            results = await asyncio.gather(*(member(n) for n in "abcd"[:2 + num_servers]))
            t0 = time.monotonic()
            with pytest.raises(ServerLostError, match=want):
                await make(group, num_servers=num_servers).start()
            assert time.monotonic() - t0 < 2
        finally:
            await group.close()
    finally:
        await server.close()
    errors = [(exc, at) for _, exc, at in results if exc != "crashed"]
    assert len(errors) == 1 + num_servers and crashed_at, results
    for exc, at in errors:
        assert isinstance(exc, ServerLostError), exc
        assert want in str(exc) and "gone" in str(exc), exc
        assert at - crashed_at[0] < TIMEOUT / 4, at - crashed_at[0]


@pytest.mark.timeout(60)
async def test_a_worker_that_finishes_in_a_full_world_lets_a_waiting_one_in() -> None:
    """max_nodes=3, full with the server and two workers: a newcomer waits as a spare. The
    worker that finishes first opens the next generation, so the newcomer gets in (and the
    re-form does not wait for the finished worker), and its pushes are applied."""
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    running, arriving, joined = asyncio.Event(), asyncio.Event(), asyncio.Event()
    finished_at: list[float] = []
    ids: list[str] = []             # the first worker to get here finishes first

    async def member(newcomer: bool = False) -> dict[str, Any]:
        group = await connect(rdv, max_nodes=3)
        try:
            opt = make(group)
            if newcomer:
                arriving.set()
            await opt.start()
            if opt.is_server:
                return {"stats": await opt.serve()}
            ids.append(group.id)
            running.set()
            steps = 0
            # the first worker: 10 steps, then it finishes once the newcomer waits as a
            # spare; the other: until the newcomer is in; the newcomer: 20 steps
            while steps < (20 if newcomer else 10) or (
                    not newcomer and ids[0] != group.id and not joined.is_set()):
                await opt.step(regression(steps))
                steps += 1
                await asyncio.sleep(0.01)
            if newcomer:
                joined.set()
            elif ids[0] == group.id:
                await arriving.wait()
                await asyncio.sleep(0.5)                # (it waits as a spare by now)
            await opt.finish()
            finished_at.append(time.monotonic())
            return {"id": group.id, "history": opt.history, "at": time.monotonic(),
                    "steps": steps}
        finally:
            await group.close()

    async def late() -> dict[str, Any]:
        await asyncio.wait_for(running.wait(), 30)
        return await member(newcomer=True)

    try:
        results = await asyncio.gather(member(), member(), member(), late())
    finally:
        await server.close()
    stats: ElasticServerStats = next(r["stats"] for r in results if "stats" in r)
    newcomer = results[3]
    assert newcomer["history"][0][1] == 3, newcomer          # it took a finished one's place
    mine = stats.workers[newcomer["id"]]
    assert mine.state == "done" and mine.accepted + mine.scaled == 20, stats
    assert len(stats.done) == 3 and not stats.lost, stats
    # it got in (and did its 20 steps) soon after the first worker finished, not after a
    # timeout
    assert newcomer["at"] - min(finished_at) < TIMEOUT / 4


@pytest.mark.timeout(60)
async def test_serve_returns_when_the_last_worker_left_dies() -> None:
    """One worker finishes, the other then crashes: no worker is left, so serve() returns at
    once (the crashed one "lost"), without waiting for a generation nobody would join."""
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    finished = asyncio.Event()
    ids: list[str] = []

    async def member() -> dict[str, Any]:
        group = await connect(rdv)
        try:
            opt = make(group)
            await opt.start()
            if opt.is_server:
                stats = await opt.serve()
                return {"stats": stats, "at": time.monotonic()}
            ids.append(group.id)
            for s in range(10):
                await opt.step(regression(s))
            if ids[0] == group.id:
                await opt.finish()
                finished.set()
                return {"finished": group.id}
            await finished.wait()
            await opt.step(regression(10))
            await crash(opt.comm)
            return {"crashed": group.id, "at": time.monotonic()}
        finally:
            await group.close()

    try:
        results = await asyncio.gather(member(), member(), member())
    finally:
        await server.close()
    by = {k: r for r in results for k in r}
    stats: ElasticServerStats = by["stats"]["stats"]
    assert stats.done == (by["finished"]["finished"],), stats
    assert stats.lost == (by["crashed"]["crashed"],), stats
    assert stats.workers[by["crashed"]["crashed"]].pushes == 11
    assert stats.generations == 1 and stats.version == 21
    assert by["stats"]["at"] - by["crashed"]["at"] < TIMEOUT / 4


async def test_bad_arguments() -> None:
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    try:
        group = await connect(f"127.0.0.1:{server.port}")
        try:
            with pytest.raises(ValueError, match="min_nodes"):
                make(group, num_servers=2)
            with pytest.raises(ValueError, match="check_interval"):
                ElasticAsyncSGD(group, MLP(SIZES, seed=0), optimizer=SGD(lr=0.1),
                                check_interval=0)
            with pytest.raises(TypeError, match="optimizer"):
                ElasticAsyncSGD(group, MLP(SIZES, seed=0), optimizer="sgd")  # type: ignore
            opt = make(group)
            with pytest.raises(RuntimeError, match="before start"):
                await opt.step(regression(0))
        finally:
            await group.close()
    finally:
        await server.close()


# ------------------------------------------------------------------------ real processes

EXAMPLE = str(REPO / "examples" / "elastic_param_server.py")
ROLE = re.compile(r"^\[(\d+)\] ROLE (server|worker) pid=(\d+) id=(\w+)$")


def has(pattern: str) -> Callable[[list[str]], bool]:
    rx = re.compile(pattern)
    return lambda lines: any(rx.search(line) for line in lines)


@pytest.mark.timeout(120)
def test_processes_under_the_launcher_a_worker_killed_then_one_joins(
        reaper: Callable[..., Proc]) -> None:
    """``asynccoll run -n 3`` (1 server, 2 workers), one worker SIGKILLed mid-run, a new
    process joins the running job: the others go on, the newcomer's pushes are applied, the
    model trains, the launcher and the newcomer exit 0, and no wait reached the timeout."""
    port, token, timeout = free_fixed_port(), "easgd-test", 30
    common = ["--step-delay", "0.01", "--settle", "0.3", "--timeout", str(timeout)]
    t0 = time.monotonic()
    job = reaper(launcher("-n", "3", "--min-nodes", "2", "--max-nodes", "4", "--port",
                          str(port), "--token", token, EXAMPLE, "--steps", "300", *common))
    assert job.wait_for(lambda lines: sum(bool(ROLE.match(x)) for x in lines) == 3
                        and has(r"STEP 25 ")(lines), 60), job.output
    roles = [m.groups() for line in job.lines if (m := ROLE.match(line))]
    victim = next(r for r in roles if r[1] == "worker")
    os.kill(int(victim[2]), signal.SIGKILL)
    killed = time.monotonic()
    assert job.wait_for(has(r"WORLD gen=\d+ size=2 "), 30), job.output
    assert time.monotonic() - killed < timeout / 3

    newcomer = reaper([sys.executable, EXAMPLE, "--steps", "60", *common], clean_env(
        ASYNCCOLL_RENDEZVOUS=f"127.0.0.1:{port}", ASYNCCOLL_TOKEN=token,
        ASYNCCOLL_MIN_NODES="2", ASYNCCOLL_MAX_NODES="4"))
    assert newcomer.finish(90) == 0, newcomer.output + job.output
    assert job.finish(60) == 0, job.output
    assert time.monotonic() - t0 < 3 * timeout

    out = job.output + "\n" + newcomer.output
    stats = json.loads(next(line.split("STATS ", 1)[1] for line in job.lines
                            if "STATS " in line))
    new_id = re.search(r"ROLE worker pid=\d+ id=(\w+)", newcomer.output).group(1)  # type: ignore
    assert stats["workers"][victim[3]]["state"] == "lost", stats
    mine = stats["workers"][new_id]
    assert mine["state"] == "done" and mine["accepted"] + mine["scaled"] > 0, stats
    finals = re.findall(r"FINAL id=(\w+) steps=(\d+) dropped=(\d+) initial=([\d.]+) "
                        r"loss=([\d.]+)", out)
    assert {(i, int(s)) for i, s, *_ in finals} == {
        (r[3], 300) for r in roles if r[1] == "worker" and r != victim} | {(new_id, 60)}, out
    for _, _, dropped, initial, loss in finals:
        assert float(loss) < float(initial) / 2 and int(dropped) <= 3, out
