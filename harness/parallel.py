"""How a run's ranks share the model: DDP (full replicas), FSDP or HSDP (FSDP2's ``fully_shard``).

``trainer.parallelism``:

* ``ddp`` (default): every rank holds the whole model; :func:`slamb.wrap_model` puts DDP around it;
* ``fsdp``: one shard group of every rank (a 1-D mesh): each rank holds 1/world of every parameter,
  gradient and optimizer state; one replica;
* ``hsdp``: ``world / trainer.shard_size`` replica groups of ``trainer.shard_size`` ranks (a 2-D
  ``(replicate, shard)`` mesh): sharded inside a group (a node's NVLink), replicated across groups.
  SLAMB's workers are the replicas: FSDP reduce-scatters the gradients inside each group, SLAMB's
  sampled-momentum exchange and parameter syncs cross the groups (:mod:`slamb.sharding`).

The pipelines shard their transformer layers one ``fully_shard`` unit each (:func:`slamb.shard_model`),
build the optimizer on the sharded parameters and let :func:`slamb.wrap_model` give it its communication
(:func:`distribute`). The run's model is the replicas' average (:func:`slamb.average_model` averages a
sharded model over its replicas); :func:`full_state_dict` gathers it to whole tensors for an export.
Checkpoints of a sharded run go through ``torch.distributed.checkpoint`` (:mod:`harness.checkpoint`).

Only SLAMB and LAMB on their multi-tensor path take sharded parameters: :func:`check_parallelism` asks
the optimizer itself, built on a sharded stand-in, before any worker starts.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import slamb
from slamb.ddp import fsdp_modules
from slamb.optim.checks import check_choice
from .replica import current as current_replica

PARALLELISMS = ("ddp", "fsdp", "hsdp")
MESH_DIMS = ("replicate", "shard")


def shard_groups(parallelism: str, shard_size: int | None, world_size: int) -> tuple[int, int]:
    """``(replicas, shards per replica)`` of ``world_size`` ranks; a clear error for a size that does not fit."""
    check_choice("trainer.parallelism", parallelism, PARALLELISMS)
    if parallelism == "ddp":
        if shard_size is not None:
            raise ValueError(f"invalid trainer.shard_size={shard_size!r} with trainer.parallelism=ddp (full replicas, "
                             "nothing sharded): set trainer.parallelism=hsdp, or trainer.shard_size=null")
        return world_size, 1
    if world_size < 2:
        raise ValueError(f"invalid trainer.parallelism={parallelism} with {world_size} worker: sharding needs 2 or "
                         "more; set trainer.nproc_per_node (or torchrun's world) to 2 or more, or "
                         "trainer.parallelism=ddp")
    if parallelism == "fsdp":
        if shard_size not in (None, world_size):
            raise ValueError(f"invalid trainer.shard_size={shard_size!r} with trainer.parallelism=fsdp, which shards "
                             f"over all {world_size} workers: set trainer.shard_size=null, or "
                             "trainer.parallelism=hsdp for replica groups of that size")
        return 1, world_size
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or not 1 <= shard_size <= world_size \
            or world_size % shard_size:
        raise ValueError(f"invalid trainer.shard_size={shard_size!r} with trainer.parallelism=hsdp and {world_size} "
                         f"workers: must divide the workers into replica groups (a divisor of {world_size}, e.g. "
                         "the GPUs of a node)")
    return world_size // shard_size, shard_size


@contextlib.contextmanager
def _one_rank_mesh():
    """A 1-D device mesh over a process group of this process alone (an in-memory store, nothing sent),
    taken down after: a sharded stand-in for checks made before any worker starts."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def check_parallelism(cfg: dict, world_size: int, shards: bool, build_optimizer) -> None:
    """Clear errors, before any worker starts, for a ``trainer.parallelism`` the run cannot have: a pipeline
    that does not shard (``shards`` False), a shard size that does not divide the workers, or an optimizer (or
    one of its settings) that takes no sharded parameters.

    The optimizer decides: ``build_optimizer(model, cfg["optimizer"])`` builds it on FSDP2 parameters of a one-rank
    mesh, where it refuses them as it would in the workers (``foreach=False``, ``overlap``, ``hierarchy``, the
    optimizers other than SLAMB and LAMB)."""
    t = cfg["trainer"]
    parallelism, shard_size = t["parallelism"], t["shard_size"]
    if parallelism != "ddp" and not shards:  # first: a shard size that fits would not help
        check_choice("trainer.parallelism", parallelism, PARALLELISMS)
        raise ValueError(f"invalid trainer.parallelism={parallelism}: this pipeline trains full replicas only; "
                         "bert.train and swin.train shard. Set trainer.parallelism=ddp")
    shard_groups(parallelism, shard_size, world_size)
    if parallelism == "ddp":
        return
    if cfg.get("init_optimizer_from"):
        raise ValueError(f"invalid trainer.parallelism={parallelism} with init_optimizer_from: an earlier phase's "
                         "optimizer continues under trainer.parallelism=ddp only; set init_optimizer_from=null (a "
                         "fresh optimizer; init_from still loads the model), or trainer.parallelism=ddp")
    if dist.is_initialized():  # the workers' own process group: the optimizer refuses in the worker
        return
    with _one_rank_mesh() as mesh:
        stand_in = slamb.shard_model(torch.nn.Linear(2, 2), mesh)
        try:
            build_optimizer(stand_in, cfg["optimizer"])
        except ValueError as e:
            if "sharded" not in str(e):
                raise
            raise ValueError(f"invalid trainer.parallelism={parallelism} for optimizer={cfg['optimizer']['name']}: "
                             f"{e}") from None


def device_mesh(trainer, env):
    """The run's device mesh (None under DDP): 1-D ``(shard,)`` for FSDP, ``(replicate, shard)`` for HSDP. Under
    torchft, a replica group's own 1-D ``(shard,)`` over its workers: its replicas are torchft's groups, which
    meet through its manager (:mod:`harness.fault_tolerance`)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shards = shard_groups(trainer.parallelism, trainer.shard_size, env.world_size)
    if trainer.parallelism == "ddp":
        return None
    if trainer.parallelism == "fsdp" or current_replica() is not None:
        return init_device_mesh(env.device.type, (shards,), mesh_dim_names=MESH_DIMS[1:])
    return init_device_mesh(env.device.type, (replicas, shards), mesh_dim_names=MESH_DIMS)


def distribute(model: torch.nn.Module, trainer, env, *, blocks, build_optimizer, **ddp_kwargs):
    """``(model, optimizer)``: ``model`` (on its device) sharded per ``blocks`` (module classes) on the run's
    mesh under FSDP/HSDP, the optimizer ``build_optimizer(model)`` built on its (sharded) parameters, and
    :func:`slamb.wrap_model` giving it its communication; under DDP, ``ddp_kwargs`` go to DDP."""
    mesh = device_mesh(trainer, env)
    if mesh is not None:
        slamb.shard_model(model, mesh, blocks=tuple(blocks))
        ddp_kwargs = {}
    optimizer = build_optimizer(model)
    return slamb.wrap_model(model, optimizer, **ddp_kwargs), optimizer


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` was sharded by ``fully_shard`` (FSDP or HSDP)."""
    return bool(fsdp_modules(model))
