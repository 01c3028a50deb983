"""AsyncSGD with parameter servers: workers train without waiting for each other, servers
apply pushes as they come, stale pushes are rejected or scaled as configured, a lost worker
does not stop the others (``peer_loss="isolate"``), and one worker with ``max_staleness=0`` is
exactly synchronous SGD."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import BACKENDS, LogWatch, run_world
from test_launcher import REPO, clean_env
from test_peer_loss import crash

from asynccoll import CollectiveError, CollectiveTimeout, Communicator, PeerLostError
from asynccoll.parallel import MLP, SGD, Adam, DistributedModel, FlatLayout, Optimizer
from asynccoll.parallel.layout import split_bounds
from asynccoll.parallel.model import Model
from asynccoll.parallel.param_server import AsyncSGD, PushResult, ServerStats

SIZES = [4, 16, 1]
W_TRUE = np.random.default_rng(0).standard_normal((SIZES[0], 1))


def regression(seed: int, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """A batch of the regression problem ``y = sin(x @ w)``."""
    x = np.random.default_rng(seed).standard_normal((n, SIZES[0]))
    return x, np.sin(x @ W_TRUE)


TEST_SET = regression(12345, 512)


def flatten(model: Model) -> np.ndarray:
    return np.concatenate([model.parameters()[s.name].reshape(-1) for s in model.param_specs()])


def flat_of(named: dict[str, np.ndarray], model: Model) -> np.ndarray:
    return np.concatenate([named[s.name].reshape(-1) for s in model.param_specs()])


# ------------------------------------------------------------------------------ training

@pytest.mark.parametrize("backend", BACKENDS)
async def test_one_server_three_workers_train_to_target(backend: str) -> None:
    steps = 60
    start = await MLP(SIZES, seed=0).loss(TEST_SET)

    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=0 if comm.rank == 0 else comm.rank)   # server 0's wins
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=0.1), max_staleness=4, stale="scale")
        if opt.is_server:
            return await opt.serve()
        losses = [await opt.step(regression(1000 * comm.rank + s)) for s in range(steps)]
        await opt.parameters()                  # the latest model, into `model`
        final = await model.loss(TEST_SET)
        await opt.finish()
        return losses, final

    stats, *workers = await run_world(rank, 4, backend)
    assert isinstance(stats, ServerStats)
    assert stats.done == (1, 2, 3) and stats.lost == ()
    assert stats.version == stats.accepted + stats.scaled == 3 * steps - stats.rejected
    assert stats.rejected == 0                      # "scale" never drops a push
    for (losses, final), w in zip(workers, (1, 2, 3), strict=True):
        assert stats.workers[w].accepted + stats.workers[w].scaled == steps
        assert stats.workers[w].pulls == steps + 1      # + the final parameters()
        assert losses[-1] < losses[0]
        assert final < start / 10 and final < 0.03, (start, final)


async def reference(opt: Optimizer, batches: list[Any]) -> np.ndarray:
    """One process: the model bound to flat buffers, one optimizer over them."""
    model = MLP(SIZES, seed=3)
    lay = FlatLayout(model.param_specs(), 1, 0)
    params, grads = flatten(model), np.zeros(lay.size)
    model.bind(params=lay.views(params), grads=lay.views(grads))
    for batch in batches:
        grads.fill(0)
        await model.forward_backward(batch)
        opt.step(params, grads)
    return params


OPTIMIZERS: dict[str, Callable[[], Optimizer]] = {
    "sgd": lambda: SGD(lr=0.05, momentum=0.9),
    "adam": lambda: Adam(lr=0.01),
}


@pytest.mark.parametrize(("backend", "servers", "opt_name"), [
    ("memory", (0,), "sgd"), ("memory", (0,), "adam"), ("memory", (0, 1), "sgd"),
    ("memory", (2, 0), "adam"), ("tcp", (0, 1), "adam")])
async def test_one_worker_with_zero_staleness_is_synchronous_sgd(
        backend: str, servers: tuple[int, ...], opt_name: str) -> None:
    batches = [regression(s, 16) for s in range(15)]
    want = await reference(OPTIMIZERS[opt_name](), batches)
    world = len(servers) + 1

    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=3 if comm.rank == servers[0] else 50 + comm.rank)
        opt = AsyncSGD(model, comm, servers=servers, optimizer=OPTIMIZERS[opt_name](),
                       max_staleness=0)
        if opt.is_server:
            return await opt.serve()
        for batch in batches:
            await opt.step(batch)
            assert [p.status for p in opt.last_push] == ["accepted"] * len(servers)
        got = flat_of(await opt.parameters(), model)
        await opt.finish()
        return got

    results = await run_world(rank, world, backend)
    worker = next(r for r in results if isinstance(r, np.ndarray))
    assert np.array_equal(worker, want)          # bit for bit
    for r in results:
        if isinstance(r, ServerStats):
            assert r.accepted == r.version == len(batches) and r.rejected == r.scaled == 0


@pytest.mark.parametrize("servers", [(0,), (0, 1)])
async def test_max_grad_norm_clips_as_the_synchronous_wrapper_does(
        servers: tuple[int, ...]) -> None:
    """One worker with ``max_staleness=0`` and ``max_grad_norm`` is DistributedModel with
    the same ``max_grad_norm`` on one rank, bit for bit: every pushed gradient is clipped to
    the global norm over the whole model (the worker holds all of it) before it is sent."""
    batches = [regression(s, 16) for s in range(12)]
    max_norm = 0.02                         # below these gradients' norms: every step clips

    async def synchronous(comm: Communicator) -> tuple[np.ndarray, list[float]]:
        dist = DistributedModel(MLP(SIZES, seed=3), comm, Adam(lr=0.01),
                                max_grad_norm=max_norm)
        norms = []
        for batch in batches:
            await dist.step(batch)
            assert dist.last_grad_norm is not None
            norms.append(dist.last_grad_norm)
        return (await dist.full_state())[0], norms

    [(want, want_norms)] = await run_world(synchronous, 1, "memory")
    assert min(want_norms) > 2 * max_norm

    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=3 if comm.rank == servers[0] else 50 + comm.rank)
        opt = AsyncSGD(model, comm, servers=servers, optimizer=Adam(lr=0.01),
                       max_staleness=0, max_grad_norm=max_norm)
        if opt.is_server:
            return await opt.serve()
        norms = []
        for batch in batches:
            await opt.step(batch)
            assert opt.last_grad_norm is not None
            norms.append(opt.last_grad_norm)
        got = flat_of(await opt.parameters(), model)
        await opt.finish()
        return got, norms

    results = await run_world(rank, len(servers) + 1, "memory")
    got, norms = next(r for r in results if isinstance(r, tuple))
    assert norms == want_norms
    assert np.array_equal(got, want)


async def test_max_grad_norm_leaves_a_callers_gradient_as_it_was() -> None:
    """``push(array)`` with ``max_grad_norm`` sends the clipped gradient without changing
    the caller's array; a gradient already within the norm goes as it is."""
    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=0)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=1.0), max_grad_norm=1.0)
        if opt.is_server:
            return await opt.serve()
        before = (await opt.parameters())
        grad = np.full(opt.layout.size, 2.0)           # norm 2 * sqrt(n): clipped to 1
        await opt.push(grad)
        assert np.all(grad == 2.0)
        assert opt.last_grad_norm == pytest.approx(2.0 * np.sqrt(grad.size))
        small = np.full(opt.layout.size, 0.5 / np.sqrt(grad.size))    # norm 0.5: kept
        await opt.pull()
        await opt.push(small)
        assert opt.last_grad_norm == pytest.approx(0.5)
        after = await opt.parameters()
        await opt.finish()
        moved = flat_of(before, model) - flat_of(after, model)
        return float(np.linalg.norm(moved - small))

    _, moved = await run_world(rank, 2, "memory")
    assert moved == pytest.approx(1.0, rel=1e-5)        # the first step: the clipped gradient


