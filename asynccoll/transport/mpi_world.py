"""What the communicators of one ``"mpi"`` world share (see ``asynccoll.transport.mpi``).

``MpiWorld`` holds the world's control communicator (abort messages), the failure that
broke the world, the user-defined reduction ops, the sends still in flight and the requests of
failed operations; ``import_mpi`` imports mpi4py lazily, naming the extra to install. Also
the buffer and header helpers of the communicator.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import time
import weakref
from typing import Any

import msgpack
import numpy as np

from .._progress import poll
from ..errors import CollectiveError, CollectiveTimeout, CommunicatorClosedError, PeerLostError
from ..ops import ReduceOp, combine_ordered
from ..wire import MAX_NDIM, SUPPORTED_DTYPES, dtype_code

log = logging.getLogger("asynccoll.mpi")

_INSTALL_HINT = ('the "mpi" backend needs mpi4py and an MPI library (Open MPI or MPICH): '
                 'pip install "asynccoll[mpi]", then start the processes with mpirun/mpiexec')

#: tag of the messages on the world's ``ctrl`` communicator: aborts, and the notices of a
#: rank that closed its world communicator or a group (``MpiWorld.tell_closed``)
_ABORT_TAG = 3
#: MPI datatype names of the dtypes MPI reduces natively (bool is reduced as uint8)
_NATIVE_TYPES = {"|b1": "UINT8_T", "|i1": "INT8_T", "<i2": "INT16_T", "<i4": "INT32_T",
                 "<i8": "INT64_T", "|u1": "UINT8_T", "<u2": "UINT16_T", "<u4": "UINT32_T",
                 "<u8": "UINT64_T", "<f4": "FLOAT", "<f8": "DOUBLE",
                 "<c8": "C_FLOAT_COMPLEX", "<c16": "C_DOUBLE_COMPLEX"}
_NATIVE_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "SUM", ReduceOp.PROD: "PROD",
               ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX", ReduceOp.BAND: "BAND",
               ReduceOp.BOR: "BOR", ReduceOp.BXOR: "BXOR"}
#: bool as uint8 (0/1): SUM/MAX are "or", PROD/MIN are "and", exactly as NumPy computes them
_BOOL_OPS = {ReduceOp.SUM: "BOR", ReduceOp.MAX: "BOR", ReduceOp.BOR: "BOR",
             ReduceOp.PROD: "BAND", ReduceOp.MIN: "BAND", ReduceOp.BAND: "BAND",
             ReduceOp.BXOR: "BXOR"}


def import_mpi() -> Any:
    """``mpi4py.MPI`` (initialising MPI), or an ImportError naming the extra to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(f"{_INSTALL_HINT} ({exc})") from exc
    return MPI


def mpi_launched() -> bool:
    """Whether this process looks started by an MPI launcher (without importing mpi4py)."""
    import os

    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                         "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"))


# -------------------------------------------------------------------- buffers and headers

#: int64 words of an array header (dtype index, ndim, dims) in scatter / all_to_all
_HEAD_WORDS = 2 + MAX_NDIM
#: the dtypes a header can name, by index
_DTYPES = tuple(sorted(SUPPORTED_DTYPES))
#: MPI datatype names that move ``itemsize`` bytes per element (data movement only)
_MOVE_TYPES = {1: "UINT8_T", 2: "UINT16_T", 4: "UINT32_T", 8: "UINT64_T", 16: "C_DOUBLE_COMPLEX"}


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a writable-if-``a``-is uint8 view."""
    return a.reshape(-1).view(np.uint8)


def _header(a: np.ndarray) -> np.ndarray:
    """Fixed-size int64 description of ``a``'s dtype and shape (scatter, all_to_all)."""
    head = np.zeros(_HEAD_WORDS, np.int64)
    head[0] = _DTYPES.index(dtype_code(a.dtype))
    head[1] = a.ndim
    head[2:2 + a.ndim] = a.shape
    return head


def _from_header(head: np.ndarray) -> tuple[np.dtype[Any], tuple[int, ...]]:
    ndim = int(head[1])
    return np.dtype(_DTYPES[int(head[0])]), tuple(int(n) for n in head[2:2 + ndim])


