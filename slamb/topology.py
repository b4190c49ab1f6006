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

__all__ = ["NodeTopology", "node_topology", "whole_group", "HIERARCHIES"]

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
    """The process group spanning every rank of ``group`` (a :class:`NodeTopology` or a process group)."""
    return group.group if isinstance(group, NodeTopology) else group


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
