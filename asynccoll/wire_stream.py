"""The caches and readers of one connection's frame stream, sans-IO (see ``asynccoll.wire``).

``HeadCache`` encodes the heads of the DATA frames a rank sends again and again,
``HeaderMemo`` decodes the headers of one incoming stream, remembering those it has seen;
``BufferedFrameReader`` reads a stream of frames for ``asyncio.BufferedProtocol``-style I/O,
payloads straight into the buffers receives posted (or reduced into them: ``ReduceOnRead``).
The frame format itself (prefix, header, validation) is ``asynccoll.wire``'s. Sans-IO as
``wire`` is: this module imports nothing of asynccoll but ``wire``, and no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

import msgpack
import numpy as np

from .wire import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    PREFIX_SIZE,
    VERSION,
    Frame,
    FrameHeader,
    FrameKind,
    _check_prefix,
    _decode_data_header,
    _trusted_header,
    check_payload,
    decode_header,
)


def _pack_uint(n: int) -> bytes:
    """msgpack's (shortest) encoding of a non-negative int, as ``msgpack.packb`` gives it."""
    if n < 0x80:
        return _U8.pack(n)
    if n <= 0xFF:
        return b"\xcc" + _U8.pack(n)
    if n <= 0xFFFF:
        return b"\xcd" + _U16.pack(n)
    if n <= 0xFFFFFFFF:
        return b"\xce" + _U32S.pack(n)
    return b"\xcf" + _U64S.pack(n)


_U8 = struct.Struct("B")
_U16 = struct.Struct("!H")
_U32S = struct.Struct("!I")
_U64S = struct.Struct("!Q")


