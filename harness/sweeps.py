"""Sweep pages: the runs of a ``study`` (``configs/sweep/*.yaml``) of any pipeline as a grid of SLAMB's settings.

A beta3 x compression-ratio grid (a heat map, the metric against bytes), or a line of one setting (SLAMB's H: the
metric by H and against bytes), each beside LAMB's runs of the same identity apart from the optimizer block
(:func:`lamb_reference`). The metric is the pipeline's own (:data:`METRICS`: CIFAR-10's and Swin's top-1, BERT's
validation MLM loss, SQuAD's F1). A cell gives the compression ratio its steps actually used and a warning
where the compression warm-up held k above the cell's own for more than a tenth of them.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from pathlib import Path

from .figures import pyplot, save_figure, save_png, wrapped_title
from .records import (configuration, fmt_bytes, groups, label_groups, one_per_seed, pm, recipe, settings_key, stat,
                      to_stderr, what_ran, write_csv)
from .settings import lookup

GRID_KEYS = ("optimizer.beta3", "optimizer.compress_ratio")
LINE_KEYS = {"sync_interval": "optimizer.sync_interval"}  # the one-setting sweeps drawn as a line of cells
WARMUP_WARN = 0.1  # the share of a cell's steps that the compression warm-up may hold k above the cell's own


@dataclasses.dataclass(frozen=True)
class Metric:
    """What a sweep page compares: ``key`` of the runs' summaries, named ``short`` (in sentences) and ``axis`` (on
    plots, in files as ``slug``), better ``higher`` or lower; a cell "stays with LAMB" within ``margin`` ``units``
    of LAMB's mean."""
    key: str
    short: str
    axis: str
    slug: str
    higher: bool
    margin: float
    units: str
    digits: int

    def near(self, value: float, reference: float) -> bool:
        return value >= reference - self.margin if self.higher else value <= reference + self.margin

    def worse_by(self, value: float, reference: float) -> float:
        return reference - value if self.higher else value - reference

    def best(self, cells, mean):
        return (max if self.higher else min)(cells, key=mean.get)

    def within(self) -> str:
        return f"{self.margin:g} {self.units[:-1] if self.margin == 1 else self.units}"


# by pipeline, the first metric every run of a page has: CIFAR-10's and Swin's top-1, SQuAD's F1, BERT's
# validation MLM loss (the paper's BERT metric) or, without held-out shards, its training loss
METRICS = (Metric("final_test_top1", "top-1", "final top-1 (%)", "top1", True, 1.0, "points", 2),
           Metric("f1", "F1", "F1 (%)", "f1", True, 1.0, "points", 2),
           Metric("final_val_mlm_loss", "validation MLM loss", "validation MLM loss", "val_mlm_loss", False, 0.05,
                  "nats", 4),
           Metric("final_loss", "training loss", "training loss (MLM + NSP)", "loss", False, 0.05, "nats", 4))
TOP1 = METRICS[0]


def metric_of(runs: list[dict]) -> Metric:
    """The metric of a page of ``runs``: the first of :data:`METRICS` that each of them logged (finite)."""
    def has(run, key):
        value = run["summary"].get(key)
        return isinstance(value, (int, float)) and math.isfinite(value)

    return next((m for m in METRICS if all(has(r, m.key) for r in runs)), TOP1)


def lamb_same(metric: Metric) -> str:
    return f"LAMB's {metric.short} in the same configuration apart from the optimizer"


def effective_k(run: dict) -> tuple[float, float] | None:
    """(the mean compression ratio over the run's steps, the share of its steps whose k the compression warm-up
    raised above the configured one), from the k each logged period trained at; None where no period logged k."""
    periods = [h for h in run["history"] if "compress_ratio" in h]
    if not periods:
        return None
    target = lookup(run["config"], "optimizer.compress_ratio")
    steps = [h.get("period_steps", 1) for h in periods]
    total = sum(steps)
    raised = sum(n for n, h in zip(steps, periods) if target is not None and h["compress_ratio"] > target)
    return sum(n * h["compress_ratio"] for n, h in zip(steps, periods)) / total, raised / total


