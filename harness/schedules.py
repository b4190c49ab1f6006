"""LR schedules from a ``schedule`` config node (``name`` + its settings) for the pipelines."""
from __future__ import annotations

import math

import torch

from slamb.schedules import MultiStep, WarmupCosine, WarmupExpDecay, WarmupPolyDecay

SCHEDULES = ("constant", "multistep", "warmup_poly", "warmup_exp", "warmup_cosine")


def warmup_steps(cfg, total_steps: int) -> int:
    """``cfg.warmup_steps`` when set, else ``ceil(cfg.warmup_fraction * total_steps)`` (0 when neither)."""
    steps = cfg.get("warmup_steps")
    return math.ceil(cfg.get("warmup_fraction", 0.0) * total_steps) if steps is None else int(steps)


def lr_multiplier(cfg, steps_per_epoch: int, total_steps: int):
    """The multiplier object a schedule config (``name`` + its settings) describes."""
    name = cfg["name"]
    if name == "constant":
        return MultiStep([], 1.0, steps_per_epoch)
    if name == "multistep":
        return MultiStep(cfg["milestones"], cfg["gamma"], steps_per_epoch)
    if name == "warmup_poly":
        return WarmupPolyDecay(warmup_steps(cfg, total_steps), total_steps, cfg.get("power", 1.0))
    if name == "warmup_exp":
        return WarmupExpDecay(warmup_steps(cfg, total_steps), cfg["decay_rate"], cfg["decay_steps"],
                              cfg.get("degree", 2.0))
    if name == "warmup_cosine":
        return WarmupCosine(cfg["warmup_epochs"] * steps_per_epoch, total_steps, cfg.get("warmup_init", 0.0),
                            cfg.get("min_ratio", 0.0))
    raise ValueError(f"invalid schedule.name={name!r}: must be one of {list(SCHEDULES)}")


def build_lr_scheduler(optimizer, cfg, steps_per_epoch: int, total_steps: int):
    """A per-step :class:`LambdaLR` for the schedule config ``cfg``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, steps_per_epoch, total_steps))
