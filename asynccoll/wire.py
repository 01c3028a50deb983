"""The asynccoll wire protocol, sans-IO.

Pure functions and one small incremental decoder: no sockets, no asyncio. The transports move the
bytes this module produces; ``protocol/SPEC.md`` is the normative description and
``protocol/vectors/`` holds the test vectors that pin it down byte for byte.

A frame is::

    prefix   20 bytes, big-endian: magic "ACOL" | version u8 | kind u8 | flags u16 |
             header_len u32 | payload_len u64
    header   header_len bytes: one msgpack map (short string keys, see FrameHeader)
    payload  payload_len raw bytes (array data; never msgpack-encoded)
"""

from __future__ import annotations

import enum
import functools
import math
import struct
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import numpy as np

from .errors import ProtocolError

MAGIC: Final = b"ACOL"
VERSION: Final = 1
PREFIX: Final = struct.Struct("!4sBBHIQ")
PREFIX_SIZE: Final = PREFIX.size  # 20

#: Hard limit on a frame's msgpack header, for every implementation.
MAX_HEADER_BYTES: Final = 64 * 1024
#: Default limit on a frame's payload; endpoints may configure a lower one.
DEFAULT_MAX_PAYLOAD_BYTES: Final = 1 << 32
#: Largest payload the protocol can ever describe (the u64 field is capped here).
ABSOLUTE_MAX_PAYLOAD_BYTES: Final = 1 << 40

#: Deepest nesting of arrays and maps in a header, the header map itself being level 1.
MAX_HEADER_DEPTH: Final = 32
MAX_NDIM: Final = 32
_U32: Final = (1 << 32) - 1
_U64: Final = (1 << 64) - 1
_I63: Final = (1 << 63) - 1


class FrameKind(enum.IntEnum):
    """What a frame carries. Values are fixed by the spec."""

    DATA = 1  #: one step of a collective
    P2P = 2  #: a point-to-point message (send/recv)
    ABORT = 3  #: the sender's world is broken; meta says why
    BYE = 4  #: graceful close of a connection
    HELLO = 16  #: handshake: client -> server
    CHALLENGE = 17  #: handshake: server -> client
    PROOF = 18  #: handshake: client -> server
    WELCOME = 19  #: handshake: server -> client, accepted
    REJECT = 20  #: handshake: server -> client, refused
    REQUEST = 32  #: rendezvous request
    RESPONSE = 33  #: rendezvous response


_KINDS: Final = frozenset(int(k) for k in FrameKind)
_KIND_OF: Final = types.MappingProxyType({int(k): k for k in FrameKind})

#: dtypes that may travel, by numpy ``dtype.str`` (little-endian or byte-order free).
SUPPORTED_DTYPES: Final = frozenset(
    np.dtype(name).newbyteorder("<").str if np.dtype(name).itemsize > 1 else np.dtype(name).str
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)
#: bytes per element of each supported dtype
ITEMSIZE: Final = types.MappingProxyType({code: np.dtype(code).itemsize
                                          for code in SUPPORTED_DTYPES})


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"


#: Returned by :meth:`FrameDecoder.next_frame` when more bytes are needed.
NEED_DATA: Final = _Sentinel.NEED_DATA
#: Returned by :meth:`FrameDecoder.next_frame` after a clean end of stream.
CLOSED: Final = _Sentinel.CLOSED


