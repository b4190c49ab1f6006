"""BERT pre-training, phase 1 (seq 128) and phase 2 (seq 512), with any optimizer of the package.

    python -m bert.train experiment=bert/phase1_slamb trainer.nproc_per_node=8
    python -m bert.train experiment=bert/phase2_slamb init_from=runs/bert_phase1_slamb/model
    torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m bert.train experiment=bert/phase1_slamb                          # multi-node

The global batch (``data.global_batch``, 65,536 in phase 1) is reached from
any number of workers by gradient accumulation over micro-batches of
``data.micro_batch`` sequences; gradients are communicated (by the
optimizer's DDP hook, if any) on the last micro-batch only. Under fp16 the
loss is scaled dynamically and overflowing steps are skipped by all ranks
together (:mod:`harness.amp`); ``clip_grad`` clips the unscaled
gradients' global norm before the optimizer step (null: no clipping).

Training is counted in optimizer steps; ``steps_per_epoch`` (default: the
examples of all shards over the global batch) gives the optimizer contract
its epochs, so that per-epoch schedules (DGC's density warm-up, SLAMB's
compression warm-up) advance. Every ``log_every`` steps a line goes to
``metrics.jsonl`` (``epoch`` there is the step count, so that a resume
truncates it at the checkpoint): loss (MLM + NSP), MLM and NSP accuracy over
the period's micro-batches of all ranks, sequences/s, LR, loss scale, skipped
steps, the optimizer's scheduled settings and the ledger's bytes. With
``validation.dir`` set, each line also carries the MLM loss and accuracy of
held-out shards (``val_mlm_loss``: mean over their masked tokens, the paper's
Table 2 metric) of the ranks' averaged model, and of the local models beside it
(``val_mlm_loss_local``) where the ranks' parameters differ. At the end
the model is the ranks' average (:func:`slamb.average_model`: SLAMB's ranks
differ between model syncs; :meth:`harness.Loop.export`) and rank 0 writes it in Hugging Face format to
``<run_dir>/model``, with the data's ``vocab.txt``: phase 2's ``init_from``
and SQuAD fine-tuning load it from there.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import harness
from harness.accumulate import accumulation_steps
from harness.amp import MixedPrecision, accumulation_context, check_clip_grad, check_loss_scale
from harness.build import optimizer_source, planned_world
from harness.schedules import build_lr_scheduler, check_lr_schedule
from harness.seeding import reseed
from harness.settings import check_count, flatten

from .data import (IGNORE_INDEX, Prefetcher, PretrainingStream, StepStream, check_shards, find_shards, fingerprint,
                   load_shard, to_batch)
from .model import build_model, check_model, load_pretrained, shard_blocks

# per-period sums, kept on the device (no host sync per step)
LOSS, MLM_CORRECT, MLM_COUNT, NSP_CORRECT, NSP_COUNT, MICRO = range(6)


def initial_model(cfg) -> torch.nn.Module:
    """Phase 1: fresh weights from ``seed``; phase 2: the weights phase 1 saved (``init_from``)."""
    if cfg.get("init_from"):
        return load_pretrained(cfg.init_from, cfg.model)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    return build_model(cfg.model)


def batch_sums(out, batch: dict) -> torch.Tensor:
    """(loss, MLM correct, MLM count, NSP correct, NSP count, 1) of one micro-batch.

    No host synchronisation: the masked positions are counted with a mask instead of boolean indexing
    (whose output size the host must learn), and the constants are filled on the device."""
    labels = batch["labels"]
    masked = labels != IGNORE_INDEX
    mlm_hits = ((out.prediction_logits.argmax(-1) == labels) & masked).sum()
    nsp = batch["next_sentence_label"]
    nsp_hits = (out.seq_relationship_logits.argmax(-1) == nsp).sum()
    constant = lambda x: torch.full((), float(x), dtype=torch.float64, device=nsp.device)  # noqa: E731
    return torch.stack([out.loss.detach().double(), mlm_hits.double(), masked.sum().double(), nsp_hits.double(),
                        constant(nsp.numel()), constant(1)])


def period_metrics(sums: torch.Tensor) -> dict:
    """Loss and accuracies over all ranks from this rank's period sums."""
    s = harness.rank_sums(sums)
    return {"loss": s[LOSS] / max(s[MICRO], 1), "mlm_acc": 100.0 * s[MLM_CORRECT] / max(s[MLM_COUNT], 1),
            "nsp_acc": 100.0 * s[NSP_CORRECT] / max(s[NSP_COUNT], 1)}


