"""SLAMB (Xu et al., ICML 2023): LAMB whose workers average only a shared random subset of their momentum each step.

Step t of worker i, numbered as in ``docs/algorithm.md`` (the specification), each one call of :meth:`SLAMB.step`
into the file named:

1. no gradient all-reduce: g is the local gradient (``base.py``);
2. local moments m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2 (v is never sent);
3. a mask M_t, identical on every worker, drawn from (seed, t): the ``cyclic`` (v1) or ``bernoulli`` (v2) policy of
   ``masks.py``, plus every coordinate of an always-averaged tensor (``always_averaged``, ``slamb_update.py``);
4. m[M_t] = mean over workers of m[M_t]: ONE all-reduce of the packed entries (``exchange.py``);
5. the Adam direction (v1 and v2 place bias correction and eps differently);
6. the freshness r of each element: 1 where averaged now, decaying by b3 per step since (the state is the age c, an
   int16 counter; r = b3^c);
7. two layer-wise trust ratios (fresh / stale entries) blended by r, and a step size blended between lr (fresh) and
   lr/sqrt(n) (stale);
8. after the updates of steps 1, H+1, 2H+1, ... the parameters are averaged (``averaging.py``).

Steps 2 and 5-7 are one call, :func:`slamb_update_` (``slamb_update.py``): the fused path runs them as compiled
passes (the moments, the age, the update) with the end of step 4 before them. The optimizer keeps the state, the
layout, the mask and the parameter sync.
"""
from __future__ import annotations

import torch

from .. import comm
from ..averaging import average_tensors_
from ..schedules import check_compression_warmup, compression_ratio
from ..sharding import local, sharded_topology
from ..topology import HIERARCHIES, node_topology
from ..ddp import no_comm_hook
from . import fused as fused_passes
from .base import LocalStateOptimizer, eager_under_compile
from .checks import (check_adam_group, check_choice, check_comm_dtype, check_count, check_fused, check_range,
                     check_sharded)
from .exchange import FlatMomentum, MomentumExchange, overlap_hook
from .flat import check_layouts_agree, params_with_grad
from .masks import MASK_POLICIES, BernoulliMask, Selection, make_mask
from .slamb_update import FusedSlamb, SlambHyper, SlambLayout, age_of_freshness, slamb_update_

VARIANTS = {"v1": "cyclic", "v2": "bernoulli"}


