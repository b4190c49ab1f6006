"""LR schedules from a ``schedule`` config node (``name`` + its settings) for the pipelines."""
from __future__ import annotations

import math

import torch

from slamb.optim.checks import check_range
from slamb.schedules import MultiStep, WarmupCosine, WarmupExpDecay, WarmupPolyDecay

SCHEDULES = ("constant", "multistep", "warmup_poly", "warmup_exp", "warmup_cosine")
# the settings each schedule reads beside its name (what a command line may add under ``schedule.``)
SCHEDULE_SETTINGS = {"constant": (), "multistep": ("milestones", "gamma"),
                     "warmup_poly": ("warmup_steps", "warmup_fraction", "power"),
                     "warmup_exp": ("warmup_steps", "warmup_fraction", "decay_rate", "decay_steps", "degree"),
                     "warmup_cosine": ("warmup_epochs", "warmup_init", "min_ratio")}
# the steps of an epoch where a check before the workers does not know them (they come from the data): many,
# so that only a schedule that no data could make valid is refused
MANY_STEPS = 1000


def warmup_steps(cfg, total_steps: int) -> int:
    """``cfg.warmup_steps`` when set, else ``ceil(cfg.warmup_fraction * total_steps)`` (0 when neither)."""
    steps = cfg.get("warmup_steps")
    if steps is not None:
        return int(steps)
    fraction = cfg.get("warmup_fraction", 0.0)
    check_range("schedule.warmup_fraction", fraction, 0.0, 1.0, hi_open=True)
    return math.ceil(fraction * total_steps)


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


def check_lr_schedule(cfg, length: int, steps_per_epoch: int | None = None) -> None:
    """The schedule config ``cfg`` of a run of ``length`` epochs (steps: ``steps_per_epoch=1``), checked
    before any worker starts; ``None``: the epoch's steps come from the data (:data:`MANY_STEPS`)."""
    steps_per_epoch = steps_per_epoch or MANY_STEPS
    lr_multiplier(cfg, steps_per_epoch, length * steps_per_epoch)


def build_lr_scheduler(optimizer, cfg, steps_per_epoch: int, total_steps: int):
    """A per-step :class:`LambdaLR` for the schedule config ``cfg`` (``lr_offset``: an absolute LR added to
    every step's, 0 when not given)."""
    multiplier = lr_multiplier(cfg, steps_per_epoch, total_steps)
    offset = cfg.get("lr_offset") or 0.0
    check_range("schedule.lr_offset", offset, 0.0)
    if offset:
        multiplier = [Offset(multiplier, offset, group["lr"]) for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
