"""ImageNet in the ImageFolder layout through timm's own data pipeline (Swin's recipe).

Layout under ``data.dir``::

    train/<class>/*.JPEG     val/<class>/*.JPEG     (the same class folders in both)

Training images go through timm's ``create_transform`` (random resized crop,
flip, RandAugment ``rand-m9-mstd0.5-inc1``, colour jitter 0.4, bicubic,
random erasing 0.25) and each batch through timm's ``Mixup`` (mixup 0.8,
cutmix 1.0, label smoothing 0.1) with its soft-target cross-entropy.

Each step takes the same images whatever the number of workers: its micro-batches
(workers x ``accumulation_steps`` at the run's first start) are the blocks of
:class:`harness.ShardedBatches`, each worker loading an equal run of them
(:class:`MicroBatches`), and an image's augmentation draws come from (seed,
epoch, image) (:class:`KeyedAugmentation`), not from the worker that loads it,
so a run resumes on any divisor of its micro-batches. Validation: resize to
1/0.875 and centre crop, each rank scoring a strided shard (no padding, exact
counts).

A run records what ``data.dir`` holds (:func:`fingerprint`): its classes, its images per split and a digest of
their names and sizes, listed, never read. ImageNet publishes no digest of this layout, so ImageNet-1k is named
by its counts: 1,000 classes, 1,281,167 training and 50,000 validation images.
"""
from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import numpy as np
import torch
from timm.data import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    ImageDataset,
    Mixup,
    create_transform,
)
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch.utils.data import DataLoader, Dataset, Subset

from harness import DistEnv, ShardedBatches, eval_shard, identity
from harness.seeding import reseed

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
SPLITS = ("train", "val")
IMAGENET_1K = {"classes": 1000, "train": 1_281_167, "val": 50_000}  # ILSVRC2012's train and val sets


def check_layout(root) -> list[str]:
    """The class names (sorted) of an ImageFolder tree; ``FileNotFoundError`` saying what is wrong."""
    root = Path(root)
    how = ("expected the ImageFolder layout train/<class>/*.JPEG and val/<class>/*.JPEG under data.dir "
           "(ImageNet: the ILSVRC2012 train and val archives, val images moved into class folders, e.g. with "
           "the valprep.sh script); set data.dir=/path/to/imagenet")
    classes = {}
    for split in SPLITS:
        folder = root / split
        if not folder.is_dir():
            raise FileNotFoundError(f"missing {folder}: {how}")
        names = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if not names:
            raise FileNotFoundError(f"{folder} has no class folders: {how}")
        empty = [n for n in names if not any(f.suffix.lower() in IMAGE_SUFFIXES for f in (folder / n).iterdir())]
        if empty:
            raise FileNotFoundError(f"{folder} has class folders without images ({', '.join(empty[:5])}"
                                    f"{' ...' if len(empty) > 5 else ''}): {how}")
        classes[split] = names
    if classes["train"] != classes["val"]:
        only = sorted(set(classes["train"]) ^ set(classes["val"]))
        raise FileNotFoundError(f"train/ and val/ under {root} hold different class folders "
                                f"({', '.join(only[:5])}{' ...' if len(only) > 5 else ''}): {how}")
    return classes["train"]


def fingerprint(root) -> dict:
    """What the ImageFolder tree at ``root`` holds (:mod:`harness.identity`): classes, images per split, a
    digest of every image's path and size; ImageNet-1k where its counts are ILSVRC2012's."""
    root = Path(root)
    check_layout(root)
    folders = [root / split / c for split in SPLITS for c in sorted(os.listdir(root / split))
               if (root / split / c).is_dir()]

    def make() -> dict:
        h, counts = hashlib.sha256(), {"classes": len(os.listdir(root / "train"))}
        for folder in folders:
            split = folder.parent.name
            with os.scandir(folder) as entries:
                images = sorted((e.name, e.stat().st_size) for e in entries
                                if e.is_file() and Path(e.name).suffix.lower() in IMAGE_SUFFIXES)
            counts[split] = counts.get(split, 0) + len(images)
            for name, size in images:
                h.update(f"{split}/{folder.name}/{name}\0{size}\n".encode())
        dataset = "ImageNet-1k" if counts == IMAGENET_1K else None
        size = (f"{identity.count(counts['classes'], 'class')}; {counts['train']:,} training / {counts['val']:,} "
                "validation images")
        name = (f"ImageNet-1k ({size}: ILSVRC2012's counts)" if dataset else
                f"an ImageFolder tree ({size}), not ImageNet-1k")
        return {"layout": "image-folder", "dataset": dataset, "name": name, "digest": h.hexdigest(), "counts": counts}

    return identity.kept(root, "imagefolder", [root / split for split in SPLITS] + folders, make)


