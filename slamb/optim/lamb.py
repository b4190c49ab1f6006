"""LAMB (You et al., ICLR 2020) on gradients the caller has averaged (DDP).

u = m_hat / (sqrt(v_hat) + eps) + wd * p, trust = ||p|| / ||u|| optionally
clamped, p -= lr * trust * u. When a norm is 0 (a zero-initialised bias at
step 1) trust is 1 and the clamp does not apply, as in DeepSpeed's LAMB
kernels and 1-bit LAMB and apex's FusedLAMB. DeepSpeed's BERT baseline is
``bias_correction=False, trust_clamp=(0.01, 0.3)``; NVIDIA's recipe puts
biases and LayerNorm in a group with ``weight_decay=0``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch.optim import Optimizer

from .. import comm
from ..contract import ContractDefaults
from ..ddp import check_prepared, refuse_replaced
from ..sharding import check_state_shapes, local, reduce_squares, sharded_topology, sum_squares_
from ..topology import MeshTopology
from . import fused as fused_passes
from .checks import (NONFINITE_POLICIES, check_adam_group, check_choice, check_fused, check_process_group,
                     check_sharded, nonfinite_skip)
from .flat import FlatLayout
from .lamb_math import adam_moments_, bias_folding, safe_ratio
from .precision import promote_state_, state_dtype, working_copies, write_back_


def trust_ratio(p_norm: torch.Tensor, u_norm: torch.Tensor, trust_clamp) -> torch.Tensor:
    """``||p|| / ||u||`` clamped to ``trust_clamp`` where both norms are positive, an unclamped 1 elsewhere."""
    trust = safe_ratio(p_norm, u_norm, 1.0)
    if trust_clamp is None:
        return trust
    return torch.where((p_norm > 0) & (u_norm > 0), trust.clamp(*trust_clamp), trust)


def lamb_reference(p, g, m, v, *, t, lr, b1, b2, eps, wd, bias_correction, trust_clamp):
    """One tensor's step. Returns the trust ratio applied and whether both of its norms were positive."""
    adam_moments_([m], [v], [g], b1, b2, foreach=False)
    bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
    u = (m / bc1) / ((v / bc2).sqrt() + eps) + wd * p
    p_norm, u_norm = p.norm(), u.norm()
    trust = trust_ratio(p_norm, u_norm, trust_clamp)
    p.sub_(lr * trust * u)
    return trust, (p_norm > 0) & (u_norm > 0)


def lamb_foreach(params, grads, ms, vs, *, t, lr, b1, b2, eps, wd, bias_correction, trust_clamp):
    """The step of a list of tensors; returns :func:`lamb_reference`'s figures, one per tensor."""
    u, c = lamb_direction(params, grads, ms, vs, t=t, b1=b1, b2=b2, eps=eps, wd=wd, bias_correction=bias_correction)
    return lamb_apply_(params, u, c, lamb_norms(params, u, c), lr=lr, trust_clamp=trust_clamp)


def lamb_direction(params, grads, ms, vs, *, t, b1, b2, eps, wd, bias_correction):
    """The moments updated, and (u / c, c): the update divided by the folded bias correction."""
    adam_moments_(ms, vs, grads, b1, b2, foreach=True)
    c, eps = bias_folding(t, b1, b2, eps) if bias_correction else (1.0, eps)
    u = torch._foreach_sqrt(vs)
    torch._foreach_add_(u, eps)
    torch._foreach_div_(u, ms)
    torch._foreach_reciprocal_(u)  # u = m / (sqrt(v) + eps) = u_hat / c: no second model-sized temporary
    if wd != 0:
        torch._foreach_add_(u, params, alpha=wd / c)
    return u, c


def lamb_norms(params, u, c) -> torch.Tensor:
    """(||p||, ||u_hat||) per tensor, a (2, tensors) tensor."""
    return torch.stack([torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(u)) * c])


def lamb_apply_(params, u, c, norms, *, lr, trust_clamp):
    """p -= lr * trust * u_hat, the trust ratios from ``norms`` (:func:`lamb_norms`, or a whole tensor's)."""
    p_norm, u_norm = norms
    trust = trust_ratio(p_norm, u_norm, trust_clamp)
    torch._foreach_mul_(u, list((trust * (-lr * c)).unbind()))
    torch._foreach_add_(params, u)
    return trust, (p_norm > 0) & (u_norm > 0)