def _cell(runs: list[dict], metric: Metric) -> dict:
    """A sweep cell from its runs (seeds): the metric (stat), bytes, effective k and warm-up share (means; None
    where the runs logged no k)."""
    ks = [k for k in map(effective_k, runs) if k is not None]
    return {"runs": runs, "key": metric.key, "value": stat(r["summary"].get(metric.key) for r in runs),
            "bytes": statistics.fmean(r["summary"]["bytes_total"].get("all", 0) for r in runs),
            "k": statistics.fmean(k for k, _ in ks) if ks else None,
            "warmup": statistics.fmean(w for _, w in ks) if ks else None}


def study_grids(runs: list[dict], metric: Metric, keys: tuple[str, ...] = GRID_KEYS) -> list[tuple[str, dict, dict]]:
    """One grid per configuration of the rest: (label, rest settings, {cell: :func:`_cell`}), a cell being the
    tuple of the runs' values of ``keys``, each seed once."""
    by_rest: dict[tuple, list] = defaultdict(list)
    for run in runs:
        rest = {k: v for k, v in configuration(run).items() if k not in keys}
        by_rest[settings_key(rest)].append((rest, run))
    found = [{"settings": members[0][0], "runs": [r for _, r in members]} for members in by_rest.values()]
    label_groups(found)
    out = []
    for g in found:
        cells = defaultdict(list)
        for run in g["runs"]:
            cells[tuple(lookup(run["config"], k) for k in keys)].append(run)
        grid = {cell: _cell(one_per_seed(rs, to_stderr), metric) for cell, rs in cells.items()}
        out.append((g["label"] if len(found) > 1 else "", g["settings"], grid))
    return out


def lamb_reference(runs: list[dict], rest: dict, metric: Metric) -> dict | None:
    """LAMB's runs of the identity ``rest`` apart from the optimizer block (the same model, data by content,
    length, schedule, workers), each seed once, as a cell (:func:`_cell`); where LAMB ran there in several
    configurations of its own, the one with the most seeds."""
    mine = recipe(rest)
    found = groups([r for r in runs if lookup(r["config"], "optimizer.name") == "lamb"
                    and recipe(configuration(r)) == mine], log=None)
    if not found:
        return None
    best = max(found, key=lambda g: len(g["runs"]))  # the groups are sorted: a tie keeps the first
    return _cell(best["runs"], metric)


def warmup_warning(grid: dict) -> list[str]:
    """A warning where the compression warm-up held k above a cell's own for more than WARMUP_WARN of its steps."""
    over = [v["warmup"] for v in grid.values() if v["warmup"] is not None and v["warmup"] > WARMUP_WARN]
    if not over:
        return []
    return ["", f"**Warning**: in {len(over)} of {len(grid)} cells the compression warm-up "
            f"(`optimizer.compression_warmup`) held k above the cell's own for more than {WARMUP_WARN:.0%} of the "
            f"steps (up to {max(over):.0%}): those cells trained at their effective k (the mean k over their steps, "
            "in the table), not at their setting's, and the page cannot tell what k itself changes there. A longer "
            "run, or `optimizer.compression_warmup=null`, measures k."]


def beta3_at_fixed_k(grid: dict) -> tuple[float, int, int, float] | None:
    """An F test of beta3 at a fixed k (its main effect and its interaction with k) against the seeds' spread
    inside the cells: (F, its two degrees of freedom, p), or None where no cell has two different seeds."""
    from scipy.stats import f as f_dist

    values = {c: [r["summary"][v["key"]] for r in v["runs"]] for c, v in grid.items()}
    within = sum((x - statistics.fmean(v)) ** 2 for v in values.values() for x in v)
    df_within = sum(len(v) - 1 for v in values.values())
    between, df_between = 0.0, 0
    for k in sorted({k for _, k in values}):
        cells = [v for (_, k2), v in values.items() if k2 == k]
        pooled = statistics.fmean(x for v in cells for x in v)
        between += sum(len(v) * (statistics.fmean(v) - pooled) ** 2 for v in cells)
        df_between += len(cells) - 1
    if not (df_within and df_between and within > 0):
        return None
    f = (between / df_between) / (within / df_within)
    return f, df_between, df_within, float(f_dist.sf(f, df_between, df_within))


