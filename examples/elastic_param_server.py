"""Elastic asynchronous SGD: parameter-server training that workers join and leave while it runs.

    asynccoll run -n 3 --min-nodes 2 --max-nodes 8 examples/elastic_param_server.py

and, while it runs, a worker more from another shell (it joins the running job; the
rendezvous is the launcher's, at ``--port``, 29500 by default):

    ASYNCCOLL_RENDEZVOUS=127.0.0.1:29500 python examples/elastic_param_server.py --steps 100

(1 server and 2 workers at first; a generation needs the servers and one worker at least, so
``--min-nodes`` is raised to ``--servers`` + 1 if it is lower; a newcomer with no
``ASYNCCOLL_MAX_NODES`` sets no bound of its own.)

Kill a worker (``kill -9``) and the others go on without it; kill the server and every worker
stops with ``ServerLostError`` (the parameters it held are gone). Which process serves is
decided when the first generation forms: the first ``--servers`` members. Every world change
is printed (``WORLD``), every worker's last test loss (``FINAL``) and the server's counters per
worker (``STATS``, JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import numpy as np

from asynccoll.elastic import ElasticGroup
from asynccoll.parallel import MLP, SGD, ElasticAsyncSGD

SIZES = [8, 32, 1]


def batch(rng: np.random.Generator, w: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((n, SIZES[0]))
    return x, np.sin(x @ w)


async def main(args: argparse.Namespace) -> None:
    w = np.random.default_rng(0).standard_normal((SIZES[0], 1)) / 2
    test = batch(np.random.default_rng(999), w, 512)
    min_nodes = max(int(os.environ.get("ASYNCCOLL_MIN_NODES") or 1), args.servers + 1)
    async with await ElasticGroup.connect(min_nodes=min_nodes, settle=args.settle,
                                          timeout=args.timeout) as group:
        model = MLP(SIZES, seed=0)
        opt = ElasticAsyncSGD(group, model, num_servers=args.servers,
                              optimizer=SGD(lr=args.lr, momentum=0.5), max_staleness=8,
                              stale="scale", check_interval=0.1)
        await opt.start()
        if opt.is_server:
            print(f"ROLE server pid={os.getpid()} id={group.id}", flush=True)
            stats = await opt.serve()
            print("STATS " + json.dumps({
                "server": stats.server, "version": stats.version,
                "generations": stats.generations,
                "workers": {i: {"accepted": s.accepted, "scaled": s.scaled,
                                "rejected": s.rejected, "state": s.state}
                            for i, s in stats.workers.items()}}), flush=True)
            return
        print(f"ROLE worker pid={os.getpid()} id={group.id}", flush=True)
        rng = np.random.default_rng(int.from_bytes(group.id.encode(), "little") % 2**32)
        seen = 0
        for step in range(args.steps):
            loss = await opt.step(batch(rng, w, 32))
            while seen < len(opt.history):
                gen, size, rank = opt.history[seen]
                print(f"WORLD gen={gen} size={size} rank={rank} step={step}", flush=True)
                seen += 1
            if step % 25 == 0:
                print(f"STEP {step} loss {loss:.4f}", flush=True)
            if args.step_delay:
                await asyncio.sleep(args.step_delay)
        await opt.parameters()                  # the newest parameters, into the model
        final = await model.loss(test)
        await opt.finish()
        print(f"FINAL id={group.id} steps={opt.steps} dropped={opt.dropped} "
              f"initial={await MLP(SIZES, seed=0).loss(test):.4f} loss={final:.4f}",
              flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-delay", type=float, default=0.01)
    p.add_argument("--settle", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=30.0)
    asyncio.run(main(p.parse_args()))
