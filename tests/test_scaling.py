"""The alpha-beta cost model against hand-computed times, and its bench calibration on synthetic records."""
import dataclasses
import json
import math
import os

import pytest

from bench import cost_model as sc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
US = 1e-6
NET = sc.Link(10 * US, 10e9 / 8)  # 10 Gbit/s: beta = 8e-10 s/byte
NVL = sc.Link(5 * US, 100e9)  # 100 GB/s: beta = 1e-11 s/byte


def test_ring_all_reduce_by_hand():
    # n=4, 100 MB, alpha 10 us, 10 Gbit/s: 2*3*10us + 2*3/4 * 1e8 B * 8e-10 s/B = 60 us + 0.12 s
    assert sc.ring_time("all_reduce", 1e8, 4, NET) == pytest.approx(0.12006, rel=1e-12)
    # three calls (buckets) of the same total pay the latency three times, the bandwidth once
    assert sc.ring_time("all_reduce", 1e8, 4, NET, calls=3) == pytest.approx(0.12018, rel=1e-12)
    assert sc.ring_time("all_reduce", 1e8, 1, NET) == 0.0


def test_ring_all_gather_all_to_all_reduce_scatter_broadcast_by_hand():
    # all-gather of a 25 MB block per rank: 3*10us + 3 * 25e6 * 8e-10
    assert sc.ring_time("all_gather", 25e6, 4, NET) == pytest.approx(0.06003, rel=1e-12)
    # all-to-all / reduce-scatter of a 100 MB input: 3*10us + 3/4 * 1e8 * 8e-10
    assert sc.ring_time("all_to_all", 1e8, 4, NET) == pytest.approx(0.06003, rel=1e-12)
    assert sc.ring_time("reduce_scatter", 1e8, 4, NET) == pytest.approx(0.06003, rel=1e-12)
    # pipelined broadcast: 3*10us + 1e8 * 8e-10
    assert sc.ring_time("broadcast", 1e8, 4, NET) == pytest.approx(0.08003, rel=1e-12)
    with pytest.raises(ValueError, match="unknown collective"):
        sc.ring_time("allreduce", 1.0, 4, NET)


def test_hierarchical_all_reduce_by_hand():
    # 2 nodes x 4 GPUs, 100 MB:
    #   intra reduce-scatter 3*5us + 3/4*1e8*1e-11      = 7.65e-4
    #   inter all-reduce     2*1*10us + 2*1/2*1e8*8e-10 = 0.08002 (the NIC carries 2 (N-1)/N of the buffer)
    #   intra all-gather     3*5us + 3*2.5e7*1e-11      = 7.65e-4
    assert sc.hierarchical_time("all_reduce", 1e8, 2, 4, NVL, NET) == pytest.approx(0.08155, rel=1e-12)
    # one flat ring through the 8 GPUs waits on the network at every step: 14*10us + 14/8*1e8*8e-10
    cluster = sc.Cluster("test", 4, NVL, NET)
    assert sc.collective_time("all_reduce", 1e8, 8, cluster, algorithm="ring") == pytest.approx(0.14014, rel=1e-12)
    assert sc.collective_time("all_reduce", 1e8, 8, cluster) == pytest.approx(0.08155, rel=1e-12)
    # inside one node, and one GPU per node, it is the plain ring of that link
    assert sc.hierarchical_time("all_reduce", 1e8, 1, 4, NVL, NET) == sc.ring_time("all_reduce", 1e8, 4, NVL)
    assert sc.hierarchical_time("all_reduce", 1e8, 4, 1, NVL, NET) == sc.ring_time("all_reduce", 1e8, 4, NET)


def test_hierarchical_all_gather_and_all_to_all_by_hand():
    # all-gather, 10 MB block per GPU, 2 x 4 GPUs (80 MB gathered):
    #   intra 2*3*5us + 3/4*8e7*1e-11 = 6.3e-4 ; inter 10us + 1/2*8e7*8e-10 = 0.03201
    assert sc.hierarchical_time("all_gather", 1e7, 2, 4, NVL, NET) == pytest.approx(0.03264, rel=1e-12)
    # all-to-all, 100 MB per GPU: half of every GPU's input leaves the node and the 4 GPUs share the NIC:
    #   latency 3*5us + 1*10us ; bandwidth max(4 * 1/2 * 1e8 * 8e-10, 3/8 * 1e8 * 1e-11) = 0.16
    assert sc.hierarchical_time("all_to_all", 1e8, 2, 4, NVL, NET) == pytest.approx(0.160025, rel=1e-12)