@pytest.mark.parametrize("servers", [(0,), (0, 1)])
async def test_frozen_torch_parameters_stay_as_they_are(servers: tuple[int, ...]) -> None:
    """A parameter frozen in the model (requires_grad=False) is left as it is by the
    servers, as torch.optim leaves it, under a weight decay that would shrink it (AdamW's
    default); it used to decay. One synchronous worker equals plain torch."""
    torch = pytest.importorskip("torch")
    from asynccoll.parallel import AdamW, TorchModel

    def net() -> Any:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                                     torch.nn.Linear(6, 1)).double()
        module[0].weight.requires_grad_(False)
        return module

    batches = [regression(s, 16) for s in range(5)]
    ref_net = net()
    ref = torch.optim.AdamW(ref_net.parameters(), lr=0.05, weight_decay=0.5)
    for x, y in batches:
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref_net(torch.from_numpy(x)),
                                     torch.from_numpy(y)).backward()
        ref.step()
    want = {k: v.detach().numpy() for k, v in ref_net.named_parameters()}

    async def rank(comm: Communicator) -> Any:
        with TorchModel(net(), torch.nn.functional.mse_loss) as model:
            opt = AsyncSGD(model, comm, servers=servers,
                           optimizer=AdamW(lr=0.05, weight_decay=0.5), max_staleness=0)
            if opt.is_server:
                return await opt.serve()
            for batch in batches:
                await opt.step(batch)
            got = await opt.parameters()
            await opt.finish()
            return got

    results = await run_world(rank, len(servers) + 1, "memory")
    got = results[-1]
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


