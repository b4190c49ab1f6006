"""SLAMB, LAMB and AdamW under torchft on the CPU: replica groups killed with SIGKILL in a step's collective, in a
parameter sync and while sending their state, relaunched, joining late; a lighthouse and one or two gloo processes
per replica group (two shard the group's model with FSDP2), started by the tests
(:func:`bench.fault_tolerance.run_job`)."""
from __future__ import annotations

import itertools
import statistics

import pytest
import torch

import slamb
from bench.fault_tolerance import (Fault, Job, Task, make_optimizer, page_row, render_page, run_job, time_to,
                                   undo_cost)
from slamb.integrations.torchft import FaultTolerant, ManagedGroup, Undo

# the tests' model (bench.fault_tolerance.Task, "tiny"): Linear(32, 64), ReLU, Linear(64, 4)
PARAMS = 32 * 64 + 64 + 64 * 4 + 4
DENSE = 64 + 64 * 4 + 4  # always averaged: the biases, and the second weight (under min_compress_numel=1000)


def sampled_bytes(job: Job) -> dict[int, int]:
    """Per step, the bytes of the sampled momentum entries SLAMB's mask draws from (seed, step): those of one
    process stepping alone, whose masks are the replicas'."""
    task = Task(job)
    opt = make_optimizer(job, task.model.parameters(), None)
    out = {}
    for t in range(1, job.steps + 1):
        x, y = task.batch(t, 0)
        torch.nn.functional.cross_entropy(task.model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out[t] = 4 * (int(opt.last_sync_mask().sum()) - DENSE)
    return out


def run(job: Job, tmp_path) -> dict:
    res = run_job(job, tmp_path, limit=120.0)
    check_common(job, res)
    return res


def check_common(job: Job, res: dict) -> None:
    # the replicas agree to the bit at the end: the last step is a parameter sync (data-parallel: every step)
    models = [res[r]["end"]["model"] for r in res]
    for m in models[1:]:
        assert all(torch.equal(m[k], models[0][k]) for k in m)
    for r, v in res.items():
        # SLAMB draws its masks from its step count: the committed steps on every replica
        assert v["end"]["committed"] == job.steps and v["end"]["steps"] in (job.steps, None)
        log = v["log"]
        for attempt in sorted({e["attempt"] for e in log}):
            steps = [e["step"] for e in log if e["attempt"] == attempt and e["committed"]]
            # an attempt's committed steps follow each other, a relaunched one's from where the others were
            assert steps == list(range(steps[0], steps[0] + len(steps))), (r, attempt, steps)
        assert [e["step"] for e in log if e["committed"]][-1] == job.steps
        for other in v["ranks"][1:]:  # a group's processes commit together, or not at all
            assert [(e["attempt"], e["step"]) for e in other if e["committed"]] == \
                [(e["attempt"], e["step"]) for e in log if e["committed"]], r
        for failed, retry in zip(log, log[1:]):
            if not failed["committed"] and retry["attempt"] == failed["attempt"]:
                # a failed step is seen at once and the next one commits without waiting out a timeout
                assert retry["ended"] - failed["began"] < job.timeout, (r, failed, retry)


def survivor(res, r, steps) -> list[dict]:
    """A replica never killed: every step committed once, in order, with a finite loss."""
    log = [e for e in res[r]["log"] if e["committed"]]
    assert [e["step"] for e in log] == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in log)
    return log


def heals(res, state_bytes: int, group_size: int = 1) -> int:
    """The states received over every process of every group (each process of a group of two receives its own
    shards), checked against what torchft heals for: each heal took a process that lagged the step's quorum (it
    held fewer committed steps than the quorum's), which a loaded machine may cause beyond the faults (a replica
    late to a quorum heals at the next), and the senders recorded ``state_bytes`` per heal as kind "heal". A
    replica of one process never gives up a step it held: a step it healed at and that did not commit leaves it
    healed, not to be sent the same state again."""
    count = 0
    for log in (log for v in res.values() for log in v["ranks"]):
        for attempt in sorted({e["attempt"] for e in log}):
            tries = [e for e in log if e["attempt"] == attempt]
            received = 0
            for e in tries:
                if e["heals"] > received:
                    assert e["heals"] == received + 1 and e["held"] < e["step"] - 1, ("a heal without a lag", e)
                    received = e["heals"]
            if group_size == 1:
                held = [e["held"] for e in tries]
                assert held == sorted(held), ("a step given up, to be healed again", tries)
            count += received
    sent = sum(e["bytes"].get("heal", 0) for v in res.values() for log in v["ranks"] for e in log)
    assert sent == count * state_bytes
    return count


