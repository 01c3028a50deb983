"""The ``"mpi"`` backend: every collective is an mpi4py non-blocking call, awaited from asyncio.

``mpi_init`` (``asynccoll.init(backend="mpi")``) returns an ``MpiCommunicator`` over
``MPI.COMM_WORLD`` (or a communicator you pass); rank and size come from MPI, so the launcher's
environment (``mpirun``/``mpiexec``/``srun``) is all it needs. The communicator has the
``Communicator`` API, argument checks and results; only the transport differs.

How it maps onto MPI
--------------------
Each communicator duplicates its MPI communicator into four: ``meta`` (the signature checks),
``stage0`` and ``stage1`` (the collectives' data; collectives with two dependent MPI calls, like
a scatter's header then payload, put the second on ``stage1``) and ``p2p`` (send/recv). A world
also keeps ``ctrl``, on which a failing rank tells every other one to stop waiting.

MPI requires every process to start the collectives of a communicator in the same order. A call
takes a *ticket* (in call order, which the API already requires to be the same everywhere),
issues its signature check on ``meta`` at once, and issues its data calls only when every
earlier ticket has issued its own (``Turns``, one per stage
communicator), so ``asyncio.gather(comm.all_reduce(a), comm.all_reduce(b))`` issues the same
sequence on every rank, and several collectives are in flight at once.

Requests are polled from the event loop (``poll``), so a wait never
blocks other coroutines, and a wait raises ``CollectiveTimeout`` once no wait of the world
completed for the communicator's ``timeout`` (``_poll``).

Guarantees (see ``docs/backends/mpi.md``)
-----------------------------------------
* Signatures (name, dtype, shape, op, root, member lists) are checked before any data moves
  (``check_signatures=True``, the default): ranks that disagree all raise
  ``CollectiveError`` naming both calls, and no buffer is touched. With
  ``check_signatures=False`` the check (one small all-gather per collective) is skipped, and a
  mismatch is whatever MPI makes of it: an MPI error, a hang until ``timeout``, or wrong data.
* ``all_reduce`` leaves bit-identical values on every rank: exact dtypes (integers, bool) use
  ``MPI_Iallreduce``; floating-point ones a reduce-scatter then an all-gather, so that every
  element is computed once, on one rank.
* A rank that fails (timeout, cancellation, an error) tells the others over ``ctrl``: their
  waits raise ``CollectiveError`` promptly. A rank that *dies* is MPI's
  business: ``mpirun`` normally ends the whole job.
* A rank that closes the world with nothing in flight (or ends without closing it), or a
  group, tells the others over ``ctrl`` how many collectives it started on each
  communicator they share (``_cid``: the same on every member) and how many messages it
  sent them (``MpiWorld.tell_closed``):
  their calls that need it beyond those raise at once, as on tcp (``PeerLostError`` for a
  closed world, ``CollectiveError`` "world rank r closed the group" for a group).
* ``send`` copies the array and returns at once (it never waits for the receiver); ``recv``
  reads a small header (tag, dtype, shape) then the payload.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from .._progress import SPIN_SECONDS, Turns, poll
from ..collectives import (
    Communicator,
    _check_array,
    _pack_object,
    _sig_array,
    _unpack_object,
    check_int,
    check_timeout,
)
from ..errors import CollectiveError, CollectiveTimeout, CommunicatorClosedError
from ..ops import ReduceOp, check_op, finish
from ..tuning import Tuning
from ..wire import dtype_code
from ._native import (
    Failures,
    block_sizes,
    check_arrays,
    check_axis,
    check_gather_out,
    check_ndim,
    digest,
    failed_in,
    gather_alone,
    gather_mismatch,
    no_progress,
    offsets,
    scatter_blocks,
    signature_mismatch,
)
from .base import describe_sig, refused
from .mpi_world import (
    _HEAD_WORDS,
    _MOVE_TYPES,
    SETTLE_RECEIVES,
    MpiWorld,
    SendTo,
    _flat_bytes,
    _free,
    _from_header,
    _header,
    closed_group,
    closed_scope,
    import_mpi,
    keep_pending,
    mpi_launched,
)

T = TypeVar("T")
log = logging.getLogger("asynccoll.mpi")

#: seconds a wait for a collective's requests (or a receive's payload) tests them on every
#: turn of the event loop before it starts sleeping between tests. MPI moves data only while
#: it is called (a large message takes many calls, on both sides), and the loop's sleeps are
#: about a millisecond, so a wait that sleeps stretches to milliseconds per step: 2 MiB
#: float32 all_reduce over 2 ranks, each call after a barrier, took 9964 us with the 200 us
#: spin of the other waits and 854 us with this one; 4 ranks on 2 cores 11.7-14.4 ms against
#: 2.4-2.6 ms. Blocking MPI calls spin the whole time; this spins for as long as data
#: usually takes, then lets an idle wait (a late peer) stop burning the core.
WAIT_SPIN_SECONDS = 0.1

#: tags on the ``p2p`` communicator: a message is a header, then its payload
_HEAD_TAG = 1
_DATA_TAG = 2
#: tag of MPI_Comm_create_group in new_group
_GROUP_TAG = 4
#: what a new_group body returns when the ranks passed different member lists
_DIFFERENT_MEMBERS = object()
#: bytes of a signature description exchanged when signatures differ
_DESCRIBE_BYTES = 240
#: communicators a world keeps a record of (``MpiWorld.records``) at most: groups closed
#: on this rank are forgotten at once, groups dropped unclosed once this many are newer
MAX_RECORDS = 1024


class _Expired(Exception):
    """A wait's deadline passed (it may have moved on since: see ``_later``)."""


