"""Replica groups that die and rejoin a running torchft job, on the CPU: the job runner of the fault tests and
of the heal-policy measurement.

    python -m bench.fault_tolerance --policies        # the heal policies compared (digits MLP), a table on stdout
    python -m bench.fault_tolerance --undo-cost resnet110   # the commit-safe step against the plain one
    python -m bench.fault_tolerance --page            # results/fault_tolerance.md and .json (about 25 minutes)

:func:`run_job` starts a lighthouse and one process per replica group (forks of a fork server that imported
this module: no interpreter start per replica), each training the same model under :class:`slamb.integrations.torchft.FaultTolerant`;
:class:`Fault` kills a replica's process with SIGKILL at a chosen point (in a step's collective, in a
parameter sync, as it sends its state to a joining replica), and the runner relaunches it, as a job
scheduler would. Each replica writes a line per step it tried (``replica<i>.jsonl``: the step, the loss,
whether it committed, the quorum's size, the committed steps it held before the quorum, the states it received
so far, the ledger's bytes of the step by kind) and, at the end, its
parameters and ledger (``replica<i>.pt``).

Tasks: ``tiny`` (a 2-layer MLP on a synthetic teacher's labels, the tests') and ``digits`` (a 2-layer MLP
on scikit-learn's 8x8 digits, 1,500 training and 297 test images: the heal-policy measurement; the
digits/ResNet-8 recipe's forward and backward take 0.25 s per replica and step on one thread, which would
add about half an hour of compute on 2 shared cores to the comparison's 20 minutes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from harness.distributed import forkserver
from harness.replica import group_store
from slamb.comm import HEAL

KILLED = -signal.SIGKILL
WHERE = ("step", "sync", "send")  # the collective of the step, SLAMB's parameter sync, sending a joining replica's state


@dataclasses.dataclass(frozen=True)
class Fault:
    """Replica ``replica`` (-1: whichever gets there first, in any attempt) dies by SIGKILL during step ``step`` ``where``
    (:data:`WHERE`: SLAMB's momentum exchange or a data-parallel optimizer's gradient all-reduce; SLAMB's
    parameter sync; or, any step from ``step`` on, as it sends its state to a joining replica), in its
    ``attempt``-th process; ``relaunch``: whether the runner starts it again. ``rank``: which process of the
    replica group dies (the others of the group are killed by the runner, as a job scheduler ends a group
    that lost a process)."""
    replica: int
    step: int
    where: str = "step"
    attempt: int = 0
    relaunch: bool = True
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class Job:
    optimizer: str = "slamb"  # slamb | lamb | adamw
    heal: str = "peer"
    replicas: int = 3
    group_size: int = 1  # processes per replica group, which shard its model (FSDP2 on the group's 1-D mesh)
    steps: int = 13
    sync_interval: int = 4
    variant: str = "v1"
    task: str = "tiny"  # tiny | digits
    seed: int = 0
    batch: int = 32
    lr: float = 0.02
    faults: tuple[Fault, ...] = ()
    late: tuple[tuple[int, int], ...] = ()  # (replica, committed steps of the others before it starts)
    relaunch_after: int = 2  # steps the others commit between a replica's death and its relaunch
    timeout: float = 10.0  # seconds a collective, commit or heal may take
    heartbeat_ms: int = 1500  # the lighthouse drops a replica silent this long
    join_ms: int = 3000  # how long a quorum waits for a replica that is up but has not asked to join

    def __post_init__(self):
        for f in self.faults:
            if f.where not in WHERE:
                raise ValueError(f"invalid Fault.where={f.where!r}: must be one of {WHERE}")
            if not 0 <= f.rank < self.group_size:
                raise ValueError(f"invalid Fault.rank={f.rank}: a replica group has ranks 0 .. {self.group_size - 1}")
        if self.group_size > 1 and self.optimizer == "adamw":
            raise ValueError("invalid Job.optimizer='adamw' with group_size > 1: SLAMB and LAMB take sharded parameters")


# -- the task ---------------------------------------------------------------------------------------------

def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.data).float() / 16.0
    y = torch.from_numpy(d.target).long()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    test, train = order[:297], order[297:]
    return (x[train], y[train]), (x[test], y[test])


class Task:
    def __init__(self, job: Job):
        self.job = job
        if job.task == "digits":
            self.train, self.test = _digits()
            dims = (64, 128, 10)
        else:
            g = torch.Generator().manual_seed(99)
            self.teacher = torch.randn(32, 4, generator=g)
            dims = (32, 64, 4)
        torch.manual_seed(job.seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.ReLU(),
                                         torch.nn.Linear(dims[1], dims[2]))

    def batch(self, step: int, replica: int):
        """The batch of ``step`` on ``replica``: a function of (seed, step, replica) only."""
        g = torch.Generator().manual_seed(self.job.seed * 1_000_003 + step * 101 + replica)
        if self.job.task == "digits":
            x, y = self.train
            idx = torch.randint(len(x), (self.job.batch,), generator=g)
            return x[idx], y[idx]
        x = torch.randn(self.job.batch, 32, generator=g)
        return x, (x @ self.teacher).argmax(1)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The test loss and accuracy of this replica's model (digits; nothing for the synthetic task)."""
        if self.job.task != "digits":
            return {}
        x, y = self.test
        out = self.model(x)
        return {"test_loss": float(F.cross_entropy(out, y)), "accuracy": float((out.argmax(1) == y).float().mean())}


