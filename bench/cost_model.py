"""Alpha-beta cost model of data-parallel training steps, calibrated on measured figures.

A collective moves bytes over links; a link costs ``alpha`` seconds per message
step (latency plus software overhead) and ``beta`` seconds per byte (the
inverse of its effective bandwidth). Payloads are in the ledger's terms
(:mod:`slamb.comm`): the bytes one rank hands to the collective, so that an
optimizer's measured ledger volume is the model's input as it stands.

Flat ring over ``n`` ranks on one link class (gloo's algorithms, and NCCL's
ring on a homogeneous network), with ``P`` the per-rank payload:

* all-reduce: ``2 (n-1) alpha + 2 (n-1)/n P beta``
* reduce-scatter, all-to-all (pairwise): ``(n-1) alpha + (n-1)/n P beta``
* all-gather (``P`` = this rank's block): ``(n-1) alpha + (n-1) P beta``
* broadcast (pipelined): ``(n-1) alpha + P beta``

so the bandwidth term is always ``comm.wire_factor(op, n) * P * beta``.

Hierarchical, for ``N`` nodes of ``g`` GPUs (NVLink inside a node, one network
interface per node shared by its ``g`` GPUs):

* all-reduce: intra reduce-scatter, inter all-reduce of the ``g`` shards (the
  ``g`` concurrent rings share the node's NIC, so the NIC carries
  ``2 (N-1)/N P``), intra all-gather;
* all-gather: intra gather of the node's blocks, inter all-gather through the
  NIC (``(N-1)/N`` of the total), intra spread of what arrived;
* all-to-all: no reduction to exploit; ``(N-1)/N`` of every GPU's input leaves
  the node, so the NIC carries ``g (N-1)/N P`` while NVLink carries the rest
  concurrently.

Hierarchical SLAMB (``SLAMB(hierarchy="node")``) splits a step's exchanges by
scope: the dense gradient all-reduce inside each node only (``scope="intra"``),
and the momentum exchange over the nodes (``scope="inter"``): the g GPUs of a
node hold the same momentum, so each carries 1/g of it over its own inter-node
ring (the g rings share the node's NIC, which carries ``2 (N-1)/N P`` in all)
and an intra all-gather spreads the averaged shares; no intra reduce-scatter,
since nothing is left to reduce inside the node.

HSDP with a replica group per node (``scope="replicas"``): FSDP's all-gathers and
reduce-scatter run inside the node (``scope="intra"``), and what crosses the nodes
is an all-reduce of shards: each GPU carries its own 1/g over its inter-node ring
(the NIC carries ``2 (N-1)/N P`` of the node's total ``P``) and keeps the result,
with no intra all-gather after it.

A step is ``forward + max(backward window, overlappable comm) + exposed comm``
(the rest of the backward pass cannot hide anything), or the plain sum when
nothing overlaps. Scaling efficiency is per-GPU throughput relative to a
baseline configuration (one GPU, or one node).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from slamb.comm import wire_factor

__all__ = [
    "Link", "Cluster", "Collective", "CommProfile", "BenchParams",
    "ring_time", "hierarchical_time", "replica_exchange_time", "node_exchange_time", "collective_time", "step_time", "scaling_efficiency",
    "tcp_wire_overhead", "solve_op_split", "bench_profile", "predict_bench_record",
    "fit_bench", "validate_bench", "last_bucket_share", "BENCH_KEYS",
]

RING_LATENCY_STEPS = {  # message steps of the ring algorithm of each collective, per (n - 1)
    "all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1, "broadcast": 1,
}


@dataclasses.dataclass(frozen=True)
class Link:
    """``alpha``: seconds per message step; ``bandwidth``: effective bytes per second."""
    alpha: float
    bandwidth: float

    def __post_init__(self):
        if not self.alpha >= 0:
            raise ValueError(f"Link.alpha must be >= 0 seconds, got {self.alpha}")
        if not self.bandwidth > 0:
            raise ValueError(f"Link.bandwidth must be > 0 bytes/s, got {self.bandwidth}")

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    @classmethod
    def from_gbit(cls, alpha: float, gbit_per_s: float, efficiency: float = 1.0) -> "Link":
        if not 0 < efficiency <= 1:
            raise ValueError(f"link efficiency must be in (0, 1], got {efficiency}")
        return cls(alpha, gbit_per_s * 1e9 / 8 * efficiency)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs on ``intra`` links, joined by one ``inter`` NIC per node."""
    name: str
    gpus_per_node: int
    intra: Link
    inter: Link

    def layout(self, gpus: int) -> tuple[int, int]:
        """(nodes, GPUs per node) of a job of ``gpus`` GPUs, filling nodes first."""
        if gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {gpus}")
        if gpus <= self.gpus_per_node:
            return 1, gpus
        if gpus % self.gpus_per_node:
            raise ValueError(f"{gpus} GPUs do not fill whole nodes of {self.gpus_per_node} ({self.name})")
        return gpus // self.gpus_per_node, self.gpus_per_node