@dataclass(frozen=True, slots=True, kw_only=True)
class FrameHeader:
    """The msgpack header of a frame.

    ``group``, ``seq``, ``step``, ``tag`` and ``src`` always travel (keys ``g q s t r``);
    ``dtype``, ``shape``, ``sig`` and ``meta`` (keys ``d h c m``) only when not ``None``.
    """

    group: int = 0
    seq: int = 0
    step: int = 0
    tag: int = 0
    src: int = 0
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    sig: tuple[Any, ...] | None = None
    meta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        g, q, s, t, r = self.group, self.seq, self.step, self.tag, self.src
        if (type(g) is int and type(q) is int and type(s) is int and type(t) is int
                and type(r) is int and 0 <= g <= _U64 and 0 <= q <= _U64 and 0 <= s <= _U32
                and 0 <= t <= _I63 and 0 <= r <= _U32):
            pass  # the common case, checked in one go
        else:
            self._explain_ints()
        if self.dtype is not None and self.dtype not in SUPPORTED_DTYPES:
            raise ProtocolError(f"unsupported dtype {self.dtype!r}")
        if self.shape is not None:
            if not isinstance(self.shape, tuple) or len(self.shape) > MAX_NDIM or not all(
                type(n) is int and 0 <= n <= _I63 for n in self.shape
            ):
                raise ProtocolError(f"bad shape {self.shape!r}")
        if self.sig is not None and not isinstance(self.sig, tuple):
            raise ProtocolError("sig must be a tuple")
        if self.meta is not None and (
            not isinstance(self.meta, dict) or not all(isinstance(k, str) for k in self.meta)
        ):
            raise ProtocolError("meta must be a map with string keys")

    def _explain_ints(self) -> None:
        for name, hi in (("group", _U64), ("seq", _U64), ("step", _U32), ("tag", _I63),
                         ("src", _U32)):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= hi:
                raise ProtocolError(
                    f"header field {name!r} must be an int in [0, {hi}], got {value!r}")

    def expected_payload(self) -> int | None:
        """Payload length implied by ``dtype`` and ``shape``, or ``None`` if either is absent."""
        if self.dtype is None or self.shape is None:
            return None
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class Frame:
    """A whole frame: kind, header and payload (any bytes-like object)."""

    kind: FrameKind
    header: FrameHeader
    payload: Any = field(default=b"")


# ----------------------------------------------------------------------------------- encoding

def _tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


def _too_deep(obj: Any, depth: int = 1) -> bool:
    """Whether arrays and maps nest deeper than MAX_HEADER_DEPTH.

    Recursion stops at the limit, so hostile input cannot exhaust the stack.
    """
    if isinstance(obj, (list, tuple)) and not isinstance(obj, msgpack.ExtType):
        if depth > MAX_HEADER_DEPTH:
            return True
        for child in obj:
            if isinstance(child, (list, tuple, dict)) and _too_deep(child, depth + 1):
                return True
    elif isinstance(obj, dict):
        if depth > MAX_HEADER_DEPTH:
            return True
        for key, child in obj.items():
            if isinstance(key, (list, tuple, dict)) and _too_deep(key, depth + 1):
                return True
            if isinstance(child, (list, tuple, dict)) and _too_deep(child, depth + 1):
                return True
    return False


def header_to_map(header: FrameHeader) -> dict[str, Any]:
    """The canonical msgpack map of a header (key order is part of the encoding)."""
    out: dict[str, Any] = {"g": header.group, "q": header.seq, "s": header.step,
                           "t": header.tag, "r": header.src}
    if header.dtype is not None:
        out["d"] = header.dtype
    if header.shape is not None:
        out["h"] = list(header.shape)
    if header.sig is not None:
        out["c"] = header.sig
    if header.meta is not None:
        out["m"] = header.meta
    return out


def encode_head(kind: FrameKind | int, header: FrameHeader, payload_len: int) -> bytes:
    """Prefix and header of a frame whose payload (``payload_len`` bytes) follows separately."""
    obj = header_to_map(header)
    if _too_deep(obj):
        raise ProtocolError(f"header nests deeper than {MAX_HEADER_DEPTH} levels")
    try:
        body = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"header cannot be encoded: {exc}") from exc
    if len(body) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    if not 0 <= payload_len <= ABSOLUTE_MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds the protocol's limit")
    return PREFIX.pack(MAGIC, VERSION, int(kind), 0, len(body), payload_len) + body


def encode_data_head(kind: int, group: int, seq: int, step: int, tag: int, src: int,
                     dtype: str, shape: tuple[int, ...], sig: tuple[Any, ...] | None,
                     payload_len: int) -> bytes:
    """:func:`encode_head` for DATA and P2P frames, without building a FrameHeader.

    The hot path of every collective: the caller vouches for the field values (they come from
    the library, not from the wire); the bytes are the same canonical encoding.
    """
    obj: dict[str, Any] = {"g": group, "q": seq, "s": step, "t": tag, "r": src, "d": dtype,
                           "h": shape}
    if sig is not None:
        obj["c"] = sig
    body = msgpack.packb(obj, use_bin_type=True)
    return PREFIX.pack(MAGIC, VERSION, kind, 0, len(body), payload_len) + body


