"""Regenerate every results table (markdown + CSV) and plot from the run directories.

    python scripts/make_tables.py [--runs runs] [--out results]

Every page first says what ran, from the runs' own records (config, summary,
meta.json): model, data set, workers, epochs or steps, precision, hardware and
commit. Comparison tables (one per ``paper.table`` of the experiment configs):
one row per optimizer and configuration (all settings but the seed and the
operational ones), mean ± standard deviation over its seeds (each counted once)
and their number, bytes per worker, ratio to LAMB, wall time. Published numbers
stand beside ours only where every run has their setting (``paper.setting``);
otherwise the page says so and gives them apart, under their source
(``paper.source``). Also the training curves (accuracy vs epoch and vs bytes
sent) and, for sweeps, the beta3 x k grid and heat maps, the H line, top-1
against bytes, each cell's effective compression ratio and a warning where the
compression warm-up decided it. Runs with a NaN summary or no epoch are left
out with a message. See :mod:`harness.tables`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/make_tables.py`: the repository's packages are importable
    sys.path.insert(0, str(ROOT))

from harness.tables import build_tables, load_runs  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="results tables and plots from run directories")
    parser.add_argument("--runs", default="runs", help="folder searched (recursively) for finished runs")
    parser.add_argument("--out", default="results", help="where the tables and plots go")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    if not runs:
        print(f"no finished run (metrics.json) under {args.runs}: run scripts/cifar10_resnet110.sh first",
              file=sys.stderr)
        return 1
    for table, files in build_tables(runs, args.out).items():
        print(f"{table}: " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
