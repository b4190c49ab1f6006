"""Results pages from run directories (``scripts/make_tables.py``, the demo, the study).

Runs whose config names a ``paper: {table, row, ...}`` entry form the comparison tables, one per
``paper.table`` (the CIFAR-10 and Swin top-1 tables, BERT's pre-training table per phase, SQuAD's F1 table), one
row per optimizer row and identity (:func:`harness.records.configuration`: what the run computed and what its
data is, by content), seeds pooled within an identity only: each cell gives their mean ± standard deviation
(n - 1) and the row the number of runs. Runs of a ``study`` (the sweeps, any pipeline) form the sweep pages of
:mod:`harness.sweeps`.

Every page says what ran (:func:`harness.records.what_ran`). Published numbers (``paper.top1``, ``paper.f1``)
stand beside ours only where every run is its experiment's recipe at the recipe's size on the published data
(:func:`harness.records.paper_setting`); otherwise the page gives the reasons in one line and the published
numbers apart, under their source (``paper.source``).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from .figures import pyplot, save_figure
from .records import (bytes_by_kind, compressed_share, fmt_bytes, groups, label_groups, last_logged, note_of, pm,
                      published, stat, volume, what_ran, write_csv)
from .sweeps import sweep_pages

def add_bytes_vs_lamb(rows: list[dict]) -> list[dict]:
    """Each row's bytes over those of the LAMB row with the same model, data, length and workers."""
    lamb = {volume(r["settings"]): r["bytes_per_worker"] for r in rows if r["optimizer"] == "LAMB"}
    for r in rows:
        ref = lamb.get(volume(r["settings"]))
        r["bytes_vs_lamb"] = r["bytes_per_worker"] / ref if ref else math.nan
    return rows


def comparison_rows(runs: list[dict]) -> list[dict]:
    """One row per optimizer row and configuration of a paper table, seeds as mean ± std."""
    found = groups(runs)
    label_groups(found)
    rows = []
    for g in found:
        members = g["runs"]
        s = [m["summary"] for m in members]
        kinds = bytes_by_kind(s)
        rows.append({
            "optimizer": g["row"], "configuration": g["label"],
            "paper_top1": (members[0]["config"].get("paper") or {}).get("top1"),
            "top1_stat": stat(x["final_test_top1"] for x in s),
            "top1_local_stat": stat(last_logged(m, "test_top1_local") for m in members),
            "best_top1_stat": stat(x.get("best_test_top1") for x in s),
            "bytes_per_worker": kinds.get("all", 0),
            "bytes_by_kind": kinds, "compressed_share": compressed_share(kinds),
            "wall_time_s": stat(x.get("wall_time_s") for x in s)[0],
            "step_time_s": stat(x.get("mean_step_time_s") for x in s)[0],
            "optimizer_time_s": stat(x.get("mean_optimizer_time_s") for x in s)[0],
            "runs": len(members), "seeds": sorted(m["config"].get("seed") for m in members),
            "epochs": s[0].get("epochs"), "workers": s[0].get("world_size"), "global_batch": s[0].get("global_batch"),
            "params": s[0].get("params"), "settings": g["settings"], "members": members,
        })
    return add_bytes_vs_lamb(rows)


def _published_value(x) -> str:
    """A published number as published: two decimals, or all it has (an F1 of 90.584)."""
    return "-" if x is None else f"{x:.2f}" if round(x, 2) == x else f"{x:g}"


def paper_markdown(rows: list[dict], head: str, columns: dict[str, str]) -> list[str]:
    """The published numbers as a table of their own (where the runs are not in their setting); ``columns``
    maps a row's key to its heading."""
    seen = {}
    for r in rows:
        seen.setdefault(r["optimizer"], [r[k] for k in columns])
    return ["", f"| {head} | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"] + [
        f"| {name} | " + " | ".join(_published_value(x) for x in v) + " |" for name, v in seen.items()]


