# %% [markdown]
# # asynccoll in one process: a notebook walk-through
#
# Every rank is a coroutine of one event loop (`asynccoll.run_local`, the `memory` backend):
# no launcher, no sockets, nothing to clean up. The collectives and the training wrappers
# are exactly those that run between processes over TCP.
#
# Open this file as a notebook (VS Code, or `jupytext --to notebook`), or run it as a script:
#
#     python examples/notebook_local.py
#
# In Jupyter you can also write `await asynccoll.run_local(fn, 4)` directly in a cell; the
# `run` helper below makes the same cells work in a plain script too.

# %%
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import asynccoll
from asynccoll import CollectiveError, CollectiveTimeout, ReduceOp


def run(coro: Any) -> Any:
    """Run ``coro`` to the end, from a script (``asyncio.run``) or from a notebook cell, whose
    event loop is already running (then in a thread with an event loop of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


print("asynccoll", asynccoll.__version__)

# %% [markdown]
# ## all_reduce on 4 ranks
#
# `run_local(fn, world_size)` runs `await fn(comm)` once per rank, concurrently, and returns
# the results in rank order. `all_reduce` works in place: every rank ends with the sum.

# %%
async def add_up(comm: asynccoll.Communicator) -> list[float]:
    a = np.full(3, comm.rank + 1.0)          # rank r holds [r+1, r+1, r+1]
    await comm.all_reduce(a)                 # op=ReduceOp.SUM
    return a.tolist()


print("all_reduce:", run(asynccoll.run_local(add_up, world_size=4)))
# every rank holds [10.0, 10.0, 10.0] = 1 + 2 + 3 + 4

# %% [markdown]
# ## The other collectives
#
# Each rank returns what it got; the table shows one row per rank.

# %%
async def tour(comm: asynccoll.Communicator) -> dict[str, Any]:
    r, w = comm.rank, comm.world_size
    out: dict[str, Any] = {}
    out["broadcast"] = (await comm.broadcast(np.array([r * 10]), root=0)).tolist()
    out["all_reduce max"] = (await comm.all_reduce(np.array([r]), op=ReduceOp.MAX)).tolist()
    reduced = await comm.reduce(np.array([1.0]), root=0)
    out["reduce"] = None if reduced is None else reduced.tolist()
    out["all_gather"] = (await comm.all_gather(np.array([r, r]))).tolist()
    out["reduce_scatter"] = (await comm.reduce_scatter(np.arange(w * 1.0))).tolist()
    gathered = await comm.gather(np.array([r]), root=0)
    out["gather"] = None if gathered is None else [g.tolist() for g in gathered]
    parts = [np.array([100 + j]) for j in range(w)] if r == 0 else None
    out["scatter"] = (await comm.scatter(parts, root=0)).tolist()
    mine = [np.array([10 * r + j]) for j in range(w)]     # element j goes to rank j
    out["all_to_all"] = [x.tolist() for x in await comm.all_to_all(mine)]
    out["all_gather_object"] = await comm.all_gather_object({"rank": r})
    return out


results = run(asynccoll.run_local(tour, world_size=3))
for name in results[0]:
    print(f"{name:<18}", "  ".join(f"rank {r}: {res[name]}" for r, res in enumerate(results)))

# %% [markdown]
# ## Point to point, and groups
#
# `send`/`recv` carry dtype and shape with the data. `new_group` is called by every rank and
# returns a communicator for the members (renumbered from 0), `None` for the others.

# %%
async def ring_and_groups(comm: asynccoll.Communicator) -> tuple[Any, Any]:
    right, left = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    sending = asyncio.ensure_future(comm.send(np.array([comm.rank]), dst=right, tag=1))
    got = await comm.recv(src=left, tag=1)
    await sending
    evens = await comm.new_group([0, 2])
    in_group = None if evens is None else (evens.rank, (await evens.all_reduce(
        np.array([comm.rank]))).tolist())
    return got.tolist(), in_group


for r, (got, grp) in enumerate(run(asynccoll.run_local(ring_and_groups, 4))):
    print(f"rank {r}: received {got} from its left neighbour; in the even group: {grp}")

# %% [markdown]
# ## Several collectives in flight
#
# Collectives are matched across ranks by sequence number, so launching several at once
# with `asyncio.gather` is legal and never mixes their data.

# %%
async def in_flight(comm: asynccoll.Communicator) -> tuple[list[float], list[int]]:
    a, b = np.ones(4) * comm.rank, np.array([comm.rank])
    summed, gathered = await asyncio.gather(comm.all_reduce(a), comm.all_gather(b))
    return summed.tolist(), gathered.tolist()


print("in flight:", run(asynccoll.run_local(in_flight, 3))[0])

# %% [markdown]
# ## Errors, never hangs
#
# Ranks that disagree about a collective all raise `CollectiveError` naming both calls;
# a rank that never shows up makes the others raise `CollectiveTimeout` after `timeout`
# seconds. `run_local` re-raises the first error.

# %%
async def disagree(comm: asynccoll.Communicator) -> None:
    await comm.all_reduce(np.ones(3 + comm.rank))   # rank 0 passes 3 values, rank 1 passes 4


async def absent(comm: asynccoll.Communicator) -> None:
    if comm.rank == 0:
        await comm.barrier()                         # rank 1 never enters it


for fn, timeout in ((disagree, 60.0), (absent, 0.5)):
    try:
        run(asynccoll.run_local(fn, 2, timeout=timeout))
    except CollectiveTimeout as exc:
        print("CollectiveTimeout:", exc)
    except CollectiveError as exc:
        print("CollectiveError:", exc)

# %% [markdown]
# ## A tiny training run
#
# `asynccoll.parallel` wraps a model for data-parallel training: each rank computes the
# gradients of its share of every batch and the wrapper averages them (DDP), or shards
# gradients and optimizer state across the ranks (ZeRO-2). Both give the model that one
# process training on the whole batches would give.

# %%
from asynccoll.parallel import MLP, Adam, as_distributed, split_batch  # noqa: E402

rng = np.random.default_rng(0)
W_TRUE = rng.standard_normal((8, 1))
BATCHES = [(x, np.tanh(x @ W_TRUE)) for x in rng.standard_normal((60, 32, 8))]


async def train(comm: asynccoll.Communicator, strategy: str) -> tuple[float, np.ndarray]:
    model = MLP([8, 32, 1], seed=0)
    dist = as_distributed(model, comm, Adam(lr=1e-2), strategy=strategy)
    for batch in BATCHES:
        await dist.step(split_batch(batch, comm.rank, comm.world_size))
    params = await dist.full_parameters()
    return await dist.loss(BATCHES[0]), params["layers.0.weight"]


single_loss, single_w = run(asynccoll.run_local(lambda c: train(c, "ddp"), 1))[0]
for strategy in ("ddp", "zero2"):
    ranks = run(asynccoll.run_local(lambda c, s=strategy: train(c, s), 4))
    same = all(np.allclose(w, single_w, atol=1e-6) for _, w in ranks)
    print(f"{strategy:<5} on 4 ranks: loss {ranks[0][0]:.5f} (1 process: {single_loss:.5f}), "
          f"weights equal to the single process's: {same}")

# %% [markdown]
# ## The same over real sockets
#
# `backend="tcp"` runs the same ranks over loopback TCP connections and a real rendezvous
# server, still in this one process: what `asynccoll run -n 4 script.py` does with processes.

# %%
print("tcp all_reduce:", run(asynccoll.run_local(add_up, world_size=4, backend="tcp")))
