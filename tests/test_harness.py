"""The shared harness: schedules, sharded batches, rank-aware atomic checkpoints, run directory, tables."""
from __future__ import annotations

import csv
import importlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

import slamb
import harness
from harness.checkpoint import Checkpointer
from harness.lock import RunLock
from harness.records import load_runs
from harness.run import ConsoleLog, RunLogger
from harness.tables import RERUN_DRIFT, build_tables
from harness.schedules import build_lr_scheduler
from slamb.schedules import MultiStep, WarmupPolyDecay, compression_ratio
from tests import distributed
from tests.test_configs import compose_root

CPU = torch.device("cpu")


def solo(rank=0, world=1) -> harness.DistEnv:
    return harness.DistEnv(rank, world, rank, world, CPU)


# ------------------------------------------------------------------------------------ schedules


def test_multistep_and_warmup_poly():
    m = MultiStep([100, 150], 0.1, steps_per_epoch=49)
    assert [m(s) for s in (0, 100 * 49 - 1, 100 * 49, 150 * 49 - 1, 150 * 49)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01])
    w = WarmupPolyDecay(warmup_steps=4, total_steps=14, power=0.5)
    assert [w(s) for s in (0, 3, 4, 9, 14)] == pytest.approx([0.25, 1.0, 1.0, 0.5**0.5, 0.0])
    with pytest.raises(ValueError, match="invalid warmup_steps=20, total_steps=14"):
        WarmupPolyDecay(20, 14)
    with pytest.raises(ValueError, match=r"invalid schedule.name='cosine': must be one of"):
        build_lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), {"name": "cosine"}, 1, 1)


def test_lr_scheduler_state_survives_a_round_trip():
    def make():
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        return opt, build_lr_scheduler(opt, {"name": "warmup_poly", "warmup_fraction": 0.25, "power": 1.0}, 2, 8)

    opt, sched = make()
    for _ in range(3):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    sched2.load_state_dict(sched.state_dict())
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(0.5 * 4 / 6)


def test_compression_warmup_list_and_floor():
    assert [compression_ratio(e, 0.1) for e in range(6)] == [0.5, 0.5, 0.2, 0.1, 0.1, 0.1]
    assert compression_ratio(100, 0.0005) == 0.001  # the last entry is kept after the list
    assert compression_ratio(3, 0.05, [0.9, 0.2]) == 0.2 and compression_ratio(0, 0.3, []) == 0.3
    with pytest.raises(ValueError, match="invalid compression_warmup='bert'"):
        compression_ratio(0, 0.1, "bert")


# ---------------------------------------------------------------------------------- data shards


def test_sharded_batches_partition_the_epoch_and_resume_mid_epoch():
    shards = [harness.ShardedBatches(103, 10, solo(r, 3), seed=4) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]  # 34 samples per rank, 3 full batches
    epoch0 = [torch.cat([b.flatten() for b in s.epoch(0)]) for s in shards]
    seen = torch.cat(epoch0)
    assert len(seen) == 90 and len(set(seen.tolist())) == 90  # disjoint across ranks
    assert not torch.equal(epoch0[0], torch.cat([b.flatten() for b in shards[0].epoch(1)]))  # set_epoch reshuffles
    assert torch.equal(torch.cat([b.flatten() for b in shards[1].epoch(0, start=2)]), epoch0[1][20:])
    with pytest.raises(ValueError, match=r"^invalid data.micro_batch=16: the 20 training samples give each of a step's "
                                         r"2 micro-batches 10, not a full batch: no step would be taken; set "
                                         r"data.micro_batch to at most 10, or run on fewer workers$"):
        harness.ShardedBatches(20, 16, solo(0, 2), seed=0)
    assert harness.eval_shard(7, solo(1, 3)).tolist() == [1, 4]


def test_a_steps_samples_are_the_same_block_whatever_the_number_of_workers():
    """Global batch 32 on 4 workers x 8 and on 2 x 16: step b's samples are block b of the epoch's permutation
    (DistributedSampler, drop_last), the same set on any number of workers; split into the 4 workers'
    micro-batches (``micro_batches=4``), 2 workers take those very micro-batches, 2 each."""
    def steps(world, batch, **kw):
        ranks = [list(harness.ShardedBatches(103, batch, solo(r, world), seed=4, **kw).epoch(1)) for r in range(world)]
        return [torch.cat([rank[b] for rank in ranks]) for b in range(len(ranks[0]))]  # micro-batches x batch

    four, two, split = steps(4, 8), steps(2, 16), steps(2, 8, micro_batches=4)
    assert len(four) == len(two) == len(split) == 103 // 32
    for a, b, c in zip(four, two, split):
        assert a.shape == (4, 8) and sorted(a.flatten().tolist()) == sorted(b.flatten().tolist())
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match="3 workers cannot take an equal share of a step's 4 micro-batches"):
        harness.ShardedBatches(103, 8, solo(0, 3), seed=4, micro_batches=4)


# ---------------------------------------------------------------------------------- checkpoints


def _slamb_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))


