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
  (warning once), and starts the rest (:func:`launch`; where the whole
  exchange is left and the layout is a fused one, :func:`launch_flat`: one
  gather by layout positions, whatever the number of tensors);
* :meth:`MomentumExchange.finish`, called by the update once step 2 is done,
  waits, writes the averages into the momentum and returns them; it also
  watches the first steps for gradients averaged before SLAMB saw them.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from .. import comm
from ..ddp import in_place
from .masks import LayoutRuns, Selection

# first steps at which identical momenta on every rank show gradients averaged before SLAMB saw them
ALIKE_STEPS = 3


@dataclasses.dataclass
class Sent:
    """One exchange in flight: the parameter places it averages, in packed order (:func:`packing`), and where it
    gathered by layout positions (:func:`launch_flat`), those positions and the flat gradient it read."""
    ids: list[int]
    work: comm.MeanWork
    positions: torch.Tensor | None = None
    grad: torch.Tensor | None = None


@dataclasses.dataclass
class FlatMomentum:
    """A fused layout's momentum as one buffer, its :class:`LayoutRuns` and its parameter groups' runs
    (``FlatLayout.groups``): step 4 by layout positions."""
    momentum: torch.Tensor
    runs: LayoutRuns
    groups: list[tuple[int, int, int]]


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
        # parameter places -> (selection, exchange, gradient norms seen)
        self.pending: dict[tuple[int, ...], tuple[Selection, comm.MeanWork, torch.Tensor]] = {}
        self.warned_fallback = False
        self.alike_steps: int | None = 0  # first steps whose momenta were the same on every rank; None: done

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

    def start(self, sel: Selection, grads: list[torch.Tensor], flat_grad: torch.Tensor | None = None) -> list[Sent]:
        """Step 4 starts: the exchanges of ``sel``'s momentum.

        The hook's exchanges of another mask (k changed after backward) are dropped; when the gradients
        changed since the hook saw them (on any rank), every rank drops them all and sends again.
        ``flat_grad``: the gradients as the fused layout's flat buffer, where there is one.
        """
        pending, self.pending = self.pending, {}
        discard({key: e for key, e in pending.items() if e[0] is not sel})
        pending = {key: e for key, e in pending.items() if e[0] is sel}
        if pending and grads_changed(self, pending, grads, sel):
            discard(pending)
            pending = {}
            if not self.warned_fallback:
                self.warned_fallback = True
                warnings.warn("SLAMB(overlap=True): gradients changed between backward and step() (clipping, or "
                              "a loss scale not given as opt.grad_scale); this step and any such later one run "
                              "the plain exchange instead (same numbers, their momentum bytes sent twice)",
                              stacklevel=3)
        works = [Sent(packing(sel, key)[0], work) for key, (_, work, _) in pending.items()]
        if comm.world_size(self.process_group) > 1:  # the rest of the selected momentum goes out now
            if not works and self.flat is not None and flat_grad is not None:
                return [launch_flat(self, sel, flat_grad)]
            covered = {i for sent in works for i in sent.ids}
            rest = [i for i in range(len(self.momenta)) if i not in covered]
            if rest:
                works.append(Sent(packing(sel, rest)[0],
                                  launch(self, sel, rest, sel.take([grads[i] for i in rest], rest))))
        return works

    def finish(self, sel: Selection, works: list[Sent], grads=None) -> list[tuple[list[int], torch.Tensor]]:
        """Step 4 ends: m[M_t] = the averages; returns them as (parameter places in packed order, averages).

        ``grads``: the step's gradients where step 2 has not run yet (the fused path's order): the first
        steps' check of the averages against this rank's own momentum then recomputes that momentum."""
        alike = self.alike_steps is not None
        means = []
        for sent in works:
            ids = sent.ids
            mean = sent.work.wait().to(self.momenta[ids[0]].dtype)
            if alike:
                alike = self._same_as_local(self._local(sel, sent, grads), mean)
            if sent.positions is not None:
                self.flat.momentum.index_copy_(0, sent.positions, mean)
            else:
                sel.put_([self.momenta[i] for i in ids], mean.split([sel.counts[i] for i in ids]), ids)
            means.append((ids, mean))
        if self.alike_steps is not None and comm.world_size(self.process_group) > 1:
            self._count_alike(alike)
        return means

    def _local(self, sel: Selection, sent: Sent, grads=None) -> torch.Tensor:
        """This rank's momentum entries that ``sent`` averages; with ``grads`` (step 2 not run yet), their step 2
        as the launch computed it."""
        ids = sent.ids
        if sent.positions is not None:
            local = self.flat.momentum.index_select(0, sent.positions)
            return local if grads is None else step_two_(self, sel, local, sent.grad, sent.positions)
        ms = sel.take([self.momenta[i] for i in ids], ids)
        if grads is not None:
            ms = [torch.lerp(m, g.to(m.dtype), 1 - self.groups[i]["betas"][0])
                  for i, m, g in zip(ids, ms, sel.take([grads[i] for i in ids], ids))]
        return torch.cat(ms)

    def _same_as_local(self, local: torch.Tensor, mean: torch.Tensor) -> bool:
        """Whether this rank's momentum entries equal their average: to the rounding of the exchange."""
        if self.comm_dtype == torch.int8:  # quantised per chunk: off by up to a scale of the chunk's largest entry
            return bool(torch.allclose(local, mean, rtol=0.0, atol=2 * float(local.abs().max()) / 127))
        rtol = 8 * torch.finfo(self.wire_dtype).eps
        return bool(torch.allclose(local, mean, rtol=rtol, atol=0.0))

    def _count_alike(self, alike: bool) -> None:
        """Warn once when the first steps' momenta were the same on every rank before averaging.

        Costs nothing on the wire (the averages are those of step 4); stops at the first step that differs.
        """
        if not alike:
            self.alike_steps = None
            return
        self.alike_steps += 1
        if self.alike_steps == ALIKE_STEPS:
            self.alike_steps = None
            warnings.warn(
                f"SLAMB: every rank held the same momentum before averaging at its first {ALIKE_STEPS} steps: the "
                "gradients were already averaged across ranks (plain DDP, or a framework's trainer), or every rank "
                "trains on the same data. SLAMB needs each rank's local gradients, else it sends its momentum on top "
                "of a gradient all-reduce: wrap the model with slamb.wrap_model(model, optimizer) (or use the "
                "slamb.integrations trainer) instead of DistributedDataParallel.", stacklevel=3)


