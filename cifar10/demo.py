"""``make demo``: a mini reproduction of the CIFAR-10 table, offline, on a 2-core CPU.

scikit-learn's 8x8 digits (1797 images, shipped with the package) are written
in the exact CIFAR-10 pickle layout (upsampled to 32 x 32 x 3 uint8), then the
three demo rows (``configs/experiment/cifar10/demo_*.yaml``: SGD-M, LAMB,
SLAMB on ResNet-8, 4 gloo workers, global batch 256) run through the same
entry point as the paper rows, as one Hydra ``--multirun``. The tables and the
training-curve plot go to ``results/demo/``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from harness.tables import build_tables, comparison_rows, load_runs

from .data import write_cifar10

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("cifar10/demo_sgd", "cifar10/demo_lamb", "cifar10/demo_slamb")
TEST_SIZE = 297


def write_digits_dataset(path: Path, seed: int = 0) -> Path:
    """Digits as CIFAR-10 batches: bilinear 8x8 -> 32x32, grey -> RGB, 0..16 -> 0..255; a fixed test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images).float().unsqueeze(1)  # N x 1 x 8 x 8, values 0..16
    images = torch.nn.functional.interpolate(images, size=32, mode="bilinear", align_corners=False)
    images = (images / 16.0 * 255.0).round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).numpy()
    order = np.random.default_rng(seed).permutation(len(images))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    labels = digits.target.astype(np.int64)
    return write_cifar10(path, (images[train], labels[train]), (images[test], labels[test]),
                         [str(c) for c in digits.target_names])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=str(ROOT / "runs" / "demo"), help="where the three run directories go")
    parser.add_argument("--out", default=str(ROOT / "results" / "demo"), help="where the tables and plot go")
    parser.add_argument("--data", default=str(ROOT / "data" / "digits-cifar10-layout"))
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every row (e.g. epochs=5)")
    args = parser.parse_args(argv)

    write_digits_dataset(Path(args.data))
    tic = time.perf_counter()
    cmd = [sys.executable, "-m", "cifar10.train", "--multirun", f"experiment={','.join(ROWS)}",
           f"data.dir={args.data}", f"hydra.sweep.dir={args.runs}", "hydra.sweep.subdir=${name}",
           "trainer.resume=never", *args.overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    total = time.perf_counter() - tic

    runs = [r for r in load_runs(args.runs) if r["config"].get("name") in ROWS]
    written = build_tables(runs, args.out)
    rows = comparison_rows(runs)
    print(f"\nDemo finished in {total:.0f} s (3 rows x 4 workers). Tables and plots in {args.out}:")
    for files in written.values():
        for f in files:
            print("  ", Path(f).relative_to(ROOT) if Path(f).is_relative_to(ROOT) else f)
    print()
    for table in written:
        print((Path(args.out) / f"{table}.md").read_text())
    slamb = next((r for r in rows if r["optimizer"] == "SLAMB"), None)
    lamb = next((r for r in rows if r["optimizer"] == "LAMB"), None)
    if slamb and lamb:
        print(f"SLAMB: top-1 {slamb['top1']:.2f}% vs LAMB {lamb['top1']:.2f}%, sending "
              f"{slamb['bytes_vs_lamb']:.3f}x LAMB's bytes ({1 / slamb['bytes_vs_lamb']:.1f}x less).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
