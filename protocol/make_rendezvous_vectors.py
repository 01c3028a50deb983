"""Generate ``protocol/vectors/rendezvous.json``, the rendezvous test vectors, by driving the
reference ``RendezvousServer`` over a loopback socket.

The JSON file is the artefact (see ``protocol/SPEC.md``, "Rendezvous messages", "Test
vectors"); this script documents how it was made::

    python protocol/make_rendezvous_vectors.py           # rewrite the file
    python protocol/make_rendezvous_vectors.py --check   # exit 1 if the file is out of date

``session`` is one connection to a fresh server (token ``"secret"``, default limits): each
REQUEST is sent after the previous RESPONSE arrived, so the server's state carries from step
to step and every response is deterministic (waiting ops use a ``timeout`` of 0 or find what
they wait for). ``closing`` holds requests that each make the server close a connection of
their own, without a response. ``limits`` is one connection, as ``session``, to a fresh
server with the small limits of ``limits_server``: the error code ``limit``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asynccoll.handshake import client_handshake, read_frame  # noqa: E402
from asynccoll.rendezvous import RendezvousServer  # noqa: E402
from asynccoll.wire import (  # noqa: E402
    Frame,
    FrameHeader,
    FrameKind,
    decode_frames,
    encode_frame_bytes,
)
from protocol._vectorfile import json_lines, write_or_check  # noqa: E402

OUTPUT = ROOT / "protocol" / "vectors" / "rendezvous.json"
TOKEN = "secret"
#: the limits of the server the ``limits`` steps run against (RendezvousServer arguments)
LIMITS = {"max_keys": 2, "max_store_bytes": 8, "max_waiting": 0}

DESCRIPTION = (
    "asynccoll protocol v1: rendezvous test vectors (see protocol/SPEC.md, 'Rendezvous "
    "messages'). 'session': the REQUESTs one client sends on one connection to a fresh server, "
    "in order, each after the previous RESPONSE arrived, and the RESPONSE the server sends to "
    "each ('request_hex', 'response_hex': whole frames; 'request'/'response': their meta and "
    "payload in hex, a msgpack bin value written {\"bin\": hex}). 'closing': REQUESTs (or "
    "other frames) each sent first on a connection of its own, after which the server closes "
    "the connection without a response. 'limits': as 'session', on one connection to a fresh "
    "server with the limits of 'limits_server' (max_keys: keys and roster entries; "
    "max_store_bytes: bytes of keys, values, roster hosts and packed metas; max_waiting: "
    "requests waiting at once). The handshake before each connection is ordinary "
    "(token 'secret', role 'client')."
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _request(rid: int, op: str, payload: bytes = b"", **args: Any) -> Frame:
    return Frame(FrameKind.REQUEST, FrameHeader(meta={"id": rid, "op": op, **args}), payload)


def session_requests() -> list[tuple[str, Frame]]:
    """(name, REQUEST) in the order they are sent; every op and every error code."""
    steps: list[tuple[str, str, bytes, dict[str, Any]]] = [
        ("set", "set", b"v1", {"key": "a"}),
        ("set_empty_value", "set", b"", {"key": "empty"}),
        ("get_found", "get", b"", {"key": "a"}),
        ("get_empty_value", "get", b"", {"key": "empty"}),
        ("get_missing_nowait", "get", b"", {"key": "nope", "wait": False}),
        ("get_missing_timeout", "get", b"", {"key": "nope", "timeout": 0}),
        ("get_default_wait_found", "get", b"", {"key": "a", "timeout": None}),
        ("wait_present", "wait", b"", {"keys": ["a", "empty"], "timeout": 1.5}),
        ("wait_no_keys", "wait", b"", {"keys": []}),
        ("wait_timeout", "wait", b"", {"keys": ["a", "nope"], "timeout": 0}),
        ("add_missing_key", "add", b"", {"key": "n", "delta": 5}),
        ("add_negative", "add", b"", {"key": "n", "delta": -7}),
        ("get_added_value", "get", b"", {"key": "n"}),
        ("add_not_integer", "add", b"", {"key": "a", "delta": 1}),
        ("add_max", "add", b"", {"key": "m", "delta": (1 << 63) - 1}),
        ("add_overflow", "add", b"", {"key": "m", "delta": 1}),
        ("set_leading_zeros", "set", b"007", {"key": "z"}),
        ("add_leading_zeros", "add", b"", {"key": "z", "delta": 0}),
        ("compare_set_create", "compare_set", b"c1", {"key": "c", "expected": None}),
        ("compare_set_exists", "compare_set", b"c2", {"key": "c", "expected": None}),
        ("compare_set_swap", "compare_set", b"c2", {"key": "c", "expected": b"c1"}),
        ("compare_set_mismatch", "compare_set", b"c3", {"key": "c", "expected": b"c1"}),
        ("compare_set_empty_on_missing", "compare_set", b"x", {"key": "nokey",
                                                                 "expected": b""}),
        ("delete_present", "delete", b"", {"key": "c"}),
        ("delete_missing", "delete", b"", {"key": "c"}),
        ("num_keys", "num_keys", b"", {}),
        ("generation_initial", "generation", b"", {}),
        ("join_rank_1", "join", b"", {"rank": 1, "host": "10.0.0.2", "port": 40001,
                                      "meta": {"crowded": False}}),
        ("join_rank_0_nil_meta", "join", b"", {"rank": 0, "host": "10.0.0.1", "port": 40000,
                                               "meta": None}),
        ("roster", "roster", b"", {}),
        ("roster_world_size_met", "roster", b"", {"world_size": 2, "timeout": 0}),
        ("roster_world_size_timeout", "roster", b"", {"world_size": 3, "timeout": 0}),
        ("roster_other_generation", "roster", b"", {"world_size": 3, "generation": 7,
                                                     "timeout": 0}),
        ("leave_present", "leave", b"", {"rank": 1}),
        ("leave_missing", "leave", b"", {"rank": 1}),
        ("bump_generation_expected_wrong", "bump_generation", b"", {"expected": 5}),
        ("bump_generation_expected", "bump_generation", b"", {"expected": 0}),
        ("bump_generation", "bump_generation", b"", {}),
        ("roster_after_bump", "roster", b"", {}),
        ("unknown_op", "frobnicate", b"", {"key": "a"}),
        ("unknown_argument_ignored", "get", b"", {"key": "a", "future": [1, 2]}),
        ("bad_request_missing_key", "get", b"", {}),
        ("bad_request_key_bin", "get", b"", {"key": b"a"}),
        ("bad_request_wait_nil", "get", b"", {"key": "a", "wait": None}),
        ("bad_request_timeout_negative", "get", b"", {"key": "a", "timeout": -1}),
        ("bad_request_timeout_too_long", "get", b"", {"key": "a", "timeout": 86401}),
        ("bad_request_timeout_bool", "wait", b"", {"keys": ["a"], "timeout": True}),
        ("bad_request_keys_not_array", "wait", b"", {"keys": "a"}),
        ("bad_request_unexpected_payload", "get", b"x", {"key": "a"}),
        ("bad_request_delta_float", "add", b"", {"key": "n", "delta": 1.0}),
        ("bad_request_delta_over_i64", "add", b"", {"key": "n", "delta": 1 << 63}),
        ("bad_request_expected_missing", "compare_set", b"x", {"key": "c"}),
        ("bad_request_expected_str", "compare_set", b"x", {"key": "c", "expected": "x"}),
        ("bad_request_rank_over_u32", "join", b"", {"rank": 1 << 32, "host": "h", "port": 1}),
        ("bad_request_port_over_u16", "join", b"", {"rank": 0, "host": "h", "port": 65536}),
        ("bad_request_meta_not_map", "join", b"", {"rank": 0, "host": "h", "port": 1,
                                                   "meta": [1]}),
        ("bad_request_world_size_0", "roster", b"", {"world_size": 0}),
        ("bad_request_generation_negative", "roster", b"", {"generation": -1}),
        ("bad_request_expected_bool", "bump_generation", b"", {"expected": True}),
    ]
    return [(name, _request(i, op, payload, **args))
            for i, (name, op, payload, args) in enumerate(steps, start=1)]


def limits_requests() -> list[tuple[str, Frame]]:
    """(name, REQUEST) in the order they are sent to a server with ``LIMITS``."""
    steps: list[tuple[str, str, bytes, dict[str, Any]]] = [
        ("set_within_limits", "set", b"1", {"key": "a"}),
        ("get_that_would_wait", "get", b"", {"key": "nope", "timeout": 1}),
        ("wait_that_would_wait", "wait", b"", {"keys": ["nope"], "timeout": 1}),
        ("roster_that_would_wait", "roster", b"", {"world_size": 1, "timeout": 1}),
        ("get_found_does_not_wait", "get", b"", {"key": "a"}),
        ("set_past_max_store_bytes", "set", b"1234567", {"key": "b"}),
        ("set_second_key", "set", b"12", {"key": "b"}),
        ("set_existing_key", "set", b"3", {"key": "b"}),
        ("add_past_max_keys", "add", b"", {"key": "c", "delta": 1}),
        ("compare_set_past_max_keys", "compare_set", b"x", {"key": "c", "expected": None}),
        ("join_past_max_keys", "join", b"", {"rank": 0, "host": "h", "port": 1}),
        ("delete_makes_room", "delete", b"", {"key": "a"}),
        ("join_within_limits", "join", b"", {"rank": 0, "host": "h", "port": 1}),
        ("num_keys", "num_keys", b"", {}),
    ]
    return [(name, _request(i, op, payload, **args))
            for i, (name, op, payload, args) in enumerate(steps, start=1)]


def closing_frames() -> list[tuple[str, Frame]]:
    """Frames after which the server closes the connection without a response."""
    return [
        ("request_without_meta", Frame(FrameKind.REQUEST, FrameHeader(), b"")),
        ("request_id_missing", Frame(FrameKind.REQUEST, FrameHeader(meta={"op": "num_keys"}))),
        ("request_id_negative", _request(-1, "num_keys")),
        ("request_id_over_i63", _request(1 << 63, "num_keys")),
        ("request_id_bool", Frame(FrameKind.REQUEST, FrameHeader(
            meta={"id": True, "op": "num_keys"}))),
        ("request_op_missing", Frame(FrameKind.REQUEST, FrameHeader(meta={"id": 1}))),
        ("request_op_bin", Frame(FrameKind.REQUEST, FrameHeader(
            meta={"id": 1, "op": b"num_keys"}))),
        ("response_kind", Frame(FrameKind.RESPONSE, FrameHeader(meta={"id": 1, "ok": True}))),
        ("hello_kind", Frame(FrameKind.HELLO, FrameHeader(meta={"role": "client"}))),
        ("bye_kind", Frame(FrameKind.BYE, FrameHeader())),
    ]


def _frame_json(frame: Frame) -> dict[str, Any]:
    return {"meta": _jsonable(frame.header.meta or {}),
            "payload_hex": bytes(frame.payload).hex()}


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await client_handshake(reader, writer, TOKEN, role="client", timeout=5)
    return reader, writer


async def run_session(port: int, requests: list[bytes]) -> list[bytes]:
    """Send each REQUEST (whole frame bytes) in turn on one connection; return each RESPONSE's
    bytes (re-encoded canonically from what arrived)."""
    reader, writer = await _connect(port)
    out = []
    try:
        for data in requests:
            writer.write(data)
            await writer.drain()
            async with asyncio.timeout(5):
                frame = await read_frame(reader, 1 << 26)
            assert frame is not None, "the server closed the connection"
            out.append(encode_frame_bytes(frame))
    finally:
        writer.close()
    return out


async def closes_without_response(port: int, data: bytes) -> bool:
    """Whether the server closes the connection after ``data`` without sending anything."""
    reader, writer = await _connect(port)
    try:
        writer.write(data)
        async with asyncio.timeout(5):
            return await reader.read() == b""
    finally:
        writer.close()


async def _build() -> dict[str, Any]:
    requests = session_requests()
    async with RendezvousServer("127.0.0.1", 0, token=TOKEN) as server:
        responses = await run_session(server.port,
                                      [encode_frame_bytes(f) for _, f in requests])
        closing = []
        for name, frame in closing_frames():
            data = encode_frame_bytes(frame)
            assert await closes_without_response(server.port, data), name
            closing.append({"name": name, "hex": data.hex(), "kind": int(frame.kind),
                            "meta": _jsonable(frame.header.meta)})
    limited = limits_requests()
    async with RendezvousServer("127.0.0.1", 0, token=TOKEN, **LIMITS) as server:
        limited_responses = await run_session(server.port,
                                              [encode_frame_bytes(f) for _, f in limited])
    session = _steps(requests, responses)
    roster = next(s for s in session if s["name"] == "roster")
    members = msgpack.unpackb(bytes.fromhex(roster["response"]["payload_hex"]), raw=False)
    assert members == [[0, "10.0.0.1", 40000, {}], [1, "10.0.0.2", 40001, {"crowded": False}]]
    limits = _steps(limited, limited_responses)
    assert {s["response"]["meta"].get("code") for s in limits} == {None, "limit"}
    return {"description": DESCRIPTION, "version": 1, "token": TOKEN,
            "limits_server": LIMITS, "session": session, "closing": closing,
            "limits": limits}


def _steps(requests: list[tuple[str, Frame]], responses: list[bytes]) -> list[dict[str, Any]]:
    steps = []
    for (name, request), response_bytes in zip(requests, responses, strict=True):
        frames = decode_frames(response_bytes, 1 << 26)
        assert len(frames) == 1 and frames[0].kind == FrameKind.RESPONSE, name
        response = frames[0]
        assert request.header.meta is not None and response.header.meta is not None
        assert response.header.meta["id"] == request.header.meta["id"], name
        steps.append({"name": name, "request_hex": encode_frame_bytes(request).hex(),
                      "request": _frame_json(request), "response_hex": response_bytes.hex(),
                      "response": _frame_json(response)})
    return steps


def build() -> dict[str, Any]:
    """All vectors, from a fresh server (its WARNINGs about the closing cases silenced)."""
    log = logging.getLogger("asynccoll.rendezvous")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return asyncio.run(_build())
    finally:
        log.setLevel(level)


def render() -> str:
    """The file's exact text: one vector per line."""
    return json_lines(build(), ("session", "closing", "limits"))


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUTPUT, render(), __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
