"""make study (scripts/study.py): the page's numbers are the runs' numbers, and the verdict's interval is Welch's."""
from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from scipy import stats

from harness.records import RECORD

ROOT = Path(__file__).resolve().parents[1]


def load_study():
    spec = importlib.util.spec_from_file_location("study_script", ROOT / "scripts" / "study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def welch_by_hand(a, b, level=0.95):
    """Welch's interval from its textbook formula (Welch-Satterthwaite degrees of freedom)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = stats.t.ppf(0.5 + level / 2, df) * math.sqrt(va + vb)
    d = statistics.fmean(a) - statistics.fmean(b)
    return d, d - half, d + half


def test_welch_interval_and_verdict_on_known_numbers():
    study = load_study()
    slamb, lamb = [96.0, 97.0, 95.5, 96.5, 97.5], [97.0, 97.5, 96.0, 98.0, 97.0]
    d, lo, hi = study.welch_interval(slamb, lamb)
    assert (d, lo, hi) == pytest.approx(welch_by_hand(slamb, lamb), abs=1e-12)
    assert d == pytest.approx(-0.6) and lo < d < hi
    # equal variances and sizes: df = 2n - 2 = 8, half-width t(0.975, 8) x sqrt(2 var / n) = 2.306 x 1 exactly
    d, lo, hi = study.welch_interval([1, 2, 3, 4, 5], [2, 3, 4, 5, 6])
    assert (d, lo, hi) == pytest.approx((-1.0, -1.0 - 2.3060041, -1.0 + 2.3060041), abs=1e-6)

    text = study.verdict("SLAMB v1", [1, 2, 3, 4, 5], [2, 3, 4, 5, 6], 0.36, unit="points", metric="test top-1",
                         higher_is_better=True, delta=1.0)
    assert text == ("SLAMB v1's averaged model is 1.00 points below LAMB's test top-1 (95% CI -3.31 to +1.31, "
                    "±2.31: wider than the ±1 target; n = 5 and 5): **undecided, interval ±2.31**, at 0.360x "
                    "LAMB's bytes per worker.")
    text = study.verdict("SLAMB", [2.0, 2.1, 2.05], [2.5, 2.6, 2.55], 0.1, unit="nats", metric="validation MLM loss",
                         higher_is_better=False, delta=0.05)
    assert "0.5000 nats below LAMB's validation MLM loss" in text and "**better than LAMB**" in text
    assert "one seed" in study.verdict("SLAMB", [2.0], [2.5], 0.1, unit="nats", metric="validation MLM loss",
                                        higher_is_better=False, delta=0.05)


def test_verdicts_are_equivalence_statements_at_the_margin():
    study = load_study()
    j = lambda lo, hi, higher=True: study.judgement(lo, hi, 1.0, higher_is_better=higher, digits=2)  # noqa: E731
    assert j(-0.6, 0.4) == "equivalent within ±1"                    # inside the margin, 0 inside too
    assert j(-0.9, -0.1) == "worse than LAMB and equivalent within ±1"  # both hold: a small, certain loss
    assert j(-2.5, -1.5) == "worse than LAMB"
    assert j(0.2, 1.7) == "better than LAMB"
    assert j(-0.2, 0.3, higher=False) == "equivalent within ±1"
    assert j(0.1, 0.3, higher=False) == "worse than LAMB and equivalent within ±1"  # a higher loss is worse
    assert j(-1.4, 1.2) == "undecided, interval ±1.30"
    assert j(math.nan, math.nan) == "no interval"


def test_seeds_for_reaches_the_margin_with_the_spread_it_saw():
    """The runs per row at which Welch's interval with these spreads is within the margin: the smallest n at
    which welch_by_hand on samples of that spread would be, checked one below and at it."""
    study = load_study()
    a, b = [96.0, 97.3, 96.6, 95.1, 97.9], [97.5, 96.0, 98.0, 97.0, 96.4]
    n = study.seeds_for(a, b, 1.0, cap=50)
    va, vb = statistics.variance(a), statistics.variance(b)

    def half(k):  # Welch's half-width for k runs of each with these variances
        se2 = (va + vb) / k
        df = se2 ** 2 / (((va / k) ** 2 + (vb / k) ** 2) / (k - 1))
        return stats.t.ppf(0.975, df) * math.sqrt(se2)

    assert 5 < n < 50 and half(n) <= 1.0 < half(n - 1)
    assert study.seeds_for(a, b, 1.0, cap=8) == 8  # never more than the cap
    assert study.seeds_for(a, b, 10.0, cap=50) == 5  # already within: the runs there are


def test_top_up_plan_asks_for_more_runs_of_lamb_and_the_wide_rows_only():
    study = load_study()

    def row(name, file, values, slamb=True):
        return {"optimizer": name, "runs": len(values), "settings": {"optimizer.name": "slamb" if slamb else "lamb"},
                "members": [{"config": {"name": f"study_{file}"}, "summary": {"final_test_top1": v}} for v in values]}

    lamb = row("LAMB", "digits_lamb", [97.0, 96.0, 98.0, 97.5, 96.5], slamb=False)
    wide = row("SLAMB v1", "digits_slamb_v1", [95.0, 97.5, 96.0, 98.0, 94.5])
    narrow = row("SLAMB v2", "digits_slamb_v2", [97.0, 97.1, 96.9, 97.0, 97.05])
    sgd = row("SGD-M", "digits_sgd", [80.0, 90.0, 85.0, 70.0, 95.0], slamb=False)  # wide, but no verdict
    # within ±1 wide but not decided: its interval straddles -1 (a difference of -0.45, as the study saw)
    shifted = row("SLAMB int8", "digits_slamb_int8", [96.2, 97.4, 96.6, 97.3, 96.8])
    plan = study.top_up_plan([lamb, wide, narrow, sgd, shifted], "digits", cap=20)
    lamb_values = study._metric_values(lamb, "digits")

    def runs_needed(r):  # the half-width that decides: inside ±1, or clear of 0, with the difference seen so far
        d, _, _ = study.welch_interval(study._metric_values(r, "digits"), lamb_values)
        return study.seeds_for(study._metric_values(r, "digits"), lamb_values, min(1.0, max(1 - abs(d), abs(d))), 20)

    d, lo, hi = study.welch_interval(study._metric_values(shifted, "digits"), lamb_values)
    assert (hi - lo) / 2 <= 1.0 and lo < -1.0 < d  # narrow enough, yet undecided
    n_wide, n_shifted = runs_needed(wide), runs_needed(shifted)
    assert plan == {"study/digits_lamb": max(n_wide, n_shifted), "study/digits_slamb_v1": n_wide,
                    "study/digits_slamb_int8": n_shifted} and min(n_wide, n_shifted) > 5


def grid_run(study, row, lr, seed, top1, loss):
    """A run of the learning-rate grid as load_runs gives it: scored on the validation split, no test metric."""
    return {"config": {"paper": {"table": study.GRID_TABLE, "row": row}, "optimizer": {"lr": lr}, "seed": seed},
            "summary": {"final_valid_top1": top1, "final_valid_loss": loss, "steps": 200},
            "history": [{"epoch": 40, "valid_top1": top1, "valid_loss": loss}],
            "identity": {"data": {"data.valid_images": {"counts": {"train": 1280, "valid": 220}}}}}


def test_the_grid_chooses_the_best_validation_top1_and_says_whether_the_rows_run_at_it():
    study = load_study()
    assert [study.grid_lr(1e-3, i) for i in range(-3, 4)] == [3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
    runs = [grid_run(study, "AdamW", lr, s, top1, loss) for lr, s, top1, loss in
            [(1e-3, 0, 97.0, 0.20), (1e-3, 1, 98.0, 0.10), (3e-3, 0, 98.5, 0.12), (3e-3, 1, 96.5, 0.11),
             (1e-2, 0, 90.0, 0.5), (1e-2, 1, 91.0, 0.4)]]
    runs += [grid_run(study, "LAMB", lr, s, top1, 0.1) for lr, s, top1 in
             [(3e-3, 0, 97.0), (3e-3, 1, 97.0), (1e-2, 0, 97.5), (1e-2, 1, 97.5), (3e-2, 0, 98.0), (3e-2, 1, 99.0)]]
    cells = study.grid_cells(runs)
    # AdamW: 1e-3 and 3e-3 tie at a mean of 97.5; 3e-3's validation loss is the lower
    assert study.grid_choice(cells["AdamW"]) == 3e-3 and study.grid_choice(cells["LAMB"]) == 3e-2

    def row(name, lr):
        return {"optimizer": name, "members": [{"config": {"optimizer": {"lr": lr}}}]}

    text, record = study.grid_section(runs, [row("AdamW", 3e-3), row("LAMB", 1e-2)])
    assert record["AdamW"]["chosen_lr"] == 3e-3 and record["LAMB"]["chosen_lr"] == 3e-2
    assert [r["valid_top1"] for r in record["AdamW"]["grid"]["0.001"]] == [97.0, 98.0]
    assert "| 0.003 | **97.50 ± 1.41 (n = 2)** | 0.1150 ± 0.0071 | 97.00 ± 0.00 (n = 2) | 0.1000 ± 0.0000 |" in text
    assert "trained on 1,280 of the 1,500 training images and scored on the other 220" in text
    assert "No run of the grid read the test split" in text
    assert "- AdamW: the grid chose lr 0.003, the learning rate its study row runs at." in text
    assert ("- LAMB: the grid chose lr 0.03 (at the edge of the grid as run: a wider grid may choose otherwise), "
            "NOT the learning rate its study row runs at (0.01)") in text
    runs[0]["history"][0]["test_top1"] = 97.0  # a grid run that scored the test split is called out
    assert "1 run of the grid read the test splits: the choice below is NOT independent" in study.grid_section(
        runs, [])[0]
    assert study.grid_section([], []) == ("", {})


def test_slamb_v1_is_also_judged_against_the_tuned_adamw_row():
    study = load_study()

    def row(name, file, values, optimizer, nbytes):
        return {"optimizer": name, "runs": len(values), "settings": {"optimizer.name": optimizer},
                "bytes_per_worker": nbytes,
                "members": [{"config": {"name": f"study_{file}"}, "summary": {"final_test_top1": v}} for v in values]}

    lamb = row("LAMB", "digits_lamb", [97.0, 96.0, 98.0], "lamb", 60.0)
    adamw = row("AdamW", "digits_adamw", [96.0, 95.5, 96.5], "adamw", 60.0)
    v1 = row("SLAMB v1", "digits_slamb_v1", [97.5, 97.0, 96.0], "slamb", 21.0)
    v2 = row("SLAMB v2", "digits_slamb_v2", [97.5, 97.0, 96.0], "slamb", 21.0)
    lines = study.verdicts([adamw, lamb, v1, v2], "digits")
    assert len(lines) == 3 and lines[:2] == study.verdicts([lamb, v1, v2], "digits")  # v1 only, after the LAMB ones
    d, lo, hi = welch_by_hand([97.5, 97.0, 96.0], [96.0, 95.5, 96.5])
    assert lines[2].startswith(f"SLAMB v1's averaged model is {d:.2f} points above tuned AdamW's test top-1 "
                               f"(95% CI {lo:+.2f} to {hi:+.2f}")
    assert lines[2].endswith(f"at {21 / 60:.3f}x tuned AdamW's bytes per worker.")


def test_bytes_by_role_add_up_to_the_ledgers_total_and_the_warm_up_is_what_a_raised_k_sent_above_the_target():
    study = load_study()
    # two warm-up periods (k 0.5 and 0.2) and two at the target 0.1, 5 steps each; the sampled bytes per step at
    # 0.1 are 100 and 110 in the steady periods (a mask's rounding): 105 on average
    history = [{"compress_ratio": k, "period_steps": 5, "bytes/momentum": b}
               for k, b in ((0.5, 2600), (0.2, 1040), (0.1, 500), (0.1, 550))]
    total = {"momentum": 4690, "momentum_dense": 800, "params": 3000, "control": 40}
    run = {"config": {"optimizer": {"compress_ratio": 0.1}}, "history": history,
           "summary": {"bytes_total": {**total, "all": sum(total.values())}}}
    assert study.warmup_excess(run) == pytest.approx((2600 - 525) + (1040 - 525))
    got = study.roles(run)
    assert got["warmup"] + got["sampled"] == 4690 and sum(got.values()) == run["summary"]["bytes_total"]["all"]
    # a run shorter than the warm-up (no period at the target): the sampled bytes scale with k
    run["history"] = history[:2]
    assert study.warmup_excess(run) == pytest.approx(2600 * 0.8 + 1040 * 0.5)
    assert study.warmup_excess({"config": {"optimizer": {}}, "history": history}) == 0.0  # no k: not SLAMB


# a ResNet-like and a BERT-like set of shapes, small: tensors above SLAMB's threshold (9,000) whose momentum is
# sampled, and ones under it or one-dimensional that are always averaged whole
LEDGER_SHAPES = {"resnet": [(64, 64, 3, 3), (32, 32, 3, 3), (64,), (64,), (10, 64)],
                 "bert_layer": [(96, 128), (128, 96), (128,), (48, 48)], "bert_embedding": [(400, 32), (32,)]}
LEDGER_ROWS = ("1-bit LAMB", "SLAMB fp32 (k=0.1, H=100)", "SLAMB fp16 (k=0.1, H=100)")


def ledger_worker(rank, world, shape_sets, names):
    from bench.comm_volume import measure_worker

    return [measure_worker(rank, world, shapes, names) for shapes in shape_sets]


@pytest.mark.multiprocess
def test_the_paper_settings_bytes_are_the_ledgers_at_the_recipes_k_and_h(tmp_path, monkeypatch):
    """A ledger measured as bench.comm_volume measures it (its workers, its steps, its figures), on small shapes
    in its raw record's layout: the roles at the paper's settings add up to its measured step, the parameter syncs
    are the whole model every H steps of the recipe, the always-averaged share is the parameters in tensors under
    the threshold or one-dimensional, and the warm-up's stages add their sampled momentum over the recipe's epochs."""
    from bench.comm_volume import extrapolate, per_step_figures
    from harness.local import run_local

    study = load_study()
    bert = {d: LEDGER_SHAPES["bert_embedding"] + d * LEDGER_SHAPES["bert_layer"] for d in (1, 2, 3)}
    sets = [LEDGER_SHAPES["resnet"], bert[1], bert[2], bert[3]]
    steps = run_local(ledger_worker, 2, sets, list(LEDGER_ROWS))[0]
    figures = [{label: per_step_figures(label, got[label]) for label in LEDGER_ROWS} for got in steps]
    numel = lambda shapes: sum(math.prod(x) for x in shapes)  # noqa: E731
    raw = {"workers": 2, "resnet110_numel": numel(sets[0]), "bert_large_numel": numel(bert[3]),
           "resnet110": figures[0], "bert_large_by_depth": {str(d): figures[d] for d in (1, 2, 3)}}
    ledger = tmp_path / "comm_volume_raw.json"
    ledger.write_text(json.dumps(raw))
    monkeypatch.setattr(study, "LEDGER", ledger)

    rows = extrapolate({d: figures[d] for d in (1, 2, 3)}, 24)
    large, slamb, onebit = study.ledger_setting("BERT-Large"), rows[study.LEDGER_SLAMB], rows["1-bit LAMB"]
    assert large["H"] == 100 and large["per_step"]["warmup"] == 0  # BERT's recipe: the ledger's H, no warm-up
    assert sum(large["per_step"].values()) == pytest.approx(slamb["step_payload_amortised"], rel=1e-9)
    assert large["vs_onebit"] == pytest.approx(slamb["step_payload_amortised"] / onebit["step_payload_amortised"])
    res, r = study.ledger_setting("ResNet-110"), figures[0][study.LEDGER_SLAMB]
    parts, whole = res["per_step"], numel(sets[0])
    assert res["H"] == 50 and parts["params"] == 4 * whole / 50  # the whole model in fp32, every 50 steps
    assert parts["sampled"] + parts["dense"] + parts["control"] == r["step_payload"]
    dense = sum(math.prod(x) for x in sets[0] if len(x) == 1 or math.prod(x) < 9000)
    assert res["dense_params"] == pytest.approx(dense / whole) and parts["dense"] == 4 * dense
    assert parts["sampled"] == pytest.approx(0.1 * 4 * (whole - dense), rel=0.25)  # a Bernoulli mask at k = 0.1
    # k 0.5, 0.5 and 0.2 in the first three of 200 epochs, at a target of 0.1: 4 + 4 + 1 epochs' worth of sampled
    # momentum more, over the run
    assert parts["warmup"] == pytest.approx(parts["sampled"] * 9 / 200) and res["raised_epochs"] == 3
    assert large["onebit_full_share"] == pytest.approx(
        1000 * onebit["first_payload/grads"] / (7038 * onebit["step_payload_amortised"]), rel=1e-9)

    # the net statement follows the ratios it quotes
    kind = {"vs_onebit": 1.7}
    text = study.net("SLAMB v1", kind, None, res, large, ["params", "dense"])
    assert f"at the paper's settings the ledger gives {res['vs_onebit']:.2f}x at ResNet-110's shapes" in text
    fp16 = study.ledger_setting("BERT-Large", study.LEDGER_SLAMB.replace("fp32", "fp16"))
    assert f"({fp16['vs_onebit']:.2f}x with the paper's fp16 momentum)" in text
    assert fp16["vs_onebit"] < large["vs_onebit"]  # half the momentum's bytes
    if max(res["vs_onebit"], large["vs_onebit"]) < 1:
        assert text.endswith("does not carry to the paper's setting; the roles the in-kind sizes inflate are the "
                             "parameter syncs and always-averaged tensors.")
    assert study.net("SLAMB v1", {"vs_onebit": 2.0}, None, {"vs_onebit": 1.5}, {"vs_onebit": 1.2}, []).endswith(
        "more bytes than 1-bit LAMB in kind and at the paper's settings alike.")
    alone = study.net("SLAMB v1", {"vs_onebit": math.nan}, None, res, large, [])  # no 1-bit LAMB row in kind
    assert alone.startswith("Net: SLAMB v1 on the digits: no 1-bit LAMB row; at the paper's settings")
    assert alone.endswith("Nothing in kind to set beside them.")


def test_unigram_line_is_the_cross_entropy_of_the_masked_tokens_under_training_frequencies(tmp_path):
    """Shards written in the real format by hand: the line is -mean log p over the validation's masked tokens,
    p the add-one-smoothed frequency of the training text as written (masked positions restored, [CLS] and
    [SEP] left out, padding left out)."""
    import h5py
    import numpy as np

    study = load_study()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c"]) + "\n")

    def shard(path, ids, positions, labels):
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = np.array(ids, dtype="i4")
        with h5py.File(path, "w") as f:
            f["input_ids"] = ids
            f["input_mask"] = (ids != 0).astype("i1")
            f["segment_ids"] = np.zeros_like(ids, dtype="i1")
            f["masked_lm_positions"] = np.array(positions, dtype="i4")
            f["masked_lm_ids"] = np.array(labels, dtype="i4")
            f["next_sentence_labels"] = np.zeros(len(ids), dtype="i1")

    # training text: [CLS] a a b [SEP] c (pad) with b masked, and [CLS] a [MASK]=a [SEP] (pad pad pad)
    shard(tmp_path / "train" / "t.hdf5", [[2, 5, 5, 4, 3, 7, 0], [2, 5, 4, 3, 0, 0, 0]], [[3, 0], [2, 0]],
          [[6, 0], [5, 0]])
    shard(tmp_path / "valid" / "v.hdf5", [[2, 4, 6, 4, 3, 0, 0]], [[1, 3]], [[5, 7]])
    counts = np.array([0, 0, 0, 0, 0, 4, 1, 1], dtype=float)  # a x4, b, c; [MASK] is never text
    p = (counts + 1) / (counts.sum() + 8)
    want = -(math.log(p[5]) + math.log(p[7])) / 2
    got = study.unigram_cross_entropy(tmp_path / "train", tmp_path / "valid", vocab)
    assert got == pytest.approx(want, rel=1e-12)


def test_rows_are_the_config_files():
    study = load_study()
    found = {task: study.rows(task) for task in study.TABLES}
    assert found["digits"] == ["study/digits_adamw", "study/digits_dgc", "study/digits_lamb", "study/digits_onebit_lamb",
                               "study/digits_sgd", "study/digits_slamb_hierarchical", "study/digits_slamb_int8",
                               "study/digits_slamb_v1", "study/digits_slamb_v2"]
    assert found["bert"] == ["study/bert_lamb", "study/bert_onebit_lamb", "study/bert_slamb"]
    # --rows: only the named rows of each task run; a name that is no file is refused
    named = ["digits_slamb_int8", "digits_slamb_hierarchical"]
    assert study.rows("digits", named) == ["study/digits_slamb_int8", "study/digits_slamb_hierarchical"]
    assert study.rows("bert", named) == []
    with pytest.raises(SystemExit, match="digits_slamb_v9"):
        study.rows("digits", ["digits_slamb_v9"])


def test_validation_split_is_disjoint_and_deterministic():
    study = load_study()
    train, valid = study.stdlib_documents(limit_files=40)
    assert train and valid and not set(train) & set(valid)
    assert (train, valid) == study.stdlib_documents(limit_files=40)
    assert all(len(doc.splitlines()) >= 2 for doc in train + valid)  # a sentence per line, two or more


def _run_dirs(runs: Path, table: str) -> dict[tuple[str, int], dict]:
    """(row, seed) -> the summary and history of each run of ``table``, read straight from the run directories."""
    out = {}
    for summary in runs.rglob("metrics.json"):
        cfg = yaml.safe_load((summary.parent / "config.yaml").read_text())
        if cfg["paper"]["table"] == table:
            history = [json.loads(x) for x in (summary.parent / "metrics.jsonl").read_text().splitlines() if x]
            out[(cfg["paper"]["row"], cfg["seed"])] = {"summary": json.loads(summary.read_text()), "history": history,
                                                       "dir": summary.parent}
    return out


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_quick_study_page_is_computed_from_its_runs(tmp_path):
    """Both tasks at tiny sizes (2 workers, LAMB and SLAMB rows): every number the page states is recomputed
    here from the run directories (metrics.json / metrics.jsonl), not from the page's own code."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    subprocess.run([sys.executable, "scripts/study.py", "--quick", "--out", str(out), "--runs", str(runs)],
                   cwd=ROOT, check=True, timeout=900)
    page, record = (out / "README.md").read_text(), json.loads((out / "study.json").read_text())
    digits, bert = _run_dirs(runs, "study_digits_resnet8"), _run_dirs(runs, "study_bert")
    assert sorted(digits) == [("LAMB", 0), ("LAMB", 1), ("SLAMB v1", 0), ("SLAMB v1", 1)]
    assert sorted(bert) == [("LAMB", 0), ("SLAMB", 0)]

    # digits: the table's mean, the verdict's interval and the bytes ratio, from the runs
    top1 = {row: [digits[(row, s)]["summary"]["final_test_top1"] for s in (0, 1)] for row in ("LAMB", "SLAMB v1")}
    for row, values in top1.items():
        assert values == [h["history"][-1]["test_top1"] for k, h in sorted(digits.items()) if k[0] == row]
        assert f"| {row} | " in page and f" {statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f} |" in page
    ledger = {row: statistics.fmean(digits[(row, s)]["summary"]["bytes_total"]["all"] for s in (0, 1))
              for row in top1}
    assert 0 < ledger["SLAMB v1"] < ledger["LAMB"]
    d, lo, hi = welch_by_hand(top1["SLAMB v1"], top1["LAMB"]) if len(set(top1["SLAMB v1"] + top1["LAMB"])) > 1 \
        else (0.0, math.nan, math.nan)
    (line,) = record["verdicts"]["digits"]
    assert f"{abs(d):.2f} points" in line and f"at {ledger['SLAMB v1'] / ledger['LAMB']:.3f}x LAMB's bytes" in line
    if not math.isnan(lo):
        assert f"95% CI {lo:+.2f} to {hi:+.2f}" in line
    assert line in page

    # bert: the final validation MLM loss is the last logged one of the averaged model, and is the page's
    for (row, _), run in bert.items():
        last = run["history"][-1]
        assert run["summary"]["final_val_mlm_loss"] == last["val_mlm_loss"]
        assert 0 < last["val_mlm_loss"] < 2 * math.log(400)
        assert ("val_mlm_loss_local" in last) == (row == "SLAMB")  # SLAMB's ranks differ between syncs
        assert f"| {row} | {last['val_mlm_loss']:.4f} |" in page
    lamb_bytes, slamb_bytes = (bert[(r, 0)]["summary"]["bytes_total"]["all"] for r in ("LAMB", "SLAMB"))
    (line,) = record["verdicts"]["bert"]
    d = bert[("SLAMB", 0)]["summary"]["final_val_mlm_loss"] - bert[("LAMB", 0)]["summary"]["final_val_mlm_loss"]
    assert f"{abs(d):.4f} nats" in line and "one seed" in line
    assert {r["val_mlm_acc"] for r in record["runs"]["bert"]} == {b["history"][-1]["val_mlm_acc"] for b in bert.values()}
    assert record["bert_data"]["unigram_entropy"] > 0 and "Reference line: the unigram cross-entropy" in page
    assert f"at {slamb_bytes / lamb_bytes:.3f}x LAMB's bytes" in line
    assert (out / "study_bert_curves.png").stat().st_size > 0 and (out / "study_digits_resnet8_curves.png").exists()
    assert {r["metric"] for r in record["runs"]["bert"]} == {b["summary"]["final_val_mlm_loss"] for b in bert.values()}

    # where SLAMB's bytes go: each SLAMB row's total and its roles are its runs' ledger kinds, mean over the seeds
    # (the sampled momentum and the warm-up's part of it add up to the momentum kind)
    from harness.records import fmt_bytes

    study = load_study()
    for task, row, found in (("digits", "SLAMB v1", digits), ("bert", "SLAMB", bert)):
        kinds = [run["summary"]["bytes_total"] for (name, _), run in found.items() if name == row]
        mean = {k: statistics.fmean(b.get(k, 0) for b in kinds) for k in ("all", "params", "momentum_dense")}
        line = next(x for x in page.splitlines() if x.startswith(f"| {task} | {row} | "))
        assert line.startswith(f"| {task} | {row} | {fmt_bytes(mean['all'])} | ")
        for kind in ("params", "momentum_dense"):
            assert f"| {fmt_bytes(mean[kind])} ({100 * mean[kind] / mean['all']:.1f}%) |" in line
        warm = statistics.fmean(study.warmup_excess({**run, "config": yaml.safe_load(
            (run["dir"] / "config.yaml").read_text())}) for (name, _), run in found.items() if name == row)
        assert (warm > 0) == (task == "digits")  # one epoch, all of it at the warm-up's raised k; BERT has none
    assert not any(x.startswith(("| digits | LAMB |", "| bert | LAMB |")) for x in page.splitlines())
    ledger = json.loads(study.LEDGER.read_text())["resnet110"][study.LEDGER_SLAMB]
    assert ("No figures at the paper's settings" in page) != ("first_payload/params" in ledger)
    # the page says at which commit its runs ran, and how loaded the machine was while they did
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    invocations = json.loads((out / "runs" / "invocations.json").read_text())
    assert f"Commits: the runs ran at {head[:10]}" in page and len(invocations) == 1
    assert f"{invocations[0]['load_avg'][0]:g} to {invocations[0]['load_avg'][1]:g}" in page
    assert str(tmp_path) not in page and str(ROOT) not in page and not re.search(r"\bnan\b", page)

    # the page is computed from the records kept beside it (no checkpoints), and rebuilt from them alone
    for task, found in (("digits", digits), ("bert", bert)):
        for run in found.values():
            kept = out / "runs" / task / run["dir"].name
            assert sorted(p.name for p in kept.iterdir()) == sorted(RECORD)
            assert (kept / "metrics.jsonl").read_bytes() == (run["dir"] / "metrics.jsonl").read_bytes()
    shutil.rmtree(runs)
    subprocess.run([sys.executable, "scripts/study.py", "--quick", "--out", str(out), "--runs", str(runs),
                    "--report-only"], cwd=ROOT, check=True, timeout=300)
    again = json.loads((out / "study.json").read_text())
    assert again["verdicts"] == record["verdicts"] and again["wall_time_s"] == record["wall_time_s"]
    assert [r["metric"] for r in again["runs"]["bert"]] == [r["metric"] for r in record["runs"]["bert"]]

    # the learning-rate grid (one point per row at quick sizes): on the validation split, never the test split;
    # its records beside the study's, its table on the page, computed from its runs
    subprocess.run([sys.executable, "scripts/study.py", "--quick", "--tune", "--tasks", "digits", "--out", str(out),
                    "--runs", str(runs)], cwd=ROOT, check=True, timeout=600)
    grid = {}
    for summary in (out / "runs" / "tune").rglob("metrics.json"):
        cfg = yaml.safe_load((summary.parent / "config.yaml").read_text())
        history = [json.loads(x) for x in (summary.parent / "metrics.jsonl").read_text().splitlines() if x]
        split = json.loads((summary.parent / "identity.json").read_text())["data"]["data.valid_images"]
        assert split["counts"] == {"train": 1280, "valid": 220}
        assert all("valid_top1" in h and not any(k.startswith("test_") for k in h) for h in history)
        grid[cfg["paper"]["row"]] = (cfg["optimizer"]["lr"], json.loads(summary.read_text())["final_valid_top1"])
    assert sorted(grid) == ["AdamW", "LAMB"] and grid["LAMB"][0] == 0.01
    page = (out / "README.md").read_text()
    assert "No run of the grid read the test split" in page
    for row, (lr, top1) in grid.items():
        assert f"| {lr:g} | " in page and f"**{top1:.2f} (n = 1)**" in page

    # a continued study on data other than its recorded runs' is refused before any run, in one line
    kept = json.loads((out / "runs" / "bert_data.json").read_text())
    (out / "runs" / "bert_data.json").write_text(json.dumps({**kept, "digest": "0" * 64}))
    done = subprocess.run([sys.executable, "scripts/study.py", "--quick", "--tasks", "bert", "--out", str(out),
                           "--runs", str(runs)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("error: the BERT runs recorded")
    assert "fix:" in done.stderr and not (runs / "bert").exists()


@pytest.mark.multiprocess  # bert.prepare_data.prepare shards the corpus over a process pool
def test_validation_loss_is_the_mean_over_every_masked_token(tmp_path):
    """bert.train's validation: the ranks' strided shares cover every held-out example once, and the loss is
    the cross-entropy averaged over all masked tokens (not over batches), which the model's own MLM loss is
    on one batch holding them all."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from bert.model import build_model
    from bert.prepare_data import Settings, prepare
    from bert.train import validation_batches, validation_metrics
    from bert.vocab import train_vocab
    from harness.amp import MixedPrecision

    study = load_study()
    _, docs = study.stdlib_documents(limit_files=30)
    files = study.write_documents(docs, tmp_path / "text", 2, "valid")
    vocab = train_vocab(files, tmp_path / "vocab", 300)
    prepare(files, vocab, tmp_path / "valid", Settings(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=1))
    cfg = OmegaConf.create({"validation": {"dir": str(tmp_path / "valid"), "pattern": "*.hdf5"},
                            "data": {"seq_len": 32, "micro_batch": 7}})
    env = lambda rank, world: SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"))  # noqa: E731
    whole = validation_batches(cfg, env(0, 1))
    shares = [validation_batches(cfg, env(r, 3)) for r in range(3)]
    ids = lambda batches: sorted(map(tuple, torch.cat([b["input_ids"] for b in batches]).tolist()))  # noqa: E731
    assert ids(whole) == ids([b for share in shares for b in share]) and len(whole) > 2

    torch.manual_seed(0)
    model = build_model({"vocab_size": len(vocab.read_text().splitlines()), "hidden_size": 16,
                         "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
                         "max_position_embeddings": 64, "type_vocab_size": 2, "hidden_act": "gelu",
                         "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})
    metrics = validation_metrics(model, whole, MixedPrecision("fp32", torch.device("cpu")))
    assert model.training  # restored after evaluation (dropout off during it)
    everything = {k: torch.cat([b[k] for b in whole]) for k in whole[0]}
    model.eval()
    with torch.no_grad():
        out = model(**everything)
        nsp = torch.nn.functional.cross_entropy(out.seq_relationship_logits, everything["next_sentence_label"])
    assert metrics["val_mlm_loss"] == pytest.approx((out.loss - nsp).item(), rel=1e-5)
