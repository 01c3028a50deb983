"""The asynccoll wire protocol, sans-IO.

Pure functions and one small incremental decoder: no sockets, no asyncio. The transports move the
bytes this module produces (the caches and buffered reader of one connection's stream are in
``asynccoll.wire_stream``); ``protocol/SPEC.md`` is the normative description and
``protocol/vectors/`` holds the test vectors that pin it down byte for byte.

A frame is:

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
from collections.abc import Iterator, Sequence
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
    CLOSE = 5  #: the sender closed a group communicator (``g``) before its collective ``q``
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


#: Returned by ``FrameDecoder.next_frame`` when more bytes are needed.
NEED_DATA: Final = _Sentinel.NEED_DATA
#: Returned by ``FrameDecoder.next_frame`` after a clean end of stream.
CLOSED: Final = _Sentinel.CLOSED


#: the longest repr of a received value an error message quotes
MAX_QUOTED_CHARS: Final = 80


def short_repr(value: Any) -> str:
    """``repr(value)``, cut to MAX_QUOTED_CHARS: error messages (and the log lines made of
    them) quote what a peer sent, and anyone who can connect may send 64 KiB of it."""
    text = repr(value)
    if len(text) <= MAX_QUOTED_CHARS:
        return text
    return f"{text[:MAX_QUOTED_CHARS]}... ({len(text)} chars)"


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
            raise ProtocolError(f"unsupported dtype {short_repr(self.dtype)}")
        if self.shape is not None:
            if not isinstance(self.shape, tuple) or len(self.shape) > MAX_NDIM or not all(
                type(n) is int and 0 <= n <= _I63 for n in self.shape
            ):
                raise ProtocolError(f"bad shape {short_repr(self.shape)}")
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
                    f"header field {name!r} must be an int in [0, {hi}], "
                    f"got {short_repr(value)}")

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
    """``encode_head`` for DATA and P2P frames, without building a FrameHeader.

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
    return _check_prefix(magic, version, kind, flags, header_len, payload_len, max_payload)


def _check_prefix(magic: bytes, version: int, kind: int, flags: int, header_len: int,
                  payload_len: int, max_payload: int) -> tuple[FrameKind, int, int]:
    if (magic == MAGIC and version == VERSION and flags == 0 and header_len <= MAX_HEADER_BYTES
            and payload_len <= max_payload and payload_len <= ABSOLUTE_MAX_PAYLOAD_BYTES):
        kind_of = _KIND_OF.get(kind)
        if kind_of is not None:
            return kind_of, header_len, payload_len
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
    raise ProtocolError(f"payload length {payload_len} exceeds the limit of {max_payload}")


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
    except msgpack.StackError:  # (deeper than msgpack's own stack; its message is empty)
        raise ProtocolError(f"header nests deeper than {MAX_HEADER_DEPTH} levels") from None
    except Exception as exc:  # msgpack raises many types for corrupt input; all mean the same
        raise ProtocolError(f"header is not valid msgpack: {exc or type(exc).__name__}"
                            ) from exc
    if not isinstance(obj, dict):
        raise ProtocolError("header must be a msgpack map")
    return obj


_new_header = object.__new__
_SET_FIELDS = tuple(FrameHeader.__dict__[name].__set__ for name in
                    ("group", "seq", "step", "tag", "src", "dtype", "shape", "sig", "meta"))


def _trusted_header(group: int, seq: int, step: int, tag: int, src: int, dtype: str | None,
                    shape: tuple[int, ...] | None, sig: tuple[Any, ...] | None) -> FrameHeader:
    """A FrameHeader of already validated fields, without running the checks again
    (through the slot descriptors: a quarter of the cost of the dataclass ``__init__``)."""
    h = _new_header(FrameHeader)
    sg, sq, ss, st, sr, sd, sh, sc, sm = _SET_FIELDS
    sg(h, group)
    sq(h, seq)
    ss(h, step)
    st(h, tag)
    sr(h, src)
    sd(h, dtype)
    sh(h, shape)
    sc(h, sig)
    sm(h, None)
    return h


