"""Hybrid 3D parallelism: data parallel over pipeline parallel over tensor parallel, from one
configuration.

    hybrid = await Hybrid.create(comm, MLP(sizes), data=2, pipe=2, tensor=2,
                                 optimizer=Adam(lr=1e-3), strategy="zero1", micro_batches=4)
    loss = await hybrid.step((x, y))          # every rank passes the same global batch

The world is laid out as a ``Mesh`` (tensor innermost). Along
``pipe`` the model is cut into stages (balanced by parameter count, or at ``cuts``); inside a
stage its layers are split Megatron-style over the ``tensor`` group
(``TensorParallelStage``), and along ``data`` every stage's (sharded) parameters are
trained data-parallel by a ``DistributedModel`` with
any strategy. Each data replica gets ``1/data`` of every batch (``numpy.array_split``), each
pipeline splits its share into micro-batches, and every tensor rank of a stage computes on
the whole micro-batch.

What each level communicates, per step: the tensor group one all_reduce per column+row pair
and micro-batch, forward and backward; the pipe group the activations and their gradients
(send/recv, one message per micro-batch and direction, between ranks of the same tensor
coordinate); the data group the strategy's gradient exchange, once per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import numpy as np

from ..collectives import Communicator
from ._failure import break_comm
from ._mlp_math import check_targets, mean_loss
from .data_parallel import DistributedModel
from .mesh import Mesh
from .mlp import MLP
from .model import ModelParallelGroup, ParamSpec, split_batch
from .optim import Optimizer
from .pipeline import (
    MLPStage,
    PipelineParallel,
    Stage,
    _layer_range,
    _Saved,
    mlp_partition,
)
from .tensor import TensorParallelMLP


class TensorParallelStage(Stage):
    """Layers ``[start, stop)`` of ``mlp`` as a pipeline stage, tensor parallel over ``comm``.

    Parameter names are the MLP's (``layers.{i}.weight``, with global ``i``) and layer ``i``
    is unit ``i - start``, as in ``MLPStage``; the shapes
    are this rank's shards. Inputs and outputs are whole on every tensor rank (a stage that
    is not the last applies the activation to its output, as ``MLPStage`` does).
    """

    def __init__(self, mlp: MLP, start: int, stop: int, comm: Communicator) -> None:
        start, stop = _layer_range(mlp, start, stop)
        self.start, self.stop = start, stop
        self.comm = comm
        self.loss_kind = mlp.loss_kind
        self._last = stop == mlp.num_units
        self._first = start == 0
        self.inner = TensorParallelMLP(mlp.sizes[start:stop + 1], comm,
                                       activation=mlp.activation, loss=mlp.loss_kind,
                                       dtype=mlp.dtype, output_activation=not self._last)
        full = mlp.parameters()
        self.inner.load_full_parameters({self._local(name): full[name]
                                         for name in self._global_names()})
        self._specs = [ParamSpec(name=self._global(s.name), shape=s.shape, dtype=s.dtype,
                                 unit=s.unit) for s in self.inner.param_specs()]
        self._saved: _Saved[list[np.ndarray]] = _Saved()

    def __repr__(self) -> str:
        return (f"TensorParallelStage(layers {self.start}..{self.stop - 1}, tensor rank "
                f"{self.comm.rank} of {self.comm.world_size})")

    def _global_names(self) -> list[str]:
        return [f"layers.{i}.{k}" for i in range(self.start, self.stop)
                for k in ("weight", "bias")]

    def _global(self, local: str) -> str:
        _, i, kind = local.split(".")
        return f"layers.{int(i) + self.start}.{kind}"

    def _local(self, name: str) -> str:
        _, i, kind = name.split(".")
        return f"layers.{int(i) - self.start}.{kind}"

    @property
    def computes_loss(self) -> bool:
        return self._last

    @property
    def held(self) -> int:
        return len(self._saved)

    def param_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def parameters(self) -> dict[str, np.ndarray]:
        return {self._global(k): v for k, v in self.inner.parameters().items()}

    def bind(self, params: Mapping[str, np.ndarray] | None = None,
             grads: Mapping[str, np.ndarray] | None = None) -> None:
        self.inner.bind(None if params is None else {self._local(k): v
                                                     for k, v in params.items()},
                        None if grads is None else {self._local(k): v for k, v in grads.items()})

    def clear(self) -> None:
        self._saved.clear()

    def model_parallel_groups(self) -> list[ModelParallelGroup]:
        return [ModelParallelGroup(comm=g.comm, replicated=frozenset(
            self._global(n) for n in g.replicated)) for g in self.inner.model_parallel_groups()]

    async def forward(self, mb: int, x: np.ndarray, *, grad: bool = True) -> np.ndarray:
        if grad:
            self._saved.check_free(mb)
        acts = await self.inner.forward(x)
        if grad:
            self._saved[mb] = acts
        return acts[-1]

    async def backward(self, mb: int, dy: np.ndarray) -> np.ndarray | None:
        acts = self._saved.take(mb)
        return await self.inner.backward(acts, np.array(dy, dtype=self.inner.dtype),
                                         input_grad=not self._first)

    async def loss_grad(self, mb: int, y: np.ndarray, target: Any, weight: float, *,
                        grad: bool = True) -> tuple[float, np.ndarray | None]:
        if not self._last:
            return await super().loss_grad(mb, y, target, weight, grad=grad)
        out = np.array(y, dtype=self.inner.dtype)   # a copy: the gradient is computed in it
        n, k = out.shape
        t = check_targets(self.loss_kind, target, n, k, self.inner.dtype)
        # weight x the mean over the micro-batch, as MLPStage computes it
        return mean_loss(self.loss_kind, out, t, grad=grad, weight=weight)

    async def full_parameters(self, params: Mapping[str, np.ndarray] | None = None
                              ) -> dict[str, np.ndarray]:
        """The stage's unsplit parameters (global names), gathered over the tensor group."""
        local = None if params is None else {self._local(k): v for k, v in params.items()}
        got = await self.inner.full_parameters(local)
        return {self._global(k): v for k, v in got.items()}