def _later(world: MpiWorld, timeout: float, error: Callable[[], CollectiveError]) -> float:
    """The deadline of a wait whose deadline passed: ``timeout`` after the world's last
    progress, as the other backends count a timeout (no progress for ``timeout``: a call
    queued behind others that keep completing waits as long as they do). Raises ``error()``
    if that moment passed too."""
    deadline = world.progressed + timeout
    if asyncio.get_running_loop().time() >= deadline:
        raise error()
    return deadline


async def _poll(done: Callable[[], bool], deadline: float, world: MpiWorld, timeout: float,
                error: Callable[[], CollectiveError], spin: float,
                check: Callable[[], None] | None = None) -> float:
    """``poll`` until ``done()``, with the deadline moving on as the world progresses; notes
    the progress; returns the deadline. ``check``: what ends the wait early (default: the
    world broke or was closed)."""
    while True:
        try:
            await poll(done, deadline=deadline, check=check or world.check, on_timeout=_Expired,
                       spin=spin)
        except _Expired:
            deadline = _later(world, timeout, error)
            continue
        world.progressed = asyncio.get_running_loop().time()
        return deadline


class _Op:
    """One collective in progress: its ticket, deadline and the MPI requests it issued."""

    __slots__ = ("comm", "deadline", "reqs", "sig", "stages_done", "ticket")

    def __init__(self, comm: MpiCommunicator, ticket: int, sig: tuple[Any, ...],
                 deadline: float) -> None:
        self.comm = comm
        self.ticket = ticket
        self.sig = sig
        self.deadline = deadline
        self.reqs: list[tuple[Any, tuple[Any, ...]]] = []
        self.stages_done = [False, False]

    async def stage(self, s: int) -> Any:
        """Wait for the turn to issue on stage communicator ``s``; returns that communicator."""
        comm = self.comm
        while not comm._turns[s].ready(self.ticket):
            try:
                async with asyncio.timeout_at(self.deadline):
                    await comm._turns[s].wait(self.ticket)
            except TimeoutError:
                self.deadline = _later(comm._world, comm.timeout, self.timeout_error)
        self.check()
        return comm._stage_comms[s]

    def check(self) -> None:
        """Raise if the world broke or was closed, or a member closed the world or this
        group before starting this collective (it never will)."""
        comm = self.comm
        comm._world.check()
        err = comm._world.closed_error(comm._cid, self.ticket)
        if err is not None:
            raise err

    def issued(self, s: int) -> None:
        """Everything this collective puts on stage ``s`` was issued."""
        if not self.stages_done[s]:
            self.stages_done[s] = True
            self.comm._turns[s].done(self.ticket)

    def track(self, req: Any, *keep: Any) -> Any:
        self.reqs.append((req, keep))
        return req

    async def wait(self, *reqs: Any) -> None:
        comm = self.comm
        mpi = comm._mpi
        items = list(reqs)

        def done() -> bool:
            try:
                return bool(mpi.Request.Testall(items))
            except mpi.Exception as exc:
                raise failed_in("MPI", self.sig, comm._rank, exc) from exc

        self.deadline = await _poll(done, self.deadline, comm._world, comm.timeout,
                                    self.timeout_error, WAIT_SPIN_SECONDS, self.check)

    def timeout_error(self) -> CollectiveTimeout:
        comm = self.comm
        return no_progress(self.sig, comm._rank, comm.timeout, comm._where(self.ticket))


