"""In-process transport: every rank is a coroutine of one event loop.

Frames still go through the real codec (the prefix and msgpack header are encoded and decoded),
so in-process tests exercise the wire format. Payloads are copied once: straight into the
receiver's posted buffer when it waits already, otherwise into a fresh buffer it then owns.
A world is an object (:class:`MemoryWorld`); two worlds in one process share nothing.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from ..errors import PeerLostError, ProtocolError
from ..wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PREFIX_SIZE,
    Frame,
    FrameKind,
    check_payload,
    decode_header,
    encode_head,
    parse_prefix,
)
from .base import Transport, frame_key

log = logging.getLogger("asynccoll.transport.memory")

#: collective payloads at least this large are lent to an early receiver instead of copied
#: twice (once now, once into the receive); point-to-point messages are always copied, so
#: that a send never waits for its receive
LEND_MIN_BYTES = 64 * 1024


class MemoryWorld:
    """The ranks of one in-process world."""

    def __init__(self, world_size: int, *, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.max_payload = max_payload
        self.transports = [MemoryTransport(self, r, world_size) for r in range(world_size)]


class MemoryTransport(Transport):
    def __init__(self, world: MemoryWorld, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._world = world

    def post(self, dst: int, head: bytes, payload: memoryview | None
             ) -> asyncio.Future[None] | None:
        """Deliver at once: into the receive when it is posted (one copy, ``None`` returned);
        otherwise a large collective payload is lent until the receiver copies it (the
        returned future), and anything else copied now."""
        self.check_sendable()
        view = payload if payload is not None else memoryview(b"")
        peer = self._world.transports[dst]
        if peer._closed:
            raise PeerLostError(f"world rank {dst} has closed its communicator", rank=dst)
        self.bytes_sent += view.nbytes
        return peer._receive(head, view)

    def _receive(self, head: bytes, payload: memoryview) -> asyncio.Future[None] | None:
        """Decode a frame as a socket reader would, and hand it to the mailbox."""
        try:
            kind, header_len, payload_len = parse_prefix(head[:PREFIX_SIZE],
                                                         self._world.max_payload)
            header = decode_header(head[PREFIX_SIZE:PREFIX_SIZE + header_len], kind)
            check_payload(kind, header, payload_len)
        except ProtocolError:  # pragma: no cover - our own encoder produced these bytes
            log.exception("rank %d: undecodable in-process frame", self.rank)
            raise
        if kind == FrameKind.ABORT:
            self._on_abort_frame(Frame(kind, header, b""))
            return None
        if not self.mailbox.check(kind, header):
            return None
        key = frame_key(kind, header)
        into = self.mailbox.claim(key, payload_len)
        if into is not None:
            into[:] = payload
            self.mailbox.deliver(key, Frame(kind, header, into))
        elif (kind == FrameKind.DATA and payload_len >= LEND_MIN_BYTES
              and not self.mailbox.waiting(key)):
            return self.mailbox.lend(key, Frame(kind, header, payload))
        else:
            owner = np.empty(payload_len, np.uint8)  # no zero-fill: every byte is copied in
            owner.data.cast("B")[:] = payload
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


__all__ = ["MemoryTransport", "MemoryWorld"]
