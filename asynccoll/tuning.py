"""Where each collective switches algorithm: every threshold lives here, in one place.

All ranks of a group must use equal settings (the algorithm is part of a collective's
signature, so a rank that disagrees makes the collective fail with CollectiveError rather
than hang).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Tuning:
    """Algorithm selection thresholds, in bytes of the array a rank passes.

    Attributes:
        small_bytes: at or below this, latency-optimal algorithms (recursive doubling
            all_reduce, binomial-tree reduce, direct all_gather / reduce_scatter); above it,
            bandwidth-optimal ring algorithms.
        chain_broadcast_bytes: at or above this, broadcast pipelines segments along a chain
            instead of a binomial tree.
        segment_bytes: segment size of the pipelined ring.
        chain_segment_bytes: segment size of the pipelined chain broadcast.
        direct_all_gather_ranks: up to this many ranks, all_gather sends every block straight
            to every rank (one round); beyond, it uses the ring. All_gather decides by world
            size alone because ranks may pass different lengths (and so different bytes).
        poll_us: before a receive sleeps in the event loop, keep polling this long (in
            microseconds). Waking a sleeping event loop costs tens of microseconds on many
            machines, more than a small message takes to arrive; polling trades CPU for
            latency; with more ranks than cores, pollers hand their core over between polls.
        poll_max_bytes: with more ranks than cores, only receives of at most this many bytes
            poll: a large payload takes far longer to arrive than a wake-up, and polling for
            it burns a core another rank needs.
    """

    small_bytes: int = 64 * 1024
    chain_broadcast_bytes: int = 1 << 20
    segment_bytes: int = 1 << 20
    chain_segment_bytes: int = 1 << 20
    direct_all_gather_ranks: int = 4
    poll_us: int = 200
    poll_max_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.segment_bytes < 1:
            raise ValueError("segment_bytes must be >= 1")

    def all_reduce(self, nbytes: int, world_size: int) -> str:
        return "recursive_doubling" if nbytes <= self.small_bytes else "ring"

    def reduce(self, nbytes: int, world_size: int) -> str:
        return "binomial" if nbytes <= self.small_bytes else "ring"

    def reduce_scatter(self, nbytes: int, world_size: int) -> str:
        return "direct" if nbytes <= self.small_bytes else "ring"

    def all_gather(self, world_size: int) -> str:
        return "direct" if world_size <= self.direct_all_gather_ranks else "ring"

    def broadcast(self, nbytes: int, world_size: int) -> str:
        return "chain" if nbytes >= self.chain_broadcast_bytes else "binomial"


#: Always the latency-optimal algorithms (for tests).
TREE = Tuning(small_bytes=1 << 62, chain_broadcast_bytes=1 << 62,
             direct_all_gather_ranks=1 << 30)
#: Always the bandwidth-optimal algorithms, with tiny segments (for tests).
RING = Tuning(small_bytes=-1, chain_broadcast_bytes=0, segment_bytes=64, chain_segment_bytes=64,
              direct_all_gather_ranks=0)

__all__ = ["RING", "TREE", "Tuning"]