def discard(pending: dict) -> None:
    """Finish exchanges whose result is not used: every rank ran them, so every rank waits."""
    for _, work, _ in pending.values():
        work.wait()


def packing(sel: Selection, ids) -> tuple[list[int], tuple[tuple[str, int], ...]]:
    """The packed buffer of parameters ``ids``: their order in it (always-averaged tensors first, each part in
    ``ids`` order) and its kind runs for the ledger, ``(("momentum_dense", entries), ("momentum", entries))``.

    One buffer, one collective: the runs only apportion its bytes (see :func:`slamb.comm.all_reduce_mean_`
    for int8, which sends each run as a quantised mean of its own)."""
    dense = [i for i in ids if sel.dense[i]]
    sampled = [i for i in ids if not sel.dense[i]]
    return dense + sampled, (("momentum_dense", sum(sel.counts[i] for i in dense)),
                             ("momentum", sum(sel.counts[i] for i in sampled)))


def launch(state: MomentumExchange, sel: Selection, ids: list[int], gs: list[torch.Tensor]) -> comm.MeanWork:
    """Steps 2 and 4 on the selected entries of parameters ``ids``: their new momentum, all-reduced.

    ``gs``: the selected entries of their gradients (``sel.take``). It reads only the old momentum and the
    gradients, so it can run during backward; the dense momentum update of ``step()`` then recomputes these
    entries and the average overwrites them. The average comes back in :func:`packing`'s order.
    """
    order, kinds = packing(sel, ids)
    g_of = dict(zip(ids, gs))
    gs = [g_of[i] for i in order]
    ms = sel.take([state.momenta[i] for i in order], order)
    gs = [g.to(m.dtype) for g, m in zip(gs, ms)]  # bf16 or fp16 gradients: the fp32 momentum's arithmetic
    weights = [1 - state.groups[i]["betas"][0] for i in order]
    if len(set(weights)) == 1:
        new = torch._foreach_lerp(ms, gs, weights[0])
    else:
        new = [torch.lerp(m, g, w) for m, g, w in zip(ms, gs, weights)]
    return comm.all_reduce_mean_(torch.cat(new), kind=kinds, ledger=state.ledger, group=state.process_group,
                                 async_op=True, comm_dtype=state.wire_dtype)


