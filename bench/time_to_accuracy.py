"""The paper's speed claim in kind: wall-clock time to accuracy under a slow link, with seeds.

    python -m bench.time_to_accuracy                    # results/time_to_accuracy.md and .json (about 30 min)
    python -m bench.time_to_accuracy --render-only      # the page again from the .json
    python -m bench.time_to_accuracy --extend --seeds 3 4  # more seeds beside the .json's runs
    python -m bench.time_to_accuracy --quick --out DIR  # 2 epochs, one seed (the test's mode)

Emulated hosts (:class:`bench.netns.Cluster`: network namespaces, veth pairs, ``tc tbf``), one worker each,
run the study's digits recipe (ResNet-8, 40 epochs, x0.1 at 20 and 30, 64 images per worker and step;
:func:`bench.netbench.run_overrides`) with LAMB, SLAMB and 1-bit LAMB, every seed, at a link rate where
LAMB is communication-bound. One LAMB run on an unlimited link first measures the compute-only step, so
that the page can say how communication-bound LAMB is at the set rate (the bar: its communication at
least 2x its compute).

The time of a run is its training time (the pipeline's ``epoch_time_s``, evaluation left out, which is
the same work for every row) summed until the averaged model's test top-1 first reaches the target:
LAMB's final mean over its seeds minus one point. The verdict is SLAMB's time over LAMB's, the ratio of
the rows' geometric means with a 95% Welch interval on the log times (the ratio of two times is a
difference of logs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import shown_command
from bench.netbench import ROOT, UNLIMITED, analyse_run, launch_run, prepare_data, run_overrides, time_to

OUT = ROOT / "results" / "time_to_accuracy.md"
ROWS = ("LAMB", "SLAMB", "1-bit LAMB")
MARGIN = 1.0  # target = LAMB's final mean top-1 minus this many points


def log_ratio_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """exp(mean log a - mean log b) with the exp of its Welch interval: the ratio of geometric means."""
    from scipy import stats

    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
    d = statistics.fmean(la) - statistics.fmean(lb)
    if len(a) < 2 or len(b) < 2:
        return math.exp(d), math.nan, math.nan
    ci = stats.ttest_ind(la, lb, equal_var=False).confidence_interval(level)
    return math.exp(d), math.exp(ci.low), math.exp(ci.high)


def summarise(record: dict) -> dict:
    """Targets and times from the runs' histories: computed here, never carried from a run."""
    runs = [r for r in record["runs"] if r["status"] == "ok"]
    lamb = [r["final_top1"] for r in runs if r["optimizer"] == "LAMB"]
    target = statistics.fmean(lamb) - MARGIN if lamb else None
    for r in record["runs"]:
        r["time_to_target_s"] = time_to(r["history"], target) if r["status"] == "ok" and target is not None else None
    record["target_top1"] = target
    return record


def verdict(record: dict) -> tuple[str, dict]:
    times = {row: [r["time_to_target_s"] for r in record["runs"] if r["optimizer"] == row and r["status"] == "ok"]
             for row in ROWS}
    lamb = times["LAMB"]
    out = {}
    lines = []
    for row in ("SLAMB", "1-bit LAMB"):
        mine = times[row]
        if not mine or not lamb:
            continue
        missed = sum(t is None for t in mine + lamb)
        if missed:
            lines.append(f"{row}: {missed} of its and LAMB's runs never reached the target, so no ratio is computed.")
            out[row] = {"ratio": None, "low": None, "high": None, "unreached": missed}
            continue
        ratio, lo, hi = log_ratio_interval(mine, lamb)
        out[row] = {"ratio": ratio, "low": lo, "high": hi, "unreached": 0}
        ci = f"95% CI {lo:.3f} to {hi:.3f}" if not math.isnan(lo) else "one seed each, no interval"
        lines.append(f"{row} reaches the target in {ratio:.3f}x LAMB's time ({ci}, n = {len(mine)} and {len(lamb)}).")
    return " ".join(lines), out


