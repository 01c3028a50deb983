"""The rendezvous state: key-value data, the roster of ranks and its generation (no I/O)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ._common import _DECIMAL, _I64_MAX, _I64_MIN, E_NOT_INTEGER, E_OVERFLOW, _OpError


@dataclass(slots=True)
class Member:
    """One rank of the roster, and the connection (``owner``, the server's number for it)
    that joined it."""

    host: str
    port: int
    meta: dict[str, Any]
    owner: int = 0
    #: whether ``owner`` has been answered a full roster (``roster`` with a ``world_size``
    #: that the members met): once every member has, their world has every address it needs
    read: bool = False


@dataclass(slots=True)
class Store:
    """The state of a rendezvous server: plain data and synchronous operations, no I/O.

    Each mutating method returns what it changed so the server can wake the matching waiters.
    """

    data: dict[str, bytes] = field(default_factory=dict)
    members: dict[int, Member] = field(default_factory=dict)
    generation: int = 0

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def add(self, key: str, delta: int) -> int:
        old = self.data.get(key, b"0")
        if not _DECIMAL.fullmatch(old):
            raise _OpError(E_NOT_INTEGER, f"value of key {key!r} is not a decimal integer")
        new = int(old) + delta
        if not _I64_MIN <= new <= _I64_MAX:
            raise _OpError(E_OVERFLOW, f"add would overflow a signed 64-bit integer at {key!r}")
        self.data[key] = str(new).encode("ascii")
        return new

    def compare_set(self, key: str, expected: bytes | None, desired: bytes
                    ) -> tuple[bool, bytes | None]:
        current = self.data.get(key)
        if current != expected:
            return False, current
        self.data[key] = desired
        return True, desired

    def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def join(self, rank: int, host: str, port: int, meta: dict[str, Any], owner: int = 0,
             live: Collection[int] | None = None) -> int:
        """Add (or replace) ``rank``'s entry, joined by connection ``owner``. A roster that
        belongs to another world is cleared first, so that a standalone server (the
        launcher's, say) serves one world after another: one that every member has read in
        full (that world formed, or is forming, from what it read; this join is the next
        world's, or a stray), or, given the connections still open (``live``), one none of
        whose members' connections is among them (that world is over)."""
        if self.members and (
                all(m.read for m in self.members.values())
                or (live is not None and not any(m.owner in live
                                                 for m in self.members.values()))):
            self.members.clear()
        self.members[rank] = Member(host, port, meta, owner)
        return self.generation

    def leave(self, rank: int) -> bool:
        return self.members.pop(rank, None) is not None

    def bump(self, expected: int | None) -> tuple[bool, int]:
        if expected is not None and expected != self.generation:
            return False, self.generation
        self.generation += 1
        self.members.clear()
        return True, self.generation

    def roster(self, reader: int | None = None, world_size: int | None = None
               ) -> tuple[dict[str, Any], bytes]:
        """The ``roster`` result: meta, and the members as a msgpack array in the payload
        (a large world would not fit the 64 KiB header). Asked by connection ``reader`` for
        ``world_size`` members, and there are as many, the members it joined have read it."""
        if reader is not None and world_size is not None and len(self.members) >= world_size:
            for m in self.members.values():
                if m.owner == reader:
                    m.read = True
        members = [[rank, m.host, m.port, m.meta] for rank, m in sorted(self.members.items())]
        return ({"generation": self.generation, "count": len(members)},
                msgpack.packb(members, use_bin_type=True))
