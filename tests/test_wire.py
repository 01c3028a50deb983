"""The frame codec (asynccoll.wire) against protocol/vectors/frames.json and random input.

Every vector is decoded from the whole byte string and fed one byte at a time (as h11's tests
do), valid ones re-encode byte for byte, invalid ones raise ProtocolError and nothing else.
Hypothesis then checks that no input, random or mutated, gets anything but frames or a
ProtocolError out of the decoder, that headers round-trip, and that memory stays bounded by
what was received rather than what a prefix claims.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import re
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asynccoll import wire
from asynccoll.errors import ProtocolError
from asynccoll.wire import (
    CLOSED,
    NEED_DATA,
    Frame,
    FrameDecoder,
    FrameHeader,
    FrameKind,
)

ROOT = Path(__file__).resolve().parents[1]
VECTORS_PATH = ROOT / "protocol" / "vectors" / "frames.json"
VECTORS = json.loads(VECTORS_PATH.read_text())
VALID = VECTORS["valid"]
NONCANONICAL = VECTORS["noncanonical"]
INVALID = VECTORS["invalid"]
ALL_VALID_BYTES = [bytes.fromhex(v["hex"]) for v in (*VALID, *NONCANONICAL)]

HEADER_FIELDS = ("group", "seq", "step", "tag", "src", "dtype", "shape", "sig", "meta")
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
MiB = 1 << 20

FUZZ = settings(deadline=None, max_examples=300, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(FUZZ, max_examples=60)


# ----------------------------------------------------------------------------------- helpers

def tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(tuplify(v) for v in value)
    return value


def header_from_json(obj: dict[str, Any]) -> FrameHeader:
    assert set(obj) <= set(HEADER_FIELDS), set(obj) - set(HEADER_FIELDS)
    return FrameHeader(
        **{k: obj[k] for k in ("group", "seq", "step", "tag", "src", "dtype", "meta") if k in obj},
        shape=tuple(obj["shape"]) if "shape" in obj else None,
        sig=tuplify(obj["sig"]) if "sig" in obj else None,
    )


def frame_from_json(vector: dict[str, Any]) -> Frame:
    return Frame(FrameKind(vector["kind"]), header_from_json(vector["header"]),
                 bytes.fromhex(vector["payload_hex"]))


def drive(chunks: Sequence[bytes | bytearray | memoryview],
          max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
          ) -> tuple[list[Frame], ProtocolError | None]:
    """Feed ``chunks`` then EOF, collecting frames; return them and the ProtocolError, if any.

    Any other exception propagates and fails the test.
    """
    decoder = FrameDecoder(max_payload)
    frames: list[Frame] = []
    try:
        for chunk in chunks:
            if not chunk:
                continue  # b"" would mean EOF
            decoder.feed(chunk)
            frames.extend(decoder.frames())
        decoder.feed(b"")
        frames.extend(decoder.frames())
        assert decoder.next_frame() is CLOSED
    except ProtocolError as exc:
        # after an error the decoder is dead: every call raises again
        with pytest.raises(ProtocolError):
            decoder.next_frame()
        with pytest.raises(ProtocolError):
            decoder.feed(b"x")
        return frames, exc
    return frames, None


def bytewise(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def outcome(chunks: list[bytes], max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES
            ) -> tuple[list[bytes], str | None]:
    """The frames (re-encoded, so that a NaN in meta compares equal) and the error message."""
    frames, err = drive(chunks, max_payload)
    return [wire.encode_frame_bytes(f) for f in frames], (str(err) if err is not None else None)


def raw_frame(kind: int, body: bytes, payload: bytes = b"", *, header_len: int | None = None,
              payload_len: int | None = None) -> bytes:
    return wire.PREFIX.pack(
        wire.MAGIC, wire.VERSION, kind, 0, len(body) if header_len is None else header_len,
        len(payload) if payload_len is None else payload_len) + body + payload


# ----------------------------------------------------------------------------------- vectors

def test_vector_file_shape() -> None:
    assert VECTORS["version"] == wire.VERSION
    assert set(VECTORS) == {"description", "version", "valid", "noncanonical", "invalid"}
    names = [v["name"] for v in (*VALID, *NONCANONICAL, *INVALID)]
    assert len(names) == len(set(names))
    for v in (*VALID, *NONCANONICAL, *INVALID):
        assert v["hex"] == v["hex"].lower()
    # every kind of data frame and every dtype is pinned by at least one valid vector
    assert {v["header"].get("dtype") for v in VALID} >= set(wire.SUPPORTED_DTYPES)
    assert {v["kind"] for v in VALID} >= {k.value for k in
                                          (FrameKind.DATA, FrameKind.P2P, FrameKind.ABORT,
                                           FrameKind.BYE)}


def test_vectors_are_up_to_date() -> None:
    path = ROOT / "protocol" / "make_vectors.py"
    spec = importlib.util.spec_from_file_location("make_vectors", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == VECTORS_PATH.read_text(), "run protocol/make_vectors.py"


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_valid_vector(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    expected = frame_from_json(vector)
    for chunks in ([data], bytewise(data)):
        frames, err = drive(chunks)
        assert err is None
        assert frames == [expected]
        (frame,) = frames
        assert type(frame.kind) is FrameKind and frame.kind == vector["kind"]
        assert frame.kind.name == vector["kind_name"]
        for name in HEADER_FIELDS:  # absent fields really are absent
            assert (getattr(frame.header, name) is None) == (name not in vector["header"])
        assert bytes(frame.payload) == bytes.fromhex(vector["payload_hex"])
    # re-encodes byte for byte, also via the two-buffer form the transports use
    assert wire.encode_frame_bytes(expected).hex() == vector["hex"]
    assert b"".join(bytes(b) for b in wire.encode_frame(expected)) == data
    head = wire.encode_head(expected.kind, expected.header, len(expected.payload))
    assert head + expected.payload == data


@pytest.mark.parametrize("vector", [v for v in VALID if v["kind"] in (1, 2)],
                         ids=[v["name"] for v in VALID if v["kind"] in (1, 2)])
def test_valid_vector_payload_is_the_array(vector: dict[str, Any]) -> None:
    header = vector["header"]
    payload = bytes.fromhex(vector["payload_hex"])
    dtype = np.dtype(header["dtype"])
    assert len(payload) == math.prod(header["shape"]) * dtype.itemsize
    array = wire.array_view(payload, header["dtype"], header["shape"])
    assert array.shape == tuple(header["shape"]) and array.dtype == dtype
    assert array.tobytes() == payload
    assert wire.dtype_code(array.dtype) == header["dtype"]


@pytest.mark.parametrize("vector", NONCANONICAL, ids=[v["name"] for v in NONCANONICAL])
def test_noncanonical_vector(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    expected = frame_from_json(vector)
    assert drive([data]) == ([expected], None)
    assert drive(bytewise(data)) == ([expected], None)
    assert wire.encode_frame_bytes(expected).hex() == vector["canonical_hex"]
    assert vector["canonical_hex"] != vector["hex"]


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_invalid_vector(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    limit = vector.get("max_payload", wire.DEFAULT_MAX_PAYLOAD_BYTES)
    results = []
    for chunks in ([data], bytewise(data)):
        frames, err = drive(chunks, limit)
        assert isinstance(err, ProtocolError)
        if "error" in vector:
            assert vector["error"] in str(err)
        results.append((frames, str(err)))
    assert results[0] == results[1]
    with pytest.raises(ProtocolError):
        wire.decode_frames(data, limit)


def test_all_vectors_in_one_stream() -> None:
    stream = b"".join(ALL_VALID_BYTES)
    expected = [frame_from_json(v) for v in (*VALID, *NONCANONICAL)]
    assert wire.decode_frames(stream) == expected
    assert drive(bytewise(stream)) == (expected, None)


@given(cuts=st.lists(st.integers(min_value=0), max_size=20))
@FEW
def test_all_vectors_in_random_chunks(cuts: list[int]) -> None:
    stream = b"".join(ALL_VALID_BYTES)
    assert drive(split(stream, cuts)) == (wire.decode_frames(stream), None)


# ----------------------------------------------------------------------------------- decoder

def test_decoder_states() -> None:
    decoder = FrameDecoder()
    assert decoder.next_frame() is NEED_DATA
    data = ALL_VALID_BYTES[0]
    decoder.feed(data[:7])
    assert decoder.next_frame() is NEED_DATA
    decoder.feed(data[7:])
    assert isinstance(decoder.next_frame(), Frame)
    assert decoder.next_frame() is NEED_DATA
    decoder.feed(b"")
    assert decoder.next_frame() is CLOSED
    assert decoder.next_frame() is CLOSED
    with pytest.raises(ProtocolError, match="after end of stream"):
        decoder.feed(b"x")


def test_decoder_accepts_memoryview_and_bytearray() -> None:
    data = b"".join(ALL_VALID_BYTES)
    assert drive([memoryview(data)]) == drive([bytearray(data)]) == drive([data])


def test_payload_at_the_limit_is_accepted() -> None:
    frame = Frame(FrameKind.DATA, FrameHeader(dtype="|u1", shape=(1024,)), bytes(range(256)) * 4)
    data = wire.encode_frame_bytes(frame)
    assert drive([data], max_payload=1024) == ([frame], None)
    frames, err = drive([data], max_payload=1023)
    assert frames == [] and err is not None and "exceeds the limit" in str(err)


def test_prefix_is_checked_before_the_header_arrives() -> None:
    decoder = FrameDecoder(max_payload=1024)
    decoder.feed(wire.PREFIX.pack(wire.MAGIC, 1, 1, 0, 100, 1025))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decoder.next_frame()


def test_payload_length_is_checked_before_the_payload_arrives() -> None:
    decoder = FrameDecoder()
    decoder.feed(wire.encode_head(FrameKind.DATA, FrameHeader(dtype="<f8", shape=(2,)), 15))
    with pytest.raises(ProtocolError, match="does not match"):
        decoder.next_frame()


# ----------------------------------------------------------------------------------- encoder

def test_encode_frame_passes_the_payload_through() -> None:
    array = np.arange(6, dtype=np.float32)
    view = array.data.cast("B")
    frame = Frame(FrameKind.DATA, FrameHeader(dtype="<f4", shape=(6,)), view)
    buffers = wire.encode_frame(frame)
    assert len(buffers) == 2 and buffers[1] is view
    assert wire.encode_frame(Frame(FrameKind.BYE, FrameHeader()))[0] == wire.encode_frame_bytes(
        Frame(FrameKind.BYE, FrameHeader()))
    assert len(wire.encode_frame(Frame(FrameKind.BYE, FrameHeader()))) == 1


def test_encoder_refuses_what_a_decoder_must_reject() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.encode_head(FrameKind.ABORT, FrameHeader(meta={"reason": "x" * wire.MAX_HEADER_BYTES}),
                         0)
    with pytest.raises(ProtocolError, match="protocol's limit"):
        wire.encode_head(FrameKind.DATA, FrameHeader(), wire.ABSOLUTE_MAX_PAYLOAD_BYTES + 1)
    deepest: Any = ()  # the header map is level 1, sig level 2: 31 nested tuples reach 32
    for _ in range(wire.MAX_HEADER_DEPTH - 2):
        deepest = (deepest,)
    head = wire.encode_head(FrameKind.DATA, FrameHeader(sig=deepest), 0)
    assert wire.decode_header(head[wire.PREFIX_SIZE:]).sig == deepest
    with pytest.raises(ProtocolError, match="nests deeper"):
        wire.encode_head(FrameKind.DATA, FrameHeader(sig=(deepest,)), 0)
    with pytest.raises(ProtocolError, match="nests deeper"):
        wire.decode_header(head[wire.PREFIX_SIZE:].replace(b"\x91\x90", b"\x91\x91\x90"))
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        wire.encode_head(FrameKind.ABORT, FrameHeader(meta={"x": {1, 2}}), 0)
    with pytest.raises(ProtocolError, match="cannot be encoded"):
        wire.encode_head(FrameKind.ABORT, FrameHeader(meta={"x": 1 << 64}), 0)


def test_deep_headers_are_protocol_errors() -> None:
    # msgpack itself decodes ~1000 levels; the codec must refuse them without recursing
    for depth in (33, 500, 999, 1023, 5000):
        for key in ("c", "g", "h", "m", "d"):
            fields = [(k, b"\x00") for k in "gqstr" if k != key]
            body = bytes([0x80 | (len(fields) + 1)]) + b"".join(
                msgpack.packb(k) + v for k, v in fields) + msgpack.packb(key) + (
                b"\x91" * depth + b"\xc0")
            frames, err = drive([raw_frame(4, body)])
            assert frames == [] and err is not None


@pytest.mark.parametrize("kwargs", [
    {"group": -1}, {"group": U64 + 1}, {"seq": U64 + 1}, {"step": U32 + 1}, {"tag": 1 << 63},
    {"src": U32 + 1}, {"src": True}, {"seq": 1.0}, {"dtype": ">f8"}, {"dtype": "float32"},
    {"shape": [1, 2]}, {"shape": (-1,)}, {"shape": (1,) * 33}, {"shape": (True,)},
    {"sig": ["x"]}, {"meta": [("a", 1)]}, {"meta": {1: "a"}}, {"meta": {b"a": 1}},
])
def test_header_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        FrameHeader(**kwargs)


def test_header_extremes_are_valid() -> None:
    header = FrameHeader(group=U64, seq=U64, step=U32, tag=(1 << 63) - 1, src=U32,
                         shape=((1 << 63) - 1,) * 32)
    assert wire.decode_header(wire.encode_head(FrameKind.BYE, header, 0)[20:]) == header


def test_dtypes() -> None:
    names = ["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8",
             "<c8", "<c16"]
    assert set(wire.SUPPORTED_DTYPES) == set(names)
    assert wire.dtype_code(np.dtype(">f4")) == "<f4"
    assert wire.dtype_code(np.dtype("=i8")) == "<i8"
    assert wire.dtype_code(np.dtype(bool)) == "|b1"
    for bad in (object, "U4", "datetime64[s]", "f16" if hasattr(np, "float128") else "V8"):
        with pytest.raises(TypeError):
            wire.dtype_code(np.dtype(bad))


def test_array_view_without_copy() -> None:
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    payload = bytearray(array.tobytes())
    view = wire.array_view(payload, "<i2", (3, 4))
    np.testing.assert_array_equal(view, array)
    view[0, 0] = 99  # writes through: no copy was made
    assert payload[:2] == (99).to_bytes(2, "little")
    assert wire.array_view(b"", "<f4", (0, 5)).shape == (0, 5)


# ----------------------------------------------------------------------------------- the spec

SPEC = (ROOT / "protocol" / "SPEC.md").read_text()


def test_spec_agrees_with_the_code() -> None:
    kinds = {int(v): n for v, n in re.findall(r"^\| (\d+)\s+\| `([A-Z0-9]+)`", SPEC, re.M)}
    assert kinds == {int(k): k.name for k in FrameKind}
    dtypes = set(re.findall(r"\| `(?:\\\|)?([<|]?[a-z]\d+)`", SPEC))
    documented = {d if d.startswith("<") else "|" + d for d in dtypes}
    assert documented == set(wire.SUPPORTED_DTYPES)
    for number in ("65536", "2^32", "2^40"):
        assert number in SPEC
    assert wire.MAX_HEADER_BYTES == 65536
    assert wire.DEFAULT_MAX_PAYLOAD_BYTES == 1 << 32
    assert wire.ABSOLUTE_MAX_PAYLOAD_BYTES == 1 << 40
    assert "## Handshake" in SPEC and "## Rendezvous messages" in SPEC


# ----------------------------------------------------------------------------------- fuzzing

KIND_VALUES = sorted(int(k) for k in FrameKind)
_scalars = (st.none() | st.booleans() | st.integers(-(1 << 64), 1 << 65) | st.floats()
            | st.text(alphabet="gqstrdhcm<|f48 ", max_size=6) | st.binary(max_size=6))
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4)
                       | st.dictionaries(st.sampled_from("gqstrdhcmx"), c, max_size=4),
                       max_leaves=12)


def _packable(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return b"\xc0"


# prefixes that pass the magic and version checks, so the rest of the decoder gets exercised
_framed_junk = st.builds(
    lambda kind, flags, hl, pl, rest: wire.PREFIX.pack(wire.MAGIC, 1, kind, flags, hl, pl) + rest,
    st.sampled_from([*KIND_VALUES, 0, 99]), st.sampled_from([0, 0, 0, 1]),
    st.integers(0, 300) | st.sampled_from([65536, 65537, U32]),
    st.integers(0, 300) | st.sampled_from([1 << 32, (1 << 32) + 1, 1 << 40, U64]),
    st.binary(max_size=400))
# whole frames with a random msgpack header (random keys, types and values)
_random_headers = st.builds(
    lambda kind, header, payload, exact: raw_frame(
        kind, _packable(header), payload,
        payload_len=None if exact else len(payload) + 1),
    st.sampled_from(KIND_VALUES),
    st.dictionaries(st.sampled_from("gqstrdhcmx"), _values, max_size=9)
    | st.fixed_dictionaries({k: st.integers(-2, 1 << 64) for k in "gqstr"},
                            optional={"d": st.sampled_from(sorted(wire.SUPPORTED_DTYPES)),
                                      "h": st.lists(st.integers(0, 4), max_size=3),
                                      "c": _values, "m": _values}),
    st.binary(max_size=64), st.booleans())
ARBITRARY = st.one_of(st.binary(max_size=512), _framed_junk, _random_headers,
                      st.lists(_random_headers, min_size=2, max_size=4).map(b"".join))


@given(data=ARBITRARY, cuts=st.lists(st.integers(min_value=0), max_size=12))
@FUZZ
def test_arbitrary_bytes_give_frames_or_protocol_error(data: bytes, cuts: list[int]) -> None:
    whole = outcome([data])
    assert outcome(split(data, cuts)) == whole
    for encoded in whole[0]:  # whatever decodes is valid: its canonical form decodes the same
        assert outcome([encoded]) == ([encoded], None)


_mutation = st.tuples(st.sampled_from(["flip", "insert", "delete"]), st.integers(min_value=0),
                      st.integers(1, 255))


def mutate(data: bytes, mutations: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, value in mutations:
        i = pos % (len(buf) + 1)
        if op == "insert":
            buf.insert(i, value)
        elif buf and op == "flip":
            buf[i % len(buf)] ^= value
        elif buf:
            del buf[i % len(buf)]
    return bytes(buf)


@given(data=st.sampled_from(ALL_VALID_BYTES), mutations=st.lists(_mutation, min_size=1,
                                                                  max_size=4),
       cuts=st.lists(st.integers(min_value=0), max_size=12))
@FUZZ
def test_mutated_vectors_give_frames_or_protocol_error(data: bytes, mutations: list[Any],
                                                        cuts: list[int]) -> None:
    mutated = mutate(data, mutations)
    whole = outcome([mutated])
    assert outcome(split(mutated, cuts)) == whole
    assert outcome(bytewise(mutated)) == whole


# round trip: random valid frames
_sig_values = st.recursive(
    st.none() | st.integers(-(1 << 63), U64) | st.text(alphabet="abcxyz_<>|0123456789", max_size=8),
    lambda c: st.lists(c, max_size=4), max_leaves=12)
_meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), U64) | st.floats(allow_nan=False)
    | st.text(alphabet="abcé €\u0000", max_size=8) | st.binary(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(alphabet="abc", max_size=3), c,
                                                        max_size=3),
    max_leaves=10)


@st.composite
def frames(draw: st.DrawFn) -> Frame:
    kind = draw(st.sampled_from(list(FrameKind)))
    dtype = shape = None
    if kind in (FrameKind.DATA, FrameKind.P2P) or draw(st.booleans()):
        dtype = draw(st.sampled_from(sorted(wire.SUPPORTED_DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    if kind in (FrameKind.DATA, FrameKind.P2P):
        assert dtype is not None and shape is not None
        n = math.prod(shape) * np.dtype(dtype).itemsize
        payload = draw(st.binary(min_size=n, max_size=n))
    else:
        payload = draw(st.binary(max_size=16))
    header = FrameHeader(
        group=draw(st.integers(0, U64)), seq=draw(st.integers(0, U64)),
        step=draw(st.integers(0, U32)), tag=draw(st.integers(0, (1 << 63) - 1)),
        src=draw(st.integers(0, U32)), dtype=dtype, shape=shape,
        sig=draw(st.none() | st.lists(_sig_values, max_size=5).map(tuplify)),
        meta=draw(st.none() | st.dictionaries(st.text(alphabet="abcdef", max_size=6),
                                              _meta_values, max_size=4)),
    )
    return Frame(kind, header, payload)


@given(batch=st.lists(frames(), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0), max_size=8))
@FUZZ
def test_round_trip(batch: list[Frame], cuts: list[int]) -> None:
    data = b"".join(wire.encode_frame_bytes(f) for f in batch)
    decoded = wire.decode_frames(data)
    assert decoded == batch
    assert b"".join(wire.encode_frame_bytes(f) for f in decoded) == data  # canonical: stable
    assert drive(split(data, cuts)) == (batch, None)
    for frame in decoded:
        if frame.kind in (FrameKind.DATA, FrameKind.P2P):
            assert frame.header.dtype is not None and frame.header.shape is not None
            array = wire.array_view(frame.payload, frame.header.dtype, frame.header.shape)
            assert array.tobytes() == frame.payload


@given(frame=frames().filter(lambda f: f.kind in (FrameKind.DATA, FrameKind.P2P)),
       seqs=st.lists(st.integers(0, U64), min_size=1, max_size=4))
@FUZZ
def test_head_cache_and_header_memo_agree_with_the_codec(frame: Frame, seqs: list[int]) -> None:
    """The encode cache gives encode_head's canonical bytes, and the decode memo
    decode_header's result, on first sight and on every repeat with another seq."""
    h = frame.header
    assert h.dtype is not None and h.shape is not None
    heads, memo = wire.HeadCache(limit=2), wire.HeaderMemo(limit=2)
    for seq in [h.seq, *seqs, h.seq]:
        header = FrameHeader(group=h.group, seq=seq, step=h.step, tag=h.tag, src=h.src,
                             dtype=h.dtype, shape=h.shape, sig=h.sig)
        expected = wire.encode_head(frame.kind, header, len(frame.payload))
        got = heads.data_head(int(frame.kind), h.group, seq, h.step, h.tag, h.src, h.dtype,
                              h.shape, h.sig, len(frame.payload))
        assert got == expected
        assert memo.decode(memoryview(got)[wire.PREFIX_SIZE:], frame.kind) == header


