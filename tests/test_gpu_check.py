"""``make gpu-check``'s plumbing on the CPU: the one line without CUDA, the tests it runs, the report it reads,
the page it writes (the committed pages are its rendering of their own .json)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check, optimizer_step

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess  # runs Python in a subprocess
def test_without_cuda_it_prints_one_line_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); nothing to check."]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess  # runs Python in a subprocess
def test_every_gpu_marked_test_is_in_the_files_it_runs():
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert len(ids) >= 10, proc.stdout[-2000:]
    assert {i.split("::")[0] for i in ids} == set(gpu_check.TEST_FILES)


@pytest.mark.multiprocess  # runs Python in a subprocess
def test_junit_rows_read_a_real_pytest_report(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert 1\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n")
    report = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "test_sample.py"], cwd=tmp_path, capture_output=True, timeout=300)
    rows = {r["test"]: r for r in gpu_check.junit_rows(report)}
    assert {k: r["outcome"] for k, r in rows.items()} == {
        "test_sample::test_ok": "passed", "test_sample::test_bad": "failed", "test_sample::test_skipped": "skipped"}
    assert "one is not two" in rows["test_sample::test_bad"]["message"]


def test_the_page_renders_what_was_measured():
    numel = 1000
    times = {"floor": [1e-6, 1.1e-6], "lamb": [2e-5, 2.2e-5], "slamb_v2_fused": [4e-5, 4.4e-5]}
    res = {"environment": {"gpu": "Test GPU", "revision": "abc1234", "dirty": False, "torch": "2.x", "mig_mode": "Disabled"},
           "date": "2026-01-01 00:00 UTC",
           "tests": {"command": "python -m pytest -q -m gpu tests/test_gpu.py", "exit_code": 1, "seconds": 3.0,
                     "rows": [{"test": "test_gpu::test_a", "outcome": "passed", "seconds": 1.0, "message": ""},
                              {"test": "test_gpu::test_b", "outcome": "failed", "seconds": 2.0, "message": "x | y"}],
                     "tail": []},
           "step": {"bert_base": {"numel": numel, "steps": 2, "rows": optimizer_step.summarize(times, numel)}},
           "memory": [{"optimizer": "lamb", "micro_batch": 32, "seq": 128, "peak_gb": 11.67, "reserved_gb": 11.97,
                       "predicted_no_activations_gb": 6.1, "activations_gb": 5.57}],
           "step_error": "RuntimeError: boom"}
    page = gpu_check.render(res)
    assert "# GPU check: Test GPU" in page and "| mig_mode | Disabled |" in page
    assert "exit code 1, 3.0 s; 1 passed, 1 failed." in page
    assert "| `test_gpu::test_b` | failed | 2.0 | x / y |" in page  # a '|' in a message cannot break the table
    assert "| slamb_v2_fused | 0.04 | 2.00 (2.00-2.00) | 11.43 (11.43-11.43) | – |" in page
    assert "| lamb | 32 | 11.67 | 11.97 | 6.1 | 5.57 |" in page
    assert "- step: `RuntimeError: boom`" in page
    assert "predicted with activations" not in page  # a run from before the page modelled them keeps its table
    res["memory"][0]["predicted_gb"] = 11.9
    page = gpu_check.render(res)
    assert "| lamb | 32 | 11.67 | 11.97 | 6.1 | 5.57 | 11.9 |" in page
    assert "| activations (GB) | predicted with activations (GB) |" in page


def test_the_prediction_is_read_from_the_memory_page():
    pred = gpu_check.predicted_gb("slamb_v2")
    assert set(pred) >= {"parameters", "gradients", "state", "forward/backward", "first step", "later step"}
    assert pred["forward/backward"] > pred["parameters"] > 0
    # the page's activations per sequence of 128 (BERT-Large): the H100 measured 0.173 GB
    assert 0.15 < pred["activations per sequence"] < 0.2
    with pytest.raises(KeyError, match="no row 'sgd'"):
        gpu_check.predicted_gb("sgd")


@pytest.mark.parametrize("page", sorted((ROOT / "results" / "gpu").glob("*.json")), ids=lambda p: p.stem)
def test_committed_pages_are_the_rendering_of_their_json(page):
    res = json.loads(page.read_text())
    assert page.with_suffix(".md").read_text() == gpu_check.render(res)
    assert res["tests"]["exit_code"] == 0 and all(r["outcome"] == "passed" for r in res["tests"]["rows"])
    assert len(res["tests"]["rows"]) >= 10
