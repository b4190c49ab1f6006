"""The run directory of a job: resolved config, provenance, metrics, wandb, progress bar.

Written by rank 0 only::

    config.yaml      the resolved config of the job
    meta.json        git revision (and whether the tree was dirty), command, world size, versions
    metrics.jsonl    one line per epoch (appended; truncated to the resumed epoch on resume)
    metrics.json     the final summary (last epoch, best top-1, totals, wall time); removed when a
                     run starts writing, so that it exists only when the last writer finished
    run.lock         held while a job writes the directory (see :class:`RunLock`)

Communication columns come from the optimizer's ledger (bytes this rank handed
to collectives, by kind): ``bytes/<kind>`` for the epoch and ``bytes_cum/<kind>``
since the start of the run (restored on resume).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

from .checkpoint import atomic_write_json
from .distributed import DistEnv

# Settings that change how a run is operated, not what it computes: two runs that differ only in
# these are the same configuration (same table row, same finished run). A key covers its subtree.
OPERATIONAL_KEYS = ("trainer.progress", "trainer.resume", "trainer.max_restarts", "trainer.threads_per_worker",
                    "trainer.device", "trainer.cudnn_benchmark", "trainer.checkpoint", "logger", "data.workers",
                    "data.prefetch", "paper", "study")
# settings whose value is a length that must be at least 1 (an empty schedule trains nothing)
SCHEDULE_KEYS = ("epochs", "steps", "log_every", "trainer.checkpoint.every")


def check_schedule(cfg) -> None:
    """Clear errors for an empty schedule (``epochs=0``), before any worker starts."""
    from .checkpoint import lookup

    for key in SCHEDULE_KEYS:
        value = lookup(cfg, key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"invalid {key}={value!r}: must be an integer >= 1 (an empty schedule trains "
                             f"nothing); set {key} to 1 or more")


def flatten(cfg: dict, prefix: str = "") -> dict:
    """``{"a.b": value}`` for every leaf of a nested dict (lists are leaves, as tuples)."""
    out = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


def effective_config(cfg: dict, drop: tuple[str, ...] = ()) -> dict:
    """The flattened settings of ``cfg`` that determine what a run computes (less those under ``drop``)."""
    skip = OPERATIONAL_KEYS + tuple(drop)
    return {k: v for k, v in flatten(cfg).items() if not any(k == s or k.startswith(s + ".") for s in skip)}


def same_configuration(a: dict, b: dict) -> bool:
    return effective_config(a) == effective_config(b)


class RunLock:
    """``<run_dir>/run.lock`` while a job writes the run directory; a second writer gets a clear error.

    The file names the holder (host, pid); a lock whose process is gone on this host is stale and is
    taken over with a message. ``hold=False`` makes it a no-op (the workers torchrun starts beside
    the one that holds it).
    """

    def __init__(self, run_dir, hold: bool = True):
        self.path = Path(run_dir) / "run.lock"
        self.hold = hold
        self.me = {"host": socket.gethostname(), "pid": os.getpid()}

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):  # removed meanwhile, or a holder killed while writing it
            return None

    @staticmethod
    def _alive(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return True  # another host's process cannot be checked from here
        try:
            os.kill(int(holder["pid"]), 0)  # signal 0: is there such a process, nothing sent
        except ProcessLookupError:
            return False
        except PermissionError:  # there is, run by another user
            pass
        return True

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {**self.me, "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._alive(holder):
                    raise RuntimeError(
                        f"run directory {self.path.parent} is being written by process {holder['pid']} on "
                        f"{holder['host']} (since {holder.get('since')}): wait for it to finish or use another run "
                        f"directory; if that process is gone, delete {self.path}") from None
                print(f"removing the stale lock {self.path} (process {holder and holder.get('pid')} is gone)",
                      flush=True)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            return
        raise RuntimeError(f"could not lock run directory {self.path.parent}: another job took it; wait for it "
                           "to finish or use another run directory")

    def release(self) -> None:
        holder = self._holder()
        if holder is not None and (holder.get("host"), holder.get("pid")) == (self.me["host"], self.me["pid"]):
            self.path.unlink(missing_ok=True)

    def __enter__(self):
        if self.hold:
            self.acquire()
        return self

    def __exit__(self, *exc):
        if self.hold:
            self.release()
        return False


def git_revision(repo: Path | None = None) -> dict:
    """Commit and dirtiness of the checkout the code runs from ("unknown" outside git)."""
    cwd = repo or Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
        return {"commit": rev, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": None}


def comm_totals(optimizer) -> dict[str, int]:
    """Cumulative payload bytes this rank handed to collectives, by kind and ``all``."""
    return {k: int(v["payload"]) for k, v in optimizer.comm_stats()["total"].items()}


def comm_metrics(totals: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Per-period and cumulative byte columns from two :func:`comm_totals` snapshots."""
    out = {}
    for kind, total in sorted(totals.items()):
        out[f"bytes/{kind}"] = total - before.get(kind, 0)
        out[f"bytes_cum/{kind}"] = total
    out.setdefault("bytes/all", 0)
    out.setdefault("bytes_cum/all", 0)
    return out


