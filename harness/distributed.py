"""Distributed set-up and the one launch path of every pipeline.

``launch(worker, cfg, run_dir)`` runs ``worker(cfg, run_dir)`` on every
worker (``worker``: a function, or its ``"package.module:function"`` name, which
any process can import: a function of ``__main__`` cannot be pickled into the
workers when ``__main__`` is another program, as under submitit):

* under ``torchrun`` (any number of nodes) it simply calls it: torchrun
  already started one process per worker;
* in a SLURM step of several tasks (``srun``, sbatch/submitit with
  ``--ntasks``), each task is one worker: its rank, local rank, the world
  size and the master address (the first host of the step's node list) come
  from SLURM's environment, and it simply calls it;
* otherwise, with ``trainer.nproc_per_node > 1``, it starts that many local
  workers itself through torch's elastic launcher (the engine behind
  torchrun), on a fresh rendezvous port, with ``trainer.max_restarts`` (spent on
  faults that may pass only: an error that would recur, :data:`WILL_RECUR`, ends the
  job at the first attempt in one line, :class:`WorkerError`);
* with one worker it calls it in-process, without a process group.

Test hook: ``SLAMB_FAULT_AT_STEP=N`` kills (``os._exit``) the worker of rank
``SLAMB_FAULT_RANK`` (default 0) just before its N-th optimizer step, on the
first attempt of the job only, so that restarts (``--max-restarts``) and
auto-resume can be exercised. ``SLAMB_FAULT_AT_STEP=N0,N1,...``: attempt k
(the k-th restart; under torchft, the group's k-th relaunch) dies before step
N_k, so that one run meets several failures. ``SLAMB_FAULT_KIND=hang``: that worker
hangs there instead (it sleeps until it is ended), as a worker that trains on
unseen, printing nothing, does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import uuid

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from slamb import comm
from .atomic import DiskFull
from .lock import RunLocked, end_with, enlist, this_process
from .replica import current as current_replica, join

FAULT_ENV, FAULT_RANK_ENV, FAULT_KIND_ENV = "SLAMB_FAULT_AT_STEP", "SLAMB_FAULT_RANK", "SLAMB_FAULT_KIND"


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """True in a worker that torchrun or the elastic launcher started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def slurm_tasks() -> int:
    """The number of tasks of this SLURM step (0 outside SLURM)."""
    return int(os.environ.get("SLURM_NTASKS", "0"))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-09,12],cpu3`` -> ``gpu07``; ``n[1-2]-ib`` -> ``n1-ib``."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot read a host from SLURM_NODELIST={nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first.group(0))


def slurm_env(environ=os.environ) -> dict[str, str]:
    """torch.distributed's ``env://`` variables for this task of a multi-task SLURM step (one task per worker).

    ``MASTER_ADDR``/``MASTER_PORT`` already set win; otherwise the first host of
    the node list, and a port every task derives from the job id.
    """
    nodelist = environ.get("SLURM_NODELIST", environ.get("SLURM_JOB_NODELIST"))
    missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS") if k not in environ]
    missing += [] if nodelist or "MASTER_ADDR" in environ else ["SLURM_NODELIST"]
    missing += [] if "SLURM_JOB_ID" in environ or "MASTER_PORT" in environ else ["SLURM_JOB_ID"]
    if missing:
        raise RuntimeError(
            f"a SLURM step of {environ.get('SLURM_NTASKS')} tasks without {missing} in the environment: start "
            "one task per worker with srun (or hydra/launcher=slurm), or set MASTER_ADDR, MASTER_PORT, RANK, "
            "WORLD_SIZE and LOCAL_RANK yourself")
    return {
        "RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ["SLURM_LOCALID"], "LOCAL_WORLD_SIZE": str(slurm_tasks_per_node(environ)),
        "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(20000 + int(environ["SLURM_JOB_ID"]) % 20000),
    }


