"""The mechanics every pipeline's loop shares, so that each ``train.py`` keeps only what is its own.

A pipeline's ``train`` reads top to bottom like nanoGPT's loop: data, model,
optimizer, then the epochs (or steps), each a forward, backward and step per
batch. :class:`Loop` does the rest, the same way in all four:

* the opening: checkpointer, auto-resume with its one "resumed from" line, run logger;
* the steps: progress bar, the fault-injection test hook, the step count;
* evaluation of the run's model, the ranks' average (:func:`slamb.averaged_model`,
  BatchNorm statistics included; training continues from the local models
  unchanged), with the local models' metrics beside it (``<metric>_local``)
  where the optimizer's ranks hold different parameters between syncs;
* the logged period (an epoch, or BERT's ``log_every`` steps): learning rate,
  where the optimizer's per-epoch schedules stand (DGC's ``density``, SLAMB's
  ``compress_ratio``), loss scale, the ledger's byte columns, step time and
  throughput; the checkpoint cadence; :data:`PERIOD_HOOKS` around each period's training;
* the export of the run's model at its end, the ranks' average as it was evaluated (``<run_dir>/model``;
  :func:`save_state_dict` for a model the pipeline builds from its ``model`` config);
* the run summary's common fields, and its one line on the console (:func:`summary_line`).

:func:`check_counts` rejects counts below 1 (epochs, steps, ...) and
:func:`rank_sums` sums a vector of per-rank totals over the ranks.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch

from slamb import average_model, averaged_model, comm
from slamb.ddp import full_state_dict
from slamb.optim.checks import check_count
from .atomic import atomic_torch_save, atomic_write_json
from .checkpoint import open_run, save_training, unwrap
from .distributed import DistEnv, barrier, evaluation_env, maybe_inject_fault
from .fault_tolerance import ManagedSteps
from .replica import current as current_replica
from .run import comm_metrics, comm_totals
from .records import compressed_share, fmt_bytes

# Optimizer settings that the contract's begin_epoch moves (DGC's density warm-up, SLAMB's compression
# warm-up): logged each period to show the schedule the run followed. Reporting only; nothing branches on them.
SCHEDULED = ("density", "compress_ratio")

# Called on every rank as ``hook(loop, event)`` where the training part of a period begins (``"begin"``)
# and ends (``"end"``, before evaluation): bench.netbench reads the ledger and the network counters there,
# so that evaluation's traffic (the averaged model) stays out of its per-step figures.
PERIOD_HOOKS: list[Callable] = []


def check_counts(cfg, *keys: str) -> None:
    """Settings that count something (``epochs``, ``steps``, ``trainer.checkpoint.every``) must be >= 1."""
    for key in keys:
        value = cfg
        for part in key.split("."):
            value = value[part]
        check_count(key, value)


def save_state_dict(model_cfg: dict) -> Callable:
    """The :meth:`Loop.export` ``save`` of a model the pipeline builds from its ``model`` config: ``model.pt``, the
    state dict on the CPU (``torch.load`` it into the built model with ``load_state_dict(strict=True)``), and
    ``config.json``, that config."""
    def save(model: torch.nn.Module, state: dict, folder: Path) -> None:
        atomic_torch_save({k: v.cpu() for k, v in state.items()}, folder / "model.pt")
        atomic_write_json(model_cfg, folder / "config.json")

    return save


def summary_line(summary: dict, command_s: float | None = None) -> str:
    """The line a run ends with: its directory, the final metrics of its model (the summary's ``headline``
    fields), the bytes each worker sent, its training time (its logged periods: steps and evaluations, not the
    start of its processes) and, given ``command_s``, the wall time of the command so far."""
    metrics = " ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}"
                       for k in summary.get("headline", ()))
    return (f"run {summary['run_dir']}: {metrics or 'finished'}; {fmt_bytes(summary['bytes_total'].get('all', 0))} "
            f"sent per worker; training {summary['wall_time_s']:.1f} s"
            + (f" of a {command_s:.1f} s command" if command_s is not None else ""))


def rank_sums(values: torch.Tensor) -> list[float]:
    """The sum over all ranks of this rank's vector of totals (bookkeeping, not training traffic)."""
    totals = values.detach().double().reshape(-1).clone()
    comm.all_reduce_sum_(totals, kind="eval", ledger=None)
    return totals.tolist()


