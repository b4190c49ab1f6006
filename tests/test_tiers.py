"""The test tiers: marks only of the four tier names, and the run-time check (tests/tiers.py) failing a
test that uses a tier it is not marked with, tried on synthetic tests."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from tests.tiers import TIERS

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
# pytest's own marks; every other mark a test carries must be a tier
BUILTIN = {"parametrize", "skipif", "skip", "xfail", "usefixtures", "filterwarnings", "timeout"}


def marks_in(tree: ast.AST) -> set[str]:
    """The X of every ``pytest.mark.X`` a test module names."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"}


def test_the_marks_are_the_four_tiers_and_pytests_own():
    registered = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert sorted(m.split(":")[0] for m in registered) == sorted(TIERS)
    used = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        used |= marks_in(ast.parse(path.read_text()))
    assert used - BUILTIN <= set(TIERS), used - BUILTIN - set(TIERS)
    assert {"multiprocess", "e2e", "netns"} <= used  # the scan sees the marks the suite carries


SYNTHETIC = '''
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

from harness.loop import Loop


def test_python_subprocess_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.multiprocess
def test_python_subprocess_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_helper_command_is_no_worker():
    subprocess.run(["git", "--version"], capture_output=True)


def test_spawned_process_unmarked():
    p = multiprocessing.Process(target=os.getpid)
    p.start()
    p.join()


def test_training_loop_unmarked():
    with pytest.raises(Exception):
        Loop(None, None, None, {}, model=None, optimizer=None, scheduler=None, global_batch=1, throughput="x")


@pytest.mark.e2e
def test_training_loop_marked():
    with pytest.raises(Exception):
        Loop(None, None, None, {}, model=None, optimizer=None, scheduler=None, global_batch=1, throughput="x")


def test_bench_main_unmarked():
    from bench.scaling import main

    with pytest.raises(BaseException):
        main(["--no-such-flag"])


def test_namespace_unmarked():
    with pytest.raises(OSError):
        subprocess.run(["/nonexistent/ip", "netns", "add", "x"])


@pytest.fixture(scope="module")
def workers():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_worker_fixture_unmarked(workers):
    pass


def test_cuda_unmarked(monkeypatch):
    # what CUDA use looks like from the process: initialised, and its allocation count grown
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"allocation.all.allocated": 1})
'''


def test_the_check_fails_exactly_the_tests_that_use_an_unmarked_tier(pytester):
    pytester.makeconftest("from tests.conftest import *  # noqa: F401,F403\n")
    pytester.makeini("[pytest]\nmarkers =\n" + "".join(f"    {t}: tier\n" for t in TIERS))
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    outcomes = {r.nodeid.split("::")[-1]: r.outcome for r in result.reprec.getreports("pytest_runtest_logreport")
                if r.when == "call"}
    assert outcomes == {
        "test_python_subprocess_unmarked": "failed", "test_python_subprocess_marked": "passed",
        "test_helper_command_is_no_worker": "passed", "test_spawned_process_unmarked": "failed",
        "test_training_loop_unmarked": "failed", "test_training_loop_marked": "passed",
        "test_bench_main_unmarked": "failed", "test_namespace_unmarked": "failed",
        "test_worker_fixture_unmarked": "failed", "test_cuda_unmarked": "failed",
    }
    text = result.stdout.str()
    for name, tier in (("test_python_subprocess_unmarked", "multiprocess"), ("test_spawned_process_unmarked",
                       "multiprocess"), ("test_training_loop_unmarked", "e2e"), ("test_bench_main_unmarked", "e2e"),
                       ("test_namespace_unmarked", "netns"), ("test_worker_fixture_unmarked", "multiprocess"),
                       ("test_cuda_unmarked", "gpu")):
        assert f"{name} uses the tier(s) {tier} without the mark" in text, name


COMPILES = '''
import multiprocessing
import os

import torch


def test_compiles_cold_unmarked():
    f = torch.compile(lambda x: (x * 2).sin().sum())
    assert f(torch.ones(8)).item() == torch.ones(8).mul(2).sin().sum().item()


def test_compiles_then_spawns_unmarked():
    torch.compile(lambda x: x + 1)(torch.ones(3))
    p = multiprocessing.Process(target=os.getpid)
    p.start()
    p.join()
'''


@pytest.mark.multiprocess  # runs the synthetic tests in a fresh interpreter, as a fresh machine's first run is
def test_a_cold_compile_is_no_worker_of_the_test(pytester, tmp_path, monkeypatch):
    # before: with an empty inductor cache, the vector-ISA probe that torch.compile runs as a Python subprocess
    # (and its compile-worker pool) counted as the test starting workers, so a quick-tier test failed on a fresh
    # machine only
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty-inductor-cache"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest("from tests.conftest import *  # noqa: F401,F403\n")
    pytester.makeini("[pytest]\nmarkers =\n" + "".join(f"    {t}: tier\n" for t in TIERS))
    pytester.makepyfile(test_compiles=COMPILES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:logging")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "test_compiles_then_spawns_unmarked uses the tier(s) multiprocess without the mark" in text
    assert "test_compiles_cold_unmarked uses" not in text
    assert (tmp_path / "empty-inductor-cache").is_dir()  # the synthetic run compiled into the empty cache
