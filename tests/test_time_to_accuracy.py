"""bench.time_to_accuracy: the target, each run's time to it and the ratio's interval are computed from the
runs' histories; end to end on two emulated hosts behind a shaped link (needs network namespaces)."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from bench import time_to_accuracy as tta
from bench.netns import list_namespaces, netns_unsupported

ROOT = Path(__file__).resolve().parents[1]
WHY = netns_unsupported()


def run(row, seed, accs, epoch_s=2.0):
    return {"optimizer": row, "seed": seed, "status": "ok", "final_top1": accs[-1], "bytes": 1e6, "step_time_s": 0.1,
            "history": [{"epoch": i + 1, "test_top1": a, "epoch_time_s": epoch_s} for i, a in enumerate(accs)]}


def test_time_to_target_and_the_ratio_of_geometric_means():
    assert tta.time_to([{"test_top1": 50, "epoch_time_s": 3.0}, {"test_top1": 91, "epoch_time_s": 4.0}], 90) == 7.0
    assert tta.time_to([{"test_top1": 50, "epoch_time_s": 3.0}], 90) is None
    a, b = [10.0, 12.0, 11.0], [20.0, 25.0, 22.0]
    ratio, lo, hi = tta.log_ratio_interval(a, b)
    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
    ci = stats.ttest_ind(la, lb, equal_var=False).confidence_interval(0.95)
    assert ratio == pytest.approx(math.exp(statistics.fmean(la) - statistics.fmean(lb)))
    assert (lo, hi) == pytest.approx((math.exp(ci.low), math.exp(ci.high)))


def test_target_is_lambs_final_mean_minus_a_point_and_verdict_follows():
    record = {"runs": [run("LAMB", 0, [80, 95, 97]), run("LAMB", 1, [70, 94, 95]),  # LAMB 96 -> target 95
                       run("SLAMB", 0, [90, 95.5, 96], epoch_s=1.0), run("SLAMB", 1, [96, 96, 96], epoch_s=1.0),
                       run("1-bit LAMB", 0, [50, 60, 70])]}
    tta.summarise(record)
    assert record["target_top1"] == 95.0
    assert [r["time_to_target_s"] for r in record["runs"]] == [4.0, 6.0, 2.0, 1.0, None]
    text, out = tta.verdict(record)
    ratio, lo, hi = tta.log_ratio_interval([2.0, 1.0], [4.0, 6.0])
    assert out["SLAMB"] == {"ratio": ratio, "low": lo, "high": hi, "unreached": 0}
    assert f"SLAMB reaches the target in {ratio:.3f}x LAMB's time" in text
    assert out["1-bit LAMB"]["ratio"] is None and "1 of its and LAMB's runs never reached the target" in text


@pytest.mark.skipif(WHY is not None, reason=f"network namespaces unavailable: {WHY}")
@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.netns
def test_quick_time_to_accuracy_page_is_computed_from_its_runs(tmp_path):
    before = set(list_namespaces())
    out = tmp_path / "tta.md"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.time_to_accuracy", "--quick", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert set(list_namespaces()) == before
    record = json.loads(out.with_suffix(".json").read_text())
    runs = record["runs"]
    assert [(r["optimizer"], r["seed"], r["hosts"], r["rate_mbit"]) for r in runs] == \
        [("LAMB", 0, 2, 10.0), ("SLAMB", 0, 2, 10.0), ("1-bit LAMB", 0, 2, 10.0)]
    lamb = runs[0]
    assert record["target_top1"] == pytest.approx(lamb["final_top1"] - 1.0)
    assert lamb["final_top1"] == lamb["history"][-1]["test_top1"] and len(lamb["history"]) == 2
    for r in runs:  # each time is the training time up to the first epoch at the target
        assert r["time_to_target_s"] == tta.time_to(r["history"], record["target_top1"])
        assert r["bytes"] > 0
    assert runs[1]["bytes"] < lamb["bytes"] and runs[2]["bytes"] < lamb["bytes"]
    assert record["compute_reference"]["status"] == "ok" and record["compute_reference"]["step_time_s"] > 0
    page = out.read_text()
    assert f"**{record['target_top1']:.2f}%**" in page and "communication" in page
    out.unlink()  # --render-only rebuilds the same page from the json
    subprocess.run([sys.executable, "-m", "bench.time_to_accuracy", "--render-only", "--out", str(out)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=120)
    assert out.read_text() == page


@pytest.mark.e2e  # it runs the command's main, which tests/tiers.py counts as end to end
def test_extend_keeps_the_pages_runs_and_refuses_another_set_up(tmp_path, capsys):
    out = tmp_path / "tta.md"
    record = {"command": "python -m bench.time_to_accuracy", "started": "2026-01-01 00:00", "wall_s": 600.0, "cpus": 2,
              "load_avg": [0.5, 1.0], "hosts": 2, "rate_mbit": 5.0, "epochs": 3, "seeds": [0, 1],
              "compute_reference": {"status": "ok", "error": None, "step_time_s": 0.05},
              "runs": [run(row, s, [80, 95, 96 + s], epoch_s=2.0 + s + i) for s in (0, 1)
                       for i, row in enumerate(tta.ROWS)]}
    out.with_suffix(".json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="rate_mbit=5.0, this invocation 10.0"):
        tta.main(["--extend", "--rate", "10", "--epochs", "3", "--seeds", "0", "--out", str(out)])
    # every (row, seed) asked for is on the page already: nothing runs, the page is rebuilt from the kept runs
    assert tta.main(["--extend", "--epochs", "3", "--seeds", "1", "--out", str(out)]) == 0
    again = json.loads(out.with_suffix(".json").read_text())
    assert [(r["optimizer"], r["seed"]) for r in again["runs"]] == [(r["optimizer"], r["seed"]) for r in record["runs"]]
    assert again["seeds"] == [0, 1] and again["compute_reference"] == record["compute_reference"]
    # the command as the page records it: a path outside the repository by its last part, no machine's directory
    assert again["wall_s"] >= 600.0 and again["load_avg"][0] == 0.5 and again["command"].endswith("--seeds 1 --out "
                                                                                                    ".../tta.md")
    assert again["target_top1"] == pytest.approx(statistics.fmean([96, 97]) - 1.0)
    with pytest.raises(SystemExit, match="does not exist"):
        tta.main(["--extend", "--out", str(tmp_path / "none.md")])
