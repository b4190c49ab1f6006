"""A loss scaler whose skip decision is the same on every rank.

torch's ``GradScaler`` decides per rank whether the gradients overflowed. With
averaged gradients (DDP) every rank sees the same values and decides the same.
With an optimizer that communicates inside ``step()`` on LOCAL gradients
(SLAMB, DGC, 1-bit LAMB), one rank can overflow alone: it skips ``step()`` and
its collectives while the others enter them, and the collectives pair across
different iterations until the job hangs or dies.

:class:`RankAgreedGradScaler` is ``torch.amp.GradScaler`` with one change:
when the gradients are unscaled, the overflow flag is reduced (MAX) over the
ranks, one 4-byte all-reduce recorded as kind ``"control"`` in the
optimizer's ledger. Every rank then steps, or every rank skips and backs off
the scale; a skipped step still closes the optimizer's ledger step, so the
ledger counts the loop's steps.
"""
from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from . import comm

__all__ = ["RankAgreedGradScaler"]


class RankAgreedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same arguments and methods) with the overflow decision agreed by all ranks.

    ``process_group``: the ranks that agree (default: the whole world). With
    one rank it is ``GradScaler`` exactly. :attr:`skipped_steps` counts the
    steps skipped so far; it is in :meth:`state_dict`.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 process_group=None):
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.process_group = process_group
        self.skipped_steps = 0

    def unscale_(self, optimizer) -> None:
        if self._enabled and self._scale is None:  # gradients scaled elsewhere: by init_scale
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        super().unscale_(optimizer)
        if not self._enabled:
            return
        # this rank's flags (one per device) folded into one, then reduced over the ranks
        state, device = self._per_optimizer_states[id(optimizer)], self._scale.device
        local = sum((f.to(device) for f in state["found_inf_per_device"].values()), torch.zeros((), device=device))
        state["agreed"] = comm.agree_any(local, ledger=getattr(optimizer, "ledger", None), group=self.process_group)
        state["found_inf_per_device"] = {device: torch.full((), float(state["agreed"]), device=device)}

    def found_inf(self, optimizer) -> bool:
        """This iteration's agreed decision for ``optimizer``: True when every rank skips its step.

        Valid after :meth:`unscale_` (or :meth:`step`) and before :meth:`update`.
        """
        state = self._per_optimizer_states.get(id(optimizer))
        if not self._enabled or state is None or "agreed" not in state:
            raise RuntimeError("found_inf() needs the gradients unscaled first: call scaler.unscale_(optimizer)")
        return state["agreed"]

    def step(self, optimizer, *args, **kwargs):
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        # unscale (and agree) here even for optimizers that unscale inside step() (fused ones): the
        # decision must precede every collective of optimizer.step()
        if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)
        skip = self.found_inf(optimizer)
        out = super().step(optimizer, *args, **kwargs)
        if skip:
            self.skipped_steps += 1
            ledger = getattr(optimizer, "ledger", None)
            if ledger is not None:
                ledger.end_step()
        return out

    def state_dict(self) -> dict:
        state = super().state_dict()
        if state:
            state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
