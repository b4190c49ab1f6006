"""Mixed precision and gradient accumulation for every pipeline: one optimizer step, agreed by all ranks.

:class:`MixedPrecision` wraps what a training step does around ``backward``
and ``optimizer.step()``:

* ``fp32``: nothing; ``bf16``: autocast only (bf16 has fp32's range, no
  loss scaling);
* ``fp16``: autocast and a dynamic loss scale (:class:`slamb.RankAgreedGradScaler`).
  Before the optimizer runs, the gradients are unscaled and checked for
  inf/NaN, and the skip decision is made by ALL ranks together (one 4-byte
  all-reduce, kind ``"control"``).
  This matters for optimizers that communicate inside ``step()`` on local
  gradients (SLAMB): torch's ``GradScaler`` decides per rank, so a rank whose
  local gradients overflowed would skip ``step()`` and its collectives while
  the others enter them, and the job hangs. A skipped step still closes the
  optimizer's ledger step (``ledger.end_step()``), so step counts in the
  ledger stay those of the loop.

Gradient clipping (``clip_grad``) acts on the unscaled gradients: averaged
ones under DDP, each rank's local ones under SLAMB (whose update is computed
from local moments); under FSDP/HSDP each replica's, the norm summed over its
shards (DTensor's own reduction). :func:`accumulation_context` is the ``no_sync`` of
DDP on the non-final micro-batches of an accumulated step.

An optimizer that exchanges during backward (SLAMB with ``overlap=True``)
unscales the gradients it sends in DDP's hook, before :meth:`MixedPrecision.step`
unscales them: given as ``optimizer``, it is told the loss scale
(``grad_scale``) before each backward, read to the host once per optimizer
step (after the scale's update), so its exchange is the plain path's and
nothing is sent twice.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from slamb.amp import RankAgreedGradScaler
from slamb.optim.checks import check_choice, check_count, check_range

PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_loss_scale(init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                     growth_interval: int = 2000) -> None:
    """The dynamic loss scale's settings (``loss_scale.*``)."""
    check_range("loss_scale.init_scale", init_scale, 0.0, lo_open=True)
    check_range("loss_scale.growth_factor", growth_factor, 1.0, lo_open=True)
    check_range("loss_scale.backoff_factor", backoff_factor, 0.0, 1.0, lo_open=True, hi_open=True)
    check_count("loss_scale.growth_interval", growth_interval)


def check_clip_grad(clip_grad) -> None:
    """``clip_grad``: the gradients' largest global norm, or None for no clipping (0 or less would be none
    either, unsaid)."""
    if clip_grad is not None:
        check_range("clip_grad", clip_grad, 0.0, lo_open=True)


