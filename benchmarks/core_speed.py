"""How fast each core of this machine is, over time: ``workers.CoreProbe`` on every core at once.

    python benchmarks/core_speed.py                  # 60 s, every core this process may use
    python benchmarks/core_speed.py --seconds 10 --every 0.05

One process per core, pinned to it, runs the probe every ``--every`` seconds and the script
prints, per core, the probe's distribution (us; lower is faster) and how often and for how
long the core ran faster than ``--fast`` us. On a machine whose cores run at one speed the
distribution is narrow; on a virtual machine whose host runs other work beside its cores it
is not, and a collective's figures move with it (docs/performance.md, "Cores that change
speed"). The probe itself takes ~0.1 ms, so the cores stay almost idle.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from workers import CoreProbe  # benchmarks/ is on sys.path when run as a script


def sample(core: int, seconds: float, every: float) -> list[float]:
    """Probe times (us) on ``core``, one every ``every`` seconds for ``seconds``."""
    os.sched_setaffinity(0, {core})
    probe = CoreProbe()
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(probe() * 1e6)
        time.sleep(every)
    return out


def stretches(values: list[float], fast: float) -> list[int]:
    """Lengths of the runs of consecutive samples below ``fast``."""
    runs, cur = [], 0
    for v in values:
        if v < fast:
            cur += 1
        elif cur:
            runs.append(cur)
            cur = 0
    if cur:
        runs.append(cur)
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--every", type=float, default=0.1, help="seconds between probes")
    p.add_argument("--fast", type=float, default=100.0,
                   help="probe time (us) below which a sample counts as a fast core")
    a = p.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    with ProcessPoolExecutor(len(cores)) as pool:
        results = list(pool.map(sample, cores, [a.seconds] * len(cores),
                                [a.every] * len(cores)))
    print(f"# {len(cores)} cores, a probe every {a.every} s for {a.seconds} s (us, lower is "
          f"faster); fast: below {a.fast:g} us")
    for core, values in zip(cores, results, strict=True):
        q = sorted(values)
        runs = stretches(values, a.fast)
        fast = sum(runs)
        print(f"core {core}: {len(values)} probes, min {q[0]:.0f}, p10 "
              f"{q[len(q) // 10]:.0f}, median {statistics.median(q):.0f}, p90 "
              f"{q[len(q) * 9 // 10]:.0f}, max {q[-1]:.0f}; fast in {fast / len(q):.0%} "
              f"({len(runs)} stretches, longest {max(runs, default=0) * a.every:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
