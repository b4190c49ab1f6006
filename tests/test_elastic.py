"""A CIFAR-10 or BERT run checkpointed on 4 workers resumes on 2 (and back on 4): the same global batch, split
into the same micro-batches, each step computing what the uninterrupted run computes; SLAMB from the saved
ranks' mean. A sharded BERT run (HSDP, 2 replicas x 2 shards) resumes on 1 replica of 2 shards, and on 2
replicas of 1 shard."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import harness
from cifar10 import data as cdata
from cifar10.model import ResNetCifar
from bert.model import build_model, load_pretrained
from bert.train import train as bert_train
from cifar10.train import train
from harness import PERIOD_HOOKS, unwrap
from harness.checkpoint import Checkpointer, prepare_run, run_inputs, run_settings
from tests import distributed
from tests.test_bert_pretrain import ROWS as BERT_ROWS
from tests.test_bert_pretrain import tiny_cfg, tiny_data  # noqa: F401 (a fixture)
from tests.test_cifar10 import TINY, history
from tests.test_configs import compose_cfg
from tests.test_settings_errors import refused
from tests.test_sharded_pipelines import dcp_state

# 32 training images, 4 workers x 8: one step per epoch, so each logged epoch is one step's loss
EPOCHS = 4
BASE = [*TINY, "data.micro_batch=8", "trainer.deterministic=true", "trainer.checkpoint.keep=10",
        "schedule.milestones=[3]"]
OPTIMIZERS = {"lamb": ["optimizer=lamb"],
              "slamb": ["experiment=cifar10/slamb", "optimizer.min_compress_numel=100", "optimizer.sync_interval=3"]}


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    return cdata.write_digits(tmp_path_factory.mktemp("digits") / "cifar-10-batches-py", 32, 40)


def cfg(name: str, data: Path, epochs: int) -> dict:
    return compose_cfg(*BASE, *OPTIMIZERS[name], f"data.dir={data}", f"epochs={epochs}")


def worker(rank, world, jobs):
    """``train(config, run directory)`` of each job (train, config, run directory); for each, this rank's parameters
    as its loop opened (resumed)."""
    loops, opened = [], []

    def record(loop, event):
        if event == "begin" and not any(seen is loop for seen in loops):  # the first period: Loop.__init__'s
            loops.append(loop)
            # a sharded model's parameters whole (collective: every rank in the same order)
            opened.append([getattr(p, "full_tensor", p.detach)().detach().clone()
                           for p in unwrap(loop.model).parameters()])

    PERIOD_HOOKS.append(record)
    try:
        for fn, c, d in jobs:
            fn(c, d)
    finally:
        PERIOD_HOOKS.remove(record)
    return opened


def stopped_at(run_dir: Path, to: Path, epoch: int) -> Path:
    """``run_dir`` as it was when it stopped after ``epoch`` (one step per epoch, or per logged BERT period): later
    checkpoints, metrics and summary removed."""
    shutil.copytree(run_dir, to)
    for folder in (to / "ckpt").glob("step*"):
        if int(folder.name[4:]) > epoch:  # one step per epoch
            shutil.rmtree(folder)
    last = to / "ckpt" / f"step{epoch:09d}"
    (to / "ckpt" / "latest.json").write_text(json.dumps({"dir": last.name,
                                                         **json.loads((last / "complete.json").read_text())}))
    rows = history(to)[:epoch]
    (to / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (to / "metrics.json").unlink()
    shutil.rmtree(to / "model")
    return to


@pytest.fixture(scope="module")
def runs(digits, tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    whole = {n: root / n for n in OPTIMIZERS}
    distributed.run(worker, 4, [(train, cfg(n, digits, EPOCHS), str(whole[n])) for n in OPTIMIZERS])
    halved = {n: stopped_at(whole[n], root / f"{n}_4to2", 2) for n in OPTIMIZERS}
    back = stopped_at(whole["lamb"], root / "lamb_4to2to4", 1)
    out = distributed.run(worker, 2, [(train, cfg(n, digits, EPOCHS), str(halved[n])) for n in OPTIMIZERS]
                          + [(train, cfg("lamb", digits, 2), str(back))])
    distributed.run(worker, 4, [(train, cfg("lamb", digits, EPOCHS), str(back))])
    return {"root": root, "opened": out}


def final_params(run_dir: Path) -> dict:
    return torch.load(run_dir / "model" / "model.pt", weights_only=True)


def assert_same_steps(resumed: Path, whole: Path) -> None:
    """Each step's loss to float32 rounding (the gradients of 2 micro-batches are summed on one worker before
    the all-reduce: another summation order), the learning rate exactly, and the final model's parameters."""
    a, b = history(resumed), history(whole)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, EPOCHS + 1))
    for ra, rb in zip(a, b):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-5, abs=1e-6)
        assert ra["train_top1"] == rb["train_top1"] and ra["lr"] == rb["lr"]
    pa, pb = final_params(resumed), final_params(whole)
    for k in pb:
        if not k.endswith(("running_mean", "running_var", "num_batches_tracked")):  # evaluation's, per worker
            torch.testing.assert_close(pa[k], pb[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_lamb_resumed_on_2_workers_computes_each_step_of_the_4_worker_run(runs):
    assert_same_steps(runs["root"] / "lamb_4to2", runs["root"] / "lamb")
    summary = json.loads((runs["root"] / "lamb_4to2" / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 32 and summary["resumed_from"] == [2]


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_lamb_resumed_on_2_then_on_4_workers_again_computes_each_step_of_the_4_worker_run(runs):
    assert_same_steps(runs["root"] / "lamb_4to2to4", runs["root"] / "lamb")
    latest = json.loads((runs["root"] / "lamb_4to2to4" / "ckpt" / "latest.json").read_text())
    assert latest["world_size"] == 4 and latest["micro_batches"] == 4


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_slamb_resumed_on_2_workers_starts_from_the_saved_ranks_mean(runs):
    root = runs["root"]
    saved = [torch.load(root / "slamb" / "ckpt" / "step000000002" / f"rank{r}.pt", weights_only=False)["model"]
             for r in range(4)]
    opened = [rank[1] for rank in runs["opened"]]  # the second job of the 2-worker run: SLAMB 4 -> 2
    params = [k for k, _ in ResNetCifar(8, 4).named_parameters()]
    mean = [sum(s[k] for s in saved) / 4 for k in params]
    assert not all(torch.equal(saved[0][k], saved[1][k]) for k in params)  # the ranks differ between syncs
    for rank in opened:
        for got, want in zip(rank, mean):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7)



@pytest.mark.multiprocess
@pytest.mark.e2e
def test_slamb_resumed_on_2_workers_ends_close_to_the_4_worker_run(runs):
    """The resumed steps take the same micro-batches; only the start differs: every replica from the 4 ranks'
    mean, as a model sync leaves them, where each of the 4 continued its own model (and its own moments), so
    the numbers are close, not equal. Measured: the 2 resumed steps' train losses within 0.3%, the final
    averaged model's test loss within 1% and its top-1 the same; the bounds below are 3x those, and 2 of the
    40 test images (5 points) for the top-1."""
    a, b = history(runs["root"] / "slamb_4to2"), history(runs["root"] / "slamb")
    assert [r["train_loss"] for r in a[:2]] == [r["train_loss"] for r in b[:2]]  # before the resume: copied
    assert [r["train_loss"] for r in a[2:]] == pytest.approx([r["train_loss"] for r in b[2:]], rel=0.01)
    assert a[-1]["test_loss"] == pytest.approx(b[-1]["test_loss"], rel=0.03)
    assert abs(a[-1]["test_top1"] - b[-1]["test_top1"]) <= 5.0

# ------------------------------------------------------------------------------------------------- BERT

# 16 sequences a step in 8 micro-batches of 2: 4 workers accumulate 2 each, 2 workers 4; a line per step;
# dropout, drawn per micro-batch
BERT_STEPS, BERT_STOP = 4, 2
BERT = ["data.micro_batch=2", "model.hidden_dropout_prob=0.1", "model.attention_probs_dropout_prob=0.1", "trainer.precision=fp32", "trainer.nproc_per_node=4", f"steps={BERT_STEPS}",
        "log_every=1", "trainer.checkpoint.every=1", "trainer.checkpoint.keep=10"]
HSDP = ["trainer.parallelism=hsdp", "trainer.shard_size=2"]
TOL = 1e-3  # HSDP SLAMB 2x2 -> 1x2: the resumed steps' losses (test_hsdp_slamb_bert_resumed_...)
SLAMB = [*BERT_ROWS["slamb"], "optimizer.lr=0.01"]  # micro-batches of 2 sequences: 0.05 diverges at step 2
BERT_RUNS = {"lamb": BERT_ROWS["lamb"], "slamb": SLAMB, "lamb_hsdp": [*BERT_ROWS["lamb"], *HSDP],
             "slamb_hsdp": [*SLAMB, *HSDP]}


@pytest.fixture(scope="module")
def bert_runs(tiny_data, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """Each of BERT_RUNS on 4 workers, and a copy of each stopped after step 2 and resumed on 2 (HSDP: 1 replica
    of the 2 shards, ``<run>_4to2``; and 2 replicas of 1, ``<run>_4to2x1``)."""
    root = tmp_path_factory.mktemp("elastic_bert")
    cfgs = {n: tiny_cfg(tiny_data, root / n, *BERT, *overrides) for n, overrides in BERT_RUNS.items()}
    distributed.run(worker, 4, [(bert_train, c, str(root / n)) for n, c in cfgs.items()])
    resumed = {f"{n}_4to2": c for n, c in cfgs.items()}
    resumed.update({f"{n}_4to2x1": tiny_cfg(tiny_data, root / n, *BERT, *BERT_RUNS[n], "trainer.shard_size=1")
                    for n in cfgs if "hsdp" in n})
    for name in resumed:
        stopped_at(root / name.rsplit("_", 1)[0], root / name, BERT_STOP)
    out = distributed.run(worker, 2, [(bert_train, c, str(root / n)) for n, c in resumed.items()])
    opened = {n: [rank[i] for rank in out] for i, n in enumerate(resumed)}
    return {"root": root, "cfgs": cfgs, "opened": {n: opened[f"{n}_4to2"] for n in cfgs},
            "opened_2x1": {n: opened[f"{n}_4to2x1"] for n in cfgs if "hsdp" in n}}


def bert_params(run_dir: Path, cfg: dict) -> dict:
    return load_pretrained(run_dir / "model", OmegaConf.create(cfg).model).state_dict()


@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.parametrize("run, resumed", [("lamb", "4to2"), ("lamb_hsdp", "4to2"), ("lamb_hsdp", "4to2x1")])
def test_bert_lamb_resumed_on_2_workers_computes_each_step_of_the_4_worker_run(bert_runs, run, resumed):
    """Each step's loss and accuracies, and the final parameters, to float32 rounding (each worker sums 4
    micro-batches' gradients where it summed 2: another summation order), dropout included (drawn per
    micro-batch). HSDP: the model and moments resharded by DCP over 1 replica of the 2 shards, or over 2
    replicas of 1 shard (another shard size), the same numbers."""
    root = bert_runs["root"]
    a, b = history(root / f"{run}_{resumed}"), history(root / run)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, BERT_STEPS + 1))
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["mlm_acc"] == rb["mlm_acc"] and ra["nsp_acc"] == rb["nsp_acc"] and ra["lr"] == rb["lr"]
    assert a[-1]["loss"] < a[0]["loss"] - 0.1  # the run trains: the steps compared are not all alike
    pa, pb = (bert_params(root / r, bert_runs["cfgs"][run]) for r in (f"{run}_{resumed}", run))
    for k in pb:
        torch.testing.assert_close(pa[k], pb[k], rtol=1e-5, atol=1e-6, msg=k)
    summary = json.loads((root / f"{run}_{resumed}" / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["accumulation_steps"] == 4 and summary["resumed_from"] == [2]
    latest = json.loads((root / f"{run}_{resumed}" / "ckpt" / "latest.json").read_text())
    assert (latest["world_size"], latest["micro_batches"], latest["streams"]) == (2, 8, 4)


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_hsdp_slamb_bert_resumed_on_1_replica_starts_from_the_replicas_mean_and_continues_close(bert_runs):
    """2 replicas x 2 shards resumed as 1 replica of 2 shards: DCP reshards each parameter and moment to the
    replicas' mean (slamb.load_sharded), as a model sync leaves them, where each replica of the uninterrupted
    run continued its own (and SLAMB's exchange across 1 replica compresses nothing): close, not equal.
    Measured: the 2 resumed steps' losses within 1.9e-4 (relative) of the uninterrupted run's (3.2e-4 without
    dropout); the bound is 3x the larger."""
    root = bert_runs["root"]
    a, b = history(root / "slamb_hsdp_4to2"), history(root / "slamb_hsdp")
    assert [r["loss"] for r in a[:BERT_STOP]] == [r["loss"] for r in b[:BERT_STOP]]  # before the resume: copied
    assert [r["loss"] for r in a[BERT_STOP:]] == pytest.approx([r["loss"] for r in b[BERT_STOP:]], rel=TOL)
    saved = dcp_state(root / "slamb_hsdp" / "ckpt" / f"step{BERT_STOP:09d}" / "dcp")
    names = [k for k, _ in build_model(bert_runs["cfgs"]["slamb_hsdp"]["model"]).named_parameters()]
    assert not all(torch.equal(saved[f"replica0.model.{k}"], saved[f"replica1.model.{k}"]) for k in names)
    for rank in bert_runs["opened"]["slamb_hsdp"]:
        for k, got in zip(names, rank):
            want = (saved[f"replica0.model.{k}"] + saved[f"replica1.model.{k}"]) / 2
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=k)


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_hsdp_slamb_bert_resumed_with_another_shard_size_continues_each_replica(bert_runs):
    """2 replicas x 2 shards resumed as 2 replicas of 1 shard (trainer.shard_size 2 -> 1): each replica's own
    parameters and moments, resharded by DCP, and its own micro-batches (those its 2 shards took), so every
    step is the uninterrupted run's to float32 rounding (each worker sums 4 micro-batches' gradients where
    its shard group reduced 2 on each of 2 ranks). Measured: the same losses, bit for bit."""
    root = bert_runs["root"]
    a, b = history(root / "slamb_hsdp_4to2x1"), history(root / "slamb_hsdp")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    saved = dcp_state(root / "slamb_hsdp" / "ckpt" / f"step{BERT_STOP:09d}" / "dcp")
    names = [k for k, _ in build_model(bert_runs["cfgs"]["slamb_hsdp"]["model"]).named_parameters()]
    for replica, rank in enumerate(bert_runs["opened_2x1"]["slamb_hsdp"]):
        for k, got in zip(names, rank):
            torch.testing.assert_close(got, saved[f"replica{replica}.model.{k}"], rtol=0, atol=0, msg=k)
    latest = json.loads((root / "slamb_hsdp_4to2x1" / "ckpt" / "latest.json").read_text())
    assert latest["world_size"] == 2 and latest["settings"] == json.loads(
        (root / "slamb_hsdp" / "ckpt" / "latest.json").read_text())["settings"]


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_bert_slamb_resumed_on_2_workers_starts_from_the_saved_ranks_mean(bert_runs):
    root = bert_runs["root"]
    saved = [torch.load(root / "slamb" / "ckpt" / f"step{BERT_STOP:09d}" / f"rank{r}.pt", weights_only=False)["model"]
             for r in range(4)]
    names = [k for k, _ in build_model(bert_runs["cfgs"]["slamb"]["model"]).named_parameters()]
    mean = [sum(s[k] for s in saved) / 4 for k in names]
    assert not all(torch.equal(saved[0][k], saved[1][k]) for k in names)  # the ranks differ between syncs
    for rank in bert_runs["opened"]["slamb"]:
        assert len(rank) == len(names)
        for k, got, want in zip(names, rank, mean):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=k)


# ---------------------------------------------------------------------- refused before any worker starts


def checkpoint_of_4_workers(run: Path, data: Path, *overrides) -> None:
    """The record of a CIFAR-10 LAMB run of 4 workers x data.micro_batch=8 (global batch 32) after one step."""
    four = harness.DistEnv(0, 4, 0, 4, torch.device("cpu"))
    saved = compose_cfg(*CIFAR_LAMB, "trainer.nproc_per_node=4", f"data.dir={data}", *overrides)
    Checkpointer(run, four, inputs=run_inputs(saved), settings=run_settings(saved), micro_batches=4).save(
        {"epoch": 1, "step": 1}, {}, {})


CIFAR_LAMB = ["experiment=cifar10/lamb", "data.micro_batch=8"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("args, line", [
    # 3 workers cannot take the step's 4 micro-batches evenly: another global batch, or other micro-batches
    (["trainer.nproc_per_node=3"], "the run in {ckpt} takes each step in 4 micro-batches of data.micro_batch samples, "
                                   "and this run's 3 workers cannot take an equal number of them"),
    # the same global batch by a larger micro-batch: BatchNorm over 16 images instead of 8
    (["trainer.nproc_per_node=2", "data.micro_batch=16"], "was trained with data.micro_batch=8 and this run has "
                                                           "data.micro_batch=16"),
    (["trainer.nproc_per_node=2", "optimizer.lr=0.02"], "was trained with optimizer.lr=0.01 and this run has "
                                                         "optimizer.lr=0.02"),
])
def test_a_resume_on_other_workers_that_would_change_what_is_computed_is_refused_in_one_line(tmp_path, digits, args,
                                                                                            line):
    # real data: the data's own checks come before the checkpoint's
    run, data = tmp_path / "run", digits
    checkpoint_of_4_workers(run, data)
    stderr = refused("cifar10.train", [*CIFAR_LAMB, f"data.dir={data}", *args], run)
    assert line.format(ckpt=run / "ckpt") in stderr


@pytest.mark.multiprocess
def test_an_optimizer_whose_per_rank_state_has_no_mean_is_refused_another_number_of_workers(tmp_path, digits):
    run, data = tmp_path / "run", digits
    checkpoint_of_4_workers(run, data, "optimizer=dgc")
    stderr = refused("cifar10.train", [*CIFAR_LAMB, "optimizer=dgc", f"data.dir={data}", "trainer.nproc_per_node=2"],
                     run)
    assert stderr == (f"error: the checkpoint in {run / 'ckpt'} was written by 4 workers and this run has 2: DGC's "
                      "per-rank state has no mean over the workers (each worker keeps its own residuals and momenta). "
                      "Resume with 4 workers, or use a new run directory (trainer.resume=never starts over); fix: "
                      "correct the override or the experiment's config\n")


def test_a_resume_on_a_divisor_of_the_workers_passes_the_checks(tmp_path):
    run, data = tmp_path / "run", tmp_path / "data"
    data.mkdir()
    checkpoint_of_4_workers(run, data)
    for workers in (1, 2, 4):
        assert prepare_run(compose_cfg(*CIFAR_LAMB, f"data.dir={data}", f"trainer.nproc_per_node={workers}"), run,
                           world_size=workers, why_fixed=None) is None


BERT_LAMB = ["experiment=bert/phase1_lamb", "model=bert_tiny", "data.seq_len=32", "data.global_batch=16",
             "data.micro_batch=2"]


def bert_checkpoint_of_4_workers(run: Path, data: Path, *overrides) -> dict:
    """The record of a BERT LAMB run of 4 workers (16 sequences a step in 8 micro-batches of 2, HSDP 2x2) after
    one step; returns its config."""
    from tests.test_bert_pretrain import compose_bert

    four = harness.DistEnv(0, 4, 0, 4, torch.device("cpu"))
    saved = compose_bert(*BERT_LAMB, *HSDP, "trainer.nproc_per_node=4", f"data.dir={data}", *overrides)
    Checkpointer(run, four, inputs=run_inputs(saved), settings=run_settings(saved), micro_batches=8,
                 streams=4).save({"step": 1}, {}, {})
    return saved


@pytest.mark.multiprocess
@pytest.mark.parametrize("args, line", [
    # 3 workers cannot take the step's 8 micro-batches evenly
    (["trainer.nproc_per_node=3", "trainer.shard_size=1"],
     "error: data.global_batch=16 is not a multiple of data.micro_batch=2 x 3 workers = 6"),
    # the same global batch in 4 micro-batches of 4: other sequences per micro-batch, other gradient sums
    (["trainer.nproc_per_node=2", "data.micro_batch=4"],
     "was trained with data.micro_batch=2 and this run has data.micro_batch=4"),
    # DDP: the sharded run's model and optimizer are a DCP folder, a DDP run's per-rank files
    (["trainer.nproc_per_node=2", "trainer.parallelism=ddp", "trainer.shard_size=null"],
     "was trained with trainer.parallelism='hsdp' and this run has trainer.parallelism='ddp'"),
])
def test_a_bert_resume_on_other_workers_that_would_change_what_is_computed_is_refused_in_one_line(tmp_path, args,
                                                                                                   line):
    from tests.test_configs import write_bert_shards

    run, data = tmp_path / "run", write_bert_shards(tmp_path / "shards")
    bert_checkpoint_of_4_workers(run, data)
    stderr = refused("bert.train", [*BERT_LAMB, *HSDP, f"data.dir={data}", *args], run)
    assert line in stderr, stderr


def test_a_bert_resume_on_a_divisor_of_the_step_micro_batches_passes_the_checks(tmp_path):
    from tests.test_configs import write_bert_shards

    run, data = tmp_path / "run", write_bert_shards(tmp_path / "shards")
    saved = bert_checkpoint_of_4_workers(run, data)
    for workers in (2, 4, 8):
        assert prepare_run({**saved, "trainer": {**saved["trainer"], "nproc_per_node": workers}}, run,
                           world_size=workers, why_fixed=None) is None
    for workers, shards in ((2, 1), (4, 1), (4, 4)):  # another shard size: DCP reshards
        assert prepare_run({**saved, "trainer": {**saved["trainer"], "nproc_per_node": workers, "shard_size": shards}},
                           run, world_size=workers, why_fixed=None) is None
    with pytest.raises(ValueError, match="takes each step in 8 micro-batches .* this run's 3 workers cannot"):
        prepare_run(saved, run, world_size=3, why_fixed=None)