def comm_bound(record: dict) -> str:
    ref = record.get("compute_reference")
    lamb = [r["step_time_s"] for r in record["runs"] if r["optimizer"] == "LAMB" and r["status"] == "ok"]
    if not ref or not lamb:
        return "No compute-only reference was measured: how communication-bound LAMB is is unknown."
    compute, step = ref["step_time_s"], statistics.fmean(lamb)
    ratio = (step - compute) / compute
    return (f"LAMB's step at {record['rate_mbit']:g} Mbit/s: {step * 1e3:.0f} ms; on an unlimited link "
            f"{compute * 1e3:.0f} ms (the compute, same hosts and CPU sharing): communication {ratio:.2f}x the "
            f"compute, {'at least' if ratio >= 2 else 'BELOW'} the 2x that makes LAMB communication-bound.")


def render(record: dict) -> str:
    summary, _ = verdict(record)
    lines = ["# Time to accuracy under a slow link", "",
             f"Written by `{record['command']}` on {record['started']} ({record['wall_s'] / 60:.1f} min on "
             f"{record['cpus']} CPU cores, 1-minute load average {record['load_avg'][0]} at the start and "
             f"{record['load_avg'][1]} at the end); every number is computed from the runs in "
             "`time_to_accuracy.json`.", "",
             "## Verdict", "", summary or "No verdict: runs are missing.", "",
             f"Target: LAMB's final mean test top-1 minus {MARGIN:g} point = **{record['target_top1']:.2f}%**. "
             "Time: training seconds (evaluation left out) until the averaged model's test top-1 first reaches "
             "the target; ratio: geometric means, interval from Welch's t on the log times.", "",
             comm_bound(record), "",
             "## Set-up", "",
             f"- {record['hosts']} emulated hosts, one worker each (network namespaces on a switch namespace, gloo "
             f"over veth pairs), link {record['rate_mbit']:g} Mbit/s each way (`tc tbf`), no added delay; all "
             "workers share this machine's cores.",
             f"- The digits recipe of the study: ResNet-8 on scikit-learn's digits in the CIFAR-10 layout, "
             f"{record['epochs']} epochs (x0.1 at half and 23/30 of them), 64 images per worker and step, the demo "
             "rows' optimizer settings (LAMB lr 0.01; SLAMB v1, k 0.1, beta3 0.99, H 10, the compression warm-up; "
             "1-bit LAMB at LAMB's settings with its full-precision stage the first 20% of the steps).",
             f"- Seeds {', '.join(map(str, record['seeds']))} for every row.", "",
             "## Runs", "",
             "Load: the machine's 1-minute load average when the run ended (other work shares these cores; a "
             "loaded machine lengthens the compute of every row).", "",
             "| optimizer | seed | time to target (s) | final top-1 | training time (s) | step (ms) | bytes / worker "
             "| load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in record["runs"]:
        if r["status"] != "ok":
            lines.append(f"| {r['optimizer']} | {r['seed']} | failed: {r['error']} | | | | | |")
            continue
        t = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"| {r['optimizer']} | {r['seed']} | {t} | {r['final_top1']:.2f} | "
                     f"{sum(h['epoch_time_s'] for h in r['history']):.1f} | {r['step_time_s'] * 1e3:.0f} | "
                     f"{r['bytes'] / 1e6:.2f} MB | {r.get('load_avg_1m') if r.get('load_avg_1m') is not None else ''} |")
    lines += ["", "| optimizer | time to target (s), mean ± sd | final top-1, mean ± sd | bytes / worker |",
              "|---|---|---|---|"]
    for row in ROWS:
        rs = [r for r in record["runs"] if r["optimizer"] == row and r["status"] == "ok"]
        if not rs:
            continue
        ts = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        acc = [r["final_top1"] for r in rs]
        sd = lambda xs: f" ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else ""  # noqa: E731
        lines.append(f"| {row} | {statistics.fmean(ts):.1f}{sd(ts)} ({len(ts)} of {len(rs)} reached) | "
                     f"{statistics.fmean(acc):.2f}{sd(acc)} | {statistics.fmean(r['bytes'] for r in rs) / 1e6:.2f} MB |"
                     if ts else f"| {row} | never reached | {statistics.fmean(acc):.2f}{sd(acc)} | "
                     f"{statistics.fmean(r['bytes'] for r in rs) / 1e6:.2f} MB |")
    return "\n".join(lines) + "\n"


