"""Every Hydra config composes and builds; the paper rows hold the seed's settings."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cifar10.model import build_model
from slamb import registry
from harness import build_optimizer, check_trainer
from harness.schedules import build_lr_scheduler
from slamb.schedules import CIFAR10_COMPRESSION_WARMUP, compression_ratio

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# the CIFAR-10 pipeline's rows (configs/cifar10.yaml); every other pipeline's tests compose its own rows
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")
                     if p.stem.startswith(("cifar10_", "demo_digits_")) and not p.stem.endswith("_common"))
OPTIMIZERS = sorted(p.stem for p in (CONFIGS / "optimizer").glob("*.yaml"))
SWEEPS = sorted(p.stem for p in (CONFIGS / "sweep").glob("*.yaml"))


def compose_cfg(*overrides, hydra_cfg=False):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("cifar10", overrides=list(overrides), return_hydra_config=hydra_cfg)
    return cfg if hydra_cfg else OmegaConf.to_container(cfg, resolve=True)


def test_every_registry_optimizer_has_a_config():
    assert set(OPTIMIZERS) == set(registry.OPTIMIZERS)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_config_builds_with_its_settings(name):
    cfg = compose_cfg(f"optimizer={name}", "model=resnet8")
    opt = build_optimizer(build_model(cfg["model"]), cfg["optimizer"])
    assert type(opt) is registry.optimizer_class(name)
    assert opt.param_groups[0]["lr"] == cfg["optimizer"]["lr"]
    assert opt.param_groups[0]["weight_decay"] == cfg["optimizer"]["weight_decay"]
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups[1:])  # biases and BN weights
    assert hasattr(opt, "ledger") and "total" in opt.comm_stats()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_builds(experiment):
    cfg = compose_cfg(f"experiment={experiment}")
    check_trainer(cfg["trainer"])
    model = build_model(cfg["model"])
    opt = build_optimizer(model, cfg["optimizer"])
    sched = build_lr_scheduler(opt, cfg["schedule"], 10, 10 * cfg["epochs"])
    assert cfg["name"] == experiment
    assert cfg["paper"]["row"] in ("SGD-M", "LAMB", "SLAMB") and cfg["paper"]["top1"] > 90
    first, second = cfg["schedule"]["milestones"]
    multiplier = sched.lr_lambdas[0]
    assert [multiplier(10 * e) for e in (0, first - 1, first, second - 1, second, cfg["epochs"])] == \
        pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_cifar10_rows_hold_the_seed_settings():
    rows = {r: compose_cfg(f"experiment=cifar10_resnet110_{r}") for r in ("sgd", "lamb", "slamb")}
    for cfg in rows.values():
        assert sum(p.numel() for p in build_model(cfg["model"]).parameters()) == 1_727_962  # 1.7M
        assert (cfg["model"]["depth"], cfg["trainer"]["nproc_per_node"], cfg["data"]["batch_size_per_worker"],
                cfg["epochs"]) == (110, 4, 256, 200)
        assert cfg["schedule"] == {"name": "multistep", "milestones": [100, 150], "gamma": 0.1}
        assert cfg["optimizer"]["weight_decay"] == 1e-4
    assert (rows["sgd"]["optimizer"]["lr"], rows["sgd"]["optimizer"]["momentum"]) == (0.03, 0.9)
    assert rows["lamb"]["optimizer"]["lr"] == 0.01
    s = rows["slamb"]["optimizer"]
    assert (s["lr"], s["variant"], s["compress_ratio"], s["beta3"], s["sync_interval"]) == (0.01, "v1", 0.1, 0.99, 50)
    opt = build_optimizer(build_model(rows["slamb"]["model"]), s)
    assert (opt.variant, opt.mask_policy, opt.sync_interval, opt.min_compress_numel) == ("v1", "cyclic", 50, 9000)
    ks = []
    for epoch in range(20):
        opt.begin_epoch(epoch)
        ks.append(opt.compress_ratio)
    assert ks == [0.5, 0.5, 0.2] + [0.1] * 17
    assert [compression_ratio(e, 0.002, "cifar10") for e in (0, 9, 12, 14, 16, 40)] == [0.5, 0.01, 0.006, 0.003,
                                                                                      0.002, 0.002]
    assert len(CIFAR10_COMPRESSION_WARMUP) == 17


@pytest.mark.parametrize("sweep", SWEEPS)
def test_sweeps_compose_over_slamb_settings(sweep):
    cfg = compose_cfg("experiment=cifar10_resnet110_slamb", f"sweep={sweep}", hydra_cfg=True)
    params = cfg.hydra.sweeper.params
    assert params and cfg.study == sweep
    for key, values in params.items():
        assert key.startswith("optimizer.") and key.split(".")[1] in registry.optimizer_settings("slamb")
        assert len(values.split(",")) >= 3


def test_run_directory_is_named_by_the_overrides():
    """Deterministic (no timestamp): rerunning a command finds its checkpoint, torchrun ranks agree."""
    cfg = compose_cfg("experiment=cifar10_resnet110_slamb", hydra_cfg=True)
    assert cfg.hydra.run.dir == "runs/cifar10_resnet110_slamb/"
    cfg = compose_cfg("experiment=cifar10_resnet110_slamb", "seed=3", "optimizer.beta3=0.9", "trainer.progress=false",
                      "data.dir=/x", hydra_cfg=True)
    assert cfg.hydra.run.dir == "runs/cifar10_resnet110_slamb/optimizer.beta3=0.9,seed=3"


@pytest.mark.parametrize("override, match", [
    ("+optimizer.betaz=0.5", r"unknown setting\(s\) \['betaz'\] for optimizer 'slamb'; valid: .*beta3"),
    ("optimizer.beta3=1.5", r"invalid beta3=1.5: must be a number in \[0.0, 1.0\)"),
    ("optimizer.comm_dtype=float17", r"invalid optimizer.comm_dtype='float17'"),
    ("optimizer.compression_warmup=bert", r"invalid compression_warmup='bert'"),
    ("model.depth=10", r"invalid model.depth=10: must be 6n\+2"),
])
def test_invalid_settings_name_the_setting(override, match):
    cfg = compose_cfg("experiment=cifar10_resnet110_slamb", override)
    with pytest.raises(ValueError, match=match):
        build_optimizer(build_model(cfg["model"]), cfg["optimizer"])


def test_compression_warmup_needs_a_compressing_optimizer():
    cfg = compose_cfg("experiment=cifar10_resnet110_sgd", "+optimizer.compression_warmup=cifar10", "model=resnet8")
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['compression_warmup'\] for optimizer 'sgd'"):
        build_optimizer(build_model(cfg["model"]), cfg["optimizer"])


@pytest.mark.parametrize("override, match", [
    ("trainer.precision=fp8", r"invalid trainer.precision='fp8': must be one of \['fp32', 'bf16', 'fp16'\]"),
    ("trainer.nproc_per_node=0", r"invalid trainer.nproc_per_node=0: must be an integer >= 1"),
    ("trainer.resume=maybe", r"invalid trainer.resume='maybe'"),
    ("trainer.device=gpu0", r"invalid trainer.device='gpu0'"),
    ("trainer.checkpoint.every_epochs=0", r"invalid trainer.checkpoint.every_epochs=0"),
])
def test_invalid_trainer_settings(override, match):
    with pytest.raises(ValueError, match=match):
        check_trainer(compose_cfg(override)["trainer"])


def test_comm_dtype_names_become_dtypes():
    cfg = compose_cfg("optimizer=slamb", "optimizer.comm_dtype=float16", "model=resnet8")
    assert build_optimizer(build_model(cfg["model"]), cfg["optimizer"]).comm_dtype is torch.float16