def validation_batches(cfg, env) -> list[dict]:
    """This rank's strided share of every example of the held-out shards, in micro-batches on the device."""
    v, d = cfg.validation, cfg.data
    batches = []
    for path in find_shards(v.dir, v.pattern, "validation"):
        arrays = load_shard(path, d.seq_len)
        rows = np.arange(len(arrays["next_sentence_labels"]))[env.rank::env.world_size]
        batches += [{k: t.to(env.device) for k, t in to_batch(arrays, rows[i:i + d.micro_batch]).items()}
                    for i in range(0, len(rows), d.micro_batch)]
    return batches


@torch.no_grad()
def validation_metrics(model, batches: list[dict], amp) -> dict:
    """MLM loss (mean over all ranks' masked tokens) and MLM accuracy (%) of ``batches``; collective."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=next(model.parameters()).device)
    for batch in batches:
        with amp.autocast():
            logits = model(**batch).prediction_logits
        labels = batch["labels"].reshape(-1)
        logits = logits.reshape(labels.numel(), -1).float()
        masked = labels != IGNORE_INDEX
        sums += torch.stack([F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum").double(),
                             masked.sum().double(), ((logits.argmax(-1) == labels) & masked).sum().double()])
    model.train(was_training)
    loss, count, hits = harness.rank_sums(sums)
    return {"val_mlm_loss": loss / max(count, 1), "val_mlm_acc": 100.0 * hits / max(count, 1)}


def save_pretrained(vocab: Path | None):
    """The :meth:`harness.Loop.export` ``save`` of BERT: Hugging Face format, with the vocabulary when known."""
    def save(model, state: dict, folder: Path) -> None:
        model.save_pretrained(str(folder), state_dict=state)
        if vocab is not None and vocab.is_file():
            shutil.copyfile(vocab, folder / "vocab.txt")

    return save


def data_vocab(data_dir) -> Path | None:
    """The vocabulary ``bert.prepare_data`` recorded for the shards (None for shards made elsewhere)."""
    stats = Path(data_dir) / "stats.json"
    return Path(json.loads(stats.read_text())["vocab"]) if stats.is_file() else None


# what a command line may add (+key=value) that this pipeline reads though its config leaves it out
OPTIONAL = ("init_optimizer_from",)


def check(cfg: dict) -> None:
    """This pipeline's settings and data, before any worker starts (:func:`harness.build.check_settings`):
    the model's shape, the loss scale, clipping, the schedule, the shards (readable, of this phase, with ids
    the model embeds)."""
    d, m = cfg["data"], cfg["model"]
    check_model(m)
    if d["seq_len"] > m["max_position_embeddings"]:
        raise ValueError(f"invalid data.seq_len={d['seq_len']}: longer than model.max_position_embeddings="
                         f"{m['max_position_embeddings']}")
    check_loss_scale(**cfg["loss_scale"])
    check_clip_grad(cfg["clip_grad"])
    if cfg.get("steps_per_epoch") is not None:
        check_count("steps_per_epoch", cfg["steps_per_epoch"])
    check_count("data.prefetch", d["prefetch"], " (micro-batches read ahead)", minimum=0)
    check_lr_schedule(cfg["schedule"], cfg["steps"], steps_per_epoch=1)
    check_shards(find_shards(d["dir"], d["pattern"]), d["seq_len"], m["vocab_size"])
    v = cfg.get("validation") or {}
    if v.get("dir"):
        check_shards(find_shards(v["dir"], v["pattern"], "validation"), d["seq_len"], m["vocab_size"])
    if cfg.get("init_optimizer_from"):
        check_optimizer_source(cfg, cfg["init_optimizer_from"])


def check_optimizer_source(cfg: dict, source: str) -> None:
    """The run whose optimizer this phase continues (``init_optimizer_from``) is the earlier phase of this run:
    finished, of the same optimizer and model, the run whose model ``init_from`` names, its last checkpoint
    written by as many workers. Another run's state (an older run's, another row's) would be continued
    without a word, as the optimizer loads any state of its shape."""
    import yaml

    run = Path(source)
    if not (run / "config.yaml").is_file() or not (run / "metrics.json").is_file():
        raise ValueError(f"invalid init_optimizer_from={source!r}: no finished run there (config.yaml and "
                         "metrics.json); run the earlier phase into it first")
    init_from = cfg.get("init_from")
    if init_from and Path(init_from).resolve() != (run / "model").resolve():
        raise ValueError(f"invalid init_optimizer_from={source!r}: init_from={init_from!r} is another run's model; "
                         "continue the optimizer of the run whose model starts this phase "
                         "(init_optimizer_from=${parent:${init_from}})")
    earlier = flatten({k: v for k, v in yaml.safe_load((run / "config.yaml").read_text()).items()
                       if k in ("optimizer", "model")})
    for key, value in flatten({"optimizer": {"name": cfg["optimizer"]["name"]}, "model": cfg["model"]}).items():
        if earlier.get(key) != value:
            raise ValueError(f"invalid init_optimizer_from={source!r}: that run has {key}={earlier.get(key)!r} and "
                             f"this one {key}={value!r}, so its optimizer state is another run's; point it at the "
                             "earlier phase of this run, or init_optimizer_from=null (a fresh optimizer)")
    optimizer_source(run, planned_world(cfg["trainer"]))


def inputs(cfg: dict) -> dict:
    """What the run reads, by content (:mod:`harness.identity`): its shards and its held-out ones."""
    d, v = cfg["data"], cfg.get("validation") or {}
    return {"data.dir": fingerprint(d["dir"], d["pattern"]),
            **({"validation.dir": fingerprint(v["dir"], v["pattern"], "validation")} if v.get("dir") else {})}


def train(cfg: dict, run_dir: str) -> dict:
    plain, cfg = cfg, OmegaConf.create(cfg)
    t, d = cfg.trainer, cfg.data
    harness.check_counts(cfg, "steps", "log_every", "trainer.checkpoint.every",
                         *(["steps_per_epoch"] if cfg.get("steps_per_epoch") is not None else []))
    env = harness.init_distributed(t.device, t.threads_per_worker, t.timeout_s, tf32=t.tf32, cudnn_benchmark=t.cudnn_benchmark)
    accum = accumulation_steps(d.global_batch, d.micro_batch, env.world_size)
    # each step's micro-batches come from the data streams of the run's first workers, however many workers
    # resume it: fewer take several streams' each, more share one stream's, so every step sees the same sequences
    streams = harness.data_streams(run_dir, t.resume, env.world_size)
    stream = PretrainingStream(find_shards(d.dir, d.pattern), d.micro_batch, 0, streams, seed=cfg.seed,
                               seq_len=d.seq_len)
    step_stream = StepStream(stream, d.global_batch // (d.micro_batch * streams), env.rank, env.world_size)
    steps_per_epoch = cfg.get("steps_per_epoch") or max(1, sum(stream.lengths) // d.global_batch)

    # BERT's buffers (position and token type ids) are constants: no broadcast before every forward
    model, optimizer = harness.distribute(initial_model(cfg).to(env.device), t, env, blocks=shard_blocks(),
                                          build_optimizer=lambda m: harness.build_optimizer(m, plain["optimizer"]),
                                          forward_sync_buffers=False)
    scheduler = build_lr_scheduler(optimizer, cfg.schedule, 1, cfg.steps)
    amp = MixedPrecision(t.precision, env.device, optimizer=optimizer, **cfg.loss_scale)
    params = [p for p in model.parameters() if p.requires_grad]
    harness.seed_everything(cfg.seed, env.rank, t.deterministic)
    run = harness.Loop(run_dir, env, cfg, plain, model=model, optimizer=optimizer, scheduler=scheduler, amp=amp,
                       global_batch=d.global_batch, throughput="seqs", unit="step",
                       micro_batches=d.global_batch // d.micro_batch, streams=streams)

    if cfg.get("init_optimizer_from") and not run.restored:  # phase 2 continues phase 1's optimizer (DeepSpeed)
        at = harness.continue_optimizer(optimizer, cfg.init_optimizer_from, env)
        if env.is_main:
            print(f"optimizer continues from {cfg.init_optimizer_from} at its step {at}", flush=True)
    # read ahead in a thread, pinned on an accelerator: the loop only starts an asynchronous copy
    batches = harness.StepReader(lambda step: Prefetcher(step_stream.micro_batches(start=step), env.device,
                                                         d.prefetch), len(step_stream.shards))
    sums = torch.zeros(6, dtype=torch.float64, device=env.device)
    valid = validation_batches(cfg, run.eval_env) if (cfg.get("validation") or {}).get("dir") else None
    model.train()
    epoch = None
    for first, end in run.periods(cfg.log_every):
        for step in run.steps(range(first, end), total=end - first, desc=d.phase, totals=sums):
            if step // steps_per_epoch != epoch:  # DGC's density and SLAMB's compression warm-ups
                epoch = step // steps_per_epoch
                optimizer.begin_epoch(epoch)
            optimizer.begin_step()  # JointSpar: draw this round's layers, freeze the others
            optimizer.zero_grad(set_to_none=True)
            for m, batch in enumerate(batches(step)):
                # dropout draws from (seed, step, the micro-batch's place in the step), not from this worker's
                # stream: the same on any number of workers, so a run resumed on another number repeats the steps
                reseed(cfg.seed, step, step_stream.shards[m])
                with accumulation_context(model, last_micro_batch=m == accum - 1):
                    with amp.autocast():
                        out = model(**batch)
                    if out.loss.requires_grad:  # False only in a JointSpar round that sampled no layer
                        amp.backward(out.loss / accum)
                sums += batch_sums(out, batch)
            run.optimizer_step(params, clip_grad=cfg.clip_grad)
            scheduler.step()
            if step + 1 < end:  # a period's last step is saved after its line: a resume keeps the lines before it
                run.save_if_due(step + 1)
        metrics = period_metrics(sums)
        if valid is not None:
            metrics.update(run.evaluate(lambda: validation_metrics(model, valid, amp)))
        run.log_period(end, metrics, steps=end - first)
        run.save_if_due(end)
        sums.zero_()
    batches.close()
    model_dir = run.export(save_pretrained(data_vocab(d.dir)))

    # the averaged model's validation where there is one, else the training batches' (the local models')
    headline = ("final_val_mlm_loss", "final_val_mlm_acc") if valid is not None else ("final_loss", "final_mlm_acc")
    return run.finish(headline=headline, phase=d.phase, micro_batch=d.micro_batch, accumulation_steps=accum,
                      seq_len=d.seq_len, steps_per_epoch=steps_per_epoch, precision=t.precision,
                      skipped_steps=amp.skipped_steps, final_loss=run.last("loss"), final_mlm_acc=run.last("mlm_acc"),
                      final_nsp_acc=run.last("nsp_acc"), final_val_mlm_loss=run.last("val_mlm_loss"),
                      final_val_mlm_acc=run.last("val_mlm_acc"), init_from=cfg.get("init_from"),
                      model_dir=model_dir)


# how this pipeline is checked and launched: its main, and a script's checks of every run before the first
# (harness.preflight)
LAUNCH = {"shards": True, "check": check, "optional": OPTIONAL, "fault_tolerant": True}


@hydra.main(version_base="1.3", config_path="../configs", config_name="bert")
def main(cfg) -> dict:
    return harness.run_from_hydra("bert.train:train", cfg, inputs=inputs, **LAUNCH)


if __name__ == "__main__":
    harness.command(main)
