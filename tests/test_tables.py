"""Results pages (harness.tables) say what ran and cannot mislead: each page names the model, data, workers, length,
precision, hardware and commit from the runs' own records; published numbers stand beside ours only in their
setting and are labelled with their source; a sweep's LAMB reference is its own configuration, each seed once;
a sweep cell gives the compression ratio its steps used and the page warns where the warm-up decided it.

The run directories are written by the harness's own :class:`harness.run.RunLogger` (config.yaml, meta.json,
metrics.jsonl, metrics.json), with configs composed from configs/ as the pipelines compose them."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from harness.distributed import DistEnv
from harness.run import RunLogger, hardware
from harness.tables import build_tables, heatmap_figure, load_runs, save_figure, sweep_figure, _save
from slamb.schedules import compression_ratio
from tests.test_configs import EXPERIMENTS, compose_root, experiment_root

CPU1 = DistEnv(0, 1, 0, 1, torch.device("cpu"))


def write_run(root: Path, name: str, cfg: dict, history: list[dict], **summary) -> Path:
    """A finished run directory as the harness leaves it: the logger's config and metadata, a metrics line per
    period, the summary's fields as :meth:`harness.Loop.finish` writes them (``summary`` adds or replaces)."""
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


def facts(page: str) -> dict[str, str]:
    """The page's "What ran" list."""
    return dict(re.findall(r"^- (\w+): (.*)$", page, flags=re.M))


# ------------------------------------------------------------------------------------------ what ran


def test_run_metadata_records_the_hardware_and_the_commit(tmp_path):
    RunLogger(tmp_path, {"name": "t", "optimizer": {"name": "sgd"}}, CPU1, progress=False)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", meta["git"]["commit"]) and isinstance(meta["git"]["dirty"], bool)
    assert meta["hardware"] == hardware(torch.device("cpu"))
    assert re.fullmatch(r"CPU \(.+, \d+ cores\)", meta["hardware"])


def test_a_page_of_runs_outside_the_papers_setting_says_what_ran_and_keeps_the_published_numbers_apart(tmp_path):
    """The CIFAR-10 / ResNet-110 table filled by a ResNet-8 on digits (a smoke run of the per-paper script):
    the page names what ran and prints the authors' README's numbers apart, under that source."""
    runs = tmp_path / "runs"
    small = ["model=resnet8", "data=digits", "epochs=2"]
    for seed, top1 in enumerate([96.0, 98.0]):
        write_run(runs, f"lamb{seed}", cifar10("experiment=cifar10/lamb", *small, f"seed={seed}"),
                  epochs_of(cifar10("experiment=cifar10/lamb", *small), top1))
    sgd = cifar10("experiment=cifar10/sgd", *small)
    write_run(runs, "sgd", sgd, epochs_of(sgd, 90.0))
    gpu = write_run(runs, "lamb2", cifar10("experiment=cifar10/lamb", *small, "seed=2"),
                    epochs_of(sgd, 97.0))
    meta = json.loads((gpu / "meta.json").read_text())
    (gpu / "meta.json").write_text(json.dumps({**meta, "hardware": "NVIDIA H100 80GB HBM3"}))

    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "cifar10_resnet110.md").read_text()
    here = hardware(torch.device("cpu"))
    commit = meta["git"]["commit"][:10] + (" with uncommitted changes" if meta["git"]["dirty"] else "")
    assert facts(page) == {"model": "resnet_cifar (depth 8, width 16)", "data": "digits", "workers": "4",
                           "length": "2 epochs (12 steps)", "precision": "fp32",
                           "hardware": f"{here} (3 runs); NVIDIA H100 80GB HBM3 (1 run)", "commit": commit}
    assert "What ran (4 runs, from their recorded config and metadata):" in page
    assert ("Not the paper's setting: these runs trained resnet_cifar (depth 8, width 16) on digits, so the "
            "published top-1 stand apart below, for reference only. Their source: the SLAMB authors' README "
            "(github.com/hangxu0304/SLAMB") in page
    assert "Table 1" not in page and "published top-1 |" not in page.split("Not the paper's setting")[0]
    assert "| Optimizer | published top-1 (%) |\n|---|---|\n| SGD-M | 91.70 |\n| LAMB | 93.15 |" in page
    # LAMB's three seeds are one row, n = 3
    assert re.search(r"^\| LAMB \| .* \| 97\.00 ± 1\.00 \| .* \| 3 \|$", page, flags=re.M)


