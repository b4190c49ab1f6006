"""What the framework integrations share: the optimizer behind a framework's wrappers, the check that the
framework sees every rank, the DDP communication the optimizer needs, the ranks' average for evaluation and
export, per-rank model checkpoints, the rank-agreed loss scaler."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import comm
from ..averaging import averaged_model
from ..checkpoint import optimizer_file
from ..contract import NO_DDP, adopt
from ..ddp import comm_hook


def unwrap_optimizer(optimizer):
    """The registry optimizer inside accelerate's ``AcceleratedOptimizer`` or Lightning's ``LightningOptimizer``."""
    while True:
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return adopt(optimizer)
        optimizer = inner


def refuse_undistributed(framework_ranks: int, framework: str, fix: str) -> None:
    """Refuse a framework that counts other ranks than were launched (``fix``: how to make it count them; its
    ``{ranks}`` becomes the count it should see).

    On the CPU, without its CPU flag, each framework runs every process as a
    world of one: each rank would train alone on all the data, with no DDP and
    no exchange, and nothing would fail. A framework counting more ranks than
    an already initialised torch.distributed has splits the data among ranks
    that do not exist.
    """
    launched = max(comm.world_size(), int(os.environ.get("WORLD_SIZE", "1")))
    if framework_ranks < launched:
        raise RuntimeError(f"{framework} runs {framework_ranks} process(es) of the {launched} launched: each would "
                           f"train alone on all the data; {fix.format(ranks=launched)}")
    if dist.is_available() and dist.is_initialized() and framework_ranks > comm.world_size():
        raise RuntimeError(f"{framework} runs {framework_ranks} processes, torch.distributed has "
                           f"{comm.world_size()}: the data would be split among ranks that do not exist; "
                           f"{fix.format(ranks=comm.world_size())}")


def register_comm_hook(ddp: torch.nn.Module, optimizer) -> None:
    """Give a framework's DDP the gradient communication ``optimizer`` needs (:mod:`slamb.ddp`).

    The optimizer's own hook (SLAMB: none at all; DGC, 1-bit LAMB: their
    exchange), or for data-parallel optimizers DDP's averaging all-reduce
    recorded in the optimizer's ledger. Must run before the first backward.
    """
    optimizer = unwrap_optimizer(optimizer)
    if not isinstance(ddp, DistributedDataParallel):
        return
    if optimizer.communication == NO_DDP:
        raise ValueError(f"{type(optimizer).__name__} has communication='no_ddp': the model must not be wrapped in "
                         "DDP, pass the plain model (the integration does so when it builds the wrapping)")
    ddp.register_comm_hook(*comm_hook(optimizer, ddp.process_group))


def ranks_average(model: torch.nn.Module, optimizer):
    """``with ranks_average(model, optimizer):`` the body sees the ranks' average of ``model`` when the ranks'
    copies differ under ``optimizer`` (:class:`slamb.averaged_model`), ``model`` itself otherwise.

    Collective when the copies differ: every rank enters it. With no
    optimizer yet (nothing trained) or a data-parallel one, the copies are
    equal and an all-reduce would only round them.
    """
    if optimizer is None or not unwrap_optimizer(optimizer).params_differ or comm.world_size() == 1:
        return contextlib.nullcontext()
    return averaged_model(model)


def refuse_framework_checkpoint(optimizer, directory, saved_file: str, saved_by: str, saver: str,
                                state: dict | None = None) -> None:
    """Refuse, in one line, resuming ``optimizer`` (whose state is each rank's own) from a checkpoint the framework
    saved without the integration (``saved_by``): its one optimizer file ``saved_file`` (``state``, read from it
    where not given) holds rank 0's state, and its model rank 0's copy. Another optimizer's state, or the per-rank
    files of another world, are left to :func:`slamb.load_optimizer`, which names them."""
    directory = Path(directory)
    if optimizer_file(optimizer, directory).is_file() or any(directory.glob("optimizer.rank*-of-*.pt")):
        return
    if state is None:
        try:
            state = torch.load(directory / saved_file, map_location="cpu", weights_only=True)
        except Exception:  # absent or unreadable: slamb.load_optimizer says what the directory holds
            return
    groups = state.get("param_groups") if isinstance(state, dict) else None
    # this optimizer's hyper-parameters (an LR scheduler adds initial_lr to the groups it has seen)
    if not (groups and set(optimizer.param_groups[0]) - {"params", "initial_lr"} <= set(groups[0])):
        return
    name = type(optimizer).__name__
    raise FileNotFoundError(
        f"{directory} was saved by {saved_by}, which keeps rank 0's {name} state ({saved_file}) and rank 0's model "
        f"only, not each rank's own ({optimizer_file(optimizer, directory).name}): the ranks cannot resume from it; "
        f"resume from a checkpoint {saver} saved, or load only its model and start {name} afresh")


def local_model_file(directory) -> Path:
    return Path(directory) / f"model.rank{comm.rank()}-of-{comm.world_size()}.pt"


def save_local_model(model: torch.nn.Module, directory) -> None:
    """This rank's own parameters and buffers, for optimizers whose ranks' parameters differ between syncs.

    The checkpoint's model is the ranks' average (what to evaluate and
    export); continuing the run bit-exactly needs each rank's own copy.
    """
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(getattr(model, "module", model).state_dict(), local_model_file(directory))


def load_local_model(model: torch.nn.Module, directory) -> None:
    path = local_model_file(directory)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the ranks' parameters differ between syncs, so resuming needs "
                                f"each rank's own copy; resume with the world size the checkpoint was saved with "
                                f"({comm.world_size()} now), or load only the averaged model and start a new run")
    getattr(model, "module", model).load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def rank_agreed_scaler(scaler, device: str):
    """``scaler`` (a ``torch.amp.GradScaler`` for ``device``, the framework's device type) as a
    :class:`slamb.RankAgreedGradScaler` with its settings and state.

    Through ``GradScaler``'s public API only: its ``state_dict()`` holds every
    setting (scale, growth and backoff factors, growth interval) and the
    growth tracker; a disabled scaler's is empty, and none is needed.
    """
    if scaler is None:
        return None
    from .. import RankAgreedGradScaler

    if isinstance(scaler, RankAgreedGradScaler):
        return scaler
    agreed = RankAgreedGradScaler(device, enabled=scaler.is_enabled())
    if scaler.is_enabled():
        agreed.load_state_dict(scaler.state_dict())
    return agreed
