"""DistributedDataParallel and FSDP2 wrapping for any optimizer of the package.

DDP still broadcasts the initial parameters (and buffers) from rank 0; what
happens to the gradient buckets during backward is the optimizer's
``communication`` (:mod:`slamb.contract`):

* ``gradient_allreduce`` (LAMB, SGD, AdamW, ...): the usual all-reduce,
  recorded in the optimizer's ledger as kind ``"grads"``;
* ``optimizer_hook``: the hook returned by its ``ddp_comm_hook()``: one that
  sends nothing for SLAMB (each rank keeps its local gradient), the exchange
  of DGC and 1-bit LAMB;
* ``no_ddp`` (JointSpar, which freezes a different set of layers every round,
  more than DDP's reducer can follow): the model is returned unwrapped and the
  optimizer broadcasts the initial parameters itself.

FSDP2 modules are not wrapped: their gradient reduction is made the optimizer's
(:func:`prepare_fsdp`, below). An optimizer over a
:class:`slamb.topology.NodeTopology` (``SLAMB(hierarchy="node")``)
gets its hook after a dense averaging of each bucket inside the node (kind
``"grads"``, level ``"intra"``): DDP spans every rank (its initial broadcast
from global rank 0 gives every node the same start), the hook's all-reduce
only the node's ranks.

Where the hook leaves its result in the bucket itself (marked ``in_place``:
SLAMB's hooks send no gradient or reduce it in place), DDP is built with
``gradient_as_bucket_view=True``: the parameters' ``.grad`` are views into the
buckets, so DDP keeps no second model-sized copy of the gradients.

FSDP2 (the optimizers' side is :mod:`slamb.sharding`): :func:`shard_model` calls ``fully_shard`` per block
and on the root; :func:`wrap_model` on such a module makes its gradient reduction the one the optimizer needs
(:func:`prepare_fsdp`). FSDP's own collectives go to the optimizer's ledger too: its parameter all-gathers
and gradient reduce-scatters at level ``"shard"``, as kinds of their own (``"fsdp_all_gather"``,
``"fsdp_reduce_scatter"``: what sharding costs whatever the optimizer, kept apart from the kinds that
compare optimizers), and under HSDP with a data-parallel optimizer its gradient all-reduce over the
replicas (``"grads"``, level ``"replicate"``, as DDP's), so the ledger holds what crosses each mesh dimension.
Built in another order, or without ``wrap_model``, a run would go wrong silently (the replicas keep the weights
each rank built, FSDP's collectives stay out of the ledger, an optimizer built before ``fully_shard`` holds the
tensors it replaced and trains nothing): the optimizers refuse such a step (:func:`check_prepared`,
:func:`refuse_replaced`), and :func:`slamb.load_sharded` such a load, in one line naming the order.
"""

import dataclasses
import os
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from . import comm
from .contract import GRADIENT_ALLREDUCE, NO_DDP, adopt
from .sharding import SHARDED_OPTIMIZERS, is_sharded, local
from .topology import MeshTopology, NodeTopology

BUILD_AFTER = ("build the optimizer after slamb.shard_model, on model.parameters() (fully_shard replaces a module's "
               "parameters by their shards), then model = slamb.wrap_model(model, optimizer)")

# the optimizers prepare_fsdp has prepared an FSDP2 model for
_PREPARED: weakref.WeakSet = weakref.WeakSet()
# the parameters shard_model replaced by their shards: an optimizer built on them would step tensors no module uses
_REPLACED = WeakIdKeyDictionary()


def in_place(hook):
    """Mark a DDP comm hook whose future's value is the bucket's own buffer (reduced in place or untouched)."""
    hook.in_place = True
    return hook


@in_place
def no_comm_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@dataclasses.dataclass
class RecordingState:
    ledger: comm.CommLedger | None
    process_group: dist.ProcessGroup | None = None
    kind: str = "grads"


