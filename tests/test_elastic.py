"""Elastic training in one process: members of an ElasticGroup as tasks over real loopback
TCP worlds and a real rendezvous server; one crashes, one joins later."""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import numpy as np
import pytest
from test_peer_loss import crash

from asynccoll import Communicator
from asynccoll.elastic import ElasticGroup
from asynccoll.errors import CollectiveTimeout, RendezvousError, RendezvousTimeout
from asynccoll.parallel import (
    MLP,
    Adam,
    DistributedModel,
    as_distributed,
    train_locally,
)
from asynccoll.parallel.elastic import ElasticTrainer
from asynccoll.rendezvous import RendezvousServer

SIZES = [6, 10, 3]
BATCH = 12


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    return rng.standard_normal((BATCH, SIZES[0])), rng.standard_normal((BATCH, SIZES[-1]))


def my_share(step: int, comm: Communicator) -> tuple[np.ndarray, ...]:
    return tuple(np.array_split(a, comm.world_size)[comm.rank] for a in batch(step))


async def replay(steps: int, make_opt: Any) -> np.ndarray:
    _, params = await train_locally(MLP(SIZES, seed=0), make_opt(),
                                    (batch(step) for step in range(steps)))
    return params


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
async def test_crash_then_join(strategy: str) -> None:
    total = 90
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    make_opt = lambda: Adam(lr=0.01)  # noqa: E731
    reached = asyncio.Event()

    def build(comm: Communicator) -> DistributedModel:
        return as_distributed(MLP(SIZES, seed=0), comm, make_opt(), strategy=strategy)

    async def step_fn(dist: DistributedModel, step: int) -> float:
        return await dist.step(my_share(step, dist.comm))

    async def member(name: str, crash_at: int | None = None) -> dict[str, Any]:
        group = await ElasticGroup.connect(min_nodes=2, max_nodes=4, rendezvous=rdv, token="t",
                                           settle=0.2, timeout=20)
        try:
            trainer = ElasticTrainer(group, build, commit_every=7)
            await trainer.start()
            while trainer.step < total:
                if crash_at is not None and trainer.step == crash_at:
                    await crash(trainer.comm)
                    return {"name": name, "crashed": True}
                await trainer.run_step(step_fn)
                if trainer.comm.world_size == 2 and trainer.step >= 55:
                    reached.set()
                await asyncio.sleep(0)
            assert trainer.dist is not None
            params, _, _ = await trainer.dist.full_state()
            return {"name": name, "params": params, "history": trainer.history}
        finally:
            await group.close()

    async def late() -> dict[str, Any]:
        await asyncio.wait_for(reached.wait(), 30)
        return await member("late")

    try:
        results = await asyncio.gather(member("a"), member("b"), member("c", crash_at=30),
                                       late())
    finally:
        await server.close()
    want = await replay(total, make_opt)
    finished = [r for r in results if "params" in r]
    assert [r["name"] for r in finished] == ["a", "b", "late"]
    for r in finished:
        np.testing.assert_allclose(r["params"], want, rtol=1e-9, atol=1e-12)
        np.testing.assert_array_equal(r["params"], finished[0]["params"])
    print({r["name"]: r["history"] for r in finished})
    sizes = [size for _, size, _ in finished[0]["history"]]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, finished[0]["history"]
    # after the crash at step 30 the survivors resumed from the commit of step 28
    assert any(size == 2 and step == 28 for _, size, step in finished[0]["history"]), \
        finished[0]["history"]
    late_hist = finished[2]["history"]
    assert late_hist[0][1] == 3 and late_hist[0][2] >= 55      # joined the running job


async def test_bad_sizes() -> None:
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        with pytest.raises(ValueError, match="min_nodes"):
            await ElasticGroup.connect(min_nodes=3, max_nodes=2,
                                       rendezvous=f"127.0.0.1:{server.port}")
    finally:
        await server.close()
    with pytest.raises(ValueError, match="rendezvous"):
        await ElasticGroup.connect(rendezvous="nohost")


