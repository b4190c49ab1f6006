"""Running the matrix: one torchrun per emulated host and run, on shaped links."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .analysis import analyse_run, complete, fill_compute_times
from .config import IFNAME_ENV, ROOT, UNLIMITED, WORKER_FLAG, Settings, model_name, plan, prepare_data, run_overrides, run_tag
from .report import _rate


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
    from ..netns import kill_processes

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


def run_matrix(s: Settings, log=print) -> tuple[list[dict], list[dict]]:
    from ..netns import Cluster, netem_available, tcp_throughput

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
