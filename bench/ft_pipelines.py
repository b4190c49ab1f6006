"""Training through failures in a pipeline: the study's digits recipe (``cifar10.train``, ResNet-8 on 4 workers x 64
images, 40 epochs of 5 steps) under torchft, against the same job restarted from its checkpoints.

    python -m bench.ft_pipelines                 # results/fault_tolerance_pipelines.md and .json (about 45 minutes)
    python -m bench.ft_pipelines --report-only   # the page again from the .json

Each run is the pipeline's own command (``python -m cifar10.train experiment=study/digits_<row> ...``), as a user
runs it; failures come from the pipelines' fault hook (``SLAMB_FAULT_AT_STEP=48,98,148``, worker or replica group 1:
attempt k dies before step N_k, so one run meets three failures). The rows, each on seeds 0-2:

* ``slamb``: SLAMB v1 without a failure, on 4 workers (the study's run);
* ``slamb_ft`` / ``lamb_ft``: SLAMB / LAMB under torchft (4 replica groups of one worker, ``+mixin=torchft``) without
  a failure: torchft's own cost;
* ``slamb_ft_fail`` / ``lamb_ft_fail``: the same with the failures: group 1 is killed, the launcher relaunches it while
  the others train on, and it heals from a peer (heal policy ``peer``);
* ``slamb_restart``: SLAMB on 4 workers with a checkpoint every epoch and ``trainer.max_restarts=3``: each failure
  restarts every worker from the last checkpoint (torch's elastic launcher).

Every failing row may restart (relaunch) once per failure (``trainer.max_restarts``).

The runner watches each run's ``metrics.jsonl`` and records when each epoch's line appears (seconds from the
command's start): the time to the study's target is the first line at or above it, whichever attempt wrote it.
Each finished run is kept in the .json at once, and a run already there is not run again, so a stopped page
continues (``--fresh`` starts over).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAILURES = (48, 98, 148)  # mid-epoch (the 3rd of an epoch's 5 steps): a restart redoes 2 steps of each
ROWS = {
    "slamb": ("study/digits_slamb_v1", [], False),
    "slamb_ft": ("study/digits_slamb_v1", ["+mixin=torchft", "trainer.replica_groups=4"], False),
    "slamb_ft_fail": ("study/digits_slamb_v1", ["+mixin=torchft", "trainer.replica_groups=4"], True),
    "slamb_restart": ("study/digits_slamb_v1", ["trainer.checkpoint.enabled=true"], True),
    "lamb_ft": ("study/digits_lamb", ["+mixin=torchft", "trainer.replica_groups=4"], False),
    "lamb_ft_fail": ("study/digits_lamb", ["+mixin=torchft", "trainer.replica_groups=4"], True),
}
NAMES = {"slamb": "SLAMB, no failure (4 workers)", "slamb_ft": "SLAMB under torchft, no failure",
         "slamb_ft_fail": "SLAMB under torchft, failures",
         "slamb_restart": "SLAMB, restart from a checkpoint, failures",
         "lamb_ft": "LAMB under torchft, no failure", "lamb_ft_fail": "LAMB under torchft, failures"}
BASE = {"slamb_ft_fail": "slamb_ft", "lamb_ft_fail": "lamb_ft", "slamb_restart": "slamb"}  # time lost: against these
MARGIN = 1.0  # the study's equivalence margin (points of top-1): the target is LAMB's mean less this
COMMAND = "python -m bench.ft_pipelines"


def study_target(records: Path) -> tuple[float, int]:
    """The study's LAMB mean final top-1 (its records) less :data:`MARGIN`, and the runs it averages."""
    top1 = [json.loads(p.read_text())["final_test_top1"]
            for p in sorted(records.glob("study_digits_lamb_seed*/metrics.json"))]
    if not top1:
        raise SystemExit(f"error: no LAMB run of the study under {records}; fix: run `make study` (its digits task) "
                         "first: its LAMB runs set the target")
    return statistics.mean(top1) - MARGIN, len(top1)


