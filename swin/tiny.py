"""A tiny image set in ImageNet's ImageFolder layout, for smoke runs and tests, in a second.

    python -m swin.tiny data/imagenet_tiny        # train/<class>/*.JPEG, val/<class>/*.JPEG: 4 classes

Real JPEG files of 40 x 40 pixels whose mean colour is their class, so that ``model=swin_tiny_test``
(``model.num_classes`` = the classes written) learns it through timm's own data pipeline (:mod:`swin.data`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def write_tiny_imagenet(root, classes: int = 4, train: int = 8, val: int = 2, seed: int = 0) -> Path:
    """``train`` and ``val`` JPEG files per class under ``root``; the class sets the mean colour."""
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, n in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 40, (40, 40, 3)) + np.array([60 * c, 200 - 60 * c, 100])
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"img{i}.JPEG", quality=90)
    return root


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where train/ and val/ go")
    parser.add_argument("--classes", type=int, default=4, help="class folders (model.num_classes)")
    parser.add_argument("--train", type=int, default=8, help="training images per class")
    parser.add_argument("--val", type=int, default=2, help="validation images per class")
    args = parser.parse_args(argv)
    root = write_tiny_imagenet(args.out, args.classes, args.train, args.val)
    print(f"{root}: {args.classes} classes of {args.train} training and {args.val} validation images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
