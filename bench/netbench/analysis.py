"""A finished run's numbers from its metrics and probe lines; the figures derived across runs."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .config import run_tag


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


def time_to(history: list[dict], target: float) -> float | None:
    """Training seconds (``epoch_time_s`` summed) until the test top-1 first reaches ``target``; None if never."""
    elapsed = 0.0
    for h in history:
        elapsed += h["epoch_time_s"]
        if h["test_top1"] >= target:
            return elapsed
    return None


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
    time_to_target = time_to(history, target_top1) if target_top1 is not None and pipeline == "cifar10" else None
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


def fill_compute_times(records: list[dict]) -> None:
    """compute_time_s of each run: its row's step time on the same hosts with the unlimited link."""
    def key(r):
        return r["pipeline"], r["hosts"], r.get("procs_per_host") or 1, r["optimizer"]

    ref = {key(r): r["step_time_s"] for r in records if r["rate_mbit"] is None and r["status"] == "ok"}
    for r in records:
        c = ref.get(key(r)) if r["status"] == "ok" else None
        r["compute_time_s"] = c
        r["comm_time_s"] = None if c is None else r["step_time_s"] - c


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
