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
   step since (the state is the age c, an int16 counter; r = b3^c);
7. two layer-wise trust ratios (fresh / stale entries) blended by r, and a
   step size blended between lr (fresh) and lr/sqrt(n) (stale);
8. after the updates of steps 1, H+1, 2H+1, ... the parameters are averaged.

Steps 2 and 4-7 have implementations with one signature, as torch's Adam has:
``_single_tensor_slamb`` (the reference: ``v1_reference`` / ``v2_reference``
per tensor, the spec written out), ``_multi_tensor_slamb`` (steps 5-7
rewritten into per-tensor scalars and multi-tensor ops over flat buffers, as
derived below) and ``_fused_slamb`` (two passes compiled by ``torch.compile``,
``fused.py``), chosen by :func:`slamb_update_`, which ``SLAMB.step()`` calls
with a callback that ends step 4. The optimizer keeps the state, the layout,
the mask, the exchange (``overlap.py``) and the parameter sync.

How the multi-tensor path rewrites steps 5-7
--------------------------------------------
Per tensor, with S the entries selected at step t and L the others:

* Bias folding (``_common.bias_folding``). With c = sqrt(1-b2^t) / (1-b1^t)
  and eps' = eps sqrt(1-b2^t),
  m_hat / (sqrt(v_hat) + eps) = c m / (sqrt(v) + eps'):
  no pass over the moments divides them. v1 uses this; v2's direction is
  a = c m / (sqrt(v) + eps) with eps unscaled. The scratch buffer holds the
  direction divided by c, d = u / c = m / (sqrt(v) + eps') + (wd / c) p,
  and every norm of u is c times that of d.
* Split norms. |x[L]| = sqrt(|x|^2 - |x[S]|^2) (clamped at 0 against
  rounding): a gather of the k N selected entries and one norm of the whole
  tensor, instead of a masked pass over each part. An always-averaged
  tensor has no L.
* v1: trust(r) = clamp(r phi_s + (1 - r) phi_l, c_min, c_max) = A + B r with
  A = phi_l, B = phi_s - phi_l; an always-averaged tensor has r = 1:
  A = clamp(phi_s) (unclamped for a 1-D one: plain LAMB), B = 0. A blend
  of two ratios inside [c_min, c_max] stays inside, so only a tensor with a
  ratio outside needs the element-wise clamp (rare, done per tensor).
  The step size is eta(r) = r lr + (1 - r) lr / sqrt(n) = e0 + e1 r with
  e0 = lr / sqrt(n), e1 = lr - e0, so
  p -= trust(r) eta(r) u = (c e0) (A + B r) (1 + (e1 / e0) r) d:
  d *= 1 + (e1 / e0) r in place (one pass, r = b3^age in a second scratch),
  then p += (-c e0 B) r d + (-c e0 A) d.
* v2: p -= lr phi_s r u + (lr / sqrt(n)) phi_l (1 - r) u = (slope r + base) u
  with base = (lr / sqrt(n)) phi_l and slope = lr phi_s - base; with u = c d
  both scale by -c: p += (-c slope) r d + (-c base) d.

Every factor above is a scalar per tensor: the element-wise work is a few
multi-tensor ops over the parameters and the scratch. Those scalars of all
parameter groups are read to the host at once (the multi-tensor ops take
them as numbers).
"""
from __future__ import annotations

import math
import warnings

import torch

from .. import comm
from ..averaging import average_tensors_
from ..schedules import check_compression_warmup, compression_ratio
from ..topology import HIERARCHIES, node_topology
from ..ddp import no_comm_hook
from ._common import (adam_direction_, adam_moments_, bias_folding, check_adam_group, check_choice, check_range,
                      safe_ratio)
from . import fused as fused_passes
from .base import LocalStateOptimizer
from .flat import FlatLayout, check_layouts_agree, params_with_grad
from .masks import MASK_POLICIES, Selection, make_mask
from .overlap import OverlapState, discard, grads_changed, launch, overlap_hook

VARIANTS = {"v1": "cyclic", "v2": "bernoulli"}
# the per-element state of step 6: steps since the last average, in int16 (half a word); exact up to this
# age, where b3^age is 0 in fp32 for b3 <= 0.997 (the fused path keeps it in fp16: fused.MAX_AGE)
_MAX_AGE = 2**15 - 1
# first steps at which identical momenta on every rank show gradients averaged before SLAMB saw them
_ALIKE_STEPS = 3


def _norms(x, sel):
    """The norms of ``x[sel]`` and ``x[~sel]``."""
    sq = x * x
    return torch.where(sel, sq, 0).sum().sqrt(), torch.where(sel, 0, sq).sum().sqrt()


def v1_reference(p, m, v, age, sel, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
    """Steps 5-7 of v1 for one tensor; ``sel`` marks the entries averaged at step t."""
    u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p
    if p.dim() == 1:  # plain LAMB: no clamp, no blending
        p.sub_(lr * safe_ratio(p.norm(), u.norm(), 1.0) * u)
        return
    r = torch.pow(b3, age.to(p.dtype))
    (p_s, p_l), (u_s, u_l) = _norms(p, sel), _norms(u, sel)
    phi_s, phi_l = safe_ratio(p_s, u_s, 1.0), safe_ratio(p_l, u_l, 1.0)
    trust = (r * phi_s + (1 - r) * phi_l).clamp(c_min, c_max)
    eta = r * lr + (1 - r) * lr / math.sqrt(n)
    p.sub_(trust * eta * u)


def v2_reference(p, m, v, age, sel, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
    """Steps 5-7 of v2 for one tensor; the fresh entries are those with r == 1, the ones of ``sel``."""
    a = (m / (v.sqrt() + eps)) * ((1 - b2**t) ** 0.5 / (1 - b1**t))
    r = torch.pow(b3, age.to(p.dtype))
    (p_s, p_l), (a_s, a_l) = _norms(p, sel), _norms(a, sel)
    phi_s = safe_ratio(p_s, a_s, 1.0).clamp(c_min, c_max)
    phi_l = safe_ratio(p_l, a_l, 0.0).clamp(max=c_max)  # >= 0
    u = a + wd * p
    p.sub_(lr * phi_s * r * u + (lr / math.sqrt(n)) * phi_l * (1 - r) * u)


def _fused_age(age: torch.Tensor) -> torch.Tensor:
    """The fused path's fp16 age of an int16 one: held at ``fused.MAX_AGE``."""
    return age.clamp_max(fused_passes.MAX_AGE).to(torch.float16)


def _int16_age(age: torch.Tensor) -> torch.Tensor:
    """The int16 age of the fused path's fp16 one; an entry marked for averaging is 0."""
    return torch.where(age == fused_passes.SELECTED, 0, age).to(torch.int16)


class SlambLayout:
    """The flat layout with what steps 5-7 read of it besides the step's buffers: which tensors are always
    averaged, and per-parameter views of the long-lived flat buffers (made once: a model with hundreds of
    small tensors spends more on making views each step than on its arithmetic)."""

    def __init__(self, layout: FlatLayout, dense: list[bool]):
        self.layout, self.params, self.dense = layout, layout.params, dense
        self.dense_t = torch.tensor(dense, device=layout.device)
        self.one_dim_t = torch.tensor([p.dim() == 1 for p in layout.params], device=layout.device)
        # per group: its compressed tensors, and their places in the group (for _split_norms)
        self.compressed_of = {}
        for _, lo, hi in layout.groups:
            ids = [i for i in range(lo, hi) if not dense[i]]
            self.compressed_of[lo] = (ids, torch.tensor([i - lo for i in ids], dtype=torch.long,
                                                        device=layout.device))
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._index: dict[tuple[int, ...], torch.Tensor] = {}
        # the fused path's runs of tensors, their compiled passes, and each tensor's group (in ``layout.groups``)
        self.runs = fused_passes.runs([(lo, hi) for _, lo, hi in layout.groups])
        self.passes = fused_passes.Passes("SLAMB")
        self.group_index = torch.tensor([g for g, (_, lo, hi) in enumerate(layout.groups) for _ in range(lo, hi)],
                                        device=layout.device)

    def index(self, ids: list[int]) -> torch.Tensor:
        """``ids`` as a tensor on the device, made once per distinct list."""
        key = tuple(ids)
        if key not in self._index:
            self._index[key] = torch.tensor(ids, device=self.layout.device)
        return self._index[key]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of ``flat``, a buffer over the whole layout that lives as long as this."""
        got = self._views.get(id(flat))
        if got is None or got[0] is not flat:
            got = self._views[id(flat)] = (flat, self.layout.views(flat))
        return got[1]


def _split_norms(plan: SlambLayout, sel: Selection, tensors, lo: int, hi: int):
    """Per-tensor norms of the selected and of the other entries of ``tensors`` (parameters lo:hi)."""
    whole = torch.stack(torch._foreach_norm(tensors))
    ids, at = plan.compressed_of[lo]
    if not ids:
        return whole, torch.zeros_like(whole)
    selected = whole.index_copy(0, at, torch.stack(torch._foreach_norm(sel.take([tensors[i - lo] for i in ids],
                                                                                ids))))
    rest = (whole.square() - selected.square()).clamp_min_(0.0).sqrt_()
    return selected, rest.masked_fill_(plan.dense_t[lo:hi], 0.0)


def _moments(plan, grads, m, v, groups, *, foreach: bool) -> None:
    """Step 2 on the flat buffers."""
    ms, vs = plan.views(m), plan.views(v)
    for lo, hi, hyper in groups:
        adam_moments_(ms[lo:hi], vs[lo:hi], grads[lo:hi], hyper["b1"], hyper["b2"], foreach=foreach)


def _advance_age(age: torch.Tensor, sel: Selection) -> None:
    """Step 6 on the age: 0 where averaged now, else one more (held at ``_MAX_AGE``)."""
    age.clamp_max_(_MAX_AGE - 1).add_(1)
    sel.fill_(age, 0)


def _single_tensor_slamb(plan, sel, grads, m, v, age, groups, *, variant, n, exchange, work):
    """Steps 2 and 4-7, tensor by tensor, with the reference functions."""
    _moments(plan, grads, m, v, groups, foreach=False)
    exchange()
    _advance_age(age, sel)
    mask = plan.layout.views(sel.bool_mask())
    reference = v1_reference if variant == "v1" else v2_reference
    for lo, hi, hyper in groups:
        for i in range(lo, hi):
            reference(plan.params[i], plan.views(m)[i], plan.views(v)[i], plan.views(age)[i], mask[i],
                      n=n, **hyper)


# devices where p.add_(x, alpha=s) per tensor beats the multi-tensor pair: torch's foreach ops loop over the
# tensors there anyway, and the pair makes two passes and writes x
_PER_TENSOR_ADD = {"cpu"}


def _add_scaled_(params, xs, scales) -> None:
    """p += s * x per tensor; ``xs`` is scratch and may be overwritten. Elsewhere than ``_PER_TENSOR_ADD``,
    two multi-tensor launches instead of one kernel per tensor (foreach ``add_`` takes one alpha for all)."""
    if params and params[0].device.type in _PER_TENSOR_ADD:
        for p, x, s in zip(params, xs, scales):
            p.add_(x, alpha=s)
    else:
        torch._foreach_mul_(xs, scales)
        torch._foreach_add_(params, xs)


def _freshness(age: torch.Tensor, b3: float, *, out: torch.Tensor) -> torch.Tensor:
    """r = b3^age (step 6)."""
    if b3 > 0:
        return out.copy_(age).mul_(math.log(b3)).exp_()
    return out.copy_(age == 0)


def _v1_flat(plan, sel, lo, hi, m, v, age, work, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
    span, params = plan.layout.span(lo, hi), plan.params[lo:hi]
    c, eps = bias_folding(t, b1, b2, eps)
    adam_direction_(m[span], v[span], eps, out=work[0][span])
    d = plan.views(work[0])[lo:hi]
    if wd != 0:
        torch._foreach_add_(d, params, alpha=wd / c)
    p_s, p_l = _split_norms(plan, sel, params, lo, hi)
    d_s, d_l = _split_norms(plan, sel, d, lo, hi)
    phi_s, phi_l = safe_ratio(p_s, d_s * c, 1.0), safe_ratio(p_l, d_l * c, 1.0)
    dense, one_dim = plan.dense_t[lo:hi], plan.one_dim_t[lo:hi]
    a = torch.where(dense, torch.where(one_dim, phi_s, phi_s.clamp(c_min, c_max)), phi_l)
    b = torch.where(dense, 0.0, phi_s - phi_l)
    clamps = ~dense & ((torch.minimum(phi_s, phi_l) < c_min) | (torch.maximum(phi_s, phi_l) > c_max))
    r = _freshness(age[span], b3, out=work[1][span])
    e0 = lr / math.sqrt(n)
    e1 = lr - e0
    if e1 != 0:
        work[0][span].addcmul_(work[0][span], r, value=e1 / e0)
    scale = -c * e0
    rs = plan.views(work[1])[lo:hi]

    def update(a, b, clamps):
        keep = [i for i, x in enumerate(clamps) if not x]
        if keep:
            def sub(xs):
                return [xs[i] for i in keep]
            torch._foreach_addcmul_(sub(params), sub(d), sub(rs), [scale * x for x in sub(b)])
            _add_scaled_(sub(params), sub(d), [scale * x for x in sub(a)])
        for i in (i for i, x in enumerate(clamps) if x):
            trust = torch.mul(rs[i], b[i]).add_(a[i]).clamp_(c_min, c_max)
            params[i].addcmul_(d[i], trust, value=scale)

    return torch.stack([a, b, clamps.to(a.dtype)]), update


def _v2_flat(plan, sel, lo, hi, m, v, age, work, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
    span, params = plan.layout.span(lo, hi), plan.params[lo:hi]
    c = bias_folding(t, b1, b2, eps)[0]
    adam_direction_(m[span], v[span], eps, out=work[0][span])
    d = plan.views(work[0])[lo:hi]  # a / c
    p_s, p_l = _split_norms(plan, sel, params, lo, hi)
    a_s, a_l = _split_norms(plan, sel, d, lo, hi)
    phi_s = safe_ratio(p_s, a_s * c, 1.0).clamp_(c_min, c_max)
    phi_l = safe_ratio(p_l, a_l * c, 0.0).clamp_(0.0, c_max)
    if wd != 0:
        torch._foreach_add_(d, params, alpha=wd / c)  # u / c
    base = phi_l * (lr / math.sqrt(n))
    _freshness(age[span], b3, out=work[1][span])
    fresh = plan.views(work[1])[lo:hi]

    def update(slope, base):
        torch._foreach_addcmul_(params, d, fresh, slope)
        _add_scaled_(params, d, base)

    return torch.stack([phi_s * lr - base, base]) * -c, update


def _multi_tensor_slamb(plan, sel, grads, m, v, age, groups, *, variant, n, exchange, work):
    """Steps 2 and 4-7 with multi-tensor ops on flat buffers (the rewrites of the module docstring); ``work``:
    the scratch buffers."""
    _moments(plan, grads, m, v, groups, foreach=True)
    exchange()
    _advance_age(age, sel)
    flat = _v1_flat if variant == "v1" else _v2_flat
    deferred = [flat(plan, sel, lo, hi, m, v, age, work, n=n, **hyper) for lo, hi, hyper in groups]
    # every group's scalars in one host read: a group's update changes nothing another reads
    values = torch.cat([s.reshape(-1) for s, _ in deferred]).tolist()
    for scalars, update in deferred:
        rows, values = values[:scalars.numel()], values[scalars.numel():]
        width = scalars.shape[1]
        update(*(rows[i * width:(i + 1) * width] for i in range(scalars.shape[0])))


def _fused_slamb(plan, sel, grads, m, v, age, groups, *, variant, n, exchange, work):
    """Steps 2 and 4-7 as the two compiled passes of :mod:`slamb.optim.fused`: moments, age and the norms
    in the first, the update in the second; between them, the norms of the averaged entries are redone on
    the averages (a fraction k of the entries). ``age``: fp16 (``fused.MAX_AGE``). No scratch,
    no host read. Raises ``fused.CompileFailed`` where the first graph failed to compile: nothing has
    changed but the marks, which step 6 makes 0 on any path."""
    layout, passes = plan.layout, plan.passes
    rows = [_fused_columns(variant, **hyper) for _, _, hyper in groups]
    ages, ms, vs = plan.views(age), plan.views(m), plan.views(v)
    sel.fill_(age, fused_passes.SELECTED)  # pass 1 splits the norms at these marks and makes them 0
    cols = dict(zip(_FUSED_COLUMNS, fused_passes.table(rows, plan.group_index, layout.device).unbind(1)))
    moment_table = torch.stack([cols[k] for k in fused_passes.MOMENT_COLUMNS], 1)
    params = plan.params

    passes.begin_step()
    sums = torch.cat([passes(fused_passes.moments_pass, params[a:b], grads[a:b], ms[a:b], vs[a:b], ages[a:b],
                             moment_table[a:b]) for a, b in plan.runs])
    p_s, p_l, u_s, u_l = sums.clamp_min(0).sqrt().unbind(1)

    u_s = u_s.clone()
    per_tensor = [rows[g] for g, (lo, hi, _) in enumerate(groups) for _ in range(lo, hi)]
    c_at, eps_at, wd_at = (_FUSED_COLUMNS.index(k) for k in ("c", "eps", "wd_norm"))
    for ids, mean in exchange():  # step 4 ended: the norms of the averaged entries, on the averages
        den = torch._foreach_sqrt(sel.take([vs[i] for i in ids], ids))
        torch._foreach_add_(den, [per_tensor[i][eps_at] for i in ids])
        u = torch._foreach_div(list(mean.split([sel.counts[i] for i in ids])), den)
        torch._foreach_mul_(u, [per_tensor[i][c_at] for i in ids])
        wd = [per_tensor[i][wd_at] for i in ids]
        if any(wd):
            torch._foreach_add_(u, torch._foreach_mul(sel.take([params[i] for i in ids], ids), wd))
        u_s.index_copy_(0, plan.index(ids), torch.stack(torch._foreach_norm(u)))

    lr, c_min, c_max = cols["lr"], cols["c_min"], cols["c_max"]
    inf = torch.full_like(lr, math.inf)
    if variant == "v1":
        phi_s, phi_l = safe_ratio(p_s, u_s, 1.0), safe_ratio(p_l, u_l, 1.0)
        one_dim = plan.one_dim_t
        a = torch.where(one_dim, phi_s, phi_l)  # a 1-D tensor is plain LAMB: no clamp, no blending
        b = torch.where(one_dim, 0.0, phi_s - phi_l)
        lo, hi = torch.where(one_dim, -inf, c_min), torch.where(one_dim, inf, c_max)
        e0 = lr / math.sqrt(n)
        e1 = lr - e0
    else:
        phi_s = safe_ratio(p_s, u_s, 1.0).clamp(c_min, c_max)
        phi_l = safe_ratio(p_l, u_l, 0.0).clamp(max=c_max)
        a = phi_l * (lr / math.sqrt(n))  # p -= (a + b r) u
        b = phi_s * lr - a
        lo, hi, e0, e1 = -inf, inf, torch.ones_like(lr), torch.zeros_like(lr)
    update_table = torch.stack([cols["c"], cols["eps"], cols["wd"], cols["log2_b3"], a, b, lo, hi, e0, e1], 1)
    for first, end in plan.runs:
        passes(fused_passes.update_pass, params[first:end], ms[first:end], vs[first:end], ages[first:end],
               update_table[first:end])


# the per-group numbers of the fused passes, staged to the device in one copy per step
_FUSED_COLUMNS = ("one_minus_b1", "b2", "one_minus_b2", "c", "eps", "wd_norm", "wd", "log2_b3", "lr", "c_min",
                  "c_max")


def check_fused_beta3(b3: float) -> None:
    if b3 > fused_passes.MAX_BETA3:
        raise ValueError(f"invalid beta3={b3!r} with fused=True: the fused step counts ages to "
                         f"{fused_passes.MAX_AGE} (fp16), which is exact to fp32's rounding only for beta3 <= "
                         f"{fused_passes.MAX_BETA3:.4f}; use fused=False for a larger beta3")


def _fused_columns(variant, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max) -> list[float]:
    check_fused_beta3(b3)
    c, eps_v1 = bias_folding(t, b1, b2, eps)
    return [1 - b1, b2, 1 - b2, c, eps_v1 if variant == "v1" else eps, wd if variant == "v1" else 0.0, wd,
            math.log2(b3) if b3 > 0 else fused_passes.LOG2_ZERO, lr, c_min, c_max]


_IMPLS = {"reference": _single_tensor_slamb, "foreach": _multi_tensor_slamb, "fused": _fused_slamb}


def slamb_update_(plan: SlambLayout, sel: Selection, grads, m, v, age, groups, *, variant: str, n: int,
                  exchange, work: list[torch.Tensor], impl: str) -> None:
    """Steps 2 and 4-7 of every parameter group, in place on ``plan.params`` and the flat buffers.

    ``grads``: the local gradients (step 1); ``m``, ``v``, ``age``: flat buffers over the layout (the
    moments and the age (``staleness``) of the last step); ``sel``: the step's mask; ``exchange``: ends
    step 4 (waits for the momentum averages of ``sel``, started before, and writes them into ``m``; call it
    after step 2) and returns them as (parameter ids, packed averages); ``groups``: (first, end,
    hyper-parameters) per run of the layout; ``n``: the world size; ``work``: the multi-tensor path's
    scratch, two flat buffers over the layout (none for the others); ``impl``: ``"foreach"``, ``"fused"``
    or ``"reference"``.
    """
    _IMPLS[impl](plan, sel, grads, m, v, age, groups, variant=variant, n=n, exchange=exchange, work=work)


class SLAMB(LocalStateOptimizer):
    """SLAMB over torch.distributed (any backend, any device, or no process group).

    Per parameter group: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``beta3``,
    ``c_min``, ``c_max``. For the whole optimizer (they shape the collective):
    ``compress_ratio`` (k), ``sync_interval`` (H), ``min_compress_numel`` (T),
    ``variant``, ``mask``, ``comm_dtype``, ``seed``, ``process_group``,
    ``hierarchy``, ``local_world_size``.

    ``hierarchy="node"``: the workers are the nodes (``local_world_size`` ranks each, default
    torchrun's ``LOCAL_WORLD_SIZE``): :func:`slamb.wrap_model` averages the gradients densely inside
    each node, and the momentum exchange and parameter syncs run across nodes, every local rank
    carrying a share (:mod:`slamb.topology`); n is the number of nodes. ``comm_dtype=torch.int8``
    quantises the exchange per chunk (:func:`slamb.comm.int8_mean_`).

    ``compress_ratio`` may change between steps: assign ``opt.compress_ratio``;
    the next step's mask uses it, and a cyclic mask re-cuts its permutation
    into int(1/k) chunks. ``compression_warmup`` (None, a list of per-epoch
    ratios, or ``"cifar10"``: the CIFAR-10 recipe's) does so at each
    :meth:`begin_epoch`: k_e = max(warmup[e], k), the last entry kept after.

    The ranks' parameters differ between syncs: the model of the run is their
    average, :meth:`average_parameters` (or :func:`slamb.average_model`, which
    also averages buffers such as BatchNorm statistics).

    Wrap the model with :func:`slamb.wrap_model` (DDP that broadcasts the
    initial parameters but keeps gradients local) or call ``backward()`` on an
    unwrapped model: gradients must NOT be all-reduced.

    The flat layout is fixed at the first step: the parameters that have a
    gradient then. A later step where one of them has no gradient treats it
    as zero, so every rank still packs the same entries; a parameter that
    first gets a gradient later (on any rank) joins the layout on every rank,
    with fresh moments. A step where no rank has a gradient does nothing.

    ``nonfinite``: what a step does when any rank's gradients hold NaN/inf,
    decided identically on every rank before any state changes: ``"raise"``
    (``FloatingPointError``), ``"skip"`` (no update, step not counted) or
    ``"ignore"`` (no check; saves a pass over the gradients). The decision
    travels in the step's one 4-byte all-reduce (kind ``"control"``).

    ``fused=True`` runs steps 2 and 4-7 as two passes compiled by ``torch.compile``
    (:mod:`slamb.optim.fused`; once per run of tensor shapes): no scratch buffer, no
    host read of the trust ratios, the reference path's numbers to fp32 rounding. Its
    age is fp16, held at 2048, so it takes ``beta3 <= 0.9919`` (where b3^2048 is below
    fp32's rounding; a larger one is refused). ``torch.compile(opt.step)`` runs the step
    eagerly (it decides on the host and communicates between its kernels): use
    ``fused=True`` for a compiled step. Where ``torch.compile`` fails, the step warns
    once and runs the multi-tensor path from then on. It has never run on a GPU;
    ``results/bench/optimizer_step.md`` has what it does on a CPU.

    ``overlap``: under :func:`slamb.wrap_model`, start each DDP bucket's share of
    the momentum exchange from DDP's comm hook as soon as backward fills the
    bucket, and finish it in ``step()``; the numbers are those of the plain path.
    Gradients that change between backward and ``step()`` are handled so:

    * a loss scale unscaled before ``step()``: set ``opt.grad_scale`` to it
      before backward (the scale backward's gradients carry and ``step()``'s do
      not); the buckets' gradients are unscaled in the hook as they would be
      after backward, so the exchange is the plain path's to the bit;
    * anything else (per-rank gradient clipping, an unscaling ``grad_scale``
      does not describe): ``step()`` compares each bucket's gradient norms with
      those the hook saw, and when they differ on any rank (by more than 1e-5
      relative), every rank drops the overlapped exchanges and runs the plain
      one, warning once. The numbers stay the plain path's; the bytes of such a
      step are sent twice. Clipping cannot be applied in the hook: its factor
      depends on gradients that backward has not produced yet.

    Host reads in ``step()`` (each a decision only the host can take): the
    non-finite check (unless ``nonfinite="ignore"``), the selection's per-tensor
    counts (to cut the packed exchange), the per-tensor trust-ratio scalars of
    all parameter groups at once (the multi-tensor update takes them as
    numbers), and, with ``overlap``, the rank-agreed check above. The mask is
    drawn without one.
    """

    params_differ = True
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
        overlap: bool = False,
        compression_warmup=None,
        hierarchy: str | None = None,
        local_world_size: int | None = None,
        fused: bool = False,
    ):
        check_choice("variant", variant, VARIANTS)
        check_choice("hierarchy", hierarchy, HIERARCHIES)
        check_choice("overlap", overlap, (False, True))
        check_choice("fused", fused, (False, True))
        if fused and foreach is False:
            raise ValueError("invalid fused=True with foreach=False: the fused step replaces the multi-tensor one "
                             "and foreach=False asks for the per-tensor reference; set only one of them")
        check_choice("mask", mask, (None, *MASK_POLICIES))
        if not (isinstance(sync_interval, int) and sync_interval >= 1):
            raise ValueError(f"invalid sync_interval={sync_interval!r}: must be an integer >= 1")
        if not (isinstance(min_compress_numel, int) and min_compress_numel >= 0):
            raise ValueError(f"invalid min_compress_numel={min_compress_numel!r}: must be an integer >= 0")
        if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype)
                                           and (comm_dtype.is_floating_point or comm_dtype == torch.int8)):
            raise ValueError(f"invalid comm_dtype={comm_dtype!r}: must be None, a floating torch.dtype or torch.int8")
        if not isinstance(seed, int):
            raise ValueError(f"invalid seed={seed!r}: must be an integer")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, beta3=beta3,
                        c_min=c_min, c_max=c_max)
        self.fused = fused  # add_param_group checks beta3 against it
        super().__init__(params, defaults)
        self.hierarchy = hierarchy
        if hierarchy == "node" and comm.world_size(process_group) > 1:
            process_group = node_topology(process_group, local_world_size)  # the workers are the nodes
        self._setup(process_group=process_group, nonfinite=nonfinite, ledger=ledger)
        self.variant = variant
        self.mask_policy = mask or VARIANTS[variant]
        self.compress_ratio = compress_ratio
        self.target_compress_ratio = self.compress_ratio
        self.compression_warmup = check_compression_warmup(compression_warmup)
        self.sync_interval = sync_interval
        self.min_compress_numel = min_compress_numel
        self.comm_dtype = comm_dtype
        self.seed = seed
        self.foreach = True if foreach is None else foreach
        self.fused = fused
        self.overlap = overlap
        self._warned_fallback = False
        self._layout: FlatLayout | None = None
        self._last_draw: tuple[int, float] | None = None
        self._drawn: tuple[int, float, Selection] | None = None
        # the momentum exchange: DDP's comm hook starts it during backward with ``overlap``
        self.overlap_state = OverlapState(process_group=process_group, ledger=self.ledger, comm_dtype=comm_dtype,
                                          param_groups=self.param_groups,
                                          next_selection=lambda: self._selection(self._step + 1))
        self._alike_steps: int | None = 0  # first steps whose momenta were the same on every rank; None: done

    # -- settings -----------------------------------------------------------------

    @property
    def compress_ratio(self) -> float:
        return self._compress_ratio

    @compress_ratio.setter
    def compress_ratio(self, k: float) -> None:
        check_range("compress_ratio", k, 0.0, 1.0, lo_open=True)
        self._compress_ratio = float(k)

    def begin_epoch(self, epoch: int) -> None:
        """The compression warm-up: k for ``epoch`` (0-based) from ``compression_warmup``."""
        if self.compression_warmup is not None:
            self.compress_ratio = compression_ratio(epoch, self.target_compress_ratio, self.compression_warmup)
            if self.overlap and self._layout is not None:
                self._selection(self._step + 1)  # the new k's draw, before backward

    @torch.no_grad()
    def average_parameters(self) -> None:
        """Every rank ends with the ranks' average of the parameters (one flat all-reduce, kind ``"params"``).

        Collective. Use it for the model of the run (evaluation, export); the
        moments stay local. Before the first step the layout is not fixed and
        every parameter is averaged.
        """
        if self._layout is not None:
            self._sync_params()
        else:
            average_tensors_([p for g in self.param_groups for p in g["params"]], process_group=self.process_group,
                             ledger=self.ledger)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_adam_group(g)
        check_range("beta3", g["beta3"], 0.0, 1.0, hi_open=True)
        check_range("c_min", g["c_min"], 0.0)
        check_range("c_max", g["c_max"], 0.0, lo_open=True)
        if g["c_min"] > g["c_max"]:
            raise ValueError(f"invalid c_min={g['c_min']} > c_max={g['c_max']}: need c_min <= c_max")
        if getattr(self, "fused", False):
            check_fused_beta3(g["beta3"])

    # -- inspection ---------------------------------------------------------------

    def last_sync_mask(self) -> torch.Tensor | None:
        """Flat bool tensor (layout order) of the momentum entries averaged at the last step.

        Redrawn on demand (a mask is a function of seed, step and k), so no step keeps one alive.
        """
        return None if self._last_draw is None else self._draw(*self._last_draw).bool_mask()

    def _draw(self, step: int, k: float) -> Selection:
        """M_t (step 3): the policy's draw over the compressible tensors, plus all of the others."""
        layout = self._layout
        drawn = (self._mask_fn(step, k) if self._mask_fn is not None
                 else torch.empty(0, dtype=torch.long, device=layout.device))
        return Selection(layout, self._dense, drawn, self._bounds)

    def _selection(self, step: int) -> Selection:
        """M_t at the current compression ratio, drawn once per (step, k)."""
        k = self.compress_ratio
        if self._drawn is None or self._drawn[:2] != (step, k):
            self._drawn = (step, k, self._draw(step, k))
        return self._drawn[2]

    # -- communication ----------------------------------------------------------------

    def ddp_comm_hook(self):
        """``(state, hook)``: with ``overlap``, each DDP bucket's momentum exchange starts as soon as backward
        fills it (:func:`slamb.optim.overlap.overlap_hook`); else DDP sends nothing."""
        return (self.overlap_state, overlap_hook) if self.overlap else (None, no_comm_hook)

    @property
    def grad_scale(self) -> float:
        return self.overlap_state.grad_scale

    @grad_scale.setter
    def grad_scale(self, scale: float) -> None:
        self.overlap_state.grad_scale = float(scale)

    # -- state ----------------------------------------------------------------------

    def _build(self, ids: list[int] | None = None) -> None:
        """Fix the flat layout; adopt per-parameter state already present (a loaded checkpoint)."""
        ids = params_with_grad(self) if ids is None else ids
        if not ids:
            raise ValueError("SLAMB: no parameter has a gradient: nothing to optimize")
        layout = FlatLayout.of(self, ids)
        check_layouts_agree([layout], ledger=self.ledger, group=self.process_group, who="SLAMB")
        self._flat = {"exp_avg": layout.adopt(self.state, "exp_avg"),
                      "exp_avg_sq": layout.adopt(self.state, "exp_avg_sq")}
        self._age = self._adopt_age(layout)
        # scratch for the update (not state): reused, since a fresh model-sized buffer each step costs
        # more in page faults than the arithmetic done in it
        self._work = ([layout.zeros() for _ in range(2)]
                      if self.foreach and not self.fused else [])
        self._dense = [p.dim() == 1 or p.numel() < self.min_compress_numel for p in layout.params]
        self._plan = SlambLayout(layout, self._dense)
        self._views = {key: self._plan.views(buf) for key, buf in self._flat.items()}
        compressible = sum(n for n, d in zip(layout.numels, self._dense) if not d)
        self._mask_fn = make_mask(self.mask_policy, compressible, self.seed, layout.device) if compressible else None
        self._bounds = Selection.bounds(layout, self._dense)
        self.overlap_state.bind(layout.params, self._views["exp_avg"], layout.group_of)
        self._drawn = None
        self._layout, self._layout_ids = layout, ids
        self._check_counts_agree()

    def _adopt_age(self, layout: FlatLayout) -> torch.Tensor:
        """Step 6's age of every entry, one flat buffer: int16, or fp16 for the fused path (``fused.MAX_AGE``).
        The per-parameter state holds views of it; :meth:`state_dict` saves the int16 counter for both."""
        dtype = torch.float16 if self.fused else torch.int16
        for p in layout.params:
            saved = self.state[p].get("staleness")
            if saved is not None and saved.dtype != dtype:
                self.state[p]["staleness"] = _fused_age(saved) if self.fused else _int16_age(saved)
        return layout.adopt(self.state, "staleness", fill=0, dtype=dtype)

    def _leave_fused(self) -> None:
        """The multi-tensor path from now on, ``torch.compile`` having failed: its age buffer and scratch."""
        self.fused = False
        self._age = self._adopt_age(self._layout)
        self._work = [self._layout.zeros() for _ in range(2)]

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["state"] = {k: {**s, "staleness": _int16_age(s["staleness"])}
                       if "staleness" in s and s["staleness"].dtype == torch.float16 else s
                       for k, s in sd["state"].items()}
        return sd

    def _check_counts_agree(self) -> None:
        """Every rank must pack as many entries as the others (collectives need equal counts; masks of
        other seeds or ratios would hang or mix unrelated entries): checked once, on the next step's draw."""
        n = comm.world_size(self.process_group)
        if n == 1:
            return
        t = self._step + 1
        mine = torch.tensor([self._selection(t).numel], dtype=torch.long, device=self._layout.device)
        everyone = torch.empty(n, dtype=torch.long, device=mine.device)
        comm.all_gather_into_tensor(everyone, mine, kind="control", ledger=self.ledger, group=self.process_group)
        if not bool((everyone == mine).all()):
            raise RuntimeError(
                f"SLAMB: the ranks' masks select different numbers of momentum entries at step {t} (per rank: "
                f"{everyone.tolist()}); every rank must use the same seed, compress_ratio, mask and model"
            )

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
        self._age_from_freshness()
        self.compress_ratio = extra["compress_ratio"]
        self.seed = int(extra["seed"])  # the masks are a function of it: resumed runs redraw the same ones
        self._layout, self._last_draw = None, None
        self.overlap_state.pending = {}

    def _age_from_freshness(self) -> None:
        """A v2 state saved with the freshness r itself (float, one word per element) holds r = b3^age:
        its age, the int16 counter kept now. Exact where b3^age is above fp32's smallest normal number."""
        for group in self.param_groups:
            b3 = group["beta3"]
            for p in group["params"]:
                state = self.state.get(p, {})
                if "freshness" not in state:
                    continue
                r = state.pop("freshness").double()
                if b3 > 0:
                    age = (r.log() / math.log(b3)).round().nan_to_num(posinf=_MAX_AGE).clamp(0, _MAX_AGE)
                else:  # r = 0^age: 1 for age 0, else 0 for every age
                    age = (r < 1).double()
                state["staleness"] = torch.where(r >= 1, 0.0, age.clamp_min(1)).to(torch.int16)

    # -- the step -------------------------------------------------------------------

    # the step decides on the host and communicates between its kernels: under torch.compile it
    # runs as written (eager), where a traced graph would break at every decision
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        try:
            loss, grads = self._open_step(closure)  # step 1: local gradients
        except BaseException:
            discard(self.overlap_state.drain())
            raise
        pending = self.overlap_state.drain()  # exchanges of the DDP buckets started during backward (overlap)
        if grads is None:  # skipped on every rank
            discard(pending)
            return loss
        layout = self._layout
        t, n = self._step + 1, comm.world_size(self.process_group)
        self._step = t
        m, v, age = self._flat["exp_avg"], self._flat["exp_avg_sq"], self._age
        sel = self._selection(t)  # step 3
        discard({key: e for key, e in pending.items() if e[0] is not sel})  # k changed after backward
        pending = {key: e for key, e in pending.items() if e[0] is sel}
        if pending and grads_changed(self.overlap_state, pending, grads, sel):
            discard(pending)
            pending = {}
            if not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn("SLAMB(overlap=True): gradients changed between backward and step() (clipping, or "
                              "a loss scale not given as opt.grad_scale); this step and any such later one run "
                              "the plain exchange instead (same numbers, their momentum bytes sent twice)",
                              stacklevel=2)
        pending = {key: work for key, (_, work, _) in pending.items()}

        if n > 1:  # step 4 starts: the rest of the selected momentum goes out now, before step 2 runs
            covered = {i for key in pending for i in key}
            rest = [i for i in range(len(layout.params)) if i not in covered]
            if rest:
                pending[tuple(rest)] = launch(self.overlap_state, sel, rest, sel.take([grads[i] for i in rest], rest))

        alike = self._alike_steps is not None

        def exchange():  # step 4 ends: m[M_t] = the average
            nonlocal alike
            means = []
            for ids, work in pending.items():
                mean = work.wait().to(m.dtype)
                if alike:
                    alike = self._same_as_local(sel, ids, mean)
                sel.put_([self._views["exp_avg"][i] for i in ids], mean.split([sel.counts[i] for i in ids]), ids)
                means.append((list(ids), mean))
            if self._alike_steps is not None and n > 1:
                self._count_alike(alike)
            return means

        groups = []
        for gi, lo, hi in layout.groups:
            group = self.param_groups[gi]
            b1, b2 = group["betas"]
            groups.append((lo, hi, dict(t=t, lr=group["lr"], b1=b1, b2=b2, eps=group["eps"], wd=group["weight_decay"],
                                        b3=group["beta3"], c_min=group["c_min"], c_max=group["c_max"])))
        try:
            slamb_update_(self._plan, sel, grads, m, v, age, groups, variant=self.variant, n=n, exchange=exchange,
                          work=self._work, impl="fused" if self.fused else "foreach" if self.foreach else "reference")
        except fused_passes.CompileFailed:  # warned; nothing changed but the marks, which step 6 makes 0
            self._leave_fused()
            slamb_update_(self._plan, sel, grads, m, v, self._age, groups, variant=self.variant, n=n,
                          exchange=exchange, work=self._work, impl="foreach")

        if (t - 1) % self.sync_interval == 0:  # step 8
            self._sync_params()
        self._last_draw = (t, self.compress_ratio)
        # the next step's draw, now rather than in the DDP hook on the autograd thread mid-backward; without
        # overlap the next step draws its own (last_sync_mask() redraws this one)
        self._drawn = None
        if self.overlap:
            self._selection(t + 1)
        self.ledger.end_step()
        return loss

    def _same_as_local(self, sel: Selection, ids: list[int], mean: torch.Tensor) -> bool:
        """Whether this rank's momentum entries equal their average: to the rounding of the exchange."""
        local = torch.cat(sel.take([self._views["exp_avg"][i] for i in ids], ids))
        if self.comm_dtype == torch.int8:  # quantised per chunk: off by up to a scale of the chunk's largest entry
            return bool(torch.allclose(local, mean, rtol=0.0, atol=2 * float(local.abs().max()) / 127))
        rtol = 8 * torch.finfo(self.comm_dtype or mean.dtype).eps
        return bool(torch.allclose(local, mean, rtol=rtol, atol=0.0))

    def _count_alike(self, alike: bool) -> None:
        """Warn once when the first steps' momenta were the same on every rank before averaging.

        Costs nothing on the wire (the averages are those of step 4); stops at the first step that differs.
        """
        if not alike:
            self._alike_steps = None
            return
        self._alike_steps += 1
        if self._alike_steps == _ALIKE_STEPS:
            self._alike_steps = None
            warnings.warn(
                f"SLAMB: every rank held the same momentum before averaging at its first {_ALIKE_STEPS} steps: the "
                "gradients were already averaged across ranks (plain DDP, or a framework's trainer), or every rank "
                "trains on the same data. SLAMB needs each rank's local gradients, else it sends its momentum on top "
                "of a gradient all-reduce: wrap the model with slamb.wrap_model(model, optimizer) (or use the "
                "slamb.integrations trainer) instead of DistributedDataParallel.", stacklevel=3)

    def _sync_params(self) -> None:
        average_tensors_(self._layout.params, process_group=self.process_group, ledger=self.ledger)
