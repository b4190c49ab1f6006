"""The CIFAR-10, BERT, Swin and SQuAD pipelines under ``trainer.fault_tolerance=torchft`` (harness/fault_tolerance.py), as a user
runs them: ``python -m cifar10.train ... +mixin=torchft``, whose launcher starts torchft's lighthouse and 3 replica
groups of one gloo worker each on the CPU (BERT also of two workers sharding the model); a group killed before a
step (the fault-injection hook) and relaunched.
LAMB's (data-parallel) steps under a failure: tests/test_torchft.py."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from cifar10.data import channel_stats, load_cifar10, write_digits
from cifar10.model import build_model
from cifar10.train import evaluate
from harness.build import check_settings, user_error
from harness.distributed import DistEnv
from bert.model import load_pretrained
from bert.tiny import write_tiny
from bert.train import validation_batches, validation_metrics
from harness.amp import MixedPrecision
from tests.test_cifar10 import ROOT, SLAMB_TINY, TINY, cli, env, history
from tests.test_configs import compose_cfg, compose_root
from tests.test_squad import bert_dir as squad_bert_dir  # noqa: F401 (a fixture)

pytest.importorskip("torchft")

# TINY's job on 3 replica groups; each epoch is 3 steps of 3 x 16 images
GROUPS = [a for a in TINY if not a.startswith("trainer.nproc_per_node")]
# a torchft group scores the whole evaluation set in batches of its own, the 3 workers each their shard: other
# float32 sums in each batch's loss (measured: 2.2e-6 relative on the test loss, on one machine and not another)
EVALUATED = {"test_loss": 1e-5, "val_mlm_loss": 1e-5}
COMPARED = ("epoch", "step", "train_loss", "train_top1", "test_loss", "test_top1", "lr", "compress_ratio",
            "bytes_cum/momentum", "bytes_cum/momentum_dense", "bytes_cum/params", "bytes_cum/grads")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("digits") / "cifar-10-batches-py", 144, 40)


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    """The same exported tensor to float32 rounding, as a whole: the gradients' average through the manager
    sums in another order than DDP's buckets, and LAMB's steps carry the last bits into a few elements
    (measured after 6 steps: 1 of 1,152 elements 1.1e-5 apart, the tensor 1e-6 relative; identical on
    another machine)."""
    a, b = a.double(), b.double()
    assert a.shape == b.shape and ((a - b).norm() <= 1e-5 * b.norm() + 1e-7), \
        f"{key}: {((a - b).norm() / b.norm().clamp_min(1e-12)).item():.2e} relative"


def rows(run_dir) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in history(run_dir)]


def exported(run_dir) -> dict:
    return torch.load(run_dir / "model" / "model.pt", weights_only=True)


TORCHFT = ["+mixin=torchft", "trainer.replica_groups=3", "trainer.timeout_s=60"]
PLAIN = ["trainer.nproc_per_node=3", "trainer.checkpoint.enabled=false"]  # the same job on 3 workers


def command(module: str, args, extra_env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env(**(extra_env or {})),
                          capture_output=True, text=True, timeout=600, check=False)


def torchft_and_plain(module: str, common: list[str], tmp_path, compared, torchft=TORCHFT,
                      plain=PLAIN) -> tuple[list[dict], list[dict]]:
    """``common`` under torchft (3 groups, ``tmp_path/ft``) and on 3 plain workers (``tmp_path/plain``): the
    ``compared`` keys of each run's lines."""
    for name, mode in (("ft", torchft), ("plain", plain)):
        done = command(module, [*common, *mode, f"hydra.run.dir={tmp_path / name}"])
        assert done.returncode == 0, done.stderr[-3000:]
    return tuple([{k: r[k] for k in compared if k in r} for r in history(tmp_path / d)] for d in ("ft", "plain"))


