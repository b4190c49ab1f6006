"""Results tables and plots from run directories (``scripts/make_tables.py``, the demo).

A run directory holds ``config.yaml``, ``metrics.jsonl`` and ``metrics.json``
(see :mod:`.run`). Runs whose config names a ``paper: {table, row, top1}``
entry form the comparison tables, one per ``paper.table``, laid out like the
paper's (one row per optimizer, the paper's top-1 beside ours, bytes each
worker handed to the collectives, the ratio to LAMB, wall time, and the
config's ``paper.note`` below); several runs of one row (seeds) are averaged. Runs of a ``study`` (the sweeps) form one
grid per study and table: final top-1 by SLAMB's beta3 x compression ratio,
also drawn as a heat map.
"""
from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import yaml

ROW_ORDER = ("SGD-M", "AdamW", "LAMB", "1-bit LAMB", "DGC", "JointSpar", "JointSpar-LARS", "SLAMB")


def load_runs(root) -> list[dict]:
    """Every finished run (a ``metrics.json``) under ``root``."""
    runs = []
    for summary_path in sorted(Path(root).rglob("metrics.json")):
        folder = summary_path.parent
        config = yaml.safe_load((folder / "config.yaml").read_text()) if (folder / "config.yaml").exists() else {}
        history_path = folder / "metrics.jsonl"
        history = [json.loads(line) for line in history_path.read_text().splitlines() if line.strip()] \
            if history_path.exists() else []
        runs.append({"dir": folder, "summary": json.loads(summary_path.read_text()), "config": config,
                     "history": history})
    return runs


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000.0
    return f"{n:.3g} TB"


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def by_paper_row(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """The runs of each row of a paper table (``paper.row``), rows in the paper's order."""
    groups = defaultdict(list)
    for run in runs:
        groups[run["config"]["paper"]["row"]].append(run)
    order = {name: i for i, name in enumerate(ROW_ORDER)}
    return sorted(groups.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))


def add_bytes_vs_lamb(rows: list[dict]) -> list[dict]:
    lamb = next((r["bytes_per_worker"] for r in rows if r["optimizer"] == "LAMB"), None)
    for r in rows:
        r["bytes_vs_lamb"] = r["bytes_per_worker"] / lamb if lamb else math.nan
    return rows