def compressed_share(optimizer, model) -> float | None:
    """Fraction of parameters SLAMB compresses (tensors with dim > 1 and >= min_compress_numel elements)."""
    threshold = getattr(optimizer, "min_compress_numel", None)
    if threshold is None:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    big = sum(p.numel() for p in params if p.dim() > 1 and p.numel() >= threshold)
    return big / sum(p.numel() for p in params)


def _position(line: dict) -> int:
    return line.get("epoch", line.get("step", 0))


class RunLogger:
    def __init__(self, run_dir, cfg: dict, env: DistEnv, *, wandb: bool = False, wandb_project: str = "slamb",
                 progress: bool = True, resume_epoch: int = 0):
        self.dir = Path(run_dir)
        self.env = env
        self.progress_enabled = progress and env.is_main
        self._wandb = None
        if not env.is_main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        (self.dir / "metrics.json").unlink(missing_ok=True)  # this run has not finished (yet)
        (self.dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
        atomic_write_json({
            "git": git_revision(), "command": sys.argv, "world_size": env.world_size, "device": str(env.device),
            "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
        }, self.dir / "meta.json")
        self._truncate_metrics(resume_epoch)
        if wandb:
            self._wandb = self._init_wandb(cfg, wandb_project)

    def _truncate_metrics(self, resume_epoch: int) -> None:
        """Drop lines of epochs the resumed run will redo: those after the ``resume_epoch`` epochs it completed.

        A step-based run's lines carry no ``epoch``: ``step`` and ``resume_epoch`` then count optimizer steps.
        """
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return
        keep = [line for line in path.read_text().splitlines()
                if line.strip() and _position(json.loads(line)) <= resume_epoch]
        path.write_text("".join(line + "\n" for line in keep))

    def _init_wandb(self, cfg: dict, project: str):
        import uuid

        import wandb

        # the id lives in the run directory, so a resumed job continues the same wandb run; made here
        # because wandb's own id helper has moved between releases
        id_file = self.dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        return wandb.init(project=project, name=cfg.get("name"), id=run_id, resume="allow", config=cfg,
                          dir=str(self.dir), mode=os.environ.get("WANDB_MODE", "offline"))

    def progress(self, iterable, total: int, desc: str):
        """A tqdm bar on rank 0 (when enabled), the bare iterable elsewhere."""
        if not self.progress_enabled:
            return iterable
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)

    def log(self, metrics: dict) -> None:
        if not self.env.is_main:
            return
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=metrics.get("step"))
        shown = {k: v for k, v in metrics.items() if not k.startswith("bytes/") and k != "time"}
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
              flush=True)

    def history(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def finish(self, summary: dict) -> None:
        if not self.env.is_main:
            return
        atomic_write_json(summary, self.dir / "metrics.json")
        if self._wandb is not None:
            self._wandb.summary.update(summary)
            self._wandb.finish()