def test_hierarchical_slamb_exchange_by_hand():
    # over 2 nodes x 4 GPUs, 100 MB the 4 GPUs of a node hold alike: each sends 25 MB over its own ring,
    # the 4 rings share the NIC: 2*1*10us + 2*1/2*1e8*8e-10 = 0.08002; then the intra all-gather of the
    # 25 MB shares: 3*5us + 3*2.5e7*1e-11 = 7.65e-4. No intra reduce-scatter (the flat hierarchical
    # all-reduce's 7.65e-4): 0.080785
    assert sc.node_exchange_time(1e8, 2, 4, NVL, NET) == pytest.approx(0.080785, rel=1e-12)
    cluster = sc.Cluster("test", 4, NVL, NET)
    assert sc.collective_time("all_reduce", 1e8, 8, cluster, scope="inter") == pytest.approx(0.080785, rel=1e-12)
    assert sc.collective_time("all_reduce", 1e8, 4, cluster, scope="inter") == 0.0  # one node: nothing to send
    # the gradients averaged inside each node only: 2*3*5us + 2*3/4*4e8*1e-11 = 0.00603, at any node count
    assert sc.collective_time("all_reduce", 4e8, 64, cluster, scope="intra") == pytest.approx(0.00603, rel=1e-12)
    with pytest.raises(ValueError, match="scope"):
        sc.collective_time("all_gather", 1.0, 8, cluster, scope="inter")
    with pytest.raises(ValueError, match="scope"):
        sc.collective_time("all_reduce", 1.0, 8, cluster, scope="rack")


def test_hsdp_replica_exchange_by_hand():
    # HSDP over 2 nodes x 4 GPUs, a node's 100 MB held as 4 shards of 25 MB: each GPU sends its shard over its
    # own ring, the 4 rings share the NIC: 2*1*10us + 2*1/2*1e8*8e-10 = 0.08002, and each keeps its result
    # (no intra all-gather: hierarchical SLAMB's exchange less its 7.65e-4)
    assert sc.replica_exchange_time(1e8, 2, NET) == pytest.approx(0.08002, rel=1e-12)
    assert sc.node_exchange_time(1e8, 2, 4, NVL, NET) - sc.replica_exchange_time(1e8, 2, NET) == pytest.approx(
        sc.ring_time("all_gather", 2.5e7, 4, NVL), rel=1e-9)
    cluster = sc.Cluster("test", 4, NVL, NET)
    assert sc.collective_time("all_reduce", 1e8, 8, cluster, scope="replicas") == pytest.approx(0.08002, rel=1e-12)
    assert sc.collective_time("all_reduce", 1e8, 4, cluster, scope="replicas") == 0.0  # one replica group
    with pytest.raises(ValueError, match="scope"):
        sc.collective_time("reduce_scatter", 1.0, 8, cluster, scope="replicas")


@pytest.mark.e2e
def test_hsdp_profiles_from_the_ledger_and_fsdp_bytes():
    from bench.memory_sharded import units
    from bench.scaling import hsdp_profiles, ledger_profiles
    from bench.shapes import bert_model_config, bert_named_shapes

    with open(os.path.join(ROOT, "results", "comm_volume_raw.json")) as f:
        profiles = ledger_profiles(json.load(f))
    named = bert_named_shapes(bert_model_config("bert_xl"))
    params, unit = sum(math.prod(s) for _, s in named), max(units(named).values())
    hsdp = hsdp_profiles(profiles, named, 8)
    (grads,) = profiles["LAMB"].collectives
    momentum, sync = profiles["SLAMB fp16 (k=0.1, H=100)"].collectives
    for name, across in (("HSDP LAMB", [dataclasses.replace(grads, scope="replicas", bucket_bytes=4.0 * unit)]),
                         ("HSDP SLAMB", [dataclasses.replace(c, scope="replicas") for c in (momentum, sync)])):
        cols = hsdp[name].collectives
        inside = [c for c in cols if c.scope == "intra"]
        # FSDP2 inside the node: two fp16 all-gathers of a GPU's 1/8 block and the fp32 reduce-scatter (4.5 bytes
        # per parameter), and one all-reduce of the norms (LAMB 2, SLAMB 4 fp32 per tensor)
        assert sum(c.bytes_per_param for c in inside[:3]) == pytest.approx(2 * 2 / 8 + 4)
        assert inside[3].bytes_per_param * params == pytest.approx((8 if name == "HSDP LAMB" else 16) * len(named))
        assert [c for c in cols if c.scope != "intra"] == [dataclasses.replace(c, bucket_basis_per_param=None)
                                                           for c in across]
    # 1,024 GPUs, 128 nodes x 8: SLAMB's replica exchanges are the hand-summed parts
    cluster = sc.Cluster("c", 8, NVL, NET)
    got = sum(sc.collective_time(c.op, c.payload(params, 1024), 1024, cluster, scope=c.scope) / c.every
              for c in hsdp["HSDP SLAMB"].collectives if c.scope == "replicas")
    assert got == pytest.approx(sc.replica_exchange_time(momentum.bytes_per_param * params, 128, NET)
                                + sc.replica_exchange_time(sync.bytes_per_param * params, 128, NET) / 100, rel=1e-12)


