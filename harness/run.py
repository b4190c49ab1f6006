"""The run directory of a job: resolved config, provenance, metrics, wandb, progress bar.

Written by rank 0 only::

    config.yaml      the resolved config of the job
    meta.json        git revision (and whether the tree was dirty), command, world size, the hardware
                     of rank 0's host (:func:`hardware`), versions
    metrics.jsonl    one line per epoch (appended; truncated to the resumed epoch on resume)
    metrics.json     the final summary (last epoch, best top-1, totals, wall time); removed when a
                     run starts writing, so that it exists only when the last writer finished
    run.lock         held while a job writes the directory (see :class:`harness.lock.RunLock`)
    train.log        the job's console, as a terminal shows it (see :class:`ConsoleLog`; appended by each attempt)

Communication columns come from the optimizer's ledger (bytes this rank handed
to collectives, by kind): ``bytes/<kind>`` for the epoch and ``bytes_cum/<kind>``
since the start of the run (restored on resume).
"""
from __future__ import annotations

import json
import multiprocessing.resource_tracker
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import torch

from .atomic import atomic_write_bytes, atomic_write_json
from .distributed import DistEnv, forkserver_started, stop_forkserver
from .lock import process_start


def process_seconds() -> float | None:
    """How long this process has run (Linux's /proc), None where unknown: a command's wall time, its interpreter's
    start and imports included."""
    try:
        started = int(process_start(os.getpid()))
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, TypeError, ValueError):
        return None
    return uptime - started / os.sysconf("SC_CLK_TCK")


class ConsoleLog:
    """``with ConsoleLog() as console:`` what this process and the workers it starts write to stdout and stderr
    reaches the console as before and, once ``console.attach(path)`` names it, is appended to ``path`` (the
    run's ``train.log``) too, what was written before included; without ``attach`` no file is written (a
    command refused before its run directory is its own).

    The copy is made at the file descriptors, which the workers inherit, so their output and that of native
    code is in it too; a line redrawn with carriage returns (a progress bar) is logged once, as it was left.
    The workers' Python writes unbuffered meanwhile (``PYTHONUNBUFFERED``): their output goes through a pipe,
    which would otherwise hold it back. The pipe exists from the start of the block, so that a process started
    in it before the file is named (the workers' fork server, whose children write to its console) writes
    into it. ``hold=False`` makes it a no-op (the workers torchrun starts beside rank 0).
    """

    def __init__(self, hold: bool = True):
        self.hold = hold

    def __enter__(self):
        if not self.hold:
            return self
        self.log, self.kept = None, []
        self.lock = threading.Lock()
        self.unbuffered = os.environ.get("PYTHONUNBUFFERED")
        os.environ["PYTHONUNBUFFERED"] = "1"
        # multiprocessing's resource tracker, which lives as long as this process, would hold the pipe below
        # open past __exit__ had a fork server or a spawned worker started it inside the block: started first, it
        # holds the console
        multiprocessing.resource_tracker.ensure_running()
        self.server = forkserver_started()
        sys.stdout.flush()
        sys.stderr.flush()
        self.streams = []
        for fd in (1, 2):
            console = os.dup(fd)
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            thread = threading.Thread(target=self._copy, args=(read, console), daemon=True)
            thread.start()
            self.streams.append((fd, console, thread))
        return self

    def attach(self, path) -> None:
        """Append what was written so far, and from now on, to ``path``."""
        if not self.hold:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        with self.lock:
            self.log = open(path, "ab")
            self.log.write(b"".join(self.kept))
            self.log.flush()
            self.kept = []

    def _copy(self, read: int, console: int) -> None:
        line = b""
        while chunk := os.read(read, 1 << 16):
            view = memoryview(chunk)
            while view:
                view = view[os.write(console, view):]
            *done, line = (line + chunk).split(b"\n")
            self._log(done)
        self._log([line] if line else [])
        os.close(read)

    def _log(self, lines: list[bytes]) -> None:
        # what a terminal leaves of a line redrawn after carriage returns; a bar erased at its end leaves nothing
        shown = [line.rsplit(b"\r", 1)[-1] for line in lines]
        text = b"".join(s + b"\n" for line, s in zip(lines, shown) if s.strip() or b"\r" not in line)
        if text:
            with self.lock:
                if self.log is None:
                    self.kept.append(text)
                else:
                    self.log.write(text)
                    self.log.flush()

    def __exit__(self, *exc):
        if not self.hold:
            return False
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, console, _ in self.streams:
            os.dup2(console, fd)  # closes the pipe's last writer here: its copier reads the end
        # a fork server of the workers started inside this block holds the pipe too: ending it ends the copy now,
        # not at the timeout below (10 s of each run that started workers, measured)
        stop_forkserver(unless=self.server)
        for _, _, thread in self.streams:
            # a process left holding the pipe (one the job started and did not end) must not hold the job up
            thread.join(timeout=5)
        if not any(thread.is_alive() for _, _, thread in self.streams):  # else the copier still writes to them
            for _, console, _ in self.streams:
                os.close(console)
            if self.log is not None:
                self.log.close()
        if self.unbuffered is None:
            os.environ.pop("PYTHONUNBUFFERED", None)
        else:
            os.environ["PYTHONUNBUFFERED"] = self.unbuffered
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


