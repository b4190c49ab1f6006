"""SLAMB (Xu et al., ICML 2023): LAMB whose workers average only a shared
random subset of their momentum each step.

Step t of worker i, numbered as in ``docs/algorithm.md`` (the specification):

1. no gradient all-reduce: g is the local gradient;
2. local moments m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2 (v is never sent);
3. a mask M_t, identical on every worker, drawn from (seed, t): the
   ``cyclic`` (v1) or ``bernoulli`` (v2) policy of ``masks.py``, plus every
   coordinate of a tensor with ``dim() == 1`` or fewer than
   ``min_compress_numel`` elements;
4. m[M_t] = mean over workers of m[M_t]: ONE all-reduce of the packed entries;
5. the Adam direction (v1 and v2 place bias correction and eps differently);
6. the freshness r of each element: 1 where averaged now, decaying by b3 per
   step since (v1 keeps the age c and takes r = b3^c, v2 keeps r);
7. two layer-wise trust ratios (fresh / stale entries) blended by r, and a
   step size blended between lr (fresh) and lr/sqrt(n) (stale);
8. after the updates of steps 1, H+1, 2H+1, ... the parameters are averaged.

``foreach=False`` runs the per-tensor reference functions ``v1_reference`` /
``v2_reference`` (the spec written out); the default fast path does the same
math on flat buffers. Both share the mask, the exchange and the sync.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..ddp import no_comm_hook
from ._common import check_adam_group, check_choice, check_range, safe_ratio
from .base import LocalStateOptimizer
from .flat import FlatLayout, check_layouts_agree, param_labels, params_with_grad
from .masks import MASK_POLICIES, make_mask

VARIANTS = {"v1": "cyclic", "v2": "bernoulli"}
_AGE = {"v1": "staleness", "v2": "freshness"}  # the per-element state of step 6


def v1_reference(p, m, v, age, sel, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
    """Step 5-7 of v1 for one tensor; ``sel`` marks the entries averaged at step t."""
    u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p
    if p.dim() == 1:  # plain LAMB: no clamp, no blending
        p.sub_(lr * safe_ratio(p.norm(), u.norm(), 1.0) * u)
        return
    r = torch.pow(b3, age)
    phi_s = safe_ratio(p[sel].norm(), u[sel].norm(), 1.0)
    phi_l = safe_ratio(p[~sel].norm(), u[~sel].norm(), 1.0)
    trust = (r * phi_s + (1 - r) * phi_l).clamp(c_min, c_max)
    eta = r * lr + (1 - r) * lr / math.sqrt(n)
    p.sub_(trust * eta * u)


def v2_reference(p, m, v, r, *, t, lr, b1, b2, eps, wd, c_min, c_max, n):
    """Step 5-7 of v2 for one tensor; the fresh entries are those with r == 1."""
    a = (m / (v.sqrt() + eps)) * (math.sqrt(1 - b2**t) / (1 - b1**t))
    fresh, stale = r == 1, r < 1
    phi_s = safe_ratio(p[fresh].norm(), a[fresh].norm(), 1.0).clamp(c_min, c_max)
    phi_l = safe_ratio(p[stale].norm(), a[stale].norm(), 0.0).clamp(0.0, c_max)
    u = a + wd * p
    p.sub_(lr * phi_s * r * u + (lr / math.sqrt(n)) * phi_l * (1 - r) * u)


class SLAMB(LocalStateOptimizer):
    """SLAMB over torch.distributed (any backend, any device, or no process group).

    Per parameter group: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``beta3``,
    ``c_min``, ``c_max``. For the whole optimizer (they shape the collective):
    ``compress_ratio`` (k), ``sync_interval`` (H), ``min_compress_numel`` (T),
    ``variant``, ``mask``, ``comm_dtype``, ``seed``, ``process_group``.

    ``compress_ratio`` may change between steps: assign ``opt.compress_ratio``
    (the CIFAR-10 compression warm-up does so each epoch); the next step's
    mask uses it, and a cyclic mask re-cuts its permutation into int(1/k) chunks.

    Wrap the model with :func:`slamb.wrap_model` (DDP that broadcasts the
    initial parameters but keeps gradients local) or call ``backward()`` on an
    unwrapped model: gradients must NOT be all-reduced.

    The flat layout is fixed at the first step: the parameters that have a
    gradient then. A later step where one of them has no gradient treats it
    as zero, so every rank still packs the same entries.

    ``nonfinite``: what a step does when any rank's gradients hold NaN/inf,
    decided identically on every rank before any state changes: ``"raise"``
    (``FloatingPointError``), ``"skip"`` (no update, step not counted) or
    ``"ignore"`` (no check; saves one 4-byte all-reduce and a host sync).
    """

    communicates_itself = True
    state_key = "slamb"
    per_rank_reason = "each worker keeps its own moments"

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        compress_ratio: float = 0.1,
        beta3: float = 0.99,
        sync_interval: int = 100,
        c_min: float = 0.01,
        c_max: float = 1000.0,
        min_compress_numel: int = 9000,
        variant: str = "v2",
        mask: str | None = None,
        comm_dtype: torch.dtype | None = None,
        seed: int = 0,
        process_group=None,
        foreach: bool | None = None,
        nonfinite: str = "raise",
        ledger: comm.CommLedger | None = None,
    ):
        check_choice("variant", variant, VARIANTS)
        check_choice("mask", mask, (None, *MASK_POLICIES))
        if not (isinstance(sync_interval, int) and sync_interval >= 1):
            raise ValueError(f"invalid sync_interval={sync_interval!r}: must be an integer >= 1")
        if not (isinstance(min_compress_numel, int) and min_compress_numel >= 0):
            raise ValueError(f"invalid min_compress_numel={min_compress_numel!r}: must be an integer >= 0")
        if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
            raise ValueError(f"invalid comm_dtype={comm_dtype!r}: must be None or a floating torch.dtype")
        if not isinstance(seed, int):
            raise ValueError(f"invalid seed={seed!r}: must be an integer")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, beta3=beta3,
                        c_min=c_min, c_max=c_max)
        super().__init__(params, defaults)
        self._setup(process_group=process_group, nonfinite=nonfinite, ledger=ledger)
        self.variant = variant
        self.mask_policy = mask or VARIANTS[variant]
        self.compress_ratio = compress_ratio
        self.sync_interval = sync_interval
        self.min_compress_numel = min_compress_numel
        self.comm_dtype = comm_dtype
        self.seed = seed
        self.foreach = True if foreach is None else foreach
        self._layout: FlatLayout | None = None
        self._last_draw: tuple[int, float] | None = None

    # -- settings -----------------------------------------------------------------

    @property
    def compress_ratio(self) -> float:
        return self._compress_ratio

    @compress_ratio.setter
    def compress_ratio(self, k: float) -> None:
        check_range("compress_ratio", k, 0.0, 1.0, lo_open=True)
        self._compress_ratio = float(k)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_adam_group(g)
        check_range("beta3", g["beta3"], 0.0, 1.0, hi_open=True)
        check_range("c_min", g["c_min"], 0.0)
        check_range("c_max", g["c_max"], 0.0, lo_open=True)
        if g["c_min"] > g["c_max"]:
            raise ValueError(f"invalid c_min={g['c_min']} > c_max={g['c_max']}: need c_min <= c_max")

    # -- inspection ---------------------------------------------------------------

    def last_sync_mask(self) -> torch.Tensor | None:
        """Flat bool tensor (layout order) of the momentum entries averaged at the last step.

        Redrawn on demand (a mask is a function of seed, step and k), so no step keeps one alive.
        """
        return None if self._last_draw is None else self._draw_mask(*self._last_draw)

    def _draw_mask(self, step: int, compress_ratio: float) -> torch.Tensor:
        """M_t (step 3): the policy's draw plus every coordinate of the always-dense tensors."""
        mask = self._mask_fn(step, compress_ratio)
        if self._dense_views is not None:
            stale = mask.logical_not_()
            torch._foreach_zero_(self._dense_views(stale))
            mask = stale.logical_not_()
        return mask

    def ddp_comm_hook(self):
        return None, no_comm_hook

    # -- state ----------------------------------------------------------------------

    def _build(self, ids: list[int] | None = None) -> None:
        """Fix the flat layout; adopt per-parameter state already present (a loaded checkpoint)."""
        ids = params_with_grad(self) if ids is None else ids
        if not ids:
            raise ValueError("SLAMB: no parameter has a gradient: nothing to optimize")
        layout = FlatLayout.of(self, ids)
        check_layouts_agree([layout], ledger=self.ledger, group=self.process_group, who="SLAMB")
        age = _AGE[self.variant]
        self._flat = {"exp_avg": layout.adopt(self.state, "exp_avg"),
                      "exp_avg_sq": layout.adopt(self.state, "exp_avg_sq"),
                      age: layout.adopt(self.state, age, fill=0.0 if age == "staleness" else 1.0)}
        runs = []  # maximal ranges of consecutive always-averaged coordinates
        for i, p in enumerate(layout.params):
            if p.dim() == 1 or p.numel() < self.min_compress_numel:
                if runs and runs[-1][1] == layout.offsets[i]:
                    runs[-1][1] = layout.offsets[i + 1]
                else:
                    runs.append([layout.offsets[i], layout.offsets[i + 1]])
        self._dense_views = (lambda flat: [flat[a:b] for a, b in runs]) if runs else None
        self._one_dim = torch.tensor([p.dim() == 1 for p in layout.params], device=layout.device)
        self._names = param_labels(self, ids)
        self._mask_fn = make_mask(self.mask_policy, layout.numel, self.seed, layout.device)
        self._layout, self._layout_ids = layout, ids

    def _extra_state(self) -> dict:
        return {"compress_ratio": self.compress_ratio, "variant": self.variant, "mask": self.mask_policy,
                "seed": self.seed}

    def _check_extra_state(self, extra: dict) -> None:
        if (extra["variant"], extra["mask"]) != (self.variant, self.mask_policy):
            raise ValueError(
                f"SLAMB checkpoint has variant={extra['variant']!r}, mask={extra['mask']!r}; this optimizer "
                f"has variant={self.variant!r}, mask={self.mask_policy!r}: construct it with the saved ones"
            )

    def _load_extra_state(self, extra: dict) -> None:
        self.compress_ratio = extra["compress_ratio"]
        self.seed = int(extra["seed"])  # the masks are a function of it: resumed runs redraw the same ones
        self._layout, self._last_draw = None, None

    # -- the step -------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._open_step(closure)
        layout = self._layout
        grads = self._begin_step(layout.params)  # step 1: local gradients
        if grads is None:
            return loss

        self._step += 1
        t, n = self._step, comm.world_size(self.process_group)
        m, v, age = (self._flat[k] for k in ("exp_avg", "exp_avg_sq", _AGE[self.variant]))

        for gi, lo, hi in layout.groups:  # step 2
            b1, b2 = self.param_groups[gi]["betas"]
            span = layout.span(lo, hi)
            self._moments(layout.views(m[span], lo, hi), layout.views(v[span], lo, hi), grads[lo:hi], b1, b2)

        mask = self._draw_mask(t, self.compress_ratio)  # step 3
        self._average(m, mask, n)  # step 4

        for gi, lo, hi in layout.groups:  # step 6
            span = layout.span(lo, hi)
            if self.variant == "v1":
                age[span].add_(1).masked_fill_(mask[span], 0)
            else:
                age[span].mul_(self.param_groups[gi]["beta3"]).masked_fill_(mask[span], 1)

        for gi, lo, hi in layout.groups:  # steps 5 and 7
            group, span = self.param_groups[gi], layout.span(lo, hi)
            b1, b2 = group["betas"]
            hyper = dict(t=t, lr=group["lr"], b1=b1, b2=b2, eps=group["eps"], wd=group["weight_decay"],
                         c_min=group["c_min"], c_max=group["c_max"], n=n)
            if self.variant == "v1":
                hyper["b3"] = group["beta3"]
            args = (layout.params[lo:hi], m[span], v[span], age[span], mask[span])
            if self.foreach:
                (self._v1_flat if self.variant == "v1" else self._v2_flat)(lo, hi, *args, **hyper)
            else:
                for p, *views in zip(args[0], *(layout.views(x, lo, hi) for x in args[1:])):
                    if self.variant == "v1":
                        v1_reference(p, *views, **hyper)
                    else:
                        v2_reference(p, *views[:3], **hyper)

        if (t - 1) % self.sync_interval == 0:  # step 8
            self._sync_params()
        self._last_draw = (t, self.compress_ratio)
        self.ledger.end_step()
        return loss

    def _moments(self, ms, vs, grads, b1, b2) -> None:
        if self.foreach:
            torch._foreach_mul_(ms, b1)
            torch._foreach_add_(ms, grads, alpha=1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
        else:
            for m, v, g in zip(ms, vs, grads):
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)

    def _average(self, m: torch.Tensor, mask: torch.Tensor, n: int) -> None:
        """m[mask] = mean over ranks: one all-reduce, in ``comm_dtype``, no indices sent."""
        if n == 1:
            return
        packed = m[mask]
        if self.comm_dtype is not None:
            packed = packed.to(self.comm_dtype)
        comm.all_reduce_mean_(packed, kind="momentum", ledger=self.ledger, group=self.process_group)
        m.masked_scatter_(mask, packed.to(m.dtype))

    def _sync_params(self) -> None:
        params = self._layout.params
        flat = self._layout.flatten(params)
        comm.all_reduce_mean_(flat, kind="params", ledger=self.ledger, group=self.process_group)
        torch._foreach_copy_(params, self._layout.views(flat))

    def _split_norms(self, x: torch.Tensor, sel: torch.Tensor, lo: int, hi: int):
        """Per-tensor norms of the selected and of the other entries of ``x``."""
        part = torch.where(sel, x, 0.0)
        selected = self._layout.segment_norms(part, lo, hi)
        torch.sub(x, part, out=part)
        return selected, self._layout.segment_norms(part, lo, hi)

    # The flat paths turn the per-tensor factors into Python scalars (one host read per group)
    # so that the element-wise blend runs as fused multi-tensor ops with per-tensor scalars,
    # with one model-sized temporary instead of one per factor.

    def _v1_flat(self, lo, hi, params, m, v, age, sel, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
        layout = self._layout
        u = torch.div(m, 1 - b1**t)
        u.div_(torch.div(v, 1 - b2**t).sqrt_().add_(eps))
        p = layout.flatten(params)
        u.add_(p, alpha=wd)
        p_s, p_l = self._split_norms(p, sel, lo, hi)
        u_s, u_l = self._split_norms(u, sel, lo, hi)
        del p
        phi_s, phi_l = safe_ratio(p_s, u_s, 1.0), safe_ratio(p_l, u_l, 1.0)
        one_dim = self._one_dim[lo:hi]  # plain LAMB there: r == 1, so only the clamp must go
        c_lo = torch.full_like(phi_s, c_min).masked_fill_(one_dim, 0.0)
        c_hi = torch.full_like(phi_s, c_max).masked_fill_(one_dim, math.inf)
        slope, base, c_lo, c_hi = torch.stack([phi_s - phi_l, phi_l, c_lo, c_hi]).tolist()
        r = torch.pow(b3, age)
        trust = torch._foreach_mul(layout.views(r, lo, hi), slope)  # r*phi_s + (1-r)*phi_l
        torch._foreach_add_(trust, base)
        torch._foreach_clamp_min_(trust, c_lo)
        torch._foreach_clamp_max_(trust, c_hi)
        eta = r.mul_(lr - lr / math.sqrt(n)).add_(lr / math.sqrt(n))  # r*lr + (1-r)*lr/sqrt(n)
        torch._foreach_mul_(trust, layout.views(eta, lo, hi))
        torch._foreach_addcmul_(params, layout.views(u, lo, hi), trust, value=-1)

    def _v2_flat(self, lo, hi, params, m, v, r, sel, *, t, lr, b1, b2, eps, wd, c_min, c_max, n):
        layout = self._layout
        a = v.sqrt().add_(eps)
        torch.div(m, a, out=a).mul_(math.sqrt(1 - b2**t) / (1 - b1**t))
        p = layout.flatten(params)
        p_s, p_l = self._split_norms(p, sel, lo, hi)
        a_s, a_l = self._split_norms(a, sel, lo, hi)
        phi_s = safe_ratio(p_s, a_s, 1.0).clamp_(c_min, c_max)
        phi_l = safe_ratio(p_l, a_l, 0.0).clamp_(0.0, c_max)
        u = a.add_(p, alpha=wd)
        del p
        # lr*phi_s*r + lr/sqrt(n)*phi_l*(1-r) = r*slope + base
        base = phi_l * (lr / math.sqrt(n))
        slope, base = torch.stack([phi_s * lr - base, base]).tolist()
        coef = torch._foreach_mul(layout.views(r, lo, hi), slope)
        torch._foreach_add_(coef, base)
        torch._foreach_addcmul_(params, layout.views(u, lo, hi), coef, value=-1)
