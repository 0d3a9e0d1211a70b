"""How the benchmark scripts write their results: OUT.json with the data, OUT.md with the table
(and, when given, the command that made it)."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: str, data, lines: list[str], command: str | None = None) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(data, indent=2) + "\n")
    text = "\n".join(lines) + "\n"
    if command is not None:
        text += f"\nCommand: `{command}`\n"
    Path(out + ".md").write_text(text)
