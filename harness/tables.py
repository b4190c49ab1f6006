"""Results tables and plots from run directories (``scripts/make_tables.py``, the demo).

A run directory holds ``config.yaml``, ``meta.json``, ``metrics.jsonl`` and
``metrics.json`` (see :mod:`.run`). Runs whose config names a ``paper: {table,
row, ...}`` entry form the comparison tables, one per ``paper.table``, one row
per optimizer row and configuration.

Runs are grouped by their full effective configuration: every setting except
the seed, the operational ones (:data:`harness.settings.OPERATIONAL_KEYS`: progress
bar, resume, restarts, threads, device, checkpointing, logger, loader workers,
the ``paper``/``study`` labels) and where the data lives (:data:`DATA_PATH_KEYS`:
the same data set in another folder is the same experiment; the model a run
starts from, ``model.dir`` / ``init_from``, is not a location but a setting).
The world size comes from the run's summary. Runs of one group are seeds, each
seed counted once (a second run of a seed repeats the first's computation): each
cell gives their mean ± standard deviation (n - 1) and the row the number of
runs; groups are never averaged together. A row names its configuration: the
optimizer settings that differ from the optimizer's defaults, and any other
setting that differs between the groups of its table; the settings all rows
share are stated above the table.

Every page says what ran, from the runs' own records: model, data set, workers,
epochs or steps, precision, hardware and commit (:func:`what_ran`). Published
numbers (``paper.top1``, ``paper.f1``) stand beside ours only where every run
has the published setting (``paper.setting``, :func:`in_paper_setting`); otherwise
the page says so in one line and gives them apart, under their source
(``paper.source``). Runs of a ``study`` (the sweeps) form one grid per study:
final top-1 by SLAMB's beta3 x compression ratio (a heat map, top-1 against
bytes), or a line of one setting (SLAMB's H: top-1 by H and against bytes),
each beside LAMB's runs of the same configuration apart from the optimizer; a
cell gives the compression ratio its steps actually used and a warning where
the compression warm-up held k above the cell's own for more than a tenth of
them. A run whose summary is NaN or that trained no epoch or step is left out,
with a message.
"""
from __future__ import annotations

import csv
import inspect
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from slamb.comm import MOMENTUM, MOMENTUM_DENSE
from .run import read_jsonl
from .settings import INPUT_KEYS, effective_config, flatten, lookup

ROW_ORDER = ("SGD-M", "AdamW", "LAMB", "1-bit LAMB", "DGC", "JointSpar", "JointSpar-LARS", "SLAMB")
DATA_PATH_KEYS = tuple(k for k in INPUT_KEYS if k.startswith("data."))
# settings that a row's configuration label leaves out: they name the row already, or vary with it
LABEL_SKIP = ("name", "optimizer.name")
# the metric that says whether a run produced anything, by kind of summary
HEADLINE = ("final_test_top1", "f1", "final_loss")


def _excluded(summary: dict) -> str | None:
    """Why a summary cannot enter a table, or None."""
    for key in ("epochs", "steps"):
        if isinstance(summary.get(key), (int, float)) and summary[key] < 1:
            return f"{key} = {summary[key]} (trained nothing)"
    for key in HEADLINE:
        value = summary.get(key)
        if (key in summary and value is None) or (isinstance(value, float) and math.isnan(value)):
            return f"{key} is NaN"
    return None