class MixedPrecision:
    """Autocast, loss scaling and the rank-agreed step of one precision setting.

    The loss scale is :class:`slamb.RankAgreedGradScaler`'s (torch's
    ``GradScaler`` rule: x ``growth_factor`` after ``growth_interval``
    overflow-free steps, x ``backoff_factor`` on overflow, decided by all
    ranks); it is in :meth:`state_dict`, so a resumed run continues with it.
    ``optimizer``: the one this precision steps, when it exchanges during
    backward and must know the loss scale (SLAMB with ``overlap``); others ignore it.
    """

    def __init__(self, precision: str, device: torch.device, *, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 2000,
                 optimizer=None, time_steps: bool | None = None):
        check_choice("trainer.precision", precision, PRECISIONS)
        check_loss_scale(init_scale, growth_factor, backoff_factor, growth_interval)
        self.precision, self.device = precision, torch.device(device)
        self.scaling = precision == "fp16"
        self.scaler = RankAgreedGradScaler(self.device.type, init_scale=float(init_scale),
                                           growth_factor=growth_factor, backoff_factor=backoff_factor,
                                           growth_interval=growth_interval, enabled=self.scaling)
        self.dropped_steps = 0  # steps the optimizer dropped itself (nonfinite="skip"), besides the loss scale's
        # told the scale before backward: an optimizer whose DDP hook sends what backward gives (SLAMB's overlap)
        self.told = optimizer if self.scaling and getattr(optimizer, "overlap", False) else None
        self._told_scale: float | None = None  # the scale it was told; None: read it at the next backward
        # seconds in step() (the optimizer's share of the step time, logged as optimizer_time_s). On the CPU
        # the host's clock, free: every op has finished when step() returns. On CUDA a pair of timing events
        # around each step, read only when step_seconds is (the loop's logging period, after its own wait
        # for the device), so that no step waits. Other accelerators only with time_steps=True, which waits
        # for the device before and after each step.
        self.time_steps = self.device.type in ("cpu", "cuda") if time_steps is None else bool(time_steps)
        self.events = self.time_steps and self.device.type == "cuda"
        self._seconds = 0.0
        self._pending: list[tuple] = []  # the (start, end) CUDA events of the steps not yet read

    @property
    def scale(self) -> float:
        return self.scaler.get_scale()

    @property
    def step_seconds(self) -> float:
        """Seconds in :meth:`step` so far. With CUDA events the read waits for the last step's end (the
        elapsed time of an event the device has not reached is unknown): read it where the host waits anyway."""
        if self._pending:
            self._pending[-1][1].synchronize()  # one stream: the earlier events have completed too
            self._seconds += sum(start.elapsed_time(end) for start, end in self._pending) / 1000.0
            self._pending.clear()
        return self._seconds

    @property
    def skipped_steps(self) -> int:
        """Steps that changed nothing: the loss scale's overflows and the optimizer's own drops of NaN/inf
        gradients (``nonfinite="skip"``)."""
        return self.scaler.skipped_steps + self.dropped_steps

    def autocast(self):
        dtype = AUTOCAST_DTYPES.get(self.precision)
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = self.scaler.scale(loss)
        if self.told is not None and self._told_scale is None:
            self._told_scale = self.told.grad_scale = self.scale  # one host read per optimizer step
        scaled.backward()

    def step(self, optimizer, params, *, clip_grad: float | None = None) -> tuple[bool, torch.Tensor | None]:
        """Unscale, agree on skipping, clip, ``optimizer.step()``; returns (skipped, gradient norm or None).

        No host sync unless loss scaling is on (the agreed decision needs one) or ``time_steps`` waits for
        an accelerator other than CUDA.
        """
        if not self.time_steps:
            return self._step(optimizer, params, clip_grad)
        if self.events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return self._step(optimizer, params, clip_grad)
            finally:
                end.record()
                self._pending.append((start, end))
        wait = self.device.type != "cpu"
        if wait:
            torch.accelerator.synchronize()
        tic = time.perf_counter()
        try:
            return self._step(optimizer, params, clip_grad)
        finally:
            if wait:
                torch.accelerator.synchronize()
            self._seconds += time.perf_counter() - tic

    def _step(self, optimizer, params, clip_grad):
        params = list(params)
        if self.scaling:
            # the decision precedes every collective of optimizer.step(): all ranks enter it, or none
            self.scaler.unscale_(optimizer)
            if self.scaler.found_inf(optimizer):
                self.scaler.step(optimizer)  # skips, and closes the optimizer's ledger step
                self._update()
                return True, None
        norm = None
        if clip_grad is not None and clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad, foreach=True)
        # a torch optimizer the contract has not adopted drops no step of its own
        before = getattr(optimizer, "nonfinite_skips", 0)
        self.scaler.step(optimizer)
        self.dropped_steps += getattr(optimizer, "nonfinite_skips", 0) - before
        self._update()
        return False, norm

    def _update(self) -> None:
        self.scaler.update()
        self._told_scale = None  # the scale may have moved

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.scaler.state_dict().get("_growth_tracker", 0),
                "skipped_steps": self.scaler.skipped_steps, "dropped_steps": self.dropped_steps}

    def load_state_dict(self, state: dict) -> None:
        if not math.isfinite(state["scale"]) or state["scale"] <= 0:
            raise ValueError(f"invalid loss scale {state['scale']!r} in the checkpoint")
        self.dropped_steps = int(state.get("dropped_steps", 0))  # absent from checkpoints written before it was
        if self.scaling:
            self.scaler.load_state_dict({
                "scale": float(state["scale"]), "_growth_tracker": int(state["good_steps"]),
                "growth_factor": self.scaler.get_growth_factor(), "backoff_factor": self.scaler.get_backoff_factor(),
                "growth_interval": self.scaler.get_growth_interval(), "skipped_steps": int(state["skipped_steps"])})
            self._told_scale = None


def accumulation_context(model: torch.nn.Module, last_micro_batch: bool):
    """DDP's ``no_sync()`` on the non-final micro-batches (gradients accumulate locally, one
    all-reduce per optimizer step); a no-op for models DDP does not wrap (one worker), and for FSDP2 modules,
    which reduce-scatter every micro-batch: holding the whole gradients back would undo the memory sharding saves."""
    if last_micro_batch or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