def slurm_tasks_per_node(environ=os.environ) -> int:
    """The tasks of this SLURM step on this node (``2(x3)`` -> 2; 1 where SLURM does not say)."""
    per_node = re.match(r"\d+", environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or "1")
    return int(per_node.group(0)) if per_node else 1


def local_workers(nproc_per_node: int) -> int:
    """The workers of this node: torchrun's or SLURM's where they start them, else ``nproc_per_node``."""
    if under_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node))
    return slurm_tasks_per_node() if slurm_tasks() > 1 else nproc_per_node


def started_externally() -> bool:
    """True in a worker that torchrun, the elastic launcher or a multi-task SLURM step started."""
    return under_torchrun() or slurm_tasks() > 1


def planned_world_size(nproc_per_node: int) -> int:
    """The workers a job will have, known before any starts: torchrun's or SLURM's, else ``nproc_per_node``."""
    if under_torchrun():
        return int(os.environ.get("WORLD_SIZE", "1"))
    return slurm_tasks() if slurm_tasks() > 1 else nproc_per_node


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def driver_version() -> str:
    """The NVIDIA driver's version as nvidia-smi reports it; 'unknown' without a driver or nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[0] if out else "unknown"


def cuda_versions() -> str:
    return f"torch built for CUDA {torch.version.cuda or 'none (a CPU build)'}, NVIDIA driver {driver_version()}"


def check_device(name: str, workers: int) -> bool:
    """Refuse (``ValueError``, one line) a ``trainer.device`` that ``workers`` workers of a node cannot run
    on; True where ``auto`` finds no accelerator and falls back to the CPU.

    Two workers on one GPU would reach NCCL's "Duplicate GPU detected" only once every worker has started,
    and ``cuda`` without a usable CUDA (a driver older than torch's CUDA build) only in each worker.
    """
    if name == "auto":
        if not torch.accelerator.is_available():
            return True
        kind, count = torch.accelerator.current_accelerator().type, torch.accelerator.device_count()
    else:
        device = torch.device(name)
        if device.type == "cpu":
            return False
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"invalid trainer.device={name!r}: no usable CUDA device ({cuda_versions()}); a driver "
                             "older than the build needs an update (or a torch built for its CUDA); "
                             "trainer.device=cpu trains on the CPU")
        if device.index is not None:
            if workers > 1:
                raise ValueError(f"invalid trainer.device={name!r}: one device for {workers} workers on this node "
                                 f"(NCCL: 'Duplicate GPU detected'); trainer.device={device.type} gives each "
                                 "worker the device of its local rank")
            return False
        kind, count = device.type, torch.get_device_module(device.type).device_count()
    if workers > count:
        raise ValueError(f"invalid trainer.nproc_per_node={workers}: {workers} workers on this node and {count} "
                         f"visible {kind} device(s): two workers would share one (NCCL: 'Duplicate GPU detected'); "
                         f"at most {count} (torchrun: --nproc-per-node), or trainer.device=cpu")
    return False


def cpu_fallback_notice() -> str:
    return (f"notice: trainer.device=auto found no usable GPU ({cuda_versions()}): the workers train on the CPU "
            "(gloo); trainer.device=cuda refuses to, trainer.device=cpu asks for it")


def resolve_device(name: str, local_rank: int) -> torch.device:
    """``auto``: the local accelerator of this worker when there is one, else the CPU.

    A worker sees only its own local rank: the node's worker count was checked, with the same
    refusals, before any worker started (:func:`check_device`); here a local rank beyond the visible
    devices is refused instead of wrapped onto a device another worker holds."""
    if check_device(name, local_rank + 1):
        return torch.device("cpu")
    device = torch.device(torch.accelerator.current_accelerator().type if name == "auto" else name)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, local_rank)
    return device


def set_cuda_math(tf32: bool | None = None, cudnn_benchmark: bool | None = None) -> None:
    """TF32 in float32 matmuls and cuDNN convolutions, cuDNN's per-shape autotuner; None leaves torch's
    setting. Both choose CUDA kernels only: a CPU worker computes the same either way."""
    if tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(tf32)
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = bool(cudnn_benchmark)


def evaluation_env(env: DistEnv) -> DistEnv:
    """The ranks an evaluation shares its data among (:func:`harness.eval_shard`, :func:`harness.rank_sums`): the
    run's, except under torchft, where each replica group scores the whole set (its collectives would run outside
    a step's commit)."""
    return env if current_replica() is None else dataclasses.replace(env, rank=0, world_size=1)


def init_distributed(device: str = "auto", threads_per_worker: int | None = None,
                     timeout_s: float = 1800, *, tf32: bool | None = None,
                     cudnn_benchmark: bool | None = None) -> DistEnv:
    """Join the job's process group (env:// from torchrun / the launcher), or its torchft replica groups
    (:func:`harness.replica.join`: the ranks are the groups), or run alone.

    Reuses a process group that already exists (tests, notebooks). Backend:
    NCCL on CUDA, gloo elsewhere. CPU threads default to cores / local workers.
    ``tf32``, ``cudnn_benchmark``: :func:`set_cuda_math` (``trainer.deterministic``'s
    :func:`harness.seeding.seed_everything`, called later, turns the autotuner off again).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    dev = resolve_device(device, local_rank)
    if dev.type != "cpu":
        torch.accelerator.set_device_index(dev.index)
    if threads_per_worker is None:
        threads_per_worker = max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads_per_worker)
    set_cuda_math(tf32, cudnn_benchmark)
    replica = join(dev, timeout_s)
    if replica is not None:  # one of a torchft job's replica groups: they meet through its manager, not dist
        return DistEnv(replica.global_rank, replica.groups * replica.size, local_rank, local_world, dev)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(rendezvous("env://", timeout=timeout))
        # The elastic agent's store outlives a restart: without a namespace per attempt, restarted workers
        # read the dead workers' addresses from it and gloo waits forever to connect to them.
        store = dist.PrefixStore(f"slamb/attempt{restart_count()}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=dev if backend == "nccl" else None)
    if comm.rank() != 0:
        quiet_library_warnings()
    return DistEnv(comm.rank(), comm.world_size(), local_rank, local_world, dev)


def quiet_library_warnings() -> None:
    """Hugging Face's warnings (a model's 20-line load report) at error level: one copy per job, from rank 0."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # read when transformers configures its logger
    if "transformers" in sys.modules:
        sys.modules["transformers"].logging.set_verbosity_error()