def load_runs(root, log=None) -> list[dict]:
    """Every finished run (a ``metrics.json``) under ``root``; unusable ones are left out with a message."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    runs = []
    for summary_path in sorted(Path(root).rglob("metrics.json")):
        folder = summary_path.parent
        summary = json.loads(summary_path.read_text())
        why = _excluded(summary)
        if why:
            log(f"left out of the tables: {folder}: {why}")
            continue
        config = yaml.safe_load((folder / "config.yaml").read_text()) if (folder / "config.yaml").exists() else {}
        meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").exists() else {}
        history = read_jsonl(folder / "metrics.jsonl", notice=log)
        runs.append({"dir": folder, "summary": summary, "config": config, "meta": meta, "history": history})
    return runs


# ------------------------------------------------------------------------------------- groups


def configuration(run: dict) -> dict:
    """The settings that define what ``run`` computed, less the seed (its group key, flattened)."""
    settings = effective_config(run["config"], drop=("seed", "trainer.nproc_per_node", *DATA_PATH_KEYS))
    settings["workers"] = run["summary"].get("world_size")
    return settings


def _key(settings: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.items()))


def one_per_seed(runs: list[dict], log=None) -> list[dict]:
    """``runs`` of one configuration with each seed once, the first found: a second run of a seed computed the
    same thing again, and counting it would narrow the spread (two copies of seed 0: "± 0.00"). ``log`` is
    told of each one left out."""
    seen, out = {}, []
    for run in runs:
        seed = run["config"].get("seed")
        if seed in seen:
            if log:
                log(f"left out of the tables: {run['dir']}: seed {seed} of its configuration is counted once, "
                    f"from {seen[seed]}")
            continue
        seen[seed] = run["dir"]
        out.append(run)
    return out


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def groups(runs: list[dict], log=_stderr) -> list[dict]:
    """``[{"row", "settings", "runs"}]``: runs of one ``paper.row`` and one configuration, each seed once, in
    the paper's order."""
    found: dict[tuple, dict] = {}
    for run in runs:
        row = (run["config"].get("paper") or {}).get("row") or run["config"].get("name", "?")
        settings = configuration(run)
        found.setdefault((row, _key(settings)), {"row": row, "settings": settings, "runs": []})["runs"].append(run)
    for g in found.values():
        g["runs"] = one_per_seed(g["runs"], log)
    order = {name: i for i, name in enumerate(ROW_ORDER)}
    return sorted(found.values(), key=lambda g: (order.get(g["row"], len(order)), g["row"], _key(g["settings"])))


def optimizer_defaults(name: str) -> dict:
    """The keyword defaults of optimizer ``name``'s constructor ({} for an unknown name)."""
    from slamb import registry

    try:
        params = inspect.signature(registry.optimizer_class(name).__init__).parameters
    except ValueError:
        return {}
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)


def label_groups(found: list[dict]) -> str:
    """Set each group's ``label`` (its configuration); returns the settings every group shares, as text."""
    common = {k: v for k, v in found[0]["settings"].items()
              if all(k in g["settings"] and g["settings"][k] == v for g in found)}
    for g in found:
        s = g["settings"]
        defaults = optimizer_defaults(s.get("optimizer.name", ""))
        parts = []
        for key, value in sorted(s.items()):
            if key in LABEL_SKIP:
                continue
            if key.startswith("optimizer."):
                short = key[len("optimizer."):]
                if short in defaults and _same(value, defaults[short]):
                    continue  # the optimizer's own default: nothing to name
                parts.append(f"{short}={_value(value)}")
            elif key not in common:
                parts.append(f"{key}={_value(value)}")
        g["label"] = ", ".join(parts) or "defaults"
    shown = [("workers", "workers"), ("epochs", "epochs"), ("steps", "steps"),
             ("data.micro_batch", "per-worker batch")]
    return ", ".join(f"{name} {_value(common[k])}" for k, name in shown if k in common)


