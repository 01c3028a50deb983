"""In-process transport: every rank is a coroutine of one event loop.

Frames still go through the real codec (the prefix and msgpack header are encoded and decoded),
so in-process tests exercise the wire format. Payloads are copied once: straight into the
receiver's posted buffer when it waits already, otherwise into a fresh buffer it then owns.
Large collective payloads are *lent* instead (see ``.base``): to a receive that only reads
them (``borrow``), not copied at all; to a receiver that has not posted yet, until it copies.

Ranks share one event loop, and so one thread. ``MemoryTransport.compute_and_post`` runs
large reductions and the copies of their results in worker threads the world owns (NumPy
releases the GIL in large ufuncs and copies), so the ranks' arithmetic uses more than one core.
The workers share out every rank's job a chunk at a time (``_Workers``): they finish together
however the jobs fall, and go from one job to the next without a turn of the event loop.
A world is an object (``MemoryWorld``); two worlds in one process share nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import CollectiveError, PeerLostError, ProtocolError
from ..wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX_SIZE,
    Frame,
    FrameHeader,
    FrameKind,
    encode_head,
    parse_prefix,
)
from ..wire_stream import HeaderMemo
from .base import Key, Transport, Work, copy_bytes, frame_key

log = logging.getLogger("asynccoll.transport.memory")

#: collective payloads at least this large are lent to an early receiver instead of copied
#: twice (once now, once into the receive); point-to-point messages are always copied, so
#: that a send never waits for its receive
LEND_MIN_BYTES = 64 * 1024

#: seconds a cancelled collective waits for the chunks of its compute job that already run
#: on its buffers (a chunk reduces and copies ``Tuning.reduce_chunk_bytes`` of one rank's
#: block: ~0.3 ms for 1 MiB over 4 ranks)
JOB_DRAIN_TIMEOUT = 60.0


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


class _Job:
    """One ``compute_and_post`` call's work: ``left`` chunks to go, then ``future`` is set."""

    __slots__ = ("busy", "cancelled", "claims", "error", "errstate", "future", "left", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, left: int) -> None:
        self.loop = loop
        #: the caller's NumPy error state (``np.seterr``, ``np.errstate``, ``np.seterrcall``):
        #: its chunks run under it, as when a reduction runs in the event loop's thread (a
        #: worker thread has NumPy's defaults: an overflow under ``over="raise"`` passed as
        #: inf). The state itself, not a copy of the context: NumPy 2 keeps it in a context
        #: variable, NumPy 1 per thread
        self.errstate: dict[str, Any] = dict(np.geterr())
        if (call := np.geterrcall()) is not None:
            self.errstate["call"] = call
        self.future: asyncio.Future[None] = loop.create_future()
        self.left = left
        self.error: BaseException | None = None
        self.cancelled = False  # the caller gave up: chunks not started are skipped
        self.busy = 0  # chunks running now (changed under _Workers._lock)
        #: the receives its chunks copy into: (receiver, key)
        self.claims: list[tuple[MemoryTransport, Key]] = []

    def do(self, unit: Callable[[], None]) -> None:
        """Run one of the job's chunks, unless the job failed or was given up."""
        if self.error is None and not self.cancelled:
            try:
                with np.errstate(**self.errstate):
                    unit()
            except BaseException as exc:  # handed to the job's caller
                self.error = exc

    def signal(self) -> None:
        """From the thread that ran the last chunk: every chunk is over."""
        try:
            self.loop.call_soon_threadsafe(self._finish)
        except RuntimeError:  # pragma: no cover - the loop was closed under a running job
            pass

    def _finish(self) -> None:
        """In the loop's thread: set ``future`` (to the first chunk's error, if one failed)."""
        if self.future.done():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(None)