def comparison_rows(runs: list[dict]) -> list[dict]:
    """One row per optimizer row of a paper table (runs of the same row averaged)."""
    rows = []
    for row, members in by_paper_row(runs):
        s = [m["summary"] for m in members]
        share = s[0].get("compressed_share")
        rows.append({
            "optimizer": row,
            "paper_top1": members[0]["config"]["paper"].get("top1"),
            "top1": _mean([x["final_test_top1"] for x in s]),
            "best_top1": _mean([x["best_test_top1"] for x in s]),
            "bytes_per_worker": _mean([x["bytes_total"].get("all", 0) for x in s]),
            "wall_time_s": _mean([x["wall_time_s"] for x in s]),
            "runs": len(members),
            "epochs": s[0]["epochs"], "workers": s[0]["world_size"], "global_batch": s[0]["global_batch"],
            "params": s[0]["params"], "compressed_share": share,
        })
    return add_bytes_vs_lamb(rows)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def comparison_markdown(table: str, rows: list[dict], note: str | None = None) -> str:
    head = rows[0]
    lines = [f"### {table}", "",
             (f"{head['workers']} workers, global batch {head['global_batch']}, {head['epochs']} epochs, "
              f"{head['params']:,} parameters. Top-1 (%) of the last epoch (mean of the runs); bytes = payload "
              "each worker handed to the collectives over the whole run."), "",
             "| Optimizer | top-1 paper | top-1 ours | best top-1 ours | bytes sent / worker | vs LAMB | wall time | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paper = "-" if r["paper_top1"] is None else f"{r['paper_top1']:.2f}"
        ratio = "-" if math.isnan(r["bytes_vs_lamb"]) else f"{r['bytes_vs_lamb']:.3f}x"
        lines.append(f"| {r['optimizer']} | {paper} | {r['top1']:.2f} | {r['best_top1']:.2f} | "
                     f"{_fmt_bytes(r['bytes_per_worker'])} | {ratio} | {r['wall_time_s']:.0f} s | {r['runs']} |")
    slamb = next((r for r in rows if r["compressed_share"] is not None), None)
    if slamb is not None:
        lines += ["", f"SLAMB compresses {100 * slamb['compressed_share']:.1f}% of the parameters (tensors with "
                  "dim > 1 and >= min_compress_numel elements); the rest is averaged in full every step."]
    if note:
        lines += ["", note.strip()]
    return "\n".join(lines) + "\n"


def squad_rows(runs: list[dict]) -> list[dict]:
    """SQuAD fine-tuning: one row per pre-training optimizer (``paper.row``), runs of a row averaged."""
    rows = []
    for row, members in by_paper_row(runs):
        s, paper = [m["summary"] for m in members], members[0]["config"]["paper"]
        rows.append({"optimizer": row, "paper_f1": paper.get("f1"), "paper_exact_match": paper.get("exact_match"),
                     "exact_match": _mean([x["exact_match"] for x in s]), "f1": _mean([x["f1"] for x in s]),
                     "wall_time_s": _mean([x["wall_time_s"] for x in s]), "runs": len(members),
                     "epochs": s[0]["epochs"], "global_batch": s[0]["global_batch"], "model_dir": s[0]["model_dir"]})
    return rows


def squad_markdown(table: str, rows: list[dict], note: str | None = None) -> str:
    def num(x):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"

    lines = [f"### {table}", "",
             (f"SQuAD v1.1 dev, official exact match / F1 (%) after fine-tuning ({rows[0]['epochs']} epochs, global "
              f"batch {rows[0]['global_batch']}) the BERT checkpoint each optimizer pre-trained; mean of the runs."),
             "",
             "| Pre-training optimizer | F1 paper | EM paper | F1 ours | EM ours | fine-tune time | runs |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        paper_f1, paper_em = ("-" if x is None else f"{x:g}" for x in (r["paper_f1"], r["paper_exact_match"]))
        lines.append(f"| {r['optimizer']} | {paper_f1} | {paper_em} | {num(r['f1'])} | "
                     f"{num(r['exact_match'])} | {r['wall_time_s']:.0f} s | {r['runs']} |")
    if note:
        lines += ["", note.strip()]
    return "\n".join(lines) + "\n"


def pretrain_rows(runs: list[dict]) -> list[dict]:
    """BERT pre-training (one table per phase): one row per optimizer (``paper.row``), runs of a row averaged."""
    rows = []
    for row, members in by_paper_row(runs):
        s = [m["summary"] for m in members]
        rows.append({"optimizer": row, "loss": _mean([x["final_loss"] for x in s]),
                     "mlm_acc": _mean([x["final_mlm_acc"] for x in s]), "nsp_acc": _mean([x["final_nsp_acc"] for x in s]),
                     "seqs_per_s": _mean([x["seqs_per_s"] for x in s]),
                     "bytes_per_worker": _mean([x["bytes_total"].get("all", 0) for x in s]), "runs": len(members),
                     "steps": s[0]["steps"], "seq_len": s[0]["seq_len"], "workers": s[0]["world_size"],
                     "global_batch": s[0]["global_batch"], "params": s[0]["params"]})
    return add_bytes_vs_lamb(rows)


def pretrain_markdown(table: str, rows: list[dict], note: str | None = None) -> str:
    head = rows[0]
    lines = [f"### {table}", "",
             (f"BERT pre-training, seq {head['seq_len']}, {head['steps']} steps, global batch {head['global_batch']}, "
              f"{head['workers']} workers, {head['params']:,} parameters. Loss (MLM + NSP) and accuracies (%) of the "
              "last logged period; bytes = payload each worker handed to the collectives."), "",
             "| Optimizer | loss | MLM acc | NSP acc | sequences/s | bytes sent / worker | vs LAMB | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if math.isnan(r["bytes_vs_lamb"]) else f"{r['bytes_vs_lamb']:.3f}x"
        lines.append(f"| {r['optimizer']} | {r['loss']:.4f} | {r['mlm_acc']:.2f} | {r['nsp_acc']:.2f} | "
                     f"{r['seqs_per_s']:.1f} | {_fmt_bytes(r['bytes_per_worker'])} | {ratio} | {r['runs']} |")
    if note:
        lines += ["", note.strip()]
    return "\n".join(lines) + "\n"


def study_grid(runs: list[dict]) -> tuple[list, list, dict]:
    """(beta3 values, k values, {(beta3, k): final top-1}) of a sweep's runs."""
    cells = defaultdict(list)
    for run in runs:
        o = run["config"]["optimizer"]
        cells[(o.get("beta3"), o.get("compress_ratio"))].append(run["summary"]["final_test_top1"])
    grid = {key: _mean(v) for key, v in cells.items()}
    return sorted({b for b, _ in grid}), sorted({k for _, k in grid}), grid


def _plots(table: str, runs: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in sorted(runs, key=lambda r: ROW_ORDER.index(r["config"]["paper"]["row"])
                      if r["config"]["paper"]["row"] in ROW_ORDER else len(ROW_ORDER)):
        h = run["history"]
        label = run["config"]["paper"]["row"]
        ax1.plot([x["epoch"] for x in h], [x["test_top1"] for x in h], label=label)
        ax2.plot([x["bytes_cum/all"] / 1e6 for x in h], [x["test_top1"] for x in h], label=label)
    ax1.set(xlabel="epoch", ylabel="test top-1 (%)", title=f"{table}: accuracy vs epoch")
    ax2.set(xlabel="MB sent per worker (cumulative)", ylabel="test top-1 (%)", xscale="symlog",
            title="accuracy vs bytes sent")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = out / f"{table}_curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def _heatmap(name: str, betas, ks, grid, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    values = np.array([[grid.get((b, k), np.nan) for k in ks] for b in betas])
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(ks), 1.2 + 0.8 * len(betas)))
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(betas)), [str(b) for b in betas])
    ax.set(xlabel="compression ratio k", ylabel="beta3", title=f"{name}: final top-1 (%)")
    for i in range(len(betas)):
        for j in range(len(ks)):
            if not np.isnan(values[i, j]):
                ax.text(j, i, f"{values[i, j]:.1f}", ha="center", va="center", color="w")
    fig.colorbar(im)
    fig.tight_layout()
    path = out / f"{name}_heatmap.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_tables(runs: list[dict], out) -> dict[str, list[Path]]:
    """Write every table (markdown + CSV) and plot for ``runs`` into ``out``; returns the files by table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    papers, studies, squad, pretrain = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
    for run in runs:
        paper, study = run["config"].get("paper"), run["config"].get("study")
        if paper and "f1" in paper:  # SQuAD fine-tuning runs score EM / F1, not top-1
            squad[paper["table"]].append(run)
        elif paper and "phase" in paper:  # BERT pre-training runs: loss and MLM / NSP accuracy, per phase
            pretrain[f"{paper['table']}_phase{paper['phase']}"].append(run)
        elif study:
            studies[f"{(paper or {}).get('table', run['config'].get('name'))}_{study}"].append(run)
        elif paper:
            papers[paper["table"]].append(run)
    for table, members in sorted(papers.items()):
        rows = comparison_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        note = next((m["config"]["paper"].get("note") for m in members if m["config"]["paper"].get("note")), None)
        md.write_text(comparison_markdown(table, rows, note))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path, *_plots(table, members, out)]
    for table, members in sorted(squad.items()):
        rows = squad_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        note = next((m["config"]["paper"].get("note") for m in members if m["config"]["paper"].get("note")), None)
        md.write_text(squad_markdown(table, rows, note))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path]
    for table, members in sorted(pretrain.items()):
        rows = pretrain_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        note = next((m["config"]["paper"].get("note") for m in members if m["config"]["paper"].get("note")), None)
        md.write_text(pretrain_markdown(table, rows, note))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path]
    for name, members in sorted(studies.items()):
        betas, ks, grid = study_grid(members)
        header = "| beta3 \\ k | " + " | ".join(str(k) for k in ks) + " |"
        lines = [f"### {name}", "", "Final top-1 (%) by beta3 (rows) and compression ratio k (columns).", "",
                 header, "|---" * (len(ks) + 1) + "|"]
        for b in betas:
            cells = [f"{grid[(b, k)]:.2f}" if (b, k) in grid else "-" for k in ks]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        md, csv_path = out / f"{name}.md", out / f"{name}.csv"
        md.write_text("\n".join(lines) + "\n")
        write_csv([{"beta3": b, "compress_ratio": k, "top1": v} for (b, k), v in sorted(grid.items())], csv_path)
        written[name] = [md, csv_path, _heatmap(name, betas, ks, grid, out)]
    return written
