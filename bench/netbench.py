"""Multi-host bandwidth bench: the real pipelines across emulated hosts with shaped links.

    python -m bench.netbench                                   # the full matrix (about 30 min on 2 cores)
    python -m bench.netbench --hosts 2 4 --rates 50 200 --epochs 8 --pipelines cifar10
    python -m bench.netbench --quick                           # 2 hosts, 10 Mbit/s, 2 epochs (~1 min)
    python -m bench.netbench --render-only                     # netbench.md and plots from the raw JSON
    python -m bench.netbench --hosts 2 --procs-per-host 2 --rates 10 --pipelines cifar10 \
        --out results/netbench_hierarchical.md                  # hosts of 2 processes: hierarchical SLAMB's rows

Only the full matrix (every setting at its default) writes ``results/``; ``--quick`` and any other
partial matrix write to ``runs/netbench/`` unless ``--out`` names a page, so that a quick check never
replaces the committed results. The raw JSON and the plots are named after the page.

With ``--procs-per-host P`` each host runs P processes (``--nproc-per-node P``): their traffic inside
the host crosses the namespace's loopback, the traffic between hosts its shaped veth, and both
interfaces' counters are recorded beside the ledger's bytes by level (``intra``, ``inter``, ``world``).

For each host count N a :class:`bench.netns.Cluster` of N network namespaces
on a switch namespace is created; for each link rate (and an unlimited link,
the compute-only reference) and each optimizer row, one ``torchrun`` per
namespace (``--nnodes N --node-rank i --nproc-per-node 1``) runs the real
training pipeline (``cifar10.train`` on the digits demo data, ``bert.train``
with the tiny BERT on the offline docstring corpus) with gloo over the veth
addresses. Namespaces are deleted when the bench ends, fails or is killed.

Inside each worker this module (``--worker``) wraps the pipeline: whenever the
pipeline logs a period (an epoch for CIFAR-10, ``log_every`` steps for BERT,
right after a period's collective bookkeeping all-reduce, so all ranks are at
the same point) it appends the rank's ledger totals (payload and wire bytes by
kind) and its interface counters and TCP retransmissions to
``<run_dir>/netbench/rank<r>.jsonl``. The difference between the first and
the last period boundary is the training phase: no start-up, rendezvous,
model broadcast or final export, only optimizer steps and the tiny
per-period metric all-reduces (a few dozen bytes).

Numbers per run (``results/netbench_raw.json``, one record per pipeline,
hosts, rate and optimizer row):

* ``step_time_s``: median over the measured periods of the pipeline's own
  training time per step (evaluation excluded);
* ``compute_time_s``: the same row's step time on the same hosts with an
  unlimited link (no ``tc``): the step with communication as cheap as this
  machine can make it, under the same CPU sharing among the N workers
  (with 8 hosts on 2 cores each worker gets a quarter of a core; world size 1
  would understate it); ``comm_time_s = step_time_s - compute_time_s``;
* ``ledger_*_bytes_per_step``: the optimizer's ledger per rank and step;
* ``link_tx_bytes_per_step``: bytes the interface sent, mean over hosts;
  ``link_tx_payload_bytes_per_step``: the same less 66 header bytes
  (Ethernet 14, IPv4 20, TCP with timestamps 32) per packet counted: every
  packet counted (a GSO super-packet included) carries one set of headers, so
  this is the TCP payload exactly, retransmissions included (reported).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER_FLAG = "--worker"
IFNAME_ENV = "NETBENCH_IFNAME"
PIPELINES = ("cifar10", "bert")
UNLIMITED = None


# ----------------------------------------------------------------------------- worker side

def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read())


def tcp_snmp() -> dict:
    """TCP segment counters of this network namespace (``/proc/net/snmp`` is per namespace)."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    table = dict(zip(rows[0][1:], rows[1][1:]))
    return {"out_segs": int(table["OutSegs"]), "retrans_segs": int(table["RetransSegs"])}


def interface_counters(dev: str) -> dict:
    """The interface's counters from sysfs (``ip netns exec`` mounts the namespace's own sysfs)."""
    base = f"/sys/class/net/{dev}/statistics"
    return {f"{d}_{k}": _read_int(f"{base}/{d}_{k}") for d in ("tx", "rx") for k in ("bytes", "packets")}


def _install_probes(dev: str) -> None:
    """Record ledger totals and interface counters where each period's training begins and ends (all ranks)."""
    from harness import PERIOD_HOOKS

    def record(loop, event: str) -> None:
        rank = int(os.environ.get("RANK", "0"))
        ledger = {k: {"payload": int(v["payload"]), "wire": float(v["wire"]), "calls": int(v["calls"]),
                      "levels": {lv: {"payload": int(x["payload"]), "wire": float(x["wire"])}
                                 for lv, x in v.get("levels", {}).items()}}
                  for k, v in loop.optimizer.comm_stats()["total"].items()}
        # the loopback carries the traffic between the processes of one host (see launch_run)
        loopback = {f"lo_{k}": v for k, v in interface_counters("lo").items()}
        line = {"event": event, "step": loop.step, "time": time.time(), "ledger": ledger,
                **interface_counters(dev), **loopback, **tcp_snmp()}
        out = Path(loop.run_dir) / "netbench"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    PERIOD_HOOKS.append(record)


def worker_main(argv: list[str]) -> None:
    """``--worker PIPELINE [hydra overrides]``: the pipeline's Hydra entry point with the probes installed."""
    if not argv or argv[0] not in PIPELINES:
        raise SystemExit(f"usage: python -m bench.netbench {WORKER_FLAG} {{{'|'.join(PIPELINES)}}} [overrides]")
    dev = os.environ.get(IFNAME_ENV)
    if not dev:
        raise SystemExit(f"{IFNAME_ENV} must name this host's interface (the bench sets it)")
    _install_probes(dev)
    import runpy

    # as `python -m PIPELINE.train`: Hydra finds the pipeline's config directory from its __main__ file
    module = f"{argv[0]}.train"
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# ----------------------------------------------------------------------------- bench configuration

