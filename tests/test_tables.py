"""Results pages (harness.tables, harness.sweeps) say what ran and cannot mislead: each page names the model, data
by content, workers, length, precision, hardware and commit from the runs' own records; published numbers stand
beside ours only where every run is its recipe at the recipe's size on the published data, else apart with the
reasons; rows and baselines pool runs of one identity only (the data's content included); a sweep's LAMB
reference is its own identity, each seed once; a sweep cell gives the compression ratio its steps used and the
page warns where the warm-up decided it; every pipeline's sweep gets its page; the committed results/ take no
smoke run.

The run directories are written by the harness's own :class:`harness.run.RunLogger` (config.yaml, meta.json,
metrics.jsonl, metrics.json) and :mod:`harness.identity` (identity.json: the fingerprints of data written in the
real on-disk formats by the pipelines' own writers, and the departures harness.recipe computes from the configs),
with configs composed from configs/ as the pipelines compose them."""
from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

import cifar10.data as cifar_data
import squad_finetune.data as squad_data
from harness import identity
from harness.distributed import DistEnv
from harness.figures import save_figure, save_png
from harness.recipe import departures
from harness.records import load_runs
from harness.run import RunLogger, hardware
from harness.sweeps import TOP1, heatmap_figure, sweep_figure
from harness.tables import build_tables
from slamb.schedules import compression_ratio
from squad_finetune.tiny import documented_functions, make_squad
from tests.test_configs import EXPERIMENTS, compose_root, experiment_root

CPU1 = DistEnv(0, 1, 0, 1, torch.device("cpu"))
ROOT = Path(__file__).resolve().parents[1]


def write_run(root: Path, name: str, cfg: dict, history: list[dict], ran_on: dict | None = None, **summary) -> Path:
    """A finished run directory as the harness leaves it: the logger's config and metadata, a metrics line per
    period, the summary's fields as :meth:`harness.Loop.finish` writes them (``summary`` adds or replaces), and
    ``ran_on`` as its identity.json (None: a run recorded before runs recorded one)."""
    d = root / name
    log = RunLogger(d, cfg, CPU1, progress=False)
    for line in history:
        log.log(line)
    steps = sum(h.get("period_steps", 0) for h in history)
    last = history[-1] if history else {}
    length = {"epochs": cfg["epochs"]} if "epochs" in cfg else {}  # a step-based run's summary has no epochs
    top1 = {"final_test_top1": last["test_top1"], "best_test_top1": last["test_top1"]} if "test_top1" in last else {}
    log.finish({"name": cfg["name"], "optimizer": cfg["optimizer"]["name"], "world_size": 4, "global_batch": 256,
                **length, "steps": steps, "params": 75_290, "compressed_share": None, **top1,
                "bytes_total": {"all": last.get("bytes_cum/all", 0)}, "wall_time_s": 10.0,
                "mean_step_time_s": 0.1, "mean_optimizer_time_s": None, "resumed_from": [], "run_dir": str(d),
                "paper": cfg.get("paper"), **summary})
    if ran_on is not None:
        identity.save(d, ran_on)
    return d


def epochs_of(cfg: dict, top1: float, bytes_per_epoch: int = 1_000_000, steps: int = 6) -> list[dict]:
    """One metrics line per epoch, as the CIFAR-10 loop logs them; SLAMB's lines carry the k each epoch used
    (the compression warm-up's, as ``begin_epoch`` sets it)."""
    o = cfg["optimizer"]
    out = []
    for e in range(cfg["epochs"]):
        line = {"epoch": e + 1, "step": steps * (e + 1), "test_top1": top1 - (cfg["epochs"] - 1 - e),
                "bytes_cum/all": bytes_per_epoch * (e + 1), "period_steps": steps}
        if o["name"] == "slamb":
            line["compress_ratio"] = compression_ratio(e, o["compress_ratio"], o["compression_warmup"])
        out.append(line)
    return out


def cifar10(*overrides) -> dict:
    return compose_root("cifar10", *overrides, "trainer.nproc_per_node=4")


