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

FSDP's own collectives go to the optimizer's ledger too (:func:`prepare_fsdp`): its parameter all-gathers
and gradient reduce-scatters at level ``"shard"``, as kinds of their own (``"fsdp_all_gather"``,
``"fsdp_reduce_scatter"``: what sharding costs whatever the optimizer, kept apart from the kinds that
compare optimizers), and under HSDP with a data-parallel optimizer its gradient all-reduce over the
replicas (``"grads"``, level ``"replicate"``, as DDP's), so the ledger holds what crosses each mesh dimension.

:func:`shard_model` calls ``fully_shard`` per block and on the root; :func:`slamb.wrap_model` on such
a module makes its gradient reduction the one the optimizer needs (:func:`prepare_fsdp`). Built in another
order, or without ``wrap_model``, a run would go wrong silently (the replicas keep the weights each rank built,
FSDP's collectives stay out of the ledger, an optimizer built before ``fully_shard`` holds the tensors it
replaced and trains nothing): the optimizers refuse such a step, and :func:`slamb.load_sharded` such a load,
in one line naming the order.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from . import comm
from .topology import MeshTopology, mesh_topology

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch without DTensor: nothing is sharded
    DTensor = Replicate = Shard = None

__all__ = ["local", "is_sharded", "sharded_topology", "chunk_rows", "shard_offsets", "sum_squares_", "reduce_squares",
           "shard_model", "prepare_fsdp", "is_prepared", "check_prepared", "refuse_replaced", "reshard",
           "full_state_dict", "refuse_sharded", "check_state_shapes"]

# the optimizers that take sharded parameters, named where another refuses them
SHARDED_OPTIMIZERS = "SLAMB or LAMB"
BUILD_AFTER = ("build the optimizer after slamb.shard_model, on model.parameters() (fully_shard replaces a module's "
               "parameters by their shards), then model = slamb.wrap_model(model, optimizer)")

# the optimizers prepare_fsdp has prepared an FSDP2 model for
_PREPARED: weakref.WeakSet = weakref.WeakSet()
# the parameters shard_model replaced by their shards: an optimizer built on them would step tensors no module uses
_REPLACED = WeakIdKeyDictionary()


def is_sharded(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


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
    shards = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if len(shards) != 1 or p.placements[shards[0]].dim != 0 or not all(
            isinstance(pl, (Shard, Replicate)) for pl in p.placements):
        raise ValueError(f"a DTensor parameter with placements {tuple(p.placements)}: SLAMB and LAMB take FSDP2's "
                         "(Shard(0),) or HSDP's (Replicate(), Shard(0)) parameters")
    return shards[0]


def sharded_topology(params, process_group=None) -> MeshTopology | None:
    """The replicas of the mesh the DTensor ``params`` share, or None where none is a DTensor."""
    params = list(params)
    sharded = [p for p in params if is_sharded(p)]
    if not sharded:
        return None
    if len(sharded) != len(params):
        raise ValueError(f"{len(params) - len(sharded)} of the parameters are plain tensors and the others FSDP2 "
                         "DTensors: shard every parameter (fully_shard on the root module as well)")
    if process_group is not None:
        raise ValueError("sharded parameters carry their process groups in their device mesh: leave process_group "
                         "unset")
    meshes = {p.device_mesh for p in sharded}
    dims = {_shard_dim(p) for p in sharded}
    if len(meshes) != 1 or len(dims) != 1:
        raise ValueError("the parameters are sharded over different device meshes: SLAMB and LAMB take one mesh")
    return mesh_topology(meshes.pop(), dims.pop())


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


# -- FSDP2 modules ------------------------------------------------------------------------------

def fsdp_modules(model: torch.nn.Module) -> list:
    """The modules of ``model`` on which ``fully_shard`` was called."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its shards: a forward without backward (an evaluation) leaves the
    root's parameters gathered, as plain tensors in place of the DTensors the optimizer holds."""
    for m in fsdp_modules(model):
        m.reshard()


def shard_model(model: torch.nn.Module, mesh, blocks=(), **fsdp_kwargs) -> torch.nn.Module:
    """``fully_shard`` each block of ``model`` (bottom-up: each gathers and frees its parameters as one unit),
    then the root, which takes the rest; returns ``model``.

    ``blocks``: module classes (transformer layers, ResNet stages) or a predicate ``module -> bool``.
    ``mesh``: a 1-D mesh (FSDP) or a 2-D ``("replicate", "shard")`` mesh (HSDP). Build the optimizer on
    the sharded parameters, then :func:`slamb.wrap_model` the model with it.
    """
    from torch.distributed.fsdp import fully_shard

    if isinstance(blocks, type) or isinstance(blocks, tuple):
        classes = blocks if isinstance(blocks, tuple) else (blocks,)
        chosen = lambda m: isinstance(m, classes)  # noqa: E731
    else:
        chosen = blocks
    picked = [m for m in model.modules() if m is not model and chosen(m)]
    before = list(model.parameters())
    for m in reversed(picked):  # children before their parents
        fully_shard(m, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    sharded = {id(p) for p in model.parameters()}
    for p in before:
        if id(p) not in sharded:
            _REPLACED[p] = True
    return model


def refuse_replaced(name: str, params) -> None:
    """One line where ``params`` (an optimizer's, none of which got a gradient) are tensors :func:`shard_model`
    replaced by their shards: the optimizer was built before it and would train nothing."""
    if any(p in _REPLACED for p in params):
        raise RuntimeError(f"{name} was built on the parameters slamb.shard_model replaced by their FSDP2 shards, so "
                           f"they get no gradient and it trains nothing: {BUILD_AFTER}")


def is_prepared(optimizer) -> bool:
    """Whether :func:`slamb.wrap_model` has prepared an FSDP2 model for ``optimizer``."""
    return optimizer in _PREPARED


def check_prepared(optimizer) -> None:
    """Refuse, in one line, a step of ``optimizer`` on sharded parameters before :func:`slamb.wrap_model`: the
    replicas would keep the weights each rank built, and FSDP's collectives (under HSDP its all-reduce of every
    gradient, which SLAMB's exchange replaces) would stay out of the ledger."""
    if not is_prepared(optimizer):
        raise RuntimeError(f"{type(optimizer).__name__}: a step on FSDP2 parameters whose model slamb.wrap_model has "
                           "not prepared (the replicas would keep the weights each rank built, and FSDP's collectives "
                           "would be missing from the ledger): call model = slamb.wrap_model(model, optimizer) before "
                           "the first step")


def prepare_fsdp(model: torch.nn.Module, optimizer) -> torch.nn.Module:
    """The gradient reduction of an FSDP2 ``model`` that ``optimizer`` needs.

    A data-parallel optimizer (LAMB) keeps FSDP's own: reduce-scatter over the shards, all-reduce over
    the replicas (HSDP), the mean over every rank. SLAMB (whose workers are the replicas) keeps the
    reduce-scatter, each replica's gradient being the mean over its own shard group, and drops the
    all-reduce over the replicas: the momentum exchange replaces it.
    """
    from .contract import GRADIENT_ALLREDUCE

    name = type(optimizer).__name__
    if not getattr(optimizer, "takes_sharded", False):
        raise ValueError(f"slamb.wrap_model got an FSDP2 module for {name}, which takes no sharded parameters; "
                         f"{SHARDED_OPTIMIZERS} does")
    reshard(model)  # the root's parameters are the DTensors again after an evaluation's forward
    own = {id(p) for p in model.parameters()}
    if not all(id(p) in own for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(f"slamb.wrap_model: {name} holds other parameters than the FSDP2 model's: {BUILD_AFTER}")
    topology = optimizer.shards
    _broadcast_replicas(model, topology)
    dense = optimizer.communication == GRADIENT_ALLREDUCE
    modules = fsdp_modules(model)
    if not dense:
        for m in modules:
            _reduce_over_shards_only(m, topology)
    _record_fsdp_collectives(model, modules, optimizer.ledger, replicas=topology.replicate if dense else None)
    _PREPARED.add(optimizer)
    return model


def _record_fsdp_collectives(model, modules, ledger: comm.CommLedger, *, replicas) -> None:
    """Route the FSDP2 ``modules``' all-gathers and reduce-scatters through ledgered ones (FSDP2's public
    custom collectives; one of each, shared), and where FSDP all-reduces over ``replicas`` (HSDP under a
    data-parallel optimizer; a process group, or None) record that all-reduce, which FSDP runs itself, from
    the hook it calls after.

    An all-gather while ``model`` is in eval mode is not recorded: the ledger holds the training steps'
    traffic, and an evaluation between two steps would otherwise count in the next one (and not survive a
    resume, which saves the ledger's finished steps). The collectives have the methods FSDP2 calls (``allocate``
    and the call), which is all it asks of them: its ``AllGather`` and ``ReduceScatter`` base classes are private."""

    class _Fresh:  # a buffer per call, as FSDP's default collectives allocate
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    def record(kind: str, op: str, tensor: torch.Tensor, group) -> None:
        ledger.record(kind, op, tensor.numel() * tensor.element_size(), dist.get_world_size(group), level="shard")

    class _LedgeredAllGather(_Fresh):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if model.training:
                record("fsdp_all_gather", "all_gather", input_tensor, group)
            return comm._all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    class _LedgeredReduceScatter(_Fresh):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            record("fsdp_reduce_scatter", "reduce_scatter", input_tensor, group)
            return comm._reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    gather, scatter = _LedgeredAllGather(), _LedgeredReduceScatter()
    for m in modules:
        m.set_custom_all_gather(gather)
        m.set_custom_reduce_scatter(scatter)
    if replicas is not None:
        n = dist.get_world_size(replicas)
        for m in modules:
            m.set_all_reduce_hook(lambda reduced: ledger.record(
                "grads", "all_reduce", reduced.numel() * reduced.element_size(), n, level="replicate"))


@torch.no_grad()
def _broadcast_replicas(model: torch.nn.Module, topology: MeshTopology) -> None:
    """Every replica starts from replica 0's shards, as DDP starts every rank from rank 0's parameters
    (``fully_shard`` shards each rank's own copy and sends nothing)."""
    if topology.replicate is None:
        return
    for p in model.parameters():
        if is_sharded(p) and local(p).numel():
            shard = local(p)
            sent = shard.contiguous()
            dist.broadcast(sent, group=topology.replicate, group_src=0)
            shard.copy_(sent)


def _reduce_over_shards_only(module, topology: MeshTopology) -> None:
    """FSDP2 (torch 2.11 to 2.14) has no public switch for "reduce-scatter, but no all-reduce over the replicas":
    ``set_requires_all_reduce(False)`` holds the reduce-scatter output back for a later all-reduce (gradient
    accumulation) and sets no gradient. So each parameter group's reduction is re-pointed at the shard
    dimension alone, FSDP's 1-D mesh information over the same mesh: the parameters stay the HSDP mesh's
    DTensors, and FSDP divides the reduce-scatter's sum by the shard group's size, the mean over the replica."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    for group in _param_groups(module._get_fsdp_state()):
        info = group.mesh_info
        if isinstance(info, HSDPMeshInfo):
            if info.mesh != topology.mesh or getattr(info, "is_spmd_mesh", False):
                raise ValueError("slamb.wrap_model: the FSDP2 module is sharded over another mesh than the "
                                 "optimizer's parameters")
            group.mesh_info = FSDPMeshInfo(info.mesh, shard_mesh_dim=info.shard_mesh_dim)
        elif not isinstance(info, FSDPMeshInfo):
            raise ValueError("slamb.wrap_model: SLAMB takes FSDP2 modules sharded by fully_shard (FSDP or HSDP), "
                             f"not {type(info).__name__}")


def _param_groups(state) -> list:
    """An FSDP2 state's parameter groups: a list where torch has per-parameter meshes (2.14), one group or None
    in torch 2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


def full_state_dict(model: torch.nn.Module) -> dict:
    """``model``'s state dict as whole CPU tensors on rank 0 (``{}`` on the other ranks), for an export
    (``save_pretrained(directory, state_dict=...)``). Collective for an FSDP2 module: each DTensor is gathered
    over its shard dimension (``DTensor.full_tensor``, one tensor at a time, so no rank holds two copies of
    the model on its device) and moved to the CPU; replicas are taken to be equal, so average them first
    (:func:`slamb.average_model`). An unsharded model's own state dict, on every rank."""
    if not fsdp_modules(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


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