# ----------------------------------------------------------------------------------- world

#: the requests (and buffers) of failed operations, of every world: never freed, not even as
#: the interpreter shuts down. mpi4py calls MPI_Finalize after Python has torn down its
#: objects, and MPI_Finalize still progresses pending requests: a buffer freed by then was
#: written into (a segfault at exit, or peers hanging in theirs on the data it garbled)
class _Kept(list[tuple[list[Any], tuple[Any, ...]]]):
    """A list (a subclass, so a weakref finalizer can be attached: see ``_settle_at_exit``)."""


_ABANDONED = _Kept()
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ABANDONED))


#: seconds ``keep_pending`` lets receives already under way finish (see there)
SETTLE_RECEIVES = 5.0
#: at exit, the abandoned requests get this long without any of them completing to finish
#: (and at most ``EXIT_SETTLE_LIMIT`` in all): see ``_settle_at_exit``
EXIT_SETTLE_STALL = 0.5
EXIT_SETTLE_LIMIT = 10.0


def _completed(mpi: Any, groups: list[list[Any]], *, limit: float,
               stall: float = math.inf) -> list[bool]:
    """Test the request ``groups`` until all completed, ``limit`` seconds passed or none
    completed for ``stall`` seconds (each at least once); which of them completed (none that
    were pending when MPI itself failed or was finalized)."""
    done = [False] * len(groups)
    start = last = time.monotonic()
    try:
        while True:
            for i, reqs in enumerate(groups):
                if not done[i] and mpi.Request.Testall(reqs):
                    done[i], last = True, time.monotonic()
            now = time.monotonic()
            if all(done) or now - start >= limit or now - last >= stall:
                return done
            time.sleep(0.0005)
    except Exception as exc:  # MPI finalized or failed: what is not done stays pending
        log.debug("testing pending MPI requests failed: %s", exc)
        return done