def _members(rows: list[dict]) -> list[dict]:
    return [m for r in rows for m in r["members"]]


def comparison_markdown(table: str, rows: list[dict], runs: list[dict], note: str | None = None) -> str:
    shared = label_groups([{"settings": r["settings"]} for r in rows])
    local = any(r["top1_local_stat"][2] for r in rows)
    params = {r["params"] for r in rows}
    members = _members(rows)
    has_paper = any(r["paper_top1"] is not None for r in rows)
    beside, source = published(members, runs, "top-1") if has_paper else (False, [])
    lines = [f"### {table}", "", *what_ran(members, runs), "",
             ("Every row: " + ", ".join(x for x in (shared, f"{params.pop():,} parameters" if len(params) == 1 else "")
                                        if x) + ". "
              "Top-1 (%) of the last epoch, mean ± standard deviation over the n runs (seeds) of the row's "
              "configuration" + (" (the ranks' averaged model; 'local' is the mean over ranks of each rank's own "
                                 "model)" if local else "") + "; bytes = payload each worker handed to the "
              "collectives over the whole run."), "",
             "| Optimizer | configuration | top-1 |" + (" published top-1 |" if beside else "")
             + (" top-1 local |" if local else "")
             + " best top-1 | bytes sent / worker | vs LAMB | training time | n |",
             "|---|---|---|" + ("---|" if beside else "") + ("---|" if local else "") + "---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if math.isnan(r["bytes_vs_lamb"]) else f"{r['bytes_vs_lamb']:.3f}x"
        lines.append(f"| {r['optimizer']} | {r['configuration']} | {pm(r['top1_stat'])} | "
                     + (f"{_published_value(r['paper_top1'])} | " if beside else "")
                     + (f"{pm(r['top1_local_stat'])} | " if local else "")
                     + f"{pm(r['best_top1_stat'])} | {fmt_bytes(r['bytes_per_worker'])} | {ratio} | "
                     f"{r['wall_time_s']:.0f} s | {r['runs']} |")
    slamb = next((r for r in rows if r["compressed_share"] is not None), None)
    if slamb is not None:
        lines += ["", f"{100 * slamb['compressed_share']:.1f}% of SLAMB's momentum bytes were sampled entries "
                  "(tensors with dim > 1 and >= min_compress_numel elements), as the ledger measured them; the rest "
                  "is the always-averaged tensors, sent in full every step."]
    lines += source + ([] if beside or not has_paper else
                       paper_markdown(rows, "Optimizer", {"paper_top1": "published top-1 (%)"}))
    if note:
        lines += ["", note.strip()]
    return "\n".join(lines) + "\n"


def squad_rows(runs: list[dict]) -> list[dict]:
    """SQuAD fine-tuning: one row per pre-training optimizer (``paper.row``) and configuration."""
    found = groups(runs)
    label_groups(found)
    rows = []
    for g in found:
        s, paper = [m["summary"] for m in g["runs"]], g["runs"][0]["config"].get("paper") or {}
        rows.append({"optimizer": g["row"], "configuration": g["label"], "paper_f1": paper.get("f1"),
                     "paper_exact_match": paper.get("exact_match"),
                     "exact_match_stat": stat(x["exact_match"] for x in s), "f1_stat": stat(x["f1"] for x in s),
                     "wall_time_s": stat(x["wall_time_s"] for x in s)[0], "runs": len(s),
                     "epochs": s[0]["epochs"], "global_batch": s[0]["global_batch"], "model_dir": s[0]["model_dir"],
                     "settings": g["settings"], "members": g["runs"]})
    return rows


def squad_markdown(table: str, rows: list[dict], runs: list[dict], note: str | None = None) -> str:
    shared = label_groups([{"settings": r["settings"]} for r in rows])
    members = _members(rows)
    has_paper = any(r["paper_f1"] is not None or r["paper_exact_match"] is not None for r in rows)
    beside, source = published(members, runs, "F1 / exact match") if has_paper else (False, [])
    lines = [f"### {table}", "", *what_ran(members, runs), "",
             ("Exact match / F1 (%) of the official definitions on the dev file (`data.dev_file`, named above), after "
              "fine-tuning the "
              f"model of each row (every row: {shared}, global batch {rows[0]['global_batch']}); mean ± standard "
              "deviation over the n runs of a configuration."), "",
             "| Pre-training optimizer |" + (" F1 published | EM published |" if beside else "")
             + " F1 ours | EM ours | configuration | fine-tune time | n |",
             "|---|" + ("---|---|" if beside else "") + "---|---|---|---|---|"]
    for r in rows:
        paper_f1, paper_em = (_published_value(x) for x in (r["paper_f1"], r["paper_exact_match"]))
        lines.append(f"| {r['optimizer']} | " + (f"{paper_f1} | {paper_em} | " if beside else "")
                     + f"{pm(r['f1_stat'])} | {pm(r['exact_match_stat'])} | {r['configuration']} | "
                     f"{r['wall_time_s']:.0f} s | {r['runs']} |")
    lines += source + ([] if beside or not has_paper else paper_markdown(
        rows, "Pre-training optimizer", {"paper_f1": "published F1", "paper_exact_match": "published EM"}))
    if note:
        lines += ["", note.strip()]
    return "\n".join(lines) + "\n"


def pretrain_rows(runs: list[dict]) -> list[dict]:
    """BERT pre-training (one table per phase): one row per optimizer (``paper.row``) and configuration."""
    found = groups(runs)
    label_groups(found)
    rows = []
    for g in found:
        s = [m["summary"] for m in g["runs"]]
        kinds = bytes_by_kind(s)
        rows.append({"optimizer": g["row"], "configuration": g["label"],
                     "loss_stat": stat(x["final_loss"] for x in s),
                     "mlm_acc_stat": stat(x["final_mlm_acc"] for x in s),
                     "nsp_acc_stat": stat(x["final_nsp_acc"] for x in s),
                     "val_mlm_loss_stat": stat(x.get("final_val_mlm_loss") for x in s),
                     "seqs_per_s": stat(x["mean_seqs_per_s"] for x in s)[0],
                     "bytes_per_worker": kinds.get("all", 0),
                     "bytes_by_kind": kinds, "compressed_share": compressed_share(kinds), "runs": len(s),
                     "steps": s[0]["steps"], "seq_len": s[0]["seq_len"], "workers": s[0]["world_size"],
                     "global_batch": s[0]["global_batch"], "params": s[0]["params"], "settings": g["settings"],
                     "members": g["runs"]})
    return add_bytes_vs_lamb(rows)


def pretrain_markdown(table: str, rows: list[dict], runs: list[dict], note: str | None = None) -> str:
    shared = label_groups([{"settings": r["settings"]} for r in rows])
    head = rows[0]
    valid = any(r["val_mlm_loss_stat"][2] for r in rows)
    lines = [f"### {table}", "", *what_ran(_members(rows), runs), "",
             (f"BERT pre-training, seq {head['seq_len']}, global batch {head['global_batch']}, {head['params']:,} "
              f"parameters; every row: {shared}. Loss (MLM + NSP) and accuracies (%) of the last logged period"
              + (", validation MLM loss of the ranks' averaged model on the held-out shards at the last step"
                 if valid else "") + ", mean ± standard deviation over the n runs of a configuration; bytes = "
              "payload each worker handed to the collectives."), "",
             "| Optimizer | loss |" + (" validation MLM loss |" if valid else "")
             + " MLM acc | NSP acc | sequences/s | bytes sent / worker | vs LAMB | configuration | n |",
             "|---|---|" + ("---|" if valid else "") + "---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if math.isnan(r["bytes_vs_lamb"]) else f"{r['bytes_vs_lamb']:.3f}x"
        lines.append(f"| {r['optimizer']} | {pm(r['loss_stat'], 4)} | "
                     + (f"{pm(r['val_mlm_loss_stat'], 4)} | " if valid else "") + f"{pm(r['mlm_acc_stat'])} | "
                     f"{pm(r['nsp_acc_stat'])} | {r['seqs_per_s']:.1f} | {fmt_bytes(r['bytes_per_worker'])} | "
                     f"{ratio} | {r['configuration']} | {r['runs']} |")
    if note:
        lines += ["", note.strip()]
    return "\n".join(lines) + "\n"


# what a rerun elsewhere moves: said on every page whose numbers a user will try to reproduce
RERUN_DRIFT = ("Reruns: on one machine the runs repeat exactly (fixed seeds, gloo, deterministic kernels); on another "
               "CPU they are not bit-identical, since its vector units and thread counts reorder floating-point sums. A "
               "fresh clone on another machine gave the demo's LAMB 97.19 / SLAMB 96.75 where the page of that code said "
               "96.97 / 96.86 (means of three seeds): moves of a few tenths of a point, inside the seeds' spread.")


def _plots(table: str, rows: list[dict], out: Path) -> list[Path]:
    """Accuracy vs epoch and vs bytes: each row's mean over its runs (seeds)."""
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 4))
    several = len({r["optimizer"] for r in rows}) < len(rows)
    for r in rows:
        hists = [m["history"] for m in r["members"] if m["history"]]
        if not hists:
            continue
        length = min(len(h) for h in hists)
        label = r["optimizer"] + (f" ({r['configuration']})" if several else "") + f", n={len(hists)}"
        epochs = [hists[0][i]["epoch"] for i in range(length)]
        top1 = [statistics.fmean(h[i]["test_top1"] for h in hists) for i in range(length)]
        mb = [statistics.fmean(h[i]["bytes_cum/all"] for h in hists) / 1e6 for i in range(length)]
        ax1.plot(epochs, top1, label=label)
        ax2.plot(mb, top1, label=label)
    ax1.set(xlabel="epoch", ylabel="test top-1 (%)", title=f"{table}: accuracy vs epoch (mean over seeds)")
    ax2.set(xlabel="MB sent per worker (cumulative)", ylabel="test top-1 (%)", xscale="symlog",
            title="accuracy vs bytes sent")
    return [save_figure(fig, (ax1, ax2), out / f"{table}_curves.png", legend_size=7)]


