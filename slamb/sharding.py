"""SLAMB and LAMB on FSDP2's sharded parameters (``torch.distributed.fsdp.fully_shard``).

The parameters are DTensors on a 1-D shard mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP),
sharded on dim 0 (uneven shards included: FSDP2 pads them). The optimizers keep their state per
local shard and compute on the local tensors; what a whole tensor decides is summed over its shards:

* the trust ratios: each shard's partial sums of squares (of p and of the update; SLAMB's over the
  fresh and the stale entries apart) are summed over the shard group in ONE all-reduce per step
  (kind ``"norms"``, level ``"shard"``), so every ratio is the whole tensor's;
* SLAMB's masks: drawn over the whole model's coordinates, as the unsharded run draws them, each
  shard keeping the slice at its global offsets (:func:`shard_offsets`), so every replica of a shard
  selects the same entries and a sharded run is the unsharded one;
* the always-averaged tensors and ``min_compress_numel``: by the whole tensor's shape.

The workers are the replicas (:class:`slamb.topology.MeshTopology`): SLAMB's momentum exchange and
parameter syncs run over the replicate dimension, each rank with the ranks holding its shard.

Wrapping an FSDP2 model (:func:`slamb.shard_model`, and :func:`slamb.wrap_model` giving its gradient
reduction the one the optimizer needs) is :mod:`slamb.ddp`'s, beside DDP's.
"""
from __future__ import annotations

import dataclasses
import math
import sys

import torch
import torch.distributed as dist

from . import comm
from .topology import MeshTopology, mesh_topology

__all__ = ["local", "is_sharded", "sharded_topology", "chunk_rows", "shard_offsets", "sum_squares_", "reduce_squares",
           "refuse_sharded", "check_state_shapes"]

# the optimizers that take sharded parameters, named where another refuses them
SHARDED_OPTIMIZERS = "SLAMB or LAMB"


def is_sharded(t) -> bool:
    # a tensor is a DTensor only once torch.distributed.tensor is imported (by FSDP2, or by its user): importing
    # it here would cost every process that shards nothing about 1.5 s of its start
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a view: writing it writes the parameter), or ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def refuse_sharded(name: str, params) -> None:
    """One line naming what takes sharded parameters, where ``name`` does not."""
    if any(is_sharded(p) for p in params):
        raise ValueError(f"{name} takes no sharded (FSDP2 DTensor) parameters; the multi-tensor path of "
                         f"{SHARDED_OPTIMIZERS} does")


def _shard_dim(p) -> int:
    """The mesh dimension ``p`` is sharded over (dim 0 of the tensor); the others must replicate it."""
    from torch.distributed.tensor import Replicate, Shard

    shards = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(shards) != 1 or p.placements[shards[0]].dim != 0 or not all(
            isinstance(pl, (Shard, Replicate)) for pl in p.placements):
        raise ValueError(f"a DTensor parameter with placements {tuple(p.placements)}: SLAMB and LAMB take FSDP2's "
                         "(Shard(0),) or HSDP's (Replicate(), Shard(0)) parameters")
    return shards[0]


def sharded_topology(params, process_group=None) -> MeshTopology | None:
    """The replicas of the mesh the DTensor ``params`` share, or None where none is a DTensor. ``process_group``: a
    :class:`slamb.comm.Collectives` group the replicas meet through (torchft's replica groups, each sharded over
    its own 1-D mesh), or None (the mesh's replicate dimension, where it has one)."""
    params = list(params)
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return None
    if len(sharded) != len(params):
        raise ValueError(f"{len(params) - len(sharded)} of the parameters are plain tensors and the others FSDP2 "
                         "DTensors: shard every parameter (fully_shard on the root module as well)")
    replicas = process_group if isinstance(process_group, comm.Collectives) else None
    if process_group is not None and replicas is None:
        raise ValueError("sharded parameters carry their process groups in their device mesh: leave process_group "
                         "unset")
    meshes = {p.device_mesh for p in sharded}
    dims = {_shard_dim(p) for p in sharded}
    if len(meshes) != 1 or len(dims) != 1:
        raise ValueError("the parameters are sharded over different device meshes: SLAMB and LAMB take one mesh")
    topology = mesh_topology(meshes.pop(), dims.pop())
    if replicas is None:
        return topology
    if topology.replicate is not None:
        raise ValueError("sharded parameters whose replicas meet through process_group (torchft's replica groups) "
                         "are sharded over their own replica group alone: a 1-D mesh, not an HSDP mesh")
    return dataclasses.replace(topology, replicate=replicas, group=EveryRank(topology.shard, replicas))