def _settle_at_exit() -> None:
    """Let the abandoned requests that can still complete do so before ``MPI_Finalize``.

    A failed collective's data may still be moving when the processes end (the other ranks
    posted it too). Open MPI 4.1 progresses it inside ``MPI_Finalize``, after its exit
    fence: a peer that already passed the fence closes its connections, the writev fails
    ("Broken pipe") and the tcp BTL deadlocks on its own endpoint lock (the job hung at exit
    in about one run in fifty of ``tests/helpers/mpi_exit_after_failure.py``). Progressing
    them here, while every rank still does, ends that traffic first. Requests that cannot
    complete (a collective another rank never entered, a send nobody receives) are given up
    once none completed for ``EXIT_SETTLE_STALL`` seconds: they move no bulk data."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not _ABANDONED or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    done = _completed(mpi, [reqs for reqs, _ in _ABANDONED], limit=EXIT_SETTLE_LIMIT,
                      stall=EXIT_SETTLE_STALL)
    if not all(done):
        log.debug("%d abandoned request group(s) still pending at exit", done.count(False))


# the list is never freed, so this runs only as the interpreter ends: as a weakref finalizer
# created at import it runs after the finalizers of every world (created later), which move
# what they leave behind into the list
weakref.finalize(_ABANDONED, _settle_at_exit)


def keep_pending(mpi: Any, items: list[tuple[list[Any], tuple[Any, ...]]], *,
                 settle: float = 0.0) -> None:
    """Move the ``(requests, buffers)`` of ``items`` that MPI has not completed to the list
    that is never freed, and empty ``items``: what their owner leaves behind as it is closed,
    dropped or the interpreter ends (a message nobody received, a send nobody took).

    ``settle``: first wait up to this long for them to complete (receives whose message was
    matched: their sender is sending, so they end). A process that ended while such a
    receive was still reading left its sender's MPI_Finalize hanging on the closed
    connection ("writev failed: Broken pipe"), about one run in twelve."""
    done = _completed(mpi, [reqs for reqs, _ in items], limit=settle)
    _ABANDONED.extend(item for item, ok in zip(items, done, strict=True) if not ok)
    items.clear()


class SendTo:
    """The world rank a send in flight goes to (``MpiWorld.add_send``)."""

    __slots__ = ("dst",)

    def __init__(self, dst: int) -> None:
        self.dst = dst


class MpiWorld:
    """What a world communicator and its subgroups share.

    The ``ctrl`` communicator (abort messages), the failure that broke the world, the user
    defined reduction ops (created lazily, one per dtype and op), sends still in flight, and
    the requests of collectives that failed: MPI may still write into their buffers, so they
    are kept alive here rather than garbage collected.

    Attributes:
        peer_loss: always ``"abort"``: a failure anywhere breaks the whole world.
        broken: the error that broke the world, or ``None``.
        bytes_sent: payload bytes this rank handed to MPI (its contribution to each
            collective, and its sends); the traffic of MPI's own algorithms is not visible.
    """

    peer_loss = "abort"

    def __init__(self, mpi: Any, ctrl: Any) -> None:
        self.mpi = mpi
        self.ctrl = ctrl
        self.rank = int(ctrl.Get_rank())
        self.world_size = int(ctrl.Get_size())
        self.broken: CollectiveError | None = None
        self.bytes_sent = 0
        self._ops: dict[tuple[str, ReduceOp], Any] = {}
        self._sends: list[tuple[list[Any], tuple[Any, ...]]] = []
        # sends still going out when the world is dropped unclosed (or the interpreter ends)
        weakref.finalize(self, keep_pending, mpi, self._sends)
        self._abandoned = _ABANDONED

        self._status = mpi.Status()
        self._closed = False
        #: collectives and receives in progress on the world and its subgroups
        self.calls = 0
        #: loop time at which a wait of the world last completed (timeouts count from it)
        self.progressed = 0.0
        #: the world communicator was closed (``close`` started): every call fails
        self.closing = False
        #: what a notice that this rank closed the world (or ended without closing it) says
        #: of each of its communicators not closed: ``cid -> (world ranks, [collectives
        #: started], {group rank: messages sent})``, kept by the communicators
        self.records: dict[str, tuple[tuple[int, ...], list[int], dict[int, int]]] = {}
        #: what the notice sent as this world is dropped unclosed (the process ends) needs
        self._bye = _Bye(mpi, ctrl, self.rank, self.world_size, self.records)
        weakref.finalize(self, _bye_at_exit, self._bye)
        #: world ranks that closed their world communicator with nothing in flight, with
        #: what they had done: ``{cid: tickets}`` (collectives started) and ``{cid: sends to
        #: this rank}`` of each of their communicators this rank shares, and the error that
        #: calls needing them raise
        self.gone: dict[int, tuple[dict[str, int], dict[str, int], PeerLostError]] = {}
        #: groups a member closed: ``{cid: {world rank: (tickets, sends to this rank, error)}}``
        self.left: dict[str, dict[int, tuple[int, int, CollectiveError]]] = {}

    # -- failures ------------------------------------------------------------------------

    def check(self) -> None:
        """Raise if the world was closed (``CommunicatorClosedError``) or is broken, here or
        (per a ctrl message) on another rank."""
        if self.closing:
            raise CommunicatorClosedError("the communicator was closed")
        if self.broken is None and not self._closed:
            self._read_ctrl()
        if self.broken is not None:
            text = f"the communicator is broken: {self.broken}"
            if isinstance(self.broken, PeerLostError):  # (keeps its class and rank)
                raise PeerLostError(text, rank=self.broken.rank)
            raise CollectiveError(text)

    def _read_ctrl(self) -> None:
        """Read the ctrl messages that arrived: notices of closing (kept), until an abort
        (breaks the world)."""
        mpi = self.mpi
        while self.broken is None:
            lost = None
            try:
                if not self.ctrl.Iprobe(mpi.ANY_SOURCE, _ABORT_TAG, self._status):
                    return
                src = self._status.Get_source()
                buf = bytearray(self._status.Get_count(mpi.BYTE))
                self.ctrl.Recv([buf, mpi.BYTE], src, _ABORT_TAG)
                msg = msgpack.unpackb(bytes(buf), raw=False, strict_map_key=False)
                if isinstance(msg, dict) and "abort" not in msg:
                    self._closed_notice(src, msg)
                    continue
                text = str(msg["abort"] if isinstance(msg, dict) else msg)
                if isinstance(msg, dict) and type(msg.get("lost")) is int:
                    lost = msg["lost"]
            except (mpi.Exception, ValueError, TypeError, KeyError) as exc:
                # the ctrl channel itself failed, or a message it cannot read
                text, src = f"MPI error on the abort channel: {exc}", -1
            error = f"world rank {src} failed: {text}"
            self.broken = (CollectiveError(error) if lost is None
                           else PeerLostError(error, rank=lost))
            self._bye.done = True

    def _closed_notice(self, src: int, msg: dict[str, Any]) -> None:
        """World rank ``src`` closed its world communicator (``tickets``) or a group
        (``group``), having started ``tickets`` collectives and sent ``p2p`` messages to
        this rank in each (see ``tell_closed``)."""
        tickets, p2p = msg.get("tickets", {}), msg.get("p2p", {})
        if "group" in msg:
            cid = str(msg["group"])
            if cid not in self.records:  # (closed or dropped here too: nothing to fail)
                return
            self.left.setdefault(cid, {})[src] = (
                int(tickets), int(p2p), CollectiveError(f"world rank {src} closed the group"))
        else:
            how = ("ended without closing its communicator" if msg.get("ended")
                   else "has closed its communicator")
            self.gone[src] = ({str(k): int(v) for k, v in tickets.items()},
                              {str(k): int(v) for k, v in p2p.items()},
                              PeerLostError(f"world rank {src} {how}", rank=src))

    def closed_error(self, cid: str, ticket: int) -> CollectiveError | None:
        """The error of collective ``ticket`` of the communicator ``cid`` when a member
        closed its world (``PeerLostError``) or that group before starting it; else
        ``None``. (A notice names only the communicators its sender shares with this rank.)"""
        if not self.gone and not self.left:
            return None
        for first, _, err in self.left.get(cid, {}).values():
            if ticket >= first:
                return _fresh(err)
        for tickets, _, err in self.gone.values():
            if ticket >= tickets.get(cid, ticket + 1):
                return _fresh(err)
        return None

    def closed_peer(self, cid: str, peer: int, got: int | None = None
                    ) -> CollectiveError | None:
        """The error of a send to world rank ``peer`` in the communicator ``cid`` (``got``
        ``None``), or of a receive from it that has had ``got`` of its messages, when that
        rank closed its world or that group and sent no more; else ``None``."""
        gone = self.gone.get(peer)
        if gone is not None and cid in gone[0] and (got is None or got >= gone[1].get(cid, 0)):
            return _fresh(gone[2])
        left = self.left.get(cid, {}).get(peer)
        if left is not None and (got is None or got >= left[1]):
            return _fresh(left[2])
        return None

    def tell_closed(self, dst: int, notice: dict[str, Any]) -> None:
        """Tell world rank ``dst`` that this rank closed its world communicator or a group
        (best effort; ``close`` waits for the message to go out, as for sends)."""
        if self.broken is not None or self._closed:
            return
        mpi = self.mpi
        data = bytearray(msgpack.packb(notice, use_bin_type=True))
        try:
            self.add_send([self.ctrl.Isend([data, mpi.BYTE], dst, _ABORT_TAG)],
                          (SendTo(dst), data))
        except mpi.Exception as exc:
            log.debug("could not tell world rank %d about a close: %s", dst, exc)

    def abort(self, err: CollectiveError, *, notify: bool = True) -> None:
        """Break the world with ``err``; tell every other rank (once)."""
        if self.broken is not None:
            return
        self.broken = err
        self._bye.done = True
        log.debug("mpi world rank %d breaks: %s", self.rank, err)
        if not notify or self._closed:
            return
        mpi = self.mpi
        lost = err.rank if isinstance(err, PeerLostError) else None
        data = bytearray(msgpack.packb({"abort": str(err)[:2000], "lost": lost},
                                       use_bin_type=True))
        reqs = []
        for dst in range(self.world_size):
            if dst != self.rank:
                try:
                    reqs.append(self.ctrl.Isend([data, mpi.BYTE], dst, _ABORT_TAG))
                except mpi.Exception as exc:
                    log.warning("could not tell world rank %d about a failure: %s", dst, exc)
        self._abandoned.append((reqs, (data,)))

    def abandon(self, reqs: list[Any], keep: tuple[Any, ...]) -> None:
        """Requests of a failed operation: never freed, so MPI never writes into freed memory."""
        if reqs or keep:
            self._abandoned.append((list(reqs), keep))

    # -- sends that outlive their call ---------------------------------------------------

    def add_send(self, reqs: list[Any], keep: tuple[Any, ...]) -> None:
        """A send still going out: ``keep`` (kept alive until it completed) starts with its
        destination, a ``SendTo``, where it has one."""
        self.reap()
        self._sends.append((reqs, keep))

    def _to_gone(self, send: tuple[list[Any], tuple[Any, ...]]) -> bool:
        """Whether ``send`` (of ``add_send``) goes to a rank that closed or ended."""
        keep = send[1]
        return bool(keep) and isinstance(keep[0], SendTo) and keep[0].dst in self.gone

    def reap(self) -> None:
        """Forget the sends that completed."""
        if self._sends:
            test = self.mpi.Request.Testall
            self._sends[:] = [s for s in self._sends if not test(s[0])]

    # -- reductions ----------------------------------------------------------------------

    def reduction(self, dtype: np.dtype[Any], op: ReduceOp) -> tuple[Any, Any, bool]:
        """``(datatype, mpi_op, exact)`` to reduce ``dtype`` with ``op``.

        ``exact``: the result does not depend on the order MPI combines in (integers, bool),
        so ``MPI_Allreduce`` is bit-identical on every rank whatever its algorithm.
        MPI has no float16 and no complex MIN/MAX, its float MIN/MAX do not propagate NaN as
        NumPy does, and Open MPI 4.1 saturates 8/16-bit integer sums: those use user-defined
        ops that call NumPy.
        """
        mpi = self.mpi
        code = dtype_code(dtype)
        kind = dtype.kind
        if kind == "b":
            return mpi.UINT8_T, getattr(mpi, _BOOL_OPS[op]), True
        if kind in "iu":
            if op is ReduceOp.SUM and dtype.itemsize <= 2:
                # Open MPI 4.1's AVX kernels saturate 8- and 16-bit sums instead of wrapping
                return getattr(mpi, _NATIVE_TYPES[code]), self._user_op(code, op), True
            return getattr(mpi, _NATIVE_TYPES[code]), getattr(mpi, _NATIVE_OPS[op]), True
        if code != "<f2" and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD):
            return getattr(mpi, _NATIVE_TYPES[code]), getattr(mpi, _NATIVE_OPS[op]), False
        carrier = mpi.UINT16_T if code == "<f2" else getattr(mpi, _NATIVE_TYPES[code])
        return carrier, self._user_op(code, op), False

    def _user_op(self, code: str, op: ReduceOp) -> Any:
        got = self._ops.get((code, op))
        if got is None:
            dt = np.dtype(code)

            def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                dst = np.frombuffer(inoutbuf, dt)
                combine_ordered(dst, np.frombuffer(inbuf, dt), dst, op)

            got = self._ops[(code, op)] = self.mpi.Op.Create(apply, commute=True)
        return got

    # -- lifetime ------------------------------------------------------------------------

    async def close(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for sends in flight, then free what MPI lets us free.

        Calls in flight (on the world or a subgroup) fail with ``CommunicatorClosedError``
        at their next test, and the other ranks are told: those calls can never complete."""
        if self.closing:
            return
        self.closing = True
        if self.calls:
            self.abort(CommunicatorClosedError(f"the communicator was closed while "
                                               f"{self.calls} call(s) were in flight"))
        else:
            for dst, notice in self._bye.notices():
                self.tell_closed(dst, notice)
        self._bye.done = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def sent() -> bool:
            self.reap()
            if self._sends and self.broken is None:
                self._read_ctrl()  # (which ranks closed or ended since)
            # a send to a rank that closed or ended is never going to be received
            return self.broken is not None or all(self._to_gone(s) for s in self._sends)

        def nothing() -> None:
            return None

        try:
            if self.broken is not None:  # nobody is going to receive them
                raise CollectiveTimeout("the world is broken")
            await poll(sent, deadline=deadline, check=nothing,
                       on_timeout=lambda: CollectiveTimeout("sends still in flight at close"))
        except CollectiveTimeout:
            waited = [s for s in self._sends if not self._to_gone(s)]
            if waited and self.broken is None:
                log.warning("closing with %d send(s) no rank received", len(waited))
        self._abandoned.extend(self._sends)
        self._sends.clear()
        self._closed = True
        if self.broken is None:
            for mop in self._ops.values():
                mop.Free()
            self._ops.clear()
        # ``ctrl`` is never freed: a peer that failed may send its abort message to this rank
        # at any time, also after this rank closed without reading it. Open MPI keeps a
        # message for a freed communicator and hands it to the next communicator given that
        # context id, where it takes the place of a real one: that communicator's
        # first calls never completed (a later world's new_group, CollectiveTimeout)