class Hybrid:
    """Data x pipeline x tensor parallel training of an ``MLP``. Build with
    ``create`` (a collective over ``comm``).

    Attributes:
        mesh: the ``Mesh``.
        stage: this rank's stage (``TensorParallelStage``, or
            ``MLPStage`` when ``tensor == 1``).
        pipeline: the ``PipelineParallel`` over the pipe
            group.
        dist: the ``DistributedModel`` over the data
            group.
        layers: every stage's ``(start, stop)`` layer range.
    """

    def __init__(self, mesh: Mesh, mlp: MLP, layers: list[tuple[int, int]], stage: Stage,
                 pipeline: PipelineParallel, dist: DistributedModel) -> None:
        self.mesh, self.layers = mesh, layers
        self.stage, self.pipeline, self.dist = stage, pipeline, dist
        self._specs = mlp.param_specs()

    @classmethod
    async def create(cls, comm: Communicator, mlp: MLP, *, data: int = 1, pipe: int = 1,
                     tensor: int = 1, optimizer: Optimizer, strategy: str = "ddp",
                     micro_batches: int = 1, schedule: str = "1f1b",
                     cuts: Sequence[int] | None = None, balance: str = "params",
                     **data_parallel: Any) -> Hybrid:
        """Lay out ``comm`` as ``data x pipe x tensor`` and build every level.

        Every rank passes the same ``mlp`` (its parameters are the starting point), sizes
        and settings. ``data_parallel`` goes to
        ``DistributedModel`` (``bucket_bytes``,
        ``compression``, ``prefetch``, ``max_grad_norm``: clipping by the global norm over
        the whole model, every stage and tensor shard; ``dist.last_grad_norm``).
        """
        mesh = await Mesh.create(comm, data=data, pipe=pipe, tensor=tensor)
        layers = mlp_partition(mlp, mesh.shape.pipe, cuts=cuts, balance=balance)
        start, stop = layers[mesh.coords.pipe]
        stage: Stage
        if mesh.shape.tensor > 1:
            stage = TensorParallelStage(mlp, start, stop, mesh.tensor)
        else:
            stage = MLPStage(mlp, start, stop)
        pipeline = PipelineParallel(stage, mesh.pipe, micro_batches=micro_batches,
                                    schedule=schedule)
        dist = DistributedModel(pipeline, mesh.data, optimizer, strategy=strategy,
                                **data_parallel)
        return cls(mesh, mlp, layers, stage, pipeline, dist)

    async def step(self, batch: tuple[np.ndarray, np.ndarray]) -> float:
        """One training step on the global ``batch`` (the same on every rank): this data
        replica's share goes through the pipeline, gradients are exchanged over the data
        group, the optimizer steps. Returns the mean loss over the whole batch.

        Raises:
            ValueError: a malformed batch, or a replica's share too small for its
                micro-batches (on that replica's ranks; the others raise CollectiveError).
            CollectiveError: another rank failed. A failing (or cancelled) step breaks the
                world communicator, so no rank waits for the timeout.
        """
        return await self._broken_on_failure(self._step(batch))

    async def _step(self, batch: tuple[np.ndarray, np.ndarray]) -> float:
        loss = await self.dist.step(self._share(batch))
        return await self._global_loss(loss)

    async def loss(self, batch: tuple[np.ndarray, np.ndarray]) -> float:
        """The mean loss over ``batch`` without training (failures as for ``step``)."""
        return await self._broken_on_failure(self._loss(batch))

    async def _loss(self, batch: tuple[np.ndarray, np.ndarray]) -> float:
        loss = await self.dist.loss(self._share(batch))
        return await self._global_loss(loss)

    async def _broken_on_failure(self, work: Coroutine[Any, Any, float]) -> float:
        """Await ``work``; if it fails, break the world before re-raising. A failing
        pipeline breaks it already when it has several stages, but one of a single stage
        has no peer to break its group with, and the other replicas would wait for this
        one's gradients until the timeout."""
        try:
            return await work
        except (Exception, asyncio.CancelledError):
            await break_comm(self.mesh.world)
            raise

    def _share(self, batch: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
        """This replica's share of ``batch``, its loss weighted by its size: the data group
        averages the gradients with equal weights, which is the whole batch's gradient
        only when every replica's loss counts ``data * n / N`` times its mean over its
        ``n`` of the ``N`` samples (1 when the batch splits evenly)."""
        data = self.mesh.shape.data
        mine = split_batch(batch, self.mesh.coords.data, data)
        total, n = len(batch[0]), len(mine[0])
        self.pipeline._loss_scale = data * n / total if total else 1.0
        return mine

    async def _global_loss(self, loss: float) -> float:
        """The mean over the whole batch from the replicas' weighted losses."""
        if self.mesh.shape.data == 1:
            return loss
        buf = np.array([loss / self.mesh.shape.data])
        await self.mesh.data.all_reduce(buf)
        return float(buf[0])

    async def full_parameters(self) -> dict[str, np.ndarray]:
        """Every parameter of the whole model, unsplit, on every rank (a collective over the
        world: ZeRO shards, tensor shards and stages are gathered)."""
        mine = await self.dist.full_parameters()           # the stage's, tensor-sharded
        if isinstance(self.stage, TensorParallelStage):
            mine = await self.stage.full_parameters(mine)
        out: dict[str, np.ndarray] = {}
        shape, world = self.mesh.shape, self.mesh.world
        for p, (start, stop) in enumerate(self.layers):
            root = shape.rank_of(0, p, 0)
            for s in self._specs:
                if start <= s.unit < stop:
                    buf = mine[s.name] if world.rank == root else np.empty(s.shape, s.dtype)
                    await world.broadcast(buf, root=root)
                    out[s.name] = buf
        return out


__all__ = ["Hybrid", "TensorParallelStage"]