def _train_steps(model, opt, rank, steps, start):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + s)
        x, y = torch.randn(8, 40, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def checkpoint_worker(rank, world, run_dir, name):
    env = harness.init_distributed("cpu", 1)
    settings = {"min_compress_numel": 100, "sync_interval": 4, "compress_ratio": 0.3} if name == "slamb" else {}

    def fresh():
        model = _slamb_model()
        opt = slamb.create_optimizer(name, model, lr=0.01, **settings)
        return slamb.wrap_model(model, opt), opt

    model, opt = fresh()
    ckpt = Checkpointer(run_dir, env)
    assert harness.restore_training(ckpt, model=model, optimizer=opt) is None
    _train_steps(model, opt, rank, 3, 0)
    harness.save_training(ckpt, {"epoch": 1, "step": 3}, model=model, optimizer=opt, extra={"note": "x"})
    _train_steps(model, opt, rank, 4, 3)
    final = [p.detach().clone() for p in model.parameters()]
    total = opt.comm_stats()["total"]["all"]["payload"]

    model2, opt2 = fresh()
    progress, extra = harness.restore_training(ckpt, model=model2, optimizer=opt2)
    _train_steps(model2, opt2, rank, 4, 3)
    files = sorted(os.listdir(ckpt.dir / "step000000003"))
    return {"progress": progress, "extra": extra, "files": files, "total": total,
            "total_resumed": opt2.comm_stats()["total"]["all"]["payload"],
            "same": all(torch.equal(a, b) for a, b in zip(final, model2.parameters())),
            "diverged": not all(torch.equal(a, b) for a, b in zip(final, _slamb_model().parameters()))}


@pytest.mark.parametrize("name", ["slamb", "lamb"])
@pytest.mark.multiprocess
def test_rank_aware_checkpoint_resumes_exactly(tmp_path, name):
    out = distributed.run(checkpoint_worker, 2, str(tmp_path), name)
    for r in out:
        assert r["progress"] == {"epoch": 1, "step": 3} and r["extra"] == {"note": "x"}
        assert r["same"] and r["diverged"]  # resumed == uninterrupted, and training did move the weights
        assert r["total_resumed"] == r["total"] > 0  # cumulative bytes survive resume (ledger saved)
    # SLAMB's moments and parameters are per rank: both in every rank's file; LAMB's model once, on rank 0
    assert out[0]["files"] == ["complete.json", "rank0.pt", "rank0.pt.sha256", "rank1.pt", "rank1.pt.sha256",
                               "shared.pt", "shared.pt.sha256"]
    per_rank = torch.load(tmp_path / "ckpt/step000000003/rank1.pt", weights_only=False)
    shared = torch.load(tmp_path / "ckpt/step000000003/shared.pt", weights_only=False)
    assert ("model" in per_rank) == (name == "slamb") and ("model" in shared) == (name != "slamb")
    latest = json.loads((tmp_path / "ckpt/latest.json").read_text())
    # each with its digest beside it, and in the marker too
    files = {name: (tmp_path / "ckpt/step000000003" / f"{name}.sha256").read_text().split()[0]
             for name in ("rank0.pt", "rank1.pt", "shared.pt")}
    assert latest == {"dir": "step000000003", "world_size": 2, "epoch": 1, "step": 3, "files": files}
    assert json.loads((tmp_path / "ckpt/step000000003/complete.json").read_text()) == \
        {"world_size": 2, "epoch": 1, "step": 3, "files": files}


def test_checkpoint_keeps_the_last_and_refuses_another_world_size(tmp_path):
    ckpt = Checkpointer(tmp_path, solo(), keep=2)
    for step in (1, 2, 3):
        ckpt.save({"step": step}, {"a": step}, {"b": step})
    assert sorted(p.name for p in ckpt.dir.glob("step*")) == ["step000000002", "step000000003"]
    assert not list(ckpt.dir.rglob("*.tmp*"))  # every file was renamed into place
    progress, shared, (mine,) = ckpt.load()
    assert progress == {"step": 3} and shared == {"a": 3} and mine == {"b": 3}
    with pytest.raises(ValueError, match="written by 1 workers and this run has 4.*Resume with 1 workers"):
        Checkpointer(tmp_path, solo(0, 4)).load()
    with pytest.raises(ValueError, match="invalid checkpoint.keep=0"):
        Checkpointer(tmp_path, solo(), keep=0)


def test_a_save_interrupted_before_latest_leaves_the_previous_checkpoint(tmp_path):
    ckpt = Checkpointer(tmp_path, solo())
    ckpt.save({"step": 5}, {"a": 5}, {"b": 5})
    # a worker killed mid-save: its files exist, latest.json was not rewritten
    (ckpt.dir / "step000000009").mkdir()
    torch.save({"b": 9}, ckpt.dir / "step000000009" / "rank0.pt")
    assert ckpt.load()[0] == {"step": 5}


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, solo())  # keeps two by default
    for step in (1, 2, 3):
        ckpt.save({"step": step}, {"a": step}, {"b": step})
    newest = ckpt.dir / "step000000003" / "rank0.pt"
    newest.write_bytes(newest.read_bytes()[:40])  # truncated, as by a full disk
    assert ckpt.load() == ({"step": 2}, {"a": 2}, [{"b": 2}])
    out = capsys.readouterr().out
    assert f"checkpoint file {newest} is unreadable" in out and "resuming from the previous checkpoint, step000000002" in out
    (ckpt.dir / "step000000002" / "shared.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"step000000002/shared.pt is unreadable .*trainer.resume=never"):
        ckpt.load()


def test_a_damaged_latest_json_resumes_from_the_newest_complete_folder(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, solo())
    for step in (1, 2):
        ckpt.save({"step": step}, {"a": step}, {"b": step})
    (ckpt.dir / "step000000003").mkdir()  # a save interrupted before it completed: no complete.json
    (ckpt.dir / "latest.json").write_text('{"dir": "step0')
    assert ckpt.load() == ({"step": 2}, {"a": 2}, [{"b": 2}])
    assert "latest.json is unreadable" in capsys.readouterr().out


def test_resuming_with_other_inputs_is_refused(tmp_path):
    Checkpointer(tmp_path, solo(), inputs={"data.dir": "/data/a"}).save({"step": 1}, {}, {})
    assert Checkpointer(tmp_path, solo(), inputs={"data.dir": "/data/a"}).load()[0] == {"step": 1}
    with pytest.raises(ValueError, match=r"trained with data.dir='/data/a' and this run has data.dir='/data/b'.*"
                                         r"trainer.resume=never"):
        Checkpointer(tmp_path, solo(), inputs={"data.dir": "/data/b"}).load()
    with pytest.raises(ValueError, match=r"init_from=None and this run has init_from='/m'"):
        Checkpointer(tmp_path, solo(), inputs={"data.dir": "/data/a", "init_from": "/m"}).load()
    assert harness.checkpoint.run_inputs({"data": {"dir": "d"}, "model": {"dir": "???"}, "init_from": None}) == \
        {"data.dir": os.path.abspath("d")}


@pytest.mark.parametrize("name", ["lamb", "dgc", "jointspar"])
def test_checkpoints_load_to_the_cpu_whatever_the_run_device(tmp_path, name):
    """A run on an accelerator resumes: RNG states arrive as CPU ByteTensors (``meta`` stands in for CUDA)."""
    model = _slamb_model()
    opt = slamb.create_optimizer(name, model, lr=0.01)
    for _ in range(2):
        opt.begin_step()
        _train_steps(model, opt, 0, 1, 0)
    ckpt = Checkpointer(tmp_path, solo())
    harness.save_training(ckpt, {"step": 2}, model=model, optimizer=opt)
    torch.manual_seed(123)
    model2 = _slamb_model()
    opt2 = slamb.create_optimizer(name, model2, lr=0.01)
    on_gpu = harness.DistEnv(0, 1, 0, 1, torch.device("meta"))
    assert harness.restore_training(Checkpointer(tmp_path, on_gpu), model=model2, optimizer=opt2)[0] == {"step": 2}
    assert torch.equal(torch.get_rng_state(), torch.load(tmp_path / "ckpt/step000000002/rank0.pt",
                                                         weights_only=False)["rng"]["torch"])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    if name == "dgc":
        assert torch.equal(opt2.generator.get_state(), opt.generator.get_state())
    if name == "jointspar":
        assert opt2._prob.device.type == "cpu" and torch.equal(opt2._prob, opt._prob)
        assert torch.equal(opt2.sample_round(), opt.sample_round())  # the same next round


def test_rng_state_round_trip_restores_every_stream():
    state = harness.seeding.rng_state()
    a = (torch.rand(3), np.random.rand(), random.random())
    harness.seeding.set_rng_state(state)
    b = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    assert state["torch"].dtype == torch.uint8 and state["torch"].device.type == "cpu"


# ------------------------------------------------------------------------------- run identity


def _cfg(**over):
    cfg = {"name": "r", "seed": 0, "epochs": 2, "data": {"dir": "/data/a"}, "optimizer": {"name": "sgd", "lr": 0.1},
           "trainer": {"resume": "auto", "progress": True, "checkpoint": {"every": 1, "keep": 2}}}
    for key, value in over.items():
        node = cfg
        *path, last = key.split("__")
        for p in path:
            node = node[p]
        node[last] = value
    return cfg


def test_empty_schedules_are_refused():
    for key, value in (("epochs", 0), ("epochs", -1), ("steps", 0), ("trainer__checkpoint__every", 0)):
        with pytest.raises(ValueError, match=f"invalid {key.replace('__', '.')}={value}: must be an integer >= 1"):
            harness.checkpoint.prepare_run(_cfg(**{key: value}), "/nonexistent")


def test_a_finished_run_is_reported_finished_and_other_inputs_are_refused(tmp_path, capsys):
    log = RunLogger(tmp_path, _cfg(), solo(), progress=False)
    log.finish({"final_test_top1": 90.0})
    # operational settings do not make it another run
    assert harness.checkpoint.prepare_run(_cfg(trainer__progress=False), tmp_path) == {"final_test_top1": 90.0}
    assert f"{tmp_path} is finished" in capsys.readouterr().out
    assert harness.checkpoint.prepare_run(_cfg(epochs=3), tmp_path) is None  # extended: resumes
    assert harness.checkpoint.prepare_run(_cfg(seed=1), tmp_path) is None
    with pytest.raises(ValueError, match="data.dir='/data/a' and this run has data.dir='/data/b'"):
        harness.checkpoint.prepare_run(_cfg(data__dir="/data/b"), tmp_path)
    RunLogger(tmp_path, _cfg(), solo(), progress=False)  # a new writer: no longer finished
    assert not (tmp_path / "metrics.json").exists()
    assert harness.checkpoint.prepare_run(_cfg(), tmp_path) is None
    Checkpointer(tmp_path, solo()).save({"step": 1}, {}, {})
    assert harness.checkpoint.prepare_run(_cfg(trainer__resume="never"), tmp_path) is None
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.multiprocess
def test_run_lock_refuses_a_second_writer_and_takes_over_a_stale_lock(tmp_path, capsys):
    with RunLock(tmp_path):
        with pytest.raises(RuntimeError, match=rf"run directory {tmp_path} is being written by process {os.getpid()}"):
            RunLock(tmp_path).acquire()
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "run.lock").exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    with RunLock(tmp_path):
        assert f"removing the stale lock {tmp_path / 'run.lock'} (process {dead.pid} is gone)" in capsys.readouterr().out
    assert RunLock(tmp_path, hold=False).__enter__() and not (tmp_path / "run.lock").exists()


