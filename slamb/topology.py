"""Nodes of a process group: the two levels of a hierarchical exchange.

With L processes per node (torchrun's ``LOCAL_WORLD_SIZE``; the ranks of a
node contiguous, as torchrun assigns them), a :class:`NodeTopology` holds

* ``intra``: the L ranks of this rank's node (NVLink, shared memory);
* ``inter``: the ranks with this rank's local rank on every node, one per node
  (each local rank has its own inter-node group, so that every NIC of a node
  carries a share of an exchange);
* ``group``: the whole process group.

The collectives of :mod:`slamb.comm` accept it wherever they accept a process
group. They treat a node as ONE worker whose L ranks hold identical tensors:
``world_size`` is the number of nodes, ``rank`` this node's index, a mean is
taken over nodes (local rank l carries the l-th chunk over its inter-node group,
then the node's ranks all-gather the chunks), a gather collects one entry per
node; only :func:`slamb.comm.agree_max` (rank-local conditions) asks every rank.
"""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

__all__ = ["NodeTopology", "node_topology", "MeshTopology", "mesh_topology", "whole_group", "HIERARCHIES"]

HIERARCHIES = (None, "node")


@dataclasses.dataclass(frozen=True)
class NodeTopology:
    group: dist.ProcessGroup | None  # the whole process group (None: the default one)
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    n_nodes: int
    local_world_size: int
    node: int  # this rank's node, 0 .. n_nodes - 1
    local_rank: int


def whole_group(group):
    """The process group spanning every rank of ``group`` (a topology or a process group)."""
    return group.group if isinstance(group, (NodeTopology, MeshTopology)) else group


def local_world_size_from_env(local_world_size: int | None) -> int:
    if local_world_size is None:
        value = os.environ.get("LOCAL_WORLD_SIZE")
        if value is None:
            raise ValueError("hierarchy='node' needs the processes per node: run under torchrun (it sets "
                             "LOCAL_WORLD_SIZE) or pass local_world_size=")
        local_world_size = int(value)
    if not (isinstance(local_world_size, int) and local_world_size >= 1):
        raise ValueError(f"invalid local_world_size={local_world_size!r}: must be an integer >= 1 (processes per node)")
    return local_world_size


def node_topology(process_group=None, local_world_size: int | None = None) -> NodeTopology:
    """The nodes of ``process_group`` (default: the whole world), L = ``local_world_size`` ranks each.

    Collective over the whole world (``dist.new_group``): every rank calls it with the same arguments.
    """
    local = local_world_size_from_env(local_world_size)
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    world = len(ranks)
    if world % local:
        raise ValueError(f"hierarchy='node': the {world} ranks do not split into nodes of local_world_size={local} "
                         "processes; launch the same number of processes on every node (torchrun "
                         "--nproc-per-node) or set local_world_size to the processes per node")
    n_nodes = world // local
    me = dist.get_rank(process_group)
    # every rank creates every group, in the same order (new_group is collective over the world)
    intra = [dist.new_group([ranks[i * local + j] for j in range(local)]) for i in range(n_nodes)]
    inter = [dist.new_group([ranks[i * local + j] for i in range(n_nodes)]) for j in range(local)]
    node, local_rank = divmod(me, local)
    return NodeTopology(process_group, intra[node], inter[local_rank], n_nodes, local, node, local_rank)


@dataclasses.dataclass(frozen=True)
class MeshTopology:
    """The workers of an FSDP2 run: the replicas of a (replicate, shard) device mesh.

    A worker is one replica: the ``n_shards`` ranks of its shard group, each holding one shard of every
    parameter. The collectives of :mod:`slamb.comm` treat it like a :class:`NodeTopology` node (one
    worker, ``world_size`` the number of replicas), except that the ranks of a replica hold different
    shards, so each one exchanges its own shard with the ranks holding the same shard in the other
    replicas (its ``replicate`` group): nothing is chunked or gathered inside the replica.

    Under torchft (:mod:`slamb.integrations.torchft`) the mesh is one replica group's, 1-D, and ``replicate``
    and ``group`` are the manager's: the replicas are the groups of each step's quorum, their number read from
    ``replicate`` at each collective.
    """

    mesh: object  # the parameters' DeviceMesh
    group: object  # every rank of the job (None: the default process group)
    replicate: object  # the ranks holding this rank's shard, one per replica (None: one replica)
    shard: dist.ProcessGroup  # this rank's replica
    n_shards: int
    shard_rank: int  # which shard this rank holds

    @property
    def n_replicas(self) -> int:
        return 1 if self.replicate is None else self.replicate.size()

    @property
    def replica(self) -> int:
        """This rank's replica, 0 .. n_replicas - 1."""
        return 0 if self.replicate is None else self.replicate.rank()


def mesh_topology(mesh, shard_dim: int) -> MeshTopology:
    """The replicas of ``mesh`` (1-D: one replica; 2-D: the other dimension indexes them), sharded over
    dimension ``shard_dim``. The mesh must span the default process group: the step's decisions are
    taken by every rank of it."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"sharded parameters on a {mesh.ndim}-D device mesh: SLAMB and LAMB take a 1-D shard mesh "
                         "or a 2-D (replicate, shard) HSDP mesh")
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"the parameters' device mesh spans {mesh.size()} of the {dist.get_world_size()} ranks: "
                         "SLAMB and LAMB take a mesh over every rank of the default process group")
    replicate_dim = 1 - shard_dim if mesh.ndim == 2 else None
    replicate = mesh.get_group(replicate_dim) if replicate_dim is not None and mesh.size(replicate_dim) > 1 else None
    return MeshTopology(mesh=mesh, group=None, replicate=replicate, shard=mesh.get_group(shard_dim),
                        n_shards=mesh.size(shard_dim), shard_rank=mesh.get_local_rank(shard_dim))