def encode_frame(frame: Frame) -> list[Any]:
    """Buffers to write, in order: ``[prefix+header]`` or ``[prefix+header, payload]``.

    The payload is passed through untouched (a memoryview stays a memoryview), so a transport
    can hand the list to ``writelines`` without copying array data.
    """
    payload = frame.payload
    n = memoryview(payload).nbytes if payload is not None else 0
    head = encode_head(frame.kind, frame.header, n)
    return [head, payload] if n else [head]


def encode_frame_bytes(frame: Frame) -> bytes:
    """The whole frame as one ``bytes`` (for tests, vectors and small control frames)."""
    return b"".join(bytes(b) for b in encode_frame(frame))


# ----------------------------------------------------------------------------------- decoding

def parse_prefix(prefix: bytes | bytearray | memoryview,
                 max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> tuple[FrameKind, int, int]:
    """Validate a 20-byte prefix; return ``(kind, header_len, payload_len)``.

    Raises:
        ProtocolError: wrong magic, unknown version or kind, nonzero flags, or a length over
            the limits. The caller must close the connection: the stream cannot be resynchronised.
    """
    magic, version, kind, flags, header_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if flags != 0:
        raise ProtocolError(f"reserved flags must be zero, got {flags:#x}")
    if header_len > MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {header_len} exceeds {MAX_HEADER_BYTES}")
    if payload_len > min(max_payload, ABSOLUTE_MAX_PAYLOAD_BYTES):
        raise ProtocolError(f"payload length {payload_len} exceeds the limit of {max_payload}")
    return _KIND_OF[kind], header_len, payload_len


def decode_header(body: bytes | bytearray | memoryview, kind: int = 0) -> FrameHeader:
    """Decode and validate a msgpack header (of a frame of ``kind``, when known).

    Raises:
        ProtocolError: not one msgpack map, a missing or ill-typed field.
    """
    if kind == FrameKind.DATA or kind == FrameKind.P2P:
        return _decode_data_header(body)
    obj = _unpack_map(body, use_list=True)
    if _too_deep(obj):  # before anything below recurses into it (or reprs it)
        raise ProtocolError(f"header nests deeper than {MAX_HEADER_DEPTH} levels")
    try:
        shape = obj.get("h")
        sig = obj.get("c")
        if shape is not None and not isinstance(shape, list):
            raise ProtocolError("shape must be an array")
        if sig is not None and not isinstance(sig, list):
            raise ProtocolError("sig must be an array")
        return FrameHeader(
            group=obj["g"], seq=obj["q"], step=obj["s"], tag=obj["t"], src=obj["r"],
            dtype=obj.get("d"),
            shape=tuple(shape) if shape is not None else None,
            sig=_tuplify(sig) if sig is not None else None,
            meta=obj.get("m"),
        )
    except KeyError as exc:
        raise ProtocolError(f"header lacks field {exc.args[0]!r}") from None
    except TypeError as exc:
        raise ProtocolError(f"bad header: {exc}") from None


def _unpack_map(body: bytes | bytearray | memoryview, *, use_list: bool) -> dict[Any, Any]:
    """One msgpack map, with every length bounded by the header's own size."""
    limit = len(body)
    try:
        obj = msgpack.unpackb(
            body, raw=False, strict_map_key=True, use_list=use_list,
            max_str_len=limit, max_bin_len=limit, max_array_len=limit, max_map_len=limit,
            max_ext_len=limit,
        )
    except Exception as exc:  # msgpack raises many types for corrupt input; all mean the same
        raise ProtocolError(f"header is not valid msgpack: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError("header must be a msgpack map")
    return obj


def _decode_data_header(body: bytes | bytearray | memoryview) -> FrameHeader:
    """:func:`decode_header` for DATA and P2P frames, the hot path: msgpack builds the tuples
    itself, and only the signature can nest (``meta`` does not belong in these frames)."""
    obj = _unpack_map(body, use_list=False)
    sig = obj.get("c")
    shape = obj.get("h")
    dtype = obj.get("d")
    if "m" in obj or (sig is not None and (not isinstance(sig, tuple) or _too_deep(sig))) or (
            shape is not None and not isinstance(shape, tuple)) or (
            dtype is not None and type(dtype) is not str):
        return decode_header(body)  # unusual: the general path explains what is wrong
    try:
        return FrameHeader(group=obj["g"], seq=obj["q"], step=obj["s"], tag=obj["t"],
                           src=obj["r"], dtype=dtype, shape=shape, sig=sig)
    except KeyError as exc:
        raise ProtocolError(f"header lacks field {exc.args[0]!r}") from None
    except TypeError as exc:
        raise ProtocolError(f"bad header: {exc}") from None


def check_payload(kind: FrameKind, header: FrameHeader, payload_len: int) -> None:
    """Check that a header agrees with its payload length (DATA and P2P frames)."""
    if kind in (FrameKind.DATA, FrameKind.P2P):
        if header.dtype is None or header.shape is None:
            raise ProtocolError(f"{kind.name} frame without dtype and shape")
        expected = header.expected_payload()
        if expected != payload_len:
            raise ProtocolError(
                f"payload of {payload_len} bytes does not match dtype {header.dtype} "
                f"and shape {header.shape} ({expected} bytes)")


class FrameDecoder:
    """Incremental decoder: bytes in with :meth:`feed`, frames out with :meth:`next_frame`.

    It buffers at most one prefix and header (<= 20 + 64 KiB) plus the payload bytes actually
    received; it never allocates from a length it has not validated against ``max_payload``.
    After a :class:`ProtocolError` the decoder is dead and every call raises again.
    """

    def __init__(self, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.max_payload = max_payload
        self._buf = bytearray()
        self._eof = False
        self._error: ProtocolError | None = None
        self._head: tuple[FrameKind, FrameHeader, int] | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Add received bytes; ``b""`` means the peer closed the stream."""
        if self._error is not None:
            raise self._error
        if self._eof:
            raise ProtocolError("data fed after end of stream")
        if not data:
            self._eof = True
        else:
            self._buf += data

    def next_frame(self) -> Frame | _Sentinel:
        """Return the next whole frame, ``NEED_DATA`` or ``CLOSED``."""
        if self._error is not None:
            raise self._error
        try:
            return self._next()
        except ProtocolError as exc:
            self._error = exc
            self._buf = bytearray()
            raise

    def _next(self) -> Frame | _Sentinel:
        if self._head is None:
            if len(self._buf) < PREFIX_SIZE:
                return self._need()
            kind, header_len, payload_len = parse_prefix(
                memoryview(self._buf)[:PREFIX_SIZE], self.max_payload)
            if len(self._buf) < PREFIX_SIZE + header_len:
                return self._need()
            header = decode_header(memoryview(self._buf)[PREFIX_SIZE:PREFIX_SIZE + header_len],
                                   kind)
            check_payload(kind, header, payload_len)
            del self._buf[:PREFIX_SIZE + header_len]
            self._head = (kind, header, payload_len)
        kind, header, payload_len = self._head
        if len(self._buf) < payload_len:
            return self._need()
        payload = bytes(self._buf[:payload_len])
        del self._buf[:payload_len]
        self._head = None
        return Frame(kind, header, payload)

    def _need(self) -> _Sentinel:
        if self._eof:
            if self._buf or self._head is not None:
                raise ProtocolError("stream ended in the middle of a frame")
            return CLOSED
        return NEED_DATA

    def frames(self) -> Iterator[Frame]:
        """Yield every whole frame buffered so far."""
        while isinstance(frame := self.next_frame(), Frame):
            yield frame


def decode_frames(data: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES) -> list[Frame]:
    """Decode a byte string that holds whole frames and nothing else."""
    decoder = FrameDecoder(max_payload)
    decoder.feed(data)
    decoder.feed(b"")
    frames = list(decoder.frames())
    if decoder.next_frame() is not CLOSED:  # pragma: no cover - frames() drained it
        raise ProtocolError("trailing bytes")
    return frames


# ----------------------------------------------------------------------------------- arrays

@functools.lru_cache(maxsize=64)
def dtype_code(dtype: np.dtype[Any]) -> str:
    """The wire name of a dtype (numpy ``dtype.str`` in little-endian order)."""
    code = dtype.str if dtype.itemsize == 1 else dtype.newbyteorder("<").str
    if code not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported by asynccoll")
    return code


def array_view(payload: Any, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """A NumPy array over a received payload, without copying."""
    dt = np.dtype(dtype)
    if not len(payload):
        return np.empty(tuple(shape), dtype=dt)
    return np.frombuffer(payload, dtype=dt).reshape(tuple(shape))


__all__ = [
    "CLOSED",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "NEED_DATA",
    "PREFIX_SIZE",
    "VERSION",
    "BufferedFrameReader",
    "Frame",
    "FrameDecoder",
    "FrameHeader",
    "FrameKind",
    "array_view",
    "check_payload",
    "decode_frames",
    "decode_header",
    "dtype_code",
    "encode_data_head",
    "encode_frame",
    "encode_frame_bytes",
    "encode_head",
    "parse_prefix",
]


# ------------------------------------------------------------------ zero-copy stream reading

#: Chooses where a frame's payload goes once its header is known: a writable memoryview of
#: exactly ``payload_len`` bytes, or ``None`` for a fresh buffer. It may raise ProtocolError.
PayloadSink = Callable[[FrameKind, FrameHeader, int], "memoryview | None"]


class BufferedFrameReader:
    """Sans-IO frame reader for ``asyncio.BufferedProtocol``-style I/O.

    The I/O layer asks :meth:`get_buffer` where to put the next bytes and reports with
    :meth:`buffer_updated` how many arrived. Small frames are parsed out of a staging buffer;
    once a header is parsed, ``sink`` picks the payload's destination, and the rest of a large
    payload is read straight into it (no intermediate copy). Frames come out whole, in order.
    """

    STAGE_BYTES: Final = 256 * 1024

    def __init__(self, sink: PayloadSink | None = None, *, max_payload: int = 0) -> None:
        self.sink = sink
        self.max_payload = max_payload
        self._stage = bytearray(self.STAGE_BYTES)
        self._view = memoryview(self._stage)
        self._start = 0
        self._end = 0
        # a frame whose payload is being read directly: kind, header, owner, view, filled
        self._pending: tuple[FrameKind, FrameHeader, Any, memoryview, int] | None = None

    def get_buffer(self) -> memoryview:
        """Where the next received bytes must be written (never empty)."""
        if self._pending is not None:
            return self._pending[3][self._pending[4]:]
        if self.STAGE_BYTES - self._end < PREFIX_SIZE + MAX_HEADER_BYTES:
            n = self._end - self._start
            self._stage[:n] = self._stage[self._start:self._end]
            self._start, self._end = 0, n
        return self._view[self._end:]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last buffer; return completed frames.

        Raises:
            ProtocolError: the stream broke the protocol; the connection must be closed.
        """
        if self._pending is not None:
            p_kind, p_header, p_owner, p_view, filled = self._pending
            filled += nbytes
            if filled < p_view.nbytes:
                self._pending = (p_kind, p_header, p_owner, p_view, filled)
                return []
            self._pending = None
            return [Frame(p_kind, p_header, p_owner)]
        self._end += nbytes
        frames: list[Frame] = []
        stage = self._view
        while True:
            avail = self._end - self._start
            if avail < PREFIX_SIZE:
                break
            kind, header_len, payload_len = parse_prefix(
                stage[self._start:self._start + PREFIX_SIZE], self.max_payload)
            if avail < PREFIX_SIZE + header_len:
                break
            pos = self._start + PREFIX_SIZE
            header = decode_header(stage[pos:pos + header_len], kind)
            check_payload(kind, header, payload_len)
            self._start = pos + header_len
            dest = self.sink(kind, header, payload_len) if self.sink is not None else None
            owner: Any
            if dest is None:
                owner = np.empty(payload_len, np.uint8)  # no zero-fill: all of it is read in
                dest = memoryview(owner)
            else:
                owner = dest
            take = min(payload_len, self._end - self._start)
            if take:
                dest[:take] = stage[self._start:self._start + take]
                self._start += take
            if take < payload_len:
                self._pending = (kind, header, owner, dest, take)
                break
            frames.append(Frame(kind, header, owner))
        if self._start == self._end:
            self._start = self._end = 0
        return frames

    @property
    def idle(self) -> bool:
        """True at a frame boundary with nothing buffered (a clean place for EOF)."""
        return self._pending is None and self._start == self._end