def make_optimizer(job: Job, params, group):
    import slamb

    if job.optimizer == "slamb":
        return slamb.SLAMB(params, lr=job.lr, weight_decay=0.01, compress_ratio=0.1, variant=job.variant,
                           sync_interval=job.sync_interval, min_compress_numel=1000, seed=job.seed,
                           process_group=group)
    if job.optimizer == "lamb":
        return slamb.LAMB(params, lr=job.lr, weight_decay=0.01)
    if job.optimizer == "adamw":
        return slamb.adopt(torch.optim.AdamW(params, lr=job.lr / 10, weight_decay=0.01))
    raise ValueError(f"invalid optimizer={job.optimizer!r}: must be slamb, lamb or adamw")


# -- a replica's process ------------------------------------------------------------------------------------

def _replica(index: int, attempt: int, rank: int, address: str, job: Job, out: Path) -> None:
    import slamb
    from slamb.ddp import full_state_dict, reshard
    from slamb.integrations.torchft import FaultTolerant, ManagedGroup, connect
    from slamb.sharding import local

    faults = [f for f in job.faults if f.rank == rank and (f.replica == -1 or (f.replica == index and
                                                                               f.attempt == attempt))]
    state = {}  # the model's size (this rank's shards of it), once it is built

    def die(where: str, step: int) -> bool:
        for f in faults:
            if f.where == where and (step == f.step or (where == "send" and step >= f.step)):
                if f.replica == -1:  # the first replica to get there; the others go on
                    try:
                        os.close(os.open(out / f"fault-{job.faults.index(f)}", os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        continue
                return True
        return False

    class Dying(ManagedGroup):
        def all_reduce(self, tensor, op, async_op=False):
            # SLAMB's exchange is its step's one asynchronous all-reduce; its parameter sync, like a
            # data-parallel optimizer's gradient all-reduce, carries the whole model
            whole = tensor.numel() == state["numel"]
            at = "step" if (async_op if job.optimizer == "slamb" else whole) else "sync" if whole else None
            if at is not None and die(at, self.manager.current_step() + 1):
                os.kill(os.getpid(), signal.SIGKILL)  # in the collective, before its bytes leave: no peer completes it
            return super().all_reduce(tensor, op, async_op)

    class Sending(FaultTolerant):
        def _state(self):
            if die("send", self.committed_steps + 1):
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._state()

    torch.set_num_threads(1)
    store = group_store(index, attempt, rank, job.group_size, out, job.timeout)
    g = connect(address, replica_id=str(index), rank=rank, world_size=job.group_size, store=store,
                timeout=job.timeout, host="127.0.0.1", init_sync=False)
    group = Dying(g.manager, g.pg, g.transport, g.store, process=g.process, processes=g.processes)
    first = [r for r in range(job.replicas) if r not in dict(job.late)]
    if attempt == 0 and index in first and rank == 0:  # the first quorum holds every replica that starts with the job
        (out / f"up{index}").touch()
        while not all((out / f"up{r}").exists() for r in first):
            time.sleep(0.01)
    task = Task(job)
    model = task.model
    if job.group_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        slamb.shard_model(model, init_device_mesh("cpu", (job.group_size,)))
    state["numel"] = sum(local(p).numel() for p in model.parameters())
    opt = make_optimizer(job, model.parameters(), group)
    if job.group_size > 1:
        model = slamb.wrap_model(model, opt)  # FSDP's reduce-scatter inside the group, and the ledger's record of it
    ft = Sending(group, model, opt, heal=job.heal)

    def evaluate() -> dict:
        metrics = task.evaluate()
        reshard(model)  # an evaluation's forward leaves a sharded model's root gathered
        return metrics

    name = f"replica{index}" if rank == 0 else f"replica{index}.rank{rank}"
    with open(out / f"{name}.jsonl", "a") as log:
        while ft.committed_steps < job.steps:
            (out / f"joining{index}").unlink(missing_ok=True)  # at once it asks to join: the others go on
            # a replica the runner starts once the others committed this many steps joins at the next one
            while any(after <= ft.committed_steps for after in _joining(out)):
                time.sleep(0.01)
            began, held = time.time(), ft.committed_steps
            ft.start_step()
            t = ft.committed_steps + 1
            x, y = (part.chunk(job.group_size)[rank] for part in task.batch(t, index))  # this rank's share
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            committed = ft.step()
            opt.zero_grad()
            record = {"attempt": attempt, "step": t, "loss": float(loss.detach()), "committed": committed,
                      **(evaluate() if committed else {}),
                      "replicas": group.size(), "held": held, "began": began, "ended": time.time(),
                      "heals": ft.heals,
                      "bytes": {k: v["payload"] for k, v in opt.ledger.summary()["last_step"].items()}}
            log.write(json.dumps(record) + "\n")
            log.flush()
    end = {"model": full_state_dict(model), "ledger": opt.ledger.summary(), "heals": ft.heals,
           "steps": getattr(opt, "steps", None), "committed": ft.committed_steps, **evaluate(), "attempt": attempt}
    if rank == 0:
        torch.save(end, out / f"replica{index}.pt")
    group.shutdown()


def _joining(out: Path) -> list[int]:
    """The committed steps the replicas about to join wait for; a file its replica removed meanwhile (it asked to
    join) is no wait."""
    steps = []
    for f in out.glob("joining*"):
        try:
            steps.append(int(f.read_text() or 0))
        except FileNotFoundError:
            pass
    return steps


def _child(target, args, log: Path) -> None:
    """A forked process's body: its output to ``log``, its end by ``os._exit`` (the parent's exit handlers,
    a test runner's among them, are not its own)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 0
    try:
        target(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _lighthouse(job: Job, out: Path) -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=job.join_ms,
                              heartbeat_timeout_ms=job.heartbeat_ms)
    (out / "lighthouse.tmp").write_text(server.address())
    os.replace(out / "lighthouse.tmp", out / "lighthouse")
    while True:
        time.sleep(3600)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_job(job: Job, out: Path, limit: float = 120.0) -> dict:
    """Run ``job`` in ``out``; returns per replica its step log and its end state (see the module's doc).

    Raises if a replica fails other than by an injected fault, or the job outlasts ``limit`` seconds."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # forks of a fork server that imported this module, never of the caller: a caller that ran autograd cannot be
    # forked, and spawning would import torch and torchft again for every replica
    # (the step's first call imports torch._dynamo: once there, not in every replica)
    fork = multiprocessing.get_context(forkserver(__name__, "slamb.integrations.torchft", "torch._dynamo"))
    started: list = []

    def start(target, args, name):
        p = fork.Process(target=_child, args=(target, args, out / f"{name}.log"), daemon=True)
        p.start()
        started.append(p)
        return p

    try:
        start(_lighthouse, (job, out), "lighthouse")
        deadline = time.time() + limit
        while not (out / "lighthouse").exists():
            if time.time() > deadline or not started[0].is_alive():
                raise RuntimeError(f"the lighthouse did not start: {(out / 'lighthouse.log').read_text()}")
            time.sleep(0.02)
        address = (out / "lighthouse").read_text()
        waiting = {}  # replica -> the others' committed steps before it starts
        attempts = {r: 0 for r in range(job.replicas)}
        running: dict[int, list] = {}  # replica group -> its processes

        def launch(r):
            running[r] = [start(_replica, (r, attempts[r], k, address, job, out), f"replica{r}.{attempts[r]}"
                                + (f".rank{k}" if k else "")) for k in range(job.group_size)]

        def later(r, after):
            waiting[r] = after
            (out / f"joining{r}").write_text(str(after))

        def committed(r) -> int:
            return max((e["step"] for e in read_log(out / f"replica{r}.jsonl") if e["committed"]), default=0)

        for r, after in job.late:
            later(r, after)
        for r in range(job.replicas):
            if r not in waiting:
                launch(r)
        while any(not (out / f"replica{r}.pt").exists() for r in range(job.replicas)):
            if time.time() > deadline:
                raise TimeoutError(f"the job outlasted {limit} s: " + "; ".join(
                    f"replica {r}: {read_log(out / f'replica{r}.jsonl')[-1:]}" for r in range(job.replicas)))
            for r, procs in list(running.items()):
                codes = [p.exitcode for p in procs]
                if all(c in (None, 0) for c in codes) or (out / f"replica{r}.pt").exists():
                    continue
                fault = [f for f in job.faults if f.replica == -1 or (f.replica == r and f.attempt == attempts[r])]
                killed = [k for k, c in enumerate(codes) if c == KILLED and any(f.rank == k for f in fault)]
                if not killed:
                    k = next(k for k, c in enumerate(codes) if c not in (None, 0))
                    log = out / (f"replica{r}.{attempts[r]}" + (f".rank{k}" if k else "") + ".log")
                    raise RuntimeError(f"replica {r} (attempt {attempts[r]}, rank {k}) exited with {codes[k]}:\n"
                                       + log.read_text()[-4000:])
                for p in procs:  # the group's other processes go with it, as a scheduler ends the group
                    p.kill()  # (not os.kill: the fork server may have reaped it since its exit code was read)
                    p.join()
                del running[r]
                attempts[r] += 1
                if any(f.relaunch for f in fault):  # as a scheduler would, once the others went on without it
                    later(r, max(map(committed, running), default=0) + job.relaunch_after)
                else:
                    (out / f"replica{r}.pt").touch()
            for r, after in list(waiting.items()):
                if running and max(map(committed, running)) >= after:
                    del waiting[r]
                    launch(r)
            time.sleep(0.05)
        for procs in running.values():
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.time()))
    finally:
        for p in started:
            p.kill()  # SIGKILL where it still runs (a process the fork server reaped meanwhile is left)
            p.join()
    results = {}
    for r in range(job.replicas):
        path = out / f"replica{r}.pt"
        results[r] = {"log": read_log(out / f"replica{r}.jsonl"),  # rank 0's; "ranks": every rank's
                      "ranks": [read_log(out / (f"replica{r}.rank{k}.jsonl" if k else f"replica{r}.jsonl"))
                                for k in range(job.group_size)],
                      "end": torch.load(path, weights_only=False) if path.stat().st_size else None}
    return results


# -- the cost of the commit-safe step ---------------------------------------------------------------------

def undo_cost(shapes, steps: int = 20, fused: bool = False) -> dict:
    """SLAMB's commit-safe step (:class:`slamb.integrations.torchft.Undo`'s copy, then the step) against its
    plain step, paired: one optimizer in one process takes them in turn, so both see the same state and the
    same machine; the median over the pairs of their ratio. Also the restore (taken after a failed commit
    only) and the copy's bytes against the optimizer's own (parameters, gradients, state, scratch)."""
    import slamb
    from bench.memory import counted_bytes
    from bench.optimizer_step import _model_params, _timed
    from slamb.integrations.torchft import Undo

    cpu = torch.device("cpu")
    params = _model_params(shapes, cpu)
    opt = slamb.SLAMB(params, lr=1e-3, weight_decay=0.01, sync_interval=10**9, fused=fused)
    opt.fix_layout()
    undo = Undo(opt)

    def safe():
        undo.take()
        opt.step()

    for _ in range(3):
        safe()
        opt.step()
    plain_s, safe_s, restore_s = [], [], []
    for i in range(steps):
        order = (("plain", opt.step), ("safe", safe)) if i % 2 else (("safe", safe), ("plain", opt.step))
        for name, fn in order:
            (plain_s if name == "plain" else safe_s).append(_timed(fn, cpu))
        restore_s.append(_timed(undo.restore, cpu))
    numel = sum(p.numel() for p in params)
    counted = counted_bytes(opt, params)
    own = counted["state"] + counted["scratch"] + 2 * 4 * numel  # and the parameters and their gradients
    return {"numel": numel, "plain_ms": 1e3 * statistics.median(plain_s), "safe_ms": 1e3 * statistics.median(safe_s),
            "ratio": statistics.median(s / p for s, p in zip(safe_s, plain_s)),
            "restore_ms": 1e3 * statistics.median(restore_s), "copy_bytes": undo.nbytes(), "own_bytes": own}


# -- the heal policies compared ----------------------------------------------------------------------------

def policy_row(job: Job, out: Path) -> dict:
    """One job: the final test accuracy and loss (every replica holds the same parameters after the last step, a
    sync) and, with a replica killed at step ``k`` and relaunched, the join: ``excess``, how much higher the
    joining replica's test loss is than the others' over its first 10 steps (mean), and ``spike``, the highest
    test loss of any replica over those steps less the replicas' mean test loss at step ``k - 1``."""
    res = run_job(job, out, limit=1800.0)
    row = {"heal": job.heal if job.faults else "uninterrupted", "seed": job.seed,
           "accuracy": res[0]["end"]["accuracy"], "test_loss": res[0]["end"]["test_loss"],
           "heal_bytes": sum(e["bytes"].get(HEAL, 0) for q in res for e in res[q]["log"])}
    if not job.faults:
        return row
    kill, r = job.faults[0].step, job.faults[0].replica
    logs = {q: [e for e in res[q]["log"] if e["committed"]] for q in res}
    join = next(e["step"] for e in logs[r] if e["attempt"] > 0)
    window = range(join, join + 10)
    joiner = [e["test_loss"] for e in logs[r] if e["step"] in window]
    others = [e["test_loss"] for q in logs if q != r for e in logs[q] if e["step"] in window]
    before = statistics.mean(e["test_loss"] for q in logs for e in logs[q] if e["step"] == kill - 1)
    return {**row, "join": join, "excess": statistics.mean(joiner) - statistics.mean(others),
            "spike": max(joiner + others) - before}


def compare_policies(seeds=(0, 1, 2), steps: int = 301, kill: int = 125) -> list[dict]:
    """Each heal policy, and the uninterrupted run, per seed: a replica killed mid-interval between two
    parameter syncs (H = 50), so that the replicas' parameters differ when it joins."""
    from slamb.integrations.torchft import HEAL_POLICIES

    rows = []
    for heal in (None, *HEAL_POLICIES):
        for seed in seeds:
            job = Job(heal=heal or "peer", seed=seed, task="digits", steps=steps, sync_interval=50, variant="v2",
                      lr=0.01, faults=(Fault(replica=2, step=kill),) if heal else ())
            with tempfile.TemporaryDirectory() as out:
                rows.append(policy_row(job, Path(out)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def policy_table(rows: list[dict]) -> str:
    """Mean and sample standard deviation over the seeds, per row kind."""
    def pm(values, scale=1.0, digits=3):
        values = [scale * v for v in values]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"

    lines = ["| heal | final accuracy (%) | final test loss | joiner's excess test loss, first 10 steps | "
             "spike | heal bytes | seeds |", "|---|---|---|---|---|---|---|"]
    for heal in dict.fromkeys(r["heal"] for r in rows):
        group = [r for r in rows if r["heal"] == heal]
        joined = "excess" in group[0]
        lines.append(f"| {heal} | {pm([r['accuracy'] for r in group], 100, 1)} | "
                     f"{pm([r['test_loss'] for r in group])} | "
                     f"{pm([r['excess'] for r in group]) if joined else '-'} | "
                     f"{pm([r['spike'] for r in group]) if joined else '-'} | {group[0]['heal_bytes']:,} | "
                     f"{len(group)} |")
    return "\n".join(lines)


# -- the page: training through failures ---------------------------------------------------------------

# The page's job: the digits MLP, 3 replica groups, 301 steps; the parameters are averaged every 20 steps, and the
# accuracy is compared there, where every replica holds the average. Failures: a replica group killed in a step's
# collective at each of FAILURES, replicas 1 and 2 in turn, relaunched once the others committed 2 more steps.
PAGE_STEPS, PAGE_H, TARGET_MARGIN = 301, 20, 1.0
FAILURES = (60, 120, 180, 240)
CHECKPOINT_EVERY = 50  # the restart row's checkpoint interval


def page_job(optimizer: str, seed: int, failures: bool) -> Job:
    # replica 1 + i % 2's process of attempt i // 2: each failure kills the process then running
    faults = tuple(Fault(replica=1 + i % 2, step=s, attempt=i // 2) for i, s in enumerate(FAILURES))
    return Job(optimizer=optimizer, seed=seed, task="digits", steps=PAGE_STEPS, sync_interval=PAGE_H, variant="v2",
               lr=0.01, faults=faults if failures else ())


def page_row(job: Job, res: dict) -> dict:
    """What the page states of one job, from replica 0's log (never killed): the accuracy after each parameter
    sync and when it was reached, the time each failure cost it, and the healing bytes of the job."""
    log = res[0]["log"]
    began = log[0]["began"]
    committed = [e for e in log if e["committed"]]
    synced = [(e["step"], e["ended"] - began, e["accuracy"]) for e in committed
              if (e["step"] - 1) % job.sync_interval == 0]
    step_s = statistics.median(e["ended"] - e["began"] for e in committed)
    lost = []  # per failed step: from its start to the end of the next committed step, less one step's time
    for failed, nxt in zip(log, log[1:]):
        if not failed["committed"] and nxt["committed"]:
            lost.append(nxt["ended"] - failed["began"] - step_s)
    heals = sum(max(e["heals"] for e in v["log"] if e["attempt"] == a)
                for v in res.values() for a in {e["attempt"] for e in v["log"]})
    return {"optimizer": job.optimizer, "seed": job.seed, "failures": len(job.faults),
            "final_accuracy": res[0]["end"]["accuracy"], "wall_s": committed[-1]["ended"] - began,
            "step_s": step_s, "synced": synced, "uncommitted": sum(not e["committed"] for e in log),
            "lost_s": lost, "heals": heals, "heal_bytes": sum(e["bytes"].get("heal", 0) for v in res.values()
                                                              for e in v["log"]),
            "relaunch_s": _relaunch_seconds(res) if job.faults else []}


def _relaunch_seconds(res: dict) -> list[float]:
    """Per relaunched process: from its first step's start to the end of its first committed step (the join:
    the quorum that takes it in and the heal), the cost a whole-job restart pays on every replica."""
    out = []
    for v in res.values():
        for a in {e["attempt"] for e in v["log"]} - {0}:
            tries = [e for e in v["log"] if e["attempt"] == a]
            first = next((e for e in tries if e["committed"]), None)
            if first is not None:
                out.append(first["ended"] - tries[0]["began"])
    return out


def time_to(row: dict, target: float) -> float | None:
    return next((t for _, t, acc in row["synced"] if 100 * acc >= target), None)


def job_start_seconds(repeats: int = 3) -> float:
    """A start of the job after a failure, at least: a fresh interpreter importing what a replica runs (median
    of ``repeats``); a real restart adds its launcher, rendezvous and checkpoint load."""
    times = []
    for _ in range(repeats):
        t = time.time()
        subprocess.run([sys.executable, "-c", "import bench.fault_tolerance, slamb.integrations.torchft"],
                       cwd=Path(__file__).resolve().parents[1], check=True)
        times.append(time.time() - t)
    return statistics.median(times)


def restart_row(uninterrupted: dict, start_s: float, join_s: float) -> dict:
    """SLAMB restarted from its last checkpoint after each failure, as the harness does today: modelled from the
    uninterrupted run (a restart resumes it bit for bit, so the accuracy is the same) plus, per failure, the
    steps since the last checkpoint again, a start of the job and a relaunched replica's join (both measured)."""
    extra = [(s % CHECKPOINT_EVERY) * uninterrupted["step_s"] + start_s + join_s for s in FAILURES]

    def later(t):  # the failures before the uninterrupted run's time t add their cost
        return t + sum(x for s, x in zip(FAILURES, extra) if s * uninterrupted["step_s"] <= t)

    return {**uninterrupted, "optimizer": "slamb (restart)", "failures": len(FAILURES), "lost_s": [],
            "per_failure_s": statistics.mean(extra), "synced": [(s, later(t), acc) for s, t, acc in
                                                                 uninterrupted["synced"]],
            "wall_s": later(uninterrupted["wall_s"]), "heals": 0, "heal_bytes": 0, "uncommitted": 0}


def run_page(seeds=(0, 1, 2)) -> dict:
    started, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()[0]
    t0 = time.time()
    runs = []
    for optimizer, failures in (("lamb", False), ("slamb", False), ("lamb", True), ("slamb", True)):
        for seed in seeds:
            job = page_job(optimizer, seed, failures)
            with tempfile.TemporaryDirectory() as out:
                runs.append(page_row(job, run_job(job, Path(out), limit=1800.0)))
            print(json.dumps({k: runs[-1][k] for k in ("optimizer", "seed", "failures", "final_accuracy", "wall_s")}),
                  flush=True)
    for r in runs:  # the time a failure cost: the wall time over that of the same seed's run without failures
        if r["failures"]:
            base = next(b for b in runs if (b["optimizer"], b["seed"], b["failures"]) == (r["optimizer"], r["seed"], 0))
            r["per_failure_s"] = (r["wall_s"] - base["wall_s"]) / r["failures"]
    relaunch, start = statistics.median(x for r in runs for x in r["relaunch_s"]), job_start_seconds()
    runs += [restart_row(r, start, relaunch) for r in runs if r["optimizer"] == "slamb" and not r["failures"]]
    from bench.shapes import MODELS
    from harness.run import git_revision, hardware

    lamb = [r["final_accuracy"] for r in runs if r["optimizer"] == "lamb" and not r["failures"]]
    return {"command": "python -m bench.fault_tolerance --page", "started": started, "wall_s": time.time() - t0,
            "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)], "hardware": hardware(torch.device("cpu")),
            "revision": git_revision(), "torch": torch.__version__, "seeds": list(seeds),
            "target": 100 * statistics.mean(lamb) - TARGET_MARGIN, "relaunch_s": relaunch, "start_s": start,
            "runs": runs,
            "undo": undo_cost(MODELS["resnet110"]())}


def render_page(record: dict) -> str:
    def pm(values, digits=1):
        values = [v for v in values if v is not None]
        if not values:
            return "not reached"
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}" + (
            f" ({len(values)} of {len(record['seeds'])})" if len(values) < len(record["seeds"]) else "")

    names = {("lamb", 0): "LAMB, no failure", ("slamb", 0): "SLAMB, no failure",
             ("lamb", 1): "LAMB under torchft", ("slamb", 1): "SLAMB under torchft",
             ("slamb (restart)", 1): "SLAMB, restart from a checkpoint (modelled)"}
    rev = record["revision"]
    u = record["undo"]
    lines = ["# Training through failures: SLAMB and LAMB under torchft", "",
             f"Written by `{record['command']}` on {record['started']} at commit {rev['commit'][:12]}"
             f"{' (with uncommitted changes)' if rev['dirty'] else ''}, torch {record['torch']}, on "
             f"{record['hardware']} ({record['wall_s'] / 60:.1f} min; 1-minute load average "
             f"{record['load_avg'][0]} at the start, {record['load_avg'][1]} at the end). Every number is computed "
             "from the runs in `fault_tolerance.json`.", "",
             "## Set-up", "",
             f"- 3 replica groups of one gloo process each under torchft ({record['torch']}; torchft's lighthouse, "
             "`slamb.integrations.torchft`, heal policy `peer`), all on this machine's cores.",
             f"- A 2-layer MLP (64-128-10) on scikit-learn's 8x8 digits (1,500 training, 297 test images), 32 images "
             f"per replica and step, {PAGE_STEPS} steps, lr 0.01; SLAMB v2 (k 0.1, beta3 0.99), the parameters "
             f"averaged every H = {PAGE_H} steps; LAMB all-reduces its gradients every step.",
             f"- Failures: a replica group killed by SIGKILL inside a step's collective at steps "
             f"{', '.join(map(str, FAILURES))}, replicas 1 and 2 in turn, relaunched once the others have "
             "committed 2 more steps, as a scheduler would; it heals from a peer and joins the next quorum.",
             f"- The accuracy is that of replica 0 (never killed) after each parameter sync, where every replica "
             f"holds the average. Target: LAMB's final accuracy without failures less {TARGET_MARGIN:g} point = "
             f"**{record['target']:.2f}%**. Time: wall seconds from the first step, evaluations included.",
             f"- The restart row is modelled, not run: the uninterrupted SLAMB runs plus, per failure, the steps since "
             f"the last checkpoint (every {CHECKPOINT_EVERY} steps) again, a start of the job (a fresh interpreter "
             f"importing what a replica runs: {record['start_s']:.1f} s, a lower bound: no launcher, rendezvous "
             f"or checkpoint load) and a relaunched replica's join (median {record['relaunch_s']:.2f} s). A "
             "restart resumes bit for bit (tests/test_harness.py), so its accuracy is the uninterrupted one's.",
             "- Time lost per failure: the wall time over that of the same seed's run without failures, per "
             "failure. Survivors' recovery: on replica 0, from the start of a step that did not commit to the end "
             "of the next one that did, less one step's time (median over the failures and seeds).",
             f"- Seeds {', '.join(map(str, record['seeds']))} for every row; mean ± sample standard deviation.", "",
             "## Results", "",
             "| run | final accuracy (%) | time to target (s) | wall time (s) | failures | time lost per failure (s) "
             "| survivors' recovery (s) | steps not committed | heals | healing bytes per heal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, name in names.items():
        rows = [r for r in record["runs"] if r["optimizer"] == key[0] and bool(r["failures"]) == bool(key[1])]
        if not rows:
            continue
        lost = [x for r in rows for x in r["lost_s"]]
        heals = sum(r["heals"] for r in rows)
        per_heal = f"{sum(r['heal_bytes'] for r in rows) // heals:,}" if heals else "-"
        lines.append(f"| {name} | {pm([100 * r['final_accuracy'] for r in rows], 2)} | "
                     f"{pm([time_to(r, record['target']) for r in rows])} | {pm([r['wall_s'] for r in rows])} | "
                     f"{rows[0]['failures']} | "
                     f"{pm([r['per_failure_s'] for r in rows]) if rows[0]['failures'] else '-'} | "
                     f"{f'{statistics.median(lost):.2f}' if lost else '-'} | "
                     f"{pm([r['uncommitted'] for r in rows])} | {heals / len(rows):.1f} per run | {per_heal} |")
    lines += ["", "## The commit-safe step", "",
              f"SLAMB's step under torchft first copies what a step changes (parameters, m, v, ages) so that a step "
              f"whose commit fails is undone on every survivor. ResNet-110's shapes ({u['numel']:,} parameters, "
              f"one process, paired against the plain step): {u['plain_ms']:.1f} ms plain, {u['safe_ms']:.1f} ms "
              f"with the copy (median ratio {u['ratio']:.2f}x), restore {u['restore_ms']:.1f} ms; the copy holds "
              f"{u['copy_bytes']:,} bytes against the optimizer's own {u['own_bytes']:,}.", "",
              "## What changes at scale", "",
              "A heal sends the parameters, m and v in fp32 and SLAMB's staleness ages in int16, 14 bytes per "
              "parameter, whatever the number of replicas (the healing bytes above per heal, over the MLP's "
              "parameters). A failure costs the survivors the failed step and the next quorum, not the steps since "
              "a checkpoint and a start of the whole job; the more replicas, the more often one fails, so the "
              "restart row's loss grows with the job while the survivors' does not. Not run here: groups of more "
              "than one process, NCCL, a model of more than a few thousand parameters, more than 3 replicas."]
    return "\n".join(lines) + "\n"


def write_page(record: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "fault_tolerance.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "fault_tolerance.md").write_text(render_page(record))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", action="store_true", help="compare the heal policies (digits MLP)")
    parser.add_argument("--undo-cost", nargs="*", metavar="MODEL",
                        help="the commit-safe step against the plain one (bench.shapes models; default resnet110)")
    parser.add_argument("--page", action="store_true", help="results/fault_tolerance.md and .json")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.page:
        write_page(run_page(seeds=tuple(range(args.seeds))), args.out)
    if args.policies:
        print(policy_table(compare_policies(seeds=tuple(range(args.seeds)))))
    if args.undo_cost is not None:
        from bench.shapes import MODELS

        torch.set_num_threads(1)
        for model in args.undo_cost or ["resnet110"]:
            print(json.dumps({"model": model, **undo_cost(MODELS[model]())}), flush=True)


if __name__ == "__main__":
    main()
