"""CIFAR-10 from the standard python-pickle layout, and batched augmentation.

``data.dir`` is the folder ``cifar-10-batches-py`` (or its parent) as
extracted from https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz:
``data_batch_1`` .. ``data_batch_5``, ``test_batch`` (pickled dicts with
``b"data"``: uint8 N x 3072, channel-major R, G, B planes of 32 x 32, and
``b"labels"``) and ``batches.meta`` (``b"label_names"``). Nothing is
downloaded at run time. For smoke runs and tests, ``python -m cifar10.data --write-digits DIR``
writes scikit-learn's 8x8 digits (shipped with the package) in this layout, marked as digits in its
``batches.meta`` (``b"source"``). A run records what its folder holds (:func:`fingerprint`): CIFAR-10 only
where every file has the MD5 that torchvision publishes for it.

``data.valid_images: N`` holds N images of the training split out as a validation split (:func:`hold_out`: a
fixed draw, ``data.valid_seed``), scored after each epoch in place of the test split, which such a run never
reads: the split a learning-rate grid chooses on (``scripts/study.py --tune``).

The whole split is held as one uint8 tensor on the training device;
augmentation (random 32 x 32 crop of the 4-pixel zero-padded image, random
horizontal flip) runs batched there, drawn from a generator seeded by
(seed, rank, step), so it is exactly reproducible and resumable and never
touches the global RNG. The draws are made on the host (the same numbers on
every device) and reach the device once per epoch (``augment_draws``).
"""
from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import numpy as np
import torch

from harness import identity

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
FILES = (*TRAIN_FILES, TEST_FILE, META_FILE)
FOLDER = "cifar-10-batches-py"
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4
DIGITS_TEST = 297  # the digits' test split; the other 1500 images are the training split
# CIFAR-10's python version as torchvision verifies it (torchvision.datasets.CIFAR10's train_list, test_list, meta)
PUBLISHED_MD5 = {"data_batch_1": "c99cafc152244af753f735de768cd75f", "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
                 "data_batch_3": "54ebc095f3ab1f0389bbae665268c751", "data_batch_4": "634d18415352ddfa80567beed471001a",
                 "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb", "test_batch": "40351d587109b95175f43aff81a1287e",
                 "batches.meta": "5ff9c542aee3614f3951f8cda6e48888"}
DIGITS_SOURCE = "scikit-learn's 8x8 digits"  # the mark write_digits leaves in batches.meta

WHERE = (f"Get CIFAR-10 (python version) from {URL}, extract it (tar xzf) and set data.dir to the "
         f"'{FOLDER}' folder it creates; it must hold {', '.join(FILES)}.")


def resolve_dir(path) -> Path:
    """The folder holding the batch files: ``path`` itself or ``path/cifar-10-batches-py``."""
    path = Path(path).expanduser()
    if not (path / META_FILE).exists() and (path / FOLDER).is_dir():
        path = path / FOLDER
    missing = [f for f in FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"CIFAR-10 not found in {path}: missing {', '.join(missing)}. {WHERE}")
    return path


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError) as e:
        raise ValueError(f"{path} is not a CIFAR-10 python-pickle batch ({type(e).__name__}: {e}). {WHERE}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, expected a dict with b'data' and b'labels'. {WHERE}")
    return obj


def load_batches(path: Path, names) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images N x 3 x 32 x 32 and int64 labels of the named batch files."""
    xs, ys = [], []
    for name in names:
        batch = _unpickle(path / name)
        if b"data" not in batch or b"labels" not in batch:
            raise ValueError(f"{path / name}: expected keys b'data' and b'labels', found {sorted(batch)}. {WHERE}")
        x, y = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
        if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072 or len(y) != len(x):
            raise ValueError(f"{path / name}: b'data' must be uint8 N x 3072 with N labels, got {x.dtype} "
                             f"{x.shape} and {len(y)} labels. {WHERE}")
        if len(y) and (y.min() < 0 or y.max() > 9):
            raise ValueError(f"{path / name}: labels must be in 0..9, found {y.min()}..{y.max()}. {WHERE}")
        xs.append(torch.from_numpy(x.reshape(-1, 3, 32, 32).copy()))
        ys.append(torch.from_numpy(y.astype(np.int64)))
    return torch.cat(xs), torch.cat(ys)


def train_samples(path) -> int | None:
    """The training images of the CIFAR-10 set at ``path``, before any worker starts: its :func:`fingerprint`'s
    count (kept beside the data, so the batches are read once, for the run's identity too); None where it is
    missing or unreadable, which the launcher's look at the data and :func:`load_cifar10` say."""
    try:
        return fingerprint(path)["counts"]["train"]
    except (OSError, ValueError):
        return None


def load_cifar10(path, test: bool = True) -> dict:
    """``{"train": (x, y), "test": (x, y), "classes": [...]}``; clear errors for a missing or malformed set.
    ``test=False``: the test split is not read (no ``"test"``)."""
    path = resolve_dir(path)
    meta = _unpickle(path / META_FILE)
    if b"label_names" not in meta:
        raise ValueError(f"{path / META_FILE}: expected key b'label_names'. {WHERE}")
    classes = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[b"label_names"]]
    out = {"train": load_batches(path, TRAIN_FILES), "classes": classes}
    return {**out, "test": load_batches(path, (TEST_FILE,))} if test else out


