"""1-bit LAMB (Li et al., 2021; DeepSpeed's ``OnebitLamb``) over torch.distributed.

Two stages, numbered by the step t = 1, 2, ... (skipped steps do not count):

* warm-up, t <= ``freeze_step``: LAMB on gradients averaged by DDP (the hook
  of :meth:`OnebitLamb.ddp_comm_hook` all-reduces them, kind ``"grads"``),
  with the trust ratio (the "LAMB coefficient") clamped to
  ``[min_coeff, max_coeff]`` (1, unclamped, when a weight or update norm is
  0, as in DeepSpeed), and an EMA of that clamped coefficient per
  tensor: ``c_freeze = coeff_beta * c_freeze + (1 - coeff_beta) * coeff``,
  starting at 0 as in DeepSpeed (not bias-corrected: after 50 steps the bias
  is 0.9**50 < 1%).
* at the end of step ``freeze_step``: v is frozen, ``v_fresh = v``, and the
  momentum scaling coefficient of each tensor is fixed,
  ``s_i = mean_j(rms(m_j)) / rms(m_i)`` with ``rms(m) = ||m|| / sqrt(numel)``
  (1 where ``rms(m_i) == 0``). The DDP hook sends nothing from then on.
* compression, t > ``freeze_step``, in DeepSpeed's order:

  1. ``m_prev = m``; ``m = b1 m + (1 - b1) g`` with the LOCAL gradient g;
  2. ``m = compressed_allreduce(m * s) / s``: the error-compensated 1-bit
     all-reduce of :mod:`slamb.compression.onebit` (sign bytes recorded as
     ``"momentum_1bit"``, scales as ``"scales"``); every rank decodes the same
     bytes, so m, and with it every parameter, stays identical on all ranks;
  3. ``g~ = (m - b1 m_prev) / (1 - b1)``; ``v_fresh = b2 v_fresh + (1 - b2) g~^2``;
  4. ``update = m / (sqrt(v) + eps) + wd * p`` with the FROZEN v;
  5. ``factor = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))`` per tensor,
     blended towards 1 by the weight-decay share as DeepSpeed does
     (``r = min(1, ||m / (sqrt(v) + eps)|| / ||update||)``,
     ``factor = r * factor + 1 - r``), clamped to ``[factor_min, factor_max]``
     and then to ``last_factor * (1 -+ factor_threshold)``;
  6. ``p -= lr * c_freeze * factor * update``.

``bias_correction``: DeepSpeed's 1-bit LAMB accepts the flag but applies no
bias correction in either stage, which is this class's default (``False``,
the DeepSpeed BERT setting). With ``True`` the warm-up is LAMB with bias
correction (m / (1 - b1^t), v / (1 - b2^t)), and in the compression stage
each moment is divided by its own bias: m by 1 - b1^t, the frozen v by
1 - b2^freeze_step (its value at the freeze), v_fresh by 1 - b2^t (it
continues v's EMA).

Other free choices, named:

* the coefficient EMA counts a step when both norms of the trust ratio are
  positive (DeepSpeed tests ``coeff != 1.0``, which also drops a coefficient
  clamped to exactly 1);
* with one worker nothing is compressed (the local momentum is the mean;
  1-bit compression would only add error), as DeepSpeed skips it at size 1;
* the momentum of all parameter groups is compressed in one call (one flat
  vector, one pair of error buffers); DeepSpeed does the same;
* DeepSpeed's ``exp_avg_mask`` (momentum entries known to stay zero) is not
  offered; ``max_grad_norm``, ``amsgrad``, ``eps_inside_sqrt`` neither (its
  1-bit LAMB ignores or rejects them too).

Checkpoints: ``state_dict()`` holds m, v, v_fresh, the frozen and last
factors, the scaling coefficients (per parameter, in ``state``), the step,
``freeze_step`` and the error-feedback buffers of this rank. By default they
are restored, so a resumed run continues bit for bit; it must then use the
same world size, and each rank loads its own state. With
``reset_error_on_load=True`` the error buffers are zeroed on load, as
DeepSpeed does; everything else is identical on all ranks (averaged
gradients, then all-reduced momentum), so such a state may be loaded with
any world size, on any rank.

``foreach=False`` runs the compression-stage update (steps 3-6) per tensor
with :func:`compression_update_reference` (DeepSpeed's loop written out); the
default path does the same math on flat buffers. The warm-up is LAMB on flat
buffers (checked against :class:`slamb.LAMB`). Neither path syncs the host.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import comm
from ..compression.onebit import ErrorFeedback, compressed_allreduce
from ..ddp import RecordingState, no_comm_hook, recording_allreduce_hook
from .checks import check_adam_group, check_count, check_range
from .base import LocalStateOptimizer, eager_under_compile
from .flat import FlatLayout, check_layouts_agree, param_labels, params_with_grad
from .lamb import lamb_foreach
from .lamb_math import safe_ratio
from .precision import working_copies, write_back_

_FLAT = {"exp_avg": 0.0, "exp_avg_sq": 0.0, "exp_avg_sq_fresh": 0.0}  # per-element state, initial value
_SCALAR = {"lamb_coeff_freeze": 0.0, "last_factor": 1.0, "scaling_coeff": 1.0}  # per-tensor state


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"invalid {name}={value!r}: must be True or False")


def compression_update_reference(p, m, m_prev, v, v_fresh, coeff_freeze, last_factor, *, lr, b1, b2, eps, wd,
                                 bc1, bc2_frozen, bc2, factor_min, factor_max, factor_threshold):
    """Steps 3-6 of the compression stage for one tensor, after the momentum exchange.

    ``coeff_freeze`` and ``last_factor`` are 0-d tensors; ``last_factor`` is updated in place.
    """
    g = (m - b1 * m_prev) / (1 - b1)
    v_fresh.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (v / bc2_frozen).sqrt() + eps
    prelim = (m / bc1) / denom
    update = prelim + wd * p
    factor = (denom / ((v_fresh / bc2).sqrt() + eps)).max()
    keep = safe_ratio(prelim.norm(), update.norm(), 1.0).clamp(max=1.0)
    factor = (factor * keep + (1 - keep)).clamp(factor_min, factor_max)
    factor = factor.clamp(last_factor * (1 - factor_threshold), last_factor * (1 + factor_threshold))
    last_factor.copy_(factor)
    p.sub_(lr * coeff_freeze * factor * update)


@dataclasses.dataclass
class StagedHookState:
    optimizer: "OnebitLamb"
    recording: RecordingState


def staged_allreduce_hook(state: StagedHookState, bucket):
    """DDP hook: the recorded averaging all-reduce in the warm-up, nothing once compressing.

    No annotations: DDP compares them to the objects ``dist.GradBucket`` and
    ``Future[Tensor]``, which postponed (string) annotations never equal."""
    if state.optimizer.compressing:
        return no_comm_hook(None, bucket)
    return recording_allreduce_hook(state.recording, bucket)


class OnebitLamb(LocalStateOptimizer):
    """1-bit LAMB. Per parameter group: ``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``max_coeff``, ``min_coeff``, ``bias_correction``. For the whole optimizer:
    ``freeze_step`` (warm-up steps), ``coeff_beta``, ``factor_max``,
    ``factor_min``, ``factor_threshold``, ``reset_error_on_load``,
    ``process_group``, ``nonfinite`` (as :class:`slamb.LAMB`; decided across
    ranks in the compression stage, where gradients are local).

    Defaults are DeepSpeed's (``eps`` 1e-8, ``max_coeff`` 10, ``min_coeff``
    0.01); its BERT configs use ``max_coeff=0.3``. Wrap the model with
    :func:`slamb.wrap_model`, which installs :meth:`ddp_comm_hook`.

    The flat layout is fixed at the first step: the parameters that have a
    gradient then; a later missing gradient counts as zero. A parameter whose
    first gradient comes later joins the layout in the warm-up; after
    ``freeze_step`` it is refused (its variance was never frozen).
    """

    state_key = "onebit"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100000, bias_correction: bool = False,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 reset_error_on_load: bool = False, foreach: bool | None = None, nonfinite: str = "raise",
                 process_group=None, ledger: comm.CommLedger | None = None):
        check_count("freeze_step", freeze_step,
                    " (the warm-up steps; the frozen v and LAMB coefficients come from them)")
        check_range("coeff_beta", coeff_beta, 0.0, 1.0, hi_open=True)
        check_range("factor_min", factor_min, 0.0, lo_open=True)
        check_range("factor_max", factor_max, factor_min)
        check_range("factor_threshold", factor_threshold, 0.0, 1.0, hi_open=True)
        _check_bool("reset_error_on_load", reset_error_on_load)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self._setup(process_group=process_group, nonfinite=nonfinite, ledger=ledger)
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.reset_error_on_load = reset_error_on_load
        self.foreach = True if foreach is None else foreach
        self._layout: FlatLayout | None = None
        self._errors: ErrorFeedback | None = None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_adam_group(g)
        check_range("min_coeff", g["min_coeff"], 0.0)
        check_range("max_coeff", g["max_coeff"], g["min_coeff"], lo_open=g["min_coeff"] == 0)
        _check_bool("bias_correction", g["bias_correction"])

    # -- stage, hook, inspection ------------------------------------------------------

    @property
    def compressing(self) -> bool:
        """True once ``freeze_step`` steps are done: momentum goes 1-bit, gradients stay local."""
        return self._step >= self.freeze_step

    def ddp_comm_hook(self):
        return StagedHookState(self, RecordingState(self.ledger, self.process_group)), staged_allreduce_hook

    def lamb_coeffs(self) -> torch.Tensor | None:
        """Per tensor (layout order): the coefficient EMA times the last factor, i.e. the LAMB
        coefficient of the last compression step (in the warm-up, the EMA so far), or None
        before the first step."""
        if self._layout is None:
            return None
        return self._scalar["lamb_coeff_freeze"] * self._scalar["last_factor"]

    # -- state ----------------------------------------------------------------------------

    def _build(self, ids: list[int] | None = None) -> None:
        """Fix the flat layout; adopt per-parameter state already present (a loaded checkpoint)."""
        ids = params_with_grad(self) if ids is None else ids
        if not ids:
            raise ValueError("OnebitLamb: no parameter has a gradient: nothing to optimize")
        layout = FlatLayout.of(self, ids)
        check_layouts_agree([layout], ledger=self.ledger, group=self.process_group, who="OnebitLamb",
                            start=layout.params if self._step == 0 else None)
        self._flat = {key: layout.adopt(self.state, key, fill) for key, fill in _FLAT.items()}
        self._scalar = {key: layout.adopt(self.state, key, fill, per_tensor=True) for key, fill in _SCALAR.items()}
        self._layout, self._layout_ids = layout, ids

    def _check_growth(self, new: list[int]) -> None:
        if self.compressing:
            raise ValueError(
                f"OnebitLamb: {', '.join(param_labels(self, new))} got a gradient for the first time after "
                f"freeze_step={self.freeze_step}, when the variance and the error buffers are frozen for the "
                "parameters of the warm-up: give it a gradient (zero will do) in the warm-up, or leave it to "
                "another optimizer")

    def _error_feedback(self) -> ErrorFeedback:
        if self._errors is None:
            layout = self._layout
            self._errors = ErrorFeedback(layout.numel, comm.world_size(self.process_group),
                                         comm.rank(self.process_group), device=layout.device,
                                         dtype=layout.state_dtype)
        return self._errors

    per_rank_reason = "its error-feedback buffers are the rank's own and chunked for that world size"
    per_rank_alternative = "construct the optimizer with reset_error_on_load=True (DeepSpeed's behaviour)"

    def _saved_per_rank(self, extra: dict) -> bool:
        # with the buffers reset, everything left is the same on every rank (averaged gradients, then
        # all-reduced momentum), so such a state may be loaded anywhere: DeepSpeed's behaviour
        return extra["error_feedback"] is not None and not self.reset_error_on_load

    def _extra_state(self) -> dict:
        return {"freeze_step": self.freeze_step,
                "error_feedback": None if self._errors is None else self._errors.state_dict()}

    def _load_extra_state(self, extra: dict) -> None:
        self.freeze_step = int(extra["freeze_step"])
        self._layout, self._errors = None, None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        errors = self._extra_of(state_dict)["error_feedback"]
        if errors is not None and not self.reset_error_on_load and self._layout is not None:
            self._error_feedback().load_state_dict(errors)

    # -- the step -------------------------------------------------------------------------

    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        compressing = self.compressing
        # warm-up gradients are averaged, hence equal on every rank: a local decision is a shared one
        loss, grads = self._open_step(closure, agree=compressing)
        if grads is None:
            return loss
        layout = self._layout
        self._step += 1
        if compressing:
            self._compression_step(layout.flatten(grads).to(layout.state_dtype))
        else:
            self._warmup_step(grads)
            if self._step == self.freeze_step:
                self._freeze()
        self.ledger.end_step()
        return loss

    def _moments_of(self, group: dict, t: int):
        b1, b2 = group["betas"]
        bc = group["bias_correction"]
        return b1, b2, (1 - b1**t if bc else 1.0), (1 - b2**t if bc else 1.0)

    def _warmup_step(self, grads: list[torch.Tensor]) -> None:
        """LAMB with the coefficient clamped to [min_coeff, max_coeff], plus the coefficient's EMA."""
        layout, t = self._layout, self._step
        m, v, cf = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._scalar["lamb_coeff_freeze"]
        for gi, lo, hi in layout.groups:
            group, span = self.param_groups[gi], layout.span(lo, hi)
            b1, b2 = group["betas"]
            params = working_copies(layout.params[lo:hi])
            coeff, counted = lamb_foreach(
                params, working_copies(grads[lo:hi]), layout.views(m[span], lo, hi), layout.views(v[span], lo, hi),
                t=t, lr=group["lr"], b1=b1, b2=b2, eps=group["eps"], wd=group["weight_decay"],
                bias_correction=group["bias_correction"], trust_clamp=(group["min_coeff"], group["max_coeff"]))
            write_back_(layout.params[lo:hi], params)
            cf[lo:hi] = torch.where(counted, torch.lerp(coeff, cf[lo:hi], self.coeff_beta), cf[lo:hi])

    def _freeze(self) -> None:
        layout = self._layout
        self._flat["exp_avg_sq_fresh"].copy_(self._flat["exp_avg_sq"])
        sizes = torch.tensor(layout.numels, dtype=layout.state_dtype, device=layout.device)
        norms = torch._foreach_norm(list(torch.split(self._flat["exp_avg"], layout.numels)))
        rms = torch.stack(norms) / sizes.sqrt()
        self._scalar["scaling_coeff"].copy_(safe_ratio(rms.mean().expand_as(rms), rms, 1.0))

    def _compression_step(self, g: torch.Tensor) -> None:
        layout, t, everything = self._layout, self._step, len(self._layout.params)
        m, v, v_fresh = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._flat["exp_avg_sq_fresh"]
        m_prev = m.clone()
        for gi, lo, hi in layout.groups:  # step 1
            b1 = self.param_groups[gi]["betas"][0]
            m[layout.span(lo, hi)].mul_(b1).add_(g[layout.span(lo, hi)], alpha=1 - b1)
        if comm.world_size(self.process_group) > 1:  # step 2
            scale = layout.expand(self._scalar["scaling_coeff"], 0, everything)
            compressed_allreduce(m.mul_(scale), self._error_feedback(), ledger=self.ledger,
                                 group=self.process_group)
            m.div_(scale)
        for gi, lo, hi in layout.groups:  # steps 3-6
            group, span = self.param_groups[gi], layout.span(lo, hi)
            b1, b2, bc1, bc2 = self._moments_of(group, t)
            hyper = dict(lr=group["lr"], b1=b1, b2=b2, eps=group["eps"], wd=group["weight_decay"], bc1=bc1,
                         bc2_frozen=self._moments_of(group, self.freeze_step)[3], bc2=bc2)
            args = (m[span], m_prev[span], v[span], v_fresh[span])
            scalars = (self._scalar["lamb_coeff_freeze"][lo:hi], self._scalar["last_factor"][lo:hi])
            if self.foreach:
                self._compression_update_flat(lo, hi, *args, *scalars, **hyper)
            else:
                params = working_copies(layout.params[lo:hi])
                for p, *views in zip(params, *(layout.views(x, lo, hi) for x in args),
                                     *(s.unbind() for s in scalars)):
                    compression_update_reference(p, *views, factor_min=self.factor_min, factor_max=self.factor_max,
                                                 factor_threshold=self.factor_threshold, **hyper)
                write_back_(layout.params[lo:hi], params)

    def _compression_update_flat(self, lo, hi, m, m_prev, v, v_fresh, coeff_freeze, last_factor, *, lr, b1, b2,
                                 eps, wd, bc1, bc2_frozen, bc2) -> None:
        layout, params = self._layout, working_copies(self._layout.params[lo:hi])
        g = m_prev.mul_(-b1).add_(m).div_(1 - b1)  # m_prev is a scratch copy: reuse its memory
        v_fresh.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = torch.div(v, bc2_frozen).sqrt_().add_(eps)
        update = torch.div(m, bc1).div_(denom)
        prelim_norm = layout.segment_norms(update, lo, hi)
        ratio = denom.div_(torch.div(v_fresh, bc2).sqrt_().add_(eps))
        factor = torch.stack(torch._foreach_norm(list(torch.split(ratio, layout.numels[lo:hi])), ord=math.inf))
        if wd != 0:
            torch._foreach_add_(layout.views(update, lo, hi), params, alpha=wd)
            keep = safe_ratio(prelim_norm, layout.segment_norms(update, lo, hi), 1.0).clamp_(max=1.0)
            factor = factor * keep + (1 - keep)
        factor = factor.clamp_(self.factor_min, self.factor_max)
        factor = torch.minimum(torch.maximum(factor, last_factor * (1 - self.factor_threshold)),
                               last_factor * (1 + self.factor_threshold))
        last_factor.copy_(factor)
        update.mul_(layout.expand(coeff_freeze * factor * lr, lo, hi))
        torch._foreach_sub_(params, layout.views(update, lo, hi))
        write_back_(layout.params[lo:hi], params)
