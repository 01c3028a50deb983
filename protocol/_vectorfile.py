"""The command line the vector generators share: write the vector file, or check it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def write_or_check(output: Path, text: str, doc: str | None, argv: list[str] | None) -> int:
    """Write ``text`` to ``output``; with ``--check``, exit 1 instead if the file differs."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    script = Path(sys.argv[0]).name
    if args.check:
        if not output.exists() or output.read_text() != text:
            print(f"{output} is out of date; run {script}", file=sys.stderr)
            return 1
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(f"wrote {output}")
    return 0
