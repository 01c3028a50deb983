"""Asynchronous SGD with parameter servers: ``AsyncSGD``.

Some ranks are *servers*: together they hold the model's parameters, flat and in one dtype
(laid out by ``FlatLayout``), cut into contiguous ranges the
way ``numpy.array_split`` cuts the flat vector, one range per server. The other ranks are
*workers*: each, at its own pace, pulls the current parameters from every server, computes a
gradient on its own batch and pushes each server its range of it. Workers never wait for one
another; a server applies every push as it arrives, with its own optimizer over its range, and
counts a *version* (the number of pushes it applied).

Message flow
------------

Everything travels as point-to-point messages of the public Communicator (``send``/``recv``),
on three fixed tags. A *header* is an ``int64`` array of ``HEADER_LEN`` elements
``[kind or status, a, b, MAGIC]``; payloads are 1-D arrays of the parameters' dtype. Messages
on one ``(peer, tag)`` arrive in order, so a header and the payload that follows it never mix.
A worker holds one lock per server, so one exchange at a time runs on each channel:

    worker w                                         server s
    -- pull -----------------------------------------------------------------------
    REQUEST [PULL, f, n, MAGIC]          ------->    (n: the shard size w expects, f: the
                                                      fingerprint of w's model)
                                         <-------    REPLY [OK, version, n, MAGIC]
                                         <-------    REPLY shard (n elements, a snapshot)
    -- push -----------------------------------------------------------------------
    REQUEST [PUSH, version, n, MAGIC]    ------->    (version: what the gradient was
    REQUEST gradient (n elements)        ------->     computed on, from w's last pull)
                                         <-------    REPLY [ACCEPTED | SCALED | REJECTED,
                                                            new version, staleness, MAGIC]
    -- finish ---------------------------------------------------------------------
    REQUEST [DONE, 0, 0, MAGIC]          ------->
                                         <-------    REPLY [OK, version, 0, MAGIC]

    server 0                                         server k > 0 (at the start of serve)
    INIT [INIT, 0, n, MAGIC] + shard     ------->    the initial values of k's range

A request the server cannot use (bad header, unknown kind, a shard size or a model
fingerprint that does not match: the names, shapes, order and dtype of the parameters) gets
``REPLY [REFUSED, version, reason, MAGIC]``; the worker raises ``CollectiveError`` and the
server stops serving it (state ``"failed"``). The worker's later pulls and pushes to that
server raise ``CollectiveError`` at once, and its ``finish`` skips that server: nothing
waits for a reply that will not come. A server whose ``serve`` fails before it serves anyone
(another server was lost before the initial parameters came, or they do not fit) answers in
the same spirit, where the world isolates lost peers: every worker gets ``REPLY [STOPPED,
version, lost rank or -1, MAGIC]``, its pending and later requests to that server raise at
once (``PeerLostError`` naming the lost rank, else ``CollectiveError``) and its ``finish``
skips it. After ``DONE`` the server reads nothing more from that worker (``finish`` is
idempotent, and a finished worker's ``pull`` and ``push`` raise ``RuntimeError`` without
sending).

Staleness
---------

A push computed on version ``v`` of a shard that is now at version ``V`` has staleness
``V - v`` (the pushes of other workers applied in between). With ``max_staleness=None``
(Hogwild-style, fully asynchronous) every push is applied. With ``max_staleness=k`` a push of
staleness ``> k`` is either dropped (``stale="reject"``: the version does not move) or applied
with the learning rate scaled by ``1 / (1 + staleness)`` (``stale="scale"``, as in
staleness-aware async SGD). Every server counts, per worker, the pulls and the accepted,
scaled and rejected pushes (``ServerStats``). One worker with ``max_staleness=0`` is
exactly synchronous SGD.

Failures and time
-----------------

Every wait is one ``send`` or ``recv`` of the Communicator, bounded by its ``timeout``. A
server waits on each worker for the worker's *next* request, so **the timeout must exceed a
worker's longest step** (pull, forward and backward, push) plus any pause between steps; a
server that is slower to start than ``timeout`` likewise fails the workers' first pull.

A worker that is lost (its connection breaks, or its channel times out) is removed, logged
and reported (state ``"lost"``), and the server goes on serving the others, *if* the world
isolates lost peers: the TCP backend with ``peer_loss="isolate"``. Under the default
``peer_loss="abort"`` a lost peer breaks the whole world, so ``AsyncSGD.serve`` raises
``PeerLostError`` (or ``CollectiveTimeout``) on every server, as collectives need; a worker
that closes its communicator without ``finish`` is lost too, and the server breaks the world
with an error that names it ("parameter server 0 lost worker 3"). A lost *server* is fatal
to the workers: their next step raises, at once (their exchanges with it fail as its
connection breaks; a server that cannot start because another one was lost sends them
``STOPPED``, or breaks the world under ``"abort"``, rather than leave them waiting for the
timeout).
Cancelling a pull or push midway breaks the communicator for everyone (the Communicator's
cancellation contract).

``AsyncSGD`` runs over one fixed world: no worker can join it. For workers that join and leave
a running job, see ``asynccoll.parallel.elastic_ps.ElasticAsyncSGD``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from ..collectives import Communicator
from ..errors import CollectiveError, CollectiveTimeout, PeerLostError
from ._failure import first_error
from .clip import SquareSum, check_max_norm, clip_coefficient, counted
from .layout import FlatLayout, split_bounds
from .model import Model
from .optim import Optimizer, step_keeping

T = TypeVar("T")

log = logging.getLogger("asynccoll.parallel.param_server")

#: Tag of worker-to-server messages (requests, and the gradients of a push).
TAG_REQUEST = 0x5053_0001
#: Tag of server-to-worker messages (replies, and the shard of a pull).
TAG_REPLY = 0x5053_0002
#: Tag of server 0's initial shards for the other servers.
TAG_INIT = 0x5053_0003

#: Elements of every header array (int64).
HEADER_LEN = 4
#: Last element of every header: guards against foreign messages on our tags.
MAGIC = 0x4153_4744          # "ASGD"

# request kinds
PULL, PUSH, DONE, INIT = 1, 2, 3, 4
# reply statuses
OK, ACCEPTED, SCALED, REJECTED, REFUSED, STOPPED = 0, 1, 2, 3, 4, 5

PushStatus = Literal["accepted", "scaled", "rejected"]
WorkerState = Literal["active", "done", "lost", "failed"]
STATUS_NAMES: dict[int, PushStatus] = {ACCEPTED: "accepted", SCALED: "scaled",
                                       REJECTED: "rejected"}
STALE_MODES = ("reject", "scale")

# why a server refused a request (the third element of a REFUSED reply)
BAD_HEADER, BAD_SIZE, BAD_PAYLOAD, BAD_KIND, BAD_MODEL = 1, 2, 3, 4, 5
REFUSAL_REASONS = {
    BAD_HEADER: "a malformed request header",
    BAD_SIZE: "a shard size that does not match the server's (different models?)",
    BAD_PAYLOAD: "a gradient of the wrong dtype or shape",
    BAD_KIND: "an unknown request",
    BAD_MODEL: "the fingerprint of a model with other parameter names, shapes or dtype",
}


# ----------------------------------------------------------------------------- reports

@dataclass(frozen=True, slots=True, kw_only=True)
class PushResult:
    """What one server did with one push."""

    server: int
    status: PushStatus
    #: the server's version minus the version the gradient was computed on
    staleness: int
    #: the server's version after the push
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStats:
    """A server's counters for one worker."""

    pulls: int = 0
    accepted: int = 0
    scaled: int = 0
    rejected: int = 0
    #: the largest staleness of its pushes
    max_staleness: int = 0
    #: ``"active"`` (still training), ``"done"`` (called finish), ``"lost"`` (its
    #: connection broke or timed out) or ``"failed"`` (the server refused its messages)
    state: WorkerState = "active"
    #: why it was lost or refused
    error: str | None = None

    @property
    def pushes(self) -> int:
        return self.accepted + self.scaled + self.rejected


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerStats:
    """One server's report: its range, its version and its counters per worker."""

    rank: int
    #: the flat ``(start, stop)`` range of the parameters this server holds
    shard: tuple[int, int]
    #: pushes applied (accepted or scaled)
    version: int
    workers: Mapping[int, WorkerStats]

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
    def done(self) -> tuple[int, ...]:
        """Workers that finished normally."""
        return tuple(r for r, w in self.workers.items() if w.state == "done")

    @property
    def lost(self) -> tuple[int, ...]:
        """Workers that were lost or refused."""
        return tuple(r for r, w in self.workers.items() if w.state in ("lost", "failed"))

    def as_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-friendly copy (worker ranks become string keys)."""
        return {"rank": self.rank, "shard": list(self.shard), "version": self.version,
                "accepted": self.accepted, "scaled": self.scaled, "rejected": self.rejected,
                "workers": {str(r): {"pulls": w.pulls, "accepted": w.accepted,
                                     "scaled": w.scaled, "rejected": w.rejected,
                                     "max_staleness": w.max_staleness, "state": w.state,
                                     "error": w.error}
                            for r, w in self.workers.items()}}


class _Counters:
    """The mutable counters behind a ``WorkerStats``."""

    __slots__ = ("accepted", "error", "max_staleness", "pulls", "rejected", "scaled", "state")

    def __init__(self) -> None:
        self.pulls = self.accepted = self.scaled = self.rejected = self.max_staleness = 0
        self.state: WorkerState = "active"
        self.error: str | None = None

    def snapshot(self) -> WorkerStats:
        return WorkerStats(pulls=self.pulls, accepted=self.accepted, scaled=self.scaled,
                           rejected=self.rejected, max_staleness=self.max_staleness,
                           state=self.state, error=self.error)


class _Refusal(Exception):
    """A worker sent something the server cannot use."""

    def __init__(self, code: int) -> None:
        super().__init__(REFUSAL_REASONS.get(code, f"reason {code}"))
        self.code = code


# ----------------------------------------------------------------------------- helpers

def _header(kind: int, a: int = 0, b: int = 0) -> np.ndarray:
    return np.array([kind, a, b, MAGIC], dtype=np.int64)


def _parse(head: np.ndarray) -> tuple[int, int, int] | None:
    """``(kind, a, b)`` of a header array, or ``None`` when it is not one of ours."""
    if head.dtype != np.int64 or head.shape != (HEADER_LEN,) or int(head[3]) != MAGIC:
        return None
    return int(head[0]), int(head[1]), int(head[2])


def _fingerprint(layout: FlatLayout) -> int:
    """A number that tells apart models whose flat vectors differ (parameter names, shapes
    and order, and the dtype), the same in every process: a pull carries it, so a worker
    built with another model of as many parameters is refused rather than trained."""
    text = repr([(s.name, tuple(s.shape)) for s in layout.specs] + [np.dtype(layout.dtype).str])
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)


def _isolates_peers(comm: Communicator) -> bool:
    """Whether a failure on one peer's channel concerns that peer only: the transport
    isolates lost peers (``peer_loss="isolate"``) and the world as a whole is not broken."""
    transport = comm.transport
    return transport.peer_loss == "isolate" and transport.broken is None


async def _all(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Run ``coros`` concurrently and wait for every one of them (each is bounded by the
    Communicator's timeout), then raise the first failure, if any.

    Unlike a TaskGroup, a failure does not cancel the others: cancelling a receive would
    break the communicator for every rank, while a failed exchange with one server should
    not disturb the exchanges with the rest. If the caller is cancelled, so are they.
    """
    if len(coros) <= 1:
        return [await c for c in coros]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    errors = [e for e in (t.exception() for t in tasks) if e is not None]   # all retrieved
    if errors:
        raise errors[0]
    return [t.result() for t in tasks]


