"""Atomic, rank-aware checkpoints with auto-resume.

Layout under ``<run_dir>/ckpt/``::

    step000000480/shared.pt      rank 0: what every rank holds identically
                                 (model when parameters agree, LR scheduler, progress, extra)
    step000000480/rank{r}.pt     every rank: optimizer state, its ledger, its RNG
                                 streams, and its model when parameters differ by rank
    step000000480/*.pt.sha256    each file's sha256 (``sha256sum -c`` format), checked before it is loaded
    step000000480/dcp/           FSDP/HSDP runs (``trainer.parallelism``): the model and optimizer state through
                                 ``torch.distributed.checkpoint`` (:func:`slamb.save_sharded`: each rank its
                                 shards, each SLAMB replica its own), in place of the model and
                                 optimizer entries of the ``.pt`` files
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
cannot be read on some rank, or its content differs from the digest written
beside it (torch.load ignores the zip's CRCs: a flipped bit loads as a changed
value), every rank falls back to the previous one, and rank 0 prints one line
naming the damaged file, whichever rank found it.

A run's data and model inputs (:data:`harness.settings.INPUT_KEYS`) are recorded with each
checkpoint; resuming from it with other inputs is refused, because the
directory name leaves them out (a dataset can move) and a resumed run would
otherwise report one model's results under another's name.

So are the settings of what it computes (:func:`run_settings`): resuming with
another learning rate, compression ratio or any other of them is refused,
naming each one (only the run's length, :data:`RESUMABLE_KEYS`, may grow). The
checkpoint's optimizer and scheduler state would otherwise keep the old
learning rate under a config.yaml that shows the new one, or a new ratio would
take effect mid-run: results that belong to neither configuration.

Files are loaded to the CPU and copied where they belong by the objects'
``load_state_dict``: RNG states must stay CPU ``ByteTensor``s, and a run may
resume on another device layout than the one that saved it.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import slamb
from .atomic import atomic_torch_save, atomic_write_json, verified_torch_load
from .distributed import DistEnv, barrier
from .parallel import is_fsdp
from .run import RunLogger
from .seeding import rng_state, set_rng_state
from .settings import (INPUT_KEYS, check_schedule, effective_config, lookup, same_configuration,
                       with_added_settings)

LATEST, COMPLETE = "latest.json", "complete.json"
SHARDED = "dcp"  # the folder of a checkpoint that holds a sharded run's model and optimizer
# settings a resumed run may change: its length (an extended run continues where the shorter one stopped) and
# Swin's time_breakdown (device syncs that split the step time: what is measured, not computed). Every other
# setting of what the run computes must match the checkpoint's (see check_settings).
RESUMABLE_KEYS = ("epochs", "steps", "time_breakdown")


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


def check_world_size(latest: dict, world_size: int, where) -> None:
    """Refuse to resume the checkpoint ``latest`` (in ``where``) with another number of workers."""
    if latest["world_size"] != world_size:
        raise ValueError(
            f"the checkpoint in {where} was written by {latest['world_size']} workers and this run has "
            f"{world_size}: per-rank optimizer state cannot be redistributed. Resume with "
            f"{latest['world_size']} workers, or use a new run directory (trainer.resume=never starts over)"
        )


def check_writable(folder: Path) -> None:
    """Refuse a checkpoint directory that cannot be written now (its nearest existing folder, which is left
    as it was), rather than at the first checkpoint, after a period of training."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    probe = existing / f".writable{os.getpid()}"
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"checkpoint directory {folder} is not writable ({existing}: {e.strerror or e}): make "
                         "it writable, choose another run directory (hydra.run.dir=...), or set "
                         "trainer.checkpoint.enabled=false") from None


def run_settings(cfg) -> dict:
    """What a run computes with (:func:`harness.settings.effective_config`) as JSON holds it, less the settings a
    resume checks on their own (:data:`INPUT_KEYS`; the worker count, as the checkpoint's world size) and
    those a resume may change (:data:`RESUMABLE_KEYS`)."""

    return json.loads(json.dumps(effective_config(cfg, drop=(*INPUT_KEYS, *RESUMABLE_KEYS, "trainer.nproc_per_node"))))