def _check_op(op: str) -> None:
    if op not in RING_LATENCY_STEPS:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(RING_LATENCY_STEPS)}")


def ring_time(op: str, payload: float, n: int, link: Link, calls: int = 1) -> float:
    """Seconds for ``calls`` ring collectives over ``n`` ranks moving ``payload`` bytes per rank in all."""
    _check_op(op)
    if n <= 1:
        return 0.0
    latency = calls * RING_LATENCY_STEPS[op] * (n - 1) * link.alpha
    return latency + wire_factor(op, n) * payload * link.beta


def hierarchical_time(op: str, payload: float, nodes: int, gpus_per_node: int, intra: Link, inter: Link,
                      calls: int = 1) -> float:
    """Seconds for ``calls`` two-level collectives (``payload`` per GPU in all, ledger terms)."""
    _check_op(op)
    N, g = nodes, gpus_per_node
    if N <= 1:
        return ring_time(op, payload, g, intra, calls)
    if g <= 1:
        return ring_time(op, payload, N, inter, calls)
    if op == "all_reduce":
        return (ring_time("reduce_scatter", payload, g, intra, calls)
                + calls * 2 * (N - 1) * inter.alpha + 2 * (N - 1) / N * payload * inter.beta
                + ring_time("all_gather", payload / g, g, intra, calls))
    if op == "all_gather":  # payload = this GPU's block; the gathered total is N g payload
        total = N * g * payload
        return (calls * 2 * (g - 1) * intra.alpha + (g - 1) / g * total * intra.beta
                + calls * (N - 1) * inter.alpha + (N - 1) / N * total * inter.beta)
    if op == "all_to_all":
        p = N * g
        latency = calls * ((g - 1) * intra.alpha + (N - 1) * inter.alpha)
        return latency + max(g * (N - 1) / N * payload * inter.beta, (g - 1) / p * payload * intra.beta)
    if op == "reduce_scatter":  # half of the all-reduce
        return (ring_time("reduce_scatter", payload, g, intra, calls)
                + calls * (N - 1) * inter.alpha + (N - 1) / N * payload * inter.beta)
    # broadcast: down the node tree through each NIC once, then inside the node
    return calls * (N - 1) * inter.alpha + payload * inter.beta + ring_time("broadcast", payload, g, intra, calls)


def replica_exchange_time(payload: float, nodes: int, inter: Link, calls: int = 1) -> float:
    """Seconds for ``calls`` all-reduces over the nodes of a node's ``payload`` split over its GPUs, each
    GPU's share over its own inter-node ring, all of a node's rings through its NIC at once (which carries
    ``2 (N-1)/N payload``): HSDP's exchange across replica groups of one node each, every GPU keeping the
    shard it holds."""
    if nodes <= 1:
        return 0.0
    return calls * 2 * (nodes - 1) * inter.alpha + 2 * (nodes - 1) / nodes * payload * inter.beta


