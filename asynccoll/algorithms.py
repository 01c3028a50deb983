"""Every collective algorithm, written once over the transport interface.

A collective of ``Communicator`` runs one of these coroutines with a
``Call``, its view of the collective in flight (sequence number, signature, group ranks).
The algorithms:

=================  ==========================================  ===============================
collective         small messages (latency)                    large messages (bandwidth)
=================  ==========================================  ===============================
all_reduce         recursive doubling (with fold for non-2^k)  ring reduce-scatter + all-gather
                                                               (blocks of one frame read off the
                                                               wire where the transport can);
                                                               direct (each rank reduces its
                                                               block from all) in process
reduce             recursive doubling (every rank reduces)     ring reduce-scatter + gather
reduce_scatter     direct (one round)                          ring (as all_reduce's)
all_gather         direct (one round, W <= 4 by default)       ring (blocks read off the wire
                                                               where the transport can)
broadcast          recursive doubling's pairs (a binomial      pipelined chain (3+ ranks)
                   tree; idle pairs swap empty tokens)
gather             recursive doubling's pairs (blocks relayed  direct
                   towards the root, tokens back)
scatter            direct                                      direct
all_to_all         pairwise exchange                           pairwise exchange
barrier            dissemination                               -
broadcast_object   binomial tree                               binomial tree
=================  ==========================================  ===============================

Symmetric algorithms (every rank's result depends on every rank's frames) check the
collective's signature on the way; the others (chain broadcast, ring reduce, direct gather,
scatter, broadcast_object) run an agreement round beside them (``Communicator._run``).

Thresholds live in ``asynccoll.tuning``. Algorithms talk to peers only through
``Call`` (post, send, post_recv, recv, exchange, compute_and_post, the lean receives of
small collectives, payload_of and swap, and take_direct), so every backend runs
exactly this code; where a backend differs, the algorithm reads its flags (``lends``: payloads
can be read in place; ``polls``; ``reads_direct``) rather than its type. ``Call`` and its
receives are in ``asynccoll.call``.
"""

from __future__ import annotations

import asyncio

import numpy as np

from .call import _DATA, POLL_READS, Call, Recv, bytes_view, row_bounds, settle
from .call import poll_window as poll_window  # (imported from here by the tests)
from .ops import ReduceOp, combine, combine_ordered
from .wire import dtype_code

# ------------------------------------------------------------------------------ algorithms

def power_of_two_fold(w: int) -> tuple[int, int, int]:
    """``(p, extra, rounds)`` of recursive doubling over ``w`` ranks: ``p`` the largest power
    of two <= ``w``, ``extra = w - p`` ranks folded onto ranks ``0..extra-1`` (rank
    ``p + i`` onto ``i``), ``rounds = log2(p)`` pairwise rounds among the first ``p``."""
    p = 1 << (w.bit_length() - 1)
    return p, w - p, p.bit_length() - 1


async def recursive_doubling(call: Call, flat: np.ndarray, op: ReduceOp) -> None:
    """All-reduce in place in ceil(log2 W) (+2) rounds; every rank ends bit-identical."""
    w, r = call.size, call.rank
    p, extra, rounds = power_of_two_fold(w)
    if r >= p:  # fold: hand my data to a partner, get the result back
        pending = call.post(r - p, 0, flat)
        await call.recv(r - p, rounds + 1, flat)
        await settle([pending])
        return
    if r < extra:
        combine(flat, await call.payload_of(r + p, 0, flat), op)
    for k in range(rounds):
        partner = r ^ (1 << k)
        got = await call.swap(partner, k + 1, flat)
        if r < partner:  # the lower rank's operand on the left on both ranks: identical bits
            combine_ordered(flat, flat, got, op)
        else:
            combine_ordered(flat, got, flat, op)
    if r < extra:
        await call.send(r + p, rounds + 1, flat)


#: bytes ``copy_polling`` copies between two turns of the event loop
COPY_CHUNK_BYTES = 1 << 20


