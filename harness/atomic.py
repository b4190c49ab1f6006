"""Files written whole or not at all: a temporary sibling, fsync, then a rename over the target.

A job killed while writing leaves the previous file (a checkpoint, ``metrics.json``) in force. A
checkpoint's files get their sha256 beside them (``<file>.sha256``, as ``sha256sum`` writes it), checked
before they are read: ``torch.load`` ignores the zip's CRCs and DCP's files have none, so a flipped bit
would otherwise load as a changed value. A failed write raises the file's own error, naming the file
(``torch.save`` reports a full disk as "unexpected pos 64 vs 0").
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import torch


DIGEST = ".sha256"
FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left: on the device, in the user's quota


class DiskFull(OSError):
    """A write found no space left on its disk (or in its quota): a rerun finds it full again until space is
    freed."""


class _Hashing:
    """A write-only file that hashes what passes through it: the digest costs no second read of a large file."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()
        self.error: OSError | None = None  # the file's own error, which torch.save replaces with its own

    def write(self, data) -> int:
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def atomic_write_bytes(path: Path, write) -> str:
    """``write(file)`` into a temporary sibling, fsync, then rename over ``path``; returns the sha256 of the bytes.

    A failed write (a full disk) removes its temporary file: a rerun on that disk must not find it fuller. The
    ``OSError`` of the file's write, whatever ``write`` made of it, is what it raises, naming ``path``
    (:class:`DiskFull` for a full disk).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    out = None
    try:
        with open(tmp, "wb") as f:
            out = _Hashing(f)
            write(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        error = out.error if out is not None and out.error is not None else e
        if isinstance(error, OSError) and error.errno is not None:
            raise (DiskFull if error.errno in FULL else OSError)(error.errno, error.strerror, str(path)) from error
        raise
    return out.sha.hexdigest()


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST)


def write_digest(path: Path, digest: str) -> None:
    """``<path>.sha256`` (``sha256sum -c`` reads it), written atomically."""
    path = Path(path)
    atomic_write_bytes(digest_path(path), lambda f: f.write(f"{digest}  {path.name}\n".encode()))


def atomic_torch_save(obj, path: Path) -> str:
    """``torch.save`` atomically, with ``<path>.sha256`` beside it: torch.load ignores the zip's CRCs, so that
    a flipped bit would otherwise load as a changed value. Returns the digest."""
    path = Path(path)
    digest = atomic_write_bytes(path, lambda f: torch.save(obj, f))
    write_digest(path, digest)
    return digest


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()


def verify(path: Path, required: bool = True, listed: str | None = None) -> None:
    """Check ``path`` against its ``.sha256``; a missing digest is an error where ``required`` (a checkpoint
    that records its digests), else the file goes unchecked (one written before digests were). ``listed``: the
    digest the checkpoint's marker (``complete.json``) records for it, which it must match too: a file of another
    checkpoint, copied in with its own ``.sha256``, matches that one only."""
    path = Path(path)
    recorded = digest_path(path)
    if not recorded.exists():
        if required:
            raise FileNotFoundError(f"its digest {recorded.name} is missing, though the checkpoint records one: "
                                    "the file cannot be checked")
        return
    expected = (recorded.read_text().split() or [""])[0]
    actual = file_sha256(path)
    if actual != expected:
        raise ValueError(f"its sha256 {actual[:16]}... differs from the {expected[:16] or 'empty'}... "
                         f"recorded in {recorded.name} when it was written: the file changed on disk")
    if listed is not None and actual != listed:
        raise ValueError(f"its sha256 {actual[:16]}... differs from the {listed[:16]}... that complete.json "
                         "records for it: it is not the file this checkpoint wrote (another checkpoint's, copied in "
                         "with its digest)")


def verified_torch_load(path: Path, required: bool = True, listed: str | None = None):
    """``torch.load`` to the CPU after :func:`verify`."""
    verify(path, required, listed)
    return torch.load(path, map_location="cpu", weights_only=False)


def atomic_write_json(obj, path: Path) -> None:
    atomic_write_bytes(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))
