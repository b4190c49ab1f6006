"""The frame shared by the optimizers that keep rank-local state in flat
buffers and communicate themselves (SLAMB, DGC, 1-bit LAMB).

It owns what they have in common and nothing of their algorithms:

* the layout is fixed at the first step (the parameters that have a gradient
  then) by the subclass's ``_build(ids)``, which records ``self._layout_ids``;
* every step starts the same way (closure, layout, gradients with a missing one
  read as zero, the rank-agreed non-finite decision) and closes its ledger step;
* checkpoints carry the step, the layout, the ledger and the world they were
  saved in. State that is the rank's own may only be loaded by the same rank
  of the same world; a layout of other shapes is refused before anything loads.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from .. import comm
from ..contract import OPTIMIZER_HOOK, ContractDefaults
from ._common import NONFINITE_POLICIES, check_choice, nonfinite_skip


class LocalStateOptimizer(ContractDefaults, Optimizer):
    communication = OPTIMIZER_HOOK
    per_rank_state = True
    state_key: str = ""  # the optimizer-level entry of state_dict()
    per_rank_reason = "each worker keeps its own state"
    per_rank_alternative = "start the optimizer afresh and load only the model"

    def _setup(self, *, process_group, nonfinite: str, ledger) -> None:
        check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        self.process_group = process_group
        self.nonfinite = nonfinite
        self.ledger = ledger or comm.CommLedger()
        self._layout_ids: list[int] | None = None
        self._step = 0

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_layout_ids", None) is not None:
            raise RuntimeError(f"{type(self).__name__}'s flat layout is fixed at the first step: "
                               "add parameter groups before it")
        super().add_param_group(param_group)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _open_step(self, closure):
        """The closure's loss (or None); the layout is fixed before the step touches any state."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._layout_ids is None:
            self._build()
        return loss

    def _begin_step(self, params: list[torch.Tensor], *, agree: bool = True):
        """The step's gradients (zeros for a missing one), or None when every rank skips the step."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if nonfinite_skip(grads, self._names, self.nonfinite, ledger=self.ledger, group=self.process_group,
                          where=f"{type(self).__name__}: ", agree=agree):
            self.ledger.end_step()
            return None
        return grads

    # -- checkpoints ----------------------------------------------------------------------

    def _extra_state(self) -> dict:
        """Optimizer-level state of the subclass, saved beside the common entries."""
        return {}

    def _check_extra_state(self, extra: dict) -> None:
        """Refuse, before anything is loaded, a state this optimizer cannot continue."""

    def _load_extra_state(self, extra: dict) -> None:
        """Adopt the subclass's optimizer-level state (before the layout is rebuilt)."""

    def _saved_per_rank(self, extra: dict) -> bool:
        return True

    def state_dict(self) -> dict:
        sd = super().state_dict()
        ids = self._layout_ids
        everything = self._all_params()
        sd[self.state_key] = {
            "step": self._step,
            "world_size": comm.world_size(self.process_group),
            "rank": comm.rank(self.process_group),
            "layout_ids": None if ids is None else list(ids),
            "layout_numels": None if ids is None else [everything[i].numel() for i in ids],
            "ledger": self.ledger.state_dict(),
            **self._extra_state(),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        name, key = type(self).__name__, self.state_key
        extra = state_dict.get(key)
        if extra is None:
            raise ValueError(f"not a {name} state dict (no {key!r} entry): it was saved by another optimizer")
        n, r = comm.world_size(self.process_group), comm.rank(self.process_group)
        if self._saved_per_rank(extra) and (extra["world_size"], extra["rank"]) != (n, r):
            raise ValueError(
                f"{name} checkpoint saved by rank {extra['rank']} of world size {extra['world_size']}, loaded on "
                f"rank {r} of world size {n}: {self.per_rank_reason}, which cannot be redistributed. Resume with "
                f"{extra['world_size']} workers, each rank loading the state it saved (save one optimizer state "
                f"per rank), or {self.per_rank_alternative}."
            )
        ids = extra["layout_ids"]
        if ids is not None:
            everything = self._all_params()
            if max(ids) >= len(everything) or [everything[i].numel() for i in ids] != extra["layout_numels"]:
                raise ValueError(f"{name} checkpoint was saved for a different parameter layout (shapes differ)")
        self._check_extra_state(extra)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != key})
        self._step = int(extra["step"])
        self.ledger.load_state_dict(extra["ledger"])
        self._load_extra_state(extra)
        self._layout_ids = None
        if ids is not None:
            self._build(ids)
