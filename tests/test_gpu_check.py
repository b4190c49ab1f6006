"""``make gpu-check``'s plumbing on the CPU: a tier without CUDA (its environment part, a line per part it skips,
nothing written), the torch APIs it probes, the tiers' tests, the plugin that streams their results and limits
each, the run of a tier's parts against its deadline with the page written after each, and the pages it renders
(the committed pages are its rendering of their own .json)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check, optimizer_step

ROOT = Path(__file__).resolve().parents[1]


def no_cuda_run(*args) -> list[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


@pytest.mark.multiprocess  # runs Python in a subprocess
def test_without_cuda_a_tier_runs_its_environment_part_and_says_which_parts_it_skips(tmp_path):
    import torch

    lines = no_cuda_run("--tier", "1", "--out-dir", str(tmp_path))
    assert lines[0] == (f"gpu-check: tier 1; torch {torch.__version__}, triton {gpu_check._version('triton')}, "
                        "no CUDA device: nothing is written")
    assert lines[1] == "gpu-check: environment ..."
    probed = [line for line in lines if line.startswith("gpu-check:   ")]
    assert len(probed) == len(gpu_check.api_probe()) and "gpu-check:   DeviceMesh.from_group: True" in probed
    assert lines[-3:] == [f"gpu-check: {part} skipped: no CUDA device is visible" for part in ("bandwidth", "tests",
                                                                                             "step")]
    assert list(tmp_path.iterdir()) == []
    assert no_cuda_run("--tier", "2", "--out-dir", str(tmp_path))[1:] == [
        f"gpu-check: {part} skipped: no CUDA device is visible" for part in gpu_check.TIERS[2]]
    assert list(tmp_path.iterdir()) == []


def test_this_torch_has_every_api_the_library_relies_on():
    """The probe on the installed torch (2.11 under ``make test-compat``, 2.14 under ``make test``, 2.15 under
    ``make test-newest``): every hook and signature exists, and the names the library calls are this torch's."""
    import torch.distributed as dist

    api = gpu_check.api_probe()
    assert all(v is True for k, v in api.items() if isinstance(v, bool)), api
    assert api["FSDPState parameter groups"] in ("_fsdp_param_groups", "_fsdp_param_group")
    assert hasattr(dist, api["all-gather"]) and hasattr(dist, api["reduce-scatter"])
    assert "missing" not in api["inductor deterministic settings"]


def collected(pytester, *args) -> tuple[set[str], int]:
    """The node ids a ``pytest --collect-only -m gpu`` of ``args`` selects (pytest's own collection, run in this
    process: the test modules are imported once), and its exit code."""
    recorder = pytester.inline_run("--collect-only", "-m", "gpu", "-p", "no:cacheprovider", *args)
    finished = recorder.getcalls("pytest_collection_finish")
    return {i.nodeid for i in finished[0].session.items} if finished else set(), recorder.ret


def test_every_gpu_marked_test_is_in_one_tier(pytester):
    """The tiers split the gpu tests of the files gpu-check runs; a gpu test elsewhere is refused at collection
    (:func:`tests.tiers.misfiled_gpu_tests`: every run of the suite checks its own files)."""
    files = [str(ROOT / f) for f in gpu_check.TEST_FILES]
    every = collected(pytester, *files)[0]
    assert len(every) >= 60 and {i.split("::")[0] for i in every} == set(gpu_check.TEST_FILES)
    tiers = [collected(pytester, *files, "-k", gpu_check.test_selection(t))[0] for t in (1, 2)]
    assert tiers[0] | tiers[1] == every and not tiers[0] & tiers[1]
    for name in gpu_check.TIER2_TESTS:
        assert any(f"::{name}" in i for i in tiers[1]), name


