"""bench.optimizer_step on tiny shapes: the floor row's bytes, ratios computed from the paired timings
the measuring function returns, the targets computed from the rows, and ``--quick`` kept out of results/."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from bench import optimizer_step as bench

pytestmark = pytest.mark.e2e

SHAPES = [(64, 32), (32,), (128, 16)]
NUMEL = 64 * 32 + 32 + 128 * 16


def test_every_row_builds_and_steps_fused_ones_included():
    rows = bench.optimizers()
    assert set(rows) == {"lamb", "lamb_fused", "adamw_foreach", "adamw_fused", "timm_lamb", "slamb_v1", "slamb_v2",
                         "slamb_v2_nocheck", "slamb_v1_fused", "slamb_v2_fused"}
    for name, build in rows.items():  # every row builds and steps
        params = bench._model_params(SHAPES, torch.device("cpu"))
        build(params).step()
        assert all(torch.isfinite(p).all() for p in params), name


def test_paired_timings_give_the_rows_ratios_and_the_floor():
    names = ["lamb", "slamb_v2", "adamw_fused"]
    times = bench.measure_times(SHAPES, names, 6, "cpu")
    assert set(times) == {bench.FLOOR, *names} and all(len(t) == 6 and min(t) > 0 for t in times.values())
    rows = {r["optimizer"]: r for r in bench.summarize(times, NUMEL)}
    floor = rows[bench.FLOOR]
    assert floor["bytes"] == 7 * 4 * NUMEL  # read p, g, m, v; write p, m, v
    # the add_ pass moves 8 bytes per word, so the floor takes 3.5 times as long
    per_round = [3.5 * t for t in times[bench.FLOOR]]
    assert floor["ms"] == pytest.approx(1e3 * statistics.median(per_round))
    assert floor["gb_per_s"] == pytest.approx(8 * NUMEL / statistics.median(times[bench.FLOOR]) / 1e9)
    assert floor["vs_floor"] == pytest.approx((1.0, 1.0, 1.0))
    for name in names:
        r = rows[name]
        assert r["ms"] == pytest.approx(1e3 * statistics.median(times[name]))
        vs_lamb = [t / b for t, b in zip(times[name], times["lamb"])]
        vs_floor = [t / f for t, f in zip(times[name], per_round)]
        assert r["vs_lamb"][1] == pytest.approx(statistics.median(vs_lamb))
        assert r["vs_floor"][1] == pytest.approx(statistics.median(vs_floor))
        assert r["vs_floor"][0] <= r["vs_floor"][1] <= r["vs_floor"][2]
        vs_adamw = [t / a for t, a in zip(times[name], times["adamw_fused"])]
        assert r["vs_adamw"][1] == pytest.approx(statistics.median(vs_adamw))
    assert rows["lamb"]["vs_lamb"] == (1.0, 1.0, 1.0) and rows["adamw_fused"]["vs_adamw"] == (1.0, 1.0, 1.0)
    assert rows[bench.FLOOR]["vs_adamw"][1] == pytest.approx(statistics.median(
        [f / a for f, a in zip(per_round, times["adamw_fused"])]))


def test_targets_are_computed_from_the_rows_for_the_models_they_are_set_for():
    def row(model, name, floor, state=2.0, vs_fused_lamb=None, vs_adamw=1.0):
        return {"model": model, "optimizer": name, "vs_floor": (0, floor, 0), "state_words": state,
                "vs_adamw": (0, vs_adamw, 0),
                "paired": {} if vs_fused_lamb is None else {"lamb_fused": (0, vs_fused_lamb, 0)}}

    got = {(t["model"], t["target"]): t for t in bench.targets([
        row("bert_base", "lamb_fused", 1.4), row("bert_base", "slamb_v2_fused", 2.6, state=2.25, vs_fused_lamb=1.2),
        row("resnet110", "slamb_v2_fused", 9.0, state=2.6, vs_adamw=2.1)])}
    assert got["resnet110", "fused SLAMB v2 step / torch fused AdamW step"] == {
        "model": "resnet110", "target": "fused SLAMB v2 step / torch fused AdamW step", "limit": 2.0, "value": 2.1,
        "verdict": "missed"}
    assert got["bert_base", "fused LAMB step / floor"]["verdict"] == "met"
    assert got["bert_base", "fused SLAMB v2 step / floor"]["verdict"] == "missed"
    assert got["bert_base", "fused SLAMB v2 step / fused LAMB step"]["value"] == 1.2
    assert got["bert_base", "fused SLAMB v2 state (words/param)"]["verdict"] == "met"
    assert got["resnet110", "fused SLAMB v2 state (words/param)"]["verdict"] == "missed"
    assert got["bert_base", "fused SLAMB v1 step / floor"] == {
        "model": "bert_base", "target": "fused SLAMB v1 step / floor", "limit": 2.5, "value": None,
        "verdict": "not measured"}
    # a floor is set for BERT's tensors, torch's fused AdamW for ResNet-110's
    assert ("resnet110", "fused SLAMB v2 step / floor") not in got
    assert ("bert_base", "fused SLAMB v2 step / torch fused AdamW step") not in got


def tiny_runs(monkeypatch, tmp_path, shapes=None, timed=SHAPES) -> list:
    """``run_model`` timing ``timed``, without the memory processes, the pages in ``tmp_path``; (model, steps,
    names) of each run. ``shapes``: each model's, where not SHAPES, as the memory check sees them."""
    written = []
    numel = sum(math.prod(s) for s in timed)

    def run_model(model, names, steps, device):
        written.append((model, steps, names))
        built = {}
        times = bench.measure_times(timed, names, steps, device, built=built)
        return [{"model": model, "steps": steps, **r, **({} if r["optimizer"] == bench.FLOOR else
                                                         {"state_words": 2.0, "scratch_words": 0.0, "peak_words": 1.0,
                                                          "kernels": 7, "host_ops": 5})}
                for r in bench.summarize(times, numel, bench.fallbacks(built))]

    monkeypatch.setattr(bench, "run_model", run_model)
    for model in bench.MODELS:  # the sizes run_model's memory check sees
        monkeypatch.setitem(bench.MODELS, model, lambda model=model: (shapes or {}).get(model, SHAPES))
    monkeypatch.setattr(bench, "SCRATCH_OUT", tmp_path / "runs" / "optimizer_step.md")
    monkeypatch.setattr(bench, "FULL_OUT", tmp_path / "results" / "optimizer_step.md")
    return written