def watch(cmd: list[str], run_dir: Path, env: dict) -> tuple[subprocess.CompletedProcess, float, list[list]]:
    """Run ``cmd``; the wall seconds, and ``[seconds, epoch, test_top1]`` for each metrics line when it appeared
    (a restart rewrites the lines after its checkpoint: each written line counts once, when first seen)."""
    tic = time.perf_counter()
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        seen, lines = set(), []
        while True:
            done = proc.poll() is not None
            path = run_dir / "metrics.jsonl"
            for raw in (path.read_text().splitlines() if path.exists() else []):
                if raw.strip() and raw not in seen:
                    try:
                        row = json.loads(raw)
                    except json.JSONDecodeError:  # a line being written: read it at the next poll
                        continue
                    seen.add(raw)
                    lines.append([round(time.perf_counter() - tic, 2), row["epoch"], row["test_top1"]])
            if done:
                break
            time.sleep(0.25)
    wall = time.perf_counter() - tic
    return subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), ""), wall, lines


def one_run(row: str, seed: int, data: Path, runs: Path, epochs: int, failures: tuple[int, ...]) -> dict:
    experiment, mode, failing = ROWS[row]
    run_dir = runs / f"{row}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished attempt's: the run starts over
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    if failing:
        env.update({"SLAMB_FAULT_AT_STEP": ",".join(map(str, failures)), "SLAMB_FAULT_RANK": "1"})
        mode = [*mode, f"trainer.max_restarts={len(failures)}"]  # a restart (relaunch) per failure
    cmd = [sys.executable, "-m", "cifar10.train", f"experiment={experiment}", f"seed={seed}", f"data.dir={data}",
           f"epochs={epochs}", "trainer.resume=auto", *mode, f"hydra.run.dir={run_dir}"]
    done, wall, lines = watch(cmd, run_dir, env)
    if done.returncode != 0:
        raise SystemExit(f"error: {row} seed {seed} failed (exit {done.returncode}); its console: "
                         f"{run_dir.parent / (run_dir.name + '.log')}\n{done.stdout[-2000:]}")
    summary = json.loads((run_dir / "metrics.json").read_text())
    out = done.stdout
    meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").exists() else {}
    return {"row": row, "seed": seed, "command": " ".join(cmd[1:]), "commit": meta.get("git", {}).get("commit"),
            "dirty": meta.get("git", {}).get("dirty"),
            "final_test_top1": summary["final_test_top1"], "final_test_loss": summary["final_test_loss"],
            "steps": summary["steps"], "wall_s": round(wall, 2), "lines": lines,
            "failures": out.count("[fault injection]"),
            "relaunches": sum(line.startswith("replica group ") for line in out.splitlines()),
            "resumed_from": summary.get("resumed_from", []), "bytes_total": summary["bytes_total"],
            "step_s": step_seconds(run_dir)}


def step_seconds(run_dir: Path) -> float:
    """The median over the run's epochs of the mean step time each epoch's line gives (forward, backward and the
    optimizer's step with its collectives; not the epoch's averaging and evaluation)."""
    lines = [json.loads(raw) for raw in (run_dir / "metrics.jsonl").read_text().splitlines() if raw.strip()]
    return round(statistics.median(r["step_time_s"] for r in lines), 4)


def epoch_seconds(run: dict) -> float:
    """The median seconds from one epoch's line to the next's, as the runner saw them appear (the epoch's steps,
    its averaging and its evaluation)."""
    t = [x[0] for x in run["lines"]]
    return statistics.median(b - a for a, b in zip(t, t[1:]))


def time_to(run: dict, target: float) -> float | None:
    return next((t for t, _, top1 in run["lines"] if top1 >= target), None)


def same_end(run: dict, others: list[dict]) -> bool:
    return any(o["seed"] == run["seed"] and (o["final_test_loss"], o["final_test_top1"]) ==
               (run["final_test_loss"], run["final_test_top1"]) for o in others)


