"""The rendezvous state: key-value data, the roster of ranks and its generation (no I/O)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ._common import (
    _DECIMAL,
    _I64_MAX,
    _I64_MIN,
    E_LIMIT,
    E_NOT_INTEGER,
    E_OVERFLOW,
    _OpError,
)


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
    #: what the entry counts against ``Usage.max_bytes``
    size: int = 0


@dataclass(slots=True)
class Usage:
    """What the stores of one server hold together (keys and roster entries, and their
    bytes), against the server's limits (``None``: none)."""

    max_keys: int | None = None
    max_bytes: int | None = None
    keys: int = 0
    nbytes: int = 0

    def charge(self, keys: int, nbytes: int, what: str) -> None:
        """Count ``keys`` more entries and ``nbytes`` more bytes (either may be negative), or
        raise ``_OpError`` (``limit``) and count nothing when that would pass a limit."""
        if keys > 0 and self.max_keys is not None and self.keys + keys > self.max_keys:
            raise _OpError(E_LIMIT, f"{what} refused: the rendezvous server holds "
                                    f"{self.keys} keys and roster entries, its limit "
                                    f"(max_keys={self.max_keys})")
        if (nbytes > 0 and self.max_bytes is not None
                and self.nbytes + nbytes > self.max_bytes):
            raise _OpError(E_LIMIT, f"{what} refused: the rendezvous server holds "
                                    f"{self.nbytes} bytes of keys, values and roster "
                                    f"entries; {nbytes} more would pass its limit "
                                    f"(max_store_bytes={self.max_bytes})")
        self.keys += keys
        self.nbytes += nbytes


def _key_size(key: str) -> int:
    return len(key.encode("utf-8", "surrogatepass"))


@dataclass(slots=True)
class Store:
    """The state of a rendezvous server: plain data and synchronous operations, no I/O.

    Each mutating method returns what it changed so the server can wake the matching waiters.
    Every entry is counted in ``usage``, which the stores of one server share, and a change
    that would pass its limits raises ``_OpError`` (``limit``) and changes nothing;
    ``release`` gives back what a store held when the server drops it.
    """

    data: dict[str, bytes] = field(default_factory=dict)
    members: dict[int, Member] = field(default_factory=dict)
    generation: int = 0
    usage: Usage = field(default_factory=Usage)
    #: the bytes of this store's keys, values and roster entries (counted in ``usage``)
    nbytes: int = 0

    def _charge(self, keys: int, nbytes: int, what: str) -> None:
        self.usage.charge(keys, nbytes, what)
        self.nbytes += nbytes

    def _put(self, key: str, value: bytes, what: str) -> None:
        old = self.data.get(key)
        if old is None:
            self._charge(1, _key_size(key) + len(value), what)
        else:
            self._charge(0, len(value) - len(old), what)
        self.data[key] = value

    def release(self) -> None:
        """Give back to ``usage`` everything this store holds (the server drops it)."""
        self.usage.charge(-(len(self.data) + len(self.members)), -self.nbytes, "")
        self.nbytes = 0

    def set(self, key: str, value: bytes) -> None:
        self._put(key, value, f"set of key {key!r}")

    def add(self, key: str, delta: int) -> int:
        old = self.data.get(key, b"0")
        if not _DECIMAL.fullmatch(old):
            raise _OpError(E_NOT_INTEGER, f"value of key {key!r} is not a decimal integer")
        new = int(old) + delta
        if not _I64_MIN <= new <= _I64_MAX:
            raise _OpError(E_OVERFLOW, f"add would overflow a signed 64-bit integer at {key!r}")
        self._put(key, str(new).encode("ascii"), f"add to key {key!r}")
        return new

    def compare_set(self, key: str, expected: bytes | None, desired: bytes
                    ) -> tuple[bool, bytes | None]:
        current = self.data.get(key)
        if current != expected:
            return False, current
        self._put(key, desired, f"compare_set of key {key!r}")
        return True, desired

    def delete(self, key: str) -> bool:
        value = self.data.pop(key, None)
        if value is None:
            return False
        self._charge(-1, -(_key_size(key) + len(value)), "")
        return True

    def _clear_roster(self) -> None:
        self._charge(-len(self.members), -sum(m.size for m in self.members.values()), "")
        self.members.clear()

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
            self._clear_roster()
        size = _key_size(host) + len(msgpack.packb(meta, use_bin_type=True))
        old = self.members.get(rank)
        what = f"join of rank {rank}"
        if old is None:
            self._charge(1, size, what)
        else:
            self._charge(0, size - old.size, what)
        self.members[rank] = Member(host, port, meta, owner, size=size)
        return self.generation

    def leave(self, rank: int) -> bool:
        member = self.members.pop(rank, None)
        if member is None:
            return False
        self._charge(-1, -member.size, "")
        return True

    def bump(self, expected: int | None) -> tuple[bool, int]:
        if expected is not None and expected != self.generation:
            return False, self.generation
        self.generation += 1
        self._clear_roster()
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