class EveryRank(comm.Collectives):
    """Every rank of a job whose replicas are sharded over their own process group (``shard``) and meet through
    a :class:`slamb.comm.Collectives` group (``replicas``: torchft's replica groups): the group a step's
    decisions are agreed over (:func:`slamb.comm.agree_max`, its only collective).

    A maximum is taken inside the replica, across the replicas, then inside the replica again: a collective
    across that failed on some of a replica's ranks (torchft: the step will not commit) leaves them a partial
    maximum, and the second one makes every rank of the replica decide alike, so that they go on running the
    same collectives among themselves."""

    def __init__(self, shard, replicas: comm.Collectives):
        self.shard, self.replicas = shard, replicas

    def size(self) -> int:
        return self.shard.size() * self.replicas.size()

    def rank(self) -> int:
        return self.replicas.rank() * self.shard.size() + self.shard.rank()

    def all_reduce(self, tensor, op, async_op=False):
        if op != dist.ReduceOp.MAX or async_op:
            self._refuse()
        comm._all_reduce(tensor, op, self.shard)
        self.replicas.all_reduce(tensor, op)
        comm._all_reduce(tensor, op, self.shard)

    # the shards' collectives run over the replicas alone (MeshTopology.replicate), never over every rank
    def all_gather_into_tensor(self, output, input):
        self._refuse()

    def all_to_all_single(self, output, input, async_op=False):
        self._refuse()

    def broadcast(self, tensor, src):
        self._refuse()

    @staticmethod
    def _refuse():
        raise TypeError("EveryRank agrees a maximum at once (slamb.comm.agree_max), and runs no other collective")


def chunk_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """``(first row, rows)`` of shard ``index`` of ``rows`` rows cut into ``shards`` as ``torch.chunk`` cuts
    (and FSDP2 with it): chunks of ceil(rows / shards) rows, the last ones shorter or empty. Every rank's
    storage is padded to the first chunk's rows."""
    size = math.ceil(rows / shards) if rows else 0
    start = min(index * size, rows)
    return start, min(size, rows - start)


def shard_offsets(p) -> tuple[int, int]:
    """``(global numel, offset)``: where this rank's shard of ``p`` starts in the whole tensor, flattened.

    FSDP2 cuts dim 0 as ``torch.chunk`` does (chunks of ceil(rows / S) rows, the last ones shorter or
    empty), so a shard is one contiguous run of the flattened tensor."""
    if not is_sharded(p):
        return p.numel(), 0
    d = _shard_dim(p)
    mesh, rows = p.device_mesh, p.shape[0]
    start, n = chunk_rows(rows, mesh.size(d), mesh.get_local_rank(d))
    mine = local(p)
    if mine.shape[0] != n or tuple(mine.shape[1:]) != tuple(p.shape[1:]):
        raise ValueError(f"a DTensor parameter of shape {tuple(p.shape)} whose shard has shape {tuple(mine.shape)}: "
                         "SLAMB and LAMB take FSDP2's dim-0 shards (torch.chunk's cut)")
    return p.numel(), start * (p.numel() // rows if rows else 0)


def sum_squares_(sums: torch.Tensor, topology: MeshTopology | None, ledger) -> torch.Tensor:
    """Whole-tensor sums of squares from per-shard ones, in place: ``sums`` summed over the shard group in ONE
    all-reduce (kind ``"norms"``, level ``"shard"``). Unsharded: ``sums`` as given."""
    if topology is not None and topology.n_shards > 1 and sums.numel():
        comm.all_reduce_sum_(sums, kind="norms", ledger=comm.at_level(ledger, "shard"), group=topology.shard)
    return sums


def reduce_squares(norms: list[torch.Tensor], topology: MeshTopology | None, ledger) -> list[torch.Tensor]:
    """Whole-tensor norms from per-shard ones: ``norms`` (tensors of per-shard norms), squared and summed over
    the shard group at once (:func:`sum_squares_`), rooted. Unsharded: ``norms`` as given."""
    if topology is None or topology.n_shards == 1 or not norms:
        return norms
    sq = sum_squares_(torch.cat([n.reshape(-1) for n in norms]).square(), topology, ledger)
    return [x.view_as(n) for x, n in zip(sq.sqrt_().split([n.numel() for n in norms]), norms)]


def check_state_shapes(name: str, params, states) -> None:
    """Refuse, in one line, a state saved for other shards of the same parameters (a DDP run's whole tensors
    loaded into an FSDP2 run, or the reverse): torch would copy or broadcast it into the wrong entries.
    ``states``: per parameter, its state dict (or None)."""
    for p, state in zip(params, states):
        mine = tuple(local(p).shape)
        for key, v in (state or {}).items():
            if torch.is_tensor(v) and v.dim() and tuple(local(v).shape) != mine:
                sharded = "sharded (FSDP2)" if is_sharded(p) else "unsharded (DDP)"
                raise ValueError(f"{name} state {key!r} of shape {tuple(local(v).shape)} for a parameter of shape "
                                 f"{tuple(p.shape)} whose {sharded} tensor here is {mine}: the state was saved by a "
                                 "run sharded differently; checkpoint FSDP2/HSDP runs with slamb.save_sharded and "
                                 "slamb.load_sharded (they reshard), DDP runs with slamb.save_optimizer and "
                                 "slamb.load_optimizer")