@pytest.mark.multiprocess  # a child process writes to the console as the workers' fork server's children do
def test_console_log_keeps_what_came_before_its_file_and_writes_no_file_unless_named(tmp_path, capfd):
    log = tmp_path / "run" / "train.log"
    with ConsoleLog() as console:
        os.write(1, b"checks passed\n")  # at the descriptor, as this process's print does outside pytest
        subprocess.run([sys.executable, "-c", "import sys; print('from a child'); print('to stderr', file=sys.stderr)"],
                       check=True)
        console.attach(log)
        os.write(1, b"after the file\n")
    lines = log.read_text().splitlines()  # each stream in its order (the two are copied apart)
    assert [line for line in lines if line != "to stderr"] == ["checks passed", "from a child", "after the file"]
    assert lines.count("to stderr") == 1
    assert capfd.readouterr().out.splitlines() == ["checks passed", "from a child", "after the file"]
    with ConsoleLog():  # a command refused before its run directory is its own: the console only
        os.write(1, b"error: refused\n")
    assert capfd.readouterr().out == "error: refused\n" and sorted(tmp_path.rglob("*")) == [log.parent, log]


def test_the_workers_fork_server_is_kept_when_torch_resolves_its_cache_folder(monkeypatch):
    """:func:`harness.distributed.prestart` starts the server before the launching process's torch sets
    TORCHINDUCTOR_CACHE_DIR to the default every process resolves alike: the launch keeps that server."""
    from harness.distributed import forkserver, forkserver_started, stop_forkserver

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    try:
        forkserver("harness.loop")
        started = forkserver_started()
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")
        forkserver("harness.loop")
        assert forkserver_started() is started
        monkeypatch.setenv("SLAMB_SOMETHING_ELSE", "1")  # any other change gives the workers a new server
        forkserver("harness.loop")
        assert forkserver_started() is not started
    finally:
        stop_forkserver()


