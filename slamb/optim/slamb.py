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
import warnings

import torch

from .. import comm
from ..averaging import average_tensors_
from ..schedules import check_compression_warmup, compression_ratio
from ..topology import HIERARCHIES, node_topology
from ..ddp import in_place, no_comm_hook
from ._common import (adam_direction_, adam_moments_, bias_folding, check_adam_group, check_choice, check_range,
                      safe_ratio)
from .base import LocalStateOptimizer
from .flat import FlatLayout, check_layouts_agree, param_labels, params_with_grad
from .masks import MASK_POLICIES, Selection, make_mask

VARIANTS = {"v1": "cyclic", "v2": "bernoulli"}
_AGE = {"v1": "staleness", "v2": "freshness"}  # the per-element state of step 6
# v1 counts steps in int16 (half a word): exact up to this age, where b3^age is 0 in fp32 for b3 <= 0.997
_MAX_AGE = 2**15 - 1
# first steps at which identical momenta on every rank show gradients averaged before SLAMB saw them
_ALIKE_STEPS = 3


def v1_reference(p, m, v, age, sel, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
    """Step 5-7 of v1 for one tensor; ``sel`` marks the entries averaged at step t."""
    u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * p
    if p.dim() == 1:  # plain LAMB: no clamp, no blending
        p.sub_(lr * safe_ratio(p.norm(), u.norm(), 1.0) * u)
        return
    r = torch.pow(b3, age.to(p.dtype))
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


def _add_scaled_(params, xs, scales) -> None:
    """p += s * x per tensor: one pass, where ``_foreach_mul_`` + ``_foreach_add_`` (foreach ``add_``
    takes one alpha for all tensors) make two and write x."""
    for p, x, s in zip(params, xs, scales):
        p.add_(x, alpha=s)


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

    ``torch.compile(opt.step)`` runs this step eagerly (the same numbers).

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
    ):
        check_choice("variant", variant, VARIANTS)
        check_choice("hierarchy", hierarchy, HIERARCHIES)
        check_choice("overlap", overlap, (False, True))
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
        self.overlap = overlap
        self.grad_scale = 1.0
        self._warned_fallback = False
        self._layout: FlatLayout | None = None
        self._last_draw: tuple[int, float] | None = None
        self._drawn: tuple[int, float, Selection] | None = None
        # bucket exchanges started in backward: parameter ids -> (selection, exchange, gradient norms seen)
        self._pending: dict[tuple[int, ...], tuple[Selection, comm.MeanWork, torch.Tensor]] = {}
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
        """With ``overlap``, each DDP bucket's momentum exchange starts as soon as backward fills it."""
        return None, (self._bucket_hook if self.overlap else no_comm_hook)

    @in_place
    def _bucket_hook(self, state, bucket):  # no annotations: DDP checks them against its own
        if self._layout is not None:  # the first step's buckets arrive before the layout exists
            index = self._index
            ids, grads = [], []
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                if id(p) in index:
                    ids.append(index[id(p)])
                    grads.append(g)
            if ids:
                key = tuple(ids)
                # a second backward before step() (accumulation outside no_sync) supersedes the first
                if key in self._pending:
                    self._discard({key: self._pending.pop(key)})
                sel = self._selection(self._step + 1)  # drawn at the end of the last step: no draw here
                gs = sel.take(grads, ids)
                if self.grad_scale != 1.0:
                    gs = torch._foreach_mul(gs, 1.0 / self.grad_scale)  # as unscaling will before step()
                norms = torch.stack(torch._foreach_norm(gs))
                self._pending[key] = (sel, self._launch(sel, ids, gs), norms)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    def _launch(self, sel: Selection, ids: list[int], gs: list[torch.Tensor]) -> comm.MeanWork:
        """Step 2 and 4 on the selected entries of parameters ``ids``: their new momentum, all-reduced.

        ``gs``: the selected entries of their gradients (``sel.take``). It reads only the old momentum
        and the gradients, so it can run during backward; the dense momentum update of step() then
        recomputes these entries and the average overwrites them.
        """
        ms = sel.take([self._m_views[i] for i in ids], ids)
        weights = [1 - self.param_groups[self._layout.group_of[i]]["betas"][0] for i in ids]
        if len(set(weights)) == 1:
            new = torch._foreach_lerp(ms, gs, weights[0])
        else:
            new = [torch.lerp(m, g, w) for m, g, w in zip(ms, gs, weights)]
        return comm.all_reduce_mean_(torch.cat(new), kind="momentum", ledger=self.ledger, group=self.process_group,
                                     async_op=True, comm_dtype=self.comm_dtype)

    def _drain(self) -> dict:
        pending, self._pending = self._pending, {}
        return pending

    @staticmethod
    def _discard(pending: dict) -> None:
        """Finish exchanges whose result is not used: every rank ran them, so every rank waits."""
        for _, work, _ in pending.values():
            work.wait()

    def _grads_changed(self, pending: dict, grads: list[torch.Tensor], sel: Selection) -> bool:
        """Whether, on any rank, the gradients of the overlapped exchanges differ from those backward gave
        them (clipping, an unscaling other than ``grad_scale``): a rank-agreed decision, one host read."""
        seen = torch.cat([norms for _, _, norms in pending.values()])
        now = torch.cat([torch.stack(torch._foreach_norm(sel.take([grads[i] for i in ids], ids))) for ids in pending])
        changed = ((seen - now).abs() > 1e-5 * now).any()
        return comm.agree_any(changed, ledger=self.ledger, group=self.process_group)

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
                      age: (layout.adopt(self.state, age, fill=0, dtype=torch.int16) if age == "staleness"
                            else layout.adopt(self.state, age, fill=1.0))}
        # scratch for the update (not state): reused, since a fresh model-sized buffer each step costs
        # more in page faults than the arithmetic done in it
        self._work = [layout.zeros() for _ in range(2 if self.variant == "v1" else 1)]
        # per-parameter views of every flat buffer, made once: a model with hundreds of small tensors
        # spends more on making views each step than on its arithmetic
        self._views = {key: layout.views(buf) for key, buf in self._flat.items()}
        self._work_views = [layout.views(w) for w in self._work]
        self._m_views = self._views["exp_avg"]
        self._dense = [p.dim() == 1 or p.numel() < self.min_compress_numel for p in layout.params]
        self._dense_t = torch.tensor(self._dense, device=layout.device)
        self._one_dim_t = torch.tensor([p.dim() == 1 for p in layout.params], device=layout.device)
        compressible = sum(n for n, d in zip(layout.numels, self._dense) if not d)
        self._mask_fn = make_mask(self.mask_policy, compressible, self.seed, layout.device) if compressible else None
        self._bounds = Selection.bounds(layout, self._dense)
        self._index = {id(p): i for i, p in enumerate(layout.params)}
        # per group: its compressed tensors, and their places in the group (for _split_norms)
        self._compressed_of = {}
        for _, lo, hi in layout.groups:
            compressed = [i for i in range(lo, hi) if not self._dense[i]]
            self._compressed_of[lo] = (compressed, torch.tensor([i - lo for i in compressed], dtype=torch.long,
                                                                device=layout.device))
        self._names = param_labels(self, ids)
        self._drawn = None
        self._layout, self._layout_ids = layout, ids
        self._check_counts_agree()

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
        self.compress_ratio = extra["compress_ratio"]
        self.seed = int(extra["seed"])  # the masks are a function of it: resumed runs redraw the same ones
        self._layout, self._last_draw, self._pending = None, None, {}

    # -- the step -------------------------------------------------------------------

    # the step decides on the host and communicates between its kernels: under torch.compile it
    # runs as written (eager), where a traced graph would break at every decision
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        try:
            loss, grads = self._open_step(closure)  # step 1: local gradients
        except BaseException:
            self._discard(self._drain())
            raise
        pending = self._drain()  # exchanges of the DDP buckets started during backward (overlap)
        if grads is None:  # skipped on every rank
            self._discard(pending)
            return loss
        layout = self._layout
        t, n = self._step + 1, comm.world_size(self.process_group)
        self._step = t
        m, v, age = (self._flat[k] for k in ("exp_avg", "exp_avg_sq", _AGE[self.variant]))
        sel = self._selection(t)  # step 3
        self._discard({key: e for key, e in pending.items() if e[0] is not sel})  # k changed after backward
        pending = {key: e for key, e in pending.items() if e[0] is sel}
        if pending and self._grads_changed(pending, grads, sel):
            self._discard(pending)
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
                pending[tuple(rest)] = self._launch(sel, rest, sel.take([grads[i] for i in rest], rest))

        for gi, lo, hi in layout.groups:  # step 2
            b1, b2 = self.param_groups[gi]["betas"]
            adam_moments_(self._views["exp_avg"][lo:hi], self._views["exp_avg_sq"][lo:hi], grads[lo:hi], b1, b2,
                          foreach=self.foreach)

        alike = self._alike_steps is not None
        for ids, work in pending.items():  # step 4 ends: m[M_t] = the average
            mean = work.wait().to(m.dtype)
            if alike:
                alike = self._same_as_local(sel, ids, mean)
            sel.put_([self._m_views[i] for i in ids], mean.split([sel.counts[i] for i in ids]), ids)
        if self._alike_steps is not None and n > 1:
            self._count_alike(alike)

        if self.variant == "v1":  # step 6
            age.clamp_max_(_MAX_AGE - 1).add_(1)
            sel.fill_(age, 0)
        else:
            for gi, lo, hi in layout.groups:
                age[layout.span(lo, hi)].mul_(self.param_groups[gi]["beta3"])
            sel.fill_(age, 1.0)

        mask = None if self.foreach else sel.bool_mask()  # the reference path's per-tensor masks
        deferred = []  # the flat paths' per-tensor scalars of each group, and the update that takes them
        for gi, lo, hi in layout.groups:  # steps 5 and 7
            group, span = self.param_groups[gi], layout.span(lo, hi)
            b1, b2 = group["betas"]
            hyper = dict(t=t, lr=group["lr"], b1=b1, b2=b2, eps=group["eps"], wd=group["weight_decay"],
                         c_min=group["c_min"], c_max=group["c_max"], n=n)
            if self.variant == "v1":
                hyper["b3"] = group["beta3"]
            if self.foreach:
                work = [w[span] for w in self._work]
                if self.variant == "v1":
                    deferred.append(self._v1_flat(lo, hi, sel, layout.params[lo:hi], m[span], v[span], age[span],
                                                  *work, **hyper))
                else:  # v2 reads its freshness through the per-parameter views
                    deferred.append(self._v2_flat(lo, hi, sel, layout.params[lo:hi], m[span], v[span], *work,
                                                  **hyper))
            else:
                for p, *views in zip(layout.params[lo:hi],
                                     *(layout.views(x[span], lo, hi) for x in (m, v, age, mask))):
                    if self.variant == "v1":
                        v1_reference(p, *views, **hyper)
                    else:
                        v2_reference(p, *views[:3], **hyper)
        if deferred:  # every group's scalars in one host read: a group's update changes nothing another reads
            values = torch.cat([s.reshape(-1) for s, _ in deferred]).tolist()
            for scalars, update in deferred:
                rows, values = values[:scalars.numel()], values[scalars.numel():]
                width = scalars.shape[1]
                update(*(rows[i * width:(i + 1) * width] for i in range(scalars.shape[0])))

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
        local = torch.cat(sel.take([self._m_views[i] for i in ids], ids))
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
        params = self._layout.params
        flat = self._layout.flatten(params)
        comm.all_reduce_mean_(flat, kind="params", ledger=self.ledger, group=self.process_group)
        torch._foreach_copy_(params, self._layout.views(flat))

    def _split_norms(self, tensors, sel: Selection, lo: int, hi: int):
        """Per-tensor norms of the selected and of the other entries of ``tensors`` (parameters lo:hi).

        The other entries' norm is sqrt(whole^2 - selected^2): a gather of k N entries instead of a
        masked pass over all N; always-averaged tensors have no other entries.
        """
        whole = torch.stack(torch._foreach_norm(tensors))
        ids, at = self._compressed_of[lo]
        if not ids:
            return whole, torch.zeros_like(whole)
        selected = whole.index_copy(0, at, torch.stack(torch._foreach_norm(sel.take([tensors[i - lo] for i in ids],
                                                                                    ids))))
        rest = (whole.square() - selected.square()).clamp_min_(0.0).sqrt_()
        return selected, rest.masked_fill_(self._dense_t[lo:hi], 0.0)

    # The flat paths fold each scalar factor (bias corrections, lr, the per-tensor trust ratios) into
    # per-tensor scalars, so that the element-wise work is a few fused multi-tensor ops over the parameters
    # and one reused scratch buffer. Each returns its scalars (rows of a 2-D tensor) and the update that
    # takes them as numbers: step() reads those of every group to the host at once.

    def _v1_flat(self, lo, hi, sel, params, m, v, age, work, r, *, t, lr, b1, b2, eps, wd, b3, c_min, c_max, n):
        c, eps = bias_folding(t, b1, b2, eps)  # u = c * m / (sqrt(v) + eps') + wd * p
        adam_direction_(m, v, eps, out=work)
        u = self._work_views[0][lo:hi]  # u / c from here on
        if wd != 0:
            torch._foreach_add_(u, params, alpha=wd / c)
        p_s, p_l = self._split_norms(params, sel, lo, hi)
        u_s, u_l = self._split_norms(u, sel, lo, hi)
        phi_s, phi_l = safe_ratio(p_s, u_s * c, 1.0), safe_ratio(p_l, u_l * c, 1.0)
        # trust(r) = A + B r; always-averaged tensors have r = 1 (1-D ones are plain LAMB: no clamp)
        dense, one_dim = self._dense_t[lo:hi], self._one_dim_t[lo:hi]
        a = torch.where(dense, torch.where(one_dim, phi_s, phi_s.clamp(c_min, c_max)), phi_l)
        b = torch.where(dense, 0.0, phi_s - phi_l)
        # a linear blend between two ratios inside [c_min, c_max] stays inside: only other tensors clamp
        clamps = ~dense & ((torch.minimum(phi_s, phi_l) < c_min) | (torch.maximum(phi_s, phi_l) > c_max))
        if b3 > 0:
            r.copy_(age).mul_(math.log(b3)).exp_()  # r = b3^age
        else:
            r.copy_(age == 0)
        # eta(r) = e0 + e1 r (lr for fresh entries, lr / sqrt(n) for stale): u *= 1 + (e1/e0) r
        e0 = lr / math.sqrt(n)
        e1 = lr - e0
        if e1 != 0:
            work.addcmul_(work, r, value=e1 / e0)
        # p -= c e0 (A + B r) u
        scale = -c * e0
        rs = self._work_views[1][lo:hi]

        def update(a, b, clamps):
            keep = [i for i, x in enumerate(clamps) if not x]
            if keep:
                def sub(xs):
                    return [xs[i] for i in keep]
                torch._foreach_addcmul_(sub(params), sub(u), sub(rs), [scale * x for x in sub(b)])
                _add_scaled_(sub(params), sub(u), [scale * x for x in sub(a)])
            for i in (i for i, x in enumerate(clamps) if x):  # rare: the clamp binds for some r
                trust = torch.mul(rs[i], b[i]).add_(a[i]).clamp_(c_min, c_max)
                params[i].addcmul_(u[i], trust, value=scale)

        return torch.stack([a, b, clamps.to(a.dtype)]), update

    def _v2_flat(self, lo, hi, sel, params, m, v, work, *, t, lr, b1, b2, eps, wd, c_min, c_max, n):
        c = bias_folding(t, b1, b2, eps)[0]  # a = c * m / (sqrt(v) + eps): v2 keeps eps unscaled
        adam_direction_(m, v, eps, out=work)
        a = self._work_views[0][lo:hi]  # a / c
        p_s, p_l = self._split_norms(params, sel, lo, hi)
        a_s, a_l = self._split_norms(a, sel, lo, hi)
        phi_s = safe_ratio(p_s, a_s * c, 1.0).clamp_(c_min, c_max)
        phi_l = safe_ratio(p_l, a_l * c, 0.0).clamp_(0.0, c_max)
        if wd != 0:
            torch._foreach_add_(a, params, alpha=wd / c)  # u / c
        # p -= u (lr phi_s r + lr/sqrt(n) phi_l (1 - r)) = u (slope r + base)
        base = phi_l * (lr / math.sqrt(n))
        fresh = self._views["freshness"][lo:hi]

        def update(slope, base):
            torch._foreach_addcmul_(params, a, fresh, slope)
            _add_scaled_(params, a, base)

        return torch.stack([phi_s * lr - base, base]) * -c, update
