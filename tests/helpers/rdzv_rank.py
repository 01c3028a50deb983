"""One rank of a job that meets at a standalone rendezvous (tests/test_rendezvous_service.py).

Reads the usual environment (``ASYNCCOLL_RENDEZVOUS``, ``ASYNCCOLL_RANK``, ...) and ``TAG``;
all-reduces ``[TAG]`` and prints one JSON line: the rank, the sum, or the error.
"""

import asyncio
import json
import os

import numpy as np

import asynccoll


async def main() -> None:
    try:
        comm = await asynccoll.init(backend="tcp", timeout=float(os.environ.get("TIMEOUT", "8")))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    async with comm:
        total = await comm.all_reduce(np.full(1, float(os.environ["TAG"])))
        print(json.dumps({"rank": comm.rank, "sum": float(total[0])}), flush=True)


asyncio.run(main())
