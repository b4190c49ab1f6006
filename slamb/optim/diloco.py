"""DiLoCo (Douillard et al., 2023): local training with an outer Nesterov step
on the averaged parameter change every H steps.

Each rank runs its inner optimizer (AdamW in the paper; LAMB, or plain SGD)
on its local gradients, sending nothing. After every ``sync_interval`` (H)
inner steps, the outer step:

1. the ranks' parameters are averaged: one all-reduce (kind ``"params"``);
2. the outer gradient is ``delta = anchor - average``, where the anchor is the
   parameters at the last outer step (the initial ones before the first);
3. outer SGD with Nesterov momentum mu and rate ``outer_lr``, as
   ``torch.optim.SGD(nesterov=True)``: ``b = mu b + delta``,
   ``anchor -= outer_lr (delta + mu b)`` (``mu = 0``: plain SGD);
4. every rank's parameters become the new anchor.

With ``inner="sgd"``, H = 1, ``outer_lr = 1`` and ``outer_momentum = 0``
this is data-parallel SGD: the average of the ranks' SGD steps from the same
parameters is the SGD step on the averaged gradient.

Choices, each named:

* The anchor is taken at the first ``step()``, not at construction: the
  parameters DDP broadcast from rank 0 when :func:`slamb.wrap_model` wrapped
  the model. Without DDP the ranks may start apart; the first outer step
  brings them together.
* The inner optimizer shares this optimizer's ``param_groups`` and ``state``,
  so learning-rate schedules act on the inner rate (``lr``, the paper's inner
  learning rate) and the outer rate stays fixed, as in the paper.
* The inner state (Adam moments) stays local and is never averaged, as in
  the paper.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

from .. import comm
from ..averaging import average_tensors_
from ..contract import OPTIMIZER_HOOK, ContractDefaults, check_rank_stamp, rank_stamp
from ..ddp import no_comm_hook
from .checks import check_betas, check_choice, check_count, check_process_group, check_range
from .lamb import LAMB
from .precision import state_dtype, working_copies

INNER = ("adamw", "lamb", "sgd")
_KEY = "diloco"


class DiLoCo(ContractDefaults, Optimizer):
    """DiLoCo over torch.distributed (any backend, any device, or no process group).

    Inner (per parameter group): ``lr``, ``weight_decay``; ``betas`` and ``eps``
    for ``inner="adamw"`` or ``"lamb"``. Outer: ``outer_lr``,
    ``outer_momentum`` (Nesterov), ``sync_interval`` (H). The paper's
    settings: AdamW, lr 4e-4, weight decay 0.1, H = 500, outer_lr 0.7,
    outer_momentum 0.9.

    The ranks' parameters differ between outer steps: the model of the run is
    their average, :meth:`average_parameters` (or :func:`slamb.average_model`).
    State is per rank (its inner moments): save and load one per rank.
    """

    communication = OPTIMIZER_HOOK
    params_differ = True
    per_rank_state = True

    def __init__(
        self,
        params,
        lr: float = 4e-4,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        sync_interval: int = 500,
        inner: str = "adamw",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        process_group=None,
        ledger: comm.CommLedger | None = None,
    ):
        check_choice("inner", inner, INNER)
        check_range("lr", lr, 0.0, lo_open=True)
        check_range("outer_lr", outer_lr, 0.0, lo_open=True)
        check_range("outer_momentum", outer_momentum, 0.0, 1.0, hi_open=True)
        check_range("weight_decay", weight_decay, 0.0)
        check_betas(betas)
        check_count("sync_interval", sync_interval)
        if inner == "adamw":
            self.inner = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        elif inner == "lamb":
            self.inner = LAMB(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        else:
            self.inner = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
        # the inner optimizer's group dicts and state are this optimizer's: a scheduler's lr is the inner lr
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.state = self.inner.state
        self.inner_name = inner
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.sync_interval = sync_interval
        check_process_group(process_group)
        self.process_group = process_group
        self.ledger = ledger or comm.CommLedger()
        self._step = 0
        self._anchor: list[torch.Tensor] | None = None
        self._momentum: list[torch.Tensor] | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def ddp_comm_hook(self):
        return None, no_comm_hook

    @torch.no_grad()
    def step(self, closure=None):
        if self._anchor is None:
            self._anchor = [p.detach().clone() for p in self._params()]
        loss = self.inner.step(closure)
        self._step += 1
        if self._step % self.sync_interval == 0:
            self._outer_step()
        self.ledger.end_step()
        return loss

    def _outer_step(self) -> None:
        params, anchor = self._params(), self._anchor
        average_tensors_(params, process_group=self.process_group, ledger=self.ledger, kind="params")
        # the outer gradient and momentum in fp32 under bf16 or fp16 parameters; the anchor rounded once
        delta = torch._foreach_sub(working_copies(anchor), working_copies(params))
        mu = self.outer_momentum
        if mu > 0:
            if self._momentum is None:
                self._momentum = [d.clone() for d in delta]  # torch's SGD: the first buffer is the gradient
            else:
                torch._foreach_mul_(self._momentum, mu)
                torch._foreach_add_(self._momentum, delta)
            torch._foreach_add_(delta, self._momentum, alpha=mu)  # Nesterov
        torch._foreach_add_(anchor, delta, alpha=-self.outer_lr)
        torch._foreach_copy_(params, anchor)

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Every rank ends with the ranks' average of the parameters (one flat all-reduce, kind ``"params"``).

        Collective. For the model of the run (evaluation, export) between outer
        steps; the anchor, the outer momentum and the inner state are kept.
        """
        average_tensors_(self._params(), process_group=self.process_group, ledger=self.ledger, kind="params")

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        sd = self.inner.state_dict()
        sd[_KEY] = {
            **rank_stamp(self.process_group),
            "inner": self.inner_name,
            "step": self._step,
            "anchor": self._anchor,
            "momentum": self._momentum,
            "ledger": self.ledger.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get(_KEY)
        if saved is None:
            raise ValueError(f"not a DiLoCo state dict (no {_KEY!r} entry): it was saved by another optimizer")
        if saved["inner"] != self.inner_name:
            raise ValueError(f"DiLoCo checkpoint has inner={saved['inner']!r}, this optimizer inner="
                             f"{self.inner_name!r}: resume with inner={saved['inner']!r}")
        check_rank_stamp("DiLoCo", saved, self.process_group, reason="each worker keeps its own inner state")
        params = self._params()
        anchor = saved["anchor"]
        if anchor is not None and [a.shape for a in anchor] != [p.shape for p in params]:
            raise ValueError("DiLoCo checkpoint was saved for a different model (parameter shapes differ)")
        self.inner.load_state_dict({k: v for k, v in state_dict.items() if k != _KEY})
        self.param_groups, self.state = self.inner.param_groups, self.inner.state  # load made new ones

        def own(tensors, state=False):  # copies on the parameters' devices: the outer step updates them in place
            return None if tensors is None else [t.to(p.device, state_dtype(p.dtype) if state else p.dtype, copy=True)
                                                 for t, p in zip(tensors, params)]

        self._step = int(saved["step"])
        self._anchor, self._momentum = own(anchor), own(saved["momentum"], state=True)
        self.ledger.load_state_dict(saved["ledger"])
