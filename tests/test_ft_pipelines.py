"""bench.ft_pipelines: the fault-tolerance page's runner, end to end on the digits recipe at a smoke size (4 epochs
of 5 steps, 4 workers): the failures the page asks for happen, a restart from a checkpoint resumes exactly through
several of them, and the page is computed from the runs."""
from __future__ import annotations

import json

import pytest

from bench import ft_pipelines


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_two_failures_restart_from_their_checkpoints_and_end_as_the_run_without_one(tmp_path, monkeypatch):
    study = tmp_path / "study"
    for seed, top1 in enumerate((30.0, 40.0)):  # the study's LAMB runs: the target is their mean less 1 point
        run = study / "digits" / f"study_digits_lamb_seed{seed}"
        run.mkdir(parents=True)
        (run / "metrics.json").write_text(json.dumps({"final_test_top1": top1}))
    out = tmp_path / "out"
    seen, real = [], ft_pipelines.one_run

    def one_run(*args, **kwargs):  # what the checkout's results/ holds when each run starts
        seen.append(sorted(p.name for p in out.iterdir()))
        return real(*args, **kwargs)
    monkeypatch.setattr(ft_pipelines, "one_run", one_run)
    # worker 1 dies before step 8 (epoch 2), and the restarted job's worker 1 before step 13 (epoch 3)
    assert ft_pipelines.main(["--epochs", "4", "--failures", "8", "13", "--rows", "slamb", "slamb_restart",
                              "--seeds", "1", "--out", str(out), "--runs", str(tmp_path / "runs"),
                              "--study", str(study)]) == 0
    # the runs find results/ as committed (a run's meta.json would call a changed one uncommitted changes)
    assert seen == [[], []]
    assert not (tmp_path / "runs" / "fault_tolerance_pipelines_digits.json").exists()  # kept there while running
    record = json.loads((out / "fault_tolerance_pipelines_digits.json").read_text())
    assert record["target"] == 34.0 and record["target_runs"] == 2
    plain, restart = sorted(record["runs"], key=lambda r: r["row"])
    assert (plain["row"], plain["failures"], plain["resumed_from"]) == ("slamb", 0, [])
    assert (restart["row"], restart["failures"], restart["resumed_from"]) == ("slamb_restart", 2, [1, 2])
    # a restart resumes exactly: the same final model's scores, and every epoch's line once, when first written
    assert (restart["final_test_loss"], restart["final_test_top1"]) == (plain["final_test_loss"],
                                                                         plain["final_test_top1"])
    assert [s for _, s, _ in restart["lines"]] == [s for _, s, _ in plain["lines"]] == [5, 10, 15, 20]
    assert all(a[0] < b[0] for a, b in zip(restart["lines"], restart["lines"][1:]))
    page = (out / "fault_tolerance_pipelines.md").read_text()
    assert "| SLAMB, restart from a checkpoint, failures | " in page and "| SLAMB, no failure (4 workers) | " in page
    assert "resumed from epochs 1, 2 (seeds in order) and took 2.0 ± 0.0 steps again per failure" in page
    assert "in 1 of 1 seeds (a restart resumes exactly)" in page
    assert restart["step_s"] > 0 and plain["step_s"] > 0
