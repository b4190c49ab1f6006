"""Training through failures in the pipelines: the study's digits recipe (``cifar10.train``, ResNet-8) and its tiny
BERT (``bert.train``) under torchft, against the same jobs restarted from their checkpoints.

    python -m bench.ft_pipelines                         # the digits rows, 3 seeds (about 40 minutes)
    python -m bench.ft_pipelines --task bert --rows slamb slamb_ft_fail slamb_restart lamb_ft_fail  # 35 min a seed
    python -m bench.ft_pipelines --report-only           # results/fault_tolerance_pipelines.md again from the .json

Each run is the pipeline's own command (``python -m cifar10.train experiment=study/digits_<row> ...``), as a user
runs it; failures come from the pipelines' fault hook (``SLAMB_FAULT_AT_STEP=N0,N1,N2``, worker or replica group 1:
attempt k dies before step N_k, so one run meets three failures). The rows, each on the seeds asked for:

* ``slamb``: SLAMB without a failure, on 4 workers (the study's run);
* ``slamb_ft`` / ``lamb_ft``: SLAMB / LAMB under torchft (4 replica groups of one worker, ``+mixin=torchft``) without
  a failure: torchft's own cost;
* ``slamb_ft_fail`` / ``lamb_ft_fail``: the same with the failures: group 1 is killed, the launcher relaunches it while
  the others train on, and it heals from a peer (heal policy ``peer``);
* ``slamb_restart``: SLAMB on 4 workers with checkpoints: each failure restarts every worker from the last
  checkpoint (torch's elastic launcher).

Every failing row may restart (relaunch) once per failure (``trainer.max_restarts``). The runner watches each run's
``metrics.jsonl`` and records when each line appears (seconds from the command's start): the time to the study's
target is the first line at or above it (digits; BERT: at or below), whichever attempt wrote it. Each finished run
is kept at once in ``<runs>/fault_tolerance_pipelines_<task>.json``, outside the checkout, so that the runs after it
find the checkout as committed; a run already there (or on the page) is not run again, so a stopped page continues
(``--fresh`` starts the task over). The page and its ``.json`` in ``results/`` are written when the runs end.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT, shown_command

TORCHFT = ["+mixin=torchft", "trainer.replica_groups=4"]


@dataclasses.dataclass(frozen=True)
class Task:
    module: str
    experiments: dict  # optimizer -> the study's experiment
    metric: str  # the metrics line's key the target is on
    finals: tuple  # the summary's keys kept per run; the first is the target's
    higher_is_better: bool
    margin: float  # the study's equivalence margin: the target is LAMB's mean less (or plus) this
    failures: tuple  # steps before which worker (group) 1 dies, one per attempt
    checkpoint: tuple  # what the restart row adds: its checkpoints
    resumed: tuple  # what a resumed run's ``resumed_from`` counts, and the steps in one: ("epochs", 5) | ("steps", 1)
    setup: str  # the recipe, for the page


TASKS = {
    "digits": Task(
        "cifar10.train", {"slamb": "study/digits_slamb_v1", "lamb": "study/digits_lamb"}, "test_top1",
        ("final_test_top1", "final_test_loss"), True, 1.0,
        (48, 98, 148),  # mid-epoch (the 3rd of an epoch's 5 steps): a restart redoes 2 steps of each
        ("trainer.checkpoint.enabled=true",),  # one each epoch
        ("epochs", 5),
        "`cifar10.train` with a ResNet-8 (75,290 parameters) on scikit-learn's digits in the CIFAR-10 layout (1,500 "
        "training, 297 test images), global batch 256 (4 x 64), epochs of 5 steps, fp32; SLAMB v1 (k 0.1, beta3 0.99, "
        "H 10, the compression warm-up) and LAMB, as the study's rows; a checkpoint each epoch for the restart row; "
        "the metric: the test top-1 (%) of the ranks' (groups') averaged model at each epoch's end"),
    "bert": Task(
        "bert.train", {"slamb": "study/bert_slamb", "lamb": "study/bert_lamb"}, "val_mlm_loss",
        ("final_val_mlm_loss", "final_val_mlm_acc"), False, 0.05,
        (175, 375, 575),  # half-way between two checkpoints: a restart redoes 24 steps of each
        ("trainer.checkpoint.enabled=true", "trainer.checkpoint.every=50"),
        ("steps", 1),
        "`bert.train`, phase 1 of a 2-layer BERT (hidden 64, 271,570 parameters) on the standard library's "
        "docstrings (the study's shards), seq 128, global batch 128 (4 x 32), 800 steps, fp32; SLAMB v2 (k 0.1, "
        "beta3 0.93, H 11) and LAMB, as the study's rows; a checkpoint every 50 steps for the restart row; the "
        "metric: the validation MLM loss of the averaged model every 50 steps"),
}
ROWS = {  # optimizer, mode, with failures
    "slamb": ("slamb", [], False),
    "slamb_ft": ("slamb", TORCHFT, False),
    "slamb_ft_fail": ("slamb", TORCHFT, True),
    "slamb_restart": ("slamb", ["checkpoint"], True),
    "lamb_ft": ("lamb", TORCHFT, False),
    "lamb_ft_fail": ("lamb", TORCHFT, True),
}
NAMES = {"slamb": "SLAMB, no failure (4 workers)", "slamb_ft": "SLAMB under torchft, no failure",
         "slamb_ft_fail": "SLAMB under torchft, failures",
         "slamb_restart": "SLAMB, restart from a checkpoint, failures",
         "lamb_ft": "LAMB under torchft, no failure", "lamb_ft_fail": "LAMB under torchft, failures"}
BASE = {"slamb_ft_fail": "slamb_ft", "lamb_ft_fail": "lamb_ft", "slamb_restart": "slamb"}  # time lost: against these
COMMAND = "python -m bench.ft_pipelines"


def study_target(task: str, records: Path) -> tuple[float, int]:
    """The study's LAMB mean of the task's final metric (its records) less (or plus) the margin, and the runs it
    averages."""
    t = TASKS[task]
    values = [json.loads(p.read_text())[t.finals[0]]
              for p in sorted((records / task).glob(f"study_{task}_lamb_seed*/metrics.json"))]
    if not values:
        raise SystemExit(f"error: no LAMB run of the study under {records / task}; fix: run `make study` (its "
                         f"{task} task) first: its LAMB runs set the target")
    return statistics.mean(values) + (-t.margin if t.higher_is_better else t.margin), len(values)


def data_overrides(task: str, runs: Path, study_runs: Path) -> list[str]:
    """The task's data: the digits written here; the study's BERT shards, which ``scripts/study.py`` prepares."""
    if task == "digits":
        from cifar10.data import write_digits

        return [f"data.dir={write_digits(runs / 'data' / 'digits-cifar10-layout')}"]
    made = study_runs / "data" / "bert" / "data.json"
    if not made.exists():
        raise SystemExit(f"error: no BERT data of the study at {made.parent}; fix: run `python scripts/study.py "
                         "--tasks bert` first (it prepares the shards, then runs only the runs it lacks)")
    data = json.loads(made.read_text())
    return [f"data.dir={data['train_dir']}", f"validation.dir={data['valid_dir']}",
            f"model.vocab_size={data['vocab_size']}"]


def watch(cmd: list[str], run_dir: Path, env: dict, task: Task) -> tuple[subprocess.CompletedProcess, float, list]:
    """Run ``cmd``; the wall seconds, and ``[seconds, step, metric]`` for each metrics line when it appeared (a
    restart rewrites the lines after its checkpoint: each written line counts once, when first seen)."""
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
                    lines.append([round(time.perf_counter() - tic, 2), row["step"], row[task.metric]])
            if done:
                break
            time.sleep(0.25)
    wall = time.perf_counter() - tic
    return subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), ""), wall, lines


def step_seconds(run_dir: Path) -> float:
    """The median over the run's metrics lines of the mean step time each gives (forward, backward and the
    optimizer's step with its collectives; not the period's averaging and evaluation)."""
    from harness.run import read_jsonl

    return round(statistics.median(r["step_time_s"] for r in read_jsonl(run_dir / "metrics.jsonl")), 4)


def one_run(task: str, row: str, seed: int, overrides: list[str], runs: Path, failures: tuple[int, ...]) -> dict:
    t = TASKS[task]
    optimizer, mode, failing = ROWS[row]
    mode = [m for m in mode if m != "checkpoint"] + (list(t.checkpoint) if "checkpoint" in mode else [])
    run_dir = runs / task / f"{row}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished attempt's: the run starts over
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    if failing:
        env.update({"SLAMB_FAULT_AT_STEP": ",".join(map(str, failures)), "SLAMB_FAULT_RANK": "1"})
        mode = [*mode, f"trainer.max_restarts={len(failures)}"]  # a restart (relaunch) per failure
    cmd = [sys.executable, "-m", t.module, f"experiment={t.experiments[optimizer]}", f"seed={seed}", *overrides,
           "trainer.resume=auto", *mode, f"hydra.run.dir={run_dir}"]
    done, wall, lines = watch(cmd, run_dir, env, t)
    if done.returncode != 0:
        raise SystemExit(f"error: {task} {row} seed {seed} failed (exit {done.returncode}); its console: "
                         f"{run_dir.parent / (run_dir.name + '.log')}\n{done.stdout[-2000:]}")
    summary = json.loads((run_dir / "metrics.json").read_text())
    meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").exists() else {}
    return {"row": row, "seed": seed, "command": shown_command(cmd[1:]), "commit": meta.get("git", {}).get("commit"),
            "dirty": meta.get("git", {}).get("dirty"), **{k: summary[k] for k in t.finals},
            "steps": summary["steps"], "wall_s": round(wall, 2), "lines": lines,
            "failures": done.stdout.count("[fault injection]"),
            "relaunches": sum(line.startswith("replica group ") for line in done.stdout.splitlines()),
            "resumed_from": summary.get("resumed_from", []), "bytes_total": summary["bytes_total"],
            "step_s": step_seconds(run_dir)}


def line_seconds(run: dict) -> float:
    """The median seconds from one metrics line to the next, as the runner saw them appear (the period's steps,
    its averaging and its evaluation)."""
    t = [x[0] for x in run["lines"]]
    return statistics.median(b - a for a, b in zip(t, t[1:]))


def time_to(run: dict, target: float, higher_is_better: bool) -> float | None:
    return next((t for t, _, v in run["lines"] if (v >= target if higher_is_better else v <= target)), None)


def pm(values: list[float], digits: int = 1) -> str:
    """``mean ± sd`` of the runs' values (the mean alone for one run)."""
    from harness.records import pm as mean_sd, stat

    return mean_sd(stat(values), digits)


