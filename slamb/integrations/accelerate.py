"""SLAMB under Hugging Face accelerate: ``prepare`` instead of ``accelerator.prepare``.

::

    model, opt, loader = slamb.integrations.accelerate.prepare(accelerator, model, opt, loader)

What ``accelerator.prepare`` alone gets wrong for SLAMB: its DDP averages the
gradients on every step (SLAMB then sends its momentum on top), its
``save_state`` keeps one optimizer state (rank 0's, which rank 1 refuses to
load) and rank 0's local model, and its fp16 scaler lets one rank skip a step
the others take. Here the model's DDP gets the optimizer's communication hook
(or no DDP for ``communication="no_ddp"``: JointSpar), ``save_state`` /
``load_state`` also write and read one optimizer state per rank (and, when the
ranks' parameters differ, each rank's own model, with the ranks' average as the
saved model), and the scaler is a :class:`slamb.RankAgreedGradScaler`.
"""
from __future__ import annotations

from ..averaging import average_tensors_
from ..contract import NO_DDP
from ._common import (load_local_model, rank_agreed_scaler, register_comm_hook, save_local_model,
                      unwrap_optimizer)

__all__ = ["prepare"]


class _OwnState:
    """Mixed into accelerate's optimizer wrapper: inside ``load_state`` it reads this rank's own files instead of
    the single optimizer file accelerate keeps (rank 0's state). accelerate loads the optimizers after the
    models, so the rank's own model lands last, over the ranks' average."""

    _own_state_dir = None

    def load_state_dict(self, state_dict):
        directory, self._own_state_dir = self._own_state_dir, None
        if directory is None:
            return super().load_state_dict(state_dict)
        self._load_own_state(directory)


def prepare(accelerator, model, optimizer, *others):
    """``accelerator.prepare(model, optimizer, *others)`` with what ``optimizer`` needs; the same return value.

    Call it once per (model, optimizer) pair, on every rank, before training
    and before ``accelerator.load_state``.
    """
    opt = unwrap_optimizer(optimizer)
    accelerator.scaler = rank_agreed_scaler(accelerator.scaler)
    if opt.communication == NO_DDP:
        # device placement and autocast, no DDP: the optimizer averages the gradients itself
        wrapped = accelerator.prepare_model(model, evaluation_mode=True)
        rest = accelerator.prepare(optimizer, *others)
        prepared = (wrapped, *(rest if isinstance(rest, tuple) else (rest,)))
    else:
        prepared = accelerator.prepare(model, optimizer, *others)
        wrapped = prepared[0]
        register_comm_hook(wrapped, opt)
    accelerated = prepared[1]
    if not (opt.per_rank_state or opt.params_differ):
        return prepared
    accelerated.__class__ = type(f"PerRank{type(accelerated).__name__}", (_OwnState, type(accelerated)), {})

    def save_hook(models, weights, output_dir):
        from .. import save_optimizer

        if opt.per_rank_state:
            save_optimizer(opt, output_dir)
        if opt.params_differ:
            save_local_model(wrapped, output_dir)
            for i, m in enumerate(models):  # accelerate keeps the DDP on GPUs, the module itself on CPUs
                if getattr(m, "module", m) is getattr(wrapped, "module", wrapped) and i < len(weights):
                    # the saved model is the ranks' average; the rank's own copy is in its file
                    weights[i] = {k: v.clone() for k, v in weights[i].items()}
                    average_tensors_([v for v in weights[i].values() if v.is_floating_point()], kind="eval")

    def load_own_state(directory):
        from .. import load_optimizer

        if opt.per_rank_state:
            load_optimizer(opt, directory)
        if opt.params_differ:
            load_local_model(wrapped, directory)

    def load_hook(models, input_dir):
        accelerated._own_state_dir = input_dir

    accelerated._load_own_state = load_own_state
    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return prepared
