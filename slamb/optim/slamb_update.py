"""Steps 2 and 4-7 of SLAMB (``docs/algorithm.md``) on flat buffers, in place:
one signature, three implementations, as torch's Adam has, behind one
dispatcher, :func:`slamb_update_`, which chooses by its ``foreach`` and ``fused`` flags:

* ``_single_tensor_slamb``: the reference, ``v1_reference`` /
  ``v2_reference`` per tensor (the specification written out);
* ``_multi_tensor_slamb``: steps 5-7 rewritten into per-tensor scalars and
  multi-tensor ops over flat buffers, as derived below;
* ``_fused_slamb``: two passes and the age's, compiled by ``torch.compile`` over flat buffers (``fused.py``).

Step 4 is not here: each implementation ends the exchange it is given
(``averages.wait_into``, ``exchange.py``) where its docstring says.

How the multi-tensor path rewrites steps 5-7
--------------------------------------------
Per tensor, with S the entries selected at step t and L the others:

* Bias folding (``lamb_math.bias_folding``). With c = sqrt(1-b2^t) / (1-b1^t)
  and eps' = eps sqrt(1-b2^t),
  m_hat / (sqrt(v_hat) + eps) = c m / (sqrt(v) + eps'):
  no pass over the moments divides them. v1 uses this; v2's direction is
  a = c m / (sqrt(v) + eps) with eps unscaled. The scratch buffer holds the
  direction divided by c, d = u / c = m / (sqrt(v) + eps') + (wd / c) p,
  and every norm of u is c times that of d.
* Split norms. |x[S]| is the norm of a gather of the k N selected entries;
  |x[L]| the norm of the tensor with those entries set to 0 for the while
  (then put back): the stale entries summed directly, as the other paths
  do. sqrt(|x|^2 - |x[S]|^2) would cancel where the selected entries
  dominate, which is common: m_avg / (sqrt(v) + eps) on coordinates this
  rank's data did not touch (embedding rows) is large where its own m and v
  are small. An always-averaged tensor has no L.
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

import dataclasses
import math

import torch

from ..sharding import reduce_squares, sum_squares_
from . import fused as fused_passes
from .flat import FlatLayout
from .lamb_math import adam_direction_, adam_moments_, bias_folding, safe_ratio
from .masks import LayoutRuns, Selection
from .precision import working_copies, write_back_

# the per-element state of step 6: steps since the last average, in int16 (half a word), held at this age on
# every path (the fused path reads the same bits as fp16, whose largest finite number's they are); b3^age
# there is below 1.3e-7 for b3 <= 0.9995
MAX_INT16_AGE = fused_passes.MAX_AGE


@dataclasses.dataclass(frozen=True)
class SlambHyper:
    """A parameter group's settings at step ``t``, as steps 2 and 5-7 read them."""

    t: int
    lr: float
    b1: float
    b2: float
    eps: float
    wd: float
    b3: float
    c_min: float
    c_max: float

    @classmethod
    def of(cls, group: dict, t: int) -> SlambHyper:
        b1, b2 = group["betas"]
        return cls(t, group["lr"], b1, b2, group["eps"], group["weight_decay"], group["beta3"], group["c_min"],
                   group["c_max"])


def _norms(x, sel):
    """The norms of ``x[sel]`` and ``x[~sel]``."""
    sq = x * x
    return torch.where(sel, sq, 0).sum().sqrt(), torch.where(sel, 0, sq).sum().sqrt()


def v1_reference(p, m, v, age, sel, h: SlambHyper, *, n):
    """Steps 5-7 of v1 for one tensor; ``sel`` marks the entries averaged at step t."""
    u = (m / (1 - h.b1**h.t)) / ((v / (1 - h.b2**h.t)).sqrt() + h.eps) + h.wd * p
    if p.dim() == 1:  # plain LAMB: no clamp, no blending
        p.sub_(h.lr * safe_ratio(p.norm(), u.norm(), 1.0) * u)
        return
    r = torch.pow(h.b3, age.to(p.dtype))
    (p_s, p_l), (u_s, u_l) = _norms(p, sel), _norms(u, sel)
    phi_s, phi_l = safe_ratio(p_s, u_s, 1.0), safe_ratio(p_l, u_l, 1.0)
    trust = (r * phi_s + (1 - r) * phi_l).clamp(h.c_min, h.c_max)
    eta = r * h.lr + (1 - r) * h.lr / math.sqrt(n)
    p.sub_(trust * eta * u)