def barrier() -> None:
    if comm.world_size() > 1:
        dist.barrier()


def maybe_inject_fault(step: int, env: DistEnv) -> None:
    """The ``SLAMB_FAULT_AT_STEP`` test hook (see the module docstring)."""
    at = os.environ.get(FAULT_ENV)
    if not at or env.rank != int(os.environ.get(FAULT_RANK_ENV, "0")):
        return
    steps, attempt = [int(s) for s in at.split(",")], restart_count()
    if attempt < len(steps) and step == steps[attempt]:
        hang = os.environ.get(FAULT_KIND_ENV) == "hang"
        print(f"[fault injection] rank {env.rank} {'hangs' if hang else 'exits'} before step {step} ({FAULT_ENV}={at})",
              flush=True)
        while hang:
            time.sleep(60)
        os._exit(17)


def shutdown() -> None:
    """Leave the process group, if any, before the interpreter exits.

    Without this, a gloo thread could still be running when Python shuts down, be killed inside C++
    (std::terminate) and take the worker down with SIGABRT after its work was done, which a launcher
    reports as a failure: 1 run in 5 of the resume test did. Collecting cyclic garbage, then destroying
    the group, made it disappear in 30 runs; the object that kept gloo busy was not identified.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_worker(worker):
    """A worker function, or the function a ``"package.module:function"`` name imports."""
    if callable(worker):
        return worker
    module, _, name = str(worker).partition(":")
    fn = getattr(importlib.import_module(module), name, None) if name else None
    if not callable(fn):
        raise ValueError(f"invalid worker {worker!r}: must be a function or 'package.module:function'")
    return fn


# Worker errors a restart from the last checkpoint meets again: a missing input (the data's files, a model
# directory), a value a check rejects (a setting, a damaged input) and a full disk. A restart helps only where
# the cause lies outside the run's inputs, settings and disk: a killed worker, a lost peer, a device or network
# fault (RuntimeError, the process group's errors), a signal.
WILL_RECUR = (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, DiskFull)
# the exit status of a worker that ended on one of them, and of the command; sysexits' EX_DATAERR. The elastic
# launcher of :func:`launch` does not restart it; under torchrun, a scheduler's retry policy can key on it
# (torchrun itself restarts any failure)
WILL_RECUR_EXIT = 65


class WorkerError(Exception):
    """A worker's failure in one line (``str()``: the error, its rank and where its traceback is); ``status``:
    the command's exit status, :data:`WILL_RECUR_EXIT` for an error a restart would meet again
    (:data:`WILL_RECUR`: the launch stopped at the first attempt), else 1."""

    def __init__(self, line: str, status: int = 1):
        super().__init__(line)
        self.status = status


def error_line(error: BaseException, rank, traceback_file: str | None = None) -> str:
    message = " ".join(str(error).split())
    notes = [f"its traceback: {traceback_file}"] if traceback_file else []
    if isinstance(error, WILL_RECUR):
        notes.insert(0, "not restarted: a restart from the last checkpoint would fail the same way")
    said = "; ".join(notes)
    return f"error: {type(error).__name__} on rank {rank}: {message}{f' ({said})' if said else ''}"


def keep_traceback(run_dir, rank) -> str | None:
    """The traceback of the exception being handled, in ``run_dir``: the one line leaves it out, a bug found
    this way still needs it. None where ``run_dir`` cannot take it."""
    import traceback

    path = os.path.join(str(run_dir), f"error.rank{rank}.txt")
    try:
        with open(path, "w") as f:
            f.write(traceback.format_exc())
    except OSError:
        return None
    return path


def _worker_entry(worker, cfg, run_dir, errors_dir=None, launcher=None):
    """A worker's body: ``worker(cfg, run_dir)``, its error in one line (:func:`error_line`; the traceback in
    ``run_dir``).

    A worker this module's launchers start (``launcher``: theirs, :func:`harness.lock.this_process`) ends with its
    launcher and enlists in the run directory's lock that the launcher holds (:mod:`harness.lock`); one that
    torchrun or SLURM started ends with its parent, their agent.

    In the process of :func:`launch` (one worker) the error is a :class:`WorkerError`. Under this launcher's
    elastic agent (``errors_dir`` its folder) the worker writes the line there and exits (status 1, or
    :data:`WILL_RECUR_EXIT` for an error that would recur); the launcher prints it once for the job. Under
    torchrun's agent a worker prints the line of an error that would recur and exits with that status; torchrun
    reports any other error itself.
    """
    if launcher is not None or started_externally():
        end_with(launcher)
    if launcher is not None:
        try:
            enlist(run_dir, launcher)
        except RunLocked as e:  # its launcher is gone, the run directory another job's: nothing more of it there
            print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    try:
        return resolve_worker(worker)(cfg, run_dir)
    except Exception as e:
        recurs = isinstance(e, WILL_RECUR)
        torchrun = errors_dir is None and "TORCHELASTIC_RUN_ID" in os.environ
        if torchrun and not recurs:
            raise
        rank = os.environ.get("RANK", "0")
        line = error_line(e, rank, keep_traceback(run_dir, rank))
        status = WILL_RECUR_EXIT if recurs else 1
        if torchrun:
            print(line, file=sys.stderr, flush=True)
        elif errors_dir is None:
            raise WorkerError(line, status) from e
        else:
            with open(os.path.join(errors_dir, f"rank{rank}.{'error' if recurs else 'fault'}"), "w") as f:
                f.write(line)
        raise SystemExit(status) from None
    finally:
        shutdown()


# the loggers of elastic's reports on failed workers and on the stopping of the others
REPORTERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


class _Reporting:
    """The one line of a failed launch, in place of elastic's reports (the worker's traceback, then a block
    for the group, once per attempt): the workers write their lines in ``errors_dir``
    (``rank<r>.error`` for an error that would recur, ``rank<r>.fault`` for another). After an error that would
    recur, torch's elastic agent restarts no more, as it does for a worker stuck in the kernel."""

    def __init__(self, errors_dir: str):
        self.errors_dir = errors_dir

    def line(self, failed) -> WorkerError:
        """The launch's error from elastic's ``ChildFailedError``: the first rank's line that would recur, else
        the line of the worker that failed first, else (a worker killed, without a line) its exit."""
        final = sorted((n for n in os.listdir(self.errors_dir) if n.endswith(".error")),
                       key=lambda n: int(re.sub(r"\D", "", n)))
        if final:
            return WorkerError(self._read(final[0]), WILL_RECUR_EXIT)
        rank, failure = failed.get_first_failure()
        fault = f"rank{rank}.fault"
        if failure.exitcode == 1 and os.path.exists(os.path.join(self.errors_dir, fault)):
            return WorkerError(self._read(fault))
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        return WorkerError(f"error: the worker of rank {rank} ended on {how}, without an error of its own (killed, "
                           "or out of memory: see the system's log)")

    def _read(self, name: str) -> str:
        with open(os.path.join(self.errors_dir, name)) as f:
            return f.read()

    def filter(self, record) -> bool:  # a logging filter of REPORTERS: the launch's line says it
        return False

    def agent_class(self):
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        errors_dir = self.errors_dir

        class FinalOnRecurringErrorAgent(LocalElasticAgent):
            def _monitor_workers(self, worker_group):
                result = super()._monitor_workers(worker_group)
                if result.is_failed() and any(n.endswith(".error") for n in os.listdir(errors_dir)):
                    self._remaining_restarts = 0
                return result

        return FinalOnRecurringErrorAgent


