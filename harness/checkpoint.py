"""Atomic, rank-aware checkpoints with auto-resume.

Layout under ``<run_dir>/ckpt/``::

    step000000480/shared.pt      rank 0: what every rank holds identically
                                 (model when parameters agree, LR scheduler, progress, extra)
    step000000480/rank{r}.pt     every rank: optimizer state, its ledger, its RNG
                                 streams, and its model when parameters differ by rank
    step000000480/dcp/           FSDP/HSDP runs (``trainer.parallelism``): the model and optimizer state through
                                 ``torch.distributed.checkpoint`` (:func:`slamb.save_sharded`: each rank its
                                 shards, each SLAMB replica its own), in place of the model and
                                 optimizer entries of the ``.pt`` files
    step000000480/**.sha256      each file's sha256 (``sha256sum -c`` format), checked before it is read
    step000000480/complete.json  written once every rank's file is on disk: the folder is usable; records the
                                 step and the files with their digests (``files``), each of which must match
                                 its ``.sha256`` and the digest recorded here (a file of another checkpoint,
                                 copied in with its ``.sha256``, does not)
    latest.json                  the last COMPLETE checkpoint (written last, atomically)

Each file is written to a temporary name and renamed; ``complete.json`` and
``latest.json`` are renamed into place only after every rank has finished
writing (a barrier), so a worker killed during a save leaves the previous
checkpoint in force and all ranks resume from the same step. Optimizers whose
state is per rank (SLAMB: local moments; its load refuses another rank's
state) therefore resume exactly; so do parameters that differ between SLAMB's
model syncs.

The last ``keep`` complete checkpoints stay (two by default): when the newest
cannot be read on some rank, or a file's content differs from the digest written
beside it (torch.load ignores the zip's CRCs and DCP's files have none: a
flipped bit loads as a changed value), or its digest is missing, every rank
falls back to the previous one, and rank 0 prints one line naming the damaged
file, whichever rank found it. A sharded checkpoint's files are checked each by
one rank, and its load (:func:`slamb.load_sharded`) falls back the same way.
When no checkpoint can be read, the error (a ``ValueError``) names the file: a
restart would meet it again. A save that fails (a full disk) leaves no partial
folder behind to keep the disk full: the sharded one removes it at once, any
other the next start (:func:`prepare_run`), which also refuses a disk without
room for one more checkpoint.

A run's data and model inputs (:data:`harness.settings.INPUT_KEYS`) are recorded with each
checkpoint; resuming from it with other inputs is refused, because the
directory name leaves them out (a dataset can move) and a resumed run would
otherwise report one model's results under another's name.

So are the settings of what it computes (:func:`run_settings`): resuming with
another learning rate, compression ratio or any other of them is refused,
naming each one (only the run's length may grow, and a sharded run's shard
size change: :data:`RESUMABLE_KEYS`). The checkpoint's optimizer and scheduler
state would otherwise keep the old learning rate under a config.yaml that shows
the new one, or a new ratio would take effect mid-run: results that belong to
neither configuration.

A run of a pipeline that splits each step into micro-batches of its own (CIFAR-10's
:class:`harness.ShardedBatches` with ``micro_batches``, BERT's :class:`bert.data.StepStream`) may resume on
another number of workers that divides the step's micro-batches (recorded as ``micro_batches``; with
``streams``, the worker count whose data streams BERT's steps follow, that of the run's first start): each
worker then takes several of them per step, by gradient accumulation, so every step computes what it
computed before, the same samples in the same micro-batches (BatchNorm over the same images, CIFAR-10's
augmentation keyed by micro-batch, BERT's masks those of the shards). Every new rank starts from rank 0's
files, under SLAMB (whose ranks differ) from the mean over the saved ranks of the parameters, the buffers and
the moments (:func:`slamb.checkpoint.mean_state_dict`, as :func:`slamb.load_sharded` starts another replica
count), the step and the mask ages as saved; each rank resumes rank 0's ledger (the bytes a worker sent so
far: every rank of a DDP run sends as much), and its RNG streams from (seed, step, rank)
(:func:`harness.seeding.reseed`). A sharded run (FSDP/HSDP) resumes so too: :func:`slamb.load_sharded`
reshards its model and optimizer over the new mesh, of another shard size too (SLAMB's replicas from their
mean), and its ``rank<r>.pt`` files are taken as a DDP run's. Optimizers whose per-rank state has no mean
(DGC, 1-bit LAMB, PowerSGD, DiLoCo) and loops that cut their data per worker (:data:`FIXED_DATA`) are
refused another world size, in one line, before any worker starts.

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
from slamb.checkpoint import mean_state_dict, replica_mean
from .atomic import (FULL, DiskFull, atomic_torch_save, atomic_write_bytes, atomic_write_json, file_sha256, verify,
                     verified_torch_load, write_digest)
from .distributed import DistEnv, barrier
from .identity import check_same_data, load as load_identity
from .parallel import is_fsdp
from .run import RunLogger
from .seeding import reseed, rng_state, set_rng_state
from .settings import (INPUT_KEYS, check_schedule, covers, effective_config, lookup, same_configuration,
                       with_added_settings)

LATEST, COMPLETE = "latest.json", "complete.json"
SHARDED = "dcp"  # the folder of a checkpoint that holds a sharded run's model and optimizer
# settings a resumed run may change: its length (an extended run continues where the shorter one stopped),
# Swin's time_breakdown (device syncs that split the step time: what is measured, not computed) and a sharded
# run's shard size (DCP reshards the model and optimizer over the new mesh; under DDP it is null, which
# harness.parallel checks). Every other setting of what the run computes must match the checkpoint's (see
# check_settings); the parallelism too, as a DDP run's files are per rank and a sharded run's a DCP folder.
RESUMABLE_KEYS = ("epochs", "steps", "time_breakdown", "trainer.shard_size")


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


# why a loop that does not record how it splits its steps (Loop's micro_batches; every pipeline does) cannot
# resume on another number of workers
FIXED_DATA = ("this loop cuts its data stream per worker (it records no micro-batches of its steps), so no other "
              "number of workers continues it")


def fixed_world(optimizer, pipeline: str | None) -> str | None:
    """Why a run of ``optimizer`` cannot resume on another number of workers (None: it can). ``pipeline``: the
    loop's own reason (:data:`FIXED_DATA` where it records no micro-batches), None where it splits its steps by
    micro-batch."""
    if pipeline is not None:
        return pipeline
    if optimizer.per_rank_state and not optimizer.state_averages:
        why = getattr(optimizer, "per_rank_reason", "each worker keeps its own state")
        return f"{type(optimizer).__name__}'s per-rank state has no mean over the workers ({why})"
    return None


def check_world_size(latest: dict, world_size: int, where, why_fixed: str | None = FIXED_DATA) -> None:
    """Refuse to resume the checkpoint ``latest`` (in ``where``) with another number of workers where the run
    cannot (``why_fixed``, :func:`fixed_world`), or where they cannot split the step's micro-batches evenly."""
    saved = latest["world_size"]
    if saved == world_size:
        return
    if why_fixed is not None:
        raise ValueError(f"the checkpoint in {where} was written by {saved} workers and this run has {world_size}: "
                         f"{why_fixed}. Resume with {saved} workers, or use a new run directory (trainer.resume=never "
                         "starts over)")
    splits = latest.get("micro_batches", saved)
    if splits % world_size:
        fits = ", ".join(str(n) for n in range(1, splits + 1) if splits % n == 0)
        raise ValueError(
            f"the run in {where} takes each step in {splits} micro-batches of data.micro_batch samples, and this "
            f"run's {world_size} workers cannot take an equal number of them: a global batch of another size, or "
            f"other micro-batches, would change what the run computes. Resume on {fits} workers "
            "(trainer.nproc_per_node), or start this run over with trainer.resume=never (or another run directory)")


