"""Optimizer checkpoints that keep each rank's own state.

An optimizer whose ``state_dict()`` is the rank's own (``per_rank_state``:
SLAMB's local moments, DGC's residuals, 1-bit LAMB's error buffers) is saved
as one file per rank, ``optimizer.rank{r}-of-{n}.pt``, and each rank loads
the file it wrote; any other optimizer as one file, ``optimizer.pt``, written
by rank 0. The world size, the rank and the optimizer are checked before
anything loads, and every refusal is one line naming the file and the fix.

``torch.distributed.checkpoint`` (DCP) files cannot hold such state: they
keep one copy of every entry for all ranks, so every rank would resume from
some other rank's moments; the optimizers refuse such a state on load, on
every rank, pointing here. DCP's in-memory ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` round trip works (each rank gets and sets its
own), and takes no step of its own on these optimizers.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from . import comm
from .topology import whole_group

__all__ = ["save_optimizer", "load_optimizer", "optimizer_file"]

FORMAT = 1
SHARED_FILE = "optimizer.pt"
_RANK_FILE = re.compile(r"optimizer\.rank(\d+)-of-(\d+)\.pt")


def _place(optimizer) -> tuple[bool, int, int]:
    group = whole_group(getattr(optimizer, "process_group", None))  # every rank of a node keeps its own file
    return bool(getattr(optimizer, "per_rank_state", False)), comm.rank(group), comm.world_size(group)


def optimizer_file(optimizer, directory) -> Path:
    """The file that holds ``optimizer``'s state for this rank in ``directory``."""
    per_rank, r, n = _place(optimizer)
    return Path(directory) / (f"optimizer.rank{r}-of-{n}.pt" if per_rank else SHARED_FILE)


def save_optimizer(optimizer, directory) -> Path:
    """Write ``optimizer.state_dict()`` into ``directory`` (created if needed); returns the file.

    Every rank calls it: each writes its own file when the state is per rank,
    rank 0 alone writes the shared file otherwise. It is no collective (no
    rank waits for another): synchronize before another process reads the
    files. The file is written under a temporary name and renamed, so a crash
    never leaves a truncated state behind.
    """
    per_rank, r, n = _place(optimizer)
    path = optimizer_file(optimizer, directory)
    if per_rank or r == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": FORMAT, "optimizer": type(optimizer).__name__, "world_size": n, "rank": r,
                   "per_rank": per_rank, "state": optimizer.state_dict()}
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
    return path


def _missing(path: Path, per_rank: bool, r: int, n: int) -> str:
    """Why ``path`` is not there, from what the directory holds instead, and the fix."""
    directory = path.parent
    worlds = sorted({int(m.group(2)) for f in directory.glob("optimizer.rank*-of-*.pt")
                     if (m := _RANK_FILE.fullmatch(f.name))})
    save = f"save it with slamb.save_optimizer(optimizer, {str(directory)!r}) on every rank"
    if per_rank:
        if worlds:
            return (f"{path} is missing: {directory} holds the per-rank optimizer states of a world of size "
                    f"{', '.join(map(str, worlds))}, this run has {n} ranks; each rank's state is its own and cannot "
                    f"be redistributed: resume with {worlds[0]} ranks, or start the optimizer afresh and load only "
                    "the model")
        if (directory / SHARED_FILE).is_file():
            return (f"{path} is missing: {directory} holds one shared optimizer state ({SHARED_FILE}), saved by an "
                    "optimizer whose state is the same on every rank; this one keeps a state per rank: construct "
                    "the optimizer the run was saved with")
        return f"{path} is missing: no optimizer state for rank {r} of {n} in {directory}; {save}"
    if worlds:
        return (f"{path} is missing: {directory} holds per-rank optimizer states (optimizer.rank*-of-*.pt), saved "
                "by an optimizer whose state is the rank's own (SLAMB, DGC, 1-bit LAMB): construct that optimizer")
    return f"{path} is missing: no optimizer state in {directory}; {save}"


def load_optimizer(optimizer, directory) -> Path:
    """Load the state :func:`save_optimizer` wrote into ``directory`` for this rank; returns the file.

    The file is read to the CPU, then ``optimizer.load_state_dict`` places the
    state on the parameters' devices.
    """
    per_rank, r, n = _place(optimizer)
    path = optimizer_file(optimizer, directory)
    if not path.is_file():
        raise FileNotFoundError(_missing(path, per_rank, r, n))
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: unreadable optimizer state ({reason}): the file is truncated or corrupt; save "
                         "it again, or resume from an earlier checkpoint") from e
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
        raise ValueError(f"{path}: not an optimizer state written by slamb.save_optimizer: save it with "
                         "slamb.save_optimizer(optimizer, directory)")
    name = type(optimizer).__name__
    if payload["optimizer"] != name:
        raise ValueError(f"{path}: holds the state of {payload['optimizer']}, this optimizer is {name}: construct "
                         f"a {payload['optimizer']} to resume from it")
    if per_rank and (payload["rank"], payload["world_size"]) != (r, n):
        raise ValueError(f"{path}: holds the state of rank {payload['rank']} of {payload['world_size']}, read by rank "
                         f"{r} of {n}: the file was renamed or copied; each rank must load the file it saved")
    try:
        optimizer.load_state_dict(payload["state"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    return path
