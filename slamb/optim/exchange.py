"""Step 4 of SLAMB (``docs/algorithm.md``): m[M_t] = the mean over the workers
of m[M_t], one asynchronous all-reduce of the packed selected entries.

The packed buffer holds the always-averaged tensors' momentum first, then the
sampled entries of the others (:func:`packing`); the ledger records the two
runs of each collective as kinds ``"momentum_dense"`` and ``"momentum"``, the
bytes of each run's entries (:mod:`slamb.comm`), so the compressed share of
the traffic is measured, in every ``comm_dtype``.

:class:`MomentumExchange` holds everything the exchange needs (the group,
the ledger, the wire dtype, per-parameter views of the momentum and their
parameter groups, the coming step's mask) and the exchanges in flight; the
optimizer gives it those at each layout and each draw, and it calls nothing
back. Each step:

* :meth:`MomentumExchange.start` starts what is still to send: with
  ``overlap``, the DDP hook (:func:`overlap_hook`, in the manner of torch's
  ``PowerSGDState`` + ``powerSGD_hook``) has already started each bucket's
  share as backward filled it; ``start`` keeps those whose mask and
  gradients are still the step's, falls back to sending the others again
  (warning once), and starts the rest (:func:`launch`);
* :meth:`MomentumExchange.finish`, called by the update once step 2 is done,
  waits, writes the averages into the momentum and returns them.

On a fused optimizer's layout (:class:`FlatMomentum`) an exchange gathers and
scatters by positions in the flat buffers instead of tensor by tensor
(:func:`launch`), the same packed buffer in a constant number of ops: the
whole exchange by :meth:`slamb.optim.masks.Selection.layout_positions`, and a
DDP bucket whose parameters are consecutive in the layout by its share of
them, its gradients read from the bucket by those positions moved to the
bucket's own offsets (:func:`bucket_positions`). Other buckets go tensor by
tensor.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings

import torch

from .. import comm
from ..ddp import in_place
from .masks import LayoutRuns, Selection, run_shifts, run_steps

@dataclasses.dataclass
class Sent:
    """One exchange in flight: the parameter places it averages, in packed order (:func:`packing`), and where it
    gathered by layout positions (:func:`launch`), those positions in the same order."""
    ids: list[int]
    work: comm.MeanWork
    positions: torch.Tensor | None = None


@dataclasses.dataclass
class Pending:
    """An exchange the DDP hook started: its mask, what it sent, and the norms of the gradients it read (one per
    tensor, or one for the entries it gathered by positions), for :func:`grads_changed`."""
    sel: Selection
    sent: Sent
    norms: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Averages:
    """Step 4 under way (:meth:`MomentumExchange.start`): the exchanges of ``sel``'s momentum in flight. The
    update ends it where its implementation's docstring says (:func:`slamb.optim.slamb_update.slamb_update_`)."""
    exchange: "MomentumExchange"
    sel: Selection
    sent: list[Sent]

    def wait_into(self) -> list[tuple[list[int], torch.Tensor]]:
        """m[M_t] = the averages (:meth:`MomentumExchange.finish`)."""
        return self.exchange.finish(self.sel, self.sent)


@dataclasses.dataclass
class FlatMomentum:
    """A fused layout's momentum as one buffer, with its :class:`LayoutRuns` and each parameter's offset in it:
    step 4 by layout positions. ``grad``: the flat gradient buffer the step gathers its gradients into; None once
    the optimizer runs the multi-tensor path (``torch.compile`` failed), whose gradients are the parameters'."""
    momentum: torch.Tensor
    runs: LayoutRuns
    offsets: list[int]
    grad: torch.Tensor | None
    # a DDP bucket's (first, end, offsets in the bucket) -> its constants (:func:`bucket_positions`)
    buckets: dict = dataclasses.field(default_factory=dict)


