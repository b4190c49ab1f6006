"""Learning-rate and compression-ratio schedules of the reproduced recipes.

LR schedules are picklable multiplier objects of the global step (so a
:class:`torch.optim.lr_scheduler.LambdaLR` built on them saves and restores
with the checkpoint) and are stepped once per optimizer step:

* :class:`MultiStep`: x gamma at given epochs (CIFAR-10: x0.1 at 100 and 150);
* :class:`WarmupPolyDecay`: linear warm-up then polynomial decay to zero
  (BERT / NVIDIA LAMB recipe, degree 0.5).

:func:`compression_ratio` is SLAMB's per-epoch compression warm-up of the
CIFAR-10 recipe: k_e = max(list[e], k), the last entry kept after the list.
"""
from __future__ import annotations

import bisect
import math

import torch

from .optim._common import check_range

# The seed's per-epoch warm-up of SLAMB's compression ratio (CIFAR-10 recipe).
CIFAR10_COMPRESSION_WARMUP = (0.5, 0.5, 0.2, 0.1, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01,
                              0.008, 0.008, 0.006, 0.006, 0.003, 0.003, 0.001)
COMPRESSION_WARMUPS = {"cifar10": CIFAR10_COMPRESSION_WARMUP}


class MultiStep:
    """Multiplier ``gamma ** (number of milestones reached)``; milestones in epochs."""

    def __init__(self, milestones, gamma: float, steps_per_epoch: int):
        check_range("schedule.gamma", gamma, 0.0, lo_open=True)
        if steps_per_epoch < 1:
            raise ValueError(f"invalid steps_per_epoch={steps_per_epoch}: must be >= 1")
        if list(milestones) != sorted(milestones) or any(m < 0 for m in milestones):
            raise ValueError(f"invalid schedule.milestones={list(milestones)}: must be increasing epochs >= 0")
        self.milestones = [int(m) * steps_per_epoch for m in milestones]
        self.gamma = float(gamma)

    def __call__(self, step: int) -> float:
        return self.gamma ** bisect.bisect_right(self.milestones, step)


class WarmupPolyDecay:
    """Linear warm-up from 0 over ``warmup_steps``, then ``(1 - progress) ** power`` to 0 at ``total_steps``."""

    def __init__(self, warmup_steps: int, total_steps: int, power: float = 1.0):
        if not (0 <= warmup_steps < total_steps):
            raise ValueError(f"invalid warmup_steps={warmup_steps}, total_steps={total_steps}: "
                             "need 0 <= warmup_steps < total_steps")
        check_range("schedule.power", power, 0.0)
        self.warmup_steps, self.total_steps, self.power = int(warmup_steps), int(total_steps), float(power)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return max(0.0, 1.0 - progress) ** self.power


SCHEDULES = ("constant", "multistep", "warmup_poly")


def lr_multiplier(cfg, steps_per_epoch: int, total_steps: int):
    """The multiplier object a schedule config (``name`` + its settings) describes."""
    name = cfg["name"]
    if name == "constant":
        return MultiStep([], 1.0, steps_per_epoch)
    if name == "multistep":
        return MultiStep(cfg["milestones"], cfg["gamma"], steps_per_epoch)
    if name == "warmup_poly":
        warmup = cfg.get("warmup_steps")
        if warmup is None:
            warmup = math.ceil(cfg.get("warmup_fraction", 0.0) * total_steps)
        return WarmupPolyDecay(warmup, total_steps, cfg.get("power", 1.0))
    raise ValueError(f"invalid schedule.name={name!r}: must be one of {list(SCHEDULES)}")


def build_lr_scheduler(optimizer, cfg, steps_per_epoch: int, total_steps: int):
    """A per-step :class:`LambdaLR` for the schedule config ``cfg``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, steps_per_epoch, total_steps))


def compression_ratio(epoch: int, k: float, warmup=CIFAR10_COMPRESSION_WARMUP) -> float:
    """SLAMB's compression ratio for ``epoch`` (0-based): ``max(warmup[epoch], k)``, last entry kept after."""
    if isinstance(warmup, str):
        if warmup not in COMPRESSION_WARMUPS:
            raise ValueError(f"invalid compression_warmup={warmup!r}: must be one of {sorted(COMPRESSION_WARMUPS)}"
                             " or a list of per-epoch ratios")
        warmup = COMPRESSION_WARMUPS[warmup]
    if not warmup:
        return k
    return max(float(warmup[min(epoch, len(warmup) - 1)]), k)
