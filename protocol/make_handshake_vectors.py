"""Generate ``protocol/vectors/handshake.json``, the handshake test vectors, from
``asynccoll.handshake``.

The JSON file is the artefact (see ``protocol/SPEC.md``, "Handshake"); this script documents
how it was made::

    python protocol/make_handshake_vectors.py           # rewrite the file
    python protocol/make_handshake_vectors.py --check   # exit 1 if the file is out of date

Every exchange uses fixed tokens and nonces, so the frames are deterministic. Frames are built
by the reference state machines (``ClientHandshake``, ``ServerHandshake``), except the PROOF of
``server_rejects_wrong_proof``, which a misbehaving client computes without checking the
server's proof first (an honest client would have stopped after the CHALLENGE).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asynccoll import handshake  # noqa: E402
from asynccoll.errors import AuthenticationError, ProtocolError  # noqa: E402
from asynccoll.rendezvous._common import DEFAULT_MAX_VALUE_BYTES  # noqa: E402
from asynccoll.wire import Frame, FrameHeader, FrameKind, encode_frame_bytes  # noqa: E402
from protocol._vectorfile import json_lines, write_or_check  # noqa: E402

OUTPUT = ROOT / "protocol" / "vectors" / "handshake.json"

DESCRIPTION = (
    "asynccoll protocol v1: handshake test vectors (see protocol/SPEC.md, 'Handshake'). Each "
    "exchange gives both sides' inputs (tokens as UTF-8 strings, nonces in hex) and the frames "
    "in the order they are sent ('from' is 'client' or 'server'); 'hex' is the whole frame, "
    "'meta' its decoded header meta, where a msgpack bin value is written {\"bin\": hex}. For "
    "CHALLENGE and PROOF frames, 'hmac_message_hex' is the exact message given to HMAC-SHA256 "
    "keyed with the sender's token. 'outcome' says how each side ends. Frame headers other than "
    "'meta' are all zero."
)

CLIENT_NONCE = bytes(range(0x00, 0x20))
#: what the reference rendezvous server's WELCOME carries (its default max_value_bytes)
RENDEZVOUS_WELCOME = {"max_value_bytes": DEFAULT_MAX_VALUE_BYTES}
SERVER_NONCE = bytes(range(0xA0, 0xC0))


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _frame_json(sender: str, frame: Frame, hmac_message: bytes | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "from": sender,
        "kind": int(frame.kind),
        "kind_name": frame.kind.name,
        "hex": encode_frame_bytes(frame).hex(),
        "meta": _jsonable(frame.header.meta or {}),
    }
    if hmac_message is not None:
        out["hmac_message_hex"] = hmac_message.hex()
    return out


def _exchange(name: str, description: str, *, client_token: str, server_token: str,
              role: str, rank: int | None, client_job: str, server_job: str,
              welcome_meta: dict[str, Any], forge_proof: bool = False) -> dict[str, Any]:
    client = handshake.ClientHandshake(client_token, role=role, rank=rank, job=client_job,
                                       nonce=CLIENT_NONCE)
    server = handshake.ServerHandshake(server_token, job=server_job, nonce=SERVER_NONCE,
                                       welcome_meta=welcome_meta)
    frames = []
    hello = client.hello()
    frames.append(_frame_json("client", hello))
    challenge = server.on_hello(hello)
    frames.append(_frame_json("server", challenge,
                              handshake.SERVER_LABEL + CLIENT_NONCE + SERVER_NONCE))
    client_message = handshake.CLIENT_LABEL + SERVER_NONCE + CLIENT_NONCE
    outcome: dict[str, Any]
    try:
        proof = client.on_challenge(challenge)
    except AuthenticationError:
        if not forge_proof:
            outcome = {"client": "error", "client_error": "authentication",
                       "server": "no PROOF received (the client closes the connection)"}
            return _assemble(name, description, client_token, server_token, role, rank,
                             client_job, server_job, welcome_meta, frames, outcome)
        proof = Frame(FrameKind.PROOF, FrameHeader(meta={"proof": handshake.client_proof(
            handshake.normalize_token(client_token), SERVER_NONCE, CLIENT_NONCE)}))
    frames.append(_frame_json("client", proof, client_message))
    result = server.on_proof(proof)
    frames.append(_frame_json("server", result))
    if server.accepted:
        welcome = client.on_result(result)
        outcome = {"client": "welcome", "welcome_meta": _jsonable(welcome),
                   "server": "accepted", "peer_role": server.peer_role,
                   "peer_rank": server.peer_rank, "peer_job": server.peer_job}
    else:
        outcome = {"client": "error", "client_error": "rejected", "server": "rejected",
                   "reason": server.reason}
    return _assemble(name, description, client_token, server_token, role, rank, client_job,
                     server_job, welcome_meta, frames, outcome)


def _assemble(name: str, description: str, client_token: str, server_token: str, role: str,
              rank: int | None, client_job: str, server_job: str,
              welcome_meta: dict[str, Any], frames: list[dict[str, Any]],
              outcome: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "client": {"token": client_token, "role": role, "rank": rank, "job": client_job,
                   "nonce_hex": CLIENT_NONCE.hex()},
        "server": {"token": server_token, "job": server_job, "nonce_hex": SERVER_NONCE.hex(),
                   "welcome_meta": _jsonable(welcome_meta)},
        "frames": frames,
        "outcome": outcome,
    }


def _malformed(name: str, description: str, client_frames: list[Frame]) -> dict[str, Any]:
    """A client whose last frame is a whole frame, but not a well-formed one of the kind due:
    the server answers REJECT "protocol error" (frames before it are answered as usual)."""
    server = handshake.ServerHandshake("secret", nonce=SERVER_NONCE)
    frames = []
    for i, frame in enumerate(client_frames):
        frames.append(_frame_json("client", frame))
        step = server.on_hello if i == 0 else server.on_proof
        try:
            reply = step(frame)
        except ProtocolError:
            assert i == len(client_frames) - 1, name
            frames.append(_frame_json("server", server.reject_frame(handshake.REASON_PROTOCOL)))
            break
        assert i < len(client_frames) - 1, name
        frames.append(_frame_json("server", reply))
    else:
        raise AssertionError(f"{name}: the server accepted every frame")
    return {"name": name, "description": description,
            "server": {"token": "secret", "job": "", "nonce_hex": SERVER_NONCE.hex()},
            "frames": frames}


def malformed() -> list[dict[str, Any]]:
    def hs(kind: FrameKind, **meta: Any) -> Frame:
        return Frame(kind, FrameHeader(meta=meta))

    good_hello = handshake.ClientHandshake("secret", role="peer", rank=1,
                                           nonce=CLIENT_NONCE).hello()
    hello = {"role": "peer", "rank": 1, "nonce": CLIENT_NONCE, "job": ""}
    return [
        _malformed("hello_bad_role", "role is neither \"peer\" nor \"client\"",
                   [hs(FrameKind.HELLO, **{**hello, "role": "admin"})]),
        _malformed("hello_peer_without_rank", "a peer with a nil rank",
                   [hs(FrameKind.HELLO, **{**hello, "rank": None})]),
        _malformed("hello_rank_over_u32", "rank 2^32",
                   [hs(FrameKind.HELLO, **{**hello, "rank": 1 << 32})]),
        _malformed("hello_rank_bool", "rank true (a bool is not an int)",
                   [hs(FrameKind.HELLO, **{**hello, "rank": True})]),
        _malformed("hello_rank_negative", "rank -1",
                   [hs(FrameKind.HELLO, **{**hello, "rank": -1})]),
        _malformed("hello_nonce_31_bytes", "a nonce one byte short",
                   [hs(FrameKind.HELLO, **{**hello, "nonce": CLIENT_NONCE[:31]})]),
        _malformed("hello_nonce_str", "the nonce as str, not bin",
                   [hs(FrameKind.HELLO, **{**hello, "nonce": "x" * 32})]),
        _malformed("hello_job_missing", "no job key",
                   [hs(FrameKind.HELLO, role="peer", rank=1, nonce=CLIENT_NONCE)]),
        _malformed("hello_job_bin", "the job as bin, not str",
                   [hs(FrameKind.HELLO, **{**hello, "job": b"job-42"})]),
        _malformed("hello_without_meta", "a HELLO with no meta at all",
                   [Frame(FrameKind.HELLO, FrameHeader())]),
        _malformed("proof_instead_of_hello", "a PROOF first",
                   [hs(FrameKind.PROOF, proof=bytes(32))]),
        _malformed("proof_31_bytes", "a proof one byte short, after a good HELLO",
                   [good_hello, hs(FrameKind.PROOF, proof=bytes(31))]),
        _malformed("proof_str", "the proof as a str of 32 characters, not bin",
                   [good_hello, hs(FrameKind.PROOF, proof="p" * 32)]),
        _malformed("hello_instead_of_proof", "a second HELLO instead of PROOF",
                   [good_hello, good_hello]),
    ]


def build() -> dict[str, Any]:
    exchanges = [
        _exchange("accepted", "a peer rank authenticates to a peer server of the same job",
                  client_token="secret", server_token="secret", role="peer", rank=1,
                  client_job="job-42", server_job="job-42", welcome_meta={"rank": 0}),
        _exchange("accepted_empty_token", "no token configured on either side: the exchange "
                  "still runs, with the empty HMAC key; the server sets no job",
                  client_token="", server_token="", role="client", rank=None,
                  client_job="", server_job="", welcome_meta={}),
        _exchange("accepted_non_ascii_token", "a text token beyond ASCII: the HMAC key is "
                  "its UTF-8 encoding (not Latin-1, not UTF-16)",
                  client_token="cl\u00e9-\u043a\u043b\u044e\u0447-\u9375",
                  server_token="cl\u00e9-\u043a\u043b\u044e\u0447-\u9375",
                  role="client", rank=None, client_job="", server_job="", welcome_meta={}),
        _exchange("accepted_long_token", "a token of 100 bytes, longer than SHA-256's 64-byte "
                  "block: RFC 2104 hashes such a key first",
                  client_token="0123456789" * 10, server_token="0123456789" * 10,
                  role="peer", rank=2, client_job="", server_job="", welcome_meta={}),
        _exchange("client_rejects_wrong_server", "the server's token differs: the client finds "
                  "the server's proof wrong and closes without sending PROOF",
                  client_token="secret", server_token="wrong", role="client", rank=None,
                  client_job="", server_job="", welcome_meta={}),
        _exchange("server_rejects_wrong_proof", "a client with the wrong token that sends a "
                  "PROOF anyway (skipping the check of the server's proof): REJECT",
                  client_token="wrong", server_token="secret", role="client", rank=None,
                  client_job="", server_job="", welcome_meta={}, forge_proof=True),
        _exchange("job_mismatch", "same token, different job ids: the client authenticates, "
                  "then the server rejects it",
                  client_token="secret", server_token="secret", role="peer", rank=3,
                  client_job="job-7", server_job="job-42", welcome_meta={"rank": 0}),
        # the rendezvous and job ids (SPEC, "Job ids" and "Rendezvous messages")
        _exchange("rendezvous_client_with_job", "a rank's rendezvous client announces job id "
                  "\"train-7\" (ASYNCCOLL_JOB_ID) to a standalone rendezvous, whose job id is "
                  "empty: accepted, and its requests act on the namespace of \"train-7\" "
                  "(peer_job)",
                  client_token="secret", server_token="secret", role="client", rank=2,
                  client_job="train-7", server_job="", welcome_meta=RENDEZVOUS_WELCOME),
        _exchange("rendezvous_client_empty_job", "a rank's rendezvous client with the empty "
                  "job id (none set) to a standalone rendezvous: accepted, in the namespace of "
                  "the empty job id, which lives as long as the server",
                  client_token="secret", server_token="secret", role="client", rank=2,
                  client_job="", server_job="", welcome_meta=RENDEZVOUS_WELCOME),
        _exchange("rendezvous_of_rank_0_accepts_its_job", "the rendezvous rank 0 hosts is "
                  "configured with rank 0's job id, \"train-7\": a rank of that job is "
                  "accepted",
                  client_token="secret", server_token="secret", role="client", rank=1,
                  client_job="train-7", server_job="train-7", welcome_meta=RENDEZVOUS_WELCOME),
        _exchange("rendezvous_of_rank_0_refuses_another_job", "the rendezvous rank 0 hosts, "
                  "configured with job id \"train-7\", and a rank of job \"train-8\" with the "
                  "same token (two jobs pointed at one address): the client authenticates, "
                  "then REJECT \"job mismatch\"",
                  client_token="secret", server_token="secret", role="client", rank=1,
                  client_job="train-8", server_job="train-7", welcome_meta=RENDEZVOUS_WELCOME),
        _exchange("rendezvous_of_rank_0_refuses_the_empty_job", "the rendezvous rank 0 hosts, "
                  "configured with job id \"train-7\", and a rank with the empty job id: "
                  "REJECT \"job mismatch\" (a configured job id admits that job only)",
                  client_token="secret", server_token="secret", role="client", rank=1,
                  client_job="", server_job="train-7", welcome_meta=RENDEZVOUS_WELCOME),
    ]
    return {"description": DESCRIPTION, "version": 1,
            "labels": {"server": handshake.SERVER_LABEL.decode(),
                       "client": handshake.CLIENT_LABEL.decode()},
            "exchanges": exchanges, "malformed": malformed()}


def render() -> str:
    """The file's exact text."""
    return json_lines(build(), ("exchanges", "malformed"))


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUTPUT, render(), __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