# optimizer rows: (pipeline -> Hydra overrides). The CIFAR-10 rows are the digits demo's; 1-bit LAMB takes
# LAMB's row settings (its warm-up, freeze_step, is set per run to 20% of the steps as in bert.demo), DGC takes
# the SGD-M demo row's (lr 0.03, momentum 0.9, wd 1e-4) with DGC's own density 0.001 and 4-epoch warm-up.
HIER = "SLAMB hierarchical"
ROWS = {
    "LAMB": {"cifar10": ["experiment=cifar10/demo_lamb"],
             "bert": ["experiment=bert/phase1_lamb"]},
    "SLAMB": {"cifar10": ["experiment=cifar10/demo_slamb"],
              "bert": ["experiment=bert/phase1_slamb", "optimizer.sync_interval=10",
                       "optimizer.min_compress_numel=2000"]},
    # the fused step (torch.compile'd passes): its optimizer time beside the multi-tensor step's
    "LAMB fused": {"cifar10": ["experiment=cifar10/demo_lamb", "optimizer.fused=true"],
                   "bert": ["experiment=bert/phase1_lamb", "optimizer.fused=true"]},
    "SLAMB fused": {"cifar10": ["experiment=cifar10/demo_slamb", "optimizer.fused=true"],
                    "bert": ["experiment=bert/phase1_slamb", "optimizer.sync_interval=10",
                             "optimizer.min_compress_numel=2000", "optimizer.fused=true"]},
    "SLAMB+overlap": {"cifar10": ["experiment=cifar10/demo_slamb", "optimizer.overlap=true"],
                      "bert": ["experiment=bert/phase1_slamb", "optimizer.sync_interval=10",
                               "optimizer.min_compress_numel=2000", "optimizer.overlap=true"]},
    "1-bit LAMB": {"cifar10": ["+mixin=demo_digits", "optimizer=onebit_lamb", "name=netbench_onebit_lamb",
                               "optimizer.lr=0.01", "optimizer.weight_decay=1.0e-4"],
                   "bert": ["experiment=bert/phase1_onebit_lamb"]},
    "DGC": {"cifar10": ["+mixin=demo_digits", "optimizer=dgc", "name=netbench_dgc", "optimizer.lr=0.03",
                        "optimizer.momentum=0.9", "optimizer.weight_decay=1.0e-4"],
            "bert": ["optimizer=dgc", "name=netbench_bert_dgc", "optimizer.momentum=0.9",
                     "optimizer.weight_decay=0.01"]},
    # rows of hosts with several processes (--procs-per-host): SLAMB with a node as its worker (gradients
    # averaged densely inside the host, the momentum exchange and model syncs across hosts), and two more
    # communication-efficient baselines of the registry. PowerSGD takes the SGD-M demo row's settings (its
    # rank-1 factors from the second epoch on, set per run); DiLoCo takes LAMB's row settings as its inner
    # optimizer with H = 10 local steps, SLAMB's sync interval in the demo
    HIER: {"cifar10": ["experiment=cifar10/demo_slamb", "optimizer.hierarchy=node"],
           "bert": ["experiment=bert/phase1_slamb", "optimizer.sync_interval=10",
                    "optimizer.min_compress_numel=2000", "optimizer.hierarchy=node"]},
    "PowerSGD": {"cifar10": ["+mixin=demo_digits", "optimizer=powersgd", "name=netbench_powersgd",
                             "optimizer.lr=0.03", "optimizer.weight_decay=1.0e-4"],
                 "bert": ["optimizer=powersgd", "name=netbench_bert_powersgd", "optimizer.weight_decay=0.01"]},
    "DiLoCo": {"cifar10": ["+mixin=demo_digits", "optimizer=diloco", "name=netbench_diloco", "optimizer.inner=lamb",
                           "optimizer.lr=0.01", "optimizer.weight_decay=1.0e-4", "optimizer.sync_interval=10"],
               "bert": ["optimizer=diloco", "name=netbench_bert_diloco", "optimizer.inner=lamb",
                        "optimizer.sync_interval=10", "optimizer.weight_decay=0.01"]},
}
# the rows of the default matrix (one process per host)
DEFAULT_ROWS = ["LAMB", "SLAMB", "SLAMB+overlap", "1-bit LAMB", "DGC"]
# the rows of --procs-per-host > 1 when --optimizers is not given
MULTI_PROC_ROWS = ["LAMB", "SLAMB", HIER, "PowerSGD", "DiLoCo"]
TRAIN_IMAGES = 1500        # digits demo: training images (cifar10.demo.TEST_SIZE of 1797 held out)
CIFAR_BATCH = 64           # data.micro_batch of the demo rows
BERT_MICRO = 16            # sequences per worker and step (one micro-batch: no accumulation)


@dataclasses.dataclass
class Settings:
    pipelines: list[str]
    hosts: list[int]
    rates: list[float]
    rows: list[str]
    epochs: int
    bert_steps: int
    bert_hosts: list[int]
    bert_rates: list[float]
    bert_rows: list[str]
    delay_ms: float
    target_top1: float
    tta_hosts: list[int]
    tta_rates: list[float]
    timing_epochs: int
    run_timeout_s: float
    workdir: Path
    check_rates: list[float] = dataclasses.field(default_factory=list)
    reduce_from: int = 1 << 30
    reduced_rates: list[float] = dataclasses.field(default_factory=list)
    reduced_rows: list[str] = dataclasses.field(default_factory=list)
    procs_per_host: int = 1


