"""Every pipeline runs every optimizer of the registry (2 gloo workers, tiny models, one launch per
pipeline): the optimizer contract's schedules advance (DGC's density follows its warm-up in all
four), and what a run evaluates is the run's model, the ranks' average."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import slamb
from cifar10.data import load_cifar10, normalize
from cifar10.model import build_model as build_resnet
from harness import check_counts
from swin.tiny import write_tiny_imagenet
from tests import distributed
from tests.test_bert_pretrain import tiny_cfg as bert_cfg, tiny_data  # noqa: F401 (fixture)
from tests.test_cifar10 import TINY as CIFAR_TINY, TWO_EPOCHS, tiny_dir  # noqa: F401 (fixture)
from tests.test_configs import compose_cfg
from tests.test_squad import bert_dir, compose_squad, squad_json, write_json  # noqa: F401 (fixture)
from tests.test_swin import TINY as SWIN_TINY, compose_swin

NAMES = sorted(slamb.OPTIMIZERS)
SLAMB_TINY = ["optimizer.min_compress_numel=500", "optimizer.sync_interval=3"]
# the Swin and SQuAD recipes set Adam's betas / eps at the root: another optimizer drops them by name
NO_ADAM = ("sgd", "dgc", "jointspar", "jointspar_lars", "powersgd")


def _train_all(rank, world, module, jobs):
    import importlib

    train = importlib.import_module(module).train
    return [train(cfg, run_dir) for cfg, run_dir in jobs]


def _launch(module: str, cfgs: dict, root: Path) -> dict:
    jobs = [(cfg, str(root / name)) for name, cfg in cfgs.items()]
    results = distributed.run(_train_all, 2, module, jobs)
    return {name: {"cfg": cfg, "dir": root / name, "summaries": [r[i] for r in results]}
            for i, (name, cfg) in enumerate(cfgs.items())}


@pytest.fixture(scope="module")
def cifar10_runs(tiny_dir, tmp_path_factory):  # noqa: F811
    # SLAMB with no model sync after the first step: the ranks drift apart for the whole run
    extra = {"slamb": ["optimizer.min_compress_numel=500", "optimizer.sync_interval=1000"]}
    cfgs = {n: compose_cfg(*CIFAR_TINY, *TWO_EPOCHS, f"optimizer={n}", f"data.dir={tiny_dir}", *extra.get(n, []))
            for n in NAMES}
    return _launch("cifar10.train", cfgs, tmp_path_factory.mktemp("cifar10_runs"))


@pytest.fixture(scope="module")
def swin_runs(tmp_path_factory):
    data = write_tiny_imagenet(tmp_path_factory.mktemp("imagenet"))
    cfgs = {n: compose_swin(*SWIN_TINY, f"optimizer={n}", f"data.dir={data}", "trainer.precision=fp32",
                            *(["~optimizer.betas", "~optimizer.eps"] if n in NO_ADAM else []),
                            *(SLAMB_TINY if n == "slamb" else [])) for n in NAMES}
    return _launch("swin.train", cfgs, tmp_path_factory.mktemp("swin_runs"))


@pytest.fixture(scope="module")
def bert_runs(tiny_data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("bert_runs")
    cfgs = {n: bert_cfg(tiny_data, root / n, f"optimizer={n}", "optimizer.lr=0.01", "trainer.precision=fp32",
                        *(SLAMB_TINY if n == "slamb" else [])) for n in NAMES}
    return _launch("bert.train", cfgs, root)


@pytest.fixture(scope="module")
def squad_runs(bert_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("squad_runs")
    squad = write_json(root / "squad.json", squad_json())
    cfgs = {n: compose_squad(f"model.dir={bert_dir}", f"data.train_file={squad}", f"data.dev_file={squad}",
                             "data.max_length=48", "data.doc_stride=16", "data.max_query_length=16",
                             "data.global_batch=4", "data.eval_batch=5", "epochs=2",
                             "trainer.progress=false", "trainer.threads_per_worker=1", "trainer.device=cpu",
                             f"optimizer={n}",
                             *(["~optimizer.eps"] if n in NO_ADAM else []), *(SLAMB_TINY if n == "slamb" else []))
            for n in NAMES}
    return _launch("squad_finetune.train", cfgs, root)


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


HEADLINE = {"cifar10": ("test_loss", "test_top1"), "swin": ("test_loss", "test_top1", "test_top5"),
            "bert": (), "squad": ("exact_match", "f1")}


@pytest.mark.multiprocess  # the first test of a pipeline starts its module fixture's 2-worker runs
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("pipeline", list(HEADLINE))
def test_every_pipeline_runs_every_optimizer_and_its_epoch_schedule(request, pipeline, name):
    run = request.getfixturevalue(f"{pipeline}_runs")[name]
    rows, (rank0, rank1) = history(run["dir"]), run["summaries"]
    summary = json.loads((run["dir"] / "metrics.json").read_text())
    assert summary["optimizer"] == name and summary["world_size"] == 2
    assert rank0["bytes_total"] == rank1["bytes_total"] == summary["bytes_total"]  # every rank sends as much
    assert rows[-1]["bytes_cum/all"] == summary["bytes_total"]["all"]
    assert all(np.isfinite(r["train_loss" if pipeline != "bert" else "loss"]) for r in rows)
    local = {f"{k}_local" for k in HEADLINE[pipeline]}
    params_differ = slamb.create_optimizer(name, torch.nn.Linear(2, 2)).params_differ
    for r in rows:
        assert all(np.isfinite(r[k]) for k in HEADLINE[pipeline])
        assert local <= set(r) if params_differ else not local & set(r)  # local models beside the average
    # the epoch of each logged period's last step: an epoch per row, or BERT's steps over steps_per_epoch
    if pipeline == "bert":
        assert summary["steps_per_epoch"] == 1  # 16 examples, global batch 16
        epochs = [r["step"] - 1 for r in rows]
        assert epochs == [1, 3, 5]
    else:
        epochs = [r["epoch"] - 1 for r in rows]
        assert epochs == [0, 1]
    o = run["cfg"]["optimizer"]
    if name == "dgc":  # the warm-up densities, then the target
        warmup = o["warmup_densities"]
        assert [r["density"] for r in rows] == [warmup[e] if e < len(warmup) else o["density"] for e in epochs]
        assert len({r["density"] for r in rows}) == len(rows)
    if name == "slamb":
        assert [r["compress_ratio"] for r in rows] == [o["compress_ratio"]] * len(rows)
        assert summary["bytes_total"]["momentum"] > 0 and "grads" not in summary["bytes_total"]


@pytest.mark.multiprocess
def test_the_evaluated_model_is_the_ranks_average(cifar10_runs, tiny_dir):  # noqa: F811
    """SLAMB without model syncs: the logged test metrics are an independent evaluation of the mean of
    the two ranks' final models (BatchNorm statistics included), not those of the local models."""
    run = cifar10_runs["slamb"]
    last = history(run["dir"])[-1]
    ckpt = run["dir"] / "ckpt" / json.loads((run["dir"] / "ckpt" / "latest.json").read_text())["dir"]
    r0, r1 = (torch.load(ckpt / f"rank{r}.pt", weights_only=False)["model"] for r in (0, 1))
    assert not torch.allclose(r0["fc.weight"], r1["fc.weight"])  # the ranks drifted apart
    assert not torch.allclose(r0["bn.running_mean"], r1["bn.running_mean"])
    model = build_resnet(run["cfg"]["model"])
    model.load_state_dict({k: (v + r1[k]) / 2 if v.is_floating_point() else v for k, v in r0.items()})
    x, y = load_cifar10(tiny_dir)["test"]
    with torch.no_grad():
        logits = model.eval()(normalize(x)).float()
    assert last["test_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    assert last["test_top1"] == pytest.approx(100.0 * (logits.argmax(1) == y).float().mean().item())
    assert last["test_loss_local"] != pytest.approx(last["test_loss"], rel=1e-4)


def exported(run: dict, build) -> torch.nn.Module:
    """The model a run exported, loaded into a freshly built model of its config (strictly: every key)."""
    folder = run["dir"] / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config == run["cfg"]["model"]
    model = build(config)
    model.load_state_dict(torch.load(folder / "model.pt"), strict=True)
    return model.eval()


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_cifar10_exports_the_model_it_evaluated(cifar10_runs, tiny_dir, name):  # noqa: F811
    """The export is the ranks' average (BatchNorm statistics included) that the last evaluation scored: one
    process scores the same test top-1 exactly, from the file alone."""
    run = cifar10_runs[name]
    model = exported(run, build_resnet)
    x, y = load_cifar10(tiny_dir)["test"]
    with torch.no_grad():
        logits = model(normalize(x)).float()
    last = history(run["dir"])[-1]
    assert 100.0 * (logits.argmax(1) == y).sum().item() / len(y) == last["test_top1"]
    assert F.cross_entropy(logits, y).item() == pytest.approx(last["test_loss"], rel=1e-5)
    assert run["summaries"][0]["model_dir"] == str(run["dir"] / "model")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_swin_exports_the_model_it_evaluated(swin_runs, name):
    """Swin's export loads into timm's model of the config and scores the run's last validation top-1 and top-5
    exactly, in one process through the pipeline's own validation data."""
    from harness import DistEnv
    from harness.amp import MixedPrecision
    from swin.data import build_loaders
    from swin.model import build_model as build_swin, image_size
    from swin.train import evaluate

    run = swin_runs[name]
    model = exported(run, build_swin)
    one = DistEnv(0, 1, 0, 1, torch.device("cpu"))
    cfg = run["cfg"]
    _, _, val = build_loaders(cfg["data"], image_size(model), cfg["model"]["num_classes"], one, seed=cfg["seed"])
    scores = evaluate(model, val, one, MixedPrecision("fp32", one.device))
    last = history(run["dir"])[-1]
    assert (scores["test_top1"], scores["test_top5"]) == (last["test_top1"], last["test_top5"])
    assert scores["test_loss"] == pytest.approx(last["test_loss"], rel=1e-5)


def test_counts_below_one_are_clear_errors():
    cfg = {"epochs": 0, "trainer": {"checkpoint": {"every": 2.5}}}
    with pytest.raises(ValueError, match=r"invalid epochs=0: must be an integer >= 1"):
        check_counts(cfg, "epochs")
    with pytest.raises(ValueError, match=r"invalid trainer.checkpoint.every=2.5: must be an integer >= 1"):
        check_counts(cfg, "trainer.checkpoint.every")
