"""Finished runs as the results pages read them: what each run is, what it ran on, how runs pool.

A run directory holds ``config.yaml``, ``meta.json``, ``identity.json``, ``metrics.jsonl`` and ``metrics.json``
(see :mod:`.run`, :mod:`.identity`). A run's identity is its full effective configuration (every setting but the
seed, the operational ones, :data:`harness.settings.OPERATIONAL_KEYS`, and the paths of its data,
:data:`DATA_PATH_KEYS`) together with what its data is by content (``data``: its fingerprints' names and digest,
:mod:`harness.identity`): the same data in another folder is the same experiment, other data in the same folder
is not. The model a run starts from (``model.dir`` / ``init_from``) is a setting, not a location. The world size
comes from the run's summary. Runs of one identity are seeds, each seed counted once (a second run of a seed
repeats the first's computation); runs of two identities are never pooled. A row names its identity: the
optimizer settings that differ from the optimizer's defaults, and any other setting that differs between the
groups of its page; the settings all rows share are stated above the table.

Every page says what ran, from the runs' own records: model, data, workers, epochs or steps, precision,
hardware and commit (:func:`what_ran`). Published numbers stand beside ours only where every run is its
experiment's recipe at the recipe's size on the published data (:func:`paper_setting`); otherwise the page gives
them apart, with the reasons the runs are not the paper's setting. A run whose summary is NaN or that trained no
epoch or step is left out, with a message.
"""
from __future__ import annotations

import csv
import inspect
import json
import math
import statistics
import sys
from pathlib import Path

import yaml

from slamb.comm import MOMENTUM, MOMENTUM_DENSE
from . import identity
from .recipe import swept
from .run import read_jsonl
from .settings import INPUT_KEYS, covers, effective_config, flatten, lookup

ROW_ORDER = ("SGD-M", "AdamW", "LAMB", "1-bit LAMB", "DGC", "JointSpar", "JointSpar-LARS", "SLAMB")


# where a run's data lives (its content is its identity: identity.json), not the model it starts from
DATA_PATH_KEYS = (*(k for k in INPUT_KEYS if k.startswith("data.")), "validation.dir")


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
        runs.append({"dir": folder, "summary": summary, "config": config, "meta": meta, "history": history,
                     "identity": identity.load(folder)})
    return runs


def configuration(run: dict) -> dict:
    """The identity of ``run`` less its seed (its group key, flattened): the settings that define what it computed,
    its workers, and what its data is by content (its name and digest; None for a run recorded before data
    fingerprints, which its config's settings alone tell apart)."""
    settings = effective_config(run["config"], drop=("seed", "trainer.nproc_per_node", *DATA_PATH_KEYS))
    settings["workers"] = run["summary"].get("world_size")
    settings["data"] = data_name(run) if identity.data_names(run.get("identity")) else None
    return settings


def settings_key(settings: dict) -> tuple:
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


def to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def groups(runs: list[dict], log=to_stderr) -> list[dict]:
    """``[{"row", "settings", "runs"}]``: runs of one ``paper.row`` and one configuration, each seed once, in
    the paper's order."""
    found: dict[tuple, dict] = {}
    for run in runs:
        row = (run["config"].get("paper") or {}).get("row") or run["config"].get("name", "?")
        settings = configuration(run)
        group = found.setdefault((row, settings_key(settings)), {"row": row, "settings": settings, "runs": []})
        group["runs"].append(run)
    for g in found.values():
        g["runs"] = one_per_seed(g["runs"], log)
    order = {name: i for i, name in enumerate(ROW_ORDER)}
    return sorted(found.values(),
                  key=lambda g: (order.get(g["row"], len(order)), g["row"], settings_key(g["settings"])))


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
            elif key not in common and key != "data":
                parts.append(f"{key}={_value(value)}")
        # the data's name holds commas of its own: set apart, last
        data = [f"data: {s['data']}"] if s.get("data") is not None and "data" not in common else []
        g["label"] = "; ".join([", ".join(parts) or "defaults", *data])
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


