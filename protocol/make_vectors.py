"""Generate ``protocol/vectors/frames.json``, the frame test vectors, from ``asynccoll.wire``.

The JSON file is the artefact (see ``protocol/SPEC.md``, "Test vectors"); this script documents
how it was made and checks every vector against the reference codec before writing it::

    python protocol/make_vectors.py           # rewrite protocol/vectors/frames.json
    python protocol/make_vectors.py --check   # exit 1 if the file differs from what it would write

Valid vectors are built with the reference encoder, so they are canonical by construction.
Invalid and non-canonical vectors are assembled by hand from raw prefixes and msgpack bodies.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asynccoll import wire  # noqa: E402
from asynccoll.errors import ProtocolError  # noqa: E402
from asynccoll.wire import Frame, FrameHeader, FrameKind  # noqa: E402
from protocol._vectorfile import write_or_check  # noqa: E402

OUTPUT = ROOT / "protocol" / "vectors" / "frames.json"
PREFIX = struct.Struct("!4sBBHIQ")

DESCRIPTION = (
    "asynccoll wire protocol v1: frame test vectors (see protocol/SPEC.md, 'Test vectors'). "
    "'valid': canonical frames; decode 'hex' to 'kind', 'header' (long field names, absent "
    "fields omitted) and 'payload_hex', and re-encode to 'hex' byte for byte. 'noncanonical': "
    "frames a decoder must accept with the stated meaning; a canonical encoder writes "
    "'canonical_hex' instead. 'invalid': byte streams (each ends at end of stream) that a "
    "receiver must reject with a protocol error; 'max_payload', when present, is the receiver's "
    "payload limit (otherwise the default, 2^32); 'error' is a substring of the reference "
    "implementation's message, informative only. Integers go up to 2^64-1: parse them exactly."
)

U64 = (1 << 64) - 1
U32 = (1 << 32) - 1


# ----------------------------------------------------------------------------------- helpers

def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def header_json(header: FrameHeader) -> dict[str, Any]:
    """A header as a JSON object: long field names, absent (``None``) fields omitted."""
    out: dict[str, Any] = {}
    for name in ("group", "seq", "step", "tag", "src", "dtype", "shape", "sig", "meta"):
        value = getattr(header, name)
        if value is not None:
            out[name] = _jsonable(value)
    return out


def raw_frame(kind: int, body: bytes, payload: bytes = b"", *, magic: bytes = b"ACOL",
              version: int = 1, flags: int = 0, header_len: int | None = None,
              payload_len: int | None = None) -> bytes:
    """A frame assembled by hand, so that any field can be wrong."""
    hl = len(body) if header_len is None else header_len
    pl = len(payload) if payload_len is None else payload_len
    return PREFIX.pack(magic, version, kind, flags, hl, pl) + body + payload


def body(**fields: Any) -> bytes:
    """A msgpack header map with the given short keys, in the order given."""
    return msgpack.packb(fields, use_bin_type=True)


BASE = {"g": 0, "q": 0, "s": 0, "t": 0, "r": 0}


def base(**extra: Any) -> bytes:
    return body(**{**BASE, **extra})


# ----------------------------------------------------------------------------------- vectors

def array_frame(kind: FrameKind, array: np.ndarray, **fields: Any) -> Frame:
    array = np.ascontiguousarray(array)
    header = FrameHeader(dtype=wire.dtype_code(array.dtype), shape=tuple(array.shape), **fields)
    return Frame(kind, header, array.astype(array.dtype.newbyteorder("<")).tobytes())


def _nested(levels: int) -> tuple[Any, ...]:
    """``levels`` tuples, each holding the next, the innermost holding 0."""
    value: Any = 0
    for _ in range(levels):
        value = (value,)
    return value  # type: ignore[no-any-return]


def valid_frames() -> list[tuple[str, Frame]]:
    d, p2p = FrameKind.DATA, FrameKind.P2P
    return [
        ("data_float32_2x3", array_frame(
            d, np.array([[1.5, -2.0, 0.0], [3.25, 1e-3, -0.0]], dtype=np.float32),
            group=1, seq=0, step=0, src=0, sig=("all_reduce", "<f4", (2, 3), "sum"))),
        ("data_int64_1d", array_frame(
            d, np.array([0, 1, -1, 2**62, -(2**63)], dtype=np.int64), group=2, seq=7, step=3,
            src=1)),
        ("data_bool", array_frame(d, np.array([True, False, True, True]), group=1, seq=1,
                                  src=3)),
        ("data_complex128", array_frame(d, np.array([1 + 2j, -0.5 - 0j], dtype=np.complex128),
                                        group=1, seq=2, step=1, src=2)),
        ("data_float16", array_frame(
            d, np.array([1.0, -65504.0, np.inf, 6e-8], dtype=np.float16), group=1, seq=3,
            src=1)),
        ("data_int8", array_frame(d, np.array([-128, 127, 0], dtype=np.int8), seq=4)),
        ("data_int16", array_frame(d, np.array([[-32768], [32767]], dtype=np.int16), seq=5)),
        ("data_uint32", array_frame(d, np.array([0, U32], dtype=np.uint32), seq=6)),
        ("data_complex64", array_frame(d, np.array([0.5 - 1.5j], dtype=np.complex64), seq=7)),
        ("data_empty_float64", array_frame(d, np.zeros((0,), dtype=np.float64), group=3,
                                           seq=1)),
        ("data_empty_2d", array_frame(d, np.zeros((4, 0), dtype=np.int32), group=3, seq=2)),
        ("data_0d_int32", array_frame(d, np.array(-7, dtype=np.int32), group=3, seq=3,
                                      step=2)),
        # SPEC 8.2: the first message rank 2 sends to its destination, user tag 42 in c
        ("p2p_tagged_uint8", array_frame(p2p, np.array([1, 2, 255], dtype=np.uint8), seq=0,
                                         src=2, sig=(42,))),
        ("p2p_third_message_tag_0", array_frame(p2p, np.array([1.5], dtype=np.float64),
                                                group=1, seq=2, src=1, sig=(0,))),
        ("data_sig_nested", array_frame(
            d, np.array([[513]], dtype=np.uint16), group=4, seq=9, step=1, src=1,
            sig=(1, (2, (3, None)), None, "x", (), -5))),
        ("data_sig_at_depth_limit", array_frame(  # c is level 2, its innermost array 32
            d, np.array([1], dtype=np.uint8), seq=10, sig=_nested(wire.MAX_HEADER_DEPTH - 1))),
        ("data_big_ints", array_frame(
            d, np.array([U64], dtype=np.uint64), group=U64 - 1, seq=U64, step=U32,
            tag=(1 << 63) - 1, src=U32)),
        ("abort_peer_lost", Frame(FrameKind.ABORT, FrameHeader(
            src=1, meta={"reason": "connection to rank 3 lost", "error": "PeerLostError",
                         "lost": 3}))),
        ("abort_collective_error", Frame(FrameKind.ABORT, FrameHeader(
            group=1, seq=5, src=0, meta={"reason": "signature mismatch in all_reduce",
                                         "error": "CollectiveError"}))),
        ("bye", Frame(FrameKind.BYE, FrameHeader(src=5))),
        ("close_group", Frame(FrameKind.CLOSE, FrameHeader(group=0x1234, seq=7, src=2,
                                                           meta={"p2p": 3}))),
    ]


def noncanonical_frames() -> list[tuple[str, bytes, Frame]]:
    """Frames that must decode to the given meaning though a canonical encoder would not write
    them so."""
    bye = Frame(FrameKind.BYE, FrameHeader(src=2))
    data = Frame(FrameKind.DATA, FrameHeader(seq=1, dtype="|u1", shape=(2,)), b"\x01\x02")
    return [
        ("unknown_key_ignored", raw_frame(4, body(g=0, q=0, s=0, t=0, r=2, x="future")), bye),
        ("keys_out_of_order", raw_frame(
            1, body(h=[2], d="|u1", r=0, t=0, s=0, q=1, g=0), b"\x01\x02"), data),
        # 0xcf: uint 64 holding 2; 0xcc: uint 8 holding 0 (canonical: positive fixints)
        ("non_minimal_ints", raw_frame(
            4, b"\x85\xa1g\xcc\x00\xa1q\x00\xa1s\x00\xa1t\x00\xa1r\xcf" + (2).to_bytes(8, "big")),
         bye),
        ("nil_optional_keys", raw_frame(
            4, body(g=0, q=0, s=0, t=0, r=2, d=None, h=None, c=None, m=None)), bye),
        ("map16_header", raw_frame(
            4, b"\xde\x00\x05\xa1g\x00\xa1q\x00\xa1s\x00\xa1t\x00\xa1r\x02"), bye),
    ]


def invalid_streams() -> list[dict[str, Any]]:
    good = wire.encode_frame_bytes(Frame(FrameKind.DATA, FrameHeader(
        dtype="<f4", shape=(2, 3)), bytes(24)))
    bye = base()
    deep: Any = None
    for _ in range(wire.MAX_HEADER_DEPTH):  # the header map is level 1: this makes 33 levels
        deep = [deep]
    v: list[dict[str, Any]] = []

    def add(name: str, data: bytes, error: str, **extra: Any) -> None:
        v.append({"name": name, "hex": data.hex(), "error": error, **extra})

    # prefix
    add("bad_magic", raw_frame(4, bye, magic=b"ACOX"), "bad magic")
    add("http_request", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic")
    add("version_0", raw_frame(4, bye, version=0), "unsupported protocol version")
    add("version_2", raw_frame(4, bye, version=2), "unsupported protocol version")
    add("kind_0", raw_frame(0, bye), "unknown frame kind")
    add("kind_99", raw_frame(99, bye), "unknown frame kind")
    add("nonzero_flags", raw_frame(4, bye, flags=1), "reserved flags")
    add("header_len_65537", raw_frame(4, b"", header_len=65537), "header length")
    add("header_len_max_u32", raw_frame(4, b"", header_len=U32), "header length")
    add("payload_len_over_default_limit", raw_frame(4, bye, payload_len=(1 << 32) + 1),
        "exceeds the limit")
    add("payload_len_over_configured_limit", raw_frame(4, bye, payload_len=1025),
        "exceeds the limit", max_payload=1024)
    add("payload_len_over_absolute_cap", raw_frame(4, bye, payload_len=(1 << 40) + 1),
        "exceeds the limit", max_payload=1 << 50)
    add("payload_len_max_u64", raw_frame(4, bye, payload_len=U64), "exceeds the limit")
    # header: msgpack
    add("header_empty", raw_frame(4, b""), "not valid msgpack")
    add("header_not_msgpack", raw_frame(4, b"\xc1"), "not valid msgpack")
    add("header_truncated_msgpack", raw_frame(4, bye[:-1]), "not valid msgpack")
    add("header_trailing_bytes", raw_frame(4, bye + b"\x00"), "not valid msgpack")
    add("header_bad_utf8", raw_frame(4, b"\x86" + bye[1:] + b"\xa1x\xa2\xff\xfe"),
        "not valid msgpack")
    add("header_not_map", raw_frame(4, msgpack.packb([0, 0, 0, 0, 0])), "must be a msgpack map")
    add("header_int_key", raw_frame(4, b"\x86" + bye[1:] + b"\x01\x00"), "not valid msgpack")
    add("header_too_deep", raw_frame(4, base(c=deep)), "nests deeper")
    add("data_sig_too_deep", raw_frame(1, base(d="|u1", h=[1], c=deep), b"\x00"),
        "nests deeper")
    # (deeper than msgpack's own decoder goes: a decoder that recurses must not crash)
    add("header_nested_2000_levels", raw_frame(4, b"\x86" + bye[1:] + b"\xa1c"
                                               + b"\x91" * 2000 + b"\xc0"), "nests deeper")
    # header: fields
    add("missing_field_src", raw_frame(4, body(g=0, q=0, s=0, t=0)), "lacks field 'r'")
    add("missing_field_group_bin_key", raw_frame(
        4, msgpack.packb({b"g": 0, "q": 0, "s": 0, "t": 0, "r": 0}, use_bin_type=True)),
        "lacks field 'g'")
    add("negative_seq", raw_frame(4, body(g=0, q=-1, s=0, t=0, r=0)), "'seq'")
    add("step_over_u32", raw_frame(4, body(g=0, q=0, s=1 << 32, t=0, r=0)), "'step'")
    add("tag_over_i64", raw_frame(4, body(g=0, q=0, s=0, t=1 << 63, r=0)), "'tag'")
    add("src_over_u32", raw_frame(4, body(g=0, q=0, s=0, t=0, r=1 << 32)), "'src'")
    add("group_bool", raw_frame(4, body(g=True, q=0, s=0, t=0, r=0)), "'group'")
    add("seq_float", raw_frame(4, body(g=0, q=1.0, s=0, t=0, r=0)), "'seq'")
    add("src_nil", raw_frame(4, body(g=0, q=0, s=0, t=0, r=None)), "'src'")
    add("dtype_big_endian_f8", raw_frame(1, base(d=">f8", h=[1]), bytes(8)),
        "unsupported dtype")
    add("dtype_object", raw_frame(1, base(d="object", h=[1]), bytes(8)), "unsupported dtype")
    add("dtype_O", raw_frame(1, base(d="|O", h=[1]), bytes(8)), "unsupported dtype")
    add("dtype_native_float32_name", raw_frame(1, base(d="float32", h=[1]), bytes(4)),
        "unsupported dtype")
    add("dtype_bin", raw_frame(1, base(d=b"<f4", h=[1]), bytes(4)), "unsupported dtype")
    add("dtype_array", raw_frame(1, base(d=["<f4"], h=[1]), bytes(4)), "bad header")
    add("shape_not_array", raw_frame(1, base(d="<f4", h=3), bytes(12)),
        "shape must be an array")
    add("shape_negative", raw_frame(1, base(d="<f4", h=[-1]), b""), "bad shape")
    add("shape_33_dims", raw_frame(1, base(d="|u1", h=[1] * 33), b"\x00"), "bad shape")
    add("shape_float_dim", raw_frame(1, base(d="|u1", h=[1.0]), b"\x00"), "bad shape")
    add("sig_not_array", raw_frame(1, base(d="|u1", h=[1], c="all_reduce"), b"\x00"),
        "sig must be an array")
    add("meta_not_map", raw_frame(3, base(m=["reason"])), "meta must be a map")
    add("meta_int_key", raw_frame(3, base(m={1: "x"})), "not valid msgpack")
    add("meta_bin_key", raw_frame(3, base(m={b"reason": "x"})), "meta must be a map")
    # header and payload together
    add("data_payload_too_short", raw_frame(1, base(d="<f4", h=[2, 3]), bytes(20)),
        "does not match")
    add("data_payload_too_long", raw_frame(1, base(d="<f4", h=[2, 3]), bytes(28)),
        "does not match")
    add("data_without_dtype", raw_frame(1, base(h=[3]), bytes(3)), "without dtype and shape")
    add("p2p_without_shape", raw_frame(2, base(d="|u1"), bytes(3)), "without dtype and shape")
    add("data_huge_shape", raw_frame(1, base(d="<f8", h=[1 << 40, 1 << 40]), b""),
        "does not match")
    # the stream
    add("truncated_prefix", good[:10], "stream ended")
    add("truncated_header", good[:25], "stream ended")
    add("truncated_payload", good[:-1], "stream ended")
    add("valid_frame_then_partial", good + good[:19], "stream ended")
    add("valid_frame_then_garbage", good + b"ACOX" + good[4:], "bad magic")
    return v


# ----------------------------------------------------------------------------------- checks

def _decode(data: bytes, max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES) -> list[Frame]:
    return wire.decode_frames(data, max_payload)


def build() -> dict[str, Any]:
    """All vectors, each checked against the reference codec."""
    valid = []
    for name, frame in valid_frames():
        data = wire.encode_frame_bytes(frame)
        assert _decode(data) == [frame], name
        valid.append({"name": name, "hex": data.hex(), "kind": int(frame.kind),
                      "kind_name": frame.kind.name, "header": header_json(frame.header),
                      "payload_hex": bytes(frame.payload).hex()})
    noncanonical = []
    for name, data, frame in noncanonical_frames():
        assert _decode(data) == [frame], name
        canonical = wire.encode_frame_bytes(frame)
        assert canonical != data, name
        noncanonical.append({"name": name, "hex": data.hex(), "kind": int(frame.kind),
                             "kind_name": frame.kind.name, "header": header_json(frame.header),
                             "payload_hex": bytes(frame.payload).hex(),
                             "canonical_hex": canonical.hex()})
    invalid = invalid_streams()
    for vector in invalid:
        try:
            _decode(bytes.fromhex(vector["hex"]),
                    vector.get("max_payload", wire.DEFAULT_MAX_PAYLOAD_BYTES))
        except ProtocolError as exc:
            assert vector["error"] in str(exc), (vector["name"], str(exc))
        else:
            raise AssertionError(f"{vector['name']} decoded without error")
    names = [v["name"] for v in (*valid, *noncanonical, *invalid)]
    assert len(names) == len(set(names)), "duplicate vector names"
    return {"description": DESCRIPTION, "version": wire.VERSION, "valid": valid,
            "noncanonical": noncanonical, "invalid": invalid}


def render() -> str:
    """The JSON text: one vector per line, so that diffs stay readable."""
    doc = build()
    parts = []
    for key, value in doc.items():
        if isinstance(value, list):
            rows = ",\n".join("  " + json.dumps(v, ensure_ascii=True) for v in value)
            parts.append(f"{json.dumps(key)}: [\n{rows}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=True)}")
    text = "{\n " + ",\n ".join(parts) + "\n}\n"
    assert json.loads(text) == doc
    return text


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUTPUT, render(), __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