def write_cifar10(path, train: tuple, test: tuple, classes, source: str | None = None) -> Path:
    """Write images (uint8 N x 3 x 32 x 32) and labels in the exact CIFAR-10 pickle layout.

    The training split is cut into the five ``data_batch_*`` files. Used to
    put other image sets (the demo's digits, test fixtures) through the same pipeline; ``source`` names such a
    set in ``batches.meta``, where a run's :func:`fingerprint` reads it.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    def dump(name, x, y, label):
        x = np.ascontiguousarray(np.asarray(x, dtype=np.uint8).reshape(len(x), 3072))
        batch = {b"batch_label": label.encode(), b"labels": [int(v) for v in y], b"data": x,
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(len(x))]}
        with open(path / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)

    xs, ys = np.array_split(np.asarray(train[0]), 5), np.array_split(np.asarray(train[1]), 5)
    for i, (x, y) in enumerate(zip(xs, ys)):
        dump(TRAIN_FILES[i], x, y, f"training batch {i + 1} of 5")
    dump(TEST_FILE, test[0], test[1], "testing batch 1 of 1")
    with open(path / META_FILE, "wb") as f:
        meta = {b"label_names": [c.encode() for c in classes], b"num_cases_per_batch": len(xs[0]), b"num_vis": 3072}
        pickle.dump({**meta, **({b"source": source.encode()} if source else {})}, f, protocol=2)
    return path


def fingerprint(path) -> dict:
    """What the CIFAR-10-layout folder at ``path`` holds (:mod:`harness.identity`): the MD5 of each file, the
    images per split and the classes; CIFAR-10 where every MD5 is the published one, else the folder named by
    its layout, its size and the mark of the writer that made it."""
    path = resolve_dir(path)

    def make() -> dict:
        md5 = {name: identity.md5_file(path / name) for name in FILES}
        meta = _unpickle(path / META_FILE)
        images = {split: sum(len(_unpickle(path / f).get(b"labels", ())) for f in files)
                  for split, files in (("train", TRAIN_FILES), ("test", (TEST_FILE,)))}
        classes = len(meta.get(b"label_names", ()))
        source = meta.get(b"source", b"").decode() or None
        dataset = "CIFAR-10" if md5 == PUBLISHED_MD5 else None
        size = f"{images['train']:,} training / {images['test']:,} test images, {identity.count(classes, 'class')}"
        if dataset:
            name = f"CIFAR-10 ({size}; every file's MD5 is the published one)"
        elif source:
            name = f"{source} in the CIFAR-10 layout ({size}), not CIFAR-10"
        else:
            name = f"a CIFAR-10-layout folder ({size}), not CIFAR-10 (its files' MD5s are not the published ones)"
        return {"layout": "cifar10-python", "dataset": dataset, "name": name, "digest": identity.digest_of(md5),
                "counts": {**images, "classes": classes}, "files": md5}

    return identity.kept(path, "cifar10", [path / f for f in FILES], make)


def hold_out(n_train: int, valid_images: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation) indices into the training split: ``valid_images`` of its ``n_train`` images drawn
    with ``seed`` (its own generator: the same draw for every run seed, so that a grid's points are scored on
    the same images), the rest to train on; both sorted. The test split plays no part."""
    if not 1 <= valid_images < n_train:
        raise ValueError(f"invalid data.valid_images={valid_images}: the training split has {n_train:,} images, "
                         f"so hold out between 1 and {n_train - 1:,} (or null: no validation split)")
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed))
    return order[valid_images:].sort().values, order[:valid_images].sort().values