# imported once by the fork server rather than by every worker
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "harness.distributed")
_server_started_in: tuple | None = None  # the environment and directory the fork server was started in
# set by torch in the environment where it first needs it, to the default it resolves in any process alike: a server
# started before the caller's torch set it (:func:`prestart`) is not restarted for it
_RESOLVED_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR",)


def forkserver(*modules: str) -> str:
    """The ``forkserver`` start method, its server having imported torch and ``modules``.

    A spawned worker imports torch and its function's module again: 5-15 s of CPU on a small machine, most of a
    short multi-process test's cost and of a pipeline's start. A fork server's children are forks of one process
    that did those imports once. It is a fresh interpreter, never a fork of the caller (whose threads, autograd's
    among them, must not be forked), and it is restarted when the caller's modules, environment or directory have
    changed since it started, so its children start as spawned ones would.
    """
    global _server_started_in
    preload = [*_PRELOAD, *(name for m in modules for name in _imports_of(m))]
    environ = {k: v for k, v in os.environ.items() if k not in _RESOLVED_BY_TORCH}
    started_in = (preload, environ, os.getcwd())
    if started_in != _server_started_in:
        multiprocessing.forkserver._forkserver._stop()
        multiprocessing.set_forkserver_preload(preload)
        _server_started_in = started_in
    return "forkserver"


