"""DistributedDataParallel wrapping for any optimizer of the package.

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

FSDP2 modules are not wrapped (:mod:`slamb.sharding`). An optimizer over a
:class:`slamb.topology.NodeTopology` (``SLAMB(hierarchy="node")``)
gets its hook after a dense averaging of each bucket inside the node (kind
``"grads"``, level ``"intra"``): DDP spans every rank (its initial broadcast
from global rank 0 gives every node the same start), the hook's all-reduce
only the node's ranks.

Where the hook leaves its result in the bucket itself (marked ``in_place``:
SLAMB's hooks send no gradient or reduce it in place), DDP is built with
``gradient_as_bucket_view=True``: the parameters' ``.grad`` are views into the
buckets, so DDP keeps no second model-sized copy of the gradients.
"""

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import comm
from .contract import GRADIENT_ALLREDUCE, NO_DDP, adopt
from .sharding import fsdp_modules, prepare_fsdp
from .topology import NodeTopology


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
    reduction made the one ``optimizer`` needs (:func:`slamb.sharding.prepare_fsdp`): FSDP's own for
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