def node_exchange_time(payload: float, nodes: int, gpus_per_node: int, intra: Link, inter: Link,
                       calls: int = 1) -> float:
    """Seconds for ``calls`` all-reduces over the nodes of a ``payload`` every GPU of a node holds alike
    (hierarchical SLAMB): each GPU's 1/g share over its inter-node ring (:func:`replica_exchange_time`),
    then an intra all-gather of the shares."""
    if nodes <= 1:
        return 0.0
    return (replica_exchange_time(payload, nodes, inter, calls)
            + ring_time("all_gather", payload / gpus_per_node, gpus_per_node, intra, calls))


SCOPES = ("all", "intra", "inter", "replicas")


def collective_time(op: str, payload: float, gpus: int, cluster: Cluster, *, algorithm: str = "hierarchical",
                    calls: int = 1, scope: str = "all") -> float:
    """One collective of a job of ``gpus`` GPUs on ``cluster`` ("ring": one flat ring through every GPU).

    ``scope``: ``"all"`` the GPUs of the job; ``"intra"`` each node's GPUs only (a ring on the intra
    link); ``"inter"`` an all-reduce over the nodes of what a node's GPUs hold alike
    (:func:`node_exchange_time`); ``"replicas"`` an all-reduce over the nodes of what a node's GPUs hold
    as shards, ``payload`` being the node's total (:func:`replica_exchange_time`: HSDP, a replica group
    per node)."""
    nodes, g = cluster.layout(gpus)
    if scope == "intra":
        return ring_time(op, payload, g, cluster.intra, calls)
    if scope in ("inter", "replicas"):
        if op != "all_reduce":
            raise ValueError(f"scope={scope!r} models the all-reduce over nodes, got {op!r}")
        if scope == "replicas":
            return replica_exchange_time(payload, nodes, cluster.inter, calls)
        return node_exchange_time(payload, nodes, g, cluster.intra, cluster.inter, calls)
    if scope != "all":
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if algorithm == "hierarchical":
        return hierarchical_time(op, payload, nodes, g, cluster.intra, cluster.inter, calls)
    if algorithm == "ring":  # every step waits for the slowest hop: the network once it spans nodes
        return ring_time(op, payload, gpus, cluster.inter if nodes > 1 else cluster.intra, calls)
    raise ValueError(f"algorithm must be 'ring' or 'hierarchical', got {algorithm!r}")


def step_time(compute: float, exposed_comm: float, overlappable_comm: float = 0.0, *,
              backward_share: float = 2 / 3, overlap_window: float | None = None, overlap: bool = True) -> float:
    """``forward + max(window, overlappable) + rest of backward + exposed`` (or the sum without overlap).

    ``overlap_window`` caps the backward time that communication can hide behind
    (with gradient accumulation only the last micro-batch's backward can); by
    default the whole backward pass, ``backward_share * compute``.
    """
    if not 0 <= backward_share <= 1:
        raise ValueError(f"backward_share must be in [0, 1], got {backward_share}")
    if min(compute, exposed_comm, overlappable_comm) < 0:
        raise ValueError("compute and communication times must be >= 0")
    if not overlap:
        return compute + overlappable_comm + exposed_comm
    window = backward_share * compute
    if overlap_window is not None:
        window = min(window, max(overlap_window, 0.0))
    return compute - window + max(window, overlappable_comm) + exposed_comm


def scaling_efficiency(throughput: float, gpus: int, base_throughput: float, base_gpus: int = 1) -> float:
    """Per-GPU throughput at ``gpus`` over per-GPU throughput of the baseline (1 GPU or one node)."""
    if gpus < 1 or base_gpus < 1 or base_throughput <= 0:
        raise ValueError("gpus and base_gpus must be >= 1 and base_throughput > 0")
    return (throughput / gpus) / (base_throughput / base_gpus)