@given(data=st.sampled_from(ALL_VALID_BYTES), mutations=st.lists(_mutation, min_size=1,
                                                                  max_size=4))
@FUZZ
def test_header_memo_rejects_what_decode_header_rejects(data: bytes,
                                                         mutations: list[Any]) -> None:
    """Mutated headers decode through the memo exactly as through decode_header (the same
    header, or a ProtocolError), also once the memo has seen the unmutated header."""
    kind, header_len, _ = wire.parse_prefix(data[:wire.PREFIX_SIZE])
    body = data[wire.PREFIX_SIZE:wire.PREFIX_SIZE + header_len]
    memo = wire.HeaderMemo()
    for candidate in (body, mutate(body, mutations), body):
        try:
            expected = wire.decode_header(candidate, kind)
        except ProtocolError:
            with pytest.raises(ProtocolError):
                memo.decode(candidate, kind)
        else:
            assert memo.decode(candidate, kind) == expected


def test_header_memo_remembers_only_short_headers() -> None:
    """A header with a huge signature decodes the same through the memo, every time, but is
    not remembered: one peer's large headers cannot fill a connection's memo."""
    memo = wire.HeaderMemo(limit=4)
    for sig_len, remembered in ((8, True), (4000, False)):
        memo._seen.clear()
        header = FrameHeader(group=1, seq=5, step=0, tag=0, src=1, dtype="<f4", shape=(2,),
                             sig=tuple(range(sig_len)))
        body = memoryview(wire.encode_head(FrameKind.DATA, header, 8))[wire.PREFIX_SIZE:]
        for _ in range(2):
            assert memo.decode(body, FrameKind.DATA) == header
        assert bool(memo._seen) is remembered
        assert all(len(key) <= wire.HeaderMemo.MAX_REST + 1 for key in memo._seen)


