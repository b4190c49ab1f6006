"""A rejected setting ends the command before any worker starts: one line on stderr naming the setting,
its allowed values and the fix, exit status 2, no launcher traceback."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import slamb
from harness.build import check_optimizer, user_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, line", [
    ("optimizer.lr=inf", "invalid lr=inf: must be a number in [0.0, 100.0]; fix: set optimizer.lr"),
    ("optimizer.lr=1e300", "invalid lr=1e+300: must be a number in [0.0, 100.0]; fix: set optimizer.lr"),
    ("optimizer.compression_warmup=[2.0]",
     "invalid compression_warmup[0]=2.0: must be a number in (0.0, 1.0]; fix: set optimizer.compression_warmup"),
    ("optimizer.compress_ratio=1.5", "invalid compress_ratio=1.5: must be a number in (0.0, 1.0]; fix: set "
                                     "optimizer.compress_ratio to an allowed value (command line or "
                                     "configs/optimizer/slamb.yaml)"),
    ("optimizer.name=adam", "unknown optimizer 'adam'; known: ['adamw', "),
])
@pytest.mark.multiprocess
def test_rejected_setting_is_one_line_and_exit_2_before_any_worker(tmp_path, override, line):
    run_dir = tmp_path / "run"
    # two workers and no data: a worker that started would fail on the missing CIFAR-10 files instead
    args = ["experiment=cifar10/slamb", override, "trainer.nproc_per_node=2",
            f"data.dir={tmp_path / 'absent'}", f"hydra.run.dir={run_dir}"]
    tic = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cifar10.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    elapsed = time.perf_counter() - tic
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ") and line in done.stderr, done.stderr
    assert done.stdout == "" and not (run_dir / "meta.json").exists()  # no worker wrote its run directory
    assert elapsed < 120  # the interpreter's imports and Hydra's composition, no process group, no data


@pytest.mark.parametrize("name, settings, match", [
    ("sgd", dict(lr=float("inf")), r"invalid lr=inf: must be a number in \[0.0, 100.0\]"),  # torch takes inf
    ("adamw", dict(lr=1e300), r"invalid lr=1e\+300"),
    ("dgc", dict(lr=-0.1), r"invalid lr=-0.1"),
    ("lamb", dict(lr=float("nan")), r"invalid lr=nan"),
    ("slamb", dict(compression_warmup=[0.5, 2.0]), r"invalid compression_warmup\[1\]=2.0"),
])
def test_every_optimizer_gets_finite_lr_bounds(name, settings, match):
    with pytest.raises(ValueError, match=match):
        check_optimizer({"name": name, **settings})
    with pytest.raises(ValueError, match=match):
        slamb.create_optimizer(name, torch.nn.Linear(2, 2), **settings)


def test_user_error_names_the_fix():
    ocfg = {"name": "onebit_lamb"}
    with pytest.raises(ValueError) as caught:
        check_optimizer({**ocfg, "freeze_step": 0})
    assert user_error(caught.value, ocfg) == (
        f"error: {caught.value}; fix: set optimizer.freeze_step to an allowed value (command line or "
        "configs/optimizer/onebit_lamb.yaml)")
    assert user_error(ValueError("invalid trainer.precision='fp8': must be one of ['fp32']"), ocfg).endswith(
        "fix: set trainer.precision to an allowed value (command line or configs/trainer/default.yaml)")
