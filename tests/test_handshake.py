"""The handshake (asynccoll.handshake) against protocol/vectors/handshake.json, tampering, and
real sockets on 127.0.0.1.

The state machines are driven with the vectors' fixed nonces and must reproduce every frame byte
for byte; the HMACs are recomputed here with hashlib, independently of the implementation.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccoll import handshake
from asynccoll.errors import AuthenticationError, ProtocolError
from asynccoll.handshake import (
    ClientHandshake,
    ServerHandshake,
    client_handshake,
    normalize_token,
    read_frame,
    server_handshake,
    write_frame,
)
from asynccoll.wire import (
    NEED_DATA,
    Frame,
    FrameDecoder,
    FrameHeader,
    FrameKind,
    decode_frames,
    encode_frame_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
VECTORS_PATH = ROOT / "protocol" / "vectors" / "handshake.json"
VECTORS = json.loads(VECTORS_PATH.read_text())
EXCHANGES = {e["name"]: e for e in VECTORS["exchanges"]}
MALFORMED = {e["name"]: e for e in VECTORS["malformed"]}
NONCE_C = bytes(range(32))
NONCE_S = bytes(range(100, 132))
LONG_TOKEN = b"tok-\x00\xff-a-rather-long-shared-secret-0123456789"


# ----------------------------------------------------------------------------------- helpers

def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"bin"}:
            return bytes.fromhex(value["bin"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def frame_of(vector_frame: dict[str, Any]) -> Frame:
    (frame,) = decode_frames(bytes.fromhex(vector_frame["hex"]))
    return frame


def hs_frame(kind: FrameKind, meta: dict[str, Any] | None, payload: bytes = b"") -> Frame:
    return Frame(kind, FrameHeader(meta=meta), payload)


def pair(client_token: Any = "secret", server_token: Any = "secret", **client_kw: Any
         ) -> tuple[ClientHandshake, ServerHandshake]:
    client_kw.setdefault("role", "client")
    return (ClientHandshake(client_token, nonce=NONCE_C, **client_kw),
            ServerHandshake(server_token, nonce=NONCE_S))


def run_exchange(client: ClientHandshake, server: ServerHandshake) -> list[Frame]:
    frames = [client.hello()]
    frames.append(server.on_hello(frames[-1]))
    frames.append(client.on_challenge(frames[-1]))
    frames.append(server.on_proof(frames[-1]))
    client.on_result(frames[-1])
    return frames


def with_meta(frame: Frame, **changes: Any) -> Frame:
    meta = dict(frame.header.meta or {})
    for key, value in changes.items():
        if value is ...:
            meta.pop(key, None)
        else:
            meta[key] = value
    return hs_frame(frame.kind, meta, frame.payload)


# ----------------------------------------------------------------------------------- vectors

def test_vectors_are_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location(
        "make_handshake_vectors", ROOT / "protocol" / "make_handshake_vectors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == VECTORS_PATH.read_text(), "run protocol/make_handshake_vectors.py"


def test_vector_file_shape() -> None:
    assert VECTORS["version"] == 1
    assert set(EXCHANGES) >= {"accepted", "accepted_empty_token", "client_rejects_wrong_server",
                              "server_rejects_wrong_proof", "job_mismatch",
                              # the token's rules (SPEC, Token; Nonces and proofs): text is
                              # UTF-8, a key over 64 bytes is hashed first (RFC 2104)
                              "accepted_non_ascii_token", "accepted_long_token",
                              # job ids at the rendezvous (SPEC, Job ids): a client with one
                              # and with none on a shared server, and rank 0's server, which
                              # admits its own job only
                              "rendezvous_client_with_job", "rendezvous_client_empty_job",
                              "rendezvous_of_rank_0_accepts_its_job",
                              "rendezvous_of_rank_0_refuses_another_job",
                              "rendezvous_of_rank_0_refuses_the_empty_job"}
    for name in ("rendezvous_of_rank_0_refuses_another_job",
                 "rendezvous_of_rank_0_refuses_the_empty_job"):
        assert EXCHANGES[name]["outcome"]["reason"] == "job mismatch", name
    assert EXCHANGES["rendezvous_client_with_job"]["outcome"]["peer_job"] == "train-7"
    assert EXCHANGES["rendezvous_client_empty_job"]["outcome"]["peer_job"] == ""
    assert EXCHANGES["accepted_non_ascii_token"]["client"]["token"].encode() != \
        EXCHANGES["accepted_non_ascii_token"]["client"]["token"].encode("latin-1", "replace")
    assert len(EXCHANGES["accepted_long_token"]["client"]["token"].encode()) > 64
    assert {"hello_bad_role", "proof_instead_of_hello", "proof_31_bytes", "hello_rank_negative",
            "hello_job_bin", "proof_str"} <= set(MALFORMED)
    assert VECTORS["labels"] == {"server": "asynccoll/v1/server", "client": "asynccoll/v1/client"}


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_vector_frames_decode_to_their_meaning(name: str) -> None:
    for vf in EXCHANGES[name]["frames"]:
        data = bytes.fromhex(vf["hex"])
        frame = frame_of(vf)
        assert frame.kind == vf["kind"] == FrameKind[vf["kind_name"]]
        assert frame.header == FrameHeader(meta=from_json(vf["meta"]))  # other fields all 0
        assert frame.payload == b""
        assert encode_frame_bytes(frame) == data
        # sans-IO: the same bytes fed one at a time give the same frame
        decoder = FrameDecoder()
        got = []
        for i in range(len(data)):
            decoder.feed(data[i:i + 1])
            while (f := decoder.next_frame()) is not NEED_DATA:
                got.append(f)
        assert got == [frame]


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_vector_hmacs_recomputed_independently(name: str) -> None:
    ex = EXCHANGES[name]
    cn, sn = bytes.fromhex(ex["client"]["nonce_hex"]), bytes.fromhex(ex["server"]["nonce_hex"])
    for vf in ex["frames"]:
        if vf["kind_name"] == "CHALLENGE":
            message = b"asynccoll/v1/server" + cn + sn
            key = ex["server"]["token"].encode()
        elif vf["kind_name"] == "PROOF":
            message = b"asynccoll/v1/client" + sn + cn
            key = ex["client"]["token"].encode()
        else:
            assert "hmac_message_hex" not in vf
            continue
        assert bytes.fromhex(vf["hmac_message_hex"]) == message
        assert from_json(vf["meta"])["proof"] == hmac.new(key, message, hashlib.sha256).digest()


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_vector_exchange_reproduced_byte_for_byte(name: str) -> None:
    ex = EXCHANGES[name]
    c, s = ex["client"], ex["server"]
    client = ClientHandshake(c["token"], role=c["role"], rank=c["rank"], job=c["job"],
                             nonce=bytes.fromhex(c["nonce_hex"]))
    server = ServerHandshake(s["token"], job=s["job"], nonce=bytes.fromhex(s["nonce_hex"]),
                             welcome_meta=from_json(s["welcome_meta"]))
    vf = ex["frames"]
    outcome = ex["outcome"]
    assert encode_frame_bytes(client.hello()).hex() == vf[0]["hex"]
    assert encode_frame_bytes(server.on_hello(frame_of(vf[0]))).hex() == vf[1]["hex"]
    assert (server.peer_role, server.peer_rank) == (c["role"], c["rank"])
    if outcome["client"] == "error" and outcome["client_error"] == "authentication":
        assert len(vf) == 2
        with pytest.raises(AuthenticationError):
            client.on_challenge(frame_of(vf[1]))
        return
    if name == "server_rejects_wrong_proof":
        with pytest.raises(AuthenticationError):  # an honest client would stop here
            client.on_challenge(frame_of(vf[1]))
    else:
        assert encode_frame_bytes(client.on_challenge(frame_of(vf[1]))).hex() == vf[2]["hex"]
    result = server.on_proof(frame_of(vf[2]))
    assert encode_frame_bytes(result).hex() == vf[3]["hex"]
    if outcome["server"] == "accepted":
        assert server.accepted and server.reason is None
        assert server.peer_job == outcome["peer_job"] == c["job"]
        assert client.on_result(frame_of(vf[3])) == from_json(outcome["welcome_meta"])
        assert client.done and server.done
    else:
        assert not server.accepted and server.reason == outcome["reason"]
        if name != "server_rejects_wrong_proof":
            with pytest.raises(AuthenticationError, match=outcome["reason"]):
                client.on_result(frame_of(vf[3]))


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_vector_answered_with_protocol_error_reject(name: str) -> None:
    """The state machine, fed the vector's client frames, answers each as the vector says and
    raises ProtocolError at the last one; the caller's REJECT is the vector's last frame."""
    vector = MALFORMED[name]
    frames = vector["frames"]
    server = ServerHandshake(vector["server"]["token"], job=vector["server"]["job"],
                             nonce=bytes.fromhex(vector["server"]["nonce_hex"]))
    assert [f["from"] for f in frames] == ["client", "server"] * (len(frames) // 2)
    for i in range(0, len(frames), 2):
        step = server.on_hello if i == 0 else server.on_proof
        if i + 2 < len(frames):
            assert encode_frame_bytes(step(frame_of(frames[i]))).hex() == frames[i + 1]["hex"]
        else:
            with pytest.raises(ProtocolError):
                step(frame_of(frames[i]))
    reject = server.reject_frame(handshake.REASON_PROTOCOL)
    assert encode_frame_bytes(reject).hex() == frames[-1]["hex"]
    assert frames[-1]["meta"] == {"reason": "protocol error"} and not server.accepted


@pytest.mark.parametrize("target", ["rank", "rendezvous"])
async def test_malformed_vectors_against_live_servers(target: str) -> None:
    """Every malformed vector's client frames, sent as they are to a TCP rank's listener and
    to a rendezvous server: the answers have the vector's kinds, the last is its REJECT byte
    for byte, then the connection closes."""
    from asynccoll.rendezvous import RendezvousServer
    from asynccoll.transport.tcp import TcpTransport

    server: Any = (TcpTransport(0, 3, token="secret") if target == "rank"
                   else RendezvousServer(token="secret"))
    try:
        if target == "rank":
            host, port = await server.listen("127.0.0.1", 0)
        else:
            await server.start()
            host, port = server.host, server.port
        for vector in MALFORMED.values():
            reader, writer = await asyncio.open_connection(host, port)
            try:
                async with asyncio.timeout(5):
                    for i in range(0, len(vector["frames"]), 2):
                        writer.write(bytes.fromhex(vector["frames"][i]["hex"]))
                        want = vector["frames"][i + 1]
                        got = await read_frame(reader, 0)
                        assert got is not None and got.kind == want["kind"], vector["name"]
                    assert encode_frame_bytes(got).hex() == want["hex"], vector["name"]
                    assert await reader.read() == b"", vector["name"]
            finally:
                await _close(writer)
    finally:
        await server.close()


def test_token_never_in_vector_frames() -> None:
    for ex in EXCHANGES.values():
        for token in {ex["client"]["token"], ex["server"]["token"]} - {""}:
            for vf in ex["frames"]:
                assert token.encode() not in bytes.fromhex(vf["hex"])


# ----------------------------------------------------------------------------------- state machine

def test_full_exchange_with_random_nonces() -> None:
    client = ClientHandshake(b"k", role="peer", rank=7, job="j")
    server = ServerHandshake("k", job="j", welcome_meta={"world_size": 8})
    frames = [client.hello()]
    frames.append(server.on_hello(frames[-1]))
    frames.append(client.on_challenge(frames[-1]))
    frames.append(server.on_proof(frames[-1]))
    assert client.on_result(frames[-1]) == {"world_size": 8}
    assert (server.accepted, server.peer_role, server.peer_rank, server.peer_job) == (
        True, "peer", 7, "j")
    # fresh random nonces every time
    other = ClientHandshake(b"k", role="client").hello()
    assert other.header.meta["nonce"] != frames[0].header.meta["nonce"]


def test_str_and_bytes_tokens_are_the_same_key() -> None:
    client, server = pair("sécret", "sécret".encode())
    run_exchange(client, server)
    assert server.accepted


def test_a_token_from_an_environment_that_is_not_utf8_is_its_bytes() -> None:
    """ASYNCCOLL_TOKEN holding bytes that are not UTF-8 (a token made with head -c 16
    /dev/urandom) reaches Python as a str with surrogate escapes; encoding it raised
    UnicodeEncodeError in every handshake (the rendezvous server logged an internal error with
    a traceback per connection; the rank's message quoted a character of the token and its
    position). The key is the bytes the environment holds, so every process agrees, and a
    str that no environment could give is refused when the handshake is made, quoting
    nothing of it."""
    assert normalize_token("abc\udcffdef") == b"abc\xffdef"
    client, server = pair("abc\udcffdef", b"abc\xffdef")
    run_exchange(client, server)
    assert server.accepted
    with pytest.raises(ValueError) as info:
        ClientHandshake("x\ud800secret", role="client")
    assert "secret" not in str(info.value) and "ud800" not in str(info.value)
    assert "UTF-8" in str(info.value), info.value


def test_none_token_is_empty_token() -> None:
    client, server = pair(None, b"")
    run_exchange(client, server)
    assert server.accepted


def test_wrong_token_client_side_detects_impostor_server() -> None:
    client, server = pair("right", "wrong")
    challenge = server.on_hello(client.hello())
    with pytest.raises(AuthenticationError, match="server failed to prove"):
        client.on_challenge(challenge)
    with pytest.raises(RuntimeError):  # dead after the error
        client.on_result(challenge)


def test_wrong_token_server_side_rejects_forged_proof() -> None:
    client, server = pair("right", "right")
    challenge = server.on_hello(client.hello())
    proof = client.on_challenge(challenge)
    forged = with_meta(proof, proof=hmac.new(b"wrong", b"x", hashlib.sha256).digest())
    result = server.on_proof(forged)
    assert result.kind == FrameKind.REJECT
    assert result.header.meta == {"reason": "authentication failed"}
    assert not server.accepted and server.reason == "authentication failed"
    with pytest.raises(AuthenticationError, match="authentication failed"):
        client.on_result(result)


def test_job_mismatch_rejected_after_authentication() -> None:
    client = ClientHandshake("t", role="client", job="a", nonce=NONCE_C)
    server = ServerHandshake("t", job="b", nonce=NONCE_S)
    proof = client.on_challenge(server.on_hello(client.hello()))
    result = server.on_proof(proof)
    assert result.header.meta == {"reason": "job mismatch"}
    with pytest.raises(AuthenticationError, match="job mismatch"):
        client.on_result(result)


def test_server_without_job_accepts_any_job() -> None:
    client = ClientHandshake("t", role="client", job="anything")
    server = ServerHandshake("t")
    run_exchange(client, server)
    assert server.accepted and server.peer_job == "anything"


def test_unauthenticated_client_with_wrong_job_reads_authentication_failed() -> None:
    client = ClientHandshake("t", role="client", job="a", nonce=NONCE_C)
    server = ServerHandshake("t", job="b", nonce=NONCE_S)
    server.on_hello(client.hello())
    result = server.on_proof(hs_frame(FrameKind.PROOF, {"proof": bytes(32)}))
    assert result.header.meta == {"reason": "authentication failed"}


def test_reflected_server_proof_is_not_a_client_proof() -> None:
    # the labels separate the two proofs: echoing the server's proof back fails
    client, server = pair()
    challenge = server.on_hello(client.hello())
    result = server.on_proof(hs_frame(FrameKind.PROOF, {"proof": challenge.header.meta["proof"]}))
    assert result.kind == FrameKind.REJECT


@pytest.mark.parametrize("field", ["nonce", "proof"])
def test_tampered_challenge_is_an_authentication_error(field: str) -> None:
    client, server = pair()
    challenge = server.on_hello(client.hello())
    value = bytearray(challenge.header.meta[field])
    value[5] ^= 0x01
    with pytest.raises(AuthenticationError):
        client.on_challenge(with_meta(challenge, **{field: bytes(value)}))


def test_tampered_hello_nonce_makes_client_reject_the_server() -> None:
    # a man in the middle that changes the client's nonce breaks the server's proof
    client, server = pair()
    hello = client.hello()
    challenge = server.on_hello(with_meta(hello, nonce=bytes(32)))
    with pytest.raises(AuthenticationError):
        client.on_challenge(challenge)


def test_tampered_proof_rejected() -> None:
    client, server = pair()
    proof = client.on_challenge(server.on_hello(client.hello()))
    value = bytearray(proof.header.meta["proof"])
    value[-1] ^= 0x80
    assert server.on_proof(with_meta(proof, proof=bytes(value))).kind == FrameKind.REJECT


BAD_HELLOS = {
    "no meta": None,
    "role missing": {"rank": None, "nonce": NONCE_C, "job": ""},
    "role unknown": {"role": "admin", "rank": None, "nonce": NONCE_C, "job": ""},
    "role bin": {"role": b"client", "rank": None, "nonce": NONCE_C, "job": ""},
    "rank bool": {"role": "peer", "rank": True, "nonce": NONCE_C, "job": ""},
    "rank negative": {"role": "peer", "rank": -1, "nonce": NONCE_C, "job": ""},
    "rank float": {"role": "peer", "rank": 1.0, "nonce": NONCE_C, "job": ""},
    "peer without rank": {"role": "peer", "rank": None, "nonce": NONCE_C, "job": ""},
    "nonce short": {"role": "client", "rank": None, "nonce": NONCE_C[:31], "job": ""},
    "nonce long": {"role": "client", "rank": None, "nonce": NONCE_C + b"\0", "job": ""},
    "nonce str": {"role": "client", "rank": None, "nonce": "x" * 32, "job": ""},
    "nonce missing": {"role": "client", "rank": None, "job": ""},
    "job missing": {"role": "client", "rank": None, "nonce": NONCE_C},
    "job int": {"role": "client", "rank": None, "nonce": NONCE_C, "job": 1},
}


@pytest.mark.parametrize("case", sorted(BAD_HELLOS))
def test_malformed_hello_is_a_protocol_error(case: str) -> None:
    server = ServerHandshake("t")
    with pytest.raises(ProtocolError) as info:
        server.on_hello(hs_frame(FrameKind.HELLO, BAD_HELLOS[case]))
    assert not isinstance(info.value, AuthenticationError)
    assert not server.accepted


def test_unknown_hello_keys_are_ignored() -> None:
    client, server = pair()
    hello = with_meta(client.hello(), future_key=[1, 2, 3])
    proof = client.on_challenge(server.on_hello(hello))
    assert server.on_proof(proof).kind == FrameKind.WELCOME


@pytest.mark.parametrize("kind", [FrameKind.DATA, FrameKind.PROOF, FrameKind.REQUEST,
                                  FrameKind.CHALLENGE])
def test_wrong_kind_instead_of_hello(kind: FrameKind) -> None:
    client, server = pair()
    hello = client.hello()
    with pytest.raises(ProtocolError, match="expected a HELLO"):
        server.on_hello(Frame(kind, hello.header, b""))


def test_handshake_frame_with_payload_is_a_protocol_error() -> None:
    client, server = pair()
    hello = client.hello()
    with pytest.raises(ProtocolError, match="payload"):
        server.on_hello(Frame(FrameKind.HELLO, hello.header, b"extra"))


@pytest.mark.parametrize("meta", [None, {"nonce": NONCE_S}, {"proof": bytes(32)},
                                  {"nonce": NONCE_S[:16], "proof": bytes(32)},
                                  {"nonce": NONCE_S, "proof": bytes(31)},
                                  {"nonce": NONCE_S, "proof": "p" * 32}])
def test_malformed_challenge_is_a_protocol_error(meta: dict[str, Any] | None) -> None:
    client = ClientHandshake("t", role="client")
    client.hello()
    with pytest.raises(ProtocolError) as info:
        client.on_challenge(hs_frame(FrameKind.CHALLENGE, meta))
    assert not isinstance(info.value, AuthenticationError)


def test_client_wrong_kind_instead_of_challenge_and_result() -> None:
    client, server = pair()
    hello = client.hello()
    with pytest.raises(ProtocolError, match="expected a CHALLENGE"):
        client.on_challenge(hs_frame(FrameKind.WELCOME, {}))
    client2, server2 = pair()
    proof = client2.on_challenge(server2.on_hello(client2.hello()))
    server2.on_proof(proof)
    with pytest.raises(ProtocolError, match="expected a WELCOME"):
        client2.on_result(hs_frame(FrameKind.CHALLENGE, {}))
    del hello, server


def test_reject_instead_of_challenge_carries_the_reason() -> None:
    client = ClientHandshake("t", role="client")
    client.hello()
    with pytest.raises(AuthenticationError, match="protocol error"):
        client.on_challenge(hs_frame(FrameKind.REJECT, {"reason": "protocol error"}))


def test_reject_reason_is_truncated() -> None:
    client, server = pair()
    client.on_challenge(server.on_hello(client.hello()))
    with pytest.raises(AuthenticationError) as info:
        client.on_result(hs_frame(FrameKind.REJECT, {"reason": "x" * 10_000}))
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("meta", [{"proof": bytes(31)}, {"proof": None}, {}, None,
                                  {"proof": "a" * 32}])
def test_malformed_proof_is_a_protocol_error(meta: dict[str, Any] | None) -> None:
    client, server = pair()
    server.on_hello(client.hello())
    with pytest.raises(ProtocolError):
        server.on_proof(hs_frame(FrameKind.PROOF, meta))
    assert not server.accepted


def test_calls_out_of_order_are_caller_bugs() -> None:
    client, server = pair()
    with pytest.raises(RuntimeError):
        client.on_challenge(hs_frame(FrameKind.CHALLENGE, {}))
    with pytest.raises(RuntimeError):
        server.on_proof(hs_frame(FrameKind.PROOF, {}))
    hello = client.hello()
    with pytest.raises(RuntimeError):
        client.hello()
    server.on_hello(hello)
    with pytest.raises(RuntimeError):
        server.on_hello(hello)


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"role": "admin"}, ValueError),
    ({"role": "peer"}, ValueError),                 # a peer needs a rank
    ({"role": "peer", "rank": -1}, ValueError),
    ({"role": "peer", "rank": True}, ValueError),
    ({"role": "client", "job": 3}, TypeError),
    ({"role": "client", "nonce": b"short"}, ValueError),
])
def test_client_bad_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        ClientHandshake("t", **kwargs)


def test_bad_token_type() -> None:
    with pytest.raises(TypeError):
        ClientHandshake(123, role="client")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ServerHandshake(["x"])  # type: ignore[arg-type]


@settings(deadline=None, max_examples=50, database=None)
@given(token=st.binary(min_size=12, max_size=64), role_rank=st.sampled_from(
    [("client", None), ("peer", 0), ("peer", 12345)]))
def test_token_never_appears_in_frames_or_reprs(token: bytes, role_rank: tuple[str, Any]
                                               ) -> None:
    role, rank = role_rank
    client = ClientHandshake(token, role=role, rank=rank, job="job")
    server = ServerHandshake(token, job="job")
    frames = run_exchange(client, server)
    assert server.accepted
    wire_bytes = b"".join(encode_frame_bytes(f) for f in frames)
    assert token not in wire_bytes
    for text in (repr(client), repr(server)):
        assert repr(token) not in text and token.hex() not in text


def test_token_not_in_error_messages() -> None:
    client, server = pair(LONG_TOKEN, b"other-" + LONG_TOKEN)
    with pytest.raises(AuthenticationError) as info:
        client.on_challenge(server.on_hello(client.hello()))
    assert LONG_TOKEN.decode("latin-1") not in str(info.value)
    assert LONG_TOKEN.hex() not in str(info.value)


# ----------------------------------------------------------------------------------- read_frame

def _reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_read_frame_whole_frames_then_clean_eof() -> None:
    frames = [ClientHandshake("t", role="client").hello(),
              Frame(FrameKind.RESPONSE, FrameHeader(meta={"id": 1}), b"value")]
    reader = _reader_with(b"".join(encode_frame_bytes(f) for f in frames))
    assert await read_frame(reader, 1024) == frames[0]
    assert await read_frame(reader, 1024) == frames[1]
    assert await read_frame(reader, 1024) is None


@pytest.mark.parametrize("cut", [1, 19, 20, 25, -1])
async def test_read_frame_eof_mid_frame(cut: int) -> None:
    data = encode_frame_bytes(Frame(FrameKind.REQUEST, FrameHeader(meta={"id": 1}), b"abc"))
    with pytest.raises(ProtocolError, match="middle"):
        await read_frame(_reader_with(data[:cut]), 1024)


async def test_read_frame_limits_and_magic() -> None:
    head = struct.pack("!4sBBHIQ", b"ACOL", 1, 32, 0, 10, 2048)
    with pytest.raises(ProtocolError, match="exceeds"):
        await read_frame(_reader_with(head, eof=False), 1024)
    with pytest.raises(ProtocolError, match="magic"):
        await read_frame(_reader_with(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), 1024)
    huge_header = struct.pack("!4sBBHIQ", b"ACOL", 1, 16, 0, 1 << 20, 0)
    with pytest.raises(ProtocolError, match="header length"):
        await read_frame(_reader_with(huge_header, eof=False), 1024)


# ----------------------------------------------------------------------------------- sockets

class _Served:
    """One-connection helper: runs ``server_handshake`` on whatever connects."""

    def __init__(self, token: Any, **kwargs: Any) -> None:
        self.token, self.kwargs = token, kwargs
        self.result: asyncio.Future[Any] | None = None
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> _Served:
        self.result = asyncio.get_running_loop().create_future()
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.result is not None
        outcome: Any = None
        try:
            outcome = await server_handshake(reader, writer, self.token, **self.kwargs)
        except Exception as exc:
            outcome = exc
        finally:
            await _close(writer)
            self.result.set_result(outcome)  # only once the handler is all but finished

    async def outcome(self) -> Any:
        assert self.result is not None
        async with asyncio.timeout(5):
            return await self.result

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass


async def test_stream_handshake_success() -> None:
    async with _Served("tok", job="j", welcome_meta={"rank": 0}) as served:
        reader, writer = await _open(served.port)
        try:
            welcome = await client_handshake(reader, writer, "tok", role="peer", rank=2, job="j",
                                             timeout=2)
        finally:
            await _close(writer)
        hs = await served.outcome()
    assert welcome == {"rank": 0}
    assert isinstance(hs, ServerHandshake) and hs.accepted and hs.peer_rank == 2


async def test_stream_handshake_wrong_token_fails_on_both_sides() -> None:
    async with _Served(LONG_TOKEN) as served:
        reader, writer = await _open(served.port)
        try:
            with pytest.raises(AuthenticationError) as info:
                await client_handshake(reader, writer, b"not-the-token", role="client",
                                       timeout=2)
        finally:
            await _close(writer)
        server_error = await served.outcome()
    assert isinstance(server_error, ProtocolError)  # the client hung up instead of proving
    for text in (str(info.value), str(server_error)):
        assert "not-the-token" not in text and LONG_TOKEN.decode("latin-1") not in text


async def test_stream_handshake_server_sends_reject_then_raises() -> None:
    async with _Served("tok", job="right") as served:
        reader, writer = await _open(served.port)
        try:
            with pytest.raises(AuthenticationError, match="job mismatch"):
                await client_handshake(reader, writer, "tok", role="client", job="wrong",
                                       timeout=2)
        finally:
            await _close(writer)
        server_error = await served.outcome()
    assert isinstance(server_error, AuthenticationError)
    assert "job mismatch" in str(server_error)


async def test_stream_handshake_forged_proof_gets_reject() -> None:
    async with _Served("tok") as served:
        reader, writer = await _open(served.port)
        try:
            client = ClientHandshake("tok", role="client")
            write_frame(writer, client.hello())
            challenge = await read_frame(reader, 0)
            assert challenge is not None and challenge.kind == FrameKind.CHALLENGE
            write_frame(writer, hs_frame(FrameKind.PROOF, {"proof": bytes(32)}))
            result = await read_frame(reader, 0)
            assert result is not None and result.kind == FrameKind.REJECT
            assert result.header.meta == {"reason": "authentication failed"}
            assert await read_frame(reader, 0) is None  # then the server closes
        finally:
            await _close(writer)
        assert isinstance(await served.outcome(), AuthenticationError)


async def test_stream_handshake_malformed_hello_gets_reject() -> None:
    async with _Served("tok") as served:
        reader, writer = await _open(served.port)
        try:
            write_frame(writer, hs_frame(FrameKind.HELLO, {"role": "admin"}))
            result = await read_frame(reader, 0)
            assert result is not None and result.kind == FrameKind.REJECT
            assert result.header.meta == {"reason": "protocol error"}
        finally:
            await _close(writer)
        error = await served.outcome()
        assert isinstance(error, ProtocolError) and not isinstance(error, AuthenticationError)


async def test_stream_handshake_server_times_out_silent_client() -> None:
    async with _Served("tok", timeout=0.2) as served:
        reader, writer = await _open(served.port)
        try:
            error = await served.outcome()
            assert isinstance(error, TimeoutError)
            assert await reader.read() == b""  # closed by the server
        finally:
            await _close(writer)


async def _one_shot_server(handler: Any) -> tuple[asyncio.Server, asyncio.Event]:
    """A server whose single handler sets the returned event when it has finished."""
    finished = asyncio.Event()

    async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            await _close(writer)
            finished.set()

    return await asyncio.start_server(wrapped, "127.0.0.1", 0), finished


async def _client_against(handler: Any, **kwargs: Any) -> None:
    server, finished = await _one_shot_server(handler)
    try:
        reader, writer = await _open(server.sockets[0].getsockname()[1])
        try:
            await client_handshake(reader, writer, "tok", role="client", **kwargs)
        finally:
            await _close(writer)
            async with asyncio.timeout(2):
                await finished.wait()
    finally:
        server.close()
        await server.wait_closed()


async def test_stream_handshake_client_times_out_silent_server() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    with pytest.raises(TimeoutError):
        await _client_against(silent, timeout=0.2)


async def test_stream_handshake_client_sees_garbage_server() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n" + bytes(64))
        await writer.drain()

    with pytest.raises(ProtocolError, match="magic"):
        await _client_against(garbage, timeout=2)


async def test_stream_handshake_client_sees_server_hang_up() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert (await read_frame(reader, 0)) is not None  # reads HELLO, answers nothing

    with pytest.raises(ProtocolError, match="connection closed during the handshake"):
        await _client_against(hang_up, timeout=2)


def test_public_names() -> None:
    for name in handshake.__all__:
        assert hasattr(handshake, name)
