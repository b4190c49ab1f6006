"""Benchmarks and the pages they write into results/."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shown_command(args) -> str:
    """A command line as a results page records it, with no machine's directory: a path inside the repository
    relative to it (``--workdir runs/tta``), one elsewhere by its last part (``--workdir .../tta``). An argument
    is a path, or ``key=path`` (a Hydra override)."""
    def shown(path: str) -> str:
        if not os.path.isabs(path):
            return path
        inside = os.path.relpath(path, ROOT)
        return inside if not inside.startswith("..") else f".../{os.path.basename(path.rstrip('/'))}"

    out = []
    for arg in map(str, args):
        key, eq, value = arg.partition("=")
        out.append(f"{key}={shown(value)}" if eq and not key.startswith("-") else shown(arg))
    return " ".join(out)
