"""SLAMB under the Hugging Face ``Trainer``: ``SLAMBTrainer``, same arguments.

::

    trainer = SLAMBTrainer(model=model, args=args, train_dataset=ds, optimizer_name="slamb",
                           optimizer_settings=dict(compress_ratio=0.1, sync_interval=100))
    trainer.train()

or ``SLAMBTrainer(..., optimizers=(slamb_opt, scheduler))``. What the plain
``Trainer`` gets wrong for SLAMB: its DDP averages the gradients on every step,
its checkpoints keep rank 0's optimizer state (the other ranks refuse it on
resume) and rank 0's local model, and its fp16 scaler lets one rank skip a step
the others take. Here the DDP gets the optimizer's communication hook (none
for ``communication="no_ddp"``), each ``checkpoint-N/`` also holds one
optimizer state per rank (and each rank's own model when the ranks' parameters
differ), ``save_model()`` saves the ranks' average, ``evaluate()`` and
``predict()`` score it (each rank's own copy comes back after), the scaler is a
:class:`slamb.RankAgreedGradScaler`, and the optimizer's schedules
(``begin_epoch``, ``begin_step``) run at the trainer's epoch and step starts.
Every optimizer of the registry works the same way. On the CPU, pass
``TrainingArguments(use_cpu=True)``: without it each process trains alone
(``SLAMBTrainer`` refuses to). ``TrainingArguments(optim=...)`` and
``optim_args`` name none of these optimizers: left at their defaults, or
refused. A checkpoint saved by a plain ``Trainer`` holds rank 0's optimizer
state only: resuming from it is refused, naming it.

``max_grad_norm`` (``TrainingArguments``' default 1.0) clips the gradient the
optimizer steps with: under SLAMB (and every optimizer that keeps its
gradients local) that is each rank's own, so each rank's local gradient is
scaled by its own norm, that of a mini-batch of 1/n of the global batch
(larger and noisier than the averaged gradient's that DDP clips), and no byte
is sent for it, as the pipelines' ``clip_grad`` does. The trust ratio sets a
layer's step from its parameters' norm, not from the gradient's scale:
clipping changes how much a step weighs in the moments, not the step's size.
``max_grad_norm=0`` turns it off (docs/integrations.md).
"""
from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainingArguments

from .. import create_optimizer, load_optimizer, save_optimizer
from ..contract import GRADIENT_ALLREDUCE, NO_DDP, adopt
from ..registry import optimizer_class
from .support import (load_local_model, rank_agreed_scaler, ranks_average, refuse_framework_checkpoint,
                      refuse_undistributed, register_comm_hook, save_local_model, unwrap_optimizer)

__all__ = ["SLAMBTrainer"]

SCHEDULER_NAME = "scheduler.pt"  # transformers' names for the scheduler and optimizer states in checkpoint-N/
OPTIMIZER_NAME = "optimizer.pt"


class _Schedules(TrainerCallback):
    """The optimizer's epoch and step schedules at the trainer's epoch and optimizer-step starts."""

    def __init__(self, trainer: "SLAMBTrainer"):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer.base_optimizer.begin_epoch(int(state.epoch or 0))

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.base_optimizer.begin_step()


def refuse_optim(args: TrainingArguments | None, optimizer_name: str) -> None:
    """Refuse, in one line, ``TrainingArguments(optim=..., optim_args=...)`` set to other than their defaults:
    ``SLAMBTrainer``'s optimizer is ``optimizer_name``'s (or the one given), and transformers' names hold none of
    the registry's."""
    if args is None:
        return
    default = TrainingArguments.__dataclass_fields__["optim"].default
    if args.optim != default or args.optim_args is not None:
        given = f"optim={getattr(args.optim, 'value', args.optim)!r}" + (
            f", optim_args={args.optim_args!r}" if args.optim_args is not None else "")
        raise ValueError(f"SLAMBTrainer ignores TrainingArguments({given}): its optimizer is "
                         f"optimizer_name={optimizer_name!r} (one of slamb.OPTIMIZERS, settings in optimizer_settings) "
                         "or the one in optimizers=(optimizer, scheduler); leave optim and optim_args at their "
                         "defaults")


