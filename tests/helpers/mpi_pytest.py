"""Run pytest as one process of an MPI job, with a JUnit report per rank.

``mpirun -n N python tests/helpers/mpi_pytest.py REPORT_DIR [pytest args...]`` (what
tests/test_mpi.py starts): every process runs the same tests in the same order and writes
``REPORT_DIR/rank<R>.xml``, which the caller reads for the counts.
"""

from __future__ import annotations

import os
import sys

import pytest


def main() -> int:
    report_dir, *args = sys.argv[1:]
    rank = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
                 if v in os.environ), "0")
    return int(pytest.main([*args, f"--junitxml={os.path.join(report_dir, f'rank{rank}.xml')}"]))


if __name__ == "__main__":
    sys.exit(main())