# -- what an optimizer sends per step --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Collective:
    """One exchange of a step.

    ``bytes_per_param``: ledger payload per rank per model parameter at
    ``ref_world`` ranks. ``sharded``: the payload is a 1/n shard of a model-sized
    buffer (1-bit LAMB's all-gather), so it scales as ``ref_world / n``.
    ``every``: the exchange runs once per ``every`` steps (SLAMB's model sync).
    ``overlappable``: it can run under the backward pass (DDP buckets).
    """
    op: str
    bytes_per_param: float
    ref_world: int = 1
    sharded: bool = False
    every: int = 1
    overlappable: bool = False
    bucket_bytes: float | None = None  # split into calls of at most this many bytes (DDP buckets)
    # bytes per parameter of the buffer DDP cuts into buckets (None: this payload itself): SLAMB's overlapped
    # momentum rides on the gradient buckets, so its last bucket is a share of the gradient's
    bucket_basis_per_param: float | None = None
    scope: str = "all"  # "all" GPUs, "intra" each node, "inter" / "replicas" the nodes (see collective_time)

    def payload(self, params: float, n: int) -> float:
        scale = self.ref_world / n if self.sharded else 1.0
        return self.bytes_per_param * params * scale

    def calls(self, payload: float) -> int:
        if self.bucket_bytes is None or payload <= 0:
            return 1
        return max(1, math.ceil(payload / self.bucket_bytes))


@dataclasses.dataclass(frozen=True)
class CommProfile:
    name: str
    collectives: tuple[Collective, ...]

    def times(self, params: float, gpus: int, cluster: Cluster, algorithm: str = "hierarchical"):
        """(exposed, overlappable) communication seconds per step, periodic exchanges amortised."""
        exposed = overlappable = 0.0
        for c in self.collectives:
            payload = c.payload(params, gpus)
            t = collective_time(c.op, payload, gpus, cluster, algorithm=algorithm, calls=c.calls(payload),
                                scope=c.scope) / c.every
            if c.overlappable:
                basis = payload if c.bucket_basis_per_param is None else c.bucket_basis_per_param * params
                last = last_bucket_share(basis, c.bucket_bytes) if c.bucket_bytes else 0.0
                exposed += last * t
                overlappable += (1 - last) * t
            else:
                exposed += t
        return exposed, overlappable

    def bytes_per_step(self, params: float, gpus: int) -> float:
        return sum(c.payload(params, gpus) / c.every for c in self.collectives)


def solve_op_split(payload: float, wire: float, n: int, ops: Sequence[str]) -> list[float]:
    """Per-op payloads from a ledger's (payload, wire) totals at ``n`` ranks.

    The ledger sums payload and wire over ops; with wire = sum_op factor(op, n) x
    payload_op, one or two ops are determined exactly. A single op whose wire
    disagrees with its factor (by more than 0.5%) means the assumed structure is
    wrong: that raises rather than silently miscounting.
    """
    factors = [wire_factor(op, n) for op in ops]
    if len(ops) == 1:
        if payload and abs(wire - factors[0] * payload) > 5e-3 * wire:
            raise ValueError(f"ledger wire {wire:.6g} != {ops[0]} factor {factors[0]:.4g} x payload {payload:.6g}: "
                             "the optimizer sends more than one kind of collective; give its ops")
        return [payload]
    if len(ops) != 2:
        raise ValueError(f"can split a ledger total over 1 or 2 ops, got {list(ops)}")
    a = np.array([[1.0, 1.0], factors])
    if abs(np.linalg.det(a)) < 1e-12:
        raise ValueError(f"ops {list(ops)} have equal wire factors at n={n}: the split is not determined")
    split = np.linalg.solve(a, np.array([payload, wire]))
    if (split < -1e-6 * payload).any():
        raise ValueError(f"ledger totals ({payload}, {wire}) are not a mix of {list(ops)} at n={n}")
    return [float(max(s, 0.0)) for s in split]


# -- the network-namespace bench (gloo over TCP through tc-limited links) ---------------------------------

BENCH_KEYS = ("pipeline", "model", "hosts", "rate_mbit", "delay_ms", "optimizer", "step_time_s",
              "compute_time_s", "comm_time_s", "ledger_payload_bytes_per_step", "ledger_wire_bytes_per_step")
# optional: "params" (DDP's buckets), "link_burst_bytes" (depth of the links' token bucket, 0 when absent)

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 2**20  # torch DDP's smaller first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


