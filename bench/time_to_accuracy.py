"""The paper's speed claim in kind: wall-clock time to accuracy under a slow link, with seeds.

    python -m bench.time_to_accuracy                    # results/time_to_accuracy.md and .json (2 and 4 hosts,
                                                        # 60 runs: about 3.5 hours on a quiet 2-core machine)
    python -m bench.time_to_accuracy --render-only      # the page again from the .json
    python -m bench.time_to_accuracy --extend --seeds 6 7  # more seeds beside the .json's runs
    python -m bench.time_to_accuracy --quick --out DIR  # 2 hosts, 2 epochs, one seed (the test's mode)

Emulated hosts (:class:`bench.netns.Cluster`: network namespaces, veth pairs, ``tc tbf``), one worker each,
run the study's digits recipe (ResNet-8, 40 epochs, x0.1 at 20 and 30, 64 images per worker and step;
:func:`bench.netbench.run_overrides`) with LAMB, SLAMB as the demo runs it (H 10), SLAMB with its momentum
exchanged in int8, SLAMB at the CIFAR-10 recipe's sync interval, and 1-bit LAMB, every seed, at each host
count, at a link rate where LAMB is communication-bound. One LAMB run on an unlimited link per host count first
measures the compute-only step, so that the page can say how communication-bound LAMB is at the set rate (the
bar: its communication at least 2x its compute).

The time of a run is its training time (the pipeline's ``epoch_time_s``, evaluation left out, which is
the same work for every row) summed until the averaged model's test top-1 first reaches the target:
LAMB's final mean over its seeds at that host count minus one point. A verdict is a row's time over another's
(each SLAMB row against LAMB and against 1-bit LAMB, per host count), the ratio of the rows' geometric means
with a 95% Welch interval on the log times (the ratio of two times is a difference of logs). The goal the page
checks: a SLAMB row at or under 0.5x LAMB's time and ahead of 1-bit LAMB.
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
from bench.netbench.config import RECIPE_H, RECIPE_H_ROW

OUT = ROOT / "results" / "time_to_accuracy.md"
SLAMB_ROWS = ("SLAMB", "SLAMB int8", RECIPE_H_ROW)
ROWS = ("LAMB", *SLAMB_ROWS, "1-bit LAMB")
MARGIN = 1.0  # target = LAMB's final mean top-1 minus this many points
GOAL = 0.5  # the paper's claim in kind: a SLAMB row at or under this fraction of LAMB's time, ahead of 1-bit LAMB


def log_ratio_interval(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """exp(mean log a - mean log b) with the exp of its Welch interval: the ratio of geometric means."""
    from scipy import stats

    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
    d = statistics.fmean(la) - statistics.fmean(lb)
    if len(a) < 2 or len(b) < 2:
        return math.exp(d), math.nan, math.nan
    ci = stats.ttest_ind(la, lb, equal_var=False).confidence_interval(level)
    return math.exp(d), math.exp(ci.low), math.exp(ci.high)


def upgrade(record: dict) -> dict:
    """A record written when the page had one host count (``hosts`` a number, one compute reference) in the
    present layout: host counts as a list, a compute reference per host count."""
    if isinstance(record.get("hosts"), int):
        record["compute_reference"] = {str(record["hosts"]): record.get("compute_reference")}
        record["hosts"] = [record["hosts"]]
    for r in record["runs"]:
        r.setdefault("hosts", record["hosts"][0])
    return record


def ok_runs(record: dict, hosts: int) -> list[dict]:
    return [r for r in record["runs"] if r["status"] == "ok" and r["hosts"] == hosts]


def summarise(record: dict) -> dict:
    """Targets and times from the runs' histories, per host count: computed here, never carried from a run."""
    upgrade(record)
    record["target_top1"] = {}
    for hosts in record["hosts"]:
        lamb = [r["final_top1"] for r in ok_runs(record, hosts) if r["optimizer"] == "LAMB"]
        target = statistics.fmean(lamb) - MARGIN if lamb else None
        record["target_top1"][str(hosts)] = target
        for r in record["runs"]:
            if r["hosts"] == hosts:
                r["time_to_target_s"] = (time_to(r["history"], target) if r["status"] == "ok" and target is not None
                                         else None)
    return record