def pm(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def render(record: dict) -> str:
    runs, target = record["runs"], record["target"]

    def of(row):
        return sorted((r for r in runs if r["row"] == row), key=lambda r: r["seed"])

    def lost(r):
        base = next((b for b in of(BASE[r["row"]]) if b["seed"] == r["seed"]), None) if r["row"] in BASE else None
        return (r["wall_s"] - base["wall_s"]) / r["failures"] if base and r["failures"] else None

    commits = sorted({str(r["commit"])[:12] + (" (with uncommitted changes)" if r.get("dirty") else "")
                      for r in runs})
    lines = ["# Training through failures in a pipeline: the digits recipe under torchft and with restarts", "",
             f"Written by `{COMMAND}` ({record['started']}); the runs on commit{'s' if len(commits) > 1 else ''} "
             f"{', '.join(commits)}, torch {record['torch']}, on {record['hardware']} (the runs' wall time "
             f"{sum(r['wall_s'] for r in runs) / 60:.0f} min). Every number is computed from the runs in "
             "`fault_tolerance_pipelines.json`.", "",
             "## Set-up", "",
             "- The study's digits recipe (`results/study/`): `cifar10.train` with a ResNet-8 (75,290 parameters) "
             "on scikit-learn's digits in the CIFAR-10 layout (1,500 training, 297 test images), global batch 256 "
             f"(4 x 64), {record['epochs']} epochs of 5 steps ({5 * record['epochs']} steps), fp32, on this "
             "machine's CPU cores (gloo). SLAMB v1 "
             "(k 0.1, beta3 0.99, H 10, the compression warm-up) and LAMB, as the study's rows.",
             "- Under torchft: 4 replica groups of one worker each (the launcher's lighthouse; "
             "`+mixin=torchft trainer.replica_groups=4`), each taking the share of the global batch a rank of 4 "
             "workers would; a relaunched group heals from a peer (`trainer.heal=peer`).",
             f"- Failures: worker (group) 1 exits before steps {', '.join(map(str, record['failures']))} "
             "(`SLAMB_FAULT_AT_STEP`), each the third step of an epoch. Under torchft the launcher relaunches the "
             "group while the others train on; with a restart, torch's elastic launcher restarts every worker, "
             "which resume from the last checkpoint (one each epoch, every 5 steps). Three failures in 200 steps "
             "stand for a job that loses a node every few hours over a run of a day or two, as the paper's "
             "1,024-GPU runs would.",
             f"- Accuracy: the test top-1 of the ranks' (groups') averaged model at each epoch's end. Target: the "
             f"study's LAMB mean final top-1 (n = {record['target_runs']}) less {MARGIN:g} point = "
             f"**{target:.2f}%**. Time: wall seconds from the command's start (interpreter, launcher and "
             "evaluations included) to the first metrics line at or above the target.",
             "- Time lost per failure: the run's wall time over that of the same seed's run of the same mode "
             "without a failure (torchft rows: under torchft; the restart row: the plain run, which writes no "
             "checkpoint), per failure.",
             "- Step: the median over a run's epochs of their mean step time (forward, backward, the optimizer's "
             "step with its collectives and, under torchft, the quorum and the commit). Epoch, line to line: the "
             "median time between two epochs' metrics lines (the steps, the end of epoch's model average and the "
             "evaluation).",
             f"- Seeds {', '.join(map(str, record['seeds']))}; mean ± sample standard deviation.", "",
             "## Results", "",
             "| run | final top-1 (%) | final test loss | time to target (s) | wall time (s) | failures | "
             "time lost per failure (s) | step (s) | epoch, line to line (s) | healing bytes per worker | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, name in NAMES.items():
        rs = of(row)
        if not rs:
            continue
        reached = [t for t in (time_to(r, target) for r in rs) if t is not None]
        ttt = pm(reached) + (f" ({len(reached)} of {len(rs)} reached it)" if len(reached) < len(rs) else "")
        losts = [x for x in (lost(r) for r in rs) if x is not None]
        heal = [r["bytes_total"].get("heal", 0) for r in rs]
        lines.append(f"| {name} | {pm([r['final_test_top1'] for r in rs], 2)} | "
                     f"{pm([r['final_test_loss'] for r in rs], 3)} | {ttt} | {pm([r['wall_s'] for r in rs])} | "
                     f"{pm([r['failures'] for r in rs], 0)} | {pm(losts) if losts else '-'} | "
                     f"{pm([r['step_s'] for r in rs if 'step_s' in r], 3)} | {pm([epoch_seconds(r) for r in rs], 2)} | "
                     f"{f'{statistics.mean(heal):,.0f}' if any(heal) else '-'} | {len(rs)} |")
    restart = of("slamb_restart")
    lines += ["", "## What a failure costs", ""]
    if restart:
        # a restart resumes at its last checkpoint's epoch and takes again the steps from there to the failure
        redone = [f - 1 - 5 * e for r in restart for f, e in zip(record["failures"], r["resumed_from"])]
        lines.append(f"- A restart from a checkpoint resumed from epochs "
                     f"{'; '.join(', '.join(map(str, r['resumed_from'])) for r in restart)} (seeds in order) and took "
                     f"{pm(redone, 1)} steps again per failure. Its final test loss and top-1 equal those of the "
                     f"same seed's run without a failure in {sum(same_end(r, of('slamb')) for r in restart)} of "
                     f"{len(restart)} "
                     "seeds: a restart resumes exactly.")
    from harness.fault_tolerance import HEARTBEAT_MS, JOIN_MS

    lines += ["- Under torchft the survivors do not stop: a failed step is undone and taken again by the next "
              "quorum, and the relaunched group joins a later step with a peer's parameters, moments and "
              f"staleness ages (the healing bytes above). What a failure costs them is set by the lighthouse: it "
              f"drops a dead group after {HEARTBEAT_MS / 1000:g} s without a heartbeat, and a quorum waits up to "
              f"{JOIN_MS / 1000:g} s for a group of the last one (`harness/fault_tolerance.py`); "
              "`results/fault_tolerance.md` measures the survivors' recovery per failure with shorter timeouts and "
              "the commit-safe step's cost.",
              "", "## What would change at scale", "",
              "Here a restart costs an interpreter and launcher start, a rendezvous, a checkpoint load and the "
              "steps since the last checkpoint, for every worker; under torchft a failure costs the survivors the "
              "failed step and a quorum, and the joining group one heal (14 bytes per parameter, whatever the "
              "number of groups). On 1,024 GPUs a restart's start-up and checkpoint load take minutes, not "
              "seconds, and failures come more often the more nodes there are, so the restart row's loss per "
              "failure grows with the job while the survivors' does not. Not run here: groups of more than one "
              "process, NCCL, more than 4 groups, the tiny BERT (its runs take 8-11 minutes each on these 2 "
              "cores: 18 runs would not fit with the rest)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "ft_pipelines")
    parser.add_argument("--study", type=Path, default=ROOT / "results" / "study" / "runs" / "digits",
                        help="the study's digits records (its LAMB runs set the target)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--epochs", type=int, default=40, help="the recipe's 40 (a smaller number: a smoke run)")
    parser.add_argument("--failures", type=int, nargs="+", default=list(FAILURES), help="the steps before which "
                        "worker (group) 1 dies, one per attempt")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="run every run again")
    args = parser.parse_args(argv)
    import torch

    from harness.run import hardware

    page_json = args.out / "fault_tolerance_pipelines.json"
    record = json.loads(page_json.read_text()) if page_json.exists() and not args.fresh else {"runs": []}
    target, n = study_target(args.study)
    record.update({"target": target, "target_runs": n})
    for run in record["runs"]:  # runs recorded before the step time was
        run_dir = args.runs / f"{run['row']}_seed{run['seed']}"
        if "step_s" not in run and (run_dir / "metrics.jsonl").exists():
            run["step_s"] = step_seconds(run_dir)
    if not args.report_only:
        record.update({"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                       "hardware": hardware(torch.device("cpu")), "seeds": list(range(args.seeds)),
                       "epochs": args.epochs, "failures": args.failures})
        from cifar10.data import write_digits

        data = write_digits(args.runs / "data" / "digits-cifar10-layout")
        for seed in range(args.seeds):
            for row in args.rows:
                if any(r["row"] == row and r["seed"] == seed for r in record["runs"]):
                    continue
                run = one_run(row, seed, data, args.runs, args.epochs, tuple(args.failures))
                record["runs"].append(run)
                args.out.mkdir(parents=True, exist_ok=True)
                page_json.write_text(json.dumps(record, indent=1) + "\n")
                print(json.dumps({k: run[k] for k in ("row", "seed", "final_test_top1", "wall_s", "failures")}),
                      flush=True)
    (args.out / "fault_tolerance_pipelines.md").write_text(render(record))
    page_json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
