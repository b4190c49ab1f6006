"""DGC: Deep Gradient Compression (Lin et al., ICLR 2018) over torch.distributed.

Momentum SGD whose workers exchange only the largest entries of a locally
accumulated update. Step t of worker i (the spec: baselines.md, "DGC"):

1. (optional) local clipping: the local gradient is scaled so that its norm
   is at most ``clip_norm / sqrt(n)`` (the paper's rule for clipping before
   accumulation, so that the sum of n workers keeps the usual bound);
2. momentum correction and local accumulation, per element of every tensor
   with ``dim() > 1``: ``u = m u + g; acc = acc + u`` (Nesterov:
   ``u = (u + g) m; acc = acc + u + g``);
3. sparsification of ``acc`` per tensor: about ``k = ceil(density * numel)``
   entries chosen by a sampled threshold (:mod:`slamb.compression.topk`);
4. momentum factor masking: where an entry is sent, ``acc`` and ``u`` are
   zeroed (``acc`` keeps the fp16 rounding error when values travel in fp16);
5. exchange: every rank's (values, indices) all-gathered, summed into a
   dense tensor in rank order, divided by n; tensors with ``dim() <= 1`` are
   all-reduced densely (then get momentum after averaging, as in DGC's code);
6. update ``p -= lr * (averaged sparse gradient + weight-decay direction)``
   with plain SGD: the momentum is already inside the accumulation.

Choices, each named:

* Weight decay follows DGC's own ``DGCSGD``: ``wd * p`` is identical on every
  rank, so it is neither accumulated nor sent; it gets its own momentum
  buffer (``decay_momentum``) and is added to the averaged sparse gradient.
  By linearity this equals momentum SGD on ``g + wd * p`` at density 1.
* Density 1 means no compression (DGC's ``compress_ratio < 1`` test): every
  tensor is all-reduced and momentum applies after averaging, which is
  exactly ``torch.optim.SGD`` on averaged gradients. When the density returns
  to 1 after sparse steps, the pending residuals and local momenta are
  averaged once (kind ``"residual"``) so nothing accumulated is lost.
* Variable k per worker: the ranks first all-gather their counts (one int64
  each, kind ``"control"``), then every rank pads its values and indices to
  the largest count and all-gathers them (kinds ``"sparse_values"``,
  ``"sparse_indices"``). The ledger records the padded payloads, which is
  what crosses the wire. Indices are positions in the flat concatenation of
  the compressed tensors, so one pair of collectives serves all of them.
* The exchange happens in :meth:`step`, not in a DDP comm hook: the clipping
  of step 1 needs the whole local gradient, the non-finite decision must be
  agreed before any accumulator changes, and the threshold search needs host
  synchronisations that would stall the autograd thread inside a hook. So
  :meth:`ddp_comm_hook` returns the package's ``no_comm_hook`` (DDP sends
  nothing) and the step runs three collectives in all, whatever the number
  of tensors, plus one dense all-reduce.
* The sum of the gathered entries runs rank by rank (each rank's indices are
  distinct), so it is the same to the last bit on every rank and device:
  parameters never drift apart.
* The density is set per epoch: ``opt.begin_epoch(e)`` takes
  ``warmup_densities[e]`` for the first epochs, then ``density`` (the
  target); ``opt.density = x`` sets it directly. Default warm-up: the reference code's
  (0.25, 0.063, 0.015, 0.004), then 0.001; pass ``warmup_densities=()`` for
  none (DGC's ImageNet runs).
* The sample start of the threshold estimate comes from a generator owned by
  the optimizer (``seed``), saved in ``state_dict()``.

The all-gather costs ``(n - 1) * k`` per rank, so DGC's volume grows with the
number of workers (the paper's known limit), unlike an all-reduce.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..compression.topk import num_selected, sampled_topk_mask
from ..ddp import no_comm_hook
from .checks import check_count, check_lr, check_range
from .base import LocalStateOptimizer, eager_under_compile
from .flat import FlatLayout, check_layouts_agree, params_with_grad

DEFAULT_WARMUP = (0.25, 0.063, 0.015, 0.004)


def momentum_direction_(u: torch.Tensor, g: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Advance the momentum ``u`` by ``g`` in place; return the update direction.

    DGC's form: plain ``u = m u + g`` (direction ``u``, returned as ``u``
    itself); Nesterov ``u = (u + g) m`` (direction ``u + g``). Both equal
    ``torch.optim.SGD``'s directions, whose buffer is ``u / m`` in the Nesterov case.
    """
    if nesterov:
        u.add_(g).mul_(momentum)
        return u + g
    return u.mul_(momentum).add_(g)


