"""Files written whole or not at all: a temporary sibling, fsync, then a rename over the target.

A job killed while writing leaves the previous file (a checkpoint, ``metrics.json``) in force. A
checkpoint's ``.pt`` gets its sha256 beside it (``<file>.sha256``, as ``sha256sum`` writes it), checked
before ``torch.load``, which ignores the zip's CRCs: a flipped bit would otherwise load as a changed value.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch


DIGEST = ".sha256"


class _Hashing:
    """A write-only file that hashes what passes through it: the digest costs no second read of a large file."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def atomic_write_bytes(path: Path, write) -> str:
    """``write(file)`` into a temporary sibling, fsync, then rename over ``path``; returns the sha256 of the bytes.

    A failed write (a full disk) removes its temporary file: a rerun on that disk must not find it fuller.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            out = _Hashing(f)
            write(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out.sha.hexdigest()


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST)


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` atomically, with ``<path>.sha256`` beside it (``sha256sum -c`` reads it): torch.load
    ignores the zip's CRCs, so that a flipped bit would otherwise load as a changed value."""
    path = Path(path)
    digest = atomic_write_bytes(path, lambda f: torch.save(obj, f))
    atomic_write_bytes(digest_path(path), lambda f: f.write(f"{digest}  {path.name}\n".encode()))


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()


def verified_torch_load(path: Path):
    """``torch.load`` to the CPU after checking the file against its ``.sha256`` (absent in checkpoints
    written before digests were: those load unchecked)."""
    path = Path(path)
    recorded = digest_path(path)
    if recorded.exists():
        expected = (recorded.read_text().split() or [""])[0]
        actual = file_sha256(path)
        if actual != expected:
            raise ValueError(f"its sha256 {actual[:16]}... differs from the {expected[:16] or 'empty'}... "
                             f"recorded in {recorded.name} when it was written: the file changed on disk")
    return torch.load(path, map_location="cpu", weights_only=False)


def atomic_write_json(obj, path: Path) -> None:
    atomic_write_bytes(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))
