"""The Swin / ImageNet pipeline: ImageFolder layout and errors, timm's transforms and mixup, Swin-B's size,
the configs of the paper's rows, the cosine schedule against timm's, the rank-agreed fp16 skip, and
end-to-end runs (2 gloo workers, real JPEG files) of AdamW, LAMB and SLAMB with bf16, accumulation and resume
(on 1 worker too)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness import DistEnv, build_optimizer, check_trainer, seed_everything
from harness.amp import MixedPrecision
from harness.records import load_runs
from harness.tables import build_tables
from harness.schedules import build_lr_scheduler
from slamb.schedules import WarmupCosine
from swin import data as sdata
from swin.model import build_model
from swin.tiny import write_tiny_imagenet
from swin.train import forward_backward, train
from tests import distributed

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ROWS = ("adamw", "lamb", "slamb")
# data.global_batch=null: the paper's rows fix 16,384; a tiny run's batch is its workers' micro-batches
TINY = ["model=swin_tiny_test", "data.global_batch=null", "data.micro_batch=4", "data.eval_batch=8", "data.workers=0",
        "epochs=2", "schedule.warmup_epochs=1", "trainer.nproc_per_node=2", "trainer.progress=false",
        "trainer.threads_per_worker=1", "trainer.device=cpu"]
SLAMB_TINY = ["optimizer.min_compress_numel=500", "optimizer.sync_interval=3"]
CPU1 = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def compose_swin(*overrides) -> dict:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return OmegaConf.to_container(compose("swin", overrides=list(overrides)), resolve=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_imagenet(tmp_path_factory.mktemp("imagenet"))


# ------------------------------------------------------------------------------------------ data


def test_layout_gives_the_classes_and_timm_reads_the_jpegs(tiny_dir):
    assert sdata.check_layout(tiny_dir) == [f"n{c:08d}" for c in range(4)]
    cfg = compose_swin("model=swin_tiny_test", f"data.dir={tiny_dir}", "data.micro_batch=4",
                       "data.eval_batch=8", "data.workers=0")
    train_loader, _, val_loader = sdata.build_loaders(cfg["data"], 32, 4, CPU1, seed=0, micro_batches=1)
    x, y = next(iter(train_loader))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and set(y.tolist()) <= {0, 1, 2, 3}
    assert len(train_loader) == 8 and len(val_loader.dataset) == 8
    xv, yv = next(iter(val_loader))  # deterministic validation transform: sorted files, class-major
    assert xv.shape == (8, 3, 32, 32) and yv.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(xv, next(iter(val_loader))[0])
    # the Swin recipe's augmentation, from timm
    train_tf, _ = sdata.transforms(cfg["data"], 32)
    names = " ".join(type(t).__name__ for t in train_tf.transforms)
    assert "RandAugment" in names and "RandomErasing" in names and "ColorJitter" not in names  # RA replaces jitter
    erasing = next(t for t in train_tf.transforms if type(t).__name__ == "RandomErasing")
    assert erasing.probability == 0.25 and erasing.mode == "pixel"
    assert "bicubic" in str(train_tf.transforms[0]).lower()


def test_a_step_takes_the_same_augmented_images_on_any_number_of_workers(tiny_dir):
    """A step's 2 micro-batches: loaded by 1 worker (accumulating both) or by 2 (one each), under any state of the
    global generators, the same images with the same augmentation draws; another epoch draws anew."""
    cfg = compose_swin("model=swin_tiny_test", f"data.dir={tiny_dir}", "data.micro_batch=4", "data.workers=0")

    def steps(env, epoch=0):
        loader, sampler, _ = sdata.build_loaders(cfg["data"], 32, 4, env, seed=3, micro_batches=2)
        sampler.set_epoch(epoch)
        return list(loader)

    seed_everything(0)
    one = steps(CPU1)
    seed_everything(1)
    two = [steps(DistEnv(r, 2, r, 2, torch.device("cpu"))) for r in (0, 1)]
    assert len(one) == 2 * len(two[0]) == 8  # 4 steps of 2 micro-batches of 4 of the 32 images
    for i, (x, y) in enumerate(one):
        xt, yt = two[i % 2][i // 2]
        assert torch.equal(x, xt) and torch.equal(y, yt)
    other = steps(CPU1, epoch=1)
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(one, other))


def test_mixup_gives_smoothed_soft_targets():
    cfg = compose_swin("data.micro_batch=4")
    mixup, criterion = sdata.mixup_and_loss(cfg["data"], 10)
    assert (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.label_smoothing) == (0.8, 1.0, 0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    _, target = mixup(x.clone(), y)
    assert target.shape == (4, 10) and torch.allclose(target.sum(1), torch.ones(4))
    assert target.min() >= 0.1 / 10 - 1e-6 and target.max() <= 1 - 0.1 + 0.1 / 10 + 1e-6  # smoothing 0.1
    assert type(criterion).__name__ == "SoftTargetCrossEntropy"
    odd = compose_swin("data.micro_batch=3")
    with pytest.raises(ValueError, match="micro_batch=3 must be even"):
        sdata.mixup_and_loss(odd["data"], 10)


def _mkdirs(root: Path, *folders: str) -> None:
    for f in folders:
        (root / f).mkdir(parents=True)


@pytest.mark.parametrize("layout, files, match", [
    ((), (), "missing .*train"),
    (("train/a", "val/a"), ("val/a/x.JPEG",), r"class folders without images \(a\)"),
    (("train", "val/a"), ("val/a/x.JPEG",), "has no class folders"),
    (("train/a", "train/b", "val/a"), ("train/a/x.JPEG", "train/b/x.JPEG", "val/a/x.JPEG"), "different class .*b"),
])
def test_malformed_layout_is_a_clear_error(tmp_path, layout, files, match):
    _mkdirs(tmp_path, *layout)
    for f in files:
        (tmp_path / f).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=match) as err:
        sdata.check_layout(tmp_path)
    assert "train/<class>/*.JPEG" in str(err.value) and "data.dir" in str(err.value)


def test_class_count_must_match_the_model(tiny_dir):
    cfg = compose_swin("model=swin_tiny_test", f"data.dir={tiny_dir}", "data.workers=0")
    with pytest.raises(ValueError, match="4 classes but model.num_classes=1000: set model.num_classes=4"):
        sdata.build_loaders(cfg["data"], 32, 1000, CPU1, seed=0)


# ------------------------------------------------------------------------------------------ model, configs


def test_swin_b_has_88m_parameters_and_no_decay_on_positions():
    cfg = compose_swin("experiment=swin_b/adamw")
    with torch.device("meta"):  # the full model's shapes without its memory or init time
        model = build_model(cfg["model"])
    assert sum(p.numel() for p in model.parameters()) == 87_768_224  # the paper's "88M"
    assert model.patch_embed.img_size == (224, 224) and model.num_classes == 1000
    dpr = [b.drop_path1.drop_prob for layer in model.layers for b in layer.blocks if hasattr(b.drop_path1, "drop_prob")]
    assert max(dpr) == pytest.approx(0.5)  # stochastic depth of Swin-B, linear over the 24 blocks
    opt = build_optimizer(model, cfg["optimizer"])
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert opt.param_groups[0]["weight_decay"] == 0.05 and opt.param_groups[1]["weight_decay"] == 0.0
    assert not any("relative_position_bias_table" in n or n.endswith(".bias") or "norm" in n for n in names)
    assert "layers.0.blocks.0.attn.qkv.weight" in names and "head.fc.weight" in names


def test_model_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="model.arch='resnet50'"):
        build_model({"arch": "resnet50"})


@pytest.mark.parametrize("experiment", [None, "swin_b/adamw", "swin_b/lamb", "swin_b/slamb"])
def test_every_swin_config_composes_with_the_reference_recipe(experiment):
    cfg = compose_swin(*([f"experiment={experiment}"] if experiment else []))
    check_trainer(cfg["trainer"])
    assert (cfg["epochs"], cfg["schedule"]["warmup_epochs"], cfg["data"]["micro_batch"]) == (300, 20, 128)
    assert cfg["optimizer"]["lr"] == pytest.approx(5e-4 / 8 * 2.828, rel=1e-4)
    assert cfg["optimizer"]["weight_decay"] == 0.05 and cfg["clip_grad"] == 1.0
    assert cfg["trainer"]["precision"] == "fp16"  # the reference runs' AMP: fp16 with a dynamic loss scale
    assert cfg["model"]["arch"] == "swin_base_patch4_window7_224" and cfg["model"]["drop_path_rate"] == 0.5
    assert cfg["data"]["aug"]["auto_augment"] == "rand-m9-mstd0.5-inc1" and cfg["data"]["mixup"]["cutmix_alpha"] == 1.0
    with torch.device("meta"):
        model = build_model({**cfg["model"], "depths": [1, 1], "num_heads": [1, 2], "embed_dim": 16})
    opt = build_optimizer(model, cfg["optimizer"])
    build_lr_scheduler(opt, cfg["schedule"], 10, 10 * cfg["epochs"])
    if experiment:
        row = experiment.split("/")[1]
        assert cfg["name"] == f"swin_b_{row}" and cfg["optimizer"]["name"] == row
        assert cfg["paper"]["table"] == "swin_b_imagenet" and cfg["optimizer"]["eps"] == 1e-8
    if experiment == "swin_b/slamb":
        o = cfg["optimizer"]
        assert (o["variant"], o["compress_ratio"], o["beta3"], o["sync_interval"]) == ("v2", 0.1, 0.999, 100)


def test_warmup_cosine_matches_timms_per_step_scheduler():
    from timm.scheduler import CosineLRScheduler

    peak, warmup, total = 1e-3, 20, 200
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    ref = CosineLRScheduler(opt, t_initial=total - warmup, lr_min=peak * 1e-2, warmup_lr_init=peak * 1e-3,
                            warmup_t=warmup, warmup_prefix=True, t_in_epochs=False, cycle_limit=1)
    ours = WarmupCosine(warmup, total, warmup_init=1e-3, min_ratio=1e-2)
    for step in range(total + 5):
        ref.step_update(step)
        assert peak * ours(step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-15), step
    assert ours(0) == 1e-3 and ours(warmup) == 1.0 and ours(total) == pytest.approx(1e-2)
    with pytest.raises(ValueError, match="warmup_epochs < epochs"):
        WarmupCosine(10, 10)


# ------------------------------------------------------------------------------------------ mixed precision


def steps_worker(rank, world, tiny_dir):
    """The fp16 skip cases and the repeated-batch runs in one launch (process start-up dominates)."""
    from slamb.optim.slamb import SLAMB

    SLAMB.allow_same_gradients = True  # the tiny set's images alike on both ranks: their gradients may agree
    return {"fp16": {name: fp16_skip_case(rank, name) for name in ("slamb", "adamw")},
            "repeated": {name: repeated_batch_case(rank, world, name, precision, lr, tiny_dir)
                         for name, precision, lr in REPEATED}}


@pytest.fixture(scope="module")
def step_results(tiny_dir):
    return distributed.run(steps_worker, 2, str(tiny_dir))


def fp16_skip_case(rank, name):
    torch.manual_seed(0)
    model = build_model(compose_swin("model=swin_tiny_test")["model"])
    settings = {"name": name, "lr": 1e-3, "weight_decay": 0.05}
    if name == "slamb":
        settings.update(min_compress_numel=500, sync_interval=1)
    opt = build_optimizer(model, settings)
    amp = MixedPrecision("fp16", torch.device("cpu"), init_scale=1024.0)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    for p in params:  # scaled gradients as backward would leave them, local to each rank as under SLAMB
        p.grad = torch.full_like(p, 1024.0 * (rank + 1))
    if rank == 1:
        params[3].grad[0] = float("inf")  # only this rank overflows
    skipped, _ = amp.step(opt, params, clip_grad=1.0)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, params))
    first = {"skipped": skipped, "unchanged": unchanged, "scale": amp.scale, "ledger": opt.comm_stats()}
    for p in params:
        p.grad = torch.full_like(p, 1024.0 * (rank + 1) / 2)  # 512: the backed-off scale
    skipped2, norm = amp.step(opt, params, clip_grad=1.0)
    moved = any(not torch.equal(a, p) for a, p in zip(before, params))
    return {**first, "skipped2": skipped2, "moved": moved, "norm": float(norm),
            "steps": opt.ledger.steps, "state": amp.state_dict()}


@pytest.mark.multiprocess
def test_fp16_overflow_on_one_rank_is_skipped_by_all_ranks(step_results):
    """SLAMB (collectives inside step(), local gradients) and AdamW: both ranks skip, the scale backs off."""
    results = [r["fp16"] for r in step_results]
    n = sum(p.numel() for p in build_model(compose_swin("model=swin_tiny_test")["model"]).parameters())
    for rank, name in [(rank, name) for rank in range(2) for name in ("slamb", "adamw")]:
        r = results[rank][name]
        assert r["skipped"] and r["unchanged"] and r["scale"] == 512.0  # both ranks, before any collective
        assert r["ledger"]["last_step"]["control"]["payload"] == 4  # the one agreed flag
        assert set(r["ledger"]["last_step"]) == {"control", "all"}  # nothing else was sent
        assert not r["skipped2"] and r["moved"] and r["steps"] == 2
        assert r["norm"] == pytest.approx((rank + 1) * n ** 0.5, rel=1e-4)  # unscaled before clipping
        assert r["state"] == {"scale": 512.0, "good_steps": 1, "skipped_steps": 1, "dropped_steps": 0}


def test_precision_setting_is_checked():
    with pytest.raises(ValueError, match="trainer.precision='fp8'"):
        MixedPrecision("fp8", torch.device("cpu"))


# ------------------------------------------------------------------------------------------ training


# layer-wise trust ratios make LAMB's and SLAMB's steps lr x ||w||: a larger lr for the same progress
REPEATED = (("adamw", "bf16", 2e-3), ("lamb", "fp32", 2e-2), ("slamb", "bf16", 2e-2))


def repeated_batch_case(rank, world, name, precision, lr, tiny_dir):
    """15 steps on one fixed batch (no mixup): the loss must fall, on every rank."""
    import slamb

    cfg = compose_swin("model=swin_tiny_test", f"data.dir={tiny_dir}", "data.micro_batch=8",
                       "data.workers=0", f"optimizer={name}", f"optimizer.lr={lr}", "optimizer.weight_decay=0.0",
                       *(SLAMB_TINY if name == "slamb" else []))
    env = DistEnv(rank, world, rank, world, torch.device("cpu"))
    seed_everything(0, rank)
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    train_loader, _, _ = sdata.build_loaders(cfg["data"], 32, 4, env, seed=0)
    x, y = next(iter(train_loader))
    opt = build_optimizer(model, cfg["optimizer"])
    params = list(model.parameters())
    model = slamb.wrap_model(model, opt)
    model.eval()  # no stochastic depth: the same function at every step
    amp = MixedPrecision(precision, torch.device("cpu"))
    losses = []
    for _ in range(15):
        opt.zero_grad(set_to_none=True)
        losses.append(float(forward_backward(model, [(x, y), (x, y)], torch.nn.CrossEntropyLoss(), amp)))
        amp.step(opt, params, clip_grad=1.0)
    return {"losses": losses, "bytes": opt.comm_stats()["total"]["all"]["payload"]}


@pytest.mark.multiprocess
def test_loss_falls_on_a_repeated_batch(step_results):
    results = [r["repeated"] for r in step_results]
    for name, _, _ in REPEATED:
        for r in (results[0][name], results[1][name]):
            assert all(np.isfinite(r["losses"])) and r["losses"][-1] < 0.95 * r["losses"][0], (name, r["losses"])
        assert results[0][name]["bytes"] == results[1][name]["bytes"] > 0


def e2e_worker(rank, world, jobs):
    return [train(cfg, run_dir) for cfg, run_dir in jobs]


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiprocess
def test_each_row_trains_end_to_end_on_two_workers_and_the_table_renders(tiny_dir, tmp_path):
    extra = {"adamw": ["trainer.precision=bf16"], "lamb": ["accumulation_steps=2", "trainer.precision=fp32"],
             "slamb": [*SLAMB_TINY, "trainer.precision=bf16"]}
    jobs = [(compose_swin(*TINY, f"experiment=swin_b/{row}", f"data.dir={tiny_dir}", *extra[row]),
             str(tmp_path / "runs" / row)) for row in ROWS]
    jobs[2][0]["trainer"]["checkpoint"]["keep"] = 2
    results = distributed.run(e2e_worker, 2, jobs)
    # SLAMB resumed: its run directory as it was after epoch 1, continued by a second launch
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "runs" / "slamb", resumed_dir)
    first, last = sorted((resumed_dir / "ckpt").glob("step*"))
    shutil.rmtree(last)
    (resumed_dir / "ckpt" / "latest.json").write_text(json.dumps({"dir": first.name, "world_size": 2,
                                                                   "epoch": 1, "step": 4, "resumed_from": []}))
    (resumed_dir / "metrics.json").unlink()
    resumed = distributed.run(e2e_worker, 2, [(jobs[2][0], str(resumed_dir))])
    # LAMB resumed on 1 worker after epoch 1: it accumulates the step's 4 micro-batches where each of the 2
    # accumulated 2
    one_dir = tmp_path / "lamb_on_1"
    shutil.copytree(tmp_path / "runs" / "lamb", one_dir)
    first, last = sorted((one_dir / "ckpt").glob("step*"))
    shutil.rmtree(last)
    (one_dir / "ckpt" / "latest.json").write_text(json.dumps({"dir": first.name,
                                                             **json.loads((first / "complete.json").read_text())}))
    (one_dir / "metrics.json").unlink()
    (one_dir / "metrics.jsonl").write_text((one_dir / "metrics.jsonl").read_text().splitlines(True)[0])
    one = {**jobs[1][0], "trainer": {**jobs[1][0]["trainer"], "nproc_per_node": 1}}
    on_1 = distributed.run(e2e_worker, 1, [(one, str(one_dir))])[0][0]

    param_bytes = 4 * sum(p.numel() for p in build_model(jobs[0][0]["model"]).parameters())
    for i, row in enumerate(ROWS):
        run_dir = tmp_path / "runs" / row
        rows = history(run_dir)
        summary = json.loads((run_dir / "metrics.json").read_text())
        steps = 4 // (2 if row == "lamb" else 1)  # 32 images / (2 workers x 4) = 4 batches per epoch
        assert [r["epoch"] for r in rows] == [1, 2] and [r["step"] for r in rows] == [steps, 2 * steps]
        assert summary["global_batch"] == 8 * (2 if row == "lamb" else 1)
        assert summary["peak_lr"] == pytest.approx(1.7675e-4 * summary["global_batch"] / 512)
        for r in rows:
            assert np.isfinite(r["train_loss"]) and np.isfinite(r["test_loss"])
            assert 0 <= r["test_top1"] <= r["test_top5"] <= 100
            assert r["images_per_s"] == pytest.approx(2 * r["images_per_s_per_worker"]) and r["images_per_s"] > 0
            assert {"data_time_s", "forward_backward_time_s", "optimizer_time_s"} <= set(r)
            assert r["skipped_steps"] == 0 and r["loss_scale"] == 1.0
        assert rows[0]["lr"] == pytest.approx(summary["peak_lr"])  # end of the 1-epoch warm-up
        assert rows[1]["lr"] == pytest.approx(summary["peak_lr"] * 1e-2)  # the cosine's floor at the end
        assert results[0][i]["bytes_total"] == results[1][i]["bytes_total"]  # every rank sends as much
        if row != "slamb":  # averaged gradients: every parameter once per optimizer step, not per micro-batch
            assert rows[1]["bytes_cum/grads"] == 2 * steps * param_bytes
    slamb_rows = history(tmp_path / "runs" / "slamb")
    assert "bytes_cum/grads" not in slamb_rows[1]
    assert 0 < slamb_rows[1]["bytes_cum/momentum"] < 8 * param_bytes
    assert slamb_rows[1]["bytes_cum/params"] == 3 * param_bytes  # model syncs after steps 1, 4, 7

    # the resumed run continues from its epoch-1 checkpoint to the same numbers as the uninterrupted one
    again = history(tmp_path / "resumed")
    assert resumed[0][0]["resumed_from"] == [1] and [r["step"] for r in again] == [4, 8]
    for key in ("test_top1", "bytes_cum/all", "lr"):
        assert again[1][key] == pytest.approx(slamb_rows[1][key]), key
    assert again[1]["train_loss"] == pytest.approx(slamb_rows[1]["train_loss"], rel=1e-4)

    # every step of the 1-worker continuation takes the same images, augmentation, mixup and stochastic depth:
    # the 2-worker run's numbers to float32 rounding (another summation order of the gradients)
    lamb_rows, on_1_rows = history(tmp_path / "runs" / "lamb"), history(one_dir)
    assert on_1["world_size"] == 1 and on_1["accumulation_steps"] == 4 and on_1["global_batch"] == 16
    assert on_1["resumed_from"] == [1] and [r["step"] for r in on_1_rows] == [2, 4]
    for key in ("train_loss", "test_loss", "test_top1", "lr"):
        assert on_1_rows[1][key] == pytest.approx(lamb_rows[1][key], rel=1e-5), key
    a, b = (torch.load(d / "model" / "model.pt") for d in (one_dir, tmp_path / "runs" / "lamb"))
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)

    written = build_tables(load_runs(tmp_path / "runs"), tmp_path / "tables")
    table = (tmp_path / "tables" / "swin_b_imagenet.md").read_text()
    assert "swin_b_imagenet" in written and "| AdamW | 83.50 |" in table and "| SLAMB | - |" in table


@pytest.mark.multiprocess
def test_missing_data_is_a_clear_error_from_the_command_line(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "swin.train", "trainer.nproc_per_node=1", "trainer.device=cpu",
                           f"data.dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode != 0
    assert f"missing {tmp_path / 'train'}" in done.stderr and "train/<class>/*.JPEG" in done.stderr
