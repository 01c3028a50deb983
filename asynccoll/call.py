"""One collective in flight, as the algorithms see it: ``Call`` and its receives (``Recv``).

``Call`` numbers a collective's frames (sequence number, signature, group ranks) and does its
peer I/O by group rank over the transport interface: posted sends, posted receives (``Recv``),
the lean receives of small collectives, frames read off the wire (``take_direct``) and
reductions overlapped with sends (``compute_and_post``). The algorithms that use it are in
``asynccoll.algorithms``; like them, it never imports a concrete transport.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import CollectiveError
from .ops import ReduceOp, combine
from .transport.base import (
    Key,
    Transport,
    Work,
    checked_payload,
    compute_and_post_inline,
)
from .tuning import Tuning
from .wire import Frame, FrameKind, array_view, dtype_code
from .wire_stream import ReduceOnRead

#: the kind of collective frames, looked up once (an enum attribute costs ~0.1 us a time)
_DATA = int(FrameKind.DATA)


def bytes_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a flat memoryview (no copy)."""
    if a.size:
        return memoryview(a).cast("B")  # type: ignore[arg-type]
    return memoryview(a.reshape(-1)).cast("B")  # type: ignore[arg-type]  # 0 in the shape


def row_bounds(rows: int, row_size: int, parts: int) -> list[tuple[int, int]]:
    """Element ranges of ``numpy.array_split(rows, parts)`` blocks of a flat array."""
    base, extra = divmod(rows, parts)
    bounds, start = [], 0
    for j in range(parts):
        n = (base + (1 if j < extra else 0)) * row_size
        bounds.append((start, start + n))
        start += n
    return bounds


async def settle(pending: list[asyncio.Future[None] | None]) -> None:
    """Wait for posted sends (see Transport.post) to release their payloads."""
    for p in pending:
        if p is not None:
            await p