def table_rows(page: str) -> dict:
    """(model, optimizer) -> the row's cells, from a page's first table."""
    lines = page.split("\n")
    head = next(i for i, line in enumerate(lines) if line.startswith("| model |"))
    names = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = {}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))
        rows[cells["model"], cells["optimizer"]] = cells
    return rows


def test_quick_run_writes_to_runs_not_results(monkeypatch, tmp_path):
    written = tiny_runs(monkeypatch, tmp_path)
    bench.main(["--quick", "--device", "cpu", "--optimizers", "slamb_v2"])
    assert written == [("resnet110", 10, ["lamb", "adamw_fused", "slamb_v2"])]
    assert not (tmp_path / "results").exists()
    page = (tmp_path / "runs" / "optimizer_step.md").read_text()
    assert "| resnet110 |" in page and "| floor |" in page and "## Targets" in page
    assert "| 7 (5) |" in page  # the kernels column
    assert math.isfinite(float(page.split("| slamb_v2 | ")[1].split(" |")[0]))


def test_quick_run_gives_every_row_its_ratio_to_torch_fused_adamw(monkeypatch, tmp_path):
    """The BERT-Large and ResNet-110 rows, each optimizer's step as x floor and x torch's fused AdamW."""
    # a floor pass long enough that its ratio to an AdamW step shows in two decimals
    written = tiny_runs(monkeypatch, tmp_path, timed=[(512, 256), (256,)])
    bench.main(["--quick", "--device", "cpu", "--models", "resnet110", "bert_large",
                "--optimizers", "lamb_fused", "slamb_v2_fused"])
    assert [w[:2] for w in written] == [("resnet110", 10), ("bert_large", 10)]
    rows = table_rows((tmp_path / "runs" / "optimizer_step.md").read_text())
    names = ["floor", "lamb", "adamw_fused", "lamb_fused", "slamb_v2_fused"]
    assert sorted(rows) == sorted((m, n) for m in ("resnet110", "bert_large") for n in names)
    for (model, name), cells in rows.items():
        for column in ("vs floor", "vs fused AdamW"):
            median, quartiles = cells[column].split("x ")
            low, high = (float(q) for q in quartiles.strip("()").split("-"))
            assert 0 < low <= float(median) <= high, (model, name, column)
        if name == "adamw_fused":
            assert cells["vs fused AdamW"] == "1.00x (1.00-1.00)"


