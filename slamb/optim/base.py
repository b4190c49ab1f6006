"""The frame shared by the optimizers that keep rank-local state in flat
buffers and communicate themselves (SLAMB, DGC, 1-bit LAMB).

It owns what they have in common and nothing of their algorithms:

* the layout is fixed at the first step (the parameters that have a gradient
  then) by the subclass's ``_build(ids)``, which records ``self._layout_ids``;
* every step starts the same way: the closure, then ONE decision taken by all
  ranks together (a 4-byte all-reduce, kind ``"control"``, when the gradients
  are local): skip the step (no rank has a gradient, or one has NaN/inf),
  grow the layout (a rank has a gradient for a parameter outside it: every
  rank lays out the union, and the state of the others is kept), or step
  with the layout's gradients, a missing one read as zero. Then the step
  closes its ledger step, skipped or not;
* checkpoints carry the step, the layout, the ledger and the world they were
  saved in. State that is the rank's own may only be loaded by the same rank
  of the same world; a layout of other shapes is refused before anything loads.
  The optimizer-level entry is also kept in the first parameter group, where
  ``torch.distributed.checkpoint.state_dict`` (which keeps only ``state`` and
  ``param_groups``) carries it through.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from .. import comm
from ..contract import OPTIMIZER_HOOK, ContractDefaults, check_rank_stamp, rank_stamp
from ..ddp import check_prepared, refuse_replaced
from ..sharding import check_state_shapes, is_sharded, local
from .checks import (NONFINITE_POLICIES, check_choice, check_process_group, nonfinite_candidates, nonfinite_error,
                     nonfinite_exact)
from .flat import param_labels
from .precision import state_dtype


def eager_under_compile(step):
    """``torch.compiler.disable(step)`` that imports ``torch._dynamo`` at its first call, not at decoration.

    The step decides on the host and communicates between its kernels: under
    ``torch.compile`` it runs as written (eager), where a traced graph would
    break at every decision. ``torch.compiler.disable`` imports ``torch._dynamo``
    where it decorates: 1-3 s, most of ``import slamb``, paid by every command
    that only checks its settings. torch's own optimizers use this lazy form.
    """
    lazy = getattr(torch, "_disable_dynamo", None)  # torch's, private: the public form where it is gone
    return lazy(step) if lazy is not None else torch.compiler.disable(step)


# what a rank reports before a step; the maximum over the ranks is what every rank does
NO_GRADIENT, GRADIENTS, NEW_PARAMETERS, NONFINITE = range(4)


class LocalStateOptimizer(ContractDefaults, Optimizer):
    communication = OPTIMIZER_HOOK
    per_rank_state = True
    state_key: str = ""  # the optimizer-level entry of state_dict()
    per_rank_reason = "each worker keeps its own state"
    per_rank_alternative = "start the optimizer afresh and load only the model"

    def _setup(self, *, process_group, nonfinite: str, ledger) -> None:
        check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        check_process_group(process_group)
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
        # An entry per parameter from the start (empty until the layout holds it): DCP's state_dict helpers
        # then see an initialized optimizer and skip the zero-lr step they take on a fresh one, which here
        # would average the ranks' parameters (a SLAMB sync) and count a step.
        for p in self.param_groups[-1]["params"]:
            self.state.setdefault(p, {})
        # whether a parameter is an FSDP2 shard: a step then reads every gradient's local shard
        self._sharded = getattr(self, "_sharded", False) or any(map(is_sharded, self.param_groups[-1]["params"]))

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @property
    def steps(self) -> int:
        """Steps taken; the next is step ``steps + 1`` (SLAMB draws its mask from that number).

        A step changes the parameters, the tensors of ``self.state`` and this count; nothing else it changes
        alters what a later step computes (caches keyed by the step, the ledger's records, warnings). Those
        three are what undoing a step, or handing a replica's state to another, carries
        (:mod:`slamb.integrations.torchft`).
        """
        return self._step

    @steps.setter
    def steps(self, t: int) -> None:
        self._step = int(t)

    def fix_layout(self) -> None:
        """Fix the flat layout now, over every parameter that requires a gradient, rather than at the first step.

        Its checks that the ranks agree run over the process group as it is now (none while it has one rank).
        A fault-tolerant job fixes it before its first quorum, so that a replica joining later runs the
        same collectives as the others from its first step (:mod:`slamb.integrations.torchft`).
        """
        if self._layout_ids is None:
            self._build([i for i, p in enumerate(self._all_params()) if p.requires_grad])

    def _layout_params(self) -> list[torch.Tensor]:
        """The layout's parameters, in the order of the step's gradients."""
        everything = self._all_params()
        return [everything[i] for i in self._layout_ids]

    def _open_step(self, closure, *, agree: bool = True):
        """``(loss, gradients)``: the closure's loss (or None) and the gradients of the layout's
        parameters (zeros for a missing one), or ``(loss, None)`` when every rank skips the step.

        ``agree=False`` decides locally: for gradients that are already averaged, hence the same on
        every rank. The layout is fixed (or grown) before the step touches any state.
        """
        if self._layout_ids is None and self._sharded:
            check_prepared(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        everything = self._all_params()
        # a sharded parameter's gradient: this rank's shard (no per-tensor call otherwise: a model of hundreds
        # of tensors spends more on these lists than on a fused step's arithmetic)
        grad_of = (lambda p: local(p.grad)) if self._sharded else (lambda p: p.grad)  # of a p with a gradient
        have = [i for i, p in enumerate(everything) if p.grad is not None]
        known = set(self._layout_ids or have)
        plain = NEW_PARAMETERS if any(i not in known for i in have) else GRADIENTS if have else NO_GRADIENT
        grads = [grad_of(everything[i]) for i in have]

        def decide(bad: torch.Tensor | None) -> int:
            # made on the parameters' device (the one a backend such as NCCL communicates from) without a host
            # copy; the agreed decision is the step's one host read for the screen and the layout together
            mine = torch.full((), float(plain), device=everything[0].device)
            if bad is not None:
                mine = torch.where(bad.any(), float(NONFINITE), mine)
            if agree:
                mine = comm.agree_max(mine, ledger=self.ledger, group=self.process_group)
            return int(mine.item())

        check = self.nonfinite != "ignore" and bool(have)
        screened = self._screened(have, grads) if check else None
        bad = nonfinite_candidates(grads, screened) if check else None
        decision = decide(bad)
        if decision == NONFINITE:  # rare: tell overflowed norms of finite gradients from NaN and inf, agreed again
            bad = nonfinite_exact(grads, bad, screened) if bad is not None else None
            decision = decide(bad)
        if decision == NONFINITE and self.nonfinite == "raise":
            bad_ids = [have[i] for i in torch.nonzero(bad).flatten().tolist()] if bad is not None else []
            raise nonfinite_error(f"{type(self).__name__}: ", param_labels(self, bad_ids))
        if decision == NONFINITE:  # nonfinite="skip"
            self.nonfinite_skips += 1
        if decision in (NONFINITE, NO_GRADIENT):  # every rank skips: nothing is sent, no state changes
            if decision == NO_GRADIENT and self._layout_ids is None:
                refuse_replaced(type(self).__name__, everything)
            self.ledger.end_step()
            return loss, None
        if self._layout_ids is None:
            if not have:
                raise ValueError(f"{type(self).__name__}: this rank has no gradient at the first step while another "
                                 "rank has: the layout is fixed then, so every rank must compute gradients for the "
                                 "same parameters at the first step")
            self._build()
        elif decision == NEW_PARAMETERS:
            self._grow(have, agree=agree)
        return loss, self._gradients(screened)

    def _gradients(self, screened: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The gradients of the layout's parameters for the update (zeros for a missing one); ``screened``: what
        the non-finite screen read (:meth:`_screened`), which a fused optimizer's layout reads them from."""
        grad_of = (lambda p: local(p.grad)) if self._sharded else (lambda p: p.grad)
        return [torch.zeros_like(local(p)) if p.grad is None else grad_of(p) for p in self._layout_params()]

    def _screened(self, have: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """What the non-finite screen reads for ``grads`` (of the parameters ``have``) where not the gradients
        themselves: the same values in fewer tensors (a fused optimizer's flat buffer: one reduction, whatever
        the number of tensors), or None. On a step that fails the screen, the gradients are checked one by one."""
        return None

    def _grow(self, have: list[int], *, agree: bool) -> None:
        """Lay out the union over the ranks of the parameters with gradients; the layout's state is kept
        and the newcomers start as at a first step."""
        everything, known = self._all_params(), set(self._layout_ids)
        flags = torch.zeros(len(everything), device=everything[0].device)
        flags[have] = 1.0
        if agree:
            flags = comm.agree_max(flags, ledger=self.ledger, group=self.process_group)
        new = [i for i in torch.nonzero(flags).flatten().tolist() if i not in known]
        self._check_growth(new)
        self._build(sorted(known | set(new)))

    def _check_growth(self, new: list[int]) -> None:
        """Refuse, on every rank, parameters that cannot join the layout now."""

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
            **rank_stamp(self.process_group),
            "layout_ids": None if ids is None else list(ids),
            "layout_numels": None if ids is None else [everything[i].numel() for i in ids],
            "ledger": self.ledger.state_dict(),
            **self._extra_state(),
        }
        if sd["param_groups"]:  # the same object: pickled once
            sd["param_groups"][0][self.state_key] = sd[self.state_key]
        return sd

    def _extra_of(self, state_dict: dict) -> dict:
        """The optimizer-level entry: top-level, or in a parameter group (after a DCP round trip)."""
        extra = state_dict.get(self.state_key)
        for group in state_dict.get("param_groups", ()):
            extra = group.get(self.state_key, extra) if extra is None else extra
        if extra is None:
            raise ValueError(f"not a {type(self).__name__} state dict (no {self.state_key!r} entry): it was saved "
                             "by another optimizer")
        return extra

    def load_state_dict(self, state_dict: dict) -> None:
        name, key = type(self).__name__, self.state_key
        extra = self._extra_of(state_dict)
        if self._saved_per_rank(extra):
            check_rank_stamp(name, extra, self.process_group, reason=self.per_rank_reason,
                             alternative=self.per_rank_alternative)
        ids = extra["layout_ids"]
        if ids is not None:
            everything = self._all_params()
            if max(ids) >= len(everything) or [everything[i].numel() for i in ids] != extra["layout_numels"]:
                raise ValueError(f"{name} checkpoint was saved for a different parameter layout (shapes differ)")
            saved = [k for g in state_dict["param_groups"] for k in g["params"]]
            lost = [i for i in ids if i >= len(saved) or not state_dict["state"].get(saved[i])]
            if lost:
                raise ValueError(
                    f"{name} state dict holds no state for {', '.join(param_labels(self, lost[:4]))}"
                    f"{' ...' if len(lost) > 4 else ''} of its layout: the rank's own state was lost on the way "
                    "(torch.distributed.checkpoint keeps one copy of each entry for all ranks, and loads only "
                    "the entries of the state dict it is given): save and load it with slamb.save_optimizer and "
                    "slamb.load_optimizer")
            check_state_shapes(name, [everything[i] for i in ids], [state_dict["state"][saved[i]] for i in ids])
        self._check_extra_state(extra)
        # torch's loader would move every state tensor to its parameter's device: a second model-sized copy
        # there beside the flat buffers _build makes. It loads the groups only; the state keeps the device it
        # was read to (the CPU, by slamb.load_optimizer) and _build copies it into the flat buffers.
        super().load_state_dict({**{k: v for k, v in state_dict.items() if k not in (key, "state")}, "state": {},
                                 "param_groups": [{k: v for k, v in g.items() if k != key}
                                                  for g in state_dict["param_groups"]]})
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        for k, p in zip(saved, self._all_params()):
            if k in state_dict["state"]:
                # a state saved in bf16 or fp16 (before the state was fp32) is promoted
                self.state[p] = {name: v.to(state_dtype(p.dtype)) if torch.is_tensor(v) and v.is_floating_point()
                                 else v
                                 for name, v in state_dict["state"][k].items()}
        self._step = int(extra["step"])
        self.ledger.load_state_dict(extra["ledger"])
        self._load_extra_state(extra)
        self._layout_ids = None
        if ids is not None:
            self._build(ids)
