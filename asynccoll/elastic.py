"""Elastic membership: worlds that shrink when a process dies and grow when one joins.

An elastic job is a sequence of *generations*. Each generation is an ordinary TCP world
(a fresh ``Communicator``) over the processes that joined it; when a member is
lost or a new process asks to join, the next generation opens, every live process joins it,
and a new world forms, without restarting any process. ``ElasticGroup`` does the
membership; ``asynccoll.parallel.elastic.ElasticTrainer`` carries training state across
generations, and ``asynccoll.parallel.elastic_ps.ElasticAsyncSGD`` runs parameter-server
training over them (its keys live under ``asgd/``).

Membership lives in the rendezvous store (the launcher's, or ``asynccoll rendezvous``), in the
namespace of the job's **job id** (``ElasticGroup.connect(job=...)``, else ``ASYNCCOLL_JOB_ID``,
else ``"elastic"``; see "Job ids" below), under ``elastic/``:

- ``elastic/round``: the newest generation number (decimal).
- ``elastic/G/joined``: a counter; a process joining generation G takes the next index ``i``
  and writes its record (id, previous generation, rank and world size) to ``elastic/G/m/i``.
- ``elastic/G/closed``: the generation's roster (member ids in rank order), written once by
  compare-and-set, by whichever member first sees that ``max_nodes`` joined, every member of
  the previous generation among them, or that at least ``min_nodes`` joined and nobody else
  for ``settle`` seconds. Survivors of the previous
  generation come first, in their old rank order (so rank 0 stays rank 0 if it lives), then
  newcomers in joining order.
- ``elastic/G/addr/R``: the address rank R listens on in generation G.
- ``elastic/G/crowded/R``: ``1`` if rank R shares a core with another rank, else ``0`` (set
  before its address; any ``1`` makes the generation's world crowded, see
  ``Tuning.crowded_segment_bytes``).
- ``elastic/left/L``: the process group of the process the launcher labels L
  (``ASYNCCOLL_RANK``), written when it leaves the job (``leave``): the launcher does not
  count that process's exit as one that finished.
- ``elastic/swept``: the first generation whose keys are still in the store. Rank 0 of every
  new generation G deletes the keys of the generations before G-1 (those a job no longer
  reads), so a long job keeps a few generations' keys, not every one.

A process that finds generation G already closed without it asks for G+1 (unless G is full,
then it waits as a spare for the next generation); the running members see the newer round at
their next step boundary (``ElasticGroup.check``) and move over together. A member that
leaves says so in that check; the others expect one member fewer of G in G+1, and the
leaver closes its world (``ElasticGroup.leave``) instead of joining. A member
whose collective fails (a peer died: ``PeerLostError``) opens the next
generation itself. A member that dies after it joined a generation and before that
generation's world formed is noticed when the others' wait for its address times out; they
then open the next generation, with a fresh ``timeout``, and form it without it.

Job ids: every member connects to the rendezvous announcing the job id, so the server keeps
the job's ``elastic/`` keys apart from those of every other job it serves (two elastic jobs
on one ``asynccoll rendezvous`` need distinct ids), and drops them when the job's last
connection closes. Each member holds its connection from ``connect`` to ``close``, through
every generation, so the keys live as long as one member (or ``asynccoll run``'s launcher,
which holds one for the whole run) is connected; once none is, the job is over, and a later
one of the same id starts from generation 0 with nothing of it. The empty job id (``job=""``)
is the server's shared namespace, which it keeps as long as it runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from .collectives import Communicator, check_int, check_timeout
from .errors import RendezvousError, RendezvousTimeout
from .rendezvous._common import MAX_WAIT_TIMEOUT
from .tuning import Tuning

log = logging.getLogger("asynccoll.elastic")

PREFIX = "elastic"
#: the job id of a member given none (no ``job`` argument, no ``ASYNCCOLL_JOB_ID``)
DEFAULT_JOB = "elastic"
#: how many times one ``form`` starts its ``timeout`` again after a generation failed to form
#: because a member in its roster never came (it died between joining and forming)
MAX_FRESH = 3


def _env_int(name: str) -> int | None:
    """The integer in the environment variable ``name`` (``None`` if unset or empty); a
    ValueError naming the variable if it holds something else."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _check_nodes(min_nodes: object, max_nodes: object) -> tuple[int, int]:
    """``min_nodes`` and ``max_nodes`` as ints with 1 <= min_nodes <= max_nodes (a bool, a
    float or a string is a TypeError naming the argument)."""
    lo, hi = check_int(min_nodes, "min_nodes"), check_int(max_nodes, "max_nodes")
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {lo}, {hi}")
    return lo, hi


