"""Elastic data-parallel training: go on when workers die, join or leave.

``ElasticTrainer`` drives a ``DistributedModel`` (any strategy)
through the generations of an ``ElasticGroup``:

- Every ``commit_every`` steps it *commits*: every rank keeps a copy of the whole training
  state (parameters, optimizer buffers, step count; ZeRO shards are all-gathered for it;
  rank 0's model buffers, such as BatchNorm statistics, broadcast for it). A
  failure loses at most the steps since the last commit.
- When a collective fails (a member died: ``PeerLostError``, or timed out),
  every survivor falls back to its last commit, joins the next generation and the world
  re-forms without the dead member.
- After every ``check_every``-th step the ranks agree (one small all_reduce) on whether a
  newer generation is open (a process asked to join) or a member leaves
  (``request_leave``, e.g. on SIGTERM); if so they commit that step and move together, and
  the leavers close their world: leaving costs the others no step.
- In a new world, the member with the newest commit (ties: the lowest rank) broadcasts it, the
  model is rebuilt for the new world size by ``build(comm)`` and loads the state: shards are
  re-cut for the new number of ranks (ZeRO too), newcomers get everything.

What the run computes is then the same as one process doing the same steps on the whole
batches, provided each step's batch is a function of the step number (``fn`` gets it) split
evenly over the current world: survivors redo the steps lost since the last commit, with the
same data. The one difference is floating-point rounding: averaging the gradient over 2 or 3
ranks adds the same numbers in a different order.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import numpy as np

from ..collectives import Communicator
from ..elastic import ElasticGroup
from ..errors import CollectiveError, RendezvousError
from .data_parallel import DistributedModel

log = logging.getLogger("asynccoll.parallel.elastic")

T = TypeVar("T")

#: step, params, optimizer buffers, optimizer step, model buffers
State = tuple[int, np.ndarray, dict[str, np.ndarray], int, dict[str, np.ndarray]]


class ElasticTrainer:
    """Run training steps across the generations of ``group``.

    Args:
        group: this process's ``ElasticGroup``.
        build: makes the wrapped model for a new world: ``build(comm) -> DistributedModel``
            (called again at every re-formation, with the new communicator).
        commit_every: steps between commits (the most a failure can lose).
        check_every: steps between checks for processes waiting to join.
        max_reforms: give up (re-raise) after this many re-formations in a row without a
            completed step.

    Use:

        async with await ElasticGroup.connect() as group:
            trainer = ElasticTrainer(group, build, commit_every=10)
            await trainer.start()
            while trainer.step < total and not trainer.left:  # (left: request_leave)
                await trainer.run_step(lambda dist, step: dist.step(batch(step, dist.comm)))
    """

    def __init__(self, group: ElasticGroup, build: Callable[[Communicator], DistributedModel],
                 *, commit_every: int = 10, check_every: int = 1, max_reforms: int = 10) -> None:
        if commit_every < 1 or check_every < 1:
            raise ValueError("commit_every and check_every must be >= 1")
        self.group = group
        self.build = build
        self.commit_every = commit_every
        self.check_every = check_every
        self.max_reforms = max_reforms
        self.step = 0
        self.reforms = 0
        self.dist: DistributedModel | None = None
        self._commit: State | None = None
        self._since_check = 0
        self._failed_in_a_row = 0
        self._leave = False
        self._left_at: int | None = None
        #: (generation, world size, step resumed from) for every world this process was in
        self.history: list[tuple[int, int, int]] = []

    @property
    def comm(self) -> Communicator:
        if self.group.comm is None:
            self._check_not_left()
            raise RuntimeError("not started: await trainer.start() first")
        return self.group.comm

    def _check_not_left(self) -> None:
        if self._left_at is not None:
            raise RuntimeError(f"this process left the elastic job at step {self._left_at}")

    async def start(self) -> None:
        """Join the first generation (or the running job) and get the current state.

        Raises:
            RendezvousError: no generation formed within the group's ``timeout``
                (``RendezvousTimeout``, also a ``CollectiveTimeout``, when too few processes
                came).
        """
        for attempt in range(self.max_reforms + 1):
            try:
                await self._reform()
                return
            except RendezvousError:
                raise                       # no generation formed within the timeout
            except CollectiveError as exc:
                if attempt == self.max_reforms:
                    raise
                log.warning("elastic: joining failed (%s); trying the next generation", exc)

    def request_leave(self) -> None:
        """Ask this process to leave the job at the next membership check (every
        ``check_every`` steps, after the step in progress). The job commits the state after
        that step, so the others lose nothing; they form the next generation without this
        process, which closes its world and ends with ``left`` true (``run_step`` then
        raises). Only sets a flag: safe from a signal handler, e.g.
        ``loop.add_signal_handler(signal.SIGTERM, trainer.request_leave)``."""
        self._leave = True

    @property
    def left(self) -> bool:
        """This process left the job (``request_leave``); ``step`` is where it left."""
        return self._left_at is not None

    async def run_step(self, fn: Callable[[DistributedModel, int], Awaitable[T]]) -> T:
        """Run ``await fn(dist, step)`` (one training step); returns what ``fn`` returned.

        Every ``check_every`` steps, after the step, the ranks check membership together: if
        a process asked to join or a member leaves (``request_leave``), they commit and form
        the next generation (the leavers close their world instead). A member that fails
        makes the others retry from the last commit in a new world; when that failure comes
        in the check after the step, they form it before returning (``step`` is then the
        commit's), so that a loop ending there still has a model. A process asked to leave
        whose step fails leaves there instead of joining the next world (it returns None).

        Raises:
            RendezvousError: no new world formed within the group's ``timeout``
                (``RendezvousTimeout``, also a ``CollectiveTimeout``, when fewer than
                ``min_nodes`` processes are left); not retried.
            CollectiveError: more than ``max_reforms`` failures in a row.
            RuntimeError: this process left the job.
        """
        self._check_not_left()
        ran, out = False, None  # whether the step ran, what fn returned
        while True:
            try:
                if self.dist is None:
                    if self._leave:             # asked to go: not into another world
                        await self._quit(None)
                        return cast(T, out)
                    await self._reform()
                    if ran:                     # the check after the step failed
                        return cast(T, out)
                    continue
                out = await fn(self.dist, self.step)
                self.step += 1
                self._since_check = (self._since_check + 1) % self.check_every
                if self.step % self.commit_every == 0:
                    await self.commit()
                self._failed_in_a_row = 0
            except RendezvousError:
                raise                       # no generation formed within the timeout
            except CollectiveError as exc:
                self._failed_in_a_row += 1
                if self._failed_in_a_row > self.max_reforms:
                    raise
                log.warning("elastic: step %d failed (%s); %s", self.step, exc,
                            "leaving" if self._leave else "re-forming from the commit of "
                            f"step {self._commit[0] if self._commit else '-'}")
                self.dist = None
                continue
            ran = True
            if self._since_check == 0:
                # every rank of a world comes here after the same step (the counter restarts
                # with each world), so they all take part in the check
                await self._membership()
                if self.dist is None and self._left_at is None:
                    continue                    # it failed: re-form before returning
            return out

    async def _quit(self, after: Exception | None) -> None:
        """Leave the job at ``step``: close the world, form no more."""
        await self.group.leave()
        self.dist, self._left_at = None, self.step
        if after is None:
            log.info("elastic: left the job at step %d", self.step)
        else:
            log.warning("elastic: left the job at step %d after %s", self.step, after)

    async def _membership(self) -> None:
        """The check after a step: commit and move on if a process joins or a member leaves.
        If it fails, ``dist`` is None: the caller re-forms, from the last commit."""
        try:
            reform, leavers = await self.group.check(leaving=self._leave)
            if not reform:
                return
            log.info("elastic: %s at step %d; committing it",
                     f"{leavers} member(s) leave" if leavers else "a process waits to join",
                     self.step)
            if self._commit is None or self._commit[0] != self.step:
                await self.commit()
            if self._leave:
                await self._quit(None)
                return
            await self._reform()
        except RendezvousError:
            raise
        except CollectiveError as exc:
            if self._leave:  # the others have a commit each: go anyway
                await self._quit(exc)
                return
            log.warning("elastic: the membership check after step %d failed (%s); "
                        "re-forming from the commit of step %s", self.step, exc,
                        self._commit[0] if self._commit else "-")
            self.dist = None

    async def commit(self) -> None:
        """Keep a copy of the whole training state on every rank (a collective).

        Raises:
            RuntimeError: no model yet (before ``start``, or between a failure and the
                re-formation), or this process left the job.
        """
        if self.dist is None:
            self._check_not_left()
            raise RuntimeError("no model to commit: await trainer.start() first")
        params, buffers, opt_step = await self.dist.full_state()
        model_buffers = await self.dist.full_buffers()
        self._commit = (self.step, params, buffers, opt_step, model_buffers)

    @property
    def committed_step(self) -> int | None:
        return None if self._commit is None else self._commit[0]

    async def _reform(self) -> None:
        self.dist = None
        self._since_check = 0
        comm = await self.group.form()
        self.reforms += 1
        # who has the newest commit? (newcomers have none)
        mine = -1 if self._commit is None else self._commit[0]
        steps = await comm.all_gather_object(mine)
        best = max(steps)
        root = steps.index(best)
        dist = self.build(comm)
        if best < 0:
            await dist.start()                  # a fresh job: rank 0's initial parameters
            self.step = 0
            self.dist = dist
            await self.commit()
        else:
            if comm.rank == root:
                assert self._commit is not None
                _, params, buffers, opt_step, model_buffers = self._commit
                meta = {"size": int(params.size), "dtype": params.dtype.str,
                        "buffers": sorted(buffers), "opt_step": opt_step,
                        "model_buffers": [[n, list(v.shape), v.dtype.str]
                                          for n, v in sorted(model_buffers.items())]}
            else:
                meta = None
            meta = await comm.broadcast_object(meta, root=root)
            if comm.rank != root:
                params = np.empty(meta["size"], np.dtype(meta["dtype"]))
                buffers = {k: np.empty_like(params) for k in meta["buffers"]}
                model_buffers = {n: np.empty(shape, np.dtype(dt))
                                 for n, shape, dt in meta["model_buffers"]}
            await comm.broadcast(params, root=root)
            for k in meta["buffers"]:
                await comm.broadcast(buffers[k], root=root)
            for n, _, _ in meta["model_buffers"]:
                await comm.broadcast(model_buffers[n], root=root)
            dist.load_full_state(params, buffers, int(meta["opt_step"]))
            dist.load_buffers(model_buffers)
            self.step = best
            self._commit = (best, params, buffers, int(meta["opt_step"]), model_buffers)
            self.dist = dist
        gen = self.group.generation
        assert gen is not None
        self.history.append((gen.number, gen.world_size, self.step))
        log.info("elastic: generation %d, rank %d of %d, resuming at step %d", gen.number,
                 gen.rank, gen.world_size, self.step)


async def run_elastic(group: ElasticGroup, build: Callable[[Communicator], DistributedModel],
                      step_fn: Callable[[DistributedModel, int], Awaitable[Any]], steps: int,
                      *, commit_every: int = 10, check_every: int = 1) -> ElasticTrainer:
    """Train ``steps`` steps with ``ElasticTrainer``; returns the trainer (its ``dist``
    holds the final model)."""
    trainer = ElasticTrainer(group, build, commit_every=commit_every, check_every=check_every)
    await trainer.start()
    while trainer.step < steps and not trainer.left:
        await trainer.run_step(step_fn)
    return trainer


__all__ = ["ElasticTrainer", "run_elastic"]