@dataclasses.dataclass(frozen=True)
class LambHyper:
    """A parameter group's settings, as its step reads them."""

    lr: float
    b1: float
    b2: float
    eps: float
    wd: float
    bias_correction: bool
    trust_clamp: tuple[float, float] | None

    @classmethod
    def of(cls, group: dict) -> LambHyper:
        b1, b2 = group["betas"]
        return cls(group["lr"], b1, b2, group["eps"], group["weight_decay"], group["bias_correction"],
                   group["trust_clamp"])


def lamb(params, grads, exp_avgs, exp_avg_sqs, state_steps, hypers, *, foreach: bool, fused: Prepared | None = None,
         shards: MeshTopology | None = None, ledger: comm.CommLedger | None = None) -> bool:
    """LAMB's step in ``torch.optim.adam.adam``'s shape: per parameter group, lists of its local tensors
    (parameters, gradients, moments, step counters) and its :class:`LambHyper`.

    ``fused`` (the flat buffers :meth:`FusedBuckets.prepare` gathered these tensors into) runs the compiled
    passes, else ``foreach`` the multi-tensor path, else the per-tensor reference. Under FSDP2 (``shards``) a
    trust ratio is the whole tensor's: each shard's sums of squares summed over the shard group in one
    all-reduce, recorded in ``ledger``. Returns False where the fused passes failed to compile before any tensor
    changed (the caller then runs the multi-tensor path)."""
    if fused is not None:
        impl = _fused_lamb
    elif foreach:
        impl = _multi_tensor_lamb
    else:
        impl = _single_tensor_lamb
    return impl(params, grads, exp_avgs, exp_avg_sqs, state_steps, hypers, fused=fused, shards=shards, ledger=ledger)


def _advance(state_steps) -> int:
    """The group's step counters advanced; the step number they now hold (the same in every tensor)."""
    for s in state_steps:
        s += 1
    return int(state_steps[0])


def _single_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, state_steps, hypers, *, fused, shards, ledger) -> bool:
    for ps, gs, ms, vs, steps, h in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, hypers):
        t = _advance(steps)
        work, gs = working_copies(ps), working_copies(gs)
        for p, g, m, v in zip(work, gs, ms, vs):
            lamb_reference(p, g, m, v, t=t, lr=h.lr, b1=h.b1, b2=h.b2, eps=h.eps, wd=h.wd,
                           bias_correction=h.bias_correction, trust_clamp=h.trust_clamp)
        write_back_(ps, work)
    return True


def _multi_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, state_steps, hypers, *, fused, shards, ledger) -> bool:
    staged = []
    for ps, gs, ms, vs, steps, h in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, hypers):
        t = _advance(steps)
        work, gs = working_copies(ps), working_copies(gs)
        u, c = lamb_direction(work, gs, ms, vs, t=t, b1=h.b1, b2=h.b2, eps=h.eps, wd=h.wd,
                              bias_correction=h.bias_correction)
        staged.append((ps, work, u, c, lamb_norms(work, u, c), h))
    # every group's trust ratios at once: a sharded tensor's norms are summed over its shards in one collective
    whole = reduce_squares([norms for *_, norms, _ in staged], shards, ledger)
    for (ps, work, u, c, _, h), norms in zip(staged, whole):
        lamb_apply_(work, u, c, norms, lr=h.lr, trust_clamp=h.trust_clamp)
        write_back_(ps, work)
    return True


def _fused_lamb(params, grads, exp_avgs, exp_avg_sqs, state_steps, hypers, *, fused, shards, ledger) -> bool:
    """The tensors' step as the two compiled passes of :mod:`slamb.optim.fused` per flat bucket of ``fused``
    (whose buffers the tensors are views of)."""
    fused.passes.begin_step()
    for flat, state, steps in fused.buckets:
        try:
            _fused_bucket(fused.passes, flat, state, steps, hypers, shards, ledger)
        except fused_passes.CompileFailed:
            return False
    return True