async def test_trainer_gives_up_after_one_timeout_when_too_few_join() -> None:
    """Fewer than min_nodes: forming waits up to ``timeout``, then raises RendezvousError (as
    the docs promise); the trainer does not retry it ``max_reforms`` times over."""
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        group = await ElasticGroup.connect(min_nodes=2, max_nodes=2, settle=0.05, timeout=1.0,
                                           rendezvous=f"127.0.0.1:{server.port}")
        try:
            trainer = ElasticTrainer(group, lambda comm: as_distributed(
                MLP(SIZES, seed=0), comm, Adam(lr=0.01)))
            began = time.monotonic()
            with pytest.raises(RendezvousError, match="1 of at least 2"):
                await trainer.start()
            assert time.monotonic() - began < 2.5
        finally:
            await group.close()
    finally:
        await server.close()


async def test_a_generation_that_does_not_form_in_time_is_a_rendezvous_timeout() -> None:
    """Too few members within ``timeout`` is a ``RendezvousTimeout``, as a TCP world that
    does not form is (docs/concepts.md, Errors): code catching ``CollectiveTimeout`` or
    ``TimeoutError`` for a world that never formed catches it too."""
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        group = await ElasticGroup.connect(min_nodes=2, max_nodes=2, settle=0.05, timeout=0.5,
                                           rendezvous=f"127.0.0.1:{server.port}")
        try:
            with pytest.raises(RendezvousTimeout, match="1 of at least 2") as info:
                await asyncio.wait_for(group.form(), 5)
            assert isinstance(info.value, CollectiveTimeout)
            assert isinstance(info.value, TimeoutError)
        finally:
            await group.close()
    finally:
        await server.close()


async def test_joining_again_after_a_timeout_counts_once() -> None:
    """A process whose ``form`` timed out and that tries again is one member, not two: the
    generation forms with the process that comes later, not with a phantom of itself."""
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    try:
        a = await ElasticGroup.connect(min_nodes=2, max_nodes=2, settle=0.05, timeout=1.0,
                                       rendezvous=rdv)
        b = await ElasticGroup.connect(min_nodes=2, max_nodes=2, settle=0.05, timeout=5.0,
                                       rendezvous=rdv)
        try:
            with pytest.raises(RendezvousError):
                await a.form()                  # alone: times out

            async def later() -> Communicator:
                await asyncio.sleep(0.3)        # `a` is waiting again by now
                return await b.form()

            ca, cb = await asyncio.gather(a.form(), later())
            assert a.generation is not None and b.generation is not None
            assert sorted(a.generation.roster) == sorted([a.id, b.id])
            assert (ca.world_size, cb.world_size) == (2, 2)
            assert {ca.rank, cb.rank} == {0, 1}
        finally:
            await asyncio.gather(a.close(), b.close())
    finally:
        await server.close()


async def test_form_gives_up_when_worlds_keep_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world that fails to form every time (here: the address cannot be bound) ends in
    RendezvousError within about ``timeout``, instead of opening generations forever."""
    import asynccoll.transport.tcp_world as tcp_world

    async def unbindable(*args: Any, **kw: Any) -> Communicator:
        raise OSError(99, "Cannot assign requested address")

    monkeypatch.setattr(tcp_world, "tcp_store_world", unbindable)
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        group = await ElasticGroup.connect(min_nodes=1, max_nodes=1, settle=0.0, timeout=0.5,
                                           rendezvous=f"127.0.0.1:{server.port}")
        try:
            with pytest.raises(RendezvousError, match=r"within 0\.5 s") as info:
                await asyncio.wait_for(group.form(), 10)
            assert isinstance(info.value.__cause__, OSError)
        finally:
            await group.close()
    finally:
        await server.close()


async def test_bad_settle_is_refused_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad argument raises ValueError without leaving a rendezvous connection open."""
    from asynccoll.rendezvous import RendezvousClient

    opened: list[Any] = []
    connect = RendezvousClient.connect

    async def tracked(*args: Any, **kw: Any) -> Any:
        opened.append(await connect(*args, **kw))
        return opened[-1]

    monkeypatch.setattr(RendezvousClient, "connect", tracked)
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        with pytest.raises(ValueError, match="settle"):
            await ElasticGroup.connect(settle=-1.0, rendezvous=f"127.0.0.1:{server.port}")
    finally:
        for client in opened:
            await client.close()
        await server.close()
    assert opened == []