def check_options(optimizer: object, max_staleness: object, stale: object) -> None:
    """Check ``AsyncSGD``'s ``optimizer``, ``max_staleness`` and ``stale`` (see the class)."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be an asynccoll.parallel Optimizer, "
                        f"got {type(optimizer).__name__}")
    if stale not in STALE_MODES:
        raise ValueError(f"stale must be one of {', '.join(STALE_MODES)}, got {stale!r}")
    if max_staleness is not None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
            raise TypeError(f"max_staleness must be an int or None, got {max_staleness!r}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (or None), got {max_staleness}")


# ------------------------------------------------------------------------------- AsyncSGD

class AsyncSGD:
    """Asynchronous SGD over parameter servers (see the module docstring for the protocol).

    Every rank builds the same model and an ``AsyncSGD`` with the same ``servers``; server
    0's initial parameters are the ones training starts from. A worker's loop looks like the
    synchronous one:

        opt = AsyncSGD(model, comm, servers=(0,), optimizer=SGD(lr=0.05), max_staleness=4)
        if opt.is_server:
            stats = await opt.serve()          # until every worker is done (or lost)
        else:
            for batch in my_batches:           # each worker its own batches
                loss = await opt.step(batch)   # pull, forward/backward, push
            await opt.finish()

    Args:
        model: the ``Model`` (all parameters in one float
            dtype). On workers it is bound to a flat buffer that ``pull`` fills; on
            server 0 its initial values are read once. Its buffers (BatchNorm statistics)
            are not exchanged: each worker's forward passes update its own.
        comm: the communicator. Its ``timeout`` bounds every wait and must exceed a
            worker's longest step (see the module docstring).
        servers: the ranks that hold the parameters, in shard order (server ``i`` holds the
            ``i``-th ``numpy.array_split`` range of the flat vector).
        optimizer: the update rule; each server applies it to its range (workers ignore it),
            leaving the parameters its own ``model`` marks frozen (``ParamSpec.trainable``
            False, torch's ``requires_grad=False``) and their state as they are.
        max_staleness: ``None`` applies every push (Hogwild-style); ``k`` treats a push whose
            gradient is more than ``k`` versions old as stale.
        stale: what a server does with a stale push: ``"reject"`` drops it, ``"scale"``
            applies it with the learning rate divided by ``1 + staleness``. It has an effect
            only when ``max_staleness`` is set.
        workers: the ranks that train (default: every rank that is not a server).
        max_grad_norm: clip every gradient a worker pushes to this L2 norm first, as
            ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)`` on the
            worker before it sends: the norm over every trainable parameter of the whole
            gradient (the worker holds all of it, so nothing is communicated); the gradient
            is multiplied by ``max_grad_norm / (norm + 1e-6)`` when that is below 1 (a
            non-finite norm scales it by NaN or 0, as torch's default does). The norm before
            clipping is then in ``last_grad_norm``. Default ``None``: no clipping.

    Raises:
        ValueError: bad ranks (out of range, repeated, a rank both server and worker, no
            worker), a negative ``max_staleness``, an unknown ``stale`` mode or a
            ``max_grad_norm`` that is not a positive number.
        TypeError: ``optimizer`` is not an ``Optimizer``, or
            the parameters are not of one float dtype.
    """

    def __init__(self, model: Model, comm: Communicator, *, servers: Sequence[int] = (0,),
                 optimizer: Optimizer, max_staleness: int | None = None,
                 stale: str = "reject", workers: Sequence[int] | None = None,
                 max_grad_norm: float | None = None) -> None:
        check_options(optimizer, max_staleness, stale)
        self.servers = self._ranks(comm, servers, "server")
        if not self.servers:
            raise ValueError("AsyncSGD needs at least one server rank")
        if workers is None:
            self.workers = tuple(r for r in range(comm.world_size) if r not in self.servers)
        else:
            self.workers = self._ranks(comm, workers, "worker")
        both = set(self.servers) & set(self.workers)
        if both:
            raise ValueError(f"ranks {sorted(both)} are both servers and workers")
        if not self.workers:
            raise ValueError(f"AsyncSGD needs at least one worker rank; world_size is "
                             f"{comm.world_size} and the servers are {list(self.servers)}")
        self.model = model
        self.comm = comm
        self.optimizer = optimizer
        self.max_staleness = max_staleness
        self.stale = stale
        self.max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
        self.last_grad_norm: float | None = None
        """On a worker with ``max_grad_norm``, the norm of the last gradient it pushed,
        before clipping."""
        self.rank = comm.rank
        # one "rank" and one bucket per unit: AsyncSGD cuts the flat vector by servers itself
        self.layout = lay = FlatLayout(model.param_specs(), 1, 0)
        self._fingerprint = _fingerprint(lay)
        #: the flat ``(start, stop)`` range of every server, in the order of ``servers``
        self.shards: tuple[tuple[int, int], ...] = tuple(split_bounds(lay.size,
                                                                      len(self.servers)))
        self.is_server = self.rank in self.servers
        self.is_worker = self.rank in self.workers
        self.last_push: tuple[PushResult, ...] = ()
        self._steps = 0
        self._finished = False
        # server state
        self._serving = False
        #: serve() starts from carried state (``_resume``), not from server 0's INIT
        self._resumed = False
        self._version = 0
        self._counters: dict[int, _Counters] = {}
        self._shard: np.ndarray | None = None
        self._initial: np.ndarray | None = None     # server 0's, until it shared them
        if self.is_server:
            self._counters = {w: _Counters() for w in self.workers}
            if self.rank == self.servers[0]:
                self._initial = self._flatten(model)
                a, b = self.shards[0]
                self._shard = self._initial[a:b].copy()
        # worker state
        self._params: np.ndarray | None = None
        self._grads: np.ndarray | None = None
        self._versions = [-1] * len(self.servers)
        self._locks: list[asyncio.Lock] = []
        #: servers that no longer serve this worker (they refused it, or stopped serving),
        #: rank -> (why, the world rank whose loss stopped it): they read no more requests
        self._unserved: dict[int, tuple[str, int | None]] = {}
        if self.is_worker:
            self._params = self._flatten(model)
            self._grads = np.zeros(lay.size, lay.dtype)
            model.bind(params=lay.views(self._params), grads=lay.views(self._grads))
            self._locks = [asyncio.Lock() for _ in self.servers]

    @staticmethod
    def _ranks(comm: Communicator, ranks: Sequence[int], what: str) -> tuple[int, ...]:
        out = []
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int | np.integer):
                raise TypeError(f"{what} ranks must be ints, got {r!r}")
            if not 0 <= r < comm.world_size:
                raise ValueError(f"{what} rank {r} is out of range for world_size "
                                 f"{comm.world_size}")
            out.append(int(r))
        if len(set(out)) != len(out):
            raise ValueError(f"{what} ranks must be distinct, got {out}")
        return tuple(out)

    def _flatten(self, model: Model) -> np.ndarray:
        lay = self.layout
        flat = np.empty(lay.size, lay.dtype)
        current = model.parameters()
        for s in lay.specs:
            a, b = lay.offsets[s.name]
            flat[a:b] = np.asarray(current[s.name], lay.dtype).reshape(-1)
        return flat

    # ----------------------------------------------------------------------- worker side

    @property
    def steps(self) -> int:
        """Steps this worker took with ``step``."""
        return self._steps

    @property
    def versions(self) -> tuple[int, ...]:
        """Per server, the version of the shard this worker pulled last (-1: never)."""
        return tuple(self._versions)

    def _check_worker(self, what: str) -> None:
        if not self.is_worker:
            raise RuntimeError(f"{what} runs on worker ranks; rank {self.rank} is "
                               f"{'a server' if self.is_server else 'neither'}")
        if self._finished:
            raise RuntimeError(f"{what} after finish(): this worker told the servers it is done")

    async def step(self, batch: Any) -> float:
        """One asynchronous step on this worker's ``batch``: ``pull`` the current
        parameters, run the model's forward and backward pass, ``push`` the gradient.

        Returns the loss of ``batch`` (computed on the pulled parameters). What each server
        did with the push is in ``last_push``.

        Raises:
            CollectiveError: a server was lost, timed out or refused this worker (then the
                step's push may or may not have reached the servers).
            RuntimeError: called on a server, or after ``finish``.
        """
        self._check_worker("step()")
        await self.pull()
        self.zero_grad()
        loss = await self.model.forward_backward(batch)
        self.last_push = await self.push()
        self._steps += 1
        return float(loss)

    def zero_grad(self) -> None:
        """Zero the gradient buffer the model adds into (``step`` does it itself)."""
        if self._grads is not None:
            self._grads.fill(0)

    async def pull(self) -> tuple[int, ...]:
        """Fetch every server's shard, concurrently, into the model's parameters (in place).

        Returns the version of each shard (in the order of ``servers``); later pushes say
        they were computed on these versions.

        Raises:
            CollectiveError: a server was lost, timed out or refused the request (the
                parameters of that server's range then hold undefined values), or it
                refused this worker before (raised at once).
        """
        self._check_worker("pull()")
        got = await _all([self._pull_one(i) for i in range(len(self.servers))])
        return tuple(got)

    async def _pull_one(self, i: int) -> int:
        server, (a, b) = self.servers[i], self.shards[i]
        assert self._params is not None
        async with self._locks[i]:
            self._check_served(server)
            await self.comm.send(_header(PULL, self._fingerprint, b - a), server,
                                 TAG_REQUEST)
            status, version, n = self._reply(await self.comm.recv(server, TAG_REPLY), server)
            if status != OK or n != b - a:
                raise CollectiveError(f"parameter server {server} answered a pull with "
                                      f"status {status} and {n} elements (expected {b - a})")
            shard = await self.comm.recv(server, TAG_REPLY)
        if shard.dtype != self.layout.dtype or shard.shape != (b - a,):
            raise CollectiveError(f"parameter server {server} sent a shard of {shard.dtype} "
                                  f"{shard.shape}, expected {self.layout.dtype} ({b - a},)")
        self._params[a:b] = shard
        self._versions[i] = version
        return version

    async def push(self, grads: np.ndarray | Mapping[str, np.ndarray] | None = None
                   ) -> tuple[PushResult, ...]:
        """Send every server its range of a gradient, concurrently, and wait for its verdict.

        Args:
            grads: the gradient: ``None`` for the buffer the model's backward pass added
                into, a flat array of all parameters (in layout order), or a mapping from
                parameter name to array. It is taken as computed on the versions of this
                worker's last ``pull``.

        Returns:
            One ``PushResult`` per server, in the order of ``servers``.

        Raises:
            RuntimeError: no ``pull`` yet, called on a server, or after ``finish``.
            ValueError: ``grads`` of the wrong size or with unknown names.
            CollectiveError: a server was lost, timed out or refused the push, or it
                refused this worker before (raised at once).
        """
        self._check_worker("push()")
        if min(self._versions) < 0:
            raise RuntimeError("push() before pull(): a gradient must be computed on "
                               "parameters pulled from the servers")
        flat = self._gradient_array(grads)
        if self.max_grad_norm is not None:
            flat = self._clip(flat, self.max_grad_norm)
        return tuple(await _all([self._push_one(i, flat) for i in range(len(self.servers))]))

    def _clip(self, flat: np.ndarray, max_norm: float) -> np.ndarray:
        """``flat`` clipped to the global norm ``max_norm`` over the trainable parameters:
        the model's gradient buffer in place (as torch clips ``.grad``), a caller's array
        into a new one (it is left as it was)."""
        squares = SquareSum()
        for a, b in counted(0, flat.size, self.layout.frozen_ranges(self.model.param_specs())):
            squares.add(flat[a:b])
        total = math.sqrt(squares.total)
        self.last_grad_norm = total
        coef = clip_coefficient(max_norm, total)
        if coef is None:
            return flat
        if flat is self._grads:
            flat *= coef
            return flat
        return flat * flat.dtype.type(coef)

    def _gradient_array(self, grads: np.ndarray | Mapping[str, np.ndarray] | None
                        ) -> np.ndarray:
        lay = self.layout
        if grads is None:
            assert self._grads is not None
            return self._grads
        if isinstance(grads, Mapping):
            unknown = set(grads) - set(lay.offsets)
            if unknown:
                raise ValueError(f"no parameters named {sorted(unknown)}")
            missing = set(lay.offsets) - set(grads)
            if missing:
                raise ValueError(f"gradients missing for {sorted(missing)}")
            flat = np.empty(lay.size, lay.dtype)
            for name, (a, b) in lay.offsets.items():
                g = np.asarray(grads[name], lay.dtype)
                if g.size != b - a:
                    raise ValueError(f"gradient {name!r} has {g.size} elements, "
                                     f"expected {b - a}")
                flat[a:b] = g.reshape(-1)
            return flat
        flat = np.ascontiguousarray(grads, dtype=lay.dtype).reshape(-1)
        if flat.size != lay.size:
            raise ValueError(f"a flat gradient must have {lay.size} elements, got {flat.size}")
        return flat

    async def _push_one(self, i: int, flat: np.ndarray) -> PushResult:
        server, (a, b) = self.servers[i], self.shards[i]
        async with self._locks[i]:
            self._check_served(server)
            await self.comm.send(_header(PUSH, self._versions[i], b - a), server, TAG_REQUEST)
            await self.comm.send(flat[a:b], server, TAG_REQUEST)
            status, version, staleness = self._reply(
                await self.comm.recv(server, TAG_REPLY), server)
        if status not in STATUS_NAMES:
            raise CollectiveError(f"parameter server {server} answered a push with "
                                  f"status {status}")
        return PushResult(server=server, status=STATUS_NAMES[status],
                          staleness=staleness, version=version)

    def _reply(self, head: np.ndarray, server: int) -> tuple[int, int, int]:
        parsed = _parse(head)
        if parsed is None:
            raise CollectiveError(f"parameter server {server} sent a malformed reply "
                                  f"({head.dtype} {head.shape}); do all ranks run AsyncSGD "
                                  f"with the same servers?")
        status, version, extra = parsed
        if status == REFUSED:
            why = REFUSAL_REASONS.get(extra, f"reason {extra}")
            self._unserved[server] = (f"parameter server {server} refused rank {self.rank}: "
                                      f"it sent {why}", None)
            self._check_served(server)
        elif status == STOPPED:
            lost = extra if extra >= 0 else None
            cause = (f"it lost world rank {lost}" if lost is not None
                     else "it failed (its serve() raised)")
            self._unserved[server] = (f"parameter server {server} stopped serving: {cause}",
                                      lost)
            self._check_served(server)
        return status, version, extra

    def _check_served(self, server: int) -> None:
        """Raise if ``server`` no longer serves this worker (it refused it, or it stopped):
        it reads none of this worker's requests, so a new one would only wait for the
        timeout. ``PeerLostError`` when it stopped because it lost a peer, else
        ``CollectiveError``."""
        gone = self._unserved.get(server)
        if gone is not None:
            why, lost = gone
            if lost is not None:
                raise PeerLostError(why, rank=lost)
            raise CollectiveError(why)

    async def finish(self) -> None:
        """Tell every server this worker is done (idempotent); a server's ``serve``
        returns once every worker did (or was lost). Servers that refused this worker are
        skipped: they stopped serving it already.

        Raises:
            CollectiveError: a server was lost or timed out.
        """
        if not self.is_worker:
            raise RuntimeError(f"finish() runs on worker ranks; rank {self.rank} is "
                               f"{'a server' if self.is_server else 'neither'}")
        if self._finished:
            return
        self._finished = True
        await _all([self._finish_one(i) for i in range(len(self.servers))])

    async def _finish_one(self, i: int) -> None:
        server = self.servers[i]
        async with self._locks[i]:
            if server in self._unserved:
                return                  # it stopped serving this worker already
            await self.comm.send(_header(DONE), server, TAG_REQUEST)
            self._reply(await self.comm.recv(server, TAG_REPLY), server)

    async def parameters(self) -> dict[str, np.ndarray]:
        """Every parameter, whole, freshly pulled from the servers (new arrays).

        On a worker only (it pulls, so the model's parameters are updated too).
        """
        await self.pull()
        assert self._params is not None
        return {k: v.copy() for k, v in self.layout.views(self._params).items()}

    # ----------------------------------------------------------------------- server side

    @property
    def shard(self) -> tuple[int, int]:
        """The flat ``(start, stop)`` range this server holds."""
        if not self.is_server:
            raise RuntimeError(f"rank {self.rank} is not a server")
        return self.shards[self.servers.index(self.rank)]

    @property
    def version(self) -> int:
        """This server's version: the pushes it applied."""
        if not self.is_server:
            raise RuntimeError(f"rank {self.rank} is not a server")
        return self._version

    def local_parameters(self) -> np.ndarray:
        """On a server, its shard of the flat parameters (the live array, which pushes
        update; on servers other than 0 it is filled at the start of ``serve``); on a
        worker, its flat copy of every parameter as of its last ``pull``.

        Raises:
            RuntimeError: on a rank that is neither a server nor a worker.
        """
        if self.is_server:
            if self._shard is None:
                a, b = self.shard
                return np.full(b - a, np.nan, self.layout.dtype)
            return self._shard
        if self._params is None:
            raise RuntimeError(f"rank {self.rank} is neither a server nor a worker")
        return self._params

    def stats(self) -> ServerStats:
        """A snapshot of this server's counters (also while it serves)."""
        return ServerStats(rank=self.rank, shard=self.shard, version=self._version,
                           workers={w: c.snapshot() for w, c in self._counters.items()})

    async def serve(self) -> ServerStats:
        """Serve the workers until every one of them called ``finish`` or was lost.

        Server 0 first sends every other server its initial range. Then one task per
        worker answers that worker's requests as they come, applying pushes at once.

        Returns:
            This server's ``ServerStats``.

        Raises:
            PeerLostError, CollectiveTimeout: a peer was lost or timed out and the world
                does not isolate lost peers (``peer_loss="abort"``, the default, or the
                memory backend), or another server was lost.
            CollectiveError: the world is broken (an error elsewhere), or server 0's initial
                parameters do not fit this server. A server that fails before serving tells
                the workers first (see the module docstring), so that none waits for it.
            RuntimeError: called on a worker, or a second time.

        Cancelling it breaks the communicator for every rank (its receives are cancelled),
        under ``peer_loss="isolate"`` too: the workers' next step raises at once.
        """
        if not self.is_server:
            raise RuntimeError(f"serve() runs on server ranks; rank {self.rank} is a worker")
        if self._serving:
            raise RuntimeError("serve() runs once")
        self._serving = True
        try:
            if not self._resumed:
                await self._share_initial()
        except CollectiveError as exc:
            await self._give_up(exc)
            raise
        try:
            async with asyncio.TaskGroup() as tg:
                for w in self.workers:
                    tg.create_task(self._serve_worker(w), name=f"asyncsgd-{self.rank}-{w}")
        except BaseExceptionGroup as group:
            raise first_error(group, CollectiveError) from group
        stats = self.stats()
        log.debug("parameter server %d done at version %d: %d accepted, %d scaled, "
                  "%d rejected, lost %s", self.rank, stats.version, stats.accepted,
                  stats.scaled, stats.rejected, list(stats.lost))
        return stats

    def _resume(self, shard: np.ndarray, version: int) -> None:
        """Serve from carried state (a server of an earlier world over other ranks: see
        ``asynccoll.parallel.elastic_ps``): ``shard`` (this server's range, taken as the live
        array, not copied) at ``version``, instead of server 0's initial parameters. The
        optimizer given to the constructor carries its own state. Before ``serve``."""
        a, b = self.shard
        if self._serving or shard.shape != (b - a,) or shard.dtype != self.layout.dtype:
            raise RuntimeError(f"cannot resume server {self.rank} with {shard.dtype} "
                               f"{shard.shape} (expected {self.layout.dtype} ({b - a},)), "
                               f"or after serve()")
        self._shard, self._version = shard, int(version)
        self._initial, self._resumed = None, True

    async def _give_up(self, exc: CollectiveError) -> None:
        """``serve`` fails before serving anyone (``exc``: another server was lost, or sent
        parameters that do not fit): tell the workers at once, since the requests they
        sent this server will never be answered. Where the world isolates lost peers, each
        worker gets a ``STOPPED`` reply (its pending and later requests to this server raise
        at once, and the other servers go on); elsewhere the world is broken with ``exc``,
        as any failure breaks it there."""
        comm = self.comm
        if comm.transport.broken is not None:
            return                      # every rank hears of it already
        lost = exc.rank if isinstance(exc, PeerLostError) and exc.rank is not None else -1
        if isinstance(exc, CollectiveTimeout) and self.rank != self.servers[0]:
            lost = self.servers[0]      # it never sent the initial parameters
        if not _isolates_peers(comm):
            self._break_world(exc)
            return
        log.error("parameter server %d cannot serve (%s); telling the workers", self.rank, exc)

        async def tell(w: int) -> None:
            with contextlib.suppress(PeerLostError, CollectiveTimeout):  # lost too, or gone
                await comm.send(_header(STOPPED, self._version, lost), w, TAG_REPLY)

        await _all([tell(w) for w in self.workers])

    def _break_world(self, exc: CollectiveError) -> None:
        """Break the world with ``exc`` (unless it is broken already), so that every rank
        raises it, rather than the error of this server's cancelled receives."""
        transport = self.comm.transport
        if transport.broken is None:
            transport.abort(exc)

    async def _share_initial(self) -> None:
        """Server 0 sends each other server its range of server 0's initial parameters."""
        lay = self.layout
        if self.rank == self.servers[0]:
            initial, self._initial = self._initial, None
            assert initial is not None

            async def send(k: int) -> None:
                a, b = self.shards[k]
                await self.comm.send(_header(INIT, 0, b - a), self.servers[k], TAG_INIT)
                await self.comm.send(initial[a:b], self.servers[k], TAG_INIT)

            if len(self.servers) > 1:
                await _all([send(k) for k in range(1, len(self.servers))])
            return
        a, b = self.shard
        head = _parse(await self.comm.recv(self.servers[0], TAG_INIT))
        shard = await self.comm.recv(self.servers[0], TAG_INIT)
        if (head is None or head[0] != INIT or head[2] != b - a
                or shard.dtype != lay.dtype or shard.shape != (b - a,)):
            raise CollectiveError(f"parameter server {self.rank} expected {b - a} initial "
                                  f"parameters of {lay.dtype} from server {self.servers[0]}, "
                                  f"got {shard.dtype} {shard.shape}: do all ranks build the "
                                  f"same model and AsyncSGD(servers=...)?")
        self._shard = shard.copy()

    async def _serve_worker(self, w: int) -> None:
        """Answer worker ``w`` until it is done, lost or refused."""
        counters = self._counters[w]
        comm = self.comm
        try:
            while True:
                parsed = _parse(await comm.recv(w, TAG_REQUEST))
                if parsed is None:
                    raise _Refusal(BAD_HEADER)
                kind, version, n = parsed
                if kind == PULL:          # (version: the worker's model's fingerprint)
                    self._check_size(n)
                    if version != self._fingerprint:
                        raise _Refusal(BAD_MODEL)
                    counters.pulls += 1
                    assert self._shard is not None
                    snapshot, now = self._shard.copy(), self._version
                    await comm.send(_header(OK, now, snapshot.size), w, TAG_REPLY)
                    await comm.send(snapshot, w, TAG_REPLY)
                elif kind == PUSH:
                    grads = await comm.recv(w, TAG_REQUEST)
                    self._check_size(n)
                    status, staleness = self._apply(counters, version, grads)
                    await comm.send(_header(status, self._version, staleness), w, TAG_REPLY)
                elif kind == DONE:
                    await comm.send(_header(OK, self._version), w, TAG_REPLY)
                    counters.state = "done"
                    return
                else:
                    raise _Refusal(BAD_KIND)
        except _Refusal as exc:
            counters.state, counters.error = "failed", str(exc)
            log.error("parameter server %d: worker %d sent %s; it is no longer served",
                      self.rank, w, exc)
            try:
                await comm.send(_header(REFUSED, self._version, exc.code), w, TAG_REPLY)
            except (PeerLostError, CollectiveTimeout):
                if not _isolates_peers(comm):
                    raise
        except (PeerLostError, CollectiveTimeout) as exc:
            if not _isolates_peers(comm):
                # the world breaks with the cause (a rank that closed its communicator
                # without finish() does not break it by itself), not with the error of the
                # receives the task group is about to cancel
                why = f"parameter server {self.rank} lost worker {w}: {exc}"
                self._break_world(PeerLostError(why, rank=w) if isinstance(exc, PeerLostError)
                                  else CollectiveError(why))
                raise
            counters.state, counters.error = "lost", str(exc)
            log.warning("parameter server %d: lost worker %d (%s); serving the others",
                        self.rank, w, exc)

    def _check_size(self, n: int) -> None:
        assert self._shard is not None
        if n != self._shard.size:
            raise _Refusal(BAD_SIZE)

    def _apply(self, counters: _Counters, version: int, grads: np.ndarray) -> tuple[int, int]:
        """Apply (or not) one push; returns its status and staleness."""
        shard = self._shard
        assert shard is not None
        if grads.dtype != shard.dtype or grads.shape != shard.shape:
            raise _Refusal(BAD_PAYLOAD)
        if not 0 <= version <= self._version:
            raise _Refusal(BAD_HEADER)
        staleness = self._version - version
        counters.max_staleness = max(counters.max_staleness, staleness)
        # the parameters frozen in this server's model (requires_grad=False) stay as they are
        start = self.shard[0]
        frozen = self.layout.frozen_ranges(self.model.param_specs())
        if self.max_staleness is None or staleness <= self.max_staleness:
            step_keeping(self.optimizer, shard, grads, start, frozen)
            status = ACCEPTED
            counters.accepted += 1
        elif self.stale == "reject":
            counters.rejected += 1
            return REJECTED, staleness
        else:
            base = self.optimizer.lr
            self.optimizer.lr = base / (1 + staleness)
            try:
                step_keeping(self.optimizer, shard, grads, start, frozen)
            finally:
                self.optimizer.lr = base
            status = SCALED
            counters.scaled += 1
        self._version += 1
        return status, staleness


__all__ = ["AsyncSGD", "PushResult", "ServerStats", "WorkerStats"]