def launched(root: str, experiment: str, *overrides, inputs: dict) -> tuple[dict, dict]:
    """A run's resolved config and its identity.json as the launcher records them: the fingerprints of its
    ``inputs`` and the settings in which it departs from ``experiment``'s recipe (``trainer.nproc_per_node=4``
    for the CIFAR-10 pipeline unless the overrides say otherwise, as the tests' other runs)."""
    if root == "cifar10" and not any(o.startswith("trainer.nproc_per_node=") for o in overrides):
        overrides = (*overrides, "trainer.nproc_per_node=4")
    recipe = {"experiment": experiment,
              "departures": {k: list(v) for k, v in departures(root, experiment, overrides).items()}}
    return compose_root(root, f"experiment={experiment}", *overrides), identity.run_identity(inputs, recipe)


def facts(page: str) -> dict[str, str]:
    """The page's "What ran" list."""
    return dict(re.findall(r"^- (\w+): (.*)$", page, flags=re.M))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Data in the CIFAR-10 layout, by the pipeline's writer: the digits (64 and 256 training images), and the same
    layout without the digits' mark."""
    root = tmp_path_factory.mktemp("data")
    made = {"digits64": cifar_data.write_digits(root / "digits64", 64, 32),
            "digits256": cifar_data.write_digits(root / "digits256", 256, 32)}
    plain = cifar_data.load_cifar10(made["digits64"])
    made["plain"] = cifar_data.write_cifar10(root / "plain", plain["train"], plain["test"], plain["classes"])
    return made


@pytest.fixture
def published_cifar10(tmp_path, monkeypatch) -> Path:
    """A CIFAR-10-layout folder whose files' MD5s this test declares CIFAR-10's (the product's list patched here,
    never in the product): what a real CIFAR-10 folder is to the pipeline."""
    folder = cifar_data.write_digits(tmp_path / "cifar-10-batches-py", 128, 64)
    md5 = {name: identity.md5_file(folder / name) for name in cifar_data.FILES}
    monkeypatch.setattr(cifar_data, "PUBLISHED_MD5", md5)
    return folder


def data_line(folder: Path) -> str:
    fp = cifar_data.fingerprint(folder)
    return f"{fp['name']}, digest {fp['digest'][:12]}"


# ------------------------------------------------------------------------------------------ what ran


def test_run_metadata_records_the_hardware_and_the_commit(tmp_path):
    RunLogger(tmp_path, {"name": "t", "optimizer": {"name": "sgd"}}, CPU1, progress=False)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", meta["git"]["commit"]) and isinstance(meta["git"]["dirty"], bool)
    assert meta["hardware"] == hardware(torch.device("cpu"))
    assert re.fullmatch(r"CPU \(.+, \d+ cores\)", meta["hardware"])


def test_data_is_named_by_content_and_the_digits_by_their_writers_mark(folders, published_cifar10):
    digits = cifar_data.fingerprint(folders["digits64"])
    assert digits["dataset"] is None and digits["counts"] == {"train": 64, "test": 32, "classes": 10}
    assert digits["name"] == ("scikit-learn's 8x8 digits in the CIFAR-10 layout (64 training / 32 test images, "
                              "10 classes), not CIFAR-10")
    plain = cifar_data.fingerprint(folders["plain"])  # the same images, without the digits' mark
    assert plain["name"].startswith("a CIFAR-10-layout folder (64 training / 32 test images, 10 classes), not CIFAR-10")
    assert plain["digest"] != digits["digest"] != cifar_data.fingerprint(folders["digits256"])["digest"]
    real = cifar_data.fingerprint(published_cifar10)
    assert real["dataset"] == "CIFAR-10" and real["name"].startswith("CIFAR-10 (128 training / 64 test images")
    # kept beside the data and made again when a file changes
    assert (published_cifar10 / ".slamb-fingerprint-cifar10.json").exists()
    with open(published_cifar10 / "test_batch", "ab") as f:
        f.write(b"\0")
    assert cifar_data.fingerprint(published_cifar10)["dataset"] is None


def test_squad_files_are_squad_v11_only_where_their_md5_is_the_published_one(tmp_path, monkeypatch):
    train, dev = make_squad(documented_functions()[:40])
    for name, obj in (("train-v1.1.json", train), ("dev-v1.1.json", dev)):
        (tmp_path / name).write_text(json.dumps(obj))
    tiny = squad_data.fingerprint(tmp_path / "dev-v1.1.json")
    assert tiny["dataset"] is None and tiny["counts"] == {"questions": 40, "articles": 1}
    assert tiny["name"] == ("questions on the docstrings of Python's standard library in the SQuAD format "
                            "(40 questions in 1 article), not SQuAD v1.1's")
    md5 = identity.md5_file(tmp_path / "dev-v1.1.json")
    monkeypatch.setattr(squad_data, "PUBLISHED_MD5", {md5: "SQuAD v1.1 dev set"})
    (tmp_path / ".slamb-fingerprint-squad-dev-v1.1.json").unlink()  # made before the patch
    assert squad_data.fingerprint(tmp_path / "dev-v1.1.json")["name"] == \
        "SQuAD v1.1 dev set (40 questions in 1 article; its MD5 is the published one)"