def cifar_steps_per_epoch(workers: int) -> int:
    """Steps per epoch of the digits demo on ``workers`` processes (hosts x processes per host)."""
    return (TRAIN_IMAGES // workers) // CIFAR_BATCH


def run_overrides(pipeline: str, row: str, hosts: int, length: int, data_dir: Path, run_dir: Path,
                  vocab_size: int | None = None, *, steady: bool = False, procs: int = 1) -> list[str]:
    """Hydra overrides of one run (the row's settings, the bench's data and run directory, no checkpoints).

    ``steady``: a timing run (CIFAR-10), a few epochs of which only the first is left out of the
    measurement, so the schedules that change the communication in the first epochs start at their
    final value: SLAMB's k without the compression warm-up, DGC's density without its warm-up, 1-bit
    LAMB's compressed stage after the first epoch. The full runs keep the rows' recipes.
    """
    common = [f"hydra.run.dir={run_dir}", "trainer.device=cpu", "trainer.threads_per_worker=1",
              "trainer.resume=never", "trainer.checkpoint.enabled=false", "trainer.progress=false",
              "logger.wandb=false", f"data.dir={data_dir}"]
    workers = hosts * procs
    if row == HIER:
        common.append(f"optimizer.local_world_size={procs}")
    if pipeline == "cifar10":
        e = length
        spe = cifar_steps_per_epoch(workers)
        out = [*ROWS[row]["cifar10"], f"epochs={e}", f"schedule.milestones=[{max(1, e // 2)},{max(1, (23 * e) // 30)}]"]
        if row == "1-bit LAMB":
            freeze = spe if steady else max(1, spe * e // 5)
            out.append(f"optimizer.freeze_step={freeze}")
        if row == "PowerSGD":  # torch's hook needs > 1 with error feedback and warm start
            out.append(f"optimizer.start_powerSGD_iter={max(2, spe if steady else spe * e // 5)}")
        if steady and row in ("SLAMB", "SLAMB fused", "SLAMB+overlap", HIER):
            out.append("optimizer.compression_warmup=null")
        if steady and row == "DGC":
            out.append("optimizer.warmup_densities=[]")
        return out + common
    steps = length
    out = [*ROWS[row]["bert"], "model=bert_tiny", f"model.vocab_size={vocab_size}", "model.hidden_size=64",
           "model.intermediate_size=256", f"data.global_batch={BERT_MICRO * workers}", f"data.micro_batch={BERT_MICRO}",
           f"steps={steps}", f"log_every={max(1, steps // 8)}", "schedule.warmup_steps=null",
           "+schedule.warmup_fraction=0.1", "optimizer.lr=0.01", "trainer.precision=fp32", "paper=null"]
    if row == "1-bit LAMB":
        out.append(f"optimizer.freeze_step={max(1, steps // 8)}")
    if row == "DGC":
        out.append("optimizer.warmup_densities=[]")  # BERT's steps are all in one "epoch"
    if row == "PowerSGD":
        out.append(f"optimizer.start_powerSGD_iter={max(2, steps // 8)}")
    return out + common


def prepare_data(pipelines: list[str], workdir: Path) -> dict:
    """The offline demo data of each pipeline, written under the bench's work directory."""
    out = {}
    if "cifar10" in pipelines:
        from cifar10.demo import write_digits_dataset

        out["cifar10"] = {"dir": write_digits_dataset(workdir / "data" / "digits")}
    if "bert" in pipelines:
        from bert.demo import write_corpus
        from bert.prepare_data import Settings as PrepSettings
        from bert.prepare_data import default_max_predictions, prepare
        from bert.vocab import train_vocab

        base = workdir / "data" / "bert"
        files = write_corpus(base / "text")
        vocab = train_vocab(files, base / "vocab", 4000)
        prepare(files, vocab, base / "seq128", PrepSettings(128, default_max_predictions(128), dupe_factor=1),
                workers=1, progress=False)
        out["bert"] = {"dir": base / "seq128", "vocab_size": len(vocab.read_text().splitlines())}
    return out


# ----------------------------------------------------------------------------- running one configuration

def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def launch_run(cluster, pipeline: str, overrides: list[str], run_dir: Path, port: int, timeout_s: float,
               procs_per_host: int = 1) -> dict:
    """One torchrun per host with ``procs_per_host`` processes; waits for all of them. Returns {'ok', 'error', 'wall_s'}.

    Every process binds gloo to its host's veth address (gloo takes one interface per process group, not
    one per peer). Between two processes of one host that address is local, so the kernel routes their
    pairs through the namespace's loopback: the veth counts only the traffic between hosts, and ``lo``
    (recorded beside it) the traffic inside a host.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    from .netns import kill_processes

    procs, logs, error = [], [], None
    tic = time.perf_counter()
    try:
        for i in range(cluster.hosts):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.dev[i], IFNAME_ENV: cluster.dev[i],
                   "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            cmd = [*cluster.exec_prefix(i), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", str(cluster.hosts), "--node-rank", str(i), "--nproc-per-node", str(procs_per_host),
                   "--master-addr", cluster.addr[0], "--master-port", str(port), "--max-restarts", "0",
                   "-m", "bench.netbench", WORKER_FLAG, pipeline, *overrides]
            log = open(run_dir / f"host{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if any(c is None for c in codes):
            error = f"timed out after {timeout_s:.0f} s"
        elif any(c != 0 for c in codes):
            error = f"exit codes {codes}"
    finally:
        if any(p.poll() is None for p in procs):  # timed out or interrupted: torchrun's workers have their own
            kill_processes(cluster.ns)            # sessions, so stop everything inside the hosts
        for p in procs:
            _kill_group(p)
        for log in logs:
            log.close()
    if error:
        error += ": " + _failure_reason(run_dir)
    return {"ok": error is None, "error": error, "wall_s": time.perf_counter() - tic}


def _failure_reason(run_dir: Path) -> str:
    """The most telling line of the hosts' logs (a Hydra or Python error), else the tail of host 0's."""
    texts = [(run_dir / f).read_text(errors="replace") for f in sorted(os.listdir(run_dir)) if f.endswith(".log")]
    noise = ("elastic", "ChildFailedError", "error_file", "traceback :", "errors.html", "HYDRA_FULL_ERROR",
             "Error executing job")
    for pattern in (r"^\w+(Error|Exception)\b.*", r"Could not override.*", r".*(Error|Exception|not found).*"):
        for text in texts:
            hits = [ln.strip() for ln in text.splitlines()
                    if re.match(pattern, ln.strip()) and not any(n in ln for n in noise)]
            if hits:
                return hits[-1][:400]
    lines = [ln for ln in (texts[0] if texts else "").splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[:400]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def _training_intervals(lines: list[dict]) -> list[tuple[dict, dict]]:
    """(begin, end) probe lines of each period's training: an end pairs with the last begin before it."""
    intervals, begin = [], None
    for line in lines:
        if line["event"] == "begin":
            begin = line
        elif begin is not None:
            intervals.append((begin, line))
            begin = None
    return intervals


def analyse_run(run_dir: Path, pipeline: str, hosts: int, target_top1: float | None, procs: int = 1) -> dict:
    """Per-step numbers of a finished run from rank 0's metrics and every rank's probe lines.

    Ledger figures are per rank (``ledger_*``) and per host (``host_ledger_*``: the sum over the host's
    ``procs`` ranks, split by level); interface figures are per host (every rank of a host reads its
    host's counters: the mean over ranks is the mean over hosts).
    """
    history = _read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "metrics.json").read_text())
    probes = [_training_intervals(_read_jsonl(run_dir / "netbench" / f"rank{r}.jsonl")) for r in range(hosts * procs)]
    if len(history) < 2 or any(len(p) != len(history) for p in probes):
        raise RuntimeError(f"{run_dir}: need >= 2 logged periods on every rank "
                           f"(metrics: {len(history)}, probes: {[len(p) for p in probes]})")
    # the first period holds the first steps' one-off costs (allocations, the optimizer's first-step layout)
    measured = history[1:]
    steps = history[-1]["step"] - history[0]["step"]

    def period_mean(key):
        return sum(h[key] * (h["step"] - g["step"]) for g, h in zip(history, measured)) / steps

    per_rank = []
    for intervals in probes:
        counters = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets", "lo_tx_bytes", "lo_tx_packets", "out_segs",
                    "retrans_segs")
        totals = {k: 0.0 for k in ("payload", "wire", "calls", *counters)}
        levels: dict[str, dict[str, float]] = {}
        for first, last in intervals[1:]:  # training only: evaluation's traffic is not in the ledger
            kinds = set(last["ledger"]) - {"all"}
            for field in ("payload", "wire", "calls"):
                totals[field] += sum(last["ledger"][k][field] - first["ledger"].get(k, {}).get(field, 0)
                                     for k in kinds)
            for k in kinds:
                for level, x in last["ledger"][k].get("levels", {}).items():
                    before = first["ledger"].get(k, {}).get("levels", {}).get(level, {})
                    acc = levels.setdefault(level, {"payload": 0.0, "wire": 0.0})
                    for field in ("payload", "wire"):
                        acc[field] += x[field] - before.get(field, 0)
            for k in counters:
                totals[k] += last.get(k, 0) - first.get(k, 0)  # probes of older runs have no loopback counters
        # a collective without a level ran over the whole process group
        labelled = {f: sum(x[f] for x in levels.values()) for f in ("payload", "wire")}
        if totals["wire"] - labelled["wire"] > 0.5:
            world = levels.setdefault("world", {"payload": 0.0, "wire": 0.0})
            for field in ("payload", "wire"):
                world[field] += totals[field] - labelled[field]
        totals["levels"] = levels
        per_rank.append(totals)

    def mean(key):
        return statistics.fmean(r[key] for r in per_rank) / steps

    acc_key = "test_top1" if pipeline == "cifar10" else "mlm_acc"
    time_to_target = None
    if target_top1 is not None and pipeline == "cifar10":
        elapsed = 0.0
        for h in history:
            elapsed += h["epoch_time_s"]
            if h["test_top1"] >= target_top1:
                time_to_target = elapsed
                break
    tx_payload = statistics.fmean(r["tx_bytes"] - 66 * r["tx_packets"] for r in per_rank) / steps
    host_levels = {}
    for level in sorted({lv for r in per_rank for lv in r["levels"]}):
        host_levels[level] = {f: sum(r["levels"].get(level, {}).get(f, 0.0) for r in per_rank) / hosts / steps
                              for f in ("payload", "wire")}
    return {
        "procs_per_host": procs,
        "host_ledger_wire_bytes_per_step": sum(r["wire"] for r in per_rank) / hosts / steps,
        "host_ledger_levels_per_step": host_levels,
        "lo_tx_payload_bytes_per_step": statistics.fmean(r["lo_tx_bytes"] - 66 * r["lo_tx_packets"]
                                                         for r in per_rank) / steps,
        # mean over the measured periods, weighted by their steps: SLAMB's model sync every H steps and 1-bit
        # LAMB's periodic costs are part of the steady state, and a period may hold one or none of them
        "step_time_s": period_mean("step_time_s"),
        # spread of the per-period step times: how far one period's figure can be trusted on a shared machine
        "step_time_spread_s": statistics.stdev([h["step_time_s"] for h in measured]) if len(measured) > 1 else None,
        # the optimizer's share of step_time_s (its step, communication included), where the pipeline logs it
        "optimizer_time_s": (period_mean("optimizer_time_s") if all("optimizer_time_s" in h for h in measured)
                             else None),
        "ledger_payload_bytes_per_step": mean("payload"),
        "ledger_wire_bytes_per_step": mean("wire"),
        "ledger_calls_per_step": mean("calls"),
        "link_tx_bytes_per_step": mean("tx_bytes"),
        "link_tx_payload_bytes_per_step": tx_payload,
        "link_tx_packets_per_step": mean("tx_packets"),
        "link_rx_bytes_per_step": mean("rx_bytes"),
        "tcp_retrans_segs": int(sum(r["retrans_segs"] for r in per_rank)),
        "tcp_out_segs": int(sum(r["out_segs"] for r in per_rank)),
        "steps": int(summary["steps"]),
        "measured_steps": int(steps),
        "final_top1": history[-1][acc_key],
        "accuracy_metric": acc_key,
        "time_to_target_s": time_to_target,
        "target_top1": target_top1 if pipeline == "cifar10" else None,
        "params": int(summary["params"]),
        "history": [{"step": h["step"], acc_key: h[acc_key], "step_time_s": h["step_time_s"],
                     "time_s": h.get("epoch_time_s", h["step_time_s"] * h.get("period_steps", 1))}
                    for h in history],
    }