def public(record: dict) -> dict:
    """The page's json: target and one entry per run (histories kept beside, for the times)."""
    return {"target_top1": record["target_top1"], "verdict": verdict(record)[1],
            "runs": [{"optimizer": r["optimizer"], "seed": r["seed"], "hosts": record["hosts"],
                      "rate_mbit": record["rate_mbit"], "time_to_target_s": r["time_to_target_s"],
                      "final_top1": r.get("final_top1"), "bytes": r.get("bytes"), "status": r["status"],
                      "error": r.get("error"), "step_time_s": r.get("step_time_s"),
                      "load_avg_1m": r.get("load_avg_1m"), "history": r.get("history", [])}
                     for r in record["runs"]],
            **{k: record[k] for k in ("command", "started", "wall_s", "cpus", "load_avg", "hosts", "rate_mbit",
                                      "epochs", "seeds", "compute_reference")}}


def one_run(cluster, row: str, seed: int, a, data: dict, workdir: Path, port: int, steady: bool = False) -> dict:
    tag = f"{row.replace(' ', '').lower()}_seed{seed}" + ("_compute" if steady else "")
    run_dir = workdir / "runs" / tag
    length = a.timing_epochs if steady else a.epochs
    overrides = [*run_overrides("cifar10", row, a.hosts, length, data["cifar10"]["dir"], run_dir, steady=steady),
                 f"seed={seed}"]
    res = launch_run(cluster, "cifar10", overrides, run_dir, port, a.run_timeout)
    out = {"optimizer": row, "seed": seed, "wall_s": res["wall_s"], "load_avg_1m": round(os.getloadavg()[0], 2)}
    if not res["ok"]:
        return {**out, "status": "failed", "error": res["error"]}
    got = analyse_run(run_dir, "cifar10", a.hosts, None)  # its history: each epoch's top-1 and training time
    summary = json.loads((run_dir / "metrics.json").read_text())
    return {**out, "status": "ok", "final_top1": summary["final_test_top1"], "step_time_s": got["step_time_s"],
            "bytes": summary["bytes_total"].get("all", 0),
            "history": [{"epoch": i + 1, "test_top1": h["test_top1"], "epoch_time_s": h["time_s"]}
                        for i, h in enumerate(got["history"])]}


def extended(json_path: Path, a) -> dict:
    """The record of ``--extend``: the existing .json, whose set-up must be this invocation's."""
    if not json_path.exists():
        raise SystemExit(f"--extend: {json_path} does not exist; run without --extend first")
    before = json.loads(json_path.read_text())
    for key, mine in (("hosts", a.hosts), ("rate_mbit", a.rate), ("epochs", a.epochs)):
        if before[key] != mine:
            raise SystemExit(f"--extend: {json_path} has {key}={before[key]}, this invocation {mine}; extend with "
                             "the same --hosts, --rate and --epochs, or write another page with --out")
    return before