class SLAMB(LocalStateOptimizer):
    """SLAMB over torch.distributed (any backend, any device, or no process group).

    Per parameter group: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``beta3``, ``c_min``, ``c_max``. For the
    whole optimizer (they shape the collective): ``compress_ratio`` (k), ``sync_interval`` (H),
    ``min_compress_numel`` (T), ``variant``, ``mask``, ``comm_dtype``, ``seed``, ``process_group``, ``hierarchy``,
    ``local_world_size``.

    ``hierarchy="node"``: the workers are the nodes (``local_world_size`` ranks each, default torchrun's
    ``LOCAL_WORLD_SIZE``): :func:`slamb.wrap_model` averages the gradients densely inside each node, and the
    momentum exchange and parameter syncs run across nodes, every local rank carrying a share
    (:mod:`slamb.topology`); n is the number of nodes. ``comm_dtype=torch.int8`` quantises the exchange per chunk
    (:func:`slamb.comm.int8_mean_`).

    FSDP2's sharded parameters (DTensors of ``fully_shard`` on a 1-D or a (replicate, shard) HSDP mesh,
    :mod:`slamb.sharding`): the workers are the replicas, n = R; each rank keeps the state of its shard, draws the
    unsharded model's mask and keeps its slice, exchanges and syncs with the ranks holding its shard, and takes the
    trust ratios of the whole tensors (one all-reduce of the norms over the shard group per step, kind ``"norms"``).
    :func:`slamb.wrap_model` drops FSDP's gradient all-reduce across the replicas. The multi-tensor and fused paths
    (not ``foreach=False``, ``overlap``, ``hierarchy``).

    ``compress_ratio`` may change between steps: assign ``opt.compress_ratio``; the next step's mask uses it, and a
    cyclic mask re-cuts its permutation into int(1/k) chunks. ``compression_warmup`` (None, a list of per-epoch
    ratios, or ``"cifar10"``: the CIFAR-10 recipe's) does so at each :meth:`begin_epoch`: k_e = max(warmup[e], k),
    the last entry kept after.

    The ranks' parameters differ between syncs: the model of the run is their average, :meth:`average_parameters`
    (or :func:`slamb.average_model`, which also averages buffers such as BatchNorm statistics).

    Wrap the model with :func:`slamb.wrap_model` (DDP that broadcasts the initial parameters but keeps gradients
    local) or call ``backward()`` on an unwrapped model: gradients must NOT be all-reduced. A first step (of a run,
    or of a layout that grows) whose gradients are the same on every rank, as torch's own
    ``DistributedDataParallel`` leaves them, is refused in one line naming ``slamb.wrap_model``, before it changes
    anything (their bit sums ride in the step's layout check, 8 bytes); set ``opt.allow_same_gradients = True``
    where every rank computes the same gradients on purpose.

    The flat layout is fixed at the first step: the parameters that have a gradient then. A later step where one of
    them has no gradient treats it as zero, so every rank still packs the same entries; a parameter that first gets
    a gradient later (on any rank) joins the layout on every rank, with fresh moments. A step where no rank has a
    gradient does nothing.

    ``nonfinite``: what a step does when any rank's gradients hold NaN/inf, decided identically on every rank before
    any state changes: ``"raise"`` (``FloatingPointError``), ``"skip"`` (no update, step not counted) or
    ``"ignore"`` (no check; saves a pass over the gradients). The decision travels in the step's one 4-byte
    all-reduce (kind ``"control"``).

    ``fused=True`` runs steps 2 and 4-7 as three passes compiled by ``torch.compile`` over flat buffers
    (:mod:`slamb.optim.fused`): a constant number of kernels whatever the number of tensors, no update buffer, no
    host read of the trust ratios, the reference path's numbers to fp32 rounding, every beta3 in [0, 1); v2's
    Bernoulli mask is drawn by a compiled kernel too (the same positions), and step 4 gathers and scatters the
    selected momentum by layout positions (the same packed buffer; with ``overlap``, per DDP bucket whose parameters
    are consecutive in the layout, the others tensor by tensor). Its layout is aligned (each tensor starts at a
    multiple of ``fused.BLOCK`` entries) and it adopts the parameters into one flat buffer (each ``p.data`` becomes
    a view of it, adopted again at a step where it is not; FSDP2's shards are copied in and back at each step
    instead) and points their ``p.grad`` at views of a flat gradient buffer (:class:`slamb.optim.fused.FlatStep`).
    ``torch.compile(opt.step)`` runs the step eagerly (it decides on the host and communicates between its kernels):
    use ``fused=True`` for a compiled step. Where ``torch.compile`` fails, the step warns once and runs the
    multi-tensor path from then on; :attr:`fused_fallback` says why. ``results/bench/optimizer_step.md`` has what it
    does on a CPU.

    ``overlap``: under :func:`slamb.wrap_model`, start each DDP bucket's share of the momentum exchange from DDP's
    comm hook as soon as backward fills the bucket, and finish it in ``step()``; the numbers are those of the plain
    path. Gradients that change between backward and ``step()`` are handled so:

    * a loss scale unscaled before ``step()``: set ``opt.grad_scale`` to it before backward (the scale backward's
      gradients carry and ``step()``'s do not); the buckets' gradients are unscaled in the hook as they would be
      after backward, so the exchange is the plain path's to the bit;
    * anything else (per-rank gradient clipping, an unscaling ``grad_scale`` does not describe): ``step()`` compares
      each bucket's gradient norms with those the hook saw, and when they differ on any rank (by more than 1e-5
      relative), every rank drops the overlapped exchanges and runs the plain one, warning once. The numbers stay
      the plain path's; the bytes of such a step are sent twice. Clipping cannot be applied in the hook: its factor
      depends on gradients that backward has not produced yet.

    Host reads in ``step()`` (each a decision only the host can take): the non-finite check (unless
    ``nonfinite="ignore"``), the selection's per-tensor counts (to cut the packed exchange), the per-tensor
    trust-ratio scalars of all parameter groups at once (the multi-tensor update takes them as numbers), and, with
    ``overlap``, the rank-agreed check above. The mask is drawn without one.
    """

    params_differ = True
    state_averages = True  # the moments' mean, as a model sync leaves the parameters
    # refuse a first step whose gradients are the same on every rank (plain DDP), unless set (the same batch on
    # every rank on purpose): see the class docstring
    allow_same_gradients = False
    takes_sharded = True
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
        check_fused(fused, foreach)
        check_choice("mask", mask, (None, *MASK_POLICIES))
        check_count("sync_interval", sync_interval)
        check_count("min_compress_numel", min_compress_numel, minimum=0)
        check_comm_dtype(comm_dtype)
        if not isinstance(seed, int):
            raise ValueError(f"invalid seed={seed!r}: must be an integer")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, beta3=beta3,
                        c_min=c_min, c_max=c_max)
        self.fused = fused
        super().__init__(params, defaults)
        self.hierarchy = hierarchy
        self.shards = sharded_topology(self._all_params(), process_group)  # FSDP2: the workers are the replicas
        if self.shards is not None:
            check_sharded("SLAMB", {"foreach=False": foreach is False, "overlap=True": overlap,
                                    f"hierarchy={hierarchy!r}": hierarchy is not None},
                          "foreach=None, overlap=False, hierarchy=None")
            process_group = self.shards
        elif hierarchy == "node" and comm.world_size(process_group) > 1:
            process_group = node_topology(process_group, local_world_size)  # the workers are the nodes
        self._setup(process_group=process_group, nonfinite=nonfinite, ledger=ledger)
        self.variant = variant
        self.mask_policy = mask or VARIANTS[variant]
        self.overlap = overlap
        self._layout: SlambLayout | None = None
        self._fused: FusedSlamb | None = None  # the fused path's passes and flat buffers, while it runs
        self.compress_ratio = compress_ratio
        self.target_compress_ratio = self.compress_ratio
        self.compression_warmup = check_compression_warmup(compression_warmup)
        self.sync_interval = sync_interval
        self.min_compress_numel = min_compress_numel
        self.comm_dtype = comm_dtype
        self.seed = seed
        self.foreach = True if foreach is None else foreach
        self._last_draw: tuple[int, float] | None = None
        self._drawn: tuple[int, float, Selection] | None = None
        self._fused_fallback: str | None = None
        # step 4: with ``overlap`` DDP's comm hook starts it during backward
        self.exchange = MomentumExchange(process_group=process_group, ledger=self.ledger, comm_dtype=comm_dtype)

    # -- settings -----------------------------------------------------------------

    @property
    def compress_ratio(self) -> float:
        return self._compress_ratio

    @compress_ratio.setter
    def compress_ratio(self, k: float) -> None:
        check_range("compress_ratio", k, 0.0, 1.0, lo_open=True)
        self._compress_ratio = float(k)
        self._draw_next()  # the new k's draw, before backward

    def begin_epoch(self, epoch: int) -> None:
        """The compression warm-up: k for ``epoch`` (0-based) from ``compression_warmup``."""
        if self.compression_warmup is not None:
            self.compress_ratio = compression_ratio(epoch, self.target_compress_ratio, self.compression_warmup)

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
            average_tensors_([local(p) for g in self.param_groups for p in g["params"]],
                             process_group=self.process_group, ledger=self.ledger)

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

    @property
    def fused_fallback(self) -> str | None:
        """Why ``torch.compile`` failed, where ``fused=True`` then runs the multi-tensor path (the same numbers,
        more kernels), or None. What times or checks the fused step asserts it is None."""
        if self._fused is not None:
            return self._fused.passes.failed  # a graph failed in this step, after others had run: left at the next
        return self._fused_fallback

    def last_sync_mask(self) -> torch.Tensor | None:
        """Flat bool tensor (layout order) of the momentum entries averaged at the last step.

        Redrawn on demand (a mask is a function of seed, step and k), so no step keeps one alive.
        """
        return None if self._last_draw is None else self._draw(*self._last_draw).bool_mask()

    def _draw(self, step: int, k: float) -> Selection:
        """M_t (step 3): the policy's draw over the compressible tensors, plus all of the others."""
        layout = self._layout
        drawn = torch.empty(0, dtype=torch.long, device=layout.device)
        if self._mask_fn is not None:
            try:
                drawn = self._mask_fn(step, k)
            except fused_passes.CompileFailed:  # the fused path's first graph, v2's draw: warned, nothing changed
                self._leave_fused()
                drawn = self._mask_fn(step, k)
        return Selection(layout, layout.dense, drawn, self._bounds)

    def _selection(self, step: int) -> Selection:
        """M_t at the current compression ratio, drawn once per (step, k)."""
        k = self.compress_ratio
        if self._drawn is None or self._drawn[:2] != (step, k):
            self._drawn = (step, k, self._draw(step, k))
        return self._drawn[2]

    def _draw_next(self) -> None:
        """With ``overlap``, M_t of the coming step for DDP's hook, drawn now rather than on the autograd
        thread mid-backward; without it the step draws its own."""
        if self.overlap and self._layout is not None:
            self.exchange.next_sel = self._selection(self._step + 1)

    # -- communication ----------------------------------------------------------------

    def ddp_comm_hook(self):
        """``(state, hook)``: with ``overlap``, each DDP bucket's momentum exchange starts as soon as backward
        fills it (:func:`slamb.optim.exchange.overlap_hook`); else DDP sends nothing."""
        return (self.exchange, overlap_hook) if self.overlap else (None, no_comm_hook)

    @property
    def grad_scale(self) -> float:
        return self.exchange.grad_scale

    @grad_scale.setter
    def grad_scale(self, scale: float) -> None:
        self.exchange.grad_scale = float(scale)

    # -- state ----------------------------------------------------------------------

    def _build(self, ids: list[int] | None = None) -> None:
        """Fix the flat layout; adopt per-parameter state already present (a loaded checkpoint)."""
        ids = params_with_grad(self) if ids is None else ids
        if not ids:
            raise ValueError("SLAMB: no parameter has a gradient: nothing to optimize")
        layout = SlambLayout.of(self, ids, align=fused_passes.BLOCK if self.fused else 1,
                                min_compress_numel=self.min_compress_numel)
        check_layouts_agree([layout], ledger=self.ledger, group=self.process_group, who="SLAMB",
                            start=layout.params if self._step == 0 else None,
                            grads=None if self.allow_same_gradients else [k.grad for k in layout.keys])
        self._flat = {"exp_avg": layout.adopt(self.state, "exp_avg"),
                      "exp_avg_sq": layout.adopt(self.state, "exp_avg_sq")}
        self._age = self._adopt_age(layout)
        # scratch for the update (not state): reused, since a fresh model-sized buffer each step costs
        # more in page faults than the arithmetic done in it
        self._work = [layout.zeros() for _ in range(2)] if self.foreach and not self.fused else []
        self._fused = FusedSlamb(layout) if self.fused else None
        compressible = sum(n for n, d in zip(layout.global_numels, layout.dense) if not d)  # the unsharded model's
        self._bounds = Selection.bounds(layout, layout.dense)
        keep = self._bounds.cpu() if self.shards is not None else None  # a shard's cyclic mask keeps its own part
        self._mask_fn = (make_mask(self.mask_policy, compressible, self.seed, layout.device, keep,
                                   self._fused.passes if self.fused else None)
                         if compressible else None)
        flat = (FlatMomentum(self._flat["exp_avg"], self._fused.runs, layout.offsets, self._fused.flat.grad)
                if self.fused else None)
        self.exchange.bind(layout.params, layout.held_views(self._flat["exp_avg"]),
                           [self.param_groups[g] for g in layout.group_of], flat)
        self._drawn = None
        self._layout, self._layout_ids = layout, ids
        self._check_counts_agree()
        self._draw_next()

    def _adopt_age(self, layout: SlambLayout) -> torch.Tensor:
        """Step 6's age of every entry, one flat int16 buffer (the fused path reads its bits as fp16,
        :func:`slamb.optim.fused.age_of`); the per-parameter state holds views of it."""
        return layout.adopt(self.state, "staleness", fill=0, dtype=torch.int16)

    def _leave_fused(self) -> None:
        """The multi-tensor path from now on, ``torch.compile`` having failed: its scratch (the layout, aligned
        for the fused passes, and the parameters adopted into it stay)."""
        self._fused_fallback = self._fused.passes.failed
        self.fused, self._fused = False, None
        self.exchange.flat.grad = None  # the gradients are the parameters' from now on
        self._work = [self._layout.zeros() for _ in range(2)]
        if isinstance(self._mask_fn, BernoulliMask):
            self._mask_fn.passes = None  # the eager draw

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
        self._layout, self._last_draw = None, None
        self.compress_ratio = extra["compress_ratio"]
        self.seed = int(extra["seed"])  # the masks are a function of it: resumed runs redraw the same ones
        self.exchange.pending = {}

    def _age_from_freshness(self) -> None:
        """A v2 state saved with the freshness r itself (one float per element): its age, kept now."""
        for group in self.param_groups:
            for p in group["params"]:
                if "freshness" in self.state.get(p, {}):
                    self.state[p]["staleness"] = age_of_freshness(self.state[p].pop("freshness"), group["beta3"])

    # -- the step -------------------------------------------------------------------

    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        loss, grads = self._local_gradients(closure)  # step 1: the local gradients (base.py)
        if grads is None:  # skipped on every rank
            return loss
        t = self._step = self._step + 1
        sel = self._selection(t)  # step 3: the mask M_t (masks.py)
        averages = self.exchange.start(sel, grads)  # step 4 starts: the selected momentum goes out (exchange.py)
        self._update(t, sel, grads, averages)  # steps 2 and 5-7, step 4 ending between them (slamb_update.py)
        if (t - 1) % self.sync_interval == 0:  # step 8: the parameters averaged (averaging.py)
            self._sync_params()
        self._end_step(t)
        return loss

    def _local_gradients(self, closure):
        """Step 1; where the step fails or is skipped, the exchanges DDP's hook started are dropped."""
        if self._fused is not None and self._fused.passes.failed is not None:
            self._leave_fused()  # a graph failed to compile after others of the last step had run: it ran eagerly
        try:
            loss, grads = self._open_step(closure)
        except BaseException:
            self.exchange.cancel()
            raise
        if grads is None:
            self.exchange.cancel()
        return loss, grads

    def _screened(self, have: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The fused path, once its layout holds exactly the parameters with gradients: the flat gradient buffer
        it gathers anyway (:meth:`_gradients` then finds them in place). Before the update writes anything, so
        the decision still precedes every change of state."""
        if self._fused is None or self._layout_ids != have:
            return None
        return [self._fused.flat.grads(grads)]

    def _gradients(self, screened) -> list[torch.Tensor]:
        """The fused path's are views of its flat gradient buffer, gathered once: by the screen, or here."""
        if self._fused is None:
            return super()._gradients(screened)
        if screened is None:
            self._fused.flat.grads(super()._gradients(None))
        return self._fused.flat.grad_views

    def _update(self, t: int, sel: Selection, grads, averages) -> None:
        """Steps 2 and 4-7 (:func:`slamb_update_`); where ``torch.compile`` fails, on the multi-tensor path."""
        groups = [(lo, hi, SlambHyper.of(self.param_groups[gi], t)) for gi, lo, hi in self._layout.groups]

        def update():
            slamb_update_(self._layout, sel, grads, self._flat["exp_avg"], self._flat["exp_avg_sq"], self._age,
                          groups, variant=self.variant, n=comm.world_size(self.process_group), averages=averages,
                          work=self._work, foreach=self.foreach, fused=self._fused, shards=self.shards,
                          ledger=self.ledger)
        try:
            update()
        except fused_passes.CompileFailed:  # warned; nothing changed but the marks, which step 6 makes 0
            self._leave_fused()
            update()

    def _end_step(self, t: int) -> None:
        self._last_draw = (t, self.compress_ratio)
        # no step keeps its draw alive (last_sync_mask() redraws it); with overlap the next step's is drawn now
        self._drawn = None
        self._draw_next()
        self.ledger.end_step()

    def _sync_params(self) -> None:
        average_tensors_(self._layout.params, process_group=self.process_group, ledger=self.ledger)
