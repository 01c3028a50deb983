"""Training on top of the Communicator: data parallelism (DDP, ZeRO 1/2/3), gradient
compression, checkpoints, and the one-line entry points.

>>> dist = as_distributed(model, comm, Adam(lr=1e-3), strategy="zero3")   # doctest: +SKIP
>>> loss = await dist.step(batch)                                         # doctest: +SKIP

Importing this package imports no optional dependency; ``TorchModel`` imports torch when
first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checkpoint import load_checkpoint, load_parameters, read_buffers, save_checkpoint
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
from .elastic import ElasticTrainer, run_elastic
from .elastic_ps import ElasticAsyncSGD, ElasticServerStats, ServerLostError
from .hybrid import Hybrid, TensorParallelStage
from .layout import FlatLayout
from .local import flat_parameters, train_locally
from .mesh import Mesh, MeshCoords, MeshShape
from .mlp import MLP
from .model import BufferSpec, Hooks, Model, ModelParallelGroup, NoHooks, ParamSpec, split_batch
from .optim import SGD, Adam, AdamW, Optimizer
from .param_server import AsyncSGD, PushResult, ServerStats, WorkerStats
from .pipeline import (
    MLPStage,
    PipelineParallel,
    Stage,
    TorchStage,
    mlp_partition,
    split_mlp,
    split_sequential,
)
from .tensor import (
    ColumnParallel,
    ParallelLinear,
    Replicated,
    RowParallel,
    TensorParallelMLP,
    megatron_layers,
)

if TYPE_CHECKING:
    from .tensor import ColumnParallelLinear, RowParallelLinear
    from .torch_model import TorchModel


def __getattr__(name: str) -> Any:
    # names that import torch: loaded on first use
    if name == "TorchModel":
        from .torch_model import TorchModel
        return TorchModel
    if name in ("ColumnParallelLinear", "RowParallelLinear"):
        from . import tensor
        return getattr(tensor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MLP",
    "PRESETS",
    "SGD",
    "STRATEGIES",
    "Adam",
    "AdamW",
    "AsyncSGD",
    "BufferSpec",
    "ColumnParallel",
    "ColumnParallelLinear",
    "Compression",
    "DistributedModel",
    "DistributedOptimizer",
    "ElasticAsyncSGD",
    "ElasticServerStats",
    "ElasticTrainer",
    "FlatLayout",
    "Hooks",
    "Hybrid",
    "MLPStage",
    "MemoryReport",
    "Mesh",
    "MeshCoords",
    "MeshShape",
    "Model",
    "ModelParallelGroup",
    "NoHooks",
    "Optimizer",
    "ParallelLinear",
    "ParamSpec",
    "PipelineParallel",
    "PushResult",
    "Replicated",
    "RowParallel",
    "RowParallelLinear",
    "ServerLostError",
    "ServerStats",
    "Stage",
    "TensorParallelMLP",
    "TensorParallelStage",
    "TorchModel",
    "TorchStage",
    "WorkerStats",
    "agree_to_stop",
    "as_distributed",
    "as_distributed_for_high_bandwidth",
    "as_distributed_for_low_bandwidth",
    "as_distributed_optimizer",
    "flat_parameters",
    "load_checkpoint",
    "load_parameters",
    "make_compression",
    "megatron_layers",
    "mlp_partition",
    "read_buffers",
    "run_elastic",
    "save_checkpoint",
    "split_batch",
    "split_mlp",
    "split_sequential",
    "train_locally",
]
