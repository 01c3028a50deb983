"""The transport interface: move frames between ranks, match them to the receives waiting for them.

A backend implements ``Transport`` in one file. It has to provide three things:

* ``send(dst, kind, header, payload)``: deliver one frame to world rank ``dst``. When it
  returns, the caller may reuse ``payload``.
* ``_notify_abort(frame)``: best-effort delivery of an ABORT frame to every other rank.
* ``close()``.

Receiving is shared code: the backend hands each incoming frame to ``Mailbox``, which
matches it to a posted receive by its key ``(src, kind, group, seq, step, tag)``. A backend that
can read payloads straight into memory (TCP) first asks ``Mailbox.claim`` for the buffer the
receiver posted, so array data lands where it belongs without a copy.

A backend whose senders live in the receiver's process (memory) may instead *lend* a payload:
the receiver gets the sender's memory itself, and the sender's ``post`` returns a future that
resolves once the receiver is done with it. A receive posted with ``borrow=True`` says the
receiver only reads the payload (to reduce it into its own data) and releases it explicitly
(``Transport.release``); backends that cannot lend ignore the flag and fill the posted
buffer as usual. ``Transport.lends`` tells algorithms which of the two they get.

A receive whose data is only combined into an array may also name that array
(``reduce``, a ``wire_stream.ReduceOnRead``): a backend that reads sockets itself
(``Transport.reduces_on_read``) then combines the payload into it as it reads, a
cache-sized piece at a time, instead of filling ``into`` first; the frame it delivers then
carries the ``ReduceOnRead`` as its payload. A frame that arrived before the receive was
posted fills ``into`` as usual, and the receiver combines it itself.

A backend may also offer ``Transport.pump``: read what one peer sent, right now, without
an event-loop turn. A receive that polls (``Transport.polls``) calls it between turns, so
a small frame that is already in the socket is parsed, matched and delivered in the waiting
coroutine itself: a turn of the event loop costs more than the read. Small collectives go
further with ``Transport.poll_payload``: nothing is posted at all, and a transport that reads
bytes itself may take a frame whose head is exactly the one predicted without decoding it.

The mailbox also checks collective signatures: every DATA frame carries the signature of the
collective that sent it (name, dtype, shape, op, algorithm ...). When it differs from the
signature of the collective this rank runs under the same ``(group, seq)`` the world is aborted
with a ``CollectiveError`` naming both, before any payload touches a user
buffer.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._aio import uncancelled
from ..errors import (
    CollectiveError,
    CommunicatorClosedError,
    PeerLostError,
)
from ..scratch import ScratchPool
from ..wire import Frame, FrameHeader, FrameKind, encode_head
from ..wire_stream import HeadCache, ReduceOnRead

log = logging.getLogger("asynccoll.transport")

#: looked up once: the hot path compares frame kinds per frame
_DATA = FrameKind.DATA
_P2P = FrameKind.P2P

#: groups closed by a member that a mailbox remembers at most (``Mailbox.close_group``):
#: beyond, the one that closed longest ago is forgotten (a frame of it that still comes is
#: then kept as an early frame, and a member that keeps using it waits for its timeout
#: instead of failing at once); a job that creates and closes groups for days holds no more
MAX_CLOSED_GROUPS = 1024

#: (src world rank, frame kind, group, seq, step, tag)
Key = tuple[int, int, int, int, int, int]
#: ``(fn, nbytes, frames)``: ``fn(lo, hi)`` computes bytes ``[lo, hi)`` of an ``nbytes``
#: payload, which each frame ``(dst, head, payload)`` then sends (Transport.compute_and_post)
Work = tuple[Callable[[int, int], None], int, Sequence[tuple[int, bytes, memoryview]]]
#: (group, seq) of the collective a failure happened in
Scope = tuple[int, int]


def frame_key(kind: int, header: FrameHeader) -> Key:
    return (header.src, int(kind), header.group, header.seq, header.step, header.tag)


@dataclass(slots=True)
class _Posted:
    future: asyncio.Future[Frame]
    into: memoryview | None
    sig: tuple[Any, ...] | None
    borrow: bool = False
    reduce: ReduceOnRead | None = None


@dataclass(slots=True)
class _Left:
    """A group some member closed (``Mailbox.close_group``): its collectives from sequence
    number ``first`` on fail with ``error``, and so do its point-to-point receives from a
    member that closed it once that member's messages to this rank were taken (``p2p``: per
    world rank of such a member, how many it sent, and the error naming it); all of them
    where ``p2p`` is ``None`` (this rank closed it)."""
    first: int
    p2p: dict[int, tuple[int, CollectiveError]] | None
    error: CollectiveError


def payload_too_large(nbytes: int, limit: int) -> str:
    """The error message for a payload of ``nbytes`` that one frame cannot carry."""
    return (f"an array of {nbytes} bytes is larger than one frame may carry (max_payload: "
            f"{limit} bytes): split it, or raise max_payload on every rank")


def describe_sig(sig: tuple[Any, ...] | None) -> str:
    """Human-readable form of a collective signature, for error messages."""
    if not sig:
        return "<nothing>"
    name, *rest = sig
    return f"{name}({', '.join(str(x) for x in rest)})"


def name_call(exc: CollectiveError, sig: tuple[Any, ...], rank: int, where: str,
              extra: str = "", *, own: bool = False) -> CollectiveError:
    """``exc``, which ended the collective ``sig`` on group rank ``rank`` (``where``: which
    call of which group, ``Communicator._where``), as an error of its class whose message
    starts with that call, that rank and that sequence number (``"all_reduce(<f4, (4,),
    sum, ring) on group rank 1 (sequence number 3 of the world): "``), with ``extra``
    added at its end. A failure relayed from another rank, a lost peer, a close, another
    call's error say nothing of this call, even when they name a call of the same signature
    (another rank's cancelled ``barrier()``). ``exc`` is kept as it is (``extra`` aside)
    where this rank made it about this very call, its message naming all three already: a
    timeout or a native library's mismatch (``_native``), or, with ``own``, the mismatch
    this rank's mailbox found in this call (``Mailbox.mismatch``). A ``PeerLostError``
    keeps its ``rank``."""
    described = describe_sig(sig)
    text = str(exc) + extra
    if not (own or _names_call(str(exc), described, rank, where)):
        text = f"{described} on group rank {rank} ({where}): {text}"
    elif not extra:
        return exc
    return _retold(exc, text)


def _retold(exc: CollectiveError, text: str) -> CollectiveError:
    """An error of ``exc``'s class with the message ``text`` (a ``PeerLostError`` keeps its
    ``rank``); ``exc`` itself for a class built from more than a message."""
    if isinstance(exc, PeerLostError):
        return PeerLostError(text, rank=exc.rank)
    try:
        return type(exc)(text)
    except Exception:  # pragma: no cover - a subclass that takes more than a message
        return exc


def _names_call(text: str, described: str, rank: int, where: str) -> bool:
    """Whether ``text`` is this rank's own error about the call ``described`` on group rank
    ``rank`` (``where``): it starts by naming that call on that rank (a relayed error starts
    with the rank that relayed it), and names the call's sequence number and group."""
    return where in text and (
        text.startswith(f"{described} on group rank {rank} ")
        or text.startswith(f"ranks called different collectives: group rank {rank} called "
                           f"{described}, "))


