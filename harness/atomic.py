"""Files written whole or not at all: a temporary sibling, fsync, then a rename over the target.

A job killed while writing leaves the previous file (a checkpoint, ``metrics.json``) in force.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def atomic_write_bytes(path: Path, write) -> None:
    """``write(file)`` into a temporary sibling, fsync, then rename over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    atomic_write_bytes(path, lambda f: torch.save(obj, f))


def atomic_write_json(obj, path: Path) -> None:
    atomic_write_bytes(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))
