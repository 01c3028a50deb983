"""Training on top of the Communicator: data parallelism (DDP, ZeRO 1/2/3), gradient
compression, checkpoints, and the one-line entry points.

>>> dist = as_distributed(model, comm, Adam(lr=1e-3), strategy="zero3")   # doctest: +SKIP
>>> loss = await dist.step(batch)                                         # doctest: +SKIP

Importing this package imports no optional dependency; :class:`TorchModel` imports torch when
first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checkpoint import load_checkpoint, load_parameters, save_checkpoint
from .compression import Compression, make_compression
from .data_parallel import STRATEGIES, DistributedModel, MemoryReport, agree_to_stop
from .distributed import (
    PRESETS,
    DistributedOptimizer,
    as_distributed,
    as_distributed_for_high_bandwidth,
    as_distributed_for_low_bandwidth,
    as_distributed_optimizer,
)
from .layout import FlatLayout
from .mlp import MLP
from .model import Hooks, Model, NoHooks, ParamSpec, split_batch
from .optim import SGD, Adam, AdamW, Optimizer

if TYPE_CHECKING:
    from .torch_model import TorchModel


def __getattr__(name: str) -> Any:
    if name == "TorchModel":
        from .torch_model import TorchModel
        return TorchModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MLP", "PRESETS", "SGD", "STRATEGIES", "Adam", "AdamW", "Compression", "DistributedModel",
    "DistributedOptimizer", "FlatLayout", "Hooks", "MemoryReport", "Model", "NoHooks",
    "Optimizer", "ParamSpec", "TorchModel", "agree_to_stop", "as_distributed",
    "as_distributed_for_high_bandwidth", "as_distributed_for_low_bandwidth",
    "as_distributed_optimizer", "load_checkpoint", "load_parameters", "make_compression",
    "save_checkpoint", "split_batch",
]