class _Workers:
    """A world's worker threads, and the chunks of compute work they share.

    Jobs are queued a chunk at a time, in order. Every worker takes the next chunk, whoever's
    it is, until none is left: the workers finish within a chunk of each other however the
    jobs are sized or timed, and go on to the next job without waiting for the event loop's
    thread (which needs the GIL to hand out work). Jobs queued in one turn of the event loop
    start together, at the end of that turn. A job's chunks must be independent of each other
    (see ``Transport.compute_and_post``).
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._queue: deque[tuple[_Job, Callable[[], None]]] = deque()
        self._lock = threading.Lock()
        self._running = 0  # workers taking chunks (changed under _lock)
        self._batch: list[tuple[_Job, Sequence[Callable[[], None]]]] = []  # queued this turn
        self._closed = False

    def run(self, units: Sequence[Callable[[], None]]) -> _Job:
        """Queue ``units`` as one job; they start at the end of this turn of the loop."""
        loop = asyncio.get_running_loop()
        job = _Job(loop, len(units))
        self._batch.append((job, units))
        if len(self._batch) == 1:
            loop.call_soon(self._start)
        return job

    def _start(self) -> None:
        # at the end of the turn: ranks that are ready in this turn have queued their jobs by
        # now. Once a worker runs, it takes and drops the GIL around every NumPy call, and the
        # event loop's thread, which needs the GIL to get the next rank going, can wait
        # milliseconds for it (CPython's switch interval).
        # The turn's jobs go out in groups of one per worker, their chunks interleaved: the
        # workers work on different jobs (two cores streaming through neighbouring chunks of
        # one block measured ~4% slower), and the first jobs finish early.
        batch, self._batch = self._batch, []
        order: list[tuple[_Job, Callable[[], None]]] = []
        for g in range(0, len(batch), self.threads):
            group = batch[g:g + self.threads]
            for k in range(max(len(units) for _, units in group)):
                order.extend((job, units[k]) for job, units in group if k < len(units))
        with self._lock:
            self._queue.extend(order)
            # every rank closed under a running collective: no more threads, this one works
            more = 1 if self._closed else min(self.threads, len(self._queue)) - self._running
            if more > 0:
                self._running += more
        if self._closed:
            self._work()
            return
        if more <= 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="asynccoll-memory")
        for _ in range(more):
            self._pool.submit(self._work)

    def _work(self) -> None:
        """A worker: chunks until the queue is empty."""
        queue, lock = self._queue, self._lock
        job: _Job | None = None
        while True:
            finished = None
            with lock:
                if job is not None:
                    job.busy -= 1
                    job.left -= 1
                    if job.left == 0:
                        finished = job
                if queue:
                    job, unit = queue.popleft()
                    job.busy += 1
                else:
                    self._running -= 1
                    job = None
            if finished is not None:
                finished.signal()
            if job is None:
                return
            job.do(unit)

    def shutdown(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class MemoryWorld:
    """The ranks of one in-process world.

    Args:
        threads: worker threads for ``MemoryTransport.compute_and_post``, started on
            first use and stopped when every rank has closed. ``None``: one per core, at most
            one per rank; ``0`` or ``1``: none, reductions run in the event loop's thread.
    """

    def __init__(self, world_size: int, *, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 threads: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if threads is not None and threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        self.max_payload = max_payload
        self.threads = min(_cores(), world_size) if threads is None else threads
        self._workers: _Workers | None = None
        self.transports = [MemoryTransport(self, r, world_size) for r in range(world_size)]

    def workers(self) -> _Workers | None:
        """The worker threads (``None`` when reductions run inline)."""
        if self._workers is None and self.threads > 1:
            if all(t._closed for t in self.transports):
                return None
            self._workers = _Workers(self.threads)
        return self._workers

    def _rank_closed(self) -> None:
        if self._workers is not None and all(t._closed for t in self.transports):
            # idle by now: a compute job is always awaited to its end
            self._workers.shutdown()
            self._workers = None


class _Chunk:
    """Bytes ``[lo, hi)`` of one payload: computed, then copied into the posted receives."""

    __slots__ = ("copies", "fn", "hi", "lo")

    def __init__(self, fn: Callable[[int, int], None], lo: int, hi: int,
                 copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.fn, self.lo, self.hi, self.copies = fn, lo, hi, copies

    def __call__(self) -> None:
        lo, hi = self.lo, self.hi
        self.fn(lo, hi)
        for into, payload in self.copies:
            np.copyto(into[lo:hi], payload[lo:hi])


class MemoryTransport(Transport):
    def __init__(self, world: MemoryWorld, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._world = world
        self.lends = True
        self._memo = HeaderMemo()  # as a socket reader has, one per receiving end
        #: peers' compute jobs that copy into receives this rank posted
        self._writers: set[_Job] = set()

    async def compute_and_post(self, work: Sequence[Work], chunk: int
                               ) -> list[asyncio.Future[None] | None]:
        """One job computes every payload a chunk at a time and copies each chunk into the
        receives posted for its frames (claimed now, delivered once the job is over), in the
        world's worker threads when it has some (they share the chunks of every job queued);
        frames nobody waits for yet are posted (lent) after the job."""
        self.check_sendable()
        steps: list[tuple[Callable[[int, int], None], int, list[tuple[Any, Any]]]] = []
        claimed: list[tuple[MemoryTransport, Key, Frame]] = []
        later: list[tuple[int, bytes, memoryview]] = []
        for fn, nbytes, frames in work:
            copies = []
            for dst, head, payload in frames:
                peer = self._peer(dst)
                kind, header, size = peer._decode(head)
                into = None
                if kind == FrameKind.DATA and size == nbytes >= LEND_MIN_BYTES:
                    if not peer.mailbox.check(kind, header):
                        self.bytes_sent += size
                        continue  # a mismatch: the world is aborted, the frame dropped
                    key = frame_key(kind, header)
                    into = peer.mailbox.claim(key, size)
                if into is None:
                    later.append((dst, head, payload))
                    continue
                self.bytes_sent += size
                copies.append((np.frombuffer(into, np.uint8),
                               np.frombuffer(payload.cast("B"), np.uint8)))
                claimed.append((peer, key, Frame(kind, header, into)))
            steps.append((fn, nbytes, copies))

        units = [_Chunk(fn, lo, min(nbytes, lo + chunk), copies)
                 for fn, nbytes, copies in steps for lo in range(0, nbytes, chunk)]
        workers = self._world.workers()
        if workers is None or not units:
            for unit in units:
                unit()
        else:
            job = workers.run(units)
            job.claims = [(peer, key) for peer, key, _ in claimed]
            for peer, _ in job.claims:
                peer._writers.add(job)
            try:
                await asyncio.shield(job.future)
            except asyncio.CancelledError:
                # chunks already running cannot be interrupted: the buffers they write go
                # back to the caller only once they are over (the others are skipped)
                job.cancelled = True
                await asyncio.wait([job.future], timeout=JOB_DRAIN_TIMEOUT)
                if job.future.done():
                    job.future.exception()  # retrieved: the cancellation is what is raised
                raise
            finally:
                for peer, _ in job.claims:
                    peer._writers.discard(job)
        for peer, key, frame in claimed:
            if not peer._closed:
                nbytes = memoryview(frame.payload).nbytes
                peer.bytes_received += nbytes
                peer.received_from[self.rank] += nbytes
                peer.mailbox.deliver(key, frame)
        return [self.post(dst, head, payload) for dst, head, payload in later]

    def abort(self, exc: CollectiveError, *, notify: bool = True,
              scope: tuple[int, int] | None = None) -> None:
        super().abort(exc, notify=notify, scope=scope)
        # the writers' ranks raise this: a lost peer stays a PeerLostError naming it (this
        # rank, when it closed), as the ABORT frame relays it to the others
        gave_up = f"world rank {self.rank} gave up: {exc}"
        if self._closed:
            stop: CollectiveError = PeerLostError(
                f"world rank {self.rank} closed its communicator", rank=self.rank)
        elif isinstance(exc, PeerLostError):
            stop = PeerLostError(gave_up, rank=exc.rank)
        else:
            stop = CollectiveError(gave_up)
        self._stop_writers(stop)

    def _stop_writers(self, exc: CollectiveError) -> None:
        """Fail the peers' jobs that copy into receives this rank gave up (a failed or
        cancelled collective, or a close), and wait for their chunks that run: the caller
        may reuse those buffers as soon as this returns."""
        mailbox = self.mailbox
        jobs = [job for job in self._writers
                if any(peer is self and (self._closed or not mailbox._key_allowed(key)
                                         or mailbox.left(key) is not None)
                       for peer, key in job.claims)]
        for job in jobs:
            if job.error is None:
                job.error = exc  # its chunks not started are skipped
        deadline = time.monotonic() + JOB_DRAIN_TIMEOUT
        while any(job.busy for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.0002)  # at most a chunk (see JOB_DRAIN_TIMEOUT)

    def _group_left(self) -> None:
        self._stop_writers(CollectiveError(f"world rank {self.rank} gave up: a member closed "
                                           f"the group"))

    def _peer(self, dst: int) -> MemoryTransport:
        peer = self._world.transports[dst]
        if peer._closed:
            raise PeerLostError(f"world rank {dst} has closed its communicator", rank=dst)
        return peer

    def post(self, dst: int, head: bytes, payload: memoryview | None
             ) -> asyncio.Future[None] | None:
        """Deliver at once: into the receive when it is posted (one copy, ``None`` returned);
        otherwise a large collective payload is lent until the receiver copies it (the
        returned future), and anything else copied now."""
        self.check_sendable()
        view = payload if payload is not None else memoryview(b"")
        peer = self._peer(dst)
        self.bytes_sent += view.nbytes
        return peer._receive(head, view)

    def _decode(self, head: bytes) -> tuple[FrameKind, FrameHeader, int]:
        """Decode a frame's head as a socket reader would."""
        try:
            kind, header_len, payload_len = parse_prefix(head[:PREFIX_SIZE],
                                                         self._world.max_payload)
            header = self._memo.decode_checked(head[PREFIX_SIZE:PREFIX_SIZE + header_len],
                                               kind, payload_len)
        except ProtocolError:  # pragma: no cover - our own encoder produced these bytes
            log.exception("rank %d: undecodable in-process frame", self.rank)
            raise
        return kind, header, payload_len

    def _receive(self, head: bytes, payload: memoryview) -> asyncio.Future[None] | None:
        """Decode a frame and hand it to the mailbox."""
        kind, header, payload_len = self._decode(head)
        self.bytes_received += payload_len
        self.received_from[header.src] += payload_len
        if kind == FrameKind.ABORT:
            self._on_abort_frame(Frame(kind, header, b""))
            return None
        if kind == FrameKind.CLOSE:
            self._on_close_frame(Frame(kind, header, b""))
            return None
        if not self.mailbox.check(kind, header):
            return None
        key = frame_key(kind, header)
        if kind == FrameKind.DATA and self.mailbox.lends_to(key, payload_len):
            return self.mailbox.lend(key, Frame(kind, header, payload))
        into = self.mailbox.claim(key, payload_len)
        if into is not None:
            copy_bytes(into, payload)
            self.mailbox.deliver(key, Frame(kind, header, into))
        elif (kind == FrameKind.DATA and payload_len >= LEND_MIN_BYTES
              and not self.mailbox.waiting(key)):
            return self.mailbox.lend(key, Frame(kind, header, payload))
        else:
            owner = np.empty(payload_len, np.uint8)  # no zero-fill: every byte is copied in
            copy_bytes(owner.data.cast("B"), payload)
            self.mailbox.deliver(key, Frame(kind, header, owner))
        return None

    def _notify_abort(self, frame: Frame) -> None:
        head = encode_head(frame.kind, frame.header, 0)
        for peer in self._world.transports:
            if peer is not self and not peer._closed:
                peer._receive(head, memoryview(b""))

    async def _close(self) -> None:
        lost = PeerLostError(f"world rank {self.rank} closed its communicator", rank=self.rank)
        for peer in self._world.transports:
            if peer is not self and not peer._closed:
                peer.mailbox.peer_lost(self.rank, lost)
        self._stop_writers(lost)
        self._world._rank_closed()


__all__ = ["MemoryTransport", "MemoryWorld"]