def _flat_enough(sig: tuple[Any, ...]) -> bool:
    """``not _too_deep(sig)`` for a sig at level 2 (in the header map), without recursing
    for the usual signature (scalars and flat tuples of scalars, such as a shape)."""
    for child in sig:
        if type(child) is tuple:
            for grandchild in child:
                if isinstance(grandchild, (list, tuple, dict)):
                    return not _too_deep(sig, 2)
        elif isinstance(child, (list, dict)):
            return not _too_deep(sig, 2)
    return True


def _decode_data_header(body: bytes | bytearray | memoryview) -> FrameHeader:
    """``decode_header`` for DATA and P2P frames, the hot path: msgpack builds the tuples
    itself, only the signature can nest (``meta`` does not belong in these frames), and the
    fields are checked here once (what ``FrameHeader.__post_init__`` checks) rather than in
    the dataclass. Anything unusual goes to the general path, which explains what is wrong."""
    obj = _unpack_map(body, use_list=False)
    get = obj.get
    g, q, s, t, r = get("g"), get("q"), get("s"), get("t"), get("r")
    dtype, shape, sig = get("d"), get("h"), get("c")
    if (type(g) is int and type(q) is int and type(s) is int and type(t) is int
            and type(r) is int and 0 <= g <= _U64 and 0 <= q <= _U64 and 0 <= s <= _U32
            and 0 <= t <= _I63 and 0 <= r <= _U32 and "m" not in obj
            and (dtype is None or (type(dtype) is str and dtype in SUPPORTED_DTYPES))
            and (shape is None or (type(shape) is tuple and len(shape) <= MAX_NDIM
                                   and all(type(n) is int and 0 <= n <= _I63 for n in shape)))
            and (sig is None or (type(sig) is tuple and _flat_enough(sig)))):
        return _trusted_header(g, q, s, t, r, dtype, shape, sig)
    return decode_header(body)


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
    """Incremental decoder: bytes in with ``feed``, frames out with ``next_frame``.

    It buffers at most one prefix and header (<= 20 + 64 KiB) plus the payload bytes actually
    received; it never allocates from a length it has not validated against ``max_payload``.
    After a ``ProtocolError`` the decoder is dead and every call raises again.
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
    """A NumPy array over a received payload, without copying.

    Raises:
        ProtocolError: an empty payload whose (valid) shape NumPy cannot represent, its
            non-zero dimensions multiplying past the largest array size.
    """
    dt = np.dtype(dtype)
    if not len(payload):
        try:
            return np.empty(tuple(shape), dtype=dt)
        except ValueError:
            raise ProtocolError(f"shape {tuple(shape)} cannot be a NumPy array") from None
    return np.frombuffer(payload, dtype=dt).reshape(tuple(shape))


#: names that moved to ``wire_stream`` (the caches and readers of one connection), still
#: importable from here; looked up there on first use, since ``wire_stream`` imports this module
_STREAM_NAMES: Final = frozenset({"BufferedFrameReader", "HeadCache", "HeaderMemo",
                                  "PayloadSink", "ReduceOnRead"})


def __getattr__(name: str) -> Any:
    if name in _STREAM_NAMES:
        from . import wire_stream

        return getattr(wire_stream, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CLOSED",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "NEED_DATA",
    "PREFIX_SIZE",
    "VERSION",
    "BufferedFrameReader",  # noqa: F822 (from wire_stream, see __getattr__)
    "Frame",
    "FrameDecoder",
    "FrameHeader",
    "FrameKind",
    "HeadCache",  # noqa: F822 (from wire_stream, see __getattr__)
    "HeaderMemo",  # noqa: F822 (from wire_stream, see __getattr__)
    "ReduceOnRead",  # noqa: F822 (from wire_stream, see __getattr__)
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