async def test_no_timeout_forms_a_world_without_one() -> None:
    """``timeout=math.inf`` (as for a Communicator): the group connects and forms, and the
    world's collectives have no timeout either (it was refused: the rendezvous protocol
    bounds one request's wait, which is no bound of the group's own)."""
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        group = await ElasticGroup.connect(min_nodes=1, max_nodes=1, settle=0.0,
                                           timeout=math.inf,
                                           rendezvous=f"127.0.0.1:{server.port}")
        try:
            comm = await asyncio.wait_for(group.form(), 10)
            assert (comm.world_size, comm.timeout) == (1, math.inf)
            x = np.arange(3.0)
            await comm.all_reduce(x)
            np.testing.assert_array_equal(x, np.arange(3.0))
        finally:
            await group.close()
    finally:
        await server.close()


@pytest.mark.parametrize(("timeout", "error"), [(-1.0, ValueError), (math.nan, ValueError),
                                                ("5", TypeError), (True, TypeError),
                                                (None, TypeError)])
async def test_bad_timeout_is_refused_before_connecting(timeout: Any, error: type) -> None:
    """Checked as ``Communicator.timeout`` is (``check_timeout``): not a number is a
    TypeError, a negative or NaN one a ValueError (0 is a timeout: see test_config.py)."""
    # nothing listens on port 1: a connection attempt would raise RendezvousError instead
    with pytest.raises(error, match="timeout must be"):
        await ElasticGroup.connect(timeout=timeout, rendezvous="127.0.0.1:1")


async def test_after_a_world_failed_to_form_its_members_are_all_expected_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A member left generation 0 (``check`` counted it), so generation 1 expects one member
    of 0 fewer. Generation 1 closes without the leaver but its world fails to form: generation
    2 must expect *every* member of 1 back. The leaver was counted out a second time, so a
    survivor could be pushed out of a full generation 2 by a newcomer."""
    import asynccoll.transport.tcp_world as tcp_world
    from asynccoll.elastic import Generation

    real = tcp_world.tcp_store_world
    calls: list[str] = []

    async def fails_once(client: Any, prefix: str, *args: Any, **kw: Any) -> Communicator:
        calls.append(prefix)
        if len(calls) == 1:
            raise OSError(99, "Cannot assign requested address")
        return await real(client, prefix, *args, **kw)

    monkeypatch.setattr(tcp_world, "tcp_store_world", fails_once)
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        group = await ElasticGroup.connect(min_nodes=1, max_nodes=1, settle=0.0, timeout=5.0,
                                           rendezvous=f"127.0.0.1:{server.port}")
        try:
            # a member of a world of 3 (generation 0) of which one member leaves
            group.generation = Generation(0, 0, 3, (group.id, "b", "c"), ())
            group._leavers = 1
            comm = await asyncio.wait_for(group.form(), 10)
            assert calls == ["elastic/1", "elastic/2"] and comm.world_size == 1
            first = json.loads(await group.client.get("elastic/1/m/0", wait=False))
            second = json.loads(await group.client.get("elastic/2/m/0", wait=False))
            assert (first["gen"], first["size"]) == (0, 2)    # 3 members, 1 leaves
            assert (second["gen"], second["size"]) == (1, 1)  # all of generation 1
        finally:
            await group.close()
    finally:
        await server.close()


class ClosedJustAfter:
    """A rendezvous client that answers the first read of a generation's roster as if it
    were written a moment later (just after this process looked)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.hidden = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def get(self, key: str, **kw: Any) -> bytes:
        if self.hidden and key.endswith("/closed"):
            self.hidden = False
            raise KeyError(key)
        return bytes(await self.client.get(key, **kw))