LABELS = {"final_test_top1": ("final top-1 (%)", 2), "final_test_loss": ("final test loss", 3),
          "final_val_mlm_loss": ("final validation MLM loss", 4),
          "final_val_mlm_acc": ("final validation MLM acc (%)", 2)}


def section(task: str, record: dict) -> list[str]:
    t, runs, target = TASKS[task], record["runs"], record["target"]

    def of(row):
        return sorted((r for r in runs if r["row"] == row), key=lambda r: r["seed"])

    def lost(r):
        base = next((b for b in of(BASE[r["row"]]) if b["seed"] == r["seed"]), None) if r["row"] in BASE else None
        return (r["wall_s"] - base["wall_s"]) / r["failures"] if base and r["failures"] else None

    commits = sorted({str(r["commit"])[:12] + (" (with uncommitted changes)" if r.get("dirty") else "")
                      for r in runs})
    unit = "point" if t.higher_is_better else "nats"
    lines = [f"## {task}", "",
             f"Runs on commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}, torch {record['torch']}, on "
             f"{record['hardware']}; started {record['started']}; the runs' wall time "
             f"{sum(r['wall_s'] for r in runs) / 60:.0f} min (`fault_tolerance_pipelines_{task}.json`).", "",
             f"- The study's recipe (`results/study/`): {t.setup}. {record['steps']} steps.",
             f"- Failures: worker (group) 1 exits before steps {', '.join(map(str, record['failures']))}.",
             f"- Target: the study's LAMB mean ({t.finals[0]}, n = {record['target_runs']}) "
             f"{'less' if t.higher_is_better else 'plus'} {t.margin:g} {unit} = **{target:.4g}**.",
             f"- Seeds {', '.join(map(str, sorted({r['seed'] for r in runs})))}; mean ± sample standard deviation"
             + (" (one seed: no interval)" if len({r["seed"] for r in runs}) == 1 else "") + ".", "",
             "| run | " + " | ".join(LABELS[k][0] for k in t.finals) + " | time to target (s) | wall time (s) | "
             "failures | time lost per failure (s) | step (s) | line to line (s) | healing bytes sent | seeds |",
             "|---" * (9 + len(t.finals)) + "|"]
    for row, name in NAMES.items():
        rs = of(row)
        if not rs:
            continue
        reached = [x for x in (time_to(r, target, t.higher_is_better) for r in rs) if x is not None]
        ttt = pm(reached) + (f" ({len(reached)} of {len(rs)} reached it)" if len(reached) < len(rs) else "")
        losts = [x for x in (lost(r) for r in rs) if x is not None]
        heal = [r["bytes_total"].get("heal", 0) for r in rs]
        lines.append(f"| {name} | " + " | ".join(pm([r[k] for r in rs], LABELS[k][1]) for k in t.finals) +
                     f" | {ttt} | {pm([r['wall_s'] for r in rs])} | {pm([r['failures'] for r in rs], 0)} | "
                     f"{pm(losts) if losts else '-'} | {pm([r['step_s'] for r in rs if 'step_s' in r], 3)} | "
                     f"{pm([line_seconds(r) for r in rs], 2)} | "
                     f"{f'{statistics.mean(heal):,.0f}' if any(heal) else '-'} | {len(rs)} |")
    restart, plain = of("slamb_restart"), of("slamb")
    if restart:
        # a restart resumes at its last checkpoint and takes again the steps from there to the failure
        unit, per = t.resumed
        redone = [f - 1 - per * at for r in restart for f, at in zip(record["failures"], r["resumed_from"])]
        same = sum(any(p["seed"] == r["seed"] and all(p[k] == r[k] for k in t.finals) for p in plain) for r in restart)
        lines += ["", f"A restart from a checkpoint resumed from {unit} "
                  f"{'; '.join(', '.join(map(str, r['resumed_from'])) for r in restart)} (seeds in order) and took "
                  f"{pm(redone, 1)} steps again per failure. Its final metrics equal those of the same seed's run "
                  f"without a failure in {same} of {len(restart)} seeds (a restart resumes exactly)."]
    return lines