def _fused_bucket(passes, flat, state, steps, hypers, shards, ledger) -> None:
    layout = flat.layout
    rows = []
    for gi, lo, _ in layout.groups:
        h = hypers[gi]
        t = int(steps[lo]) + 1
        c, eps = bias_folding(t, h.b1, h.b2, h.eps) if h.bias_correction else (1.0, h.eps)
        lo_, hi_ = h.trust_clamp or (0.0, math.inf)
        rows.append([1 - h.b1, h.b2, 1 - h.b2, c, eps, h.wd, h.lr, lo_, hi_])
    index = passes.index([r for r, (_, lo, hi) in enumerate(layout.groups) for _ in range(lo, hi)], layout.device)
    cols = fused_passes.table(rows, index, layout.device).unbind(1)
    zeros = torch.zeros_like(cols[0])
    moment_table = torch.stack([*cols[:6], zeros, zeros], 1)  # no age: the dense and written columns unread
    p = flat.view(flat.params())
    g = flat.view(flat.grad)  # gathered by prepare()
    m, v = flat.view(state["exp_avg"]), flat.view(state["exp_avg_sq"])
    sums = flat.sums(passes(fused_passes.moments_pass, p, g, m, v, None, flat.per_block(moment_table)))
    sums = sum_squares_(sums, shards, ledger)  # a shard's sums: the whole tensors' (one collective)
    steps.add_(1)
    p_norm, u_norm = sums.clamp_min(0).sqrt().unbind(1)
    trust = trust_ratio(p_norm, u_norm, (cols[7], cols[8]))  # per-tensor bounds
    inf = torch.full_like(trust, math.inf)
    table = torch.stack([cols[3], cols[4], cols[5], zeros, trust, zeros, -inf, inf, cols[6], zeros], 1)
    passes(fused_passes.update_pass, p, m, v, None, flat.per_block(table))
    flat.store()


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The flat buckets of one fused step, their gradients gathered: ``(FlatStep, moments, step counters)``."""

    passes: fused_passes.Passes
    buckets: list

    def screened(self) -> list[torch.Tensor]:
        """The flat gradient buffers, which the non-finite screen reads."""
        return [flat.grad for flat, _, _ in self.buckets]


class FusedBuckets:
    """``LAMB(fused=True)``'s flat buffers: per (device, dtype), the parameters with gradients, adopted into an
    aligned layout (:class:`slamb.optim.fused.FlatStep`), their moments and step counters, whose per-parameter
    views are the state (``state_dict()`` unchanged). Rebuilt, the state carried over, when the parameters
    with gradients change or a state is loaded."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.passes = fused_passes.Passes("LAMB")
        self.buckets: dict = {}

    def reset(self) -> None:
        self.buckets = {}

    def _bucket(self, members):
        opt = self.optimizer
        layout = FlatLayout([p for _, p in members], [gi for gi, _ in members], align=fused_passes.BLOCK)
        flat = fused_passes.FlatStep(layout)
        state = {key: layout.adopt(opt.state, key) for key in ("exp_avg", "exp_avg_sq")}
        # the counters on the host, as torch keeps them: one add per step, t read without a device sync
        steps = layout.adopt(opt.state, "step", per_tensor=True, dtype=torch.float32, device="cpu")
        return tuple(id(p) for _, p in members), flat, state, steps

    def prepare(self, work) -> Prepared | None:
        """The buckets of ``work`` (per parameter group with gradients: the group and those parameters; a
        bucket's layout numbers the groups as ``work`` lists them), their gradients gathered into the flat
        buffers, or None where ``torch.compile`` has failed: the caller runs the multi-tensor path."""
        if self.passes.failed is not None:
            return None
        members: dict = {}
        for gi, (_, params) in enumerate(work):
            for p in params:
                members.setdefault((p.device, p.dtype), []).append((gi, p))
        buckets = []
        for key, ps in members.items():
            bucket = self.buckets.get(key)
            if bucket is None or bucket[0] != tuple(id(p) for _, p in ps):
                bucket = self.buckets[key] = self._bucket(ps)
            bucket[1].grads([local(p.grad) for _, p in ps])
            buckets.append(bucket[1:])
        return Prepared(self.passes, buckets)


