"""The page and the plots from the raw records."""
from __future__ import annotations

import math
from pathlib import Path

from .analysis import target_checks
from .config import BERT_MICRO, CIFAR_BATCH, HIER, HSDP, PIPELINES, ROWS, TRAIN_IMAGES, cifar_steps_per_epoch


def _fmt(v, spec=".3g", none="–"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _rate(r):
    return "unlimited" if r is None else f"{r:g}"


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
            "for the inner optimizer, H = 10 local steps, outer Nesterov SGD (lr 0.7, momentum 0.9).")
         + ("" if not any(r["optimizer"] in HSDP for r in records) else
            f" {' and '.join(HSDP)}: the LAMB and SLAMB rows with `trainer.parallelism=hsdp trainer.shard_size={procs}` "
            "(FSDP2 shards each host's replica of the model over its processes, per BERT layer; the hosts are the "
            "replicas: LAMB's gradient all-reduce, or SLAMB's momentum exchange and model syncs, cross the hosts, "
            "FSDP's all-gathers and reduce-scatters stay inside them)."),
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
                     f"{'yes' if x['comm_bound'] else 'no'} | {_fmt(x['slamb_over_lamb'], '.3f')} | "
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


# the ledger's levels that cross the hosts, and those that stay inside one (a host is a node of the hierarchical
# row, a replica of the HSDP rows)
ACROSS, INSIDE = ("inter", "replicate"), ("intra", "shard")


def _level_sum(levels: dict, names) -> float | None:
    """The wire bytes of ``levels`` summed over ``names``; None where the run recorded none of them."""
    got = [levels[k]["wire"] for k in names if k in levels]
    return sum(got) if got else None


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
        inter, world, intra = (_level_sum(lv, names) for names in (ACROSS, ("world",), INSIDE))
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
    for pipeline, n, rate, _ in sorted((k for k in by if k[3] == HSDP[1] and (*k[:3], HSDP[0]) in by),
                                       key=lambda k: (k[0], k[1], k[2] or math.inf)):
        slamb, lamb = by[(pipeline, n, rate, HSDP[1])], by[(pipeline, n, rate, HSDP[0])]
        L.append(f"- {pipeline}, {n} hosts x {slamb['procs_per_host']} processes, "
                 f"{f'{rate:g} Mbit/s' if rate else 'unlimited link'}: {HSDP[1]} / {HSDP[0]} step time = "
                 f"**{slamb['step_time_s'] / lamb['step_time_s']:.3f}**, bytes across the hosts (veth payload) "
                 f"**{slamb['link_tx_payload_bytes_per_step'] / lamb['link_tx_payload_bytes_per_step']:.3f}**.")
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
          "counters match, and its dense gradient average stays on the loopback."
          + ("" if not any(r["optimizer"] in HSDP for r in ok) else
             " The HSDP rows' levels are FSDP2's mesh dimensions: `replicate` (across hosts) counts as `inter`, "
             "`shard` (FSDP's all-gathers and reduce-scatters, and the trust ratios' sums of squares) as `intra`; "
             "each is in the optimizer's ledger, FSDP's own collectives included. The ledger's wire bytes are the "
             "bandwidth-optimal ring's; gloo's reduce-scatter sends its whole input on 2 ranks (1.00x per rank, "
             "measured on the loopback, against the ring's 0.5x), so `lo / ledger intra` is above 1 there, by the "
             "reduce-scatter's share."), ""]
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
                    return _level_sum(r["host_ledger_levels_per_step"], names) or 0.0

                bars = [("ledger across + world", lambda r: level(r, *ACROSS, "world")),
                        ("veth payload", lambda r: r["link_tx_payload_bytes_per_step"]),
                        ("ledger inside", lambda r: level(r, *INSIDE)),
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