# ------------------------------------------------------------------------------ staleness

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("max_staleness", "stale", "status", "factor"), [
    (0, "reject", "rejected", 0.0),
    (0, "scale", "scaled", 0.5),
    (1, "reject", "accepted", 1.0),          # staleness 1 is within the bound
    (None, "reject", "accepted", 1.0),       # Hogwild: everything is applied
])
async def test_interleaved_push_is_judged_by_its_staleness(
        backend: str, max_staleness: int | None, stale: str, status: str,
        factor: float) -> None:
    """Worker 1 pulls version 0, worker 2 pulls version 0 and pushes (version 1), then worker
    1 pushes its gradient of version 0: staleness 1, provably (the workers hand a token)."""
    lr = 0.5
    g1 = np.full(flatten(MLP(SIZES)).size, 0.25)
    g2 = np.linspace(-1.0, 1.0, g1.size)

    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=0)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=lr), max_staleness=max_staleness,
                       stale=stale)
        if opt.is_server:
            stats = await opt.serve()
            return stats, opt.local_parameters().copy()
        token = np.zeros(1)
        result: tuple[PushResult, ...]
        if comm.rank == 1:
            assert await opt.pull() == (0,)
            await comm.send(token, dst=2, tag=7)
            await comm.recv(src=2, tag=7)           # worker 2 has pushed
            result = await opt.push(g1)
        else:
            await comm.recv(src=1, tag=7)
            assert await opt.pull() == (0,)
            result = await opt.push({s.name: g2[a:b].reshape(s.shape)
                                     for s in model.param_specs()
                                     for a, b in [opt.layout.offsets[s.name]]})
            await comm.send(token, dst=1, tag=7)
        await opt.finish()
        return result

    (stats, params), (push1,), (push2,) = await run_world(rank, 3, backend)
    assert push2 == PushResult(server=0, status="accepted", staleness=0, version=1)
    assert push1.status == status and push1.staleness == 1
    applied = 2 if status != "rejected" else 1
    assert push1.version == stats.version == applied
    w1, w2 = stats.workers[1], stats.workers[2]
    assert (w1.accepted, w1.scaled, w1.rejected) == (
        int(status == "accepted"), int(status == "scaled"), int(status == "rejected"))
    assert (w2.accepted, w2.scaled, w2.rejected) == (1, 0, 0)
    assert w1.max_staleness == 1 and w2.max_staleness == 0
    p0 = flatten(MLP(SIZES, seed=0))
    np.testing.assert_allclose(params, p0 - lr * g2 - factor * lr * g1, rtol=0, atol=1e-14)