class HeadCache:
    """``encode_data_head`` for the frames a rank sends again and again.

    Successive collectives of one kind differ in their headers only by the sequence number,
    so the encoding is kept as the bytes before and after it (a msgpack map is the
    concatenation of its keys' and values' encodings, in order), and a frame's head is those
    two around the packed number: the same bytes as ``encode_data_head``, in a third of
    the time. Bounded: the cache starts over after ``limit`` distinct headers.
    """

    __slots__ = ("_parts", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self._parts: dict[tuple[Any, ...], tuple[int, bytes, bytes]] = {}
        self.limit = limit

    def data_head(self, kind: int, group: int, seq: int, step: int, tag: int, src: int,
                  dtype: str, shape: tuple[int, ...], sig: tuple[Any, ...] | None,
                  payload_len: int) -> bytes:
        key = (kind, group, step, tag, src, dtype, shape, sig)
        parts = self._parts.get(key)
        if parts is None:
            if len(self._parts) >= self.limit:
                self._parts.clear()
            obj: dict[str, Any] = {"s": step, "t": tag, "r": src, "d": dtype, "h": shape}
            if sig is not None:
                obj["c"] = sig
            after = msgpack.packb(obj, use_bin_type=True)
            # the map's own header (fixmap of len(obj) + 2 entries), then "g": group, "q"
            before = (bytes([0x80 | (len(obj) + 2)]) + msgpack.packb("g") + _pack_uint(group)
                      + msgpack.packb("q"))
            parts = self._parts[key] = (kind, before, after[1:])  # drop the inner map's header
        kind, before, after = parts
        body = before + _pack_uint(seq) + after
        return PREFIX.pack(MAGIC, VERSION, kind, 0, len(body), payload_len) + body


def _read_uint(b: bytes, pos: int) -> tuple[int, int]:
    """A msgpack unsigned int at ``b[pos]``: ``(value, next position)``; ``(-1, pos)`` when
    something else is there (or nothing: a header cut short)."""
    try:
        t = b[pos]
    except IndexError:
        return -1, pos
    if t < 0x80:
        return t, pos + 1
    width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(t)
    if width is None or pos + 1 + width > len(b):
        return -1, pos
    return int.from_bytes(b[pos + 1:pos + 1 + width], "big"), pos + 1 + width


#: the keys "g" and "q" in each msgpack str format (fixstr, str8, str16, str32)
_GQ_KEYS: Final = tuple(fmt + key for key in (b"g", b"q")
                        for fmt in (b"\xa1", b"\xd9\x01", b"\xda\x00\x01", b"\xdb\x00\x00\x00\x01"))


class HeaderMemo:
    """Decodes the DATA and P2P headers of one stream, remembering the ones it has seen.

    The receiving side of ``HeadCache``: a header that differs from one decoded before
    only by its group and sequence number (read straight from the bytes) is not decoded and
    validated again. Anything else goes through ``decode_header``, which validates it
    fully. Bounded: it starts over after ``limit`` distinct headers, and a header whose part
    after the sequence number exceeds ``MAX_REST`` bytes is decoded every time instead of
    remembered (a peer's huge signatures cannot fill the memory; there is one memo per
    incoming connection, and a collective's frames on one connection differ by step and shape
    only, so a few distinct headers of a hundred bytes or so is the usual case).
    """

    #: the longest header tail (bytes after the sequence number) that is remembered
    MAX_REST: Final = 1024

    __slots__ = ("_seen", "limit")

    def __init__(self, limit: int = 1024) -> None:
        # rest of the header -> (step, tag, src, dtype, shape, sig, payload bytes they imply)
        self._seen: dict[bytes, tuple[int, int, int, str | None, tuple[int, ...] | None,
                                      tuple[Any, ...] | None, int | None]] = {}
        self.limit = limit

    def decode(self, body: bytes | bytearray | memoryview, kind: int) -> FrameHeader:
        """``decode_header`` (the same result or the same ProtocolError)."""
        return self._decode(body, kind)[0]

    def decode_checked(self, body: bytes | bytearray | memoryview, kind: FrameKind,
                       payload_len: int) -> FrameHeader:
        """``decode_header``, then ``check_payload``."""
        header, expected = self._decode(body, kind)
        if expected != payload_len or expected is None:
            check_payload(kind, header, payload_len)
        return header

    def _decode(self, body: bytes | bytearray | memoryview, kind: int
                ) -> tuple[FrameHeader, int | None]:
        if kind != FrameKind.DATA and kind != FrameKind.P2P:
            return decode_header(body, kind), None
        b = bytes(body)
        # a canonical data header: fixmap, "g" <uint>, "q" <uint>, the rest
        if len(b) < 8 or b[0] not in (0x87, 0x88) or b[1] != 0xA1 or b[2] != 0x67:
            return _decode_data_header(b), None
        group, pos = _read_uint(b, 3)
        if group < 0 or b[pos:pos + 2] != b"\xa1q":
            return _decode_data_header(b), None
        seq, end = _read_uint(b, pos + 2)
        if seq < 0:
            return _decode_data_header(b), None
        rest = b[end:]
        key = b[:1] + rest
        seen = self._seen.get(key)
        if seen is not None:
            step, tag, src, dtype, shape, sig, expected = seen
            return _trusted_header(group, seq, step, tag, src, dtype, shape, sig), expected
        header = _decode_data_header(b)
        expected = header.expected_payload()
        # remember it unless the map repeats a key this shortcut reads (then msgpack's "last
        # one wins" would disagree with what was read here), in any str format
        if header.group == group and header.seq == seq and header.meta is None \
                and len(rest) <= self.MAX_REST and not any(k in rest for k in _GQ_KEYS):
            if len(self._seen) >= self.limit:
                self._seen.clear()
            self._seen[key] = (header.step, header.tag, header.src, header.dtype, header.shape,
                               header.sig, expected)
        return header, expected


# ------------------------------------------------------------------ zero-copy stream reading

class ReduceOnRead:
    """A payload destination that is reduced into rather than written: every piece of the
    payload read is combined (``fn(dest_piece, piece)``, in place in ``dest``) into the
    elements of ``dest`` it covers as soon as it arrives.

    For receives whose data is only reduced into an array (the ring's partial sums): the
    reader reads the payload a cache-sized piece at a time into a buffer of its own and
    combines each piece while it is still in cache, instead of reading the whole payload into
    memory and reading it back to combine it. ``dest`` must be 1-d and C-contiguous, with as
    many bytes as the payload; ``fn`` must combine element by element.

    An exception from ``fn`` (an overflow under ``np.seterr(over="raise")``) is kept in
    ``error`` and the rest of the payload read without combining: the reader stays at the
    frame's end (raised there, it would parse the rest of the payload as frames); the receive
    raises it.
    """

    __slots__ = ("dest", "error", "fn", "nbytes")

    def __init__(self, dest: np.ndarray, fn: Callable[[np.ndarray, np.ndarray], None]) -> None:
        if dest.ndim != 1 or not dest.flags.c_contiguous:
            raise ValueError("ReduceOnRead needs a 1-d C-contiguous array")
        self.dest = dest
        self.fn = fn
        self.nbytes = dest.nbytes
        self.error: Exception | None = None


#: Chooses where a frame's payload goes once its header is known: a writable memoryview of
#: exactly ``payload_len`` bytes, a ``ReduceOnRead`` of that many bytes, or ``None`` for a
#: fresh buffer. It may raise ProtocolError.
PayloadSink = Callable[[FrameKind, FrameHeader, int], "memoryview | ReduceOnRead | None"]


class BufferedFrameReader:
    """Sans-IO frame reader for ``asyncio.BufferedProtocol``-style I/O.

    The I/O layer asks ``get_buffer`` where to put the next bytes and reports with
    ``buffer_updated`` how many arrived. Small frames are parsed out of a staging buffer;
    once a header is parsed, ``sink`` picks the payload's destination, and the rest of a large
    payload is read straight into it (no intermediate copy). Frames come out whole, in order.
    """

    STAGE_BYTES: Final = 256 * 1024
    #: After a payload of at least LARGE_PAYLOAD_BYTES was read straight into its buffer,
    #: the next read into the staging buffer takes at most HEAD_READ_BYTES: the next frame's
    #: head (and a small frame or two), not the first 256 KiB of another large payload,
    #: which would then be copied out of the staging buffer (4% of a 4-rank 16 MiB
    #: all_reduce's CPU went to that copy; the read it saves happens anyway).
    HEAD_READ_BYTES: Final = 4096
    LARGE_PAYLOAD_BYTES: Final = 64 * 1024
    #: A payload that is reduced as it is read (``ReduceOnRead``) is read this many bytes at
    #: a time into a buffer that stays in cache (a bare-socket measurement: 256 KiB pieces
    #: took 0.76 x the CPU of reading 4 MiB into memory and adding it afterwards, 64 KiB
    #: pieces 1.33 x; benchmarks/receive_and_add.py)
    REDUCE_READ_BYTES: Final = 256 * 1024

    def __init__(self, sink: PayloadSink | None = None, *, max_payload: int = 0,
                 one_frame: bool = False, stage_bytes: int = STAGE_BYTES) -> None:
        self.sink = sink
        self.max_payload = max_payload
        #: return after each complete frame, leaving later bytes staged for the next call
        #: (``buffer_updated(0)`` parses them): a handshake changes ``sink`` and
        #: ``max_payload`` between one frame and the next, and the peer may write its first
        #: frames right behind the handshake's last
        self.one_frame = one_frame
        #: (``stage_bytes`` smaller than STAGE_BYTES: a connection that has not authenticated
        #: yet costs no more than the bytes it sent; ``grow`` once it has)
        self._stage = bytearray(max(stage_bytes, PREFIX_SIZE))
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        # a frame whose payload is being read directly: kind, header, owner, view, filled;
        # a payload reduced as it is read has no view (owner is the ReduceOnRead)
        self._pending: tuple[FrameKind, FrameHeader, Any, memoryview | None, int] | None = None
        # reduced payloads: the piece buffer, and how many bytes of a split element it holds
        self._pieces: np.ndarray | None = None
        self._carry = 0
        self._headers = HeaderMemo()
        # the staging buffer is empty and the last frame had a large payload
        self._head_only = False

    def get_buffer(self) -> memoryview:
        """Where the next received bytes must be written (never empty)."""
        pending = self._pending
        if pending is not None:
            view = pending[3]
            if view is not None:
                return view[pending[4]:]
            assert self._pieces is not None
            carry = self._carry
            left = pending[2].nbytes - pending[4]
            return self._pieces.data[carry:carry + min(left, self.REDUCE_READ_BYTES - carry)]
        if self._head_only:
            return self._view[self._end:self._end + self.HEAD_READ_BYTES]
        size = len(self._stage)
        if size - self._end < PREFIX_SIZE + MAX_HEADER_BYTES:
            n = self._end - self._start
            self._stage[:n] = self._stage[self._start:self._end]
            self._start, self._end = 0, n
            if n == size:  # a small staging buffer full of one frame's head: room for any
                self.grow(max(2 * size, PREFIX_SIZE + MAX_HEADER_BYTES))
        return self._view[self._end:]

    def grow(self, size: int = STAGE_BYTES) -> None:
        """Make the staging buffer ``size`` bytes long (never shorter), keeping what it
        holds. Not between ``get_buffer`` and the ``buffer_updated`` that reports on it."""
        if size <= len(self._stage):
            return
        n = self._end - self._start
        stage = bytearray(size)
        stage[:n] = self._view[self._start:self._end]
        self._stage, self._view = stage, memoryview(stage)
        self._start, self._end = 0, n

    def get_buffer_for(self, frame_bytes: int) -> memoryview:
        """``get_buffer`` for a caller that expects the next frame to be ``frame_bytes``
        long in all (head and payload) and takes it staged (``take_staged``). It differs only
        right after a large payload, where ``get_buffer`` offers a head's worth: room for the
        whole expected frame then (up to the staging buffer's size), so that it is read in
        one go and taken staged, not read head first with the rest going into a new buffer
        (which would leave the next read a head's worth again)."""
        if (not self._head_only or frame_bytes <= self.HEAD_READ_BYTES
                or self._start != self._end):
            return self.get_buffer()
        self._start = self._end = 0  # nothing staged: all of the buffer is free
        return self._view[:min(frame_bytes, len(self._stage))]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last buffer; return completed frames.

        Raises:
            ProtocolError: the stream broke the protocol; the connection must be closed.
        """
        if self._pending is not None:
            p_kind, p_header, p_owner, p_view, filled = self._pending
            if p_view is None:
                self._reduce_piece(p_owner, filled - self._carry, self._carry + nbytes)
            filled += nbytes
            if filled < (p_owner if p_view is None else p_view).nbytes:
                self._pending = (p_kind, p_header, p_owner, p_view, filled)
                return []
            self._pending = None
            self._head_only = filled >= self.LARGE_PAYLOAD_BYTES
            return [Frame(p_kind, p_header, p_owner)]
        self._head_only = False
        end = self._end = self._end + nbytes
        start = self._start
        frames: list[Frame] = []
        stage = self._view
        unpack_from = PREFIX.unpack_from
        while end - start >= PREFIX_SIZE:
            magic, version, kind_code, flags, header_len, payload_len = unpack_from(stage, start)
            kind, header_len, payload_len = _check_prefix(magic, version, kind_code, flags,
                                                          header_len, payload_len,
                                                          self.max_payload)
            pos = start + PREFIX_SIZE
            if end - pos < header_len:
                break
            header = self._headers.decode_checked(stage[pos:pos + header_len], kind,
                                                  payload_len)
            start = self._start = pos + header_len
            dest = self.sink(kind, header, payload_len) if self.sink is not None else None
            owner: Any
            view: memoryview | None  # None: the payload is reduced into owner as it is read
            if isinstance(dest, ReduceOnRead):
                owner, view = dest, None
                self._carry = 0
                if self._pieces is None:
                    self._pieces = np.empty(self.REDUCE_READ_BYTES, np.uint8)
            elif dest is None:
                # no zero-fill: all of it is read in
                owner = np.empty(payload_len, np.uint8) if payload_len else b""
                view = memoryview(owner)
            else:
                owner = view = dest
            take = min(end - start, payload_len)
            if take:  # what came with the head, from the staging buffer
                if view is None:
                    self._reduce_piece(owner, 0, take, stage[start:start + take])
                else:
                    view[:take] = stage[start:start + take]
                start += take
            if take < payload_len:
                self._start = start
                self._pending = (kind, header, owner, view, take)
                break
            frames.append(Frame(kind, header, owner))
            if self.one_frame:
                break
        if start == end:
            start = self._end = 0
        self._start = start
        return frames

    def _reduce_piece(self, red: ReduceOnRead, done: int, nbytes: int,
                      src: memoryview | None = None) -> None:
        """Combine ``nbytes`` of payload into ``red.dest`` from byte ``done`` of it (a whole
        number of elements): from ``src``, or from the piece buffer, whose first
        ``self._carry`` bytes are a split element's start. The bytes of an element still
        split are kept at the start of the piece buffer for the next read."""
        pieces = self._pieces
        assert pieces is not None
        size = red.dest.itemsize
        whole = nbytes - nbytes % size
        if whole and red.error is None:
            dtype = red.dest.dtype
            first = done // size
            piece = (np.frombuffer(src, dtype, whole // size) if src is not None
                     else pieces[:whole].view(dtype))
            try:
                red.fn(red.dest[first:first + whole // size], piece)
            except Exception as exc:  # the receive raises it (see ReduceOnRead)
                red.error = exc
        rest = nbytes - whole
        if rest:
            if src is not None:
                pieces[:rest] = np.frombuffer(src, np.uint8, rest, whole)
            else:
                pieces[:rest] = pieces[whole:nbytes]
        self._carry = rest

    @property
    def staging(self) -> bool:
        """Whether the next bytes read go to the staging buffer (not straight into a payload)."""
        return self._pending is None

    def stage(self, nbytes: int) -> None:
        """Account for ``nbytes`` written into the staging buffer (``get_buffer`` while
        ``staging``) without parsing them; ``buffer_updated(0)`` parses them later."""
        self._head_only = False
        self._end += nbytes

    def take_staged(self, head: bytes, payload_len: int) -> bytearray | None:
        """Consume the next staged frame if it is exactly ``head`` (prefix and header, byte
        for byte) followed by all of its ``payload_len`` payload bytes, and return that
        payload (a copy); else ``None``, consuming nothing.

        For a caller that knows which frame comes next and its canonical encoding (a
        collective's peer, see ``HeadCache``): equal bytes decode to the expected header, so
        nothing needs decoding or validating. A frame encoded any other way is simply not
        taken here; ``buffer_updated`` then parses it as usual.
        """
        start = self._start
        body = start + len(head)
        stop = body + payload_len
        if self._pending is not None or stop > self._end or self._view[start:body] != head:
            return None
        payload = self._stage[body:stop]
        if stop == self._end:
            self._start = self._end = 0
        else:
            self._start = stop
        return payload

    @property
    def filling(self) -> memoryview | None:
        """The buffer the payload being read goes into (``None`` between payloads, or while a
        payload is reduced as it is read)."""
        return self._pending[3] if self._pending is not None else None

    @property
    def idle(self) -> bool:
        """True at a frame boundary with nothing buffered (a clean place for EOF)."""
        return self._pending is None and self._start == self._end


__all__ = ["BufferedFrameReader", "HeadCache", "HeaderMemo", "PayloadSink", "ReduceOnRead"]