async def test_member_of_a_roster_closed_while_it_looked_stays_in_it() -> None:
    """Generation 0 closes with this process in its roster and generation 1 opens between
    the process's two reads (roster, then round): it is still a member of generation 0
    (the others wait for it there), not a process that came too late."""
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        group = await ElasticGroup.connect(min_nodes=2, max_nodes=4, settle=0.05, timeout=2.0,
                                           rendezvous=f"127.0.0.1:{server.port}")
        try:
            await group.client.set("elastic/0/closed", f'["{group.id}", "other"]')
            await group.client.set("elastic/round", "1")
            group.client = ClosedJustAfter(group.client)
            gen = await group._join(0, time.monotonic() + 2.0)
            assert gen is not None and (gen.number, gen.rank, gen.world_size) == (0, 0, 2)
        finally:
            await group.close()
    finally:
        await server.close()


async def test_commit_before_start_is_a_clear_error() -> None:
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    try:
        async with await ElasticGroup.connect(rendezvous=f"127.0.0.1:{server.port}") as group:
            trainer = ElasticTrainer(group, lambda comm: as_distributed(
                MLP(SIZES, seed=0), comm, Adam(lr=0.01)))
            with pytest.raises(RuntimeError, match="start"):
                await trainer.commit()
    finally:
        await server.close()


@pytest.mark.timeout(60)
async def test_old_generations_leave_no_keys_behind() -> None:
    """A job that reforms again and again keeps the keys of its last generations only: rank 0
    of each new generation deletes those before the previous one (``elastic/swept``)."""
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    try:
        groups = [await ElasticGroup.connect(min_nodes=2, max_nodes=2, settle=0.05,
                                             timeout=10.0, rendezvous=rdv) for _ in range(2)]
        try:
            counts = []
            for _ in range(8):
                comms = await asyncio.gather(*(g.form() for g in groups))
                x = [np.full(3, c.rank + 1.0) for c in comms]
                await asyncio.gather(*(c.all_reduce(a) for c, a in zip(comms, x, strict=True)))
                assert all((a == 3.0).all() for a in x)  # the world works
                counts.append(await groups[0].client.num_keys())
            last = groups[0].generation
            assert last is not None and last.number == 7
            # generations 6 and 7 (9 keys each with 2 members), round and swept
            assert counts[-1] == counts[-2] <= 2 * 9 + 2, counts
            for h in range(6):
                with pytest.raises(KeyError):
                    await groups[0].client.get(f"elastic/{h}/closed", wait=False)
            assert await groups[0].client.get("elastic/6/closed", wait=False)
        finally:
            await asyncio.gather(*(g.close() for g in groups))
    finally:
        await server.close()