def prestart(worker, nproc_per_node: int, *modules: str) -> None:
    """Start the fork server :func:`launch` will start ``worker``'s workers from (``modules``: the further ones
    it imports, :func:`forkserver`), now, where it will start workers: the server's imports (5-8 s of CPU) then
    run beside the launching process's checks instead of after them. The server's children write to the console
    it had when it started (:class:`harness.run.ConsoleLog` is entered first)."""
    if isinstance(nproc_per_node, int) and nproc_per_node > 1 and not started_externally():
        forkserver(_worker_module(worker), *modules)
        multiprocessing.forkserver.ensure_running()


def forkserver_started() -> object:
    """What identifies the fork server that runs now (None: none was started here); another server gives another."""
    return _server_started_in


def stop_forkserver(unless: object = None) -> None:
    """End the fork server, unless it is the one ``unless`` identifies (:func:`forkserver_started`); the next
    :func:`forkserver` starts another. It holds the file descriptors of the process that started it, a console's
    pipe among them (:class:`harness.run.ConsoleLog`)."""
    global _server_started_in
    if _server_started_in is not None and _server_started_in is not unless:
        server = multiprocessing.forkserver._forkserver
        if server._forkserver_pid is not None:  # it may still import (a command refused after prestart)
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()
        _server_started_in = None