async def copy_polling(call: Call, dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` while transfers are in flight. On a transport that polls, a large
    copy goes a chunk at a time with a turn of the event loop after each, so the sockets keep
    moving data in and out instead of stalling for the whole copy (a 32 MiB copy takes ~2 ms;
    the peer then sits idle for as long, waiting for this rank to read or write)."""
    if not call.poll or src.nbytes <= COPY_CHUNK_BYTES or src.shape != dst.shape:
        dst[...] = src
        return
    d, s = dst.reshape(-1), src.reshape(-1)
    step = max(1, COPY_CHUNK_BYTES // max(1, s.itemsize))
    for a in range(0, s.size, step):
        d[a:a + step] = s[a:a + step]
        await asyncio.sleep(0)


def segments(start: int, stop: int, nseg: int) -> list[tuple[int, int]]:
    n = stop - start
    return [(start + n * k // nseg, start + n * (k + 1) // nseg) for k in range(nseg)]


def segment_count(call: Call, items: int, seg: int, itemsize: int) -> int:
    """Segments a pipelined block of ``items`` items is cut into: of at most ``seg`` items
    each, and at most ``MAX_SEGMENTS`` of them, unless a segment would then carry more than
    one frame may (``Transport.max_payload``): then as many as frames need."""
    nseg = min(MAX_SEGMENTS, max(1, -(-items // seg)))
    if nseg == MAX_SEGMENTS:
        nseg = max(nseg, -(-items // max(1, call.t.max_payload // max(1, itemsize))))
    return nseg


async def ring(call: Call, flat: np.ndarray, bounds: list[tuple[int, int]], op: ReduceOp | None,
                *, reduce_steps: int, gather_steps: int, inplace: bool = True) -> np.ndarray | None:
    """The pipelined ring behind all_reduce and reduce_scatter.

    ``flat`` is split into ``W`` blocks (``bounds``) and each block into segments. The first
    ``reduce_steps`` steps receive a partial block from the left, reduce it with the local
    one and forward it (reduce-scatter); the next ``gather_steps`` steps receive a finished
    block and forward it (all-gather). Each segment is forwarded as soon as it is ready, and
    every receive is posted up front, so the socket writes each segment where it belongs
    (partial sums into a scratch slot per step, finished blocks into ``flat``) however far
    ahead a neighbour runs, while NumPy reduces what already arrived.

    ``inplace``: partial sums are reduced into ``flat`` (all_reduce); otherwise ``flat`` is
    only read and the finished block ``rank`` is returned (a new array; reduce-scatter steps
    only).
    """
    w, r = call.size, call.rank
    left, right = (r - 1) % w, (r + 1) % w
    width = max(stop - start for start, stop in bounds)
    seg = max(1, call.tuning.ring_segment(width * flat.itemsize, crowded=call.t.crowded)
              // max(1, flat.itemsize))
    nseg = segment_count(call, width, seg, flat.itemsize)
    total = reduce_steps + gather_steps

    def block(s: int) -> int:  # block received at step s
        return (r - s - 2) % w if s < reduce_steps else (r - (s - reduce_steps) - 1) % w

    # partial sums land in scratch that is only needed during the call, from the transport's
    # pool (no page faults on every call); not in place, the last step's sums are the
    # result (this rank's block), which lands in a new array instead
    out = None
    kept = reduce_steps
    if not inplace:
        assert reduce_steps and not gather_steps and block(reduce_steps - 1) == r
        kept -= 1
        out = np.empty(bounds[r][1] - bounds[r][0], flat.dtype)
    pool = call.t.scratch
    scratch = pool.take(kept * width, flat.dtype) if kept else None

    def targets(s: int) -> list[np.ndarray]:
        start, stop = bounds[block(s)]
        if s >= reduce_steps:
            return [flat[a:b] for a, b in segments(start, stop, nseg)]
        if s == kept:
            assert out is not None
            return [out[a - start:b - start] for a, b in segments(start, stop, nseg)]
        assert scratch is not None
        base = s * width - start
        return [scratch[base + a:base + b] for a, b in segments(start, stop, nseg)]

    first = (r - 1) % w if reduce_steps else r
    pending = [call.post(right, k, flat[a:b])
               for k, (a, b) in enumerate(segments(*bounds[first], nseg))]
    # once per call, after the first sends (handing over after every forward as well
    # measured no better: 4 ranks on 2 cores, 1 MiB all_reduce)
    call.hand_over((bounds[first][1] - bounds[first][0]) * flat.itemsize)
    # in place, partial sums are only read (added into flat): a lending transport can hand
    # over the left neighbour's memory instead of copying it into scratch
    # (and a transport that reads sockets itself may add them into flat as they arrive, a
    # cache-sized piece at a time: see Tuning.reduce_on_read_bytes)
    spin = call.spins(flat.nbytes)

    def receive(s: int, k: int, t: np.ndarray, a: int, b: int) -> Recv:
        partial = inplace and s < reduce_steps
        reduce_into = None
        if partial:
            assert op is not None
            reduce_into = (flat[a:b], op)
        return call.post_recv(left, s * nseg + k, t, borrow=partial, spin=spin,
                              reduce_into=reduce_into)

    posted = [[receive(s, k, t, a, b) for k, (t, (a, b)) in
               enumerate(zip(targets(s), segments(*bounds[block(s)], nseg), strict=True))]
              for s in range(total)]
    ready = flat[:0]
    for s in range(total):
        start, stop = bounds[block(s)]
        for k, (a, b) in enumerate(segments(start, stop, nseg)):
            rcv = posted[s][k]
            got = await rcv.get()
            if s < reduce_steps:
                assert op is not None
                if inplace:
                    if not rcv.reduced:
                        combine(flat[a:b], got, op)
                    rcv.release()
                    ready = flat[a:b]
                else:
                    combine(got, flat[a:b], op)
                    ready = got
            else:
                ready = flat[a:b]
            if s + 1 < total:
                pending.append(call.post(right, (s + 1) * nseg + k, ready))
    await settle(pending)
    if scratch is not None:
        pool.give(scratch)
    return out


def ring_reads_direct(call: Call, flat: np.ndarray, bounds: list[tuple[int, int]], *,
                      inplace: bool) -> bool:
    """Whether ``ring`` may run as ``direct_ring``: a transport that reads frames itself
    (``Call.reads_direct``), and blocks (``bounds``) that are one segment of the ring each
    (the same frames either way); in place also below ``Tuning.reduce_on_read_bytes``
    (larger partial sums are added as they are read, a piece at a time, which the ring
    does)."""
    if not call.reads_direct:
        return False
    size = max(1, flat.itemsize)
    width = max(b - a for a, b in bounds)
    seg = max(1, call.tuning.ring_segment(width * size, crowded=call.t.crowded) // size)
    return width <= seg and (not inplace or width * size < call.tuning.reduce_on_read_bytes)


async def direct_ring(call: Call, flat: np.ndarray, bounds: list[tuple[int, int]],
                      op: ReduceOp, *, inplace: bool) -> np.ndarray | None:
    """``ring`` where every block is one segment: its all_reduce (``inplace``) or its
    reduce-scatter (``flat`` only read; returns block ``rank`` reduced, a new array), each
    step's block read straight off the wire (``Call.take_direct``): no posted receives, no
    decoding, no mailbox. The frames are the ring's, so a rank running ``ring`` pairs with
    it. In place a partial sum from the left goes into scratch and is added into the block,
    which goes on to the right, and a finished block is read into place; otherwise each
    partial sum goes into a slot of its own and on from there, the last one into the result.
    Each block is reduced along one path, so every rank ends bit-identical."""
    w, r = call.size, call.rank
    left, right = (r - 1) % w, (r + 1) % w
    width = max(b - a for a, b in bounds)
    spin = call.spins(flat.nbytes)
    first = flat[slice(*bounds[(r - 1) % w])]
    pending = [call.post(right, 0, first)]
    call.hand_over(first.nbytes)
    pool = call.t.scratch
    # in place one slot serves every step; otherwise a slot per partial sum sent on
    kept = 1 if inplace else w - 2
    scratch = pool.take(kept * width, flat.dtype) if kept else None
    out = None if inplace else np.empty(bounds[r][1] - bounds[r][0], flat.dtype)
    total = 2 * (w - 1) if inplace else w - 1
    for s in range(total):
        reducing = s < w - 1
        a, b = bounds[(r - s - 2) % w if reducing else (r - s + w - 2) % w]
        if not reducing:  # a finished block, into place
            ready = flat[a:b]
            (rcv,) = await call.take_direct([left], s, [ready], spin=spin)
            if rcv is not None:
                await rcv.get()
        else:
            if out is not None and s == w - 2:
                slot = out
            else:
                assert scratch is not None
                base = 0 if inplace else s * width
                slot = scratch[base:base + b - a]
            (rcv,) = await call.take_direct([left], s, [slot], spin=spin)
            got = slot if rcv is None else await rcv.get()
            if inplace:
                ready = flat[a:b]
                combine(ready, got, op)
            else:
                ready = got
                combine(ready, flat[a:b], op)
        if s + 1 < total:
            pending.append(call.post(right, s + 1, ready))
    await settle(pending)
    if scratch is not None:
        pool.give(scratch)
    return out


async def direct_all_reduce(call: Call, flat: np.ndarray, op: ReduceOp) -> None:
    """All-reduce in place: every rank reduces its own block, then sends it to every rank.

    Rank ``j`` receives block ``j`` of every other rank, combines them with its own, a
    segment at a time (each chunk summed over all ranks while it is in cache), and sends
    each reduced segment straight on to every other rank. The bytes on the wire are the
    ring's; the difference is the number of peers at once (W-1 instead of 2). It is the
    algorithm for transports that ``lends``: the reduce-scatter half reads
    the peers' arrays in place (no copy), and the all-gather half copies each chunk while
    it is still in cache (about 8 array sizes of memory traffic for 4 ranks, against ~15
    for the ring); the whole block is then one segment (one frame per peer and direction,
    one ``compute_and_post``, whose chunks the memory backend's workers share). A single
    rank computes each block, so every rank ends bit-identical.
    """
    w, r = call.size, call.rank
    bounds = row_bounds(flat.size, 1, w)
    width = max(stop - start for start, stop in bounds)
    seg = max(1, call.tuning.direct_segment_bytes // max(1, flat.itemsize))
    # segments pipeline a network transfer; in one process everything is there at once
    nseg = 1 if call.t.lends else segment_count(call, width, seg, flat.itemsize)
    peers = [(r + d) % w for d in range(1, w)]
    start, stop = bounds[r]
    mine = segments(start, stop, nseg)
    # the peers' parts of my block land in scratch, unless the transport lends them (then
    # scratch is never touched and costs only address space)
    scratch = call.t.scratch.take((w - 1) * (stop - start), flat.dtype)
    base = [i * (stop - start) - start for i in range(w - 1)]
    incoming = [[call.post_recv(j, k, scratch[base[i] + a:base[i] + b], borrow=True)
                 for k, (a, b) in enumerate(mine)] for i, j in enumerate(peers)]
    gathered = [call.post_recv(j, nseg + k, flat[a:b])
                for j in peers for k, (a, b) in enumerate(segments(*bounds[j], nseg))]
    theirs = {j: segments(*bounds[j], nseg) for j in peers}
    pending = [call.post(j, k, flat[theirs[j][k][0]:theirs[j][k][1]])
               for k in range(nseg) for j in peers]
    for k, (a, b) in enumerate(mine):
        got = [await seg_recv[k].get() for seg_recv in incoming]
        work = [(call.reducer(flat[a:b], got, op), (b - a) * flat.itemsize,
                 [call.frame(j, nseg + k, flat[a:b]) for j in peers])]
        pending.extend(await call.compute_and_post(work, (b - a) * flat.itemsize,
                                                   flat.itemsize))
        for seg_recv in incoming:
            seg_recv[k].release()
    for rcv in gathered:
        await rcv.get()
    await settle(pending)
    call.t.scratch.give(scratch)


async def ring_all_reduce(call: Call, flat: np.ndarray, op: ReduceOp) -> None:
    """Ring all-reduce of ``flat`` in place: its blocks read straight off the wire where each
    is one frame and the transport can (``direct_ring``), else ``ring``."""
    bounds = row_bounds(flat.size, 1, call.size)
    if ring_reads_direct(call, flat, bounds, inplace=True):
        await direct_ring(call, flat, bounds, op, inplace=True)
    else:
        await ring(call, flat, bounds, op, reduce_steps=call.size - 1,
                   gather_steps=call.size - 1)


async def ring_reduce_scatter(call: Call, flat: np.ndarray, bounds: list[tuple[int, int]],
                              op: ReduceOp, *, direct: bool = True) -> np.ndarray:
    """Ring reduce-scatter leaving ``flat`` untouched; returns block ``rank`` reduced (new).
    With ``direct``, its blocks are read straight off the wire where each is one frame and
    the transport can (``direct_ring``)."""
    if direct and ring_reads_direct(call, flat, bounds, inplace=False):
        mine = await direct_ring(call, flat, bounds, op, inplace=False)
    else:
        mine = await ring(call, flat, bounds, op, reduce_steps=call.size - 1,
                          gather_steps=0, inplace=False)
    assert mine is not None
    return mine


async def ring_all_gather(call: Call, blocks: list[np.ndarray], mine: np.ndarray,
                           step0: int) -> bool:
    """Ring all-gather of ``mine`` into ``blocks``. Returns False if sizes differed, in which
    case ``blocks`` holds the actual (differently sized) arrays."""
    w, r = call.size, call.rank
    left, right = (r - 1) % w, (r + 1) % w
    even = True
    pending = [call.post(right, step0, mine)]
    call.hand_over(mine.nbytes)
    spin = call.spins(mine.nbytes * w)
    await copy_polling(call, blocks[r], mine)  # while the first block travels
    # each block read straight off the wire where the transport can (nothing posted for it)
    direct = call.reads_direct
    for s in range(w - 1):
        idx = (r - s - 1) % w
        if direct:
            (rcv,) = await call.take_direct([left], step0 + s, [blocks[idx]], spin=spin)
            got = blocks[idx] if rcv is None else await rcv.get(resize=True)
        else:
            got = await call.recv(left, step0 + s, blocks[idx], resize=True, spin=spin)
        if got is not blocks[idx]:
            blocks[idx] = got
            even = False
        if s + 1 < w - 1:
            pending.append(call.post(right, step0 + s + 1, got))
    await settle(pending)
    return even


async def direct_all_gather(call: Call, blocks: list[np.ndarray], mine: np.ndarray) -> bool:
    w, r = call.size, call.rank
    # staggered: rank r sends to r+1, r+2, ... and reads from r-1, r-2, ..., so that no rank
    # is everyone's first destination
    peers = [(r - d) % w for d in range(1, w)]
    spin = call.spins(mine.nbytes * w)
    # a large own block is copied while the others' travel (copy_polling: a chunk at a time,
    # the sockets served in between); a small one after them, so that the peers' data is
    # read, and their sends freed, first (1 MiB over 2 ranks: 156-158 against 167-195 us)
    early = mine.nbytes > COPY_CHUNK_BYTES
    # where the transport reads frames itself and nothing runs the event loop before the
    # receives (no early copy), the blocks are read straight off the wire (take_direct:
    # no posted receives, no decoding: 1 MiB over 4 ranks on 2 cores 0.87 x the time, over
    # 2 ranks 0.92 x; 8 B to 64 KiB 0.77-0.85 x)
    direct = call.reads_direct and not early
    posted: list[Recv | None] = (
        [] if direct else [call.post_recv(j, 0, blocks[j], spin=spin) for j in peers])
    pending = [call.post((r + d) % w, 0, mine) for d in range(1, w)]
    call.hand_over(mine.nbytes)
    if early:
        await copy_polling(call, blocks[r], mine)
    if direct:
        posted = await call.take_direct(peers, 0, [blocks[j] for j in peers], spin=spin)
    even = True
    for j, rcv in zip(peers, posted, strict=True):
        if rcv is None:  # read straight into its block
            continue
        got = await rcv.get(resize=True)
        if got is not blocks[j]:
            blocks[j] = got
            even = False
    if not early:
        await copy_polling(call, blocks[r], mine)
    await settle(pending)
    return even


async def binomial_broadcast(call: Call, root: int, flat: np.ndarray | None) -> np.ndarray:
    """Binomial-tree broadcast. Non-roots may pass ``flat=None`` to receive an unknown size."""
    w, r = call.size, call.rank
    vr = (r - root) % w
    mask = 1
    while mask < w:
        if vr & mask:
            flat = await call.recv((vr - mask + root) % w, 0, flat, resize=flat is None)
            break
        mask <<= 1
    assert flat is not None
    pending = []
    mask >>= 1
    while mask > 0:
        if vr + mask < w:
            pending.append(call.post((vr + mask + root) % w, 0, flat))
        mask >>= 1
    await settle(pending)
    return flat


async def take_into(call: Call, peer: int, step: int, into: np.ndarray) -> None:
    """Receive the array of ``step`` from group rank ``peer`` into ``into`` (1-d, contiguous):
    the lean polled way (``payload_of``) when it is small, a posted receive straight into it
    otherwise."""
    if into.nbytes <= call.tuning.poll_max_bytes:
        into[...] = await call.payload_of(peer, step, into)
    else:
        await call.recv(peer, step, into)


async def doubling_broadcast(call: Call, root: int, flat: np.ndarray) -> None:
    """Broadcast in place along recursive doubling's pairs: in round k, rank r and r ^ 2^k
    swap one frame each, the root's data where one of them holds it already and an empty
    token where neither does. Ranks beyond the largest power of two ``p`` fold onto r - p
    first (sending the data, from a root among them) and get the result back last.

    The data moves as in a binomial tree, but every rank sends and receives a frame in every
    round, so each has (transitively) checked every rank's signature when it returns: like
    all_reduce, it needs no agreement round beside it (a rooted collective otherwise runs a
    dissemination barrier alongside its data). Pairs do not depend on the root, so ranks that
    disagree about it still meet, and fail on the signature.
    """
    w, r = call.size, call.rank
    p, extra, rounds = power_of_two_fold(w)

    if r >= p:  # folded: hand the data (or a token) to r - p, get the result back
        first = call.post(r - p, 0, flat if r == root else _TOKEN)
        if r == root:
            await call.payload_of(r - p, rounds + 1, _TOKEN)
        else:
            await take_into(call, r - p, rounds + 1, flat)
        await settle([first])
        return
    holder = root if root < p else root - p  # who holds the data among the first p ranks
    if r < extra:
        if r + p == root:
            await take_into(call, r + p, 0, flat)
        else:
            await call.payload_of(r + p, 0, _TOKEN)
    pending: list[asyncio.Future[None] | None] = []
    for k in range(rounds):
        partner, step = r ^ (1 << k), k + 1
        if r >> (k + 1) != holder >> (k + 1):  # neither of us holds the data
            await call.swap(partner, step, _TOKEN)
        elif r >> k == holder >> k:  # I hold it: send it, the partner answers with a token
            pending.append(call.post(partner, step, flat))
            call.hand_over(flat.nbytes)
            await call.payload_of(partner, step, _TOKEN)
        else:
            pending.append(call.post(partner, step, _TOKEN))
            call.hand_over(flat.nbytes)
            await take_into(call, partner, step, flat)
    if r < extra:
        pending.append(call.post(r + p, rounds + 1, _TOKEN if r + p == root else flat))
    await settle(pending)


async def doubling_gather(call: Call, root: int, flat: np.ndarray) -> np.ndarray | None:
    """Gather along recursive doubling's pairs: the doubling broadcast run backwards.

    Ranks below the largest power of two ``p`` take ``log2(p)`` rounds; in round k rank r
    and r ^ 2^k swap one frame each. Where both collect the blocks of their half of a group
    of 2^(k+1) ranks (the ranks whose low k bits are the root's, or those of the rank a
    folded root leans on), the one on the root's side receives the other's blocks and
    answers with an empty token; elsewhere both swap tokens. Ranks from ``p`` on hand their
    block to r - p first and get a token back last, or, the root among them, every block.

    Every rank sends and receives a frame in every round, so each has (transitively) checked
    every rank's signature when it returns, and no agreement round is needed beside it (see
    ``doubling_broadcast``). Blocks are relayed by the collectors on the way, so it suits
    small arrays; large ones go straight to the root.

    Returns the ``(W, flat.size)`` array of every rank's ``flat`` in rank order on the root,
    ``None`` elsewhere.
    """
    w, r = call.size, call.rank
    p, extra, rounds = power_of_two_fold(w)
    n = flat.size

    if r >= p:  # folded: my block to r - p, then a token back (the root: every block)
        first = call.post(r - p, 0, flat)
        if r != root:
            await call.payload_of(r - p, rounds + 1, _TOKEN)
            await settle([first])
            return None
        everything = np.empty((w, n), flat.dtype)
        await take_into(call, r - p, rounds + 1, everything.reshape(-1))
        await settle([first])
        return everything
    holder = root if root < p else root - p  # where the blocks meet among the first p ranks
    away = r ^ holder
    # the rank whose low bits first differ from the holder's sends at that round; until
    # then it collects, into its row of ``blocks`` (rows by rank; rank i + p's block travels
    # with rank i's)
    blocks = None
    if away & -away != 1 or r < extra:  # it collects something: round 0's or a folded block
        blocks = np.empty((w, n), flat.dtype)
        blocks[r] = flat

    def ranges(base: int, k: int) -> list[tuple[int, int]]:
        """Rows of the blocks a collector of the 2^k ranks from ``base`` holds."""
        rows = [(base, base + (1 << k))]
        if base < extra:
            rows.append((p + base, p + min(base + (1 << k), extra)))
        return rows

    if r < extra:
        assert blocks is not None
        await take_into(call, r + p, 0, blocks[r + p])
    pending: list[asyncio.Future[None] | None] = []
    for k in range(rounds):
        partner, step = r ^ (1 << k), k + 1
        if away & ((1 << k) - 1):  # neither of us collects any more: tokens
            await call.swap(partner, step, _TOKEN)
        elif away & (1 << k):  # my half is away from the root's: send what I collected
            rows = ranges(r >> k << k, k)
            if blocks is None:  # collected nothing: my own block alone
                bundle = flat
            elif len(rows) == 1:
                bundle = blocks[rows[0][0]:rows[0][1]].reshape(-1)
            else:
                bundle = np.concatenate([blocks[a:b] for a, b in rows]).reshape(-1)
            pending.append(call.post(partner, step, bundle))
            await call.payload_of(partner, step, _TOKEN)
        else:  # the partner's half comes to me; a token goes back
            assert blocks is not None
            pending.append(call.post(partner, step, _TOKEN))
            rows = ranges(partner >> k << k, k)
            if len(rows) == 1:
                await take_into(call, partner, step, blocks[rows[0][0]:rows[0][1]].reshape(-1))
            else:
                got = np.empty((sum(b - a for a, b in rows), n), flat.dtype)
                await take_into(call, partner, step, got.reshape(-1))
                at = 0
                for a, b in rows:
                    blocks[a:b] = got[at:at + b - a]
                    at += b - a
    if r < extra:  # the folded rank's token, or, the root, every block
        assert blocks is not None
        pending.append(call.post(r + p, rounds + 1,
                                 blocks.reshape(-1) if r + p == root else _TOKEN))
    await settle(pending)
    return blocks if r == root else None


async def chain_broadcast(call: Call, root: int, flat: np.ndarray) -> None:
    """Pipelined chain root -> root+1 -> ...: segment k is forwarded as soon as it arrives."""
    w, r = call.size, call.rank
    vr = (r - root) % w
    prev, nxt = (r - 1) % w, (r + 1) % w
    seg = max(1, call.tuning.chain_segment(crowded=call.t.crowded) // max(1, flat.itemsize))
    nseg = segment_count(call, flat.size, seg, flat.itemsize)
    parts = [flat[a:b] for a, b in segments(0, flat.size, nseg)]
    posted = [call.post_recv(prev, k, part) for k, part in enumerate(parts)] if vr else []
    pending = []
    for k, part in enumerate(parts):
        if vr:
            await posted[k].get()
        if vr < w - 1:
            pending.append(call.post(nxt, k, part))
    await settle(pending)


async def ring_reduce(call: Call, root: int, flat: np.ndarray, op: ReduceOp) -> None:
    """Ring reduce-scatter, then every rank sends its reduced block to the root."""
    w, r = call.size, call.rank
    bounds = row_bounds(flat.size, 1, w)
    # the plain ring (direct=False) even where blocks could be read directly: beside the agreement
    # round a reduce runs, that measured no faster (1 MiB, 2 and 4 ranks, two pairs of
    # launches each: 182.5 and 223.5 against 184.4 and 230.5 us; 1092 and 947 against
    # 1098 and 1032)
    mine = await ring_reduce_scatter(call, flat, bounds, op, direct=False)
    # each block to the root in one frame, or in as many as max_payload needs
    per = max(1, call.t.max_payload // max(1, flat.itemsize))
    parts = max(1, -(-max(b - a for a, b in bounds) // per))
    if r != root:
        if parts == 1:
            await call.send(root, 1 << 30, mine)
        else:
            await settle([call.post(root, (1 << 30) + k, mine[a:b])
                          for k, (a, b) in enumerate(segments(0, mine.size, parts))])
        return
    posted = [call.post_recv(j, (1 << 30) + k, flat[a:b])
              for j in range(w) if j != root
              for k, (a, b) in enumerate(segments(*bounds[j], parts))]
    start, stop = bounds[r]
    flat[start:stop] = mine
    for rcv in posted:
        await rcv.get()


async def direct_reduce_scatter(call: Call, flat: np.ndarray, bounds: list[tuple[int, int]],
                                 op: ReduceOp) -> np.ndarray:
    w, r = call.size, call.rank
    start, stop = bounds[r]
    out = flat[start:stop].copy()
    peers = [j for j in range(w) if j != r]
    scratch = [np.empty(stop - start, flat.dtype) for _ in peers]
    spin = call.spins(flat.nbytes)
    posted = [call.post_recv(j, 0, buf, spin=spin) for j, buf in zip(peers, scratch, strict=True)]
    pending = [call.post(j, 0, flat[bounds[j][0]:bounds[j][1]]) for j in peers]
    for rcv in posted:
        combine(out, await rcv.get(), op)
    await settle(pending)
    return out


#: most segments a pipelined block is cut into (bounds the receives posted per call)
MAX_SEGMENTS = 64

#: first step number of the signature-agreement rounds (far above any algorithm's steps)
AGREE_STEP = 0xFFFF0000


#: the (empty, read-only) payload of barrier frames
_TOKEN = np.empty(0, np.uint8)
_TOKEN.flags.writeable = False
_TOKEN_CODE = dtype_code(_TOKEN.dtype)
_TOKEN_VIEW = bytes_view(_TOKEN)


def begin_barrier(call: Call, step0: int = 0) -> asyncio.Future[None] | None:
    """Send round 0 of a dissemination barrier of 2 or more ranks now (see
    ``dissemination_barrier``)."""
    return call.post((call.rank + 1) % call.size, step0, _TOKEN)


async def end_barrier(call: Call, step0: int, first: asyncio.Future[None] | None) -> None:
    """The rest of a dissemination barrier whose round 0 ``begin_barrier`` sent."""
    w, r = call.size, call.rank
    # Call.payload_of and post written out over the transport, the token's code and view
    # looked up once (module constants): the barrier's whole path
    t, ranks, sig, src = call.t, call.ranks, call.sig, call.src
    heads, group, seq = t.heads, call.group, call.seq
    reads = POLL_READS if call.poll else 0
    pending = first
    k, dist = 0, 1
    call.hand_over(0)  # after round 0's token went out (begin_barrier)
    while True:
        peer, step = ranks[(r - dist) % w], step0 + k
        expect = heads.data_head(_DATA, group, seq, step, 0, peer, _TOKEN_CODE, _TOKEN.shape,
                                 sig, 0) if reads else None
        payload = t.poll_payload((peer, _DATA, group, seq, step, 0), sig, reads, expect, 0)
        if payload is None:
            await call._waited(peer, step, _TOKEN, expect)
        else:
            call._as_array(peer, payload, _TOKEN)
        if pending is not None:
            await pending
            t.check_sendable()
        k, dist = k + 1, dist * 2
        if dist >= w:
            return
        pending = call.guard(t.post(ranks[(r + dist) % w], heads.data_head(
            _DATA, group, seq, step0 + k, 0, src, _TOKEN_CODE, _TOKEN.shape, sig, 0),
            _TOKEN_VIEW))
        call.hand_over(0)


async def dissemination_barrier(call: Call, step0: int = 0) -> None:
    """ceil(log2 W) rounds; round k sends to rank+2^k and receives from rank-2^k.

    Each round starts after the previous one's frame was received and its signature checked,
    so a rank that finishes has (transitively) checked every rank's signature.
    """
    if call.size > 1:
        await end_barrier(call, step0, begin_barrier(call, step0))