def check_settings(saved: dict | None, current: dict, where) -> None:
    """Refuse to resume the run in ``where`` (trained with ``saved``) with other settings, naming each one.

    The checkpoint holds the optimizer's state and the schedule's: its learning rate would override a new
    ``optimizer.lr`` while config.yaml showed the new one, and a new ``compress_ratio`` would hold for the
    rest of the run only; either way the run's results would belong to neither configuration.
    """
    if saved is None:  # written before settings were recorded
        return
    saved = with_added_settings(saved)
    changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k, ()) != current.get(k, ())]
    if changed:
        def shown(settings):
            return ", ".join(f"{k}={settings[k]!r}" if k in settings else f"{k} unset" for k in changed)

        raise ValueError(
            f"the run in {where} was trained with {shown(saved)} and this run has {shown(current)}: its "
            f"checkpoint's optimizer and schedule would hold the old values, or the new ones would hold for part "
            f"of the run only. Set {', '.join(changed)} back to resume, or start this run over with "
            "trainer.resume=never (or another run directory)")


def _unreadable(path: Path, err: Exception) -> str:
    return (f"checkpoint file {path} is unreadable ({type(err).__name__}: {err}); delete that checkpoint "
            f"folder to resume from an older one, or start over with trainer.resume=never")


def _gather_objects(obj) -> list:
    """Every rank's ``obj``, by rank (bookkeeping of the resume, outside the ledger)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Checkpointer:
    def __init__(self, run_dir, env: DistEnv, keep: int = 2, inputs: dict | None = None,
                 settings: dict | None = None):
        if keep < 1:
            raise ValueError(f"invalid checkpoint.keep={keep}: must be >= 1 (the last checkpoint resumes the run)")
        self.dir = Path(run_dir) / "ckpt"
        self.env = env
        self.keep = keep
        self.inputs = inputs
        self.settings = settings
        self.folder: Path | None = None  # the checkpoint load() returned

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

    def save(self, progress: dict, shared: dict, per_rank: dict, write=None) -> Path:
        """Write one checkpoint; ``progress`` (json-able; must hold ``step``) goes in ``latest.json``.
        ``write(folder)``: what every rank writes beside its file (collective; a sharded run's DCP entries),
        before the checkpoint is declared complete."""
        name = f"step{int(progress['step']):09d}"
        folder = self.dir / name
        folder.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(per_rank, folder / f"rank{self.env.rank}.pt")
        if self.env.is_main:
            atomic_torch_save({"progress": progress, **shared}, folder / "shared.pt")
        if write is not None:
            write(folder)
        barrier()  # every rank's file is on disk before the checkpoint is declared complete
        if self.env.is_main:
            record = {"world_size": self.env.world_size, **progress}
            if self.inputs is not None:
                record["inputs"] = self.inputs
            if self.settings is not None:
                record["settings"] = self.settings
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
                loaded[key] = verified_torch_load(folder / name)
            except Exception as err:  # changed, truncated or missing: torch.load raises many kinds
                return None, _unreadable(folder / name, err)
        return loaded, None

    def load(self) -> tuple[dict, dict, dict] | None:
        """(progress, shared, this rank's) of the newest checkpoint every rank can read, or None; its folder
        is ``self.folder`` after."""
        candidates = self.complete()
        if not candidates:
            return None
        latest = candidates[0]
        check_world_size(latest, self.env.world_size, self.dir)
        if self.inputs is not None:
            check_inputs(latest.get("inputs"), self.inputs, self.dir)
        if self.settings is not None:
            check_settings(latest.get("settings"), self.settings, self.dir)
        for i, entry in enumerate(candidates):
            loaded, why = self._read(self.dir / entry["dir"])
            # one rank's unreadable file sends every rank back, so that all resume from the same step; every
            # rank learns which file it was (on a node of its own, rank 0's line is the one a user reads)
            whys = [why] if self.env.world_size == 1 else _gather_objects(why)
            why = next((w for w in whys if w is not None), None)
            if why is None:
                shared = loaded["shared"]
                self.folder = self.dir / entry["dir"]
                return shared.pop("progress"), shared, loaded["mine"]
            if i + 1 == len(candidates):
                raise RuntimeError(why)
            if self.env.is_main:
                print(f"{why}: resuming from the previous checkpoint, {candidates[i + 1]['dir']}", flush=True)
        return None


def save_training(ckpt: Checkpointer, progress: dict, *, model, optimizer, scheduler=None, extra=None) -> Path:
    """Checkpoint a training loop: model, optimizer (+ ledger), scheduler, RNG streams, progress."""
    module = unwrap(model)
    sharded = is_fsdp(module)
    per_rank_model = optimizer.params_differ  # the contract: SLAMB between syncs
    shared = {"scheduler": scheduler.state_dict() if scheduler is not None else None, "extra": extra}
    per_rank = {"ledger": optimizer.ledger.state_dict(), "rng": rng_state()}
    if not sharded:
        per_rank["optimizer"] = optimizer.state_dict()
        (per_rank if per_rank_model else shared)["model"] = module.state_dict()
    if sharded or not per_rank_model:
        # floating buffers (BatchNorm statistics) are each rank's own under every optimizer: the pipelines
        # do not broadcast them per forward, and the evaluated model averages them (DCP keeps one copy)
        per_rank["buffers"] = {k: v for k, v in module.named_buffers() if v.is_floating_point()}
    write = (lambda folder: slamb.save_sharded(module, optimizer, folder / SHARDED)) if sharded else None
    return ckpt.save(progress, shared, per_rank, write)


def restore_training(ckpt: Checkpointer, *, model, optimizer, scheduler=None) -> tuple[dict, object] | None:
    """Load the latest checkpoint into the objects; returns (progress, extra) or None to start afresh."""
    loaded = ckpt.load()
    if loaded is None:
        return None
    progress, shared, mine = loaded
    module = unwrap(model)
    if is_fsdp(module):  # after wrap_model, as load_sharded needs
        slamb.load_sharded(module, optimizer, ckpt.folder / SHARDED)
    else:
        module.load_state_dict(mine["model"] if "model" in mine else shared["model"])
        optimizer.load_state_dict(mine["optimizer"])
    if mine.get("buffers"):
        module.load_state_dict(mine["buffers"], strict=False)
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
    ckpt = Checkpointer(run_dir, env, keep=t.checkpoint.keep, inputs=run_inputs(plain), settings=run_settings(plain))
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


def prepare_run(cfg: dict, run_dir, *, clear: bool = True, world_size: int | None = None) -> dict | None:
    """What :func:`harness.build.run_from_hydra` checks before any worker starts.

    Refuses an empty schedule, an unwritable checkpoint directory, and a resume with other inputs, other
    settings or another number of workers (``world_size``, where known); with ``trainer.resume=never`` removes
    the old checkpoints (``clear``: not under torchrun, where every worker runs this). Returns the
    summary of a run that already finished with this configuration (nothing to train), else None.
    """
    check_schedule(cfg)
    run_dir = Path(run_dir)
    ckpt = run_dir / "ckpt"
    if cfg["trainer"]["resume"] == "never":
        if clear and ckpt.exists():
            shutil.rmtree(ckpt)
    else:
        for entry in Checkpointer(run_dir, None).complete()[:1]:
            check_inputs(entry.get("inputs"), run_inputs(cfg), ckpt)
            check_settings(entry.get("settings"), run_settings(cfg), ckpt)
            if world_size is not None:
                check_world_size(entry, world_size, ckpt)
    if lookup(cfg, "trainer.checkpoint.enabled", True):
        check_writable(ckpt)
    if cfg["trainer"]["resume"] == "never":
        return None
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