def run_all(record: dict, todo: list[tuple[int, str]], a) -> None:
    """The runs of ``todo`` ((seed, row) pairs) into ``record``, after the compute reference where it has none."""
    from bench.netns import Cluster, netns_unsupported

    why = netns_unsupported()
    if why:
        raise SystemExit(f"bench.time_to_accuracy cannot run here: {why}")
    tmp = None
    workdir = Path(a.workdir) if a.workdir else Path(tmp := tempfile.mkdtemp(prefix="tta-"))
    try:
        data = prepare_data(["cifar10"], workdir)
        port = 29600
        with Cluster(a.hosts) as cluster:
            if record["compute_reference"] is None:
                cluster.shape(UNLIMITED)
                ref = one_run(cluster, "LAMB", a.seeds[0], a, data, workdir, port, steady=True)
                record["compute_reference"] = {k: ref.get(k) for k in ("status", "error", "step_time_s")}
                print(f"compute reference: {ref.get('step_time_s')}", flush=True)
            cluster.shape(a.rate)
            for seed, row in todo:
                port += 1
                r = one_run(cluster, row, seed, a, data, workdir, port)
                record["runs"].append(r)
                print(f"{row} seed {seed}: {r['status']} top-1 {r.get('final_top1')} ({r['wall_s']:.0f} s)", flush=True)
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.time_to_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", type=float, default=5.0, help="link rate, Mbit/s (default 5: LAMB's communication is "
                   "about 4x its compute there on 2 hosts, results/netbench_comm_bound.md)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--timing-epochs", type=int, default=3, help="epochs of the unlimited-link compute reference")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--run-timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true", help="2 epochs, seed 0, 10 Mbit/s")
    p.add_argument("--out", default=str(OUT), help="the page; its .json beside it")
    p.add_argument("--workdir", default=None, help="run directories (default: a temporary one, removed)")
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--extend", action="store_true", help="keep the runs of the existing .json (same hosts, rate "
                   "and epochs) and its compute reference, and run only the (row, seed) pairs it lacks: seeds "
                   "added to an interval that does not decide yet")
    a = p.parse_args(argv)
    if a.quick:
        a.epochs, a.seeds, a.rate, a.timing_epochs = 2, [0], 10.0, 2
    if not 2 <= a.hosts <= 64:
        p.error(f"--hosts {a.hosts}: must be in [2, 64]")
    if a.epochs < 2 or a.timing_epochs < 2:
        p.error("--epochs and --timing-epochs must be >= 2 (the first epoch is not timed)")
    if not a.rate > 0:
        p.error("--rate must be > 0 Mbit/s")
    out = Path(a.out)
    json_path = out.with_suffix(".json")
    if a.render_only:
        record = json.loads(json_path.read_text())
        out.write_text(render(summarise(record)))
        print(out)
        return 0

    before = extended(json_path, a) if a.extend else None
    record = {"command": "python -m bench.time_to_accuracy " + shown_command(argv), "started": time.strftime("%Y-%m-%d %H:%M"),
              "cpus": os.cpu_count(), "hosts": a.hosts, "rate_mbit": a.rate, "epochs": a.epochs, "seeds": a.seeds,
              "runs": [], "compute_reference": None}
    if before:
        record.update(command=before["command"] + f" + {record['command']}", started=before["started"],
                      seeds=sorted(set(before["seeds"]) | set(a.seeds)), runs=before["runs"],
                      compute_reference=before["compute_reference"])
    done = {(r["optimizer"], r["seed"]) for r in record["runs"]}
    # seeds outermost: a drift of the machine's speed hits every row alike
    todo = [(seed, row) for seed in a.seeds for row in ROWS if (row, seed) not in done]
    load0, tic = round(os.getloadavg()[0], 2), time.perf_counter()
    if todo:
        run_all(record, todo, a)
    wall, load = time.perf_counter() - tic, [load0, round(os.getloadavg()[0], 2)]
    if before:  # the page's time is every invocation's; its load, the first start's and the last end's
        wall, load = wall + before["wall_s"], [before["load_avg"][0], load[1]]
    record.update(wall_s=wall, load_avg=load)
    summarise(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(public(record), indent=1))
    out.write_text(render(record))
    print(out.read_text())
    return 0 if all(r["status"] == "ok" for r in record["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
