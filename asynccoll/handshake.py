"""Mutual HMAC challenge-response handshake, sans-IO, plus small asyncio stream helpers.

Every asynccoll connection (to the rendezvous server and between peer ranks) starts with:

    client -> server   HELLO      {"role", "rank", "nonce": Nc, "job"}
    server -> client   CHALLENGE  {"nonce": Ns, "proof": HMAC(token, "asynccoll/v1/server" Nc Ns)}
    client -> server   PROOF      {"proof": HMAC(token, "asynccoll/v1/client" Ns Nc)}
    server -> client   WELCOME    {...}  or  REJECT {"reason"}

Both sides prove they know the shared token without sending it; the client checks the server
first, so it never talks to an impostor. ``ClientHandshake`` and ``ServerHandshake``
are pure state machines (frames in, frames out) that any transport can drive; ``read_frame``,
``write_frame``, ``client_handshake`` and ``server_handshake`` drive them over asyncio streams.
``protocol/SPEC.md`` (section "Handshake") is the normative description.

The handshake authenticates both ends when the connection opens. It gives no confidentiality
and no integrity afterwards: run asynccoll on a trusted network or inside a tunnel.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import math
import numbers
import os
import secrets
from typing import Any, Final

from ._aio import writelines
from .errors import AuthenticationError, ProtocolError
from .wire import (
    PREFIX_SIZE,
    Frame,
    FrameHeader,
    FrameKind,
    check_payload,
    decode_header,
    encode_frame,
    parse_prefix,
    short_repr,
)

logger = logging.getLogger("asynccoll.handshake")

#: Length in bytes of each side's nonce.
NONCE_BYTES: Final = 32
#: Length in bytes of an HMAC-SHA256 proof.
PROOF_BYTES: Final = 32
#: Domain-separation labels: a server proof can never be replayed as a client proof.
SERVER_LABEL: Final = b"asynccoll/v1/server"
CLIENT_LABEL: Final = b"asynccoll/v1/client"
#: Roles a client may announce in HELLO.
ROLES: Final = frozenset({"peer", "client"})
#: The longest REJECT reason a receiver keeps (longer ones are cut).
MAX_REASON_CHARS: Final = 200
#: Handshake frames carry no payload; the stream helpers read them with this limit.
HANDSHAKE_MAX_PAYLOAD: Final = 0

REASON_AUTH: Final = "authentication failed"
REASON_JOB: Final = "job mismatch"
REASON_PROTOCOL: Final = "protocol error"

_U32: Final = (1 << 32) - 1

#: Seconds a connection (to a rendezvous server, between ranks) may take from being opened
#: to the end of its handshake, unless ``ASYNCCOLL_HANDSHAKE_TIMEOUT`` or an argument says
#: otherwise (``handshake_timeout``).
DEFAULT_HANDSHAKE_TIMEOUT: Final = 5.0
#: The environment variable that sets the handshake timeout of every rendezvous server and
#: rank of a process (``asynccoll run`` passes its environment on to its ranks).
HANDSHAKE_TIMEOUT_ENV: Final = "ASYNCCOLL_HANDSHAKE_TIMEOUT"


# ----------------------------------------------------------------------------------- helpers

def handshake_timeout(value: object = None) -> float:
    """The handshake timeout in seconds: ``value``, else the environment variable
    ``ASYNCCOLL_HANDSHAKE_TIMEOUT``, else ``DEFAULT_HANDSHAKE_TIMEOUT`` (5 s).

    It bounds how long a connection may take to finish the handshake: a server (the
    rendezvous, a rank accepting a peer) drops one that has not finished by then (a slow or
    silent client costs at most that long), and a rank dialling a peer gives up on it (that
    peer is lost). Raise it where connecting takes longer: a loaded machine, hundreds of
    ranks dialling at once.

    Raises:
        TypeError: ``value`` is not a number (a bool is not one).
        ValueError: ``value`` is not finite and > 0, or the variable holds no such number
            (the error names the variable).
    """
    if value is None:
        raw = os.environ.get(HANDSHAKE_TIMEOUT_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_HANDSHAKE_TIMEOUT
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds < math.inf:
            raise ValueError(f"{HANDSHAKE_TIMEOUT_ENV}={raw!r} is not a number of seconds "
                             f"> 0 (finite)") from None
        return seconds
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"handshake_timeout must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not 0 < seconds < math.inf:  # NaN too
        raise ValueError(f"handshake_timeout must be a finite number of seconds > 0, "
                         f"got {value!r}")
    return seconds


def normalize_token(token: str | bytes | bytearray | memoryview | None) -> bytes:
    """The token as HMAC key bytes: ``str`` is UTF-8 encoded, ``None`` means ``b""``.

    A ``str`` read from an environment (``ASYNCCOLL_TOKEN``) whose bytes are not UTF-8 holds
    them as surrogate escapes (PEP 383): those bytes are the key, as ``os.fsencode`` gives them,
    so every process that reads the same environment, and a ``bytes`` token of the same bytes,
    agree.

    Raises:
        TypeError: any other type.
        ValueError: a ``str`` with other lone surrogates, which no environment gives (the
            message quotes nothing of the token).
    """
    if token is None:
        return b""
    if isinstance(token, str):
        try:
            return token.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # (its message would quote the token's character)
            raise ValueError("the token is a str that is not UTF-8 text (it holds lone "
                             "surrogates); pass bytes instead") from None
    if isinstance(token, bytes | bytearray | memoryview):
        return bytes(token)
    raise TypeError(f"token must be str, bytes or None, not {type(token).__name__}")


def server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """HMAC-SHA256(token, ``SERVER_LABEL`` + client_nonce + server_nonce)."""
    return hmac.new(token, SERVER_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256(token, ``CLIENT_LABEL`` + server_nonce + client_nonce)."""
    return hmac.new(token, CLIENT_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def _frame(kind: FrameKind, meta: dict[str, Any]) -> Frame:
    return Frame(kind, FrameHeader(meta=meta), b"")


def _meta_of(frame: Frame, expected: FrameKind) -> dict[str, Any]:
    if not isinstance(frame, Frame):
        raise ProtocolError(f"expected a {expected.name} frame, got {type(frame).__name__}")
    if frame.kind != expected:
        raise ProtocolError(f"expected a {expected.name} frame, got {FrameKind(frame.kind).name}")
    return _checked_meta(frame)


def _checked_meta(frame: Frame) -> dict[str, Any]:
    if frame.payload is not None and memoryview(frame.payload).nbytes:
        raise ProtocolError(f"{frame.kind.name} frame must not carry a payload")
    meta = frame.header.meta
    if meta is None:
        return {}
    if not isinstance(meta, dict):  # pragma: no cover - FrameHeader validates this
        raise ProtocolError("meta must be a map")
    return meta


def _field_bytes(meta: dict[str, Any], key: str, length: int, what: str) -> bytes:
    value = meta.get(key)
    if not isinstance(value, bytes):
        raise ProtocolError(f"{what}: field {key!r} must be binary, got {type(value).__name__}")
    if len(value) != length:
        raise ProtocolError(f"{what}: field {key!r} must be {length} bytes, got {len(value)}")
    return value


def _reason_of(meta: dict[str, Any]) -> str:
    reason = meta.get("reason")
    if not isinstance(reason, str):
        return "no reason given"
    return reason[:MAX_REASON_CHARS]


def _check_rank(rank: object) -> int | None:
    if rank is None:
        return None
    if type(rank) is not int or not 0 <= rank <= _U32:
        raise ValueError(f"rank must be None or an int in [0, {_U32}], got {rank!r}")
    return rank


def _check_nonce(nonce: bytes | None) -> bytes:
    if nonce is None:
        return secrets.token_bytes(NONCE_BYTES)
    if not isinstance(nonce, bytes | bytearray) or len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
    return bytes(nonce)


class _State(enum.Enum):
    START = "start"
    WAIT_CHALLENGE = "wait-challenge"
    WAIT_PROOF = "wait-proof"
    WAIT_RESULT = "wait-result"
    DONE = "done"
    FAILED = "failed"


# ----------------------------------------------------------------------------------- client

class ClientHandshake:
    """The connecting side of the handshake, as a state machine.

    Call ``hello``, send the frame; pass the server's answer to ``on_challenge``, send
    the frame it returns; pass the server's next frame to ``on_result``, which returns the
    WELCOME meta. Deterministic when ``nonce`` is given (test vectors); random otherwise.

    Raises (from the ``on_*`` methods):
        AuthenticationError: the server's proof is wrong (it does not know the token) or the
            server sent REJECT.
        ProtocolError: a frame of the wrong kind, or a field of the wrong type or length.
        RuntimeError: the methods were called out of order (a bug in the caller).
    After any error the object is dead and the connection must be closed.
    """

    __slots__ = ("_nonce", "_server_nonce", "_state", "_token", "job", "rank", "role")

    def __init__(self, token: str | bytes | None, *, role: str, rank: int | None = None,
                 job: str = "", nonce: bytes | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        self.rank = _check_rank(rank)
        if role == "peer" and self.rank is None:
            raise ValueError("a peer must announce its rank")
        if not isinstance(job, str):
            raise TypeError(f"job must be a str, not {type(job).__name__}")
        self.role = role
        self.job = job
        self._token = normalize_token(token)
        self._nonce = _check_nonce(nonce)
        self._server_nonce: bytes | None = None
        self._state = _State.START

    def __repr__(self) -> str:  # never shows the token
        return (f"ClientHandshake(role={self.role!r}, rank={self.rank!r}, job={self.job!r}, "
                f"state={self._state.value})")

    @property
    def done(self) -> bool:
        """True once WELCOME was received."""
        return self._state is _State.DONE

    def _expect(self, state: _State, method: str) -> None:
        if self._state is not state:
            raise RuntimeError(f"ClientHandshake.{method}() called in state {self._state.value}")

    def hello(self) -> Frame:
        """The HELLO frame that opens the connection."""
        self._expect(_State.START, "hello")
        self._state = _State.WAIT_CHALLENGE
        return _frame(FrameKind.HELLO, {"role": self.role, "rank": self.rank,
                                        "nonce": self._nonce, "job": self.job})

    def on_challenge(self, frame: Frame) -> Frame:
        """Check the server's CHALLENGE and return the PROOF frame to send.

        Raises:
            AuthenticationError: the server's proof is wrong, or the server sent REJECT.
            ProtocolError: the frame is not a well-formed CHALLENGE.
        """
        self._expect(_State.WAIT_CHALLENGE, "on_challenge")
        self._state = _State.FAILED
        if isinstance(frame, Frame) and frame.kind == FrameKind.REJECT:
            reason = _reason_of(_checked_meta(frame))
            raise AuthenticationError(f"server rejected the connection: {reason}")
        meta = _meta_of(frame, FrameKind.CHALLENGE)
        server_nonce = _field_bytes(meta, "nonce", NONCE_BYTES, "CHALLENGE")
        proof = _field_bytes(meta, "proof", PROOF_BYTES, "CHALLENGE")
        expected = server_proof(self._token, self._nonce, server_nonce)
        if not hmac.compare_digest(proof, expected):
            raise AuthenticationError(
                "the server failed to prove it knows the token (wrong token on one side, "
                "or not an asynccoll server of this job)")
        self._server_nonce = server_nonce
        self._state = _State.WAIT_RESULT
        return _frame(FrameKind.PROOF,
                      {"proof": client_proof(self._token, server_nonce, self._nonce)})

    def on_result(self, frame: Frame) -> dict[str, Any]:
        """Return the WELCOME meta (a new dict).

        Raises:
            AuthenticationError: the server sent REJECT; the message carries its reason.
            ProtocolError: neither WELCOME nor REJECT.
        """
        self._expect(_State.WAIT_RESULT, "on_result")
        self._state = _State.FAILED
        if isinstance(frame, Frame) and frame.kind == FrameKind.REJECT:
            reason = _reason_of(_checked_meta(frame))
            raise AuthenticationError(f"server rejected the connection: {reason}")
        meta = _meta_of(frame, FrameKind.WELCOME)
        self._state = _State.DONE
        return dict(meta)


# ----------------------------------------------------------------------------------- server

class ServerHandshake:
    """The accepting side of the handshake, as a state machine.

    Pass the client's first frame to ``on_hello`` and send the CHALLENGE it returns; pass
    the next frame to ``on_proof`` and send the WELCOME or REJECT it returns. Afterwards
    ``accepted`` says which, ``reason`` why not, and ``peer_role``,
    ``peer_rank``, ``peer_job`` describe the client (as it announced itself).

    ``job``: when not empty, a client announcing another job id is rejected (``"job mismatch"``),
    but only after it proved it knows the token; unauthenticated clients always read
    ``"authentication failed"``.

    Raises (from the ``on_*`` methods):
        ProtocolError: a frame of the wrong kind, or a field of the wrong type or length. The
            caller may send ``reject_frame`` and must close the connection.
        RuntimeError: the methods were called out of order (a bug in the caller).
    """

    __slots__ = ("_client_nonce", "_nonce", "_state", "_token", "_welcome_meta", "accepted",
                 "job", "peer_job", "peer_rank", "peer_role", "reason")

    def __init__(self, token: str | bytes | None, *, job: str = "", nonce: bytes | None = None,
                 welcome_meta: dict[str, Any] | None = None) -> None:
        if not isinstance(job, str):
            raise TypeError(f"job must be a str, not {type(job).__name__}")
        if welcome_meta is not None and (
            not isinstance(welcome_meta, dict) or not all(isinstance(k, str) for k in welcome_meta)
        ):
            raise TypeError("welcome_meta must be a dict with str keys")
        self.job = job
        self._token = normalize_token(token)
        self._nonce = _check_nonce(nonce)
        self._welcome_meta = dict(welcome_meta or {})
        self._client_nonce: bytes | None = None
        self._state = _State.START
        self.accepted = False
        self.reason: str | None = None
        self.peer_role: str | None = None
        self.peer_rank: int | None = None
        self.peer_job: str | None = None

    def __repr__(self) -> str:  # never shows the token
        return (f"ServerHandshake(job={self.job!r}, state={self._state.value}, "
                f"peer_role={self.peer_role!r}, peer_rank={self.peer_rank!r}, "
                f"accepted={self.accepted})")

    @property
    def done(self) -> bool:
        """True once ``on_proof`` returned (whether it accepted or rejected)."""
        return self._state is _State.DONE

    def _expect(self, state: _State, method: str) -> None:
        if self._state is not state:
            raise RuntimeError(f"ServerHandshake.{method}() called in state {self._state.value}")

    def on_hello(self, frame: Frame) -> Frame:
        """Check the client's HELLO and return the CHALLENGE frame to send.

        Raises:
            ProtocolError: the frame is not a well-formed HELLO.
        """
        self._expect(_State.START, "on_hello")
        self._state = _State.FAILED
        meta = _meta_of(frame, FrameKind.HELLO)
        role = meta.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ProtocolError(
                f"HELLO: role must be one of {sorted(ROLES)}, got {short_repr(role)}")
        rank = meta.get("rank")
        if rank is not None and (type(rank) is not int or not 0 <= rank <= _U32):
            raise ProtocolError(
                f"HELLO: rank must be nil or an int in [0, {_U32}], got {short_repr(rank)}")
        if role == "peer" and rank is None:
            raise ProtocolError("HELLO: a peer must announce its rank")
        client_nonce = _field_bytes(meta, "nonce", NONCE_BYTES, "HELLO")
        job = meta.get("job")
        if not isinstance(job, str):
            raise ProtocolError(f"HELLO: job must be a string, got {type(job).__name__}")
        self.peer_role, self.peer_rank, self.peer_job = role, rank, job
        self._client_nonce = client_nonce
        self._state = _State.WAIT_PROOF
        return _frame(FrameKind.CHALLENGE, {
            "nonce": self._nonce,
            "proof": server_proof(self._token, client_nonce, self._nonce),
        })

    def on_proof(self, frame: Frame) -> Frame:
        """Check the client's PROOF; return WELCOME (accepted) or REJECT.

        Sets ``accepted`` and, on refusal, ``reason`` (``"authentication failed"`` or
        ``"job mismatch"``).

        Raises:
            ProtocolError: the frame is not a well-formed PROOF.
        """
        self._expect(_State.WAIT_PROOF, "on_proof")
        self._state = _State.FAILED
        meta = _meta_of(frame, FrameKind.PROOF)
        proof = _field_bytes(meta, "proof", PROOF_BYTES, "PROOF")
        assert self._client_nonce is not None
        expected = client_proof(self._token, self._nonce, self._client_nonce)
        self._state = _State.DONE
        if not hmac.compare_digest(proof, expected):
            return self.reject_frame(REASON_AUTH)
        if self.job and self.peer_job != self.job:
            return self.reject_frame(REASON_JOB)
        self.accepted = True
        return _frame(FrameKind.WELCOME, dict(self._welcome_meta))

    def closed_early(self) -> str:
        """Why the handshake failed when the client closed the connection before it was over
        (for the server's log line; SPEC, Handshake, Failures): what the server waited for,
        and after a CHALLENGE what the client claimed to be, since a client that finds the
        server's proof wrong (another token) leaves right there without a word."""
        if self._state is _State.WAIT_PROOF:
            return (f"connection closed during the handshake (waiting for PROOF): client "
                    f"(role={self.peer_role!r}, rank={self.peer_rank!r}) left after the "
                    f"CHALLENGE without a PROOF, as a client with another token does")
        return "connection closed during the handshake (waiting for HELLO)"

    def reject_frame(self, reason: str) -> Frame:
        """A REJECT frame with ``reason``; marks the handshake as refused."""
        self.accepted = False
        self.reason = reason
        if self._state is not _State.DONE:
            self._state = _State.FAILED
        return _frame(FrameKind.REJECT, {"reason": reason})


# ----------------------------------------------------------------------------------- streams

async def read_frame(reader: asyncio.StreamReader, max_payload: int) -> Frame | None:
    """Read one whole frame from ``reader``.

    Returns ``None`` on a clean end of stream (EOF exactly at a frame boundary).

    Raises:
        ProtocolError: the bytes break the protocol (bad magic or version, a length over the
            limits, a malformed header) or the stream ended inside a frame. The connection
            cannot be resynchronised and must be closed.
    """
    try:
        prefix = await reader.readexactly(PREFIX_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("stream ended in the middle of a frame prefix") from None
    kind, header_len, payload_len = parse_prefix(prefix, max_payload)
    try:
        body = await reader.readexactly(header_len)
        header = decode_header(body)
        check_payload(kind, header, payload_len)
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError:
        raise ProtocolError(f"stream ended in the middle of a {kind.name} frame") from None
    return Frame(kind, header, payload)


def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> None:
    """Queue ``frame`` on ``writer`` (call ``await writer.drain()`` for back-pressure)."""
    writelines(writer.transport, encode_frame(frame))


class HandshakeClosed(ProtocolError):
    """The other end closed the connection during the handshake, without REJECT (a server
    going away, or not an asynccoll server): unlike a refusal, worth another try."""


async def _read_handshake_frame(reader: asyncio.StreamReader, step: str) -> Frame:
    frame = await read_frame(reader, HANDSHAKE_MAX_PAYLOAD)
    if frame is None:
        raise HandshakeClosed(f"connection closed during the handshake (waiting for {step})")
    return frame


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           token: str | bytes | None, *, role: str, rank: int | None = None,
                           job: str = "", timeout: float = 5.0,
                           ) -> dict[str, Any]:
    """Run the client side of the handshake over asyncio streams; return the WELCOME meta.

    Raises:
        AuthenticationError: the server does not know the token, or it rejected us.
        ProtocolError: the server broke the protocol; ``HandshakeClosed`` (a ProtocolError)
            when it closed the connection without REJECT.
        TimeoutError: the handshake did not finish within ``timeout`` seconds.
    The caller owns ``writer`` and must close it after an error.
    """
    hs = ClientHandshake(token, role=role, rank=rank, job=job)
    try:
        async with asyncio.timeout(timeout):
            write_frame(writer, hs.hello())
            await writer.drain()
            proof = hs.on_challenge(await _read_handshake_frame(reader, "CHALLENGE"))
            write_frame(writer, proof)
            await writer.drain()
            return hs.on_result(await _read_handshake_frame(reader, "WELCOME"))
    except TimeoutError:
        raise TimeoutError(f"handshake did not complete within {timeout} s") from None
    except (ConnectionError, BrokenPipeError) as exc:
        raise HandshakeClosed(f"connection lost during the handshake: {exc}") from None


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           token: str | bytes | None, *, job: str = "",
                           timeout: float = 5.0,
                           welcome_meta: dict[str, Any] | None = None) -> ServerHandshake:
    """Run the server side of the handshake over asyncio streams.

    Returns the accepted ``ServerHandshake`` (see ``peer_role``, ``peer_rank``).

    Raises:
        AuthenticationError: the client's proof was wrong or its job id differs; REJECT was
            sent first.
        ProtocolError: the client broke the protocol (REJECT is sent when the framing was
            intact) or closed the connection.
        TimeoutError: the handshake did not finish within ``timeout`` seconds (slow or silent
            client).
    The caller owns ``writer`` and must close it after an error.
    """
    hs = ServerHandshake(token, job=job, welcome_meta=welcome_meta)
    try:
        async with asyncio.timeout(timeout):
            hello = await _read_handshake_frame(reader, "HELLO")
            try:
                challenge = hs.on_hello(hello)
            except ProtocolError:
                write_frame(writer, hs.reject_frame(REASON_PROTOCOL))
                raise
            write_frame(writer, challenge)
            await writer.drain()
            proof = await read_frame(reader, HANDSHAKE_MAX_PAYLOAD)
            if proof is None:
                raise ProtocolError(hs.closed_early())
            try:
                result = hs.on_proof(proof)
            except ProtocolError:
                write_frame(writer, hs.reject_frame(REASON_PROTOCOL))
                raise
            write_frame(writer, result)
            await writer.drain()
    except TimeoutError:
        raise TimeoutError(f"client did not complete the handshake within {timeout} s") from None
    except (ConnectionError, BrokenPipeError) as exc:
        raise ProtocolError(f"connection lost during the handshake: {exc}") from None
    if not hs.accepted:
        raise AuthenticationError(
            f"client (role={hs.peer_role!r}, rank={hs.peer_rank!r}) rejected: {hs.reason}")
    return hs


__all__ = [
    "CLIENT_LABEL", "DEFAULT_HANDSHAKE_TIMEOUT", "HANDSHAKE_TIMEOUT_ENV", "NONCE_BYTES",
    "PROOF_BYTES", "ROLES", "SERVER_LABEL", "ClientHandshake", "HandshakeClosed",
    "ServerHandshake",
    "client_handshake", "client_proof", "handshake_timeout", "normalize_token", "read_frame",
    "server_handshake", "server_proof", "write_frame",
]