def test_the_launch_names_rendezvous_events_as_torch_does_without_reading_the_stacks_source(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from harness.distributed import _quick_rendezvous_names

    names, reads = [], []

    class Handler:  # as the rendezvous's classes call it: from _record, named after _record's caller
        def _record(self):
            names.append(dynamic_rendezvous.get_method_name())

        def next_rendezvous(self):
            self._record()

    Handler().next_rendezvous()
    monkeypatch.setattr(dynamic_rendezvous.inspect, "stack", lambda *a: reads.append(a) or [])
    with _quick_rendezvous_names():
        Handler().next_rendezvous()
    assert names == ["next_rendezvous", "next_rendezvous"] and reads == []


@pytest.mark.multiprocess  # runs the pipeline's command line as a subprocess
def test_command_line_finished_rerun_other_data_and_empty_schedule(tmp_path):
    """Through ``python -m cifar10.train``: the checks run before any worker starts."""
    from cifar10.data import write_digits
    from tests.test_cifar10 import TINY, cli

    data = write_digits(tmp_path / "a" / "cifar-10-batches-py", 64, 16)
    common = [*[a for a in TINY if not a.startswith("trainer.nproc")], "trainer.nproc_per_node=1", "epochs=1",
              "experiment=cifar10/lamb", f"hydra.run.dir={tmp_path / 'run'}"]
    first = cli([*common, f"data.dir={data}"])
    assert first.returncode == 0, first.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = cli([*common, f"data.dir={data}", "trainer.progress=true"])
    assert again.returncode == 0 and f"{tmp_path / 'run'} is finished" in again.stdout
    assert "resumed" not in again.stdout and (tmp_path / "run" / "metrics.jsonl").read_text() == lines
    other = shutil.copytree(data, tmp_path / "b" / "cifar-10-batches-py")
    moved = cli([*common, f"data.dir={other}"])
    assert moved.returncode != 0 and f"this run has data.dir='{other}'" in moved.stderr
    empty = cli([*common, f"data.dir={data}", "epochs=0"])
    assert empty.returncode != 0 and "invalid epochs=0: must be an integer >= 1" in empty.stderr
    assert not (tmp_path / "run" / "run.lock").exists()


# ------------------------------------------------------------------------------- run directory


def test_run_logger_writes_the_run_directory_and_truncates_on_resume(tmp_path):
    cfg = {"name": "t", "optimizer": {"name": "sgd"}}
    log = RunLogger(tmp_path, cfg, solo(), progress=False)
    for epoch in (1, 2, 3):
        log.log({"epoch": epoch, "step": 10 * epoch, "test_top1": 50.0 + epoch})
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == cfg
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert len(meta["git"]["commit"]) == 40 and meta["world_size"] == 1
    RunLogger(tmp_path, cfg, solo(), progress=False, resume_epoch=2)  # resumes from the epoch-2 checkpoint
    assert [h["epoch"] for h in log.history()] == [1, 2]
    log.finish({"final_test_top1": 52.0})
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"final_test_top1": 52.0}
    other = tmp_path / "rank1"
    RunLogger(other, cfg, solo(1, 2)).log({"epoch": 1})
    assert not other.exists()  # only rank 0 writes


