"""BERT pre-training, phase 1 (seq 128) and phase 2 (seq 512), with any optimizer of the package.

    python -m bert.train experiment=bert_phase1_slamb trainer.nproc_per_node=8
    python -m bert.train experiment=bert_phase2_slamb init_from=runs/bert_phase1_slamb/model
    torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m bert.train experiment=bert_phase1_slamb                          # multi-node

The global batch (``data.global_batch``, 65,536 in phase 1) is reached from
any number of workers by gradient accumulation over micro-batches of
``data.micro_batch`` sequences; gradients are communicated (by the
optimizer's DDP hook, if any) on the last micro-batch only. Under fp16 the
loss is scaled dynamically and overflowing steps are skipped by all ranks
together (:mod:`harness.amp`); ``clip_grad`` clips the unscaled
gradients' global norm before the optimizer step (null: no clipping).

Training is counted in optimizer steps. Every ``log_every`` steps a line goes
to ``metrics.jsonl`` (``epoch`` there is the step count, so that a resume
truncates it at the checkpoint): loss (MLM + NSP), MLM and NSP accuracy over
the period's micro-batches of all ranks, sequences/s, LR, loss scale, skipped
steps and the ledger's bytes. At the end rank 0 writes the model (parameters
averaged over ranks, as they differ between SLAMB's syncs) in Hugging Face
format to ``<run_dir>/model``, with the data's ``vocab.txt``: phase 2's
``init_from`` and SQuAD fine-tuning load it from there.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf

import slamb
import harness as ex
from slamb import comm
from harness.accumulate import accumulation_steps
from harness.amp import MixedPrecision, accumulation_context
from harness.schedules import build_lr_scheduler

from .data import IGNORE_INDEX, PretrainingStream, find_shards
from .model import build_model, load_pretrained, parameter_count

# per-period sums, kept on the device (no host sync per step)
LOSS, MLM_CORRECT, MLM_COUNT, NSP_CORRECT, NSP_COUNT, MICRO = range(6)


def initial_model(cfg) -> torch.nn.Module:
    """Phase 1: fresh weights from ``seed``; phase 2: the weights phase 1 saved (``init_from``)."""
    if cfg.get("init_from"):
        return load_pretrained(cfg.init_from, cfg.model)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    return build_model(cfg.model)


def batch_sums(out, batch: dict) -> torch.Tensor:
    """(loss, MLM correct, MLM count, NSP correct, NSP count, 1) of one micro-batch."""
    labels = batch["labels"]
    masked = labels != IGNORE_INDEX
    mlm_hits = (out.prediction_logits[masked].argmax(-1) == labels[masked]).sum()
    nsp = batch["next_sentence_label"]
    nsp_hits = (out.seq_relationship_logits.argmax(-1) == nsp).sum()
    return torch.stack([out.loss.detach().double(), mlm_hits.double(), masked.sum().double(), nsp_hits.double(),
                        torch.tensor(float(nsp.numel()), dtype=torch.float64, device=nsp.device),
                        torch.ones((), dtype=torch.float64, device=nsp.device)])


def period_metrics(sums: torch.Tensor) -> dict:
    """Loss and accuracies over all ranks from this rank's period sums."""
    totals = sums.clone()
    comm.all_reduce_sum_(totals, kind="eval", ledger=None)  # bookkeeping, not training traffic
    s = totals.tolist()
    return {"loss": s[LOSS] / max(s[MICRO], 1), "mlm_acc": 100.0 * s[MLM_CORRECT] / max(s[MLM_COUNT], 1),
            "nsp_acc": 100.0 * s[NSP_CORRECT] / max(s[NSP_COUNT], 1)}


@torch.no_grad()
def export_model(model, optimizer, env, out_dir: Path, vocab: Path | None) -> None:
    """Rank 0 saves the ranks' average model in Hugging Face format (with the vocabulary when known)."""
    model = ex.unwrap(model)
    if optimizer.params_differ and env.world_size > 1:
        for p in model.parameters():  # parameters differ by rank between model syncs
            comm.all_reduce_mean_(p.data, kind="export", ledger=None)
    if env.is_main:
        model.save_pretrained(str(out_dir))
        if vocab is not None and vocab.is_file():
            shutil.copyfile(vocab, out_dir / "vocab.txt")
    ex.barrier()


def data_vocab(data_dir) -> Path | None:
    """The vocabulary ``bert.prepare_data`` recorded for the shards (None for shards made elsewhere)."""
    stats = Path(data_dir) / "stats.json"
    return Path(json.loads(stats.read_text())["vocab"]) if stats.is_file() else None


def throughput(history: list[dict], global_batch: int) -> float:
    """Sequences/s over every logged period of the run (resumed attempts included)."""
    seconds = sum(h["period_steps"] * h["step_time_s"] for h in history)
    return sum(h["period_steps"] for h in history) * global_batch / seconds if seconds > 0 else math.nan


def check_settings(cfg) -> None:
    for key in ("steps", "log_every"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise ValueError(f"invalid {key}={cfg[key]!r}: must be an integer >= 1")
    every = cfg.trainer.checkpoint.every_steps
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"invalid trainer.checkpoint.every_steps={every!r}: must be an integer >= 1")


