"""Train ResNet-110 on CIFAR-10 with any optimizer of the package.

    python -m cifar10.train experiment=cifar10/slamb              # 4 local workers
    python -m cifar10.train experiment=cifar10/lamb trainer.nproc_per_node=8
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m cifar10.train experiment=cifar10/slamb                 # multi-node
    python -m cifar10.train --multirun experiment=cifar10/slamb sweep=beta3

The run directory is Hydra's output directory (``runs/<name>/<overrides>``);
running the same command again resumes from its last checkpoint.

After each epoch the test set is scored by the run's model, the ranks'
average with its BatchNorm statistics averaged too (each rank's statistics
describe only its own shard); training continues from the local models.
Under SLAMB, whose ranks' parameters differ between model syncs, the local
models' scores are logged beside it (``test_top1_local``: each rank's own
model on its shard of the test set). At the end that average is the run's
model in ``<run_dir>/model``: ``model.pt`` (the state dict) and ``config.json``
(the ``model`` config), ``build_model(config)`` then ``load_state_dict(strict=True)``.
"""
from __future__ import annotations

import hydra
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import slamb
import harness
from harness.amp import MixedPrecision, accumulation_context
from harness.build import planned_world
from harness.data import check_micro_batch
from harness.schedules import build_lr_scheduler, check_lr_schedule

from .data import (augment, augment_draws, augment_generator, channel_stats, fingerprint, hold_out, load_cifar10,
                   normalize, train_samples, validation_identity)
from .model import build_model


@torch.no_grad()
def evaluate(model, x, y, env, batch_size: int, stats, split: str = "test") -> dict:
    """Mean loss and top-1 % over the whole evaluated split (``split``: its name in the keys), each rank scoring
    its strided shard."""
    model.eval()
    idx = harness.eval_shard(len(x), env).to(env.device)
    sums = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss sum, correct, count
    for lo in range(0, len(idx), batch_size):
        b = idx[lo:lo + batch_size]
        logits = model(normalize(x[b], stats)).float()
        sums += torch.stack([F.cross_entropy(logits, y[b], reduction="sum"), (logits.argmax(1) == y[b]).sum(),
                             torch.full((), float(len(b)), device=logits.device)]).double()
    loss, correct, count = harness.rank_sums(sums)
    return {f"{split}_loss": loss / count, f"{split}_top1": 100.0 * correct / count}


def check(cfg: dict) -> None:
    """This pipeline's settings, before any worker starts (:func:`harness.build.check_settings`): the model
    (built on the meta device: no memory, no time), the schedule, and a micro-batch the training set fills for
    every worker."""
    with torch.device("meta"):
        build_model(cfg["model"])
    check_lr_schedule(cfg["schedule"], cfg["epochs"])
    samples = train_samples(cfg["data"]["dir"])
    if samples is not None:  # else the workers' load names what is missing
        # a validation split held out of the training images leaves the rest to train on
        samples -= cfg["data"].get("valid_images") or 0
        check_micro_batch(samples, cfg["data"]["micro_batch"], planned_world(cfg["trainer"]))


def inputs(cfg: dict) -> dict:
    """What the run reads, by content (:mod:`harness.identity`): the data, and its validation split if any."""
    found = {"data.dir": fingerprint(cfg["data"]["dir"])}
    d = cfg["data"]
    if d.get("valid_images") is not None:
        found["data.valid_images"] = validation_identity(found["data.dir"], d["valid_images"], d["valid_seed"])
    return found


def splits(cfg, device) -> tuple[tuple, tuple, str]:
    """(training images and labels, evaluated images and labels, the evaluated split's metric prefix): the test
    split, or with ``data.valid_images`` the validation split held out of the training split, and then the test
    split is never read."""
    valid_images = cfg.data.get("valid_images")
    data = load_cifar10(cfg.data.dir, test=valid_images is None)
    train, scored, prefix = data["train"], data.get("test"), "test"
    if valid_images is not None:
        keep, valid = hold_out(len(train[1]), valid_images, cfg.data.get("valid_seed", 0))
        train, scored, prefix = (train[0][keep], train[1][keep]), (train[0][valid], train[1][valid]), "valid"
    return tuple(v.to(device) for v in train), tuple(v.to(device) for v in scored), prefix


