#!/usr/bin/env python3
"""Print the command of the first ``sh`` block under a README.md heading, so that CI runs exactly the line a
reader copies (``.ci/try-it`` runs the "Try it" one)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def command(text: str, heading: str) -> str:
    """The one command line of the first ``sh`` block after ``## <heading>``; SystemExit naming what is
    missing when the section, its block or its single line is not there."""
    section = re.search(rf"^## {re.escape(heading)}\b(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        raise SystemExit(f"{README}: no '## {heading}' section")
    block = re.search(r"^```sh\n(.*?)^```", section.group(1), re.M | re.S)
    if block is None:
        raise SystemExit(f"{README}: no ```sh block under '## {heading}'")
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    if len(lines) != 1:
        raise SystemExit(
            f"{README}: the ```sh block under '## {heading}' has {len(lines)} lines; CI runs one"
        )
    return lines[0]


if __name__ == "__main__":
    print(command(README.read_text(encoding="utf-8"), sys.argv[1] if len(sys.argv) > 1 else "Try it"))