def test_cluster_layout_and_links():
    cluster = sc.Cluster("c", 8, NVL, NET)
    assert cluster.layout(4) == (1, 4) and cluster.layout(64) == (8, 8)
    with pytest.raises(ValueError, match="whole nodes"):
        cluster.layout(12)
    assert sc.Link.from_gbit(0.0, 100, 0.9).bandwidth == pytest.approx(11.25e9)
    with pytest.raises(ValueError, match="efficiency"):
        sc.Link.from_gbit(0.0, 100, 1.5)
    with pytest.raises(ValueError, match="algorithm"):
        sc.collective_time("all_reduce", 1.0, 16, cluster, algorithm="tree")


def test_overlap_semantics_max_versus_sum():
    # compute 3 s, backward 2/3 of it: forward 1, backward 2
    assert sc.step_time(3.0, 0.5, 1.5) == pytest.approx(1 + 2 + 0.5)  # hidden behind backward
    assert sc.step_time(3.0, 0.5, 2.5) == pytest.approx(1 + 2.5 + 0.5)  # longer than backward
    assert sc.step_time(3.0, 0.5, 1.5, overlap=False) == pytest.approx(5.0)  # the plain sum
    # only 0.5 s of backward (the last micro-batch) can hide communication
    assert sc.step_time(3.0, 0.5, 1.5, overlap_window=0.5) == pytest.approx(3 - 0.5 + 1.5 + 0.5)
    with pytest.raises(ValueError, match="backward_share"):
        sc.step_time(1.0, 0.0, 0.0, backward_share=1.5)


def test_efficiency_definitions():
    # fixed global batch 1024: 10 s on 1 GPU, 1.5 s on 8 GPUs, 0.25 s on 64 GPUs
    thr1, thr8, thr64 = 1024 / 10, 1024 / 1.5, 1024 / 0.25
    assert sc.scaling_efficiency(thr8, 8, thr1) == pytest.approx(10 / (8 * 1.5))  # 83.3%
    assert sc.scaling_efficiency(thr64, 64, thr1) == pytest.approx(10 / (64 * 0.25))  # 62.5%
    # relative to one node of 8: (4096/64) / (682.7/8) = 0.75
    assert sc.scaling_efficiency(thr64, 64, thr8, 8) == pytest.approx(0.75)


def test_solve_op_split_recovers_each_collective():
    # 1-bit LAMB at n=4: all-to-all of 1000 B, all-gather of a 250 B shard
    n, a2a, ag = 4, 1000.0, 250.0
    wire = 3 / 4 * a2a + 3 * ag
    assert sc.solve_op_split(a2a + ag, wire, n, ["all_to_all", "all_gather"]) == pytest.approx([a2a, ag])
    assert sc.solve_op_split(100.0, 150.0, 4, ["all_reduce"]) == [100.0]
    with pytest.raises(ValueError, match="more than one kind"):
        sc.solve_op_split(100.0, 200.0, 4, ["all_reduce"])
    with pytest.raises(ValueError, match="equal wire factors"):
        sc.solve_op_split(100.0, 75.0, 4, ["all_to_all", "reduce_scatter"])


