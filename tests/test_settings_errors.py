"""Settings a run cannot use end the command before any worker starts, as the optimizer's do
(tests/test_cli_errors.py): one line on stderr naming the setting and the fix, exit status 2, no traceback.
These were found late before: after an epoch (data.eval_batch), at the first checkpoint (an unwritable
directory), in the workers (checkpoint.keep, the batch split, the checkpoint's world size), or with a
traceback and exit 1 (an empty schedule, a resume with other inputs)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import harness
from bert.model import build_model
from bert.tiny import write_tiny
from cifar10.data import write_digits
from harness.build import check_data, check_trainer
from harness.checkpoint import Checkpointer
from swin.tiny import write_tiny_imagenet
from tests.test_configs import ROOTS, compose_root

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiprocess  # each case runs a pipeline's command line as a subprocess


def refused(module: str, args: list[str], run_dir: Path) -> str:
    """Run ``python -m module args`` and return its one stderr line, checking it ended before any worker."""
    tic = time.perf_counter()
    # trainer.device=cpu: auto would add its one-line CPU-fallback notice on a machine without a GPU
    done = subprocess.run([sys.executable, "-m", module, *args, "trainer.device=cpu", f"hydra.run.dir={run_dir}"],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    elapsed = time.perf_counter() - tic
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert not (run_dir / "meta.json").exists()  # no worker wrote its run directory
    assert elapsed < 120  # the interpreter's imports and Hydra's composition, no process group, no data
    return done.stderr


# two workers and no CIFAR-10 files: a worker that started would fail on them instead
CIFAR = ["experiment=cifar10/lamb", "trainer.nproc_per_node=2"]


@pytest.mark.parametrize("override, line", [
    ("data.eval_batch=0", "error: invalid data.eval_batch=0: must be an integer >= 1; fix: set data.eval_batch to an "
                          "allowed value (command line or the pipeline's configs/data/*.yaml)"),
    ("data.micro_batch=-4", "error: invalid data.micro_batch=-4: must be an integer >= 1; fix: set data.micro_batch"),
    ("data.augment=maybe", "error: invalid data.augment='maybe': must be one of [False, True]; fix: set data.augment"),
    ("epochs=0", "error: invalid epochs=0: must be an integer >= 1 (an empty schedule trains nothing)"),
    ("trainer.checkpoint.keep=0", "error: invalid trainer.checkpoint.keep=0: must be an integer >= 1 (the last "
                                  "checkpoint resumes the run); fix: set trainer.checkpoint.keep to an allowed value"),
    ("trainer.timeout_s=0", "error: invalid trainer.timeout_s=0: must be a number of seconds > 0"),
    ("+trainer.max_restart=3", "error: unknown setting trainer.max_restart=3 (did you mean trainer.max_restarts?); "
                               "known: ['checkpoint', 'cudnn_benchmark', 'deterministic', 'device', 'fault_tolerance', 'heal', "
                               "'max_restarts', "),
    ("+trainer.checkpoint.evry=5", "error: unknown setting trainer.checkpoint.evry=5 (did you mean "
                                   "trainer.checkpoint.every?); known: ['enabled', 'every', 'keep']; fix: drop "
                                   "trainer.checkpoint.evry or correct its name (configs/trainer/default.yaml)"),
    # before: accepted, augmentation stayed on
    ("+data.augmnt=false", "error: unknown setting data.augmnt=False (did you mean data.augment?); known: "),
    ("+foo=1", "error: unknown setting foo=1; known: "),  # before: accepted
    # before: a traceback from the workers
    ("trainer.threads_per_worker=0", "error: invalid trainer.threads_per_worker=0: must be an integer >= 1"),
    ("seed=abc", "error: invalid seed='abc': must be an integer >= 0"),  # before: named no setting
    # before: asked for a shard size first, then refused for this
    ("trainer.parallelism=hsdp", "error: invalid trainer.parallelism=hsdp: this pipeline trains full replicas only"),
])
def test_a_rejected_setting_ends_the_command_before_any_worker(tmp_path, override, line):
    (tmp_path / "empty").mkdir()  # data that exists, so that the check of each setting is what ends the command
    stderr = refused("cifar10.train", [*CIFAR, f"data.dir={tmp_path / 'empty'}", override], tmp_path / "run")
    assert stderr.startswith(line), stderr


def test_an_unwritable_checkpoint_directory_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt").write_text("a file where the checkpoints go")  # unwritable, even for root
    data = write_digits(tmp_path / "digits", 64, 32)
    stderr = refused("cifar10.train", [*CIFAR, f"data.dir={data}", "data.micro_batch=16"], run)
    assert stderr.startswith(f"error: checkpoint directory {run / 'ckpt'} is not writable ({run / 'ckpt'}: Not a "
                             "directory): make it writable, choose another run directory"), stderr
    # a run without checkpoints has nothing to write there: it gets past this check (to the data it lacks, which
    # the launcher reads before any worker starts, as it records what the run reads)
    (tmp_path / "empty").mkdir()
    stderr = refused("cifar10.train", [*CIFAR, f"data.dir={tmp_path / 'empty'}", "trainer.checkpoint.enabled=false"],
                     run)
    assert stderr.startswith(f"error: CIFAR-10 not found in {tmp_path / 'empty'}: missing data_batch_1"), stderr


def test_resuming_with_other_inputs_or_another_world_size_is_refused_before_any_worker(tmp_path):
    run = tmp_path / "run"
    data, other = write_digits(tmp_path / "data", 64, 32), write_digits(tmp_path / "other", 64, 32)
    # the checkpoint of a run of two workers on data/
    two = harness.DistEnv(0, 2, 0, 2, torch.device("cpu"))
    Checkpointer(run, two, inputs={"data.dir": str(data)}).save({"epoch": 1, "step": 4}, {}, {})
    stderr = refused("cifar10.train", [*CIFAR, f"data.dir={tmp_path / 'other'}", "data.micro_batch=16"], run)
    assert f"was trained with data.dir='{data}' and this run has data.dir='{tmp_path / 'other'}'" in stderr
    stderr = refused("cifar10.train", [*CIFAR[:1], "trainer.nproc_per_node=3", f"data.dir={data}", "data.micro_batch=16"],
                     run)
    assert f"the run in {run / 'ckpt'} takes each step in 2 micro-batches of data.micro_batch samples" in stderr
    assert not (run / "run.lock").exists()  # released on the way out


@pytest.mark.parametrize("module, args, line", [
    ("bert.train", ["experiment=bert/phase1_lamb", "data.global_batch=64", "data.micro_batch=48",
                    "trainer.nproc_per_node=2"],
     "error: data.global_batch=64 is not a multiple of data.micro_batch=48 x 2 workers = 96"),
    ("squad_finetune.train", ["experiment=squad/tiny", "data.global_batch=3", "trainer.nproc_per_node=2"],
     "error: data.global_batch=3 must be a multiple of the 2 workers"),
])
def test_a_batch_that_does_not_split_over_the_workers_is_refused_before_any_worker(tmp_path, module, args, line):
    stderr = refused(module, [*args, f"data.dir={tmp_path / 'absent'}"] if module == "bert.train" else args,
                     tmp_path / "run")
    assert stderr.startswith(line), stderr


@pytest.mark.parametrize("module, args, line", [
    # before: each failed in the workers, after they started (exit status 65, or a traceback of 71-198 lines)
    ("swin.train", ["model.arch=swin_nonexistent"], "error: invalid model.arch='swin_nonexistent': must name a timm "
                                                    "Swin model"),
    ("swin.train", ["lr_scaling.reference_batch=0"], "error: invalid lr_scaling.reference_batch=0: must be an integer "
                                                     ">= 1"),
    ("bert.train", ["model=bert_tiny", "model.vocab_size=50", "data.seq_len=32", "data.global_batch=64",
                    "data.micro_batch=8"], "error: invalid model.vocab_size=50: {data}/part0_training.hdf5 holds token "
                                           "id 87; set model.vocab_size=88 or more"),
    ("squad_finetune.train", ["eval.n_best=0"], "error: invalid eval.n_best=0: must be an integer >= 1"),
])
def test_a_pipelines_own_bad_setting_ends_the_command_before_any_worker(tmp_path, module, args, line):
    from tests.test_configs import write_bert_shards

    data = write_bert_shards(tmp_path / "shards") if module == "bert.train" else tmp_path
    (tmp_path / "squad.json").write_text("{}")
    inputs = {"squad_finetune.train": [f"model.dir={tmp_path}", f"data.train_file={tmp_path / 'squad.json'}",
                                       f"data.dev_file={tmp_path / 'squad.json'}"]}.get(module, [f"data.dir={data}"])
    stderr = refused(module, [*args, *inputs, "trainer.nproc_per_node=2"], tmp_path / "run")
    assert stderr.startswith(line.format(data=data)), stderr


@pytest.mark.parametrize("module", ["cifar10.train", "swin.train", "squad_finetune.train"])
def test_data_the_run_cannot_take_a_step_on_ends_the_command_before_any_worker(tmp_path, module):
    """Before: each was found in the workers, after they had started (one line, exit status 65)."""
    from cifar10.data import write_digits

    if module == "cifar10.train":  # 64 training images, 32 for each of 2 workers
        args = [*CIFAR, f"data.dir={write_digits(tmp_path / 'cifar', 64, 16)}", "data.micro_batch=40"]
        line = ("error: invalid data.micro_batch=40: the 64 training samples give each of a step's 2 micro-batches 32, "
                "not a full batch: no step would be taken; set data.micro_batch to at most 32, or run on fewer workers; "
                "fix: set data.micro_batch to an allowed value (command line or the pipeline's configs/data/*.yaml)")
    elif module == "swin.train":  # 32 training images
        args = ["experiment=swin_b/slamb", "model=swin_tiny_test", f"data.dir={write_tiny_imagenet(tmp_path / 'in')}",
                "data.micro_batch=20", "data.global_batch=40", "data.workers=0", "epochs=2", "schedule.warmup_epochs=1",
                "trainer.nproc_per_node=2"]
        line = ("error: invalid data.micro_batch=20: the 32 training samples give each of a step's 2 micro-batches 16, "
                "not a full batch: no step would be taken; set data.micro_batch to at most 16, or run on fewer workers")
    else:
        (tmp_path / "train.json").write_text("<html>a page, not the file</html>")
        args = [f"model.dir={tmp_path}", f"data.train_file={tmp_path / 'train.json'}",
                f"data.dev_file={tmp_path / 'train.json'}", "trainer.nproc_per_node=2"]
        line = (f"error: invalid data.train_file='{tmp_path / 'train.json'}': SQuAD file {tmp_path / 'train.json'} is "
                "not valid JSON (Expecting value: line 1 column 1 (char 0)); fix: set data.train_file to an allowed value "
                "(command line or the pipeline's configs/data/*.yaml)")
    stderr = refused(module, args, tmp_path / "run")
    assert stderr.startswith(line), stderr


@pytest.mark.parametrize("root", ROOTS)
def test_every_pipelines_defaults_pass_the_checks(root):
    cfg = compose_root(root)
    check_trainer(cfg["trainer"])
    check_data(cfg["data"], cfg["trainer"]["nproc_per_node"])


def test_missing_data_is_refused_before_any_worker_and_never_retried(tmp_path):
    """A worker would fail on it at every attempt, ``trainer.max_restarts`` times over."""
    stderr = refused("cifar10.train", [*CIFAR, "trainer.max_restarts=3", f"data.dir={tmp_path / 'absent'}"],
                     tmp_path / "run")
    assert stderr == (f"error: invalid data.dir='{tmp_path / 'absent'}': {tmp_path / 'absent'} does not exist; fix: "
                      "set data.dir to an allowed value (command line or the pipeline's configs/data/*.yaml)\n")


@pytest.mark.parametrize("overrides, line", [
    (["experiment=bert/phase1_lamb", "schedule.warmup_steps=5"],
     "error: invalid schedule.warmup_steps=5: the warm-up must end before the run's steps=5 do; set "
     "schedule.warmup_steps to at most 4"),
    (["experiment=bert/phase2_lamb", "schedule.warmup_fraction=0.9"],
     "error: invalid schedule.warmup_fraction=0.9 (5 steps): the warm-up must end before the run's steps=5 do; "
     "set schedule.warmup_steps to at most 4"),
])
def test_a_warmup_the_run_never_finishes_is_refused_before_any_worker(tmp_path, overrides, line):
    """Before, the workers' LR schedule refused it once they had loaded the data: exit status 65."""
    data = write_tiny(tmp_path / "bert", (32,))
    phase1 = tmp_path / "phase1"  # init_from: a saved model
    build_model(compose_root("bert", "model=bert_tiny")["model"]).save_pretrained(phase1)
    args = [*overrides, "model=bert_tiny", f"data.dir={data[32]}", "data.seq_len=32", "data.global_batch=8",
            "data.micro_batch=4", "steps=5", "trainer.nproc_per_node=2", f"init_from={phase1}"]
    assert refused("bert.train", args, tmp_path / "run").startswith(line)


def test_a_swin_warmup_the_run_never_finishes_is_refused_before_any_worker(tmp_path):
    """Before, timm's cosine schedule refused it in the workers, once they had built the data loaders: exit 65."""
    data = write_tiny_imagenet(tmp_path / "imagenet")
    args = ["experiment=swin_b/slamb", "model=swin_tiny_test", f"data.dir={data}", "data.micro_batch=4",
            "data.workers=0", "epochs=2", "trainer.nproc_per_node=2"]
    assert refused("swin.train", args, tmp_path / "run").startswith(
        "error: invalid schedule.warmup_epochs=20: the warm-up must end before the run's epochs=2 do; set "
        "schedule.warmup_epochs to at most 1")


def test_a_required_setting_left_unset_is_one_line(tmp_path):
    # before: omegaconf's MissingMandatoryValue, a traceback and exit status 1
    stderr = refused("squad_finetune.train", [], tmp_path / "run")
    assert stderr == ("error: model.dir is required and not set; fix: set model.dir=... on the command line (or pick "
                      "an experiment that sets it)\n")