class _Bye:
    """What a rank tells the others as it closes its world with nothing in flight, or as
    the world is dropped unclosed (the process ends: an exception, ``sys.exit``): per
    other rank, the collectives it started on each communicator they share and the
    messages it sent that rank, so that their calls that need it from there on raise
    ``PeerLostError`` at once, as on tcp, instead of waiting for their timeout, while
    those it took part in finish. ``done``: closed or broken (nothing more to say)."""

    __slots__ = ("ctrl", "done", "mpi", "rank", "records", "size")

    def __init__(self, mpi: Any, ctrl: Any, rank: int, size: int,
                 records: dict[str, tuple[tuple[int, ...], list[int], dict[int, int]]]) -> None:
        self.mpi, self.ctrl, self.rank, self.size = mpi, ctrl, rank, size
        self.records = records
        self.done = False

    def notices(self, **extra: Any) -> list[tuple[int, dict[str, Any]]]:
        out = []
        for dst in range(self.size):
            if dst == self.rank:
                continue
            tickets, p2p = {}, {}
            for cid, (ranks, started, sent) in self.records.items():
                if dst in ranks:
                    tickets[cid] = started[0]
                    p2p[cid] = sent.get(ranks.index(dst), 0)
            out.append((dst, {"tickets": tickets, "p2p": p2p, **extra}))
        return out