def test_profile_times_sharding_period_and_overlap():
    cluster = sc.Cluster("c", 4, NVL, NET)
    prof = sc.CommProfile("p", (
        sc.Collective("all_to_all", 0.125, ref_world=4),
        sc.Collective("all_gather", 0.125 / 4, ref_world=4, sharded=True),
        sc.Collective("all_reduce", 4.0, ref_world=4, every=100),
        sc.Collective("all_reduce", 4.0, ref_world=4, overlappable=True, bucket_bytes=25e6),
    ))
    params, gpus = 1e8, 16
    exposed, overlappable = prof.times(params, gpus, cluster)
    expect_exposed = (sc.collective_time("all_to_all", 0.125e8, gpus, cluster)
                      + sc.collective_time("all_gather", 0.125e8 / gpus, gpus, cluster)
                      + sc.collective_time("all_reduce", 4e8, gpus, cluster) / 100)
    bucketed = sc.collective_time("all_reduce", 4e8, gpus, cluster, calls=16)
    last = (4e8 - 2**20 - 15 * 25e6) / 4e8  # DDP's last-ready bucket: what is left after 1 MiB and 15 x 25 MB
    assert exposed == pytest.approx(expect_exposed + last * bucketed, rel=1e-12)
    assert overlappable == pytest.approx((1 - last) * bucketed, rel=1e-12)
    assert prof.bytes_per_step(params, gpus) == pytest.approx(0.125e8 + 0.125e8 / 16 + 4e8 / 100 + 4e8)


def test_last_ddp_bucket_cannot_overlap_backward():
    mib = 2**20
    assert sc.last_bucket_share(0.5 * mib) == 1.0  # one bucket: launched when backward ends
    assert sc.last_bucket_share(mib) == 1.0
    assert sc.last_bucket_share(31 * mib) == pytest.approx(5 / 31)  # 1 MiB, 25 MiB, then the last 5 MiB
    assert sc.last_bucket_share(26 * mib) == pytest.approx(25 / 26)  # an exact fill: the last bucket is full
    # a bench row with DDP's gradient all-reduce of under 1 MiB gets no overlap at all
    rec = {"pipeline": "cifar10", "model": "m", "hosts": 2, "rate_mbit": 10.0, "delay_ms": 0.0, "optimizer": "LAMB",
           "step_time_s": 1.0, "compute_time_s": 0.1, "comm_time_s": 0.9, "ledger_payload_bytes_per_step": 3e5,
           "ledger_wire_bytes_per_step": 3e5, "params": 75_000}
    p = sc.BenchParams(alpha0=0.0, efficiency=1.0, wire_overhead=1.0)
    assert sc.predict_bench_record(rec, p) == pytest.approx(0.1 + 3e5 * 8 / 10e6)
    # SLAMB + overlap rides on the gradient buckets: 0.3 MB of gradients is one bucket, so nothing hides either
    assert sc.predict_bench_record({**rec, "optimizer": "SLAMB + overlap", "ledger_payload_bytes_per_step": 3e4,
                                    "ledger_wire_bytes_per_step": 3e4}, p) == pytest.approx(0.1 + 3e4 * 8 / 10e6)


def test_token_bucket_depth_is_free_once_per_step():
    rec = {"pipeline": "cifar10", "model": "m", "hosts": 2, "rate_mbit": 10.0, "delay_ms": 0.0, "optimizer": "SLAMB",
           "step_time_s": 1.0, "compute_time_s": 0.1, "comm_time_s": 0.9, "ledger_payload_bytes_per_step": 1e5,
           "ledger_wire_bytes_per_step": 1e5, "params": 75_000}
    p = sc.BenchParams(alpha0=0.0, efficiency=1.0, wire_overhead=1.0)
    rate = 10e6 / 8
    assert sc.predict_bench_record({**rec, "link_burst_bytes": 65536}, p) == pytest.approx(0.1 + (1e5 - 65536) / rate)
    # the bucket refills only while the link idles (the compute): 20 ms at 10 Mbit/s is 25 kB
    short = {**rec, "compute_time_s": 0.02, "link_burst_bytes": 65536}
    assert sc.predict_bench_record(short, p) == pytest.approx(0.02 + (1e5 - 0.02 * rate) / rate)
    # never below the compute: a bucket deeper than the exchange makes it free, not negative
    assert sc.predict_bench_record({**rec, "link_burst_bytes": 10**6}, p) == pytest.approx(0.1)


