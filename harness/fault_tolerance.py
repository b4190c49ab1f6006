"""A pipeline's run that survives its workers' failures without a restart: ``trainer.fault_tolerance=torchft``.

    python -m cifar10.train experiment=cifar10/slamb +mixin=torchft trainer.replica_groups=4

    python -m bert.train experiment=bert/slamb +mixin=torchft trainer.replica_groups=3 \
        trainer.nproc_per_node=2 trainer.parallelism=hsdp trainer.shard_size=2

The job is ``trainer.replica_groups`` replica groups, which torchft's lighthouse (started here, by the launcher)
gathers into a quorum at every step. A group is one worker, or ``trainer.nproc_per_node`` workers that shard its
model (HSDP whose replicas are the groups: ``trainer.parallelism=hsdp``, ``trainer.shard_size`` its workers).
When a group dies (a process of it killed, its host lost) the step's commit fails on the others, who undo the
step and take it again without it (:class:`slamb.integrations.torchft.FaultTolerant`); the launcher ends the
group's other workers and relaunches it (``trainer.max_restarts`` relaunches in all, none after an error that
would recur), and it joins the others at a coming step, each worker taking its shards of a peer group's state
(``trainer.heal``, :data:`slamb.integrations.torchft.HEAL_POLICIES`). While a group is away the global batch
lacks its share, as in torchft's own data-parallel training.

* :func:`launch`: the lighthouse, the groups' processes, the relaunches, the job's one line on a failure;
* :func:`harness.replica.join`: a worker's replica group (from :func:`harness.init_distributed`): the manager's
  :class:`~slamb.integrations.torchft.ManagedGroup`, SLAMB's ``process_group`` (:func:`harness.build_optimizer`);
* :class:`harness.Loop` runs each step under the manager: the steps are numbered by the manager's committed
  steps (the data, the schedule, SLAMB's masks: a joining group continues where the others are), and the
  model averaged for evaluation and export commits with a logged period's last step (an epoch's, or
  ``log_every`` steps').

A replica group holds its own copy of the run's state, which a joining one copies: the run writes no checkpoint
(a job that loses every group at once starts again), and numbers its periods in ``metrics.jsonl`` as one run,
each line written by the first group of the quorum that committed the period's last step.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

import torch

from slamb import comm
from slamb.averaging import average_tensors_
from slamb.contract import GRADIENT_ALLREDUCE
from slamb.ddp import reshard
from slamb.optim.checks import check_choice, check_count
from slamb.optim.slamb import SLAMB
from slamb.sharding import local
from .checkpoint import Checkpointer, unwrap
from .distributed import WILL_RECUR_EXIT, WorkerError, _worker_entry, _worker_module, forkserver, started_externally
from .lock import this_process
from .replica import ENV, Replica, current

MODES = ("none", "torchft")
PRELOAD = ("slamb.integrations.torchft",)  # what the groups' fork server imports beside the pipeline
# the lighthouse drops a group silent this long; a quorum waits this long for a group of the last one that has
# not asked to join (a dead group: the time the others wait before they go on without it)
HEARTBEAT_MS, JOIN_MS = 5000, 5000
QUIET = "warn"  # torchft's log level (RUST_LOG), unless the environment sets one


def check(cfg: dict, supported: bool) -> None:
    """``trainer.fault_tolerance`` and the settings it needs, before any worker starts. ``supported``: the
    pipeline runs under torchft."""
    t = cfg["trainer"]
    check_choice("trainer.fault_tolerance", t["fault_tolerance"], MODES)
    if t["fault_tolerance"] == "none":
        return
    mode = "trainer.fault_tolerance=torchft"
    if not supported:
        raise ValueError(f"invalid {mode}: this pipeline runs without it (a pipeline whose loop is harness.Loop's "
                         "takes it with run_from_hydra(..., fault_tolerant=True)); set trainer.fault_tolerance=none")
    try:
        from slamb.integrations.torchft import HEAL_POLICIES
    except ImportError:
        raise ValueError(f"invalid {mode}: torchft is not installed; pip install 'slamb[ft]'") from None
    check_count("trainer.replica_groups", t["replica_groups"],
                " (the job's replica groups, of trainer.nproc_per_node workers each)")
    check_count("trainer.min_replicas", t["min_replicas"], " (groups a step needs to commit)")
    if t["min_replicas"] > t["replica_groups"]:
        raise ValueError(f"invalid trainer.min_replicas={t['min_replicas']}: more than the job's "
                         f"trainer.replica_groups={t['replica_groups']}")
    check_choice("trainer.heal", t["heal"], HEAL_POLICIES)
    workers = t["nproc_per_node"]
    check_count("trainer.nproc_per_node", workers, " (each replica group's workers)")
    # a group of several workers is one replica sharded over them: HSDP, its replicas torchft's groups
    alone = workers == 1
    needs = [(alone and t["parallelism"] != "ddp", f"trainer.parallelism={t['parallelism']} and one worker per group",
              "trainer.parallelism=ddp, or trainer.nproc_per_node=N trainer.parallelism=hsdp trainer.shard_size=N "
              "(groups of N workers sharding their model)"),
             (not alone and (t["parallelism"] != "hsdp" or t["shard_size"] != workers),
              f"trainer.nproc_per_node={workers} (each replica group's workers) and trainer.parallelism="
              f"{t['parallelism']} trainer.shard_size={t['shard_size']}",
              f"trainer.parallelism=hsdp trainer.shard_size={workers} (each group shards its model over its workers), "
              "or trainer.nproc_per_node=1"),
             (t["precision"] == "fp16", "trainer.precision=fp16 (its skips agree over a process group)",
              "trainer.precision=fp32 or bf16"),
             (t["checkpoint"]["enabled"], "trainer.checkpoint.enabled=true (its groups hold the run's state and "
              "heal each other)", "trainer.checkpoint.enabled=false"),
             (started_externally(), "a job started by torchrun or SLURM",
              "python -m <pipeline> (the launcher starts the groups and the lighthouse)")]
    for bad, what, fix in needs:
        if bad:
            raise ValueError(f"invalid {mode} with {what}: set {fix} (+mixin=torchft sets them)")


def check_run_dir(cfg: dict, run_dir) -> None:
    """A torchft run starts from step 0 (its groups keep no checkpoint): a run directory holding another run's
    checkpoints, which the groups would load, is refused."""
    if cfg["trainer"]["fault_tolerance"] == "torchft" and cfg["trainer"]["resume"] == "auto" and \
            Checkpointer(run_dir, None).complete():
        raise ValueError(f"invalid trainer.fault_tolerance=torchft in {run_dir}: it holds the checkpoints of a run "
                         "without it, and a torchft run starts from step 0; set trainer.resume=never (they are "
                         "removed) or another hydra.run.dir")


def check_optimizer(optimizer, name: str) -> None:
    """The optimizer runs under torchft: SLAMB (its collectives through the manager) or a data-parallel one."""
    if isinstance(optimizer, SLAMB):
        bad = [what for what, on in (("optimizer.overlap=true", optimizer.overlap),
                                     ("optimizer.hierarchy", optimizer.hierarchy is not None)) if on]
        if bad:
            raise ValueError(f"invalid trainer.fault_tolerance=torchft with {' and '.join(bad)}: SLAMB runs its "
                             "collectives through torchft's manager one at a time; drop the setting")
    elif optimizer.communication != GRADIENT_ALLREDUCE:
        raise ValueError(f"invalid trainer.fault_tolerance=torchft with optimizer={name}: SLAMB, or a data-parallel "
                         "optimizer (lamb, adamw, sgd), runs under it; pick one of those")


def quiet() -> None:
    """torchft's warnings only (it logs each quorum and commit, a dozen lines a step), unless ``RUST_LOG`` says
    otherwise: set before torchft is imported (it reads it then), in the process that starts the job."""
    os.environ.setdefault("RUST_LOG", QUIET)


# -- the launcher ---------------------------------------------------------------------------------------------

def launch(worker, cfg: dict, run_dir: str) -> dict:
    """Run ``worker(cfg, run_dir)`` in the ``trainer.nproc_per_node`` processes of each of
    ``trainer.replica_groups`` groups under a lighthouse started here; relaunch a failed group (all its processes:
    the others of it are ended) while others train (``trainer.max_restarts`` in all). Returns the run's summary
    (``metrics.json``). A failure that ends the job is a :class:`harness.distributed.WorkerError`, one line."""
    from torchft.coordination import LighthouseServer

    t = cfg["trainer"]
    groups, budget, size = t["replica_groups"], t["max_restarts"], t["nproc_per_node"]
    server = LighthouseServer(bind="[::]:0", min_replicas=t["min_replicas"], join_timeout_ms=JOIN_MS,
                              heartbeat_timeout_ms=HEARTBEAT_MS)
    fork = multiprocessing.get_context(forkserver(_worker_module(worker), *PRELOAD))
    launcher = this_process()  # the groups end with it, and with the lighthouse it hosts (harness.lock.end_with)
    running: dict[int, list] = {}  # a group's processes
    with tempfile.TemporaryDirectory(prefix="slamb_ft_") as folder:
        errors = Path(folder) / "errors"
        errors.mkdir()

        def start(index: int, attempt: int):
            running[index] = []
            for rank in range(size):
                env = f"{server.address()} {index} {groups} {attempt} {folder} {rank} {size}"
                p = fork.Process(target=_worker, args=(worker, cfg, run_dir, env, str(errors), launcher))
                p.start()
                running[index].append(p)

        try:
            for index in range(groups):
                start(index, 0)
            attempts, relaunched, finished = dict.fromkeys(range(groups), 0), 0, set()
            while running:
                time.sleep(0.2)
                for index, procs in list(running.items()):
                    codes = [p.exitcode for p in procs]
                    if None in codes and not any(codes):  # running, or some of it finished
                        continue
                    del running[index]
                    if not any(codes):
                        finished.add(index)
                        continue
                    rank, code = next((k, c) for k, c in enumerate(codes) if c)
                    for p in procs:  # the group's other processes: it is relaunched whole
                        p.kill()  # (not os.kill: the fork server may have reaped it since its exit code was read)
                        p.join()
                    line = _error_line(errors, index * size + rank, code, f"replica group {index}" +
                                       (f", its worker {rank}" if size > 1 else ""))
                    if code == WILL_RECUR_EXIT:
                        raise WorkerError(line, WILL_RECUR_EXIT)
                    if finished:  # the others have finished the run: nothing to rejoin
                        print(f"replica group {index} failed after the others finished: {line}", flush=True)
                        continue
                    if not running or relaunched >= budget:
                        why = "no group is left to heal from" if not running else \
                            f"trainer.max_restarts={budget} relaunches spent"
                        raise WorkerError(f"{line} ({why})", 1)
                    relaunched += 1
                    attempts[index] += 1
                    print(f"replica group {index} failed ({line}); relaunched ({relaunched} of "
                          f"trainer.max_restarts={budget}): it joins the others at a coming step", flush=True)
                    start(index, attempts[index])
        finally:
            for p in (p for procs in running.values() for p in procs):
                p.kill()  # SIGKILL where it still runs (a process the fork server reaped meanwhile is left)
                p.join()
            server.shutdown()
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def _error_line(errors: Path, rank: int, status: int, who: str) -> str:
    for kind in ("error", "fault"):
        path = errors / f"rank{rank}.{kind}"
        if path.exists():
            line = path.read_text()
            path.unlink()
            return line
    how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
    return f"{who}: {how}"


def _worker(worker, cfg: dict, run_dir: str, env: str, errors: str, launcher: dict) -> None:
    """A replica group's process: the pipeline's worker, which :func:`join` makes this group's."""
    _, index, groups, attempt, _, rank, size = env.split()
    # RANK names its error file; the restart count, the attempt (the fault-injection hook's first attempt); the
    # processes of the machine: every group's (the CPU threads divide among them), a group's one device each
    global_rank = str(int(index) * int(size) + int(rank))
    os.environ.update({ENV: env, "RANK": global_rank, "TORCHELASTIC_RESTART_COUNT": attempt,
                       "LOCAL_RANK": global_rank, "LOCAL_WORLD_SIZE": str(int(groups) * int(size))})
    try:
        _worker_entry(worker, cfg, run_dir, errors, launcher)
    finally:
        if current() is not None:
            current().group.shutdown()




