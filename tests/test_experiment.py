"""The shared harness: schedules, sharded batches, rank-aware atomic checkpoints, run directory, tables."""
from __future__ import annotations

import csv
import json
import os

import pytest
import torch
import yaml

import slamb
import harness as ex
from harness.checkpoint import Checkpointer
from harness.run import RunLogger
from harness.tables import build_tables, load_runs
from harness.schedules import build_lr_scheduler
from slamb.schedules import MultiStep, WarmupPolyDecay, compression_ratio
from tests import distributed

CPU = torch.device("cpu")


def solo(rank=0, world=1) -> ex.DistEnv:
    return ex.DistEnv(rank, world, rank, world, CPU)


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
    shards = [ex.ShardedBatches(103, 10, solo(r, 3), seed=4) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]  # 34 samples per rank, 3 full batches
    epoch0 = [torch.cat(list(s.epoch(0))) for s in shards]
    seen = torch.cat(epoch0)
    assert len(seen) == 90 and len(set(seen.tolist())) == 90  # disjoint across ranks
    assert not torch.equal(epoch0[0], torch.cat(list(shards[0].epoch(1))))  # set_epoch reshuffles
    assert torch.equal(torch.cat(list(shards[1].epoch(0, start=2))), epoch0[1][20:])
    with pytest.raises(ValueError, match="lower data.micro_batch or the number of workers"):
        ex.ShardedBatches(20, 16, solo(0, 2), seed=0)
    assert ex.eval_shard(7, solo(1, 3)).tolist() == [1, 4]


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
    env = ex.init_distributed("cpu", 1)
    settings = {"min_compress_numel": 100, "sync_interval": 4, "compress_ratio": 0.3} if name == "slamb" else {}

    def fresh():
        model = _slamb_model()
        opt = slamb.create_optimizer(name, model, lr=0.01, **settings)
        return slamb.wrap_model(model, opt), opt

    model, opt = fresh()
    ckpt = Checkpointer(run_dir, env)
    assert ex.restore_training(ckpt, model=model, optimizer=opt) is None
    _train_steps(model, opt, rank, 3, 0)
    ex.save_training(ckpt, {"epoch": 1, "step": 3}, model=model, optimizer=opt, extra={"note": "x"})
    _train_steps(model, opt, rank, 4, 3)
    final = [p.detach().clone() for p in model.parameters()]
    total = opt.comm_stats()["total"]["all"]["payload"]

    model2, opt2 = fresh()
    progress, extra = ex.restore_training(ckpt, model=model2, optimizer=opt2)
    _train_steps(model2, opt2, rank, 4, 3)
    files = sorted(os.listdir(ckpt.dir / "step000000003"))
    return {"progress": progress, "extra": extra, "files": files, "total": total,
            "total_resumed": opt2.comm_stats()["total"]["all"]["payload"],
            "same": all(torch.equal(a, b) for a, b in zip(final, model2.parameters())),
            "diverged": not all(torch.equal(a, b) for a, b in zip(final, _slamb_model().parameters()))}


@pytest.mark.parametrize("name", ["slamb", "lamb"])
def test_rank_aware_checkpoint_resumes_exactly(tmp_path, name):
    out = distributed.run(checkpoint_worker, 2, str(tmp_path), name)
    for r in out:
        assert r["progress"] == {"epoch": 1, "step": 3} and r["extra"] == {"note": "x"}
        assert r["same"] and r["diverged"]  # resumed == uninterrupted, and training did move the weights
        assert r["total_resumed"] == r["total"] > 0  # cumulative bytes survive resume (ledger saved)
    # SLAMB's moments and parameters are per rank: both in every rank's file; LAMB's model once, on rank 0
    assert out[0]["files"] == ["rank0.pt", "rank1.pt", "shared.pt"]
    per_rank = torch.load(tmp_path / "ckpt/step000000003/rank1.pt", weights_only=False)
    shared = torch.load(tmp_path / "ckpt/step000000003/shared.pt", weights_only=False)
    assert ("model" in per_rank) == (name == "slamb") and ("model" in shared) == (name != "slamb")
    latest = json.loads((tmp_path / "ckpt/latest.json").read_text())
    assert latest == {"dir": "step000000003", "world_size": 2, "epoch": 1, "step": 3}