def last_logged(run: dict, key: str):
    return run["history"][-1].get(key) if run["history"] else None


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
        return f"the model in {shown_path(model['dir'])}" + (f" ({model_name(source, runs)})" if source else "")
    shape = ", ".join(f"{k} {_value(model[k])}" for k in SHAPE_KEYS if k in model)
    return str(model.get("name", "not recorded")) + (f" ({shape})" if shape else "")


def shown_path(path: str) -> str:
    """A path as a page shows it (a page names no folder of the machine that made it): relative to the repository
    where it lies inside; a run made in another checkout (its records kept, the page rebuilt here) from that
    checkout's ``runs/`` folder on; any other absolute path by its last component only."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        parts = Path(path).parts
        if not Path(path).is_absolute():
            return str(path)
        return str(Path(*parts[parts.index("runs"):])) if "runs" in parts else f".../{Path(path).name}"


def shown_command(argv: list[str]) -> str:
    """A command line as a page shows it: each path in it (an argument, or an override's value) by
    :func:`shown_path`."""
    def one(arg: str) -> str:
        key, eq, value = arg.rpartition("=") if "=" in arg and not arg.startswith("/") else ("", "", arg)
        return key + eq + (shown_path(value) if value.startswith("/") else value)

    return " ".join(one(a) for a in argv)


def data_name(run: dict) -> str:
    """What a run read, by content (:mod:`harness.identity`); a run recorded before data fingerprints is named by
    its config, and says so."""
    names = identity.data_names(run.get("identity"))
    if names:
        return "; ".join(names)
    data = run["config"].get("data") or {}
    named = (str(data["name"]) if "name" in data else f"the shards in {shown_path(data['dir'])}" if "dir" in data
             else "not recorded")
    return named + (f" (seq {data['seq_len']})" if "seq_len" in data else "") + " (named by its config: the run " \
        "predates data fingerprints)"


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
        "data": [data_name(r) for r in members],
        "workers": [str(r["summary"].get("world_size", "not recorded")) for r in members],
        "length": [_length(r["summary"]) for r in members],
        "precision": [str(lookup(r["config"], "trainer.precision", "not recorded")) for r in members],
        "hardware": [_hardware(r.get("meta", {})) for r in members],
        "commit": [_commit(r.get("meta", {})) for r in members],
    }
    return ([f"What ran ({len(members)} runs, from their recorded config and metadata):", ""]
            + [f"- {name}: {_tally(values)}" for name, values in facts.items()])


def departure(key: str, recipe_value, run_value) -> str:
    """One setting in which a run departs from its recipe, as a page names it."""
    counts = isinstance(run_value, int) and isinstance(recipe_value, int)
    if key in ("epochs", "steps") and counts:
        return f"{run_value:,} {key if run_value != 1 else key[:-1]} of {recipe_value:,}"
    if key == "trainer.nproc_per_node" and counts:
        return f"{run_value} worker{'s' if run_value != 1 else ''} per node of {recipe_value}"
    return f"{key} {_value(run_value)} (the recipe's {_value(recipe_value)})"


def size_departures(run: dict) -> list[str] | None:
    """How ``run`` departs from its experiment's recipe (beside the settings its study sweeps), as a page names
    it: ``[]`` for a run at the recipe's size; None for a run recorded before runs recorded their recipe."""
    record = (run.get("identity") or {}).get("recipe")
    if record is None:
        return None
    skip = swept(run["config"].get("study"))
    first = ("epochs", "steps", "trainer.nproc_per_node")  # the size a reader looks for first
    keys = sorted((k for k in record["departures"] if k not in skip), key=lambda k: (k not in first, first.index(k)
                                                                                    if k in first else 0, k))
    return [departure(k, *record["departures"][k]) for k in keys]


def paper_setting(members: list[dict], runs: list[dict]) -> list[str]:
    """Why the runs are not in the setting of the published numbers; ``[]`` where each one is its experiment's
    recipe at the recipe's size (no departure in its ``identity.json``: model, length, workers, batch, the
    optimizer's settings) on the published data (``paper.setting.datasets``, by content) and, under
    ``paper.setting.pretrained``, fine-tunes a model a run among ``runs`` pre-trained in that setting."""
    reasons = []
    for run in members:
        setting = (run["config"].get("paper") or {}).get("setting") or {}
        record = run.get("identity") or {}
        if not setting:
            reasons.append("no published setting to hold the runs to")
            continue
        size = size_departures(run)
        if size is None:
            reasons.append("a run recorded before runs recorded their data and recipe (no identity.json)")
            continue
        reasons += size
        have = {fp.get("dataset") for fp in record["data"].values()}
        if not set(setting.get("datasets") or ()) <= have:
            reasons.append(f"data: {data_name(run)}")
        if setting.get("pretrained"):
            source = pretrained_run(run, runs)
            wanted = flatten(setting["pretrained"])
            if source is None:
                reasons.append("a model that no run among these pre-trained")
            elif any(lookup(source["config"], k) != v for k, v in wanted.items()):
                reasons.append(f"a model pre-trained as {model_name(source, runs)}")
            else:
                size = size_departures(source)
                reasons += (["a model pre-trained by a run recorded before runs recorded their recipe"] if size is None
                            else [f"pre-trained with {why}" for why in size])
    return list(dict.fromkeys(reasons))


def published(members: list[dict], runs: list[dict], what: str) -> tuple[bool, list[str]]:
    """(beside, lines): whether the published numbers stand beside ours, and the lines that give their source
    and, where the runs are not in their setting, why not."""
    source = next((m["config"]["paper"]["source"] for m in members
                   if (m["config"].get("paper") or {}).get("source")), "not recorded")
    reasons = paper_setting(members, runs)
    if not reasons:
        return True, ["", f"Published {what} (the column beside ours), from {source}."]
    return False, ["", f"Not the paper's setting ({'; '.join(reasons)}), so the published {what} stand apart below, "
                   f"for reference only. Their source: {source}."]


# what a paper row sets for its optimizer: its block, and the clipping of its gradients (the authors clip LAMB's
# and 1-bit LAMB's BERT gradients, not SLAMB's)
ROW_KEYS = ("optimizer", "clip_grad")


def recipe(settings: dict) -> tuple:
    """An identity apart from its row's optimizer settings (:data:`ROW_KEYS`) and name (a group key): LAMB's
    reference for a sweep cell shares all of it (model, data by content, length, schedule, precision, workers)."""
    return settings_key({k: v for k, v in settings.items() if k != "name" and not covers(ROW_KEYS, k)})


def volume(settings: dict) -> tuple:
    """The settings that fix how much a run communicates apart from its optimizer (model, data, length, workers):
    a row's bytes compare with LAMB's where these agree, whatever else (schedule, clipping) differs."""
    return settings_key({k: v for k, v in settings.items()
                 if k in ("epochs", "steps", "workers", "data") or k.startswith(("model.", "data."))})


def compressed_share(kinds: dict) -> float | None:
    """The part of SLAMB's momentum bytes that were sampled entries, as the ledger measured them: kind
    ``momentum`` over it and ``momentum_dense`` (the always-averaged tensors); None where neither was sent."""
    sampled, dense = kinds.get(MOMENTUM, 0), kinds.get(MOMENTUM_DENSE, 0)
    return sampled / (sampled + dense) if sampled + dense else None


def bytes_by_kind(summaries: list[dict]) -> dict[str, float]:
    """The runs' mean bytes per worker by the ledger's kinds (``all`` included)."""
    return {k: stat(x["bytes_total"].get(k, 0) for x in summaries)[0]
            for k in sorted({k for x in summaries for k in x["bytes_total"]})}


def _flat(prefix: str, s: tuple[float, float, int]) -> dict:
    return {prefix: s[0], f"{prefix}_std": s[1]}


CSV_SKIP = ("settings", "members", "bytes_by_kind")


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


def note_of(members: list[dict]) -> str | None:
    return next((m["config"]["paper"].get("note") for m in members if (m["config"].get("paper") or {}).get("note")),
                None)
