"""Multi-host bandwidth bench: the real pipelines across emulated hosts with shaped links.

    python -m bench.netbench                                   # the full matrix (about 30 min on 2 cores)
    python -m bench.netbench --hosts 2 4 --rates 50 200 --epochs 8 --pipelines cifar10
    python -m bench.netbench --quick                           # 2 hosts, 10 Mbit/s, 2 epochs (~1 min)
    python -m bench.netbench --render-only                     # netbench.md and plots from the raw JSON
    python -m bench.netbench --hosts 2 --procs-per-host 2 --rates 10 --pipelines cifar10 \
        --out results/netbench_hierarchical.md                  # hosts of 2 processes: hierarchical SLAMB's rows
    python -m bench.netbench --procs-per-host 2 --pipelines bert --bert-hosts 2 --bert-rates 10 \
        --bert-optimizers "HSDP LAMB" "HSDP SLAMB" --out results/netbench_hsdp.md   # FSDP2 inside each host

Only the full matrix (every setting at its default) writes ``results/``; ``--quick`` and any other
partial matrix write to ``runs/netbench/`` unless ``--out`` names a page, so that a quick check never
replaces the committed results. The raw JSON and the plots are named after the page.

With ``--procs-per-host P`` each host runs P processes (``--nproc-per-node P``): their traffic inside
the host crosses the namespace's loopback, the traffic between hosts its shaped veth, and both
interfaces' counters are recorded beside the ledger's bytes by level (``intra``, ``inter``, ``world``;
the HSDP rows' ``shard`` and ``replicate``, FSDP2's own collectives included).

For each host count N a :class:`bench.netns.Cluster` of N network namespaces
on a switch namespace is created; for each link rate (and an unlimited link,
the compute-only reference) and each optimizer row, one ``torchrun`` per
namespace (``--nnodes N --node-rank i --nproc-per-node 1``) runs the real
training pipeline (``cifar10.train`` on the digits demo data, ``bert.train``
with the tiny BERT on the offline docstring corpus) with gloo over the veth
addresses. Namespaces are deleted when the bench ends, fails or is killed.

Inside each worker this package (``--worker``, :mod:`.worker`) wraps the pipeline: whenever the
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

# the package by job: config (rows, overrides, data, plan), worker (the probes inside each worker), runs
# (the namespaces' torchruns), analysis (a run's numbers), report (page and plots), cli (settings, main)
from .analysis import RECORD_KEYS, analyse_run, complete, fill_compute_times, reanalyse, target_checks, time_to
from .cli import FULL_OUT, SCRATCH_OUT, main, parse_args
from .config import (BERT_MICRO, CIFAR_BATCH, DEFAULT_ROWS, HIER, HSDP, MULTI_PROC_ROWS, PIPELINES, ROOT, ROWS, TRAIN_IMAGES,
                     UNLIMITED, WORKER_FLAG, Settings, cifar_steps_per_epoch, model_name, plan, prepare_data,
                     run_overrides, run_tag)
from .report import multi_proc_section, render
from .runs import launch_run, run_matrix
from .worker import interface_counters, tcp_snmp, worker_main

__all__ = ["BERT_MICRO", "CIFAR_BATCH", "DEFAULT_ROWS", "FULL_OUT", "HIER", "HSDP", "MULTI_PROC_ROWS", "PIPELINES", "RECORD_KEYS",
           "ROOT", "ROWS", "SCRATCH_OUT", "TRAIN_IMAGES", "UNLIMITED", "WORKER_FLAG", "Settings", "analyse_run",
           "cifar_steps_per_epoch", "complete", "fill_compute_times", "interface_counters", "launch_run", "main",
           "model_name", "multi_proc_section", "parse_args", "plan", "prepare_data", "reanalyse", "render",
           "run_matrix", "run_overrides", "run_tag", "target_checks", "tcp_snmp", "time_to", "worker_main"]
