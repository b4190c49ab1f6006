"""``trainer.parallelism=hsdp`` in the BERT and Swin pipelines: 4 gloo workers on the CPU as 2 replica groups
of 2 shards, SLAMB across the replicas. The exported model is the replicas' average gathered to whole tensors,
training lowers the loss, a resumed run ends bit-exactly where the uninterrupted one ends, and HSDP LAMB
trains as DDP LAMB on the same 4 workers. The settings checks refuse what cannot shard, before any worker."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bert.model import load_pretrained
from bert.train import train as bert_train
from harness.build import check_settings, user_error
from swin.tiny import write_tiny_imagenet
from swin.train import train as swin_train
from tests import distributed
from tests.test_bert_pretrain import ROWS as BERT_ROWS
from tests.test_bert_pretrain import SEQ1
from tests.test_bert_pretrain import compose_bert, history, tiny_cfg, tiny_data  # noqa: F401 (a fixture)
from tests.test_swin import SLAMB_TINY, TINY, compose_swin

WORLD = 4
HSDP = ["trainer.parallelism=hsdp", "trainer.shard_size=2", f"trainer.nproc_per_node={WORLD}"]


def rolled_back(run_dir: Path, to: Path) -> None:
    """A copy of the finished run ``run_dir`` at ``to`` whose latest checkpoint is the one before its last."""
    shutil.copytree(run_dir, to)
    previous = sorted((to / "ckpt").glob("step*"))[-2]
    record = json.loads((previous / "complete.json").read_text())
    (to / "ckpt" / "latest.json").write_text(json.dumps({"dir": previous.name, **record}))
    shutil.rmtree(to / "model", ignore_errors=True)


def worker(rank, world, jobs):
    """Each job ``(pipeline, cfg, run_dir, resumed from)`` in turn, the last a rolled-back copy of a finished run."""
    from harness import barrier

    out = []
    for pipeline, cfg, run_dir, source in jobs:
        if source is not None:
            if rank == 0:
                rolled_back(Path(source), Path(run_dir))
            barrier()
        out.append((bert_train if pipeline == "bert" else swin_train)(cfg, run_dir))
    return out


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):  # noqa: F811 (the imported fixture)
    root = tmp_path_factory.mktemp("sharded")
    imagenet = write_tiny_imagenet(root / "imagenet")
    # a shard of the same examples per worker, as test_bert_pretrain's 2 workers have (the large-batch regime)
    shards = root / "bert_shards"
    shards.mkdir()
    for i in range(WORLD):
        shutil.copyfile(tiny_data[SEQ1] / "part0_training.hdf5", shards / f"part{i}_training.hdf5")
    # SLAMB's run evaluates held-out shards (here the training ones): the average's and the local models' loss
    bert = {"slamb": [*BERT_ROWS["slamb"], *HSDP, f"validation.dir={shards}"], "lamb": [*BERT_ROWS["lamb"], *HSDP],
            "lamb_ddp": [*BERT_ROWS["lamb"], f"trainer.nproc_per_node={WORLD}"],
            "slamb_fused": [*BERT_ROWS["slamb"], *HSDP, f"validation.dir={shards}", "optimizer.fused=true"]}
    jobs = [("bert", tiny_cfg(tiny_data, root / name, f"data.dir={shards}", *overrides), str(root / name), None)
            for name, overrides in bert.items()]
    swin = compose_swin(*TINY, "experiment=swin_b/slamb", f"data.dir={imagenet}", *SLAMB_TINY,
                        "trainer.precision=fp32", *HSDP,
                        "optimizer.lr=0.3", "epochs=3")  # a peak LR of 0.0094 at 16 images a step: the loss moves
    jobs.append(("swin", swin, str(root / "swin"), None))
    jobs.append(("bert", jobs[0][1], str(root / "slamb_resumed"), jobs[0][2]))
    jobs.append(("swin", swin, str(root / "swin_resumed"), str(root / "swin")))
    # SLAMB's job evaluating at every step, without checkpoints (a checkpoint's save reshards the model)
    jobs.append(("bert", tiny_cfg(tiny_data, root / "slamb_eval", f"data.dir={shards}", *bert["slamb"], "log_every=1",
                                  "trainer.checkpoint.enabled=false"), str(root / "slamb_eval"), None))
    summaries = distributed.run(worker, WORLD, jobs)[0]
    return {"root": root, "summaries": dict(zip(["slamb", "lamb", "lamb_ddp", "slamb_fused", "swin", "slamb_resumed",
                                                 "swin_resumed", "slamb_eval"], summaries)), "jobs": jobs}


@pytest.mark.multiprocess
def test_hsdp_slamb_bert_lowers_the_loss_and_exports_the_replicas_average(runs):
    root = runs["root"]
    h = history(root / "slamb")
    losses = [r["loss"] for r in h]
    assert [r["step"] for r in h] == [2, 4, 6] and losses[2] < losses[1] < losses[0] - 0.1, losses
    assert "bytes_cum/grads" not in h[-1] and h[-1]["bytes_cum/momentum"] > 0 and h[-1]["bytes_cum/params"] > 0
    assert h[-1]["val_mlm_loss"] < h[0]["val_mlm_loss"] and all("val_mlm_loss_local" in r for r in h)
    # the export: the mean of the two replicas' final parameters (the last checkpoint, written before it)
    ckpt = root / "slamb" / "ckpt" / json.loads((root / "slamb" / "ckpt" / "latest.json").read_text())["dir"]
    saved = dcp_state(ckpt / "dcp")
    cfg = OmegaConf.create(runs["jobs"][0][1])
    exported = load_pretrained(root / "slamb" / "model", cfg.model).state_dict()
    differ = 0
    for name, p in exported.items():
        a, b = saved[f"replica0.model.{name}"], saved[f"replica1.model.{name}"]
        differ += not torch.equal(a, b)
        assert torch.allclose(p, (a + b) / 2, rtol=0, atol=1e-6), name
    assert differ > 0  # SLAMB's replicas differ between syncs (every 3 steps)


@pytest.mark.multiprocess
def test_evaluating_the_average_between_steps_leaves_the_training_as_it_was(runs):
    # the averaged model is evaluated every 2 steps in one run (each followed by a checkpoint), at every step in the
    # other: FSDP's root keeps the average's parameters gathered after an evaluation, where the next step must
    # gather the local shards again (else the root's parameters, the embeddings, end elsewhere)
    cfg = OmegaConf.create(runs["jobs"][0][1])
    a, b = (load_pretrained(runs["root"] / run / "model", cfg.model).state_dict() for run in ("slamb", "slamb_eval"))
    assert [r["step"] for r in history(runs["root"] / "slamb_eval")] == [1, 2, 3, 4, 5, 6]
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


def dcp_state(directory: Path) -> dict:
    """A DCP checkpoint read whole in this process (no process group): its flat entries."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = directory.parent / "whole.pt"
    dcp_to_torch_save(str(directory), str(out))
    state = torch.load(out, weights_only=False)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v
    return dict(flat(state))


