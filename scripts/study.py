"""``make study``: the paper's two comparisons reproduced in kind, offline, on a CPU, with seeds and intervals.

    python scripts/study.py                  # the full study into results/study/ (about 2 hours on 2 cores)
    python scripts/study.py --quick          # tiny sizes, written to runs/study-quick/ (the test's mode)
    python scripts/study.py --tune           # AdamW's and LAMB's lr grid on a validation split (about 25 min)

Two tasks, each a set of rows (``configs/experiment/study/<task>_*.yaml``, one
file per row: adding a row is adding a file) run as one Hydra ``--multirun``
per task through the pipeline's own entry point, every row with every seed:

* ``digits``: the CIFAR-10 pipeline (``cifar10.train``) on scikit-learn's
  digits in the CIFAR-10 layout (:func:`cifar10.data.write_digits`),
  ResNet-8, 4 gloo workers, global batch 256; the metric is the test top-1 of
  the ranks' averaged model, ``final_test_top1``.
* ``bert``: phase-1 pre-training (``bert.train``) of a small BERT on the
  docstrings of the Python standard library's source files, a held-out tenth
  of the files as validation shards (both through ``bert.prepare_data``, the
  vocabulary through ``bert.vocab``); the metric is the paper's Table 2 one,
  the validation MLM loss of the ranks' averaged model, ``final_val_mlm_loss``.

For each task the page (``README.md`` in the output folder) gives the table
(rows grouped by full configuration, mean ± sd and n, :mod:`harness.tables`),
the bytes each worker sent by kind (the ledger), the curves, and a verdict per
SLAMB row: its difference to LAMB with a 95% Welch t-interval over the seeds
and its bytes over LAMB's. ``study.json`` beside it holds every run's metric
and bytes, the numbers the page is computed from.

The page is computed from the runs' records, kept beside it in ``runs/`` (each
finished run's ``config.yaml``, ``meta.json``, ``metrics.json`` and
``metrics.jsonl``: no checkpoints), so that it is rebuilt from a fresh clone with
``--report-only`` and a study stopped part way continues on another machine: a
(row, seed) with a record is not run again. The BERT task's data is generated
from the standard library's source; its digest is recorded, and a continued study
whose data differ (another Python) is refused.
"""
from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/study.py`: the repository's packages are importable
    sys.path.insert(0, str(ROOT))

from harness.figures import save_figure  # noqa: E402
from harness.records import fmt_bytes, keep_records, load_runs, optimizer_defaults, pm, stat  # noqa: E402
from harness.run import git_revision, shown_command, shown_path  # noqa: E402
from harness.tables import RERUN_DRIFT, build_tables, comparison_rows, pretrain_rows  # noqa: E402

ROWS_DIR = ROOT / "configs" / "experiment" / "study"
TABLES = {"digits": "study_digits_resnet8", "bert": "study_bert"}
SEQ_LEN = 128
HELD_OUT_EVERY = 10  # every 10th standard-library file (sorted by path) is validation text


def rows(task: str, only: list[str] | None = None) -> list[str]:
    """The experiment names of a task's rows: every ``configs/experiment/study/<task>_*.yaml`` (``only``:
    those of these file names)."""
    found = [f"study/{p.stem}" for p in sorted(ROWS_DIR.glob(f"{task}_*.yaml"))]
    if not found:
        raise SystemExit(f"no rows for task {task!r}: add configs/experiment/study/{task}_<row>.yaml")
    if only is not None:  # a task whose rows are not named runs none
        mine = [o for o in only if o.startswith(f"{task}_")]
        missing = [o for o in mine if f"study/{o}" not in found]
        if missing:
            raise SystemExit(f"error: --rows {' '.join(missing)}: no such file in configs/experiment/study/; fix: "
                             "name row files without .yaml")
        found = [f"study/{o}" for o in mine]
    return found


# ------------------------------------------------------------------------------------------- statistics


def welch_interval(a, b, level: float = 0.95) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its ``level`` Welch t-interval (unequal variances) over the two samples."""
    from scipy import stats

    a, b = [float(x) for x in a], [float(x) for x in b]
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(level)
    return diff, float(ci.low), float(ci.high)


DELTA = {"digits": 1.0, "bert": 0.05}  # the equivalence margins: 1 point of top-1, 0.05 nats of MLM loss


def judgement(lo: float, hi: float, delta: float, *, higher_is_better: bool, digits: int, ref: str = "LAMB") -> str:
    """What a difference's interval against ``ref`` decides: equivalence within ±``delta`` when it lies inside that
    margin, better or worse when it excludes 0 (both can hold), otherwise undecided with its half-width."""
    if math.isnan(lo):
        return "no interval"
    said = []
    if lo > 0 or hi < 0:
        said.append(f"better than {ref}" if (lo > 0) == higher_is_better else f"worse than {ref}")
    if -delta <= lo and hi <= delta:
        said.append(f"equivalent within ±{delta:g}")
    return " and ".join(said) if said else f"undecided, interval ±{(hi - lo) / 2:.{digits}f}"


def verdict(row: str, values: list[float], lamb: list[float], bytes_ratio: float, *, unit: str, metric: str,
            higher_is_better: bool, delta: float, ref: str = "LAMB") -> str:
    """One sentence: ``row`` against ``ref``'s runs ``lamb`` (difference, its 95% interval over the seeds, what the
    interval decides at the margin ``delta``) and the bytes ratio."""
    digits = unit_digits(unit)
    d, lo, hi = welch_interval(values, lamb)
    word = ("above" if d > 0 else "below") if d != 0 else "level with"
    if math.isnan(lo):
        ci = "one seed"
    else:
        half = (hi - lo) / 2
        ci = (f"95% CI {lo:+.{digits}f} to {hi:+.{digits}f}, ±{half:.{digits}f}: "
              + (f"within the ±{delta:g} target" if half <= delta else f"wider than the ±{delta:g} target"))
    return (f"{row}'s averaged model is {abs(d):.{digits}f} {unit} {word} {ref}'s {metric} "
            f"({ci}; n = {len(values)} and {len(lamb)}): "
            f"**{judgement(lo, hi, delta, higher_is_better=higher_is_better, digits=digits, ref=ref)}**, "
            f"at {bytes_ratio:.3f}x {ref}'s bytes per worker.")


def seeds_for(values: list[float], lamb: list[float], delta: float, cap: int, level: float = 0.95) -> int:
    """The fewest runs per row (of this row and of LAMB each, at most ``cap``) at which a Welch interval with
    these samples' standard deviations would be at most ±``delta`` wide."""
    from scipy import stats

    va, vb = statistics.variance(values), statistics.variance(lamb)
    for n in range(max(len(values), len(lamb)), cap + 1):
        se2 = (va + vb) / n
        if se2 == 0:
            return n
        df = se2 ** 2 / (((va / n) ** 2 + (vb / n) ** 2) / (n - 1))
        if stats.t.ppf(0.5 + level / 2, df) * math.sqrt(se2) <= delta:
            return n
    return cap


def unit_digits(unit: str) -> int:
    return 2 if unit == "points" else 4


# ------------------------------------------------------------------------------------------- data


def stdlib_documents(limit_files: int | None = None) -> tuple[list[str], list[str]]:
    """(training, validation) documents: the docstrings of the standard library's source files, a sentence
    per line; files in sorted order, every :data:`HELD_OUT_EVERY`-th one held out. Parsed, never imported."""
    from bert.demo import SENTENCE_END

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    files = sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))
    files = files[:limit_files] if limit_files else files
    train, valid, seen = [], [], set()
    for i, path in enumerate(files):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) <= 80 or doc in seen:
                continue
            seen.add(doc)
            sentences = [s for s in SENTENCE_END.split(" ".join(doc.split())) if len(s.split()) >= 3]
            if len(sentences) >= 2:
                (valid if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).append("\n".join(sentences))
    return train, valid


def write_documents(docs: list[str], folder: Path, shards: int, stem: str) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}{i}.txt" for i in range(shards)]
    for i, path in enumerate(paths):
        path.write_text("\n\n".join(docs[i::shards]) + "\n")
    return paths


def bert_data(root: Path, *, vocab_size: int, dupe_factor: int, limit_files: int | None) -> dict:
    """Corpus, WordPiece vocabulary, training and validation shards under ``root``; their description."""
    from bert.prepare_data import Settings, default_max_predictions, prepare
    from bert.vocab import train_vocab

    train_docs, valid_docs = stdlib_documents(limit_files)
    train_files = write_documents(train_docs, root / "text" / "train", 4, "stdlib")
    valid_files = write_documents(valid_docs, root / "text" / "valid", 1, "stdlib_valid")
    vocab = train_vocab(train_files, root / "vocab", vocab_size)
    settings = dict(max_seq_length=SEQ_LEN, max_predictions_per_seq=default_max_predictions(SEQ_LEN))
    train = prepare(train_files, vocab, root / "train", Settings(**settings, dupe_factor=dupe_factor), workers=2)
    valid = prepare(valid_files, vocab, root / "valid", Settings(**settings, dupe_factor=1, seed=54321))
    return {"vocab": str(vocab), "vocab_size": len(vocab.read_text().splitlines()),
            "train_dir": str(root / "train"), "valid_dir": str(root / "valid"),
            "train_documents": len(train_docs), "valid_documents": len(valid_docs),
            "train_words": sum(len(d.split()) for d in train_docs), "valid_words": sum(len(d.split()) for d in valid_docs),
            "train_examples": sum(s["examples"] for s in train), "valid_examples": sum(s["examples"] for s in valid),
            "dupe_factor": dupe_factor, "digest": data_digest(root),
            "unigram_entropy": unigram_cross_entropy(root / "train", root / "valid", vocab)}


def data_digest(root: Path) -> str:
    """sha256 of the vocabulary and the prepared shards under ``root``: what a BERT run read."""
    h = hashlib.sha256()
    for path in sorted(p for sub in ("vocab", "train", "valid") for p in (root / sub).rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def unigram_cross_entropy(train_dir: Path, valid_dir: Path, vocab: Path) -> float:
    """Cross-entropy (nats) of the validation shards' masked tokens under the training shards' token frequencies
    (add-one smoothed over the vocabulary, [CLS] and [SEP] left out): the loss of a model that has learned
    which tokens are common and nothing of their context, the line a model must get below to have learned any."""
    import numpy as np

    from bert.data import find_shards, open_shard

    tokens = vocab.read_text(encoding="utf-8").splitlines()
    special = [tokens.index(t) for t in ("[CLS]", "[SEP]") if t in tokens]
    counts = np.zeros(len(tokens), dtype=np.float64)
    for path in find_shards(train_dir, "*.hdf5"):
        with open_shard(path) as f:
            ids, mask = f["input_ids"][:].astype(np.int64), f["input_mask"][:].astype(bool)
            pos, orig = f["masked_lm_positions"][:].astype(np.int64), f["masked_lm_ids"][:].astype(np.int64)
        rows = np.broadcast_to(np.arange(len(ids))[:, None], pos.shape)
        ids[rows[pos > 0], pos[pos > 0]] = orig[pos > 0]  # the text as written, before [MASK] replaced it
        counts += np.bincount(ids[mask], minlength=len(tokens))
    counts[special] = 0
    logp = np.log((counts + 1) / (counts.sum() + len(tokens)))
    masked = []
    for path in find_shards(valid_dir, "*.hdf5"):
        with open_shard(path) as f:
            pos, orig = f["masked_lm_positions"][:], f["masked_lm_ids"][:]
        masked.append(orig[pos > 0].astype(np.int64))
    return float(-logp[np.concatenate(masked)].mean())


# ------------------------------------------------------------------------------------------- runs


def multirun(module: str, experiments: list[str], seeds: list[int], sweep: Path, overrides: list[str]) -> float:
    """Every row with every seed through ``module``'s Hydra entry point; returns the wall time (s)."""
    cmd = [sys.executable, "-m", module, "--multirun", f"experiment={','.join(experiments)}",
           f"seed={','.join(str(s) for s in seeds)}", f"hydra.sweep.dir={sweep}",
           "hydra.sweep.subdir=${name}_seed${seed}", "trainer.resume=never", *overrides]
    print("+", " ".join(cmd), flush=True)
    tic = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, check=False)
    if done.returncode:  # the study goes on; the page counts the runs that finished, the next invocation retries
        print(f"study: a run of {', '.join(experiments)} failed (exit {done.returncode}); the page leaves it out and "
              "the next `make study` runs it again", flush=True)
    return time.perf_counter() - tic


def run_missing(module: str, experiments: list[str], seeds: list[int], sweep: Path, records: Path,
                overrides: list[str], spent: Callable[[float], None], name: str | None = None) -> None:
    """:func:`multirun` for each (row, seed) pair without a record under ``records``, one run at a time, its
    record kept and its wall time handed to ``spent`` as soon as it ends: a study stopped part way continues
    where it stopped, here or on another machine. ``name``: the name the overrides give the runs (a grid
    point's), where it is not the row's ``study_<file>``."""
    keep_records(sweep, records)
    done = {(r["config"]["name"], r["config"].get("seed"))
            for r in load_runs(records, log=lambda _: None)} if records.exists() else set()
    for e in experiments:
        missing = [s for s in seeds if (name or f"study_{e.split('/')[-1]}", s) not in done]
        if len(missing) < len(seeds):
            print(f"study: {e}: seeds {sorted(set(seeds) - set(missing))} already ran ({records})", flush=True)
        for seed in missing:
            spent(multirun(module, [e], [seed], sweep, overrides))
            keep_records(sweep, records)


def verdict_rows_first(experiments: list[str]) -> tuple[list[str], list[str]]:
    """(LAMB's row and the SLAMB rows, the other rows): the rows the verdicts compare run first, then their
    top-ups, then the context rows, so that a study stopped early has its verdicts. Rows are named after their
    optimizer (``<task>_lamb``, ``<task>_slamb*``)."""
    def compared(e: str) -> bool:
        stem = e.split("/")[-1].split("_", 1)[1]
        return stem == "lamb" or stem.startswith("slamb")

    return [e for e in experiments if compared(e)], [e for e in experiments if not compared(e)]


def task_runs(records: Path, task: str, seeds: list[int] | None = None) -> list[dict]:
    """The runs of ``task`` recorded under ``records`` (of these seeds only, when given)."""
    return [r for r in load_runs(records) if (r["config"].get("paper") or {}).get("table") == TABLES[task]
            and (seeds is None or r["config"].get("seed") in seeds)]


def table_rows(runs: list[dict], task: str) -> list[dict]:
    return comparison_rows(runs) if task == "digits" else pretrain_rows(runs)


def experiment(row: dict) -> str:
    """The row file a table row was run from (``name: study_<file>``)."""
    return "study/" + row["members"][0]["config"]["name"].removeprefix("study_")


def top_up_plan(rows_: list[dict], task: str, cap: int) -> dict[str, int]:
    """Row file -> the runs it needs (at most ``cap``) for every SLAMB row's verdict against LAMB to be decided
    (its interval inside ±DELTA, or clear of 0; never wider than ±DELTA), estimated from the difference and the
    spread of the runs so far; the rows that need none are left out."""
    lamb = next((r for r in rows_ if r["optimizer"] == "LAMB"), None)
    want: dict[str, int] = {}
    for r in rows_:
        if lamb is None or r["settings"].get("optimizer.name") != "slamb":
            continue
        values, ref = (_metric_values(x, task) for x in (r, lamb))
        if min(len(values), len(ref)) < 2:
            continue
        d, lo, hi = welch_interval(values, ref)
        delta = DELTA[task]
        if (-delta <= lo and hi <= delta) or lo > 0 or hi < 0:
            continue  # decided: equivalent within the margin, or better or worse
        # the half-width that decides, with the difference seen so far: inside ±delta, or clear of 0
        n = seeds_for(values, ref, min(delta, max(delta - abs(d), abs(d))), cap)
        for x in (r, lamb):
            want[experiment(x)] = max(want.get(experiment(x), 0), n)
    have = {experiment(r): r["runs"] for r in rows_}
    return {e: n for e, n in sorted(want.items()) if n > have[e]}


def top_up(module: str, sweep: Path, records: Path, task: str, overrides: list[str], cap: int,
           spent: Callable[[float], None], rounds: int = 3) -> None:
    """More seeds for the rows whose intervals are wider than the margin (:func:`top_up_plan`), new seeds
    after each row's highest, re-estimated after each round; ``spent`` is told each run's wall time (s)."""
    for _ in range(rounds):
        rows_ = table_rows(task_runs(records, task), task)
        plan = top_up_plan(rows_, task, cap)
        if not plan:
            break
        seeds = {experiment(r): sorted(m["config"]["seed"] for m in r["members"]) for r in rows_}
        for exp, n in plan.items():
            first = max(seeds[exp]) + 1
            print(f"study: {exp} needs {n} runs for a ±{DELTA[task]:g} interval; adding seeds {first}..{first + n - len(seeds[exp]) - 1}", flush=True)
            run_missing(module, [exp], list(range(first, first + n - len(seeds[exp]))), sweep, records, overrides,
                        spent)


METRIC = {"digits": "final_test_top1", "bert": "final_val_mlm_loss"}
SCALE = {"digits": ("points", "test top-1", True), "bert": ("nats", "validation MLM loss", False)}  # unit, name, up
# the rows also compared with the AdamW row, whose learning rate the grid (--tune) chose: the paper's SLAMB
AGAINST_ADAMW = ("study/digits_slamb_v1",)


def per_run(runs: list[dict], task: str) -> list[dict]:
    """The numbers the page is made of, one entry per run."""
    def where(folder) -> str:  # the json, like the page, names no folder of the machine
        return shown_path(str(Path(folder).resolve()))

    def entry(r: dict) -> dict:
        e = {"row": r["config"]["paper"]["row"], "seed": r["config"]["seed"], "dir": where(r["dir"]),
             "metric": r["summary"][METRIC[task]], "bytes": r["summary"]["bytes_total"].get("all", 0),
             "bytes_by_kind": r["summary"]["bytes_total"], "wall_time_s": r["summary"]["wall_time_s"]}
        if task == "bert":
            e["val_mlm_acc"] = next((h["val_mlm_acc"] for h in reversed(r["history"]) if "val_mlm_acc" in h), None)
        return e

    return [entry(r) for r in runs]


def verdicts(rows_: list[dict], task: str) -> list[str]:
    """A verdict per SLAMB row of the table, from its runs' metrics and LAMB's; and for the rows of
    :data:`AGAINST_ADAMW`, one against the tuned AdamW row where the task has one."""
    lamb = next((r for r in rows_ if r["optimizer"] == "LAMB"), None)
    if lamb is None:
        return ["No LAMB row to compare with."]
    unit, metric, higher = SCALE[task]

    def against(r: dict, ref: dict, name: str) -> str:
        return verdict(r["optimizer"], _metric_values(r, task), _metric_values(ref, task),
                       r["bytes_per_worker"] / ref["bytes_per_worker"], unit=unit, metric=metric,
                       higher_is_better=higher, delta=DELTA[task], ref=name)

    out = []
    for r in rows_:
        if r["settings"].get("optimizer.name") != "slamb":
            continue
        out.append(against(r, lamb, "LAMB"))
        if r["settings"].get("optimizer.hierarchy") == "node":
            out[-1] += (" Its bytes are every collective of a process, the dense gradient average inside each "
                        "node included; what crosses the nodes is in results/comm_volume.md and "
                        "results/netbench_hierarchical.md.")
    adamw = next((r for r in rows_ if experiment(r) == f"study/{task}_adamw"), None)
    out += [against(r, adamw, "tuned AdamW") for r in rows_ if adamw is not None and experiment(r) in AGAINST_ADAMW]
    return out


def _metric_values(row: dict, task: str) -> list[float]:
    return [m["summary"][METRIC[task]] for m in row["members"]]


# ------------------------------------------------------------------------------------------- learning-rate grid

# --tune: AdamW's and LAMB's learning rates chosen on a validation split held out of the training set, the rest of
# each row's recipe as the study runs it. The grids are alike so that neither row is favoured: factors of about 3
# around AdamW's default (configs/optimizer/adamw.yaml) and LAMB's recipe (configs/experiment/cifar10/lamb.yaml)
GRID_ROWS = {"AdamW": ("study/digits_adamw", 1e-3), "LAMB": ("study/digits_lamb", 1e-2)}
GRID_POINTS = (-2, -1, 0, 1, 2)  # centre x 0.1, 0.3, 1, 3, 10 (grid_lr)
GRID_SEEDS = (0, 1)
GRID_EXTEND = 2  # a choice at an edge of the grid extends it past that edge, one point at a time, this often at most
GRID_TABLE = "study_digits_lr_grid"
VALID_IMAGES = 220  # of the digits' 1,500 training images: 1,280 left, still 5 steps of 4 x 64 a epoch (the recipe's)
QUICK_GRID = {"points": (0,), "seeds": (0,), "extend": 0}


def grid_lr(centre: float, i: int) -> float:
    """The ``i``-th point of the 1-3 grid around ``centre``: centre x 10^(i // 2), x 3 where ``i`` is odd."""
    return float(f"{centre * 10 ** (i // 2) * (3 if i % 2 else 1):.3g}")


def grid_name(row: str, lr: float) -> str:
    return f"tune_digits_{row.lower().replace(' ', '_')}_lr{lr:g}"


def grid_cells(runs: list[dict]) -> dict[str, dict[float, list[dict]]]:
    """row -> learning rate -> its runs (each seed once) of the grid's records."""
    cells: dict[str, dict[float, list[dict]]] = {}
    for r in runs:
        if (r["config"].get("paper") or {}).get("table") != GRID_TABLE:
            continue
        point = cells.setdefault(r["config"]["paper"]["row"], {}).setdefault(float(r["config"]["optimizer"]["lr"]), [])
        if r["config"]["seed"] not in {m["config"]["seed"] for m in point}:
            point.append(r)
    return cells


def grid_choice(points: dict[float, list[dict]]) -> float:
    """The learning rate whose runs' mean validation top-1 of the averaged model at the last epoch is highest;
    of a tie, the one with the lower mean validation loss."""
    def score(lr: float) -> tuple[float, float]:
        runs = [r["summary"] for r in points[lr]]
        return (statistics.fmean(x["final_valid_top1"] for x in runs),
                -statistics.fmean(x["final_valid_loss"] for x in runs))

    return max(sorted(points), key=score)


def tune(sweep: Path, records: Path, overrides: list[str], spent: Callable[[float], None], *,
         points=GRID_POINTS, seeds=GRID_SEEDS, extend: int = GRID_EXTEND, rows_: list[str] | None = None) -> None:
    """Every row of :data:`GRID_ROWS` (``rows_``: these) at each learning rate of its grid on the validation split,
    each seed, through :func:`run_missing` (a grid stopped part way continues); a choice at an edge extends the
    grid."""
    for row, (exp, centre) in GRID_ROWS.items():
        if rows_ is not None and row not in rows_:
            continue
        todo, lo, hi = list(points), min(points), max(points)
        for extension in range(extend + 1):
            for i in todo:
                lr = grid_lr(centre, i)
                name = grid_name(row, lr)
                run_missing("cifar10.train", [exp], list(seeds), sweep, records,
                            [*overrides, f"optimizer.lr={lr}", f"data.valid_images={VALID_IMAGES}", f"name={name}",
                             f"paper.table={GRID_TABLE}"], spent, name=name)
            cells = grid_cells(load_runs(records, log=lambda _: None)).get(row, {})
            tried = sorted(cells)
            best = grid_choice(cells) if cells else None
            if best is None or len(tried) < 2 or tried[0] < best < tried[-1] or extension == extend:
                break
            lo, hi = (lo - 1, hi) if best == tried[0] else (lo, hi + 1)
            todo = [lo if best == tried[0] else hi]
            print(f"study: the grid's choice for {row}, lr {best:g}, is at its edge: adding lr "
                  f"{grid_lr(centre, todo[0]):g}", flush=True)


def grid_section(runs: list[dict], rows_: list[dict]) -> tuple[str, dict]:
    """The grid's table and what it chose from its ``runs``, against the learning rates of the study's AdamW and
    LAMB rows (``rows_``); ("", {}) where no grid has run."""
    cells = grid_cells(runs)
    if not cells:
        return "", {}
    chosen = {row: grid_choice(points) for row, points in cells.items()}
    rates = sorted({lr for points in cells.values() for lr in points})
    members = [r for points in cells.values() for runs_ in points.values() for r in runs_]
    split = {json.dumps(r["identity"]["data"]["data.valid_images"]["counts"], sort_keys=True)
             for r in members if r.get("identity") and "data.valid_images" in r["identity"]["data"]}
    tested = sum(any(k.startswith("test_") for h in r["history"] for k in h) or "final_test_top1" in r["summary"]
                 for r in members)
    seeds = sorted({r["config"]["seed"] for r in members})
    counts = json.loads(split.pop()) if len(split) == 1 else None
    lines = ["### Learning rates chosen on a validation split", "",
             f"Command: `python scripts/study.py --tune` ({len(members)} runs). AdamW and LAMB on the digits recipe "
             "above at each learning rate of a grid of factors of about 3 (0.1, 0.3, 1, 3, 10 times AdamW's default "
             f"{GRID_ROWS['AdamW'][1]:g} and LAMB's recipe {GRID_ROWS['LAMB'][1]:g}, extended past an edge that wins), "
             f"seeds {', '.join(map(str, seeds))}, "
             + (f"each trained on {counts['train']:,} of the {counts['train'] + counts['valid']:,} training images "
                f"and scored on the other {counts['valid']:,} (a fixed draw, `data.valid_images`, recorded in each "
                "run's identity.json)" if counts else "on validation splits that differ between runs (see their "
                "identity.json)")
             + f", {'/'.join(str(n) for n in sorted({r['summary']['steps'] for r in members}))} steps each"
             + f". {'No' if not tested else tested} run of the grid read the test split"
             + ("" if not tested else "s: the choice below is NOT independent of the test split")
             + ". Chosen: the highest validation top-1 of the averaged model at the last epoch, mean over the seeds "
               "(a tie: the lower validation loss); **bold**.", ""]
    head = " | ".join(f"{row} validation top-1 | {row} validation loss" for row in cells)
    lines += [f"| learning rate | {head} |", "|---" * (1 + 2 * len(cells)) + "|"]
    for lr in rates:
        cols = []
        for row, points in cells.items():
            if lr not in points:
                cols += ["-", "-"]
                continue
            top1 = pm(stat(r["summary"]["final_valid_top1"] for r in points[lr]))
            loss = pm(stat(r["summary"]["final_valid_loss"] for r in points[lr]), 4)
            mark = "**" if chosen[row] == lr else ""
            cols += [f"{mark}{top1} (n = {len(points[lr])}){mark}", loss]
        lines.append(f"| {lr:g} | " + " | ".join(cols) + " |")
    lines.append("")
    for row, lr in chosen.items():
        tried = sorted(cells[row])
        edge = "" if tried[0] < lr < tried[-1] else (" (at the edge of the grid as run: a wider grid may choose "
                                                     "otherwise)")
        ran = sorted({float(m["config"]["optimizer"]["lr"]) for r in rows_ if r["optimizer"] == row
                      for m in r["members"]})
        if not ran:
            lines.append(f"- {row}: the grid chose lr {lr:g}{edge}; the study has no {row} row yet.")
        elif ran == [lr]:
            lines.append(f"- {row}: the grid chose lr {lr:g}{edge}, the learning rate its study row runs at.")
        else:
            lines.append(f"- {row}: the grid chose lr {lr:g}{edge}, NOT the learning rate its study row runs at "
                         f"({', '.join(f'{x:g}' for x in ran)})" + (
                             ": the verdicts compare SLAMB with LAMB at the paper's recipe, whose learning rate "
                             "SLAMB's rows share; against a LAMB tuned on this task, the LAMB row (and SLAMB's) "
                             "would be rerun at the grid's choice." if row == "LAMB" else
                             ": the row should be rerun at the grid's choice."))
    return "\n".join(lines) + "\n", {row: {"chosen_lr": lr, "grid": {f"{x:g}": [
        {"seed": r["config"]["seed"], "valid_top1": r["summary"]["final_valid_top1"],
         "valid_loss": r["summary"]["final_valid_loss"]} for r in cells[row][x]] for x in sorted(cells[row])}}
        for row, lr in chosen.items()}


# ------------------------------------------------------------------------------------------- where the bytes go

LEDGER = ROOT / "results" / "comm_volume_raw.json"  # bench.comm_volume's measurements at the paper's shapes
LEDGER_SLAMB = "SLAMB fp32 (k=0.1, H=100)"  # fp32 momentum, as the study's rows exchange it
FP32_BYTES = 4
# the kinds of the ledger by what they carry: (key, heading)
ROLES = (("sampled", "momentum, sampled at the target k"), ("warmup", "compression warm-up (sampled above the target k)"),
         ("dense", "momentum, always-averaged tensors"), ("params", "parameter syncs"),
         ("grads", "dense gradients"), ("onebit", "1-bit momentum and scales"), ("control", "control"))


def warmup_excess(run: dict) -> float:
    """The sampled momentum bytes that the compression warm-up added above the target k: what each logged period at
    a raised k sent beyond the bytes per step of the periods at the target k, as the ledger logged both."""
    target = (run["config"].get("optimizer") or {}).get("compress_ratio")
    periods = [h for h in run["history"] if "compress_ratio" in h and "bytes/momentum" in h and h.get("period_steps")]
    if target is None:
        return 0.0
    steady = [h["bytes/momentum"] / h["period_steps"] for h in periods if h["compress_ratio"] <= target]
    if not steady:  # every period raised (a run shorter than the warm-up): the sampled bytes scale with k
        return sum(h["bytes/momentum"] * (1 - target / h["compress_ratio"]) for h in periods)
    per_step = statistics.fmean(steady)
    return sum(h["bytes/momentum"] - per_step * h["period_steps"] for h in periods if h["compress_ratio"] > target)


def roles(run: dict) -> dict[str, float]:
    """A run's bytes per worker by :data:`ROLES`, from the ledger's kinds (they add up to its total)."""
    b, warm = run["summary"]["bytes_total"], warmup_excess(run)
    return {"sampled": b.get("momentum", 0) - warm, "warmup": warm, "dense": b.get("momentum_dense", 0),
            "params": b.get("params", 0), "grads": b.get("grads", 0),
            "onebit": b.get("momentum_1bit", 0) + b.get("scales", 0), "control": b.get("control", 0)}


def row_roles(row: dict) -> dict[str, float]:
    """:func:`roles`, mean over the row's seeds."""
    each = [roles(m) for m in row["members"]]
    return {k: statistics.fmean(e[k] for e in each) for k, _ in ROLES}


def share(part: float, whole: float) -> str:
    return f"{fmt_bytes(part)} ({100 * part / whole:.1f}%)" if part else "-"


def breakdown_table(rows_: list[dict], task: str) -> list[str]:
    """Each SLAMB and 1-bit LAMB row's bytes per worker by role, with its share of the row's total."""
    lines = []
    for r in rows_:
        if r["settings"].get("optimizer.name") not in ("slamb", "onebit_lamb"):
            continue
        got = row_roles(r)
        total = sum(got.values())
        lines.append(f"| {task} | {r['optimizer']} | {fmt_bytes(total)} | "
                     + " | ".join(share(got[k], total) for k, _ in ROLES) + " |")
    return lines


def ledger_setting(shape: str, label: str = LEDGER_SLAMB) -> dict | None:
    """SLAMB's and 1-bit LAMB's bytes per step at the paper's settings for ``shape``, by role, from the ledger's
    measurements (results/comm_volume_raw.json; BERT-Large extrapolated in depth as bench.comm_volume does) and
    the recipe's settings (configs/): the parameter syncs every H steps, the compression warm-up's excess over
    the recipe's epochs, 1-bit LAMB's full-precision stage over DeepSpeed's share of the steps."""
    import yaml

    from bench.comm_volume import ONEBIT_WARMUP, PHASE1_STEPS, extrapolate
    from slamb.schedules import compression_ratio

    raw = json.loads(LEDGER.read_text())
    if shape == "ResNet-110":
        rows_, numel = raw["resnet110"], raw["resnet110_numel"]
        recipe = yaml.safe_load((ROOT / "configs" / "experiment" / "cifar10" / "slamb.yaml").read_text())["optimizer"]
        epochs = yaml.safe_load((ROOT / "configs" / "cifar10.yaml").read_text())["epochs"]
    else:
        rows_ = extrapolate({int(d): r for d, r in raw["bert_large_by_depth"].items()}, 24)
        numel = raw["bert_large_numel"]
        recipe = yaml.safe_load((ROOT / "configs" / "experiment" / "bert" / "phase1_slamb.yaml").read_text())["optimizer"]
        epochs = None
    slamb_, onebit = rows_[label], rows_["1-bit LAMB"]
    k, h = recipe["compress_ratio"], recipe["sync_interval"]
    sampled = slamb_.get("last_payload/momentum")
    if sampled is None:  # measured before the ledger's kinds were kept
        return None
    warm = recipe.get("compression_warmup")
    raised = sum(compression_ratio(e, k, warm) / k - 1 for e in range(epochs)) / epochs if warm and epochs else 0.0
    per_step = {"sampled": sampled, "warmup": sampled * raised, "dense": slamb_.get("last_payload/momentum_dense", 0),
                "params": slamb_["first_payload/params"] / h, "grads": 0, "onebit": 0,
                "control": slamb_.get("last_payload/control", 0)}
    full = ONEBIT_WARMUP / PHASE1_STEPS
    onebit_step = full * sum(v for key, v in onebit.items() if key.startswith("first_payload/")) + (1 - full) * sum(
        v for key, v in onebit.items() if key.startswith("last_payload/"))
    onebit_full = full * sum(v for key, v in onebit.items() if key == "first_payload/grads")
    return {"per_step": per_step, "numel": numel, "k": k, "H": h, "epochs": epochs, "warmup": warm,
            "dense_params": per_step["dense"] / FP32_BYTES / numel, "onebit_full_share": onebit_full / onebit_step,
            "vs_onebit": sum(per_step.values()) / onebit_step,
            "raised_epochs": sum(compression_ratio(e, k, warm) > k for e in range(epochs)) if warm and epochs else 0}


def in_kind(row: dict, onebit: dict | None) -> dict:
    """A measured SLAMB row as :func:`ledger_setting` gives the paper's: its bytes by role (whole runs, mean over
    the seeds), the share of its parameters in always-averaged tensors (fp32 exchange), and its bytes over 1-bit
    LAMB's."""
    got = row_roles(row)
    head = row["members"][0]["summary"]
    dense_params = got["dense"] / head["steps"] / FP32_BYTES / head["params"]
    return {"per_step": got, "dense_params": dense_params,
            "vs_onebit": sum(got.values()) / sum(row_roles(onebit).values()) if onebit else math.nan}


def pct(part: float, parts: dict) -> float:
    return 100 * part / sum(parts.values())


def bytes_section(rows_by_task: dict[str, list[dict]]) -> str:
    """Where SLAMB's bytes go in the study's runs, by the ledger's kinds, against the same roles at the paper's
    settings at ResNet-110's and BERT-Large's shapes (the ledger of bench.comm_volume): which of the in-kind
    sizes inflate SLAMB's bytes."""
    lines = ["## Where SLAMB's bytes go, in kind and at the paper's settings", "",
             "Bytes each worker handed to the collectives over the run, by what they carry (the ledger's kinds; mean "
             "over the seeds; share of the row's total). The compression warm-up's part is the sampled momentum that "
             "the periods at a raised k (the runs' metrics.jsonl log k per period) sent above the bytes per step of "
             "the periods at the target k; 1-bit LAMB's dense gradients are its full-precision stage, the "
             "hierarchical row's the average inside each node.", "",
             "| task | optimizer | total / worker | " + " | ".join(head for _, head in ROLES) + " |",
             "|---" * (3 + len(ROLES)) + "|"]
    for task, rows_ in rows_by_task.items():
        lines += breakdown_table(rows_, task)
    find = {task: ({r["optimizer"]: r for r in rows_}) for task, rows_ in rows_by_task.items()}
    measured = {}
    for task, name, label in (("digits", "SLAMB v1", "digits, ResNet-8 (in kind)"),
                              ("bert", "SLAMB", "BERT, 2 layers (in kind)")):
        if name in find.get(task, {}):
            measured[label] = (find[task][name], find[task].get("1-bit LAMB"))
    paper = {shape: ledger_setting(shape) for shape in ("ResNet-110", "BERT-Large")} if LEDGER.exists() else {}
    if not measured or not paper or None in paper.values():
        return "\n".join([*lines, "", f"No figures at the paper's settings: {LEDGER.relative_to(ROOT)} holds no "
                           "payload by kind (`python -m bench.comm_volume` measures it)." if measured else ""]) + "\n"
    settings = {label: in_kind(row, onebit) for label, (row, onebit) in measured.items()}

    def setting_of(row: dict) -> str:
        o = row["members"][0]["config"]["optimizer"]
        return (f"k {o['compress_ratio']:g}, H {o['sync_interval']}, T {o['min_compress_numel']:,}, "
                f"{row['members'][0]['summary']['steps']} steps"
                + (", the compression warm-up" if o.get("compression_warmup") else ""))

    lines += ["", "SLAMB's bytes by role in kind (measured, fp32 momentum) and at the paper's settings (the ledger of "
              f"`python -m bench.comm_volume` at the models' shapes, {LEDGER_SLAMB.split(' (')[0]} momentum, k and H "
              "of the recipe in configs/, per step averaged over the run: the syncs every H steps, the warm-up's "
              "excess over the recipe's epochs), share of SLAMB's bytes; and SLAMB's bytes over 1-bit LAMB's (at the "
              "paper's settings: 1-bit LAMB's full-precision stage over DeepSpeed's 1,000 of 7,038 steps).", "",
              "| setting | " + " | ".join(head for key, head in ROLES if key not in ("grads", "onebit"))
              + " | parameters in always-averaged tensors | SLAMB / 1-bit LAMB |", "|---" * 8 + "|"]
    rows_out = [(f"{label}: {setting_of(measured[label][0])}", settings[label]) for label in settings]
    threshold = optimizer_defaults("slamb")["min_compress_numel"]  # the ledger's SLAMB is built with the defaults
    for shape, got in paper.items():
        rows_out.append((f"{shape} (the ledger): k {got['k']:g}, H {got['H']}, T {threshold:,}, "
                         + (f"the compression warm-up over {got['epochs']} epochs" if got["warmup"] else "no warm-up"),
                         got))
    for label, got in rows_out:
        parts = got["per_step"]
        lines.append(f"| {label} | " + " | ".join(f"{pct(parts[key], parts):.1f}%" for key, _ in ROLES
                                                 if key not in ("grads", "onebit"))
                     + f" | {100 * got['dense_params']:.1f}% | "
                     + ("-" if math.isnan(got["vs_onebit"]) else f"{got['vs_onebit']:.2f}x") + " |")
    lines += ["", inflation(measured, settings, paper)]
    return "\n".join(lines) + "\n"


def inflation(measured: dict, settings: dict, paper: dict) -> str:
    """Which of the in-kind sizes inflate SLAMB's bytes against the paper's settings, from the figures of
    :func:`bytes_section`'s table: a role's share of SLAMB's bytes in kind beside its share at the paper's shapes."""
    from bench.comm_volume import ONEBIT_WARMUP, PHASE1_STEPS
    from slamb.schedules import compression_ratio

    digits, bert = (next((k for k in settings if k.lower().startswith(t)), None) for t in ("digits", "bert"))
    if digits is None:
        return ""
    row, onebit = measured[digits]
    got, res, large = settings[digits], paper["ResNet-110"], paper["BERT-Large"]
    o, head = row["members"][0]["config"]["optimizer"], row["members"][0]["summary"]
    share_of = {name: {k: pct(v, x["per_step"]) for k, v in x["per_step"].items()}
                for name, x in (("kind", got), ("res", res), ("large", large))}
    if bert:
        share_of["bert"] = {k: pct(v, settings[bert]["per_step"]) for k, v in settings[bert]["per_step"].items()}

    def verb(role: str) -> str:
        here, there = share_of["kind"][role], max(share_of["res"][role], share_of["large"][role])
        if here <= there:
            return "not inflated"
        return f"**inflated** ({here / there:.1f}x the larger of the two)" if there else "**inflated** (none there)"

    epochs = head["epochs"]
    raised = sum(compression_ratio(e, o["compress_ratio"], o["compression_warmup"]) > o["compress_ratio"]
                 for e in range(epochs)) if o.get("compression_warmup") else 0
    syncs = math.ceil(head["steps"] / o["sync_interval"])  # step 1 syncs too
    bert_o = measured[bert][0]["members"][0]["config"]["optimizer"] if bert else None
    said = [
        f"**Parameter syncs** (H = {o['sync_interval']} over {head['steps']} steps: {syncs} syncs of the whole model): "
        f"{share_of['kind']['params']:.1f}% of {row['optimizer']}'s bytes on the digits, against "
        f"{share_of['res']['params']:.1f}% at ResNet-110's shapes with the CIFAR-10 recipe's H = {res['H']} and "
        f"{share_of['large']['params']:.1f}% at BERT-Large's with H = {large['H']}"
        + (f" (BERT in kind, H = {bert_o['sync_interval']}: {share_of['bert']['params']:.1f}%)" if bert else "")
        + f": {verb('params')}.",
        f"**Always-averaged tensors** (the threshold T = {o['min_compress_numel']:,} against a {head['params']:,}-"
        f"parameter model): {100 * got['dense_params']:.1f}% of ResNet-8's parameters are in tensors under T or "
        f"with one dimension, sent whole every step: {share_of['kind']['dense']:.1f}% of {row['optimizer']}'s bytes, "
        f"against {100 * res['dense_params']:.1f}% of the parameters and {share_of['res']['dense']:.1f}% of the bytes "
        f"at ResNet-110's shapes and {100 * large['dense_params']:.1f}% and {share_of['large']['dense']:.1f}% at "
        f"BERT-Large's"
        + (f" (BERT in kind, T = {bert_o['min_compress_numel']:,}: {100 * settings[bert]['dense_params']:.1f}% and "
           f"{share_of['bert']['dense']:.1f}%)" if bert else "") + f": {verb('dense')}.",
        f"**Compression warm-up** (the reference code's per-epoch stages, k raised above {o['compress_ratio']:g} in "
        f"the first {raised} epochs): {raised} of {epochs} epochs here, {share_of['kind']['warmup']:.1f}% of "
        f"{row['optimizer']}'s bytes, against {res['raised_epochs']} of {res['epochs']} epochs and "
        f"{share_of['res']['warmup']:.1f}% at ResNet-110's shapes"
        + ("" if large["warmup"] else " (BERT-Large's recipe has none)") + f": {verb('warmup')}.",
    ]
    if onebit is not None:
        freeze = onebit["members"][0]["config"]["optimizer"]["freeze_step"]
        mine = row_roles(onebit)
        said.append(f"**1-bit LAMB's full-precision stage** is {freeze} of its {head['steps']} steps here "
                    f"({100 * freeze / head['steps']:.0f}%) and {ONEBIT_WARMUP:,} of {PHASE1_STEPS:,} in DeepSpeed's "
                    f"setting ({100 * ONEBIT_WARMUP / PHASE1_STEPS:.0f}%): {pct(mine['grads'], mine):.1f}% of its "
                    f"bytes here, {100 * large['onebit_full_share']:.1f}% at BERT-Large's shapes.")
    said.append(net(row["optimizer"], got, settings.get(bert), res, large,
                    [key for key in ("params", "dense", "warmup") if share_of["kind"][key] > max(
                        share_of["res"][key], share_of["large"][key])]))
    return "Which in-kind sizes inflate SLAMB's bytes against the paper's settings:\n\n" + "\n".join(
        f"- {x}" for x in said) + "\n"


def net(name: str, digits: dict, bert: dict | None, res: dict, large: dict, inflated: list[str]) -> str:
    """SLAMB's bytes over 1-bit LAMB's in kind and at the paper's settings, and whether the order carries over:
    said from the ratios, naming the roles that the in-kind sizes inflated."""
    fp16 = ledger_setting("BERT-Large", LEDGER_SLAMB.replace("fp32", "fp16"))
    kind = [x["vs_onebit"] for x in (digits, bert) if x is not None and not math.isnan(x["vs_onebit"])]
    paper = [res["vs_onebit"], large["vs_onebit"]]
    def ratio(x: dict) -> str:  # a task without a 1-bit LAMB row has no ratio in kind
        return "no 1-bit LAMB row" if math.isnan(x["vs_onebit"]) else f"{x['vs_onebit']:.2f}x 1-bit LAMB's bytes"

    text = (f"Net: {name} on the digits: {ratio(digits)}"
            + (f" (BERT in kind: {ratio(bert)})" if bert is not None else "")
            + f"; at the paper's settings the ledger gives {res['vs_onebit']:.2f}x at ResNet-110's shapes and "
              f"{large['vs_onebit']:.2f}x at BERT-Large's with fp32 momentum"
            + (f" ({fp16['vs_onebit']:.2f}x with the paper's fp16 momentum)" if fp16 else "") + ". ")
    names = [{"params": "parameter syncs", "dense": "always-averaged tensors", "warmup": "compression warm-up"}[key]
             for key in inflated]
    roles_ = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    if kind and min(kind) > 1 and max(paper) < 1:
        return text + ("So SLAMB's bytes are above 1-bit LAMB's in kind and below them at the paper's settings: the "
                       "in-kind comparison of bytes does not carry to the paper's setting" + (
                           f"; the roles the in-kind sizes inflate are the {roles_}." if inflated else "."))
    if kind and max(kind) < 1 and max(paper) < 1:
        return text + "SLAMB sends fewer bytes than 1-bit LAMB in kind and at the paper's settings alike."
    if kind and min(kind) > 1 and min(paper) > 1:
        return text + "SLAMB sends more bytes than 1-bit LAMB in kind and at the paper's settings alike."
    if not kind:
        return text + "Nothing in kind to set beside them."
    return text + "The order of SLAMB's and 1-bit LAMB's bytes differs between the settings compared here."


# ------------------------------------------------------------------------------------------- pages


def bert_curves(rows_: list[dict], out: Path) -> Path:
    """Validation MLM loss of the averaged model vs step and vs bytes sent: each row's mean over its seeds,
    shaded ± one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows_:
        hists = [[h for h in m["history"] if "val_mlm_loss" in h] for m in r["members"]]
        length = min(len(h) for h in hists)
        steps = [hists[0][i]["step"] for i in range(length)]
        loss = [stat(h[i]["val_mlm_loss"] for h in hists) for i in range(length)]
        mean = [m for m, _, _ in loss]
        low, high = ([m + sign * (sd if len(hists) > 1 else 0.0) for m, sd, _ in loss] for sign in (-1, 1))
        mb = [statistics.fmean(h[i]["bytes_cum/all"] for h in hists) / 1e6 for i in range(length)]
        label = f"{r['optimizer']}, n={len(hists)}"
        for ax, x in ((ax1, steps), (ax2, mb)):
            (line,) = ax.plot(x, mean, label=label)
            ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax1.set(xlabel="step", ylabel="validation MLM loss",
            title="study_bert: validation MLM loss vs step (mean ± sd over seeds)")
    ax2.set(xlabel="MB sent per worker (cumulative)", ylabel="validation MLM loss", xscale="log",
            title="validation MLM loss vs bytes sent")
    return save_figure(fig, (ax1, ax2), out / "study_bert_curves.png")


def bert_table(rows_: list[dict]) -> str:
    lines = ["| Optimizer | validation MLM loss | validation MLM acc (%) | training loss (MLM + NSP) | "
             "bytes sent / worker | vs LAMB | configuration | n |", "|---|---|---|---|---|---|---|---|"]
    for r in rows_:
        acc = [m["history"][-1].get("val_mlm_acc") for m in r["members"]]
        lines.append(f"| {r['optimizer']} | {pm(r['val_mlm_loss_stat'], 4)} | {pm(stat(acc))} | "
                     f"{pm(r['loss_stat'], 4)} | {fmt_bytes(r['bytes_per_worker'])} | {r['bytes_vs_lamb']:.3f}x | "
                     f"{r['configuration']} | {r['runs']} |")
    return "\n".join(lines) + "\n"


def other_kinds(rows_: list[dict]) -> str:
    """What the bytes table's "other" column holds, row by row: the ledger's kinds outside the demo's split."""
    from cifar10.demo import KINDS

    known = {k for k, _ in KINDS} | {"all"}
    parts = [f"{r['optimizer']}: " + ", ".join(k for k in sorted(r["bytes_by_kind"]) if k not in known)
             for r in rows_ if set(r["bytes_by_kind"]) - known]
    return ("\"other\" is the ledger's kinds of the compressed exchanges (" + "; ".join(parts) + ").\n") if parts else ""


PLATEAU = {"digits": 0.3, "bert": 0.02}  # LAMB's mean may move this little over the last 20% (points; fraction)


def last_fifth(hists: list[list[dict]], key: str, when: str) -> tuple[float, float, int, int]:
    """Mean over the runs of ``key`` at the entry 80% of the way through the runs and at the last one, and the
    ``when`` (epoch or step) of both."""
    length = min(len(h) for h in hists)
    at = max(0, math.ceil(0.8 * length) - 1)
    before, last = (statistics.fmean(h[i][key] for h in hists) for i in (at, length - 1))
    return before, last, hists[0][at][when], hists[0][length - 1][when]


def digits_plateau(rows_: list[dict]) -> str:
    """How much each row's mean test top-1 moved over the last 20% of the epochs; LAMB's decides whether the
    study compares converged runs."""
    parts, lamb = [], None
    for r in rows_:
        before, last, e0, e1 = last_fifth([m["history"] for m in r["members"]], "test_top1", "epoch")
        parts.append(f"{r['optimizer']} {last - before:+.2f}")
        if r["optimizer"] == "LAMB":
            lamb = (last - before, e0, e1)
    if lamb is None:
        return ""
    moved, e0, e1 = lamb
    ok = abs(moved) < PLATEAU["digits"]
    return (f"Convergence: LAMB's mean top-1 moved {moved:+.2f} points from epoch {e0} to epoch {e1} (the last 20% of "
            f"the epochs): {'under' if ok else 'NOT under'} the {PLATEAU['digits']:g}-point plateau criterion"
            + ("" if ok else ", so the rows are compared before LAMB has converged") + ". Every row over the same "
            "epochs: " + ", ".join(parts) + ".\n")


def digits_section(runs: list[dict], out: Path, grid_records: Path) -> tuple[str, list[str], dict]:
    """The digits part of the page, its verdicts, and the learning-rate grid's record (:func:`grid_section`)."""
    from cifar10.demo import bytes_markdown

    build_tables(runs, out)
    rows_ = comparison_rows(runs)
    lines = verdicts(rows_, "digits")
    grid, grid_record = grid_section(load_runs(grid_records, log=lambda _: None) if grid_records.exists() else [],
                                     rows_)
    text = "\n".join([(out / f"{TABLES['digits']}.md").read_text(), digits_plateau(rows_), *([grid] if grid else []),
                      bytes_markdown(rows_), other_kinds(rows_),
                      f"![accuracy vs epoch and vs bytes]({TABLES['digits']}_curves.png)", ""])
    return text, lines, grid_record


def bert_section(runs: list[dict], out: Path, data: dict) -> tuple[str, list[str]]:
    from cifar10.demo import bytes_markdown

    build_tables(runs, out)  # the pipeline's own pre-training table, study_bert_phase1.md / .csv
    rows_ = pretrain_rows(runs)
    head = rows_[0]
    curves = bert_curves(rows_, out)
    intro = (f"Phase-1 pre-training (seq {head['seq_len']}, global batch {head['global_batch']} = {head['workers']} "
             f"workers x {head['members'][0]['summary']['micro_batch']} x "
             f"{head['members'][0]['summary']['accumulation_steps']} micro-batches, {head['steps']} steps, "
             f"{head['params']:,} parameters) on {data['train_words']:,} words of standard-library docstrings "
             f"({data['train_examples']:,} sequences, {data['dupe_factor']} maskings); validation: "
             f"{data['valid_words']:,} words of held-out files ({data['valid_examples']:,} sequences, one fixed "
             f"masking), vocabulary {data['vocab_size']:,} WordPiece tokens. Validation MLM loss (mean over the "
             "masked tokens) and accuracy of the ranks' averaged model at the last step, mean ± standard deviation "
             "over the n seeds; training loss of the last logged period; bytes = payload each worker handed to "
             "the collectives.")
    text = "\n".join([f"### {TABLES['bert']}", "", intro, "", bert_table(rows_), bert_learning(rows_, data),
                      bytes_markdown(rows_), other_kinds(rows_),
                      f"![validation MLM loss vs step and vs bytes]({curves.name})", ""])
    return text, verdicts(rows_, "bert")


def bert_learning(rows_: list[dict], data: dict) -> str:
    """Whether the runs learned context (LAMB's loss against the unigram line) and had converged (each row's
    relative improvement over the last 20% of the steps; LAMB's decides)."""
    ends = {}
    for r in rows_:
        hists = [[h for h in m["history"] if "val_mlm_loss" in h] for m in r["members"]]
        ends[r["optimizer"]] = last_fifth(hists, "val_mlm_loss", "step")
    if "LAMB" not in ends:
        return ""
    before, last, s0, s1 = ends["LAMB"]
    lines = []
    unigram = data.get("unigram_entropy")
    if unigram is not None:
        below = unigram - last
        lines.append(f"Reference line: the unigram cross-entropy of the validation masked tokens (the training "
                     f"shards' token frequencies, no context) is {unigram:.3f} nats. LAMB's final validation MLM "
                     f"loss is {below:.3f} nats below it: "
                     + ("at least the 0.5 nats that show a model that learned context." if below >= 0.5 else
                        "NOT the 0.5 nats that show a model that learned context, so the rows are compared before "
                        "it has."))
    gain = (before - last) / before
    lines.append(f"Convergence: LAMB's mean validation MLM loss improved {100 * gain:.2f}% from step {s0} to step {s1} "
                 f"(the last 20% of the steps): {'under' if gain < PLATEAU['bert'] else 'NOT under'} the "
                 f"{100 * PLATEAU['bert']:g}% plateau criterion. Every row over the same steps: "
                 + ", ".join(f"{row} {100 * (b - l) / b:.2f}%" for row, (b, l, _, _) in ends.items()) + ".")
    return "\n\n".join(lines) + "\n"


def provenance(metas: list[dict], invocations: list[dict], now: dict) -> str:
    """The commits the page's runs ran at (each run's meta.json), the one that wrote the page, and the machine's
    1-minute load average at the start and end of each invocation that ran runs (``invocations.json``)."""
    def commit(git: dict) -> str:
        return str(git.get("commit", "unknown"))[:10] + (" (with uncommitted changes)" if git.get("dirty") else "")

    counts: dict[str, int] = {}
    for meta in metas:
        counts[commit(meta.get("git") or {})] = counts.get(commit(meta.get("git") or {}), 0) + 1
    ran = "; ".join(f"{c}: {n} run{'s' if n > 1 else ''}" for c, n in sorted(counts.items(), key=lambda x: -x[1]))
    loads = [x for x in invocations if x.get("load_avg")]
    load = ("The machine's 1-minute load average at the start and end of each invocation that ran runs: "
            + ", ".join(f"{x['load_avg'][0]:g} to {x['load_avg'][1]:g} ({x['started']})" for x in loads) + "."
            if loads else "The machine's load was not recorded for these runs.")
    return f"Commits: the runs ran at {ran or 'no recorded commit'}; this page was written at {commit(now)}. {load}"


def page(parts: dict, args, times: dict) -> str:
    cmd = "make study" if not args.quick else "python scripts/study.py --quick"
    run_args = [a for a in args.argv if a != "--report-only"]
    if "--machine" in run_args:  # a description of where it ran, not part of the command
        i = run_args.index("--machine")
        del run_args[i:i + 2]
    lines = ["# SLAMB vs LAMB, reproduced in kind on a CPU", "",
             "Written by `scripts/study.py` from the runs it started: every table, curve and verdict is computed from them.", "",
             f"Command: `{cmd}` (`{' '.join(['python scripts/study.py', shown_command(run_args)]).strip()}`)"
             + ("; this page rebuilt from its runs with `--report-only`" if args.report_only else "") + ". "
             f"Wall time: {sum(times.values()) / 60:.1f} min in all ("
             + ", ".join(f"{'learning-rate grid' if k == 'tune' else k} {v / 60:.1f} min" for k, v in times.items())
             + f") on {args.machine}.", "", provenance(args.metas, args.invocations, args.commit), "",
             "## Verdicts", ""]
    for task, (_, verdict_lines) in parts.items():
        lines += [f"- **{task}**: {v}" for v in verdict_lines]
    lines += ["", "95% CI: Welch t-interval over the seeds of the difference SLAMB − LAMB (or − tuned AdamW; "
              "scipy.stats.ttest_ind, "
              "unequal variances); bytes: each worker's payload over the whole run, ratio of the rows' means.", "",
              "## What differs from the paper", ""]
    differs = {
        "digits": "- Images: the paper trains ResNet-110 on CIFAR-10 for 200 epochs on 4 GPUs (global batch 1,024); "
                  "here ResNet-8 on scikit-learn's 1,797 digits (upsampled to 32x32 RGB) for the epochs in the table, "
                  "4 CPU workers x 64 (global batch 256, 17% of the training set per step: a large batch for the "
                  "data, as in the paper's setting). SLAMB's H and the warm-up stages of DGC and 1-bit LAMB are "
                  "scaled to the run (the note under the table). The page checks that LAMB has plateaued (under "
                  "the table), since the paper compares final accuracies.",
        "bert": "- Text: the paper pre-trains BERT-Large on Wikipedia + BookCorpus (phase 1: 7,038 steps at global "
                "batch 65,536, fp16, 128 GPUs) and reports the validation MLM loss; here a 2-layer BERT with hidden "
                "size 64 on standard-library docstrings, fp32, 4 CPU workers, with SLAMB's H and 1-bit LAMB's "
                "full-precision stage scaled to the run, and SLAMB's momentum exchanged in fp32 like LAMB's "
                "gradients (the paper exchanges fp16 in both).",
    }
    lines += [differs[task] for task in parts]
    lines += ["- Every row uses the published hyper-parameters of its optimizer, not ones tuned on these tasks"
              + (", but AdamW's learning rate, chosen on a validation split by a grid that also ran LAMB's (the "
                 "digits section)." if args.grid else "."), "", RERUN_DRIFT, ""]
    for task, (text, _) in parts.items():
        lines += [f"## {'Images: digits, ResNet-8' if task == 'digits' else 'Text: BERT pre-training'}", "", text]
    lines += [bytes_section(args.rows_by_task)] if args.rows_by_task else []
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- main

QUICK = {  # tiny sizes: every step of the study once, in about a minute (tests/test_study.py)
    "digits_rows": ["study/digits_lamb", "study/digits_slamb_v1"],
    "digits": ["epochs=1", "schedule.milestones=[1]", "trainer.nproc_per_node=2", "trainer.device=cpu",
               "data.micro_batch=128"],
    "bert_rows": ["study/bert_lamb", "study/bert_slamb"],
    "bert": ["steps=4", "log_every=2", "data.global_batch=32", "data.micro_batch=16", "trainer.nproc_per_node=2",
             "trainer.device=cpu",
             "trainer.checkpoint.every=4", "model.hidden_size=32", "model.intermediate_size=64",
             "model.num_attention_heads=2"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (2 rows per task, 2 seeds of "
                        "digits and 1 of BERT, 2 workers), "
                        "written to runs/study-quick unless --out is given")
    parser.add_argument("--tasks", nargs="+", default=list(TABLES), choices=list(TABLES))
    parser.add_argument("--out", default=None, help="where the page, tables and plots go (default: results/study, "
                        "or runs/study-quick/results with --quick)")
    parser.add_argument("--runs", default=None, help="where the run directories go (default: runs/study[-quick]); "
                        "each finished run's record is kept under <out>/runs, and a (row, seed) that has one is not "
                        "run again, so a stopped study continues (delete <out>/runs to start over)")
    parser.add_argument("--digits-seeds", type=int, nargs="+", default=None, help="the seeds of every row, "
                        "without top-ups (default 0..4 (quick: 0 1), then more for LAMB and each SLAMB row whose "
                        "interval is wider than ±1 point, up to --digits-max-seeds)")
    parser.add_argument("--bert-seeds", type=int, nargs="+", default=None, help="likewise (default 0..2 (quick: 0), "
                        "then top-ups to ±0.05 nats, up to --bert-max-seeds)")
    parser.add_argument("--digits-max-seeds", type=int, default=20)
    parser.add_argument("--bert-max-seeds", type=int, default=6)
    parser.add_argument("--rows", nargs="+", default=None, help="run only these rows (file names in "
                        "configs/experiment/study/, without .yaml) beside the runs already under --runs; their time "
                        "is added to the task's")
    parser.add_argument("--report-only", action="store_true", help="rebuild the page from the existing runs")
    parser.add_argument("--tune", action="store_true", help="run the learning-rate grid of AdamW and LAMB on the "
                        "digits recipe with a validation split held out of the training set (its records under "
                        "<out>/runs/tune), and no task's rows; the page is rebuilt from the records")
    parser.add_argument("--tune-rows", nargs="+", choices=list(GRID_ROWS), default=None, help="the grid of these "
                        "rows only (two invocations side by side, one row each, with their own --runs)")
    parser.add_argument("--machine", default=None, help="where the runs ran, for the page's wall time "
                        "(default: the number of CPU cores)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    scratch = ROOT / "runs" / ("study-quick" if args.quick else "study")
    runs_root = Path(args.runs) if args.runs else scratch
    out = Path(args.out) if args.out else (scratch / "results" if args.quick else ROOT / "results" / "study")
    seeds = {"digits": args.digits_seeds or ([0, 1] if args.quick else [0, 1, 2, 3, 4]),
             "bert": args.bert_seeds or ([0] if args.quick else [0, 1, 2])}
    # named seeds are the runs, as are the quick study's; otherwise the spread decides how many more
    cap = {task: len(seeds[task]) if (args.quick or named) else maximum for task, named, maximum in
           (("digits", args.digits_seeds, args.digits_max_seeds), ("bert", args.bert_seeds, args.bert_max_seeds))}
    chosen = {task: seeds[task] if cap[task] == len(seeds[task]) else None for task in seeds}
    args.machine = args.machine or f"{os.cpu_count()} CPU cores"
    out.mkdir(parents=True, exist_ok=True)
    records = out / "runs"
    times_path = records / "times.json"

    def add_time(task: str, seconds: float) -> None:
        """The records keep the time the runs took: each invocation adds its own, read and written at once,
        so that two invocations running side by side (one task each) both count."""
        times_path.parent.mkdir(parents=True, exist_ok=True)
        now = json.loads(times_path.read_text()) if times_path.exists() else {}
        now[task] = now.get(task, 0.0) + seconds
        times_path.write_text(json.dumps(now))
    parts, data, record = {}, None, {}
    args.grid, args.rows_by_task, args.metas = {}, {}, []
    # what this invocation leaves in the records: its commit and the load it ran under, when it runs anything
    started, load0 = time.strftime("%Y-%m-%d %H:%M"), round(os.getloadavg()[0], 2)
    times_before = times_path.read_text() if times_path.exists() else None
    data_root = runs_root / "data"

    if "digits" in args.tasks:
        from cifar10.data import write_digits

        digits_dir = data_root / "digits-cifar10-layout"
        sweep = runs_root / "digits"
        todo = QUICK["digits_rows"] if args.quick else rows("digits", args.rows)
        if not args.report_only and not args.tune and todo:
            write_digits(digits_dir)
            overrides = [f"data.dir={digits_dir}", *(QUICK["digits"] if args.quick else [])]
            compared, context = verdict_rows_first(todo)
            spent = functools.partial(add_time, "digits")
            run_missing("cifar10.train", compared, seeds["digits"], sweep, records / "digits", overrides, spent)
            top_up("cifar10.train", sweep, records / "digits", "digits", overrides, cap["digits"], spent)
            # the tuned AdamW row, which SLAMB v1 is compared with too, at LAMB's seeds (those it had top-ups to)
            matched = [e for e in context if e.endswith("_adamw")]
            lamb_seeds = sorted({r["config"]["seed"] for r in task_runs(records / "digits", "digits")
                                 if r["config"]["name"] == "study_digits_lamb"}) or seeds["digits"]
            run_missing("cifar10.train", matched, lamb_seeds, sweep, records / "digits", overrides, spent)
            run_missing("cifar10.train", [e for e in context if e not in matched], seeds["digits"], sweep,
                        records / "digits", overrides, spent)
        if args.tune:
            write_digits(digits_dir)
            grid = QUICK_GRID if args.quick else {}
            tune(runs_root / "tune", records / "tune",
                 [f"data.dir={digits_dir}", *(QUICK["digits"] if args.quick else [])],
                 functools.partial(add_time, "tune"), rows_=args.tune_rows, **grid)
        keep_records(sweep, records / "digits")
        runs = task_runs(records / "digits", "digits", chosen["digits"]) if (records / "digits").exists() else []
        if runs:  # (a grid run before any row has only its records to show)
            text, lines, args.grid = digits_section(runs, out, records / "tune")
            parts["digits"] = (text, lines)
            args.rows_by_task["digits"] = comparison_rows(runs)
            args.metas += [r["meta"] for r in runs]
            record["digits"] = per_run(runs, "digits")
            record["lr_grid"] = args.grid

    if "bert" in args.tasks:
        sweep, bert_root = runs_root / "bert", data_root / "bert"
        data_json, record_json = bert_root / "data.json", records / "bert_data.json"
        todo = QUICK["bert_rows"] if args.quick else rows("bert", args.rows)
        if not args.report_only and not args.tune and todo:
            tic = time.perf_counter()
            if data_json.exists():  # a continued study trains on the data its first runs had
                data = json.loads(data_json.read_text())
            else:
                data = bert_data(bert_root, vocab_size=400 if args.quick else 2000,
                                 dupe_factor=1 if args.quick else 3, limit_files=60 if args.quick else None)
                data_json.write_text(json.dumps(data, indent=1))
            data.setdefault("digest", data_digest(bert_root))  # data prepared before digests were recorded
            recorded = json.loads(record_json.read_text()) if record_json.exists() else {}
            ran = records.joinpath("bert").exists() and load_runs(records / "bert", log=lambda _: None)
            if ran and recorded.get("digest") != data["digest"]:
                raise SystemExit(f"error: the BERT runs recorded in {records / 'bert'} read other data than "
                                 f"{bert_root} (digest {str(recorded.get('digest'))[:12]} against "
                                 f"{data['digest'][:12]}: another Python's standard library); fix: run the "
                                 f"study with the Python of the recorded runs ({recorded.get('python', '?')}), or "
                                 f"delete {records / 'bert'} to start the task over")
            record_json.parent.mkdir(parents=True, exist_ok=True)
            record_json.write_text(json.dumps({**data, "python": sys.version.split()[0]}, indent=1))
            prep = time.perf_counter() - tic
            overrides = [f"data.dir={data['train_dir']}", f"validation.dir={data['valid_dir']}",
                         f"model.vocab_size={data['vocab_size']}", *(QUICK["bert"] if args.quick else [])]
            compared, context = verdict_rows_first(todo)
            spent = functools.partial(add_time, "bert")
            spent(prep)
            run_missing("bert.train", compared, seeds["bert"], sweep, records / "bert", overrides, spent)
            top_up("bert.train", sweep, records / "bert", "bert", overrides, cap["bert"], spent)
            run_missing("bert.train", context, seeds["bert"], sweep, records / "bert", overrides, spent)
        keep_records(sweep, records / "bert")
        data = json.loads(record_json.read_text())
        runs = task_runs(records / "bert", "bert", chosen["bert"])
        parts["bert"] = bert_section(runs, out, data)
        args.rows_by_task["bert"] = pretrain_rows(runs)
        args.metas += [r["meta"] for r in runs]
        record["bert"] = per_run(runs, "bert")

    if "digits" in args.tasks and args.grid:
        args.metas += [r["meta"] for r in load_runs(records / "tune", log=lambda _: None)]
    invocations_path = records / "invocations.json"
    args.invocations = json.loads(invocations_path.read_text()) if invocations_path.exists() else []
    args.commit = git_revision(ROOT)
    if (times_path.read_text() if times_path.exists() else None) != times_before:  # it ran runs
        args.invocations.append({"started": started, "command": shown_command(args.argv), **args.commit,
                                 "load_avg": [load0, round(os.getloadavg()[0], 2)]})
        invocations_path.write_text(json.dumps(args.invocations, indent=1))
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    text = page(parts, args, {task: times[task] for task in [*parts, "tune"] if task in times and
                              (task != "tune" or args.grid)})
    (out / "README.md").write_text(text)
    # the data's folders as the page would show them: the json names no folder of the machine either
    shown_data = data and {k: shown_path(v) if isinstance(v, str) and v.startswith("/") else v for k, v in data.items()}
    (out / "study.json").write_text(json.dumps({"runs": record, "verdicts": {k: v[1] for k, v in parts.items()},
                                                "wall_time_s": times, "bert_data": shown_data}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