# ----------------------------------------------------------------------------------- memory

def _peak_while(fn: Any) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_huge_declared_payload_fails_without_allocating() -> None:
    decoder = FrameDecoder(max_payload=MiB)
    prefix = wire.PREFIX.pack(wire.MAGIC, 1, 1, 0, 30, 1 << 39)

    def run() -> None:
        decoder.feed(prefix)
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            decoder.next_frame()

    assert _peak_while(run) < 64 * 1024


def test_accepted_payload_is_not_preallocated() -> None:
    decoder = FrameDecoder(max_payload=1 << 30)
    head = wire.encode_head(FrameKind.DATA, FrameHeader(dtype="|u1", shape=(1 << 30,)), 1 << 30)

    def run() -> None:
        decoder.feed(head)
        assert decoder.next_frame() is NEED_DATA
        decoder.feed(b"\x00" * 1000)
        assert decoder.next_frame() is NEED_DATA

    assert _peak_while(run) < 256 * 1024


_big_claims = st.builds(
    lambda kind, hl, pl, rest: wire.PREFIX.pack(wire.MAGIC, 1, kind, 0, hl, pl) + rest,
    st.sampled_from(KIND_VALUES), st.integers(0, 1 << 17), st.integers(0, 1 << 41),
    st.binary(max_size=2048))