class LAMB(ContractDefaults, Optimizer):
    """Data-parallel LAMB. Per group: ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``bias_correction``, ``trust_clamp`` (``None`` or ``(min, max)``).

    Gradients must already be averaged (use :func:`slamb.wrap_model`, whose DDP
    hook records the gradient bytes in ``self.ledger``). ``nonfinite`` as in
    :class:`slamb.SLAMB`; averaged gradients are the same on every rank, so
    the decision is too. The moments are fp32 under bf16 and fp16 parameters, which are updated in fp32
    and rounded once (:mod:`slamb.optim.precision`). ``fused=True`` runs the step as two compiled passes
    over flat buffers (:mod:`slamb.optim.fused`, ``torch.compile``; a constant number of kernels whatever
    the number of tensors): the same numbers to rounding, no scratch kept between steps. It adopts the
    parameters with gradients into one flat buffer per device and dtype (each ``p.data`` becomes a view of
    it, adopted again at a step where it is not; FSDP2's shards are copied in and back at each step
    instead) and points their ``p.grad`` at views of a flat gradient buffer
    (:class:`slamb.optim.fused.FlatStep`); it warns once and runs the multi-tensor path where
    ``torch.compile`` fails, and :attr:`fused_fallback` says why.

    FSDP2's sharded parameters (DTensors of ``fully_shard`` on a 1-D or an HSDP mesh; the multi-tensor and
    fused paths): the moments are sharded as the parameters, the step runs on the local shards, and the trust
    ratios are the whole tensors', each shard's sums of squares summed over the shard group in one all-reduce
    per step (kind ``"norms"``, :mod:`slamb.sharding`); FSDP averages the gradients.
    """

    takes_sharded = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = True, trust_clamp=None,
                 foreach: bool | None = None, nonfinite: str = "raise", process_group=None,
                 ledger: comm.CommLedger | None = None, fused: bool = False):
        check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        check_fused(fused, foreach)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clamp=trust_clamp)
        super().__init__(params, defaults)
        self.foreach = True if foreach is None else foreach
        self.fused = fused
        self._fused = FusedBuckets(self)  # the flat buffers and compiled graphs of fused=True
        self.nonfinite = nonfinite
        check_process_group(process_group)
        self.process_group = process_group
        self.ledger = ledger or comm.CommLedger()
        self.shards = sharded_topology([p for g in self.param_groups for p in g["params"]], process_group)
        if self.shards is not None:
            check_sharded("LAMB", {"foreach=False": foreach is False}, "foreach=None")

    @property
    def fused_fallback(self) -> str | None:
        """Why ``torch.compile`` failed, where ``fused=True`` then runs the multi-tensor path (the same numbers,
        more kernels), or None. What times or checks the fused step asserts it is None."""
        return self._fused.passes.failed

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_adam_group(g)
        clamp = g["trust_clamp"]
        if clamp is not None:
            clamp = tuple(clamp)
            if len(clamp) != 2 or not 0 <= clamp[0] <= clamp[1]:
                raise ValueError(f"invalid trust_clamp={clamp!r}: must be None or (min, max) with 0 <= min <= max")
            g["trust_clamp"] = clamp

    def load_state_dict(self, state_dict: dict) -> None:
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        check_state_shapes("LAMB", [p for g in self.param_groups for p in g["params"]],
                           [state_dict["state"].get(k) for k in saved])
        super().load_state_dict(state_dict)
        promote_state_(self)  # torch's loader casts the moments to the parameters' dtype
        self._fused.reset()  # the fused buffers adopt the loaded state at the next step

    @torch.no_grad()
    def step(self, closure=None):
        if self.shards is not None:
            check_prepared(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        work = [(g, params) for g, params in work if params]
        if not work:
            refuse_replaced("LAMB", [p for g in self.param_groups for p in g["params"]])
        grads = [local(p.grad) for _, params in work for p in params]
        names = [f"{tuple(p.shape)}" for _, params in work for p in params]
        # averaged gradients are the same on every rank, but each rank of a shard group holds another shard
        sharded = self.shards is not None
        prepared = self._fused.prepare(work) if self.fused else None
        if nonfinite_skip(grads, names, self.nonfinite, ledger=self.ledger if sharded else None, group=self.shards,
                          where="LAMB: ", agree=sharded, screened=None if prepared is None else prepared.screened()):
            self.nonfinite_skips += 1
            self.ledger.end_step()
            return loss
        for _, params in work:
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p.dtype))
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p.dtype))
        states = [[self.state[p] for p in params] for _, params in work]
        tensors = ([[local(p) for p in params] for _, params in work],
                   [[local(p.grad) for p in params] for _, params in work],
                   [[local(s["exp_avg"]) for s in group] for group in states],
                   [[local(s["exp_avg_sq"]) for s in group] for group in states],
                   [[s["step"] for s in group] for group in states],
                   [LambHyper.of(group) for group, _ in work])
        if not lamb(*tensors, foreach=self.foreach, fused=prepared, shards=self.shards, ledger=self.ledger):
            lamb(*tensors, foreach=True, shards=self.shards, ledger=self.ledger)  # torch.compile failed: unchanged
        self.ledger.end_step()
        return loss
