"""Train ResNet-110 on CIFAR-10 with any optimizer of the package.

    python -m cifar10.train experiment=cifar10/slamb                         # 4 local workers
    python -m cifar10.train experiment=cifar10/lamb trainer.nproc_per_node=8
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m cifar10.train experiment=cifar10/slamb                            # multi-node
    python -m cifar10.train --multirun experiment=cifar10/slamb sweep=beta3

The run directory is Hydra's output directory (``runs/<name>/<overrides>``);
running the same command again resumes from its last checkpoint.

Evaluation runs each rank's own model on its shard of the test set (no
extra communication): under SLAMB the ranks' parameters differ between model
syncs, so the reported top-1 is that of the workers' models, not of their average.
"""
from __future__ import annotations

import math
import time

import hydra
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import slamb
import harness as ex
from slamb import comm
from harness.amp import MixedPrecision
from harness.schedules import build_lr_scheduler

from .data import augment, augment_generator, load_cifar10, normalize
from .model import build_model


@torch.no_grad()
def evaluate(model, x, y, env, batch_size: int) -> tuple[float, float]:
    """(mean loss, top-1 %) over the whole test set, each rank scoring its strided shard."""
    model.eval()
    idx = ex.eval_shard(len(x), env)
    sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, correct
    for lo in range(0, len(idx), batch_size):
        b = idx[lo:lo + batch_size]
        logits = model(normalize(x[b])).float()
        sums += torch.stack([F.cross_entropy(logits, y[b], reduction="sum"), (logits.argmax(1) == y[b]).sum()]).double()
    return global_means(sums, len(idx))


def global_means(sums: torch.Tensor, count: int) -> tuple[float, float]:
    """(loss, top-1 %) over all ranks from this rank's (loss sum, correct) and sample count."""
    totals = torch.cat([sums, sums.new_tensor([count])])
    comm.all_reduce_sum_(totals, kind="eval", ledger=None)  # bookkeeping, not training traffic
    loss, correct, count = totals.tolist()
    return loss / count, 100.0 * correct / count


def train(cfg: dict, run_dir: str) -> dict:
    plain, cfg = cfg, OmegaConf.create(cfg)
    t, d = cfg.trainer, cfg.data
    env = ex.init_distributed(t.device, t.threads_per_worker)

    data = load_cifar10(d.dir)
    train_x, train_y = (v.to(env.device) for v in data["train"])
    test_x, test_y = (v.to(env.device) for v in data["test"])
    batches = ex.ShardedBatches(len(train_x), d.micro_batch, env, seed=cfg.seed)
    steps_per_epoch = len(batches)
    global_batch = d.micro_batch * env.world_size

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(cfg.model).to(env.device)
    optimizer = ex.build_optimizer(model, plain["optimizer"])
    params = [p for p in model.parameters() if p.requires_grad]
    amp = MixedPrecision(t.precision, env.device)
    model = slamb.wrap_model(model, optimizer, forward_sync_buffers=False)  # BN statistics stay per rank
    scheduler = build_lr_scheduler(optimizer, cfg.schedule, steps_per_epoch, steps_per_epoch * cfg.epochs)
    ex.seed_everything(cfg.seed, env.rank, t.deterministic)

    ckpt, progress, restored, log = ex.open_run(run_dir, env, cfg, plain, model=model, optimizer=optimizer,
                                                scheduler=scheduler, amp=amp, start={"epoch": 0, "step": 0})
    start_epoch, step, resumed_from = progress["epoch"], progress["step"], progress["resumed_from"]
    if restored and env.is_main:
        print(f"resumed from {run_dir}/ckpt at epoch {start_epoch} (step {step})", flush=True)

    bytes_before = ex.comm_totals(optimizer)
    for epoch in range(start_epoch, cfg.epochs):
        optimizer.begin_epoch(epoch)  # DGC's density and SLAMB's compression warm-ups
        model.train()
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, correct: no host sync per step
        tic = time.perf_counter()
        for idx in log.progress(batches.epoch(epoch), total=steps_per_epoch, desc=f"epoch {epoch + 1}"):
            ex.maybe_inject_fault(step + 1, env)
            x = train_x[idx]
            x = normalize(augment(x, augment_generator(cfg.seed, env.rank, step)) if d.augment else x)
            y = train_y[idx]
            optimizer.begin_step()  # JointSpar: draw this round's layers, freeze the others
            with amp.autocast():
                logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            if loss.requires_grad:  # False only in a JointSpar round that sampled no layer
                amp.backward(loss)
            amp.step(optimizer, params)  # with fp16, every rank steps or every rank skips
            scheduler.step()
            step += 1
            sums += torch.stack([loss.detach().double() * len(y), (logits.argmax(1) == y).sum().double()])
        if env.device.type != "cpu":
            torch.accelerator.synchronize()
        train_time = time.perf_counter() - tic
        train_loss, train_top1 = global_means(sums, steps_per_epoch * d.micro_batch)
        test_loss, test_top1 = evaluate(model, test_x, test_y, env, d.eval_batch)
        bytes_now = ex.comm_totals(optimizer)
        log.log({
            "epoch": epoch + 1, "step": step,
            "train_loss": train_loss, "train_top1": train_top1,
            "test_loss": test_loss, "test_top1": test_top1,
            "lr": optimizer.param_groups[0]["lr"], "compress_ratio": getattr(optimizer, "compress_ratio", None),
            **ex.comm_metrics(bytes_now, bytes_before),
            "step_time_s": train_time / steps_per_epoch, "images_per_s": steps_per_epoch * global_batch / train_time,
            "epoch_time_s": time.perf_counter() - tic,
        })
        bytes_before = bytes_now
        if t.checkpoint.enabled and ((epoch + 1) % t.checkpoint.every == 0 or epoch + 1 == cfg.epochs):
            ex.save_training(ckpt, {"epoch": epoch + 1, "step": step, "resumed_from": resumed_from},
                             model=model, optimizer=optimizer, scheduler=scheduler, extra={"amp": amp.state_dict()})

    history = log.history() if env.is_main else []
    summary = {
        "name": cfg.name, "optimizer": cfg.optimizer.name, "world_size": env.world_size,
        "global_batch": global_batch, "epochs": cfg.epochs, "steps": step,
        "params": sum(p.numel() for p in model.parameters()),
        "compressed_share": ex.compressed_share(optimizer, model),
        "final_test_top1": history[-1]["test_top1"] if history else math.nan,
        "best_test_top1": max((h["test_top1"] for h in history), default=math.nan),
        "bytes_total": ex.comm_totals(optimizer),
        "wall_time_s": sum(h["epoch_time_s"] for h in history),
        "resumed_from": resumed_from, "run_dir": str(run_dir), "paper": plain.get("paper"),
    }
    log.finish(summary)
    return summary


@hydra.main(version_base="1.3", config_path="../configs", config_name="cifar10")
def main(cfg) -> dict:
    return ex.run_from_hydra("cifar10.train:train", cfg)


if __name__ == "__main__":
    main()
