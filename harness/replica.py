"""This worker's replica group, where it is one of a torchft job's (:mod:`harness.fault_tolerance`)."""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from pathlib import Path

# "<lighthouse address> <group> <groups> <attempt> <folder> <rank> <processes>": set in a torchft job's workers
ENV = "SLAMB_FT"


@dataclasses.dataclass
class Replica:
    """This worker's replica group: its index and the job's number of groups, its attempt (0: started with
    the job; n: its n-th relaunch), its :class:`~slamb.integrations.torchft.ManagedGroup`; this worker's
    ``rank`` among the group's ``size`` processes (which shard its model over their own process group)."""
    index: int
    groups: int
    attempt: int
    group: object
    folder: Path
    rank: int = 0
    size: int = 1

    @property
    def global_rank(self) -> int:
        return self.index * self.size + self.rank

    def before_first_quorum(self) -> None:
        """A worker of a group that starts with the job waits, before its first quorum, for every such worker to be
        there: the lighthouse forms a first quorum without a group that asks for it more than its join timeout
        after the others (a slower start: the imports, the model, the data), which would then join at a later
        step and miss the first steps' data."""
        if self.attempt == 0:
            (self.folder / f"up{self.global_rank}").touch()
            while not all((self.folder / f"up{r}").exists() for r in range(self.groups * self.size)):
                time.sleep(0.01)


_replica: Replica | None = None


def group_store(index: int, attempt: int, rank: int, size: int, folder: Path, timeout: float, backend: str = "gloo"):
    """Replica group ``index``'s store (of its ``attempt``-th start), hosted by its rank 0 (the others find its
    port in ``folder``), and the group's own process group over it (``backend``), on which it shards its model;
    None for a group of one process."""
    if size == 1:
        return None
    import torch.distributed as dist

    found = folder / f"store{index}.{attempt}"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        (folder / f"{found.name}.tmp").write_text(str(store.port))
        os.replace(folder / f"{found.name}.tmp", found)
    else:
        deadline = time.monotonic() + timeout
        while not found.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica group {index}: its rank 0 did not start within {timeout:.0f} s")
            time.sleep(0.01)
        store = dist.TCPStore("127.0.0.1", int(found.read_text()), is_master=False, wait_for_workers=False)
    # the group's managers write keys of their own into the store
    dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))
    return store


def join(device, timeout_s: float) -> Replica | None:
    """This worker's replica group, where it is one of a torchft job's (:func:`harness.fault_tolerance.launch`),
    else None: connected to the lighthouse (and, in a group of several processes, to the group's own process
    group)."""
    global _replica
    if ENV not in os.environ:
        return None
    if _replica is None:
        from slamb.integrations.torchft import connect

        address, index, groups, attempt, folder, rank, size = os.environ[ENV].split()
        index, attempt, rank, size = int(index), int(attempt), int(rank), int(size)
        store = group_store(index, attempt, rank, size, Path(folder), timeout_s,
                            "nccl" if device.type == "cuda" else "gloo")
        # trainer.timeout_s bounds the quorum too: a group whose lighthouse or peers are gone waits that long, not
        # torchft's 300 s
        group = connect(address, replica_id=str(index), rank=rank, world_size=size, store=store, timeout=timeout_s,
                        quorum_timeout=timeout_s, device=device.type, host="127.0.0.1", init_sync=False)
        _replica = Replica(index, int(groups), attempt, group, Path(folder), rank, size)
    return _replica


def current() -> Replica | None:
    """This worker's replica group (:func:`join`), or None outside a torchft job."""
    return _replica