class SLAMBTrainer(Trainer):
    """``transformers.Trainer`` for the optimizers of the registry (SLAMB by default).

    Beside ``Trainer``'s arguments: ``optimizer_name`` and
    ``optimizer_settings`` build the optimizer with :func:`slamb.create_optimizer`
    (``lr`` and ``weight_decay`` from ``args`` unless given) when
    ``optimizers`` does not hold one.
    """

    def __init__(self, *args, optimizer_name: str = "slamb", optimizer_settings: dict | None = None, **kwargs):
        refuse_optim(kwargs.get("args", args[1] if len(args) > 1 else None), optimizer_name)
        self.optimizer_name = optimizer_name
        self.optimizer_settings = dict(optimizer_settings or {})
        given = (kwargs.get("optimizers") or (None, None))[0]
        self._communication = adopt(given).communication if given is not None else \
            getattr(optimizer_class(optimizer_name), "communication", GRADIENT_ALLREDUCE)
        super().__init__(*args, **kwargs)
        refuse_undistributed(self.args.world_size, "the Trainer",
                             "on the CPU, pass TrainingArguments(use_cpu=True)")
        self.add_callback(_Schedules(self))

    def _build_accelerator_args(self, **kwargs) -> dict:
        args = super()._build_accelerator_args(**kwargs)
        if self.args.ddp_find_unused_parameters is None and self._communication != GRADIENT_ALLREDUCE:
            # Trainer's default (True) all-reduces a map of the used parameters every step: 4 bytes per
            # parameter tensor outside the optimizer's ledger. The optimizer reads a missing gradient as
            # zero; a model whose forward skips parameters sets ddp_find_unused_parameters=True.
            for handler in args["kwargs_handlers"]:
                if isinstance(handler, DistributedDataParallelKwargs):
                    handler.find_unused_parameters = False
        return args

    @property
    def base_optimizer(self):
        """The registry optimizer behind accelerate's wrapper."""
        return unwrap_optimizer(self.optimizer)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            settings = {"lr": self.args.learning_rate, "weight_decay": self.args.weight_decay,
                        **self.optimizer_settings}
            self.optimizer = create_optimizer(self.optimizer_name, model or self.model, **settings)
        unwrap_optimizer(self.optimizer)
        return self.optimizer

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # before the optimizer is prepared: accelerate's optimizer wrapper keeps the scaler it finds
        self.accelerator.scaler = rank_agreed_scaler(self.accelerator.scaler, self.accelerator.device.type)
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if isinstance(model, DistributedDataParallel) and self.base_optimizer.communication == NO_DDP:
            # the optimizer averages the gradients itself; DDP's reducer stays idle when its forward is not used
            model = self.model_wrapped = model.module
        register_comm_hook(model, self.base_optimizer)
        return model, train_dataloader

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The ranks' average of the model (collective: every rank calls it, as ``Trainer`` does)."""
        with ranks_average(self.model, self.optimizer):
            super().save_model(output_dir, _internal_call)

    def evaluate(self, *args, **kwargs) -> dict:
        """The ranks' average scored; each rank's own copy comes back after (collective, as ``Trainer``'s)."""
        with ranks_average(self.model, self.optimizer):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """The ranks' average's predictions; each rank's own copy comes back after (collective, as ``Trainer``'s)."""
        with ranks_average(self.model, self.optimizer):
            return super().predict(*args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self.base_optimizer
        if not (opt.per_rank_state or opt.params_differ):
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer(opt, output_dir)
        if opt.params_differ:
            save_local_model(self.model, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        opt = self.base_optimizer
        if checkpoint is None or not (opt.per_rank_state or opt.params_differ):
            return super()._load_optimizer_and_scheduler(checkpoint)
        refuse_framework_checkpoint(opt, checkpoint, OPTIMIZER_NAME, "a plain transformers.Trainer", "SLAMBTrainer")
        load_optimizer(opt, checkpoint)
        if opt.params_differ:  # after DDP's broadcast of rank 0's copy at wrapping
            load_local_model(self.model, checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