@pytest.mark.timeout(60)
async def test_member_dying_while_the_next_world_forms_costs_one_timeout_not_the_job() -> None:
    """A member that joins the next generation (it is in the roster) and dies before its
    world forms leaves the others waiting for its address. That wait times out, but the
    survivors (still at least min_nodes) must then form the generation after it without the
    dead member, not give up with RendezvousError because the wait used up their budget."""
    server = RendezvousServer("127.0.0.1", 0)
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    try:
        a, b, c = [await ElasticGroup.connect(min_nodes=2, max_nodes=3, settle=0.2,
                                              timeout=2.0, rendezvous=rdv) for _ in range(3)]
        try:
            await asyncio.gather(a.form(), b.form(), c.form())          # generation 0

            async def dies_in_the_roster() -> None:
                assert c.comm is not None
                await c.comm.close()
                c.comm = None
                await c._open(1)
                gen = await c._join(1, time.monotonic() + 2.0)
                assert gen is not None and gen.world_size == 3           # in the roster
                await c.client.close()                                   # and gone

            began = time.monotonic()
            ca, cb, _ = await asyncio.gather(a.form(), b.form(), dies_in_the_roster())
            took = time.monotonic() - began
            assert a.generation is not None and b.generation is not None
            assert a.generation.number == b.generation.number == 2
            assert (ca.world_size, cb.world_size) == (2, 2) and {ca.rank, cb.rank} == {0, 1}
            x = [np.full(3, ca.rank + 1.0), np.full(3, cb.rank + 1.0)]
            await asyncio.gather(ca.all_reduce(x[0]), cb.all_reduce(x[1]))
            assert all((v == 3.0).all() for v in x)                      # the world works
            assert took < 2 * 2.0 + 3.0, took
        finally:
            await asyncio.gather(a.close(), b.close(), c.close())
    finally:
        await server.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
async def test_a_member_that_leaves_loses_no_steps(strategy: str) -> None:
    """A member asked to leave (say on SIGTERM, from a signal handler) finishes its step; the
    job commits that step and the others go on from it without the leaver: nothing redone, no
    timeout waited, and the result is still the replay's."""
    total, leave_at = 45, 23
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    make_opt = lambda: Adam(lr=0.01)  # noqa: E731

    def build(comm: Communicator) -> DistributedModel:
        return as_distributed(MLP(SIZES, seed=0), comm, make_opt(), strategy=strategy)

    async def step_fn(dist: DistributedModel, step: int) -> float:
        return await dist.step(my_share(step, dist.comm))

    async def member(name: str, leave_at: int | None = None) -> dict[str, Any]:
        group = await ElasticGroup.connect(min_nodes=2, max_nodes=4, rendezvous=rdv, token="t",
                                           settle=0.2, timeout=20)
        try:
            trainer = ElasticTrainer(group, build, commit_every=10)
            await trainer.start()
            while trainer.step < total and not trainer.left:
                if trainer.step == leave_at:
                    trainer.request_leave()
                await trainer.run_step(step_fn)
            if trainer.left:
                assert group.comm is None and trainer.dist is None
                with pytest.raises(RuntimeError, match="left the elastic job at step 24"):
                    await trainer.run_step(step_fn)
                # not "not started: await trainer.start() first"
                with pytest.raises(RuntimeError, match="left the elastic job at step 24"):
                    trainer.comm  # noqa: B018
                with pytest.raises(RuntimeError, match="left the elastic job at step 24"):
                    await trainer.commit()
                return {"name": name, "left_at": trainer.step, "history": trainer.history}
            assert trainer.dist is not None
            params, _, _ = await trainer.dist.full_state()
            return {"name": name, "params": params, "history": trainer.history}
        finally:
            await group.close()

    began = time.monotonic()
    try:
        results = await asyncio.gather(member("a"), member("b"), member("c", leave_at))
    finally:
        await server.close()
    took = time.monotonic() - began
    want = await replay(total, make_opt)
    a, b, c = results
    assert c == {"name": "c", "left_at": leave_at + 1, "history": [(0, 3, 0)]}
    for r in (a, b):
        np.testing.assert_allclose(r["params"], want, rtol=1e-9, atol=1e-12)
        # the step the leaver finished was committed: the two went on from it, not from 20
        assert r["history"] == [(0, 3, 0), (1, 2, leave_at + 1)], r["history"]
    np.testing.assert_array_equal(a["params"], b["params"])
    assert took < 15, f"took {took:.1f} s: the survivors waited for the leaver"


class Gone(Exception):
    """A member that crashed (the test's stand-in for a killed process)."""