def refused(exc: CollectiveError, what: str) -> CollectiveError:
    """``exc``, the error of a broken world that refused to start the call ``what`` (its
    name: ``"all_reduce"``, ``"send"``), as an error of its class whose message starts with
    that name; ``exc`` itself for a closed communicator, or without ``what``. A
    ``PeerLostError`` keeps its ``rank``."""
    if not what or isinstance(exc, CommunicatorClosedError):
        return exc
    return _retold(exc, f"{what}: {exc}")


class Mailbox:
    """Posted receives and early frames of one rank, matched by key. Not thread-safe.

    ``on_mismatch`` is called with a ``CollectiveError`` and the ``(group, seq)`` it
    happened in when a DATA frame's signature differs from the local collective's; the
    transport then aborts the world.

    A failure has a *scope*: the collective ``(group, seq)`` it happened in, or ``None`` for
    the whole world (a lost peer). Collectives of that group with a smaller sequence number
    still run to the end (a rank that lags behind finishes the collectives every rank already
    finished); everything else fails at once.
    """

    def __init__(self, rank: int,
                 on_mismatch: Callable[[CollectiveError, Scope], None]) -> None:
        self.rank = rank
        self._posted: dict[Key, _Posted] = {}
        self._early: dict[Key, Frame] = {}
        self._active: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._early_sig: dict[tuple[int, int], tuple[int, tuple[Any, ...] | None]] = {}
        self._lost: dict[int, CollectiveError] = {}
        # per collective (group, seq): the world ranks whose frames its receives still waited
        # for when a failure cut them short (``awaited``: what its error can name)
        self._cut: dict[tuple[int, int], set[int]] = {}
        # early frames whose payload still belongs to the (in-process) sender: the future
        # tells the sender when the receiver has copied it
        self._lent: dict[Key, asyncio.Future[None]] = {}
        # lent payloads a borrowing receive holds (until Transport.release or a failure)
        self._borrowed: dict[Key, asyncio.Future[None]] = {}
        # early payloads a borrowing receive holds, to be reclaimed when it releases them
        self._kept: dict[Key, Any] = {}
        # futures handed out by ``guard``, per the collective (group, seq) they wait in
        self._guarded: dict[asyncio.Future[None], tuple[int, int]] = {}
        #: called with an early frame's payload once nothing refers to it any more (it was
        #: copied to the receive's buffer, or a borrowing receive released it): a transport
        #: that reads early payloads into pooled buffers takes them back (ScratchPool.reclaim)
        self.reclaim: Callable[[Any], object] | None = None
        self._error: CollectiveError | None = None
        self._scope: Scope | None = None
        #: groups closed by a member, this rank or another (``close_group``): the latest
        #: ``MAX_CLOSED_GROUPS``
        self._left: dict[int, _Left] = {}
        self._on_mismatch = on_mismatch
        #: the collective ``(group, seq)`` in which this mailbox found a mismatch, and its
        #: error (which names that call already: ``name_call``'s ``own``)
        self.mismatch: tuple[Scope, CollectiveError] | None = None
        # the event loop receives are posted in, looked up once (asyncio.get_running_loop
        # costs a getpid() system call per call on Python 3.11)
        self._loop: asyncio.AbstractEventLoop | None = None

    def _future(self) -> asyncio.Future[Any]:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.create_future()

    # -- the collective's side ------------------------------------------------------------

    def begin(self, group: int, seq: int, sig: tuple[Any, ...]) -> None:
        """Register the collective ``(group, seq)`` this rank now runs, and check early frames."""
        self._active[(group, seq)] = sig
        early = self._early_sig.pop((group, seq), None)
        if early is not None and early[1] != sig:
            self._mismatch(early[0], early[1], sig, (group, seq))

    def end(self, group: int, seq: int) -> None:
        self._active.pop((group, seq), None)
        if self._cut:
            self._cut.pop((group, seq), None)

    def take(self, key: Key, into: memoryview | None, borrow: bool = False) -> Frame | None:
        """The frame for ``key`` if it arrived already (copied into ``into`` when given).

        With ``borrow``, a lent payload of ``into``'s size is handed over as it is, to be
        released with ``release``.
        """
        # (an error kept and raised again: with_traceback(None), or each raise would add
        # its frames, and what they hold, to the frames of every earlier one)
        if self._error is not None and not self._key_allowed(key):
            raise self._error.with_traceback(None)
        frame = self._early.pop(key, None)
        if frame is None:
            lost = self._lost.get(key[0])
            if lost is not None:
                raise lost.with_traceback(None)
            if self._left:
                left = self.left(key)
                if left is not None:
                    raise left.with_traceback(None)
            return None
        lent = self._lent.pop(key, None)
        if lent is None:
            return self._hand_over(key, frame, into, borrow)
        if lent.done():  # cancelled: the sender gave up the collective, and took its memory back
            raise CollectiveError(f"world rank {key[0]} gave up the collective before its "
                                  f"frame was read")
        if borrow and _fits(frame, into):
            self._borrowed[key] = lent
            return frame
        filled = _fill(frame, into)
        if filled.payload is not into:  # not copied yet: take our own copy now
            own = np.empty(memoryview(frame.payload).nbytes, np.uint8)
            copy_bytes(own.data.cast("B"), memoryview(frame.payload))
            filled = Frame(frame.kind, frame.header, own)
        lent.set_result(None)
        return filled

    def lend(self, key: Key, frame: Frame) -> asyncio.Future[None]:
        """Keep an early frame whose payload is the sender's memory, without copying it.

        Only for senders in this process (the memory transport): the returned future
        resolves once the receiver copied the payload out (or the frame was dropped), and
        the sender must not touch the payload before.
        """
        fut: asyncio.Future[None] = self._future()
        if (self._error is not None and not self._key_allowed(key)) or (
                self._left and self.left(key) is not None):
            fut.set_result(None)
            return fut
        posted = self._posted.get(key)
        if posted is not None:  # a borrowing receive (see lends_to)
            del self._posted[key]
            if posted.future.done():
                fut.set_result(None)
            else:
                self._borrowed[key] = fut
                posted.future.set_result(frame)
            return fut
        self._early[key] = frame
        self._lent[key] = fut
        return fut

    def lends_to(self, key: Key, nbytes: int) -> bool:
        """Whether a borrowing receive of ``nbytes`` is posted for ``key`` (then ``lend``
        hands the sender's payload straight to it)."""
        posted = self._posted.get(key)
        return (posted is not None and posted.borrow
                and (posted.into is None or posted.into.nbytes == nbytes))

    def release(self, key: Key) -> None:
        """The receiver is done with the payload it borrowed for ``key`` (if any)."""
        kept = self._kept.pop(key, None)
        if kept is not None and self.reclaim is not None:
            self.reclaim(kept)
        fut = self._borrowed.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def waiting(self, key: Key) -> bool:
        """Whether a receive for ``key`` is posted."""
        return key in self._posted

    def untouched(self, key: Key) -> bool:
        """Whether nothing is known of ``key`` yet: no frame kept, no receive posted, no
        failure that concerns it (a transport may then read its frame itself, see
        ``Transport.take_direct``)."""
        return (self._error is None and key not in self._early and key not in self._posted
                and key[0] not in self._lost and not (self._left and key[2] in self._left))

    def post(self, key: Key, into: memoryview | None, sig: tuple[Any, ...] | None,
             borrow: bool = False, reduce: ReduceOnRead | None = None
             ) -> asyncio.Future[Frame]:
        if key in self._posted:
            raise RuntimeError(f"receive for {key} posted twice")  # our own invariant
        fut: asyncio.Future[Frame] = self._future()
        self._posted[key] = _Posted(fut, into, sig, borrow, reduce)
        return fut

    def awaited(self, group: int, seq: int) -> list[int]:
        """World ranks whose frames of collective ``(group, seq)`` posted receives wait for
        (or waited for, when a failure failed them)."""
        return sorted({k[0] for k in self._posted if k[1] == _DATA and k[2] == group
                       and k[3] == seq}.union(self._cut.get((group, seq), ())))

    def _cut_short(self, key: Key) -> None:
        """Note that a failure failed the posted receive of ``key`` (see ``awaited``)."""
        if key[1] == _DATA:
            self._cut.setdefault((key[2], key[3]), set()).add(key[0])

    def unpost(self, key: Key) -> None:
        self._posted.pop(key, None)

    # -- the transport's side -------------------------------------------------------------

    def check(self, kind: int, header: FrameHeader) -> bool:
        """Check an incoming frame's signature; ``False`` (and the world aborted) on mismatch."""
        if kind != _DATA:
            return True
        gs = (header.group, header.seq)
        mine = self._active.get(gs)
        if mine is None:
            self._early_sig.setdefault(gs, (header.src, header.sig))
            return True
        if header.sig != mine:
            self._mismatch(header.src, header.sig, mine, gs)
            return False
        return True

    def claim(self, key: Key, nbytes: int) -> memoryview | None:
        """The buffer posted for ``key`` if it exists and holds exactly ``nbytes``."""
        posted = self._posted.get(key)
        if posted is None or posted.into is None or posted.into.nbytes != nbytes:
            return None
        return posted.into

    def claim_reducing(self, key: Key, nbytes: int) -> ReduceOnRead | None:
        """The ``ReduceOnRead`` posted for ``key`` if there is one of exactly ``nbytes``
        (a transport that reads payloads itself may combine them as it reads)."""
        posted = self._posted.get(key)
        if posted is None or posted.reduce is None or posted.reduce.nbytes != nbytes:
            return None
        return posted.reduce

    def deliver(self, key: Key, frame: Frame) -> None:
        """Hand a received frame to its receiver, or keep it until one is posted.

        The frame's payload must be memory the receiver may keep (not the sender's buffer).
        """
        if self._error is not None and not self._key_allowed(key):
            return
        if self._left and self.left(key) is not None:
            return  # (a frame of a closed group that nobody will take)
        posted = self._posted.pop(key, None)
        if frame.payload.__class__ is ReduceOnRead:
            # combined into the receive's array as it was read: the receive gets it as is
            # (nobody else may: without its receive, the data is gone into that array)
            if posted is not None and frame.payload is posted.reduce:
                if not posted.future.done():
                    posted.future.set_result(frame)
            elif posted is not None:  # pragma: no cover - claim_reducing matched the key
                self._posted[key] = posted
            return
        if posted is None:
            if key in self._early:
                log.warning("rank %d: duplicate frame %s dropped", self.rank, key)
                return
            self._early[key] = frame
            return
        if not posted.future.done():
            posted.future.set_result(self._hand_over(key, frame, posted.into, posted.borrow))

    def _hand_over(self, key: Key, frame: Frame, into: memoryview | None, borrow: bool
                   ) -> Frame:
        """What the receive of ``key`` gets of ``frame``, whose payload is this rank's own
        memory: for a borrowing receive (it only reads) the frame as it is, with no copy
        into ``into``; otherwise the payload copied into ``into`` (``_fill``). A payload
        that nothing refers to any more (copied out, or once the borrower releases it) goes
        to ``reclaim``."""
        if frame.payload is into:
            return frame
        if borrow and _fits(frame, into):
            if self.reclaim is not None:
                self._kept[key] = frame.payload
            return frame
        filled = _fill(frame, into)
        if filled is not frame and self.reclaim is not None:
            self.reclaim(frame.payload)
        return filled

    def peer_lost(self, src: int, exc: CollectiveError) -> None:
        """Fail receives from ``src`` now and later (frames that already arrived stay readable)."""
        self._lost.setdefault(src, exc)
        for key in [k for k in self._posted if k[0] == src]:
            posted = self._posted.pop(key)
            self._cut_short(key)
            _fail_future(posted.future, exc)

    def close_group(self, group: int, first: int, src: int | None, p2p: int,
                    exc: CollectiveError) -> None:
        """A member closed ``group``: world rank ``src``, after ``p2p`` point-to-point
        messages to this rank in that group, or this rank itself (``src`` ``None``). The
        group's collectives from sequence number ``first`` on fail with ``exc`` (that member
        takes no part in them), and so do the receives of that member's messages beyond the
        ones it sent (all of the group's on the rank that closed it): those posted now, and
        later ones; frames that can no longer be taken are dropped. Nothing else changes:
        the world and its other groups go on. A later notice of the group narrows it
        further (a smaller ``first``), never widens it."""
        left = self._left.pop(group, None)  # (back in as the latest: forgotten last)
        if left is None:
            left = _Left(first, {} if src is not None else None, exc)
            while len(self._left) >= MAX_CLOSED_GROUPS:
                del self._left[next(iter(self._left))]
        elif first < left.first:
            left.first, left.error = first, exc
        if src is None:
            left.p2p, left.error = None, exc
        elif left.p2p is not None:
            left.p2p.setdefault(src, (p2p, exc))
        self._left[group] = left
        for key in [k for k in self._posted if k[2] == group and self.left(k) is not None]:
            self._cut_short(key)
            _fail_future(self._posted.pop(key).future, self.left(key) or exc)
        for key in [k for k in self._early if k[2] == group and self.left(k) is not None]:
            del self._early[key]
            lent = self._lent.pop(key, None)
            if lent is not None and not lent.done():
                lent.set_result(None)
        for key in [k for k in self._borrowed if k[2] == group and self.left(k) is not None]:
            self.release(key)
        for key in [k for k in self._kept if k[2] == group and self.left(k) is not None]:
            del self._kept[key]
        for fut in [f for f, (g, s) in self._guarded.items() if g == group and s >= left.first]:
            del self._guarded[fut]
            _fail_future(fut, left.error)

    def left(self, key: Key) -> CollectiveError | None:
        """The error of the group closed under ``key`` when its frame can no longer come
        (``close_group``), else ``None``."""
        left = self._left.get(key[2])
        if left is None:
            return None
        kind = key[1]
        if kind == _DATA:
            return left.error if key[3] >= left.first else None
        if kind != _P2P:
            return None
        if left.p2p is None:
            return left.error
        sent = left.p2p.get(key[0])
        return sent[1] if sent is not None and key[3] >= sent[0] else None

    def left_group(self, group: int, seq: int | None = None, dst: int | None = None
                   ) -> CollectiveError | None:
        """The error of ``group``, closed by a member, for its collective ``seq`` (``None``:
        only whether some member closed it), or for a message to world rank ``dst``, a
        member that closed it."""
        left = self._left.get(group) if self._left else None
        if left is None:
            return None
        if dst is not None:
            if left.p2p is None:
                return left.error
            sent = left.p2p.get(dst)
            return None if sent is None else sent[1]
        return left.error if seq is None or seq >= left.first else None

    def fail(self, exc: CollectiveError, scope: Scope | None = None) -> bool:
        """Break the world from collective ``scope`` on (everything when ``None``).

        Receives that may no longer complete fail with ``exc``. Returns whether this widened
        the failure (the first failure, or one of wider scope).
        """
        if self._error is None:
            self._error, self._scope = exc, scope
        elif self._scope is None:
            return False
        elif scope is None or scope[0] != self._scope[0]:
            self._scope = None
        elif scope[1] < self._scope[1]:
            self._scope = scope
        else:
            return False
        for key in [k for k in self._posted if not self._key_allowed(k)]:
            self._cut_short(key)
            _fail_future(self._posted.pop(key).future, exc)
        for key in [k for k in self._early if not self._key_allowed(k)]:
            del self._early[key]
            lent = self._lent.pop(key, None)
            if lent is not None and not lent.done():  # done: cancelled by its sender
                lent.set_result(None)
        # a failed collective's receiver will not release what it borrowed: give it back
        # (it may still read the memory, but never hands out what it computes from it)
        for key in [k for k in self._borrowed if not self._key_allowed(k)]:
            self.release(key)
        # ... but an early payload it may still read is not reused: left to the collector
        for key in [k for k in self._kept if not self._key_allowed(k)]:
            del self._kept[key]
        for fut in [f for f, (g, s) in self._guarded.items() if not self.allowed(g, s)]:
            del self._guarded[fut]
            _fail_future(fut, exc)
        return True

    def guard(self, sent: asyncio.Future[None], group: int, seq: int) -> asyncio.Future[None]:
        """A future that completes as ``sent`` (a posted send, see Transport.post) does, or
        fails with the world's error as soon as collective ``(group, seq)`` may no longer
        run: a send that waits on a peer which stopped reading (a frozen process: its socket
        stays open) must not hold the collective once another rank aborted it."""
        out = self._future()
        if not self.allowed(group, seq):
            assert self._error is not None
            _fail_future(out, self._error)
            return out
        left = self._left.get(group) if self._left else None
        if left is not None and seq >= left.first:
            _fail_future(out, left.error)
            return out
        self._guarded[out] = (group, seq)

        def settled(fut: asyncio.Future[None]) -> None:
            self._guarded.pop(out, None)
            if out.done():
                return
            if fut.cancelled():
                out.cancel()
            elif (exc := fut.exception()) is not None:
                out.set_exception(exc)
            else:
                out.set_result(None)

        sent.add_done_callback(settled)
        return out

    def allowed(self, group: int, seq: int) -> bool:
        """Whether collective ``(group, seq)`` may still run (see the class docstring)."""
        scope = self._scope
        return self._error is None or (scope is not None and group == scope[0]
                                       and seq < scope[1])

    def _key_allowed(self, key: Key) -> bool:
        return key[1] == _DATA and self.allowed(key[2], key[3])

    @property
    def error(self) -> CollectiveError | None:
        return self._error

    @property
    def scope(self) -> Scope | None:
        return self._scope

    def _mismatch(self, src: int, theirs: tuple[Any, ...] | None, mine: tuple[Any, ...],
                  scope: Scope) -> None:
        group, seq = scope
        where = "the world" if group == 0 else f"group {group:#x}"
        err = CollectiveError(
            f"collective mismatch: world rank {src} called {describe_sig(theirs)} "
            f"but world rank {self.rank} called {describe_sig(mine)} (sequence number "
            f"{seq} of {where})")
        if self.mismatch is None:
            self.mismatch = (scope, err)
        self._on_mismatch(err, scope)