@given(data=st.one_of(_big_claims, ARBITRARY,
                      st.builds(mutate, st.sampled_from(ALL_VALID_BYTES),
                                st.lists(_mutation, max_size=3))),
       cuts=st.lists(st.integers(min_value=0), max_size=16))
@settings(FUZZ, max_examples=100)
def test_memory_is_bounded_by_input(data: bytes, cuts: list[int]) -> None:
    max_payload = MiB
    chunks = split(data, cuts)
    peak = _peak_while(lambda: drive(chunks, max_payload))
    assert peak <= wire.MAX_HEADER_BYTES + max_payload + len(data) + MiB


# --------------------------------------------------------------- taking a predicted frame

def _staged_reader(data: bytes, cuts: list[int], head: bytes, payload_len: int, *,
                   whole: bool = True) -> tuple[list[bytearray], list[Frame]]:
    """Feed ``data`` in pieces as a polling receive does (stage, try the predicted frame,
    parse the rest); returns what ``take_staged`` took and the frames parsed around it."""
    reader = wire.BufferedFrameReader(max_payload=1 << 20)
    taken: list[bytearray] = []
    frames: list[Frame] = []
    for piece in split(data, cuts):
        while piece:
            buf = reader.get_buffer()
            n = min(len(buf), len(piece))
            buf[:n] = piece[:n]
            piece = piece[n:]
            if reader.staging:
                reader.stage(n)
                got = reader.take_staged(head, payload_len)
                if got is not None:
                    taken.append(got)
                frames += reader.buffer_updated(0)
            else:
                frames += reader.buffer_updated(n)
    assert reader.idle == whole
    return taken, frames


