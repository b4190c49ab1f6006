"""The CIFAR-10 pipeline: data layout and errors, augmentation, model, and end-to-end runs
(2 gloo workers) of every optimizer, resume, torchrun restarts after a killed worker, sweeps."""
from __future__ import annotations

import collections
import csv
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cifar10 import data as cdata
from cifar10.model import ResNetCifar
from cifar10.train import train
from harness.loop import summary_line
from harness.records import load_runs
from harness.tables import build_tables
from tests import distributed
from tests.test_configs import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
TIMING = ("step_time_s", "optimizer_time_s", "images_per_s", "images_per_s_per_worker", "epoch_time_s")
# a tiny, fast job: ResNet-8 of width 4, 2 workers x 16 images, 5 steps per epoch, 2 epochs
TINY = ["model=resnet8", "model.width=4", "data.micro_batch=16", "data.eval_batch=64",
        "schedule.milestones=[1,2]", "trainer.nproc_per_node=2", "trainer.progress=false",
        "trainer.threads_per_worker=1", "trainer.device=cpu"]
TWO_EPOCHS = ["epochs=2", "trainer.deterministic=true"]
SLAMB_TINY = ["experiment=cifar10/slamb", "optimizer.min_compress_numel=500", "optimizer.sync_interval=3"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return cdata.write_digits(tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py", 160, 40)


def env(**extra):
    return {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Same epochs, steps, accuracies, learning rates and bytes (exactly); losses to float32 rounding.

    A resumed run recomputes in a fresh process, where CPU conv kernels (oneDNN) may round the last bit
    differently; a resume that lost any state (moments, staleness, RNG, schedule) differs by orders more.
    """
    strip = [[{k: v for k, v in r.items() if k not in TIMING} for r in rows] for rows in (a, b)]
    assert [sorted(r) for r in strip[0]] == [sorted(r) for r in strip[1]]
    for ra, rb in zip(*strip):
        for key, value in ra.items():
            if key.endswith("_loss"):
                assert rb[key] == pytest.approx(value, rel=1e-5), key
            else:
                assert rb[key] == value, key


# ------------------------------------------------------------------------------------------ data


def test_pickle_layout_round_trip(tiny_dir):
    with open(tiny_dir / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    assert raw[b"data"].dtype == np.uint8 and raw[b"data"].shape == (32, 3072) and len(raw[b"labels"]) == 32
    loaded = cdata.load_cifar10(tiny_dir.parent)  # the parent of cifar-10-batches-py works too
    x, y = loaded["train"]
    assert x.shape == (160, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(x[0].reshape(-1), torch.from_numpy(raw[b"data"][0]))  # R plane, then G, then B
    assert loaded["test"][0].shape == (40, 3, 32, 32) and loaded["classes"][3] == "3"


def test_missing_dataset_names_the_files_and_where_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing data_batch_1, .*test_batch, batches.meta.*"
                                                r"cifar-10-python.tar.gz.*data.dir"):
        cdata.load_cifar10(tmp_path)
    cdata.write_digits(tmp_path, 160, 40)
    (tmp_path / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing data_batch_4\. "):
        cdata.load_cifar10(tmp_path)


@pytest.mark.parametrize("content, match", [
    (b"not a pickle", r"data_batch_2 is not a CIFAR-10 python-pickle batch"),
    ([1, 2], r"data_batch_2 holds a list, expected a dict"),
    ({b"data": np.zeros((4, 1024), np.uint8), b"labels": [0] * 4},
     r"data_batch_2: b'data' must be uint8 N x 3072 with N labels, got uint8 \(4, 1024\)"),
    ({b"images": 1}, r"expected keys b'data' and b'labels'"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 12]}, r"labels must be in 0..9, found 0..12"),
])
def test_malformed_dataset_is_a_clear_error(tmp_path, content, match):
    cdata.write_digits(tmp_path, 160, 40)
    path = tmp_path / "data_batch_2"
    path.write_bytes(content if isinstance(content, bytes) else pickle.dumps(content))
    with pytest.raises(ValueError, match=match):
        cdata.load_cifar10(tmp_path)


def test_validation_split_is_held_out_of_the_training_split_and_never_loads_the_test_split(tiny_dir, tmp_path):
    """data.valid_images: a fixed draw of the training images, the rest trained on; the test split is not loaded
    (a run tuning on the split cannot see it) and the split is in the run's identity by the images it holds."""
    from omegaconf import OmegaConf

    from cifar10.train import inputs, splits

    keep, valid = cdata.hold_out(160, 40, 0)
    assert len(keep) == 120 and len(valid) == 40 and sorted(keep.tolist() + valid.tolist()) == list(range(160))
    assert all(torch.equal(a, b) for a, b in zip((keep, valid), cdata.hold_out(160, 40, 0)))
    assert not torch.equal(valid, cdata.hold_out(160, 40, 1)[1])
    with pytest.raises(ValueError, match=r"invalid data.valid_images=160: the training split has 160 images"):
        cdata.hold_out(160, 160, 0)
    folder = shutil.copytree(tiny_dir, tmp_path / "cifar")
    (folder / "test_batch").write_bytes(b"not a pickle")  # loading the test split would fail
    (train_x, train_y), (valid_x, valid_y), split = splits(
        OmegaConf.create({"data": {"dir": str(folder), "valid_images": 40, "valid_seed": 0}}), torch.device("cpu"))
    x, y = cdata.load_cifar10(tiny_dir)["train"]
    assert split == "valid" and torch.equal(valid_x, x[valid]) and torch.equal(valid_y, y[valid])
    assert torch.equal(train_x, x[keep]) and torch.equal(train_y, y[keep])
    *_, split = splits(OmegaConf.create({"data": {"dir": str(tiny_dir), "valid_images": None}}), torch.device("cpu"))
    assert split == "test"
    record = inputs({"data": {"dir": str(tiny_dir), "valid_images": 40, "valid_seed": 0}})["data.valid_images"]
    other = inputs({"data": {"dir": str(tiny_dir), "valid_images": 40, "valid_seed": 1}})["data.valid_images"]
    assert record["counts"] == {"train": 120, "valid": 40} and record["digest"] != other["digest"]


def test_augment_is_a_padded_crop_and_flip_and_reproducible():
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    out = cdata.augment(x, cdata.augment_generator(0, 0, 5))
    assert out.shape == x.shape and out.dtype == torch.uint8
    assert torch.equal(out, cdata.augment(x, cdata.augment_generator(0, 0, 5)))
    assert not torch.equal(out, cdata.augment(x, cdata.augment_generator(0, 1, 5)))  # another rank's stream
    # the draws made ahead (the training loop's, once per epoch) give the same images
    assert torch.equal(out, cdata.augment(x, cdata.augment_draws(64, cdata.augment_generator(0, 0, 5))))
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    flips = 0
    for i in range(64):  # every output is one of the 81 x 2 windows of its zero-padded input
        windows = [padded[i, :, r:r + 32, c:c + 32] for r in range(9) for c in range(9)]
        plain = any(torch.equal(out[i], w) for w in windows)
        flipped = any(torch.equal(out[i], w.flip(2)) for w in windows)
        assert plain or flipped
        flips += flipped and not plain
    assert 16 < flips < 48


def test_resnet_option_a():
    model = ResNetCifar(20)
    assert sum(p.numel() for p in model.parameters()) == 269_722  # He et al.: 0.27M
    block = model.blocks[3]  # first block of stage 2: 16 -> 32 channels, stride 2, no shortcut parameters
    assert block.stride == 2 and block.pad == 16
    x = torch.randn(2, 16, 32, 32)
    shortcut = block.shortcut(x)
    assert shortcut.shape == (2, 32, 16, 16)
    assert torch.equal(shortcut[:, 8:24], x[:, :, ::2, ::2]) and not shortcut[:, :8].any() and not shortcut[:, 24:].any()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


# ------------------------------------------------------------------------------- end to end (in-process)


def e2e_worker(rank, world, jobs):
    out = []
    for cfg, run_dir in jobs:
        summary = train(cfg, run_dir)
        out.append({"summary": summary, "ledger_total": summary["bytes_total"]})
    return out


E2E_NAMES = ("sgd", "lamb", "adamw", "jointspar", "slamb")
RESUMED = ("lamb", "slamb")  # a data-parallel row (its BatchNorm statistics are per rank) and SLAMB


def resumed_copy(run_dir: Path, to: Path) -> Path:
    """``run_dir`` as it was after its first epoch: the epoch-2 checkpoint and the summary removed."""
    shutil.copytree(run_dir, to)
    first, last = sorted((to / "ckpt").glob("step*"))
    shutil.rmtree(last)  # the resumed run must write its own
    (to / "ckpt" / "latest.json").write_text(json.dumps({"dir": first.name, "world_size": 2,
                                                         "epoch": 1, "step": 5, "resumed_from": []}))
    (to / "metrics.json").unlink()
    return to


@pytest.fixture(scope="module")
def e2e(tiny_dir, tmp_path_factory):
    """Every row of E2E_NAMES for 2 epochs on 2 workers, and the RESUMED rows resumed after epoch 1."""
    root = tmp_path_factory.mktemp("e2e")
    cfgs = {name: compose_cfg(*TINY, *TWO_EPOCHS, *(SLAMB_TINY if name == "slamb" else [f"optimizer={name}"]),
                              f"data.dir={tiny_dir}", "trainer.checkpoint.keep=2") for name in E2E_NAMES}
    results = distributed.run(e2e_worker, 2, [(cfgs[n], str(root / n)) for n in E2E_NAMES])
    resumed = distributed.run(e2e_worker, 2, [(cfgs[n], str(resumed_copy(root / n, root / f"{n}_resumed")))
                                              for n in RESUMED])
    return {"root": root, "cfgs": cfgs, "results": dict(zip(E2E_NAMES, zip(*results))),
            "resumed": dict(zip(RESUMED, zip(*resumed)))}


PARAM_BYTES = 4 * sum(p.numel() for p in ResNetCifar(8, 4).parameters())


@pytest.mark.parametrize("name", E2E_NAMES)
@pytest.mark.multiprocess
def test_every_row_writes_its_run_directory_schedule_and_bytes(e2e, name):
    run_dir, (rank0, rank1) = e2e["root"] / name, e2e["results"][name]
    for f in ("config.yaml", "meta.json", "metrics.jsonl", "metrics.json", "ckpt/latest.json"):
        assert (run_dir / f).is_file(), f
    rows = history(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2] and [r["step"] for r in rows] == [5, 10]
    assert all(0 <= r["test_top1"] <= 100 and np.isfinite(r["train_loss"]) for r in rows)
    base_lr = e2e["cfgs"][name]["optimizer"]["lr"]  # x0.1 after each epoch (milestones 1, 2)
    assert [r["lr"] for r in rows] == pytest.approx([0.1 * base_lr, 0.01 * base_lr])
    assert rank0["ledger_total"] == rank1["ledger_total"]  # every rank sends as much
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["bytes_total"] == rank0["ledger_total"] and summary["world_size"] == 2
    assert rows[-1]["bytes_cum/all"] == summary["bytes_total"]["all"]
    assert json.loads((run_dir / "meta.json").read_text())["git"]["commit"]
    # the optimizer's share of each step (timed on the CPU), and the run's means over the periods
    assert all(0 < r["optimizer_time_s"] < r["step_time_s"] for r in rows)
    steps = sum(r["period_steps"] for r in rows)
    assert summary["mean_optimizer_time_s"] == pytest.approx(sum(r["period_steps"] * r["optimizer_time_s"]
                                                                 for r in rows) / steps)
    assert summary["mean_step_time_s"] == pytest.approx(sum(r["period_steps"] * r["step_time_s"] for r in rows) / steps)


@pytest.mark.multiprocess
def test_data_parallel_rows_send_the_gradients_and_jointspar_only_the_sampled_layers(e2e):
    for name in ("sgd", "lamb", "adamw"):  # averaged gradients: every parameter's bytes once per step
        rows = history(e2e["root"] / name)
        assert rows[0]["bytes/grads"] == 5 * PARAM_BYTES and rows[1]["bytes_cum/all"] == 10 * PARAM_BYTES
    rows = history(e2e["root"] / "jointspar")  # kappa 0.5 of the layers on average
    assert 0 < rows[1]["bytes_cum/grads"] < 10 * PARAM_BYTES


@pytest.mark.multiprocess
def test_slamb_row_warms_up_k_syncs_every_h_steps_and_keeps_per_rank_checkpoints(e2e):
    rows = history(e2e["root"] / "slamb")
    assert [r["compress_ratio"] for r in rows] == [0.5, 0.5]  # the per-epoch warm-up
    assert 0 < rows[-1]["bytes_cum/momentum"] < 10 * PARAM_BYTES
    assert rows[-1]["bytes_cum/params"] == 4 * PARAM_BYTES  # model syncs after steps 1, 4, 7, 10
    assert len(list((e2e["root"] / "slamb" / "ckpt").glob("step*/rank*.pt"))) == 4  # 2 kept x 2 ranks


@pytest.mark.parametrize("name", RESUMED)
@pytest.mark.multiprocess
def test_resumed_after_epoch_one_ends_where_the_uninterrupted_run_ends(e2e, name):
    """Same epoch-2 numbers (the averaged model's evaluation included), bytes and weights."""
    root = e2e["root"]
    assert_same_run(history(root / f"{name}_resumed"), history(root / name))
    assert e2e["resumed"][name][0]["summary"]["resumed_from"] == [1]
    for r in range(2):
        for run in (name, f"{name}_resumed"):
            assert (root / run / "ckpt/step000000010" / f"rank{r}.pt").is_file()
        a, b = (torch.load(root / run / "ckpt/step000000010" / f"rank{r}.pt", weights_only=False)
                for run in (name, f"{name}_resumed"))
        a, b = (x.get("model") or x["buffers"] for x in (a, b))  # SLAMB: the rank's model; else its buffers
        assert all(torch.allclose(a[k].double(), b[k].double(), rtol=1e-5, atol=1e-6) for k in a)


# ------------------------------------------------------------------------------ the command line


def cli(args, extra_env=None, torchrun=None, timeout=600):
    launcher = [str(Path(sys.executable).with_name("torchrun")), *torchrun] if torchrun else [sys.executable]
    return subprocess.run([*launcher, "-m", "cifar10.train", *args], cwd=ROOT, env=env(**(extra_env or {})),
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.multiprocess
def test_killed_worker_restarts_under_torchrun_and_matches_the_uninterrupted_run(tiny_dir, tmp_path):
    common = [*TINY, *TWO_EPOCHS, *SLAMB_TINY, f"data.dir={tiny_dir}"]
    plain = cli([*common, f"hydra.run.dir={tmp_path / 'plain'}"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    # the console ends with the run's summary line, and train.log holds the console (the workers' lines too): its
    # training time, and the command's wall time, which its start (interpreter, imports, workers) makes longer
    line = plain.stdout.splitlines()[-1]
    assert re.fullmatch(re.escape(summary_line(json.loads((tmp_path / "plain" / "metrics.json").read_text())))
                        + r" of a \d+\.\d s command", line)
    found = re.fullmatch(rf"run {tmp_path / 'plain'}: final_test_top1=\S+ final_test_loss=\S+; \S+ [KM]B sent per "
                         r"worker; training (\d+\.\d) s of a (\d+\.\d) s command", line)
    assert found and float(found[1]) < float(found[2])
    log = (tmp_path / "plain" / "train.log").read_text().splitlines()
    epochs = [text for text in log if text.startswith("epoch=")]
    assert len(epochs) == 2 and epochs == [text for text in plain.stdout.splitlines() if text.startswith("epoch=")]
    assert log[-1] == line

    # rank 1 dies before step 8 (mid epoch 2); torchrun restarts both workers, which resume from epoch 1
    restarted = cli([*common, f"hydra.run.dir={tmp_path / 'restarted'}"],
                    extra_env={"SLAMB_FAULT_AT_STEP": "8", "SLAMB_FAULT_RANK": "1"},
                    torchrun=["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"])
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "[fault injection] rank 1 exits before step 8" in restarted.stdout + restarted.stderr
    summary = json.loads((tmp_path / "restarted" / "metrics.json").read_text())
    assert summary["resumed_from"] == [1] and summary["steps"] == 10
    assert_same_run(history(tmp_path / "restarted"), history(tmp_path / "plain"))
    # under torchrun, rank 0 keeps the console of each of its attempts
    last = (tmp_path / "restarted" / "train.log").read_text().splitlines()[-1]
    assert last.startswith(summary_line(summary) + " of a ")


@pytest.mark.multiprocess
def test_two_point_sweep_gives_two_run_directories_and_a_table(tiny_dir, tmp_path):
    sweep_dir = tmp_path / "sweep"
    done = cli(["--multirun", *TINY, *SLAMB_TINY, "epochs=1", f"data.dir={tiny_dir}", "study=beta3",
                "optimizer.beta3=0.9,0.99", f"hydra.sweep.dir={sweep_dir}"])
    assert done.returncode == 0, done.stderr[-3000:]
    runs = load_runs(sweep_dir)
    assert len(runs) == 2 and len({r["dir"] for r in runs}) == 2
    assert sorted(next(o for o in r["dir"].name.split(",") if o.startswith("optimizer.beta3")) for r in runs) == \
        ["optimizer.beta3=0.9", "optimizer.beta3=0.99"]  # each job's run directory is named by its overrides
    assert all(len(r["history"]) == 1 and r["summary"]["world_size"] == 2 for r in runs)
    written = build_tables(runs, tmp_path / "tables")
    grid = list(csv.DictReader((tmp_path / "tables" / "cifar10_resnet110_beta3.csv").read_text().splitlines()))
    by_beta3 = {r["config"]["optimizer"]["beta3"]: r["summary"]["final_test_top1"] for r in runs}
    bytes_by = {r["config"]["optimizer"]["beta3"]: r["summary"]["bytes_total"]["all"] for r in runs}
    # one epoch under the CIFAR-10 compression warm-up: every step at k = 0.5, all of them raised above 0.1
    assert [(float(g["beta3"]), float(g["compress_ratio"]), float(g["top1"]), float(g["bytes"]),
             float(g["effective_k"]), float(g["warmup_share"])) for g in grid] == \
        [(b, 0.1, by_beta3[b], float(bytes_by[b]), 0.5, 1.0) for b in (0.9, 0.99)]
    assert any(str(p).endswith("_heatmap.png") for p in written["cifar10_resnet110_beta3"])


@pytest.mark.multiprocess
def test_sweep_script_runs_the_sweep_and_writes_its_page(tiny_dir, tmp_path):
    """scripts/sweep_sync_interval.sh as a user runs it (two of its H values, named on the command line, which
    wins over the sweep file's list): one run per value, and make_tables' line of top-1 and bytes by H. At this
    size (a smaller model, one epoch) it is a smoke sweep: its runs go under RUNS/smoke-<digest>/."""
    runs, tables = tmp_path / "runs", tmp_path / "tables"
    done = subprocess.run(["scripts/sweep_sync_interval.sh", *TINY, "epochs=1", f"data.dir={tiny_dir}",
                           "optimizer.min_compress_numel=500", "optimizer.sync_interval=2,5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=env(PY=sys.executable, RUNS=str(runs), TABLES=str(tables), EXPERIMENT="cifar10/slamb"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name[:6] for p in runs.iterdir()] == ["smoke-"]
    found = {r["config"]["optimizer"]["sync_interval"]: r["summary"] for r in load_runs(runs)}
    assert sorted(found) == [2, 5]
    page = (tables / "cifar10_resnet110_sync_interval.md").read_text()
    for h, s in found.items():
        assert f"| {h} | {s['final_test_top1']:.2f} | 1 | " in page
    assert found[2]["bytes_total"]["all"] > found[5]["bytes_total"]["all"]  # more parameter syncs


@pytest.mark.multiprocess
def test_missing_data_is_a_clear_error_from_the_command_line(tmp_path):
    done = cli(["trainer.nproc_per_node=1", "trainer.device=cpu", f"data.dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode != 0
    assert "missing data_batch_1" in done.stderr and "cifar-10-python.tar.gz" in done.stderr


@pytest.mark.multiprocess
def test_data_missing_from_its_directory_is_refused_before_any_worker_in_one_line(tmp_path):
    # the directory exists, its files do not: the launcher reads them (to record what the run reads) before any
    # worker starts. Before: 3 attempts of 2 workers, 146 lines of elastic's reports, exit status 1; then each
    # worker's one line, exit status 65
    done = cli([*TINY, "trainer.max_restarts=2", f"data.dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: CIFAR-10 not found in {tmp_path}: missing data_batch_1"), done.stderr
    assert not (tmp_path / "run" / "meta.json").exists()  # no worker started


def labels_out_of_range(folder: Path) -> Path:
    """The digits in the CIFAR-10 layout with a test label of 12: files the launcher reads whole, which only a
    worker's loading of them refuses."""
    data = cdata.load_cifar10(cdata.write_digits(folder, 64, 32))
    x, y = data["test"]
    y = y.clone()
    y[0] = 12
    return cdata.write_cifar10(folder, data["train"], (x, y), data["classes"])


@pytest.mark.multiprocess
def test_an_error_every_attempt_would_meet_ends_the_first_attempt_in_one_line_whatever_max_restarts(tmp_path):
    data = labels_out_of_range(tmp_path / "data")
    done = cli([*TINY, "trainer.max_restarts=2", f"data.dir={data}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 65, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]
    # the first rank to fail names it; the launcher stops the other
    assert re.match(rf"error: ValueError on rank [01]: {re.escape(str(data / 'test_batch'))}: labels must be in "
                    "0..9, found 0..12", done.stderr), done.stderr
    assert re.search(r"\(not restarted: a restart from the last checkpoint would fail the same way; its traceback: "
                     rf"{re.escape(str(tmp_path / 'run'))}/error\.rank[01]\.txt\)\n$", done.stderr), done.stderr


@pytest.mark.multiprocess
def test_under_torchrun_such_a_worker_says_it_in_one_line_and_exits_65(tmp_path):
    # torchrun restarts every failure: the status is what a scheduler's retry policy can treat as final
    done = cli([*TINY, f"data.dir={labels_out_of_range(tmp_path / 'data')}", f"hydra.run.dir={tmp_path / 'run'}"],
               torchrun=["--standalone", "--nproc-per-node", "2", "--max-restarts", "0"])
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ValueError on rank")]
    assert len(lines) in (1, 2) and all("labels must be in 0..9" in line for line in lines), done.stderr[-3000:]
    assert "exitcode  : 65" in done.stderr, done.stderr[-3000:]  # torchrun's report of the failed worker
    assert "cifar10/data.py" not in done.stderr  # the worker's traceback went to its run directory


# ------------------------------------------------------------------------------- host synchronisations


class HostSyncs:
    """What makes the host wait for a GPU inside the training loop, counted on the CPU: scalar reads
    (``item``, ``bool``, ...), ``tolist``, ops whose output size the host must learn (boolean indexing),
    tensors made from host data, and ``Tensor.to``/``copy_`` calls that block (on a GPU, a blocking
    copy from the host, or to it, waits for the device's queue)."""

    OPS = ("_local_scalar_dense", "lift_fresh", "nonzero", "masked_select")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []
        self.active = False
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if outer.active and func.__name__.split(".")[0] in HostSyncs.OPS:
                    seen.append(func.__name__)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def patch(self, m):
        def counting(name, blocking):
            original = getattr(torch.Tensor, name)

            def wrapper(t, *args, **kwargs):
                if self.active and blocking(args, kwargs):
                    self.seen.append(name)
                return original(t, *args, **kwargs)
            m.setattr(torch.Tensor, name, wrapper)

        counting("tolist", lambda a, k: True)
        counting("to", lambda a, k: not k.get("non_blocking", False) and (
            any(isinstance(v, (torch.device, str)) for v in a) or "device" in k))
        counting("copy_", lambda a, k: not k.get("non_blocking", a[1] if len(a) > 1 else False))


@pytest.mark.e2e
def test_training_steps_make_no_host_synchronisation(tiny_dir, tmp_path, monkeypatch):
    """Inside the per-step loop body (the optimizer's step excluded: its reads are counted in
    tests/test_gpu_paths.py), nothing waits for the device: metrics are summed on the device and read
    at the epoch's end, augmentation draws and batch indices reach the device once per epoch."""
    import harness.loop
    from harness.amp import MixedPrecision

    syncs = HostSyncs()
    steps = harness.loop.Loop.steps

    def watched_steps(self, iterable, total, desc, **kwargs):
        for item in steps(self, iterable, total, desc, **kwargs):
            syncs.active = True  # the loop body runs until it asks for the next item
            yield item
            syncs.active = False
        syncs.active = False

    amp_step = MixedPrecision.step

    def unwatched_step(self, *args, **kwargs):
        was, syncs.active = syncs.active, False
        try:
            return amp_step(self, *args, **kwargs)
        finally:
            syncs.active = was

    monkeypatch.setattr(harness.loop.Loop, "steps", watched_steps)
    monkeypatch.setattr(MixedPrecision, "step", unwatched_step)
    syncs.patch(monkeypatch)
    cfg = compose_cfg(*TINY, "epochs=1", "trainer.nproc_per_node=1", "optimizer=lamb", f"data.dir={tiny_dir}",
                      "trainer.checkpoint.enabled=false")
    with syncs.mode:
        summary = train(cfg, str(tmp_path / "run"))
    assert summary["steps"] == 10
    assert collections.Counter(syncs.seen) == {}