class MpiCommunicator(Communicator):
    """A ``Communicator`` whose collectives are MPI non-blocking calls.

    Made by ``mpi_init`` (``asynccoll.init(backend="mpi")``) and ``new_group``.
    Same API, argument checks and results as every other backend; see the module docstring
    for how calls map onto MPI. ``tuning`` is kept for API compatibility but unused: MPI picks
    its own algorithms.

    Attributes:
        check_signatures: whether every collective first checks that all ranks called the
            same thing (one small all-gather). Equal on all ranks.
        mpi_comm: the MPI communicator the collectives run on (a duplicate of the one given).
    """

    def __init__(self, world: MpiWorld, comms: Sequence[Any], *, ranks: Sequence[int],
                 timeout: float = 60.0, tuning: Tuning | None = None,
                 check_signatures: bool = True, owns_world: bool = False,
                 cid: str = "w") -> None:
        # Deliberately not Communicator.__init__: there is no Transport under this one. These
        # are the attributes the base class's helpers and properties read.
        stage0, stage1, meta, p2p = comms
        self._world = world
        self._mpi = world.mpi
        self._transport = world  # type: ignore[assignment]
        self._ranks = tuple(ranks)
        self._rank = int(stage0.Get_rank())
        #: MPI has no group ids: 0 for the world, 1 for a subgroup (what ``_where`` and
        #: ``_names`` tell apart in error messages; ``_ranks`` are its world ranks)
        self._group = 0 if owns_world else 1
        self._closed = False
        self._owns_world = owns_world
        self.timeout = float(timeout)
        self.tuning = tuning if tuning is not None else Tuning()
        self.backend = "mpi"
        self.check_signatures = bool(check_signatures)
        self._stage_comms = (stage0, stage1)
        self._meta = meta
        self._p2p = p2p
        self._tickets = 0
        self._turns = (Turns(), Turns())
        self._p2p_waiting: dict[tuple[int, int], deque[asyncio.Future[Any]]] = {}
        self._p2p_status = world.mpi.Status()
        #: messages sent to / headers received from each group rank (what a notice of
        #: closing says, and what it is compared with: ``MpiWorld.closed_peer``)
        self._p2p_sent: dict[int, int] = {}
        self._p2p_got: dict[int, int] = {}
        #: a collective of this communicator failed without breaking the world (a member
        #: closed the group): MPI may still use its communicators, which are never freed
        self._keep = False
        #: this communicator's id, the same on every member: ``"w"`` for the world, then the
        #: parent's id and the ticket of the ``new_group`` that made it
        self._cid = cid
        #: collectives started (``_tickets``, kept where the world's notice of closing, or of
        #: ending unclosed, reads it: ``MpiWorld.records``)
        self._started = [0]
        world.records[cid] = (self._ranks, self._started, self._p2p_sent)
        while len(world.records) > MAX_RECORDS:  # (groups dropped unclosed: the oldest go)
            _forget(world, next(k for k in world.records if k != "w"))
        #: collectives and receives in progress: a group closed under them frees its MPI
        #: communicators after the last one (as on the other backends, they go on)
        self._calls = 0
        #: payloads being received for messages no recv asked for yet, by (src, tag); what
        #: is left of them when the communicator is closed or dropped is never freed
        self._p2p_early: dict[tuple[int, int], deque[tuple[np.ndarray, Any]]] = {}
        self._keep_early = weakref.finalize(self, _keep_early, world.mpi, self._p2p_early)

    @property
    def mpi_comm(self) -> Any:
        """The mpi4py communicator the data moves on (do not start collectives on it)."""
        return self._stage_comms[0]

    @property
    def transport(self) -> MpiWorld:  # type: ignore[override]
        """The ``MpiWorld`` this communicator shares with its subgroups."""
        return self._world

    def __repr__(self) -> str:
        return f"<MpiCommunicator rank {self._rank}/{self.world_size}>"

    # -- machinery -----------------------------------------------------------------------

    def _check_open(self, what: str = "") -> None:
        """Raise unless a call (named ``what`` in the error of a broken world) may start."""
        if self._closed:
            raise CommunicatorClosedError("the communicator was closed")
        try:
            self._world.check()
        except CollectiveError as exc:
            raise refused(exc, what) from exc.__cause__

    async def _collective(self, sig: tuple[Any, ...], body: Callable[[_Op, np.ndarray | None],
                                                                     Awaitable[T]], *,
                          extra: int = 0, meta: bool = False, check: bool = False,
                          payload: int = 0) -> T:
        """Run one collective (``world_size > 1``): ticket, signature check, failure handling.

        ``body(op, rows)`` issues the MPI calls (after ``await op.stage(s)``, marking
        ``op.issued(s)``) and waits for them. ``rows`` is the ``(world_size, 2)`` int64
        all-gather of every rank's ``[signature digest, extra]`` when ``meta`` or a check asks
        for it, else ``None``. ``payload``: bytes this rank contributes (for ``bytes_sent``).
        """
        self._check_open(str(sig[0]))
        self._world.bytes_sent += payload
        loop = asyncio.get_running_loop()
        ticket = self._tickets
        self._tickets += 1
        self._started[0] = self._tickets
        op = _Op(self, ticket, sig, loop.time() + self.timeout)
        self._begin()
        try:
            with Failures(sig, self._rank, "MPI", self._mpi.Exception,
                          functools.partial(self._fail, op), self._where, ticket):
                op.check()  # (a member that closed the world or this group: at once)
                rows = None
                checking = check or self.check_signatures
                if checking or meta:
                    mpi = self._mpi
                    mine = np.array([digest(sig) if checking else 0, extra], np.int64)
                    rows = np.empty((self.world_size, 2), np.int64)
                    req = op.track(self._meta.Iallgather([mine, mpi.INT64_T],
                                                         [rows, mpi.INT64_T]), mine, rows)
                    await op.wait(req)
                    if checking and np.any(rows[:, 0] != rows[self._rank, 0]):
                        await self._mismatch(op, rows)
                return await body(op, rows)
        finally:
            op.issued(0)
            op.issued(1)
            self._end()

    def _begin(self) -> None:
        self._calls += 1
        self._world.calls += 1

    def _end(self) -> None:
        self._calls -= 1
        self._world.calls -= 1
        if self._closed and not self._calls:
            self._free()

    def _fail(self, op: _Op, err: CollectiveError) -> None:
        pending = [(r, k) for r, k in op.reqs if r]
        if pending:
            self._world.abandon([r for r, _ in pending], tuple(k for _, k in pending))
            self._keep = True
        if closed_scope(err) != "group":  # (a member closed the group: that group only)
            self._world.abort(err)

    async def _mismatch(self, op: _Op, rows: np.ndarray) -> None:
        """Signatures differ: every rank of the group gets here for this ticket. Exchange
        descriptions (to name both calls) and raise."""
        mpi = self._mpi
        r = self._rank
        mine_text = describe_sig(op.sig).encode()[:_DESCRIBE_BYTES]
        mine = np.zeros(_DESCRIBE_BYTES, np.uint8)
        mine[:len(mine_text)] = np.frombuffer(mine_text, np.uint8)
        every = np.empty((self.world_size, _DESCRIBE_BYTES), np.uint8)
        comm = await op.stage(0)
        req = op.track(comm.Iallgather([mine, mpi.BYTE], [every, mpi.BYTE]), mine, every)
        op.issued(0)
        await op.wait(req)
        other = next(j for j in range(self.world_size) if rows[j, 0] != rows[r, 0])
        theirs = every[other].tobytes().rstrip(b"\0").decode(errors="replace")
        err = signature_mismatch(r, describe_sig(op.sig), other, theirs,
                                 self._where(op.ticket))
        self._world.abort(err, notify=True)
        raise err

    # -- collectives ---------------------------------------------------------------------

    async def broadcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` on every rank with root's ``array``; returns ``array``.

        Raises:
            CollectiveError: ranks passed different shapes/dtypes/roots (and subclasses for
                timeouts). ``array`` then holds undefined values on non-roots.
        """
        root = self._check_rank(root, "root")
        a = _check_array(array, writable=self._rank != root)  # root's is only read
        if self.world_size == 1:
            self._check_open("broadcast")
            return a

        async def body(op: _Op, rows: np.ndarray | None) -> np.ndarray:
            comm = await op.stage(0)
            req = op.track(comm.Ibcast(self._move(a), root), a)
            op.issued(0)
            await op.wait(req)
            return a

        return await self._collective(("broadcast", *_sig_array(a), root), body,
                                      payload=a.nbytes if self._rank == root else 0)

    async def reduce(self, array: np.ndarray, root: int = 0, op: ReduceOp = ReduceOp.SUM
                     ) -> np.ndarray | None:
        """Reduce ``array`` over all ranks onto ``root``, in place there.

        Returns ``array`` on root, ``None`` elsewhere (where ``array`` is left unchanged).
        """
        a = _check_array(array, writable=self._rank == root)
        root = self._check_rank(root, "root")
        rop = check_op(op, a.dtype)
        if self.world_size == 1:
            self._check_open("reduce")
            return a
        datatype, mop, _ = self._world.reduction(a.dtype, rop)
        mpi = self._mpi
        me = self._rank

        async def body(op: _Op, rows: np.ndarray | None) -> np.ndarray | None:
            buf = [_flat_bytes(a), a.size, datatype]
            comm = await op.stage(0)
            if me == root:
                req = op.track(comm.Ireduce(mpi.IN_PLACE, buf, mop, root), a)
            else:
                req = op.track(comm.Ireduce(buf, None, mop, root), a)
            op.issued(0)
            await op.wait(req)
            if me != root:
                return None
            finish(a, rop, self.world_size)
            return a

        return await self._collective(("reduce", *_sig_array(a), rop.value, root), body,
                                      payload=a.nbytes)

    async def all_reduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
        """Reduce ``array`` over all ranks, in place on every rank; returns ``array``.

        Every rank ends with bit-identical values.

        Raises:
            TypeError: unsupported/non-contiguous array, or an op that does not fit the dtype.
            CollectiveError: ranks passed different shapes/dtypes/ops, or no progress was made
                (CollectiveTimeout). ``array`` then holds undefined values.
        """
        a = _check_array(array, writable=True)
        rop = check_op(op, a.dtype)
        if self.world_size == 1:
            self._check_open("all_reduce")
            return a
        datatype, mop, exact = self._world.reduction(a.dtype, rop)
        mpi = self._mpi
        w, me = self.world_size, self._rank

        async def body(op: _Op, rows: np.ndarray | None) -> np.ndarray:
            flat = _flat_bytes(a)
            if exact:
                comm = await op.stage(0)
                req = op.track(comm.Iallreduce(mpi.IN_PLACE, [flat, a.size, datatype], mop), a)
                op.issued(0)
                await op.wait(req)
                return a
            # every element reduced once, on one rank, then copied: bit-identical everywhere
            counts = block_sizes(a.size, w)
            mine = np.empty(counts[me], a.dtype)
            comm = await op.stage(0)
            req = op.track(comm.Ireduce_scatter([flat, a.size, datatype],
                                                [_flat_bytes(mine), counts[me], datatype],
                                                counts, mop), a, mine)
            op.issued(0)
            await op.wait(req)
            finish(mine, rop, w)
            comm = await op.stage(1)
            req = op.track(comm.Iallgatherv([_flat_bytes(mine), counts[me], datatype],
                                            [flat, counts, offsets(counts), datatype]), a, mine)
            op.issued(1)
            await op.wait(req)
            return a

        return await self._collective(("all_reduce", *_sig_array(a), rop.value), body,
                                      payload=a.nbytes)

    async def reduce_scatter(self, array: np.ndarray, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
        """Reduce ``array`` over all ranks and return this rank's block of the result.

        Blocks are split along axis 0 as ``numpy.array_split(array, world_size)`` splits them.
        ``array`` is not modified.
        """
        a = _check_array(array)
        check_axis(a, "reduce_scatter")
        rop = check_op(op, a.dtype)
        w, me = self.world_size, self._rank
        rows, counts = scatter_blocks(a, w)
        out = np.empty((rows[me], *a.shape[1:]), a.dtype)
        if w == 1:
            self._check_open("reduce_scatter")
            out[...] = a
            return out
        datatype, mop, _ = self._world.reduction(a.dtype, rop)

        async def body(op: _Op, meta: np.ndarray | None) -> np.ndarray:
            comm = await op.stage(0)
            req = op.track(comm.Ireduce_scatter([_flat_bytes(a), a.size, datatype],
                                                [_flat_bytes(out), out.size, datatype],
                                                counts, mop), a, out)
            op.issued(0)
            await op.wait(req)
            finish(out, rop, w)
            return out

        return await self._collective(("reduce_scatter", *_sig_array(a), rop.value), body,
                                      payload=a.nbytes)

    async def all_gather(self, array: np.ndarray, *, out: np.ndarray | None = None
                         ) -> np.ndarray:
        """Every rank's ``array`` concatenated along axis 0, in rank order.

        Axis-0 lengths may differ between ranks; dtypes and the other axes must agree.

        Args:
            out: optional destination: same dtype as ``array``, C-contiguous, shape
                ``(total rows, *array.shape[1:])``; returned when given.

        Raises:
            CollectiveError: also when ``out`` does not hold exactly the gathered rows.
        """
        a = _check_array(array)
        check_axis(a, "all_gather")
        if out is not None:
            check_gather_out(a, _check_array(out, "out", writable=True))
        if self.world_size == 1:
            self._check_open("all_gather")
            return gather_alone(a, out)
        dtype, shape = _sig_array(a)
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        datatype = self._move_type(a.dtype)

        async def body(op: _Op, meta: np.ndarray | None) -> np.ndarray:
            assert meta is not None
            rows = [int(n) for n in meta[:, 1]]
            total = sum(rows)
            dest = out if out is not None and out.shape[0] == total else np.empty(
                (total, *a.shape[1:]), a.dtype)
            counts = [n * row for n in rows]
            comm = await op.stage(0)
            req = op.track(comm.Iallgatherv([_flat_bytes(a), a.size, datatype],
                                            [_flat_bytes(dest), counts, offsets(counts),
                                             datatype]), a, dest)
            op.issued(0)
            await op.wait(req)
            if out is not None and dest is not out:
                raise gather_mismatch(total, out)
            return dest

        return await self._collective(("all_gather", dtype, shape[1:]), body, meta=True,
                                      extra=a.shape[0], payload=a.nbytes)

    async def gather(self, array: np.ndarray, root: int = 0) -> list[np.ndarray] | None:
        """On root, the list of every rank's ``array`` in rank order; ``None`` elsewhere."""
        a = _check_array(array)
        root = self._check_rank(root, "root")
        if self.world_size == 1:
            self._check_open("gather")
            return [a.copy()]
        me, w = self._rank, self.world_size

        async def body(op: _Op, meta: np.ndarray | None) -> list[np.ndarray] | None:
            every = np.empty((w, *a.shape), a.dtype) if me == root else None
            comm = await op.stage(0)
            # a gather's receive spec counts one rank's block
            recv = ([_flat_bytes(every), a.size, self._move_type(a.dtype)]
                    if every is not None else None)
            req = op.track(comm.Igather(self._move(a), recv, root), a, every)
            op.issued(0)
            await op.wait(req)
            if every is None:
                return None
            return [np.array(every[j]) for j in range(w)]  # separate arrays, as the API promises

        return await self._collective(("gather", *_sig_array(a), root), body,
                                      payload=0 if self._rank == root else a.nbytes)

    async def scatter(self, arrays: Sequence[np.ndarray] | None, root: int = 0) -> np.ndarray:
        """The array that root put at this rank's position of ``arrays`` (a new array).

        ``arrays`` (``world_size`` arrays, each any shape) is read on root only.
        """
        root = self._check_rank(root, "root")
        me, w = self._rank, self.world_size
        items: list[np.ndarray] = []
        if me == root:
            items = check_arrays(arrays, w, "scatter on root", _check_item)
        if w == 1:
            self._check_open("scatter")
            return items[0].copy()
        mpi = self._mpi

        async def body(op: _Op, meta: np.ndarray | None) -> np.ndarray:
            head = np.empty(_HEAD_WORDS, np.int64)
            heads = np.stack([_header(x) for x in items]) if me == root else None
            comm = await op.stage(0)
            send = [heads, mpi.INT64_T] if heads is not None else None
            req = op.track(comm.Iscatter(send, [head, mpi.INT64_T], root), heads, head)
            op.issued(0)
            await op.wait(req)
            dtype, shape = _from_header(head)
            got = np.empty(shape, dtype)
            if me == root:
                sizes = [0 if j == root else x.nbytes for j, x in enumerate(items)]
                payload = np.concatenate([_flat_bytes(x) for j, x in enumerate(items)
                                          if j != root]) if any(sizes) else np.empty(0, np.uint8)
                send = [payload, sizes, offsets(sizes), mpi.BYTE]
                recv: Any = [np.empty(0, np.uint8), 0, mpi.BYTE]
            else:
                payload, send, recv = None, None, [_flat_bytes(got), got.nbytes, mpi.BYTE]
            comm = await op.stage(1)
            req = op.track(comm.Iscatterv(send, recv, root), payload, got)
            op.issued(1)
            await op.wait(req)
            return items[root].copy() if me == root else got

        return await self._collective(("scatter", root), body, payload=sum(
            x.nbytes for j, x in enumerate(items) if j != me))

    async def all_to_all(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Element ``j`` of the result is what rank ``j`` put at position ``rank`` of its
        ``arrays``."""
        w, me = self.world_size, self._rank
        items = check_arrays(arrays, w, "all_to_all", _check_item)
        if w == 1:
            self._check_open("all_to_all")
            return [items[0].copy()]
        mpi = self._mpi

        async def body(op: _Op, meta: np.ndarray | None) -> list[np.ndarray]:
            heads = np.stack([_header(x) for x in items])
            theirs = np.empty_like(heads)
            comm = await op.stage(0)
            req = op.track(comm.Ialltoall([heads, mpi.INT64_T], [theirs, mpi.INT64_T]),
                           heads, theirs)
            op.issued(0)
            await op.wait(req)
            specs = [_from_header(h) for h in theirs]
            out = [np.empty(shape, dtype) for dtype, shape in specs]
            out[me] = items[me].copy()
            send_sizes = [0 if j == me else x.nbytes for j, x in enumerate(items)]
            recv_sizes = [0 if j == me else x.nbytes for j, x in enumerate(out)]
            payload = (np.concatenate([_flat_bytes(x) for j, x in enumerate(items) if j != me])
                       if any(send_sizes) else np.empty(0, np.uint8))
            landing = np.empty(sum(recv_sizes), np.uint8)
            comm = await op.stage(1)
            req = op.track(comm.Ialltoallv([payload, send_sizes, offsets(send_sizes), mpi.BYTE],
                                           [landing, recv_sizes, offsets(recv_sizes), mpi.BYTE]),
                           payload, landing)
            op.issued(1)
            await op.wait(req)
            for j, pos in enumerate(offsets(recv_sizes)):
                if j != me:
                    _flat_bytes(out[j])[...] = landing[pos:pos + recv_sizes[j]]
            return out

        return await self._collective(("all_to_all",), body, payload=sum(
            x.nbytes for j, x in enumerate(items) if j != me))

    async def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""
        if self.world_size == 1:
            self._check_open("barrier")
            return

        async def body(op: _Op, meta: np.ndarray | None) -> None:
            comm = await op.stage(0)
            req = op.track(comm.Ibarrier())
            op.issued(0)
            await op.wait(req)

        await self._collective(("barrier",), body)

    # -- point to point ------------------------------------------------------------------

    async def send(self, array: np.ndarray, dst: int, tag: int = 0) -> None:
        """Send ``array`` to group rank ``dst``; returns at once (``array`` may be reused:
        the message goes out from a private copy).

        Messages with the same (dst, tag) arrive in the order they were sent.
        """
        a = _check_array(array)
        dst = self._check_rank(dst, "dst")
        tag = self._check_tag(tag)
        if dst == self._rank:
            raise ValueError("send to self is not supported")
        self._check_open("send")
        gone = self._world.closed_peer(self._cid, self._ranks[dst])
        if gone is not None:  # (as on tcp: the send fails, nothing else breaks)
            raise gone
        mpi = self._mpi
        head = bytearray(msgpack.packb([tag, dtype_code(a.dtype), list(a.shape)]))
        data = a.copy()
        try:
            reqs = [self._p2p.Isend([head, mpi.BYTE], dst, _HEAD_TAG),
                    self._p2p.Isend([_flat_bytes(data), data.nbytes, mpi.BYTE], dst, _DATA_TAG)]
        except mpi.Exception as exc:
            err = CollectiveError(f"send to group rank {dst} failed in MPI: {exc}")
            self._world.abort(err)
            raise err from exc
        self._world.bytes_sent += data.nbytes
        self._p2p_sent[dst] = self._p2p_sent.get(dst, 0) + 1
        self._world.add_send(reqs, (SendTo(self._ranks[dst]), head, data))

    def _pump(self) -> None:
        """Read every header that arrived and post the receive of its payload (in arrival
        order, so payloads match their headers); hand each message to its waiter or keep it."""
        mpi = self._mpi
        status = self._p2p_status
        while (msg := self._p2p.Improbe(mpi.ANY_SOURCE, _HEAD_TAG, status)) is not None:
            src = status.Get_source()
            self._p2p_got[src] = self._p2p_got.get(src, 0) + 1
            raw = bytearray(status.Get_count(mpi.BYTE))
            msg.Recv([raw, mpi.BYTE])
            tag, code, shape = msgpack.unpackb(bytes(raw), raw=False)
            arr = np.empty(tuple(shape), np.dtype(code))
            req = self._p2p.Irecv([_flat_bytes(arr), arr.nbytes, mpi.BYTE], src, _DATA_TAG)
            key = (src, int(tag))
            waiting = self._p2p_waiting.get(key)
            while waiting:
                fut = waiting.popleft()
                if not fut.done():
                    fut.set_result((arr, req))
                    break
            else:
                self._p2p_early.setdefault(key, deque()).append((arr, req))
            if waiting is not None and not waiting:  # (a tag used once leaves nothing behind)
                del self._p2p_waiting[key]

    async def recv(self, src: int, tag: int = 0) -> np.ndarray:
        """Receive the next array group rank ``src`` sent with ``tag`` (a new array)."""
        src = self._check_rank(src, "src")
        tag = self._check_tag(tag)
        if src == self._rank:
            raise ValueError("recv from self is not supported")
        self._check_open("recv")
        mpi = self._mpi
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        key = (src, tag)
        fut: asyncio.Future[Any] = loop.create_future()
        early = self._p2p_early.get(key)
        if early:
            fut.set_result(early.popleft())
            if not early:
                del self._p2p_early[key]
        else:
            self._p2p_waiting.setdefault(key, deque()).append(fut)
        item: tuple[np.ndarray, Any] | None = None
        self._begin()

        def arrived() -> bool:
            if not fut.done():
                self._pump()
            return fut.done()

        def timed_out() -> CollectiveTimeout:
            return CollectiveTimeout(f"recv from group rank {src} (tag {tag}) got nothing "
                                     f"within {self.timeout:g} s")

        def check() -> None:
            self._world.check()
            if self._closed:  # (this group, closed under it: as on tcp, only this recv fails)
                raise closed_group(CommunicatorClosedError("the communicator was closed"))
            if item is None:
                # src closed its world or this group having sent no more than what arrived
                err = self._world.closed_peer(self._cid, self._ranks[src],
                                              self._p2p_got.get(src, 0))
                if err is not None:
                    raise err

        try:
            deadline = await _poll(arrived, deadline, self._world, self.timeout, timed_out,
                                   SPIN_SECONDS, check)
            item = fut.result()
            arr, req = item
            await _poll(lambda: bool(req.Test()), deadline, self._world, self.timeout,
                        timed_out, WAIT_SPIN_SECONDS, check)
            return arr
        except asyncio.CancelledError:
            self._recv_failed(fut, item, CollectiveError(f"recv on group rank {self._rank} was "
                                                         f"cancelled"))
            raise
        except CollectiveError as exc:
            self._recv_failed(fut, item, exc)
            raise
        except mpi.Exception as exc:
            err = CollectiveError(f"recv from group rank {src} failed in MPI: {exc}")
            self._recv_failed(fut, item, err)
            raise err from exc
        finally:
            self._end()

    def _recv_failed(self, fut: asyncio.Future[Any], item: tuple[np.ndarray, Any] | None,
                     err: CollectiveError) -> None:
        if item is None and fut.done() and not fut.cancelled() and fut.exception() is None:
            item = fut.result()  # handed over just as the wait was cancelled: keep it alive
        fut.cancel()
        if item is not None:
            self._world.abandon([item[1]], (item[0],))
        if closed_scope(err) is None:  # (a peer that closed: as on tcp, only this recv fails)
            self._world.abort(err)

    # -- objects -------------------------------------------------------------------------

    async def broadcast_object(self, obj: Any = None, root: int = 0) -> Any:
        """Root's ``obj`` on every rank (msgpack-serialisable; tuples come back as lists).

        Raises:
            TypeError: root's ``obj`` does not pack (a set, a NumPy array or integer), or packs
                but does not unpack (a dict with tuple keys): on every rank, once the call
                has moved it, and the communicator stays usable.
        """
        root = self._check_rank(root, "root")
        data = _pack_object(obj, root) if self._rank == root else None
        if self.world_size == 1:
            self._check_open("broadcast_object")
            return _unpack_object(data, root)  # type: ignore[arg-type]
        mpi = self._mpi

        async def body(op: _Op, meta: np.ndarray | None) -> np.ndarray:
            assert meta is not None
            buf = data if data is not None else np.empty(int(meta[root, 1]), np.uint8)
            comm = await op.stage(0)
            req = op.track(comm.Ibcast([buf, buf.size, mpi.BYTE], root), buf)
            op.issued(0)
            await op.wait(req)
            return buf

        # unpacked after the collective: an object that does not pack, or packs but does not
        # unpack, raises TypeError on every rank and leaves the communicator usable
        return _unpack_object(await self._collective(
            ("broadcast_object", root), body, meta=True, extra=0 if data is None else data.size,
            payload=0 if data is None else data.size), root)

    async def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (msgpack-serialisable).

        Raises:
            TypeError: as ``broadcast_object`` (the communicator stays usable).
        """
        data = _pack_object(obj, self._rank)
        if self.world_size == 1:
            self._check_open("all_gather_object")
            return [_unpack_object(data, 0)]
        mpi = self._mpi

        async def body(op: _Op, meta: np.ndarray | None) -> list[np.ndarray]:
            assert meta is not None
            sizes = [int(n) for n in meta[:, 1]]
            every = np.empty(sum(sizes), np.uint8)
            displs = offsets(sizes)
            comm = await op.stage(0)
            req = op.track(comm.Iallgatherv([data, data.size, mpi.BYTE],
                                            [every, sizes, displs, mpi.BYTE]), data, every)
            op.issued(0)
            await op.wait(req)
            return [every[p:p + n] for p, n in zip(displs, sizes, strict=True)]

        # unpacked after the collective, as in broadcast_object
        got = await self._collective(("all_gather_object",), body, meta=True, extra=data.size,
                                     payload=data.size)
        return [_unpack_object(b, j) for j, b in enumerate(got)]

    # -- groups and lifetime -------------------------------------------------------------

    async def new_group(self, ranks: Sequence[int]) -> MpiCommunicator | None:
        """A communicator over ``ranks`` (renumbered 0..k-1 in the given order).

        Called by every rank of this group with the same ``ranks`` (checked: otherwise every
        rank raises ``CollectiveError``); returns ``None`` on ranks that are
        not members. Members create it with ``MPI_Comm_create_group``, which blocks this
        process until every member has called it (their event loops are past the signature
        check by then, so the wait is short).
        """
        members = [self._check_rank(r, "group member") for r in ranks]
        if not members:
            raise ValueError("new_group needs at least one rank")
        if len(set(members)) != len(members):
            raise ValueError(f"new_group ranks must be distinct, got {members}")
        me = self._rank
        mpi = self._mpi
        world_ranks = [self._ranks[m] for m in members]
        made_by = [self._tickets]  # (the ticket of this call: the group's id, everywhere)

        async def body(op: _Op, meta: np.ndarray | None) -> Any:
            made_by[0] = op.ticket
            if meta is not None and np.any(meta[:, 1] != meta[me, 1]):
                return _DIFFERENT_MEMBERS  # raised after the collective: nothing is broken
            comm = await op.stage(0)
            if me not in members:
                op.issued(0)
                return None
            group = comm.Get_group().Incl(members)
            try:
                sub = comm.Create_group(group, _GROUP_TAG)
            finally:
                group.Free()
            op.issued(0)
            return sub

        if self.world_size == 1:
            self._check_open("new_group")
            self._tickets += 1  # (for the group's id only: nobody else shares this one)
            sub = self._stage_comms[0].Dup()
        else:
            # the members travel beside the signature (as a digest), not in it: ranks that
            # pass different lists raise and keep the communicator, as on the other backends
            sub = await self._collective(("new_group",), body, check=True, meta=True,
                                         extra=digest(("new_group", tuple(members))))
        if sub is _DIFFERENT_MEMBERS:
            raise CollectiveError("new_group: ranks passed different member lists")
        if sub is None:
            return None
        comms = await _dup_comms(mpi, sub, 3, self.timeout, self._world.check)
        return MpiCommunicator(self._world, [sub, *comms], ranks=world_ranks,
                               timeout=self.timeout, tuning=self.tuning,
                               check_signatures=self.check_signatures,
                               cid=f"{self._cid}/{made_by[0]}")

    async def close(self) -> None:
        """Close the communicator (a world communicator also waits, at most ``timeout``, for
        its sends to be received). Idempotent.

        Closing the world communicator fails the calls in flight on it and its subgroups
        (``CommunicatorClosedError``; the other ranks' calls raise ``CollectiveError``);
        with none in flight, the other ranks are told, and their calls that need this rank
        from then on raise ``PeerLostError`` at once. A subgroup's calls in flight go on, and
        it frees its MPI communicators after them; the other members are told, and their
        calls of the group that this rank never started raise ``CollectiveError`` at once
        ("world rank 2 closed the group"), as do their receives from it beyond the messages
        it sent and their sends to it."""
        if self._closed:
            return
        self._closed = True
        if self._owns_world:
            await self._world.close(self.timeout)
        else:
            _forget(self._world, self._cid)
            if not self._world.closing:
                for r, dst in enumerate(self._ranks):
                    if r != self._rank:
                        self._world.tell_closed(dst, {"group": self._cid,
                                                      "tickets": self._tickets,
                                                      "p2p": self._p2p_sent.get(r, 0)})
        if not self._calls:
            self._free()

    def _free(self) -> None:
        self._keep_early()
        if (self._world.broken is None and not self._keep
                and self._stage_comms[0] != self._mpi.COMM_NULL):
            # (a broken world keeps everything: MPI may still write into its buffers)
            for comm in (*self._stage_comms, self._meta, self._p2p):
                _free(self._mpi, comm)

    # -- helpers -------------------------------------------------------------------------

    def _move_type(self, dtype: np.dtype[Any]) -> Any:
        return getattr(self._mpi, _MOVE_TYPES[dtype.itemsize])

    def _move(self, a: np.ndarray) -> list[Any]:
        """Buffer spec that moves ``a``'s bytes (element-sized units: counts stay small)."""
        return [_flat_bytes(a), a.size, self._move_type(a.dtype)]


def _forget(world: MpiWorld, cid: str) -> None:
    """The group ``cid`` was closed on this rank (or is the oldest of too many): what the
    world kept of it (its record, what other members said as they closed it) goes. A group
    dropped unclosed keeps its record, so that a notice of this rank's end describes it."""
    world.records.pop(cid, None)
    world.left.pop(cid, None)


def _keep_early(mpi: Any, early: dict[tuple[int, int], deque[tuple[np.ndarray, Any]]]
                ) -> None:
    """The payloads of messages nobody received: MPI may still be writing them."""
    keep_pending(mpi, [([req], (arr,)) for queue in early.values() for arr, req in queue],
                 settle=SETTLE_RECEIVES)
    early.clear()


def _check_item(x: Any, what: str) -> np.ndarray:
    """One array of a scatter or all-to-all (a header describes it: see ``_header``)."""
    return check_ndim(_check_array(x, what), what)


def _tested(req: Any) -> bool:
    return bool(req.Test())


async def _dup_comms(mpi: Any, comm: Any, n: int, timeout: float,
                     check: Callable[[], None]) -> list[Any]:
    """``n`` duplicates of ``comm`` (MPI_Comm_idup: collective, but never blocks the loop).

    One at a time: Open MPI 4.1 runs the context-id agreement rounds of idups in flight
    together on one communicator in whatever order each process progresses them, so where
    the processes hold different communicators (several rounds to agree: subgroups made over
    overlapping ranks) one process's idup now and then never completed. Each wait spins as
    a collective's does: an agreement takes a round trip per context id tried."""
    loop = asyncio.get_running_loop()
    made: list[Any] = []
    for _ in range(n):
        dup, req = comm.Idup()
        await poll(functools.partial(_tested, req), deadline=loop.time() + timeout,
                   check=check, spin=WAIT_SPIN_SECONDS, on_timeout=lambda: CollectiveTimeout(
                       f"MPI communicator creation made no progress within {timeout:g} s: "
                       f"did every process call it?"))
        made.append(dup)
    return made


async def mpi_init(*, rank: int | None = None, world_size: int | None = None,
                   timeout: float = 60.0, tuning: Tuning | None = None, comm: Any = None,
                   check_signatures: bool = True) -> MpiCommunicator:
    """Join the MPI world; see ``asynccoll.init`` (``backend="mpi"``).

    Args:
        rank, world_size: optional; when given they must match MPI's (a ValueError otherwise).
        timeout: per-collective timeout.
        tuning: accepted for API compatibility; MPI chooses its own algorithms.
        comm: the mpi4py intracommunicator to run over (default ``MPI.COMM_WORLD``); it is
            duplicated, never used directly.
        check_signatures: check, before each collective moves data, that every rank called
            the same thing (see the module docstring).

    Raises:
        TypeError: ``check_signatures`` is no bool (the string ``"no"`` was taken as true),
            ``comm`` is no mpi4py intracommunicator (it was an ``AttributeError``, or an MPI
            error for ``MPI.COMM_NULL``); with the checks of every backend's ``init``.
    """
    timeout = check_timeout(timeout)  # before anything is opened
    if not isinstance(check_signatures, bool):
        raise TypeError(f"check_signatures must be a bool, got {check_signatures!r}")
    # (compared with MPI's below: rank="0" was "rank=0 was given but MPI says this process is
    # rank 0", rank=True passed for rank 1)
    rank = None if rank is None else check_int(rank, "rank")
    world_size = None if world_size is None else check_int(world_size, "world_size")
    mpi = import_mpi()
    if comm is not None and not isinstance(comm, mpi.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (mpi4py.MPI.Intracomm, "
                        f"such as MPI.COMM_WORLD), got {comm!r}")
    base = mpi.COMM_WORLD if comm is None else comm
    got_rank, got_size = int(base.Get_rank()), int(base.Get_size())
    if rank is not None and rank != got_rank:
        raise ValueError(f"rank={rank} was given but MPI says this process is rank {got_rank}")
    if world_size is not None and world_size != got_size:
        raise ValueError(f"world_size={world_size} was given but the MPI world has {got_size} "
                         f"processes")

    def nothing() -> None:
        return None

    stage0, stage1, meta, p2p, ctrl = await _dup_comms(mpi, base, 5, timeout, nothing)
    world = MpiWorld(mpi, ctrl)
    return MpiCommunicator(world, [stage0, stage1, meta, p2p], ranks=range(got_size),
                           timeout=timeout, tuning=tuning, check_signatures=check_signatures,
                           owns_world=True)


__all__ = ["MpiCommunicator", "MpiWorld", "import_mpi", "mpi_init", "mpi_launched"]
