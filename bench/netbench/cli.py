"""The command line: settings, their checks, and the bench from the runs to the page."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .. import shown_command
from .analysis import reanalyse
from .config import DEFAULT_ROWS, HIER, HSDP, MULTI_PROC_ROWS, PIPELINES, ROOT, ROWS, WORKER_FLAG, Settings, plan
from .report import _rate, render
from .runs import run_matrix
from .worker import worker_main


def _git() -> str:
    from harness.run import git_revision

    g = git_revision(ROOT)
    return f"{g['commit'][:10]}{' (dirty)' if g['dirty'] else ''}"


FULL_OUT, SCRATCH_OUT = ROOT / "results" / "netbench.md", ROOT / "runs" / "netbench" / "netbench.md"
# settings that do not change which runs the matrix holds or what they measure
NOT_MATRIX = ("note", "workdir", "out", "raw", "render_only", "reanalyse", "run_timeout")


def parse_args(argv=None) -> argparse.Namespace:
    # the package's docstring is the bench's manual; its first paragraph says what it is
    p = argparse.ArgumentParser(prog="python -m bench.netbench",
                                description=sys.modules[__package__].__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8], help="host counts (CIFAR-10)")
    p.add_argument("--rates", type=float, nargs="+", default=[10, 50, 200], help="link rates, Mbit/s (CIFAR-10)")
    p.add_argument("--procs-per-host", type=int, default=1,
                   help="processes per host (torchrun --nproc-per-node): they talk over the host's loopback, "
                        "the hosts over the shaped links")
    p.add_argument("--optimizers", nargs="+", default=None, choices=list(ROWS), metavar="ROW",
                   help=f"rows: {', '.join(repr(r) for r in ROWS)} (default: {', '.join(DEFAULT_ROWS)}; with "
                        f"--procs-per-host > 1: {', '.join(MULTI_PROC_ROWS)}; --quick: LAMB SLAMB)")
    p.add_argument("--epochs", type=int, default=20, help="epochs of the time-to-accuracy runs (CIFAR-10)")
    p.add_argument("--timing-epochs", type=int, default=3, help="epochs of the other (step time and bytes) runs")
    p.add_argument("--tta-hosts", type=int, nargs="*", default=[2], help="hosts of the time-to-accuracy runs")
    p.add_argument("--tta-rates", type=float, nargs="*", default=[50], help="rates of the time-to-accuracy runs")
    p.add_argument("--target-top1", type=float, default=90.0, help="test top-1 %% of time to target (CIFAR-10)")
    p.add_argument("--reduce-from", type=int, default=8,
                   help="from this many hosts on (CIFAR-10), run only --reduced-rates and --reduced-optimizers")
    p.add_argument("--reduced-rates", type=float, nargs="*", default=[50])
    p.add_argument("--reduced-optimizers", nargs="*", default=["LAMB", "SLAMB", "SLAMB+overlap"], choices=list(ROWS),
                   metavar="ROW")
    p.add_argument("--note", default="", help="a line for the report's header (e.g. which code was measured)")
    p.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    p.add_argument("--bert-hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--bert-rates", type=float, nargs="+", default=[10, 50])
    p.add_argument("--bert-optimizers", nargs="+", default=["LAMB", "SLAMB", "SLAMB+overlap"], choices=list(ROWS),
                   metavar="ROW")
    p.add_argument("--bert-steps", type=int, default=16)
    p.add_argument("--delay-ms", type=float, default=None,
                   help="one-way link delay (netem); default 0.5 where the kernel has netem, else 0 (reported)")
    p.add_argument("--check-rates", type=float, nargs="*", default=[10, 50, 200, 1000],
                   help="rates of the TCP throughput check of the shaped links (Mbit/s)")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds before a run is killed")
    p.add_argument("--quick", action="store_true",
                   help="smallest configuration: 2 hosts, 10 Mbit/s (and the unlimited reference), LAMB and SLAMB, "
                        "CIFAR-10, 2 epochs")
    p.add_argument("--workdir", default=None, help="run directories and data (default: a temporary directory, removed)")
    p.add_argument("--out", default=None,
                   help=f"the page (raw JSON and plots beside it); default {FULL_OUT.relative_to(ROOT)} for the full "
                        f"matrix or --render-only, {SCRATCH_OUT.relative_to(ROOT)} for --quick and partial matrices")
    p.add_argument("--raw", default=None, help="raw JSON (default: <page name>_raw.json beside --out)")
    p.add_argument("--render-only", action="store_true", help="rebuild the page and plots from the raw JSON")
    p.add_argument("--reanalyse", metavar="WORKDIR", default=None,
                   help="with --render-only: first recompute the raw JSON's numbers from the run directories of a "
                        "kept --workdir")
    a = p.parse_args(argv)
    a.partial = a.quick or any(getattr(a, k) != p.get_default(k) for k in vars(a) if k not in NOT_MATRIX)
    if a.out is None:
        a.out = str(SCRATCH_OUT if a.partial and not a.render_only else FULL_OUT)
    if a.quick:
        a.hosts, a.rates, a.pipelines, a.check_rates = [2], [10], ["cifar10"], []
        a.optimizers = a.optimizers or ["LAMB", "SLAMB"]
        a.timing_epochs, a.tta_hosts, a.tta_rates = 2, [], []
    a.optimizers = a.optimizers or list(MULTI_PROC_ROWS if a.procs_per_host > 1 else DEFAULT_ROWS)
    if not 1 <= a.procs_per_host <= 16:
        p.error(f"--procs-per-host {a.procs_per_host}: must be in [1, 16]")
    rows = {*a.optimizers, *(a.bert_optimizers if "bert" in a.pipelines else []), *(a.reduced_optimizers if max(a.hosts) >= a.reduce_from else [])}
    if HIER in rows and a.procs_per_host < 2:
        p.error(f"--optimizers '{HIER}' needs --procs-per-host >= 2 (with one process per host it is flat SLAMB)")
    for pipeline, chosen in (("cifar10", {*a.optimizers, *(a.reduced_optimizers if max(a.hosts) >= a.reduce_from
                                                            else [])}),
                             ("bert", set(a.bert_optimizers))):
        missing = sorted(r for r in chosen if pipeline not in ROWS[r])
        if pipeline in a.pipelines and missing:
            p.error(f"rows {missing} have no {pipeline} run (the CIFAR-10 pipeline does not shard): pass them with "
                    f"--bert-optimizers and --pipelines bert")
    if rows & set(HSDP) and a.procs_per_host < 2:
        p.error(f"rows {sorted(rows & set(HSDP))} shard each host's replica over its processes: give "
                "--procs-per-host >= 2")
    for name in ("hosts", "bert_hosts", "tta_hosts"):
        bad = [n for n in getattr(a, name) if not 2 <= n <= 64]
        if bad:
            p.error(f"--{name.replace('_', '-')} {bad}: every host count must be in [2, 64]")
    for name in ("rates", "bert_rates", "tta_rates"):
        if any(not r > 0 for r in getattr(a, name)):
            p.error(f"--{name.replace('_', '-')}: rates must be > 0 Mbit/s (the unlimited link always runs)")
    for name, lo in (("epochs", 2), ("timing_epochs", 2), ("bert_steps", 4)):
        if getattr(a, name) < lo:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= {lo} (the first period is not measured)")
    if a.delay_ms is not None and a.delay_ms < 0:
        p.error("--delay-ms must be >= 0")
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WORKER_FLAG:
        worker_main(argv[1:])
        return 0
    a = parse_args(argv)
    out = Path(a.out)
    raw_path = Path(a.raw) if a.raw else out.with_name(out.stem + "_raw.json")
    if a.render_only:
        records = json.loads(raw_path.read_text())
        if a.reanalyse:
            print(f"re-analysed {reanalyse(records, Path(a.reanalyse), a.target_top1)} runs")
            raw_path.write_text(json.dumps(records, indent=1))
        meta_path = raw_path.with_name(raw_path.stem + "_meta.json")
        raw = {"records": records, **(json.loads(meta_path.read_text()) if meta_path.exists() else {})}
        for p in render(raw, out):
            print(p)
        return 0

    from ..netns import netem_available, netns_unsupported

    why = netns_unsupported()
    if why:
        raise SystemExit(f"bench.netbench cannot run here: {why}")
    delay = a.delay_ms if a.delay_ms is not None else (0.5 if netem_available() else 0.0)
    if a.partial and out == SCRATCH_OUT:
        print(f"a partial matrix: writing to {out.parent} (--out {FULL_OUT.relative_to(ROOT)} replaces the "
              "committed results)", flush=True)
    tmp = None
    workdir = Path(a.workdir) if a.workdir else Path(tmp := tempfile.mkdtemp(prefix="netbench-"))
    s = Settings(pipelines=a.pipelines, hosts=a.hosts, rates=a.rates, rows=a.optimizers, epochs=a.epochs,
                 bert_steps=a.bert_steps, bert_hosts=a.bert_hosts, bert_rates=a.bert_rates, bert_rows=a.bert_optimizers,
                 delay_ms=delay, target_top1=a.target_top1, tta_hosts=a.tta_hosts, tta_rates=a.tta_rates,
                 timing_epochs=a.timing_epochs, run_timeout_s=a.run_timeout, workdir=workdir, check_rates=a.check_rates,
                 reduce_from=a.reduce_from, reduced_rates=a.reduced_rates, reduced_rows=a.reduced_optimizers,
                 procs_per_host=a.procs_per_host)
    started, tic, load_start = time.strftime("%Y-%m-%d %H:%M"), time.perf_counter(), os.getloadavg()
    try:
        records, checks = run_matrix(s)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    meta = {"command": "python -m bench.netbench " + shown_command(argv), "started": started,
            "wall_s": time.perf_counter() - tic, "cpus": os.cpu_count(), "git": _git(), "delay_ms": delay,
            "netem": delay > 0, "note": a.note, "procs_per_host": a.procs_per_host,
            "load_avg": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]}, "plan": [{k: j[k] for k in ("pipeline", "hosts", "rate_mbit", "optimizer",
                                                                          "length")} for j in plan(s)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    raw_path.write_text(json.dumps(records, indent=1))
    raw_path.with_name(raw_path.stem + "_meta.json").write_text(json.dumps({"meta": meta, "link_checks": checks}, indent=1))
    for p in render({"records": records, "meta": meta, "link_checks": checks}, out):
        print(p)
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        print(f"{len(failed)} of {len(records)} runs failed (see {out}):", file=sys.stderr)
        for r in failed:
            print(f"  {r['pipeline']} {r['hosts']}h {_rate(r['rate_mbit'])} {r['optimizer']}: {r['error']}",
                  file=sys.stderr)
    return 1 if failed else 0
