"""DistributedDataParallel wrapping for any optimizer of the package.

DDP still broadcasts the initial parameters (and buffers) from rank 0; what
happens to the gradient buckets during backward depends on the optimizer:

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
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import comm
from .contract import GRADIENT_ALLREDUCE, NO_DDP, adopt


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


def comm_hook(optimizer, process_group=None) -> tuple:
    """``(state, hook)`` for a DDP around a model ``optimizer`` trains: its own hook, or for data-parallel
    optimizers DDP's averaging all-reduce recorded in its ledger."""
    if optimizer.communication == GRADIENT_ALLREDUCE:
        return RecordingState(optimizer.ledger, process_group), recording_allreduce_hook
    return optimizer.ddp_comm_hook()


def wrap_model(model: torch.nn.Module, optimizer, *, process_group=None, **ddp_kwargs) -> torch.nn.Module:
    """DDP around ``model`` with the gradient communication ``optimizer`` needs.

    Returns ``model`` itself when there is no process group (one worker).
    ``ddp_kwargs`` go to :class:`DistributedDataParallel` (``device_ids``, ...).
    """
    adopt(optimizer)
    if comm.world_size(process_group) == 1 or optimizer.communication == NO_DDP:
        return model
    ddp = DistributedDataParallel(model, process_group=process_group, **ddp_kwargs)
    ddp.register_comm_hook(*comm_hook(optimizer, process_group))
    return ddp