def test_a_smoke_run_of_the_paper_script_stands_apart_from_the_published_numbers_with_its_reasons(tmp_path, folders):
    """The per-paper script's SLAMB row at smoke size (ResNet-110, 1 worker, 1 epoch on 64 digits): the page names
    the digits for what they are and gives the published top-1 apart, with why this is not the paper's setting."""
    runs = tmp_path / "runs"
    small = ("epochs=1", "data.micro_batch=32", "trainer.nproc_per_node=1", f"data.dir={folders['digits64']}")
    cfg, ran_on = launched("cifar10", "cifar10/slamb", *small,
                           inputs={"data.dir": cifar_data.fingerprint(folders["digits64"])})
    write_run(runs, "slamb", cfg, epochs_of(cfg, 3.12, steps=2), ran_on, world_size=1)
    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "cifar10_resnet110.md").read_text()
    assert facts(page)["data"] == data_line(folders["digits64"])
    assert "published top-1 |" not in page.split("Not the paper's setting")[0]
    assert (f"Not the paper's setting (1 epoch of 200; 1 worker per node of 4; data.micro_batch 32 (the recipe's "
            f"256); data: {data_line(folders['digits64'])}), so the published top-1 stand apart below") in page
    assert "| Optimizer | published top-1 (%) |\n|---|---|\n| SLAMB | 93.21 |" in page


def test_runs_at_the_recipe_on_cifar10_get_the_published_numbers_beside_theirs(tmp_path, published_cifar10, folders):
    runs = tmp_path / "runs"
    ran_on = {"data.dir": cifar_data.fingerprint(published_cifar10)}
    for row, top1 in (("sgd", 91.0), ("lamb", 93.0)):
        cfg, record = launched("cifar10", f"cifar10/{row}", f"data.dir={published_cifar10}", inputs=ran_on)
        assert record["recipe"]["departures"] == {}
        write_run(runs, row, cfg, epochs_of(cfg, top1, steps=49), record)
    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "cifar10_resnet110.md").read_text()
    assert facts(page)["model"] == "resnet_cifar (depth 110, width 16)"
    assert facts(page)["data"] == data_line(published_cifar10) and "CIFAR-10 (128 training" in facts(page)["data"]
    assert "| Optimizer | configuration | top-1 | published top-1 | best top-1 |" in page
    assert re.search(r"^\| LAMB \| [^|]* \| 93\.00 \| 93\.15 \| 93\.00 \|", page, flags=re.M)
    assert "Published top-1 (the column beside ours), from the SLAMB authors' README" in page
    assert "Not the paper's setting" not in page

    # the recipe on other data, and a run recorded before identity.json: neither stands beside the paper's number
    for name, folder, record in (("digits", folders["digits256"], True), ("old", published_cifar10, False)):
        out = tmp_path / name
        cfg, ran = launched("cifar10", "cifar10/lamb", f"data.dir={folder}",
                            inputs={"data.dir": cifar_data.fingerprint(folder)})
        write_run(out, "lamb", cfg, epochs_of(cfg, 93.0, steps=49), ran if record else None)
        build_tables(load_runs(out), tmp_path / f"{name}_out")
        page = (tmp_path / f"{name}_out" / "cifar10_resnet110.md").read_text()
        assert "published top-1 |" not in page.split("Not the paper's setting")[0]
    assert f"Not the paper's setting (data: {data_line(folders['digits256'])})" in \
        (tmp_path / "digits_out" / "cifar10_resnet110.md").read_text()
    old = (tmp_path / "old_out" / "cifar10_resnet110.md").read_text()
    assert "Not the paper's setting (a run recorded before runs recorded their data and recipe" in old
    assert facts(old)["data"] == "cifar10 (named by its config: the run predates data fingerprints)"