def compare(record: dict, hosts: int, row: str, ref: str) -> dict | None:
    """``row``'s time to the target over ``ref``'s at ``hosts``: the ratio of geometric means and its interval;
    None where either row has no runs. ``unreached``: how many of ``row``'s and of ``ref``'s runs never reached
    the target (no ratio then: a run that never got there has no time)."""
    times = {x: [r["time_to_target_s"] for r in ok_runs(record, hosts) if r["optimizer"] == x] for x in (row, ref)}
    if not times[row] or not times[ref]:
        return None
    n = [len(times[row]), len(times[ref])]
    missed = [sum(t is None for t in times[x]) for x in (row, ref)]
    if any(missed):
        return {"ratio": None, "low": None, "high": None, "unreached": missed, "n": n}
    ratio, lo, hi = log_ratio_interval(times[row], times[ref])
    return {"ratio": ratio, "low": lo, "high": hi, "unreached": missed, "n": n}


def phrase(row: str, ref: str, got: dict) -> str:
    """One comparison as the verdicts say it."""
    if got["ratio"] is None:
        a, b = got["unreached"]
        return (f"no ratio to {ref}'s time: {a} of {row}'s {got['n'][0]} runs and {b} of {ref}'s {got['n'][1]} "
                "never reached the target")
    ci = f"95% CI {got['low']:.3f} to {got['high']:.3f}" if not math.isnan(got["low"]) else "no interval: one seed"
    return f"{got['ratio']:.3f}x {ref}'s time ({ci}, n = {got['n'][0]} and {got['n'][1]})"


def meets(lamb: dict | None, onebit: dict | None, key: str) -> bool | None:
    """Whether a row's comparisons meet the goal by ``key`` ("high": the intervals' upper ends, "ratio": the point
    estimates): at or under :data:`GOAL` of LAMB's time and under 1-bit LAMB's. False where one of the row's own
    runs never reached the target (it is not ahead of what did); None where only a reference's runs missed it, or a
    comparison is absent (nothing decides it)."""
    if lamb is None or onebit is None:
        return None
    if lamb["unreached"][0] or onebit["unreached"][0]:
        return False
    if lamb["ratio"] is None or onebit["ratio"] is None:
        return None
    return lamb[key] <= GOAL and onebit[key] < 1  # one seed: the bounds are nan, so no interval decides


def goal(hosts: int, verdicts: dict) -> str:
    """Whether a SLAMB row meets the goal at ``hosts``: its interval against LAMB at or under :data:`GOAL` and its
    interval against 1-bit LAMB under 1 (decided), or only its point estimates (not decided), or neither."""
    judged = {r: (meets(verdicts.get((r, "LAMB")), verdicts.get((r, "1-bit LAMB")), "high"),
                  meets(verdicts.get((r, "LAMB")), verdicts.get((r, "1-bit LAMB")), "ratio"))
              for r in SLAMB_ROWS if (r, "LAMB") in verdicts}
    decided = [r for r, (high, _) in judged.items() if high]
    point = [r for r, (high, ratio) in judged.items() if not high and ratio]
    open_ = [r for r, (_, ratio) in judged.items() if ratio is None]
    unknown = (f" {', '.join(open_)} cannot be judged: runs of LAMB or 1-bit LAMB never reached the target."
               if open_ else "")
    s = lambda rows: "s" if len(rows) == 1 else ""  # noqa: E731
    if decided:
        return (f"At {hosts} hosts, {', '.join(decided)} meet{s(decided)} the goal: at or under {GOAL:g}x LAMB's "
                "time and ahead of 1-bit LAMB, both intervals included." + unknown)
    if point:
        return (f"At {hosts} hosts, no SLAMB row is shown to meet the goal ({GOAL:g}x LAMB's time or less and ahead "
                f"of 1-bit LAMB): {', '.join(point)} meet{s(point)} it in the point estimates, but the intervals "
                "do not decide it." + unknown)
    return (f"At {hosts} hosts, **no SLAMB row is at or under {GOAL:g}x LAMB's time and ahead of 1-bit LAMB**"
            + (", not even in the point estimates." if judged and not open_ else ".") + unknown)


