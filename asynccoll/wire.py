"""The asynccoll wire protocol, sans-IO.

Pure functions and one small incremental decoder: no sockets, no asyncio. The transports move the
bytes this module produces; ``protocol/SPEC.md`` is the normative description and
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
    except Exception as exc:  # msgpack raises many types for corrupt input; all mean the same
        raise ProtocolError(f"header is not valid msgpack: {exc}") from exc
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
    "HeadCache",
    "HeaderMemo",
    "ReduceOnRead",
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

class ReduceOnRead:
    """A payload destination that is reduced into rather than written: every piece of the
    payload read is combined (``fn(dest_piece, piece)``, in place in ``dest``) into the
    elements of ``dest`` it covers as soon as it arrives.

    For receives whose data is only reduced into an array (the ring's partial sums): the
    reader reads the payload a cache-sized piece at a time into a buffer of its own and
    combines each piece while it is still in cache, instead of reading the whole payload into
    memory and reading it back to combine it. ``dest`` must be 1-d and C-contiguous, with as
    many bytes as the payload; ``fn`` must combine element by element.
    """

    __slots__ = ("dest", "fn", "nbytes")

    def __init__(self, dest: np.ndarray, fn: Callable[[np.ndarray, np.ndarray], None]) -> None:
        if dest.ndim != 1 or not dest.flags.c_contiguous:
            raise ValueError("ReduceOnRead needs a 1-d C-contiguous array")
        self.dest = dest
        self.fn = fn
        self.nbytes = dest.nbytes


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
        if whole:
            dtype = red.dest.dtype
            first = done // size
            piece = (np.frombuffer(src, dtype, whole // size) if src is not None
                     else pieces[:whole].view(dtype))
            red.fn(red.dest[first:first + whole // size], piece)
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
