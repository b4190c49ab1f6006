"""The model of a run whose ranks drift apart: their average.

Under SLAMB each rank updates its own copy of the parameters from its own
moments; the copies meet only at the parameter syncs (every H steps). The
model the run produces, the one to evaluate, export and ``save_pretrained``,
is the ranks' average, and with BatchNorm the average of the running
statistics as well: each rank's statistics describe only its own data shard.
"""
from __future__ import annotations

import torch

from . import comm
from .ddp import reshard
from .sharding import local, sharded_topology


def _floating(tensors) -> list[torch.Tensor]:
    return [t for t in tensors if t is not None and t.is_floating_point()]


# bytes staged per all-reduce: one flat copy of a whole model would be a second copy of it in memory
BUCKET_BYTES = 64 << 20


def _buckets(tensors, cap: int):
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > cap:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def average_tensors_(tensors, *, process_group=None, ledger: comm.CommLedger | None = None,
                     kind: str = "params", bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace every tensor by its mean over the ranks: per (device, dtype), one all-reduce per bucket of at
    most ``bucket_bytes`` (a larger tensor is reduced in place, alone)."""
    if comm.world_size(process_group) == 1:
        return
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for members in by_key.values():
        for bucket in _buckets(members, bucket_bytes):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                comm.all_reduce_mean_(bucket[0].view(-1), kind=kind, ledger=ledger, group=process_group)
                continue
            flat = torch.cat([t.reshape(-1) for t in bucket])
            comm.all_reduce_mean_(flat, kind=kind, ledger=ledger, group=process_group)
            torch._foreach_copy_(bucket, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in bucket]),
                                                                        bucket)])


def model_tensors(model: torch.nn.Module, *, buffers: bool = True) -> list[torch.Tensor]:
    """The floating-point parameters (and buffers) of ``model`` (DDP's ``module`` if wrapped)."""
    model = getattr(model, "module", model)
    tensors = _floating(p.data for p in model.parameters())
    if buffers:
        tensors += _floating(model.buffers())
    return tensors


def _averaged_together(model: torch.nn.Module, process_group, buffers: bool) -> list[tuple[list, object]]:
    """``[(tensors, group)]``: a sharded (FSDP2) model's shards are averaged with the ranks holding the same
    shard (its replicas), its buffers (not sharded) over every rank."""
    module = getattr(model, "module", model)
    reshard(module)
    shards = sharded_topology(list(module.parameters()))
    if shards is None:
        return [(model_tensors(model, buffers=buffers), process_group)]
    return [(_floating(local(p.data) for p in module.parameters()), shards),
            (_floating(module.buffers()) if buffers else [], process_group)]


def average_model(model: torch.nn.Module, *, process_group=None, buffers: bool = True,
                  ledger: comm.CommLedger | None = None) -> None:
    """Every rank ends with the ranks' average of ``model``'s floating-point parameters and buffers.

    Collective: every rank must call it. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are left as they are. Pass the optimizer's
    ``ledger`` to count the bytes as training traffic (kind ``"params"``).
    """
    for tensors, group in _averaged_together(model, process_group, buffers):
        average_tensors_(tensors, process_group=group, ledger=ledger)


class averaged_model:
    """``with averaged_model(model):`` the body sees the ranks' average; the local copies come back after.

    For evaluating the run's model at a checkpoint while training continues
    from each rank's own parameters unchanged.
    """

    def __init__(self, model: torch.nn.Module, *, process_group=None, buffers: bool = True):
        self.module = getattr(model, "module", model)
        self.parts = _averaged_together(model, process_group, buffers)
        self.tensors = [t for tensors, _ in self.parts for t in tensors]
        self.saved: list[torch.Tensor] | None = None

    def __enter__(self):
        if any(comm.world_size(group) > 1 for _, group in self.parts):
            self.saved = [t.clone() for t in self.tensors]
            for tensors, group in self.parts:
                average_tensors_(tensors, process_group=group, kind="eval")
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            # an FSDP2 model's root keeps its parameters gathered after the body's forward: the average's. The next
            # forward would train on them rather than gather the local shards put back here
            reshard(self.module)
            with torch.no_grad():
                torch._foreach_copy_(self.tensors, self.saved)
            self.saved = None