def verdict(record: dict) -> tuple[str, dict]:
    """The page's verdicts: per host count, every SLAMB row and 1-bit LAMB against LAMB, every SLAMB row against
    1-bit LAMB, and the goal's outcome."""
    lines, out = [], {}
    for hosts in record["hosts"]:
        got = {}
        for row, ref in [*((r, "LAMB") for r in (*SLAMB_ROWS, "1-bit LAMB")), *((r, "1-bit LAMB") for r in SLAMB_ROWS)]:
            found = compare(record, hosts, row, ref)
            if found is not None:
                got[(row, ref)] = found
        if not got:
            continue
        said = [f"**{hosts} hosts**, each row's time to the target over LAMB's and over 1-bit LAMB's:", ""]
        for row in ("1-bit LAMB", *SLAMB_ROWS):
            mine = [phrase(row, ref, got[(row, ref)]) for ref in ("LAMB", "1-bit LAMB") if (row, ref) in got]
            if mine:
                said.append(f"- {row}: " + "; ".join(mine) + ".")
        said += ["", goal(hosts, got)]
        lines.append("\n".join(said))
        out[str(hosts)] = {f"{row} / {ref}": v for (row, ref), v in got.items()}
        out[str(hosts)]["goal"] = goal(hosts, got)
    return "\n\n".join(lines), out


def comm_bound(record: dict, hosts: int) -> str:
    ref = (record.get("compute_reference") or {}).get(str(hosts))
    lamb = [r["step_time_s"] for r in ok_runs(record, hosts) if r["optimizer"] == "LAMB"]
    if not ref or not ref.get("step_time_s") or not lamb:
        return "No compute-only reference was measured: how communication-bound LAMB is is unknown."
    compute, step = ref["step_time_s"], statistics.fmean(lamb)
    ratio = (step - compute) / compute
    return (f"LAMB's step at {record['rate_mbit']:g} Mbit/s on {hosts} hosts: {step * 1e3:.0f} ms; on an unlimited "
            f"link {compute * 1e3:.0f} ms (the compute, same hosts and CPU sharing): communication {ratio:.2f}x the "
            f"compute, {'at least' if ratio >= 2 else 'BELOW'} the 2x that makes LAMB communication-bound.")


def runs_tables(record: dict, hosts: int) -> list[str]:
    lines = ["| optimizer | seed | time to target (s) | final top-1 | training time (s) | step (ms) | bytes / worker "
             "| load |", "|---|---|---|---|---|---|---|---|"]
    for r in record["runs"]:
        if r["hosts"] != hosts:
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['optimizer']} | {r['seed']} | failed: {r['error']} | | | | | |")
            continue
        t = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"| {r['optimizer']} | {r['seed']} | {t} | {r['final_top1']:.2f} | "
                     f"{sum(h['epoch_time_s'] for h in r['history']):.1f} | {r['step_time_s'] * 1e3:.0f} | "
                     f"{r['bytes'] / 1e6:.2f} MB | {'' if r.get('load_avg_1m') is None else r['load_avg_1m']} |")
    lines += ["", "| optimizer | time to target (s), mean ± sd | final top-1, mean ± sd | bytes / worker |",
              "|---|---|---|---|"]
    for row in ROWS:
        rs = [r for r in ok_runs(record, hosts) if r["optimizer"] == row]
        if not rs:
            continue
        ts = [r["time_to_target_s"] for r in rs if r["time_to_target_s"] is not None]
        acc = [r["final_top1"] for r in rs]
        sd = lambda xs: f" ± {statistics.stdev(xs):.2f}" if len(xs) > 1 else ""  # noqa: E731
        mb = f"{statistics.fmean(r['bytes'] for r in rs) / 1e6:.2f} MB"
        lines.append(f"| {row} | {statistics.fmean(ts):.1f}{sd(ts)} ({len(ts)} of {len(rs)} reached) | "
                     f"{statistics.fmean(acc):.2f}{sd(acc)} | {mb} |" if ts else
                     f"| {row} | never reached | {statistics.fmean(acc):.2f}{sd(acc)} | {mb} |")
    return lines