REPOSITORY = Path(__file__).resolve().parents[1]


def shown_path(path: str) -> str:
    """A path as a record kept with a page shows it (a page names no folder of the machine that made it): relative
    to the repository where it lies inside (``runs/tta``); a run made in another checkout (its records kept, the
    page rebuilt here) from that checkout's ``runs/`` folder on; by its last part elsewhere (``.../tta``)."""
    if not os.path.isabs(path) or not path.strip("/"):  # ("/" alone is a word: "1,500 train / 297 test")
        return path
    inside = os.path.relpath(path, REPOSITORY)
    if not inside.startswith(".."):
        return inside
    parts = Path(path).parts
    return str(Path(*parts[parts.index("runs"):])) if "runs" in parts else f".../{os.path.basename(path.rstrip('/'))}"


def shown_args(args) -> list[str]:
    """:func:`shown_path` of each argument that is a path, or ``key=path`` (a Hydra override, ``--out=path``)."""
    out = []
    for arg in map(str, args):
        key, eq, value = arg.partition("=")
        out.append(f"{key}={shown_path(value)}" if eq and not arg.startswith("/") else shown_path(arg))
    return out


def shown_command(args) -> str:
    """A command line as a results page records it: :func:`shown_args` of its words."""
    return " ".join(shown_args(args))


def shown_text(value):
    """``value`` (a record's JSON or YAML: dicts, lists, strings) with the paths in its strings shown as
    :func:`shown_path` shows them, word by word."""
    if isinstance(value, dict):
        return {k: shown_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shown_text(v) for v in value]
    if isinstance(value, str) and "/" in value:
        return " ".join(shown_args(value.split(" ")))
    return value


def command() -> list[str]:
    """This process's command line, its paths shown as :func:`shown_path` shows them."""
    return shown_args(sys.argv)


def hardware(device: torch.device) -> str:
    """What a worker on this host computes on: the accelerator's name, else the CPU's model and its core count
    (the tables name it beside each run, since a number moves with the machine that produced it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        return device.type
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):  # not Linux, or no model name there (some ARM kernels)
        model = platform.processor() or platform.machine() or "unknown model"
    return f"CPU ({model}, {os.cpu_count()} cores)"


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


def read_jsonl(path: Path, notice=print) -> list[dict]:
    """The records of a JSON-lines file ([] when it is absent).

    A last line that is not JSON was torn by an interrupted append (a full disk, a killed job): it is dropped,
    with a ``notice`` naming the file. A damaged line before the last is refused, naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    out = []
    for i, (n, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if i + 1 < len(lines):
                raise ValueError(f"{path} line {n} is not JSON ({e}): repair or delete that line") from None
            notice(f"dropping the torn last line of {path} (line {n}, {len(line)} characters that are not JSON: "
                   "an interrupted write)")
    return out


def _position(line: dict) -> int:
    return line.get("epoch", line.get("step", 0))


class RunLogger:
    def __init__(self, run_dir, cfg: dict, env: DistEnv, *, wandb: bool = False, wandb_project: str = "slamb",
                 progress: bool = True, resume_epoch: int = 0, writer: bool | None = None):
        """``writer``: this process writes the run directory's files (default: rank 0's); under torchft the
        writer of each line may change (:class:`harness.fault_tolerance.ManagedSteps`)."""
        self.dir = Path(run_dir)
        self.env = env
        self.writer = env.is_main if writer is None else writer
        self.progress_enabled = progress and self.writer
        self._wandb = None
        if not self.writer:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf

        (self.dir / "metrics.json").unlink(missing_ok=True)  # this run has not finished (yet)
        (self.dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
        atomic_write_json({
            "git": git_revision(), "command": command(), "world_size": env.world_size, "device": str(env.device),
            "hardware": hardware(env.device),
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
        keep = [line for line in read_jsonl(path) if _position(line) <= resume_epoch]
        # atomically: a job killed here, or a full disk, must leave the old lines rather than none
        atomic_write_bytes(path, lambda f: f.write("".join(json.dumps(line) + "\n" for line in keep).encode()))

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
        if not self.writer:
            return
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=metrics.get("step"))
        shown = {k: v for k, v in metrics.items() if not k.startswith("bytes/") and k != "time"}
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
              flush=True)

    def history(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def finish(self, summary: dict) -> None:
        if not self.writer:
            return
        atomic_write_json(summary, self.dir / "metrics.json")
        if self._wandb is not None:
            self._wandb.summary.update(summary)
            self._wandb.finish()