class Loop:
    """One training run's shared mechanics; ``unit`` is what the run counts, ``"epoch"`` or ``"step"``.

    The run's length and checkpoint cadence come from ``cfg``: ``epochs`` (or
    ``steps``) and ``trainer.checkpoint.every``, counted in that unit. ``throughput`` names the samples/s
    column (``images``: ``images_per_s``). ``micro_batches``: those of each step over all workers, where the
    pipeline splits its steps so (:class:`harness.ShardedBatches`): the run may resume on another number of
    workers (:func:`harness.checkpoint.open_run`); ``streams``: the data streams they come from, where not one
    per micro-batch. ``steps_per_epoch``: an epoch-based pipeline's, where it runs under
    ``trainer.fault_tolerance=torchft``, whose steps :class:`harness.fault_tolerance.ManagedSteps` numbers (a
    step-based one's periods are ``log_every`` steps); its ranks are the job's replica groups.
    """

    def __init__(self, run_dir, env, cfg, plain: dict, *, model, optimizer, scheduler, amp=None,
                 global_batch: int, throughput: str, unit: str = "epoch", micro_batches: int | None = None,
                 streams: int | None = None, steps_per_epoch: int | None = None):
        self.run_dir, self.env, self.cfg, self.plain = str(run_dir), env, cfg, plain
        self.model, self.optimizer, self.scheduler, self.amp = model, optimizer, scheduler, amp
        self.global_batch, self.throughput, self.unit = global_batch, f"{throughput}_per_s", unit
        self.length = cfg[f"{unit}s"]
        self.every = cfg.trainer.checkpoint.every  # in the run's unit
        start = {"epoch": 0, "step": 0} if unit == "epoch" else {"step": 0}
        replica = current_replica()
        if replica is None:
            self.managed = None
        else:  # the steps of a logged period, and of the run
            period = steps_per_epoch if unit == "epoch" else cfg.log_every
            total = self.length * steps_per_epoch if unit == "epoch" else self.length
            self.managed = ManagedSteps(replica, model, optimizer, scheduler, heal=cfg.trainer.heal, period=period,
                                        total=total)
        # a relaunched replica group joins a run whose lines others wrote
        writer = env.is_main and (replica is None or replica.attempt == 0)
        self.ckpt, progress, self.restored, self.log = open_run(run_dir, env, cfg, plain, model=model,
                                                           optimizer=optimizer, scheduler=scheduler, amp=amp,
                                                           start=start, micro_batches=micro_batches,
                                                           streams=streams, writer=writer)
        self.done = progress[unit]  # epochs or steps completed
        self.step = progress["step"]
        self.resumed_from = progress["resumed_from"]
        if self.restored and env.is_main:
            at = f"epoch {self.done} (step {self.step})" if unit == "epoch" else f"step {self.step}"
            print(f"resumed from {run_dir}/ckpt at {at}", flush=True)
        self.bytes_before = comm_totals(optimizer)
        self.begin_period()

    @property
    def eval_env(self) -> DistEnv:
        """The ranks an evaluation shares its data among: :func:`harness.distributed.evaluation_env`."""
        return evaluation_env(self.env)

    # -- the loop ---------------------------------------------------------------------------

    def epochs(self):
        """The epochs still to run (0-based); each is one logged period."""
        if self.managed is None:
            epochs = range(self.done, self.length)
        else:
            epochs = (first // self.managed.period for first, _ in self.managed.periods())
        for epoch in epochs:
            if self.managed is not None:
                self.step = epoch * self.managed.period
            self.begin_period()
            yield epoch

    def periods(self, every: int):
        """A step-based run's logged periods still to run, ``(first, end)`` steps each: to each multiple of
        ``every`` and the run's last step (a resumed run's first period is the rest of its period)."""
        if self.managed is None:
            bounds, step = [], self.step
            while step < self.length:
                bounds.append((step, min((step // every + 1) * every, self.length)))
                step = bounds[-1][1]
        else:
            bounds = self.managed.periods()
        for first, end in bounds:
            self.step = first
            self.begin_period()
            yield first, end

    def optimizer_step(self, params, clip_grad: float | None = None):
        """``amp.step(optimizer, params, clip_grad=...)``; under torchft the clipping is the managed step's
        (:meth:`FaultTolerant.step <slamb.integrations.torchft.FaultTolerant.step>`), after a data-parallel
        optimizer's gradient average, as under DDP."""
        if self.managed is None:
            return self.amp.step(self.optimizer, params, clip_grad=clip_grad)
        self.managed.clip_grad = clip_grad
        return self.amp.step(self.optimizer, params)

    def steps(self, iterable, total: int, desc: str, totals: torch.Tensor | None = None):
        """``iterable``'s items with a progress bar; ``self.step`` counts each one the body finishes. Under
        torchft the item of each attempt at a step (:meth:`ManagedSteps.steps`); ``totals``: the sums the body
        adds to, which count committed steps only, summed over the replica groups after the epoch's last."""
        if self.managed is not None:
            items, first = list(iterable), self.step
            for step in self.managed.steps(first, total, totals):
                self.step = step
                maybe_inject_fault(step + 1, self.env)
                yield items[step - first]
            self.step = self.managed.done
            return
        for item in self.log.progress(iterable, total=total, desc=desc):
            maybe_inject_fault(self.step + 1, self.env)
            yield item
            self.step += 1

    def begin_period(self) -> None:
        self.tic = time.perf_counter()
        self.train_time: float | None = None
        self.skipped_before = self.amp.skipped_steps if self.amp is not None else 0
        self.optimizer_before = self.amp.step_seconds if self.amp is not None else 0.0
        for hook in PERIOD_HOOKS:
            hook(self, "begin")

    def _stop_clock(self) -> None:
        """The period's training time ends here (after the device's queued work), before any evaluation."""
        if self.train_time is None:
            if self.env.device.type != "cpu":
                torch.accelerator.synchronize()
            self.train_time = time.perf_counter() - self.tic
            for hook in PERIOD_HOOKS:
                hook(self, "end")

    def evaluate(self, evaluate: Callable[[], dict]) -> dict:
        """``evaluate()``'s metrics of the run's model, the ranks' average, and of the local models
        (keys ``<metric>_local``) when the ranks' parameters differ. Collective: every rank calls it."""
        self._stop_clock()
        metrics = {}
        if self.managed is not None and self.managed.average is None:
            return metrics  # this group did not commit the epoch's last step: another writes its line
        if self.optimizer.params_differ:
            metrics = {f"{k}_local": v for k, v in evaluate().items()}
        if self.managed is not None:
            with self.managed.averaged():
                return {**evaluate(), **metrics}
        # the average is evaluated last, so that what an evaluation writes (SQuAD's predictions) is its
        with averaged_model(self.model):
            return {**evaluate(), **metrics}

    def log_period(self, done: int, metrics: dict, *, steps: int) -> None:
        """Log a period of ``steps`` optimizer steps that ends with ``done`` epochs (or steps) completed."""
        self._stop_clock()
        bytes_now = comm_totals(self.optimizer)
        opt = self.optimizer
        # a step-based run's lines carry no epoch: they are periods of steps, keyed by step
        row = {"epoch": done, "step": self.step} if self.unit == "epoch" else {"step": done}
        row = {**row, **metrics,
               "lr": opt.param_groups[0]["lr"], **{k: getattr(opt, k) for k in SCHEDULED if hasattr(opt, k)}}
        if self.amp is not None:
            row.update(loss_scale=self.amp.scale, skipped_steps=self.amp.skipped_steps - self.skipped_before)
            if self.amp.time_steps:  # the optimizer's share of step_time_s (its communication included)
                row["optimizer_time_s"] = (self.amp.step_seconds - self.optimizer_before) / steps
        per_s = steps * self.global_batch / self.train_time
        row.update({**comm_metrics(bytes_now, self.bytes_before), "period_steps": steps,
                    "step_time_s": self.train_time / steps, self.throughput: per_s,
                    f"{self.throughput}_per_worker": per_s / self.env.world_size,
                    "epoch_time_s": time.perf_counter() - self.tic})
        if self.managed is not None:
            self.log.writer = self.managed.writer
        self.log.log(row)
        self.bytes_before = bytes_now
        self.begin_period()

    def save_if_due(self, done: int) -> None:
        """Checkpoint every ``every`` epochs (or steps) and at the end of the run."""
        self.done = done
        if not self.cfg.trainer.checkpoint.enabled or (done % self.every and done != self.length):
            return
        progress = {"epoch": done, "step": self.step} if self.unit == "epoch" else {"step": done}
        save_training(self.ckpt, {**progress, "resumed_from": self.resumed_from}, model=self.model,
                      optimizer=self.optimizer, scheduler=self.scheduler,
                      extra={"amp": self.amp.state_dict()} if self.amp is not None else None)

    @torch.no_grad()
    def export(self, save: Callable[[torch.nn.Module, dict, Path], None]) -> str:
        """Write the run's model into ``<run_dir>/model``: the ranks' average, computed as :meth:`evaluate`
        computes it (so the export scores what the run logged); rank 0 calls ``save(model, state_dict, folder)``,
        the state dict whole under FSDP/HSDP. Collective: every rank calls it, at the end of training (the ranks
        keep the average). Returns the folder."""
        if self.managed is not None and self.managed.average is not None:
            self.managed.keep_average()
        average_model(self.model)  # one model's bytes once, outside the training ledger
        state = full_state_dict(unwrap(self.model))  # collective under FSDP/HSDP
        folder = Path(self.run_dir) / "model"
        if self.log.writer:
            folder.mkdir(parents=True, exist_ok=True)
            save(unwrap(self.model), state, folder)
        barrier()
        return str(folder)

    def end_epoch(self, epoch: int, metrics: dict, *, steps: int) -> None:
        self.log_period(epoch + 1, metrics, steps=steps)
        self.save_if_due(epoch + 1)

    # -- the summary ------------------------------------------------------------------------

    def history(self) -> list[dict]:
        return self.log.history() if self.log.writer else []

    def last(self, key: str) -> float:
        """``key`` of the last logged period (NaN on ranks other than 0, which keep no history)."""
        history = self.history()
        return history[-1].get(key, math.nan) if history else math.nan

    def best(self, key: str) -> float:
        return max((h[key] for h in self.history()), default=math.nan)

    def finish(self, headline: tuple[str, ...] = (), **fields) -> dict:
        """Write and return the run summary: the common fields, then the pipeline's ``fields``; its
        :func:`summary_line` (the launcher prints it) shows the ``headline`` fields, the final metrics of the run's
        model."""
        history = self.history()
        seconds = sum(h["period_steps"] * h["step_time_s"] for h in history)
        steps = sum(h["period_steps"] for h in history)
        model = unwrap(self.model)
        totals = comm_totals(self.optimizer)
        summary = {
            "name": self.cfg.name, "optimizer": self.cfg.optimizer.name, "world_size": self.env.world_size,
            "global_batch": self.global_batch, f"{self.unit}s": self.length, "steps": self.step,
            "params": sum(p.numel() for p in model.parameters()),
            "compressed_share": compressed_share(totals), **fields,
            # over every logged period of the run, resumed attempts included; a name of its own, as wandb's
            # run summary keeps the last logged value of a history column over an update of the same key
            f"mean_{self.throughput}": steps * self.global_batch / seconds
            if seconds > 0 else math.nan,
            "bytes_total": totals,
            "wall_time_s": sum(h["epoch_time_s"] for h in history),
            # per training step over the logged periods: the whole step, and the optimizer's share of it
            "mean_step_time_s": seconds / steps if steps else math.nan,
            "mean_optimizer_time_s": (sum(h["period_steps"] * h["optimizer_time_s"] for h in history) / steps
                                      if steps and all("optimizer_time_s" in h for h in history) else None),
            "resumed_from": self.resumed_from, "run_dir": self.run_dir, "paper": self.plain.get("paper"),
            "headline": list(headline),
        }
        self.log.finish(summary)
        return summary