# -- a worker's steps -----------------------------------------------------------------------------------------

class ManagedSteps:
    """A replica group's steps under torchft's manager, for :class:`harness.Loop`.

    Every step begins with the manager's quorum, where a group that is behind (a relaunched or late one, or one
    whose last commit failed) takes a peer's state, and is numbered by the steps the job has committed: the
    schedule is set to it, and the loop takes that step's data. ``optimizer.step()`` becomes
    :meth:`FaultTolerant.step <slamb.integrations.torchft.FaultTolerant.step>`: a step that does not commit
    changed nothing, and is taken again, on the same data, by the groups of the next quorum. With a logged
    period's last step (an epoch's, or ``log_every`` steps') the groups also sum the period's training totals and
    average the model (its floating-point buffers, and its parameters where the optimizer's replicas differ): the
    run's model for evaluation and export, valid where the step committed. ``period``: the steps of a logged
    period; ``total``: the run's.
    """

    def __init__(self, replica: Replica, model, optimizer, scheduler, *, heal: str, period: int, total: int):
        from slamb.integrations.torchft import FaultTolerant

        self.replica, self.scheduler, self.period, self.total = replica, scheduler, period, total
        self.model, self.optimizer = unwrap(model), optimizer
        self.ft = FaultTolerant(replica.group, model, optimizer, heal=heal)
        def step(*args, **kwargs):  # the pipeline's step, through the manager
            self._step()

        # what torch's LR scheduler marks a step it wraps with: FaultTolerant calls that wrapped step
        step._wrapped_by_lr_sched = True
        optimizer.step = step
        self.started = False  # the first quorum asked for
        self.quorum = False  # a quorum started for a step not taken yet
        self.committed = False  # whether the last step taken committed
        self.totals: torch.Tensor | None = None
        self.pending = None  # the period's last step's collectives, run before its commit
        self.average: list[torch.Tensor] | None = None  # the run's model, as of the period's last step
        self.writer = False  # this group writes the period's line: the first of the quorum that committed it
        self.clip_grad: float | None = None  # the step's clipping, after a data-parallel optimizer's average

    @property
    def done(self) -> int:
        return self.ft.committed_steps

    def _quorum(self) -> int:
        if not self.quorum:
            if not self.started:
                self.replica.before_first_quorum()
                self.started = True
            self.ft.start_step()
            self.quorum = True
        return self.done

    def periods(self):
        """(first, end): the steps of each logged period (``period`` steps, the run's last one shorter) this group
        takes part in, from where the job stands (a joining group skips the others')."""
        while (self.quorum or self.done < self.total) and self._quorum() < self.total:  # no quorum past the end
            if self.replica.attempt and not self.done and self.replica.group.size() == 1:
                # relaunched, and alone at step 0: the groups it was to rejoin have finished (a relaunch that came
                # up after the run's last step) or are gone; trained alone from scratch, it would write a second
                # run's lines and summary over theirs
                if self.replica.rank == 0:
                    print(f"notice: replica group {self.replica.index} was relaunched and found no group to rejoin "
                          "(the others have finished): it ends without training", flush=True)
                return
            first = self.done // self.period * self.period
            yield first, min(first + self.period, self.total)

    def steps(self, first: int, total: int, totals: torch.Tensor | None):
        """The steps of the period whose first step is ``first``: for each attempt, the step's number (0-based, in
        the run); ``totals`` (the period's training sums) is put back after an attempt that did not commit."""
        self.totals, self.average, self.writer = totals, None, False
        end = first + total
        while not (self.committed and self.done == end):
            step = self._quorum()
            if not first <= step < end:  # took a peer's state from past this period
                break
            self.quorum, self.committed = False, False
            lr = [base * f(step) for base, f in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
            for group, value in zip(self.optimizer.param_groups, lr):
                group["lr"] = value
            self.scheduler.last_epoch, self.scheduler._last_lr = step, lr
            before = totals.clone() if totals is not None else None
            self.pending = self._sum_period if step == end - 1 else None
            yield step
            if not self.committed and totals is not None:
                totals.copy_(before)
        self.committed = False

    def _step(self) -> None:
        self.committed = self.ft.step(before_commit=self.pending, clip_grad=self.clip_grad)
        if self.committed and self.pending is not None:
            self.writer = self.replica.group.rank() == 0 and self.replica.rank == 0
            if self.totals is not None:
                self.totals.copy_(self._summed)
        elif self.pending is not None:
            self.average = None

    def _model_tensors(self) -> list[torch.Tensor]:
        """This worker's part of the run's model: its shards of a sharded model's parameters (an evaluation's
        forward leaves the root's gathered: resharded first)."""
        reshard(self.model)
        params = list(self.model.parameters()) if self.optimizer.params_differ else []
        return [local(t).detach() for t in params] + [b for b in self.model.buffers() if b.is_floating_point()]

    @torch.no_grad()
    def _sum_period(self) -> None:
        group = self.replica.group
        self.average = [t.clone() for t in self._model_tensors()]
        average_tensors_(self.average, process_group=group)  # as slamb.averaged_model averages over ranks
        if self.totals is not None:
            self._summed = self.totals.clone()
            if self.replica.size > 1:  # the group's workers' sums first, over the group's own process group
                comm.all_reduce_sum_(self._summed, kind="eval", ledger=None)
            comm.all_reduce_sum_(self._summed, kind="eval", ledger=None, group=group)

    @contextlib.contextmanager
    def averaged(self):
        """The body sees the run's model (the groups' average of the period's last step); this group's own after."""
        tensors = self._model_tensors()
        saved = [t.clone() for t in tensors]
        _copy(tensors, self.average)
        try:
            yield
        finally:
            reshard(self.model)  # the root's gathered parameters, the average's: the next forward gathers these
            _copy(tensors, saved)

    def keep_average(self) -> None:
        """The model becomes the run's model, for its export at the end."""
        _copy(self._model_tensors(), self.average)


def _copy(into: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    if into:  # none where the replicas' parameters agree and the model has no floating-point buffer (BERT's)
        torch._foreach_copy_(into, values)
