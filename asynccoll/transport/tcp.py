"""TCP transport: authenticated peer-to-peer connections over asyncio (uvloop when installed).

Each rank listens on a port it reports to the rendezvous. Small frames between two ranks go
both ways over one connection, which the lower rank dials: at start-up each rank dials the
peers above it among those it will talk to most (every peer in a small world; ring
neighbours and the partners of recursive doubling and of the barrier in a larger one) and
waits for those below it to dial (``startup_peers``). A frame's acknowledgement then rides on
the frames going back instead of being a packet of its own: a 2-rank 8-byte all_reduce took
0.85-0.87 x the time of one connection per direction, a 2-rank barrier 0.89 x. Frames with a
payload above ``PAIR_FRAME_BYTES`` go on the sender's own connection, which the higher rank
dials when it first needs it: two large frames crossing on one connection took 1.4 x as long
(a 2-rank 1 MiB all_gather), 64 KiB ones 1.04 x, 32 KiB ones 0.97 x. So does everything a
rank sends a peer that has not dialled it. In a ``crowded`` world (more ranks than cores on
a machine) every rank sends on connections it dialled itself: there the shared connection
cost time (a 4-rank barrier on two cores 1.03-1.12 x, its 8-byte all_reduce level).
Frames of one rank to another may thus take two connections; matching (sequence numbers,
steps and tags; protocol/SPEC.md section 10) makes their order unnecessary, and a rank takes a
peer's frames on any connection with it.

Reading is zero-copy for posted receives: ``BufferedFrameReader`` asks the
mailbox for the buffer a collective posted for the frame's key and the socket reads straight
into it. Writing hands ``[prefix+header, memoryview(payload)]`` to ``writelines`` (small frames:
one joined write); because the event loop may keep a reference to the payload until the kernel
took it, ``post`` then returns a future that resolves once the connection's write buffer has
drained (``None`` when the kernel took everything at once).

A receive that polls reads the connection its peer sends on itself (``TcpTransport.pump``,
through a duplicate of the socket's descriptor), so a small frame is handled without waiting
for an event-loop turn. ``TcpTransport.take_direct`` goes further for frames whose exact
bytes the receiver can predict (the direct all_gather's blocks): it reads each frame's head
into a buffer of its own and compares it with the head the sender's ``HeadCache`` encodes,
then reads the payload straight into the array, with no decoding, mailbox or frame object in
between; a frame that is not the expected one, or not there in time, is handed back to the
connection's reader with whatever was read of it, so that the event loop, which reads the
same socket whenever it runs, always finds the stream where the reader thinks it is.

Failures: a connection of an authenticated peer that ends without a BYE frame means the peer
died; the world is aborted with ``PeerLostError`` naming it and every
rank is told (ABORT frames), so nobody waits for a timeout. A connection that fails the
handshake or breaks the protocol before authenticating is closed and logged; the world goes on.

Forming a world (the rendezvous, the environment, which pairs connect first) is in
``asynccoll.transport.tcp_world``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .._aio import close_server, is_loopback, wait_server_closed, writelines
from ..call import POLL_READS
from ..errors import (
    AuthenticationError,
    CollectiveError,
    CommunicatorClosedError,
    PeerLostError,
    ProtocolError,
)
from ..handshake import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    REASON_JOB,
    REASON_PROTOCOL,
    ClientHandshake,
    ServerHandshake,
    normalize_token,
)
from ..handshake import handshake_timeout as resolve_handshake_timeout
from ..wire import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    Frame,
    FrameHeader,
    FrameKind,
    encode_frame_bytes,
)
from ..wire_stream import BufferedFrameReader, ReduceOnRead
from .base import Key, Transport, checked_payload, frame_key, payload_too_large

log = logging.getLogger("asynccoll.transport.tcp")

# frame kinds looked up once: the hot path compares them per frame
_DATA, _P2P, _ABORT, _BYE = FrameKind.DATA, FrameKind.P2P, FrameKind.ABORT, FrameKind.BYE

#: What losing a peer's connection abruptly does: ``"abort"`` breaks the whole world (every
#: rank raises PeerLostError; the default, what collectives need), ``"isolate"`` fails only
#: what involves that peer (receives from it, sends to it), for worlds whose ranks do not move
#: in lock-step: parameter servers, elastic training.
PEER_LOSS_MODES = ("abort", "isolate")

#: Frames with a larger payload go on a connection of their own (see the module's doc).
PAIR_FRAME_BYTES = 32 * 1024


def check_peer_loss(mode: str) -> str:
    if mode not in PEER_LOSS_MODES:
        raise ValueError(f"peer_loss must be one of {', '.join(PEER_LOSS_MODES)}, got {mode!r}")
    return mode

#: the default handshake timeout, unless ``ASYNCCOLL_HANDSHAKE_TIMEOUT`` or the argument
#: ``handshake_timeout`` sets one (``asynccoll.handshake.handshake_timeout``)
HANDSHAKE_TIMEOUT = DEFAULT_HANDSHAKE_TIMEOUT
#: the staging buffer of a connection until it authenticated (handshake frames are ~100 B;
#: a longer head makes it grow)
HANDSHAKE_STAGE_BYTES = 4096
#: connections a rank accepts in their handshake at once, beyond twice the world size (each
#: peer may dial two: in a crowded world, or for its large frames): one past it drops the
#: oldest still in its handshake (a peer's takes milliseconds, a silent stranger's the
#: handshake timeout), so strangers hold a bounded number of its sockets
MAX_HANDSHAKES = 1024
#: payloads up to this size are copied behind their header and written in one call
SMALL_WRITE_BYTES = 16 << 10
#: collective payloads of at least this size that arrive before their receive is posted
#: are read into buffers of the transport's ScratchPool, reused once copied out (a fresh
#: buffer per frame costs page faults: ~0.8 ms of a 16 MiB all_reduce over 2 ranks)
POOLED_PAYLOAD_BYTES = 64 << 10
_BYTES = np.dtype(np.uint8)
#: the ioctl that tells how many bytes a socket's send queue holds, unsent or not yet
#: acknowledged by the peer (Linux's SIOCOUTQ; None elsewhere)
_SIOCOUTQ: int | None = None
if sys.platform.startswith("linux"):
    import fcntl
    import termios
    _SIOCOUTQ = termios.TIOCOUTQ


#: The congestion control of connections between ranks of one host (see
#: ``congestion_control``). Within a host nothing is ever lost or queued on a wire, so
#: congestion control only decides how fast the window opens and whether sends are paced, and
#: the simplest does best: with Linux's ``bbr`` (a common default, which paces every send
#: with a timer) a 16 MiB all_reduce took 6.6 ms over 2 ranks and 25.9 ms over 4 on 2 cores,
#: with ``cubic`` (whose window grows with wall-clock time, not round trips) 7.9 and 21.3 ms,
#: with ``reno`` 4.7 and 19.2 ms (a 64 MiB broadcast over 2 ranks: 15 against 9.2 ms). One
#: case got slower: a 1 MiB all_gather over 4 ranks on 2 cores, 0.77 ms with bbr, 0.92 with
#: reno. Reno is built into every Linux kernel and always allowed to unprivileged processes.
LOCAL_CONGESTION_CONTROL = "reno"
#: environment variable that overrides ``congestion_control``'s choice
CONGESTION_CONTROL_ENV = "ASYNCCOLL_TCP_CONGESTION"


def congestion_control(sock: socket.socket, setting: str | None = None) -> str | None:
    """The TCP congestion control algorithm to set on a connection between ranks, or ``None``
    to keep the system's (``sysctl net.ipv4.tcp_congestion_control``).

    ``setting`` (default: the ``ASYNCCOLL_TCP_CONGESTION`` environment variable): unset or
    ``"auto"``: ``LOCAL_CONGESTION_CONTROL`` for a peer on this host (a loopback address, or
    this socket's own address), the system's otherwise (a real network is the
    administrator's to tune); ``"system"``: always the system's; any other name: that
    algorithm on every connection.
    """
    if setting is None:
        setting = os.environ.get(CONGESTION_CONTROL_ENV, "auto")
    setting = setting.strip().lower() or "auto"
    if setting == "system":
        return None
    if setting != "auto":
        return setting
    try:
        local, peer = sock.getsockname()[0], sock.getpeername()[0]
        address = ipaddress.ip_address(peer)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1, a dual-stack socket's loopback
        same_host = peer == local or address.is_loopback
    except (OSError, ValueError, IndexError, TypeError):  # not an IP socket, or not connected
        return None
    return LOCAL_CONGESTION_CONTROL if same_host else None


def _tune_socket(sock: socket.socket | None) -> str | None:
    """Set a connection's socket options; what could not be set that the user should know
    (``None`` when all went well)."""
    if sock is None:
        return None
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        # socket buffers are left to the kernel, which grows them with the traffic (up to
        # net.ipv4.tcp_wmem / tcp_rmem's maximum): fixing them at 4 MiB (which also turns
        # the growth off) made a 64 MiB all_reduce over 2 ranks take 34-35 ms against
        # 27.5 ms, a 64 MiB all_gather 21-26 ms against 16 ms
    algorithm = congestion_control(sock)
    if algorithm is not None and hasattr(socket, "TCP_CONGESTION"):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, algorithm.encode())
        except OSError as exc:  # not built into this kernel, or not allowed to this user
            return (f"cannot set TCP congestion control {algorithm!r} "
                    f"({exc.strerror or exc}); keeping the system's")
    return None


#: what one ``_Direct.read`` did
_MOVED, _DONE, _NOTHING, _GIVE_UP = object(), object(), object(), object()


class _Direct:
    """A frame ``TcpTransport.take_direct`` reads itself: its head into ``head_buf``, its
    payload into ``into``. A frame small enough to fit what the reader's staging buffer
    always takes (``HEAD_READ_BYTES``) is read whole into ``head_buf``, one read for both
    parts, and its payload copied into ``into`` once it is there."""

    __slots__ = ("conn", "head", "head_buf", "head_got", "index", "into", "key", "payload_got",
                 "whole")

    def __init__(self, index: int, conn: _Connection, key: Key, head: bytes,
                 into: memoryview) -> None:
        self.index = index
        self.conn = conn
        self.key = key
        self.head = head
        self.into = into
        #: the frame's length when it is read whole into head_buf, else 0
        self.whole = (len(head) + into.nbytes
                      if len(head) + into.nbytes <= BufferedFrameReader.HEAD_READ_BYTES else 0)
        self.head_buf = bytearray(self.whole or len(head))
        self.head_got = 0  # bytes in head_buf
        self.payload_got = 0  # bytes read straight into ``into``

    @property
    def started(self) -> bool:
        return self.head_got > 0

    def read(self) -> object:
        """One non-blocking read: ``_MOVED`` (bytes came), ``_DONE`` (the frame is whole in
        ``into``), ``_NOTHING``, or ``_GIVE_UP`` (not the expected frame, the end of the
        stream or an error: the event loop sees the latter two as well)."""
        raw = self.conn.raw
        if raw is None or self.conn.closed:
            return _GIVE_UP
        head, got = self.head, self.head_got
        size = len(head)
        stop = self.whole or size
        try:
            if got < stop:
                n = raw.recv_into(memoryview(self.head_buf)[got:], stop - got)
            else:
                n = raw.recv_into(self.into[self.payload_got:])
        except BlockingIOError:
            return _NOTHING
        except OSError:
            return _GIVE_UP
        if not n:
            return _GIVE_UP
        conn = self.conn
        owner = conn.owner  # the bytes counted, as in _Connection.buffer_updated
        owner.bytes_received += n
        if conn.peer is not None:
            owner.received_from[conn.peer] += n
        if got < stop:
            got = self.head_got = got + n
            checked = min(got, size)
            if self.head_buf[:checked] != head[:checked]:
                return _GIVE_UP
            if got < stop:
                return _MOVED
            if self.whole:
                self.into[:] = memoryview(self.head_buf)[size:]
                return _DONE
            return _DONE if not self.into.nbytes else _MOVED
        self.payload_got += n
        return _DONE if self.payload_got == self.into.nbytes else _MOVED


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection between two ranks, incoming (we accepted) or outgoing (we dialled)."""

    def __init__(self, owner: TcpTransport, *, dst: int | None = None) -> None:
        self.owner = owner
        self.outgoing = dst is not None
        self.peer: int | None = dst
        self.transport: asyncio.Transport | None = None
        self.authenticated = False
        self.ready: asyncio.Future[None] = owner.loop.create_future()
        self.closed = False
        self.graceful = False
        self._client: ClientHandshake | None = None
        self._server: ServerHandshake | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        # one frame at a time until authenticated (see _handshake_bytes), into a staging
        # buffer no larger than the handshake needs (a full-sized one for every connection
        # anyone opens cost 256 KiB each: 2000 silent connections took 500 MB)
        self.reader = BufferedFrameReader(max_payload=0, one_frame=True,
                                          stage_bytes=HANDSHAKE_STAGE_BYTES)
        self._client_sent_proof = False
        #: this side closed (or aborted) the connection: it logged why if it had to
        self._dropped = False
        #: a second handle on the socket (dup'd descriptor) that receives poll directly
        self.raw: socket.socket | None = None

    # -- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        # uvloop's transports implement asyncio.Transport's interface without subclassing it
        self.transport = transport
        self.owner._open.add(self)
        if self.owner._closed:  # accepted while closing
            transport.abort()
            return
        trouble = _tune_socket(transport.get_extra_info("socket"))
        if trouble is not None and not self.owner._told_socket_trouble:
            self.owner._told_socket_trouble = True  # once per rank, not once per connection
            log.warning("%s", trouble)
        # pause as soon as anything is buffered, resume when everything reached the kernel:
        # the loop may hold references to payload memory until then
        transport.set_write_buffer_limits(high=0, low=0)
        owner = self.owner
        self._timer = owner.loop.call_later(owner.handshake_timeout, self._handshake_expired)
        if self.outgoing:
            self._client = ClientHandshake(owner.token, role="peer", rank=owner.rank, job=owner.job)
            transport.write(encode_frame_bytes(self._client.hello()))
        else:
            self._server = ServerHandshake(owner.token, job=owner.job)
            owner._admit(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if not self.authenticated:
            self._unauthenticated_bytes(nbytes)
            return
        owner = self.owner  # the bytes counted (inline: this runs for every read)
        owner.bytes_received += nbytes
        if self.peer is not None:
            owner.received_from[self.peer] += nbytes
        try:
            for frame in self.reader.buffer_updated(nbytes):
                self._on_frame(frame)
        except (ProtocolError, AuthenticationError) as exc:
            self._protocol_failure(exc)

    def _unauthenticated_bytes(self, nbytes: int) -> None:
        """``buffer_updated`` before the handshake is over. The bytes count as progress (the
        watchdog's) only once the peer proved it knows the token: anyone who can reach the
        port could otherwise keep a stuck collective from ever timing out by trickling bytes
        into new connections."""
        try:
            self._handshake_bytes(nbytes)
        except (ProtocolError, AuthenticationError) as exc:
            self._protocol_failure(exc)
            return
        if self.authenticated:  # (the read that finished it, and any frames behind it)
            owner = self.owner
            owner.bytes_received += nbytes
            if self.peer is not None:
                owner.received_from[self.peer] += nbytes

    def _handshake_bytes(self, nbytes: int) -> None:
        """Bytes of a connection still in its handshake. The reader hands them over a frame
        at a time: the peer may send its first frames right behind the handshake's last
        (the server side of a connection sends on it as soon as it accepted the client),
        and those must be read with the payload limit and sink of an established
        connection, which the handshake frame before them sets up."""
        reader = self.reader
        frames = reader.buffer_updated(nbytes)
        while frames and not self._closing():
            self._on_frame(frames[0])  # the only one
            if self.authenticated:
                reader.one_frame = False
                for frame in reader.buffer_updated(0):
                    self._on_frame(frame)
                return
            frames = reader.buffer_updated(0)

    def received(self, nbytes: int, head: bytes, payload_len: int) -> bytearray | None:
        """``buffer_updated`` for bytes read while a collective waits for a frame it can
        predict (``head``, see ``BufferedFrameReader.take_staged``): that frame's payload when
        it is the next one and whole, else ``None``; every other frame goes to the mailbox
        as usual."""
        owner = self.owner  # as in buffer_updated
        owner.bytes_received += nbytes
        if self.peer is not None:
            owner.received_from[self.peer] += nbytes
        reader = self.reader
        got = None
        try:
            if reader.staging:
                reader.stage(nbytes)
                got = reader.take_staged(head, payload_len)
                nbytes = 0
                if reader.idle:
                    return got
            for frame in reader.buffer_updated(nbytes):
                self._on_frame(frame)
        except (ProtocolError, AuthenticationError) as exc:
            self._protocol_failure(exc)
        return got

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.owner._handshaking.pop(self, None)
        if (not self.authenticated and self._server is not None and not self._dropped
                and not self.owner._closed):
            # the other end gave up on the handshake: as any failed one (SPEC, Failures)
            why = ("stream ended in the middle of a frame" if not self.reader.idle
                   else self._server.closed_early())
            log.warning("rank %d: dropped %s: %s%s", self.owner.rank, self._peername(), why,
                        f" ({exc})" if exc is not None else "")
        self._set_paused(False)  # nothing of it waits to be written any more
        if self.raw is not None:
            self.raw.close()
            self.raw = None
        self.owner._open.discard(self)
        if self.peer is not None:
            self.owner._forget(self)
        if self._timer is not None:
            self._timer.cancel()
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(
                f"connection lost during the handshake: {exc}" if exc is not None else
                "the other end closed the connection during the handshake"))
            self.ready.exception()  # mark retrieved; the dialler reports it
        self._wake_drain()
        self.owner._connection_lost(self, exc)

    def pause_writing(self) -> None:
        self._set_paused(True)

    def resume_writing(self) -> None:
        self._set_paused(False)
        self._wake_drain()

    def _set_paused(self, paused: bool) -> None:
        """With write buffer limits of 0, paused means bytes wait in the event loop; the
        owner counts its connections in that state (``TcpTransport.flushed``)."""
        if paused != self._paused:
            self._paused = paused
            self.owner._unflushed += 1 if paused else -1

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def drain_future(self) -> asyncio.Future[None]:
        """Resolves when everything written so far reached the kernel, or the connection is
        gone (the owner then aborts the world, which the waiter checks)."""
        if self._drain is None:
            self._drain = self.owner.loop.create_future()
        return self._drain

    # -- frames ---------------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        if not self.authenticated:
            self._handshake_step(frame)
            return
        kind = frame.kind
        owner = self.owner
        if kind is _DATA or kind is _P2P:
            owner.mailbox.deliver(frame_key(kind, frame.header), frame)
        elif kind == FrameKind.ABORT:
            owner._on_abort_frame(frame)
        elif kind == FrameKind.CLOSE:
            owner._on_close_frame(frame)
        elif kind == FrameKind.BYE:
            self.graceful = True
            owner._said_bye(self.peer)  # type: ignore[arg-type]
        else:
            raise ProtocolError(f"unexpected {kind.name} frame on an established connection")

    def _sink(self, kind: FrameKind, header: FrameHeader, nbytes: int
              ) -> memoryview | ReduceOnRead | None:
        if header.src != self.peer:
            raise ProtocolError(f"frame claims source rank {header.src} on the connection of "
                                f"rank {self.peer}")
        if kind is not _DATA and kind is not _P2P:
            return None
        owner = self.owner
        if self.raw is not None:  # a polled receive reads the connection the peer sends on
            read = owner._in if nbytes <= PAIR_FRAME_BYTES else owner._in_large
            if read.get(header.src) is not self:
                read[header.src] = self
        mailbox = owner.mailbox
        if not mailbox.check(kind, header):
            return None
        key = frame_key(kind, header)
        if kind is _DATA:
            reduce = mailbox.claim_reducing(key, nbytes)
            if reduce is not None:  # combined into its array as it is read
                return reduce
        into = mailbox.claim(key, nbytes)
        if (into is None and nbytes >= POOLED_PAYLOAD_BYTES and kind is _DATA
                and not mailbox.waiting(key)):
            # early (no receive posted yet): into a pooled buffer, which the mailbox gives
            # back once the payload was copied out or released (see asynccoll.scratch)
            return owner.scratch.take(nbytes, _BYTES).data
        return into

    def _handshake_step(self, frame: Frame) -> None:
        assert self.transport is not None
        owner = self.owner
        if self._client is not None:
            if not self._client_sent_proof:
                self.transport.write(encode_frame_bytes(self._client.on_challenge(frame)))
                self._client_sent_proof = True
                return
            self._client.on_result(frame)
            self._established()
            return
        assert self._server is not None
        try:
            if self._server.peer_role is None:
                self.transport.write(encode_frame_bytes(self._server.on_hello(frame)))
                return
            # the world's job id may have been set (tcp_init: from the roster) since this
            # connection was accepted
            self._server.job = owner.job
            reply = self._server.on_proof(frame)
        except ProtocolError:  # a whole frame, but not the one due: say so (SPEC, Failures)
            self.transport.write(encode_frame_bytes(self._server.reject_frame(REASON_PROTOCOL)))
            raise
        peer = self._server.peer_rank
        if self._server.accepted or (self._server.reason == REASON_JOB
                                     and self._server.peer_role != "peer"):
            # (a rendezvous client given a rank's port is told so, not of another job)
            refusal = self._refusal(peer)
            if refusal is not None:
                reply = self._server.reject_frame(refusal)
        self.transport.write(encode_frame_bytes(reply))
        if not self._server.accepted:
            log.warning("rank %d: rejected a connection from %s: %s", owner.rank,
                        self._peername(), self._server.reason)
            self._close()
            return
        self.peer = peer
        self._established()

    def _refusal(self, peer: int | None) -> str | None:
        """Why an incoming connection that proved it knows the token is still refused: it is
        not a peer of this world, or it claims a rank that has left the world or that
        already has its connection to this rank (a rank dials each peer once: a second one
        is another process, which would otherwise take frames for that rank, and break the
        world when it closed)."""
        owner = self.owner
        assert self._server is not None
        if (self._server.peer_role != "peer" or peer is None
                or not 0 <= peer < owner.world_size or peer == owner.rank):
            return f"rank {peer} is not a peer of this world"
        if owner._unreachable(peer) is not None:
            return f"rank {peer} has left this world"
        if any(not c.outgoing for c in owner._live_connections(peer)):
            return f"rank {peer} is already connected"
        return None

    def _established(self) -> None:
        self.owner._handshaking.pop(self, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.authenticated = True
        self.reader.grow()
        self.reader.max_payload = self.owner.max_payload
        self.reader.sink = self._sink
        owner, peer = self.owner, self.peer
        assert peer is not None
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    raw = socket.socket(fileno=os.dup(sock.fileno()))
                    raw.setblocking(False)
                    self.raw = raw
                    # the first connection of a pair is read directly until frames arrive
                    # on another (_sink)
                    owner._in.setdefault(peer, self)
        if not self.outgoing and peer < owner.rank:
            if not owner.crowded:  # small frames to it go on this one
                owner._pair.setdefault(peer, self)
            arrival = owner._arrivals.pop(peer, None)
            if arrival is not None and not arrival.done():
                arrival.set_result(None)
        log.debug("rank %d: %s connection with rank %s established", self.owner.rank,
                  "outgoing" if self.outgoing else "incoming", self.peer)
        if not self.ready.done():
            self.ready.set_result(None)

    def _handshake_expired(self) -> None:
        self._timer = None
        if not self.authenticated:
            log.warning("rank %d: dropped %s: handshake not finished within %.1f s",
                        self.owner.rank, self._peername(), self.owner.handshake_timeout)
            if not self.ready.done():
                self.ready.set_exception(TimeoutError("handshake timed out"))
                self.ready.exception()
            self._close()

    def _protocol_failure(self, exc: Exception) -> None:
        if self.authenticated:
            log.warning("rank %d: rank %s broke the protocol: %s", self.owner.rank, self.peer, exc)
            self.owner.abort(PeerLostError(f"world rank {self.peer} sent an invalid frame: {exc}",
                                           rank=self.peer))
        else:
            log.warning("rank %d: dropped %s: %s", self.owner.rank, self._peername(), exc)
            if not self.ready.done():
                self.ready.set_exception(exc)
                self.ready.exception()
        self._close()

    # -- writing --------------------------------------------------------------------------

    def write(self, head: bytes, payload: memoryview | None) -> None:
        """Queue one frame. A payload goes to the event loop whole, in one gather write with
        its head: the kernel cuts it into packets as it copies, and the receiver copies the
        first ones out while the rest go in. (Cutting a large payload into 256 KiB writes
        was faster under bbr with fixed 4 MiB socket buffers; under reno with autotuned
        buffers it only costs: a 1 MiB broadcast between 2 ranks took 248 us cut, 168 us
        whole, a 64 MiB one 16.2 against 12.5 ms.)"""
        assert self.transport is not None
        if payload is None or not payload.nbytes:
            self.transport.write(head)
        elif payload.nbytes <= SMALL_WRITE_BYTES:  # one small copy beats a gather write
            self.transport.write(head + payload)
        elif self._paused:
            self.transport.writelines([head, payload])
        else:  # (the loop's own pause check misses gather writes on CPython 3.12, 3.13.0)
            writelines(self.transport, [head, payload])

    def in_kernel(self) -> int:
        """Bytes of the socket's send queue (written, not yet acknowledged by the peer): on
        a slow link most of a large transfer waits there, not in the event loop."""
        if _SIOCOUTQ is None or self.transport is None or self.closed:
            return 0
        sock = self.transport.get_extra_info("socket")
        try:
            queued = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
        except (OSError, AttributeError, ValueError):
            return 0
        return int.from_bytes(queued, sys.byteorder, signed=True)

    def _closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def _close(self) -> None:
        self._dropped = True
        if self.transport is not None and not self.closed:
            self.transport.close()

    def _abort(self) -> None:
        self._dropped = True
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def _peername(self) -> str:
        if self.transport is None:
            return "?"
        peer = self.transport.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if peer else "?"


class TcpTransport(Transport):
    """The TCP transport of one rank. Create with ``start``."""

    def __init__(self, rank: int, world_size: int, *, token: str | bytes | None = None,
                 job: str = "", max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 handshake_timeout: float | None = None,
                 peer_loss: str = "abort") -> None:
        super().__init__(rank, world_size)
        self.mailbox.reclaim = self.scratch.reclaim
        self.peer_loss = check_peer_loss(peer_loss)
        self.loop = asyncio.get_running_loop()
        normalize_token(token)  # a token that cannot be a key fails here, not in a callback
        self.token = token
        self.job = job
        self.max_payload = max_payload
        #: seconds a connection may take to connect and finish the handshake
        self.handshake_timeout = resolve_handshake_timeout(handshake_timeout)
        self.addresses: dict[int, tuple[str, int]] = {}
        self._server: asyncio.Server | None = None
        self._out: dict[int, _Connection] = {}
        self._dialing: dict[int, asyncio.Future[_Connection]] = {}
        self._queued: dict[int, list[tuple[bytes, memoryview | None, asyncio.Future[None]]]] = {}
        #: connections whose writes wait in the event loop (see _Connection._set_paused)
        self._unflushed = 0
        #: per peer, the connection its small frames arrive on and the one its large frames
        #: arrive on (PAIR_FRAME_BYTES), which polled receives read directly
        self._in: dict[int, _Connection] = {}
        self._in_large: dict[int, _Connection] = {}
        #: per peer below this rank, the connection it dialled, on which this rank sends it
        #: small frames (``_out``: the connections this rank dialled, for everything else)
        self._pair: dict[int, _Connection] = {}
        #: peers below this rank whose connection start-up waits for (connect_peers)
        self._arrivals: dict[int, asyncio.Future[None]] = {}
        # ranks that closed their communicator (sends to them fail; see _connection_lost)
        self._gone: dict[int, PeerLostError] = {}
        self._open: set[_Connection] = set()  # every connection until connection_lost
        #: the incoming connections in their handshake, oldest first (see _admit)
        self._handshaking: dict[_Connection, None] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._on_close: list[Callable[[], Any]] = []
        self.polls = True
        self.reduces_on_read = True
        self.reads_direct = True
        self.guards_sends = True  # a frozen peer never drains: an ABORT must end the wait
        per_core = _ranks_per_core()
        self.yields = per_core > 1
        self.spins = 1 < per_core <= 2
        self.hands_over = per_core >= 2
        self._told_socket_trouble = False

    def _admit(self, conn: _Connection) -> None:
        """Count ``conn``, just accepted, among those in their handshake; past
        ``MAX_HANDSHAKES`` beyond twice the world size, drop the oldest of them."""
        most = MAX_HANDSHAKES + 2 * self.world_size
        if len(self._handshaking) >= most:
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            log.warning("rank %d: dropped %s: still in its handshake when %d were (the most "
                        "it takes at once), the oldest", self.rank, oldest._peername(),
                        most)
            oldest._abort()
        self._handshaking[conn] = None

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Start accepting peer connections; returns the bound (host, port)."""
        # not serving yet: create_server's own turn of the loop after binding would, if
        # cancelled there, lose the listening socket (close() would not know it)
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, start_serving=False)
        await self._server.start_serving()
        sockname = self._server.sockets[0].getsockname()
        if not self.token and not is_loopback(sockname[0]):
            log.warning("rank %d listens on %s:%d without a token: anyone who can reach it "
                        "can join the world as a rank and feed it data (set ASYNCCOLL_TOKEN)",
                        self.rank, sockname[0], sockname[1])
        return sockname[0], sockname[1]

    # -- sending --------------------------------------------------------------------------

    async def _connection(self, dst: int) -> _Connection:
        conn = self._out.get(dst)
        if conn is not None and not conn.closed:
            return conn
        dialing = self._dialing.get(dst)
        if dialing is None:
            dialing = asyncio.ensure_future(self._dial(dst))
            self._dialing[dst] = dialing
            dialing.add_done_callback(functools.partial(self._dial_done, dst))
        return await asyncio.shield(dialing)

    def _said_bye(self, peer: int) -> None:
        """``peer`` closed its communicator (a BYE on one of our connections with it): sends
        to it fail from now on; receives once every connection with it is closed (see
        ``_connection_lost``)."""
        self._gone.setdefault(
            peer, PeerLostError(f"world rank {peer} has closed its communicator", rank=peer))
        self._out.pop(peer, None)
        self._pair.pop(peer, None)

    def _live_connections(self, peer: int) -> Iterator[_Connection]:
        """The open, authenticated connections with ``peer`` (either direction)."""
        return (c for c in self._open if c.peer == peer and c.authenticated and not c.closed)

    def _forget(self, conn: _Connection) -> None:
        """``conn`` closed: drop it from where it was looked up; a polled receive reads the
        peer's other connection, if any."""
        peer = conn.peer
        assert peer is not None
        if self._pair.get(peer) is conn:
            del self._pair[peer]
        if self._in_large.get(peer) is conn:
            del self._in_large[peer]
        if self._in.get(peer) is conn:
            del self._in[peer]
            other = next((c for c in self._live_connections(peer) if c.raw is not None), None)
            if other is not None:
                self._in[peer] = other

    def _unreachable(self, dst: int) -> CollectiveError | None:
        """Why nothing can be sent to ``dst`` any more (lost, or closed its communicator)."""
        return self.mailbox._lost.get(dst) or self._gone.get(dst)

    def _dial_done(self, dst: int, fut: asyncio.Future[_Connection]) -> None:
        self._dialing.pop(dst, None)
        if not fut.cancelled():
            fut.exception()  # retrieved: whoever awaits it raises it, if anyone still does

    async def _dial(self, dst: int) -> _Connection:
        lost = self._unreachable(dst)
        if lost is not None:
            raise lost.with_traceback(None)  # (kept: see Mailbox.take)
        try:
            host, port = self.addresses[dst]
        except KeyError:
            raise CollectiveError(f"no address known for world rank {dst}") from None
        conn: _Connection | None = None
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can drop a connection that is
            # made just as it times out, leaking the socket
            async with asyncio.timeout(self.handshake_timeout):
                _, conn = await self.loop.create_connection(
                    functools.partial(_Connection, self, dst=dst), host, port)
                await asyncio.shield(conn.ready)
        except BaseException as exc:
            if conn is not None:
                conn._abort()
            if isinstance(exc, AuthenticationError):
                raise CollectiveError(f"world rank {dst} at {host}:{port} refused us: "
                                      f"{exc}") from None
            # (ProtocolError: what answered there speaks no asynccoll, a stale address)
            if isinstance(exc, (OSError, ConnectionError, TimeoutError, ProtocolError)):
                why = str(exc) or type(exc).__name__
                raise PeerLostError(f"cannot connect to world rank {dst} at {host}:{port}: "
                                    f"{why}", rank=dst) from None
            raise
        if self._closed:
            conn._abort()
            raise CommunicatorClosedError("the communicator was closed while connecting")
        self._out[dst] = conn
        return conn

    async def connect_peers(self, peers: Iterable[int]) -> None:
        """Open the connections to ``peers`` now, one per pair: dial those above this rank
        and wait for those below it to dial us (for at most the handshake timeout, then dial
        them after all). In a ``crowded`` world, dial them all (one connection per
        direction, see the module's doc)."""
        peers = sorted(set(peers) - {self.rank})
        tasks = [asyncio.ensure_future(self._connection(p) if p > self.rank or self.crowded
                                       else self._await_dial(p)) for p in peers]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _await_dial(self, peer: int) -> None:
        if self._pair.get(peer) is None:
            arrival = self._arrivals[peer] = self.loop.create_future()
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.handshake_timeout):
                        await arrival
            finally:
                self._arrivals.pop(peer, None)
        if self._pair.get(peer) is None:
            await self._connection(peer)

    async def connect(self, dst: int) -> None:
        """Open a connection of our own to ``dst`` now (``connect_peers`` opens one per
        pair)."""
        await self._connection(dst)

    def post(self, dst: int, head: bytes, payload: memoryview | None
             ) -> asyncio.Future[None] | None:
        self.check_sendable()
        nbytes = payload.nbytes if payload is not None else 0
        if nbytes > self.max_payload:
            raise ValueError(payload_too_large(nbytes, self.max_payload))
        self.bytes_sent += nbytes
        conn = self._pair.get(dst) if nbytes <= PAIR_FRAME_BYTES else None
        if conn is None:
            conn = self._out.get(dst)
        if conn is not None and not conn.closed:
            conn.write(head, payload)
            return conn.drain_future() if conn._paused else None
        lost = self._unreachable(dst)
        if lost is not None:
            raise lost.with_traceback(None)  # (kept: see Mailbox.take)
        # not connected yet: queue in order behind one dial
        fut: asyncio.Future[None] = self.loop.create_future()
        queue = self._queued.get(dst)
        if queue is None:
            queue = self._queued[dst] = []
            self._spawn(self._dial_and_flush(dst))
        queue.append((head, payload, fut))
        return fut

    async def _dial_and_flush(self, dst: int) -> None:
        try:
            conn = await self._connection(dst)
        except asyncio.CancelledError:
            # close() cancels the dial (one to a frozen peer waits for its handshake): the
            # sends queued behind it fail, or they would wait for ever (no watchdog then)
            closed = CommunicatorClosedError("the communicator was closed")
            for _, _, fut in self._queued.pop(dst, []):
                if not fut.done():
                    fut.set_exception(closed)
                    fut.exception()
            raise
        except CollectiveError as exc:
            for _, _, fut in self._queued.pop(dst, []):
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()
            if self.peer_loss == "abort":
                self.abort(exc)
            elif isinstance(exc, PeerLostError):
                self.mailbox.peer_lost(dst, exc)
            return
        queued = self._queued.pop(dst, [])
        for head, payload, _ in queued:
            conn.write(head, payload)
        if conn._paused:
            await conn.drain_future()
        for _, _, fut in queued:
            if not fut.done():
                fut.set_result(None)

    def _reading_conn(self, src: int, nbytes: int | None) -> _Connection | None:
        """The connection ``src``'s frames of ``nbytes`` of payload (unknown: ``None``)
        arrive on, as far as this rank has seen (see ``_Connection._sink``)."""
        conn = None
        if nbytes is not None and nbytes > PAIR_FRAME_BYTES:
            conn = self._in_large.get(src)
        return conn if conn is not None else self._in.get(src)

    def pump(self, src: int, nbytes: int | None = None) -> bool:
        """One non-blocking read of ``src``'s connection into the frame reader (see
        Transport.pump). It reads through a duplicate of the socket's descriptor, which the
        event loop also watches: whichever reads first gets the bytes, and the reader's state
        is the same either way. Errors and the end of the stream are left to the event loop,
        which sees them too and runs the usual failure handling."""
        conn = self._reading_conn(src, nbytes)
        if conn is None or conn.raw is None or conn.closed:
            return False
        try:
            n = conn.raw.recv_into(conn.reader.get_buffer())
        except OSError:  # nothing there (BlockingIOError), or the loop will see the error
            return False
        if not n:  # end of stream: the event loop sees it too
            return False
        conn.buffer_updated(n)
        return True

    def check_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Its connections are the loop's that formed the world: used from a later
        ``asyncio.run()``, small calls went through by chance and larger ones raised 'Event
        loop is closed' from inside the transport."""
        if loop is not self.loop:
            state = "closed now" if self.loop.is_closed() else "still open"
            raise RuntimeError(
                f"this tcp communicator (world rank {self.rank}) was formed in another event "
                f"loop ({state}: every asyncio.run() runs a loop of its own), and its "
                f"connections belong to that loop; form the world in the loop that uses it")

    def unsent_bytes(self, dst: int | None = None) -> int:
        """Bytes the event loop still has to write (its buffers), and those queued behind a
        dial, to ``dst`` or to anyone."""
        n = sum(c.transport.get_write_buffer_size() for c in self._open
                if c.transport is not None and not c.closed and (dst is None or c.peer == dst))
        return n + sum(len(head) + (payload.nbytes if payload is not None else 0)
                       for peer, queue in self._queued.items() if dst is None or peer == dst
                       for head, payload, _ in queue)

    def outgoing_bytes(self, dst: int | None = None) -> int:
        """``unsent_bytes`` and the bytes the kernel still holds for the connections (to
        ``dst``): they go out at the link's pace, which the watchdog counts as progress (on
        authenticated connections only: a stranger reading our CHALLENGE is none)."""
        return self.unsent_bytes(dst) + sum(
            c.in_kernel() for c in self._open
            if c.authenticated and (dst is None or c.peer == dst))

    def flushed(self) -> bool:
        # O(1): the connections count themselves in and out as the event loop pauses and
        # resumes their writing (a polled receive asks after every read)
        return not self._queued and not self._unflushed

    def poll_payload(self, key: Key, sig: tuple[Any, ...], reads: int, expect: bytes | None,
                     nbytes: int) -> Any:
        """See Transport.poll_payload: here a frame that is exactly the ``expect`` head is
        taken straight out of the bytes read (``_Connection.received``), with no decoding,
        no mailbox and no frame object. It reads the connection the sender's frames of
        ``nbytes`` arrive on (as ``pump`` does: a payload above ``PAIR_FRAME_BYTES`` comes on
        the sender's own connection), room for the whole frame at once
        (``BufferedFrameReader.get_buffer_for``), and while a frame is partly read and none
        of this rank's frames wait for the event loop, it reads on as long as bytes come
        (2 ranks, 64 KiB all_reduce 0.5 x the time, 48 KiB 0.45 x)."""
        if expect is None:
            return super().poll_payload(key, sig, reads, expect, nbytes)
        frame = self.mailbox.take(key, None)
        if frame is not None:
            return checked_payload(frame, sig)
        conn = self._reading_conn(key[0], nbytes)
        if not reads or conn is None or conn.raw is None or conn.closed:
            return None
        reader, recv_into, yields = conn.reader, conn.raw.recv_into, self.yields
        whole = len(expect) + nbytes
        left = reads
        while left:
            try:
                n = recv_into(reader.get_buffer_for(whole))
            except OSError:  # nothing there (BlockingIOError), or the loop will see the error
                n = 0
            if n:
                got = conn.received(n, expect, nbytes)
                if got is not None:
                    return got
                frame = self.mailbox.take(key, None)
                if frame is not None:
                    return checked_payload(frame, sig)
                if reader.idle or conn.closed or conn.raw is None or not self.flushed():
                    return None
                # a frame is partly read and nothing of this rank's waits for the event
                # loop: its sender is still writing it, so read on (as long as bytes keep
                # coming) rather than give the loop a turn it would spend reading the rest
                left = reads
                continue
            left -= 1
            if yields:
                os.sched_yield()
        return None

    async def take_direct(self, want: Sequence[tuple[Key, bytes, memoryview]],
                          sig: tuple[Any, ...], window: float
                          ) -> list[asyncio.Future[Frame] | None]:
        """See Transport.take_direct. Each frame is read from the connection its sender's
        frames of that size arrive on (as ``pump`` does): its head, exactly ``len(head)``
        bytes of it, into a buffer of its own, then the payload straight into ``into`` (a
        frame of at most ``HEAD_READ_BYTES`` in all: both in one read, see ``_Direct``). Only
        connections whose reader sits idle at a frame boundary, and keys the mailbox knows
        nothing of, qualify; the event loop, which also reads these sockets, runs only where
        this waits (``await``), and every frame partly read is handed back to the connection's
        reader first (``_hand_back``), so both always agree on where each stream stands."""
        out: list[asyncio.Future[Frame] | None] = [None] * len(want)
        live: list[_Direct] = []
        for i, (key, head, into) in enumerate(want):
            conn = self._direct_conn(key, head, into)
            if conn is None or any(d.conn is conn for d in live):
                # one frame at a time per connection: a second one there goes the usual way
                out[i] = self.post_recv(key, into, sig)
            else:
                live.append(_Direct(i, conn, key, head, into))
        deadline = time.perf_counter() + window
        yields = self.yields
        while live:
            moved = False
            for _ in range(POLL_READS):
                for d in list(live):
                    got = d.read()
                    if got is _MOVED:
                        moved = True
                    elif got is _DONE:
                        moved = True
                        live.remove(d)
                    elif got is _GIVE_UP:
                        live.remove(d)
                        out[d.index] = self._hand_back(d, sig)
                if moved or not live:
                    break
                if yields:
                    os.sched_yield()
            if not live or (moved and self.flushed()):
                continue
            # let the event loop run (it may have this rank's own frames to write, which the
            # peers may be waiting for): what was read of a frame goes back to its reader
            # first, since the loop reads the same sockets
            expired = time.perf_counter() >= deadline
            for d in list(live):
                if expired or d.started:
                    live.remove(d)
                    out[d.index] = self._hand_back(d, sig)
            if not live:
                break
            await asyncio.sleep(0)
            for d in list(live):
                if self._direct_conn(d.key, d.head, d.into) is not d.conn:
                    live.remove(d)
                    out[d.index] = self.post_recv(d.key, d.into, sig)
        return out

    def _direct_conn(self, key: Key, head: bytes, into: memoryview) -> _Connection | None:
        """The connection ``take_direct`` may read the frame of ``key`` from, if any."""
        conn = self._reading_conn(key[0], into.nbytes)
        if (conn is None or conn.raw is None or conn.closed or not conn.reader.idle
                or len(head) > BufferedFrameReader.HEAD_READ_BYTES
                or not self.mailbox.untouched(key)):
            return None
        return conn

    def _hand_back(self, d: _Direct, sig: tuple[Any, ...]) -> asyncio.Future[Frame]:
        """Post the usual receive for ``d``'s frame and give what was read of it to its
        connection's reader, as if the event loop had read it. A receive that cannot be
        posted (the world broke, the peer is lost) comes back as a failed future, after the
        bytes went to the reader all the same: the stream stays readable either way."""
        try:
            fut = self.post_recv(d.key, d.into, sig)
        except CollectiveError as exc:
            fut = self.loop.create_future()
            fut.set_exception(exc)
            fut.exception()  # retrieved: whoever awaits it raises it, nobody else has to
        self._replay(d)
        return fut

    def _replay(self, d: _Direct) -> None:
        """The head's bytes ``d`` read (a small frame's: all it read) go into the reader's
        staging buffer and are parsed there; the payload's bytes (in ``d.into`` already,
        where the reader puts a claimed payload) are then counted into the payload the
        reader is filling."""
        conn = d.conn
        if not d.head_got or conn.closed:
            return
        reader = conn.reader
        reader.get_buffer()[:d.head_got] = d.head_buf[:d.head_got]
        conn.buffer_updated(d.head_got)
        if not d.payload_got or conn.closed:
            return
        dest = reader.filling  # the expected head was read whole, so its payload is pending
        if dest is None or dest.nbytes < d.payload_got:  # pragma: no cover - see above
            conn._protocol_failure(ProtocolError("a frame read directly lost its payload"))
            return
        if dest is not d.into:  # not claimed by the receive (it failed): the reader's buffer
            dest[:d.payload_got] = d.into[:d.payload_got]
        conn.buffer_updated(d.payload_got)

    # -- failures -------------------------------------------------------------------------

    def _connection_lost(self, conn: _Connection, exc: Exception | None) -> None:
        if conn.outgoing and self._out.get(conn.peer) is conn:  # type: ignore[arg-type]
            del self._out[conn.peer]  # type: ignore[arg-type]
        if not conn.authenticated or self._closed or conn.peer is None:
            return
        peer = conn.peer
        if conn.graceful:
            log.debug("rank %d: rank %d closed its communicator", self.rank, peer)
            self._said_bye(peer)
            err = self._gone[peer]
            # What it sent before closing still arrives on the connection it sent on, where
            # its BYE comes last (a rank returns from a collective with the tail of its data
            # still queued; it is flushed on close): receives from it fail only once every
            # connection with it is closed, not when the first one is.
            if next(self._live_connections(peer), None) is None:
                self.mailbox.peer_lost(peer, err)
            return
        reason = f": {exc}" if exc else ""
        # (a crowded world has two connections with each peer: one fault, one warning)
        level = logging.DEBUG if peer in self.mailbox._lost else logging.WARNING
        log.log(level, "rank %d: lost connection to rank %d%s", self.rank, peer, reason)
        err = PeerLostError(f"lost the connection to world rank {peer}{reason}", rank=peer)
        self.mailbox.peer_lost(peer, err)
        if self.peer_loss == "abort":
            self.abort(err)

    def _notify_abort(self, frame: Frame) -> None:
        data = encode_frame_bytes(frame)
        for dst in range(self.world_size):
            if dst == self.rank or self._unreachable(dst) is not None:
                continue
            conn = self._out.get(dst)
            if conn is None or conn.closed:  # any other connection with it works too
                conn = next(self._live_connections(dst), None)
            if conn is not None:
                conn.write(data, None)
            elif dst in self.addresses:
                self._spawn(self._send_abort(dst, data))

    async def _send_abort(self, dst: int, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.handshake_timeout):
                conn = await self._connection(dst)
            conn.write(data, None)
        except (CollectiveError, OSError, TimeoutError) as exc:
            log.debug("rank %d: could not tell rank %d about the abort: %s", self.rank, dst, exc)

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- closing --------------------------------------------------------------------------

    async def _close(self) -> None:
        if self._server is not None:
            await close_server(self._server)
        stragglers = [*self._background, *self._dialing.values()]
        for task in stragglers:
            task.cancel()
        # let cancelled dials close the sockets they opened
        await asyncio.gather(*stragglers, return_exceptions=True)
        # every connection, the ones we dialled and the ones we accepted (which we may send
        # on too, see the module's doc)
        conns = list(self._open)
        bye = encode_frame_bytes(Frame(FrameKind.BYE, FrameHeader(src=self.rank), b""))
        for conn in conns:
            if conn.transport is not None and not conn.closed:
                if conn.authenticated:
                    conn.transport.write(bye)
                conn.transport.close()
        # give the loop a moment to flush BYE frames and run connection_lost callbacks
        for _ in range(50):
            if all(c.closed for c in conns):
                break
            await asyncio.sleep(0.01)
        for conn in list(self._open):
            conn._abort()
        for _ in range(100):  # sockets close in connection_lost callbacks: let them run
            if not self._open:
                break
            await asyncio.sleep(0.01)
        for _ in range(3):  # and those of cancelled dials that never reached connection_made
            await asyncio.sleep(0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await wait_server_closed(self._server)
        await asyncio.gather(*self._background, return_exceptions=True)
        for callback in self._on_close:
            with contextlib.suppress(Exception):
                await callback()


# ------------------------------------------------------- environment and addresses

def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return None


def local_world_size() -> int:
    """The ranks on this machine: ASYNCCOLL_LOCAL_WORLD_SIZE, else LOCAL_WORLD_SIZE, else 1.
    A value that is no positive integer is a ``ValueError`` naming the variable (it was taken
    as 1 in silence: a typo then changed, unseen, how ranks poll and whether the world is
    crowded)."""
    for name in ("ASYNCCOLL_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # ASYNCCOLL_ wins
        local = _env(name)
        if local is None:
            continue
        try:
            ranks = int(local)
        except ValueError:
            ranks = 0
        if ranks < 1:
            raise ValueError(f"{name} must be a positive integer (the ranks on this "
                             f"machine), got {local!r}")
        return ranks
    return 1


def _ranks_per_core() -> float:
    """Ranks on this machine per core this rank may run on: at most 1, every rank can have a
    core (so polling steals from no one)."""
    ranks = local_world_size()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ranks / (cores or 1)


#: names that moved to ``tcp_world`` (forming worlds), still importable from here; looked up
#: there on first use, since ``tcp_world`` imports this module
_WORLD_NAMES = frozenset({"MESH_RANKS", "startup_peers", "tcp_init", "tcp_local_world",
                          "tcp_store_world", "world_crowded"})


def __getattr__(name: str) -> Any:
    if name in _WORLD_NAMES:
        from . import tcp_world

        return getattr(tcp_world, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PEER_LOSS_MODES", "TcpTransport", "tcp_init",  # noqa: F822 (the last three: __getattr__)
           "tcp_local_world", "tcp_store_world"]