def train(cfg: dict, run_dir: str) -> dict:
    plain, cfg = cfg, OmegaConf.create(cfg)
    t, d = cfg.trainer, cfg.data
    harness.check_counts(cfg, "epochs")
    env = harness.init_distributed(t.device, t.threads_per_worker, t.timeout_s, tf32=t.tf32, cudnn_benchmark=t.cudnn_benchmark)

    (train_x, train_y), (test_x, test_y), split = splits(cfg, env.device)
    # each step's micro-batches are those of the run's first workers, however many workers resume it: fewer
    # take several each, so BatchNorm still normalizes over the same images and the global batch stays
    batches = harness.ShardedBatches(len(train_x), d.micro_batch, env, seed=cfg.seed,
                                     micro_batches=harness.step_micro_batches(run_dir, t.resume, env.world_size))
    steps_per_epoch = len(batches)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(cfg.model).to(env.device)
    optimizer = harness.build_optimizer(model, plain["optimizer"])
    params = [p for p in model.parameters() if p.requires_grad]
    amp = MixedPrecision(t.precision, env.device, optimizer=optimizer)
    model = slamb.wrap_model(model, optimizer, forward_sync_buffers=False)  # BN statistics stay per rank
    scheduler = build_lr_scheduler(optimizer, cfg.schedule, steps_per_epoch, steps_per_epoch * cfg.epochs)
    harness.seed_everything(cfg.seed, env.rank, t.deterministic)
    run = harness.Loop(run_dir, env, cfg, plain, model=model, optimizer=optimizer, scheduler=scheduler, amp=amp,
                       global_batch=d.micro_batch * batches.micro_batches, throughput="images",
                       micro_batches=batches.micro_batches, steps_per_epoch=steps_per_epoch)

    stats = channel_stats(env.device)
    for epoch in run.epochs():
        optimizer.begin_epoch(epoch)  # DGC's density and SLAMB's compression warm-ups
        model.train()
        # the epoch's batch indices and augmentation draws reach the device at once: a copy from the host
        # inside the loop would make the host wait for the device every step
        order = torch.stack(list(batches.epoch(epoch))).to(env.device)  # steps x micro-batches x images
        accum = len(batches.shards)
        if d.augment:  # drawn per micro-batch, as the worker that took it first drew them
            draws = torch.stack([
                torch.stack([augment_draws(d.micro_batch, augment_generator(cfg.seed, s, run.step + i))
                             for s in batches.shards])
                for i in range(steps_per_epoch)]).to(env.device)
        # loss sum, correct, images: no host sync per step
        sums = torch.zeros(3, dtype=torch.float64, device=env.device)
        for i in run.steps(range(steps_per_epoch), total=steps_per_epoch, desc=f"epoch {epoch + 1}", totals=sums):
            optimizer.begin_step()  # JointSpar: draw this round's layers, freeze the others
            optimizer.zero_grad(set_to_none=True)
            for j in range(accum):
                idx = order[i, j]
                x = train_x[idx]
                x = normalize(augment(x, draws[i, j]) if d.augment else x, stats)
                y = train_y[idx]
                with accumulation_context(model, last_micro_batch=j == accum - 1):
                    with amp.autocast():
                        logits = model(x)
                    loss = F.cross_entropy(logits.float(), y)
                    if loss.requires_grad:  # False only in a JointSpar round that sampled no layer
                        amp.backward(loss / accum)
                sums += torch.stack([loss.detach().double() * len(y), (logits.argmax(1) == y).sum().double(),
                                     torch.full((), float(len(y)), dtype=torch.float64, device=env.device)])
            run.optimizer_step(params)  # with fp16, every rank steps or every rank skips
            scheduler.step()
        loss_sum, correct, seen = harness.rank_sums(sums)
        metrics = run.evaluate(lambda: evaluate(model, test_x, test_y, run.eval_env, d.eval_batch, stats, split))
        seen = max(seen, 1)  # a torchft group that joined after the epoch's steps took none (another writes its line)
        run.end_epoch(epoch, {"train_loss": loss_sum / seen, "train_top1": 100.0 * correct / seen, **metrics},
                      steps=steps_per_epoch)

    model_dir = run.export(harness.save_state_dict(plain["model"]))
    final = {f"final_{split}_top1": run.last(f"{split}_top1"), f"final_{split}_loss": run.last(f"{split}_loss"),
             f"best_{split}_top1": run.best(f"{split}_top1")}
    return run.finish(headline=(f"final_{split}_top1", f"final_{split}_loss"), **final, model_dir=model_dir)


# how this pipeline is checked and launched: its main, and a script's checks of every run before the first
# (harness.preflight)
LAUNCH = {"check": check, "fault_tolerant": True}


@hydra.main(version_base="1.3", config_path="../configs", config_name="cifar10")
def main(cfg) -> dict:
    return harness.run_from_hydra("cifar10.train:train", cfg, inputs=inputs, **LAUNCH)


if __name__ == "__main__":
    harness.command(main)