def v2_reference(p, m, v, age, sel, h: SlambHyper, *, n):
    """Steps 5-7 of v2 for one tensor; the fresh entries are those with r == 1, the ones of ``sel``."""
    a = (m / (v.sqrt() + h.eps)) * ((1 - h.b2**h.t) ** 0.5 / (1 - h.b1**h.t))
    r = torch.pow(h.b3, age.to(p.dtype))
    (p_s, p_l), (a_s, a_l) = _norms(p, sel), _norms(a, sel)
    phi_s = safe_ratio(p_s, a_s, 1.0).clamp(h.c_min, h.c_max)
    phi_l = safe_ratio(p_l, a_l, 0.0).clamp(max=h.c_max)  # >= 0
    u = a + h.wd * p
    p.sub_(h.lr * phi_s * r * u + (h.lr / math.sqrt(n)) * phi_l * (1 - r) * u)


def always_averaged(p: torch.Tensor, min_compress_numel: int) -> bool:
    """Whether every entry of ``p``'s momentum is averaged at every step (biases, norms, small tensors):
    a 1-D tensor, or one of fewer than ``min_compress_numel`` entries; SLAMB's mask draws over the others."""
    return p.dim() == 1 or p.numel() < min_compress_numel


class SlambLayout(FlatLayout):
    """The flat layout with what every path of steps 5-7 reads of it besides the step's buffers: which tensors
    are always averaged (``dense``, by the whole tensors' shapes), and per-parameter views of the long-lived
    flat buffers (:meth:`held_views`, made once: a model with hundreds of small tensors spends more on making
    views each step than on its arithmetic)."""

    def __init__(self, params: list[torch.Tensor], group_index: list[int], align: int = 1, *,
                 min_compress_numel: int):
        super().__init__(params, group_index, align)
        self.dense = [always_averaged(p, min_compress_numel) for p in self.keys]
        self.dense_t = torch.tensor(self.dense, device=self.device)
        self.one_dim_t = torch.tensor([p.dim() == 1 for p in self.params], device=self.device)
        # per group: its compressed tensors, and their places in the group (for _split_norms)
        self.compressed_of = {}
        for _, lo, hi in self.groups:
            ids = [i for i in range(lo, hi) if not self.dense[i]]
            self.compressed_of[lo] = (ids, torch.tensor([i - lo for i in ids], dtype=torch.long, device=self.device))
        self._held: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def held_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of ``flat``, a buffer over the whole layout that lives as long as this."""
        got = self._held.get(id(flat))
        if got is None or got[0] is not flat:
            got = self._held[id(flat)] = (flat, self.views(flat))
        return got[1]


class FusedSlamb:
    """What only the fused path holds: its compiled passes, the flat parameters and gradients
    (:class:`slamb.optim.fused.FlatStep`), the runs that take a draw's positions to the layout's, each tensor's
    group (in ``layout.groups``) and dense column."""

    def __init__(self, layout: SlambLayout):
        self.passes = fused_passes.Passes("SLAMB")
        self.flat = fused_passes.FlatStep(layout)
        self.runs = LayoutRuns(layout, layout.dense)
        self.group_index = torch.tensor([g for g, (_, lo, hi) in enumerate(layout.groups) for _ in range(lo, hi)],
                                        device=layout.device)
        self.dense = layout.dense_t.to(torch.float32)


def _split_norms(layout: SlambLayout, sel: Selection, tensors, lo: int, hi: int):
    """Per-tensor norms of the selected and of the other entries of ``tensors`` (parameters lo:hi), each
    summed over its own entries (the module docstring: no cancellation)."""
    ids, at = layout.compressed_of[lo]
    if not ids:
        whole = torch.stack(torch._foreach_norm(tensors))
        return whole, torch.zeros_like(whole)
    # the flattened tensor itself where its layout allows, else a copy, which needs nothing put back
    flats = [x.view(-1) if x.is_contiguous() else x.flatten() for x in (tensors[i - lo] for i in ids)]
    taken = sel.take(flats, ids)
    for i, x in zip(ids, flats):
        x.index_fill_(0, sel.local[i], 0.0)
    zeroed = list(tensors)
    for i, x in zip(ids, flats):
        zeroed[i - lo] = x
    # one pass: an always-averaged tensor's whole norm, a compressed tensor's norm of its other entries
    norms = torch.stack(torch._foreach_norm(zeroed))
    for i, x, v in zip(ids, flats, taken):
        x.index_copy_(0, sel.local[i], v)
    selected = norms.index_copy(0, at, torch.stack(torch._foreach_norm(taken)))
    return selected, torch.zeros_like(norms).index_copy_(0, at, norms.index_select(0, at))


def _moments(layout, grads, m, v, groups, *, foreach: bool) -> None:
    """Step 2 on the flat buffers."""
    ms, vs = layout.held_views(m), layout.held_views(v)
    for lo, hi, h in groups:
        adam_moments_(ms[lo:hi], vs[lo:hi], grads[lo:hi], h.b1, h.b2, foreach=foreach)


def age_of_freshness(r: torch.Tensor, b3: float) -> torch.Tensor:
    """The age (int16) of a freshness r = b3^age saved by an older v2 state (one float per element). Exact where
    b3^age is above fp32's smallest normal number."""
    r = r.double()
    if b3 > 0:
        age = (r.log() / math.log(b3)).round().nan_to_num(posinf=MAX_INT16_AGE).clamp(0, MAX_INT16_AGE)
    else:  # r = 0^age: 1 for age 0, else 0 for every age
        age = (r < 1).double()
    return torch.where(r >= 1, 0.0, age.clamp_min(1)).to(torch.int16)