def recording_allreduce_hook(state: RecordingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default averaging all-reduce, with the bucket's bytes in the ledger."""
    buf = bucket.buffer()
    n = comm.world_size(state.process_group)
    buf.div_(n)
    work = comm.all_reduce_sum_(buf, kind=state.kind, ledger=state.ledger, group=state.process_group,
                                async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclasses.dataclass
class NodeState:
    topology: NodeTopology
    ledger: comm.CommLedger | None
    state: object  # the optimizer's hook and its state
    hook: object


@in_place
def node_mean_hook(state: NodeState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket averaged over the node's ranks, then handed to the optimizer's hook (which sees what a
    flat run's rank sees: the gradient of its worker, here the node)."""
    comm.all_reduce_mean_(bucket.buffer(), kind="grads", ledger=comm.at_level(state.ledger, "intra"),
                          group=state.topology.intra)
    return state.hook(state.state, bucket)


def comm_hook(optimizer, process_group=None) -> tuple:
    """``(state, hook)`` for a DDP around a model ``optimizer`` trains: its own hook, or for data-parallel
    optimizers DDP's averaging all-reduce recorded in its ledger."""
    if optimizer.communication == GRADIENT_ALLREDUCE:
        return RecordingState(optimizer.ledger, process_group), recording_allreduce_hook
    state, hook = optimizer.ddp_comm_hook()
    topology = getattr(optimizer, "process_group", None)
    if isinstance(topology, NodeTopology):
        if not getattr(hook, "in_place", False):
            raise ValueError(f"{type(optimizer).__name__}: a per-node hierarchy needs a comm hook that works on "
                             "the bucket in place")
        return NodeState(topology, optimizer.ledger, state, hook), node_mean_hook
    return state, hook


def check_current_device(model: torch.nn.Module) -> None:
    """Refuse a model that is not on this rank's current CUDA device, in one line naming the fix.

    Without ``torch.cuda.set_device(local_rank)`` every rank of a node builds its model on cuda:0 and
    NCCL refuses the second one ("Duplicate GPU detected") deep inside DDP's first broadcast. The second
    test catches exactly that: a rank other than local rank 0, which sees a GPU of its own index, still
    on the default cuda:0.
    """
    devices = sorted({str(p.device) for p in model.parameters() if p.device.type == "cuda"})
    if not devices:
        return
    current = torch.cuda.current_device()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    unset = current == 0 and 0 < local_rank < torch.cuda.device_count()
    if devices != [f"cuda:{current}"] or unset:
        raise ValueError(
            f"wrap_model: the model's parameters are on {', '.join(devices)} and this rank's current CUDA device "
            f"is cuda:{current} (LOCAL_RANK={local_rank}); call torch.cuda.set_device(local_rank) before building "
            "the model, so that each rank of a node has a GPU of its own")


def wrap_model(model: torch.nn.Module, optimizer, *, process_group=None, **ddp_kwargs) -> torch.nn.Module:
    """DDP around ``model`` with the gradient communication ``optimizer`` needs.

    Returns ``model`` itself when there is no process group (one worker).
    ``ddp_kwargs`` go to :class:`DistributedDataParallel` (``device_ids``, ...).

    An FSDP2 module (``fully_shard``, :func:`slamb.shard_model`) is returned itself, its gradient
    reduction made the one ``optimizer`` needs (:func:`prepare_fsdp`): FSDP's own for
    LAMB, only the reduce-scatter inside each replica for SLAMB.
    """
    adopt(optimizer)
    if fsdp_modules(model):
        if ddp_kwargs or process_group is not None:
            raise ValueError("slamb.wrap_model: an FSDP2 module takes no DDP arguments or process group (its device "
                             "mesh has them)")
        return prepare_fsdp(model, optimizer)
    if isinstance(model, DistributedDataParallel):
        # caught here, not 3 steps later by SLAMB's warning: the inner DDP's reducer would still all-reduce
        # every gradient under whatever hook the outer one gets
        raise ValueError(f"slamb.wrap_model got a DistributedDataParallel, whose own all-reduce of every gradient "
                         f"{type(optimizer).__name__} cannot undo: pass the module it wraps (model.module)")
    topology = getattr(optimizer, "process_group", None)
    if isinstance(topology, NodeTopology):
        process_group = topology.group
    if comm.world_size(process_group) == 1 or optimizer.communication == NO_DDP:
        return model
    check_current_device(model)
    state, hook = comm_hook(optimizer, process_group)
    ddp_kwargs.setdefault("gradient_as_bucket_view", getattr(hook, "in_place", False))
    ddp = DistributedDataParallel(model, process_group=process_group, **ddp_kwargs)
    ddp.register_comm_hook(state, hook)
    return ddp


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
    the sharded parameters, then :func:`slamb.wrap_model` the model with it. ``fsdp_kwargs`` go to
    ``fully_shard``; an ``mp_policy`` with a ``param_dtype`` and no ``reduce_dtype`` reduces the gradients in
    ``param_dtype`` (:func:`_reduce_dtype_set`), on every torch.
    """
    from torch.distributed.fsdp import fully_shard

    fsdp_kwargs = _reduce_dtype_set(fsdp_kwargs)
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


def _reduce_dtype_set(fsdp_kwargs: dict) -> dict:
    """``fsdp_kwargs`` with its mixed-precision policy's unset ``reduce_dtype`` set to the policy's ``param_dtype``.

    Unset, torch 2.11 to 2.14 reduce the gradients in the dtype they are computed in, ``param_dtype``
    (``foreach_reduce``: ``reduce_dtype or grad_dtype``), and 2.15 in the parameters' own dtype (their
    ``grad_dtype``): fp32 parameters computed in bf16 or fp16 would send twice the bytes in every reduce-scatter
    (and HSDP all-reduce), and the ledger's ``fsdp_reduce_scatter`` would change with the torch installed.
    ``param_dtype`` keeps 2.14's reduction on every torch: 2.14 clamps a ``reduce_dtype`` equal to
    ``param_dtype`` back to unset, and 2.15 reduces in it. A ``param_dtype_override_fn`` (2.15) keeps some
    parameters in their own dtype, which no earlier torch could: its policy is left as given."""
    policy = fsdp_kwargs.get("mp_policy")
    if policy is None or policy.param_dtype is None or policy.reduce_dtype is not None \
            or getattr(policy, "param_dtype_override_fn", None) is not None:
        return fsdp_kwargs
    return {**fsdp_kwargs, "mp_policy": dataclasses.replace(policy, reduce_dtype=policy.param_dtype)}


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
    (``fully_shard`` shards each rank's own copy and sends nothing). Under torchft (replicas meeting through its
    manager) there is no step yet to commit a broadcast with: the replica groups start alike (seeded), or from a
    peer's state at their first quorum (``init_sync``)."""
    if topology.replicate is None or isinstance(topology.replicate, comm.Collectives):
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