def test_checkpoint_keeps_the_last_and_refuses_another_world_size(tmp_path):
    ckpt = Checkpointer(tmp_path, solo(), keep=2)
    for step in (1, 2, 3):
        ckpt.save({"step": step}, {"a": step}, {"b": step})
    assert sorted(p.name for p in ckpt.dir.glob("step*")) == ["step000000002", "step000000003"]
    assert not list(ckpt.dir.rglob("*.tmp*"))  # every file was renamed into place
    progress, shared, mine = ckpt.load()
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
    cols = ex.comm_metrics({"grads": 300, "control": 8, "all": 308}, {"grads": 100, "all": 100})
    assert cols == {"bytes/all": 208, "bytes_cum/all": 308, "bytes/control": 8, "bytes_cum/control": 8,
                    "bytes/grads": 200, "bytes_cum/grads": 300}


def test_launch_with_one_worker_runs_in_process():
    assert ex.launch(_return_world, {"x": 1}, "/nonexistent", nproc_per_node=1) == (1, {"x": 1})


def _return_world(cfg, run_dir):
    return slamb.comm.world_size(), cfg


# ------------------------------------------------------------------------------------- tables


def _fixture_run(root, name, row, top1s, bytes_per_epoch, paper=None, study=None, optimizer=None):
    d = root / name
    d.mkdir(parents=True)
    cfg = {"name": name, "optimizer": optimizer or {"name": row.lower()}, "paper": paper, "study": study}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    hist = [{"epoch": e + 1, "test_top1": t, "bytes_cum/all": bytes_per_epoch * (e + 1)} for e, t in enumerate(top1s)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    (d / "metrics.json").write_text(json.dumps({
        "final_test_top1": top1s[-1], "best_test_top1": max(top1s), "bytes_total": {"all": bytes_per_epoch * len(top1s)},
        "wall_time_s": 12.0, "epochs": len(top1s), "world_size": 4, "global_batch": 1024, "params": 1_727_962,
        "compressed_share": 0.9 if row == "SLAMB" else None}))


def test_make_tables_from_fixture_runs(tmp_path):
    runs = tmp_path / "runs"
    t = "cifar10_resnet110"
    _fixture_run(runs, "lamb", "LAMB", [80.0, 93.0], 4_000_000, {"table": t, "row": "LAMB", "top1": 93.15})
    _fixture_run(runs, "sgd", "SGD-M", [70.0, 91.0], 4_000_000, {"table": t, "row": "SGD-M", "top1": 91.70})
    _fixture_run(runs, "slamb", "SLAMB", [79.0, 93.4], 500_000, {"table": t, "row": "SLAMB", "top1": 93.21})
    _fixture_run(runs, "slamb_seed1", "SLAMB", [79.0, 93.0], 500_000, {"table": t, "row": "SLAMB", "top1": 93.21})
    for i, (b3, k, acc) in enumerate([(0.9, 0.1, 90.0), (0.99, 0.1, 92.0), (0.9, 0.05, 89.0)]):
        _fixture_run(runs, f"sweep/{i}", "SLAMB", [acc], 1, {"table": t, "row": "SLAMB", "top1": 93.21},
                     study="beta3_compress_ratio", optimizer={"name": "slamb", "beta3": b3, "compress_ratio": k})
    written = build_tables(load_runs(runs), tmp_path / "results")
    md = (tmp_path / "results" / f"{t}.md").read_text()
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| SGD-M", "| LAMB", "| SLAMB"]  # the paper's order
    assert lines[3] == "| SLAMB | 93.21 | 93.20 | 93.20 | 1 MB | 0.125x | 12 s | 2 |"  # two seeds averaged
    assert "SLAMB compresses 90.0% of the parameters" in md
    rows = list(csv.DictReader((tmp_path / "results" / f"{t}.csv").read_text().splitlines()))
    assert float(rows[1]["bytes_vs_lamb"]) == 1.0 and float(rows[2]["bytes_per_worker"]) == 1_000_000
    grid = (tmp_path / "results" / f"{t}_beta3_compress_ratio.md").read_text()
    assert "| beta3 \\ k | 0.05 | 0.1 |" in grid and "| 0.9 | 89.00 | 90.00 |" in grid and "| 0.99 | - | 92.00 |" in grid
    pngs = [p for files in written.values() for p in files if str(p).endswith(".png")]
    assert sorted(p.name for p in pngs) == [f"{t}_beta3_compress_ratio_heatmap.png", f"{t}_curves.png"]
    assert all(p.stat().st_size > 10_000 for p in pngs)