def step_two_(state: MomentumExchange, sel: Selection, m: torch.Tensor, grad: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """Step 2 of the momentum entries ``m`` gathered at ``positions`` of the flat layout (in :func:`packing`'s
    order), in place: m + (1 - b1) (g - m), one lerp as :func:`launch`'s. Where the parameter groups' b1
    differ, one lerp per group on each of its two slices of the packed order (its always-averaged entries,
    its sampled ones), found from the host's counts."""
    g = grad.index_select(0, positions).to(m.dtype)  # bf16 or fp16 gradients: the fp32 momentum's arithmetic
    runs = state.flat.groups
    weights = [1 - state.groups[lo]["betas"][0] for _, lo, _ in runs]
    if len(set(weights)) == 1:
        return m.lerp_(g, weights[0])
    dense_at, sampled_at = 0, sum(sel.counts[i] for i, d in enumerate(sel.dense) if d)
    for (_, lo, hi), w in zip(runs, weights):
        for dense, start in ((True, dense_at), (False, sampled_at)):
            end = start + sum(sel.counts[i] for i in range(lo, hi) if sel.dense[i] == dense)
            m[start:end].lerp_(g[start:end], w)
            dense_at, sampled_at = (end, sampled_at) if dense else (dense_at, end)
    return m


def launch_flat(state: MomentumExchange, sel: Selection, grad: torch.Tensor) -> Sent:
    """:func:`launch` of every parameter by the fused layout's positions (:meth:`Selection.layout_positions` with
    the always-averaged entries): one gather of the momentum and one of ``grad`` (the flat gradient buffer),
    whatever the number of tensors. The packed buffer is :func:`launch`'s (the same entries in the same order),
    so the bytes sent and the averages are the same."""
    flat = state.flat
    positions = sel.layout_positions(flat.runs, with_dense=True)
    new = step_two_(state, sel, flat.momentum.index_select(0, positions), grad, positions)
    ids, kinds = packing(sel, range(len(state.momenta)))
    work = comm.all_reduce_mean_(new, kind=kinds, ledger=state.ledger, group=state.process_group, async_op=True,
                                 comm_dtype=state.wire_dtype)
    return Sent(ids, work, positions, grad)


def grads_changed(state: MomentumExchange, pending: dict, grads: list[torch.Tensor], sel: Selection) -> bool:
    """Whether, on any rank, the gradients of the overlapped exchanges differ from those backward gave them
    (clipping, an unscaling other than ``grad_scale``): a rank-agreed decision, one host read."""
    seen = torch.cat([norms for _, _, norms in pending.values()])
    now = torch.cat([torch.stack(torch._foreach_norm(sel.take([grads[i] for i in ids], ids))) for ids in pending])
    changed = ((seen - now).abs() > 1e-5 * now).any()
    return comm.agree_any(changed, ledger=state.ledger, group=state.process_group)


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
            gs = sel.take(grads, ids)
            if state.grad_scale != 1.0:
                gs = torch._foreach_mul(gs, 1.0 / state.grad_scale)  # as unscaling will before step()
            norms = torch.stack(torch._foreach_norm(gs))
            state.pending[key] = (sel, launch(state, sel, ids, gs), norms)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
