"""What the vector generators share: the files' layout (one vector per line) and their command
line (write the file, or check it)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def json_lines(data: dict[str, Any], lists: tuple[str, ...]) -> str:
    """``data`` as JSON with every element of its ``lists`` (keys, last in the file) on a
    line of its own, the other keys first, one per line."""
    lines = ["{"]
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k not in lists]
    lines.append(",\n".join(head) + ",")
    for key in lists:
        lines.append(f' "{key}": [')
        lines.append(",\n".join("  " + json.dumps(e) for e in data[key]))
        lines.append(" ]," if key != lists[-1] else " ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


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