def test_comm_metrics_by_kind():
    cols = harness.comm_metrics({"grads": 300, "control": 8, "all": 308}, {"grads": 100, "all": 100})
    assert cols == {"bytes/all": 208, "bytes_cum/all": 308, "bytes/control": 8, "bytes_cum/control": 8,
                    "bytes/grads": 200, "bytes_cum/grads": 300}


@pytest.mark.multiprocess
def test_launch_with_one_worker_runs_in_process():
    assert harness.launch(_return_world, {"x": 1}, "/nonexistent", nproc_per_node=1) == (1, {"x": 1})


def _return_world(cfg, run_dir):
    return slamb.comm.world_size(), cfg


# ------------------------------------------------------------------------------------- tables


def _fixture_run(root, name, row, top1s, bytes_per_epoch, paper=None, study=None, optimizer=None, seed=0, local=None,
                 **extra):
    d = root / name
    d.mkdir(parents=True)
    cfg = {"name": row.lower(), "seed": seed, "epochs": len(top1s), "optimizer": optimizer or {"name": row.lower()},
           "data": {"dir": f"/data/copy{seed}"}, "trainer": {"progress": seed % 2 == 0}, "paper": paper,
           "study": study, **extra}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    hist = [{"epoch": e + 1, "test_top1": t, "bytes_cum/all": bytes_per_epoch * (e + 1),
             **({"test_top1_local": local[e]} if local else {})} for e, t in enumerate(top1s)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    (d / "metrics.json").write_text(json.dumps({
        "final_test_top1": top1s[-1] if top1s else float("nan"), "best_test_top1": max(top1s, default=float("nan")),
        "bytes_total": {"all": bytes_per_epoch * len(top1s),
                        # SLAMB's exchange: sampled entries and always-averaged tensors, 9 to 1
                        **({"momentum": 0.72 * bytes_per_epoch * len(top1s),
                            "momentum_dense": 0.08 * bytes_per_epoch * len(top1s)} if row == "SLAMB" else {})},
        "wall_time_s": 12.0, "epochs": len(top1s), "world_size": 4, "global_batch": 1024, "params": 1_727_962}))


def test_make_tables_groups_by_configuration_with_seeds(tmp_path):
    runs = tmp_path / "runs"
    t = "cifar10_resnet110"
    paper = {"table": t, "source": "the authors' README", "setting": {"model": {"depth": 110}}}
    slamb_opt = {"name": "slamb", "lr": 0.01, "compress_ratio": 0.1, "sync_interval": 50}
    _fixture_run(runs, "lamb", "LAMB", [80.0, 93.0], 4_000_000, {**paper, "row": "LAMB", "top1": 93.15},
                 optimizer={"name": "lamb", "lr": 0.01, "betas": [0.9, 0.999]})
    _fixture_run(runs, "sgd", "SGD-M", [70.0, 91.0], 4_000_000, {**paper, "row": "SGD-M", "top1": 91.70})
    for seed, (last, local) in enumerate([(93.4, 92.0), (93.0, 91.0), (93.8, 91.5)]):  # three seeds, one row
        _fixture_run(runs, f"slamb/{seed}", "SLAMB", [79.0, last], 500_000, {**paper, "row": "SLAMB", "top1": 93.21},
                     optimizer=slamb_opt, seed=seed, local=[70.0, local])
    # the same optimizer row with another schedule: its own row, never averaged with the others
    _fixture_run(runs, "slamb_long", "SLAMB", [60.0, 70.0, 80.0], 500_000, {**paper, "row": "SLAMB", "top1": 93.21},
                 optimizer=slamb_opt)
    _fixture_run(runs, "empty", "SLAMB", [], 1, {**paper, "row": "SLAMB"}, optimizer=slamb_opt)  # epochs=0
    _fixture_run(runs, "nan", "LAMB", [float("nan")], 1, {**paper, "row": "LAMB"})
    for i, (b3, k, acc) in enumerate([(0.9, 0.1, 90.0), (0.99, 0.1, 92.0), (0.9, 0.05, 89.0), (0.9, 0.1, 91.0)]):
        _fixture_run(runs, f"sweep/{i}", "SLAMB", [acc], 1, {"table": t, "row": "SLAMB", "top1": 93.21},
                     study="beta3_compress_ratio", optimizer={"name": "slamb", "beta3": b3, "compress_ratio": k},
                     seed=i)
    messages = []
    loaded = load_runs(runs, log=messages.append)
    assert sorted(messages) == [f"left out of the tables: {runs / 'empty'}: epochs = 0 (trained nothing)",
                                f"left out of the tables: {runs / 'nan'}: final_test_top1 is NaN"]
    written = build_tables(loaded, tmp_path / "results")
    md = (tmp_path / "results" / f"{t}.md").read_text()
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert lines[0] == ("| Optimizer | configuration | top-1 | top-1 local | best top-1 | bytes sent / worker | "
                        "vs LAMB | training time | n |")
    assert "Every row: workers 4, 1,727,962 parameters." in md
    # rows in the paper's order; each names its configuration (non-default optimizer settings, the differing rest)
    assert lines[1] == "| SGD-M | epochs=2 | 91.00 | - | 91.00 | 8 MB | 1.000x | 12 s | 1 |"
    assert lines[2] == "| LAMB | epochs=2, lr=0.01 | 93.00 | - | 93.00 | 8 MB | 1.000x | 12 s | 1 |"
    # three seeds: mean ± sample standard deviation, n = 3; the local models' column from the history
    assert lines[3] == ("| SLAMB | epochs=2, lr=0.01, sync_interval=50 | 93.40 ± 0.40 | "
                        "91.50 ± 0.50 | 93.40 ± 0.40 | 1 MB | 0.125x | 12 s | 3 |")
    assert lines[4].startswith("| SLAMB | epochs=3, lr=0.01, sync_interval=50 | 80.00 | - |")
    assert lines[4].endswith("| 1.5 MB | - | 12 s | 1 |")  # no LAMB run of 3 epochs to compare with
    # not the published setting (no model.depth 110): the published numbers apart, under their source
    assert ("so the published top-1 stand apart below, for reference only. Their source: the authors' README."
            in md)
    assert lines[5:] == ["| Optimizer | published top-1 (%) |", "| SGD-M | 91.70 |", "| LAMB | 93.15 |",
                         "| SLAMB | 93.21 |"]
    assert "90.0% of SLAMB's momentum bytes were sampled entries" in md
    rows = list(csv.DictReader((tmp_path / "results" / f"{t}.csv").read_text().splitlines()))
    assert [r["optimizer"] for r in rows] == ["SGD-M", "LAMB", "SLAMB", "SLAMB"]
    assert float(rows[2]["top1_std"]) == pytest.approx(0.4) and rows[2]["top1_n"] == "3"
    assert float(rows[2]["bytes_per_worker"]) == 1_000_000 and rows[2]["seeds"] == "[0, 1, 2]"
    grid = (tmp_path / "results" / f"{t}_beta3_compress_ratio.md").read_text()
    assert "| beta3 \\ k | 0.05 | 0.1 |" in grid and "| 0.9 | 89.00 (1) | 90.50 ± 0.71 (2) |" in grid
    assert "| 0.99 | - | 92.00 (1) |" in grid
    pngs = [p for files in written.values() for p in files if str(p).endswith(".png")]
    assert sorted(p.name for p in pngs) == [f"{t}_beta3_compress_ratio_bytes_heatmap.png",
                                           f"{t}_beta3_compress_ratio_heatmap.png",
                                           f"{t}_beta3_compress_ratio_top1_vs_bytes.png", f"{t}_curves.png"]
    assert all(p.stat().st_size > 10_000 for p in pngs)


def _demo_run(root, row, seed, top1, local, bytes_total):
    d = root / f"{row}_seed{seed}"
    d.mkdir(parents=True)
    cfg = {"name": f"demo_digits_{row.lower()}", "seed": seed, "epochs": 2, "optimizer": {"name": row.lower()},
           "paper": {"table": "demo_digits_resnet8", "row": row, "top1": 93.0, "source": "the authors' README"}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    hist = [{"epoch": 1, "test_top1": 50.0, "test_top1_local": 49.0, "bytes_cum/all": bytes_total["all"] / 2},
            {"epoch": 2, "test_top1": top1, "test_top1_local": local, "bytes_cum/all": bytes_total["all"]}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    (d / "metrics.json").write_text(json.dumps({
        "final_test_top1": top1, "best_test_top1": top1, "bytes_total": bytes_total, "wall_time_s": 5.0, "epochs": 2,
        "steps": 10, "world_size": 4, "global_batch": 256, "params": 1000}))


@pytest.mark.e2e
def test_demo_report_splits_bytes_by_kind_and_states_the_comparison(tmp_path):
    from cifar10.demo import report

    # SLAMB: 10 steps of k = 0.1 of the 900 compressed entries (3600 B) and the 100 dense ones (4000 B) in fp32,
    # two parameter syncs of 4000 B, 4 B of control per step
    slamb = {"momentum": 3600, "momentum_dense": 4000, "params": 8000, "control": 40, "all": 15640}
    lamb = {"grads": 40000, "control": 40, "all": 40040}
    for seed, (s, sl, l) in enumerate([(96.0, 95.0, 96.5), (96.4, 95.2, 96.7), (96.2, 95.1, 96.6)]):
        _demo_run(tmp_path / "runs", "SLAMB", seed, s, sl, slamb)
        _demo_run(tmp_path / "runs", "LAMB", seed, l, l, lamb)
    text = report(load_runs(tmp_path / "runs"), tmp_path / "out")
    assert text == (tmp_path / "out" / "demo.md").read_text()
    assert "| LAMB | defaults | 96.60 ± 0.10 | 96.60 ± 0.10 | 96.60 ± 0.10 | 40 KB | 1.000x | 5 s | 3 |" in text
    assert "| SLAMB | defaults | 96.20 ± 0.20 | 95.10 ± 0.10 | 96.20 ± 0.20 | 15.6 KB | 0.391x | 5 s | 3 |" in text
    assert ("| Optimizer | gradients | momentum, sampled | momentum, always-averaged tensors | parameter sync | "
            "control | total | compressed share |") in text
    assert "| LAMB | 40 KB | 0 B | 0 B | 0 B | 40 B | 40 KB | - |" in text
    assert "| SLAMB | 0 B | 3.6 KB | 4 KB | 8 KB | 40 B | 15.6 KB | 47.4% |" in text  # 3600 / (3600 + 4000)
    # the difference (-0.40) exceeds two standard errors (2 sqrt(0.2^2/3 + 0.1^2/3) = 0.26)
    assert text.rstrip().endswith(
        "SLAMB's averaged model is 0.40 points below LAMB's (96.20% vs 96.60% top-1, mean of 3 and 3 seeds; two "
        "standard errors of the difference: 0.26, so a difference beyond the seeds' spread) at 0.391x LAMB's bytes "
        "per worker (2.6x fewer).\n\n" + RERUN_DRIFT)  # and what a rerun elsewhere moves


# ----------------------------------------------------------------------------- CUDA math at worker start-up


@pytest.fixture
def cuda_math():
    """torch's CUDA math flags, process-wide, restored after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    yield lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                   torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


@pytest.mark.parametrize("tf32, benchmark", [(True, True), (False, False), (True, False)])
def test_worker_start_up_sets_the_cuda_math(cuda_math, tf32, benchmark):
    """Settable without CUDA: a CPU worker sets them too (they choose CUDA kernels only)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    torch.backends.cudnn.benchmark = not benchmark
    harness.init_distributed("cpu", 1, tf32=tf32, cudnn_benchmark=benchmark)
    assert cuda_math() == (tf32, tf32, benchmark)
    harness.init_distributed("cpu", 1)  # not given: torch's settings stay
    assert cuda_math() == (tf32, tf32, benchmark)


class Started(Exception):
    pass


@pytest.mark.parametrize("root, module", [("cifar10", "cifar10.train"), ("swin", "swin.train"),
                                          ("bert", "bert.train"), ("squad", "squad_finetune.train")])
@pytest.mark.parametrize("tf32, benchmark", [(False, True), (True, False)])
def test_every_pipeline_hands_its_cuda_math_to_the_worker_start_up(monkeypatch, root, module, tf32, benchmark):
    seen = {}

    def start(*args, **kwargs):
        seen.update(kwargs)
        raise Started

    monkeypatch.setattr(harness, "init_distributed", start)
    cfg = compose_root(root, f"trainer.tf32={str(tf32).lower()}", f"trainer.cudnn_benchmark={str(benchmark).lower()}")
    with pytest.raises(Started):
        importlib.import_module(module).train(cfg, "/nonexistent")
    assert seen == {"tf32": tf32, "cudnn_benchmark": benchmark}


def test_sweep_pages_state_where_slamb_stays_with_lamb_and_at_what_bytes(tmp_path):
    """The beta3 x k grid and the H line beside LAMB's runs of the same recipe: the sentences are computed
    from the cells (means over seeds, bytes), checked here against numbers worked by hand."""
    runs = tmp_path / "runs"
    t = "study_digits_resnet8"
    lamb = {"table": t, "row": "LAMB"}
    for seed, acc in enumerate([96.0, 98.0]):  # LAMB: 97.0
        _fixture_run(runs, f"lamb{seed}", "LAMB", [50.0, acc], 4_000_000, lamb, seed=seed)
    # cells (beta3, k): two seeds each; bytes per epoch grow with k
    cells = {(0.9, 0.05): (95.0, 95.4), (0.9, 0.1): (96.2, 96.4), (0.99, 0.05): (94.0, 94.2), (0.99, 0.1): (96.6, 96.0)}
    for i, ((b3, k), accs) in enumerate(cells.items()):
        for seed, acc in enumerate(accs):
            _fixture_run(runs, f"grid{i}_{seed}", "SLAMB", [50.0, acc], int(10_000_000 * k), {"table": t, "row": "SLAMB"},
                         study="beta3_compress_ratio", seed=seed,
                         optimizer={"name": "slamb", "beta3": b3, "compress_ratio": k})
    for i, (h, accs) in enumerate({5: (96.5, 96.7), 50: (93.0, 94.0)}.items()):
        for seed, acc in enumerate(accs):
            _fixture_run(runs, f"h{i}_{seed}", "SLAMB", [50.0, acc], 1_000_000 // h, {"table": t, "row": "SLAMB"},
                         study="sync_interval", seed=seed, optimizer={"name": "slamb", "sync_interval": h})
    written = build_tables(load_runs(runs), tmp_path / "out")
    grid = (tmp_path / "out" / f"{t}_beta3_compress_ratio.md").read_text()
    # within 1 point of LAMB's 97.00: (0.9, 0.1) at 96.30 and (0.99, 0.1) at 96.30; both send 2 MB (2 epochs x 1 MB)
    assert "LAMB's top-1 in the same configuration apart from the optimizer: 97.00 ± 1.41 (n = 2)." in grid
    assert "Within 1 point of it: 2 of 4 cells (beta3 0.9, k 0.1, beta3 0.99, k 0.1)" in grid
    assert "the cheapest is beta3 0.9, k 0.1 at 2 MB per worker." in grid
    # across beta3 at fixed k: k 0.05: 95.2 - 94.1 = 1.1; k 0.1: 96.3 - 96.3 = 0 -> mean 0.55, largest 1.10
    # across k at fixed beta3: 0.9: 96.3 - 95.2 = 1.1; 0.99: 96.3 - 94.1 = 2.2 -> mean 1.65, largest 2.20
    assert "beta3 moves the top-1 by 0.55 points on average (largest 1.10)" in grid
    assert "k moves it by 1.65 (largest 2.20)" in grid
    assert "The best beta3 per k: k 0.05: 0.9, k 0.1: 0.9." in grid  # a tie keeps the first
    sds = [statistics.stdev(v) for v in cells.values()]
    assert f"a cell's seeds spread by {statistics.fmean(sds):.2f} (mean sd)" in grid
    # beta3 at a fixed k against the seeds: F = (sum over k, beta3 of n (cell mean - k's mean)^2 / 2) / (within / 4)
    from scipy.stats import f as f_dist
    between = sum(2 * (statistics.fmean(cells[(b3, k)]) - statistics.fmean(cells[(0.9, k)] + cells[(0.99, k)])) ** 2
                  for b3 in (0.9, 0.99) for k in (0.05, 0.1))
    within = sum((x - statistics.fmean(v)) ** 2 for v in cells.values() for x in v)
    f = (between / 2) / (within / 4)
    assert f"(F = {f:.2f} on 2 and 4 degrees of freedom, p = {f_dist.sf(f, 2, 4):.3f})" in grid
    assert ("holds here" in grid) == (f_dist.sf(f, 2, 4) < 0.05)
    assert "| 0.9 | 1 MB | 2 MB |" in grid  # the bytes table
    names = sorted(p.name for p in written[f"{t}_beta3_compress_ratio"])
    assert f"{t}_beta3_compress_ratio_bytes_heatmap.png" in names and f"{t}_beta3_compress_ratio_heatmap.png" in names
    line = (tmp_path / "out" / f"{t}_sync_interval.md").read_text()
    assert "| 5 | 96.60 ± 0.14 | 2 | 400 KB | - | yes |" in line and "| 50 | 93.50 ± 0.71 | 2 | 40 KB | - | no |" in line


@pytest.mark.parametrize("at, rank, died", [
    ("5", "1", [(0, 5)]),  # one fault: the first attempt only, so that the restart trains through
    ("5,9,12", "1", [(0, 5), (1, 9), (2, 12)]),  # attempt k dies before step N_k: several failures in one run
    ("5,9,12", "0", []),  # another rank's hook
])
def test_the_fault_hook_kills_each_attempt_before_its_own_step(monkeypatch, at, rank, died):
    def exit_(status):
        raise SystemExit(status)
    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setenv("SLAMB_FAULT_AT_STEP", at)
    monkeypatch.setenv("SLAMB_FAULT_RANK", rank)
    env = harness.DistEnv(1, 2, 1, 2, torch.device("cpu"))
    seen = []
    for attempt in range(4):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        for step in range(1, 16):
            try:
                harness.maybe_inject_fault(step, env)
            except SystemExit as e:
                assert e.code == 17
                seen.append((attempt, step))
                break
    assert seen == died
