"""DistributedDataParallel wrapping for any optimizer of the package.

DDP still broadcasts the initial parameters (and buffers) from rank 0; what
happens to the gradient buckets during backward depends on the optimizer:

* optimizers on averaged gradients (LAMB, SGD, AdamW, ...): the usual
  all-reduce, recorded in the optimizer's ledger as kind ``"grads"``;
* optimizers that communicate themselves (SLAMB): a hook that sends nothing,
  so each rank keeps its local gradient;
* optimizers with their own exchange (DGC, 1-bit LAMB): the hook returned by
  their ``ddp_comm_hook()``;
* optimizers whose model must not be wrapped at all (JointSpar, which freezes
  a different set of layers every round, more than DDP's reducer can follow):
  ``uses_ddp = False``; they broadcast the initial parameters themselves.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import comm


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


def attach_ledger(optimizer) -> comm.CommLedger:
    """Give an optimizer without one (torch.optim.*) a ledger closed at each step."""
    if getattr(optimizer, "ledger", None) is None:
        optimizer.ledger = comm.CommLedger()
        optimizer.register_step_post_hook(lambda opt, args, kwargs: opt.ledger.end_step())
        optimizer.comm_stats = optimizer.ledger.summary
    return optimizer.ledger


def wrap_model(model: torch.nn.Module, optimizer, *, process_group=None, **ddp_kwargs) -> torch.nn.Module:
    """DDP around ``model`` with the gradient communication ``optimizer`` needs.

    Returns ``model`` itself when there is no process group (one worker).
    ``ddp_kwargs`` go to :class:`DistributedDataParallel` (``device_ids``, ...).
    """
    if comm.world_size(process_group) == 1 or not getattr(optimizer, "uses_ddp", True):
        return model
    ddp = DistributedDataParallel(model, process_group=process_group, **ddp_kwargs)
    custom = getattr(optimizer, "ddp_comm_hook", None)
    if custom is not None:
        state, hook = custom()
    else:
        state, hook = RecordingState(attach_ledger(optimizer), process_group), recording_allreduce_hook
    ddp.register_comm_hook(state, hook)
    return ddp