def render(record: dict) -> str:

    summary, _ = verdict(record)
    commits = [c for c in record.get("commits") or [] if c.get("commit")]
    at = (" at commit " + ", then ".join(c["commit"][:10] + (" (with uncommitted changes)" if c.get("dirty") else "")
                                         for c in commits)) if commits else ""
    lines = ["# Time to accuracy under a slow link", "",
             f"Written by `{shown_command(record['command'].split())}`{at} on {record['started']} "
             f"({record['wall_s'] / 60:.1f} min on "
             f"{record['cpus']} CPU cores, 1-minute load average {record['load_avg'][0]} at the start and "
             f"{record['load_avg'][1]} at the end; each run's below); every number is computed from the runs in "
             "`time_to_accuracy.json`.", "",
             "## Verdicts", "", summary or "No verdict: runs are missing.", "",
             f"Target: LAMB's final mean test top-1 at that host count minus {MARGIN:g} point ("
             + ", ".join(f"{h} hosts: **{t:.2f}%**" for h, t in record["target_top1"].items() if t is not None)
             + "). Time: training seconds (evaluation left out) until the averaged model's test top-1 first reaches "
             "the target; ratio: geometric means, interval from Welch's t on the log times. Goal: a SLAMB row at or "
             f"under {GOAL:g}x LAMB's time and ahead of 1-bit LAMB (the paper's claim in kind); met when both "
             "intervals are, shown in the point estimates otherwise.", "",
             *[comm_bound(record, h) + "\n" for h in record["hosts"]],
             "## Set-up", "",
             f"- {' and '.join(map(str, record['hosts']))} emulated hosts, one worker each (network namespaces on a "
             f"switch namespace, gloo over veth pairs), link {record['rate_mbit']:g} Mbit/s each way (`tc tbf`), no "
             "added delay; all workers share this machine's cores.",
             f"- The digits recipe of the study: ResNet-8 on scikit-learn's digits in the CIFAR-10 layout, "
             f"{record['epochs']} epochs (x0.1 at half and 23/30 of them), 64 images per worker and step (global batch "
             "64 x hosts), the demo rows' optimizer settings: LAMB lr 0.01; SLAMB v1, k 0.1, beta3 0.99, H 10, the "
             f"compression warm-up; SLAMB int8: the same with its momentum in int8; {RECIPE_H_ROW}: the same at the "
             f"CIFAR-10 recipe's sync interval ({RECIPE_H}, configs/experiment/cifar10/slamb.yaml); 1-bit LAMB at "
             "LAMB's settings with its full-precision stage the first 20% of the steps.",
             f"- Seeds {', '.join(map(str, record['seeds']))} for every row.", ""]
    for hosts in record["hosts"]:
        lines += [f"## Runs, {hosts} hosts", "",
                  "Load: the machine's 1-minute load average when the run ended (other work shares these cores; a "
                  "loaded machine lengthens the compute of every row).", "", *runs_tables(record, hosts), ""]
    return "\n".join(lines)


def public(record: dict) -> dict:
    """The page's json: targets and one entry per run (histories kept beside, for the times)."""
    return {"target_top1": record["target_top1"], "verdict": verdict(record)[1],
            "runs": [{"optimizer": r["optimizer"], "seed": r["seed"], "hosts": r["hosts"],
                      "rate_mbit": record["rate_mbit"], "time_to_target_s": r["time_to_target_s"],
                      "final_top1": r.get("final_top1"), "bytes": r.get("bytes"), "status": r["status"],
                      "error": r.get("error"), "step_time_s": r.get("step_time_s"),
                      "load_avg_1m": r.get("load_avg_1m"), "history": r.get("history", [])}
                     for r in record["runs"]],
            **{k: record.get(k) for k in ("command", "commits", "started", "wall_s", "cpus", "load_avg", "hosts",
                                          "rate_mbit", "epochs", "seeds", "compute_reference")}}


