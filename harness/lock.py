"""A run directory's lock, and the job's processes it records: a job's workers end with their launcher.

``<run_dir>/run.lock`` is held while a job writes its run directory (:class:`RunLock`). Its first line names the
holder, the process that took it (the command's launcher; under torchrun or SLURM, rank 0); each worker the
launcher starts adds a line of its own (:func:`enlist`). The lock is stale only once none of these processes
lives: a rerun takes it over then, never while a worker of the earlier job could still write a checkpoint. The
workers torchrun or SLURM start beside rank 0 are not recorded (they may run on other hosts): they end with
their agent, as rank 0 does.

A worker ends (SIGKILL) as soon as its launcher ends (:func:`end_with`): a launcher killed (SIGKILL, the OOM
killer, a lost terminal) cannot end its workers itself, and they would otherwise train on unseen, writing
checkpoints and error files into a run directory that a rerun takes for its own. It watches the launcher
itself, not its parent: the pipelines' launcher starts its workers from a fork server, which outlives it as
long as they live (they hold its pipe).
"""
from __future__ import annotations

import datetime
import json
import os
import select
import signal
import socket
import threading
import time
from pathlib import Path

NAME = "run.lock"


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the third (the state) on; None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the command's name
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """When process ``pid`` of this host started (clock ticks since boot, /proc), None where unknown: with the
    pid it names one process, since a pid is reused once its process is gone."""
    stat = _stat(pid)
    return stat[19] if stat else None  # field 22


def this_process() -> dict:
    """This process as a lock records it: its host, pid and start."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid())}


def gone(process: dict) -> str | None:
    """Why ``process`` (a record of :func:`this_process`) is gone, or None where it may still run (another host's
    cannot be checked from here)."""
    if process.get("host", socket.gethostname()) != socket.gethostname():
        return None
    pid = int(process["pid"])
    try:
        os.kill(pid, 0)  # signal 0: is there such a process, nothing sent
    except ProcessLookupError:
        return f"process {pid} is gone"
    except PermissionError:  # there is, run by another user
        pass
    stat = _stat(pid)
    if stat is not None and stat[0] == "Z":  # ended, not yet reaped by its parent (a fork server under load)
        return f"process {pid} is gone"
    started = process.get("started")  # absent from locks written before it was recorded
    now = stat[19] if stat else None
    if started is None or now in (None, started):
        return None
    return f"process {pid} that wrote it is gone: pid {pid} now names another process, started later"


def parse(text: str) -> tuple[dict | None, list[dict]]:
    """The holder a lock's text names and the workers it records; (None, []) for a lock not written yet (a
    holder killed before writing it)."""
    try:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        return None, []
    return (records[0], records[1:]) if records and isinstance(records[0], dict) else (None, [])


def read(path: Path) -> tuple[dict | None, list[dict]]:
    """:func:`parse` of the lock at ``path``; (None, []) for one removed meanwhile."""
    try:
        return parse(Path(path).read_text())
    except OSError:
        return None, []


class RunLocked(RuntimeError):
    """The run directory is another job's (its lock is held): one line naming the holder and the fix."""