def train(cfg: dict, run_dir: str) -> dict:
    plain, cfg = cfg, OmegaConf.create(cfg)
    t, d = cfg.trainer, cfg.data
    check_settings(cfg)
    env = ex.init_distributed(t.device, t.threads_per_worker)
    accum = accumulation_steps(d.global_batch, d.micro_batch, env.world_size)
    stream = PretrainingStream(find_shards(d.dir, d.pattern), d.micro_batch, env.rank, env.world_size,
                               seed=cfg.seed, seq_len=d.seq_len)

    model = initial_model(cfg).to(env.device)
    optimizer = ex.build_optimizer(model, plain["optimizer"])
    model = slamb.wrap_model(model, optimizer)
    scheduler = build_lr_scheduler(optimizer, cfg.schedule, 1, cfg.steps)
    amp = MixedPrecision(t.precision, env.device, **cfg.loss_scale)
    params = [p for p in model.parameters() if p.requires_grad]
    ex.seed_everything(cfg.seed, env.rank, t.deterministic)

    ckpt, progress, restored, log = ex.open_run(run_dir, env, cfg, plain, model=model, optimizer=optimizer,
                                                scheduler=scheduler, amp=amp, start={"step": 0})
    step = start = progress["step"]
    resumed_from = progress["resumed_from"]
    if restored and env.is_main:
        print(f"resumed from {run_dir}/ckpt at step {start}", flush=True)
    if cfg.get("init_optimizer_from") and not restored:  # phase 2 continues phase 1's optimizer (DeepSpeed)
        at = ex.continue_optimizer(optimizer, cfg.init_optimizer_from, env)
        if env.is_main:
            print(f"optimizer continues from {cfg.init_optimizer_from} at its step {at}", flush=True)

    micro_batches = stream.micro_batches(start=start * accum)
    bytes_before = ex.comm_totals(optimizer)
    sums = torch.zeros(6, dtype=torch.float64, device=env.device)
    period_steps, skipped_before, train_time = 0, amp.skipped_steps, 0.0
    model.train()
    tic = time.perf_counter()
    for step in log.progress(range(start, cfg.steps), total=cfg.steps - start, desc=d.phase):
        ex.maybe_inject_fault(step + 1, env)
        optimizer.zero_grad(set_to_none=True)
        for m in range(accum):
            batch = {k: v.to(env.device, non_blocking=True) for k, v in next(micro_batches).items()}
            with accumulation_context(model, last_micro_batch=m == accum - 1):
                with amp.autocast():
                    out = model(**batch)
                amp.backward(out.loss / accum)
            sums += batch_sums(out, batch)
        amp.step(optimizer, params, clip_grad=cfg.clip_grad)
        scheduler.step()
        period_steps += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            if env.device.type != "cpu":
                torch.accelerator.synchronize()
            elapsed = time.perf_counter() - tic
            train_time += elapsed
            bytes_now = ex.comm_totals(optimizer)
            log.log({
                "epoch": step + 1, "step": step + 1, **period_metrics(sums),
                "lr": optimizer.param_groups[0]["lr"], "loss_scale": amp.scale,
                "skipped_steps": amp.skipped_steps - skipped_before,
                **ex.comm_metrics(bytes_now, bytes_before),
                "period_steps": period_steps, "step_time_s": elapsed / period_steps,
                "seqs_per_s": period_steps * d.global_batch / elapsed,
            })
            bytes_before, skipped_before, period_steps = bytes_now, amp.skipped_steps, 0
            sums.zero_()
            tic = time.perf_counter()
        if t.checkpoint.enabled and ((step + 1) % t.checkpoint.every_steps == 0 or step + 1 == cfg.steps):
            ex.save_training(ckpt, {"step": step + 1, "resumed_from": resumed_from}, model=model,
                             optimizer=optimizer, scheduler=scheduler, extra={"amp": amp.state_dict()})
    export_model(model, optimizer, env, Path(run_dir) / "model", data_vocab(d.dir))

    history = log.history() if env.is_main else []
    last = history[-1] if history else {}
    summary = {
        "name": cfg.name, "optimizer": cfg.optimizer.name, "phase": d.phase, "world_size": env.world_size,
        "global_batch": d.global_batch, "micro_batch": d.micro_batch, "accumulation_steps": accum,
        "seq_len": d.seq_len, "steps": cfg.steps, "params": parameter_count(ex.unwrap(model)),
        "precision": t.precision, "skipped_steps": amp.skipped_steps,
        "final_loss": last.get("loss", math.nan), "final_mlm_acc": last.get("mlm_acc", math.nan),
        "final_nsp_acc": last.get("nsp_acc", math.nan),
        "seqs_per_s": throughput(history, d.global_batch),
        "bytes_total": ex.comm_totals(optimizer), "train_time_s": train_time,  # this attempt's
        "init_from": cfg.get("init_from"), "resumed_from": resumed_from, "run_dir": str(run_dir),
        "model_dir": str(Path(run_dir) / "model"), "paper": plain.get("paper"),
    }
    log.finish(summary)
    return summary


@hydra.main(version_base="1.3", config_path="../configs", config_name="bert")
def main(cfg) -> dict:
    return ex.run_from_hydra(train, cfg)


if __name__ == "__main__":
    main()
