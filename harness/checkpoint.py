"""Atomic, rank-aware checkpoints with auto-resume.

Layout under ``<run_dir>/ckpt/``::

    step000000480/shared.pt      rank 0: what every rank holds identically
                                 (model when parameters agree, LR scheduler, progress, extra)
    step000000480/rank{r}.pt     every rank: optimizer state, its ledger, its RNG
                                 streams, and its model when parameters differ by rank
    latest.json                  the last COMPLETE checkpoint (written last, atomically)

Each file is written to a temporary name and renamed; ``latest.json`` is
renamed into place only after every rank has finished writing (a barrier), so
a worker killed during a save leaves the previous checkpoint in force and all
ranks resume from the same step. Optimizers whose state is per rank (SLAMB:
local moments; its load refuses another rank's state) therefore resume
exactly; so do parameters that differ between SLAMB's model syncs.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .distributed import DistEnv, barrier
from .seeding import rng_state, set_rng_state

LATEST = "latest.json"


def atomic_write_bytes(path: Path, write) -> None:
    """``write(file)`` into a temporary sibling, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    atomic_write_bytes(path, lambda f: torch.save(obj, f))


def atomic_write_json(obj, path: Path) -> None:
    atomic_write_bytes(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def params_differ_across_ranks(optimizer) -> bool:
    """True for optimizers that update each rank's parameters from local data (SLAMB between syncs)."""
    return optimizer.params_differ


class Checkpointer:
    def __init__(self, run_dir, env: DistEnv, keep: int = 1):
        if keep < 1:
            raise ValueError(f"invalid checkpoint.keep={keep}: must be >= 1 (the last checkpoint resumes the run)")
        self.dir = Path(run_dir) / "ckpt"
        self.env = env
        self.keep = keep

    def latest(self) -> dict | None:
        path = self.dir / LATEST
        if not path.exists():
            return None
        return json.loads(path.read_text())

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
            atomic_write_json({"dir": name, "world_size": self.env.world_size, **progress}, self.dir / LATEST)
            old = sorted(p for p in self.dir.glob("step*") if p.is_dir() and p.name != name)
            for stale in old[: max(0, len(old) - (self.keep - 1))]:
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        return folder

    def load(self) -> tuple[dict, dict, dict] | None:
        """(progress, shared, this rank's) of the latest checkpoint, or None when there is none."""
        latest = self.latest()
        if latest is None:
            return None
        if latest["world_size"] != self.env.world_size:
            raise ValueError(
                f"the checkpoint in {self.dir} was written by {latest['world_size']} workers and this run has "
                f"{self.env.world_size}: per-rank optimizer state cannot be redistributed. Resume with "
                f"{latest['world_size']} workers, or use a new run directory (trainer.resume=never starts over)"
            )
        folder = self.dir / latest["dir"]
        shared = torch.load(folder / "shared.pt", map_location=self.env.device, weights_only=False)
        mine = torch.load(folder / f"rank{self.env.rank}.pt", map_location=self.env.device, weights_only=False)
        return shared.pop("progress"), shared, mine


def save_training(ckpt: Checkpointer, progress: dict, *, model, optimizer, scheduler=None, extra=None) -> Path:
    """Checkpoint a training loop: model, optimizer (+ ledger), scheduler, RNG streams, progress."""
    model_sd = unwrap(model).state_dict()
    per_rank_model = params_differ_across_ranks(optimizer)
    shared = {"scheduler": scheduler.state_dict() if scheduler is not None else None, "extra": extra}
    per_rank = {"optimizer": optimizer.state_dict(), "ledger": optimizer.ledger.state_dict(), "rng": rng_state()}
    (per_rank if per_rank_model else shared)["model"] = model_sd
    return ckpt.save(progress, shared, per_rank)


def restore_training(ckpt: Checkpointer, *, model, optimizer, scheduler=None) -> tuple[dict, object] | None:
    """Load the latest checkpoint into the objects; returns (progress, extra) or None to start afresh."""
    loaded = ckpt.load()
    if loaded is None:
        return None
    progress, shared, mine = loaded
    unwrap(model).load_state_dict(mine["model"] if "model" in mine else shared["model"])
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
    from .run import RunLogger

    t = cfg.trainer
    ckpt = Checkpointer(run_dir, env, keep=t.checkpoint.keep)
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
