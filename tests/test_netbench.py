"""The multi-host bandwidth bench: namespaces, shaped links, and its smallest configuration end to end.

Needs root (or CAP_NET_ADMIN) and a working ``ip netns add``; where the machine forbids them the
namespace tests are skipped with the reason, never passed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import netbench
from bench.netns import (
    HEADER_BYTES,
    Cluster,
    list_namespaces,
    netns_unsupported,
    tcp_throughput,
)

ROOT = Path(__file__).resolve().parents[1]
WHY = netns_unsupported()
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"network namespaces unavailable: {WHY}")


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.netns
def test_cluster_creates_shaped_hosts_and_removes_them():
    with Cluster(2, rate_mbit=100) as c:
        assert sorted(list_namespaces(c.prefix)) == sorted([c.switch, *c.ns])
        # each host sees its own address on its veth, and only loopback besides
        links = subprocess.run(["ip", "-n", c.ns[1], "-j", "addr", "show"], capture_output=True, text=True,
                               check=True).stdout
        addrs = {a["ifname"]: [x["local"] for x in a["addr_info"] if x["family"] == "inet"] for a in json.loads(links)}
        assert addrs == {"lo": ["127.0.0.1"], c.dev[1]: [c.addr[1]]}
        r = tcp_throughput(c, 0, 1, nbytes=4 << 20)
        # the bucket holds the sender to the set rate (payload <= rate; 1448/1514 of it when saturated)
        assert 60 <= r["mbit_s"] <= 100, r
        # every packet counted carries one set of headers: raw - 66 x packets is the TCP payload exactly
        assert r["tx_payload_bytes"] == pytest.approx(r["payload_bytes"], rel=1e-3)
        assert r["tx_bytes"] > r["payload_bytes"] + HEADER_BYTES * (r["payload_bytes"] // 65536)
        c.shape(None)  # the unlimited link really is much faster than the shaped one
        assert tcp_throughput(c, 0, 1, nbytes=16 << 20)["mbit_s"] > 500
    assert list_namespaces(c.prefix) == []


@needs_netns
@pytest.mark.netns
def test_cluster_is_removed_when_the_body_fails():
    with pytest.raises(RuntimeError, match="a run failed"), Cluster(2) as c:
        assert len(list_namespaces(c.prefix)) == 3
        raise RuntimeError("a run failed")
    assert list_namespaces(c.prefix) == []


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.netns
def test_cluster_is_removed_when_the_process_is_killed():
    # a cluster with a process running inside one host (as the bench's workers do), then SIGTERM
    code = ("import subprocess, sys, time; from bench.netns import Cluster; c = Cluster(3, rate_mbit=50); "
            "w = subprocess.Popen([*c.exec_prefix(1), 'sleep', '300'], start_new_session=True); "
            "print(c.prefix, w.pid, flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    prefix, worker = p.stdout.readline().split()
    assert len(list_namespaces(prefix)) == 4
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM  # cleaned up on the way out, exit status 143
    assert list_namespaces(prefix) == []
    assert not Path(f"/proc/{worker}").exists()  # the process inside the host was stopped, not orphaned


@pytest.mark.e2e
def test_invalid_settings_are_rejected_with_the_setting_named():
    with pytest.raises(ValueError, match="hosts"):
        Cluster(0)
    with pytest.raises(SystemExit):
        netbench.parse_args(["--hosts", "1"])
    with pytest.raises(SystemExit):
        netbench.parse_args(["--rates", "0"])
    a = netbench.parse_args(["--quick"])
    assert (a.hosts, a.rates, a.optimizers, a.timing_epochs) == ([2], [10], ["LAMB", "SLAMB"], 2)


@pytest.mark.e2e
def test_only_the_full_matrix_writes_the_committed_results():
    committed, scratch = ROOT / "results" / "netbench.md", ROOT / "runs" / "netbench" / "netbench.md"
    assert Path(netbench.parse_args([]).out) == committed
    assert Path(netbench.parse_args(["--note", "x", "--run-timeout", "60"]).out) == committed
    assert Path(netbench.parse_args(["--render-only"]).out) == committed
    for partial in (["--quick"], ["--hosts", "2"], ["--pipelines", "cifar10"], ["--epochs", "5"], ["--delay-ms", "0"]):
        assert Path(netbench.parse_args(partial).out) == scratch, partial
    assert netbench.parse_args(["--quick", "--out", "/tmp/q/netbench.md"]).out == "/tmp/q/netbench.md"


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.netns
def test_quick_bench_measures_link_bytes_against_the_ledger(tmp_path):
    before = set(list_namespaces())
    out = tmp_path / "netbench.md"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    tic = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "bench.netbench", "--quick", "--optimizers", "LAMB", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert set(list_namespaces()) == before  # the bench's namespaces are gone
    records = json.loads((tmp_path / "netbench_raw.json").read_text())
    assert {(r["hosts"], r["rate_mbit"], r["optimizer"]) for r in records} == {(2, None, "LAMB"), (2, 10, "LAMB")}
    ref = next(r for r in records if r["rate_mbit"] is None)
    shaped = next(r for r in records if r["rate_mbit"] == 10)
    for r in records:
        assert r["status"] == "ok" and r["pipeline"] == "cifar10" and r["hosts"] == 2
        assert r["step_time_s"] > 0 and r["measured_steps"] == netbench.cifar_steps_per_epoch(2)
        assert r["steps"] == 2 * netbench.cifar_steps_per_epoch(2) and r["params"] > 70_000
        # LAMB all-reduces every gradient once per step: ring wire bytes = 2 (n-1)/n x 4 bytes x params
        assert r["ledger_payload_bytes_per_step"] == pytest.approx(4 * r["params"], rel=0.01)
        assert r["ledger_wire_bytes_per_step"] == pytest.approx(r["ledger_payload_bytes_per_step"], rel=1e-9)
        # the link carried what the ledger predicts (payload within 5%), plus frame headers
        assert r["link_tx_payload_bytes_per_step"] == pytest.approx(r["ledger_wire_bytes_per_step"], rel=0.05)
        assert r["link_tx_bytes_per_step"] > r["link_tx_payload_bytes_per_step"]
    # the compute-only reference is the same row's unlimited-link step; communication is the rest
    assert shaped["compute_time_s"] == ref["step_time_s"]
    assert shaped["comm_time_s"] == pytest.approx(shaped["step_time_s"] - ref["step_time_s"])
    # the shaped link bounds the step from below: its bytes cannot leave faster than 10 Mbit/s (a physical
    # bound, not a comparison of two noisy timings on a shared machine); unshaped, the same bytes take ~1 ms
    assert shaped["step_time_s"] >= 0.9 * shaped["link_tx_bytes_per_step"] * 8 / 10e6 > 0.2
    md = out.read_text()
    assert "| 2 | 10 | LAMB |" in md and (tmp_path / "netbench_cifar10_step_time.png").stat().st_size > 0
    # --render-only rebuilds the same page from the raw JSON
    (tmp_path / "netbench.md").unlink()
    subprocess.run([sys.executable, "-m", "bench.netbench", "--render-only", "--out", str(out)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    assert out.read_text() == md
    assert time.perf_counter() - tic < 150


@pytest.mark.e2e
def test_hosts_with_several_processes_settings():
    a = netbench.parse_args(["--procs-per-host", "2"])
    assert a.optimizers == netbench.MULTI_PROC_ROWS and Path(a.out).parent == ROOT / "runs" / "netbench"
    assert netbench.parse_args([]).optimizers == netbench.DEFAULT_ROWS  # the default matrix is unchanged
    with pytest.raises(SystemExit):  # hierarchical SLAMB with one process per host is flat SLAMB
        netbench.parse_args(["--optimizers", netbench.HIER])
    with pytest.raises(SystemExit):
        netbench.parse_args(["--procs-per-host", "0"])
    ov = netbench.run_overrides("cifar10", netbench.HIER, 2, 3, Path("d"), Path("r"), steady=True, procs=2)
    assert {"optimizer.hierarchy=node", "optimizer.local_world_size=2", "optimizer.compression_warmup=null"} <= set(ov)
    ov = netbench.run_overrides("cifar10", "PowerSGD", 2, 3, Path("d"), Path("r"), steady=True, procs=2)
    assert f"optimizer.start_powerSGD_iter={netbench.cifar_steps_per_epoch(4)}" in ov
    job = {"pipeline": "cifar10", "hosts": 2, "rate_mbit": 10.0, "optimizer": netbench.HIER, "procs_per_host": 2}
    assert netbench.run_tag(job) == "cifar10_2h2p_10m_SLAMBhierarchical"
    # HSDP rows: BERT only, a host's processes are its replica's shards
    ov = netbench.run_overrides("bert", "HSDP SLAMB", 2, 8, Path("d"), Path("r"), vocab_size=100, procs=2)
    assert {"trainer.parallelism=hsdp", "trainer.shard_size=2", "data.global_batch=64"} <= set(ov)
    for argv, match in ((["--pipelines", "bert", "--bert-optimizers", "HSDP SLAMB"], "--procs-per-host >= 2"),
                        (["--procs-per-host", "2", "--optimizers", "HSDP LAMB"], "no cifar10 run")):
        with pytest.raises(SystemExit):
            netbench.parse_args(argv)


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.netns
def test_hierarchical_slamb_on_hosts_with_two_processes(tmp_path):
    """2 hosts x 2 processes: the dense gradient stays on each host's loopback, the veth carries the
    ledger's inter-level bytes."""
    before = set(list_namespaces())
    out = tmp_path / "hier.md"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-m", "bench.netbench", "--hosts", "2", "--procs-per-host", "2", "--rates",
                          "50", "--optimizers", netbench.HIER, "--pipelines", "cifar10", "--timing-epochs", "2",
                          "--tta-hosts", "--check-rates", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert set(list_namespaces()) == before
    records = json.loads((tmp_path / "hier_raw.json").read_text())  # the raw JSON is named after the page
    assert {(r["hosts"], r["procs_per_host"], r["rate_mbit"]) for r in records} == {(2, 2, None), (2, 2, 50)}
    for r in records:
        assert r["status"] == "ok" and r["measured_steps"] == netbench.cifar_steps_per_epoch(4)
        levels = r["host_ledger_levels_per_step"]
        inter, intra = levels["inter"]["wire"], levels["intra"]["wire"]
        world = levels.get("world", {}).get("wire", 0.0)
        # the ledger keeps the levels apart: the dense gradient average (and the all-gather of the chunks)
        # inside the host, only the momentum chunks and model syncs across; over all ranks, a few scalars
        assert intra > 5 * inter > 0 and world < 0.01 * inter
        assert r["host_ledger_wire_bytes_per_step"] == pytest.approx(inter + intra + world, rel=1e-9)
        # the veth carries the inter-level bytes, the loopback the intra-level ones (payload within 5%)
        assert r["link_tx_payload_bytes_per_step"] == pytest.approx(inter + world, rel=0.05)
        assert r["lo_tx_payload_bytes_per_step"] == pytest.approx(intra, rel=0.05)
    assert "| cifar10 | 2 x 2 | 50 | SLAMB hierarchical |" in out.read_text()


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.e2e
@pytest.mark.netns
def test_hsdp_rows_send_across_hosts_what_the_ledger_records_at_the_replicate_level(tmp_path):
    """2 hosts x 2 processes, BERT sharded inside each host (HSDP): the veth carries the ledger's
    replicate-level bytes (LAMB's gradient all-reduce; SLAMB's momentum exchange and syncs, about 8x
    fewer), FSDP's all-gathers and reduce-scatters stay on the loopback, in the ledger at level shard."""
    out = tmp_path / "hsdp.md"
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-m", "bench.netbench", "--procs-per-host", "2", "--pipelines", "bert",
                          "--bert-hosts", "2", "--bert-rates", "50", "--bert-steps", "8", "--bert-optimizers",
                          *netbench.HSDP, "--check-rates", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = {(r["optimizer"], r["rate_mbit"]): r for r in json.loads((tmp_path / "hsdp_raw.json").read_text())}
    assert set(records) == {(row, rate) for row in netbench.HSDP for rate in (None, 50)}
    for r in records.values():
        levels = r["host_ledger_levels_per_step"]
        assert r["status"] == "ok" and set(levels) <= {"replicate", "shard", "world"}
        across = levels["replicate"]["wire"] + levels.get("world", {}).get("wire", 0.0)
        assert r["link_tx_payload_bytes_per_step"] == pytest.approx(across, rel=0.05)
        # inside: the ring's bytes of FSDP's collectives, which gloo's 2-rank reduce-scatter doubles
        assert levels["shard"]["wire"] < r["lo_tx_payload_bytes_per_step"] < 2 * levels["shard"]["wire"]
    lamb, slamb = (records[row, 50]["host_ledger_levels_per_step"]["replicate"]["wire"] for row in netbench.HSDP)
    assert 5 * slamb < lamb
    assert "HSDP SLAMB / HSDP LAMB step time" in out.read_text()