def grid_findings(grid: dict, lamb: dict | None, metric: Metric) -> str:
    """Sentences computed from a beta3 x k grid: where SLAMB stays within the metric's margin of LAMB and at what
    bytes, and whether the authors' advice (fix k, tune beta3) holds here."""
    betas, ks = sorted({b for b, _ in grid}), sorted({k for _, k in grid})
    mean = {c: v["value"][0] for c, v in grid.items()}
    sds = [v["value"][1] for v in grid.values() if v["value"][2] > 1]
    noise = statistics.fmean(sds) if sds else math.nan
    d, units = metric.digits, metric.units
    out = []
    if lamb is not None:
        ref = lamb["value"]
        near = sorted((c for c in grid if metric.near(mean[c], ref[0])), key=lambda c: grid[c]["bytes"])
        head = f"{lamb_same(metric)}: {pm(ref, d)} (n = {ref[2]}). "
        if near:
            cheapest = near[0]
            out.append(head + f"Within {metric.within()} of it: {len(near)} of {len(grid)} cells ("
                       + ", ".join(f"beta3 {b}, k {k}" for b, k in near) + f"); the cheapest is beta3 {cheapest[0]}, "
                       f"k {cheapest[1]} at {fmt_bytes(grid[cheapest]['bytes'])} per worker.")
        else:
            best = metric.best(grid, mean)
            out.append(head + f"No cell is within {metric.within()} of it; the best is beta3 {best[0]}, k {best[1]} "
                       f"({mean[best]:.{d}f}, {metric.worse_by(mean[best], ref[0]):.{d}f} {units} worse).")
    if len(betas) > 1 and len(ks) > 1:
        def spread(cells):
            values = [mean[c] for c in cells if c in mean]
            return max(values) - min(values)

        across_b = [spread([(b, k) for b in betas]) for k in ks]
        across_k = [spread([(b, k) for k in ks]) for b in betas]
        best_b = {k: metric.best([(b, k) for b in betas if (b, k) in mean], mean)[0] for k in ks}
        test = beta3_at_fixed_k(grid)
        if test is None:
            advice = "One seed per cell (or no spread between seeds): nothing to judge the authors' advice against."
        else:
            f, df1, df2, p = test
            measured = f"(F = {f:.2f} on {df1} and {df2} degrees of freedom, p = {p:.3f})"
            advice = (f"The authors' advice, fix k and tune beta3, holds here: at a fixed k, beta3 changes the "
                      f"{metric.short} beyond the seeds' spread {measured}." if p < 0.05 else
                      "Whether tuning beta3 at a fixed k pays, as the authors advise, is not decided here: at a fixed "
                      f"k, beta3's differences are within what the seeds' spread gives by chance {measured}.")
        out.append(f"At a fixed k, beta3 moves the {metric.short} by {statistics.fmean(across_b):.{d}f} {units} on "
                   f"average (largest {max(across_b):.{d}f}); at a fixed beta3, k moves it by "
                   f"{statistics.fmean(across_k):.{d}f} (largest {max(across_k):.{d}f}); a cell's seeds spread by "
                   f"{noise:.{d}f} (mean sd). The best beta3 per k: "
                   + ", ".join(f"k {k}: {b}" for k, b in best_b.items()) + ". " + advice)
    return " ".join(out)


def _k(cell: dict) -> str:
    """A cell's effective k and, where the warm-up raised it, the share of the steps it did."""
    if cell["k"] is None:
        return "-"
    return f"{cell['k']:.3g}" + (f" ({cell['warmup']:.0%} raised)" if cell["warmup"] else "")


def _sweep_members(grid: dict) -> list[dict]:
    return [r for cell in grid.values() for r in cell["runs"]]


def _sweep_csv(grid: dict, keys: tuple[str, ...], metric: Metric, path: Path) -> None:
    write_csv([{**{k.rsplit(".", 1)[-1]: v for k, v in zip(keys, cell)}, metric.slug: c["value"][0],
                f"{metric.slug}_std": c["value"][1], "n": c["value"][2], "bytes": c["bytes"], "effective_k": c["k"],
                "warmup_share": c["warmup"]} for cell, c in sorted(grid.items())], path)


EFFECTIVE_K = ("Effective k: the mean over a cell's steps of the compression ratio each step used (SLAMB's compression "
               "warm-up raises it early in a run), mean over the cell's runs; in brackets the share of the steps whose "
               "k the warm-up raised above the cell's own.")


