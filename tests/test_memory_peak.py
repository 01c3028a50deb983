"""Peak memory of a large TCP all_reduce: 4 real processes, 64 MiB of float32 each.

The zero-copy design (payloads read straight into posted buffers, writes of memoryviews)
should cost each rank at most a small multiple of the message in extra resident memory.
``tests/helpers/memory_peak.py`` measures the growth of ``ru_maxrss`` across the all_reduce.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MESSAGE_MIB = 64
WORLD = 4
LIMIT_MIB = 4 * MESSAGE_MIB

PEAK = re.compile(r"^\[(\d+)\] PEAK rank=(\d+) extra_mib=(-?[0-9.]+) .*ok=(True|False)$")


@pytest.mark.timeout(120)
def test_all_reduce_64mib_peak_memory() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCCOLL_")
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                        if p)
    res = subprocess.run(
        [sys.executable, "-m", "asynccoll", "run", "-n", str(WORLD),
         str(REPO / "tests" / "helpers" / "memory_peak.py")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=100, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    found = {int(m.group(1)): (int(m.group(2)), float(m.group(3)), m.group(4) == "True")
             for line in res.stdout.splitlines() if (m := PEAK.match(line))}
    assert set(found) == set(range(WORLD)), out
    extras = {r: extra for r, (_, extra, _) in found.items()}
    summary = ", ".join(f"rank {r}: {extras[r]:.1f} MiB" for r in sorted(extras))
    print(f"\n{MESSAGE_MIB} MiB all_reduce over {WORLD} TCP ranks, peak extra RSS: {summary}")
    for r, (reported, _, ok) in found.items():
        assert reported == r, out
        assert ok, f"rank {r} got a wrong all_reduce result:\n{out}"
    worst = max(extras.values())
    assert worst <= LIMIT_MIB, (f"peak extra memory {worst:.1f} MiB exceeds {LIMIT_MIB} MiB "
                                f"({summary})")
