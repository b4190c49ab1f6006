"""Mixed precision and gradient accumulation for every pipeline: one optimizer step, agreed by all ranks.

:class:`MixedPrecision` wraps what a training step does around ``backward``
and ``optimizer.step()``:

* ``fp32``: nothing; ``bf16``: autocast only (bf16 has fp32's range, no
  loss scaling);
* ``fp16``: autocast and a dynamic loss scale. Before the optimizer runs, the
  gradients are unscaled and checked for inf/NaN, and the skip decision is
  made by ALL ranks together (one 4-byte all-reduce, kind ``"control"``).
  This matters for optimizers that communicate inside ``step()`` on local
  gradients (SLAMB): torch's ``GradScaler`` decides per rank, so a rank whose
  local gradients overflowed would skip ``step()`` and its collectives while
  the others enter them, and the job hangs. A skipped step still closes the
  optimizer's ledger step (``ledger.end_step()``), so step counts in the
  ledger stay those of the loop.

Gradient clipping (``clip_grad``) acts on the unscaled gradients: averaged
ones under DDP, each rank's local ones under SLAMB (whose update is computed
from local moments). :func:`accumulation_context` is the ``no_sync`` of
DDP on the non-final micro-batches of an accumulated step.
"""
from __future__ import annotations

import contextlib
import math

import torch

from slamb import comm
from slamb.optim._common import check_choice, check_range

PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """Autocast, loss scaling and the rank-agreed step of one precision setting.

    The loss scale follows torch's ``GradScaler`` (x ``growth_factor`` after
    ``growth_interval`` overflow-free steps, x ``backoff_factor`` on overflow);
    it is in :meth:`state_dict`, so a resumed run continues with it.
    """

    def __init__(self, precision: str, device: torch.device, *, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000):
        check_choice("trainer.precision", precision, PRECISIONS)
        check_range("init_scale", init_scale, 0.0, lo_open=True)
        check_range("growth_factor", growth_factor, 1.0)
        check_range("backoff_factor", backoff_factor, 0.0, 1.0, lo_open=True, hi_open=True)
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"invalid growth_interval={growth_interval!r}: must be an integer >= 1")
        self.precision, self.device = precision, torch.device(device)
        self.scaling = precision == "fp16"
        self.scale = float(init_scale) if self.scaling else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.precision)
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scale if self.scaling else loss).backward()

    def found_inf(self, params) -> torch.Tensor:
        """Unscale the gradients in place; a 1-element tensor, > 0 when any of this rank's is inf/NaN."""
        found = torch.zeros(1, device=self.device)
        grads = [p.grad for p in params if p.grad is not None]
        inv = torch.full((1,), 1.0 / self.scale, device=self.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        return found

    def step(self, optimizer, params, *, clip_grad: float | None = None) -> tuple[bool, torch.Tensor | None]:
        """Unscale, agree on skipping, clip, ``optimizer.step()``; returns (skipped, gradient norm or None).

        No host sync unless loss scaling is on (the agreed decision needs one).
        """
        params = list(params)
        if self.scaling:
            # The decision precedes every collective of optimizer.step(): all ranks enter it, or none.
            if comm.agree_any(self.found_inf(params), ledger=optimizer.ledger):
                self.scale *= self.backoff_factor
                self.good_steps = 0
                self.skipped_steps += 1
                optimizer.ledger.end_step()
                return True, None
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        norm = None
        if clip_grad is not None and clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad, foreach=True)
        optimizer.step()
        return False, norm

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if not math.isfinite(state["scale"]) or state["scale"] <= 0:
            raise ValueError(f"invalid loss scale {state['scale']!r} in the checkpoint")
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def accumulation_context(model: torch.nn.Module, last_micro_batch: bool):
    """DDP's ``no_sync()`` on the non-final micro-batches (gradients accumulate locally, one
    all-reduce per optimizer step); a no-op for models DDP does not wrap (one worker)."""
    if last_micro_batch or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