@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
       before=st.booleans(), after=st.booleans())
@FUZZ
def test_take_staged_takes_exactly_the_predicted_frame(cuts: list[int], before: bool,
                                                       after: bool) -> None:
    """A frame whose bytes are exactly the predicted head and a whole payload is taken out
    (payload only); anything else, before or after it, is parsed as usual and in order. With
    the bytes cut anywhere, the predicted frame is either taken or parsed: never lost,
    never both."""
    sig = ("all_reduce", "<f4", (3,), "sum", "recursive_doubling")
    heads = wire.HeadCache()
    payload = np.arange(3, dtype=np.float32).tobytes()
    head = heads.data_head(1, 0, 7, 1, 0, 1, "<f4", (3,), sig, 12)
    other = wire.Frame(FrameKind.DATA, FrameHeader(group=0, seq=8, step=1, src=1, dtype="<f4",
                                                   shape=(3,), sig=sig), payload)
    data = ((wire.encode_frame_bytes(other) if before else b"") + head + payload
            + (wire.encode_frame_bytes(other) if after else b""))
    taken, frames = _staged_reader(data, cuts, head, 12)
    predicted = [f for f in frames if f.header.seq == 7]
    assert len(taken) + len(predicted) == 1
    assert [bytes(t) for t in taken] == [payload] * len(taken)
    assert [f.header.seq for f in frames if f.header.seq != 7] == [8] * (before + after)
    if not before and not cuts:  # all there at once and first: taken, never parsed
        assert taken and not predicted


def test_take_staged_leaves_anything_else_alone() -> None:
    sig = ("barrier",)
    heads = wire.HeadCache()
    head = heads.data_head(1, 0, 7, 0, 0, 1, "|u1", (0,), sig, 0)
    for data in (heads.data_head(1, 0, 7, 0, 0, 2, "|u1", (0,), sig, 0),  # another sender
                 heads.data_head(1, 0, 8, 0, 0, 1, "|u1", (0,), sig, 0),  # another seq
                 heads.data_head(1, 0, 7, 0, 0, 1, "|u1", (0,), ("other",), 0)):
        taken, frames = _staged_reader(data, [], head, 0)
        assert not taken and len(frames) == 1
    taken, frames = _staged_reader(head[:-1], [], head, 0, whole=False)  # not all there yet
    assert not taken and not frames
    reader = wire.BufferedFrameReader(max_payload=1 << 20)
    reader.get_buffer()[:len(head)] = head
    reader.stage(len(head))
    assert reader.take_staged(head, 0) == b"" and reader.idle  # an empty payload is taken too


# ---------------------------------------------------- the stream reader with posted buffers

def _read_all(reader: wire.BufferedFrameReader, stream: bytes, reads: list[int]) -> list[Frame]:
    """Feed ``stream`` as the TCP transport does, each read taking at most the next of
    ``reads`` bytes (cycling) of what ``get_buffer`` offers; the frames out, the reader idle.
    After a large payload read straight into its buffer, the staging buffer is offered only
    HEAD_READ_BYTES (so that the next large payload is not copied)."""
    out: list[Frame] = []
    pos = k = 0
    while pos < len(stream):
        buf = reader.get_buffer()
        assert buf.nbytes > 0
        if reader._head_only:
            assert buf.nbytes <= reader.HEAD_READ_BYTES
        n = min(buf.nbytes, reads[k % len(reads)], len(stream) - pos)
        k += 1
        buf[:n] = stream[pos:pos + n]
        pos += n
        out += reader.buffer_updated(n)
    assert reader.idle
    return out


@given(sizes=st.lists(st.sampled_from([0, 5, 3000, 70_000, 200_000]), min_size=1, max_size=6),
       posted=st.lists(st.booleans(), min_size=6, max_size=6),
       reads=st.lists(st.integers(min_value=1, max_value=300_000), min_size=1, max_size=12))