def train_images(root, enough: int) -> int:
    """The images of the ImageFolder tree's ``train/`` under ``root``, counted up to ``enough`` (ImageNet's 1.28
    million files need not be listed to their end to know that a step's micro-batches fill)."""
    count = 0
    for folder in sorted(p for p in (Path(root) / "train").iterdir() if p.is_dir()):
        count += sum(1 for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if count >= enough:
            break
    return count


def transforms(dcfg, img_size: int):
    """(train, val) transforms of timm for the ``data.aug`` settings."""
    aug = dcfg["aug"]
    train = create_transform(img_size, is_training=True, auto_augment=aug["auto_augment"],
                             color_jitter=aug["color_jitter"], interpolation=aug["interpolation"],
                             re_prob=aug["re_prob"], re_mode=aug["re_mode"], re_count=aug["re_count"],
                             mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
    val = create_transform(img_size, is_training=False, interpolation=aug["interpolation"],
                           crop_pct=aug["crop_pct"], mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
    return train, val


def check_classes(root, num_classes: int) -> None:
    """The ImageFolder layout under ``root`` (:func:`check_layout`), with ``num_classes`` classes."""
    classes = check_layout(root)
    if len(classes) != num_classes:
        raise ValueError(f"data.dir={root} has {len(classes)} classes but model.num_classes={num_classes}: "
                         f"set model.num_classes={len(classes)}")


class KeyedAugmentation(Dataset):
    """``dataset`` (whose transform draws at random) indexed by ``(epoch, i)``: image ``i`` under the draws of
    the stream (``seed``, ``epoch``, ``i``), whichever process or loader worker reads it. The draws come from
    the generators the transforms use (python's, numpy's, torch's on the CPU), put back as they were after."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, i = key
        python, numpy = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            reseed(self.seed, epoch, i)
            item = self.dataset[i]
        random.setstate(python)
        np.random.set_state(numpy)
        return item


class MicroBatches:
    """The batch sampler of this rank's micro-batches of an epoch (:meth:`set_epoch`), step by step: the
    :attr:`shards` of each step's ``micro_batches`` (:class:`harness.ShardedBatches`) that it takes, as
    :class:`KeyedAugmentation` keys."""

    def __init__(self, batches: ShardedBatches):
        self.batches, self.epoch, self.start = batches, 0, 0
        self.shards = batches.shards

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch the next iteration reads, from its step ``start``."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return (len(self.batches) - self.start) * len(self.shards)

    def __iter__(self):
        for step in self.batches.epoch(self.epoch, self.start):
            for micro in step.tolist():
                yield [(self.epoch, i) for i in micro]


def micro_batches_from(loader: DataLoader, sampler: MicroBatches, step: int):
    """The loader's micro-batches from the run's step ``step`` on, epoch after epoch (:class:`harness.StepReader`
    opens it where a run starts, or a torchft group joins)."""
    epoch, start = divmod(step, len(sampler.batches))
    while True:
        sampler.set_epoch(epoch, start)
        yield from loader
        epoch, start = epoch + 1, 0


def build_loaders(dcfg, img_size: int, num_classes: int, env: DistEnv, *, seed: int,
                  micro_batches: int | None = None, eval_env: DistEnv | None = None):
    """(train loader, its :class:`MicroBatches`, val loader) of this rank; each step in ``micro_batches``
    micro-batches over all workers (default: one per worker); the val loader holds ``eval_env``'s shard (default:
    ``env``'s)."""
    root = Path(dcfg["dir"])
    check_classes(root, num_classes)
    train_tf, val_tf = transforms(dcfg, img_size)
    train_set = ImageDataset(str(root / "train"), transform=train_tf)
    val_set = ImageDataset(str(root / "val"), transform=val_tf)
    sampler = MicroBatches(ShardedBatches(len(train_set), dcfg["micro_batch"], env, seed=seed,
                                          micro_batches=micro_batches))
    common = {"num_workers": dcfg["workers"], "pin_memory": dcfg["pin_memory"] and env.device.type != "cpu",
              "persistent_workers": dcfg["workers"] > 0}
    train = DataLoader(KeyedAugmentation(train_set, seed), batch_sampler=sampler, **common)
    val = DataLoader(Subset(val_set, eval_shard(len(val_set), eval_env or env).tolist()), batch_size=dcfg["eval_batch"],
                     shuffle=False, **common)
    return train, sampler, val


def mixup_and_loss(dcfg, num_classes: int):
    """(timm ``Mixup`` or None, training loss) for the ``data.mixup`` settings."""
    m = dcfg["mixup"]
    if m["mixup_alpha"] > 0 or m["cutmix_alpha"] > 0:
        if dcfg["micro_batch"] % 2:
            raise ValueError(f"data.micro_batch={dcfg['micro_batch']} must be even with "
                             "mixup/cutmix (timm mixes each batch with its flip)")
        mixup = Mixup(mixup_alpha=m["mixup_alpha"], cutmix_alpha=m["cutmix_alpha"], prob=m["prob"],
                      switch_prob=m["switch_prob"], mode=m["mode"], label_smoothing=m["label_smoothing"],
                      num_classes=num_classes)
        return mixup, SoftTargetCrossEntropy()
    if m["label_smoothing"] > 0:
        return None, LabelSmoothingCrossEntropy(m["label_smoothing"])
    return None, torch.nn.CrossEntropyLoss()
