"""SLAMB under Hugging Face accelerate: ``prepare`` instead of ``accelerator.prepare``.

::

    model, opt, loader = slamb.integrations.accelerate.prepare(accelerator, model, opt, loader)
    with slamb.integrations.accelerate.averaged(model):   # evaluation: the ranks' average
        evaluate(model)
    slamb.integrations.accelerate.save_model(accelerator, model, "final")   # instead of accelerator.save_model

What ``accelerator.prepare`` alone gets wrong for SLAMB: its DDP averages the
gradients on every step (SLAMB then sends its momentum on top), its
``save_state`` keeps one optimizer state (rank 0's, which rank 1 refuses to
load) and rank 0's local model, ``save_model`` exports rank 0's local model,
and its fp16 scaler lets one rank skip a step the others take. Here the
model's DDP gets the optimizer's communication hook (or no DDP for
``communication="no_ddp"``: JointSpar), ``save_state`` / ``load_state`` also
write and read one optimizer state per rank (and, when the ranks' parameters
differ, each rank's own model, with the ranks' average as the saved model),
``save_model`` and ``averaged`` give the ranks' average, and the scaler is a
:class:`slamb.RankAgreedGradScaler`.
"""
from __future__ import annotations

import weakref

from ..averaging import average_tensors_
from ..contract import NO_DDP
from .support import (load_local_model, rank_agreed_scaler, ranks_average, refuse_framework_checkpoint,
                      refuse_undistributed, register_comm_hook, save_local_model, unwrap_optimizer)

__all__ = ["prepare", "averaged", "save_model"]

# each model prepare() saw (the module inside any DDP) -> the registry optimizer training it: whether its ranks'
# copies differ is the optimizer's to say
_TRAINED_BY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare(accelerator, model, optimizer, *others):
    """``accelerator.prepare(model, optimizer, *others)`` with what ``optimizer`` needs; the same return value.

    Call it once per (model, optimizer) pair, on every rank, before training
    and before ``accelerator.load_state``.
    """
    opt = unwrap_optimizer(optimizer)
    refuse_undistributed(accelerator.num_processes, "accelerate", "on the CPU, pass Accelerator(cpu=True)")
    accelerator.scaler = rank_agreed_scaler(accelerator.scaler, accelerator.device.type)
    if opt.communication == NO_DDP:
        # device placement and autocast, no DDP: the optimizer averages the gradients itself
        wrapped = accelerator.prepare_model(model, evaluation_mode=True)
        rest = accelerator.prepare(optimizer, *others)
        prepared = (wrapped, *(rest if isinstance(rest, tuple) else (rest,)))
    else:
        prepared = accelerator.prepare(model, optimizer, *others)
        wrapped = prepared[0]
        register_comm_hook(wrapped, opt)
    _TRAINED_BY[getattr(wrapped, "module", wrapped)] = opt
    if not (opt.per_rank_state or opt.params_differ):
        return prepared

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

    accelerated = prepared[1]
    reading = []  # the directory load_state reads, from its pre-hook to the optimizer's load_state_dict
    accelerate_load = accelerated.load_state_dict

    def load_hook(models, input_dir):
        reading[:] = [input_dir]

    def load_state_dict(state_dict):
        """Inside ``load_state``, this rank's own files instead of the single optimizer file accelerate keeps
        (rank 0's state, which the other ranks refuse)."""
        if not reading:
            return accelerate_load(state_dict)
        from .. import load_optimizer

        directory = reading.pop()
        refuse_framework_checkpoint(opt, directory, "optimizer.bin", "accelerator.save_state after a plain "
                                    "accelerator.prepare", "slamb.integrations.accelerate.prepare", state_dict)
        if opt.per_rank_state:
            load_optimizer(opt, directory)
        if opt.params_differ:  # accelerate loads the models (the ranks' average) first: the rank's own lands last
            load_local_model(wrapped, directory)

    # accelerate has no public hook for the optimizer's load, and torch's load_state_dict pre-hooks run after
    # the registry optimizer has refused rank 0's state: this one instance's method is shadowed, its class kept
    accelerated.load_state_dict = load_state_dict
    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return prepared


def averaged(model):
    """``with averaged(model):`` the body sees the ranks' average of a model :func:`prepare` saw, and each
    rank's own copy comes back after (:class:`slamb.averaged_model`): for evaluation. Collective: every rank
    enters it."""
    return ranks_average(model, _TRAINED_BY.get(getattr(model, "module", model)))


def save_model(accelerator, model, save_directory, **kwargs) -> None:
    """``accelerator.save_model(model, save_directory, **kwargs)`` writing the ranks' average of a model
    :func:`prepare` saw (accelerate's writes rank 0's own copy). Collective: every rank calls it."""
    with averaged(model):
        accelerator.save_model(model, save_directory, **kwargs)