class MomentumExchange:
    """The momentum exchange's state: DDP's comm-hook state with ``overlap``, and step 4's either way.

    The momentum travels in ``comm_dtype``, by default the parameters' dtype (the bytes DDP would send for
    their gradients): under bf16 or fp16 parameters the fp32 momentum is rounded to it on the wire.

    ``grad_scale``: the loss scale backward's gradients carry and ``step()``'s do not (see
    :class:`slamb.SLAMB`). ``next_sel``: the coming step's mask, given by the optimizer when it draws it
    (at the end of the previous step, so the hook draws nothing). Until :meth:`bind` gives it the layout,
    the hook sends nothing.
    """

    def __init__(self, *, process_group, ledger: comm.CommLedger, comm_dtype):
        self.process_group, self.ledger, self.comm_dtype = process_group, ledger, comm_dtype
        self.wire_dtype = comm_dtype  # with the layout: comm_dtype, else the parameters' dtype
        self.grad_scale = 1.0
        self.index: dict[int, int] | None = None  # id(parameter) -> place in the layout
        self.momenta: list[torch.Tensor] = []  # per-parameter views of the flat momentum
        self.flat: FlatMomentum | None = None  # the flat momentum, where the layout is a fused one
        self.groups: list[dict] = []  # per parameter, its parameter group (beta1 is read at each launch)
        self.next_sel: Selection | None = None
        self.pending: dict[tuple[int, ...], Pending] = {}  # by the DDP bucket's parameter places
        self.warned_fallback = False

    def bind(self, params: list[torch.Tensor], momenta: list[torch.Tensor], groups: list[dict],
             flat: FlatMomentum | None = None) -> None:
        self.index = {id(p): i for i, p in enumerate(params)}
        self.momenta, self.groups, self.flat = momenta, groups, flat
        self.wire_dtype = self.comm_dtype or params[0].dtype
        self.pending, self.next_sel = {}, None

    def cancel(self) -> None:
        """Finish and drop every exchange in flight (a step that fails or is skipped on every rank)."""
        pending, self.pending = self.pending, {}
        discard(pending)

    @property
    def flat_grad(self) -> torch.Tensor | None:
        """The step's gradients as the fused layout's flat buffer, where there is one."""
        return None if self.flat is None else self.flat.grad

    def start(self, sel: Selection, grads: list[torch.Tensor]) -> Averages:
        """Step 4 starts: the exchanges of ``sel``'s momentum (``grads``: the step's, views of :attr:`flat_grad`
        where there is one).

        The hook's exchanges of another mask (k changed after backward) are dropped; when the gradients
        changed since the hook saw them (on any rank), every rank drops them all and sends again.
        """
        pending, self.pending = self.pending, {}
        discard({key: e for key, e in pending.items() if e.sel is not sel})
        pending = {key: e for key, e in pending.items() if e.sel is sel}
        if pending and grads_changed(self, pending, grads, sel):
            discard(pending)
            pending = {}
            if not self.warned_fallback:
                self.warned_fallback = True
                warnings.warn("SLAMB(overlap=True): gradients changed between backward and step() (clipping, or "
                              "a loss scale not given as opt.grad_scale); this step and any such later one run "
                              "the plain exchange instead (same numbers, their momentum bytes sent twice)",
                              stacklevel=3)
        works = [e.sent for e in pending.values()]
        if comm.world_size(self.process_group) > 1:  # the rest of the selected momentum goes out now
            if not works and self.flat_grad is not None:
                positions = sel.layout_positions(self.flat.runs, with_dense=True)
                works = [launch(self, sel, range(len(self.momenta)), self.flat.momentum.index_select(0, positions),
                                self.flat_grad.index_select(0, positions), positions)]
            else:
                covered = {i for sent in works for i in sent.ids}
                rest = [i for i in range(len(self.momenta)) if i not in covered]
                if rest:
                    order = packing(sel, rest)[0]
                    works.append(launch(self, sel, order, packed(sel, self.momenta, order),
                                        packed(sel, grads, order)))
        return Averages(self, sel, works)

    def finish(self, sel: Selection, works: list[Sent]) -> list[tuple[list[int], torch.Tensor]]:
        """Step 4 ends: m[M_t] = the averages; returns them as (parameter places in packed order, averages)."""
        means = []
        for sent in works:
            ids = sent.ids
            mean = sent.work.wait().to(self.momenta[ids[0]].dtype)
            if sent.positions is not None:
                self.flat.momentum.index_copy_(0, sent.positions, mean)
            else:
                sel.put_([self.momenta[i] for i in ids], mean.split([sel.counts[i] for i in ids]), ids)
            means.append((ids, mean))
        return means


def discard(pending: dict) -> None:
    """Finish exchanges whose result is not used: every rank ran them, so every rank waits."""
    for e in pending.values():
        e.sent.work.wait()