def _resumed(run_dir, resume: str) -> dict | None:
    """The record of the checkpoint the run in ``run_dir`` resumes (None: it starts afresh)."""
    found = Checkpointer(run_dir, None).complete()[:1] if resume == "auto" else []
    return found[0] if found else None


def step_micro_batches(run_dir, resume: str, world_size: int, per_worker: int = 1) -> int:
    """The micro-batches of each step of the run in ``run_dir`` (:class:`harness.ShardedBatches`): those of its
    checkpoint where it resumes one, else ``per_worker`` per worker of this run (Swin's accumulation_steps)."""
    found = _resumed(run_dir, resume)
    return found.get("micro_batches", found["world_size"] * per_worker) if found else world_size * per_worker


def data_streams(run_dir, resume: str, world_size: int) -> int:
    """The data streams the steps of the run in ``run_dir`` take their micro-batches from (BERT's, one per worker
    of its first start): those of its checkpoint where it resumes one, else one per worker of this run."""
    found = _resumed(run_dir, resume)
    return found.get("streams", found["world_size"]) if found else world_size


# bytes the writability probe writes and syncs: an empty file fits on a full disk
PROBE_BYTES = 1 << 16


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check_writable(folder: Path, keep: int = 2) -> None:
    """Refuse a checkpoint directory that cannot take the next checkpoint now, rather than at the first
    checkpoint, after a period of training: one that cannot be written (its nearest existing folder, which is
    left as it was), or whose disk has less room than the last checkpoint takes (a save writes the next one
    before it removes the oldest of the ``keep``)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    probe = existing / f".writable{os.getpid()}"
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        atomic_write_bytes(probe, lambda f: f.write(bytes(PROBE_BYTES)))  # a failed write leaves no file
        probe.unlink()
    except DiskFull:
        raise ValueError(f"checkpoint directory {folder} has no space left on its disk: {_room(keep)}") from None
    except OSError as e:
        raise ValueError(f"checkpoint directory {folder} is not writable ({existing}: {e.strerror or e}): make "
                         "it writable, choose another run directory (hydra.run.dir=...), or set "
                         "trainer.checkpoint.enabled=false") from None
    last = Checkpointer(folder.parent, None).complete()[:1]
    need = _size(folder / last[0]["dir"]) if last else 0
    free = shutil.disk_usage(existing).free
    if free < need:
        raise ValueError(f"checkpoint directory {folder} has {free / 1e6:.1f} MB free on its disk and a checkpoint "
                         f"of this run takes {need / 1e6:.1f} MB ({last[0]['dir']}): {_room(keep)}")


def _room(keep: int) -> str:
    """The fix of a full checkpoint disk."""
    return (f"free space there (an older checkpoint folder can go), or lower trainer.checkpoint.keep (now {keep}): a "
            "save needs room for one more checkpoint beside those kept")


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
    # a checkpoint of older code records settings that a resume may now change (and the added ones' defaults)
    saved = {k: v for k, v in with_added_settings(saved).items() if not covers(RESUMABLE_KEYS, k)}
    changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k, ()) != current.get(k, ())]
    if changed:
        def shown(settings):
            return ", ".join(f"{k}={settings[k]!r}" if k in settings else f"{k} unset" for k in changed)

        raise ValueError(
            f"the run in {where} was trained with {shown(saved)} and this run has {shown(current)}: its "
            f"checkpoint's optimizer and schedule would hold the old values, or the new ones would hold for part "
            f"of the run only. Set {', '.join(changed)} back to resume, or start this run over with "
            "trainer.resume=never (or another run directory)")


def _reason(err: BaseException) -> str:
    """``err`` in one line; DCP's ``CheckpointException`` (every rank's traceback) as the first failure."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        err = next(iter(failures.values()))[0]
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _unreadable(path: Path, err: BaseException, kind: str = "file") -> str:
    return f"checkpoint {kind} {path} is unreadable ({_reason(err)})"


