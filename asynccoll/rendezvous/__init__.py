"""The rendezvous: an authenticated key-value store with a roster of ranks, over asyncio.

What torch's ``TCPStore`` does, plus a roster with generations for elastic training. One
``RendezvousServer`` (usually hosted by rank 0, or standalone with
``asynccoll rendezvous``) and one ``RendezvousClient`` per process.

Every connection first passes the token handshake (``asynccoll.handshake``); then the client
sends REQUEST frames and the server answers with RESPONSE frames tagged by request id, so
several requests may be in flight on one connection and a blocking one (``get`` of a missing
key, ``wait``, ``roster`` for a world size) never holds up the others. Values travel as raw
frame payloads, never inside msgpack. ``protocol/SPEC.md`` (section "Rendezvous messages")
specifies the ops.

The store has three parts, all owned by one server object (never by the module, so two servers
in one process are independent): ``data`` (str keys to bytes values), ``members`` (rank to
host, port, meta) and ``generation`` (an int that ``bump_generation`` increments, clearing
``members``). A server shared by jobs keeps one such store per job id that its clients
announce (``RendezvousClient.connect(job=...)``), dropped when the job's last connection
closes; ``store`` is that of the empty job id (see ``RendezvousServer``).
"""

from ._common import DEFAULT_MAX_VALUE_BYTES, DEFAULT_WAIT_TIMEOUT
from .client import RendezvousClient
from .server import RendezvousServer, serve
from .store import Member, Store

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "DEFAULT_WAIT_TIMEOUT",
    "Member",
    "RendezvousClient",
    "RendezvousServer",
    "Store",
    "serve",
]