# ----------------------------------------------------------------------------- the matrix

def plan(s: Settings) -> list[dict]:
    """Every run: (pipeline, hosts, rate, row, length). The unlimited link first: it is the compute reference."""
    jobs = []
    for pipeline in s.pipelines:
        hosts = s.hosts if pipeline == "cifar10" else s.bert_hosts
        rates = s.rates if pipeline == "cifar10" else s.bert_rates
        rows = s.rows if pipeline == "cifar10" else s.bert_rows
        for n in hosts:
            reduced = pipeline == "cifar10" and n >= s.reduce_from  # N workers on few cores: long start-ups
            for rate in [UNLIMITED, *(s.reduced_rates if reduced else rates)]:
                for row in (s.reduced_rows if reduced else rows):
                    full = pipeline == "cifar10" and n in s.tta_hosts and rate in s.tta_rates
                    length = s.bert_steps if pipeline == "bert" else s.epochs if full else s.timing_epochs
                    jobs.append({"pipeline": pipeline, "hosts": n, "rate_mbit": rate, "optimizer": row,
                                 "length": length, "steady": pipeline == "cifar10" and not full,
                                 "procs_per_host": s.procs_per_host})
    return jobs


def model_name(pipeline: str) -> str:
    return "resnet8" if pipeline == "cifar10" else "bert_tiny(h64,2 layers)"


def run_matrix(s: Settings, log=print) -> tuple[list[dict], list[dict]]:
    from .netns import Cluster, netem_available, tcp_throughput

    if s.delay_ms > 0 and not netem_available():
        raise SystemExit(f"--delay-ms {s.delay_ms}: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so no "
                         "link delay can be emulated; rerun with --delay-ms 0")
    data = prepare_data(s.pipelines, s.workdir)
    jobs = plan(s)
    records, link_checks = [], []
    port = 29500
    with Cluster(2) as cluster:  # what the shaped links really carry: one TCP stream per set rate
        for rate in [UNLIMITED, *s.check_rates]:
            cluster.shape(rate, s.delay_ms if rate is not None else 0.0)
            link_checks.append(tcp_throughput(cluster, 0, 1, nbytes=_probe_bytes(rate)))
            log(f"   TCP check at {_rate(rate)} Mbit/s: {link_checks[-1]['mbit_s']:.1f} Mbit/s payload")
    for n in sorted({j["hosts"] for j in jobs}):
        with Cluster(n) as cluster:
            log(f"== {cluster}: {cluster.addr}")
            for rate in sorted({j["rate_mbit"] for j in jobs if j["hosts"] == n}, key=lambda r: r or 0):
                cluster.shape(rate, s.delay_ms if rate is not None else 0.0)
                for job in [j for j in jobs if j["hosts"] == n and j["rate_mbit"] == rate]:
                    port += 1
                    records.append(_one(job, cluster, s, data, port, log))
                    # kept as the matrix goes: a bench stopped half-way leaves its finished runs in --workdir
                    (s.workdir / "records.json").write_text(json.dumps(records, indent=1))
    fill_compute_times(records)
    return [complete(r) for r in records], link_checks


def _probe_bytes(rate: float | None) -> int:
    # about two seconds of traffic at the set rate, capped for the unlimited link
    return int(min(256e6, (rate or 1000) * 1e6 / 8 * 2))


def run_tag(job: dict) -> str:
    """The run directory's name of a job (or of its record)."""
    rate = job["rate_mbit"]
    row = job["optimizer"].replace(" ", "").replace("+", "_")
    procs = job.get("procs_per_host") or 1
    hosts = f"{job['hosts']}h" + (f"{procs}p" if procs > 1 else "")
    return f"{job['pipeline']}_{hosts}_{'unl' if rate is None else f'{rate:g}m'}_{row}"


# the keys every record has (another bench's scaling model reads them); None where a run failed
RECORD_KEYS = ("pipeline", "model", "hosts", "rate_mbit", "delay_ms", "optimizer", "step_time_s", "compute_time_s",
               "comm_time_s", "ledger_payload_bytes_per_step", "ledger_wire_bytes_per_step", "link_tx_bytes_per_step",
               "link_tx_payload_bytes_per_step", "steps", "final_top1", "time_to_target_s", "params")


def complete(record: dict) -> dict:
    for key in RECORD_KEYS:
        record.setdefault(key, None)
    return record


def reanalyse(records: list[dict], workdir: Path, target_top1: float | None) -> int:
    """Recompute the numbers of the successful records from their run directories under ``workdir``."""
    done = 0
    for r in records:
        run_dir = workdir / "runs" / run_tag(r)
        if r["status"] == "ok" and run_dir.is_dir():
            r.update(analyse_run(run_dir, r["pipeline"], r["hosts"], target_top1, r.get("procs_per_host") or 1))
            done += 1
    fill_compute_times(records)
    for r in records:
        complete(r)
    return done