class Call:
    """One collective in flight: its sequence number and signature, and peer I/O by group rank.

    Sends are *posted* (``post`` never blocks; it returns a future when the payload is
    still in use) and receives can be posted ahead (``post_recv``), so algorithms overlap
    transfers with each other and with reductions without creating tasks.
    """

    __slots__ = ("group", "poll", "rank", "ranks", "seq", "sig", "size", "src", "t", "tuning")

    def __init__(self, transport: Transport, ranks: tuple[int, ...], group: int, rank: int,
                 seq: int, sig: tuple[Any, ...], tuning: Tuning) -> None:
        self.t = transport
        self.src = transport.rank
        self.ranks = ranks
        self.group = group
        self.rank = rank
        self.size = len(ranks)
        self.seq = seq
        self.sig = sig
        self.tuning = tuning
        self.poll = tuning.poll_us * 1e-6 if transport.polls else 0.0

    def frame(self, peer: int, step: int, arr: np.ndarray) -> tuple[int, bytes, memoryview]:
        """``(dst, head, payload)`` of the frame sending ``arr`` as ``step`` to ``peer``."""
        head = self.t.heads.data_head(_DATA, self.group, self.seq, step, 0, self.src,
                                      dtype_code(arr.dtype), arr.shape, self.sig, arr.nbytes)
        return self.ranks[peer], head, bytes_view(arr)

    @property
    def reads_direct(self) -> bool:
        """Whether ``take_direct`` reads frames off the wire here: a polling call on a
        transport that ``reads_direct`` (elsewhere it posts the receives)."""
        return bool(self.poll) and self.t.reads_direct

    def head_from(self, src: int, step: int, like: np.ndarray) -> bytes:
        """The head world rank ``src``'s frame of ``step`` will have when it sends an array of
        ``like``'s dtype and shape (its ``HeadCache`` encodes the same bytes): what a receiver
        that reads the wire itself compares a frame with."""
        return self.t.heads.data_head(_DATA, self.group, self.seq, step, 0, src,
                                      dtype_code(like.dtype), like.shape, self.sig, like.nbytes)

    def post(self, peer: int, step: int, arr: np.ndarray) -> asyncio.Future[None] | None:
        """Start sending ``arr`` as ``step`` to group rank ``peer``; see Transport.post."""
        head = self.t.heads.data_head(_DATA, self.group, self.seq, step, 0, self.src,
                                      dtype_code(arr.dtype), arr.shape, self.sig, arr.nbytes)
        return self.guard(self.t.post(self.ranks[peer], head, bytes_view(arr)))

    def guard(self, pending: asyncio.Future[None] | None) -> asyncio.Future[None] | None:
        """``pending`` (a posted send), or where the transport ``guards_sends``, a future
        that also fails once this collective is aborted (``Mailbox.guard``)."""
        if pending is None or pending.done() or not self.t.guards_sends:
            return pending
        return self.t.mailbox.guard(pending, self.group, self.seq)

    async def send(self, peer: int, step: int, arr: np.ndarray) -> None:
        pending = self.post(peer, step, arr)
        if pending is not None:
            await pending
            self.t.check_sendable()

    def post_recv(self, peer: int, step: int, into: np.ndarray | None = None, *,
                  borrow: bool = False, spin: bool = False,
                  reduce_into: tuple[np.ndarray, ReduceOp] | None = None) -> Recv:
        """Post the receive of ``step`` from group rank ``peer``; ``await r.get()`` later.

        ``borrow``: the data is only read, and ``Recv.release`` is called once it was;
        a transport that ``lends`` then hands over the sender's memory
        instead of filling ``into`` (see ``Recv.get``). ``spin``: a receive of a symmetric
        algorithm, which may poll for a large payload (see ``poll_window``).
        ``reduce_into=(dest, op)``: the data is only combined into ``dest`` (1-d, of
        ``into``'s size); on a transport that ``reduces_on_read`` and from
        ``Tuning.reduce_on_read_bytes``, it may be combined as it is read, and then
        ``Recv.get`` returns ``dest`` with ``Recv.reduced`` set (``into`` untouched).
        """
        key = (self.ranks[peer], _DATA, self.group, self.seq, step, 0)
        view = bytes_view(into) if into is not None else None
        reduce = None
        if (reduce_into is not None and self.t.reduces_on_read
                and reduce_into[0].nbytes >= self.tuning.reduce_on_read_bytes):
            dest, op = reduce_into
            reduce = ReduceOnRead(dest, functools.partial(_combine_piece, op=op))
        return Recv(self, peer, into, view,
                    self.t.post_recv(key, view, self.sig, borrow, reduce),
                    key if borrow else None, spin, reduce)

    async def take_direct(self, peers: Sequence[int], step: int, intos: Sequence[np.ndarray],
                          *, spin: bool = False) -> list[Recv | None]:
        """Receive ``step`` from each group rank of ``peers`` into the array beside it at once
        (``Transport.take_direct``): per peer ``None`` where the data landed in its array as
        expected (same shape and dtype), else a posted receive (``Recv``) to ``get``.

        On a transport that ``reads_direct``, frames that come as expected are read off the
        wire straight into their arrays, for up to the window a posted receive of the largest
        would poll (``poll_window``); the others go the usual way. Call it only where no
        receive of these was posted and the event loop did not run since this call's sends
        were posted, or frames will have gone the usual way already (correct, only slower).
        """
        t = self.t
        want = []
        for peer, into in zip(peers, intos, strict=True):
            src = self.ranks[peer]
            want.append(((src, _DATA, self.group, self.seq, step, 0),
                         self.head_from(src, step, into), bytes_view(into)))
        window = poll_window(self.tuning, self.poll, t.yields,
                             max((into.nbytes for into in intos), default=0), spin and t.spins)
        futs = await t.take_direct(want, self.sig, window)
        return [None if fut is None else Recv(self, peer, into, view, fut, spin=spin)
                for peer, into, (_, _, view), fut in zip(peers, intos, want, futs, strict=True)]

    async def recv(self, peer: int, step: int, into: np.ndarray | None = None, *,
                   resize: bool = False, spin: bool = False) -> np.ndarray:
        """Receive the frame of ``step`` from group rank ``peer`` (see ``Recv.get``)."""
        return await self.post_recv(peer, step, into, spin=spin).get(resize=resize)

    def hand_over(self, nbytes: int) -> None:
        """Where every core is shared by two or more ranks (``Transport.hands_over``), give
        this rank's core to another rank once, after posting a step's sends of ``nbytes``
        and before waiting for the step's receive, when ``nbytes`` is at least
        ``Tuning.hand_over_bytes``.

        Ranks sharing a core otherwise settle into turns two calls long: a rank whose peers'
        data is already there receives it, posts the next call's sends, finds that call's
        data there too (its peers posted it before they yielded) and runs on, so every other
        call it makes spans another rank's turn, and the calls' times split into a fast and
        a slow half with the median in the gap between them. Handing over after the sends
        makes the turns one call long and the calls alike, at about the same mean.
        """
        if self.t.hands_over and nbytes >= self.tuning.hand_over_bytes:
            os.sched_yield()

    def spins(self, nbytes: int) -> bool:
        """Whether a symmetric collective moving ``nbytes`` per rank spins on its larger
        receives (see ``Tuning.spin_us``)."""
        return nbytes <= self.tuning.spin_max_bytes

    async def exchange(self, dst: int, arr: np.ndarray, src: int, into: np.ndarray | None,
                       step: int, *, resize: bool = False) -> np.ndarray:
        """Send ``arr`` to ``dst`` while receiving from ``src`` (see ``Recv.get``)."""
        pending = self.post(dst, step, arr)
        got = await self.recv(src, step, into, resize=resize)
        if pending is not None:
            await pending
            self.t.check_sendable()
        return got

    async def payload_of(self, peer: int, step: int, like: np.ndarray) -> np.ndarray:
        """The array of ``step`` from group rank ``peer``, of ``like``'s dtype and shape (a
        new array; ``like`` itself when it has no bytes), received without posting a receive:
        the lean path of small collectives.

        On a polling transport it reads the peer's socket directly, expecting the frame's
        exact head (``Transport.poll_payload``) and giving the event loop a turn between
        bursts of reads, for up to ``Tuning.poll_us``; only a frame that takes longer is
        waited for the usual way (a posted receive, the event loop asleep).
        """
        t = self.t
        src = self.ranks[peer]
        nbytes = like.nbytes
        expect = self.head_from(src, step, like) if self.poll else None
        payload = t.poll_payload((src, _DATA, self.group, self.seq, step, 0), self.sig,
                                 POLL_READS if expect is not None else 0, expect, nbytes)
        if payload is None:
            return await self._waited(src, step, like, expect)
        return self._as_array(src, payload, like)

    async def swap(self, peer: int, step: int, arr: np.ndarray) -> np.ndarray:
        """Send ``arr`` to group rank ``peer`` and receive its array of ``step`` (of
        ``arr``'s dtype and shape) in exchange, the lean way (``payload_of``): a new array."""
        pending = self.post(peer, step, arr)
        self.hand_over(arr.nbytes)
        got = await self.payload_of(peer, step, arr)
        if pending is not None:
            await pending
            self.t.check_sendable()
        return got

    async def _waited(self, src: int, step: int, like: np.ndarray, expect: bytes | None
                      ) -> np.ndarray:
        """The rest of ``payload_of`` when its first burst of reads found nothing: more
        bursts, each after a turn of the event loop, for up to ``Tuning.poll_us``, then a
        posted receive."""
        t = self.t
        key = (src, _DATA, self.group, self.seq, step, 0)
        sig, nbytes = self.sig, like.nbytes
        payload = None
        if expect is not None:
            deadline = time.perf_counter() + self.poll
            while payload is None and time.perf_counter() < deadline:
                await asyncio.sleep(0)
                payload = t.poll_payload(key, sig, POLL_READS, expect, nbytes)
        if payload is None:
            payload = checked_payload(await t.post_recv(key, None, sig), sig)
        return self._as_array(src, payload, like)

    def _as_array(self, src: int, payload: Any, like: np.ndarray) -> np.ndarray:
        """``payload`` as an array like ``like`` (checking its size)."""
        nbytes = like.nbytes
        if memoryview(payload).nbytes != nbytes:
            raise CollectiveError(f"group rank {self.ranks.index(src)} sent "
                                  f"{memoryview(payload).nbytes} bytes where {nbytes} were "
                                  f"expected")
        if not nbytes:  # nothing to read (barrier tokens): no new array either
            return like
        got = np.frombuffer(payload, like.dtype)
        return got if like.ndim == 1 else got.reshape(like.shape)

    def reducer(self, dst: np.ndarray, srcs: list[np.ndarray], op: ReduceOp
                ) -> Callable[[int, int], None]:
        """``fn(lo, hi)`` computing bytes ``[lo, hi)`` of ``dst = dst op srcs[0] op
        srcs[1] ...`` in place, a cache-sized chunk at a time (each chunk of ``dst`` stays in
        cache while every source is combined into it); see Transport.compute_and_post."""
        size = dst.itemsize
        chunk = max(1, self.tuning.reduce_chunk_bytes // size)

        def run(lo: int, hi: int) -> None:
            for a in range(lo // size, hi // size, chunk):
                b = min(hi // size, a + chunk)
                d = dst[a:b]
                for src in srcs:
                    combine(d, src[a:b], op)

        return run

    async def compute_and_post(self, work: Sequence[Work], nbytes: int, itemsize: int
                               ) -> list[asyncio.Future[None] | None]:
        """Transport.compute_and_post for ``nbytes`` of work in all, inline when small."""
        if nbytes < self.tuning.offload_bytes:
            return [self.guard(p) for p in compute_and_post_inline(self.t, work)]
        chunk = max(itemsize, self.tuning.reduce_chunk_bytes // itemsize * itemsize)
        return [self.guard(p) for p in await self.t.compute_and_post(work, chunk)]


#: direct reads of the peer's socket between event-loop turns while a receive polls
POLL_READS = 8


def poll_window(tuning: Tuning, poll: float, yields: bool, nbytes: int | None,
                spin: bool) -> float:
    """Seconds a posted receive of ``nbytes`` (``None``: unknown size) polls before it
    sleeps: ``poll`` (``Tuning.poll_us``, 0 where the transport does not poll), except with
    more ranks than cores (``yields``), where receives above ``Tuning.poll_max_bytes`` poll
    only where ``spin`` (a symmetric algorithm, on a transport that ``spins``), for
    ``Tuning.spin_us``."""
    if not poll or not yields or nbytes is None or nbytes <= tuning.poll_max_bytes:
        return poll
    return tuning.spin_us * 1e-6 if spin else 0.0


def _combine_piece(dest: np.ndarray, piece: np.ndarray, *, op: ReduceOp) -> None:
    combine(dest, piece, op)


class Recv:
    """A posted receive."""

    __slots__ = ("borrowed", "call", "fut", "into", "peer", "reduce", "reduced", "spin",
                 "view")

    def __init__(self, call: Call, peer: int, into: np.ndarray | None, view: memoryview | None,
                 fut: asyncio.Future[Frame], borrowed: Key | None = None,
                 spin: bool = False, reduce: ReduceOnRead | None = None) -> None:
        self.call = call
        self.peer = peer
        self.into = into
        self.view = view
        self.fut = fut
        self.borrowed = borrowed
        self.spin = spin
        self.reduce = reduce
        #: set by ``get`` when the data was combined into ``reduce_into``'s array as it
        #: was read (``get`` then returned that array)
        self.reduced = False

    def release(self) -> None:
        """Done reading a borrowed receive's data (no-op for other receives)."""
        if self.borrowed is not None:
            self.call.t.release(self.borrowed)

    async def frame(self) -> Frame:
        """The received frame, its signature checked (its payload not looked at)."""
        fut = self.fut
        call = self.call
        t = call.t
        window = 0.0 if fut.done() else poll_window(
            call.tuning, call.poll, t.yields, None if self.into is None else self.into.nbytes,
            self.spin and t.spins)
        if window:
            # poll a little before letting the event loop sleep (see Tuning.poll_us); with
            # more ranks than cores, hand the core over between polls (to the rank we wait for)
            deadline = time.perf_counter() + window
            yields = t.yields
            pump = t.pump
            src = call.ranks[self.peer]
            size = (self.into.nbytes if self.into is not None
                    else self.reduce.nbytes if self.reduce is not None else None)
            while not fut.done() and time.perf_counter() < deadline:
                # read the peer's socket directly a few times (no event-loop turn between:
                # a turn costs more than a read); once something was read and the frame is
                # not complete, go on reading, unless this rank's own frames wait for the
                # loop to write them (the peer may be waiting for those)
                read = False
                for _ in range(POLL_READS):
                    if pump(src, size):
                        read = True
                        break
                    if fut.done():
                        break
                    if yields:
                        os.sched_yield()
                if not fut.done() and not (read and t.flushed()):
                    await asyncio.sleep(0)
        frame = await fut
        checked_payload(frame, self.call.sig)
        return frame

    async def get(self, *, resize: bool = False) -> np.ndarray:
        """The received array: ``into`` when the data landed there.

        With ``resize``, a sender's array of another shape comes back as a new array;
        without, it is an error. A borrowing receive may return the sender's memory (of
        ``into``'s shape), valid until ``release``.
        """
        frame = await self.frame()
        h = frame.header
        assert h.dtype is not None and h.shape is not None  # check_payload guarantees it
        if self.reduce is not None and frame.payload is self.reduce:
            if self.reduce.error is not None:
                raise self.reduce.error
            self.reduced = True
            return self.reduce.dest
        into = self.into
        if into is not None:
            landed = frame.payload is self.view
            if landed and (not resize or h.shape == into.shape):
                return into
            if self.borrowed is not None and h.shape == into.shape:
                lent = array_view(frame.payload, h.dtype, h.shape)
                lent.flags.writeable = False  # the sender's memory (or a private copy)
                return lent
            if not resize:
                raise CollectiveError(f"group rank {self.peer} sent {h.shape} where "
                                      f"{into.shape} was expected")
            if landed:  # zero bytes either way, only the shape differs
                return np.empty(h.shape, into.dtype)
        return array_view(frame.payload, h.dtype, h.shape)