def test_runs_in_the_papers_setting_get_the_published_numbers_beside_theirs(tmp_path):
    runs = tmp_path / "runs"
    for row, top1 in (("sgd", 91.0), ("lamb", 93.0)):
        cfg = cifar10(f"experiment=cifar10/{row}", "epochs=1")  # ResNet-110 on CIFAR-10, if only for an epoch
        write_run(runs, row, cfg, epochs_of(cfg, top1, steps=49))
    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "cifar10_resnet110.md").read_text()
    assert facts(page)["model"] == "resnet_cifar (depth 110, width 16)" and facts(page)["data"] == "cifar10"
    assert facts(page)["length"] == "1 epochs (49 steps)"
    assert "| Optimizer | configuration | top-1 | published top-1 | best top-1 |" in page
    assert re.search(r"^\| LAMB \| [^|]* \| 93\.00 \| 93\.15 \| 93\.00 \|", page, flags=re.M)
    assert "Published top-1 (the column beside ours), from the SLAMB authors' README" in page
    assert "Not the paper's setting" not in page


def squad_run(root: Path, name: str, model_dir: Path, *overrides, f1: float = 88.0) -> Path:
    cfg = compose_root("squad", "experiment=squad/lamb", f"model.dir={model_dir}", *overrides)
    return write_run(root, name, cfg, [{"epoch": 1, "step": 5, "f1": f1, "exact_match": f1 - 8, "period_steps": 5}],
                     f1=f1, exact_match=f1 - 8, model_dir=str(model_dir))


def test_squad_pages_label_the_lamb_papers_f1_and_set_it_beside_only_a_bert_large_on_squad(tmp_path):
    runs = tmp_path / "runs"
    bert = compose_root("bert", "experiment=bert/phase2_lamb", "steps=2")
    pretrained = write_run(runs, "bert_phase2_lamb", bert, [{"step": 2, "loss": 3.0, "period_steps": 2}],
                           final_loss=3.0, final_mlm_acc=40.0, final_nsp_acc=80.0, final_val_mlm_loss=None,
                           mean_seqs_per_s=10.0, seq_len=512, steps=2)
    squad_run(runs, "squad_lamb", pretrained / "model")
    build_tables(load_runs(runs), tmp_path / "out")
    page = (tmp_path / "out" / "squad_v1.1.md").read_text()
    assert facts(page)["model"].startswith(f"the model in {pretrained / 'model'} (bert_large (")
    assert facts(page)["data"] == "squad_v1.1"
    assert "| Pre-training optimizer | F1 published | EM published | F1 ours |" in page
    assert "| LAMB | 90.584 | - | 88.00 | 80.00 |" in page
    assert "from the LAMB paper (You et al., ICLR 2020), Table 1" in page and "91.345" not in page

    tiny = tmp_path / "tiny"  # a smoke run: a model of its own (no run among these saved it), the tiny set
    squad_run(tiny, "squad_lamb", tmp_path / "tiny_bert", "data=squad_tiny")
    build_tables(load_runs(tiny), tmp_path / "tiny_out")
    page = (tmp_path / "tiny_out" / "squad_v1.1.md").read_text()
    assert facts(page)["model"] == f"the model in {tmp_path / 'tiny_bert'}" and facts(page)["data"] == "squad_tiny"
    assert f"Not the paper's setting: these runs trained the model in {tmp_path / 'tiny_bert'} on squad_tiny" in page
    assert "| Pre-training optimizer | published F1 | published EM |\n|---|---|---|\n| LAMB | 90.584 | - |" in page
    assert "F1 published" not in page


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
    grid = {(b, k): {"top1": (97.0 + k, 0.5, 2), "bytes": 2e7 * k} for b in betas for k in ks}
    for what in ("top1", "bytes"):
        fig = heatmap_figure(name, betas, ks, grid, what=what)
        _save(fig, tmp_path / f"{what}.png")
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
    lamb = {"top1": (97.0, 1.41, 2), "bytes": 8e6}
    cells = {(h,): {"top1": (97.0 - h / 50, 0.3, 2), "bytes": 2e6 / h} for h in (5, 10, 20, 50)}
    for grid, setting in ((cells, "sync_interval"), ({(0.9, 0.1): cells[(5,)], (0.99, 0.1): cells[(10,)]}, None)):
        fig = sweep_figure(f"{t}_beta3_compress_ratio", grid, lamb, setting)
        save_figure(fig, fig.axes, tmp_path / "sweep.png", legend_size=7)
        texts_inside(fig)
