"""Benchmarks and the pages they write into results/."""
from __future__ import annotations

from pathlib import Path

from harness.run import shown_command  # noqa: F401 (the benches' pages record their commands by it)

ROOT = Path(__file__).resolve().parents[1]