@pytest.mark.multiprocess
@pytest.mark.parametrize("run, keys", [("slamb", ("loss", "mlm_acc", "val_mlm_loss", "val_mlm_loss_local",
                                                   "bytes_cum/all")),
                                       ("swin", ("train_loss", "test_loss", "test_top1", "bytes_cum/all"))])
def test_a_resumed_hsdp_run_ends_where_the_uninterrupted_one_ends(runs, run, keys):
    root = runs["root"]
    assert runs["summaries"][f"{run}_resumed"]["resumed_from"] == [4 if run == "slamb" else 2]
    a, b = history(root / run), history(root / f"{run}_resumed")
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        assert {k: rb[k] for k in keys} == {k: ra[k] for k in keys}  # bit for bit
    if run == "slamb":  # and exports the same model
        model_cfg = OmegaConf.create(runs["jobs"][0][1]).model
        a, b = (load_pretrained(root / r / "model", model_cfg).state_dict() for r in (run, f"{run}_resumed"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiprocess
def test_hsdp_fused_slamb_trains_as_the_multi_tensor_path_with_its_bytes(runs):
    """optimizer.fused=true on HSDP: the compiled passes on the shards, the same run to their fp32 scalars."""
    fused, plain = history(runs["root"] / "slamb_fused"), history(runs["root"] / "slamb")
    assert [r["step"] for r in fused] == [r["step"] for r in plain] == [2, 4, 6]
    for a, b in zip(fused, plain):
        for key in ("loss", "val_mlm_loss", "val_mlm_loss_local"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
        assert {k: v for k, v in a.items() if k.startswith("bytes")} == \
            {k: v for k, v in b.items() if k.startswith("bytes")}
    assert (runs["root"] / "slamb_fused" / "model").is_dir()


@pytest.mark.multiprocess
def test_hsdp_lamb_trains_as_ddp_lamb_on_the_same_workers(runs):
    root = runs["root"]
    sharded, ddp = history(root / "lamb"), history(root / "lamb_ddp")
    for a, b in zip(sharded, ddp):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["mlm_acc"] == pytest.approx(b["mlm_acc"])
    assert sharded[-1]["loss"] < sharded[0]["loss"] - 0.3
    assert runs["summaries"]["lamb"]["params"] == runs["summaries"]["lamb_ddp"]["params"]  # whole tensors counted


@pytest.mark.multiprocess
def test_hsdp_slamb_swin_trains_and_evaluates_the_average(runs):
    h = history(runs["root"] / "swin")
    assert [r["epoch"] for r in h] == [1, 2, 3] and all("test_top1_local" in r for r in h)
    for key in ("train_loss", "test_loss"):
        assert h[2][key] < h[1][key] < h[0][key], (key, [r[key] for r in h])
    assert h[-1]["test_top1"] > h[0]["test_top1"]
    assert "bytes_cum/grads" not in h[-1] and h[-1]["bytes_cum/momentum"] > 0


@pytest.mark.parametrize("overrides, match", [
    (["trainer.parallelism=hsdp", "trainer.shard_size=3"], r"invalid trainer\.shard_size=3 .*\(a divisor of 8"),
    (["trainer.shard_size=2"], r"invalid trainer\.shard_size=2 with trainer\.parallelism=ddp"),
    (["trainer.parallelism=fsdp", "trainer.nproc_per_node=1"], r"sharding needs 2 or more"),
    (["trainer.parallelism=fsdp", "experiment=bert/phase1_onebit_lamb"],
     r"trainer\.parallelism=fsdp for optimizer=onebit_lamb: OnebitLamb takes no sharded .*fix: trainer\.parallelism=ddp"),
    (["trainer.parallelism=hsdp", "trainer.shard_size=4", "experiment=bert/phase1_slamb", "optimizer.overlap=true"],
     r"SLAMB\(overlap=True\) takes no sharded"),
    (["trainer.parallelism=fsdp", "experiment=bert/phase1_slamb", "optimizer.hierarchy=node"],
     r"SLAMB\(hierarchy='node'\) takes no sharded"),
    (["trainer.parallelism=fsdp", "+init_optimizer_from=/tmp"], r"init_optimizer_from: .*trainer\.parallelism=ddp only"),
])
def test_settings_that_cannot_shard_are_refused_before_any_worker_in_one_line(overrides, match, tmp_path):
    cfg = compose_bert("trainer.device=cpu", f"data.dir={tmp_path}", *overrides)
    with pytest.raises(ValueError) as e:
        check_settings(cfg, shards=True)
    line = user_error(e.value, cfg["optimizer"])
    assert "\n" not in line and re.search(match, line), line


def test_sharded_settings_that_fit_pass_the_checks(tmp_path):
    for overrides in (["trainer.parallelism=hsdp", "trainer.shard_size=4", "experiment=bert/phase1_slamb"],
                      ["trainer.parallelism=hsdp", "trainer.shard_size=4", "experiment=bert/phase1_slamb",
                       "optimizer.fused=true"],
                      ["trainer.parallelism=fsdp", "experiment=bert/phase1_lamb"],
                      ["trainer.parallelism=fsdp", "experiment=bert/phase1_lamb", "optimizer.fused=true"]):
        check_settings(compose_bert("trainer.device=cpu", f"data.dir={tmp_path}", *overrides), shards=True)


def test_a_ddp_checkpoint_and_an_hsdp_run_refuse_each_other_and_older_runs_are_ddp():
    """The parallelism is a setting of what a run computes: resuming across it is refused in one line, as any
    changed setting; a checkpoint written before the setting existed is a DDP run's. The shard size of a
    sharded run is not (DCP reshards), though checkpoints of older code record it."""
    from harness.checkpoint import check_settings as check_resume, run_settings
    from harness.settings import effective_config, same_configuration

    ddp, hsdp = compose_bert(), compose_bert("trainer.parallelism=hsdp", "trainer.shard_size=2")
    for saved, current in ((ddp, hsdp), (hsdp, ddp)):
        with pytest.raises(ValueError, match=r"trained with trainer\.parallelism='\w+' and "
                                             r"this run has trainer\.parallelism='\w+':") as e:
            check_resume(run_settings(saved), run_settings(current), "runs/x/ckpt")
        assert "\n" not in str(e.value)
    hsdp_1 = compose_bert("trainer.parallelism=hsdp", "trainer.shard_size=1")
    assert "trainer.shard_size" not in run_settings(hsdp)
    recorded_before = {k: v for k, v in json.loads(json.dumps(effective_config(hsdp))).items()
                       if k in run_settings(hsdp) or k == "trainer.shard_size"}
    assert recorded_before["trainer.shard_size"] == 2
    check_resume(recorded_before, run_settings(hsdp_1), "runs/x/ckpt")
    older = {k: v for k, v in run_settings(ddp).items() if k not in ("trainer.parallelism", "trainer.shard_size")}
    check_resume(older, run_settings(ddp), "runs/x/ckpt")
    with pytest.raises(ValueError, match="parallelism"):
        check_resume(older, run_settings(hsdp), "runs/x/ckpt")
    older_cfg = compose_bert()
    del older_cfg["trainer"]["parallelism"], older_cfg["trainer"]["shard_size"]
    assert same_configuration(older_cfg, ddp) and not same_configuration(older_cfg, hsdp)


@pytest.mark.multiprocess
def test_the_command_refuses_an_optimizer_that_cannot_shard_in_one_line_and_exit_2(tmp_path):
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bert.train", "experiment=bert/phase1_onebit_lamb",
                           "trainer.parallelism=hsdp", "trainer.shard_size=2", "trainer.nproc_per_node=4",
                           "trainer.device=cpu", f"data.dir={tmp_path}", f"hydra.run.dir={run_dir}"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith("error: invalid trainer.parallelism=hsdp for optimizer=onebit_lamb: OnebitLamb "
                                  "takes no sharded (FSDP2 DTensor) parameters; the multi-tensor path of SLAMB or "
                                  "LAMB does; fix: trainer.parallelism=ddp"), done.stderr
    assert not (run_dir / "meta.json").exists()
