"""make study (scripts/study.py): the page's numbers are the runs' numbers, and the verdict's interval is Welch's."""
from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from scipy import stats

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
                         higher_is_better=True)
    assert text == ("SLAMB v1's averaged model is 1.00 points below LAMB's test top-1 (95% CI -3.31 to +1.31, "
                    "n = 5 and 5; the seeds cannot tell it from LAMB) at 0.360x LAMB's bytes per worker.")
    text = study.verdict("SLAMB", [2.0, 2.1, 2.05], [2.5, 2.6, 2.55], 0.1, unit="nats", metric="validation MLM loss",
                         higher_is_better=False)
    assert "0.5000 nats below LAMB's validation MLM loss" in text and "better than LAMB beyond the seeds' spread" in text
    assert "one seed" in study.verdict("SLAMB", [2.0], [2.5], 0.1, unit="nats", metric="validation MLM loss",
                                        higher_is_better=False)


def test_rows_are_the_config_files():
    study = load_study()
    found = {task: study.rows(task) for task in study.TABLES}
    assert found["digits"] == ["study/digits_dgc", "study/digits_lamb", "study/digits_onebit_lamb",
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
            out[(cfg["paper"]["row"], cfg["seed"])] = {"summary": json.loads(summary.read_text()), "history": history}
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
    assert f"at {slamb_bytes / lamb_bytes:.3f}x LAMB's bytes" in line
    assert (out / "study_bert_curves.png").stat().st_size > 0 and (out / "study_digits_resnet8_curves.png").exists()
    assert {r["metric"] for r in record["runs"]["bert"]} == {b["summary"]["final_val_mlm_loss"] for b in bert.values()}


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