def one_run(cluster, row: str, seed: int, hosts: int, a, data: dict, workdir: Path, port: int,
            steady: bool = False) -> dict:
    tag = f"h{hosts}_{''.join(c for c in row.lower() if c.isalnum())}_seed{seed}" + ("_compute" if steady else "")
    run_dir = workdir / "runs" / tag
    length = a.timing_epochs if steady else a.epochs
    overrides = [*run_overrides("cifar10", row, hosts, length, data["cifar10"]["dir"], run_dir, steady=steady),
                 f"seed={seed}"]
    res = launch_run(cluster, "cifar10", overrides, run_dir, port, a.run_timeout)
    out = {"optimizer": row, "seed": seed, "hosts": hosts, "wall_s": res["wall_s"],
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    if not res["ok"]:
        return {**out, "status": "failed", "error": res["error"]}
    got = analyse_run(run_dir, "cifar10", hosts, None)  # its history: each epoch's top-1 and training time
    summary = json.loads((run_dir / "metrics.json").read_text())
    return {**out, "status": "ok", "final_top1": summary["final_test_top1"], "step_time_s": got["step_time_s"],
            "bytes": summary["bytes_total"].get("all", 0),
            "history": [{"epoch": i + 1, "test_top1": h["test_top1"], "epoch_time_s": h["time_s"]}
                        for i, h in enumerate(got["history"])]}


def extended(json_path: Path, a) -> dict:
    """The record of ``--extend``: the existing .json, whose set-up must be this invocation's."""
    if not json_path.exists():
        raise SystemExit(f"--extend: {json_path} does not exist; run without --extend first")
    before = upgrade(json.loads(json_path.read_text()))
    for key, mine in (("rate_mbit", a.rate), ("epochs", a.epochs)):
        if before[key] != mine:
            raise SystemExit(f"--extend: {json_path} has {key}={before[key]}, this invocation {mine}; extend with "
                             "the same --rate and --epochs, or write another page with --out")
    return before


def run_all(record: dict, todo: list[tuple[int, int, str]], a) -> None:
    """The runs of ``todo`` ((hosts, seed, row)) into ``record``, after each host count's compute reference where
    it has none."""
    from bench.netns import Cluster, netns_unsupported

    why = netns_unsupported()
    if why:
        raise SystemExit(f"bench.time_to_accuracy cannot run here: {why}")
    tmp = None
    workdir = Path(a.workdir) if a.workdir else Path(tmp := tempfile.mkdtemp(prefix="tta-"))
    try:
        data = prepare_data(["cifar10"], workdir)
        port = 29600
        for hosts in sorted({h for h, _, _ in todo}):
            with Cluster(hosts) as cluster:
                if not (record["compute_reference"] or {}).get(str(hosts)):
                    cluster.shape(UNLIMITED)
                    port += 1
                    ref = one_run(cluster, "LAMB", a.seeds[0], hosts, a, data, workdir, port, steady=True)
                    record["compute_reference"][str(hosts)] = {k: ref.get(k)
                                                               for k in ("status", "error", "step_time_s")}
                    print(f"compute reference, {hosts} hosts: {ref.get('step_time_s')}", flush=True)
                cluster.shape(a.rate)
                for h, seed, row in todo:
                    if h != hosts:
                        continue
                    port += 1
                    r = one_run(cluster, row, seed, hosts, a, data, workdir, port)
                    record["runs"].append(r)
                    print(f"{hosts} hosts, {row} seed {seed}: {r['status']} top-1 {r.get('final_top1')} "
                          f"({r['wall_s']:.0f} s, load {r['load_avg_1m']})", flush=True)
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    from harness.run import git_revision

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.time_to_accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4], help="host counts, one worker each")
    p.add_argument("--rate", type=float, default=5.0, help="link rate, Mbit/s (default 5: LAMB's communication is "
                   "about 4x its compute there on 2 hosts, results/netbench_comm_bound.md)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--timing-epochs", type=int, default=3, help="epochs of the unlimited-link compute reference")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(6)))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="the rows to run (default: all)")
    p.add_argument("--run-timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true", help="2 hosts, 2 epochs, seed 0, 10 Mbit/s")
    p.add_argument("--out", default=str(OUT), help="the page; its .json beside it")
    p.add_argument("--workdir", default=None, help="run directories (default: a temporary one, removed)")
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--extend", action="store_true", help="keep the runs of the existing .json (same rate and "
                   "epochs) and its compute references, and run only the (hosts, row, seed) triples it lacks: seeds "
                   "added to an interval that does not decide yet")
    a = p.parse_args(argv)
    if a.quick:
        a.hosts, a.epochs, a.seeds, a.rate, a.timing_epochs = [2], 2, [0], 10.0, 2
    if not all(2 <= h <= 64 for h in a.hosts):
        p.error(f"--hosts {' '.join(map(str, a.hosts))}: each must be in [2, 64]")
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
    # the command as the page shows it: the repository's paths relative to it, no folder of this machine
    record = {"command": "python -m bench.time_to_accuracy " + shown_command(argv), "commits": [git_revision(ROOT)],
              "started": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "hosts": sorted(set(a.hosts)),
              "rate_mbit": a.rate, "epochs": a.epochs, "seeds": a.seeds, "runs": [], "compute_reference": {}}
    if before:
        # a page written before commands were shown relative to the repository names a folder of its machine
        record.update(command=shown_command(before["command"].split()) + f" + {record['command']}",
                      started=before["started"],
                      commits=[*(c for c in before.get("commits") or [] if c not in record["commits"]),
                               *record["commits"]],
                      seeds=sorted(set(before["seeds"]) | set(a.seeds)), runs=before["runs"],
                      hosts=sorted(set(before["hosts"]) | set(a.hosts)), compute_reference=before["compute_reference"])
    done = {(r["hosts"], r["optimizer"], r["seed"]) for r in record["runs"]}
    # seeds outermost within a host count: a drift of the machine's speed hits every row alike
    todo = [(hosts, seed, row) for hosts in sorted(set(a.hosts)) for seed in a.seeds for row in ROWS
            if row in a.rows and (hosts, row, seed) not in done]
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
