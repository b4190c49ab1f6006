"""Train Swin on ImageNet (timm model and data pipeline) with any optimizer of the package.

    python -m swin.train experiment=swin_b/slamb data.dir=/data/imagenet trainer.nproc_per_node=8
    torchrun --nnodes 16 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m swin.train experiment=swin_b/slamb data.dir=/data/imagenet        # multi-node
    scripts/swin_b_imagenet.sh 8 -- data.dir=/data/imagenet                  # the paper's rows

The peak LR is ``optimizer.lr x global batch / lr_scaling.reference_batch``
(global batch = workers x data.micro_batch x accumulation_steps at the run's first start; the paper's
rows fix ``data.global_batch``, 16,384, and the accumulation follows from the workers; a
run resumed on fewer workers accumulates more micro-batches each, :mod:`swin.data`),
reached after ``schedule.warmup_epochs`` and decayed per step by a cosine.
Mixed precision: ``trainer.precision`` fp32 | bf16 | fp16 (loss scaling with
a skip decision agreed by all ranks, :mod:`harness.amp`).

Per epoch the run directory's metrics hold the training loss, validation
top-1/top-5 of the run's model (the ranks' average; under SLAMB, whose ranks'
parameters differ between model syncs, the local models' scores beside it as
``test_top1_local`` ...), images/s per worker and in total, and the
step time split into data wait, forward+backward (under DDP it includes the
gradient all-reduce that overlaps backward) and the optimizer step (which
includes the collectives of optimizers that communicate themselves, SLAMB's
momentum exchange and model syncs), the latter measured with a device sync
at each boundary when ``time_breakdown`` is true. At the end the run's model,
the ranks' average as evaluated, goes to ``<run_dir>/model``: ``model.pt``
(the timm model's state dict, whole under FSDP/HSDP) and ``config.json`` (the
``model`` config: ``swin.model.build_model(config)``, i.e. ``timm.create_model``,
then ``load_state_dict(strict=True)``).
"""
from __future__ import annotations

import time

import hydra
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import harness
from harness.accumulate import accumulation_steps
from harness.amp import MixedPrecision, accumulation_context, check_clip_grad
from harness.build import planned_world
from harness.data import check_micro_batch
from harness.schedules import build_lr_scheduler, check_lr_schedule
from harness.seeding import reseed
from harness.settings import check_count



def forward_backward(model, micro_batches, criterion, amp: MixedPrecision, mixup=None, draws=None) -> torch.Tensor:
    """Gradients of one optimizer step from its micro-batches (``no_sync`` on all but the last);
    returns the step's mean loss (a 0-d tensor, no host sync). ``draws(i)``, where given, seeds what micro-batch
    ``i`` draws (mixup's, stochastic depth's)."""
    total = None
    for i, (x, y) in enumerate(micro_batches):
        if draws is not None:
            draws(i)
        if mixup is not None:
            x, y = mixup(x, y)
        with accumulation_context(model, last_micro_batch=i == len(micro_batches) - 1):
            with amp.autocast():
                logits = model(x)
            loss = criterion(logits.float(), y) / len(micro_batches)
            if loss.requires_grad:  # False only in a JointSpar round that sampled no layer
                amp.backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    return total


