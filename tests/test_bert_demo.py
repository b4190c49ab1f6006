"""``python -m bert.demo`` end to end at its smallest settings: it exits 0 and prints its summary."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess  # runs the demo as a subprocess
def test_bert_demo_runs_and_prints_its_summary(tmp_path):
    out = tmp_path / "demo"
    # one worker and a few steps: the demo's own corpus, vocabulary and shards, through bert.train (one worker
    # sends nothing: bytes_total {"all": 0})
    args = ["--out", str(out), "--optimizer", "lamb", "--steps", "4", "--workers", "1", "--vocab-size", "1000",
            "log_every=2"]
    done = subprocess.run([sys.executable, "-m", "bert.demo", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, check=False, env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert set(summary) == {"final_loss", "final_mlm_acc", "final_nsp_acc", "mean_seqs_per_s", "bytes_total",
                            "params", "model_dir"}
    assert summary["mean_seqs_per_s"] > 0 and summary["final_loss"] > 0 and summary["bytes_total"] == {"all": 0}
    assert (Path(summary["model_dir"]) / "vocab.txt").exists() and (out / "run" / "metrics.json").exists()
