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
from harness import distributed
from harness.build import check_optimizer, check_settings, user_error
from tests.test_configs import compose_cfg

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
    ("trainer.parallelism=fsdp", "invalid trainer.parallelism=fsdp: this pipeline trains full replicas only; "
                                 "bert.train and swin.train shard. Set trainer.parallelism=ddp"),
    pytest.param("trainer.device=cuda", f"invalid trainer.device='cuda': no usable CUDA device (torch built for CUDA "
                 f"{torch.version.cuda or 'none (a CPU build)'}, NVIDIA driver ",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is usable here")),
    # before: Hydra's report of 6 lines and more, exit status 1
    ("data.augmnt=false", "error: unknown setting data.augmnt='false' (did you mean data.augment?); known: ['augment', "
                          "'dir', 'eval_batch', 'micro_batch', 'name', 'valid_images', 'valid_seed']; fix: drop "
                          "data.augmnt or correct its name (the "
                          "pipeline's configs/); +data.augmnt=... adds a setting the pipeline reads"),
    ("experiment=cifar10/slamm", "error: unknown option experiment='cifar10/slamm' (did you mean "
                                 "experiment=cifar10/slamb?); known: ['bert/phase1_lamb', "),
    ("optimizer=adamm", "error: unknown option optimizer='adamm' (did you mean optimizer=adamw?); known: ['adamw', "),
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


@pytest.mark.multiprocess
def test_torchft_under_torchrun_is_refused_in_one_line_of_the_first_worker(tmp_path):
    """torchrun starts the workers before any of the project's code runs: each refuses, the first says why (before:
    every worker said it), and torchrun then reports its failed workers itself."""
    done = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
                           "-m", "cifar10.train", "experiment=cifar10/slamb", "+mixin=torchft", "trainer.replica_groups=2",
                           f"data.dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert said == ["error: invalid trainer.fault_tolerance=torchft with a job started by torchrun or SLURM: set "
                    "python -m <pipeline> (the launcher starts the groups and the lighthouse) (+mixin=torchft sets them); "
                    "fix: set trainer.fault_tolerance to an allowed value (command line or configs/trainer/default.yaml)"]
    assert "exitcode  : 2" in done.stderr  # torchrun's report of the worker that refused
    assert not (tmp_path / "run" / "meta.json").exists()


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


# ----------------------------------------------------------------------------- trainer.device


@pytest.fixture
def gpus(monkeypatch):
    """A node whose visible CUDA devices the test sets (``gpus(n)``; 0: none usable); no worker environment."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS",
                "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(distributed, "driver_version", lambda: "470.57")

    def visible(n: int):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda") if n else None)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


def device_settings(*overrides) -> dict:
    # an existing data.dir: the checks before any worker also refuse a missing one, and these cases test the device
    return compose_cfg("experiment=cifar10/slamb", "trainer.nproc_per_node=2", f"data.dir={Path(__file__).parent}",
                       *overrides)


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_workers_than_gpus_are_refused_naming_both_numbers(gpus, device):
    """local_rank % devices put two workers on one GPU, which NCCL refuses once they have all started."""
    gpus(1)
    with pytest.raises(ValueError) as caught:
        check_settings(device_settings(f"trainer.device={device}"))
    line = user_error(caught.value, {"name": "slamb"})
    assert line.startswith("error: invalid trainer.nproc_per_node=2: 2 workers on this node and 1 visible cuda device")
    assert "\n" not in line and line.endswith("fix: set trainer.nproc_per_node to an allowed value (command line or "
                                              "configs/trainer/default.yaml)")
    gpus(2)
    check_settings(device_settings(f"trainer.device={device}"))


def test_one_named_gpu_for_several_workers_is_refused(gpus):
    gpus(2)
    with pytest.raises(ValueError, match=r"invalid trainer.device='cuda:1': one device for 2 workers on this node"):
        check_settings(device_settings("trainer.device=cuda:1"))
    check_settings(device_settings("trainer.device=cuda:1", "trainer.nproc_per_node=1"))


def test_torchrun_workers_are_counted_by_torchrun(gpus, monkeypatch):
    """Under torchrun trainer.nproc_per_node is ignored: the node's workers are LOCAL_WORLD_SIZE."""
    gpus(4)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"trainer.nproc_per_node=8: 8 workers on this node and 4 visible"):
        check_settings(device_settings())


def test_a_worker_beyond_the_visible_gpus_is_refused(gpus):
    gpus(2)
    assert distributed.resolve_device("auto", 1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"3 workers on this node and 2 visible cuda device"):
        distributed.resolve_device("auto", 2)  # was cuda:0, the device of local rank 0