def stat(values) -> tuple[float, float, int]:
    """(mean, sample standard deviation or NaN for one value, n) of the non-missing values."""
    xs = [float(x) for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return math.nan, math.nan, 0
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else math.nan, len(xs)


def pm(s: tuple[float, float, int], digits: int = 2) -> str:
    """``mean ± std`` (just the mean for one run, ``-`` for none)."""
    mean, std, n = s
    if n == 0:
        return "-"
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000.0
    return f"{n:.3g} TB"


def _last(run: dict, key: str):
    return run["history"][-1].get(key) if run["history"] else None


# ------------------------------------------------------------------------------------- what ran

# the settings that say which model a config builds, in the order they are named
SHAPE_KEYS = ("arch", "depth", "width", "img_size", "embed_dim", "depths", "num_heads", "num_hidden_layers",
              "hidden_size", "num_attention_heads", "intermediate_size")


def pretrained_run(run: dict, runs: list[dict]) -> dict | None:
    """The run among ``runs`` that saved the model ``run`` fine-tunes (its ``model.dir`` is that run's
    ``model/``), or None."""
    where = lookup(run["config"], "model.dir")
    if not where:
        return None
    target = Path(where).resolve()
    return next((r for r in runs if (Path(r["dir"]) / "model").resolve() == target), None)


def model_name(run: dict, runs: list[dict]) -> str:
    """The model a run trained, from its config: the model's name and its shape settings; a fine-tuning run's is
    the model it started from (named by the run that saved it, where that run is among ``runs``)."""
    model = run["config"].get("model") or {}
    if "name" not in model and "dir" in model:
        source = pretrained_run(run, runs)
        return f"the model in {model['dir']}" + (f" ({model_name(source, runs)})" if source else "")
    shape = ", ".join(f"{k} {_value(model[k])}" for k in SHAPE_KEYS if k in model)
    return str(model.get("name", "not recorded")) + (f" ({shape})" if shape else "")


def data_name(config: dict) -> str:
    data = config.get("data") or {}
    if "name" in data:
        return str(data["name"])
    shards = f"the shards in {data['dir']}" if "dir" in data else "not recorded"
    return shards + (f" (seq {data['seq_len']})" if "seq_len" in data else "")


def _length(summary: dict) -> str:
    if "epochs" in summary:
        return f"{summary['epochs']} epochs" + (f" ({summary['steps']} steps)" if "steps" in summary else "")
    return f"{summary['steps']} steps" if "steps" in summary else "not recorded"


def _commit(meta: dict) -> str:
    git = meta.get("git") or {}
    commit = git.get("commit")
    if not commit:
        return "not recorded"
    return commit[:10] + (" with uncommitted changes" if git.get("dirty") else "")


def _hardware(meta: dict) -> str:
    if "hardware" in meta:
        return meta["hardware"]
    return f"{meta['device']} (model not recorded)" if "device" in meta else "not recorded"


def _tally(values: list[str]) -> str:
    """One value, or each distinct value with its number of runs."""
    counts = {v: values.count(v) for v in dict.fromkeys(values)}
    if len(counts) == 1:
        return values[0]
    return "; ".join(f"{v} ({n} run{'s' if n > 1 else ''})" for v, n in counts.items())


def what_ran(members: list[dict], runs: list[dict]) -> list[str]:
    """The page's account of what its runs did, from their recorded config, summary and metadata (``runs``: all
    runs found, where a fine-tuning run's model was saved)."""
    facts = {
        "model": [model_name(r, runs) for r in members],
        "data": [data_name(r["config"]) for r in members],
        "workers": [str(r["summary"].get("world_size", "not recorded")) for r in members],
        "length": [_length(r["summary"]) for r in members],
        "precision": [str(lookup(r["config"], "trainer.precision", "not recorded")) for r in members],
        "hardware": [_hardware(r.get("meta", {})) for r in members],
        "commit": [_commit(r.get("meta", {})) for r in members],
    }
    return ([f"What ran ({len(members)} runs, from their recorded config and metadata):", ""]
            + [f"- {name}: {_tally(values)}" for name, values in facts.items()])


def in_paper_setting(members: list[dict], runs: list[dict]) -> bool:
    """Whether every run has the setting of the published numbers: each setting of ``paper.setting`` (nested as
    the config; under ``pretrained``: of the run that saved the model it fine-tunes) has the run's value. No
    ``paper.setting``, no claim: False."""
    for run in members:
        setting = flatten((run["config"].get("paper") or {}).get("setting") or {})
        if not setting:
            return False
        source = pretrained_run(run, runs)
        for key, want in setting.items():
            config = run["config"]
            if key.startswith("pretrained."):
                config, key = (source["config"] if source else {}), key[len("pretrained."):]
            if lookup(config, key) != want:
                return False
    return True


def published(members: list[dict], runs: list[dict], what: str) -> tuple[bool, list[str]]:
    """(beside, lines): whether the published numbers stand beside ours, and the lines that give their source
    (and, where the runs are not in their setting, say so)."""
    source = next((m["config"]["paper"]["source"] for m in members
                   if (m["config"].get("paper") or {}).get("source")), "not recorded")
    if in_paper_setting(members, runs):
        return True, ["", f"Published {what} (the column beside ours), from {source}."]
    models = _tally([model_name(m, runs) for m in members])
    data = _tally([data_name(m["config"]) for m in members])
    return False, ["", f"Not the paper's setting: these runs trained {models} on {data}, so the published {what} "
                   f"stand apart below, for reference only. Their source: {source}."]


def recipe(settings: dict) -> tuple:
    """A configuration apart from its optimizer block and name (a group key): LAMB's reference for a sweep cell
    shares all of it (model, data, length, schedule, precision, workers, ...)."""
    return _key({k: v for k, v in settings.items() if k != "name" and not k.startswith("optimizer.")})


def volume(settings: dict) -> tuple:
    """The settings that fix how much a run communicates apart from its optimizer (model, data, length, workers):
    a row's bytes compare with LAMB's where these agree, whatever else (schedule, clipping) differs."""
    return _key({k: v for k, v in settings.items()
                 if k in ("epochs", "steps", "workers") or k.startswith(("model.", "data."))})


def add_bytes_vs_lamb(rows: list[dict]) -> list[dict]:
    """Each row's bytes over those of the LAMB row with the same model, data, length and workers."""
    lamb = {volume(r["settings"]): r["bytes_per_worker"] for r in rows if r["optimizer"] == "LAMB"}
    for r in rows:
        ref = lamb.get(volume(r["settings"]))
        r["bytes_vs_lamb"] = r["bytes_per_worker"] / ref if ref else math.nan
    return rows


def _flat(prefix: str, s: tuple[float, float, int]) -> dict:
    return {prefix: s[0], f"{prefix}_std": s[1]}


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
            "top1_local_stat": stat(_last(m, "test_top1_local") for m in members),
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


CSV_SKIP = ("settings", "members", "bytes_by_kind")


def compressed_share(kinds: dict) -> float | None:
    """The part of SLAMB's momentum bytes that were sampled entries, as the ledger measured them: kind
    ``momentum`` over it and ``momentum_dense`` (the always-averaged tensors); None where neither was sent."""
    sampled, dense = kinds.get(MOMENTUM, 0), kinds.get(MOMENTUM_DENSE, 0)
    return sampled / (sampled + dense) if sampled + dense else None


def bytes_by_kind(summaries: list[dict]) -> dict[str, float]:
    """The runs' mean bytes per worker by the ledger's kinds (``all`` included)."""
    return {k: stat(x["bytes_total"].get(k, 0) for x in summaries)[0]
            for k in sorted({k for x in summaries for k in x["bytes_total"]})}


def write_csv(rows: list[dict], path: Path) -> None:
    flat = []
    for r in rows:
        out = {}
        for k, v in r.items():
            if k in CSV_SKIP:
                continue
            if k.endswith("_stat"):
                out.update(_flat(k[:-len("_stat")], v))
                out[f"{k[:-len('_stat')]}_n"] = v[2]
            else:
                out[k] = v
        for kind, b in r.get("bytes_by_kind", {}).items():
            out[f"bytes/{kind}"] = b
        flat.append(out)
    fields = list(dict.fromkeys(k for r in flat for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(flat)


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
             + " best top-1 | bytes sent / worker | vs LAMB | wall time | n |",
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
    data = _tally([data_name(m["config"]) for m in members])
    lines = [f"### {table}", "", *what_ran(members, runs), "",
             (f"Exact match / F1 (%) of the official definitions on the dev set of {data}, after fine-tuning the "
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
GRID_KEYS = ("optimizer.beta3", "optimizer.compress_ratio")
LINE_KEYS = {"sync_interval": "optimizer.sync_interval"}  # the one-setting sweeps drawn as a line of cells
WITHIN = 1.0  # points of top-1: a setting "stays with LAMB" within this
LAMB_SAME = "LAMB's top-1 in the same configuration apart from the optimizer"
WARMUP_WARN = 0.1  # the share of a cell's steps that the compression warm-up may hold k above the cell's own


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


def _cell(runs: list[dict]) -> dict:
    """A sweep cell from its runs (seeds): top-1 (stat), bytes, effective k and warm-up share (means; None where
    the runs logged no k)."""
    ks = [k for k in map(effective_k, runs) if k is not None]
    return {"runs": runs, "top1": stat(r["summary"]["final_test_top1"] for r in runs),
            "bytes": statistics.fmean(r["summary"]["bytes_total"].get("all", 0) for r in runs),
            "k": statistics.fmean(k for k, _ in ks) if ks else None,
            "warmup": statistics.fmean(w for _, w in ks) if ks else None}


def study_grids(runs: list[dict], keys: tuple[str, ...] = GRID_KEYS) -> list[tuple[str, dict, dict]]:
    """One grid per configuration of the rest: (label, rest settings, {cell: :func:`_cell`}), a cell being the
    tuple of the runs' values of ``keys``, each seed once."""
    by_rest: dict[tuple, list] = defaultdict(list)
    for run in runs:
        rest = {k: v for k, v in configuration(run).items() if k not in keys}
        by_rest[_key(rest)].append((rest, run))
    found = [{"settings": members[0][0], "runs": [r for _, r in members]} for members in by_rest.values()]
    label_groups(found)
    out = []
    for g in found:
        cells = defaultdict(list)
        for run in g["runs"]:
            cells[tuple(lookup(run["config"], k) for k in keys)].append(run)
        grid = {cell: _cell(one_per_seed(rs, _stderr)) for cell, rs in cells.items()}
        out.append((g["label"] if len(found) > 1 else "", g["settings"], grid))
    return out


def lamb_reference(runs: list[dict], rest: dict) -> dict | None:
    """LAMB's runs in the configuration of ``rest`` apart from the optimizer block, each seed once, as
    ``{"top1": stat, "bytes": mean}``; where LAMB ran there in several configurations of its own, the one with
    the most seeds."""
    mine = recipe(rest)
    found = groups([r for r in runs if lookup(r["config"], "optimizer.name") == "lamb"
                    and recipe(configuration(r)) == mine], log=None)
    if not found:
        return None
    best = max(found, key=lambda g: len(g["runs"]))  # the groups are sorted: a tie keeps the first
    return _cell(best["runs"])


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

    values = {c: [r["summary"]["final_test_top1"] for r in v["runs"]] for c, v in grid.items()}
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


def grid_findings(grid: dict, lamb: dict | None) -> str:
    """Sentences computed from a beta3 x k grid: where SLAMB stays within WITHIN points of LAMB and at what
    bytes, and whether the authors' advice (fix k, tune beta3) holds here."""
    betas, ks = sorted({b for b, _ in grid}), sorted({k for _, k in grid})
    mean = {c: v["top1"][0] for c, v in grid.items()}
    sds = [v["top1"][1] for v in grid.values() if v["top1"][2] > 1]
    noise = statistics.fmean(sds) if sds else math.nan
    out = []
    if lamb is not None:
        ref = lamb["top1"]
        near = sorted((c for c in grid if mean[c] >= ref[0] - WITHIN), key=lambda c: grid[c]["bytes"])
        head = f"{LAMB_SAME}: {pm(ref)} (n = {ref[2]}). "
        if near:
            cheapest = near[0]
            out.append(head + f"Within {WITHIN:g} point of it: {len(near)} of {len(grid)} cells ("
                       + ", ".join(f"beta3 {b}, k {k}" for b, k in near) + f"); the cheapest is beta3 {cheapest[0]}, "
                       f"k {cheapest[1]} at {fmt_bytes(grid[cheapest]['bytes'])} per worker.")
        else:
            best = max(grid, key=mean.get)
            out.append(head + f"No cell is within {WITHIN:g} point of it; the best is beta3 {best[0]}, k {best[1]} "
                       f"({mean[best]:.2f}, {ref[0] - mean[best]:.2f} points below).")
    if len(betas) > 1 and len(ks) > 1:
        across_b = [max(mean[(b, k)] for b in betas if (b, k) in mean) - min(mean[(b, k)] for b in betas if (b, k) in mean)
                    for k in ks]
        across_k = [max(mean[(b, k)] for k in ks if (b, k) in mean) - min(mean[(b, k)] for k in ks if (b, k) in mean)
                    for b in betas]
        best_b = {k: max((b for b in betas if (b, k) in mean), key=lambda b: mean[(b, k)]) for k in ks}
        test = beta3_at_fixed_k(grid)
        if test is None:
            advice = "One seed per cell (or no spread between seeds): nothing to judge the authors' advice against."
        else:
            f, df1, df2, p = test
            measured = f"(F = {f:.2f} on {df1} and {df2} degrees of freedom, p = {p:.3f})"
            advice = (f"The authors' advice, fix k and tune beta3, holds here: at a fixed k, beta3 changes the top-1 "
                      f"beyond the seeds' spread {measured}." if p < 0.05 else
                      "Whether tuning beta3 at a fixed k pays, as the authors advise, is not decided here: at a fixed "
                      f"k, beta3's differences are within what the seeds' spread gives by chance {measured}.")
        out.append(f"At a fixed k, beta3 moves the top-1 by {statistics.fmean(across_b):.2f} points on average (largest "
                   f"{max(across_b):.2f}); at a fixed beta3, k moves it by {statistics.fmean(across_k):.2f} (largest "
                   f"{max(across_k):.2f}); a cell's seeds spread by {noise:.2f} (mean sd). The best beta3 per k: "
                   + ", ".join(f"k {k}: {b}" for k, b in best_b.items()) + ". " + advice)
    return " ".join(out)


def _k(cell: dict) -> str:
    """A cell's effective k and, where the warm-up raised it, the share of the steps it did."""
    if cell["k"] is None:
        return "-"
    return f"{cell['k']:.3g}" + (f" ({cell['warmup']:.0%} raised)" if cell["warmup"] else "")


def _sweep_members(grid: dict) -> list[dict]:
    return [r for cell in grid.values() for r in cell["runs"]]


def _sweep_csv(grid: dict, keys: tuple[str, ...], path: Path) -> None:
    write_csv([{**{k.rsplit(".", 1)[-1]: v for k, v in zip(keys, cell)}, "top1": c["top1"][0],
                "top1_std": c["top1"][1], "n": c["top1"][2], "bytes": c["bytes"], "effective_k": c["k"],
                "warmup_share": c["warmup"]} for cell, c in sorted(grid.items())], path)


EFFECTIVE_K = ("Effective k: the mean over a cell's steps of the compression ratio each step used (SLAMB's compression "
               "warm-up raises it early in a run), mean over the cell's runs; in brackets the share of the steps whose "
               "k the warm-up raised above the cell's own.")


def line_section(name: str, key: str, runs: list[dict], all_runs: list[dict], out: Path) -> list[Path]:
    """A one-setting sweep (e.g. SLAMB's H): a row per value with top-1, bytes, the effective k and whether it
    stays with LAMB; its plots."""
    written = []
    for i, (label, rest, grid) in enumerate(study_grids(runs, (key,))):
        page = name if i == 0 else f"{name}_{i + 1}"
        lamb = lamb_reference(all_runs, rest)
        short = key.rsplit(".", 1)[-1]
        lines = [f"### {page}", "", *what_ran(_sweep_members(grid), all_runs), "",
                 f"Final top-1 (%) of the averaged model by {short}, mean ± standard deviation over the n runs of a "
                 "value; bytes each worker sent over the run" + (f"; configuration: {label}" if label else "") + ". "
                 + EFFECTIVE_K, "",
                 f"| {short} | top-1 | n | bytes / worker | effective k |"
                 + (" within 1 point of LAMB |" if lamb else ""),
                 "|---|---|---|---|---|" + ("---|" if lamb else "")]
        for (v,), cell in sorted(grid.items()):
            ok = "" if lamb is None else (" yes |" if cell["top1"][0] >= lamb["top1"][0] - WITHIN else " no |")
            lines.append(f"| {v} | {pm(cell['top1'])} | {cell['top1'][2]} | {fmt_bytes(cell['bytes'])} | "
                         f"{_k(cell)} |{ok}")
        if lamb:
            lines += ["", f"{LAMB_SAME}: {pm(lamb['top1'])} (n = {lamb['top1'][2]}) at {fmt_bytes(lamb['bytes'])} "
                      "per worker."]
        lines += warmup_warning(grid)
        fig = sweep_figure(page, grid, lamb, short)
        plots = [save_figure(fig, fig.axes, out / f"{page}_top1.png", legend_size=7)]
        lines += ["", f"![top-1 by {short} and against bytes]({plots[0].name})"]
        md, csv_path = out / f"{page}.md", out / f"{page}.csv"
        md.write_text("\n".join(lines) + "\n")
        _sweep_csv(grid, (key,), csv_path)
        written += [md, csv_path, *plots]
    return written


def grid_section(name: str, runs: list[dict], all_runs: list[dict], out: Path) -> list[Path]:
    """SLAMB's beta3 x k grid: top-1, bytes and effective k by cell, where it stays with LAMB; heat maps and
    top-1 against bytes."""
    written = []
    grids = study_grids(runs)
    for i, (label, rest, grid) in enumerate(grids):
        page = name if len(grids) == 1 else f"{name}_{i + 1}"
        betas, ks = sorted({b for b, _ in grid}), sorted({k for _, k in grid})
        lamb = lamb_reference(all_runs, rest)
        header = ["| beta3 \\ k | " + " | ".join(str(k) for k in ks) + " |", "|---" * (len(ks) + 1) + "|"]

        def table(show) -> list[str]:
            return header + [f"| {b} | " + " | ".join(show(grid[(b, k)]) if (b, k) in grid else "-" for k in ks)
                             + " |" for b in betas]

        lines = [f"### {page}", "", *what_ran(_sweep_members(grid), all_runs), "",
                 "Final top-1 (%) by beta3 (rows) and compression ratio k (columns), mean ± standard deviation over "
                 "the n runs of a cell (n in brackets)" + (f"; configuration: {label}" if label else "") + ".", "",
                 *table(lambda c: f"{pm(c['top1'])} ({c['top1'][2]})"),
                 "", "Bytes each worker sent over the run, mean over the cell's runs:", "",
                 *table(lambda c: fmt_bytes(c["bytes"])),
                 "", EFFECTIVE_K, "", *table(_k), *warmup_warning(grid),
                 "", grid_findings(grid, lamb)]
        fig = sweep_figure(page, grid, lamb)
        plots = [_save(heatmap_figure(page, betas, ks, grid), out / f"{page}_heatmap.png"),
                 _save(heatmap_figure(page, betas, ks, grid, what="bytes"), out / f"{page}_bytes_heatmap.png"),
                 save_figure(fig, fig.axes, out / f"{page}_top1_vs_bytes.png", legend_size=7)]
        lines += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
        md, csv_path = out / f"{page}.md", out / f"{page}.csv"
        md.write_text("\n".join(lines) + "\n")
        _sweep_csv(grid, GRID_KEYS, csv_path)
        written += [md, csv_path, *plots]
    return written


def _plots(table: str, rows: list[dict], out: Path) -> list[Path]:
    """Accuracy vs epoch and vs bytes: each row's mean over its runs (seeds)."""
    fig, (ax1, ax2) = _pyplot().subplots(1, 2, figsize=(11, 4))
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


def save_figure(fig, axes, path: Path, *, legend_size: int = 8) -> Path:
    """Every page's curves finish alike: grid, legend, tight layout, 120 dpi PNG."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(ax, name: str, what: str, width_in: float) -> None:
    """``what`` over the page's name, wrapped to the axes' figure: a long name must not run off a small plot."""
    import textwrap

    chars = max(20, int(width_in * 13))  # about 13 characters of 9-point text per inch
    ax.set_title("\n".join([*textwrap.wrap(name, chars, break_long_words=True), what]), fontsize=9)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def heatmap_figure(name: str, betas, ks, grid, what: str = "top1"):
    """A beta3 x k heat map of the cells' top-1 (or MB per worker), each cell's value written on it."""
    import numpy as np

    plt = _pyplot()

    def value(cell):
        return cell["top1"][0] if what == "top1" else cell["bytes"] / 1e6

    values = np.array([[value(grid[(b, k)]) if (b, k) in grid else np.nan for k in ks] for b in betas])
    width = max(4.5, 1.8 + 1.0 * len(ks))  # room for the colour bar, the labels and the title on any grid
    fig, ax = plt.subplots(figsize=(width, max(3.2, 1.6 + 0.6 * len(betas))))
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks], fontsize=8)
    ax.set_yticks(range(len(betas)), [str(b) for b in betas], fontsize=8)
    ax.set_xlabel("compression ratio k", fontsize=9)
    ax.set_ylabel("beta3", fontsize=9)
    _title(ax, name, "final top-1 (%)" if what == "top1" else "MB sent per worker", width)
    for i in range(len(betas)):
        for j in range(len(ks)):
            if not np.isnan(values[i, j]):  # dark text on the light end of the colour map
                ax.text(j, i, f"{values[i, j]:.1f}", ha="center", va="center", fontsize=8,
                        color="black" if im.norm(values[i, j]) > 0.6 else "white")
    fig.colorbar(im).ax.tick_params(labelsize=8)
    return fig


def sweep_figure(name: str, grid: dict, lamb: dict | None, setting: str | None = None):
    """Top-1 (mean ± sd over the seeds) against MB sent per worker, a point per cell, LAMB's beside them; for a
    one-setting sweep also top-1 by that ``setting`` (a log axis: H is swept in multiples)."""
    plt = _pyplot()
    panels = 2 if setting else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.0 * panels, 4.0), squeeze=False)
    axes = list(axes[0])
    cells = sorted(grid.items())
    top1 = [c["top1"] for _, c in cells]
    err = [0.0 if math.isnan(s[1]) else s[1] for s in top1]

    def reference(ax):
        if lamb is not None:
            ax.axhline(lamb["top1"][0], color="k", lw=1, label=f"LAMB ({pm(lamb['top1'])}, n={lamb['top1'][2]})")
            ax.axhline(lamb["top1"][0] - WITHIN, color="k", lw=1, ls=":", label=f"LAMB - {WITHIN:g} point")

    if setting:
        ax = axes.pop(0)
        values = [cell[0] for cell, _ in cells]
        ax.errorbar(values, [s[0] for s in top1], yerr=err, marker="o", capsize=3, label="SLAMB")
        reference(ax)
        ax.set_xscale("log")
        ax.set_xticks(values, [str(v) for v in values])
        ax.minorticks_off()
        ax.set_xlabel(setting, fontsize=9)
        ax.set_ylabel("final top-1 (%)", fontsize=9)
        _title(ax, name, f"top-1 by {setting}", 5.0)
    ax = axes[0]
    mb = [c["bytes"] / 1e6 for _, c in cells]
    ax.errorbar(mb, [s[0] for s in top1], yerr=err, fmt="o", capsize=3, label="SLAMB cells")
    for (cell, _), x, y in zip(cells, mb, (s[0] for s in top1)):
        ax.annotate(setting + f" {cell[0]}" if setting else f"b3 {cell[0]}, k {cell[1]}", (x, y), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    if lamb is not None:
        ax.plot([lamb["bytes"] / 1e6], [lamb["top1"][0]], "ks")
    reference(ax)
    ax.set_xlabel("MB sent per worker over the run", fontsize=9)
    ax.set_ylabel("final top-1 (%)", fontsize=9)
    _title(ax, name, "top-1 against bytes", 5.0)
    for ax in fig.axes:
        ax.tick_params(labelsize=8)
    return fig


def _note(members: list[dict]) -> str | None:
    return next((m["config"]["paper"].get("note") for m in members if (m["config"].get("paper") or {}).get("note")),
                None)


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
        md.write_text(comparison_markdown(table, rows, runs, _note(members)))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path, *_plots(table, rows, out)]
    for table, members in sorted(squad.items()):
        rows = squad_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        md.write_text(squad_markdown(table, rows, runs, _note(members)))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path]
    for table, members in sorted(pretrain.items()):
        rows = pretrain_rows(members)
        md, csv_path = out / f"{table}.md", out / f"{table}.csv"
        md.write_text(pretrain_markdown(table, rows, runs, _note(members)))
        write_csv(rows, csv_path)
        written[table] = [md, csv_path]
    for study, members in sorted(studies.items()):
        kind = members[0]["config"].get("study")
        written[study] = (line_section(study, LINE_KEYS[kind], members, runs, out) if kind in LINE_KEYS
                          else grid_section(study, members, runs, out))
    return written
