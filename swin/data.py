"""ImageNet in the ImageFolder layout through timm's own data pipeline (Swin's recipe).

Layout under ``data.dir``::

    train/<class>/*.JPEG     val/<class>/*.JPEG     (the same class folders in both)

Training images go through timm's ``create_transform`` (random resized crop,
flip, RandAugment ``rand-m9-mstd0.5-inc1``, colour jitter 0.4, bicubic,
random erasing 0.25) and each batch through timm's ``Mixup`` (mixup 0.8,
cutmix 1.0, label smoothing 0.1) with its soft-target cross-entropy; each
rank reads its shard through a ``DistributedSampler`` (``drop_last``: every
rank runs the same number of steps). Validation: resize to 1/0.875 and
centre crop, each rank scoring a strided shard (no padding, exact counts).
"""
from __future__ import annotations

from pathlib import Path

import torch
from timm.data import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    ImageDataset,
    Mixup,
    create_transform,
)
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch.utils.data import DataLoader, DistributedSampler, Subset

from harness import DistEnv, eval_shard

IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
SPLITS = ("train", "val")


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


def build_loaders(dcfg, img_size: int, num_classes: int, env: DistEnv, *, seed: int):
    """(train loader, its sampler, val loader) of this rank."""
    root = Path(dcfg["dir"])
    check_classes(root, num_classes)
    train_tf, val_tf = transforms(dcfg, img_size)
    train_set = ImageDataset(str(root / "train"), transform=train_tf)
    val_set = ImageDataset(str(root / "val"), transform=val_tf)
    batch = dcfg["micro_batch"]
    if len(train_set) < batch * env.world_size:
        raise ValueError(f"{len(train_set)} training images cannot give every one of {env.world_size} workers "
                         f"a full batch of {batch}: lower data.micro_batch or the number of workers")
    sampler = DistributedSampler(train_set, num_replicas=env.world_size, rank=env.rank, shuffle=True,
                                 seed=seed, drop_last=True)
    common = {"num_workers": dcfg["workers"], "pin_memory": dcfg["pin_memory"] and env.device.type != "cpu",
              "persistent_workers": dcfg["workers"] > 0}
    train = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True, **common)
    val = DataLoader(Subset(val_set, eval_shard(len(val_set), env).tolist()), batch_size=dcfg["eval_batch"],
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
