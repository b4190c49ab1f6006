"""SLAMB's momentum exchange started from DDP's comm hook, in the manner of
torch's ``PowerSGDState`` + ``powerSGD_hook``: a state object and a hook
``(state, bucket) -> Future`` that DDP calls as backward fills each bucket.

The hook starts steps 2 and 4 of the spec on the selected entries of the
bucket's tensors (their new momentum, all-reduced asynchronously) and leaves
the bucket's gradients as they are: SLAMB sends no gradient. ``step()`` then
drains the exchanges, checks that the gradients did not change since, and
starts the exchange of whatever no bucket covered (:func:`launch`).
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import comm
from ..ddp import in_place
from .masks import Selection


class OverlapState:
    """The exchanges in flight between backward and ``step()``, and what the hook needs to start them.

    ``grad_scale``: the loss scale backward's gradients carry and ``step()``'s do not (see
    :class:`slamb.SLAMB`). ``next_selection`` returns the coming step's mask (drawn at the end of the
    previous step, so the hook draws nothing). The optimizer :meth:`bind` s its layout once it is fixed;
    until then the hook sends nothing.
    """

    def __init__(self, *, process_group, ledger: comm.CommLedger, comm_dtype, param_groups: list,
                 next_selection: Callable[[], Selection]):
        self.process_group, self.ledger, self.comm_dtype = process_group, ledger, comm_dtype
        self.param_groups, self.next_selection = param_groups, next_selection
        self.grad_scale = 1.0
        self.index: dict[int, int] | None = None  # id(parameter) -> place in the layout
        self.momenta: list[torch.Tensor] = []  # per-parameter views of the flat momentum
        self.group_of: list[int] = []
        # parameter places -> (selection, exchange, gradient norms seen)
        self.pending: dict[tuple[int, ...], tuple[Selection, comm.MeanWork, torch.Tensor]] = {}

    def bind(self, params: list[torch.Tensor], momenta: list[torch.Tensor], group_of: list[int]) -> None:
        self.index = {id(p): i for i, p in enumerate(params)}
        self.momenta, self.group_of = momenta, group_of
        self.pending = {}

    def drain(self) -> dict:
        pending, self.pending = self.pending, {}
        return pending


def discard(pending: dict) -> None:
    """Finish exchanges whose result is not used: every rank ran them, so every rank waits."""
    for _, work, _ in pending.values():
        work.wait()


def launch(state: OverlapState, sel: Selection, ids: list[int], gs: list[torch.Tensor]) -> comm.MeanWork:
    """Steps 2 and 4 on the selected entries of parameters ``ids``: their new momentum, all-reduced.

    ``gs``: the selected entries of their gradients (``sel.take``). It reads only the old momentum and the
    gradients, so it can run during backward; the dense momentum update of ``step()`` then recomputes these
    entries and the average overwrites them.
    """
    ms = sel.take([state.momenta[i] for i in ids], ids)
    weights = [1 - state.param_groups[state.group_of[i]]["betas"][0] for i in ids]
    if len(set(weights)) == 1:
        new = torch._foreach_lerp(ms, gs, weights[0])
    else:
        new = [torch.lerp(m, g, w) for m, g, w in zip(ms, gs, weights)]
    return comm.all_reduce_mean_(torch.cat(new), kind="momentum", ledger=state.ledger, group=state.process_group,
                                 async_op=True, comm_dtype=state.comm_dtype)


def grads_changed(state: OverlapState, pending: dict, grads: list[torch.Tensor], sel: Selection) -> bool:
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
            sel = state.next_selection()
            gs = sel.take(grads, ids)
            if state.grad_scale != 1.0:
                gs = torch._foreach_mul(gs, 1.0 / state.grad_scale)  # as unscaling will before step()
            norms = torch.stack(torch._foreach_norm(gs))
            state.pending[key] = (sel, launch(state, sel, ids, gs), norms)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
