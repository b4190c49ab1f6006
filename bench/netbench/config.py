"""The bench's set-up: the optimizer rows, each run's Hydra overrides, the demo data, the plan of runs."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKER_FLAG = "--worker"
IFNAME_ENV = "NETBENCH_IFNAME"
PIPELINES = ("cifar10", "bert")
UNLIMITED = None


# optimizer rows: (pipeline -> Hydra overrides). The CIFAR-10 rows are the digits demo's; 1-bit LAMB takes
# LAMB's row settings (its warm-up, freeze_step, is set per run to 20% of the steps as in bert.demo), DGC takes
# the SGD-M demo row's (lr 0.03, momentum 0.9, wd 1e-4) with DGC's own density 0.001 and 4-epoch warm-up.
HIER = "SLAMB hierarchical"
RECIPE_H = yaml.safe_load((ROOT / "configs" / "experiment" / "cifar10" / "slamb.yaml").read_text())["optimizer"][
    "sync_interval"]
RECIPE_H_ROW = f"SLAMB H={RECIPE_H}"
# rows sharded with FSDP2 inside each host (HSDP: trainer.shard_size = the processes of a host), BERT only
HSDP = ("HSDP LAMB", "HSDP SLAMB")
ROWS = {
    "LAMB": {"cifar10": ["experiment=cifar10/demo_lamb"],
             "bert": ["experiment=bert/phase1_lamb"]},
    "SLAMB": {"cifar10": ["experiment=cifar10/demo_slamb"],
              "bert": ["experiment=bert/phase1_slamb", "optimizer.sync_interval=10",
                       "optimizer.min_compress_numel=2000"]},
    # the demo row with its momentum exchanged in int8 (one float32 scale per 256 entries), and at the CIFAR-10
    # recipe's sync interval instead of the demo's 10 (bench.time_to_accuracy's rows)
    "SLAMB int8": {"cifar10": ["experiment=cifar10/demo_slamb", "optimizer.comm_dtype=int8"]},
    RECIPE_H_ROW: {"cifar10": ["experiment=cifar10/demo_slamb", f"optimizer.sync_interval={RECIPE_H}"]},
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
    # HSDP (--procs-per-host > 1): each host holds one replica of the model, sharded over its processes; the
    # shard dimension's all-gathers and reduce-scatters stay inside the host, what crosses the hosts is LAMB's
    # gradient all-reduce over the replicas, or SLAMB's momentum exchange and model syncs
    "HSDP LAMB": {"bert": ["experiment=bert/phase1_lamb", "trainer.parallelism=hsdp"]},
    "HSDP SLAMB": {"bert": ["experiment=bert/phase1_slamb", "optimizer.sync_interval=10",
                            "optimizer.min_compress_numel=2000", "trainer.parallelism=hsdp"]},
}
# the rows of the default matrix (one process per host)
DEFAULT_ROWS = ["LAMB", "SLAMB", "SLAMB+overlap", "1-bit LAMB", "DGC"]
# the rows of --procs-per-host > 1 when --optimizers is not given
MULTI_PROC_ROWS = ["LAMB", "SLAMB", HIER, "PowerSGD", "DiLoCo"]
TRAIN_IMAGES = 1500        # digits demo: training images (cifar10.data.DIGITS_TEST of 1797 held out)
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
    if row in HSDP:
        common.append(f"trainer.shard_size={procs}")
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
        from cifar10.data import write_digits

        out["cifar10"] = {"dir": write_digits(workdir / "data" / "digits")}
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


def run_tag(job: dict) -> str:
    """The run directory's name of a job (or of its record)."""
    rate = job["rate_mbit"]
    row = job["optimizer"].replace(" ", "").replace("+", "_")
    procs = job.get("procs_per_host") or 1
    hosts = f"{job['hosts']}h" + (f"{procs}p" if procs > 1 else "")
    return f"{job['pipeline']}_{hosts}_{'unl' if rate is None else f'{rate:g}m'}_{row}"