def last_bucket_share(basis_bytes: float, bucket_bytes: float = DDP_BUCKET_BYTES,
                      first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES) -> float:
    """Share of a buffer's bytes in the DDP bucket that is ready last.

    DDP fills buckets in reverse layer order (a first bucket of 1 MiB, then 25 MiB
    each), so the last one holds the first layers, whose gradients backward
    computes last: its collective starts when backward ends and hides behind
    nothing. A model of under 1 MiB is one bucket: none of its exchange overlaps.
    """
    if basis_bytes <= first_bucket_bytes:
        return 1.0
    rest = (basis_bytes - first_bucket_bytes) % bucket_bytes or bucket_bytes
    return rest / basis_bytes


def tcp_wire_overhead(mtu: int = 1500, ip_tcp_header: int = 52, l2_header: int = 14, ack_every: int = 2) -> float:
    """Link bytes per application byte of a bulk TCP stream (tc shapes whole frames).

    Each segment carries ``mtu - ip_tcp_header`` bytes (52: IPv4 20 + TCP 20 +
    timestamps 12) in an ``mtu + l2_header`` frame; a host that also receives
    sends one header-only ACK frame per ``ack_every`` segments on its own link.
    """
    mss = mtu - ip_tcp_header
    if mss <= 0 or ack_every < 1:
        raise ValueError("mtu must exceed the IP/TCP header and ack_every must be >= 1")
    return (mtu + l2_header) / mss + (ip_tcp_header + l2_header) / (ack_every * mss)


def bench_profile(optimizer: str) -> tuple[tuple[str, ...], bool, bool]:
    """(ops, overlappable, bucketed) of a bench row, from the optimizer's communication structure."""
    name = optimizer.lower()
    overlap = "overlap" in name
    if "1-bit" in name or "onebit" in name:
        return ("all_to_all", "all_gather"), overlap, False
    if "dgc" in name:
        return ("all_gather", "all_reduce"), overlap, False
    if "slamb" in name:
        return ("all_reduce",), overlap, False
    # LAMB, SGD, AdamW, JointSpar: averaged gradients in DDP buckets, launched during backward
    return ("all_reduce",), True, True


@dataclasses.dataclass(frozen=True)
class BenchParams:
    """Calibrated constants of the bench network: per-message-step latency and rate efficiency.

    ``alpha = alpha0 + delay_hops * delay``; the effective rate is
    ``efficiency * rate / wire_overhead`` application bytes per second.
    """
    alpha0: float
    efficiency: float
    delay_hops: float = 1.0
    wire_overhead: float = dataclasses.field(default_factory=tcp_wire_overhead)
    backward_share: float = 2 / 3


def _check_record(rec: dict) -> None:
    missing = [k for k in BENCH_KEYS if k not in rec]
    if missing:
        raise ValueError(f"bench record lacks {missing}; each record needs {list(BENCH_KEYS)}")
    if int(rec["hosts"]) < 1 or float(rec["rate_mbit"]) <= 0:
        raise ValueError(f"bench record needs hosts >= 1 and rate_mbit > 0: {rec}")


def _bench_comm(rec: dict, params: BenchParams) -> tuple[float, float]:
    """(exposed, overlappable) seconds of one record's ledger volume on its link."""
    n = int(rec["hosts"])
    ops, overlap, bucketed = bench_profile(rec["optimizer"])
    payloads = solve_op_split(float(rec["ledger_payload_bytes_per_step"]), float(rec["ledger_wire_bytes_per_step"]),
                              n, ops) if n > 1 else [0.0] * len(ops)
    alpha = params.alpha0 + params.delay_hops * float(rec["delay_ms"]) * 1e-3
    rate = float(rec["rate_mbit"]) * 1e6 / 8  # link bytes per second
    link = Link(alpha, params.efficiency * rate / params.wire_overhead)
    total = wire = 0.0
    for op, payload in zip(ops, payloads):
        if payload > 0:
            calls = max(1, math.ceil(payload / DDP_BUCKET_BYTES)) if bucketed else 1
            total += ring_time(op, payload, n, link, calls)
            wire += wire_factor(op, n) * payload
    # a token-bucket shaper (tc tbf) lets a link that idled through the step's compute send its bucket's
    # depth at once: that much of the step's exchange costs no time at the shaped rate
    burst = min(float(rec.get("link_burst_bytes") or 0.0), rate * float(rec["compute_time_s"]))
    total -= min(wire, burst / params.wire_overhead) * link.beta
    if not overlap:
        return total, 0.0
    # the exchange rides on DDP's gradient buckets (fp32 gradients in the bench): the last one cannot hide
    basis = sum(payloads) if bucketed or not rec.get("params") else 4.0 * float(rec["params"])
    last = last_bucket_share(basis)
    return last * total, (1 - last) * total


