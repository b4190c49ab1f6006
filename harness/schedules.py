"""LR schedules from a ``schedule`` config node (``name`` + its settings) for the pipelines."""
from __future__ import annotations

import math

import torch

from slamb.optim.checks import check_range
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


class Offset:
    """``multiplier(step) + offset / base_lr``: an absolute ``offset`` added to the scheduled LR, DeepSpeed bing_bert's
    ``--lr_offset`` (its 1-bit LAMB scripts: 1e-3 on the EE schedule), as a multiplier of one group's base LR."""

    def __init__(self, multiplier, offset: float, base_lr: float):
        self.multiplier, self.ratio = multiplier, offset / base_lr

    def __call__(self, step: int) -> float:
        return self.multiplier(step) + self.ratio


def build_lr_scheduler(optimizer, cfg, steps_per_epoch: int, total_steps: int):
    """A per-step :class:`LambdaLR` for the schedule config ``cfg`` (``lr_offset``: an absolute LR added to
    every step's, 0 when not given)."""
    multiplier = lr_multiplier(cfg, steps_per_epoch, total_steps)
    offset = cfg.get("lr_offset") or 0.0
    check_range("schedule.lr_offset", offset, 0.0)
    if offset:
        multiplier = [Offset(multiplier, offset, group["lr"]) for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