@settings(FUZZ, max_examples=60)
def test_reader_with_posted_buffers_and_any_read_sizes(sizes: list[int], posted: list[bool],
                                                       reads: list[int]) -> None:
    """BufferedFrameReader as the TCP transport drives it: whatever size each read has, every
    frame comes out whole and in order, its payload in the posted buffer when there is one;
    after a large payload read straight into its buffer, the next read into the staging
    buffer is offered only HEAD_READ_BYTES (so that the next large payload is not copied)."""
    payloads = [bytes(np.random.default_rng(i).integers(0, 256, n, np.uint8))
                for i, n in enumerate(sizes)]
    frames_in = [Frame(FrameKind.DATA, FrameHeader(seq=i, src=1, dtype="|u1", shape=(len(p),)),
                       p) for i, p in enumerate(payloads)]
    stream = b"".join(wire.encode_frame_bytes(f) for f in frames_in)
    buffers = {i: bytearray(len(p)) for i, p in enumerate(payloads) if posted[i]}

    def sink(kind: FrameKind, header: FrameHeader, nbytes: int) -> memoryview | None:
        buf = buffers.get(header.seq)
        return memoryview(buf) if buf is not None else None

    reader = wire.BufferedFrameReader(sink, max_payload=1 << 20)
    out = _read_all(reader, stream, reads)
    assert [f.header.seq for f in out] == list(range(len(payloads)))
    for f, p in zip(out, payloads, strict=True):
        assert bytes(memoryview(f.payload)) == p
        if f.header.seq in buffers and p:
            assert f.payload is not None and memoryview(f.payload).obj is buffers[f.header.seq]


def test_after_a_large_payload_only_a_head_is_read_into_the_staging_buffer() -> None:
    big = 100_000
    frames = [Frame(FrameKind.DATA, FrameHeader(seq=i, src=1, dtype="|u1", shape=(big,)),
                    bytes([i]) * big) for i in range(2)]
    stream = b"".join(wire.encode_frame_bytes(f) for f in frames)
    targets = [bytearray(big), bytearray(big)]
    reader = wire.BufferedFrameReader(lambda k, h, n: memoryview(targets[h.seq]),
                                      max_payload=1 << 20)
    assert reader.get_buffer().nbytes == reader.STAGE_BYTES
    first = len(stream) // 2
    buf = reader.get_buffer()  # the first frame's head and the start of its payload
    buf[:1000] = stream[:1000]
    assert reader.buffer_updated(1000) == []
    buf = reader.get_buffer()  # the rest of the payload: straight into its buffer
    assert buf.nbytes == first - 1000
    buf[:] = stream[1000:first]
    assert [f.header.seq for f in reader.buffer_updated(buf.nbytes)] == [0]
    buf = reader.get_buffer()
    assert buf.nbytes == reader.HEAD_READ_BYTES  # not 256 KiB of the next payload
    buf[:] = stream[first:first + buf.nbytes]
    assert reader.buffer_updated(buf.nbytes) == []
    buf = reader.get_buffer()
    assert buf.nbytes == len(stream) - first - reader.HEAD_READ_BYTES
    buf[:] = stream[first + reader.HEAD_READ_BYTES:]
    assert [f.header.seq for f in reader.buffer_updated(buf.nbytes)] == [1]
    assert targets == [bytearray(b"\x00") * big, bytearray(b"\x01") * big]
    assert reader.get_buffer().nbytes == reader.HEAD_READ_BYTES and reader.idle


def test_get_buffer_for_reads_an_expected_frame_whole_after_a_large_payload() -> None:
    """Where the next frame is known (a lean receive), ``get_buffer_for`` offers room for all
    of it even right after a large payload, so that it is read in one go and taken staged;
    elsewhere it offers what ``get_buffer`` does."""
    big = 100_000
    frames = [Frame(FrameKind.DATA, FrameHeader(seq=i, src=1, dtype="|u1", shape=(big,)),
                    bytes([i + 1]) * big) for i in range(2)]
    first, second = (wire.encode_frame_bytes(f) for f in frames)
    target = bytearray(big)
    reader = wire.BufferedFrameReader(lambda k, h, n: memoryview(target), max_payload=1 << 20)
    assert reader.get_buffer_for(len(first)).nbytes == reader.STAGE_BYTES  # as get_buffer
    buf = reader.get_buffer()
    buf[:1000] = first[:1000]
    assert reader.buffer_updated(1000) == []
    buf = reader.get_buffer_for(len(first))  # a payload is being read: its buffer
    assert buf.nbytes == len(first) - 1000 and buf.obj is target
    buf[:] = first[1000:]
    assert [f.header.seq for f in reader.buffer_updated(buf.nbytes)] == [0]
    assert reader.get_buffer().nbytes == reader.HEAD_READ_BYTES
    assert reader.get_buffer_for(100).nbytes == reader.HEAD_READ_BYTES  # a small frame
    assert reader.get_buffer_for(1 << 20).nbytes == reader.STAGE_BYTES  # capped
    buf = reader.get_buffer_for(len(second))
    assert buf.nbytes == len(second)
    buf[:] = second
    assert reader.staging
    reader.stage(len(second))
    head = second[:len(second) - big]
    payload = reader.take_staged(head, big)
    assert payload is not None and bytes(payload) == frames[1].payload
    assert reader.idle and reader.get_buffer().nbytes == reader.STAGE_BYTES


# ------------------------------------------------------- payloads reduced as they are read

@given(dtype=st.sampled_from(["<f8", "<i4", "<c16", "|u1", "<f2"]),
       counts=st.lists(st.sampled_from([1, 3, 7, 50, 1000, 40_000]), min_size=1, max_size=4),
       reduced=st.lists(st.booleans(), min_size=4, max_size=4),
       reads=st.lists(st.integers(min_value=1, max_value=70_000), min_size=1, max_size=10),
       piece=st.sampled_from([16, 40, 4096, 256 * 1024]))