def test_tcp_framing_overhead():
    # 1448-byte segments in 1514-byte frames, and a 66-byte ACK frame per two segments received
    assert sc.tcp_wire_overhead() == pytest.approx(1514 / 1448 + 66 / 2896)
    assert sc.tcp_wire_overhead(ack_every=10**9) == pytest.approx(1514 / 1448)


# -- calibration on a synthetic bench file ----------------------------------------------------------------

TRUE = sc.BenchParams(alpha0=2e-3, efficiency=0.8, delay_hops=2.0)
ROWS = {  # optimizer -> payload of its ops per step at n hosts
    "LAMB": lambda n: {"all_reduce": 6.9e6},
    "SLAMB": lambda n: {"all_reduce": 1.04e6},
    "SLAMB + overlap": lambda n: {"all_reduce": 1.04e6},
    "1-bit LAMB": lambda n: {"all_to_all": 2.16e5, "all_gather": 2.16e5 / n},
}


def synthetic_records(noise=0.0):
    """Records whose step times come from TRUE, optionally with a deterministic +-noise pattern."""
    records, i = [], 0
    for hosts in (2, 4, 8):
        for rate, delay in ((100.0, 0.5), (20.0, 2.0)):
            for opt, ops in ROWS.items():
                payloads = ops(hosts)
                rec = {"pipeline": "cifar10", "model": "resnet110", "hosts": hosts, "rate_mbit": rate,
                       "delay_ms": delay, "optimizer": opt, "compute_time_s": 0.4 + 0.05 * hosts,
                       "comm_time_s": 0.0, "steps": 20, "final_top1": None, "time_to_target_s": None,
                       "params": 1727962,
                       "ledger_payload_bytes_per_step": sum(payloads.values()),
                       "ledger_wire_bytes_per_step": sum(sc.wire_factor(op, hosts) * b for op, b in payloads.items()),
                       "step_time_s": 1.0}
                rec["step_time_s"] = sc.predict_bench_record(rec, TRUE) * (1 + noise * (-1) ** i)
                records.append(rec)
                i += 1
    return records


@pytest.mark.e2e
def test_calibration_recovers_known_constants_from_a_file(tmp_path):
    path = tmp_path / "netbench_raw.json"
    path.write_text(json.dumps(synthetic_records()))
    fit = sc.fit_bench(json.loads(path.read_text()), delay_hops=2.0)
    assert fit.alpha0 == pytest.approx(TRUE.alpha0, rel=1e-3)
    assert fit.efficiency == pytest.approx(TRUE.efficiency, rel=1e-4)


def test_validation_reports_held_out_error_per_host_count():
    v = sc.validate_bench(synthetic_records(noise=0.05), delay_hops=2.0)
    assert sorted(v["by_hosts"]) == [2, 4, 8]
    for h, s in v["by_hosts"].items():
        assert s["rows"] == 8
        # every record is off by exactly 5% from the true model; a fit on the other host counts stays near it
        assert 0.02 < s["heldout_mean_abs_error"] < 0.10
        assert s["heldout_fit"].efficiency == pytest.approx(TRUE.efficiency, rel=0.1)
    assert all(math.isfinite(r["heldout_error"]) for r in v["rows"])
    # a record with a different structure than its name claims is refused, not silently mis-modelled
    bad = dict(synthetic_records()[0], ledger_wire_bytes_per_step=1.0)
    with pytest.raises(ValueError, match="more than one kind"):
        sc.predict_bench_record(bad, TRUE)
    with pytest.raises(ValueError, match="lacks"):
        sc.predict_bench_record({"hosts": 2}, TRUE)