def _bye_at_exit(bye: _Bye) -> None:
    """A world dropped without being closed (as the process ends, or garbage collected):
    tell the other ranks, unless it was closed or broke (see ``_Bye``). The messages are
    kept with the requests that are never freed, which the exit lets complete."""
    if bye.done:
        return
    bye.done = True
    mpi = bye.mpi
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return
        for dst, notice in bye.notices(ended=True):
            data = bytearray(msgpack.packb(notice, use_bin_type=True))
            _ABANDONED.append(([bye.ctrl.Isend([data, mpi.BYTE], dst, _ABORT_TAG)], (data,)))
    except Exception as exc:  # best effort: the other ranks then wait for their timeout
        log.debug("could not tell the other ranks that this world ended: %s", exc)


def _fresh(err: CollectiveError) -> CollectiveError:
    """A new error like ``err`` (one kept to be raised by every call it ends), marked as
    the error of a member that closed (``closed_scope``)."""
    if isinstance(err, PeerLostError):
        new = PeerLostError(str(err), rank=err.rank)
        new._asynccoll_closed = "world"  # type: ignore[attr-defined]
        return new
    return closed_group(CollectiveError(str(err)))


def closed_group(err: CollectiveError) -> CollectiveError:
    """``err``, marked as the error of a group that a member closed: it fails the call it
    ends, and breaks neither the world nor other groups (``closed_scope``)."""
    err._asynccoll_closed = "group"  # type: ignore[attr-defined]
    return err


def closed_scope(err: BaseException) -> str | None:
    """``"world"`` or ``"group"`` when ``err`` says a member closed its world communicator
    or the group (``MpiWorld.closed_error``, ``closed_peer``), else ``None``."""
    return getattr(err, "_asynccoll_closed", None)


def _free(mpi: Any, comm: Any) -> None:
    try:
        comm.Free()
    except mpi.Exception as exc:  # freeing is best effort: the communicator is unusable anyway
        log.debug("MPI_Comm_free failed: %s", exc)


__all__ = ["MpiWorld", "import_mpi", "keep_pending", "mpi_launched"]