def _advance_age(age: torch.Tensor, sel: Selection) -> None:
    """Step 6 on the age: 0 where averaged now, else one more (held at ``MAX_INT16_AGE``)."""
    age.clamp_max_(MAX_INT16_AGE - 1).add_(1)
    sel.fill_(age, 0)


def _single_tensor_slamb(layout, sel, params, grads, m, v, age, groups, *, variant, n, averages, work, fused, shards,
                         ledger):
    """Steps 2 and 4-7, tensor by tensor, with the reference functions (``work``, ``fused``, ``shards``: unused;
    FSDP2's shards are refused on this path)."""
    _moments(layout, grads, m, v, groups, foreach=False)
    averages.wait_into()
    _advance_age(age, sel)
    mask = layout.views(sel.bool_mask())
    ms, vs, ages = layout.held_views(m), layout.held_views(v), layout.held_views(age)
    reference = v1_reference if variant == "v1" else v2_reference
    for lo, hi, h in groups:
        for i in range(lo, hi):
            reference(params[i], ms[i], vs[i], ages[i], mask[i], h, n=n)


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


def _v1_flat(layout, sel, lo, hi, params, m, v, age, work, h: SlambHyper, *, n):
    span, params = layout.span(lo, hi), params[lo:hi]
    c, eps = bias_folding(h.t, h.b1, h.b2, h.eps)
    adam_direction_(m[span], v[span], eps, out=work[0][span])
    d = layout.held_views(work[0])[lo:hi]
    if h.wd != 0:
        torch._foreach_add_(d, params, alpha=h.wd / c)
    norms = torch.stack([*_split_norms(layout, sel, params, lo, hi), *_split_norms(layout, sel, d, lo, hi)])
    r = _freshness(age[span], h.b3, out=work[1][span])
    e0 = h.lr / math.sqrt(n)
    e1 = h.lr - e0
    if e1 != 0:
        work[0][span].addcmul_(work[0][span], r, value=e1 / e0)
    scale = -c * e0
    rs = layout.held_views(work[1])[lo:hi]

    def scalars(norms):
        p_s, p_l, d_s, d_l = norms
        phi_s, phi_l = safe_ratio(p_s, d_s * c, 1.0), safe_ratio(p_l, d_l * c, 1.0)
        dense, one_dim = layout.dense_t[lo:hi], layout.one_dim_t[lo:hi]
        a = torch.where(dense, torch.where(one_dim, phi_s, phi_s.clamp(h.c_min, h.c_max)), phi_l)
        b = torch.where(dense, 0.0, phi_s - phi_l)
        clamps = ~dense & ((torch.minimum(phi_s, phi_l) < h.c_min) | (torch.maximum(phi_s, phi_l) > h.c_max))
        return torch.stack([a, b, clamps.to(a.dtype)]), update

    def update(a, b, clamps):
        keep = [i for i, x in enumerate(clamps) if not x]
        if keep:
            def sub(xs):
                return [xs[i] for i in keep]
            torch._foreach_addcmul_(sub(params), sub(d), sub(rs), [scale * x for x in sub(b)])
            _add_scaled_(sub(params), sub(d), [scale * x for x in sub(a)])
        for i in (i for i, x in enumerate(clamps) if x):
            trust = torch.mul(rs[i], b[i]).add_(a[i]).clamp_(h.c_min, h.c_max)
            params[i].addcmul_(d[i], trust, value=scale)

    return norms, scalars