class RunLock:
    """``<run_dir>/run.lock`` while a job writes the run directory; a second writer gets a clear error.

    The file names the holder (host, pid, the process's start time), then the workers it started
    (:func:`enlist`). A lock whose processes are all gone on this host (a pid that now names another process
    counts as gone) is stale and is taken over with a message; one whose holder is gone while a worker of it
    lives is waited for up to :attr:`WORKERS_GRACE_S` (they end with their launcher, :func:`end_with`), then
    refused naming them. A lock file still empty is being written by its holder: it is stale only once it
    stays empty past :attr:`EMPTY_GRACE_S`. ``hold=False`` makes it a no-op (the workers torchrun starts beside
    the one that holds it).
    """

    EMPTY_GRACE_S = 10.0  # far beyond the instant between a holder's creating the file and writing it
    WORKERS_GRACE_S = 30.0  # far beyond the instant a worker takes to end once its launcher is gone

    def __init__(self, run_dir, hold: bool = True):
        self.path = Path(run_dir) / NAME
        self.hold = hold
        self.me = this_process()

    def _holder(self) -> dict | None:
        return read(self.path)[0]

    def _unwritten(self) -> bool:
        """The lock file exists and is not (yet) a record: wait for its holder to write it, up to the grace."""
        while True:
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return False
            if self._holder() is not None or age > self.EMPTY_GRACE_S:
                return self._holder() is None
            time.sleep(0.05)

    def _workers_left(self) -> list[int]:
        """The pids of the recorded workers that still run, once they had :attr:`WORKERS_GRACE_S` to end."""
        deadline = time.monotonic() + self.WORKERS_GRACE_S
        while True:
            left = [int(w["pid"]) for w in read(self.path)[1] if gone(w) is None]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {**self.me, "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                unwritten = self._unwritten()
                holder = self._holder()
                why = gone(holder) if holder is not None else None
                if holder is not None and why is None:
                    raise RunLocked(
                        f"run directory {self.path.parent} is being written by process {holder['pid']} on "
                        f"{holder['host']} (since {holder.get('since')}): wait for it to finish or use another run "
                        f"directory; if that process is gone, delete {self.path}") from None
                left = self._workers_left() if holder is not None else []
                if left:
                    raise RunLocked(
                        f"run directory {self.path.parent} is being written by the workers of process "
                        f"{holder['pid']} (since {holder.get('since')}), which is gone: {len(left)} of them still "
                        f"run (pids {', '.join(map(str, left))}); end them (kill {' '.join(map(str, left))}) or use "
                        "another run directory") from None
                if unwritten:
                    print(f"removing the stale lock {self.path} (empty for over {self.EMPTY_GRACE_S:.0f} s: its "
                          "holder died before writing it)", flush=True)
                elif holder is not None:  # else the lock was released meanwhile
                    print(f"removing the stale lock {self.path} ({why})", flush=True)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
            return
        raise RunLocked(f"could not lock run directory {self.path.parent}: another job took it; wait for it "
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


def same_process(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("host", "pid", "started"))


def enlist(run_dir, launcher: dict) -> None:
    """Add this worker to the lock of ``run_dir`` that its ``launcher`` (a record of :func:`this_process`) holds.
    Where another job holds it now (its launcher gone, a rerun took it over), :class:`RunLocked`: this worker
    must write nothing there. Without a lock (a launch outside the pipelines' command) nothing is recorded.

    One appended line (a single write, whole to every reader): the workers of a job enlist at once, and a stale
    lock replaced meanwhile takes the line with it, unread."""
    path = Path(run_dir) / NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
    except FileNotFoundError:
        return
    try:
        holder, _ = parse(os.read(fd, os.fstat(fd).st_size).decode())
        if holder is None or not same_process(holder, launcher) or gone(launcher) is not None:
            raise RunLocked(f"run directory {path.parent} is no longer held by process {launcher['pid']}, which "
                            "started this worker: the worker ends without writing there")
        os.write(fd, (json.dumps({k: v for k, v in this_process().items() if k != "host"}) + "\n").encode())
    finally:
        os.close(fd)


def end_with(launcher: dict | None = None) -> None:
    """End this process (SIGKILL) as soon as ``launcher`` (a record of :func:`this_process`; None: this process's
    parent, torchrun's agent or SLURM's step) ends, at once where it has already ended."""
    if launcher is None:
        launcher = {"pid": os.getppid(), "started": process_start(os.getppid())}
    pid = int(launcher["pid"])
    try:
        watched = os.pidfd_open(pid)  # Linux 5.3: readable once the process has ended
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):  # another system, an older kernel: asked twice a second
        watched = None
    # the pid may name another process already (the launcher gone, its pid reused): that one is not watched
    if gone(launcher) is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_end_with, args=(launcher, watched), name="end-with-launcher", daemon=True).start()


def _end_with(launcher: dict, watched: int | None) -> None:
    if watched is not None:
        select.select([watched], [], [])
    else:
        while gone(launcher) is None:
            time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
