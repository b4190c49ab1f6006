"""Inside each worker: the pipeline's entry point with probes at its period boundaries."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .config import IFNAME_ENV, PIPELINES, WORKER_FLAG


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