def test_a_fused_row_whose_compile_failed_is_refused(monkeypatch, tmp_path):
    """A fused optimizer whose graphs fail to compile warns and steps on the multi-tensor path: its row says it
    fell back, no target is computed from it, and the run ends with an error naming it (the page written)."""
    def broken(fn, **kw):
        def raise_(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")
        return raise_

    tiny_runs(monkeypatch, tmp_path)
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(UserWarning, match="torch.compile failed"), pytest.raises(SystemExit) as refused:
        bench.main(["--quick", "--device", "cpu", "--models", "bert_base", "--optimizers", "lamb_fused",
                    "slamb_v2_fused"])
    assert "torch.compile failed for bert_base lamb_fused, bert_base slamb_v2_fused" in str(refused.value)
    page = (tmp_path / "runs" / "optimizer_step.md").read_text()
    assert {name for _, name in table_rows(page)} == {
        "floor", "lamb", "adamw_fused", "lamb_fused (fell back)", "slamb_v2_fused (fell back)"}
    assert "bert_base lamb_fused: `RuntimeError: no C++ compiler found`" in page
    verdicts = {cells[1]: cells[-1] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in
                                                  page.split("## Targets")[1].splitlines()
                                                  if line.startswith("| bert_base"))}
    assert {what for what, value in verdicts.items() if value == "–"} == {
        "fused SLAMB v1 step / floor", "fused SLAMB v1 state (words/param)"}  # no such row
    assert {value for what, value in verdicts.items() if "v1 step / floor" not in what and "v1 state" not in what
            } == {"– (its compile failed)"}  # v1 / fused LAMB too: the fused LAMB row fell back


def test_full_run_has_bert_large_and_leaves_out_what_the_memory_cannot_hold(monkeypatch, tmp_path, capsys):
    """Every model by default, but one whose paired run would not fit the machine's memory is left out with a
    line that says so, and refused with one error line, before any step, when named in --models."""
    written = tiny_runs(monkeypatch, tmp_path, shapes={"bert_large": [(1000, 1000)]})
    monkeypatch.setattr(bench, "_available_bytes", lambda device: 8 * bench.WORDS_PER_ROW * 4 * NUMEL)
    bench.main(["--device", "cpu", "--steps", "2", "--optimizers", "slamb_v2", "--out", str(tmp_path / "p.md")])
    assert [w[0] for w in written] == ["bert_base", "resnet110"]
    assert "skipping bert_large: bert_large's paired run needs 0.1 GB" in capsys.readouterr().out
    monkeypatch.setattr(bench, "_available_bytes", lambda device: 1 << 34)
    bench.main(["--device", "cpu", "--steps", "2", "--optimizers", "slamb_v2", "--out", str(tmp_path / "p.md")])
    assert [w[0] for w in written[2:]] == ["bert_base", "bert_large", "resnet110"]
    monkeypatch.setattr(bench, "_available_bytes", lambda device: 8 * bench.WORDS_PER_ROW * 4 * NUMEL)
    with pytest.raises(SystemExit):
        bench.main(["--models", "bert_large", "--device", "cpu", "--out", str(tmp_path / "p.md")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "invalid --models bert_large: bert_large's paired run needs" in err and "leave it out" in err
    assert len(written) == 5  # the refused run stepped nothing


def test_paired_groups_fit_the_memory_and_keep_every_ratio_paired():
    from bench.optimizer_step import WORDS_PER_ROW, paired_groups

    names = ["lamb", "lamb_fused", "adamw_foreach", "adamw_fused", "timm_lamb", "slamb_v1", "slamb_v2",
             "slamb_v2_nocheck", "slamb_v1_fused", "slamb_v2_fused"]
    numel = 110_000_000
    budget = 4 * WORDS_PER_ROW * 4 * numel  # four rows at a time
    groups = paired_groups(names, numel, budget)
    assert len(groups) > 1 and all(len(g) <= 4 for g in groups)
    assert {n for g in groups for n in g} == set(names)
    assert all(g[0] == "lamb" for g in groups)  # every row beside LAMB
    assert all("lamb_fused" in g for g in groups if any(n.endswith("_fused") and n.startswith("slamb") for n in g))
    # room for every row: the plain rows in one group, the fused ones beside both LAMBs in another
    assert all("adamw_fused" in g for g in groups)  # and beside torch's fused AdamW
    assert paired_groups(names, numel, 100 * budget) == [["lamb", "adamw_fused"] + [n for n in names if not n.endswith(
                                                             "_fused") and n != "lamb"],
                                                         ["lamb", "lamb_fused", "adamw_fused", "slamb_v1_fused",
                                                          "slamb_v2_fused"]]