async def elastic_member(rdv: str, total: int, *, leave_at: int | None = None,
                         crash_before: int | None = None, crash_after: int | None = None,
                         max_nodes: int = 4, commit_every: int = 10) -> dict[str, Any]:
    """One DDP member over ``rdv``: asks to leave before step ``leave_at``; drops its
    connections (as a killed process would) before step ``crash_before``, or after step
    ``crash_after`` (before the membership check that follows it)."""
    group = await ElasticGroup.connect(min_nodes=2, max_nodes=max_nodes, rendezvous=rdv,
                                       token="t", settle=0.2, timeout=20)

    def build(comm: Communicator) -> DistributedModel:
        return as_distributed(MLP(SIZES, seed=0), comm, Adam(lr=0.01))

    async def step_fn(dist: DistributedModel, step: int) -> float:
        loss = await dist.step(my_share(step, dist.comm))
        if step == crash_after:
            await crash(dist.comm)
            raise Gone
        return loss

    try:
        trainer = ElasticTrainer(group, build, commit_every=commit_every)
        await trainer.start()
        while trainer.step < total and not trainer.left:
            if trainer.step == leave_at:
                trainer.request_leave()
            if trainer.step == crash_before:
                await crash(trainer.comm)
                return {"crashed": True}
            try:
                await trainer.run_step(step_fn)
            except Gone:
                return {"crashed": True}
        if trainer.left:
            return {"left_at": trainer.step, "history": trainer.history}
        assert trainer.dist is not None, f"no model after the loop: {trainer.history}"
        params, _, _ = await trainer.dist.full_state()
        return {"params": params, "history": trainer.history, "step": trainer.step}
    finally:
        await group.close()


@pytest.mark.timeout(60)
async def test_a_member_dying_after_the_last_step_leaves_the_others_a_model() -> None:
    """A member dies after the job's last step, before the membership check that follows it:
    the check fails on the others. Their loop must not end there without a model (trainer.dist
    None): they re-form from their commit before run_step returns, redo the lost steps and
    end with a working world and the replay's parameters."""
    total = 37
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    try:
        a, b, c = await asyncio.gather(elastic_member(rdv, total), elastic_member(rdv, total),
                                       elastic_member(rdv, total, crash_after=total - 1))
    finally:
        await server.close()
    want = await replay(total, lambda: Adam(lr=0.01))
    assert c == {"crashed": True}
    for r in (a, b):
        assert r["step"] == total
        # back to the commit of step 30, then on to the end in a world of two
        assert r["history"] == [(0, 3, 0), (1, 2, 30)], r["history"]
        np.testing.assert_allclose(r["params"], want, rtol=1e-9, atol=1e-12)


@pytest.mark.timeout(60)
async def test_a_leaver_whose_step_fails_leaves_instead_of_joining_the_next_world() -> None:
    """A member asked to leave, whose step then fails because another member died in the same
    step, leaves at once: it does not join the next generation only to leave it at the next
    check (which cost the others a second re-formation, and kept a process that was told to
    go running for up to commit_every more steps)."""
    total = 30
    server = RendezvousServer("127.0.0.1", 0, token="t")
    await server.start()
    rdv = f"127.0.0.1:{server.port}"
    try:
        results = await asyncio.gather(
            elastic_member(rdv, total), elastic_member(rdv, total),
            elastic_member(rdv, total, leave_at=12),
            elastic_member(rdv, total, crash_before=12))
    finally:
        await server.close()
    a, b, leaver, dead = results
    want = await replay(total, lambda: Adam(lr=0.01))
    assert dead == {"crashed": True}
    # the step it was in (12) failed: it leaves there, never in a world after the first
    assert leaver == {"left_at": 12, "history": [(0, 4, 0)]}, leaver
    for r in (a, b):
        assert r["history"] == [(0, 4, 0), (1, 2, 10)], r["history"]
        np.testing.assert_allclose(r["params"], want, rtol=1e-9, atol=1e-12)