def line_section(name: str, key: str, runs: list[dict], all_runs: list[dict], out: Path) -> list[Path]:
    """A one-setting sweep (e.g. SLAMB's H): a row per value with the metric, bytes, the effective k and whether it
    stays with LAMB; its plots."""
    written, metric = [], metric_of(runs)
    d = metric.digits
    for i, (label, rest, grid) in enumerate(study_grids(runs, metric, (key,))):
        page = name if i == 0 else f"{name}_{i + 1}"
        lamb = lamb_reference(all_runs, rest, metric)
        short = key.rsplit(".", 1)[-1]
        lines = [f"### {page}", "", *what_ran(_sweep_members(grid), all_runs), "",
                 f"The {metric.axis} of the averaged model by {short}, mean ± standard deviation over the n runs of a "
                 "value; bytes each worker sent over the run" + (f"; configuration: {label}" if label else "") + ". "
                 + EFFECTIVE_K, "",
                 f"| {short} | {metric.short} | n | bytes / worker | effective k |"
                 + (f" within {metric.within()} of LAMB |" if lamb else ""),
                 "|---|---|---|---|---|" + ("---|" if lamb else "")]
        for (v,), cell in sorted(grid.items()):
            ok = "" if lamb is None else (" yes |" if metric.near(cell["value"][0], lamb["value"][0]) else " no |")
            lines.append(f"| {v} | {pm(cell['value'], d)} | {cell['value'][2]} | {fmt_bytes(cell['bytes'])} | "
                         f"{_k(cell)} |{ok}")
        if lamb:
            lines += ["", f"{lamb_same(metric)}: {pm(lamb['value'], d)} (n = {lamb['value'][2]}) at "
                      f"{fmt_bytes(lamb['bytes'])} per worker."]
        lines += warmup_warning(grid)
        fig = sweep_figure(page, grid, lamb, metric, short)
        plots = [save_figure(fig, fig.axes, out / f"{page}_{metric.slug}.png", legend_size=7)]
        lines += ["", f"![{metric.short} by {short} and against bytes]({plots[0].name})"]
        md, csv_path = out / f"{page}.md", out / f"{page}.csv"
        md.write_text("\n".join(lines) + "\n")
        _sweep_csv(grid, (key,), metric, csv_path)
        written += [md, csv_path, *plots]
    return written


def grid_section(name: str, runs: list[dict], all_runs: list[dict], out: Path) -> list[Path]:
    """SLAMB's beta3 x k grid: the metric, bytes and effective k by cell, where it stays with LAMB; heat maps and
    the metric against bytes."""
    written, metric = [], metric_of(runs)
    grids = study_grids(runs, metric)
    for i, (label, rest, grid) in enumerate(grids):
        page = name if len(grids) == 1 else f"{name}_{i + 1}"
        betas, ks = sorted({b for b, _ in grid}), sorted({k for _, k in grid})
        lamb = lamb_reference(all_runs, rest, metric)
        header = ["| beta3 \\ k | " + " | ".join(str(k) for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]

        def table(show) -> list[str]:
            return header + [f"| {b} | " + " | ".join(show(grid[(b, k)]) if (b, k) in grid else "-" for k in ks)
                             + " |" for b in betas]

        lines = [f"### {page}", "", *what_ran(_sweep_members(grid), all_runs), "",
                 f"The {metric.axis} by beta3 (rows) and compression ratio k (columns), mean ± standard deviation "
                 "over the n runs of a cell (n in brackets)" + (f"; configuration: {label}" if label else "") + ".", "",
                 *table(lambda c: f"{pm(c['value'], metric.digits)} ({c['value'][2]})"),
                 "", "Bytes each worker sent over the run, mean over the cell's runs:", "",
                 *table(lambda c: fmt_bytes(c["bytes"])),
                 "", EFFECTIVE_K, "", *table(_k), *warmup_warning(grid),
                 "", grid_findings(grid, lamb, metric)]
        fig = sweep_figure(page, grid, lamb, metric)
        plots = [save_png(heatmap_figure(page, betas, ks, grid, metric), out / f"{page}_heatmap.png"),
                 save_png(heatmap_figure(page, betas, ks, grid), out / f"{page}_bytes_heatmap.png"),
                 save_figure(fig, fig.axes, out / f"{page}_{metric.slug}_vs_bytes.png", legend_size=7)]
        lines += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
        md, csv_path = out / f"{page}.md", out / f"{page}.csv"
        md.write_text("\n".join(lines) + "\n")
        _sweep_csv(grid, GRID_KEYS, metric, csv_path)
        written += [md, csv_path, *plots]
    return written


def sweep_pages(name: str, runs: list[dict], all_runs: list[dict], out: Path) -> list[Path]:
    """The pages of study ``name`` (its runs: ``runs``; LAMB's references are looked up in ``all_runs``)."""
    kind = runs[0]["config"].get("study")
    if kind in LINE_KEYS:
        return line_section(name, LINE_KEYS[kind], runs, all_runs, out)
    return grid_section(name, runs, all_runs, out)


def heatmap_figure(name: str, betas, ks, grid, metric: Metric | None = None):
    """A beta3 x k heat map of the cells' metric (``metric=None``: MB per worker), each cell's value written on it."""
    import numpy as np

    plt = pyplot()

    def value(cell):
        return cell["value"][0] if metric else cell["bytes"] / 1e6

    values = np.array([[value(grid[(b, k)]) if (b, k) in grid else np.nan for k in ks] for b in betas])
    width = max(4.5, 1.8 + 1.0 * len(ks))  # room for the colour bar, the labels and the title on any grid
    fig, ax = plt.subplots(figsize=(width, max(3.2, 1.6 + 0.6 * len(betas))))
    im = ax.imshow(values, cmap="viridis" if metric is None or metric.higher else "viridis_r", aspect="auto")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks], fontsize=8)
    ax.set_yticks(range(len(betas)), [str(b) for b in betas], fontsize=8)
    ax.set_xlabel("compression ratio k", fontsize=9)
    ax.set_ylabel("beta3", fontsize=9)
    wrapped_title(ax, name, metric.axis if metric else "MB sent per worker", width)
    shown = 1 if metric is None or metric.digits <= 2 else 3
    for i in range(len(betas)):
        for j in range(len(ks)):
            if not np.isnan(values[i, j]):  # dark text on the light end of the colour map
                ax.text(j, i, f"{values[i, j]:.{shown}f}", ha="center", va="center", fontsize=8,
                        color="black" if im.norm(values[i, j]) > 0.6 else "white")
    fig.colorbar(im).ax.tick_params(labelsize=8)
    return fig