def build_tables(runs: list[dict], out) -> dict[str, list[Path]]:
    """Write every table (markdown + CSV) and plot for ``runs`` into ``out``; returns the files by table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    papers, studies, squad, pretrain = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
    for run in runs:
        paper, study = run["config"].get("paper") or {}, run["config"].get("study")
        if study:  # a sweep of any pipeline, before the pipelines' own tables
            phase = f"_phase{paper['phase']}" if "phase" in paper else ""
            studies[f"{paper.get('table', run['config'].get('name'))}{phase}_{study}"].append(run)
        elif paper and "f1" in paper:  # SQuAD fine-tuning runs score EM / F1, not top-1
            squad[paper["table"]].append(run)
        elif paper and "phase" in paper:  # BERT pre-training runs: loss and MLM / NSP accuracy, per phase
            pretrain[f"{paper['table']}_phase{paper['phase']}"].append(run)
        elif paper:
            papers[paper["table"]].append(run)
    for table, members in sorted(papers.items()):
        rows = comparison_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        md.write_text(comparison_markdown(table, rows, runs, note_of(members)))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path, *_plots(table, rows, out)]
    for table, members in sorted(squad.items()):
        rows = squad_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        md.write_text(squad_markdown(table, rows, runs, note_of(members)))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path]
    for table, members in sorted(pretrain.items()):
        rows = pretrain_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        md.write_text(pretrain_markdown(table, rows, runs, note_of(members)))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path]
    for study, members in sorted(studies.items()):
        written[study] = sweep_pages(study, members, runs, out)
    return written
