"""One member of an elastic job (tests/test_elastic_jobs.py).

Reads what ``ElasticGroup.connect`` reads from the environment (``ASYNCCOLL_RENDEZVOUS``,
``ASYNCCOLL_TOKEN``, ``ASYNCCOLL_JOB_ID``, ``ASYNCCOLL_MIN_NODES``/``MAX_NODES``), and
``TAG``, ``TIMEOUT``, ``HOLD``, ``LEAVE``. Prints ``READY`` once connected, then forms one
generation, all-reduces ``[TAG]`` and prints one JSON line: the generation, the world size
and the sum (or the error). Then, with ``HOLD``, stays in the job until killed; with
``LEAVE``, leaves the job (``ElasticGroup.leave``); else closes its group.
"""

import asyncio
import json
import os

import numpy as np

from asynccoll.elastic import ElasticGroup


async def main() -> None:
    group = await ElasticGroup.connect(settle=0.2, timeout=float(os.environ.get("TIMEOUT", "8")))
    print("READY", flush=True)
    async with group:
        try:
            comm = await group.form()
            total = await comm.all_reduce(np.full(1, float(os.environ["TAG"])))
        except Exception as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
            return
        assert group.generation is not None
        print(json.dumps({"gen": group.generation.number, "size": comm.world_size,
                          "sum": float(total[0])}), flush=True)
        if os.environ.get("HOLD"):
            await asyncio.sleep(3600)
        if os.environ.get("LEAVE"):
            await group.leave()


asyncio.run(main())
