"""Benchmarks and the pages they write into results/."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shown_command(args) -> str:
    """A command line as a results page records it, with no machine's directory (:func:`harness.run.shown_path`)."""
    from harness.run import shown_args

    return " ".join(shown_args(args))