async def test_scaled_step_shrinks_with_staleness() -> None:
    """One worker pushes three gradients computed on version 0: staleness 0 and 1 are within
    max_staleness=1, staleness 2 is applied at lr / 3."""
    lr = 0.2

    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=4)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=lr), max_staleness=1, stale="scale")
        if opt.is_server:
            return await opt.serve(), opt.local_parameters().copy()
        await opt.pull()
        g = np.ones(opt.layout.size)
        got = [(await opt.push(g))[0] for _ in range(3)]
        await opt.finish()
        return got

    (stats, params), pushes = await run_world(rank, 2, "memory")
    assert [(p.status, p.staleness, p.version) for p in pushes] == [
        ("accepted", 0, 1), ("accepted", 1, 2), ("scaled", 2, 3)]
    assert (stats.accepted, stats.scaled, stats.rejected, stats.version) == (2, 1, 0, 3)
    np.testing.assert_allclose(params, flatten(MLP(SIZES, seed=4)) - lr * (2 + 1 / 3),
                               rtol=0, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_hogwild_applies_every_push(backend: str) -> None:
    steps = 25

    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=0)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=0.05), max_staleness=None)
        if opt.is_server:
            return await opt.serve()
        for s in range(steps):
            await opt.step(regression(100 * comm.rank + s))
            assert opt.last_push[0].status == "accepted"
        await opt.finish()
        return opt.steps

    stats, *done = await run_world(rank, 4, backend)
    assert done == [steps] * 3
    assert stats.accepted == stats.version == 3 * steps
    assert stats.rejected == stats.scaled == 0


# ------------------------------------------------------------------------------ sharding

@pytest.mark.parametrize("backend", BACKENDS)
async def test_two_servers_each_hold_half(backend: str) -> None:
    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=7 if comm.rank == 0 else 70 + comm.rank)   # server 0's wins
        opt = AsyncSGD(model, comm, servers=(0, 1), optimizer=SGD(lr=0.1))
        if opt.is_server:
            serving = asyncio.ensure_future(opt.serve())
            await comm.barrier()
            stats = await serving
            return stats, opt.local_parameters().copy()
        initial = flat_of(await opt.parameters(), model)
        await comm.barrier()                # both workers pulled before anyone pushes
        for s in range(10):
            await opt.step(regression(10 * comm.rank + s))
        await opt.finish()
        return initial

    (s0, p0), (s1, p1), init2, init3 = await run_world(rank, 4, backend)
    size = flatten(MLP(SIZES)).size
    halves = split_bounds(size, 2)
    assert (s0.shard, s1.shard) == (halves[0], halves[1])
    assert (p0.size, p1.size) == (halves[0][1] - halves[0][0], halves[1][1] - halves[1][0])
    assert p0.size + p1.size == size and abs(p0.size - p1.size) <= 1
    want = flatten(MLP(SIZES, seed=7))
    assert np.array_equal(init2, want) and np.array_equal(init3, want)
    assert s0.version == s1.version == 20               # every push reached both servers
    assert s0.done == s1.done == (2, 3)


async def test_two_servers_union_is_the_whole_model() -> None:
    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=8)
        opt = AsyncSGD(model, comm, servers=(1, 2), optimizer=Adam(lr=0.01))
        if opt.is_server:
            await opt.serve()
            return opt.local_parameters().copy()
        for s in range(5):
            await opt.step(regression(s))
        got = flat_of(await opt.parameters(), model)
        await opt.finish()
        return got

    worker, shard1, shard2 = await run_world(rank, 3, "memory")
    assert np.array_equal(np.concatenate([shard1, shard2]), worker)


# ------------------------------------------------------------------------------ failures

async def test_killed_worker_does_not_stop_the_others(logs: LogWatch) -> None:
    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=0)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=0.1), max_staleness=8, stale="scale")
        if opt.is_server:
            return await opt.serve()
        steps = 3 if comm.rank == 3 else 40
        for s in range(steps):
            await opt.step(regression(1000 * comm.rank + s))
            if comm.rank != 3:
                await asyncio.sleep(0.002)      # still training when rank 3 dies
        if comm.rank == 3:
            await crash(comm)
            return "crashed"
        await opt.parameters()
        final = await model.loss(TEST_SET)
        await opt.finish()
        return final

    stats, f1, f2, crashed = await run_world(rank, 4, "tcp", peer_loss="isolate")
    assert crashed == "crashed"
    assert stats.done == (1, 2) and stats.lost == (3,)
    assert stats.workers[3].state == "lost" and stats.workers[3].error
    assert stats.workers[3].accepted + stats.workers[3].scaled == 3
    assert stats.workers[1].pushes == stats.workers[2].pushes == 40
    assert f1 < 0.05 and f2 < 0.05
    assert re.search(r"parameter server 0: lost worker 3", logs.text), logs.text