def test_a_gpu_test_outside_the_files_gpu_check_runs_is_refused_at_collection(pytester, capsys):
    pytester.makeini("[pytest]\nmarkers =\n    gpu: a GPU test\n")
    pytester.makeconftest("from tests.tiers import pytest_collection_modifyitems  # noqa: F401\n")
    pytester.mkdir("tests")
    (pytester.path / "tests" / "test_elsewhere.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_on_cuda():\n    pass\n")
    assert collected(pytester, "tests")[1] == pytest.ExitCode.USAGE_ERROR
    assert ("gpu-marked tests outside bench.gpu_check.TEST_FILES, whose gpu tests make gpu-check runs: "
            "tests/test_elsewhere.py::test_on_cuda: add their files to TEST_FILES") in capsys.readouterr().err
    (pytester.path / "tests" / "test_elsewhere.py").write_text("def test_on_the_cpu():\n    pass\n")
    assert collected(pytester, "tests") == (set(), pytest.ExitCode.NO_TESTS_COLLECTED)  # none gpu-marked


SAMPLE = '''
import time
import pytest

pytestmark = pytest.mark.gpu

@pytest.fixture
def broken():
    raise RuntimeError("no such device")

def test_ok():
    pass

def test_bad():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_setup_fails(broken):
    pass

def test_too_long():
    time.sleep(30)

def test_after_the_long_one():
    pass

def test_never_ends():
    time.sleep(600)

def test_never_reached():
    pass
'''