@torch.no_grad()
def evaluate(model, loader, env, amp: MixedPrecision) -> dict:
    """Mean loss, top-1 % and top-5 % over the whole validation set, each rank scoring its shard."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=env.device)  # loss sum, top-1, top-5, count
    for x, y in loader:
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        with amp.autocast():
            logits = model(x).float()
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices == y[:, None]
        sums += torch.stack([F.cross_entropy(logits, y, reduction="sum"), top[:, 0].sum(), top.any(1).sum(),
                             torch.tensor(len(y), device=env.device)]).double()
    loss, top1, top5, count = harness.rank_sums(sums)
    return {"test_loss": loss / count, "test_top1": 100.0 * top1 / count, "test_top5": 100.0 * top5 / count}


class PhaseTimer:
    """Seconds spent in each phase of the steps; ``sync`` waits for the device at each boundary so
    that asynchronous kernels are charged to the phase that launched them."""

    def __init__(self, device: torch.device, sync: bool):
        self.sync = sync and device.type != "cpu"
        self.totals: dict[str, float] = {}
        self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.sync:
            torch.accelerator.synchronize()
        now = time.perf_counter()
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.last
        self.last = now


def accumulation(cfg: dict, world_size: int) -> int:
    """Micro-batches per worker and optimizer step: ``data.global_batch / (workers x data.micro_batch)`` where
    the run fixes its global batch (the paper's rows: on any number of GPUs), else ``accumulation_steps``
    (null: 1). Both set must agree."""
    steps, d = cfg["accumulation_steps"], cfg["data"]
    if steps is not None:
        check_count("accumulation_steps", steps, " (micro-batches per optimizer step)")
    if d.get("global_batch") is None:
        return 1 if steps is None else steps
    derived = accumulation_steps(d["global_batch"], d["micro_batch"], world_size)
    if steps not in (None, derived):
        raise ValueError(f"invalid accumulation_steps={steps}: data.global_batch={d['global_batch']} takes {derived} "
                         f"micro-batches of data.micro_batch={d['micro_batch']} on {world_size} workers; leave "
                         "accumulation_steps=null, or set data.global_batch=null to fix the accumulation instead")
    return derived


def check(cfg: dict) -> None:
    """This pipeline's settings and data, before any worker starts (:func:`harness.build.check_settings`): the
    accumulation, the LR's reference batch, clipping, the schedule, the model (timm's, built on the meta device),
    mixup, the ImageFolder's classes, and a micro-batch its training images fill for every worker."""
    from .data import check_classes, mixup_and_loss, train_images
    from .model import build_model

    world = planned_world(cfg["trainer"])
    steps = accumulation(cfg, world)
    check_count("lr_scaling.reference_batch", cfg["lr_scaling"]["reference_batch"], " (the global batch of "
                "optimizer.lr)")
    check_clip_grad(cfg["clip_grad"])
    check_lr_schedule(cfg["schedule"], cfg["epochs"])
    with torch.device("meta"):
        build_model(cfg["model"])
    mixup_and_loss(cfg["data"], cfg["model"]["num_classes"])
    check_classes(cfg["data"]["dir"], cfg["model"]["num_classes"])
    micro_batches = world * steps
    check_micro_batch(train_images(cfg["data"]["dir"], micro_batches * cfg["data"]["micro_batch"]),
                      cfg["data"]["micro_batch"], micro_batches)


def inputs(cfg: dict) -> dict:
    """What the run reads, by content (:mod:`harness.identity`)."""
    from .data import fingerprint

    return {"data.dir": fingerprint(cfg["data"]["dir"])}