async def test_timed_out_worker_is_dropped() -> None:
    async def rank(comm: Communicator) -> Any:
        model = MLP(SIZES, seed=0)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=0.1))
        if opt.is_server:
            comm.timeout = 1.0        # must exceed a worker's step: worker 2 breaks that
            return await opt.serve()
        await opt.step(regression(comm.rank))
        if comm.rank == 2:
            await asyncio.sleep(2.0)
            comm.timeout = 1.0
            with pytest.raises(CollectiveTimeout):    # the server no longer answers
                await opt.step(regression(7))
            return "gave up"
        for s in range(10):
            await opt.step(regression(s))
        await opt.finish()
        return opt.steps

    stats, steps1, gave_up = await run_world(rank, 3, "tcp", peer_loss="isolate")
    assert (steps1, gave_up) == (11, "gave up")
    assert stats.done == (1,) and stats.lost == (2,)
    assert "within 1 s" in (stats.workers[2].error or "")


async def test_lost_worker_breaks_everything_without_isolation() -> None:
    """The default peer_loss="abort": a lost worker fails the server too (the trade-off)."""
    async def rank(comm: Communicator) -> Any:
        opt = AsyncSGD(MLP(SIZES, seed=0), comm, optimizer=SGD(lr=0.1))
        if opt.is_server:
            return await opt.serve()
        await opt.step(regression(comm.rank))
        if comm.rank == 2:
            await crash(comm)
            return "crashed"
        with pytest.raises(CollectiveError):        # PeerLostError, or its echo
            for s in range(200):
                await opt.step(regression(s))
                await asyncio.sleep(0.01)
        return "broken"

    with pytest.raises(PeerLostError):
        await run_world(rank, 3, "tcp")


async def test_a_server_that_cannot_start_tells_its_workers_at_once() -> None:
    """Server 0 dies before it shares the initial parameters (``peer_loss="isolate"``):
    server 1's ``serve`` fails, and the workers, which know server 0 is lost, must not then
    wait the whole timeout for server 1's reply to their pull: it never comes."""
    async def rank(comm: Communicator) -> Any:
        opt = AsyncSGD(MLP(SIZES, seed=0), comm, servers=(0, 1), optimizer=SGD(lr=0.1))
        start = asyncio.get_running_loop().time()
        if comm.rank == 0:
            await asyncio.sleep(0.2)             # the workers' pulls are on their way
            await crash(comm)
            return "crashed"
        if opt.is_server:
            with pytest.raises(PeerLostError):
                await opt.serve()
            return "failed"
        with pytest.raises(PeerLostError, match="world rank 0") as lost:
            await opt.step(regression(comm.rank))
        with pytest.raises(PeerLostError):        # server 0 lost, server 1 stopped: at once
            await opt.pull()
        with pytest.raises(PeerLostError):
            await opt.finish()
        return lost.value.rank, asyncio.get_running_loop().time() - start

    crashed, failed, *workers = await run_world(rank, 4, "tcp", peer_loss="isolate",
                                                timeout=5.0)
    assert (crashed, failed) == ("crashed", "failed")
    for lost_rank, took in workers:
        assert lost_rank == 0
        assert took < 2.0, f"a worker took {took:.2f} s to fail (the timeout is 5 s)"


@pytest.mark.parametrize("backend", ["memory", "tcp"])
async def test_a_worker_that_leaves_without_finish_breaks_the_world_with_its_cause(
        backend: str) -> None:
    """Under ``peer_loss="abort"`` (and on the memory backend) a worker that closes its
    communicator without ``finish`` fails ``serve``; every other rank must learn why, not
    only that the server's cancelled receives broke the world."""
    async def rank(comm: Communicator) -> Any:
        opt = AsyncSGD(MLP(SIZES, seed=0), comm, optimizer=SGD(lr=0.1))
        if opt.is_server:
            with pytest.raises(PeerLostError, match="rank 2"):
                await opt.serve()
            return "failed"
        await opt.step(regression(comm.rank))
        if comm.rank == 2:
            await comm.close()                   # no finish()
            return "left"
        with pytest.raises(PeerLostError) as lost:
            for s in range(200):
                await opt.step(regression(s))
                await asyncio.sleep(0.01)
        return str(lost.value), lost.value.rank

    failed, (message, lost), left = await run_world(rank, 3, backend, timeout=5.0)
    assert (failed, left) == ("failed", "left")
    assert lost == 2 and "parameter server 0 lost worker 2" in message, message


