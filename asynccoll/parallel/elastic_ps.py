"""Elastic asynchronous SGD: parameter-server training that workers join and leave while it runs.

``ElasticAsyncSGD`` runs ``AsyncSGD`` (``asynccoll.parallel.param_server``) over the
generations of an ``ElasticGroup`` (``asynccoll.elastic``): each generation is one world, and
its ranks ``0 .. num_servers - 1`` are the servers, the others the workers. The first
generation fixes which members are the servers (their member ids are kept in the rendezvous
store); since a new generation lists the survivors of the previous one first, in their old rank
order, the servers keep their ranks in every later generation while they live.

How a world ends and the next one begins
----------------------------------------

- A process asks to join: it opens a newer generation (``ElasticGroup.form``). Every server
  checks ``group.world_changed()`` each ``check_interval`` seconds while it serves; the first
  to see the newer generation breaks the current world (every rank's pending exchange fails at
  once with an error that says so), and every member forms the next generation, the newcomer
  in it.
- A worker dies: the servers lose its connection, the world breaks (``peer_loss="abort"``, as
  elastic worlds have), and the others form the next generation without it.
- A worker's exchange fails for another reason (it timed out): it opens the next generation
  itself, and the servers see that as above.

The servers keep their shard, version, optimizer state and counters in memory from one world to
the next, and serve the next one from them (``AsyncSGD._resume``), not from server 0's initial
parameters. (When the world broke before every server got its initial range, nobody pushed
yet, and the next world starts afresh from server 0's initial parameters.) A worker whose
``step`` fails because its world ended drops the gradient it was computing or pushing (counted
in ``dropped``), joins the next generation, pulls fresh parameters and does the step again,
with the same batch: ``step`` hides the re-forms from the training loop. A newcomer starts by
pulling. (A push that a server applied just before the world ended, and whose answer did not
reach the worker, or that some of several servers applied, is applied again when the step is
redone: asynchronous SGD tolerates that as it tolerates staleness.)

At the end of each generation the servers vote in the store (``asgd/vote/G/K``): they go on to
the next generation if any of them saw a newer generation open or a worker that neither
finished nor was lost; otherwise ``serve`` returns. A worker that finished (``finish``) leaves
the job (``ElasticGroup.leave(finished=True)``): later generations do not count on it.

A lost server
-------------

Its parameters are gone, so the job cannot go on: every member raises ``ServerLostError``.
A member notices it when an exchange fails with a ``PeerLostError`` that names a server rank
which did not vote (a server always votes before it leaves a world, so a server that vanished
without a vote died), or when a new generation's first ranks are not the servers. The first
member that notices writes ``asgd/failed`` in the store; every member (newcomers too) checks it
whenever it joins a generation, and the servers while they wait for each other's votes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..collectives import Communicator, check_int, check_timeout
from ..elastic import ElasticGroup, Generation
from ..errors import (
    CollectiveError,
    CollectiveTimeout,
    PeerLostError,
    RendezvousError,
    RendezvousTimeout,
)
from .clip import check_max_norm
from .model import Model
from .optim import Optimizer
from .param_server import AsyncSGD, PushResult, WorkerStats, _Counters, check_options

log = logging.getLogger("asynccoll.parallel.elastic_ps")

#: prefix of this module's keys in the job's namespace of the rendezvous store
PREFIX = "asgd"
#: the member ids of the servers, in server order (set by the first generation)
SERVERS_KEY = f"{PREFIX}/servers"
#: why the job failed (a server was lost); every member raises ``ServerLostError`` with it
FAILED_KEY = f"{PREFIX}/failed"
#: set when the servers returned from ``serve``: a process that comes later is told so
OVER_KEY = f"{PREFIX}/over"
#: seconds between two reads of the store while a server waits for the others' votes
VOTE_POLL = 0.05


def _vote_key(generation: int, server: int) -> str:
    return f"{PREFIX}/vote/{generation}/{server}"


class ServerLostError(CollectiveError):
    """A parameter server of an ``ElasticAsyncSGD`` job was lost: the parameters it held are
    gone, so no member can go on (restart the job, from a checkpoint if you keep one)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticServerStats:
    """One server's report over every generation it served."""

    #: the server's index (its rank in every generation)
    server: int
    #: the flat ``(start, stop)`` range of the parameters this server holds
    shard: tuple[int, int]
    #: pushes applied (accepted or scaled), over all generations
    version: int
    #: how many worlds (generations) it served
    generations: int
    #: per worker, by its ``ElasticGroup.id``: its counters summed over the generations it was
    #: in, and its state at the end (``"lost"``: it died, or did not come back after a
    #: re-form)
    workers: Mapping[str, WorkerStats]

    @property
    def accepted(self) -> int:
        return sum(w.accepted for w in self.workers.values())

    @property
    def scaled(self) -> int:
        return sum(w.scaled for w in self.workers.values())

    @property
    def rejected(self) -> int:
        return sum(w.rejected for w in self.workers.values())

    @property
    def pulls(self) -> int:
        return sum(w.pulls for w in self.workers.values())

    @property
    def done(self) -> tuple[str, ...]:
        """Workers that finished normally."""
        return tuple(i for i, w in self.workers.items() if w.state == "done")

    @property
    def lost(self) -> tuple[str, ...]:
        """Workers that were lost or refused."""
        return tuple(i for i, w in self.workers.items() if w.state in ("lost", "failed"))