def validation_identity(data: dict, valid_images: int, seed: int) -> dict:
    """The validation split as a run's :mod:`harness.identity` records it: which training images it holds (by
    the data's digest and the drawn indices) and how many are left to train on."""
    n_train = data["counts"]["train"]
    train, valid = hold_out(n_train, valid_images, seed)
    return {"layout": "held-out", "dataset": None, "counts": {"train": len(train), "valid": len(valid)},
            "name": f"validation split: {len(valid):,} of the {n_train:,} training images (draw {seed}), "
                    f"{len(train):,} left to train on; the test split unread",
            "digest": identity.digest_of({"data": data["digest"], "valid": valid.tolist()})}


def write_digits(path, n_train: int | None = None, n_test: int = DIGITS_TEST, seed: int = 0) -> Path:
    """scikit-learn's digits as CIFAR-10 batches (bilinear 8x8 -> 32x32, grey -> RGB, 0..16 -> 0..255): a test
    split of ``n_test`` images drawn with ``seed``, a training split of ``n_train`` of the others (all: None)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    if n_test + (n_train or 1) > len(digits.images):
        raise ValueError(f"the digits are {len(digits.images)} images: n_train={n_train} and n_test={n_test} ask "
                         "for more")
    images = torch.from_numpy(digits.images).float().unsqueeze(1)  # N x 1 x 8 x 8, values 0..16
    images = torch.nn.functional.interpolate(images, size=32, mode="bilinear", align_corners=False)
    images = (images / 16.0 * 255.0).round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).numpy()
    order = np.random.default_rng(seed).permutation(len(images))
    test, train = order[:n_test], order[n_test:][:n_train]
    labels = digits.target.astype(np.int64)
    return write_cifar10(path, (images[train], labels[train]), (images[test], labels[test]),
                         [str(c) for c in digits.target_names], source=DIGITS_SOURCE)


def channel_stats(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The CIFAR-10 channel means and standard deviations on ``device``, made once per run (a tensor made
    from host data each step is a copy from the host)."""
    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1), torch.tensor(STD, device=device).view(1, 3, 1, 1))


def normalize(x: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """uint8 N x 3 x H x W -> float, standardised with the CIFAR-10 channel statistics (``channel_stats``)."""
    mean, std = stats if stats is not None else channel_stats(x.device)
    return (x.float() / 255.0 - mean) / std


def augment_draws(n: int, generator: torch.Generator) -> torch.Tensor:
    """The random numbers of one batch's augmentation, on the host: int64 3 x n (row and column offset in
    0..2 PAD, flip 0/1 of each image)."""
    offsets = torch.randint(0, 2 * PAD + 1, (2, n), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.5
    return torch.cat([offsets, flip[None].long()])


def augment(x: torch.Tensor, generator: torch.Generator | torch.Tensor) -> torch.Tensor:
    """Random crop (4-pixel zero padding) and horizontal flip of a uint8 batch, per image.

    ``generator``: the batch's generator, or its ``augment_draws`` already on ``x``'s device (no copy
    from the host here)."""
    n, _, h, w = x.shape
    draws = generator if isinstance(generator, torch.Tensor) else augment_draws(n, generator).to(x.device)
    offsets, flip = draws[:2], draws[2].bool()
    padded = torch.nn.functional.pad(x, (PAD, PAD, PAD, PAD))
    rows = offsets[0, :, None] + torch.arange(h, device=x.device)  # n x h
    cols = offsets[1, :, None] + torch.arange(w, device=x.device)  # n x w
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(n, device=x.device)[:, None, None]
    return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


def augment_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """The augmentation stream of one step of one rank (independent of everything else)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="write a small image set in the CIFAR-10 python-pickle layout")
    parser.add_argument("--write-digits", metavar="DIR", required=True,
                        help="scikit-learn's digits, upsampled to 32 x 32 x 3")
    parser.add_argument("--train", type=int, default=None, help="training images (default: the 1500 left)")
    parser.add_argument("--test", type=int, default=DIGITS_TEST, help="test images")
    args = parser.parse_args(argv)
    path = write_digits(args.write_digits, args.train, args.test)
    x = load_cifar10(path)
    print(f"{path}: {len(x['train'][1])} training and {len(x['test'][1])} test images of the digits in the "
          "CIFAR-10 layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