def render(records: dict) -> str:
    from harness.fault_tolerance import HEARTBEAT_MS, JOIN_MS

    lines = ["# Training through failures in the pipelines: torchft against restarts", "",
             f"Written by `{COMMAND}` from the runs in `fault_tolerance_pipelines_<task>.json`: every number below is "
             "computed from them.", "",
             "## How the rows ran", "",
             "- Each run is the pipeline's own command. Under torchft: 4 replica groups of one worker each (the "
             "launcher's lighthouse; `+mixin=torchft trainer.replica_groups=4`), each taking the share of the "
             "global batch a rank of 4 workers would; a relaunched group heals from a peer (`trainer.heal=peer`) "
             "while the others train on. With a restart: torch's elastic launcher restarts every worker, which "
             "resume from the last checkpoint. Three failures in a run stand for a job that loses a node every few "
             "hours over a run of a day or two, as the paper's 1,024-GPU runs would.",
             "- Time to target: wall seconds from the command's start (interpreter, launcher and evaluations "
             "included) to the first metrics line at the target. Time lost per failure: the run's wall time over "
             "that of the same seed's run of the same mode without a failure (torchft rows: under torchft; the "
             "restart row: the plain run, which writes no checkpoint), per failure.",
             "- Healing bytes sent: the `heal` bytes in the ledger of the run's summary (written by the first group "
             "of the last quorum; a heal's bytes are its sender's).",
             "- Step: the median over a run's metrics lines of their mean step time (forward, backward, the "
             "optimizer's step with its collectives and, under torchft, the quorum and the commit). Line to line: "
             "the median time between two metrics lines (the period's steps, its model average and the "
             "evaluation: under torchft each group scores the averaged model on the whole evaluation set, and "
             "SLAMB's its own model too, where a worker of 4 scores a quarter).",
             f"- Under torchft a failure costs the survivors the failed step and a quorum without the dead group: "
             f"the lighthouse drops it after {HEARTBEAT_MS / 1000:g} s without a heartbeat, and a quorum waits up "
             f"to {JOIN_MS / 1000:g} s for a group of the last one (`harness/fault_tolerance.py`). "
             "`results/fault_tolerance.md` measures the survivors' recovery per failure with shorter timeouts, "
             "the heal policies and the commit-safe step's cost.", ""]
    for task in TASKS:
        if task in records:
            lines += section(task, records[task]) + [""]
    lines += ["## What would change at scale", "",
              "Here a restart costs a start of the workers (forks of a fork server that has imported the "
              "pipeline), a rendezvous, a checkpoint load of a small model and the steps since the last checkpoint; "
              "under torchft a failure costs the survivors the lighthouse's timeouts above and a heal of 14 bytes "
              "per parameter to the joining group, and every step a quorum and a commit. On 1,024 GPUs a restart "
              "starts every process of the job, rendezvous over the cluster and loads a checkpoint of the "
              "model and its optimizer state (minutes, not seconds), and failures come more often the more nodes "
              "there are, so the restart row's loss per failure grows with the job while the survivors' does not; "
              "torchft's per-step quorum and commit are round trips whose cost does not grow with the model. Not "
              "run here: groups of more than one process, NCCL, more than 4 groups."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="digits", choices=list(TASKS))
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "ft_pipelines")
    parser.add_argument("--study", type=Path, default=ROOT / "results" / "study" / "runs",
                        help="the study's records (its LAMB runs set the target)")
    parser.add_argument("--study-runs", type=Path, default=ROOT / "runs" / "study",
                        help="the study's run folder (its BERT data)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--epochs", type=int, default=None, help="digits: the recipe's 40 unless given (a smaller "
                        "number: a smoke run)")
    parser.add_argument("--failures", type=int, nargs="+", default=None, help="the steps before which worker "
                        "(group) 1 dies, one per attempt (default: the task's)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="run the task's runs again")
    args = parser.parse_args(argv)
    import torch

    from harness.run import hardware

    args.out.mkdir(parents=True, exist_ok=True)
    records = {task: json.loads(p.read_text()) for task in TASKS
               if (p := args.out / f"fault_tolerance_pipelines_{task}.json").exists()}
    if not args.report_only:
        task, t = args.task, TASKS[args.task]
        page_json = args.out / f"fault_tolerance_pipelines_{task}.json"
        staged = args.runs / page_json.name
        record = ({"runs": []} if args.fresh else json.loads(staged.read_text()) if staged.exists()
                  else records.get(task, {"runs": []}))
        target, n = study_target(task, args.study)
        failures = tuple(args.failures or t.failures)
        overrides = data_overrides(task, args.runs, args.study_runs)
        if args.epochs is not None:
            overrides.append(f"epochs={args.epochs}")
        record.update({"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
                       "hardware": hardware(torch.device("cpu")), "target": target, "target_runs": n,
                       "failures": list(failures)})
        records[task] = record
        for seed in range(args.seeds):
            for row in args.rows:
                if any(r["row"] == row and r["seed"] == seed for r in record["runs"]):
                    continue
                run = one_run(task, row, seed, overrides, args.runs, failures)
                record["runs"].append(run)
                record["steps"] = run["steps"]
                staged.parent.mkdir(parents=True, exist_ok=True)
                staged.write_text(json.dumps(record, indent=1) + "\n")
                print(json.dumps({k: run[k] for k in ("row", "seed", t.finals[0], "wall_s", "failures")}),
                      flush=True)
        page_json.write_text(json.dumps(record, indent=1) + "\n")
        staged.unlink(missing_ok=True)
    (args.out / "fault_tolerance_pipelines.md").write_text(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