def assert_same_lines(a: list[dict], b: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in a] == steps and [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            assert rb[key] == pytest.approx(value, rel=EVALUATED.get(key, 1e-6)), key


def assert_same_exports(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert_same_tensor(a[key], b[key], key)


def killed_and_relaunched(module: str, args: list[str], step: int, run_dir, rank: int = 1,
                          who: str = "replica group 1") -> list[dict]:
    """``args`` under torchft with worker ``rank`` (``who``: of group 1) killed before ``step``: the others train
    on and the group is relaunched once (one line); the run's lines."""
    done = command(module, [*args, *TORCHFT, f"hydra.run.dir={run_dir}"],
                   extra_env={"SLAMB_FAULT_AT_STEP": str(step), "SLAMB_FAULT_RANK": str(rank)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert f"[fault injection] rank {rank} exits before step {step}" in out
    assert "GET /checkpoint/" not in out  # the heal server's access lines (before: one per request of each heal)
    assert [line for line in out.splitlines() if line.startswith("replica group ")] == [
        f"replica group 1 failed ({who}: exit status 17); relaunched (1 of trainer.max_restarts=3): it "
        "joins the others at a coming step"], out[-3000:]
    return history(run_dir)


@pytest.mark.parametrize("optimizer", [SLAMB_TINY, ["experiment=cifar10/lamb"]], ids=["slamb", "lamb"])
@pytest.mark.multiprocess
def test_a_torchft_run_computes_what_the_same_job_on_three_workers_computes(data, tmp_path, optimizer):
    # the same samples per step, the same exchange through the manager, the same averaged model
    a, b = torchft_and_plain("cifar10.train", [*optimizer, *GROUPS, "epochs=2", f"data.dir={data.parent}"], tmp_path,
                             COMPARED)
    assert_same_lines(a, b, [3, 6])
    assert_same_exports(exported(tmp_path / "ft"), exported(tmp_path / "plain"))


@pytest.mark.multiprocess
def test_a_killed_group_is_relaunched_and_rejoins_while_the_others_train_on(data, tmp_path):
    run_dir = tmp_path / "run"
    # group 1 dies before step 5 (mid epoch 2); the others fail that step's commit, take it again without it,
    # and go on; the launcher relaunches group 1, which takes a peer's state and joins at a coming step
    lines = killed_and_relaunched("cifar10.train", [*SLAMB_TINY, *GROUPS, "epochs=4", f"data.dir={data.parent}"],
                                  5, run_dir)
    # every epoch once, in order, though the group that wrote the first may not write the others
    assert [(r["epoch"], r["step"]) for r in lines] == [(1, 3), (2, 6), (3, 9), (4, 12)]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["steps"] == 12 and summary["final_test_loss"] == lines[-1]["test_loss"]
    # the export is the run's model: the groups' average the last line scored
    cfg = json.loads((run_dir / "model" / "config.json").read_text())
    model = build_model(cfg)
    model.load_state_dict(exported(run_dir), strict=True)
    test_x, test_y = load_cifar10(data.parent)["test"]
    scored = evaluate(model, test_x, test_y, DistEnv(0, 1, 0, 1, torch.device("cpu")), 64,
                      channel_stats(torch.device("cpu")))
    assert scored["test_loss"] == pytest.approx(summary["final_test_loss"], rel=1e-5)
    assert scored["test_top1"] == summary["final_test_top1"]


@pytest.mark.multiprocess
def test_a_killed_launcher_takes_its_groups_with_it_and_a_rerun_right_after_runs_clean(data, tmp_path):
    """Before: the groups of a launcher killed with SIGKILL (the lighthouse's host) waited out torchft's quorum
    timeout of 300 s, whatever trainer.timeout_s, then wrote error.rank*.txt into the run directory, where a rerun
    that had finished meanwhile then looked failed."""
    from tests.test_faults import kill_the_launcher

    args = [*SLAMB_TINY, *GROUPS, "epochs=2", f"data.dir={data.parent}", *TORCHFT]
    run, plain = tmp_path / "run", tmp_path / "plain"
    uninterrupted = subprocess.Popen([sys.executable, "-m", "cifar10.train", *SLAMB_TINY, *GROUPS, "epochs=2",
                                      f"data.dir={data.parent}", *PLAIN, f"hydra.run.dir={plain}"], cwd=ROOT,
                                     env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # group 0 hangs in epoch 2, the others wait for it
    groups, everything = kill_the_launcher("cifar10.train", args, run, 5)
    print(f"the groups ended {groups:.2f} s after their launcher was killed, all it started {everything:.2f} s")
    assert groups < 10
    rerun = command("cifar10.train", [*args, f"hydra.run.dir={run}"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert uninterrupted.wait(timeout=600) == 0, uninterrupted.stderr.read()[-3000:]
    uninterrupted.stderr.close()
    assert_same_lines(rows(run), rows(plain), [3, 6])
    assert not list(run.glob("error.rank*.txt"))


@pytest.mark.multiprocess  # a subprocess joins a replica group
def test_a_quorum_waits_trainer_timeout_s_not_torchfts_300_s(tmp_path):
    """A group whose quorum cannot form (a lighthouse that wants 2 groups, and 1 asks) fails after trainer.timeout_s
    (3 s here); before, after torchft's 300 s."""
    code = ("import os, sys, time, torch; from torchft.coordination import LighthouseServer\n"
            "server = LighthouseServer(bind='[::]:0', min_replicas=2, join_timeout_ms=100, heartbeat_timeout_ms=5000)\n"
            f"os.environ['SLAMB_FT'] = server.address() + ' 0 2 0 {tmp_path} 0 1'\n"
            "from harness.replica import join\n"
            "group = join(torch.device('cpu'), 3.0).group\n"
            "tic = time.monotonic()\n"
            "try:\n"
            "    group.manager.start_quorum(); group.manager.wait_quorum()\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, round(time.monotonic() - tic))\n"
            "group.shutdown(); server.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(RUST_LOG="error"), capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    failure, seconds = done.stdout.split()
    assert failure == "TimeoutError" and 3 <= int(seconds) < 60


def refused(*overrides, root="cifar10", fault_tolerant=True) -> str:
    cfg = compose_root(root, *overrides) if root != "cifar10" else compose_cfg(*overrides)
    with pytest.raises(ValueError) as error:
        check_settings(cfg, fault_tolerant=fault_tolerant)
    return user_error(error.value, cfg["optimizer"])


@pytest.mark.parametrize("overrides, line", [
    (["trainer.nproc_per_node=2"], "error: invalid trainer.fault_tolerance=torchft with trainer.nproc_per_node=2 "
     "(each replica group's workers) and trainer.parallelism=ddp trainer.shard_size=None: set trainer.parallelism=hsdp "
     "trainer.shard_size=2 (each group shards its model over its workers), or trainer.nproc_per_node=1"),
    (["trainer.parallelism=fsdp"], "error: invalid trainer.fault_tolerance=torchft with trainer.parallelism=fsdp and "
     "one worker per group: set trainer.parallelism=ddp, or trainer.nproc_per_node=N trainer.parallelism=hsdp "
     "trainer.shard_size=N (groups of N workers sharding their model)"),
    (["trainer.checkpoint.enabled=true"], "with trainer.checkpoint.enabled=true (its groups hold the run's state and "
     "heal each other): set trainer.checkpoint.enabled=false"),
    (["trainer.precision=fp16"], "set trainer.precision=fp32 or bf16"),
    (["trainer.min_replicas=4"], "error: invalid trainer.min_replicas=4: more than the job's "
     "trainer.replica_groups=3; fix: set trainer.min_replicas to an allowed value"),
    (["trainer.heal=copy"], "error: invalid trainer.heal='copy': must be one of"),
    (["optimizer=dgc"], "with optimizer=dgc: SLAMB, or a data-parallel optimizer (lamb, adamw, sgd), runs "
     "under it; pick one of those"),
    (["optimizer.overlap=true"], "with optimizer.overlap=true: SLAMB runs its collectives through torchft's manager "
     "one at a time; drop the setting"),
])
def test_what_torchft_cannot_run_is_refused_in_one_line_before_any_worker(overrides, line):
    base = [] if overrides[0].startswith("optimizer=") else ["experiment=cifar10/slamb"]
    assert line in refused(*base, "+mixin=torchft", "trainer.replica_groups=3", *overrides)


def test_a_pipeline_without_torchft_refuses_it():
    assert "this pipeline runs without it (a pipeline whose loop is harness.Loop's takes it with " \
           "run_from_hydra(..., fault_tolerant=True)); set trainer.fault_tolerance=none" in \
        refused("experiment=cifar10/slamb", "+mixin=torchft", fault_tolerant=False)


@pytest.mark.multiprocess
def test_a_run_directory_with_another_runs_checkpoints_is_refused(data, tmp_path):
    run_dir = tmp_path / "run"
    common = [*SLAMB_TINY, *GROUPS, "epochs=1", f"data.dir={data.parent}", f"hydra.run.dir={run_dir}"]
    plain = cli([*common, "trainer.nproc_per_node=1", "trainer.checkpoint.enabled=true"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    done = cli([*common, *TORCHFT[:2], "epochs=2"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: invalid trainer.fault_tolerance=torchft in {run_dir}: it holds the "
                                  "checkpoints of a run without it, and a torchft run starts from step 0; set "
                                  "trainer.resume=never"), done.stderr


# ------------------------------------------------------------------------------------------------- BERT

# 24 sequences a step, 6 micro-batches of 4 (2 per group), a line every 2 steps with the averaged model's
# validation MLM loss; LAMB's row clips the gradients at 1.0 (after their average, as under DDP: clipping each
# group's own gradients, or none, moves the validation loss by 2e-5 after 2 steps)
BERT_ROWS = {"slamb": ["experiment=bert/phase1_slamb", "optimizer.lr=0.02", "optimizer.sync_interval=3",
                       "optimizer.min_compress_numel=500"],
             "lamb": ["experiment=bert/phase1_lamb", "optimizer.lr=0.02"]}
BERT_COMPARED = ("step", "loss", "mlm_acc", "nsp_acc", "val_mlm_loss", "val_mlm_acc", "lr", "bytes_cum/momentum",
                 "bytes_cum/momentum_dense", "bytes_cum/params", "bytes_cum/grads")


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory) -> list[str]:
    out = write_tiny(tmp_path_factory.mktemp("bert_ft"), (32,))
    vocab = len(out["vocab"].read_text().splitlines())
    return ["model=bert_tiny", f"model.vocab_size={vocab}", f"data.dir={out[32]}", "data.seq_len=32",
            f"validation.dir={out[32]}", "data.global_batch=24", "data.micro_batch=4", "log_every=2",
            "schedule.warmup_steps=1", "schedule.power=0.0", "trainer.progress=false", "trainer.threads_per_worker=1",
            "trainer.device=cpu", "trainer.precision=fp32"]


@pytest.mark.parametrize("row", list(BERT_ROWS))
@pytest.mark.multiprocess
def test_a_torchft_bert_run_computes_what_the_same_job_on_three_workers_computes(bert_data, tmp_path, row):
    a, b = torchft_and_plain("bert.train", [*BERT_ROWS[row], *bert_data, "steps=4"], tmp_path, BERT_COMPARED)
    assert_same_lines(a, b, [2, 4])
    assert_same_exports(*(exported_bert(tmp_path / d).state_dict() for d in ("ft", "plain")))


# 3 groups of 2 workers sharding the model, and the same job on 6 workers under HSDP of 3 replicas of 2 shards
GROUPS_OF_TWO = [*TORCHFT, "trainer.nproc_per_node=2", "trainer.parallelism=hsdp", "trainer.shard_size=2"]
HSDP = ["trainer.nproc_per_node=6", "trainer.parallelism=hsdp", "trainer.shard_size=2", "trainer.checkpoint.enabled=false"]


@pytest.mark.parametrize("row", list(BERT_ROWS))
@pytest.mark.multiprocess
def test_torchft_groups_of_two_workers_sharding_bert_compute_what_hsdp_on_six_workers_computes(bert_data, tmp_path,
                                                                                            row):
    a, b = torchft_and_plain("bert.train", [*BERT_ROWS[row], *bert_data, "steps=4"], tmp_path, BERT_COMPARED,
                             torchft=GROUPS_OF_TWO, plain=HSDP)
    assert_same_lines(a, b, [2, 4])
    assert history(tmp_path / "ft")[0]["bytes_cum/fsdp_reduce_scatter"] > 0  # the groups' workers shard the model
    assert_same_exports(*(exported_bert(tmp_path / d).state_dict() for d in ("ft", "plain")))


@pytest.mark.multiprocess
def test_a_killed_worker_ends_its_group_of_two_which_is_relaunched_and_rejoins(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    # worker 3 (group 1's second) dies before step 4: its group's other worker is ended with it, the others take the
    # step again without the group, which is relaunched, each worker taking its shards of a peer group's state
    args = [*BERT_ROWS["slamb"], *bert_data, "steps=8", *GROUPS_OF_TWO[len(TORCHFT):]]
    lines = killed_and_relaunched("bert.train", args, 4, run_dir, rank=3, who="replica group 1, its worker 1")
    assert [r["step"] for r in lines] == [2, 4, 6, 8] and lines[-1]["val_mlm_loss"] < lines[0]["val_mlm_loss"]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["steps"] == 8 and summary["final_val_mlm_loss"] == lines[-1]["val_mlm_loss"]
    cfg = OmegaConf.load(run_dir / "config.yaml")
    cpu = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    scored = validation_metrics(exported_bert(run_dir), validation_batches(cfg, cpu), MixedPrecision("fp32", cpu.device))
    assert scored["val_mlm_loss"] == pytest.approx(summary["final_val_mlm_loss"], rel=1e-5)


def exported_bert(run_dir):
    return load_pretrained(run_dir / "model", OmegaConf.load(run_dir / "config.yaml").model)


@pytest.mark.multiprocess
def test_a_killed_bert_group_is_relaunched_and_rejoins_while_the_others_train_on(bert_data, tmp_path):
    run_dir = tmp_path / "run"
    # group 1 dies before step 4 (the first of the second period): the others fail that step's commit and take it
    # again without it; the relaunched group takes a peer's state and joins at a coming step, its data stream
    # started at that step
    lines = killed_and_relaunched("bert.train", [*BERT_ROWS["slamb"], *bert_data, "steps=8"], 4, run_dir)
    assert [r["step"] for r in lines] == [2, 4, 6, 8] and all(r["period_steps"] == 2 for r in lines)
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["steps"] == 8 and summary["final_val_mlm_loss"] == lines[-1]["val_mlm_loss"]
    # the export is the run's model: the groups' average the last line scored on the validation shards
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model = exported_bert(run_dir)
    cpu = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    scored = validation_metrics(model, validation_batches(cfg, cpu), MixedPrecision("fp32", cpu.device))
    assert scored["val_mlm_loss"] == pytest.approx(summary["final_val_mlm_loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------------- Swin

# 48 images, 3 groups x 4 a step: 4 steps an epoch; the peak LR is optimizer.lr (reference batch = the global one)
SWIN = ["model=swin_tiny_test", "optimizer=slamb", "optimizer.lr=0.01", "optimizer.min_compress_numel=500",
        "optimizer.sync_interval=3", "lr_scaling.reference_batch=12", "data.micro_batch=4", "data.eval_batch=8",
        "data.workers=0", "schedule.warmup_epochs=1", "trainer.progress=false", "trainer.threads_per_worker=1",
        "trainer.device=cpu", "trainer.precision=fp32"]
SWIN_COMPARED = ("epoch", "step", "train_loss", "test_loss", "test_top1", "test_top5", "lr", "bytes_cum/momentum",
                 "bytes_cum/momentum_dense", "bytes_cum/params")


@pytest.fixture(scope="module")
def swin_data(tmp_path_factory):
    from swin.tiny import write_tiny_imagenet

    return write_tiny_imagenet(tmp_path_factory.mktemp("imagenet_ft"), train=12, val=3)


@pytest.mark.multiprocess
def test_a_torchft_swin_run_computes_what_the_same_job_on_three_workers_computes(swin_data, tmp_path):
    a, b = torchft_and_plain("swin.train", [*SWIN, f"data.dir={swin_data}", "epochs=2"], tmp_path, SWIN_COMPARED)
    assert_same_lines(a, b, [4, 8])
    assert a[0]["train_loss"] != a[1]["train_loss"]  # it trains
    assert_same_exports(exported(tmp_path / "ft"), exported(tmp_path / "plain"))


@pytest.mark.multiprocess
def test_a_killed_swin_group_is_relaunched_and_rejoins_while_the_others_train_on(swin_data, tmp_path):
    run_dir = tmp_path / "run"
    # group 1 dies before step 6 (mid epoch 2); the relaunched group reads its micro-batches from the step it joins
    lines = killed_and_relaunched("swin.train", [*SWIN, f"data.dir={swin_data}", "epochs=3"], 6, run_dir)
    assert [(r["epoch"], r["step"]) for r in lines] == [(1, 4), (2, 8), (3, 12)]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["final_test_top1"] == lines[-1]["test_top1"] and math.isfinite(lines[-1]["train_loss"])


# ------------------------------------------------------------------------------------------------- SQuAD

SQUAD_COMPARED = ("epoch", "step", "train_loss", "exact_match", "f1", "lr", "bytes_cum/momentum", "bytes_cum/params",
                  "bytes_cum/grads")


@pytest.mark.parametrize("optimizer", [["optimizer=slamb", "optimizer.min_compress_numel=500",
                                        "optimizer.sync_interval=3"], ["optimizer=lamb"]], ids=["slamb", "lamb"])
@pytest.mark.multiprocess
def test_a_torchft_squad_run_computes_what_the_same_job_on_three_workers_computes(squad_bert_dir, tmp_path,  # noqa: F811
                                                                                  optimizer):
    from tests.test_squad import squad_json, write_json

    train_file = write_json(tmp_path / "train.json", squad_json())
    common = [*optimizer, f"model.dir={squad_bert_dir}", f"data.train_file={train_file}", f"data.dev_file={train_file}",
              "data.max_length=48", "data.doc_stride=16", "data.max_query_length=16", "data.global_batch=6",
              "data.eval_batch=5", "epochs=2", "optimizer.lr=3e-3", "schedule.warmup_fraction=0",
              "trainer.progress=false", "trainer.threads_per_worker=1", "trainer.device=cpu", "trainer.precision=fp32"]
    a, b = torchft_and_plain("squad_finetune.train", common, tmp_path, SQUAD_COMPARED)
    assert_same_lines(a, b, [a[0]["step"], 2 * a[0]["step"]])
    # the predictions of the run's model (each group that committed writes the same ones)
    assert json.loads((tmp_path / "ft" / "predictions.json").read_text()) == \
        json.loads((tmp_path / "plain" / "predictions.json").read_text())