def test_auto_falling_back_to_the_cpu_says_so_in_one_line(gpus, capsys):
    gpus(0)
    check_settings(device_settings())
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"notice: trainer.device=auto found no usable GPU (torch built for CUDA "
                              f"{torch.version.cuda or 'none (a CPU build)'}, NVIDIA driver 470.57): the workers "
                              "train on the CPU")
    assert distributed.resolve_device("auto", 1) == torch.device("cpu")
    check_settings(device_settings("trainer.device=cpu"))  # asked for: nothing to say
    assert capsys.readouterr().err == ""


def test_cuda_without_a_usable_cuda_names_the_versions(gpus):
    gpus(0)
    with pytest.raises(ValueError, match=r"invalid trainer.device='cuda': no usable CUDA device \(torch built for "
                                         r"CUDA .*, NVIDIA driver 470.57\)"):
        check_settings(device_settings("trainer.device=cuda", "trainer.nproc_per_node=1"))


def test_driver_version_comes_from_nvidia_smi(monkeypatch):
    def smi(args, **kwargs):
        assert args[0] == "nvidia-smi"
        return subprocess.CompletedProcess(args, 0, stdout="535.104.05\n535.104.05\n", stderr="")

    monkeypatch.setattr(distributed.subprocess, "run", smi)
    assert distributed.driver_version() == "535.104.05"

    def absent(args, **kwargs):
        raise FileNotFoundError(args[0])

    monkeypatch.setattr(distributed.subprocess, "run", absent)
    assert distributed.driver_version() == "unknown"


# what only the workers use, each 1-3 s of imports: a command its settings check refuses does without them
WORKER_ONLY = ("torch._dynamo", "timm", "transformers", "matplotlib", "wandb")


@pytest.mark.multiprocess  # each pipeline's command line as a subprocess
@pytest.mark.parametrize("module, args", [("cifar10.train", []), ("swin.train", []), ("bert.train", []),
                                          ("squad_finetune.train", ["experiment=squad/tiny"])])
def test_a_settings_error_imports_nothing_only_the_workers_use(tmp_path, module, args):
    # before: torch._dynamo in every pipeline (torch.compiler.disable on the optimizers' steps), timm and wandb
    # in Swin's (its data and model modules at the top of swin.train)
    # the command's own modules as it exits, not its workers' fork server's (started beside the checks, and
    # stopped by the refusal), which -X importtime would interleave with the command's on stderr
    modules = tmp_path / "modules.txt"
    command = ("import atexit, runpy, sys; "
               f"atexit.register(lambda: open({str(modules)!r}, 'w').write(chr(10).join(sys.modules))); "
               f"sys.argv = sys.argv[1:]; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    done = subprocess.run([sys.executable, "-c", command, module, *args, "trainer.checkpoint.keep=0",
                           "trainer.device=cpu", f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    imported = set(modules.read_text().split())
    said = done.stderr.splitlines()
    assert done.returncode == 2 and len(said) == 1, said[-20:]
    assert said[0].startswith("error: invalid trainer.checkpoint.keep=0"), said
    assert sorted(m for m in imported if m.split(".")[0] in WORKER_ONLY or m.startswith(WORKER_ONLY)) == []


@pytest.mark.parametrize("overrides, notice", [
    (["experiment=cifar10/slamb", "trainer.nproc_per_node=1"], "optimizer=slamb"),
    (["experiment=cifar10/lamb", "optimizer=onebit_lamb", "trainer.nproc_per_node=1"], "optimizer=onebit_lamb"),
    (["experiment=cifar10/lamb", "trainer.nproc_per_node=1"], None),  # LAMB's all-reduce: nothing hidden
    (["experiment=cifar10/slamb", "trainer.nproc_per_node=2"], None),
])
def test_a_compressing_optimizer_on_one_worker_says_it_sends_nothing(overrides, notice, capsys):
    """One worker sends nothing: a smoke run or a sweep of SLAMB's settings at that size measures no compression
    (before: the beta3 sweep's cells gave the same loss, without a word)."""
    check_settings(compose_cfg(*overrides, "trainer.device=cpu", f"data.dir={Path(__file__).parent}"))
    err = capsys.readouterr().err
    if notice is None:
        assert err == ""
    else:
        assert err.count("\n") == 1 and err.startswith(f"notice: {notice} on one worker sends nothing: its "
                                                       "compression is not exercised"), err