def first_heal(res, r, attempt) -> int:
    """The states replica group ``r``'s ``attempt``-th start received by its first committed step."""
    return next(e["heals"] for e in res[r]["log"] if e["attempt"] == attempt and e["committed"])


def group_bytes(res, r) -> dict[int, dict]:
    """Per step group ``r`` committed, the ledger's bytes by kind summed over its processes."""
    steps = {}
    for log in res[r]["ranks"]:
        for e in log:
            if e["committed"]:
                mine = steps.setdefault(e["step"], {})
                for k, b in e["bytes"].items():
                    mine[k] = mine.get(k, 0) + b
    return steps


@pytest.mark.multiprocess
def test_replicas_start_from_a_caller_that_ran_a_compiled_backward(tmp_path):
    # a compiled backward starts autograd's device threads, after which a fork of the caller cannot run
    # backward: the replicas must not be forks of the caller (the test suite's process has done both)
    x = torch.ones(3, requires_grad=True)
    torch.compile(lambda t: (t * 2).sum())(x).backward()
    run(Job(steps=3, sync_interval=2, replicas=2), tmp_path)


@pytest.mark.multiprocess
def test_slamb_survives_a_kill_in_the_exchange_and_in_a_sync_with_a_late_joiner(tmp_path):
    job = Job(steps=17, sync_interval=4, late=((2, 2),),
              faults=(Fault(replica=2, step=5, where="step"), Fault(replica=1, step=13, where="sync")))
    res = run(job, tmp_path)
    log = survivor(res, 0, job.steps)
    sampled = sampled_bytes(job)
    # replica 2 joins late; each kill, the others go on without the killed replica until it is back
    runs = [(n, len(list(g))) for n, g in itertools.groupby(e["replicas"] for e in log)]
    assert [n for n, _ in runs] == [2, 3, 2, 3, 2, 3], runs
    assert runs[2][1] >= job.relaunch_after and runs[4][1] >= job.relaunch_after, runs
    for e in log:  # the ledger's bytes of each committed step, by kind
        b = e["bytes"]
        assert (b["control"], b["momentum_dense"], b["momentum"]) == (4, 4 * DENSE, sampled[e["step"]])
        assert b.get("params", 0) == (4 * PARAMS if (e["step"] - 1) % job.sync_interval == 0 else 0)
    # parameters, m, v (fp32) and the ages (int16); the late replica, and each relaunched one, took a state
    assert heals(res, 4 * (PARAMS * 3 + PARAMS // 2)) >= 3
    assert first_heal(res, 2, 0) == first_heal(res, 2, 1) == first_heal(res, 1, 1) == 1


@pytest.mark.multiprocess
def test_slamb_survives_two_kills_at_once_and_a_kill_while_healing(tmp_path):
    job = Job(steps=17, sync_interval=4,
              faults=(Fault(replica=1, step=4), Fault(replica=2, step=4),  # replica 0 goes on alone
                      Fault(replica=2, step=10, attempt=1),
                      Fault(replica=-1, step=12, where="send")))  # the replica sending 2 its state dies
    res = run(job, tmp_path)
    alone = [e["step"] for e in res[0]["log"] if e["attempt"] == 0 and e["committed"] and e["replicas"] == 1]
    assert len(alone) >= job.relaunch_after and alone == list(range(alone[0], alone[0] + len(alone)))
    # the heal that failed: replica 2's third process got no state at its first try, and took it at the next
    third = [e for e in res[2]["log"] if e["attempt"] == 2]
    assert third[0]["heals"] == 0 and not third[0]["committed"] and third[1]["heals"] == 1
    heals(res, 4 * (PARAMS * 3 + PARAMS // 2))


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_data_parallel_optimizers_survive_a_kill_in_the_gradient_all_reduce(tmp_path, optimizer):
    job = Job(optimizer=optimizer, steps=8, late=((2, 2),), faults=(Fault(replica=1, step=4),))
    res = run(job, tmp_path)
    for e in survivor(res, 0, job.steps):
        assert e["bytes"]["grads"] == 4 * PARAMS and set(e["bytes"]) <= {"grads", "heal", "all"}
    # the parameters, m and v, and a 4-byte step count per tensor; the late replica and the relaunched one
    assert heals(res, 3 * 4 * PARAMS + 4 * 4) >= 2
    assert first_heal(res, 2, 0) == first_heal(res, 1, 1) == 1


@pytest.mark.multiprocess
def test_a_group_of_two_processes_sharding_its_model_trains_as_a_group_of_one(tmp_path):
    ends = {}
    for w in (1, 2):
        res = run(Job(group_size=w, steps=9, sync_interval=4), tmp_path / str(w))
        ends[w] = res[0]["end"]["model"]
    # FSDP's reduce-scatter averages the two halves of the group's batch; the masks are drawn over the whole model
    assert all(torch.allclose(ends[1][k], ends[2][k], rtol=0, atol=1e-5) for k in ends[1])
    assert not all(torch.equal(ends[1][k], ends[2][k]) for k in ends[1])  # two processes did run


@pytest.mark.multiprocess
def test_groups_of_two_survive_a_kill_of_either_process_in_the_exchange_and_in_a_sync(tmp_path):
    job = Job(group_size=2, steps=17, sync_interval=4, late=((2, 2),),
              faults=(Fault(replica=2, step=5, rank=1), Fault(replica=1, step=13, where="sync", rank=0)))
    res = run(job, tmp_path)
    log = survivor(res, 0, job.steps)
    runs = [(n, len(list(g))) for n, g in itertools.groupby(e["replicas"] for e in log)]
    assert [n for n, _ in runs] == [2, 3, 2, 3, 2, 3], runs
    sampled = sampled_bytes(job)  # one process's masks: the shards' entries add up to them
    for step, b in group_bytes(res, 0).items():
        assert (b["momentum_dense"], b["momentum"]) == (4 * DENSE, sampled[step]), step
        assert b.get("params", 0) == (4 * PARAMS if (step - 1) % job.sync_interval == 0 else 0)
        assert b["control"] == 2 * 4  # each process's vote on the step, agreed over every process of the job
    # a shard of the parameters, m, v and the ages, to each process of the late group and of each relaunched one
    assert heals(res, 4 * (PARAMS * 3 + PARAMS // 2) // 2, group_size=2) >= 3 * 2
    assert first_heal(res, 2, 0) == first_heal(res, 2, 1) == first_heal(res, 1, 1) == 1


@pytest.mark.multiprocess
def test_groups_of_two_survive_two_kills_at_once_and_a_kill_while_healing(tmp_path):
    job = Job(group_size=2, steps=17, sync_interval=4,
              faults=(Fault(replica=1, step=4, rank=1), Fault(replica=2, step=4, rank=0),  # group 0 goes on alone
                      Fault(replica=2, step=10, attempt=1, rank=1),
                      Fault(replica=-1, step=12, where="send", rank=1)))  # a process sending 2 its shards dies
    res = run(job, tmp_path)
    alone = [e["step"] for e in res[0]["log"] if e["attempt"] == 0 and e["committed"] and e["replicas"] == 1]
    assert len(alone) >= job.relaunch_after and alone == list(range(alone[0], alone[0] + len(alone)))
    # group 2's third start: its second process got no state at the first try, so the group did not commit
    # then, and its two processes took the shards again at the next quorum
    third = [[e for e in log if e["attempt"] == 2] for log in res[2]["ranks"]]
    assert third[1][0]["heals"] == 0 and not third[0][0]["committed"] and not third[1][0]["committed"]
    assert third[1][1]["heals"] == 1 and third[1][1]["committed"] and third[0][1]["committed"]
    heals(res, 4 * (PARAMS * 3 + PARAMS // 2) // 2, group_size=2)


@pytest.mark.multiprocess
def test_lamb_in_groups_of_two_survives_a_kill_in_the_gradient_all_reduce(tmp_path):
    # the kill after the late group's heal: a process killed in the step it sent in never logs that step's bytes
    job = Job(optimizer="lamb", group_size=2, steps=10, late=((2, 2),), faults=(Fault(replica=1, step=6, rank=1),))
    res = run(job, tmp_path)
    survivor(res, 0, job.steps)
    for step, b in group_bytes(res, 0).items():
        assert b["grads"] == 4 * PARAMS, step  # each process averages its shard of the gradients across the groups
    # a shard of the parameters, m and v; 4 step counts
    assert heals(res, 3 * 4 * PARAMS // 2 + 4 * 4, group_size=2) >= 2 * 2
    assert first_heal(res, 2, 0) == first_heal(res, 1, 1) == 1


# -- in one process ---------------------------------------------------------------------------------------

def tiny(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def backward(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 32, generator=g)
    torch.nn.functional.cross_entropy(model(x), (x[:, :4]).argmax(1)).backward()


def snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {(i, k): t.clone() for i, p in enumerate(model.parameters()) for k, t in opt.state[p].items()},
            opt.steps)


def same(a, b) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1].keys() == b[1].keys()
            and all(torch.equal(a[1][k], b[1][k]) for k in a[1]) and a[2] == b[2])


def test_undo_puts_back_the_parameters_the_moments_the_ages_and_the_step():
    model, twin = tiny(), tiny()
    opts = [slamb.SLAMB(m.parameters(), lr=0.01, compress_ratio=0.1, min_compress_numel=1000, sync_interval=2)
            for m in (model, twin)]
    for opt, m in zip(opts, (model, twin)):
        opt.fix_layout()
        for t in (1, 2):
            backward(m, t)
            opt.step()
            opt.zero_grad()
    undo = Undo(opts[0])
    before = snapshot(model, opts[0])
    undo.take()
    for t in (3, 4):  # two steps undone at once: the copy is of the state before the first
        backward(model, t)
        opts[0].step()
        opts[0].zero_grad()
    assert not same(snapshot(model, opts[0]), before)
    undo.restore()
    assert same(snapshot(model, opts[0]), before)
    for opt, m in zip(opts, (model, twin)):  # and the step taken again is the step never undone
        backward(m, 3)
        opt.step()
    assert same(snapshot(model, opts[0]), snapshot(twin, opts[1]))


def test_undo_of_a_first_step_leaves_fresh_state():
    model = tiny()
    opt = slamb.SLAMB(model.parameters(), lr=0.01, min_compress_numel=1000)
    undo = Undo(opt)
    params = [p.detach().clone() for p in model.parameters()]
    undo.take()  # no layout yet: the step builds it and its moments
    backward(model, 1)
    opt.step()
    undo.restore()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params)) and opt.steps == 0
    assert all(not t.any() for s in opt.state.values() for t in s.values())


def test_settings_torchft_cannot_run_are_refused_before_anything_starts():
    group = ManagedGroup(manager=None, pg=None)  # nothing reaches a manager before these checks
    model = tiny()
    with pytest.raises(ValueError, match="build it with process_group=group"):
        FaultTolerant(group, model, slamb.SLAMB(model.parameters()))
    with pytest.raises(ValueError, match="without overlap=True"):
        FaultTolerant(group, model, slamb.SLAMB(model.parameters(), overlap=True, process_group=group))
    with pytest.raises(ValueError, match=r"invalid heal='copy': must be one of \('peer', 'mean', 'reset'\)"):
        FaultTolerant(group, model, slamb.SLAMB(model.parameters(), process_group=group), heal="copy")
    with pytest.raises(ValueError, match="a data-parallel optimizer's state is the same on every replica"):
        FaultTolerant(group, model, slamb.LAMB(model.parameters()), heal="reset")
    with pytest.raises(ValueError, match="DGC under torchft"):
        FaultTolerant(group, model, slamb.DGC(model.parameters()))


@pytest.mark.multiprocess
def test_the_page_states_what_its_runs_logged(tmp_path):
    """bench.fault_tolerance --page's numbers of one job (the digits MLP, a replica killed once), recomputed from
    the replicas' logs; the page renders them."""
    job = Job(task="digits", steps=9, sync_interval=4, lr=0.01, faults=(Fault(replica=1, step=5),))
    res = run(job, tmp_path)
    row = page_row(job, res)
    log = res[0]["log"]
    done = {e["step"]: e for e in log if e["committed"]}
    assert [s for s, _, _ in row["synced"]] == [1, 5, 9]  # the steps after which every replica holds the average
    assert [a for _, _, a in row["synced"]] == [done[s]["accuracy"] for s in (1, 5, 9)]
    assert row["final_accuracy"] == res[0]["end"]["accuracy"] == done[9]["accuracy"]
    assert row["uncommitted"] == sum(not e["committed"] for e in log) >= 1
    assert len(row["lost_s"]) >= 1 and all(x < job.timeout for x in row["lost_s"])
    numel = 64 * 128 + 128 + 128 * 10 + 10
    state = 4 * (3 * numel + numel // 2)  # params, m, v; int16 ages
    assert row["heals"] == heals(res, state) >= 1 and row["heal_bytes"] == row["heals"] * state
    assert len(row["relaunch_s"]) == 1
    record = {"command": "c", "started": "s", "wall_s": 60.0, "load_avg": [1.0, 1.0], "hardware": "CPU",
              "revision": {"commit": "0" * 40, "dirty": False}, "torch": torch.__version__, "seeds": [0],
              "target": 100 * row["final_accuracy"] - 1, "relaunch_s": 1.0, "start_s": 5.0,
              "runs": [{**row, "per_failure_s": 2.5}],
              "undo": undo_cost([(64, 128), (128,)], steps=2)}
    page = render_page(record)
    reached = time_to(row, record["target"])
    assert reached == next(t for _, t, a in row["synced"] if 100 * a >= record["target"])
    assert f"| SLAMB under torchft | {100 * row['final_accuracy']:.2f} ± 0.00 | {reached:.1f} ± 0.0 |" in page
    assert f"| 1 | 2.5 ± 0.0 | {statistics.median(row['lost_s']):.2f} |" in page
    assert f"| {row['heals']:.1f} per run | {state:,} |" in page
