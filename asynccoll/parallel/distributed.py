"""The one-liners: ``as_distributed(model, comm)`` and friends, and the optimizer counterpart.

The presets follow the seeds' ``AsDistributedForHighBandwidth`` / ``...LowBandwidth``: on a
fast network communication is cheap, so gradients travel uncompressed in torch-sized buckets
that overlap the backward pass; on a slow one fewer, larger messages and 8-bit gradients with
error feedback cut the bytes on the wire by about four.
"""

from __future__ import annotations

from typing import Any

from ..collectives import Communicator
from .compression import Compression
from .data_parallel import DEFAULT_BUCKET_BYTES, DistributedModel
from .model import Model
from .optim import Optimizer

#: Settings of the presets, by network kind.
PRESETS: dict[str, dict[str, Any]] = {
    "high_bandwidth": {"bucket_bytes": DEFAULT_BUCKET_BYTES, "compression": None},
    "low_bandwidth": {"bucket_bytes": 4 * DEFAULT_BUCKET_BYTES, "compression": "int8"},
}


def as_distributed(model: Model, comm: Communicator, optimizer: Optimizer | None = None, *,
                   strategy: str = "ddp", compression: Compression | str | None = None,
                   bucket_bytes: int | None = None, preset: str | None = None,
                   prefetch: bool = True, broadcast_buffers: bool = True,
                   max_grad_norm: float | None = None) -> DistributedModel:
    """Wrap ``model`` for data-parallel training over ``comm``.

    Args:
        strategy: ``"ddp"`` (replicated), ``"zero1"``, ``"zero2"`` or ``"zero3"`` (sharded
            optimizer state, + gradients, + parameters); see
            ``asynccoll.parallel.data_parallel``.
        compression: ``None``, ``"fp16"``, ``"bf16"``, ``"topk"``, ``"int8"``... or a
            ``Compression`` (``ddp``/``zero1`` only).
        preset: ``"high_bandwidth"`` or ``"low_bandwidth"`` (see ``PRESETS``); explicit
            arguments win over the preset's.
        broadcast_buffers: as torch's DDP (default ``True``): rank 0's model buffers
            (BatchNorm statistics...) reach every rank at the start of each forward pass
            after a training step; ``False`` leaves every rank its own (see
            ``DistributedModel``).
        max_grad_norm: clip the averaged gradient to this global L2 norm at every step
            (torch's ``clip_grad_norm_``); the norm is in ``last_grad_norm`` (see
            ``DistributedModel.clip_grad_norm``).
    """
    settings: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
        settings.update(PRESETS[preset])
    if compression is not None:
        settings["compression"] = compression
    if bucket_bytes is not None:
        settings["bucket_bytes"] = bucket_bytes
    return DistributedModel(model, comm, optimizer, strategy=strategy, prefetch=prefetch,
                            broadcast_buffers=broadcast_buffers, max_grad_norm=max_grad_norm,
                            **settings)


def as_distributed_for_high_bandwidth(model: Model, comm: Communicator,
                                      optimizer: Optimizer | None = None, *,
                                      strategy: str = "ddp") -> DistributedModel:
    """``as_distributed`` with the ``high_bandwidth`` preset."""
    return as_distributed(model, comm, optimizer, strategy=strategy, preset="high_bandwidth")


def as_distributed_for_low_bandwidth(model: Model, comm: Communicator,
                                     optimizer: Optimizer | None = None, *,
                                     strategy: str = "ddp") -> DistributedModel:
    """``as_distributed`` with the ``low_bandwidth`` preset (``ddp`` or ``zero1``)."""
    return as_distributed(model, comm, optimizer, strategy=strategy, preset="low_bandwidth")


class DistributedOptimizer:
    """The optimizer side of a ``DistributedModel``: ``step`` applies the averaged
    gradients (to this rank's shard under ZeRO) and shares the result; ``zero_grad`` forgets
    accumulated gradients. Made by ``as_distributed_optimizer``."""

    def __init__(self, optimizer: Optimizer, dist: DistributedModel) -> None:
        self.optimizer = optimizer
        self.dist = dist
        dist.set_optimizer(optimizer)

    async def step(self) -> None:
        await self.dist.optimizer_step()

    def zero_grad(self) -> None:
        self.dist.zero_grad()

    @property
    def lr(self) -> float:
        return self.dist.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.dist.lr = value


def as_distributed_optimizer(optimizer: Optimizer, dist: DistributedModel
                             ) -> DistributedOptimizer:
    """Attach ``optimizer`` to a distributed model (the seeds' ``optimizer.AsDistributed()``):
    its state is sharded as the model's strategy says."""
    return DistributedOptimizer(optimizer, dist)


__all__ = ["PRESETS", "DistributedOptimizer", "as_distributed",
           "as_distributed_for_high_bandwidth", "as_distributed_for_low_bandwidth",
           "as_distributed_optimizer"]