def _v2_flat(layout, sel, lo, hi, params, m, v, age, work, h: SlambHyper, *, n):
    span, params = layout.span(lo, hi), params[lo:hi]
    c = bias_folding(h.t, h.b1, h.b2, h.eps)[0]
    adam_direction_(m[span], v[span], h.eps, out=work[0][span])
    d = layout.held_views(work[0])[lo:hi]  # a / c
    norms = torch.stack([*_split_norms(layout, sel, params, lo, hi), *_split_norms(layout, sel, d, lo, hi)])
    if h.wd != 0:
        torch._foreach_add_(d, params, alpha=h.wd / c)  # u / c
    _freshness(age[span], h.b3, out=work[1][span])
    fresh = layout.held_views(work[1])[lo:hi]

    def scalars(norms):
        p_s, p_l, a_s, a_l = norms
        phi_s = safe_ratio(p_s, a_s * c, 1.0).clamp_(h.c_min, h.c_max)
        phi_l = safe_ratio(p_l, a_l * c, 0.0).clamp_(0.0, h.c_max)
        base = phi_l * (h.lr / math.sqrt(n))
        return torch.stack([phi_s * h.lr - base, base]) * -c, update

    def update(slope, base):
        torch._foreach_addcmul_(params, d, fresh, slope)
        _add_scaled_(params, d, base)

    return norms, scalars


def _multi_tensor_slamb(layout, sel, params, grads, m, v, age, groups, *, variant, n, averages, work, fused, shards,
                        ledger):
    """Steps 2 and 4-7 with multi-tensor ops on flat buffers (the rewrites of the module docstring); ``work``:
    the scratch buffers (``fused``: unused)."""
    _moments(layout, grads, m, v, groups, foreach=True)
    averages.wait_into()
    _advance_age(age, sel)
    flat = _v1_flat if variant == "v1" else _v2_flat
    prepared = [flat(layout, sel, lo, hi, params, m, v, age, work, h, n=n) for lo, hi, h in groups]
    whole = reduce_squares([x for x, _ in prepared], shards, ledger)  # a shard's norms: one collective for all groups
    deferred = [scalars(x) for (_, scalars), x in zip(prepared, whole)]
    # every group's scalars in one host read: a group's update changes nothing another reads
    values = torch.cat([s.reshape(-1) for s, _ in deferred]).tolist()
    for scalars, update in deferred:
        rows, values = values[:scalars.numel()], values[scalars.numel():]
        width = scalars.shape[1]
        update(*(rows[i * width:(i + 1) * width] for i in range(scalars.shape[0])))


def _fused_slamb(layout, sel, params, grads, m, v, age, groups, *, variant, n, averages, work, fused, shards,
                 ledger):
    """Steps 2 and 4-7 as the compiled passes of :mod:`slamb.optim.fused` over the flat buffers: step 4
    ends first (the ranks' averages written into m), then the moments and the norms, split at the marks,
    in the first pass, the age in its own, and the update in the second. The drawn entries are marked by their layout
    positions (:meth:`Selection.layout_positions`), an always-averaged tensor by its dense column. A step is a
    constant number of ops whatever the number of tensors: no update buffer, no host read. On FSDP2 shards the
    per-tensor sums are summed over the shard group before the trust ratios, and the shards copied in and
    back (:class:`slamb.optim.fused.FlatStep`). Raises
    ``fused.CompileFailed`` where the first graph failed to compile: nothing has changed but the averages in
    m, which the exchange writes again on any path, and the marks, which step 6 makes 0 on any path
    (-1 + 1). ``work``: unused."""
    passes, flat = fused.passes, fused.flat
    p, g = flat.view(flat.params()), flat.view(flat.grad)  # ``grads``: views of it, gathered by the step
    age.index_fill_(0, sel.layout_positions(fused.runs), fused_passes.SELECTED)
    written = 1.0 if averages.wait_into() else 0.0  # step 4 ended: nothing written at world size 1
    rows = [_fused_columns(variant, h) for _, _, h in groups]
    cols = dict(zip(_FUSED_COLUMNS, fused_passes.table(rows, fused.group_index, layout.device).unbind(1)))
    cols["dense"] = fused.dense
    cols["written"] = torch.full_like(fused.dense, written)
    moment_table = torch.stack([cols[k] for k in fused_passes.MOMENT_COLUMNS], 1)
    m, v, bits = flat.view(m), flat.view(v), flat.view(age.view(torch.float16))

    passes.begin_step()
    moment_rows = flat.per_block(moment_table)
    sums = sum_squares_(flat.sums(passes(fused_passes.moments_pass, p, g, m, v, bits, moment_rows)), shards, ledger)
    passes(fused_passes.age_pass, bits, moment_rows)
    p_s, p_l, u_s, u_l = sums.clamp_min(0).sqrt().unbind(1)

    lr, c_min, c_max = cols["lr"], cols["c_min"], cols["c_max"]
    inf = torch.full_like(lr, math.inf)
    if variant == "v1":
        phi_s, phi_l = safe_ratio(p_s, u_s, 1.0), safe_ratio(p_l, u_l, 1.0)
        one_dim = layout.one_dim_t
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
    passes(fused_passes.update_pass, p, m, v, bits, flat.per_block(update_table))
    flat.store()


