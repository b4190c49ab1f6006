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


def run(row, seed, accs, epoch_s=2.0, hosts=2):
    return {"optimizer": row, "seed": seed, "hosts": hosts, "status": "ok", "final_top1": accs[-1], "bytes": 1e6,
            "step_time_s": 0.1,
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


def test_targets_and_verdicts_per_host_count_against_lamb_and_onebit_lamb():
    """Each host count has its own target (its LAMB runs' final mean minus a point); every SLAMB row is judged
    against LAMB and 1-bit LAMB there, and the goal (<= 0.5x LAMB, ahead of 1-bit LAMB) is said plainly."""
    int8, recipe_h = tta.SLAMB_ROWS[1], tta.SLAMB_ROWS[2]
    record = {"hosts": [2, 4], "runs": [
        run("LAMB", 0, [80, 95, 97]), run("LAMB", 1, [70, 94, 95]),  # 2 hosts: LAMB 96 -> target 95
        run("SLAMB", 0, [90, 95.5, 96], epoch_s=1.0), run("SLAMB", 1, [96, 96, 96], epoch_s=1.0),
        run(int8, 0, [96, 96, 96], epoch_s=0.5), run(int8, 1, [96, 96, 96], epoch_s=0.6),
        run("1-bit LAMB", 0, [50, 60, 70]), run("1-bit LAMB", 1, [95, 95, 95], epoch_s=3.0),
        run("LAMB", 0, [90, 99, 99], hosts=4), run("LAMB", 1, [90, 97, 97], epoch_s=2.5, hosts=4),  # 4 hosts: target 97
        run(recipe_h, 0, [97, 97, 97], epoch_s=2.0, hosts=4), run(recipe_h, 1, [90, 97, 97], epoch_s=2.0, hosts=4),
        run("1-bit LAMB", 0, [97, 97, 97], epoch_s=1.0, hosts=4), run("1-bit LAMB", 1, [97, 97, 97], hosts=4)]}
    tta.summarise(record)
    assert record["target_top1"] == {"2": 95.0, "4": 97.0}
    assert [r["time_to_target_s"] for r in record["runs"]] == [4.0, 6.0, 2.0, 1.0, 0.5, 0.6, None, 3.0,
                                                               4.0, 5.0, 2.0, 4.0, 1.0, 2.0]
    text, out = tta.verdict(record)
    ratio, lo, hi = tta.log_ratio_interval([0.5, 0.6], [4.0, 6.0])
    assert out["2"][f"{int8} / LAMB"] == {"ratio": ratio, "low": lo, "high": hi, "unreached": [0, 0], "n": [2, 2]}
    assert f"- {int8}: {ratio:.3f}x LAMB's time (95% CI {lo:.3f} to {hi:.3f}, n = 2 and 2); no ratio to 1-bit " \
        "LAMB's time: 0 of SLAMB int8's 2 runs and 1 of 1-bit LAMB's 2 never reached the target." in text
    # one of 1-bit LAMB's runs never reached it: no ratio against it, so nothing decides the goal for the rows
    # that did; said so, not claimed met or missed
    assert out["2"]["SLAMB / 1-bit LAMB"]["ratio"] is None and out["2"]["SLAMB / 1-bit LAMB"]["unreached"] == [0, 1]
    assert ("At 2 hosts, **no SLAMB row is at or under 0.5x LAMB's time and ahead of 1-bit LAMB**. SLAMB, SLAMB "
            "int8 cannot be judged: runs of LAMB or 1-bit LAMB never reached the target.") in text
    ratio, lo, hi = tta.log_ratio_interval([2.0, 4.0], [1.0, 2.0])
    assert out["4"][f"{recipe_h} / 1-bit LAMB"]["ratio"] == pytest.approx(ratio) and ratio > 1
    four = text.split("**4 hosts**")[1]
    assert "At 4 hosts, **no SLAMB row is at or under 0.5x LAMB's time and ahead of 1-bit LAMB**, not even in the " \
        "point estimates." in four and "SLAMB int8" not in four
    # a row ahead of both in its point estimates, with intervals that do not decide: said as such
    record["runs"][7]["history"][0]["test_top1"] = 0.0  # 1-bit LAMB's seed 1 reaches it later
    record["runs"][6] = run("1-bit LAMB", 0, [95, 95, 95], epoch_s=0.7)
    text, out = tta.verdict(tta.summarise(record))
    assert out["2"][f"{int8} / 1-bit LAMB"]["ratio"] < 1 and out["2"][f"{int8} / LAMB"]["ratio"] <= 0.5
    assert out["2"][f"{int8} / LAMB"]["high"] > 0.5  # two seeds each: the interval is wide
    assert (f"At 2 hosts, no SLAMB row is shown to meet the goal (0.5x LAMB's time or less and ahead of 1-bit "
            f"LAMB): SLAMB, {int8} meet it in the point estimates, but the intervals do not decide it.") in text
    # seeds that pin it down: both intervals clear of the bars, the goal met; a row one of whose runs never
    # reached the target is not ahead of anything
    record["runs"] += [run(int8, s, [96, 96, 96], epoch_s=0.5 + s / 100) for s in (2, 3, 4)]
    record["runs"] += [run("LAMB", s, [80, 95, 96], epoch_s=2.0 + s / 10) for s in (2, 3, 4)]
    record["runs"] += [run("1-bit LAMB", s, [90, 95, 96], epoch_s=1.0 + s / 10) for s in (2, 3, 4)]
    record["runs"].append(run("SLAMB", 2, [90, 90, 90], epoch_s=0.1))
    text, out = tta.verdict(tta.summarise(record))
    got = out["2"]
    assert got[f"{int8} / LAMB"]["high"] <= 0.5 and got[f"{int8} / 1-bit LAMB"]["high"] < 1
    assert got["SLAMB / LAMB"]["unreached"] == [1, 0] and got["SLAMB / 1-bit LAMB"]["ratio"] is None
    assert tta.meets(got["SLAMB / LAMB"], got["SLAMB / 1-bit LAMB"], "ratio") is False
    assert (f"At 2 hosts, {int8} meets the goal: at or under 0.5x LAMB's time and ahead of 1-bit LAMB, both "
            "intervals included.") in text and "cannot be judged" not in text.split("**4 hosts**")[0]


def test_the_page_records_the_commit_and_no_folder_of_the_machine(tmp_path):
    from harness.run import shown_command

    assert shown_command(["--workdir", str(ROOT / "runs" / "tta"), f"--out={tmp_path / 'x.md'}", "--seeds", "3"]) == \
        "--workdir runs/tta --out=.../x.md --seeds 3"
    assert shown_command(["--workdir", "/elsewhere/checkout/runs/tta"]) == "--workdir runs/tta"


@pytest.mark.skipif(WHY is not None, reason=f"network namespaces unavailable: {WHY}")
@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.netns
def test_quick_time_to_accuracy_page_is_computed_from_its_runs(tmp_path):
    """The quick mode with the rows new to the page (SLAMB as the demo runs it is the netbench tests'): every
    number on the page is the runs', and each new row ran with its own exchange (read from its run directory)."""
    import yaml

    before = set(list_namespaces())
    out, work = tmp_path / "tta.md", tmp_path / "work"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    rows = ["LAMB", "SLAMB int8", tta.RECIPE_H_ROW, "1-bit LAMB"]
    done = subprocess.run([sys.executable, "-m", "bench.time_to_accuracy", "--quick", "--rows", *rows, "--out",
                           str(out), "--workdir", str(work)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert set(list_namespaces()) == before
    record = json.loads(out.with_suffix(".json").read_text())
    runs = record["runs"]
    assert [(r["optimizer"], r["seed"], r["hosts"], r["rate_mbit"]) for r in runs] == [(row, 0, 2, 10.0) for row in rows]
    lamb, onebit = runs[0], runs[-1]
    assert record["target_top1"] == {"2": pytest.approx(lamb["final_top1"] - 1.0)}
    assert lamb["final_top1"] == lamb["history"][-1]["test_top1"] and len(lamb["history"]) == 2
    for r in runs:  # each time is the training time up to the first epoch at the target; the bytes the ledger's
        assert r["time_to_target_s"] == tta.time_to(r["history"], record["target_top1"]["2"])
        assert 0 < r["bytes"] < lamb["bytes"] or r is lamb
    # the rows' exchanges as their runs recorded them: int8 momentum at the demo's H 10, and the recipe's H, whose
    # parameter syncs are one per H steps (step 1's included) of the whole model in fp32
    ran = {}
    for r in runs:
        tag = f"h2_{''.join(c for c in r['optimizer'].lower() if c.isalnum())}_seed0"
        cfg = yaml.safe_load((work / "runs" / tag / "config.yaml").read_text())["optimizer"]
        summary = json.loads((work / "runs" / tag / "metrics.json").read_text())
        assert summary["bytes_total"]["all"] == r["bytes"]
        ran[r["optimizer"]] = (cfg, summary)
    (int8, s8), (recipe, sh) = ran["SLAMB int8"], ran[tta.RECIPE_H_ROW]
    assert (int8["comm_dtype"], int8["sync_interval"], recipe["comm_dtype"], recipe["sync_interval"]) == \
        ("int8", 10, None, tta.RECIPE_H)
    for summary, h in ((s8, 10), (sh, tta.RECIPE_H)):
        assert summary["bytes_total"]["params"] == 4 * summary["params"] * math.ceil(summary["steps"] / h)
    assert s8["bytes_total"]["momentum_dense"] < sh["bytes_total"]["momentum_dense"] / 2  # a byte, not 4, a value
    assert record["compute_reference"]["2"]["status"] == "ok" and record["compute_reference"]["2"]["step_time_s"] > 0
    page = out.read_text()
    assert f"**{record['target_top1']['2']:.2f}%**" in page and "communication" in page
    if lamb["time_to_target_s"] and onebit["time_to_target_s"]:  # one seed each: the ratio of the two times
        ratio = onebit["time_to_target_s"] / lamb["time_to_target_s"]
        assert record["verdict"]["2"]["1-bit LAMB / LAMB"]["ratio"] == pytest.approx(ratio)
        assert f"- 1-bit LAMB: {ratio:.3f}x LAMB's time (no interval: one seed, n = 1 and 1)" in page
    assert f"at commit {record['commits'][0]['commit'][:10]}" in page
    assert str(ROOT) not in page + out.with_suffix(".json").read_text() and str(tmp_path) not in page
    out.unlink()  # --render-only rebuilds the same page from the json
    subprocess.run([sys.executable, "-m", "bench.time_to_accuracy", "--render-only", "--out", str(out)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=120)
    assert out.read_text() == page


@pytest.mark.e2e  # it runs the command's main, which tests/tiers.py counts as end to end
def test_extend_keeps_the_pages_runs_and_refuses_another_set_up(tmp_path, capsys):
    """A page of the one-host-count layout (hosts a number, one compute reference) is extended in the present one."""
    out = tmp_path / "tta.md"
    record = {"command": "python -m bench.time_to_accuracy --workdir /elsewhere/checkout/runs/tta",
              "started": "2026-01-01 00:00", "wall_s": 600.0, "cpus": 2,
              "load_avg": [0.5, 1.0], "hosts": 2, "rate_mbit": 5.0, "epochs": 3, "seeds": [0, 1],
              "compute_reference": {"status": "ok", "error": None, "step_time_s": 0.05},
              "runs": [run(row, s, [80, 95, 96 + s], epoch_s=2.0 + s + i) for s in (0, 1)
                       for i, row in enumerate(tta.ROWS)]}
    out.with_suffix(".json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="rate_mbit=5.0, this invocation 10.0"):
        tta.main(["--extend", "--rate", "10", "--epochs", "3", "--seeds", "0", "--out", str(out)])
    # every (hosts, row, seed) asked for is on the page already: nothing runs, the page is rebuilt from the kept runs
    assert tta.main(["--extend", "--hosts", "2", "--epochs", "3", "--seeds", "1", "--out", str(out)]) == 0
    again = json.loads(out.with_suffix(".json").read_text())
    assert [(r["optimizer"], r["seed"]) for r in again["runs"]] == [(r["optimizer"], r["seed"]) for r in record["runs"]]
    assert again["seeds"] == [0, 1] and again["hosts"] == [2]
    assert again["compute_reference"] == {"2": record["compute_reference"]}
    assert again["wall_s"] >= 600.0 and again["load_avg"][0] == 0.5
    assert again["command"] == ("python -m bench.time_to_accuracy --workdir runs/tta + python -m "
                                "bench.time_to_accuracy --extend --hosts 2 --epochs 3 --seeds 1 --out .../tta.md")
    assert again["commits"][0]["commit"] and str(tmp_path) not in out.read_text()
    assert again["target_top1"] == {"2": pytest.approx(statistics.fmean([96, 97]) - 1.0)}
    with pytest.raises(SystemExit, match="does not exist"):
        tta.main(["--extend", "--out", str(tmp_path / "none.md")])