def test_rows_pool_runs_of_one_identity_only_and_name_what_differs(tmp_path, folders):
    """LAMB on 64 digits (2 seeds, 2 steps an epoch) and on 256 (1 seed, 8 steps): two rows, never one."""
    runs = tmp_path / "runs"
    for name, folder, seeds, top1 in (("small", "digits64", (0, 1), 4.69), ("large", "digits256", (0,), 30.0)):
        for seed in seeds:
            cfg, ran_on = launched("cifar10", "study/digits_lamb", "epochs=1", f"seed={seed}",
                                   f"data.dir={folders[folder]}",
                                   inputs={"data.dir": cifar_data.fingerprint(folders[folder])})
            write_run(runs, f"{name}{seed}", cfg, epochs_of(cfg, top1 + seed), ran_on)
    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "study_digits_resnet8.md").read_text()
    rows = re.findall(r"^\| LAMB \| (.*?) \| ([\d.]+(?: ± [\d.]+)?) \|.* \| (\d+) \|$", page, flags=re.M)
    assert sorted((top1, n) for _, top1, n in rows) == [("30.00", "1"), ("5.19 ± 0.71", "2")]
    assert {label.split("; ")[-1] for label, _, _ in rows} == {f"data: {data_line(folders[f])}"
                                                              for f in ("digits64", "digits256")}


def squad_run(root: Path, name: str, model_dir: Path, files: Path, *overrides, f1: float = 88.0) -> Path:
    inputs = {"data.train_file": squad_data.fingerprint(files / "train-v1.1.json"),
              "data.dev_file": squad_data.fingerprint(files / "dev-v1.1.json")}
    cfg, ran_on = launched("squad", "squad/lamb", f"model.dir={model_dir}", f"data.train_file={files}/train-v1.1.json",
                           f"data.dev_file={files}/dev-v1.1.json", *overrides, inputs=inputs)
    return write_run(root, name, cfg, [{"epoch": 1, "step": 5, "f1": f1, "exact_match": f1 - 8, "period_steps": 5}],
                     ran_on, f1=f1, exact_match=f1 - 8, model_dir=str(model_dir))


def phase2_run(root: Path, *overrides) -> Path:
    """A BERT-Large phase-2 LAMB run that saved its model (the summary of 2 logged steps)."""
    bert, ran_on = launched("bert", "bert/phase2_lamb", *overrides, inputs={})
    return write_run(root, "bert_phase2_lamb", bert, [{"step": 2, "loss": 3.0, "period_steps": 2}], ran_on,
                     final_loss=3.0, final_mlm_acc=40.0, final_nsp_acc=80.0, final_val_mlm_loss=None,
                     mean_seqs_per_s=10.0, seq_len=512, steps=2)


def test_squad_pages_set_the_lamb_papers_f1_beside_only_a_bert_large_at_its_recipe_on_squad(tmp_path, monkeypatch):
    files = tmp_path / "squad"
    files.mkdir()
    for name, obj in zip(("train-v1.1.json", "dev-v1.1.json"), make_squad(documented_functions()[:40])):
        (files / name).write_text(json.dumps(obj))
    published = {identity.md5_file(files / "train-v1.1.json"): "SQuAD v1.1 training set",
                 identity.md5_file(files / "dev-v1.1.json"): "SQuAD v1.1 dev set"}
    monkeypatch.setattr(squad_data, "PUBLISHED_MD5", published)
    runs = tmp_path / "runs"
    pretrained = phase2_run(runs)  # at its recipe's size
    squad_run(runs, "squad_lamb", pretrained / "model", files)
    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "squad_v1.1.md").read_text()
    # the page names no folder of the machine: a run's model from its runs/ folder on
    assert facts(page)["model"].startswith(f"the model in runs/{pretrained.name}/model (bert_large (")
    assert str(tmp_path) not in page
    assert "SQuAD v1.1 training set (40 questions" in facts(page)["data"]
    assert "| Pre-training optimizer | F1 published | EM published | F1 ours |" in page
    assert "| LAMB | 90.584 | - | 88.00 | 80.00 |" in page
    assert "from the LAMB paper (You et al., ICLR 2020), Table 1" in page and "91.345" not in page

    # the BERT it fine-tunes was pre-trained for 2 steps of its recipe's 1,563: apart, with that reason
    short = tmp_path / "short"
    squad_run(short, "squad_lamb", phase2_run(short, "steps=2") / "model", files)
    build_tables(load_runs(short), tmp_path / "short_out")
    page = (tmp_path / "short_out" / "squad_v1.1.md").read_text()
    assert "Not the paper's setting (pre-trained with 2 steps of 1,563)" in page
    assert "| Pre-training optimizer | published F1 | published EM |\n|---|---|---|\n| LAMB | 90.584 | - |" in page
    assert "F1 published" not in page

    tiny = tmp_path / "tiny"  # a smoke run: a model of its own (no run among these saved it), the tiny set
    squad_run(tiny, "squad_lamb", tmp_path / "tiny_bert", files, "data=squad_tiny")
    build_tables(load_runs(tiny), tmp_path / "tiny_out")
    page = (tmp_path / "tiny_out" / "squad_v1.1.md").read_text()
    assert facts(page)["model"] == "the model in .../tiny_bert"  # outside any runs/ folder: its name only
    assert "Not the paper's setting (" in page and "a model that no run among these pre-trained" in page