@settings(FUZZ, max_examples=80)
def test_reader_reduces_payloads_as_they_are_read(dtype: str, counts: list[int],
                                                  reduced: list[bool], reads: list[int],
                                                  piece: int) -> None:
    """A sink that answers with a ReduceOnRead gets the payload combined into its array, a
    piece at a time, whatever sizes the reads have (elements split between reads included),
    and the frame out carries the ReduceOnRead itself; other frames around it are read as
    usual. The result is exactly what adding the whole payload at once gives."""
    rng = np.random.default_rng(len(counts) * 7 + piece)
    dt = np.dtype(dtype)
    payloads = [(rng.integers(-50, 50, n) if dt.kind != "c"
                 else rng.integers(-50, 50, n) + 1j * rng.integers(-50, 50, n)).astype(dt)
                for n in counts]
    frames_in = [Frame(FrameKind.DATA, FrameHeader(seq=i, src=1, dtype=dt.str, shape=p.shape),
                       p.tobytes()) for i, p in enumerate(payloads)]
    stream = b"".join(wire.encode_frame_bytes(f) for f in frames_in)
    dests = {i: (rng.integers(-50, 50, p.size)).astype(dt) for i, p in enumerate(payloads)
             if reduced[i]}
    expected = {i: d + payloads[i] for i, d in dests.items()}
    reds = {i: wire.ReduceOnRead(d, lambda a, b: np.add(a, b, out=a)) for i, d in dests.items()}

    reader = wire.BufferedFrameReader(lambda k, h, n: reds.get(h.seq), max_payload=1 << 22)
    reader.REDUCE_READ_BYTES = piece  # type: ignore[misc]  # more pieces, split elements
    out = _read_all(reader, stream, reads)
    assert [f.header.seq for f in out] == list(range(len(payloads)))
    for f, p in zip(out, payloads, strict=True):
        if f.header.seq in reds:
            assert f.payload is reds[f.header.seq]
            np.testing.assert_array_equal(dests[f.header.seq], expected[f.header.seq])
        else:
            assert bytes(memoryview(f.payload)) == p.tobytes()


def test_reduce_on_read_needs_a_flat_contiguous_array() -> None:
    with pytest.raises(ValueError, match="1-d C-contiguous"):
        wire.ReduceOnRead(np.zeros((2, 2)), np.add)
    with pytest.raises(ValueError, match="1-d C-contiguous"):
        wire.ReduceOnRead(np.zeros(8)[::2], np.add)


def test_reader_one_frame_at_a_time_applies_later_settings_to_later_frames() -> None:
    """With ``one_frame`` the reader hands over one frame per call and keeps the bytes
    behind it; ``buffer_updated(0)`` parses them with whatever limit and sink were set in
    between (a handshake's last frame and the first frames after it, read at once)."""
    welcome = wire.Frame(FrameKind.WELCOME, FrameHeader(meta={}), b"")
    payload = np.arange(4, dtype=np.float32).tobytes()
    data = wire.Frame(FrameKind.DATA, FrameHeader(group=0, seq=1, step=1, src=1, dtype="<f4",
                                                  shape=(4,), sig=("x",)), payload)
    stream = wire.encode_frame_bytes(welcome) + wire.encode_frame_bytes(data) * 2
    reader = wire.BufferedFrameReader(max_payload=0, one_frame=True)
    reader.get_buffer()[:len(stream)] = stream
    first = reader.buffer_updated(len(stream))
    assert [f.kind for f in first] == [FrameKind.WELCOME] and not reader.idle
    landed = bytearray(len(payload))
    reader.max_payload, reader.one_frame = 1 << 20, False
    reader.sink = lambda kind, header, n: memoryview(landed)
    rest = reader.buffer_updated(0)
    assert [f.kind for f in rest] == [FrameKind.DATA] * 2 and reader.idle
    assert bytes(landed) == payload
    # without the change in between, the payload breaks the handshake's limit of 0
    reader = wire.BufferedFrameReader(max_payload=0)
    reader.get_buffer()[:len(stream)] = stream
    with pytest.raises(ProtocolError):
        reader.buffer_updated(len(stream))


@pytest.mark.parametrize("stage", [wire.PREFIX_SIZE, 100, 4096])
@pytest.mark.parametrize("reads", [[1], [7, 300], [1 << 20]])
def test_a_small_staging_buffer_grows_for_long_heads(stage: int, reads: list[int]) -> None:
    """A reader started with a small staging buffer (a connection not yet authenticated)
    reads heads up to the protocol's longest, whatever the read sizes, and after ``grow``
    (midway, with bytes staged) goes on reading the stream where it was."""
    longest = wire.MAX_HEADER_BYTES - 64
    hello = [wire.Frame(FrameKind.HELLO, FrameHeader(meta={"job": "j" * n}), b"")
             for n in (10, 5000, longest)]
    payload = np.arange(3000, dtype=np.float32).tobytes()
    data = wire.Frame(FrameKind.DATA, FrameHeader(group=0, seq=1, step=1, src=1, dtype="<f4",
                                                  shape=(3000,), sig=("x",)), payload)
    handshake = b"".join(wire.encode_frame_bytes(f) for f in hello)
    assert len(wire.encode_frame_bytes(hello[-1])) > wire.MAX_HEADER_BYTES - 64
    stream = handshake + wire.encode_frame_bytes(data) * 2
    reader = wire.BufferedFrameReader(max_payload=0, one_frame=True, stage_bytes=stage)
    assert reader.get_buffer().nbytes <= max(stage, wire.PREFIX_SIZE)
    got: list[wire.Frame] = []
    pos = k = 0
    while pos < len(stream):
        buf = reader.get_buffer()
        n = min(buf.nbytes, reads[k % len(reads)], len(stream) - pos)
        k += 1
        buf[:n] = stream[pos:pos + n]
        pos += n
        frames = reader.buffer_updated(n)
        while frames:
            got += frames
            if len(got) == len(hello):  # authenticated: full size, payloads allowed
                reader.grow()
                reader.max_payload, reader.one_frame = 1 << 20, False
            frames = reader.buffer_updated(0)
    assert reader.idle
    assert [f.header.meta for f in got[:3]] == [f.header.meta for f in hello]
    assert [bytes(f.payload) for f in got[3:]] == [payload, payload]
    assert reader.get_buffer().nbytes == wire.BufferedFrameReader.STAGE_BYTES


# ------------------------------------------------- the stream reader against the decoder