@dataclass(frozen=True, slots=True)
class Generation:
    """One formed generation, as this process sees it."""

    number: int
    rank: int
    world_size: int
    roster: tuple[str, ...]
    #: ids of members that were not in the previous generation
    newcomers: tuple[str, ...]


class ElasticGroup:
    """This process's membership in an elastic job. Create with ``connect``.

    Args:
        min_nodes: a generation forms only with at least this many processes.
        max_nodes: and at most this many (later ones wait as spares).
        settle: seconds without a new arrival after which a generation with at least
            ``min_nodes`` members closes (a generation with ``max_nodes`` closes at once;
            ``math.inf``: only then).
        timeout: bound of every wait: forming a generation, and the collectives of its
            communicator. Seconds, checked as ``Communicator.timeout`` is: a number >= 0
            (``math.inf`` for none; 0 waits for nothing, so forming fails at once unless
            everything is there); anything else is a ``TypeError`` (not a number) or a
            ``ValueError`` (negative, NaN) before anything connects. Settable.
    """

    def __init__(self, client: Any, *, min_nodes: int, max_nodes: int, settle: float,
                 timeout: float, token: str | bytes | None, tuning: Tuning | None,
                 job: str, server: Any = None) -> None:
        min_nodes, max_nodes = _check_nodes(min_nodes, max_nodes)
        settle = check_timeout(settle, "settle")  # (inf: close only with max_nodes)
        self._timeout = check_timeout(timeout)
        self.client = client
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.settle = settle
        self.token, self.tuning, self.job = token, tuning, job
        self.id = uuid.uuid4().hex[:12]
        self.comm: Communicator | None = None
        self.generation: Generation | None = None
        self._server = server
        self._poll = 0.02
        #: the generation this process last added itself to (a retry of ``form`` after a
        #: timeout waits in it again instead of counting itself twice)
        self._joined = -1
        #: members of the current generation that announced they leave (``check``)
        self._leavers = 0
        #: this process left the job (``leave``): it forms no more worlds
        self.left = False

    @property
    def timeout(self) -> float:
        """The bound of every wait (see the class); settable, checked as
        ``Communicator.timeout`` is. The next generation's communicator gets it."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = check_timeout(value)

    @classmethod
    async def connect(cls, *, min_nodes: int | None = None, max_nodes: int | None = None,
                      rendezvous: str | None = None, token: str | bytes | None = None,
                      settle: float = 1.0, timeout: float = 60.0,
                      tuning: Tuning | None = None, job: str | None = None
                      ) -> ElasticGroup:
        """Connect to the job's rendezvous server.

        Arguments left ``None`` come from the environment the launcher sets
        (``asynccoll run --elastic``): ``ASYNCCOLL_MIN_NODES``, ``ASYNCCOLL_MAX_NODES``,
        ``ASYNCCOLL_RENDEZVOUS`` (``host:port``; else ``ASYNCCOLL_ADDR``/``MASTER_ADDR`` and
        ``ASYNCCOLL_PORT``/``MASTER_PORT``), ``ASYNCCOLL_TOKEN`` and ``ASYNCCOLL_JOB_ID``.

        ``job``: the job id, the same on every member of the job (else ``ASYNCCOLL_JOB_ID``,
        else ``DEFAULT_JOB``). The rendezvous keeps each job id's membership apart (see the
        module's "Job ids"): give each elastic job sharing a standalone rendezvous its own.
        Under ``asynccoll run --elastic`` leave it to the launcher, which sets
        ``ASYNCCOLL_JOB_ID`` for its processes and reads their job's keys.
        """
        from .rendezvous import RendezvousClient

        # (every argument is checked before anything connects)
        if min_nodes is None:
            env_min = _env_int("ASYNCCOLL_MIN_NODES")
            if env_min is not None and env_min < 1:
                raise ValueError(f"ASYNCCOLL_MIN_NODES={env_min} is not >= 1")
            min_nodes = env_min if env_min is not None else 1
        if max_nodes is None:
            env_max = _env_int("ASYNCCOLL_MAX_NODES")
            if env_max is not None and env_max < check_int(min_nodes, "min_nodes"):
                raise ValueError(f"ASYNCCOLL_MAX_NODES={env_max} is less than min_nodes "
                                 f"({min_nodes})")
            max_nodes = env_max if env_max is not None else max(
                check_int(min_nodes, "min_nodes"), 1 << 16)
        if rendezvous is not None and not isinstance(rendezvous, str):
            raise TypeError(f"rendezvous must be a 'host:port' str, got {rendezvous!r}")
        source = "rendezvous"  # (what an error names: the argument or the variables)
        if not rendezvous:
            rendezvous, source = os.environ.get("ASYNCCOLL_RENDEZVOUS"), "ASYNCCOLL_RENDEZVOUS"
        if not rendezvous:
            host = (os.environ.get("ASYNCCOLL_ADDR") or os.environ.get("MASTER_ADDR")
                    or "127.0.0.1")
            port = os.environ.get("ASYNCCOLL_PORT") or os.environ.get("MASTER_PORT")
            if not port:
                raise ValueError("no rendezvous: pass rendezvous='host:port', set "
                                 "ASYNCCOLL_RENDEZVOUS, or start under `asynccoll run --elastic`")
            rendezvous = f"{host}:{port}"
            source = "ASYNCCOLL_ADDR/MASTER_ADDR and ASYNCCOLL_PORT/MASTER_PORT"
        host, _, port_s = rendezvous.rpartition(":")
        if not host or not port_s.isdigit() or int(port_s) > 65535:
            raise ValueError(f"{source} must give host:port (port 0-65535), got {rendezvous!r}")
        min_nodes, max_nodes = _check_nodes(min_nodes, max_nodes)
        settle = check_timeout(settle, "settle")
        timeout = check_timeout(timeout)
        if job is None:
            job = os.environ.get("ASYNCCOLL_JOB_ID") or DEFAULT_JOB
        elif not isinstance(job, str):
            raise TypeError(f"job must be a str, got {job!r}")
        token = token if token is not None else os.environ.get("ASYNCCOLL_TOKEN")
        # (the rendezvous protocol bounds one request's wait; our own waits have no bound).
        # This connection, in the job's namespace, stays open until ``close``: while a member
        # holds one, the server keeps the job's keys (see "Job ids")
        client = await RendezvousClient.connect(host, int(port_s), token=token, job=job,
                                                timeout=min(timeout, MAX_WAIT_TIMEOUT))
        return cls(client, min_nodes=min_nodes, max_nodes=max_nodes, settle=settle,
                   timeout=timeout, token=token, tuning=tuning, job=job)

    # ----------------------------------------------------------------------- rounds

    async def current_round(self) -> int:
        """The newest generation number in the store."""
        try:
            return int(await self.client.get(f"{PREFIX}/round", wait=False))
        except KeyError:
            _, value = await self.client.compare_set(f"{PREFIX}/round", None, b"0")
            return int(value)

    async def _open(self, number: int) -> None:
        """Make ``number`` the newest generation, unless a newer one is already open."""
        while True:
            current = await self.current_round()
            if current >= number:
                return
            ok, _ = await self.client.compare_set(f"{PREFIX}/round", str(current).encode(),
                                                  str(number).encode())
            if ok:
                log.info("elastic: %s opened generation %d", self.id, number)
                return

    async def _join(self, g: int, deadline: float) -> Generation | None:
        """Join generation ``g``; its roster once it closed, or None when this process is
        not in it (then the caller tries the newest generation)."""
        c = self.client
        base = f"{PREFIX}/{g}"
        prev = self.generation
        if self._joined != g:
            index = await c.add(f"{base}/joined", 1) - 1
            # size: the members of prev expected back (those that left will not come)
            record = {"id": self.id, "gen": prev.number if prev else -1,
                      "rank": prev.rank if prev else -1,
                      "size": prev.world_size - self._leavers if prev else 0}
            await c.set(f"{base}/m/{index}", json.dumps(record))
            self._joined = g
        last_n, last_change = -1, time.monotonic()
        records: list[dict[str, Any]] = []  # the joiners' records, read once each
        while True:
            try:
                roster = json.loads(await c.get(f"{base}/closed", wait=False))
                break
            except KeyError:
                pass
            if await self.current_round() > g:
                # a newer round opens only once this one closed: it may have closed (with
                # this process in it) just after the read above
                try:
                    roster = json.loads(await c.get(f"{base}/closed", wait=False))
                    break
                except KeyError:
                    return None          # moved on before this one closed
            n = int(await c.get(f"{base}/joined", wait=False))
            now = time.monotonic()
            if n != last_n:
                last_n, last_change = n, now
            # full: close at once, but only once every member of the previous generation is
            # in (newcomers that came first must not push a survivor out); else after settle
            settled = n >= self.min_nodes and now - last_change >= self.settle
            if settled or n >= self.max_nodes:
                records = await self._records(g, n, records)
                if settled or self._survivors_in(records):
                    roster = await self._close(g, records)
                    break
            if now > deadline:
                raise RendezvousTimeout(f"elastic generation {g}: {n} of at least "
                                        f"{self.min_nodes} processes joined within "
                                        f"{self.timeout:g} s")
            await asyncio.sleep(self._poll)
        if self.id not in roster:
            if len(roster) < self.max_nodes:
                await self._open(g + 1)  # came too late: ask the running world to take us in
            else:
                log.info("elastic: generation %d is full; %s waits as a spare", g, self.id)
                while await self.current_round() <= g:
                    if time.monotonic() > deadline:
                        raise RendezvousTimeout(f"spare {self.id} found no place within "
                                                f"{self.timeout:g} s")
                    await asyncio.sleep(10 * self._poll)
            return None
        old = set(prev.roster) if prev else set()
        return Generation(g, roster.index(self.id), len(roster), tuple(roster),
                          tuple(m for m in roster if m not in old))

    async def _records(self, g: int, n: int, have: list[dict[str, Any]]
                       ) -> list[dict[str, Any]]:
        """The records of generation ``g``'s first ``n`` joiners: ``have`` (the first ones,
        read before: a record never changes) and those after it."""
        base = f"{PREFIX}/{g}"
        wait = min(self.timeout, MAX_WAIT_TIMEOUT)
        return have + [json.loads(await self.client.get(f"{base}/m/{i}", timeout=wait))
                       for i in range(len(have), n)]

    @staticmethod
    def _survivors_in(records: list[dict[str, Any]]) -> bool:
        """Whether every member of the newest previous generation among ``records`` joined."""
        newest = max(r["gen"] for r in records)
        if newest < 0:
            return True
        ours = [r for r in records if r["gen"] == newest]
        return len(ours) >= ours[0].get("size", 0)

    async def _close(self, g: int, records: list[dict[str, Any]]) -> list[str]:
        """Close generation ``g`` with the best ``max_nodes`` of the joiners of ``records``."""
        n = len(records)
        order = sorted(range(n), key=lambda i: (records[i]["gen"] < 0, -records[i]["gen"],
                                                records[i]["rank"], i))
        roster = [records[i]["id"] for i in order[:self.max_nodes]]
        _, value = await self.client.compare_set(f"{PREFIX}/{g}/closed", None,
                                                 json.dumps(roster).encode())
        return list(json.loads(value))

    # ----------------------------------------------------------------------- worlds

    async def form(self) -> Communicator:
        """Leave the current world (if any) and join the next generation's.

        Returns the new communicator (also ``comm``); ``generation`` describes it.
        Raises ``RendezvousTimeout`` (a ``RendezvousError`` and a ``CollectiveTimeout``) if
        no generation with ``min_nodes`` members forms within ``timeout``, and
        ``RendezvousError`` if generations keep failing to form for that long (the last
        failure is its cause).
        """
        from .transport.tcp_world import tcp_store_world

        if self.left:
            raise RuntimeError("this process left the elastic job: it forms no more worlds")
        if self.comm is not None:
            old, self.comm = self.comm, None
            await old.close()
        deadline = time.monotonic() + self.timeout
        fresh = 0               # budgets renewed after a wait for a member that never came
        while True:
            g = await self.current_round()
            if self.generation is not None and g <= self.generation.number:
                await self._open(self.generation.number + 1)
                continue
            gen = await self._join(g, deadline)
            if gen is None:
                if time.monotonic() > deadline:
                    raise RendezvousTimeout(f"no elastic generation formed within "
                                            f"{self.timeout:g} s")
                continue
            began = time.monotonic()
            try:
                comm = await tcp_store_world(
                    self.client, f"{PREFIX}/{g}", gen.rank, gen.world_size,
                    timeout=self.timeout, token=self.token, job=f"{self.job}/{g}",
                    tuning=self.tuning)
            except Exception as exc:  # a member vanished while forming: try the next one
                now = time.monotonic()
                if now > deadline and now - began >= self.timeout / 2 and fresh < MAX_FRESH:
                    # it waited for a member of the roster that died before its world
                    # formed: that wait is how its death shows, and must not leave the
                    # survivors without the time to form the next generation without it
                    fresh += 1
                    deadline = now + self.timeout
                if now > deadline:
                    raise RendezvousError(f"no elastic generation formed within "
                                          f"{self.timeout:g} s: generation {g} failed to "
                                          f"form ({exc})") from exc
                log.warning("elastic: generation %d failed to form (%s); trying the next", g,
                            exc)
                # its roster already left out this world's leavers: the next generation
                # expects all of its members back
                self.generation, self._leavers = gen, 0
                await self._open(g + 1)
                continue
            self.generation, self.comm = gen, comm
            self._leavers = 0
            log.info("elastic: %s is rank %d of %d in generation %d", self.id, gen.rank,
                     gen.world_size, g)
            if gen.rank == 0:
                await self._sweep(g - 1)
            return comm

    async def _sweep(self, below: int) -> None:
        """Delete the keys of the generations before ``below`` that no earlier sweep took
        (``elastic/swept``: the first generation whose keys are still there), so that a
        long job's store holds a few generations, not all of them. Rank 0 of each new
        generation sweeps up to the one before the previous: by the time a generation has
        formed, nobody reads those any more (a straggler still looking at one finds it gone,
        as it would find it closed without it, and moves on to the newest)."""
        c = self.client
        key = f"{PREFIX}/swept"
        try:
            start = int(await c.get(key, wait=False))
        except KeyError:
            start = 0
        if start >= below:
            return
        ok, _ = await c.compare_set(key, str(start).encode() if start else None,
                                    str(below).encode())
        if not ok:  # another member swept meanwhile
            return
        for h in range(start, below):
            base = f"{PREFIX}/{h}"
            try:
                joined = int(await c.get(f"{base}/joined", wait=False))
            except KeyError:
                joined = 0
            try:
                members = len(json.loads(await c.get(f"{base}/closed", wait=False)))
            except KeyError:
                members = 0
            keys = [f"{base}/m/{i}" for i in range(joined)] + [f"{base}/joined", f"{base}/closed"]
            keys += [f"{base}/{kind}/{r}" for r in range(members) for kind in ("addr", "crowded")]
            for k in keys:
                await c.delete(k)

    async def world_changed(self) -> bool:
        """Whether a newer generation is open (a member asked to join, or one failed)."""
        return self.generation is None or await self.current_round() > self.generation.number

    async def admit_spares(self) -> bool:
        """Open the next generation if the current one is full (``max_nodes``) and a process
        waits as a spare for a place in it (it joined the generation after it closed); return
        whether it did. For a member that leaves the world without ``check`` (an
        ``ElasticAsyncSGD`` worker that finished): its place goes to the spare once the others
        move to the next generation."""
        gen = self.generation
        if gen is None or gen.world_size < self.max_nodes:
            return False
        try:
            joined = int(await self.client.get(f"{PREFIX}/{gen.number}/joined", wait=False))
        except KeyError:
            return False
        if joined <= gen.world_size:
            return False
        await self._open(gen.number + 1)
        return True

    async def check(self, *, leaving: bool = False) -> tuple[bool, int]:
        """Collective over the current world, at a step boundary: ``(reform, leavers)``, the
        same on every rank. ``leavers``: how many members pass ``leaving=True`` (they then
        ``leave``); ``reform``: some rank saw a newer generation open (a process asked to
        join, or a member failed) or a member leaves, so the others form the next one.
        Calling it at step boundaries makes every rank move at the same step."""
        if self.comm is None:
            return True, 0
        flags = np.array([await self.world_changed(), leaving], np.int64)
        await self.comm.all_reduce(flags)
        self._leavers = int(flags[1])
        return bool(flags[0]) or self._leavers > 0, self._leavers

    async def should_reform(self) -> bool:
        """``check()``'s ``reform``, for a rank that does not leave."""
        reform, _ = await self.check()
        return reform

    async def leave(self, *, finished: bool = False) -> None:
        """Leave the job for good: close this process's world (the others, told by
        ``check(leaving=True)``, form the next generation without it and do not wait for it);
        ``form`` raises from now on. The rendezvous connection stays open until ``close``.

        ``finished=True``: this process leaves because its part of the work is done (an
        ``ElasticAsyncSGD`` worker after ``finish``), so ``asynccoll run`` counts its exit
        among those that succeeded, as it counts any other; by default the launcher is told
        that its exit ends no work."""
        self.left = True
        if self.comm is not None:
            old, self.comm = self.comm, None
            await old.close()
        label = os.environ.get("ASYNCCOLL_RANK")
        if not finished and os.environ.get("ASYNCCOLL_ELASTIC") and label is not None:
            # for ``asynccoll run``: this process's exit ends no work, it must not count
            # among those that finished. The launcher's label, and its process group: the
            # launcher's child leads it (a session of its own), be this process that child
            # or one a wrapper script started
            group = getattr(os, "getpgrp", os.getpid)()
            try:
                await self.client.set(f"{PREFIX}/left/{label}", str(group))
            except Exception as exc:  # the launcher is gone: nobody to tell
                log.warning("elastic: could not tell the launcher that %s left (%s)",
                            self.id, exc)
        log.info("elastic: %s left the job", self.id)

    async def close(self) -> None:
        """Leave: close the current world and the rendezvous connection."""
        if self.comm is not None:
            await self.comm.close()
            self.comm = None
        await self.client.close()

    async def __aenter__(self) -> ElasticGroup:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


__all__ = ["ElasticGroup", "Generation"]
