"""Learning-rate and compression-ratio schedules of the reproduced recipes.

LR schedules are picklable multiplier objects of the global step (so a
:class:`torch.optim.lr_scheduler.LambdaLR` built on them saves and restores
with the checkpoint) and are stepped once per optimizer step, e.g.
``LambdaLR(opt, WarmupPolyDecay(warmup_steps, total_steps, power=0.5))``:

* :class:`MultiStep`: x gamma at given epochs (CIFAR-10: x0.1 at 100 and 150);
* :class:`WarmupPolyDecay`: linear warm-up then polynomial decay to zero
  (BERT / NVIDIA LAMB recipe, degree 0.5);
* :class:`WarmupExpDecay`: polynomial (degree 2) warm-up then exponential decay,
  DeepSpeed bing_bert's ``lr_schedule: EE`` (``warmup_exp_decay_exp``) of the
  authors' DeepSpeed BERT runs;
* :class:`WarmupCosine`: linear warm-up then cosine decay, timm's per-step
  ``CosineLRScheduler`` (Swin recipe).

:func:`compression_ratio` is SLAMB's per-epoch compression warm-up of the
CIFAR-10 recipe: k_e = max(list[e], k), the last entry kept after the list.
"""
from __future__ import annotations

import bisect
import math


from .optim.checks import check_range

# The reference code's per-epoch warm-up of SLAMB's compression ratio (CIFAR-10 recipe).
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


class WarmupExpDecay:
    """``(step / warmup_steps) ** degree`` during warm-up, then ``decay_rate ** ((step - warmup_steps) / decay_steps)``.

    DeepSpeed's ``warmup_exp_decay_exp`` with the warm-up given in steps
    (DeepSpeed: ``warmup_proportion * total_steps``); unlike :class:`WarmupPolyDecay`
    the LR never reaches zero, so runs may be extended past the planned length.
    """

    def __init__(self, warmup_steps: int, decay_rate: float, decay_steps: int, degree: float = 2.0):
        if warmup_steps < 0:
            raise ValueError(f"invalid schedule.warmup_steps={warmup_steps}: must be >= 0")
        check_range("schedule.decay_rate", decay_rate, 0.0, 1.0, lo_open=True)
        if decay_steps < 1:
            raise ValueError(f"invalid schedule.decay_steps={decay_steps}: must be >= 1")
        check_range("schedule.degree", degree, 0.0, lo_open=True)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.decay_rate, self.degree = float(decay_rate), float(degree)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step / self.warmup_steps) ** self.degree
        return self.decay_rate ** ((step - self.warmup_steps) / self.decay_steps)


def check_compression_warmup(warmup):
    """``None``, a named warm-up or a sequence of per-epoch ratios in (0, 1] -> ``None`` or a tuple."""
    if warmup is None:
        return None
    if isinstance(warmup, str):
        if warmup not in COMPRESSION_WARMUPS:
            raise ValueError(f"invalid compression_warmup={warmup!r}: must be null, a list of per-epoch ratios "
                             f"in (0, 1] or one of {sorted(COMPRESSION_WARMUPS)}")
        return COMPRESSION_WARMUPS[warmup]
    if not hasattr(warmup, "__iter__"):
        raise ValueError(f"invalid compression_warmup={warmup!r}: must be null, a list of per-epoch ratios "
                         f"in (0, 1] or one of {sorted(COMPRESSION_WARMUPS)}")
    warmup = tuple(warmup)
    for e, k in enumerate(warmup):
        check_range(f"compression_warmup[{e}]", k, 0.0, 1.0, lo_open=True)
    return warmup


def compression_ratio(epoch: int, k: float, warmup=CIFAR10_COMPRESSION_WARMUP) -> float:
    """SLAMB's compression ratio for ``epoch`` (0-based): ``max(warmup[epoch], k)``, last entry kept after."""
    warmup = check_compression_warmup(warmup)
    if not warmup:
        return k
    return max(float(warmup[min(epoch, len(warmup) - 1)]), k)


class WarmupCosine:
    """timm's ``CosineLRScheduler`` per step with ``warmup_prefix=True``, as a multiplier of the peak LR.

    Linear warm-up from ``warmup_init`` to 1 over ``warmup_steps``, then a
    half cosine from 1 to ``min_ratio`` over the remaining steps (Swin's
    recipe: warm-up LR 5e-7 and minimum 5e-6 for a peak of 5e-4, i.e.
    ``warmup_init=1e-3``, ``min_ratio=1e-2``, both scale-free so the same
    config serves every global batch).
    """

    def __init__(self, warmup_steps: int, total_steps: int, warmup_init: float = 0.0, min_ratio: float = 0.0):
        if not (0 <= warmup_steps < total_steps):
            raise ValueError(f"invalid warmup_steps={warmup_steps}, total_steps={total_steps}: "
                             "need 0 <= warmup_steps < total_steps (schedule.warmup_epochs < epochs)")
        check_range("schedule.warmup_init", warmup_init, 0.0, 1.0)
        check_range("schedule.min_ratio", min_ratio, 0.0, 1.0)
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)
        self.warmup_init, self.min_ratio = float(warmup_init), float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_init + step * (1.0 - self.warmup_init) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + 0.5 * (1.0 - self.min_ratio) * (1.0 + math.cos(math.pi * progress))
