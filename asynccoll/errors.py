"""The exception tree of asynccoll (standard library only).

Errors are named after who is at fault:

* ``CollectiveError`` and its children: the collective could not complete, because of
  another rank (``PeerLostError``), the clock (``CollectiveTimeout``) or the ranks disagreeing
  about what they called. After any of them the communicator is broken and every later call
  raises ``CollectiveError`` at once.
* ``CommunicatorClosedError``: *you* closed the communicator and then used it.
* ``ProtocolError``: bytes that break the wire protocol (bad magic, version, limits, types).
  ``RemoteProtocolError`` is the same fault attributed to a peer on a live connection.
* Bad arguments are ``TypeError`` / ``ValueError`` and are raised before anything is sent.
"""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective failed on this rank; the communicator can no longer be used."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """No progress within the communicator's ``timeout``."""


class PeerLostError(CollectiveError):
    """A peer rank disconnected or died.

    Attributes:
        rank: the world rank that was lost (``None`` when it could not be determined).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class CommunicatorClosedError(CollectiveError):
    """The communicator was closed by its owner and then used."""


class ProtocolError(ValueError):
    """Bytes that do not follow the asynccoll wire protocol."""


class RemoteProtocolError(ProtocolError):
    """A remote peer sent bytes that break the wire protocol."""


class AuthenticationError(ProtocolError):
    """A connection failed the token challenge-response handshake."""


__all__ = [
    "AuthenticationError",
    "CollectiveError",
    "CollectiveTimeout",
    "CommunicatorClosedError",
    "PeerLostError",
    "ProtocolError",
    "RemoteProtocolError",
]


class RendezvousError(CollectiveError):
    """The rendezvous server refused a request, or could not be reached in time."""


class RendezvousTimeout(RendezvousError, CollectiveTimeout):
    """A world did not form within its ``timeout``: ranks that never joined the rendezvous
    (the message names them), a rendezvous that could not be reached before it ran out (a
    port refused or hung up on until then: ``RendezvousClient.connect`` with retries), or too
    few processes for an elastic generation. Both a ``RendezvousError`` and a
    ``CollectiveTimeout``."""


__all__ += ["RendezvousError", "RendezvousTimeout"]