class DGC(LocalStateOptimizer):
    """Deep Gradient Compression over torch.distributed (any backend, any device, or no process group).

    Per parameter group: ``lr``, ``momentum``, ``nesterov``, ``weight_decay``.
    For the whole optimizer: ``density`` (the target fraction of each
    compressed tensor sent per step), ``warmup_densities`` (per-epoch
    densities before the target; see :meth:`begin_epoch`), ``sample_ratio``
    (fraction of a tensor sampled for the threshold, >= 0.01),
    ``density_bounds`` (accepted count range as multiples of k, DGC's
    (0.8, 1.3)), ``max_adjust_iters`` (threshold corrections before the exact
    top-k fallback), ``momentum_masking``, ``clip_norm`` (None: no clipping),
    ``fp16_values``, ``int32_indices``, ``seed``, ``process_group``,
    ``nonfinite`` (as in :class:`slamb.SLAMB`).

    Tensors with ``dim() > 1`` are compressed; the others are all-reduced.
    Wrap the model with :func:`slamb.wrap_model` (DDP broadcasts the initial
    parameters and sends no gradients) or call ``backward()`` on an unwrapped
    model: gradients must be local. All parameters must share one device
    and dtype; the set with gradients at the first step is fixed then (a
    later missing gradient counts as zero; a parameter whose first gradient
    comes later joins the layout on every rank). State is per rank (local
    momentum and residuals): save and load one optimizer state per rank.
    """

    state_key = "dgc"

    def __init__(
        self,
        params,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        density: float = 0.001,
        warmup_densities=DEFAULT_WARMUP,
        sample_ratio: float = 0.01,
        density_bounds: tuple[float, float] = (0.8, 1.3),
        max_adjust_iters: int = 10,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        fp16_values: bool = False,
        int32_indices: bool = False,
        seed: int = 0,
        process_group=None,
        nonfinite: str = "raise",
        ledger: comm.CommLedger | None = None,
    ):
        check_range("density", density, 0.0, 1.0, lo_open=True)
        if isinstance(warmup_densities, (str, bytes)) or not hasattr(warmup_densities, "__iter__"):
            raise ValueError(f"invalid warmup_densities={warmup_densities!r}: must be a list of per-epoch "
                             "densities in (0, 1], or () for no warm-up")
        warmup_densities = tuple(warmup_densities)
        for e, d in enumerate(warmup_densities):
            check_range(f"warmup_densities[{e}]", d, 0.0, 1.0, lo_open=True)
        check_range("sample_ratio", sample_ratio, 0.01, 1.0)
        if not (isinstance(density_bounds, (tuple, list)) and len(density_bounds) == 2):
            raise ValueError(f"invalid density_bounds={density_bounds!r}: must be a pair (lower, upper) with "
                             "0 < lower <= 1 <= upper, e.g. DGC's (0.8, 1.3)")
        check_range("density_bounds[0]", density_bounds[0], 0.0, 1.0, lo_open=True)
        check_range("density_bounds[1]", density_bounds[1], 1.0)
        check_count("max_adjust_iters", max_adjust_iters, minimum=0)
        if clip_norm is not None:
            check_range("clip_norm", clip_norm, 0.0, lo_open=True)
        for name, flag in (("momentum_masking", momentum_masking), ("fp16_values", fp16_values),
                           ("int32_indices", int32_indices)):
            if not isinstance(flag, bool):
                raise ValueError(f"invalid {name}={flag!r}: must be True or False")
        if not isinstance(seed, int):
            raise ValueError(f"invalid seed={seed!r}: must be an integer")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)
        self._setup(process_group=process_group, nonfinite=nonfinite, ledger=ledger)
        self.target_density = float(density)
        self.warmup_densities = warmup_densities
        self.sample_ratio = float(sample_ratio)
        self.density_bounds = (float(density_bounds[0]), float(density_bounds[1]))
        self.max_adjust_iters = max_adjust_iters
        self.momentum_masking = momentum_masking
        self.clip_norm = clip_norm
        self.value_dtype = torch.float16 if fp16_values else None
        self.index_dtype = torch.int32 if int32_indices else torch.int64
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.density = self.density_at(0)
        self._sparse: FlatLayout | None = None
        self._dense: FlatLayout | None = None
        self._sparse_pending = False  # local residuals/momenta exist (a compressed step ran since density 1)
        self._last: dict | None = None

    # -- settings -----------------------------------------------------------------

    @property
    def density(self) -> float:
        return self._density

    @density.setter
    def density(self, value: float) -> None:
        check_range("density", value, 0.0, 1.0, lo_open=True)
        self._density = float(value)

    def density_at(self, epoch: int) -> float:
        """The warm-up schedule: ``warmup_densities[epoch]`` while it lasts, then the target density."""
        check_count("epoch", epoch, " (epochs count from 0)", minimum=0)
        return self.warmup_densities[epoch] if epoch < len(self.warmup_densities) else self.target_density

    def begin_epoch(self, epoch: int) -> float:
        """Call at the start of each epoch (0-based); sets and returns the density of that epoch."""
        self.density = self.density_at(epoch)
        self.epoch = epoch
        return self.density

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_lr(g["lr"])
        check_range("momentum", g["momentum"], 0.0, 1.0, hi_open=True)
        check_range("weight_decay", g["weight_decay"], 0.0)
        if not isinstance(g["nesterov"], bool):
            raise ValueError(f"invalid nesterov={g['nesterov']!r}: must be True or False")
        if g["nesterov"] and g["momentum"] == 0:
            raise ValueError("invalid nesterov=True with momentum=0: Nesterov needs a momentum in (0, 1)")

    # -- inspection ---------------------------------------------------------------

    def ddp_comm_hook(self):
        return None, no_comm_hook

    def last_exchange(self) -> dict | None:
        """What the last compressed step sent and received (None before one ran).

        ``density``; per compressed tensor ``k`` and ``counts`` (this rank's);
        ``sent`` (this rank's total), ``counts_by_rank``, ``padded`` (the count
        every rank sent, padding included); ``indices`` / ``values`` (this
        rank's, flat positions over the compressed tensors, values in their
        wire dtype); ``averaged`` (the flat averaged sparse gradient, the same
        on every rank; a buffer reused by the next step); ``exact`` (tensors
        that fell back to an exact top-k) and ``passes`` (threshold passes).
        """
        return self._last

    # -- state ----------------------------------------------------------------------

    def _build(self, ids: list[int] | None = None) -> None:
        """Fix the two flat layouts; adopt per-parameter state already present (a loaded checkpoint)."""
        everything = self._all_params()
        ids = params_with_grad(self) if ids is None else ids
        if not ids:
            raise ValueError("DGC: no parameter has a gradient: nothing to optimize")
        sparse_ids = [i for i in ids if everything[i].dim() > 1]
        dense_ids = [i for i in ids if everything[i].dim() <= 1]
        self._sparse = FlatLayout.of(self, sparse_ids) if sparse_ids else None
        self._dense = FlatLayout.of(self, dense_ids) if dense_ids else None
        devices = {lay.device for lay in (self._sparse, self._dense) if lay is not None}
        dtypes = {lay.dtype for lay in (self._sparse, self._dense) if lay is not None}
        if len(devices) > 1 or len(dtypes) > 1:
            raise ValueError(f"parameters span devices {sorted(map(str, devices))} and dtypes "
                             f"{sorted(map(str, dtypes))}: create one DGC optimizer per device/dtype")
        if self._sparse is not None and self.index_dtype == torch.int32 and self._sparse.numel >= 2**31:
            raise ValueError(f"int32_indices=True, but the compressed tensors hold {self._sparse.numel} elements, "
                             "more than int32 positions can address: use int32_indices=False")
        layouts = (self._sparse, self._dense)
        start = [p for lay in layouts if lay is not None for p in lay.params] if self._step == 0 else None
        check_layouts_agree(layouts, ledger=self.ledger, group=self.process_group, who="DGC", start=start)
        self._flat = {}
        for lay, keys in ((self._sparse, ("momentum", "accumulation", "decay_momentum")),
                          (self._dense, ("momentum",))):
            for key in keys if lay is not None else ():
                self._flat[(lay is self._sparse, key)] = lay.adopt(self.state, key)
        if self._sparse is not None:
            self._avg = self._sparse.zeros()
            self._mask = self._sparse.zeros(torch.bool)
        self._layout_ids = ids

    def _layout_params(self) -> list[torch.Tensor]:
        return [p for lay in (self._sparse, self._dense) if lay is not None for p in lay.params]

    per_rank_reason = "each worker keeps its own residuals and momenta"

    def _extra_state(self) -> dict:
        return {"epoch": self.epoch, "density": self.density, "sparse_pending": self._sparse_pending,
                "generator": self.generator.get_state()}

    def _load_extra_state(self, extra: dict) -> None:
        self.epoch = int(extra["epoch"])
        self.density = extra["density"]
        self._sparse_pending = bool(extra["sparse_pending"])
        self.generator.set_state(extra["generator"].to("cpu", torch.uint8))  # a CPU generator's state
        self._last = None

    # -- the step -------------------------------------------------------------------

    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        loss, flat_grads = self._open_step(closure)
        if flat_grads is None:
            return loss
        sparse, dense = self._sparse, self._dense
        live = [lay for lay in (sparse, dense) if lay is not None]
        grads, at = {}, 0
        for lay in live:
            grads[lay is sparse], at = flat_grads[at:at + len(lay.params)], at + len(lay.params)

        self._step += 1
        n = comm.world_size(self.process_group)
        compress = sparse is not None and self.density < 1.0
        flat = {key: (sparse if key else dense).flatten(gs) for key, gs in grads.items()}  # copies: p.grad stays
        if self.clip_norm is not None:  # step 1
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(f, dtype=torch.float32) for f in flat.values()]))
            coef = torch.clamp((self.clip_norm / math.sqrt(n)) / (total + 1e-6), max=1.0)
            for f in flat.values():
                f.mul_(coef)

        on_average = [key for key in (False, True) if key in flat and not (key and compress)]
        if on_average:  # dense tensors (and, at density 1, all of them): averaged, then momentum
            self._average_dense([flat[key] for key in on_average])
            pending = self._flush_residuals() if True in on_average and self._sparse_pending else None
            for key in on_average:
                self._dense_update(sparse if key else dense, key, flat[key], pending if key else None)
        if compress:  # steps 2-6
            self._compressed_update(flat[True], n)
        self.ledger.end_step()
        return loss

    def _average_dense(self, parts: list[torch.Tensor]) -> None:
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
        wire = buf if self.value_dtype is None else buf.to(self.value_dtype)
        comm.all_reduce_mean_(wire, kind="grads", ledger=self.ledger, group=self.process_group)
        if wire is not buf:
            buf.copy_(wire)
        if len(parts) > 1:
            torch._foreach_copy_(parts, list(buf.split([p.numel() for p in parts])))

    def _flush_residuals(self) -> torch.Tensor:
        """Back to density 1 after compressed steps: average the local momenta, return the mean residual."""
        u, acc, decay = (self._flat[(True, k)] for k in ("momentum", "accumulation", "decay_momentum"))
        buf = torch.cat([u + decay, acc])
        comm.all_reduce_mean_(buf, kind="residual", ledger=self.ledger, group=self.process_group)
        u.copy_(buf[:u.numel()])
        decay.zero_()
        acc.zero_()
        self._sparse_pending = False
        return buf[u.numel():]

    def _dense_update(self, layout: FlatLayout, key: bool, g: torch.Tensor, pending: torch.Tensor | None) -> None:
        u = self._flat[(key, "momentum")]
        g = g.to(u.dtype)  # bf16 or fp16 gradients: the direction in the fp32 momentum's arithmetic
        for gi, lo, hi in layout.groups:
            group, span = self.param_groups[gi], layout.span(lo, hi)
            params = layout.params[lo:hi]
            if group["weight_decay"] != 0:
                torch._foreach_add_(layout.views(g[span], lo, hi), params, alpha=group["weight_decay"])
            d = momentum_direction_(u[span], g[span], group["momentum"], group["nesterov"])
            if pending is not None:
                d = d + pending[span]
            torch._foreach_add_(params, layout.views(d, lo, hi), alpha=-group["lr"])

    def _compressed_update(self, g: torch.Tensor, n: int) -> None:
        layout = self._sparse
        u, acc, decay = (self._flat[(True, k)] for k in ("momentum", "accumulation", "decay_momentum"))
        for gi, lo, hi in layout.groups:  # step 2
            group, span = self.param_groups[gi], layout.span(lo, hi)
            acc[span].add_(momentum_direction_(u[span], g[span], group["momentum"], group["nesterov"]))

        ks = [num_selected(numel, self.density) for numel in layout.numels]  # step 3
        lower, upper = self.density_bounds
        sel = sampled_topk_mask(acc.abs(), layout.numels, ks, generator=self.generator,
                                sample_ratio=self.sample_ratio, lower=lower, upper=upper,
                                max_iters=self.max_adjust_iters, out=self._mask)
        mask = sel.mask
        indices = mask.nonzero().view(-1)
        values = acc[indices]
        wire = self.value_dtype or layout.dtype  # the parameters' dtype unless fp16_values
        if wire == acc.dtype:  # step 4
            acc.masked_fill_(mask, 0)
        else:  # the wire's rounding error stays in the accumulator (exact: x - fp16(x) fits in fp32)
            values = values.clamp_(-torch.finfo(wire).max, torch.finfo(wire).max).to(wire)
            acc.index_put_((indices,), acc[indices].sub_(values.to(acc.dtype)))
        if self.momentum_masking:
            u.masked_fill_(mask, 0)

        counts = self._exchange(indices, values, n)  # step 5

        for gi, lo, hi in layout.groups:  # step 6
            group, span = self.param_groups[gi], layout.span(lo, hi)
            params = layout.params[lo:hi]
            d = self._avg[span]
            if group["weight_decay"] != 0:
                decayed = layout.flatten(params).to(decay.dtype).mul_(group["weight_decay"])
                d = d + momentum_direction_(decay[span], decayed, group["momentum"], group["nesterov"])
            torch._foreach_add_(params, layout.views(d, lo, hi), alpha=-group["lr"])
        self._sparse_pending = True
        self._last = dict(density=self.density, k=ks, counts=sel.counts, sent=indices.numel(),
                          counts_by_rank=counts, padded=max(counts), indices=indices, values=values,
                          averaged=self._avg, exact=[i for i, e in enumerate(sel.exact) if e], passes=sel.passes)

    def _exchange(self, indices: torch.Tensor, values: torch.Tensor, n: int) -> list[int]:
        """All-gather every rank's (values, indices) padded to the largest count; average into ``self._avg``."""
        device, group = indices.device, self.process_group
        mine = torch.tensor([indices.numel()], dtype=torch.int64, device=device)
        counts = torch.empty(n, dtype=torch.int64, device=device)
        comm.all_gather_into_tensor(counts, mine, kind="control", ledger=self.ledger, group=group)
        counts = counts.tolist()
        cap = max(counts)
        send_v = torch.zeros(cap, dtype=values.dtype, device=device)
        send_i = torch.zeros(cap, dtype=self.index_dtype, device=device)
        send_v[:indices.numel()] = values
        send_i[:indices.numel()] = indices
        all_v = torch.empty(n * cap, dtype=values.dtype, device=device)
        all_i = torch.empty(n * cap, dtype=self.index_dtype, device=device)
        comm.all_gather_into_tensor(all_v, send_v, kind="sparse_values", ledger=self.ledger, group=group)
        comm.all_gather_into_tensor(all_i, send_i, kind="sparse_indices", ledger=self.ledger, group=group)
        avg = self._avg.zero_()
        for r, c in enumerate(counts):  # rank order: the same sum, bit for bit, on every rank
            lo = r * cap
            avg.index_add_(0, all_i[lo:lo + c].long(), all_v[lo:lo + c].to(avg.dtype))
        avg.div_(n)
        return counts