def predict_bench_record(rec: dict, params: BenchParams) -> float:
    """Predicted step seconds of a bench record: its measured compute plus the modelled communication."""
    _check_record(rec)
    exposed, overlappable = _bench_comm(rec, params)
    return step_time(float(rec["compute_time_s"]), exposed, overlappable, backward_share=params.backward_share)


def fit_bench(records: Iterable[dict], *, delay_hops: float = 1.0, wire_overhead: float | None = None,
              backward_share: float = 2 / 3) -> BenchParams:
    """Least squares on relative step-time error over (alpha0, efficiency)."""
    from scipy.optimize import least_squares

    records = list(records)
    for rec in records:
        _check_record(rec)
    multi = [r for r in records if int(r["hosts"]) > 1]
    if not multi:
        raise ValueError("calibration needs records with hosts > 1")
    overhead = tcp_wire_overhead() if wire_overhead is None else wire_overhead

    def params_of(x):
        return BenchParams(alpha0=float(x[0]), efficiency=float(x[1]), delay_hops=delay_hops,
                           wire_overhead=overhead, backward_share=backward_share)

    def residuals(x):
        p = params_of(x)
        return [predict_bench_record(r, p) / float(r["step_time_s"]) - 1.0 for r in multi]

    fit = least_squares(residuals, x0=[1e-3, 0.8], bounds=([0.0, 0.05], [1.0, 1.0]))
    return params_of(fit.x)


def validate_bench(records: Sequence[dict], **fit_kwargs) -> dict:
    """Leave-one-host-count-out validation: fit on the other host counts, predict this one.

    Returns ``{"fit": BenchParams on all records, "rows": [...], "by_hosts": {h: {...}}}``;
    each row carries its in-sample and held-out prediction and relative errors.
    """
    records = [r for r in records if int(r["hosts"]) > 1]
    for rec in records:
        _check_record(rec)
    hosts = sorted({int(r["hosts"]) for r in records})
    if not hosts:
        raise ValueError("no bench record with hosts > 1 to validate against")
    full = fit_bench(records, **fit_kwargs)
    held = {h: (fit_bench([r for r in records if int(r["hosts"]) != h], **fit_kwargs) if len(hosts) > 1 else None)
            for h in hosts}
    rows, by_hosts = [], {}
    for rec in records:
        h = int(rec["hosts"])
        measured = float(rec["step_time_s"])
        pred_in = predict_bench_record(rec, full)
        pred_out = predict_bench_record(rec, held[h]) if held[h] is not None else float("nan")
        rows.append({**{k: rec[k] for k in ("pipeline", "model", "hosts", "rate_mbit", "delay_ms", "optimizer")},
                     "measured_s": measured, "compute_s": float(rec["compute_time_s"]),
                     "predicted_s": pred_in, "error": pred_in / measured - 1.0,
                     "heldout_predicted_s": pred_out, "heldout_error": pred_out / measured - 1.0})
    for h in hosts:
        mine = [r for r in rows if r["hosts"] == h]
        by_hosts[h] = {
            "rows": len(mine),
            "mean_abs_error": float(np.mean([abs(r["error"]) for r in mine])),
            "max_abs_error": float(np.max([abs(r["error"]) for r in mine])),
            "heldout_mean_abs_error": float(np.mean([abs(r["heldout_error"]) for r in mine])),
            "heldout_max_abs_error": float(np.max([abs(r["heldout_error"]) for r in mine])),
            "heldout_fit": held[h],
        }
    return {"fit": full, "rows": rows, "by_hosts": by_hosts}