@pytest.mark.parametrize(("other", "why"), [
    ({"sizes": [4, 8, 1]}, "shard size"),
    ({"sizes": [1, 32, 1]}, "names, shapes or dtype"),
    ({"dtype": np.float32}, "names, shapes or dtype"),
], ids=["other size", "other shapes, same size", "other dtype"])
async def test_worker_with_another_model_is_refused(other: dict[str, Any], why: str) -> None:
    """A worker with another model is refused at its first pull: one of another size by the
    shard size, one with as many parameters (other shapes, or another dtype) by the model's
    fingerprint, rather than trained into the servers' parameters."""
    async def rank(comm: Communicator) -> Any:
        kw = {"sizes": SIZES, **other} if comm.rank == 2 else {"sizes": SIZES}
        model = MLP(**kw, seed=0)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=0.1))
        if opt.is_server:
            return await opt.serve()
        if comm.rank == 2:
            with pytest.raises(CollectiveError, match=rf"refused rank 2.*{why}"):
                await opt.pull()
            return "refused"
        for s in range(5):
            await opt.step(regression(s))
        await opt.finish()
        return "done"

    stats, *results = await run_world(rank, 3, "memory")
    assert results == ["done", "refused"]
    assert stats.done == (1,) and stats.lost == (2,)
    assert stats.workers[2].state == "failed" and stats.workers[2].pulls == 0
    assert stats.version == stats.workers[1].accepted == 5


async def test_refused_worker_finishes_at_once_and_the_others_go_on() -> None:
    """A refused worker that goes on to call ``finish`` (in a ``finally``, say) or to pull
    again must not wait for a reply the server will never send: that wait times out and, on
    the memory backend, the timeout breaks the world for the server and the other worker."""
    async def rank(comm: Communicator) -> Any:
        model = MLP([4, 8, 1] if comm.rank == 2 else SIZES, seed=0)
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=0.1))
        if opt.is_server:
            return await opt.serve()
        if comm.rank == 2:
            with pytest.raises(CollectiveError, match="refused rank 2"):
                await opt.pull()
            with pytest.raises(CollectiveError, match="refused rank 2"):
                await opt.pull()                # at once, nothing sent
            await opt.finish()                  # at once: the server no longer serves it
            return "refused"
        for s in range(5):
            await opt.step(regression(s))
            await asyncio.sleep(0.3)            # still training when rank 2 would time out
        await opt.finish()
        return "done"

    stats, *results = await run_world(rank, 3, "memory", timeout=1.0)
    assert results == ["done", "refused"]
    assert stats.done == (1,) and stats.workers[2].state == "failed"
    assert stats.workers[1].pushes == 5


# ------------------------------------------------------------------------------ API

async def test_arguments_and_roles() -> None:
    async def rank(comm: Communicator) -> str:
        model = MLP(SIZES)
        with pytest.raises(ValueError, match="stale"):
            AsyncSGD(model, comm, optimizer=SGD(lr=0.1), stale="drop")
        with pytest.raises(ValueError, match="max_staleness"):
            AsyncSGD(model, comm, optimizer=SGD(lr=0.1), max_staleness=-1)
        with pytest.raises(ValueError, match="out of range"):
            AsyncSGD(model, comm, servers=(5,), optimizer=SGD(lr=0.1))
        with pytest.raises(ValueError, match="at least one worker"):
            AsyncSGD(model, comm, servers=(0, 1), optimizer=SGD(lr=0.1))
        with pytest.raises(ValueError, match="both servers and workers"):
            AsyncSGD(model, comm, optimizer=SGD(lr=0.1), workers=(0, 1))
        with pytest.raises(TypeError, match="Optimizer"):
            AsyncSGD(model, comm, optimizer="sgd")  # type: ignore[arg-type]
        opt = AsyncSGD(model, comm, optimizer=SGD(lr=0.1))
        assert opt.is_server == (comm.rank == 0) and opt.is_worker == (comm.rank == 1)
        if opt.is_server:
            with pytest.raises(RuntimeError, match="worker"):
                await opt.step(regression(0))
            await opt.serve()
            with pytest.raises(RuntimeError, match="once"):
                await opt.serve()
            return "server"
        with pytest.raises(RuntimeError, match="server"):
            await opt.serve()
        with pytest.raises(RuntimeError, match="before pull"):
            await opt.push()
        await opt.pull()
        with pytest.raises(ValueError, match="elements"):
            await opt.push(np.ones(3))
        await opt.finish()
        await opt.finish()                 # idempotent
        with pytest.raises(RuntimeError, match="finish"):
            await opt.pull()
        return "worker"

    assert await run_world(rank, 2, "memory") == ["server", "worker"]