@pytest.fixture
def sample(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a GPU test\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    return tmp_path / "test_sample.py"


class Recorded(gpu_check.Check):
    """A check that keeps what each save held, and whose time for the tests ends once ``stop_after`` has ended."""

    def __init__(self, stop_after: str):
        super().__init__(1, {"format": gpu_check.FORMAT, "parts": {}}, None, 1000.0)
        self.stop_after, self.saved = stop_after, []

    def save(self):
        self.saved.append(json.loads(json.dumps(self.part)))

    def left(self):
        ended = any(r["test"].endswith(self.stop_after) for r in self.part.get("rows", []))
        return 0.0 if ended else 1000.0


@pytest.mark.multiprocess  # runs pytest in a subprocess
def test_the_tests_part_streams_each_result_limits_each_test_and_stops_at_its_time(sample, monkeypatch):
    monkeypatch.setattr(gpu_check, "TEST_TIMEOUT", 2.0)
    check = Recorded("test_after_the_long_one")
    check.part = {}
    got = gpu_check.tests_part(check, (str(sample),), "not skipped_by_name")
    rows = {r["test"].split("::")[1]: r for r in got["rows"]}
    assert {k: r["outcome"] for k, r in rows.items()} == {
        "test_ok": "passed", "test_bad": "failed", "test_skipped": "skipped", "test_setup_fails": "error",
        "test_too_long": "failed", "test_after_the_long_one": "passed", "test_never_ends": "not run",
        "test_never_reached": "not run"}
    assert "one is not two" in rows["test_bad"]["message"]
    assert "no such device" in rows["test_setup_fails"]["message"]
    assert "TestTimeout: the test ran past its 2 s" in rows["test_too_long"]["message"]
    assert 2.0 <= rows["test_too_long"]["seconds"] < 10
    assert got["stopped"] and got["failed"] and got["collected"] == 8
    # the page had each result as it came, while pytest still ran
    assert [len(s["rows"]) for s in check.saved] == sorted(len(s["rows"]) for s in check.saved)
    assert any("exit_code" not in s and "test_bad" in str(s["rows"]) for s in check.saved)


def test_a_tier_runs_its_parts_in_order_writes_after_each_and_starts_none_past_its_deadline(tmp_path, monkeypatch):
    clock = [0.0]
    ran, written = [], []

    def part(name, seconds, result=None, raises=None):
        def run(check):
            ran.append(name)
            clock[0] += seconds
            if raises:
                raise raises
            return result or {}
        return run

    monkeypatch.setitem(gpu_check.PARTS, "environment", part("environment", 1, {"api": {"x": True}}))
    monkeypatch.setitem(gpu_check.PARTS, "bandwidth", part("bandwidth", 2, raises=RuntimeError("out of memory")))
    monkeypatch.setitem(gpu_check.PARTS, "tests", part("tests", 30, {"command": "pytest", "rows": [], "failed": True}))
    monkeypatch.setitem(gpu_check.PARTS, "step", part("step", 1))
    env = {"gpu": "Test GPU", "torch": "2.x", "triton": "3.x", "revision": "abc1234", "dirty": False}
    res = gpu_check.load(tmp_path / "none.json", env, 1)
    check = gpu_check.Check(1, res, tmp_path / "test-gpu", 20.0, clock=lambda: clock[0])
    real_save = check.save
    check.save = lambda: (real_save(), written.append(json.loads((tmp_path / "test-gpu.json").read_text())))
    assert check.run(gpu_check.TIERS[1], cuda=True) is True
    assert ran == ["environment", "bandwidth", "tests"]  # the step would start past the deadline
    assert [list(w["parts"]) for w in written] == [["environment"], ["environment", "bandwidth"],
                                                    ["environment", "bandwidth", "tests"],
                                                    ["environment", "bandwidth", "tests", "step"]]
    parts = written[-1]["parts"]
    assert {k: p["status"] for k, p in parts.items()} == {
        "environment": "done", "bandwidth": "error", "tests": "failed",
        "step": "not run: the tier's deadline had passed"}
    assert parts["bandwidth"]["error"] == "RuntimeError: out of memory" and parts["tests"]["seconds"] == 30
    assert all(p["tier"] == 1 and p["revision"] == "abc1234" for p in parts.values())
    page = (tmp_path / "test-gpu.md").read_text()
    assert page == gpu_check.render(written[-1])
    assert "| step | 1 | not run: the tier's deadline had passed |  | abc1234 |" in page
    assert "- bandwidth: `RuntimeError: out of memory`" in page

    # tier 2 keeps tier 1's parts; a new tier-1 run replaces them
    res = gpu_check.load(tmp_path / "test-gpu.json", {**env, "revision": "def5678"}, 2)
    assert set(res["parts"]) == {"environment", "bandwidth", "tests", "step"}
    res["parts"]["memory"] = {"tier": 2}
    (tmp_path / "test-gpu.json").write_text(json.dumps(res))
    assert set(gpu_check.load(tmp_path / "test-gpu.json", env, 1)["parts"]) == {"memory"}
    # an earlier check's page is not added to
    (tmp_path / "old.json").write_text(json.dumps({"environment": env, "tests": {}}))
    assert gpu_check.load(tmp_path / "old.json", env, 1) == {"format": gpu_check.FORMAT, "parts": {},
                                                             "environment": env}


def _sleeps(seconds, queue):
    import time

    time.sleep(seconds)


@pytest.mark.multiprocess
def test_a_part_in_a_process_of_its_own_is_stopped_past_its_time():
    """A part in a process of its own is stopped past the deadline (bench.optimizer_step._spawn's timeout)."""
    import time

    tic = time.perf_counter()
    with pytest.raises(TimeoutError, match="_sleeps did not end in 2 s; stopped"):
        optimizer_step._spawn(_sleeps, (120,), {}, timeout=2)
    assert time.perf_counter() - tic < 60


@pytest.mark.e2e
def test_only_takes_the_tiers_own_parts(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--tier", "1", "--only", "memory"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("invalid --only memory: tier 1's parts are environment, bandwidth, tests, step")


def step_rows(fallback=None):
    numel = 1000
    times = {"floor": [1e-6, 1.1e-6], "lamb": [2e-5, 2.2e-5], "adamw_fused": [4e-6, 4e-6],
             "lamb_fused": [4e-6, 4.4e-6], "slamb_v2_fused": [1e-5, 1.1e-5]}
    rows = {r["optimizer"]: r for r in optimizer_step.summarize(times, numel, fallback)}
    for name in ("adamw_fused", "lamb", "lamb_fused", "slamb_v2_fused"):
        rows[name].update(first_step_s=1.5, kernels=7, host_ops=5, host_syncs=1)
    return rows


def test_the_step_targets_are_each_rows_traffic_and_fused_adamw():
    """A fused row over its own traffic at the floor's bandwidth (the floor: 7 words at 8 bytes per word of the add_
    pass, 3.5 x its time): fused LAMB's 4 us over 3.5 us x 11/7; SLAMB v2's 10 us over 3.5 us x 15.6/7, and over
    fused AdamW's 4 us, paired; a row that fell back is refused."""
    got = {t["target"]: t for t in gpu_check.step_targets(step_rows())}
    assert [(t["value"], t["verdict"]) for t in got.values()] == [
        (pytest.approx(4 / (3.5 * 11 / 7)), "met"), (pytest.approx(10 / (3.5 * 15.6 / 7)), "met"),
        (pytest.approx(2.625), "missed")]
    refused = gpu_check.step_targets(step_rows({"slamb_v2_fused": "RuntimeError: x"}))
    assert [t["verdict"] for t in refused] == ["met", "refused: its compile failed", "refused: its compile failed"]


def test_a_tiered_page_renders_every_part_it_holds():
    stamp = {"tier": 1, "revision": "abc1234", "dirty": False, "date": "2026-01-01 00:00 UTC", "seconds": 3.0}
    rows = step_rows({"slamb_v2_fused": "RuntimeError: no compiler"})
    rows["lamb_fused"]["profile"] = [{"kernel": "triton_red_fused_0", "calls": 1, "ms": 0.5}]
    res = {"format": gpu_check.FORMAT, "environment": {"gpu": "Test GPU", "torch": "2.11.0", "triton": "3.6.0"},
           "parts": {
               "environment": {**stamp, "status": "done", "api": {"DeviceMesh.from_group": True}},
               "bandwidth": {**stamp, "status": "done", "copy_gb_per_s": 2900.0, "copy_bytes": 1, "segment_blocks":
                             1313409, "segment_tensors": 398, "segment_1d_ms": 0.2, "segment_2d_ms": 9.5,
                             "segment_max_rel_diff": 1e-7},
               "tests": {**stamp, "status": "failed", "command": "python -m pytest -q -m gpu tests/test_gpu.py",
                         "exit_code": 1, "collected": 2, "rows": [
                             {"test": "tests/test_gpu.py::test_a", "outcome": "passed", "seconds": 1.0, "message": ""},
                             {"test": "tests/test_gpu.py::test_b", "outcome": "not run", "seconds": 0.0,
                              "message": "the check's time for its tests ran out"}], "tail": []},
               "step": {**stamp, "status": "failed", "numel": 1000, "steps": 2, "rows": list(rows.values()),
                        "targets": gpu_check.step_targets(rows)},
               "bert_xl": {**stamp, "tier": 2, "status": "done", "numel": 2767626050, "layout_numel": 2767716352,
                           "checked_tensors": 5, "checked_numel": 1000, "first_step_s": 30.0, "max_rel_diff": 1e-7,
                           "fallback": None},
               "deterministic": {**stamp, "tier": 2, "status": "error", "error": "RuntimeError: boom"}}}
    page = gpu_check.render(res)
    assert "| torch | 2.11.0 |" in page and "| triton | 3.6.0 |" in page
    assert "| bandwidth | 1 | done | 3.0 | abc1234 | 2026-01-01 00:00 UTC |" in page
    assert "| DeviceMesh.from_group | True |" in page
    assert "2900.0 GB/s" in page and "1-D segment reduction (the columns one after another) 0.2 ms, 2-D 9.5 ms" in page
    assert "exit code 1, 3.0 s; 1 passed, 1 not run." in page
    assert "| `tests/test_gpu.py::test_b` | not run | 0.0 | the check's time for its tests ran out |" in page
    lines = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| ")}
    assert lines["| slamb_v2_fused"].endswith("| 1.5 | 7 | 1 | RuntimeError: no compiler |")
    assert lines["| lamb_fused"].endswith("| 1.5 | 7 | 1 | none |")
    assert lines["| floor"].endswith("| – | – | – | – |")
    assert "| slamb_v2_fused step / torch's fused AdamW step | 2.0 | – (its compile failed) |" in page
    assert "Kernels of one lamb_fused step (it misses a target)" in page
    assert "| `triton_red_fused_0` | 1 | 0.5 |" in page
    assert "past 2^31 (1,000 entries)" in page and "fallback: none" in page
    assert "- deterministic: `RuntimeError: boom`" in page
    assert "## Deterministic mode" not in page and "## Peak memory" not in page  # what did not run is not shown


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
    tests = res["parts"]["tests"] if "format" in res else res["tests"]
    assert tests["exit_code"] == 0 and all(r["outcome"] == "passed" for r in tests["rows"])
    assert len(tests["rows"]) >= 10