def _reader_outcome(data: bytes, reads: list[int], max_payload: int
                    ) -> tuple[list[bytes], bool]:
    """Feed ``data`` to a BufferedFrameReader, each read at most the next of ``reads`` bytes;
    the frames out (re-encoded) and whether it ended in a ProtocolError or mid-frame.
    Any other exception propagates and fails the test."""
    reader = wire.BufferedFrameReader(max_payload=max_payload)
    out: list[bytes] = []
    pos = k = 0
    try:
        while pos < len(data):
            buf = reader.get_buffer()
            assert buf.nbytes > 0
            n = min(buf.nbytes, reads[k % len(reads)], len(data) - pos)
            k += 1
            buf[:n] = data[pos:pos + n]
            pos += n
            out += [wire.encode_frame_bytes(f) for f in reader.buffer_updated(n)]
    except ProtocolError:
        return out, True
    return out, not reader.idle


@given(data=st.one_of(ARBITRARY, st.builds(mutate, st.sampled_from(ALL_VALID_BYTES),
                                           st.lists(_mutation, max_size=3))),
       reads=st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=8))
@FUZZ
def test_reader_accepts_and_rejects_what_the_decoder_does(data: bytes, reads: list[int]) -> None:
    """BufferedFrameReader (the TCP path, through HeaderMemo) on any input, read in any
    sizes: the decoder's frames (those of a read that ends in the error may be dropped) and
    a ProtocolError where the decoder has one, never another exception."""
    frames, err = outcome([data], MiB)
    for sizes in (reads, [1]):  # and one byte at a time
        got, failed = _reader_outcome(data, sizes, MiB)
        assert failed == (err is not None)
        assert got == (frames[:len(got)] if failed else frames)


def test_truncated_data_headers_are_protocol_errors_through_the_memo() -> None:
    """Every prefix of a DATA or P2P header, also of ones that stop right after the group
    and the "q" key, is rejected by the memo as by decode_header (a ProtocolError)."""
    bodies = []
    for raw in ALL_VALID_BYTES:
        kind, header_len, _ = wire.parse_prefix(raw[:wire.PREFIX_SIZE])
        if kind in (FrameKind.DATA, FrameKind.P2P):
            bodies.append(raw[wire.PREFIX_SIZE:wire.PREFIX_SIZE + header_len])
    for group in (0, 0x80, 0x100, 1 << 16, 1 << 32):
        bodies.append(wire.encode_head(FrameKind.DATA, FrameHeader(
            group=group, seq=group, dtype="<f4", shape=(0,)), 0)[wire.PREFIX_SIZE:])
    for body in bodies:
        for end in range(len(body)):
            with pytest.raises(ProtocolError):
                wire.decode_header(body[:end], FrameKind.DATA)
            for memo in (wire.HeaderMemo(), wire.HeaderMemo()):
                memo.decode(body, FrameKind.DATA)  # the second one has seen the whole header
                with pytest.raises(ProtocolError):
                    memo.decode(body[:end], FrameKind.DATA)


@pytest.mark.parametrize("key", [b"\xd9\x01g", b"\xda\x00\x01g", b"\xdb\x00\x00\x00\x01g",
                                 b"\xd9\x01q", b"\xda\x00\x01q", b"\xdb\x00\x00\x00\x01q"])
def test_header_memo_keeps_the_last_of_duplicate_keys(key: bytes) -> None:
    """A repeated "g" or "q" key in a longer str format (not canonical, but valid msgpack):
    the memo decodes it as decode_header does (the last one wins), also once it has seen the
    header with the repeated key's value up front."""
    def body(first: int) -> bytes:
        return (b"\x88\xa1g" + bytes([first]) + b"\xa1q" + bytes([first])
                + msgpack.packb({"s": 0, "t": 0, "r": 0, "d": "<f4", "h": [0]})[1:]
                + key + b"\x05")
    memo = wire.HeaderMemo()
    for first in (5, 7):
        expected = wire.decode_header(body(first), FrameKind.DATA)
        assert (expected.group if key.endswith(b"g") else expected.seq) == 5
        assert memo.decode(body(first), FrameKind.DATA) == expected


@pytest.mark.parametrize("shape", [(0, 1 << 62), (1 << 62, 0, 4), (0,) + ((1 << 63) - 1,) * 31])
def test_empty_shape_numpy_cannot_hold_is_a_protocol_error(shape: tuple[int, ...]) -> None:
    """A zero-size shape is valid whatever its other dimensions (spec: each 0 .. 2^63-1) and
    decodes; one NumPy cannot represent (the product of the others overflows) makes
    array_view raise ProtocolError, not numpy's ValueError."""
    frame = Frame(FrameKind.P2P, FrameHeader(src=1, dtype="<f4", shape=shape), b"")
    (decoded,) = wire.decode_frames(wire.encode_frame_bytes(frame))
    assert decoded == frame
    with pytest.raises(ProtocolError, match="shape"):
        wire.array_view(decoded.payload, "<f4", shape)


@pytest.mark.parametrize("kind", [FrameKind.DATA, FrameKind.P2P, FrameKind.BYE])
def test_nesting_limit_is_the_same_on_every_path(kind: FrameKind) -> None:
    """The header map is level 1 and ``c`` level 2: a sig whose arrays reach level 32 is
    valid, one level more is not, for DATA and P2P headers (their own fast path and the
    memo) as for the others, and on encode."""
    def sig(levels: int) -> tuple[Any, ...]:  # ``levels`` arrays deep, c itself included
        value: Any = 0
        for _ in range(levels):
            value = (value,)
        return value  # type: ignore[no-any-return]

    for levels, ok in ((wire.MAX_HEADER_DEPTH - 1, True), (wire.MAX_HEADER_DEPTH, False)):
        fields = {"g": 0, "q": 0, "s": 0, "t": 0, "r": 0, "d": "<f4", "h": [0], "c": sig(levels)}
        body = msgpack.packb(fields)
        header = FrameHeader(dtype="<f4", shape=(0,), sig=sig(levels))
        if ok:
            assert wire.decode_header(body, kind) == header
            assert wire.HeaderMemo().decode(body, kind) == header
            assert wire.encode_head(kind, header, 0)[wire.PREFIX_SIZE:] == body
        else:
            with pytest.raises(ProtocolError, match="deeper"):
                wire.decode_header(body, kind)
            with pytest.raises(ProtocolError, match="deeper"):
                wire.HeaderMemo().decode(body, kind)
            with pytest.raises(ProtocolError, match="deeper"):
                wire.encode_head(kind, header, 0)
        assert (drive([raw_frame(kind, body)])[1] is None) == ok
