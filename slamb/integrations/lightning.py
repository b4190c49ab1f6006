"""SLAMB under PyTorch Lightning: ``SLAMBStrategy``, a ``DDPStrategy``.

::

    trainer = lightning.Trainer(strategy=SLAMBStrategy(), devices=2, ...)

What ``DDPStrategy`` alone gets wrong for SLAMB: its DDP averages the gradients
on every step (its ``ddp_comm_hook`` is only registered on CUDA), its
checkpoints keep rank 0's optimizer state (the other ranks refuse it on resume)
and rank 0's local model, and its fp16 scaler lets one rank skip a step the
others take. Here the DDP gets the optimizer's communication hook on every
device (no DDP for ``communication="no_ddp"``), every checkpoint ``x.ckpt``
comes with ``x.ckpt.ranks/`` holding one optimizer state per rank (and each
rank's own model when the ranks' parameters differ, the checkpoint's
``state_dict`` being the ranks' average), the precision plugin's scaler is a
:class:`slamb.RankAgreedGradScaler`, and the optimizer's schedules run at each
epoch and optimizer-step start. Validation, test and predict score the ranks'
average (``DDPStrategy`` gives every rank rank 0's copy outside ``fit``) and
leave each rank its own copy. Every optimizer of the registry works the same way.
"""
from __future__ import annotations

import contextlib
import os
import shutil

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel

from .. import comm, load_optimizer, save_optimizer
from ..averaging import average_tensors_
from ..contract import NO_DDP
from .support import (load_local_model, rank_agreed_scaler, ranks_average, refuse_undistributed, register_comm_hook,
                      save_local_model, unwrap_optimizer)

__all__ = ["SLAMBStrategy"]


def own_state_dir(filepath) -> str:
    """Where the per-rank files of checkpoint ``filepath`` go."""
    return f"{filepath}.ranks"


class SLAMBStrategy(DDPStrategy):
    """``DDPStrategy`` (same arguments) for the optimizers of the registry; one optimizer per model."""

    strategy_name = "slamb_ddp"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loaded_from = None
        self._epoch = None
        self._evaluation = contextlib.ExitStack()

    @property
    def base_optimizer(self):
        if len(self.optimizers) != 1:
            raise ValueError(f"SLAMBStrategy drives one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}: return one")
        return unwrap_optimizer(self.optimizers[0])

    def setup_environment(self) -> None:
        # before DDPStrategy's: it indexes its devices by LOCAL_RANK (an IndexError past them) and keeps a
        # torch.distributed initialised outside Lightning whatever its size
        refuse_undistributed(self.num_nodes * self.num_processes, "Lightning",
                             "pass lightning.Trainer(devices=..., num_nodes=...) whose product is {ranks} "
                             '(one CPU machine: accelerator="cpu", devices={ranks})')
        super().setup_environment()

    def setup(self, trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        own = None
        if not fitting and self._params_differ():
            own = {k: v.clone() for k, v in self.lightning_module.state_dict().items()}
        super().setup(trainer)
        if own is not None:
            # outside fit, DDPStrategy gives every rank rank 0's copy; evaluation scores the ranks' average
            # (on_validation_start, ...) and each rank goes on from its own
            self.lightning_module.load_state_dict(own)
        scaler = getattr(self.precision_plugin, "scaler", None)
        self.precision_plugin.scaler = rank_agreed_scaler(scaler, self.root_device.type)
        if not fitting:
            return
        opt = self.base_optimizer
        if isinstance(self.model, DistributedDataParallel) and opt.communication == NO_DDP:
            # the optimizer averages the gradients itself; DDP's reducer stays idle when its forward is not used
            self.model = self.model.module
        register_comm_hook(self.model, opt)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer
        if self._epoch != trainer.current_epoch:
            self._epoch = trainer.current_epoch
            self.base_optimizer.begin_epoch(trainer.current_epoch)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.base_optimizer.begin_step()

    def _params_differ(self) -> bool:
        return bool(self.optimizers) and self.base_optimizer.params_differ and comm.world_size() > 1

    def _begin_evaluation(self) -> None:
        """The ranks' average in the module until :meth:`_end_evaluation` (collective: every rank evaluates)."""
        self._evaluation.enter_context(ranks_average(self.lightning_module,
                                                     self.base_optimizer if self.optimizers else None))

    def _end_evaluation(self) -> None:
        self._evaluation.close()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._begin_evaluation()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._begin_evaluation()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._begin_evaluation()

    def on_validation_end(self) -> None:
        self._end_evaluation()
        super().on_validation_end()

    def on_test_end(self) -> None:
        self._end_evaluation()
        super().on_test_end()

    def on_predict_end(self) -> None:
        self._end_evaluation()
        super().on_predict_end()

    def lightning_module_state_dict(self) -> dict:
        """The ranks' average when their parameters differ (collective: every rank dumps the checkpoint)."""
        # ModelCheckpoint saves in its on_validation_end, before the strategy's: the checkpoint needs each
        # rank's own copy (its per-rank file), the ranks' average is taken again below
        self._end_evaluation()
        state = super().lightning_module_state_dict()
        if not self._params_differ():
            return state
        state = {k: v.clone() for k, v in state.items()}
        average_tensors_([v for v in state.values() if v.is_floating_point()], kind="eval")
        return state

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        opt = self.base_optimizer if self.optimizers else None
        if opt is not None and (opt.per_rank_state or opt.params_differ):
            save_optimizer(opt, own_state_dir(filepath))
            if opt.params_differ:
                save_local_model(self.lightning_module, own_state_dir(filepath))

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(own_state_dir(filepath), ignore_errors=True)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        # ModelCheckpoint(save_last="link") makes last.ckpt a link to the checkpoint beside its .ranks/
        self._loaded_from = os.path.realpath(checkpoint_path) if os.path.islink(checkpoint_path) else checkpoint_path
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        opt = self.base_optimizer
        if not (opt.per_rank_state or opt.params_differ) or self._loaded_from is None:
            return super().load_optimizer_state_dict(checkpoint)
        if not os.path.isdir(own_state_dir(self._loaded_from)):
            raise FileNotFoundError(f"{own_state_dir(self._loaded_from)} is missing: {type(opt).__name__} keeps a "
                                    f"state per rank, which SLAMBStrategy writes beside each checkpoint; copy it "
                                    f"along with {self._loaded_from}, or resume from a checkpoint SLAMBStrategy saved")
        load_optimizer(opt, own_state_dir(self._loaded_from))
        if opt.params_differ:  # after DDP's broadcast of rank 0's copy at wrapping
            load_local_model(self.lightning_module, own_state_dir(self._loaded_from))