COUNTED = re.compile(r"\b(\d[\d,]*|one|two|three|four|five|six|seven|eight|nine|ten)\s+(gloo\s+|CPU\s+)?"
                     r"(epochs?|workers?|seeds?|steps?)\b", re.I)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_static_notes_state_no_run_facts_and_published_numbers_name_their_source(experiment):
    """A note under a table is the same for every run of its config, so it must not count what the runs did
    (their epochs, workers, seeds: the page computes those); published numbers come with their source."""
    paper = compose_root(experiment_root(experiment), f"experiment={experiment}").get("paper") or {}
    assert not COUNTED.search(paper.get("note") or ""), paper["note"]
    assert "task" not in paper
    if any(paper.get(k) is not None for k in ("top1", "f1", "exact_match")):
        assert paper.get("source") and paper.get("setting")
        # the data the published numbers belong to, by a name a pipeline gives data whose content is that set
        named = {"CIFAR-10", "ImageNet-1k", *squad_data.PUBLISHED_MD5.values()}
        assert paper["setting"]["datasets"] and set(paper["setting"]["datasets"]) <= named
    if paper.get("table") == "cifar10_resnet110":
        assert "authors' README" in paper["source"] and "Table 1" not in paper["source"]
    if paper.get("f1") is not None:
        assert paper["f1"] == 90.584 and "64k/32k" in paper["source"]


# ------------------------------------------------------------------------------------------ sweeps


def digits(experiment: str, *overrides) -> dict:
    return cifar10(f"experiment=study/{experiment}", *overrides)


