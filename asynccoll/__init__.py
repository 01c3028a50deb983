"""asynccoll: collective communication for asyncio.

>>> import asyncio, numpy as np, asynccoll
>>> async def main(comm):
...     return (await comm.all_reduce(np.full(3, comm.rank + 1.0))).tolist()
>>> asyncio.run(asynccoll.run_local(main, world_size=2))
[[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
"""

from ._version import __version__
from .api import init, run_local
from .collectives import Communicator
from .errors import (
    CollectiveError,
    CollectiveTimeout,
    CommunicatorClosedError,
    PeerLostError,
    ProtocolError,
)
from .ops import ReduceOp
from .tuning import Tuning

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "Communicator",
    "CommunicatorClosedError",
    "PeerLostError",
    "ProtocolError",
    "ReduceOp",
    "Tuning",
    "__version__",
    "init",
    "run_local",
]