# ------------------------------------------------------------------------------ example

@pytest.mark.timeout(120)
def test_example_runs_under_the_launcher() -> None:
    res = subprocess.run([sys.executable, "-m", "asynccoll", "run", "-n", "3",
                          "examples/param_server.py", "--steps", "80"], cwd=REPO,
                         env=clean_env(), capture_output=True, text=True, timeout=100,
                         check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    finals = re.findall(r"worker (\d): test loss after 80 steps ([0-9.]+)", out)
    assert sorted(w for w, _ in finals) == ["1", "2"], out
    assert all(float(loss) < 0.05 for _, loss in finals), out
    match = re.search(r"server 0: version (\d+), accepted (\d+), scaled (\d+), "
                      r"rejected (\d+), lost \[\]", out)
    assert match, out
    version, accepted, scaled, rejected = map(int, match.groups())
    assert accepted + scaled + rejected == 160 and version == accepted + scaled, out


@pytest.mark.timeout(120)
def test_a_crashed_worker_leaves_the_job_running_under_the_documented_command() -> None:
    """The launch async_training.md gives (``asynccoll run --elastic``) with a worker that
    really crashes (``--die-after``: SIGKILL, a non-zero exit): the launcher must not stop
    the server and the other workers, which finish; a plain ``asynccoll run`` stops them all
    at a rank's first failure."""
    res = subprocess.run([sys.executable, "-m", "asynccoll", "run", "--elastic", "-n", "4",
                          "examples/param_server.py", "--steps", "60", "--die-after", "10"],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         timeout=100, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "rank 3 exited with code -9; the others go on" in out, out
    finals = re.findall(r"worker (\d): test loss after 60 steps", out)
    assert sorted(finals) == ["1", "2"], out
    assert re.search(r"server 0: version \d+, .*lost \[3\]", out), out


async def test_rank_that_is_neither_gets_a_clear_error() -> None:
    async def rank(comm: Communicator) -> str:
        opt = AsyncSGD(MLP(SIZES), comm, optimizer=SGD(lr=0.1), workers=(1,))
        if opt.is_server:
            await opt.serve()
            return "server"
        if opt.is_worker:
            await opt.pull()
            await opt.finish()
            return "worker"
        with pytest.raises(RuntimeError, match="neither"):
            opt.local_parameters()
        return "neither"

    assert await run_world(rank, 3, "memory") == ["server", "worker", "neither"]


async def test_cancelling_serve_breaks_the_world_even_under_isolate() -> None:
    """docs/async_training.md: cancelling ``serve()`` (an ``asyncio.timeout`` around it, say)
    cancels its receives, which breaks the communicator for every rank, under
    ``peer_loss="isolate"`` too: the workers' next step raises at once, not at the timeout."""
    async def rank(comm: Communicator) -> Any:
        opt = AsyncSGD(MLP(SIZES, seed=0), comm, optimizer=SGD(lr=0.1))
        start = asyncio.get_running_loop().time()
        if opt.is_server:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await opt.serve()
            return "cancelled"
        with pytest.raises(CollectiveError, match="cancelled"):
            for s in range(10_000):
                await opt.step(regression(s))
                await asyncio.sleep(0.01)
        return asyncio.get_running_loop().time() - start

    server, *took = await run_world(rank, 3, "tcp", peer_loss="isolate", timeout=10.0)
    assert server == "cancelled"
    assert all(t < 3.0 for t in took), took   # 0.5 s of serving, then at once
