"""This worker's replica group, where it is one of a torchft job's (:mod:`harness.fault_tolerance`)."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

ENV = "SLAMB_FT"  # "<lighthouse address> <group> <groups> <attempt> <folder>": set in a torchft job's workers


@dataclasses.dataclass
class Replica:
    """This worker's replica group: its index and the job's number of groups, its attempt (0: started with
    the job; n: its n-th relaunch), its :class:`~slamb.integrations.torchft.ManagedGroup`."""
    index: int
    groups: int
    attempt: int
    group: object
    folder: Path


_replica: Replica | None = None


def join(device, timeout_s: float) -> Replica | None:
    """This worker's replica group, where it is one of a torchft job's (:func:`harness.fault_tolerance.launch`),
    else None: connected to the lighthouse; a group that starts with the job waits for the others' (the first
    quorum holds them all)."""
    global _replica
    if ENV not in os.environ:
        return None
    if _replica is None:
        from slamb.integrations.torchft import connect

        address, index, groups, attempt, folder = os.environ[ENV].split()
        group = connect(address, replica_id=index, timeout=timeout_s, device=device.type, host="127.0.0.1",
                        init_sync=False)
        _replica = Replica(int(index), int(groups), int(attempt), group, Path(folder))
        if _replica.attempt == 0:
            (_replica.folder / f"up{index}").touch()
            while not all((_replica.folder / f"up{i}").exists() for i in range(_replica.groups)):
                time.sleep(0.01)
    return _replica


def current() -> Replica | None:
    """This worker's replica group (:func:`join`), or None outside a torchft job."""
    return _replica