def _one(job: dict, cluster, s: Settings, data: dict, port: int, log) -> dict:
    pipeline, n, rate, row = job["pipeline"], job["hosts"], job["rate_mbit"], job["optimizer"]
    tag = run_tag(job)
    run_dir = s.workdir / "runs" / tag
    if run_dir.exists():
        shutil.rmtree(run_dir)
    procs = job["procs_per_host"]
    overrides = run_overrides(pipeline, row, n, job["length"], data[pipeline]["dir"], run_dir,
                              data[pipeline].get("vocab_size"), steady=job["steady"], procs=procs)
    record = {"pipeline": pipeline, "model": model_name(pipeline), "hosts": n, "procs_per_host": procs,
              "rate_mbit": rate,
              "delay_ms": cluster.delay_ms, "optimizer": row, "length": job["length"],
              "recipe": "steady" if job["steady"] else "full", "length_unit": "epochs" if pipeline == "cifar10" else "steps"}
    # the machine's load: timings of runs that shared the cores with other jobs are indicative only
    load_before = os.getloadavg()[0]
    res = launch_run(cluster, pipeline, overrides, run_dir, port, s.run_timeout_s, procs_per_host=procs)
    record["wall_s"] = res["wall_s"]
    record["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    if res["ok"]:
        try:
            record.update(status="ok", **analyse_run(run_dir, pipeline, n, s.target_top1, procs))
        except Exception as e:  # one unreadable run must not cost the matrix its other results
            record.update(status="failed", error=f"analysis: {type(e).__name__}: {e}")
    else:
        record.update(status="failed", error=res["error"])
    if record["status"] == "ok":
        log(f"   {tag}: step {record['step_time_s'] * 1e3:.1f} ms, ledger wire "
            f"{record['ledger_wire_bytes_per_step'] / 1e3:.1f} kB/step, link payload "
            f"{record['link_tx_payload_bytes_per_step'] / 1e3:.1f} kB/step, top1 {record['final_top1']:.1f} "
            f"({res['wall_s']:.0f} s)")
    else:
        log(f"   {tag}: FAILED ({record['error']})")
    return record


def fill_compute_times(records: list[dict]) -> None:
    """compute_time_s of each run: its row's step time on the same hosts with the unlimited link."""
    def key(r):
        return r["pipeline"], r["hosts"], r.get("procs_per_host") or 1, r["optimizer"]

    ref = {key(r): r["step_time_s"] for r in records if r["rate_mbit"] is None and r["status"] == "ok"}
    for r in records:
        c = ref.get(key(r)) if r["status"] == "ok" else None
        r["compute_time_s"] = c
        r["comm_time_s"] = None if c is None else r["step_time_s"] - c


# ----------------------------------------------------------------------------- report

def _fmt(v, spec=".3g", none="–"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _rate(r):
    return "unlimited" if r is None else f"{r:g}"


def target_checks(records: list[dict]) -> dict:
    """The bench's targets, evaluated where they apply (reported, not asserted)."""
    ok = [r for r in records if r["status"] == "ok"]
    by = {(r["pipeline"], r["hosts"], r["rate_mbit"], r["optimizer"]): r for r in ok}
    speed = []
    for (p, n, rate, row), lamb in by.items():
        if row != "LAMB" or rate is None or lamb["comm_time_s"] is None:
            continue
        bound = lamb["comm_time_s"] >= 2 * lamb["compute_time_s"]
        sl, ov = by.get((p, n, rate, "SLAMB")), by.get((p, n, rate, "SLAMB+overlap"))
        ov_ref = by.get((p, n, None, "SLAMB+overlap")) or by.get((p, n, None, "SLAMB"))
        speed.append({
            "pipeline": p, "hosts": n, "rate_mbit": rate, "lamb_comm_over_compute": lamb["comm_time_s"] / lamb["compute_time_s"],
            "comm_bound": bound, "slamb_over_lamb": sl["step_time_s"] / lamb["step_time_s"] if sl else None,
            "lamb_top1": lamb["final_top1"], "slamb_top1": sl["final_top1"] if sl else None,
            "overlap_over_compute": (ov["step_time_s"] / ov_ref["step_time_s"]) if ov and ov_ref else None,
            "same_length": sl is not None and sl["length"] == lamb["length"],
        })
    wire = [{"pipeline": r["pipeline"], "hosts": r["hosts"], "rate_mbit": r["rate_mbit"], "optimizer": r["optimizer"],
             "raw": r["link_tx_bytes_per_step"] / r["ledger_wire_bytes_per_step"],
             "payload": r["link_tx_payload_bytes_per_step"] / r["ledger_wire_bytes_per_step"],
             "retrans": r["tcp_retrans_segs"]}
            for r in ok if r["ledger_wire_bytes_per_step"] > 0]
    return {"speed": speed, "wire": wire}


def render(raw: dict, out_md: Path) -> list[Path]:
    """netbench.md and the plots from the raw results."""
    records, checks, meta = raw["records"], raw.get("link_checks", []), raw.get("meta", {})
    procs = max((r.get("procs_per_host") or 1 for r in records), default=1)
    plots = _plots(records, out_md.parent, out_md.stem)  # the page's name prefixes its plots
    t = target_checks(records)
    L = ["# Multi-host bandwidth bench", "",
         "Produced by `python -m bench.netbench` (rebuild this page with `--render-only`). "
         f"Command: `{meta.get('command', '?')}`; {meta.get('started', '?')}; wall time "
         f"{_fmt(meta.get('wall_s', None), '.0f')} s on {meta.get('cpus', '?')} CPU cores; git {meta.get('git', '?')}.",
         *([meta["note"]] if meta.get("note") else []),
         "",
         "## Set-up", "",
         "- Hosts: one network namespace per host, each with a veth whose peer is a port of a bridge in a separate "
         "switch namespace (no traffic touches the machine's interfaces). One `torchrun` per host "
         f"(`--nnodes N --node-rank i --nproc-per-node {procs}`, static rendezvous on host 0's address), gloo over "
         "the veth (`GLOO_SOCKET_IFNAME`), 1 CPU thread per worker, all workers sharing this machine's cores."
         + ("" if procs == 1 else " Every process binds gloo to its host's veth address (gloo takes one interface "
            "per process group); between two processes of one host that address is local, so the kernel carries "
            "their traffic over the namespace's loopback `lo`: the veth counts the traffic between hosts only, "
            "`lo` (recorded beside it) the traffic inside a host."),
         "- Links: `tc tbf` on both ends of every host link (host end egress = upload, switch end egress = download), "
         "burst max(64 KiB, 2 ms of traffic), queue limit max(1 MiB, 100 ms). "
         + ("Link delay: `netem` " + f"{meta.get('delay_ms')} ms one way." if meta.get("delay_ms") else
            "**No link delay**: this kernel has no `netem` qdisc (CONFIG_NET_SCH_NETEM is not set: only tbf and htb "
            "exist), so the default 0.5 ms could not be emulated; the veth's own latency is tens of µs. "
            "With 0.5 ms a ring all-reduce would add about 2(N-1) x 0.5 ms per collective."),
         f"- Models: CIFAR-10 pipeline on the digits demo data (ResNet-8, {CIFAR_BATCH} images per worker and step; "
         f"{TRAIN_IMAGES} training images, so {', '.join(f'{n} hosts: {cifar_steps_per_epoch(n * procs)}' for n in sorted({r['hosts'] for r in records if r['pipeline'] == 'cifar10'}))} steps per epoch); "
         f"BERT pipeline with the tiny BERT (2 layers, hidden 64) on the offline docstring corpus, "
         f"{BERT_MICRO} sequences of 128 tokens per worker and step, fp32.",
         "- Rows: LAMB and SLAMB with the demo rows' settings (`experiment=cifar10/demo_lamb|demo_slamb`; BERT: "
         "`bert/phase1_*` with H=10, T=2000 as in `bert.demo`); SLAMB+overlap = SLAMB with `optimizer.overlap=true`; "
         "1-bit LAMB: LAMB's row settings (lr 0.01, wd 1e-4), freeze_step = 20% of the run's steps; DGC: the SGD-M "
         "demo row's settings (lr 0.03, momentum 0.9, wd 1e-4) with DGC's density 0.001 and 4-epoch warm-up."
         + ("" if procs == 1 else f" {HIER}: SLAMB's row with `optimizer.hierarchy=node optimizer.local_world_size="
            f"{procs}` (a host is one SLAMB worker: its gradients averaged densely inside the host, the momentum "
            "exchange and model syncs across hosts, local rank l carrying the l-th chunk); PowerSGD: the SGD-M demo "
            "row's settings with rank-1 factors from the second epoch on (timing runs); DiLoCo: LAMB's row settings "
            "for the inner optimizer, H = 10 local steps, outer Nesterov SGD (lr 0.7, momentum 0.9)."),
         "",
         "## How the numbers are measured", "",
         "- **Step time**: the pipeline's own training time (evaluation excluded) over the logged periods (epochs for "
         "CIFAR-10, `log_every` steps for BERT) after the first (first-step costs), per step: a mean, so that SLAMB's "
         "model sync every H steps is counted at its share whether or not a period holds one. '± x' is the standard "
         "deviation of the per-period step times: the machine's 2 cores are shared with other jobs, so differences "
         "smaller than that (negative communication times included) are noise.",
         "- **Optimizer step**: the time in the pipeline's optimizer step (`amp.step`: unscaling, the "
         "non-finite check, `optimizer.step()` with every collective it makes: SLAMB's momentum exchange and "
         "parameter syncs, 1-bit LAMB's compressed all-reduce), per step, as logged by the pipeline "
         "(`optimizer_time_s`; – where the measured code did not log it); on the unlimited link it is the step's computation, the rest of compute-only is "
         "forward and backward (DDP's gradient all-reduce, for the rows that send gradients, included).",
         "- **Timing runs** (recipe `steady`, CIFAR-10): a few epochs with the communication schedules at their final "
         "value from the start (SLAMB k = 0.1 without the compression warm-up, DGC density 0.001 without its "
         "warm-up, 1-bit LAMB compressed after epoch 1, which is not measured). **Full runs** (recipe `full`): the "
         "rows' complete recipes, for accuracy and time to target.",
         "- **Compute-only step time**: the same row on the same hosts with an **unlimited link** (no tc). This keeps "
         "the CPU sharing of N workers on this machine's cores (with world size 1 a worker would have the cores to "
         "itself and the compute time would be understated by up to N/cores), while the veth then moves GB/s, so "
         "communication costs next to nothing but its CPU work. Communication = step - compute-only "
         "(0 by definition on the unlimited rows).",
         "- **Bytes**: every worker records its ledger totals (payload and ring-wire bytes by kind) and its interface "
         "counters at each period boundary, right after the pipeline's period all-reduce; the training phase is "
         "from the first boundary to the last (no start-up, rendezvous, model broadcast, export). "
         "`link raw` = tx bytes of the host's interface per step (mean over hosts); `link payload` = raw - 66 x "
         "tx packets (Ethernet 14 + IPv4 20 + TCP with timestamps 32 bytes per packet: every packet counted, GSO "
         "super-packets on unlimited links included, carries one set of headers, so this is the TCP payload "
         "exactly; TCP ACKs carry no payload and vanish). The veths pass GSO super-packets (up to 64 KiB under one "
         "set of headers; tbf splits some of them, see the link check's bytes/packet), so `link raw` understates "
         "the frames of a real 1500-MTU Ethernet, which carries 1448 payload bytes in a 1514-byte frame: there the "
         "raw bytes would be link payload x 1.046 (+ ACK frames). "
         "What remains above the ledger: gloo's per-message framing (a fixed cost per collective, shown as extra "
         "bytes per collective call: it dominates for optimizers that send many small tensors), TCP "
         "retransmissions (counted), and the tiny metric all-reduces at the period boundaries.",
         ""]
    if checks:
        L += ["## Link check (one TCP stream between two hosts, python sockets)", "",
              "| set rate (Mbit/s) | achieved payload (Mbit/s) | achieved / set | tx frames: bytes/packet |",
              "|---|---|---|---|"]
        for c in checks:
            L.append(f"| {_rate(c['rate_mbit'])} | {c['mbit_s']:.1f} | "
                     f"{_fmt(c['mbit_s'] / c['rate_mbit'] if c['rate_mbit'] else None, '.3f')} | "
                     f"{c['tx_bytes'] / max(1, c['tx_packets']):.0f} |")
        L += ["", "tbf counts whole frames, so a saturated stream carries 1448/1514 = 0.956 of the set rate in "
              "payload; the bucket's initial burst (max(64 KiB, 2 ms of traffic)) leaves at once, which adds "
              "burst / probe bytes to a 2-second probe (+2.6% at 10 Mbit/s, nothing visible at 200 Mbit/s and "
              "above).", ""]
    L += ["## Targets (reported, not asserted)", "",
          "Comm-bound: LAMB's communication >= 2x its compute-only step time. 'At equal accuracy' can only be "
          "judged on the full-recipe runs (CIFAR-10, 2 hosts, 50 Mbit/s, where LAMB and SLAMB end at the same "
          "test top-1); the timing runs are too short for accuracy, and the BERT runs (16 steps) show a masked-LM "
          "accuracy that is a sanity figure only.", ""]
    if t["speed"]:
        L += ["| pipeline | hosts | rate | LAMB comm/compute | comm-bound (>= 2x) | SLAMB / LAMB step | "
              "top-1 LAMB / SLAMB | SLAMB+overlap / compute-only |", "|---|---|---|---|---|---|---|---|"]
        for x in sorted(t["speed"], key=lambda x: (x["pipeline"], x["hosts"], x["rate_mbit"])):
            L.append(f"| {x['pipeline']} | {x['hosts']} | {_rate(x['rate_mbit'])} | {x['lamb_comm_over_compute']:.2f} | "
                     f"{'yes' if x['comm_bound'] else 'no'} | {_fmt(x['slamb_over_lamb'], '.3f')} "
                     f"{'' if x['slamb_over_lamb'] is None or not x['comm_bound'] else ('(target <= 0.35: met)' if x['slamb_over_lamb'] <= 0.35 else '(target <= 0.35: missed)')} | "
                     f"{_fmt(x['lamb_top1'], '.1f')} / {_fmt(x['slamb_top1'], '.1f')} | "
                     f"{_fmt(x['overlap_over_compute'], '.3f')} |")
        L.append("")
    if t["wire"]:
        shaped = [w for w in t["wire"] if w["rate_mbit"] is not None]
        within = [w for w in shaped if abs(w["payload"] - 1) <= 0.05]
        if procs > 1:
            L += ["Link bytes (per host) against the ledger's bytes of each level: see 'Hosts with several "
                  "processes'. In the tables below the ledger columns are per process, the link columns per host.", ""]
        else:
            L += [f"Bytes on the wire vs the ledger's ring wire bytes (shaped links): link payload / ledger wire within "
                  f"5% in {len(within)} of {len(shaped)} runs; range {_fmt(min((w['payload'] for w in shaped), default=None), '.4f')}"
                  f" .. {_fmt(max((w['payload'] for w in shaped), default=None), '.4f')} (raw frames: "
                  f"{_fmt(min((w['raw'] for w in shaped), default=None), '.4f')} .. "
                  f"{_fmt(max((w['raw'] for w in shaped), default=None), '.4f')}). Per run in the tables below.", ""]
    if procs > 1:
        L += multi_proc_section(records, meta)
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        L += ["## Failed runs", "", "| pipeline | hosts | rate | optimizer | error |", "|---|---|---|---|---|"]
        for r in failed:
            L.append(f"| {r['pipeline']} | {r['hosts']} | {_rate(r['rate_mbit'])} | {r['optimizer']} | "
                     f"{r.get('error', '?').replace('|', '/')} |")
        L.append("")
    for pipeline in PIPELINES:
        rows = [r for r in records if r["pipeline"] == pipeline and r["status"] == "ok"]
        if not rows:
            continue
        L += [f"## {pipeline} ({rows[0]['model']}, {rows[0]['params']:,} parameters)", "",
              "| hosts | rate (Mbit/s) | optimizer | run | step (ms) | compute-only (ms) | optimizer step (ms) | "
              "comm (ms) | "
              "ledger payload (kB/step) | ledger wire (kB/step) | link raw (kB/step) | link payload (kB/step) | "
              "payload / ledger wire | collectives per step | extra bytes per collective | TCP retrans | final acc | "
              "time to target (s) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["hosts"], r["rate_mbit"] or math.inf, list(ROWS).index(r["optimizer"]))):
            ratio = (r["link_tx_payload_bytes_per_step"] / r["ledger_wire_bytes_per_step"]
                     if r["ledger_wire_bytes_per_step"] > 0 else None)
            calls = r.get("ledger_calls_per_step")
            extra = ((r["link_tx_payload_bytes_per_step"] - r["ledger_wire_bytes_per_step"]) / calls
                     if calls else None)
            L.append(f"| {r['hosts']} | {_rate(r['rate_mbit'])} | {r['optimizer']} | {r['recipe']}, {r['length']} {r['length_unit']} | "
                     f"{r['step_time_s'] * 1e3:.1f} ± {_fmt(_ms(r.get('step_time_spread_s')), '.0f')} | {_fmt(_ms(r['compute_time_s']), '.1f')} | "
                     f"{_fmt(_ms(r.get('optimizer_time_s')), '.1f')} | {_fmt(_ms(r['comm_time_s']), '.1f')} | "
                     f"{r['ledger_payload_bytes_per_step'] / 1e3:.1f} | {r['ledger_wire_bytes_per_step'] / 1e3:.1f} | "
                     f"{r['link_tx_bytes_per_step'] / 1e3:.1f} | {r['link_tx_payload_bytes_per_step'] / 1e3:.1f} | "
                     f"{_fmt(ratio, '.4f')} | {_fmt(calls, '.1f')} | {_fmt(extra, '.0f')} | "
                     f"{r['tcp_retrans_segs']} | {r['final_top1']:.1f} | "
                     f"{_fmt(r['time_to_target_s'], '.0f')} |")
        L.append("")
        if pipeline == "cifar10":
            tgt = next((r["target_top1"] for r in rows if r.get("target_top1") is not None), None)
            L += [f"Final acc = test top-1 % of the last epoch; time to target = training + evaluation time of the "
                  f"epochs until test top-1 >= {_fmt(tgt, 'g')}% (– : not reached in the run's epochs). Runs of "
                  "few epochs are timing runs; compare accuracy only between runs of the same length.", ""]
        else:
            L += ["Final acc = masked-LM accuracy % of the last period (short runs: a sanity figure, not a result).", ""]
    if plots:
        L += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    out_md.write_text("\n".join(L))
    return [out_md, *plots]


def multi_proc_section(records: list[dict], meta: dict) -> list[str]:
    """Hosts with several processes: step times against flat SLAMB's, inter-host bytes against the ledger."""
    ok = [r for r in records if r["status"] == "ok" and (r.get("procs_per_host") or 1) > 1]
    by = {(r["pipeline"], r["hosts"], r["rate_mbit"], r["optimizer"]): r for r in ok}
    load = meta.get("load_avg", {})
    loads = [x for r in ok for x in r.get("load_avg_1m", [])]
    L = ["## Hosts with several processes", "",
         f"Machine load (1-minute load average on {meta.get('cpus', '?')} cores): "
         f"{_fmt((load.get('start') or [None])[0], '.2f')} at the start, {_fmt((load.get('end') or [None])[0], '.2f')} "
         f"at the end, {_fmt(min(loads, default=None), '.2f')} .. {_fmt(max(loads, default=None), '.2f')} at the runs' "
         "starts and ends (column `load`). The bench's workers shared the cores with other jobs, so the absolute "
         "timings are indicative; the ratios between rows of one run (same hosts, same link, measured back to back) "
         "are the figures to read.", "",
         "Bytes per host and step: `ledger inter` / `intra` / `world` = the ledger's wire bytes of the host's "
         "processes by level (`inter`: across hosts, one process per host in each group; `intra`: inside the "
         "host; `world`: collectives over every process, which cross the hosts in part, as gloo's algorithm "
         "routes them); `veth payload` = the TCP payload the host's link sent (the inter-host bytes, measured); "
         "`lo payload` = the same on the host's loopback (the intra-host bytes, measured; the rendezvous store's "
         "few bytes included).", ""]
    head = ("| pipeline | hosts x procs | rate (Mbit/s) | optimizer | step (ms) | compute-only (ms) | comm (ms) | "
            "step / flat SLAMB step | ledger inter (kB) | ledger world (kB) | ledger intra (kB) | veth payload (kB) | "
            "veth / (ledger inter + world) | lo payload (kB) | lo / ledger intra | final acc | time to target (s) | "
            "load |")
    L += [head, "|" + "---|" * (head.count("|") - 1)]

    def kb(v):
        return _fmt(None if v is None else v / 1e3, ".1f")

    for r in sorted(ok, key=lambda r: (r["pipeline"], r["hosts"], r["rate_mbit"] or math.inf,
                                       list(ROWS).index(r["optimizer"]))):
        lv = r.get("host_ledger_levels_per_step", {})
        inter, world, intra = (lv.get(k, {}).get("wire") for k in ("inter", "world", "intra"))
        flat = by.get((r["pipeline"], r["hosts"], r["rate_mbit"], "SLAMB"))
        cross = (inter or 0) + (world or 0)
        L.append(f"| {r['pipeline']} | {r['hosts']} x {r['procs_per_host']} | {_rate(r['rate_mbit'])} | "
                 f"{r['optimizer']} | {r['step_time_s'] * 1e3:.1f} ± {_fmt(_ms(r.get('step_time_spread_s')), '.0f')} | "
                 f"{_fmt(_ms(r['compute_time_s']), '.1f')} | {_fmt(_ms(r['comm_time_s']), '.1f')} | "
                 f"{_fmt(r['step_time_s'] / flat['step_time_s'] if flat else None, '.3f')} | "
                 f"{kb(inter)} | {kb(world)} | {kb(intra)} | {kb(r['link_tx_payload_bytes_per_step'])} | "
                 f"{_fmt(r['link_tx_payload_bytes_per_step'] / cross if cross > 0 else None, '.3f')} | "
                 f"{kb(r.get('lo_tx_payload_bytes_per_step'))} | "
                 f"{_fmt(r['lo_tx_payload_bytes_per_step'] / intra if intra else None, '.3f')} | "
                 f"{r['final_top1']:.1f} | {_fmt(r['time_to_target_s'], '.0f')} | "
                 f"{' → '.join(f'{x:.1f}' for x in r.get('load_avg_1m', []))} |")
    L.append("")
    ratios = [(k, by[k]["step_time_s"] / by[(*k[:3], "SLAMB")]["step_time_s"]) for k in by
              if k[3] == HIER and (*k[:3], "SLAMB") in by]
    for (pipeline, n, rate, _), x in sorted(ratios, key=lambda t: (t[0][0], t[0][1], t[0][2] or math.inf)):
        L.append(f"- {pipeline}, {n} hosts x {by[(pipeline, n, rate, HIER)]['procs_per_host']} processes, "
                 f"{f'{rate:g} Mbit/s' if rate else 'unlimited link'}: {HIER} / flat SLAMB step time = **{x:.3f}**.")
    silent = [r for r in ok if r["host_ledger_wire_bytes_per_step"] == 0]
    if silent:
        L += ["", "No collective in the measured steps (– in the ledger columns): "
              + "; ".join(f"{r['optimizer']} on {r['hosts']} x {r['procs_per_host']}, {_rate(r['rate_mbit'])} "
                          f"({r['measured_steps']} steps)"
                          for r in silent)
              + ". DiLoCo averages every 10 steps and a run of few steps per epoch may measure none of them."]
    L += ["", "With one process per host the veth carries what the ledger's world-level collectives send (the "
          "tables below). With several, a flat optimizer's world collectives run over every process, and how many "
          "of their bytes cross the hosts depends on gloo's algorithm: a ring over hosts of 2 consecutive ranks "
          "crosses the hosts on every second edge, so the veth carries about half the host's world-level bytes "
          "(column `veth / (ledger inter + world)`, more where gloo's per-message framing of many small "
          "collectives adds to it). The hierarchical row sends across hosts only its `inter` level, which the veth "
          "counters match, and its dense gradient average stays on the loopback.", ""]
    return L


def _plots(records: list[dict], out_dir: Path, prefix: str = "netbench") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok = [r for r in records if r["status"] == "ok"]
    for pipeline in PIPELINES:
        rows = [r for r in ok if r["pipeline"] == pipeline]
        if not rows:
            continue
        rates = sorted({r["rate_mbit"] for r in rows}, key=lambda r: math.inf if r is None else r)
        fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.6), squeeze=False, sharey=True)
        for ax, rate in zip(axes[0], rates):
            for row in ROWS:
                pts = sorted((r["hosts"], r["step_time_s"]) for r in rows if r["rate_mbit"] == rate and r["optimizer"] == row)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=row)
            ref = sorted((r["hosts"], r["step_time_s"]) for r in rows if r["rate_mbit"] is None and r["optimizer"] == "LAMB")
            if ref and rate is not None:
                ax.plot(*zip(*ref), "k--", lw=1, label="LAMB compute-only")
            ax.set_title(f"{_rate(rate)} Mbit/s" if rate is not None else "unlimited link")
            ax.set_xlabel("hosts")
            ax.set_xticks(sorted({r["hosts"] for r in rows}))
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("step time (s)")
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"{pipeline}: step time vs hosts")
        fig.tight_layout()
        path = out_dir / f"{prefix}_{pipeline}_step_time.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        shaped = sorted((r for r in rows if r["rate_mbit"] is not None and r["ledger_wire_bytes_per_step"] > 0),
                        key=lambda r: (r["hosts"], r["rate_mbit"], list(ROWS).index(r["optimizer"])))
        if shaped:
            fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(shaped)), 4))
            x = range(len(shaped))
            if any((r.get("procs_per_host") or 1) > 1 for r in shaped):
                # per host: what crosses the hosts (ledger levels inter + world, veth) and what stays inside
                def level(r, *names):
                    return sum(r["host_ledger_levels_per_step"].get(k, {}).get("wire", 0.0) for k in names)

                bars = [("ledger inter + world", lambda r: level(r, "inter", "world")),
                        ("veth payload", lambda r: r["link_tx_payload_bytes_per_step"]),
                        ("ledger intra", lambda r: level(r, "intra")),
                        ("loopback payload", lambda r: r["lo_tx_payload_bytes_per_step"])]
            else:
                bars = [("ledger wire", lambda r: r["ledger_wire_bytes_per_step"]),
                        ("link payload", lambda r: r["link_tx_payload_bytes_per_step"]),
                        ("link raw", lambda r: r["link_tx_bytes_per_step"])]
            w = 0.8 / len(bars)
            for j, (label, value) in enumerate(bars):
                ax.bar([i + (j - (len(bars) - 1) / 2) * w for i in x], [max(value(r), 1.0) for r in shaped], w,
                       label=label)
            ax.set_xticks(list(x))
            ax.set_xticklabels([f"{r['optimizer']} {r['hosts']}h" + (f"x{r['procs_per_host']}" if (r.get('procs_per_host')
                                or 1) > 1 else "") + f" {r['rate_mbit']:g}M" for r in shaped], rotation=75, fontsize=7)
            ax.set_yscale("log")
            if len(bars) > 3:  # the zero levels (flat rows' intra) at the floor, room for the legend above the bars
                ax.set_ylim(1e3, 30 * max(value(r) for _, value in bars for r in shaped))
            ax.set_ylabel("bytes per step and host")
            ax.set_title(f"{pipeline}: ledger vs link bytes (shaped links)")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3, axis="y")
            fig.tight_layout()
            path = out_dir / f"{prefix}_{pipeline}_bytes.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)

        curves = [r for r in rows if r.get("time_to_target_s") is not None or
                  (pipeline == "cifar10" and r["length_unit"] == "epochs" and len(r["history"]) >= 4
                   and r["rate_mbit"] is not None)]
        if pipeline == "cifar10" and curves:
            fig, ax = plt.subplots(figsize=(6.5, 4))
            for r in curves:
                ts, acc = 0.0, []
                for h in r["history"]:
                    ts += h["time_s"]
                    acc.append((ts, h["test_top1"]))
                ax.plot(*zip(*acc), marker=".", label=f"{r['optimizer']} {r['hosts']}h {_rate(r['rate_mbit'])}M")
            tgt = next((r["target_top1"] for r in curves if r.get("target_top1") is not None), None)
            if tgt is not None:
                ax.axhline(tgt, color="k", ls=":", lw=1)
            ax.set_xlabel("training + evaluation time (s)")
            ax.set_ylabel("test top-1 (%)")
            ax.set_title("cifar10 (digits): accuracy vs time")
            ax.legend(fontsize=6)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            path = out_dir / f"{prefix}_cifar10_time_to_accuracy.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


# ----------------------------------------------------------------------------- CLI

def _git() -> str:
    from harness.run import git_revision

    g = git_revision(ROOT)
    return f"{g['commit'][:10]}{' (dirty)' if g['dirty'] else ''}"


FULL_OUT, SCRATCH_OUT = ROOT / "results" / "netbench.md", ROOT / "runs" / "netbench" / "netbench.md"
# settings that do not change which runs the matrix holds or what they measure
NOT_MATRIX = ("note", "workdir", "out", "raw", "render_only", "reanalyse", "run_timeout")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

    from .netns import netem_available, netns_unsupported

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
    meta = {"command": "python -m bench.netbench " + " ".join(argv), "started": started,
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


if __name__ == "__main__":
    sys.exit(main())
