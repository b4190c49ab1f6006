"""Atomic, rank-aware checkpoints with auto-resume.

Layout under ``<run_dir>/ckpt/``::

    step000000480/shared.pt      rank 0: what every rank holds identically
                                 (model when parameters agree, LR scheduler, progress, extra)
    step000000480/rank{r}.pt     every rank: optimizer state, its ledger, its RNG
                                 streams, and its model when parameters differ by rank
    step000000480/complete.json  written once every rank's file is on disk: the folder is usable
    latest.json                  the last COMPLETE checkpoint (written last, atomically)

Each file is written to a temporary name and renamed; ``complete.json`` and
``latest.json`` are renamed into place only after every rank has finished
writing (a barrier), so a worker killed during a save leaves the previous
checkpoint in force and all ranks resume from the same step. Optimizers whose
state is per rank (SLAMB: local moments; its load refuses another rank's
state) therefore resume exactly; so do parameters that differ between SLAMB's
model syncs.

The last ``keep`` complete checkpoints stay (two by default): when the newest
cannot be read on some rank, every rank falls back to the previous one.

A run's data and model inputs (:data:`harness.settings.INPUT_KEYS`) are recorded with each
checkpoint; resuming from it with other inputs is refused, because the
directory name leaves them out (a dataset can move) and a resumed run would
otherwise report one model's results under another's name.

Files are loaded to the CPU and copied where they belong by the objects'
``load_state_dict``: RNG states must stay CPU ``ByteTensor``s, and a run may
resume on another device layout than the one that saved it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from slamb import comm
from .atomic import atomic_torch_save, atomic_write_json
from .distributed import DistEnv, barrier
from .run import RunLogger
from .seeding import rng_state, set_rng_state
from .settings import INPUT_KEYS, check_schedule, lookup, same_configuration

LATEST, COMPLETE = "latest.json", "complete.json"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def run_inputs(cfg) -> dict[str, str]:
    """The :data:`INPUT_KEYS` a config sets, as absolute paths (a relative path depends on the cwd)."""
    out = {}
    for key in INPUT_KEYS:
        value = lookup(cfg, key)
        if isinstance(value, str) and value not in ("", "???"):
            out[key] = os.path.abspath(value)
    return out


def check_inputs(saved: dict | None, current: dict, where) -> None:
    """Refuse to resume the run in ``where`` (trained with inputs ``saved``) with other inputs."""
    if saved is None:  # written before inputs were recorded
        return
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ValueError(
                f"the run in {where} was trained with {key}={saved.get(key)!r} and this run has "
                f"{key}={current.get(key)!r}: resuming would mix two inputs under one run. Set {key} back to "
                f"resume, or start this run over with trainer.resume=never (or another run directory)")


def _unreadable(path: Path, err: Exception) -> str:
    return (f"checkpoint file {path} is unreadable ({type(err).__name__}: {err}); delete that checkpoint "
            f"folder to resume from an older one, or start over with trainer.resume=never")


class Checkpointer:
    def __init__(self, run_dir, env: DistEnv, keep: int = 2, inputs: dict | None = None):
        if keep < 1:
            raise ValueError(f"invalid checkpoint.keep={keep}: must be >= 1 (the last checkpoint resumes the run)")
        self.dir = Path(run_dir) / "ckpt"
        self.env = env
        self.keep = keep
        self.inputs = inputs

    def latest(self) -> dict | None:
        path = self.dir / LATEST
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:  # written atomically, so only a damaged disk: the folders' markers still say
            print(f"{path} is unreadable: looking for complete checkpoints in {self.dir}", flush=True)
            return None

    def complete(self) -> list[dict]:
        """The complete checkpoints on disk, newest first (``latest.json``'s first)."""
        latest = self.latest()
        found = [latest] if latest is not None else []
        for marker in sorted(self.dir.glob(f"step*/{COMPLETE}"), reverse=True):
            if latest is None or marker.parent.name != latest["dir"]:
                try:
                    found.append({"dir": marker.parent.name, **json.loads(marker.read_text())})
                except (OSError, ValueError):
                    continue
        return found

    def save(self, progress: dict, shared: dict, per_rank: dict) -> Path:
        """Write one checkpoint; ``progress`` (json-able; must hold ``step``) goes in ``latest.json``."""
        name = f"step{int(progress['step']):09d}"
        folder = self.dir / name
        folder.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(per_rank, folder / f"rank{self.env.rank}.pt")
        if self.env.is_main:
            atomic_torch_save({"progress": progress, **shared}, folder / "shared.pt")
        barrier()  # every rank's file is on disk before the checkpoint is declared complete
        if self.env.is_main:
            record = {"world_size": self.env.world_size, **progress}
            if self.inputs is not None:
                record["inputs"] = self.inputs
            atomic_write_json(record, folder / COMPLETE)
            atomic_write_json({"dir": name, **record}, self.dir / LATEST)
            old = sorted(p for p in self.dir.glob("step*") if p.is_dir() and p.name != name)
            for stale in old[: max(0, len(old) - (self.keep - 1))]:
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        return folder

    def _read(self, folder: Path) -> tuple[dict | None, str | None]:
        """(shared + this rank's files, None) or (None, why not)."""
        loaded = {}
        for key, name in (("shared", "shared.pt"), ("mine", f"rank{self.env.rank}.pt")):
            try:
                loaded[key] = torch.load(folder / name, map_location="cpu", weights_only=False)
            except Exception as err:  # truncated, corrupt or missing: torch.load raises many kinds
                return None, _unreadable(folder / name, err)
        return loaded, None

    def load(self) -> tuple[dict, dict, dict] | None:
        """(progress, shared, this rank's) of the newest checkpoint every rank can read, or None."""
        candidates = self.complete()
        if not candidates:
            return None
        latest = candidates[0]
        if latest["world_size"] != self.env.world_size:
            raise ValueError(
                f"the checkpoint in {self.dir} was written by {latest['world_size']} workers and this run has "
                f"{self.env.world_size}: per-rank optimizer state cannot be redistributed. Resume with "
                f"{latest['world_size']} workers, or use a new run directory (trainer.resume=never starts over)"
            )
        if self.inputs is not None:
            check_inputs(latest.get("inputs"), self.inputs, self.dir)
        for i, entry in enumerate(candidates):
            loaded, why = self._read(self.dir / entry["dir"])
            # one rank's unreadable file sends every rank back, so that all resume from the same step
            failed = loaded is None if self.env.world_size == 1 else \
                comm.agree_any(torch.tensor(loaded is None, device=self.env.device), ledger=None)
            if not failed:
                shared = loaded["shared"]
                return shared.pop("progress"), shared, loaded["mine"]
            if i + 1 == len(candidates):
                raise RuntimeError(why or f"checkpoint {self.dir / entry['dir']} is unreadable on another rank; "
                                   "start over with trainer.resume=never")
            if self.env.is_main:
                print(f"{why or 'checkpoint ' + entry['dir'] + ' is unreadable on another rank'}: "
                      f"resuming from the previous checkpoint, {candidates[i + 1]['dir']}", flush=True)
        return None


def save_training(ckpt: Checkpointer, progress: dict, *, model, optimizer, scheduler=None, extra=None) -> Path:
    """Checkpoint a training loop: model, optimizer (+ ledger), scheduler, RNG streams, progress."""
    model_sd = unwrap(model).state_dict()
    per_rank_model = optimizer.params_differ  # the contract: SLAMB between syncs
    shared = {"scheduler": scheduler.state_dict() if scheduler is not None else None, "extra": extra}
    per_rank = {"optimizer": optimizer.state_dict(), "ledger": optimizer.ledger.state_dict(), "rng": rng_state()}
    (per_rank if per_rank_model else shared)["model"] = model_sd
    if not per_rank_model:
        # floating buffers (BatchNorm statistics) are each rank's own under every optimizer: the pipelines
        # do not broadcast them per forward, and the evaluated model averages them
        per_rank["buffers"] = {k: v for k, v in unwrap(model).named_buffers() if v.is_floating_point()}
    return ckpt.save(progress, shared, per_rank)


def restore_training(ckpt: Checkpointer, *, model, optimizer, scheduler=None) -> tuple[dict, object] | None:
    """Load the latest checkpoint into the objects; returns (progress, extra) or None to start afresh."""
    loaded = ckpt.load()
    if loaded is None:
        return None
    progress, shared, mine = loaded
    unwrap(model).load_state_dict(mine["model"] if "model" in mine else shared["model"])
    if mine.get("buffers"):
        unwrap(model).load_state_dict(mine["buffers"], strict=False)
    optimizer.load_state_dict(mine["optimizer"])
    # torch.optim optimizers keep the ledger outside their state_dict: cumulative bytes survive resume here
    optimizer.ledger.load_state_dict(mine["ledger"])
    if scheduler is not None:
        scheduler.load_state_dict(shared["scheduler"])
    set_rng_state(mine["rng"])
    return progress, shared.get("extra")


def open_run(run_dir, env, cfg, plain: dict, *, model, optimizer, scheduler=None, amp=None, start: dict):
    """The opening every training loop shares: checkpointer, auto-resume, logger.

    With ``trainer.resume == "auto"`` the latest checkpoint, if any, is loaded into the objects (the loss
    scale of ``amp`` too); ``start`` is the progress of a fresh run, e.g. ``{"epoch": 0, "step": 0}``.
    Returns ``(checkpointer, progress, restored, logger)``; ``progress["resumed_from"]`` lists the
    epochs (or steps, for step-based loops) the run was resumed at.
    """
    t = cfg.trainer
    ckpt = Checkpointer(run_dir, env, keep=t.checkpoint.keep, inputs=run_inputs(plain))
    restored = restore_training(ckpt, model=model, optimizer=optimizer, scheduler=scheduler) \
        if t.resume == "auto" else None
    progress, extra = restored or ({**start, "resumed_from": []}, None)
    if extra and amp is not None:
        amp.load_state_dict(extra["amp"])
    at = progress.get("epoch", progress["step"])
    if restored:
        progress = {**progress, "resumed_from": progress["resumed_from"] + [at]}
    log = RunLogger(run_dir, plain, env, wandb=cfg.logger.wandb, wandb_project=cfg.logger.project,
                    progress=t.progress, resume_epoch=at)
    return ckpt, progress, restored is not None, log


def prepare_run(cfg: dict, run_dir, *, clear: bool = True) -> dict | None:
    """What :func:`harness.build.run_from_hydra` checks before any worker starts.

    Refuses an empty schedule and a resume with other inputs; with ``trainer.resume=never`` removes
    the old checkpoints (``clear``: not under torchrun, where every worker runs this). Returns the
    summary of a run that already finished with this configuration (nothing to train), else None.
    """
    check_schedule(cfg)
    run_dir = Path(run_dir)
    ckpt = run_dir / "ckpt"
    if cfg["trainer"]["resume"] == "never":
        if clear and ckpt.exists():
            shutil.rmtree(ckpt)
        return None
    for entry in Checkpointer(run_dir, None).complete()[:1]:
        check_inputs(entry.get("inputs"), run_inputs(cfg), ckpt)
    summary, config = run_dir / "metrics.json", run_dir / "config.yaml"
    if summary.exists() and config.exists():
        import yaml

        saved = yaml.safe_load(config.read_text())
        check_inputs(run_inputs(saved), run_inputs(cfg), run_dir)
        if same_configuration(saved, cfg):
            print(f"{run_dir} is finished (metrics.json): nothing to train. Its summary stands; "
                  "trainer.resume=never trains it again from scratch", flush=True)
            return json.loads(summary.read_text())
    return None
