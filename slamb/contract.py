"""What a training loop may expect of every optimizer of the registry.

A loop (the repository's pipelines, a user's own, or a framework's trainer)
needs to know five things about a distributed optimizer, and asks them here
instead of probing attributes:

* how the model is wrapped (:attr:`communication`): DDP averaging the
  gradients (``GRADIENT_ALLREDUCE``, recorded in the ledger), DDP with the
  optimizer's own comm hook (``OPTIMIZER_HOOK``: SLAMB sends nothing there,
  DGC and 1-bit LAMB their exchange), or no DDP at all (``NO_DDP``: JointSpar
  freezes a different set of layers every round);
* whether the ranks' parameters differ between the optimizer's own syncs
  (:attr:`params_differ`: SLAMB). Then the model of the run is the ranks'
  average (:func:`slamb.average_model`), and checkpoints keep one model per rank;
* whether ``state_dict()`` is the rank's own (:attr:`per_rank_state`): one
  optimizer state per rank must be saved and loaded by the same rank, unless
  the ranks' states have a mean to start other ranks from (:attr:`state_averages`:
  SLAMB's moments, :func:`slamb.checkpoint.mean_state_dict`), so that a run may
  resume on another number of workers;
* the schedules it follows (:meth:`begin_epoch` at the start of each epoch,
  :meth:`begin_step` before each forward pass): DGC's density warm-up,
  SLAMB's compression warm-up, JointSpar's round sampling;
* the steps it dropped itself on NaN/inf gradients (:attr:`nonfinite_skips`,
  ``nonfinite="skip"``), which a loop counts beside its loss scale's skips.

The package's optimizers inherit :class:`ContractDefaults`; :func:`adopt`
makes any ``torch.optim`` optimizer satisfy the contract (data-parallel,
with a ledger of the gradient all-reduce).
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from . import comm
from .sharding import refuse_sharded
from .topology import MeshTopology, whole_group

GRADIENT_ALLREDUCE = "gradient_allreduce"
OPTIMIZER_HOOK = "optimizer_hook"
NO_DDP = "no_ddp"
COMMUNICATION = (GRADIENT_ALLREDUCE, OPTIMIZER_HOOK, NO_DDP)


@runtime_checkable
class DistributedOptimizer(Protocol):
    ledger: comm.CommLedger
    communication: str
    params_differ: bool
    per_rank_state: bool
    state_averages: bool

    def comm_stats(self) -> dict: ...

    def ddp_comm_hook(self) -> tuple[object, Callable] | None: ...

    def begin_epoch(self, epoch: int) -> None: ...

    def begin_step(self) -> None: ...


class ContractDefaults:
    """A data-parallel optimizer: gradients averaged by DDP, state and parameters the same on every rank."""

    communication: str = GRADIENT_ALLREDUCE
    params_differ: bool = False
    per_rank_state: bool = False
    state_averages: bool = False  # a per-rank state whose mean over the ranks starts any other number of ranks
    takes_sharded: bool = False  # FSDP2's DTensor parameters (slamb.sharding): SLAMB and LAMB
    nonfinite_skips: int = 0  # steps dropped on NaN/inf gradients (nonfinite="skip"), the same on every rank
    ledger: comm.CommLedger

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # a set is torch's to refuse
            param_group["params"] = params = list(params)
        if not self.takes_sharded:
            refuse_sharded(type(self).__name__, params)
        super().add_param_group(param_group)

    def comm_stats(self) -> dict:
        return self.ledger.summary()

    def ddp_comm_hook(self):
        """``(state, hook)`` for DDP's ``register_comm_hook``; None for the recorded gradient all-reduce."""
        return None

    def begin_epoch(self, epoch: int) -> None:
        """Called by the loop at the start of epoch ``epoch`` (0-based), before its first step."""

    def begin_step(self) -> None:
        """Called by the loop before each forward pass (every rank at the same points)."""


def rank_stamp(process_group) -> dict:
    """The world a rank's own state (:attr:`per_rank_state`) is saved in: its size and the rank (every rank
    of a sharded run: the ranks of a replica hold different shards)."""
    if isinstance(process_group, MeshTopology):
        process_group = whole_group(process_group)
    return {"world_size": comm.world_size(process_group), "rank": comm.rank(process_group)}


def check_rank_stamp(name: str, saved: dict, process_group, *, reason: str,
                     alternative: str = "start the optimizer afresh and load only the model") -> None:
    """Refuse a rank's own state saved by another rank or in another world (``saved`` holds its
    :func:`rank_stamp`): ``reason`` says why it cannot be redistributed, ``alternative`` what else to do."""
    here = rank_stamp(process_group)
    if (saved["world_size"], saved["rank"]) != (here["world_size"], here["rank"]):
        raise ValueError(
            f"{name} checkpoint saved by rank {saved['rank']} of world size {saved['world_size']}, loaded on "
            f"rank {here['rank']} of world size {here['world_size']}: {reason}, which cannot be redistributed. "
            f"Resume with {saved['world_size']} workers, each rank loading the state it saved (slamb.save_optimizer "
            f"and slamb.load_optimizer keep one file per rank), or {alternative}.")


def _noop(*args, **kwargs) -> None:
    return None


def adopt(optimizer):
    """Make a ``torch.optim`` optimizer satisfy the contract: a ledger closed at each step, no-op schedules."""
    if getattr(optimizer, "ledger", None) is None:
        optimizer.ledger = comm.CommLedger()
        optimizer.register_step_post_hook(lambda opt, args, kwargs: opt.ledger.end_step())
    for name in ("communication", "params_differ", "per_rank_state", "state_averages", "nonfinite_skips"):
        if not hasattr(optimizer, name):
            setattr(optimizer, name, getattr(ContractDefaults, name))
    for name, default in (("comm_stats", optimizer.ledger.summary), ("ddp_comm_hook", _noop),
                          ("begin_epoch", _noop), ("begin_step", _noop)):
        if not hasattr(optimizer, name):
            setattr(optimizer, name, default)
    if optimizer.communication not in COMMUNICATION:
        raise ValueError(f"invalid communication={optimizer.communication!r}: must be one of {COMMUNICATION}")
    return optimizer