# the per-group numbers of the fused passes, staged to the device in one copy per step
_FUSED_COLUMNS = ("one_minus_b1", "b2", "one_minus_b2", "c", "eps", "wd_norm", "wd", "log2_b3", "lr", "c_min",
                  "c_max")


def _fused_columns(variant, h: SlambHyper) -> list[float]:
    c, eps_v1 = bias_folding(h.t, h.b1, h.b2, h.eps)
    return [1 - h.b1, h.b2, 1 - h.b2, c, eps_v1 if variant == "v1" else h.eps, h.wd if variant == "v1" else 0.0, h.wd,
            math.log2(h.b3) if h.b3 > 0 else fused_passes.LOG2_ZERO, h.lr, h.c_min, h.c_max]


def slamb_update_(layout: SlambLayout, sel: Selection, grads, m, v, age, groups, *, variant: str, n: int,
                  averages, work: list[torch.Tensor], foreach: bool, fused: FusedSlamb | None, shards=None,
                  ledger=None) -> None:
    """Steps 2 and 4-7 of every parameter group, in place on ``layout.params`` and the flat buffers.

    ``grads``: the local gradients (step 1); ``m``, ``v``, ``age``: flat buffers over the layout (the
    moments and the age (``staleness``) of the last step); ``sel``: the step's mask; ``averages``: step 4
    under way (:class:`slamb.optim.exchange.Averages`), whose ``wait_into`` each implementation calls to write
    the momentum averages of ``sel`` into ``m``: the multi-tensor and reference paths after step 2, the fused
    path before, giving it ``grads``; ``groups``: (first, end, :class:`SlambHyper`) per run of the layout;
    ``n``: the world size; ``work``: the multi-tensor path's scratch, two flat buffers over the layout (none
    for the others); ``fused`` (its passes and flat buffers, :class:`FusedSlamb`) runs the compiled passes,
    else ``foreach`` the multi-tensor path, else the per-tensor reference, as ``torch.optim.adam.adam``
    chooses; ``shards``: on FSDP2 shards, their topology, over whose shard group each shard's sums of
    squares are summed into the whole tensor's (:func:`slamb.sharding.sum_squares_`, one all-reduce per step,
    recorded in ``ledger``; the multi-tensor and fused paths).

    Under bf16 or fp16 parameters the moments are fp32 and the update is computed in fp32 and rounded
    once: the reference and multi-tensor paths on fp32 copies of the parameters and gradients, the
    fused passes inside their graphs.
    """
    if fused is not None:
        impl = _fused_slamb
    elif foreach:
        impl = _multi_tensor_slamb
    else:
        impl = _single_tensor_slamb
    # the fused passes convert inside their graphs; the others step fp32 copies of low-precision tensors
    eager = fused is None
    params = working_copies(layout.params) if eager else layout.params
    impl(layout, sel, params, working_copies(grads) if eager else grads, m, v, age, groups, variant=variant, n=n,
         averages=averages, work=work, fused=fused, shards=shards, ledger=ledger)
    write_back_(layout.params, params)