def test_the_sweeps_lamb_reference_is_its_configuration_apart_from_the_optimizer_each_seed_once(tmp_path):
    runs = tmp_path / "runs"
    two = ["epochs=2"]
    for seed, top1 in enumerate([96.0, 98.0]):
        cfg = digits("digits_lamb", *two, f"seed={seed}")
        write_run(runs, f"lamb{seed}", cfg, epochs_of(cfg, top1))
    cfg = digits("digits_lamb", *two, "seed=0")
    write_run(runs, "lamb0_again", cfg, epochs_of(cfg, 96.0))  # seed 0 run a second time: counted once
    other = digits("digits_lamb", *two, "schedule.milestones=[1]", "seed=3")  # another schedule: not the reference
    write_run(runs, "lamb_other_schedule", other, epochs_of(other, 50.0))
    for h in (5, 10):
        for seed in (0, 1):
            cfg = digits("digits_slamb_v1", *two, "sweep=sync_interval", f"optimizer.sync_interval={h}", f"seed={seed}")
            write_run(runs, f"h{h}_{seed}", cfg, epochs_of(cfg, 96.5 + seed / 2, bytes_per_epoch=500_000 // h))
    messages = []
    build_tables(load_runs(runs, log=messages.append), tmp_path / "out")
    page = (tmp_path / "out" / "study_digits_resnet8_sync_interval.md").read_text()
    assert "LAMB's top-1 in the same configuration apart from the optimizer: 97.00 ± 1.41 (n = 2)" in page
    assert "| 5 | 96.75 ± 0.35 | 2 | 200 KB | 0.5 (100% raised) | yes |" in page
    study = (tmp_path / "out" / "study_digits_resnet8.md").read_text()
    assert re.search(r"^\| LAMB \| .* \| 97\.00 ± 1\.41 \| .* \| 2 \|$", study, flags=re.M)


def test_sweep_cells_give_the_k_their_steps_used_and_warn_where_the_warm_up_decided_it(tmp_path):
    """4 epochs under the CIFAR-10 warm-up (0.5, 0.5, 0.2, 0.1, ...): k = 0.01 trains at 0.5, 0.5, 0.2, 0.1
    (mean 0.325, every step raised), k = 0.2 at 0.5, 0.5, 0.2, 0.2 (mean 0.35, half the steps raised)."""
    runs = tmp_path / "runs"
    for k in (0.01, 0.2):
        for seed in (0, 1):
            cfg = digits("digits_slamb_v1", "epochs=4", "sweep=beta3_compress_ratio", f"optimizer.compress_ratio={k}",
                         f"seed={seed}")
            write_run(runs, f"k{k}_{seed}", cfg, epochs_of(cfg, 95.0 + seed, bytes_per_epoch=int(2e6 * k)))
    build_tables(load_runs(runs), tmp_path / "out")
    name = "study_digits_resnet8_beta3_compress_ratio"
    page = (tmp_path / "out" / f"{name}.md").read_text()
    assert "| 0.99 | 0.325 (100% raised) | 0.35 (50% raised) |" in page
    assert ("**Warning**: in 2 of 2 cells the compression warm-up (`optimizer.compression_warmup`) held k above the "
            "cell's own for more than 10% of the steps (up to 100%)") in page
    rows = list(csv.DictReader((tmp_path / "out" / f"{name}.csv").read_text().splitlines()))
    assert [(float(r["compress_ratio"]), float(r["effective_k"]), float(r["warmup_share"])) for r in rows] == \
        [(0.01, 0.325, 1.0), (0.2, pytest.approx(0.35), 0.5)]

    long = tmp_path / "long"  # 40 epochs at k = 0.1: the warm-up raises 3 of them (7.5%), no warning
    for h in (5, 10):
        cfg = digits("digits_slamb_v1", "sweep=sync_interval", f"optimizer.sync_interval={h}")
        write_run(long, f"h{h}", cfg, epochs_of(cfg, 97.0))
    build_tables(load_runs(long), tmp_path / "long_out")
    page = (tmp_path / "long_out" / "study_digits_resnet8_sync_interval.md").read_text()
    assert f"| 5 | 97.00 | 1 | 40 MB | {4.9 / 40:.3g} ({3 / 40:.0%} raised) |" in page and "**Warning**" not in page


def drawn_ticks(axis) -> list:
    """The tick labels an axis draws: those of its ticks inside the view (matplotlib keeps others, undrawn)."""
    lo, hi = sorted(axis.get_view_interval())
    return [t.label1 for t in axis.get_major_ticks() + axis.get_minor_ticks()
            if lo <= t.get_loc() <= hi and t.label1.get_visible() and t.label1.get_text()]


def texts_inside(fig) -> None:
    """Every title, axis label, drawn tick label, annotation and legend entry lies inside the figure, and no two
    x tick labels of an axes overlap: what a small grid must keep legible."""
    canvas = FigureCanvasAgg(fig)  # the figure as saved (its layout kept), on a canvas of its own once closed
    canvas.draw()
    renderer, frame = canvas.get_renderer(), fig.bbox
    for ax in fig.axes:
        legend = ax.get_legend()
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts, *drawn_ticks(ax.xaxis), *drawn_ticks(ax.yaxis),
                 *(legend.get_texts() if legend else [])]
        for text in (t for t in texts if t.get_visible() and t.get_text()):
            box = text.get_window_extent(renderer)
            assert (box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1
                    and box.y1 <= frame.y1 + 1), f"{text.get_text()!r} runs off the figure"
        boxes = [t.get_window_extent(renderer) for t in drawn_ticks(ax.xaxis)]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), "x tick labels overlap"


@pytest.mark.parametrize("betas, ks", [([0.99], [0.1]), ([0.99], [0.01, 0.05, 0.1, 0.2]), ([0.9, 0.99, 0.999], [0.1])])
def test_heat_maps_of_small_grids_keep_their_titles_and_labels_on_the_figure(tmp_path, betas, ks):
    name = "study_digits_resnet8_beta3_compress_ratio"
    grid = {(b, k): {"value": (97.0 + k, 0.5, 2), "bytes": 2e7 * k} for b in betas for k in ks}
    for what in (TOP1, None):  # the metric, the bytes
        fig = heatmap_figure(name, betas, ks, grid, what)
        save_png(fig, tmp_path / f"{what.slug if what else 'bytes'}.png")
        texts_inside(fig)