def checked_payload(frame: Frame, sig: tuple[Any, ...] | None) -> Any:
    """A received collective frame's payload, once its signature is checked (the mailbox
    caught a mismatch already and broke the world; such data is never handed out)."""
    if frame.header.sig != sig:
        raise CollectiveError(f"collective mismatch: {describe_sig(frame.header.sig)} "
                              f"vs {describe_sig(sig)}")
    return frame.payload


def _fail_future(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail a posted receive; pipelined algorithms may never await every one of them, so the
    exception is marked as retrieved (whoever awaits still gets it)."""
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()


def _fits(frame: Frame, into: memoryview | None) -> bool:
    return into is None or memoryview(frame.payload).nbytes == into.nbytes


def _fill(frame: Frame, into: memoryview | None) -> Frame:
    if into is None or frame.payload is into:
        return frame
    src = memoryview(frame.payload)
    if src.nbytes != into.nbytes:
        return frame  # size mismatch: the receiver validates the header and raises
    copy_bytes(into, src)
    return Frame(frame.kind, frame.header, into)


#: copies at least this large go through NumPy, which releases the GIL while it copies
#: (a memoryview assignment holds it, stalling threads that wait to start their next job)
NUMPY_COPY_BYTES = 64 * 1024


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for two buffers of equal size."""
    if src.format != "B":
        src = src.cast("B")
    if src.nbytes >= NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src


def compute_and_post_inline(transport: Transport, work: Sequence[Work]
                            ) -> list[asyncio.Future[None] | None]:
    """``Transport.compute_and_post`` in the calling thread."""
    pending: list[asyncio.Future[None] | None] = []
    for fn, nbytes, frames in work:
        fn(0, nbytes)
        pending.extend(transport.post(dst, head, payload) for dst, head, payload in frames)
    return pending


def error_from_abort(frame: Frame) -> tuple[CollectiveError, Scope | None]:
    """Rebuild the exception an ABORT frame describes, and its scope."""
    meta = frame.header.meta or {}
    reason = str(meta.get("reason", "no reason given"))
    message = f"world rank {frame.header.src} aborted: {reason}"
    group, seq = meta.get("group"), meta.get("seq")
    scope = (group, seq) if type(group) is int and type(seq) is int else None
    if meta.get("error") == "PeerLostError":
        lost = meta.get("lost")
        return PeerLostError(message, rank=lost if type(lost) is int else None), None
    return CollectiveError(message), scope


def abort_meta(exc: BaseException, scope: Scope | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"reason": str(exc), "error": type(exc).__name__}
    if isinstance(exc, PeerLostError) and exc.rank is not None:
        meta["lost"] = exc.rank
    if scope is not None:
        meta["group"], meta["seq"] = scope
    return meta


class Transport(abc.ABC):
    """Moves frames between the ranks of one world. One instance per rank."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.mailbox = Mailbox(rank, self._on_mismatch)
        self._closed = False
        #: bytes of payload handed to ``post`` (for accounting, e.g. compression tests)
        self.bytes_sent = 0
        #: bytes that came in from the peers so far (frames, or parts of frames, as they are
        #: read): with ``unsent_bytes``, how a collective's watchdog tells a slow transfer,
        #: which goes on, from one that made no progress
        self.bytes_received = 0
        #: the same per world rank of the sender
        self.received_from = [0] * world_size
        #: whether receives should poll before sleeping (see Tuning.poll_us)
        self.polls = False
        #: whether polling should yield the CPU between polls (more ranks than cores here)
        self.yields = False
        #: whether, yielding, the larger receives of symmetric algorithms poll too (at most
        #: two ranks per core here; see Tuning.spin_us)
        self.spins = False
        #: whether a rank hands its core over after posting a step's sends (at least two
        #: ranks per core here, so every core is shared; see Tuning.hand_over_bytes)
        self.hands_over = False
        #: whether some rank of the world shares a core with another rank (ranks outnumber
        #: the cores of a machine): segments grow (Tuning.crowded_segment_bytes). It changes
        #: what goes on the wire, so every rank must hold the same value: a transport sets it
        #: only from what all ranks agreed on when the world formed
        self.crowded = False
        #: whether borrowing receives get the sender's memory itself (see the module doc):
        #: ranks share an address space, so reading a peer's data costs no transfer
        self.lends = False
        #: whether a receive posted with ``reduce`` (a ``ReduceOnRead``) may have its payload
        #: combined into that array as it is read, a piece at a time, instead of landing in
        #: its buffer (transports that read sockets themselves: tcp)
        self.reduces_on_read = False
        #: the most payload bytes one frame may carry (tcp: what its peers accept, see
        #: ``max_payload``); ``post`` raises ValueError for a larger payload
        self.max_payload = 1 << 62
        #: what losing a peer does: ``"abort"`` breaks the world, ``"isolate"`` fails only
        #: what involves that peer (transports that support it: tcp)
        self.peer_loss = "abort"
        #: whether ``take_direct`` reads awaited frames off the wire itself (tcp); elsewhere
        #: it posts the receives
        self.reads_direct = False
        #: whether a collective stops waiting for its posted sends once the world failed
        #: for it (``Mailbox.guard``): where a send waits on a peer that may have stopped
        #: reading (tcp; not where the payload is lent to a receiver in this process)
        self.guards_sends = False
        #: encoded DATA headers of recurring collectives (see HeadCache)
        self.heads = HeadCache()
        #: scratch buffers of collectives, kept between calls (see asynccoll.scratch)
        self.scratch = ScratchPool()

    # -- to implement ---------------------------------------------------------------------

    @abc.abstractmethod
    def post(self, dst: int, head: bytes, payload: memoryview | None
             ) -> asyncio.Future[None] | None:
        """Start sending one frame (``head`` = prefix + header from ``asynccoll.wire``).

        Never blocks. Returns ``None`` when ``payload`` may be reused already, else a future
        that completes once it may (the caller must not touch ``payload`` before). Frames
        posted to one ``dst`` arrive in the order they were posted.

        Raises:
            ValueError: ``payload`` is larger than ``max_payload`` (nothing was sent).
            PeerLostError: ``dst`` is gone.
            CollectiveError: the world is broken.
        """

    @abc.abstractmethod
    def _notify_abort(self, frame: Frame) -> None:
        """Best effort: make every other rank receive ``frame`` (an ABORT), without waiting."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release connections; called once."""

    def pump(self, src: int, nbytes: int | None = None) -> bool:
        """Read what world rank ``src`` sent, now, without the event loop; whether anything
        was read. Frames read this way go through the mailbox exactly as the event loop's
        reads do. Receives that poll call it (the default: nothing to read directly);
        ``nbytes``, when known, is the payload size awaited (a transport may carry small
        and large frames on different connections)."""
        return False

    def flushed(self) -> bool:
        """Whether every frame posted so far has been handed to the system (nothing waits
        for the event loop to be written). A receive that polls may keep reading without
        giving the loop a turn only while this holds."""
        return True

    async def take_direct(self, want: Sequence[tuple[Key, bytes, memoryview]],
                          sig: tuple[Any, ...], window: float
                          ) -> list[asyncio.Future[Frame] | None]:
        """Receive several frames at once, each ``(key, head, into)``: ``head`` is the head
        (prefix and header) the frame will have if its sender encodes it canonically (see
        ``HeadCache``), ``into`` where its payload goes. Per frame, ``None`` when its payload
        is in ``into`` already, else the future of a receive posted as ``post_recv(key,
        into, sig)`` (which completes, and is checked, the usual way).

        A transport that reads the wire itself (``reads_direct``) polls for up to ``window``
        seconds and takes each frame whose bytes are exactly ``head`` and a payload of
        ``into``'s size straight into ``into``: no decoding, no mailbox, no frame object
        (equal bytes decode to the expected header, signature included). Anything else, and
        whatever is not there in time, goes the usual way. This default posts every receive.
        """
        return [self.post_recv(key, into, sig) for key, _, into in want]

    def poll_payload(self, key: Key, sig: tuple[Any, ...], reads: int, expect: bytes | None,
                     nbytes: int) -> Any:
        """The payload of the frame for ``key`` if it is here, trying up to ``reads`` direct
        reads of its sender first (``pump``); ``None`` if it is not (yet).

        The lean receive of small collectives (``Call.payload_of``): nothing is posted, so a
        frame costs no future, no posted entry and no event-loop turn. ``expect``, when
        given, is the head (prefix and header) the frame will have if the sender encodes it
        canonically, for ``nbytes`` of payload: a transport that reads bytes itself may take
        such a frame without decoding it. Stops after a read that completed no frame for
        ``key``, so that the caller can let the event loop run (a frame may be half read,
        and this rank's own queued writes may be what the sender waits for); a transport
        that knows none of this rank's writes wait may read on through a half-read frame.

        Raises:
            CollectiveError: the frame's signature is not ``sig``, the world is broken for
                this collective, or the sender is lost.
        """
        take = self.mailbox.take
        frame = take(key, None)
        if frame is None and reads:
            pump, src, yields = self.pump, key[0], self.yields
            for _ in range(reads):
                if pump(src, nbytes):
                    frame = take(key, None)
                    break
                if yields:
                    os.sched_yield()
        return None if frame is None else checked_payload(frame, sig)

    # -- shared ---------------------------------------------------------------------------

    async def send(self, dst: int, head: bytes, payload: memoryview | None) -> None:
        """``post``, then wait until ``payload`` may be reused."""
        pending = self.post(dst, head, payload)
        if pending is not None:
            await pending
            self.check_sendable()

    def post_recv(self, key: Key, into: memoryview | None = None,
                  sig: tuple[Any, ...] | None = None, borrow: bool = False,
                  reduce: ReduceOnRead | None = None) -> asyncio.Future[Frame]:
        """Post a receive; the future resolves with the frame (see ``recv``).

        With ``borrow``, a backend that ``lends`` may resolve it with the sender's own
        payload instead of filling ``into``: the receiver must only read it, and call
        ``release`` once done (the sender waits until then). With ``reduce`` (only for a
        backend that ``reduces_on_read``), a frame that arrives after the receive was posted
        may be combined into ``reduce.dest`` as it is read: the frame's payload is then
        ``reduce`` itself, and ``into`` was not touched.
        """
        frame = self.mailbox.take(key, into, borrow)
        if frame is not None:
            fut: asyncio.Future[Frame] = self.mailbox._future()
            fut.set_result(frame)
            return fut
        return self.mailbox.post(key, into, sig, borrow, reduce if self.reduces_on_read else None)

    def release(self, key: Key) -> None:
        """Give back the payload a borrowing receive of ``key`` got (no-op if it got none)."""
        self.mailbox.release(key)

    async def recv(self, key: Key, into: memoryview | None = None,
                   sig: tuple[Any, ...] | None = None) -> Frame:
        """Wait for the frame matching ``key``; fill ``into`` with its payload when sizes agree.

        When the returned frame's payload is not ``into``, sizes differed and the caller must
        validate the header before using the data.
        """
        frame = self.mailbox.take(key, into)
        if frame is not None:
            return frame
        fut = self.mailbox.post(key, into, sig)
        try:
            return await fut
        finally:
            self.mailbox.unpost(key)

    async def compute_and_post(self, work: Sequence[Work], chunk: int
                               ) -> list[asyncio.Future[None] | None]:
        """Compute payloads and send them: for each ``(fn, nbytes, frames)`` in order,
        ``fn(lo, hi)`` computes bytes ``[lo, hi)`` of an ``nbytes`` payload that every frame
        ``(dst, head, payload)`` of ``frames`` then carries. Returns what ``post``
        returned for the frames.

        The base version calls ``fn(0, nbytes)`` and posts, inline. A backend whose ranks
        share one process (memory) may run the work in a worker thread, so that several
        ranks' arithmetic uses several cores (NumPy releases the GIL in large ufuncs and
        copies): ``chunk`` bytes (a multiple of the element size) at a time, each chunk
        copied into the receives posted for the frames while it is still in cache. Chunks
        (and work items) must not depend on each other: they may run in any order, at the
        same time in different threads. The
        buffers the work touches must stay alive and untouched until this returns (it
        waits for a worker even when the awaiting task is cancelled).
        """
        return compute_and_post_inline(self, work)

    def check_usable(self, group: int | None = None, seq: int | None = None) -> None:
        """Raise unless a new collective (``group``, ``seq``) may start."""
        if self._closed:
            raise CommunicatorClosedError("the communicator was closed")
        err = self.mailbox.error
        if err is not None and (group is None or seq is None
                                or not self.mailbox.allowed(group, seq)):
            message = f"the communicator is broken by an earlier error: {err}"
            if isinstance(err, PeerLostError):
                raise PeerLostError(message, rank=err.rank) from err
            raise CollectiveError(message) from err

    def unsent_bytes(self, dst: int | None = None) -> int:
        """Bytes posted (to world rank ``dst``, or to anyone) but not handed to the network
        yet (frames waiting to be written); 0 where a post hands everything over at once."""
        return 0

    def outgoing_bytes(self, dst: int | None = None) -> int:
        """``unsent_bytes`` and what else of it is still on its way out (tcp: the kernel's
        send queues): how the watchdog tells a slow transfer from one that stalled."""
        return self.unsent_bytes(dst)

    def check_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Raise ``RuntimeError`` if this transport cannot run in ``loop`` (its connections
        belong to another event loop); ``loop`` runs the calls from now on. Most transports
        run in any loop."""
        return None

    def check_sendable(self) -> None:
        """Raise if frames can no longer be sent (closed, or the whole world is broken)."""
        mailbox = self.mailbox
        if self._closed or (mailbox._error is not None and mailbox._scope is None):
            self.check_usable()

    @property
    def broken(self) -> CollectiveError | None:
        return self.mailbox.error

    def abort(self, exc: CollectiveError, *, notify: bool = True,
              scope: Scope | None = None) -> None:
        """Break the world from collective ``scope`` on (all of it when ``None``): fail the
        receives that can no longer complete with ``exc`` and tell the other ranks.

        A ``PeerLostError`` breaks all of it, whatever ``scope`` says: the other ranks take
        it so (``error_from_abort``), and would fail the earlier collectives this rank still
        waits in."""
        if isinstance(exc, PeerLostError):
            scope = None
        if not self.mailbox.fail(exc, scope):
            return
        log.debug("rank %d aborts (scope %s): %s", self.rank, scope, exc)
        if notify and not self._closed:
            header = FrameHeader(src=self.rank, meta=abort_meta(exc, scope))
            self._notify_abort(Frame(FrameKind.ABORT, header, b""))

    def _on_abort_frame(self, frame: Frame) -> None:
        exc, scope = error_from_abort(frame)
        self.abort(exc, notify=False, scope=scope)

    def _on_mismatch(self, exc: CollectiveError, scope: Scope) -> None:
        self.abort(exc, scope=scope)

    def close_group(self, group: int, ranks: Sequence[int], first: int,
                    sent: dict[int, int]) -> None:
        """This rank closed its communicator of ``group`` (world ``ranks``) before the
        group's collective ``first``, having sent ``sent[r]`` point-to-point messages to
        world rank ``r`` in it: its receives in the group that nothing will complete any
        more fail, and the other members are told (a CLOSE frame each, best effort, on the
        connections the world already has), so that their collectives of the group from
        ``first`` on, and their receives of this rank's messages beyond those, fail at once
        instead of waiting for their timeout. Nothing else changes."""
        self.mailbox.close_group(group, first, None, 0,
                                 CommunicatorClosedError("the communicator was closed"))
        self._group_left()
        if self._closed or (self.mailbox.error is not None and self.mailbox.scope is None):
            return  # (nobody to tell: this rank's world is gone)
        for dst in ranks:
            if dst != self.rank:
                header = FrameHeader(group=group, seq=first, src=self.rank,
                                     meta={"p2p": sent.get(dst, 0)})
                try:
                    self.post(dst, encode_head(FrameKind.CLOSE, header, 0), None)
                except (CollectiveError, ValueError) as exc:  # that member is gone already
                    log.debug("rank %d could not tell world rank %d that group %#x closed: "
                              "%s", self.rank, dst, group, exc)

    def _on_close_frame(self, frame: Frame) -> None:
        """A member closed a group (a CLOSE frame, see ``close_group``)."""
        h = frame.header
        meta = h.meta if isinstance(h.meta, dict) else {}
        sent = meta.get("p2p")
        self.mailbox.close_group(h.group, h.seq, h.src, sent if type(sent) is int else 0,
                                 CollectiveError(f"world rank {h.src} closed the group"))
        self._group_left()

    def _group_left(self) -> None:
        """Called once a group was closed (``Mailbox.close_group``): a backend with work
        that writes into this rank's receives stops what it wrote into those that failed."""
        return None

    async def close(self) -> None:
        """Close connections; idempotent. Pending receives fail with CommunicatorClosedError."""
        if self._closed:
            return
        self._closed = True
        if self.mailbox.error is None:
            self.mailbox.fail(CommunicatorClosedError("the communicator was closed"))
        self.scratch.clear()
        await uncancelled(self._close())  # (a close cut short would leak its connections)