def sweep_figure(name: str, grid: dict, lamb: dict | None, metric: Metric = TOP1, setting: str | None = None):
    """The metric (mean ± sd over the seeds) against MB sent per worker, a point per cell, LAMB's beside them; for a
    one-setting sweep also the metric by that ``setting`` (a log axis: H is swept in multiples)."""
    plt = pyplot()
    panels = 2 if setting else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.0 * panels, 4.0), squeeze=False)
    axes = list(axes[0])
    cells = sorted(grid.items())
    values = [c["value"] for _, c in cells]
    err = [0.0 if math.isnan(s[1]) else s[1] for s in values]

    def reference(ax):
        if lamb is not None:
            ref = lamb["value"][0]
            ax.axhline(ref, color="k", lw=1, label=f"LAMB ({pm(lamb['value'], metric.digits)}, n={lamb['value'][2]})")
            ax.axhline(ref - metric.margin if metric.higher else ref + metric.margin, color="k", lw=1, ls=":",
                       label=f"LAMB {'-' if metric.higher else '+'} {metric.within()}")

    if setting:
        ax = axes.pop(0)
        xs = [cell[0] for cell, _ in cells]
        ax.errorbar(xs, [s[0] for s in values], yerr=err, marker="o", capsize=3, label="SLAMB")
        reference(ax)
        ax.set_xscale("log")
        ax.set_xticks(xs, [str(v) for v in xs])
        ax.minorticks_off()
        ax.set_xlabel(setting, fontsize=9)
        ax.set_ylabel(metric.axis, fontsize=9)
        wrapped_title(ax, name, f"{metric.short} by {setting}", 5.0)
    ax = axes[0]
    mb = [c["bytes"] / 1e6 for _, c in cells]
    ax.errorbar(mb, [s[0] for s in values], yerr=err, fmt="o", capsize=3, label="SLAMB cells")
    for (cell, _), x, y in zip(cells, mb, (s[0] for s in values)):
        ax.annotate(setting + f" {cell[0]}" if setting else f"b3 {cell[0]}, k {cell[1]}", (x, y), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    if lamb is not None:
        ax.plot([lamb["bytes"] / 1e6], [lamb["value"][0]], "ks")
    reference(ax)
    ax.set_xlabel("MB sent per worker over the run", fontsize=9)
    ax.set_ylabel(metric.axis, fontsize=9)
    wrapped_title(ax, name, f"{metric.short} against bytes", 5.0)
    for ax in fig.axes:
        ax.tick_params(labelsize=8)
    return fig