@pytest.mark.e2e
def test_ledger_profiles_from_measured_volumes():
    from bench.scaling import ledger_profiles

    with open(os.path.join(ROOT, "results", "comm_volume_raw.json")) as f:
        profiles = ledger_profiles(json.load(f))
    (grads,) = profiles["LAMB"].collectives
    assert grads.bytes_per_param == pytest.approx(4.0, rel=1e-6) and grads.overlappable  # fp32 gradients
    momentum, sync = profiles["SLAMB fp16 (k=0.1, H=100)"].collectives
    assert 0.2 <= momentum.bytes_per_param < 0.21  # k=0.1 of fp16 values plus the always-dense tensors
    assert sync.every == 100 and sync.bytes_per_param == pytest.approx(4.0, rel=1e-3)
    a2a, ag = profiles["1-bit LAMB (compression stage)"].collectives
    assert a2a.bytes_per_param == pytest.approx(1 / 8, rel=1e-3)  # one sign bit per parameter
    assert ag.sharded and ag.payload(1.0, 8) == pytest.approx(1 / 64, rel=1e-3)
    # hierarchical SLAMB: LAMB's gradient bytes inside the node, flat SLAMB's exchanges over the nodes
    hier = profiles["SLAMB hierarchical fp16 (k=0.1, H=100)"].collectives
    assert [c.scope for c in hier] == ["intra", "inter", "inter"]
    assert hier[0] == dataclasses.replace(grads, scope="intra")
    assert hier[1:] == tuple(dataclasses.replace(c, scope="inter") for c in (momentum, sync))
    # BERT-XL-sized, 1,024 A100-like GPUs (128 nodes x 8): the times are the sum of the hand-checked parts
    cluster = sc.Cluster("c", 8, NVL, NET)
    exposed, overlappable = profiles["SLAMB hierarchical fp16 (k=0.1, H=100)"].times(2.8e9, 1024, cluster)
    m, h = momentum.bytes_per_param * 2.8e9, sync.bytes_per_param * 2.8e9
    assert exposed + overlappable == pytest.approx(
        sc.collective_time("all_reduce", 4 * 2.8e9, 1024, cluster, scope="intra", calls=math.ceil(4 * 2.8e9 / 25 / 2**20))
        + sc.node_exchange_time(m, 128, 8, NVL, NET) + sc.node_exchange_time(h, 128, 8, NVL, NET) / 100, rel=1e-9)


@pytest.mark.e2e
def test_command_with_and_without_bench_file(tmp_path, capsys):
    from bench.scaling import main

    out = tmp_path / "scaling.md"
    assert main(["--netbench", str(tmp_path / "absent.json"), "--out", str(out)]) is None
    assert "does not exist yet" in out.read_text() and "does not exist yet" in capsys.readouterr().out
    assert (tmp_path / "scaling_efficiency.png").stat().st_size > 0
    # the committed page's HSDP section is this command's (it does not depend on the bench file)
    def hsdp(text):
        return text.split("## HSDP", 1)[1].split("\n## ", 1)[0]
    with open(os.path.join(ROOT, "results", "scaling.md")) as f:
        assert hsdp(f.read()) == hsdp(out.read_text())

    bench = tmp_path / "netbench_raw.json"
    reference = dict(synthetic_records()[0], rate_mbit=None, status="ok")  # unshaped run: a compute figure only
    mixed = dict(synthetic_records()[1], ledger_wire_bytes_per_step=1.0)  # not explained by its collectives
    bench.write_text(json.dumps(synthetic_records(noise=0.05) + [reference, mixed]))
    v = main(["--netbench", str(bench), "--out", str(out), "--set", "bench_delay_hops=2"])
    text = out.read_text()
    assert "Records left out" in text and "more than one kind" in text
    assert "held-out mean abs error" in text and (tmp_path / "scaling_bench.png").stat().st_size > 0
    assert set(v["by_hosts"]) == {2, 4, 8}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        main(["--out", str(out), "--set", "no_such_input=1"])


@pytest.mark.e2e
def test_a_bench_file_too_small_to_validate_is_refused(tmp_path):
    from bench.scaling import main

    bench = tmp_path / "netbench_raw.json"
    out = tmp_path / "scaling.md"
    quick = [r for r in synthetic_records() if r["hosts"] == 2][:2]  # what --quick gives: one host count
    bench.write_text(json.dumps(quick))
    with pytest.raises(SystemExit, match=r"2 usable shaped record\(s\) from host count\(s\) \[2\]: too few"):
        main(["--netbench", str(bench), "--out", str(out)])
    assert not out.exists()
    one_other = [r for r in synthetic_records() if r["hosts"] == 2] + synthetic_records()[-1:]  # one 8-host record
    bench.write_text(json.dumps(one_other))
    with pytest.raises(SystemExit, match="too few to validate"):
        main(["--netbench", str(bench), "--out", str(out)])