def train(cfg: dict, run_dir: str) -> dict:
    # timm (and the wandb it imports) here, in the workers: 1-3 s that a command refused by its settings
    # check, before any worker starts, would otherwise spend
    from .data import build_loaders, micro_batches_from, mixup_and_loss
    from .model import build_model, image_size, shard_blocks

    plain, cfg = cfg, OmegaConf.create(cfg)
    t, d = cfg.trainer, cfg.data
    harness.check_counts(cfg, "epochs")
    env = harness.init_distributed(t.device, t.threads_per_worker, t.timeout_s, tf32=t.tf32, cudnn_benchmark=t.cudnn_benchmark)
    accum = accumulation(plain, env.world_size)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(plain["model"]).to(env.device)
    num_classes = cfg.model.num_classes
    # each step's micro-batches are those of the run's first workers (accumulation_steps each), however many
    # workers resume it: fewer take more each, so the global batch and its images stay
    micro_batches = harness.step_micro_batches(run_dir, t.resume, env.world_size, per_worker=accum)
    train_loader, sampler, val_loader = build_loaders(d, image_size(model), num_classes, env, seed=cfg.seed,
                                                      micro_batches=micro_batches,
                                                      eval_env=harness.evaluation_env(env))
    accum = len(sampler.shards)  # this worker's micro-batches of each step
    mixup, criterion = mixup_and_loss(d, num_classes)
    steps_per_epoch = len(sampler.batches)
    global_batch = d.micro_batch * micro_batches
    ocfg = dict(plain["optimizer"])
    ocfg["lr"] = ocfg["lr"] * global_batch / cfg.lr_scaling.reference_batch  # the linear scaling rule
    # Swin's buffers (relative position indices, attention masks) are constants: no per-forward broadcast
    model, optimizer = harness.distribute(model, t, env, blocks=shard_blocks(),
                                          build_optimizer=lambda m: harness.build_optimizer(m, ocfg),
                                          forward_sync_buffers=False)
    amp = MixedPrecision(t.precision, env.device, optimizer=optimizer)  # an overlapping SLAMB needs the loss scale
    params = [p for p in model.parameters() if p.requires_grad]
    scheduler = build_lr_scheduler(optimizer, cfg.schedule, steps_per_epoch, steps_per_epoch * cfg.epochs)
    harness.seed_everything(cfg.seed, env.rank, t.deterministic)
    run = harness.Loop(run_dir, env, cfg, plain, model=model, optimizer=optimizer, scheduler=scheduler, amp=amp,
                       global_batch=global_batch, throughput="images", micro_batches=micro_batches,
                       steps_per_epoch=steps_per_epoch)

    # each step's micro-batches by the run's step: a torchft step taken again, or a group that joins, reads its own
    batches = harness.StepReader(lambda step: micro_batches_from(train_loader, sampler, step), accum)
    for epoch in run.epochs():
        optimizer.begin_epoch(epoch)  # DGC's density and SLAMB's compression warm-ups
        model.train()
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum over steps, steps
        timer = PhaseTimer(env.device, cfg.time_breakdown)
        for _ in run.steps(range(steps_per_epoch), total=steps_per_epoch, desc=f"epoch {epoch + 1}", totals=sums):
            micro = [tuple(v.to(env.device, non_blocking=True) for v in batch) for batch in batches(run.step)]
            timer.mark("data")
            optimizer.begin_step()  # JointSpar: draw this round's layers, freeze the others
            optimizer.zero_grad(set_to_none=True)
            # mixup's and stochastic depth's draws from (seed, step, the micro-batch's place in the step), not
            # from this worker's streams
            loss = forward_backward(model, micro, criterion, amp, mixup, draws=lambda j: reseed(
                cfg.seed, run.step, sampler.shards[j]))
            sums += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=env.device)])
            timer.mark("forward_backward")
            run.optimizer_step(params, clip_grad=cfg.clip_grad)
            scheduler.step()
            timer.mark("optimizer")
        loss_sum, steps = harness.rank_sums(sums)
        metrics = run.evaluate(lambda: evaluate(model, val_loader, run.eval_env, amp))
        run.end_epoch(epoch, {"train_loss": loss_sum / max(steps, 1), **metrics,
                              **{f"{phase}_time_s": s / steps_per_epoch for phase, s in timer.totals.items()}},
                      steps=steps_per_epoch)
    batches.close()

    model_dir = run.export(harness.save_state_dict(plain["model"]))
    return run.finish(headline=("final_test_top1", "final_test_top5"), model_dir=model_dir,
                      accumulation_steps=accum, precision=t.precision, peak_lr=scheduler.base_lrs[0],
                      final_test_top1=run.last("test_top1"), final_test_top5=run.last("test_top5"),
                      best_test_top1=run.best("test_top1"))


# how this pipeline is checked and launched: its main, and a script's checks of every run before the first
# (harness.preflight)
LAUNCH = {"shards": True, "check": check, "fault_tolerant": True}


@hydra.main(version_base="1.3", config_path="../configs", config_name="swin")
def main(cfg) -> dict:
    return harness.run_from_hydra("swin.train:train", cfg, inputs=inputs, **LAUNCH)


if __name__ == "__main__":
    harness.command(main)