def packing(sel: Selection, ids) -> tuple[list[int], tuple[tuple[str, int], ...]]:
    """The packed buffer of parameters ``ids``: their order in it (always-averaged tensors first, each part in
    ``ids`` order) and its kind runs for the ledger, ``(("momentum_dense", entries), ("momentum", entries))``.

    One buffer, one collective: the runs only apportion its bytes (see :func:`slamb.comm.all_reduce_mean_`
    for int8, which sends each run as a quantised mean of its own)."""
    dense = [i for i in ids if sel.dense[i]]
    sampled = [i for i in ids if not sel.dense[i]]
    return dense + sampled, (("momentum_dense", sum(sel.counts[i] for i in dense)),
                             ("momentum", sum(sel.counts[i] for i in sampled)))


def packed(sel: Selection, tensors: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """The selected entries of ``tensors`` (one per parameter place) of parameters ``order``, packed."""
    return torch.cat(sel.take([tensors[i] for i in order], order))


def step_two_(state: MomentumExchange, sel: Selection, order: list[int], m: torch.Tensor,
              g: torch.Tensor) -> torch.Tensor:
    """Step 2 of packed momentum entries ``m`` (of parameters ``order``, in :func:`packing`'s order) with their
    gradients ``g``, in place: m + (1 - b1) (g - m), one lerp; where the parameter groups' b1 differ, one per
    run of parameters that share it (found from the host's counts)."""
    g = g.to(m.dtype)  # bf16 or fp16 gradients: the fp32 momentum's arithmetic
    weights = [1 - state.groups[i]["betas"][0] for i in order]
    if len(set(weights)) == 1:
        return m.lerp_(g, weights[0])
    start = 0
    for w, run in itertools.groupby(zip(order, weights), key=lambda x: x[1]):
        end = start + sum(sel.counts[i] for i, _ in run)
        m[start:end].lerp_(g[start:end], w)
        start = end
    return m


def launch(state: MomentumExchange, sel: Selection, ids, m: torch.Tensor, g: torch.Tensor,
           positions: torch.Tensor | None = None) -> Sent:
    """Steps 2 and 4 on the selected entries of parameters ``ids``: their new momentum, all-reduced.

    ``m``, ``g``: those entries of the momentum and of the gradients, in :func:`packing`'s order of ``ids``
    (:func:`packed`, or gathered by their ``positions`` in a fused layout, in that order, whatever the number of
    tensors; the same buffer either way, so the same bytes and averages). It reads only the old momentum and
    the gradients, so it can run during backward; the dense momentum update of ``step()`` then recomputes
    these entries and the average overwrites them. ``m`` is overwritten.
    """
    order, kinds = packing(sel, ids)
    work = comm.all_reduce_mean_(step_two_(state, sel, order, m, g), kind=kinds, ledger=state.ledger,
                                 group=state.process_group, async_op=True, comm_dtype=state.wire_dtype)
    return Sent(order, work, positions)


def selected_grads(state: MomentumExchange, sel: Selection, sent: Sent, grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients of the entries ``sent`` averages, read back at ``step()``: by its positions from the flat
    gradient buffer, or tensor by tensor (its exchange did so too, or the step has no flat buffer: a fused
    optimizer that fell back to the multi-tensor path)."""
    if sent.positions is not None and state.flat_grad is not None:
        return state.flat_grad.index_select(0, sent.positions)
    return packed(sel, grads, sent.ids)


def bucket_positions(state: MomentumExchange, sel: Selection, ids: list[int], offsets: list[int]):
    """The entries of a DDP bucket's parameters ``ids`` (consecutive in the fused layout, ascending) that ``sel``
    averages, in :func:`packing`'s order: ``(their layout positions, their positions in the bucket's buffer)``,
    where each parameter's gradient starts at ``offsets`` (same order as ``ids``).

    The bucket's share of the step's packed positions (:meth:`Selection.layout_positions` with the always-averaged
    entries) is two slices of them, found from the host's counts: its always-averaged entries, then its drawn
    ones. The bucket's positions are those moved by each parameter's bucket offset less its layout offset
    (:func:`slamb.optim.masks.run_shifts`)."""
    flat, lo, hi = state.flat, ids[0], ids[-1] + 1
    runs, cut = flat.runs, sel.cut
    key = (lo, hi, tuple(offsets))
    const = flat.buckets.get(key)
    if const is None:
        dense = [i for i in ids if sel.dense[i] and runs.dense_before[i + 1] > runs.dense_before[i]]
        sampled = [i for i in ids if not sel.dense[i]]
        shift = {i: o - flat.offsets[i] for i, o in zip(ids, offsets)}
        device = flat.momentum.device
        const = flat.buckets[key] = (
            torch.tensor([runs.dense_before[i] - runs.dense_before[lo] for i in dense], dtype=torch.long,
                         device=device),
            torch.tensor([2 * i for i in sampled], dtype=torch.long, device=device),
            run_steps([shift[i] for i in dense + sampled], device))
    dense_starts, sampled_cuts, steps = const
    every = sel.layout_positions(runs, with_dense=True)
    nd = runs.n_dense
    d0, d1 = runs.dense_before[lo], runs.dense_before[hi]
    s0, s1 = cut[2 * lo], cut[2 * hi - 1]
    positions = torch.cat([every[d0:d1], every[nd + s0:nd + s1]])
    starts = torch.cat([dense_starts, sel.cuts.index_select(0, sampled_cuts) + (d1 - d0 - s0)])
    return positions, run_shifts(positions.numel(), starts, steps).add_(positions)


def grads_changed(state: MomentumExchange, pending: dict, grads: list[torch.Tensor], sel: Selection) -> bool:
    """Whether, on any rank, the gradients of the overlapped exchanges differ from those backward gave them
    (clipping, an unscaling other than ``grad_scale``): a rank-agreed decision, one host read."""
    seen = torch.cat([e.norms for e in pending.values()])
    now = torch.cat([selected_grads(state, sel, e.sent, grads).norm().reshape(1) if e.sent.positions is not None
                     else torch.stack(torch._foreach_norm(sel.take([grads[i] for i in key], key)))
                     for key, e in pending.items()])
    changed = ((seen - now).abs() > 1e-5 * now).any()
    return comm.agree_any(changed, ledger=state.ledger, group=state.process_group)


def _flat_bucket(state: MomentumExchange, ids: list[int], grads: list[torch.Tensor], buffer: torch.Tensor):
    """Where the bucket's parameters can be gathered by positions (a fused layout, parameters consecutive in it,
    each gradient a contiguous view of the buffer): ``(their places ascending, each one's gradient's offset in
    the bucket's buffer)``, else None."""
    if state.flat is None or sorted(ids) != list(range(min(ids), max(ids) + 1)):
        return None
    base, size = buffer.data_ptr(), buffer.element_size()
    offsets = {}
    for i, g in zip(ids, grads):
        at, rest = divmod(g.data_ptr() - base, size)
        if rest or g.dtype != buffer.dtype or not g.is_contiguous() or at < 0 or at + g.numel() > buffer.numel():
            return None
        offsets[i] = at
    ascending = sorted(ids)
    return ascending, [offsets[i] for i in ascending]


@in_place  # the gradients stay in the bucket: DDP may keep them there (gradient_as_bucket_view)
def overlap_hook(state, bucket):  # no annotations: DDP checks them against its own
    """Start the bucket's share of the momentum exchange; the bucket itself goes back unchanged."""
    if state.index is not None:  # the first step's buckets arrive before the layout exists
        ids, grads = [], []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if id(p) in state.index:
                ids.append(state.index[id(p)])
                grads.append(g)
        if ids:
            key = tuple(ids)
            # a second backward before step() (accumulation outside no_sync) supersedes the first
            if key in state.pending:
                discard({key: state.pending.pop(key)})
            sel = state.next_sel
            flat = _flat_bucket(state, ids, grads, bucket.buffer())
            if flat is not None:
                ascending, offsets = flat
                positions, moved = bucket_positions(state, sel, ascending, offsets)
                g = bucket.buffer().index_select(0, moved)
                if state.grad_scale != 1.0:
                    g.mul_(1.0 / state.grad_scale)  # as unscaling will before step()
                norms = g.norm().reshape(1)
                sent = launch(state, sel, ascending, state.flat.momentum.index_select(0, positions), g, positions)
            else:
                gs = sel.take(grads, ids)
                if state.grad_scale != 1.0:
                    gs = torch._foreach_mul(gs, 1.0 / state.grad_scale)
                norms = torch.stack(torch._foreach_norm(gs))
                order = packing(sel, ids)[0]
                g_of = dict(zip(ids, gs))
                sent = launch(state, sel, order, packed(sel, state.momenta, order), torch.cat([g_of[i] for i in order]))
            state.pending[key] = Pending(sel, sent, norms)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