class ElasticAsyncSGD:
    """Asynchronous SGD over parameter servers whose workers come and go (see the module
    docstring).

    Every process builds the same model and an ``ElasticAsyncSGD`` with the same
    ``num_servers`` and options; the servers are the first ``num_servers`` members of the first
    generation, and the initial parameters those of the first server's model:

        async with await ElasticGroup.connect(min_nodes=2, settle=0.5) as group:
            opt = ElasticAsyncSGD(group, model, optimizer=SGD(lr=0.05), max_staleness=4)
            await opt.start()                    # the first generation, or the running job
            if opt.is_server:
                stats = await opt.serve()        # until every worker finished
            else:
                for batch in my_batches:
                    loss = await opt.step(batch) # re-forms are handled inside
                await opt.finish()

    Args:
        group: this process's ``ElasticGroup``; its ``min_nodes`` must exceed ``num_servers``
            (a generation holds the servers and at least one worker), and its ``timeout``
            bounds every wait, as ``AsyncSGD``'s communicator timeout does (it must exceed a
            worker's longest step).
        model: the ``Model`` (see ``AsyncSGD``).
        num_servers: how many servers hold the parameters.
        optimizer, max_staleness, stale, max_grad_norm: as for ``AsyncSGD``. Each server's
            optimizer keeps its state across generations.
        check_interval: seconds between a server's checks for a newer generation (a process
            that asks to join waits about this long, plus the group's ``settle``).
        max_reforms: a worker's ``step`` (or ``finish``) raises after this many re-forms in
            a row without getting through.

    Raises:
        ValueError, TypeError: bad arguments (as ``AsyncSGD``'s; ``num_servers`` < 1,
            ``group.min_nodes <= num_servers``, a ``check_interval`` that is no positive
            number).
    """

    def __init__(self, group: ElasticGroup, model: Model, *, num_servers: int = 1,
                 optimizer: Optimizer, max_staleness: int | None = None,
                 stale: str = "reject", max_grad_norm: float | None = None,
                 check_interval: float = 0.5, max_reforms: int = 10) -> None:
        check_options(optimizer, max_staleness, stale)
        num_servers = check_int(num_servers, "num_servers")
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        if group.min_nodes <= num_servers:
            raise ValueError(f"the group's min_nodes ({group.min_nodes}) must exceed "
                             f"num_servers ({num_servers}): a generation holds the servers and "
                             f"at least one worker")
        check_interval = check_timeout(check_interval, "check_interval")
        if check_interval == 0 or math.isinf(check_interval):
            raise ValueError(f"check_interval must be a positive number of seconds, "
                             f"got {check_interval}")
        max_reforms = check_int(max_reforms, "max_reforms")
        if max_reforms < 0:
            raise ValueError(f"max_reforms must be >= 0, got {max_reforms}")
        self.group = group
        self.model = model
        self.num_servers = num_servers
        self.optimizer = optimizer
        self.max_staleness = max_staleness
        self.stale = stale
        self.max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
        self.check_interval = check_interval
        self.max_reforms = max_reforms
        #: (generation, world size, rank) of every world this process was in
        self.history: list[tuple[int, int, int]] = []
        #: steps this worker completed
        self.steps = 0
        #: gradients this worker computed whose push did not get through because the world
        #: re-formed (or a peer died) meanwhile; the step was done again in the next world
        self.dropped = 0
        #: what each server did with this worker's last push
        self.last_push: tuple[PushResult, ...] = ()
        self._inner: AsyncSGD | None = None
        self._started = self._finished = self._serving = self._served = False
        # server state, carried across generations
        self._shard: np.ndarray | None = None
        self._version = 0
        self._fresh = True          # the next world starts from server 0's initial parameters
        self._totals: dict[str, _Counters] = {}
        self._generations = 0
        self._range = (0, 0)        # the flat range this server holds

    # ----------------------------------------------------------------------- roles

    @property
    def comm(self) -> Communicator:
        """The current world's communicator."""
        if self._inner is None:
            raise RuntimeError("no world: await opt.start() first (or the job ended)")
        return self._inner.comm

    @property
    def generation(self) -> Generation | None:
        return self.group.generation

    @property
    def is_server(self) -> bool:
        """Whether this process is a server (known after ``start``)."""
        gen = self.group.generation
        return gen is not None and gen.rank < self.num_servers

    @property
    def is_worker(self) -> bool:
        return self._started and not self.is_server

    @property
    def versions(self) -> tuple[int, ...]:
        """On a worker, per server, the version of the shard it pulled last (in this world)."""
        return self._inner.versions if self._inner is not None else ()

    # ----------------------------------------------------------------------- forming

    async def start(self) -> None:
        """Join the first generation, or the running job.

        Raises:
            ServerLostError: the job lost a server (now or before).
            CollectiveError: the job is over (its servers returned from ``serve``).
            RendezvousError: no generation formed within the group's ``timeout``.
            RuntimeError: called twice.
        """
        if self._started:
            raise RuntimeError("start() runs once")
        self._started = True
        await self._form()

    async def _check_failed(self) -> None:
        """Raise ``ServerLostError`` if the job lost a server."""
        try:
            why = await self.group.client.get(FAILED_KEY, wait=False)
        except KeyError:
            return
        raise ServerLostError(why.decode())

    async def _check_job(self) -> None:
        """Raise if the job lost a server, or is over."""
        await self._check_failed()
        try:
            await self.group.client.get(OVER_KEY, wait=False)
        except KeyError:
            return
        raise CollectiveError("this elastic AsyncSGD job is over: its servers returned from "
                              "serve()")

    async def _form(self) -> None:
        """Join the next generation and make its ``AsyncSGD``."""
        self._inner = None
        await self._check_job()
        comm = await self.group.form()
        gen = self.group.generation
        assert gen is not None
        await self._check_job()
        s = self.num_servers
        first = list(gen.roster[:s])
        _, value = await self.group.client.compare_set(SERVERS_KEY, None,
                                                       json.dumps(first).encode())
        assert value is not None
        servers = json.loads(value)
        if first != servers:
            gone = [k for k, member in enumerate(servers) if member not in gen.roster]
            raise await self._server_lost(
                f"parameter server(s) {gone or servers} did not come back in elastic "
                f"generation {gen.number}: the parameters they held are gone")
        inner = AsyncSGD(self.model, comm, servers=tuple(range(s)), optimizer=self.optimizer,
                         max_staleness=self.max_staleness, stale=self.stale,
                         max_grad_norm=self.max_grad_norm)
        if inner.is_server:
            self._range = inner.shard
            if not self._fresh:
                assert self._shard is not None
                inner._resume(self._shard, self._version)
        self._inner = inner
        self.history.append((gen.number, gen.world_size, gen.rank))
        log.info("elastic AsyncSGD: %s is %s %d in generation %d (%d servers, %d workers)%s",
                 self.group.id, "server" if inner.is_server else "worker", gen.rank,
                 gen.number, s, gen.world_size - s,
                 "" if not inner.is_server else
                 " from server 0's initial parameters" if self._fresh
                 else f" at version {self._version}")

    async def _server_lost(self, why: str) -> ServerLostError:
        """Record that the job lost a server (the first reason recorded wins) and return the
        error to raise."""
        _, value = await self.group.client.compare_set(FAILED_KEY, None, why.encode())
        why = value.decode() if value is not None else why
        log.error("elastic AsyncSGD: %s", why)
        return ServerLostError(why)

    async def _voted(self, generation: int, server: int) -> bool:
        try:
            await self.group.client.get(_vote_key(generation, server), wait=False)
        except KeyError:
            return False
        return True

    async def _check_peer_loss(self, exc: CollectiveError) -> None:
        """Raise ``ServerLostError`` if ``exc`` is the loss of a server that did not vote:
        it vanished without leaving its world in order."""
        gen = self.group.generation
        if (isinstance(exc, PeerLostError) and exc.rank is not None and gen is not None
                and 0 <= exc.rank < self.num_servers and exc.rank != gen.rank
                and not await self._voted(gen.number, exc.rank)):
            raise await self._server_lost(f"parameter server {exc.rank} was lost in elastic "
                                          f"generation {gen.number} ({exc}): the parameters "
                                          f"it held are gone") from exc

    # ----------------------------------------------------------------------- worker side

    def _worker(self, what: str) -> AsyncSGD | None:
        if not self._started:
            raise RuntimeError(f"{what} before start()")
        if self.is_server:
            raise RuntimeError(f"{what} runs on workers; this process is server "
                               f"{self.group.generation.rank if self.group.generation else '?'}")
        if self._finished:
            raise RuntimeError(f"{what} after finish()")
        return self._inner

    async def _recover(self, exc: CollectiveError, failures: int) -> None:
        """A worker's exchange failed with ``exc``: re-raise what no re-form mends, else
        join the next generation."""
        inner = self._inner
        if inner is not None and inner._unserved:
            raise exc                   # a server refused this worker (another model?)
        if failures > self.max_reforms:
            raise exc
        await self._check_peer_loss(exc)
        gen = self.group.generation
        log.info("elastic AsyncSGD: worker %s leaves generation %s (%s); joining the next",
                 self.group.id, gen.number if gen else "-", exc)
        await self._form()

    async def step(self, batch: Any) -> float:
        """One asynchronous step on ``batch`` (pull, forward and backward, push), as
        ``AsyncSGD.step``. If the world re-forms meanwhile (a process joins, a member dies),
        the gradient is dropped (``dropped``), this worker joins the next generation and does
        the step again there, on fresh parameters.

        Returns the loss of ``batch``.

        Raises:
            ServerLostError: the job lost a server.
            CollectiveError: a server refused this worker, or more than ``max_reforms``
                re-forms in a row.
            RendezvousError: no new generation formed within the group's ``timeout``.
            RuntimeError: before ``start``, on a server, or after ``finish``.
        """
        failures = 0
        while True:
            inner = self._worker("step()")
            computed = False
            try:
                if inner is None:
                    raise CollectiveError("no world (the last re-form failed)")
                await inner.pull()
                inner.zero_grad()
                loss = await self.model.forward_backward(batch)
                computed = True
                self.last_push = await inner.push()
            except RendezvousError:
                raise
            except CollectiveError as exc:
                failures += 1
                self.dropped += computed
                await self._recover(exc, failures)
                continue
            self.steps += 1
            return float(loss)

    async def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter, whole, freshly pulled from the servers (a worker only; re-forms
        are handled as in ``step``)."""
        failures = 0
        while True:
            inner = self._worker("parameters()")
            try:
                if inner is None:
                    raise CollectiveError("no world (the last re-form failed)")
                return await inner.parameters()
            except RendezvousError:
                raise
            except CollectiveError as exc:
                failures += 1
                await self._recover(exc, failures)

    async def finish(self) -> None:
        """Tell the servers this worker is done, then leave the job (idempotent): later
        generations do not wait for it, and ``asynccoll run`` counts its exit as a success.

        Raises:
            ServerLostError, CollectiveError, RendezvousError: as ``step``.
        """
        if self._finished:
            return
        failures = 0
        while True:
            inner = self._worker("finish()")
            try:
                if inner is None:
                    raise CollectiveError("no world (the last re-form failed)")
                await inner.finish()
                break
            except RendezvousError:
                raise
            except CollectiveError as exc:
                failures += 1
                await self._recover(exc, failures)
        self._finished = True
        # in a full world, a process waiting as a spare gets in only with a new generation
        await self.group.admit_spares()
        await self.group.leave(finished=True)
        self._inner = None
        log.info("elastic AsyncSGD: worker %s finished after %d steps (%d gradients dropped)",
                 self.group.id, self.steps, self.dropped)

    # ----------------------------------------------------------------------- server side

    @property
    def server(self) -> int:
        """This server's index."""
        gen = self.group.generation
        if gen is None or gen.rank >= self.num_servers:
            raise RuntimeError("not a server")
        return gen.rank

    def stats(self) -> ElasticServerStats:
        """This server's counters over every generation (those of the current one as of now)."""
        inner = self._inner
        totals = {i: self._copy(c) for i, c in self._totals.items()}
        if inner is not None and self._serving:
            self._fold_into(totals, inner, None)
        version = inner.version if inner is not None and inner.is_server else self._version
        return ElasticServerStats(server=self.server, shard=self._range, version=version,
                                  generations=self._generations,
                                  workers={i: c.snapshot() for i, c in totals.items()})

    @staticmethod
    def _copy(c: _Counters) -> _Counters:
        out = _Counters()
        out.pulls, out.accepted, out.scaled, out.rejected = (c.pulls, c.accepted, c.scaled,
                                                             c.rejected)
        out.max_staleness, out.state, out.error = c.max_staleness, c.state, c.error
        return out

    def _fold_into(self, totals: dict[str, _Counters], inner: AsyncSGD,
                   ended: CollectiveError | None) -> None:
        """Add the counters of ``inner``'s world to ``totals`` (by member id)."""
        gen = self.group.generation
        assert gen is not None
        for w, c in inner._counters.items():
            t = totals.setdefault(gen.roster[w], _Counters())
            t.pulls += c.pulls
            t.accepted += c.accepted
            t.scaled += c.scaled
            t.rejected += c.rejected
            t.max_staleness = max(t.max_staleness, c.max_staleness)
            t.state, t.error = c.state, c.error
            if c.state == "active" and isinstance(ended, PeerLostError) and ended.rank == w:
                t.state, t.error = "lost", str(ended)

    async def serve(self) -> ElasticServerStats:
        """Serve the workers of every generation until every worker of the current one
        finished (or was lost) and no newer generation is open.

        Returns:
            This server's counters over every generation (``ElasticServerStats``).

        Raises:
            ServerLostError: another server was lost.
            RendezvousError: no new generation formed within the group's ``timeout`` (fewer
                than ``min_nodes`` processes are left).
            RuntimeError: before ``start``, on a worker, or a second time.
        """
        if not self._started:
            raise RuntimeError("serve() before start()")
        if not self.is_server:
            raise RuntimeError("serve() runs on servers; this process is a worker")
        if self._served or self._inner is None:
            raise RuntimeError("serve() runs once")
        self._served = True
        me = self.server
        while True:
            inner = self._inner
            gen = self.group.generation
            assert inner is not None and gen is not None
            self._serving = True
            self._generations += 1
            ended = await self._serve_world(inner, gen)
            self._serving = False
            if inner._shard is not None:     # (None: the initial parameters never came)
                self._shard, self._version = inner._shard, inner._version
            self._fold_into(self._totals, inner, ended)
            if ended is not None:
                await self._check_peer_loss(ended)
            settled = all(c.state != "active" for i, c in self._totals.items()
                          if i in gen.roster)
            go_on = not settled or await self.group.world_changed()
            log.info("parameter server %d: generation %d ended (%s); %s", me, gen.number,
                     ended or "every worker finished",
                     "going on" if go_on else "voting to end")
            if await self._vote(gen, go_on):
                try:
                    await self._form()
                    continue
                except RendezvousTimeout:
                    if not settled:
                        raise
                    # every worker had finished; the process that opened the newer
                    # generation never came: the job is over all the same
                    log.warning("parameter server %d: nobody came to generation %d; ending",
                                me, gen.number + 1)
            await self.group.client.set(OVER_KEY, b"1")
            for c in self._totals.values():
                if c.state == "active":
                    c.state, c.error = "lost", "it did not come back after a re-form"
            self._inner = None
            await self.group.leave(finished=True)
            stats = self.stats()
            log.info("parameter server %d done at version %d after %d generations: %d "
                     "accepted, %d scaled, %d rejected", me, stats.version, stats.generations,
                     stats.accepted, stats.scaled, stats.rejected)
            return stats

    async def _serve_world(self, inner: AsyncSGD, gen: Generation) -> CollectiveError | None:
        """Serve one world until its workers are done (None) or it ends (the error)."""
        watcher = asyncio.create_task(self._watch(inner, gen),
                                      name=f"elastic-asgd-watch-{gen.rank}")
        ended: CollectiveError | None = None
        try:
            await inner.serve()
        except RendezvousError:
            raise
        except CollectiveError as exc:
            ended = exc
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if not watcher.cancelled() and watcher.exception() is not None:
            raise watcher.exception()  # type: ignore[misc]  # (the rendezvous is gone)
        return ended

    async def _watch(self, inner: AsyncSGD, gen: Generation) -> None:
        """While ``inner`` serves, break its world as soon as a newer generation is open."""
        transport = inner.comm.transport
        try:
            while True:
                await asyncio.sleep(self.check_interval)
                if transport.broken is not None:
                    return
                if await self.group.world_changed():
                    log.info("parameter server %d: a newer generation than %d is open; "
                             "ending this world", gen.rank, gen.number)
                    transport.abort(CollectiveError(
                        f"parameter server {gen.rank} ends elastic generation {gen.number}: a "
                        f"newer one is open (a process joins, or a member failed)"))
                    return
        except Exception as exc:
            if transport.broken is None:
                transport.abort(CollectiveError(f"parameter server {gen.rank} cannot watch "
                                                f"the job's membership: {exc}"))
            raise

    async def _vote(self, gen: Generation, go_on: bool) -> bool:
        """Vote on whether the servers go on to the next generation, wait for every server's
        vote of ``gen`` and return the outcome: go on if any server says so. Also learns
        whether every server holds its range (else the next world starts afresh)."""
        client = self.group.client
        s = self.num_servers
        mine = {"next": go_on, "ready": self._shard is not None}
        await client.set(_vote_key(gen.number, gen.rank), json.dumps(mine))
        votes: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.group.timeout
        while True:
            for k in range(s):
                if k not in votes:
                    try:
                        votes[k] = json.loads(await client.get(_vote_key(gen.number, k),
                                                               wait=False))
                    except KeyError:
                        pass
            if len(votes) == s:
                break
            await self._check_failed()
            if time.monotonic() > deadline:
                missing = sorted(set(range(s)) - set(votes))
                raise CollectiveTimeout(f"parameter server {gen.rank}: server(s) {missing} "
                                        f"did not end elastic generation {gen.number} within "
                                        f"{self.group.timeout:g} s")
            await asyncio.sleep(VOTE_POLL)
        self._fresh = not all(v["ready"] for v in votes.values())
        return any(v["next"] for v in votes.values())


__all__ = ["ElasticAsyncSGD", "ElasticServerStats", "ServerLostError"]