def test_every_sweep_draws_top1_against_bytes_and_the_h_sweep_by_h(tmp_path):
    runs = tmp_path / "runs"
    for seed, top1 in enumerate([96.0, 98.0]):
        cfg = digits("digits_lamb", "epochs=2", f"seed={seed}")
        write_run(runs, f"lamb{seed}", cfg, epochs_of(cfg, top1, bytes_per_epoch=4_000_000))
    for h in (5, 10, 20, 50):
        cfg = digits("digits_slamb_v1", "epochs=2", "sweep=sync_interval", f"optimizer.sync_interval={h}")
        write_run(runs, f"h{h}", cfg, epochs_of(cfg, 97.0 - h / 50, bytes_per_epoch=1_000_000 // h))
    for b3 in (0.9, 0.99):
        cfg = digits("digits_slamb_v1", "epochs=2", "sweep=beta3_compress_ratio", f"optimizer.beta3={b3}")
        write_run(runs, f"b{b3}", cfg, epochs_of(cfg, 96.0))
    written = build_tables(load_runs(runs), tmp_path / "out")
    t = "study_digits_resnet8"
    line = (tmp_path / "out" / f"{t}_sync_interval.md").read_text()
    assert f"![top-1 by sync_interval and against bytes]({t}_sync_interval_top1.png)" in line
    assert (tmp_path / "out" / f"{t}_sync_interval_top1.png").stat().st_size > 10_000
    grid = (tmp_path / "out" / f"{t}_beta3_compress_ratio.md").read_text()
    assert f"]({t}_beta3_compress_ratio_top1_vs_bytes.png)" in grid
    assert {p.name for p in written[f"{t}_beta3_compress_ratio"]} >= {
        f"{t}_beta3_compress_ratio_top1_vs_bytes.png", f"{t}_beta3_compress_ratio_heatmap.png"}
    # the figures themselves, as the pages draw them: every text on the figure
    lamb = {"value": (97.0, 1.41, 2), "bytes": 8e6}
    cells = {(h,): {"value": (97.0 - h / 50, 0.3, 2), "bytes": 2e6 / h} for h in (5, 10, 20, 50)}
    for grid, setting in ((cells, "sync_interval"), ({(0.9, 0.1): cells[(5,)], (0.99, 0.1): cells[(10,)]}, None)):
        fig = sweep_figure(f"{t}_beta3_compress_ratio", grid, lamb, TOP1, setting)
        save_figure(fig, fig.axes, tmp_path / "sweep.png", legend_size=7)
        texts_inside(fig)


def test_a_sweeps_lamb_line_is_lamb_on_the_same_data(tmp_path, folders):
    """LAMB ran on 64 and on 256 digits; the H sweep ran on 64: its line is LAMB's on 64, never a pool of both."""
    runs = tmp_path / "runs"
    for name, folder, top1 in (("small", "digits64", 90.0), ("large", "digits256", 10.0)):
        for seed in (0, 1):
            cfg, ran_on = launched("cifar10", "study/digits_lamb", "epochs=2", f"seed={seed}",
                                   f"data.dir={folders[folder]}",
                                   inputs={"data.dir": cifar_data.fingerprint(folders[folder])})
            write_run(runs, f"lamb_{name}{seed}", cfg, epochs_of(cfg, top1 + 2 * seed), ran_on)
    for h in (5, 10):
        cfg, ran_on = launched("cifar10", "study/digits_slamb_v1", "epochs=2", "sweep=sync_interval",
                               f"optimizer.sync_interval={h}", f"data.dir={folders['digits64']}",
                               inputs={"data.dir": cifar_data.fingerprint(folders["digits64"])})
        write_run(runs, f"h{h}", cfg, epochs_of(cfg, 90.5), ran_on)
    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "study_digits_resnet8_sync_interval.md").read_text()
    assert "LAMB's top-1 in the same configuration apart from the optimizer: 91.00 ± 1.41 (n = 2)" in page
    assert facts(page)["data"] == data_line(folders["digits64"])


def bert_sweep_run(root: Path, name: str, loss: float, *overrides) -> None:
    cfg = compose_root("bert", *overrides, "steps=4", "schedule.warmup_steps=1")
    o = cfg["optimizer"]
    history = [{"step": 4, "loss": loss + 1, "val_mlm_loss": loss, "period_steps": 4, "bytes_cum/all": 1_000_000,
                **({"compress_ratio": o["compress_ratio"]} if o["name"] == "slamb" else {})}]
    write_run(root, name, cfg, history, final_loss=loss + 1, final_mlm_acc=10.0, final_nsp_acc=50.0,
              final_val_mlm_loss=loss, mean_seqs_per_s=5.0, seq_len=128, steps=4)


def test_every_pipeline_gets_its_sweep_page_in_its_own_metric(tmp_path):
    """BERT's beta3 sweep (phase-1 runs, which also carry paper.phase) gets a grid page in validation MLM loss,
    lower being better, beside LAMB's; the H line likewise."""
    runs = tmp_path / "runs"
    for seed in (0, 1):
        bert_sweep_run(runs, f"lamb{seed}", 6.00 + seed / 100, "experiment=bert/phase1_lamb", f"seed={seed}")
    for b3, loss in ((0.9, 6.2), (0.99, 6.03)):
        bert_sweep_run(runs, f"b{b3}", loss, "experiment=bert/phase1_slamb", "sweep=beta3", f"optimizer.beta3={b3}")
    written = build_tables(load_runs(runs), tmp_path / "out")
    name = "bert_pretrain_phase1_beta3"
    page = (tmp_path / "out" / f"{name}.md").read_text()
    assert "The validation MLM loss by beta3 (rows) and compression ratio k (columns)" in page
    assert "| 0.99 | 6.0300 (1) |" in page and "| 0.9 | 6.2000 (1) |" in page
    assert ("LAMB's validation MLM loss in the same configuration apart from the optimizer: 6.0050 ± 0.0071 (n = 2). "
            "Within 0.05 nats of it: 1 of 2 cells (beta3 0.99, k 0.1)") in page
    assert {p.name for p in written[name]} >= {f"{name}_heatmap.png", f"{name}_val_mlm_loss_vs_bytes.png"}
    assert list(csv.DictReader((tmp_path / "out" / f"{name}.csv").read_text().splitlines()))[0]["val_mlm_loss"]


@pytest.mark.multiprocess
def test_tables_go_where_the_user_says_and_results_take_no_smoke_run(tmp_path, folders):
    """make tables RUNS=... TABLES=... writes there and leaves results/ as it is; a smoke run's tables are refused
    in results/ in one line, exit 2, unless asked."""
    runs = tmp_path / "runs"
    cfg, ran_on = launched("cifar10", "cifar10/lamb", "model=resnet8", "epochs=1", f"data.dir={folders['digits64']}",
                           inputs={"data.dir": cifar_data.fingerprint(folders["digits64"])})
    write_run(runs, "lamb", cfg, epochs_of(cfg, 50.0), ran_on)
    status = ["git", "status", "--porcelain", "--untracked-files=all", "--", "results"]
    before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    done = subprocess.run(["make", "--no-print-directory", "tables", f"PY={sys.executable}", f"RUNS={runs}",
                           f"TABLES={tmp_path / 'mine'}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "mine" / "cifar10_resnet110.md").exists()
    # --keep: the runs' records (no checkpoints) kept beside the pages, which are rebuilt from them alone
    (runs / "lamb" / "ckpt").mkdir()
    kept = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(runs), "--keep", str(tmp_path / "kept"),
                           "--out", str(tmp_path / "again")], cwd=ROOT, capture_output=True, text=True)
    assert kept.returncode == 0, kept.stderr
    assert sorted(p.name for p in (tmp_path / "kept" / "lamb").iterdir()) == sorted(
        ["config.yaml", "meta.json", "identity.json", "metrics.json", "metrics.jsonl"])
    assert (tmp_path / "again" / "cifar10_resnet110.md").read_text() == \
        (tmp_path / "mine" / "cifar10_resnet110.md").read_text()
    refused = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(runs), "--out", "results"],
                             cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert refused.stderr.startswith("error: --out results is the repository's results/, and 1 of the 1 runs under ")
    assert "(e.g. " in refused.stderr and "1 epoch of 200; model.depth 8 (the recipe's 110)" in refused.stderr
    assert "fix: write their tables elsewhere (make tables TABLES=smoke/tables), or pass --allow-smoke" in refused.stderr
    assert subprocess.run(status, cwd=ROOT, capture_output=True, text=True, check=True).stdout == before
