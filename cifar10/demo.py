"""``make demo``: a mini reproduction of the CIFAR-10 table, offline, on a 2-core CPU.

scikit-learn's 8x8 digits (1797 images, shipped with the package) are written
in the exact CIFAR-10 pickle layout (upsampled to 32 x 32 x 3 uint8), then the
three demo rows (``configs/experiment/cifar10/demo_*.yaml``: SGD-M, LAMB,
SLAMB on ResNet-8, 4 gloo workers, global batch 256) run, each for three seeds,
through the same entry point as the paper rows, as one Hydra ``--multirun``.

Written to ``runs/demo/page/`` (ignored by git; ``--out results/demo`` regenerates the committed page): the
comparison table (mean ± standard deviation over the seeds, n), the training curves, ``demo.md`` with the bytes
each worker sent split by kind and one sentence computed from the numbers, which the command prints beside the
committed page's (``results/demo/demo.md``): a run elsewhere moves the numbers by a few tenths of a point.
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

from harness.records import fmt_bytes, load_runs
from harness.tables import RERUN_DRIFT, build_tables, comparison_rows
from slamb.comm import CONTROL, GRADS, MOMENTUM, MOMENTUM_DENSE, PARAMS

from .data import write_digits

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "demo" / "demo.md"
ROWS = ("cifar10/demo_sgd", "cifar10/demo_lamb", "cifar10/demo_slamb")
TABLE = "demo_digits_resnet8"  # the rows' paper.table
SEEDS = (0, 1, 2)
# the ledger's kinds as the demo reports them, in its columns; SLAMB's exchange records its sampled entries and
# the always-averaged tensors it packs beside them as kinds of their own
KINDS = ((GRADS, "gradients"), (MOMENTUM, "momentum, sampled"), (MOMENTUM_DENSE, "momentum, always-averaged tensors"),
         (PARAMS, "parameter sync"), (CONTROL, "control"))


def kind_columns(row: dict) -> dict[str, float]:
    """A comparison row's bytes per worker (mean over its runs) in the ledger's :data:`KINDS`, the rest of its
    kinds as ``other``, and ``all``."""
    kinds = dict(row["bytes_by_kind"])
    total = kinds.pop("all", sum(kinds.values()))
    out = {kind: kinds.pop(kind, 0.0) for kind, _ in KINDS}
    out["other"] = sum(kinds.values())
    out["all"] = total
    return out


def bytes_markdown(rows: list[dict]) -> str:
    columns = [kind_columns(r) for r in rows]
    cols = [(k, name) for k, name in (*KINDS, ("other", "other")) if any(s[k] for s in columns)]
    lines = ["Bytes each worker handed to the collectives over the run, by the ledger's kinds (mean over the "
             "seeds). The compressed share is the part of SLAMB's momentum bytes that were sampled entries: "
             "sampled / (sampled + always-averaged), as measured.", "",
             "| Optimizer | " + " | ".join(name for _, name in cols) + " | total | compressed share |",
             "|---|" + "---|" * (len(cols) + 2)]
    for r, s in zip(rows, columns):
        share = "-" if r["compressed_share"] is None else f"{100 * r['compressed_share']:.1f}%"
        lines.append(f"| {r['optimizer']} | " + " | ".join(fmt_bytes(s[k]) for k, _ in cols)
                     + f" | {fmt_bytes(s['all'])} | {share} |")
    return "\n".join(lines) + "\n"


def time_markdown(rows: list[dict]) -> str:
    """Each row's training step and the optimizer's share of it (mean over the seeds)."""
    lines = ["Step time, mean over the seeds: a training step (forward, backward, optimizer; 4 workers sharing "
             "the machine's cores) and the optimizer step within it (communication included: SLAMB's momentum "
             "exchange and parameter syncs, DDP's gradient all-reduce is in backward).", "",
             "| Optimizer | step (ms) | optimizer step (ms) | optimizer share |", "|---|---|---|---|"]
    def ms(x):
        return "-" if math.isnan(x) else f"{1e3 * x:.1f}"

    for r in rows:
        step, opt = r["step_time_s"], r["optimizer_time_s"]
        share = "-" if math.isnan(step) or math.isnan(opt) else f"{100 * opt / step:.0f}%"
        lines.append(f"| {r['optimizer']} | {ms(step)} | {ms(opt)} | {share} |")
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict]) -> str:
    """One sentence: SLAMB against LAMB, accuracy (with the seeds' spread) and bytes, from the rows."""
    slamb = next((r for r in rows if r["optimizer"] == "SLAMB"), None)
    lamb = next((r for r in rows if r["optimizer"] == "LAMB"), None)
    if slamb is None or lamb is None:
        return "No SLAMB and LAMB rows to compare."
    (ms, ss, ns), (ml, sl, nl) = slamb["top1_stat"], lamb["top1_stat"]
    d = ms - ml
    model = "averaged model" if slamb["top1_local_stat"][2] else "model"
    if ns > 1 and nl > 1:
        half = 2 * math.sqrt(ss**2 / ns + sl**2 / nl)
        spread = (f"two standard errors of the difference: {half:.2f}, so "
                  + ("the seeds cannot tell them apart" if abs(d) <= half else "a difference beyond the seeds' spread"))
    else:
        spread = "one seed, no interval"
    ratio = slamb["bytes_vs_lamb"]
    return (f"SLAMB's {model} is {abs(d):.2f} points {'below' if d < 0 else 'above'} LAMB's ({ms:.2f}% vs "
            f"{ml:.2f}% top-1, mean of {ns} and {nl} seeds; {spread}) at {ratio:.3f}x LAMB's bytes per worker "
            f"({1 / ratio:.1f}x fewer).")


def headline(page: str) -> str | None:
    """The verdict sentence of a demo page (:func:`verdict`), None where it has none."""
    return next((line for line in page.splitlines() if line.startswith(("SLAMB's ", "No SLAMB"))), None)


def committed_headline() -> str:
    """The committed page's verdict, with the commit that last wrote it."""
    import subprocess

    if not COMMITTED.exists():
        return "(no committed page)"
    commit = subprocess.run(["git", "log", "-1", "--format=%h", "--", str(COMMITTED)], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.strip() or "not in git"
    return f"{headline(COMMITTED.read_text())} (results/demo/demo.md, commit {commit})"


def select(root, seeds) -> list[dict]:
    """The demo's finished runs of these seeds under ``root``."""
    return [r for r in load_runs(root)
            if (r["config"].get("paper") or {}).get("table") == TABLE and r["config"].get("seed") in seeds]


def report(runs: list[dict], out: Path) -> str:
    """Tables and plots of the demo's runs into ``out``; returns ``demo.md``'s text (also written there)."""
    written = build_tables(runs, out)
    rows = comparison_rows(runs)
    (table,) = written
    text = "\n".join([(out / f"{table}.md").read_text(), bytes_markdown(rows), time_markdown(rows), verdict(rows),
                      "", RERUN_DRIFT, ""])
    (out / "demo.md").write_text(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=str(ROOT / "runs" / "demo"), help="where the run directories go")
    parser.add_argument("--out", default=str(ROOT / "runs" / "demo" / "page"),
                        help="where the tables and plot go (results/demo: the committed page)")
    parser.add_argument("--data", default=str(ROOT / "data" / "digits-cifar10-layout"))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="seeds of every row")
    parser.add_argument("--report-only", action="store_true", help="rebuild the page from the runs under --runs")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every row (e.g. epochs=5)")
    args = parser.parse_args(argv)
    if args.report_only:
        print(report(select(args.runs, args.seeds), Path(args.out)))
        return 0

    write_digits(Path(args.data))
    tic = time.perf_counter()
    cmd = [sys.executable, "-m", "cifar10.train", "--multirun", f"experiment={','.join(ROWS)}",
           f"seed={','.join(str(s) for s in args.seeds)}", f"data.dir={args.data}", f"hydra.sweep.dir={args.runs}",
           "hydra.sweep.subdir=${name}_seed${seed}", "trainer.resume=never", *args.overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    total = time.perf_counter() - tic

    text = report(select(args.runs, args.seeds), Path(args.out))
    print(text)
    print(f"Demo finished in {total:.0f} s ({len(ROWS)} rows x {len(args.seeds)} seeds x 4 workers). "
          f"Tables and plots in {args.out}.\n\nThis run:          {headline(text)}\n"
          f"The committed page: {committed_headline()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