def _gather_objects(obj) -> list:
    """Every rank's ``obj``, by rank (bookkeeping of the resume, outside the ledger)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _disk_full(err: BaseException) -> OSError | None:
    """The full disk behind a failed save, if that is what it was: the error itself, or a rank's in DCP's
    ``CheckpointException`` (``slamb.save_sharded`` makes each the file's own ``OSError``)."""
    for e in (err, *(f[0] for f in (getattr(err, "failures", None) or {}).values())):
        if isinstance(e, OSError) and e.errno in FULL:
            return e
    return None


def sharded_files(directory: Path, rank: int) -> list[Path]:
    """The files of a DCP checkpoint that ``rank`` wrote: its ``__<rank>_*.distcp`` and, on the coordinator
    (rank 0), ``.metadata`` (DCP's FileSystemWriter names them so)."""
    directory = Path(directory)
    return sorted(directory.glob(f"__{rank}_*.distcp")) + ([directory / ".metadata"] if rank == 0 else [])


class Checkpointer:
    def __init__(self, run_dir, env: DistEnv, keep: int = 2, inputs: dict | None = None,
                 settings: dict | None = None, micro_batches: int | None = None, streams: int | None = None):
        if keep < 1:
            raise ValueError(f"invalid checkpoint.keep={keep}: must be >= 1 (the last checkpoint resumes the run)")
        self.dir = Path(run_dir) / "ckpt"
        self.env = env
        self.keep = keep
        self.inputs = inputs
        self.settings = settings
        self.micro_batches = micro_batches  # of each step, over all workers (step_micro_batches)
        self.streams = streams  # the data streams they come from (data_streams)
        self.folder: Path | None = None  # the checkpoint load() returned
        self.saved_world: int | None = None  # the number of workers that wrote it

    def latest(self) -> dict | None:
        path = self.dir / LATEST
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:  # written atomically, so only a damaged disk: the folders' markers still say
            if self.env is not None and self.env.is_main:  # once: the launcher's look is quiet, rank 0 says it
                print(f"{path} is unreadable: looking for complete checkpoints in {self.dir}", flush=True)
            return None

    def complete(self) -> list[dict]:
        """The complete checkpoints on disk, newest first (``latest.json``'s first, unless a save of its step
        that did not finish removed it)."""
        latest = self.latest()
        if latest is not None and not (self.dir / latest["dir"] / COMPLETE).exists():
            latest = None
        found = [latest] if latest is not None else []
        for marker in sorted(self.dir.glob(f"step*/{COMPLETE}"), reverse=True):
            if latest is None or marker.parent.name != latest["dir"]:
                try:
                    found.append({"dir": marker.parent.name, **json.loads(marker.read_text())})
                except (OSError, ValueError):
                    continue
        return found

    def incomplete(self) -> list[Path]:
        """The step folders without ``complete.json``: saves that did not finish (a full disk, a killed job)."""
        return sorted(p for p in self.dir.glob("step*") if p.is_dir() and not (p / COMPLETE).exists())

    def save(self, progress: dict, shared: dict, per_rank: dict, write=None) -> Path:
        """Write one checkpoint; ``progress`` (json-able; must hold ``step``) goes in ``latest.json``.
        ``write(folder)``: what every rank writes beside its file (collective; a sharded run's DCP entries),
        before the checkpoint is declared complete; returns the files this rank wrote, which get their digests.

        A full disk raises :class:`DiskFull`, one line naming the checkpoint and the fix; a sharded save, whose
        failure every rank learns, removes the partial folder at once (the others at the next start)."""
        name = f"step{int(progress['step']):09d}"
        folder = self.dir / name
        if self.env.is_main:  # this step's folder from an earlier attempt: its files, a killed writer's temporary ones
            shutil.rmtree(folder, ignore_errors=True)
        barrier()
        folder.mkdir(parents=True, exist_ok=True)
        mine = {}  # the files this rank wrote, and their digests
        try:
            path = folder / f"rank{self.env.rank}.pt"
            mine[path] = atomic_torch_save(per_rank, path)
            if self.env.is_main:
                path = folder / "shared.pt"
                mine[path] = atomic_torch_save({"progress": progress, **shared}, path)
            for path in write(folder) if write is not None else ():
                mine[path] = file_sha256(path)
                write_digest(path, mine[path])
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            # alone, or DCP's failure, which every rank raises: no rank writes into the folder any more
            agreed = self.env.world_size == 1 or getattr(err, "failures", None) is not None
            if agreed and self.env.is_main:
                shutil.rmtree(folder, ignore_errors=True)
            full = _disk_full(err)
            if full is None:
                raise
            raise DiskFull(f"no space left on the disk of the checkpoint {folder} (writing "
                           f"{Path(full.filename or folder / SHARDED).name}): {_room(self.keep)}") from None
        # every rank's files are on disk before the checkpoint is declared complete (the gather waits for all);
        # their digests in the marker too: a file of another step copied in with its .sha256 does not match them
        gathered = _gather_objects({str(p.relative_to(folder)): digest for p, digest in mine.items()})
        files = dict(sorted(kv for each in gathered for kv in each.items()))
        if self.env.is_main:
            record = {"world_size": self.env.world_size, **progress, "files": files}
            if self.inputs is not None:
                record["inputs"] = self.inputs
            if self.settings is not None:
                record["settings"] = self.settings
            if self.micro_batches is not None:
                record["micro_batches"] = self.micro_batches
            if self.streams is not None:
                record["streams"] = self.streams
            atomic_write_json(record, folder / COMPLETE)
            atomic_write_json({"dir": name, **record}, self.dir / LATEST)
            old = sorted(p for p in self.dir.glob("step*") if p.is_dir() and p.name != name)
            for stale in old[: max(0, len(old) - (self.keep - 1))]:
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        return folder

    def _read(self, folder: Path, files: dict | list | None, ranks) -> tuple[dict | None, str | None]:
        """(shared + the files of ``ranks``, None) or (None, why not). Each of ``files`` (those the checkpoint
        records, with their digests; a list of names where written before the digests were recorded there; None:
        before the files were, unchecked) is checked against its digests: the ``.pt`` files by the ranks that load
        them, every other (a sharded run's) by one rank."""
        loaded, path = {"ranks": []}, None
        digests = files if isinstance(files, dict) else {}
        try:
            path = folder / "shared.pt"
            loaded["shared"] = verified_torch_load(path, files is not None, digests.get(path.name))
            for r in ranks:
                path = folder / f"rank{r}.pt"
                loaded["ranks"].append(verified_torch_load(path, files is not None, digests.get(path.name)))
            for name in [f for f in files or () if not f.endswith(".pt")][self.env.rank::self.env.world_size]:
                path = folder / name
                verify(path, listed=digests.get(name))
        except Exception as err:  # changed, truncated or missing: torch.load raises many kinds
            return None, _unreadable(path, err)
        return loaded, None

    @staticmethod
    def _restore(restore, folder: Path) -> str | None:
        """Why ``restore(folder)`` failed, or None."""
        try:
            restore(folder)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            return _unreadable(folder / SHARDED, err, "folder")
        return None

    def load(self, restore=None, *, why_fixed: str | None = FIXED_DATA,
             every_rank: bool = False) -> tuple[dict, dict, list[dict]] | None:
        """(progress, shared, rank files) of the newest checkpoint every rank can read, or None; its folder
        is ``self.folder`` after, the number of workers that wrote it ``self.saved_world``. The rank files:
        this rank's; on another number of workers (refused with ``why_fixed``, :func:`check_world_size`) rank
        0's, or with ``every_rank`` every saved rank's. ``restore(folder)``: what loads beyond the ``.pt`` files
        (collective: a sharded run's model and optimizer, :func:`slamb.load_sharded`); its failure falls back
        as an unreadable file does."""
        candidates = self.complete()
        if not candidates:
            return None
        latest = candidates[0]
        check_world_size(latest, self.env.world_size, self.dir, why_fixed)
        if self.inputs is not None:
            check_inputs(latest.get("inputs"), self.inputs, self.dir)
        if self.settings is not None:
            check_settings(latest.get("settings"), self.settings, self.dir)
        for i, entry in enumerate(candidates):
            folder = self.dir / entry["dir"]
            if "files" not in entry and self.env.is_main:
                print(f"checkpoint {folder} records no digests (written before they were): its files load "
                      "unchecked", flush=True)
            saved = entry.get("world_size", self.env.world_size)
            ranks = ([self.env.rank] if saved == self.env.world_size else range(saved) if every_rank else [0])
            loaded, why = self._read(folder, entry.get("files"), ranks)
            # one rank's unreadable file sends every rank back, so that all resume from the same step; every
            # rank learns which file it was (on a node of its own, rank 0's line is the one a user reads)
            why = next((w for w in _gather_objects(why) if w is not None), None)
            if why is None and restore is not None:
                why = next((w for w in _gather_objects(self._restore(restore, folder)) if w is not None), None)
            if why is None:
                shared = loaded["shared"]
                self.folder, self.saved_world = folder, saved
                return shared.pop("progress"), shared, loaded["ranks"]
            if i + 1 == len(candidates):  # a damaged input: a restart would meet it again
                raise ValueError(f"{why}; no older checkpoint is left to resume from: restore that file, or start "
                                 "over with trainer.resume=never")
            if self.env.is_main:
                print(f"{why}; delete that checkpoint folder to resume from an older one, or start over with "
                      f"trainer.resume=never: resuming from the previous checkpoint, {candidates[i + 1]['dir']}",
                      flush=True)
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

    def write(folder: Path) -> list[Path]:
        slamb.save_sharded(module, optimizer, folder / SHARDED)
        return sharded_files(folder / SHARDED, ckpt.env.rank)

    return ckpt.save(progress, shared, per_rank, write if sharded else None)


def _elastic(saved: list[dict], optimizer) -> dict:
    """This rank's file on another number of workers, from the saved ranks' files (rank 0's, or every rank's
    where the ranks' parameters differ): the mean over them of the model, the buffers and the optimizer state
    (:func:`slamb.checkpoint.mean_state_dict`), rank 0's ledger; its RNG streams are drawn afresh."""
    def mean(key: str) -> dict:
        return {k: replica_mean([s[key][k] for s in saved], k) for k in saved[0][key]}

    first = saved[0]
    mine = {"ledger": first["ledger"], **{k: mean(k) for k in ("model", "buffers") if k in first}}
    if "optimizer" in first:  # a sharded run's is in its DCP folder
        mine["optimizer"] = mean_state_dict([s["optimizer"] for s in saved], optimizer)
    return mine


def restore_training(ckpt: Checkpointer, *, model, optimizer, scheduler=None, seed: int = 0,
                     why_fixed: str | None = FIXED_DATA) -> tuple[dict, object] | None:
    """Load the latest checkpoint into the objects; returns (progress, extra) or None to start afresh. On
    another number of workers (refused with ``why_fixed``, :func:`fixed_world`), every rank starts from the
    saved ranks' mean (:func:`_elastic`), its RNG streams from (``seed``, step, rank), and rank 0 says so in
    one line."""
    module = unwrap(model)
    sharded = is_fsdp(module)
    # after wrap_model, as load_sharded needs; inside the fallback: a sharded file that fails sends every rank back
    loaded = ckpt.load((lambda folder: slamb.load_sharded(module, optimizer, folder / SHARDED)) if sharded else None,
                       why_fixed=why_fixed, every_rank=optimizer.params_differ)
    if loaded is None:
        return None
    progress, shared, saved = loaded
    world = ckpt.env.world_size
    elastic = ckpt.saved_world != world
    mine = _elastic(saved, optimizer) if elastic else saved[0]
    if elastic and ckpt.env.is_main:
        name = type(optimizer).__name__
        start = (f"slamb.load_sharded reshards the model and {name} state" if sharded else
                 f"{name} starts every worker from the {ckpt.saved_world} workers' mean parameters and moments"
                 if optimizer.params_differ else f"every worker starts from rank 0's model and {name} state")
        print(f"resuming {ckpt.saved_world} workers' checkpoint on {world}: {start}, rank 0's ledger, RNG streams "
              f"drawn from (seed, step, rank)", flush=True)
    if not sharded:
        module.load_state_dict(mine["model"] if "model" in mine else shared["model"])
        optimizer.load_state_dict(mine["optimizer"])
    if mine.get("buffers"):
        module.load_state_dict(mine["buffers"], strict=False)
    # torch.optim optimizers keep the ledger outside their state_dict: cumulative bytes survive resume here
    optimizer.ledger.load_state_dict(mine["ledger"])
    if scheduler is not None:
        scheduler.load_state_dict(shared["scheduler"])
    if elastic:
        reseed(seed, progress["step"], ckpt.env.rank)
    else:
        set_rng_state(mine["rng"])
    return progress, shared.get("extra")


def open_run(run_dir, env, cfg, plain: dict, *, model, optimizer, scheduler=None, amp=None, start: dict,
             micro_batches: int | None = None, streams: int | None = None, writer: bool | None = None):
    """The opening every training loop shares: checkpointer, auto-resume, logger.

    With ``trainer.resume == "auto"`` the latest checkpoint, if any, is loaded into the objects (the loss
    scale of ``amp`` too); ``start`` is the progress of a fresh run, e.g. ``{"epoch": 0, "step": 0}``.
    ``micro_batches``: those of each step over all workers, where the pipeline splits its steps so
    (:class:`harness.ShardedBatches`): the run may then resume on another number of workers; ``streams``: the
    data streams they come from, where they are not one per micro-batch (:func:`data_streams`); ``writer``: the
    logger's (:class:`harness.run.RunLogger`).
    Returns ``(checkpointer, progress, restored, logger)``; ``progress["resumed_from"]`` lists the
    epochs (or steps, for step-based loops) the run was resumed at.
    """
    t = cfg.trainer
    ckpt = Checkpointer(run_dir, env, keep=t.checkpoint.keep, inputs=run_inputs(plain), settings=run_settings(plain),
                        micro_batches=micro_batches, streams=streams)
    why_fixed = fixed_world(optimizer, None if micro_batches is not None else FIXED_DATA)
    restored = restore_training(ckpt, model=model, optimizer=optimizer, scheduler=scheduler,
                                seed=cfg.get("seed", 0), why_fixed=why_fixed) if t.resume == "auto" else None
    progress, extra = restored or ({**start, "resumed_from": []}, None)
    if extra and amp is not None:
        amp.load_state_dict(extra["amp"])
    at = progress.get("epoch", progress["step"])
    if restored:
        progress = {**progress, "resumed_from": progress["resumed_from"] + [at]}
    log = RunLogger(run_dir, plain, env, wandb=cfg.logger.wandb, wandb_project=cfg.logger.project,
                    progress=t.progress, resume_epoch=at, writer=writer)
    return ckpt, progress, restored is not None, log


def prepare_run(cfg: dict, run_dir, *, clear: bool = True, world_size: int | None = None,
                why_fixed: str | None = FIXED_DATA, identity: dict | None = None) -> dict | None:
    """What :func:`harness.build.run_from_hydra` checks before any worker starts.

    Refuses an empty schedule, a checkpoint directory that cannot take a checkpoint (unwritable, a full
    disk), and a resume with other inputs, other settings or a number of workers (``world_size``, where
    known) that cannot continue it (``why_fixed``, :func:`check_world_size`); with ``trainer.resume=never``
    removes the old checkpoints, and otherwise the folders of saves that did not finish (``clear``: not under
    torchrun, where every worker runs this). ``identity``: the run's inputs by content (:mod:`harness.identity`),
    refused where the run's record holds others. Returns the summary of a run that already finished with this
    configuration on the same data (nothing to train), else None.
    """
    def same_data():
        if identity is not None:
            check_same_data(load_identity(run_dir), identity, run_dir)

    check_schedule(cfg)
    run_dir = Path(run_dir)
    ckpt = run_dir / "ckpt"
    if cfg["trainer"]["resume"] == "never":
        if clear and ckpt.exists():
            shutil.rmtree(ckpt)
    else:
        for partial in Checkpointer(run_dir, None).incomplete() if clear else ():
            print(f"removing {partial}: a checkpoint whose save did not finish", flush=True)
            shutil.rmtree(partial)
        for entry in Checkpointer(run_dir, None).complete()[:1]:
            check_inputs(entry.get("inputs"), run_inputs(cfg), ckpt)
            same_data()
            check_settings(entry.get("settings"), run_settings(cfg), ckpt)
            if world_size is not None:
                check_world_size(entry, world_size, ckpt, why_fixed)
    if lookup(cfg, "trainer.checkpoint.enabled", True):
        check_writable(ckpt, lookup(cfg, "trainer.checkpoint.keep", 2))
    if cfg["trainer"]["resume"] == "never":
        return None
    summary, config = run_dir / "metrics.json", run_dir / "config.yaml"
    if summary.exists() and config.exists():
        import yaml

        saved = yaml.safe_load(config.read_text())
        check_inputs(run_inputs(saved), run_inputs(cfg), run_dir)
        same_data()
        if same_configuration(saved, cfg):
            print(f"{run_dir} is finished (metrics.json): nothing to train. Its summary stands; "
                  "trainer.resume=never trains it again from scratch", flush=True)
            return json.loads(summary.read_text())
    return None