def _imports_of(module: str) -> list[str]:
    """``[module]``, or the modules its names come from where it runs as ``__main__`` (``python -m``): each
    child runs the caller's main module again, as ``__mp_main__``, which warns where the module was imported
    already and is quick where what it imports was."""
    main = sys.modules["__main__"]
    if getattr(getattr(main, "__spec__", None), "name", None) != module:
        return [module]
    names = {v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
             for v in vars(main).values()}
    return sorted(n for n in names if isinstance(n, str) and n in sys.modules and n not in ("__main__", module))


def _worker_module(worker) -> str:
    return worker.__module__ if callable(worker) else str(worker).partition(":")[0]


def _method_name(depth: int = 2) -> str:
    return sys._getframe(depth).f_code.co_name


@contextlib.contextmanager
def _quick_rendezvous_names():
    """The c10d rendezvous names each event it records after its caller's caller, found with
    ``inspect.stack()``, which reads the source of every frame of the stack, twice per event: about 0.5 s of
    a 2-worker launch on 2 cores (paired against the frame's name, measured). The same name from the frame
    itself."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if not hasattr(dynamic_rendezvous, "get_method_name"):
        yield
        return
    from unittest import mock

    with mock.patch.object(dynamic_rendezvous, "get_method_name", _method_name):
        yield


def launch(worker, cfg, run_dir: str, *, nproc_per_node: int = 1, max_restarts: int = 0):
    """Run ``worker(cfg, run_dir)`` on every worker; returns rank 0's result.

    ``cfg`` must be picklable (a plain dict) when workers are started here.
    In a multi-task SLURM step ``nproc_per_node`` is ignored: each task is a worker.
    Workers started here are restarted up to ``max_restarts`` times, except after an error that would recur
    (:data:`WILL_RECUR`). A failure (after the restarts, or at the first attempt for an error that would
    recur) is a :class:`WorkerError`, one line; a worker's traceback stays in ``run_dir``.
    """
    if slurm_tasks() > 1 and not under_torchrun():
        os.environ.update(slurm_env())
    if under_torchrun() or nproc_per_node <= 1:
        return _worker_entry(worker, cfg, run_dir)
    from unittest import mock

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api

    # the launcher's folder (its workers' error files): by default a temporary folder it never removes
    with tempfile.TemporaryDirectory(prefix="torchelastic_") as logs:
        config = api.LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=uuid.uuid4().hex,
            rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=max_restarts,
            start_method=forkserver(_worker_module(worker)), monitor_interval=0.2, logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        reporting = _Reporting(os.path.join(logs, "errors"))
        os.mkdir(reporting.errors_dir)
        for name in REPORTERS:
            logging.getLogger(name).addFilter(reporting)
        try:
            # launch_agent builds its agent from this module's name: the one way in short of copying it
            with mock.patch.object(api, "LocalElasticAgent", reporting.agent_class()), _quick_rendezvous_names():
                results = api.elastic_launch(config, _worker_entry)(worker, cfg, run_dir, reporting.errors_dir,
                                                                    this_process())
        except ChildFailedError as failed:
            raise reporting.line(failed) from None
        finally:
            for name in REPORTERS:
                logging.getLogger(name).removeFilter(reporting)
    return results[0]
