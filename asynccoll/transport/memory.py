"""In-process transport: every rank is a coroutine of one event loop.

Frames still go through the real codec (the prefix and msgpack header are encoded and decoded),
so in-process tests exercise the wire format. Payloads are copied once: straight into the
receiver's posted buffer when it waits already, otherwise into a fresh buffer it then owns.
Large collective payloads are *lent* instead (see ``.base``): to a receive that only reads
them (``borrow``), not copied at all; to a receiver that has not posted yet, until it copies.

Ranks share one event loop, and so one thread. ``MemoryTransport.compute_and_post`` runs
large reductions and the copies of their results in a thread pool the world owns (NumPy
releases the GIL in large ufuncs and copies), so the ranks' arithmetic uses more than one core.
A world is an object (``MemoryWorld``); two worlds in one process share nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import PeerLostError, ProtocolError
from ..wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX_SIZE,
    Frame,
    FrameHeader,
    FrameKind,
    check_payload,
    decode_header,
    encode_head,
    parse_prefix,
)
from .base import Key, Transport, Work, copy_bytes, frame_key

log = logging.getLogger("asynccoll.transport.memory")

#: collective payloads at least this large are lent to an early receiver instead of copied
#: twice (once now, once into the receive); point-to-point messages are always copied, so
#: that a send never waits for its receive
LEND_MIN_BYTES = 64 * 1024

#: seconds a cancelled collective waits for a compute job already running on its buffers
#: (a job reduces and copies one rank's block: ~3 ms for the 16 MiB block of a 64 MiB
#: all_reduce over 4 ranks)
JOB_DRAIN_TIMEOUT = 60.0


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


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
        self._pool: ThreadPoolExecutor | None = None
        self.transports = [MemoryTransport(self, r, world_size) for r in range(world_size)]

    def pool(self) -> ThreadPoolExecutor | None:
        """The worker threads (``None`` when reductions run inline)."""
        if self._pool is None and self.threads > 1:
            if all(t._closed for t in self.transports):
                return None
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="asynccoll-memory")
        return self._pool

    def _rank_closed(self) -> None:
        if self._pool is not None and all(t._closed for t in self.transports):
            # idle by now: a compute job is always awaited to its end
            self._pool.shutdown(wait=True)
            self._pool = None


class MemoryTransport(Transport):
    def __init__(self, world: MemoryWorld, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._world = world
        self.lends = True

    async def compute_and_post(self, work: Sequence[Work], chunk: int
                               ) -> list[asyncio.Future[None] | None]:
        """One job computes every payload a chunk at a time and copies each chunk into the
        receives posted for its frames (claimed now, delivered once the job is over), in a
        worker thread when the world has some; frames nobody waits for yet are posted (lent)
        after the job."""
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

        def job() -> None:
            for fn, nbytes, copies in steps:
                for lo in range(0, nbytes, chunk):
                    hi = min(nbytes, lo + chunk)
                    fn(lo, hi)
                    for into, payload in copies:
                        np.copyto(into[lo:hi], payload[lo:hi])

        pool = self._world.pool()
        if pool is None:
            job()
        else:
            # one turn of the event loop first: ranks that are ready in this turn get this far
            # too, and their jobs reach the pool together. Once a worker runs, it takes and
            # drops the GIL around every NumPy call, and the event loop's thread, which needs
            # it to get the next rank going, can wait milliseconds for it (CPython's switch
            # interval)
            await asyncio.sleep(0)
            jobf = asyncio.wrap_future(pool.submit(job))
            try:
                await asyncio.shield(jobf)
            except asyncio.CancelledError:
                # a running job cannot be interrupted: the buffers it writes go back to the
                # caller only once it is over
                await asyncio.wait([jobf], timeout=JOB_DRAIN_TIMEOUT)
                raise
        for peer, key, frame in claimed:
            if not peer._closed:
                peer.mailbox.deliver(key, frame)
        return [self.post(dst, head, payload) for dst, head, payload in later]

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
            header = decode_header(head[PREFIX_SIZE:PREFIX_SIZE + header_len], kind)
            check_payload(kind, header, payload_len)
        except ProtocolError:  # pragma: no cover - our own encoder produced these bytes
            log.exception("rank %d: undecodable in-process frame", self.rank)
            raise
        return kind, header, payload_len

    def _receive(self, head: bytes, payload: memoryview) -> asyncio.Future[None] | None:
        """Decode a frame and hand it to the mailbox."""
        kind, header, payload_len = self._decode(head)
        if kind == FrameKind.ABORT:
            self._on_abort_frame(Frame(kind, header, b""))
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
        self._world._rank_closed()


__all__ = ["MemoryTransport", "MemoryWorld"]
