"""Where each collective switches algorithm: every threshold lives here, in one place.

All ranks of a group must use equal settings (the algorithm is part of a collective's
signature, so a rank that disagrees makes the collective fail with CollectiveError rather
than hang).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Tuning:
    """Algorithm selection thresholds, in bytes of the array a rank passes.

    A communicator whose frames carry less (tcp's ``max_payload``) runs it with the frame
    sizes above that lowered to it (``fit_frames``); ``Communicator.tuning`` returns it as
    set.

    Attributes:
        small_bytes: at or below this, latency-optimal algorithms (recursive doubling
            all_reduce and reduce, doubling or direct reduce_scatter; gather when the
            gathered bytes are at most this); above it, bandwidth-optimal ring algorithms
            (gather: straight to the root). Over TCP, the small algorithms against the large
            ones, 2 ranks: all_reduce 0.66 x the time and reduce_scatter (direct) 0.87 x at
            128 KiB, reduce 0.46 x and gather 0.54 x at 96 KiB; 4 ranks on 2 cores: 0.39,
            0.83, 0.30 and 0.48 x. Beyond 128 KiB it depends on the collective and the world
            (at 192 KiB with 4 ranks on 2 cores the reduce takes 1.25 x, at 256 KiB the
            all_reduce 1.17 x).
        doubling_reduce_scatter_bytes: a reduce_scatter of at most ``small_bytes`` whose
            array, times the rounds of recursive doubling (log2 of the world size, rounded
            up), is at most this all-reduces the whole array along recursive doubling's pairs
            and keeps its block; otherwise every rank sends each peer its block (direct).
            Doubling moves more bytes, ``log2(W)`` arrays against ``(W-1)/W`` of one, but
            takes the lean receive path of small all_reduces, where the direct exchange
            posts a receive per peer. Over TCP, 2 ranks: 8 B 0.56-0.39 x the time, 16 KiB
            0.64-0.67 x, 64 KiB 0.95-0.74 x, 128 KiB 1.07-1.05 x; 4 ranks on 2 cores: 8 B
            0.55 x, 16 KiB 0.52-0.72 x, 32 KiB 0.55-0.66 x, 64 KiB 0.85-0.89 x, 96 KiB
            0.77-0.79 x, 128 KiB 0.98-1.06 x.
        chain_broadcast_bytes: at or above this, broadcast over 3 or more ranks pipelines
            segments along a chain instead of recursive doubling's pairs (a binomial tree
            whose idle pairs swap empty tokens, so that no separate agreement round is
            needed). The tree sends a message log2(W) times in a row, the chain about one
            message plus a segment per hop: on a network the chain wins from a few segments
            per hop (a model of 4 ranks, 1 MiB segments: from 2 MiB). Two ranks always use
            the tree (a chain of two is one hop).
        segment_bytes: largest segment of the pipelined ring. A ring step's block is cut into
            ``ring_segments`` segments, each at least ``min_segment_bytes`` and at most
            ``segment_bytes``: each segment costs a frame and a turn of the algorithm, and
            smaller ones overlap more of the reduction with the transfer.
        min_segment_bytes: smallest segment of the pipelined ring (unless ``segment_bytes``
            is smaller).
        ring_segments: segments a ring step's block is cut into, within the bounds above.
        chain_segment_bytes: segment size of the pipelined chain broadcast.
        crowded_chain_broadcast_bytes: ``chain_broadcast_bytes`` for crowded worlds (see
            ``crowded_segment_bytes``); by default the chain never runs there: both move the
            message W-1 times, and where ranks share cores, the bytes, not the tree's
            log2(W) rounds, set the time, while the chain adds an agreement round and a
            wake-up per segment and hop (4 ranks on 2 cores, the tree against the chain: 4
            MiB 0.66 x the time, 16 MiB 0.93 x, 64 MiB 0.89 x; 3 ranks, 16 MiB 0.68 x; 8
            ranks, 16 MiB 0.89 x).
        crowded_segment_bytes: where the world's ranks outnumber the cores of a machine they
            run on (``Transport.crowded``, agreed by every rank when the world forms), the
            ring's and the chain's segments are at least this large (a block or message
            smaller than this is one segment). Every segment costs each rank a frame, a
            wake-up and a turn of the algorithm, while pipelining only overlaps work that
            competes for the same cores there (4 ranks on 2 cores, 4 MiB segments against
            1 MiB: a 16 MiB all_reduce 0.935-1.004 x the time, 8 MiB 0.939 x, 16 and 64
            MiB broadcasts 0.908 and 0.914 x; 3 ranks: 0.917 and 0.899 x at 16 MiB). It
            wins over ``segment_bytes`` and ``chain_segment_bytes`` there: to keep smaller
            segments in a crowded world, lower it too.
        direct_all_gather_ranks: up to this many ranks, all_gather sends every block straight
            to every rank (one round); beyond, it uses the ring. All_gather decides by world
            size alone because ranks may pass different lengths (and so different bytes).
        poll_us: before a receive sleeps in the event loop, keep polling this long (in
            microseconds). Waking a sleeping event loop costs tens of microseconds on many
            machines, more than a small message takes to arrive; polling trades CPU for
            latency; with more ranks than cores, pollers hand their core over between polls.
        poll_max_bytes: with more ranks than cores, only receives of at most this many bytes
            poll for ``poll_us`` (larger ones: see ``spin_us``): a large payload takes far
            longer to arrive than a wake-up, and polling for it burns a core another rank
            needs.
        spin_us: with more ranks than cores, but at most two per core, larger receives of the
            symmetric algorithms (the ring of all_reduce, reduce_scatter and all_gather, the
            direct all_gather: every rank sends as much as it receives, so every rank a
            receive waits for is busy sending) poll this long before they sleep, handing
            their core over between polls, when the collective moves at most
            ``spin_max_bytes`` per rank. Medium messages make many short waits, and a rank
            that sleeps through each lets its core fall idle and pays a wake-up every time
            (4 ranks on 2 cores: a 1 MiB all_reduce 0.78-0.79 x the time, a 4 MiB one
            0.80-0.86 x, a 1 MiB all_gather 0.79-0.89 x); large ones gain nothing, rooted
            collectives such as broadcast lose (their waiting ranks spin while the rank they
            wait for needs the core), and so do more ranks per core (8 on 2: a 1 MiB
            all_reduce 1.18 x). 0 turns it off.
        spin_max_bytes: largest array (all_gather: gathered result) per rank whose symmetric
            collective spins (see ``spin_us``).
        hand_over_bytes: where every core is shared by two or more ranks
            (``Transport.hands_over``), a rank that has posted a step's sends of at least
            this many bytes gives its core to another rank once (``os.sched_yield``) before
            it waits for the step's receive: after each swap of recursive doubling, each
            round of the barrier and of the doubling broadcast, the direct all_gather's
            sends, and the ring's first sends (once per call). Ranks sharing a core
            otherwise settle into turns two calls long, and every other call a rank makes
            then spans another rank's turn: the calls' times split into a fast and a slow
            half (4 ranks on 2 cores: a 1 MiB all_gather ~160 and ~560 us, an 8-byte
            all_reduce ~30 and ~125 us) and the median lands between them. With turns one
            call long the calls take about the mean: 4 ranks on 2 cores, slowest rank's
            median 0.75-0.85 x the time for a 1 MiB all_gather (p90 0.7-0.8 x), 0.8-0.9 x
            for an 8-byte all_reduce and the barrier, 0.9 x for a 1 MiB broadcast, with
            means level to 7% higher (twice the context switches); the ring's 4 MiB
            all_reduce and 1 MiB reduce_scatter 0.85-0.9 x in median and mean (16 MiB
            level). With 3 ranks on 2 cores (a core to one rank) small all_reduces lost, so
            it is off there. 0 (the default): every send; ``1 << 62`` turns it off.
        direct_all_reduce: when all_reduce above ``small_bytes`` uses the direct algorithm
            (every rank reduces its own block from all others, then sends it to all) instead
            of the ring: ``"lending"`` on transports that lend payloads in place (the
            in-process memory backend, where it saves memory traffic), ``"always"`` or
            ``"never"``.
        direct_segment_bytes: segment size of the direct all_reduce over a network (each
            segment is one frame per peer and one reduction; in process a block is one).
        reduce_chunk_bytes: reductions of several arrays into one go a chunk of this many
            bytes at a time, so that the chunk stays in cache while every array is added
            (and, in process, while it is copied to the other ranks). Smaller chunks fit a
            smaller cache but cost more NumPy calls, each of which takes and drops the GIL
            that the memory backend's worker threads share (1 MiB: 7-15% faster than 512 KiB
            for a 64 MiB all_reduce over 4 in-process ranks on 2 cores).
        offload_bytes: reductions of at least this many bytes go through the transport's
            ``compute_and_post`` (worker threads on the memory backend; inline elsewhere).
        reduce_on_read_bytes: ring segments of partial sums at least this large are added
            into the array as they are read, a cache-sized piece at a time, on transports
            that read sockets themselves (tcp), instead of being read into scratch memory
            and added afterwards. It changes nothing on the wire, so ranks may differ (4
            ranks on 2 cores: 4, 16 and 64 MiB all_reduce 0.973, 0.960 and 0.969 x the time;
            2 ranks: 4 MiB 0.914 x, 16 MiB 0.963 x, 64 MiB level). ``1 << 62`` turns it off.
    """

    small_bytes: int = 128 * 1024
    doubling_reduce_scatter_bytes: int = 128 * 1024
    chain_broadcast_bytes: int = 4 << 20
    segment_bytes: int = 4 << 20
    min_segment_bytes: int = 1 << 20
    ring_segments: int = 4
    chain_segment_bytes: int = 1 << 20
    crowded_segment_bytes: int = 4 << 20
    crowded_chain_broadcast_bytes: int = 1 << 62
    direct_all_gather_ranks: int = 4
    poll_us: int = 200
    poll_max_bytes: int = 64 * 1024
    spin_us: int = 3000
    spin_max_bytes: int = 4 << 20
    hand_over_bytes: int = 0
    direct_all_reduce: str = "lending"
    direct_segment_bytes: int = 1 << 20
    reduce_chunk_bytes: int = 1 << 20
    offload_bytes: int = 256 * 1024
    reduce_on_read_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        # every field but direct_all_reduce is an integer: NumPy integers are taken (and
        # stored as int), floats, strings, None and bools are not (True is no byte count)
        for f in fields(self):
            if f.name == "direct_all_reduce":
                continue
            value = getattr(self, f.name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                number = operator.index(value)
            except TypeError:
                raise TypeError(f"Tuning.{f.name} must be an int, got "
                                f"{type(value).__name__} {value!r}") from None
            object.__setattr__(self, f.name, number)
        # segment and chunk sizes and counts: an empty one would never make progress
        for name in ("segment_bytes", "min_segment_bytes", "ring_segments",
                     "chain_segment_bytes", "crowded_segment_bytes", "direct_segment_bytes",
                     "reduce_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tuning.{name} must be >= 1, got {getattr(self, name)}")
        # times and sizes where 0 means off (or always); thresholds compared with a size
        # (small_bytes, chain_broadcast_bytes, crowded_chain_broadcast_bytes,
        # direct_all_gather_ranks) may be negative: -1 means "never" (see RING)
        for name in ("poll_us", "poll_max_bytes", "spin_us", "spin_max_bytes",
                     "hand_over_bytes", "offload_bytes", "reduce_on_read_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Tuning.{name} must be >= 0, got {getattr(self, name)}")
        if not isinstance(self.direct_all_reduce, str):
            raise TypeError(f"Tuning.direct_all_reduce must be a str, got "
                            f"{type(self.direct_all_reduce).__name__} "
                            f"{self.direct_all_reduce!r}")
        if self.direct_all_reduce not in ("lending", "always", "never"):
            raise ValueError(f"Tuning.direct_all_reduce must be 'lending', 'always' or "
                             f"'never', got {self.direct_all_reduce!r}")

    def all_reduce(self, nbytes: int, world_size: int, *, lends: bool = False) -> str:
        """The algorithm; ``lends``: the transport lends payloads in place (memory)."""
        if nbytes <= self.small_bytes:
            return "recursive_doubling"
        mode = self.direct_all_reduce
        return "direct" if mode == "always" or (mode == "lending" and lends) else "ring"

    def ring_segment(self, block_bytes: int, *, crowded: bool = False) -> int:
        """Bytes per segment of a ring step whose blocks have ``block_bytes``; ``crowded``:
        see ``crowded_segment_bytes``."""
        per = -(-block_bytes // self.ring_segments)
        seg = max(1, min(self.segment_bytes, max(self.min_segment_bytes, per)))
        return max(seg, self.crowded_segment_bytes) if crowded else seg

    def chain_segment(self, *, crowded: bool = False) -> int:
        """Bytes per segment of the chain broadcast; ``crowded``: see
        ``crowded_segment_bytes``."""
        seg = self.chain_segment_bytes
        return max(seg, self.crowded_segment_bytes) if crowded else seg

    def reduce(self, nbytes: int, world_size: int) -> str:
        return "doubling" if nbytes <= self.small_bytes else "ring"

    def reduce_scatter(self, nbytes: int, world_size: int) -> str:
        if nbytes > self.small_bytes:
            return "ring"
        rounds = max(1, (world_size - 1).bit_length())
        return "doubling" if nbytes * rounds <= self.doubling_reduce_scatter_bytes else "direct"

    def gather(self, nbytes: int, world_size: int) -> str:
        """``nbytes``: one rank's array. Up to ``small_bytes`` gathered in all, the blocks
        travel along recursive doubling's pairs, relayed towards the root (no agreement
        round); beyond, every rank sends straight to the root."""
        return "doubling" if nbytes * world_size <= self.small_bytes else "direct"

    def all_gather(self, world_size: int) -> str:
        return "direct" if world_size <= self.direct_all_gather_ranks else "ring"

    def broadcast(self, nbytes: int, world_size: int, *, crowded: bool = False,
                  max_payload: int | None = None) -> str:
        """The algorithm; ``crowded``: see ``crowded_chain_broadcast_bytes``; ``max_payload``:
        the most one frame may carry (tcp's option): a larger array takes the chain, in
        segments, whatever the thresholds and the world (two ranks too), since the tree
        sends it whole."""
        if max_payload is not None and nbytes > max_payload and world_size > 1:
            return "chain"
        # two ranks: a chain is one hop, and its segments and agreement round only cost
        chain = self.crowded_chain_broadcast_bytes if crowded else self.chain_broadcast_bytes
        if world_size <= 2 or nbytes < chain:
            return "doubling"
        return "chain"


#: the thresholds that bound a frame an algorithm sends: recursive doubling (all_reduce,
#: reduce, reduce_scatter) and the doubling gather send arrays of up to ``small_bytes`` whole,
#: the ring, the chain broadcast and the direct all_reduce segments of up to the others
FRAME_FIELDS = ("small_bytes", "segment_bytes", "crowded_segment_bytes",
                "chain_segment_bytes", "direct_segment_bytes")


def fit_frames(tuning: Tuning, max_payload: int) -> Tuning:
    """``tuning`` as a communicator whose frames carry at most ``max_payload`` bytes runs it:
    every threshold of ``FRAME_FIELDS`` above ``max_payload`` lowered to it (so that larger
    arrays take the ring, and segments fit a frame), every other field as it is; ``tuning``
    itself when every one fits already (the default ``Tuning`` from 4 MiB on: nothing is
    copied, and nothing changes per call). Segment sizes are in bytes and the algorithms
    round them down to whole items, so none needs to be a multiple of an item size. The
    segmented algorithms also cut a block into more than ``MAX_SEGMENTS`` segments and the
    broadcast takes the chain (``broadcast``'s ``max_payload``) where a frame needs it."""
    lowered: dict[str, Any] = {name: max_payload for name in FRAME_FIELDS
                               if getattr(tuning, name) > max_payload}
    return replace(tuning, **lowered) if lowered else tuning


#: Always the latency-optimal algorithms (for tests).
TREE = Tuning(small_bytes=1 << 62, chain_broadcast_bytes=1 << 62,
             direct_all_gather_ranks=1 << 30)
#: Always the bandwidth-optimal algorithms, with tiny segments (for tests).
RING = Tuning(small_bytes=-1, chain_broadcast_bytes=0, segment_bytes=64, chain_segment_bytes=64,
              crowded_segment_bytes=64, crowded_chain_broadcast_bytes=0,
              direct_all_gather_ranks=0, direct_all_reduce="never")
#: The direct all_reduce on every transport, with tiny segments and chunks (for tests).
DIRECT = Tuning(small_bytes=-1, direct_all_reduce="always", direct_segment_bytes=64,
                reduce_chunk_bytes=16, offload_bytes=64)


def check_tuning(tuning: object, *, default: bool = True) -> None:
    """A ``TypeError`` at once for a ``tuning`` that is no ``Tuning`` (a wrong object failed
    only at the first collective); ``None``, the default tuning, passes where ``default``."""
    if not (isinstance(tuning, Tuning) or (default and tuning is None)):
        raise TypeError(f"tuning must be an asynccoll.Tuning, got {tuning!r}")


__all__ = ["DIRECT", "RING", "TREE", "Tuning", "check_tuning"]
