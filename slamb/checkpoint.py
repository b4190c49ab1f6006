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
every rank, pointing here. The exception is FSDP2/HSDP (sharded) runs:
:func:`save_sharded` / :func:`load_sharded` give each replica and each shard
its own DCP entries (below), and these two refuse their optimizers. DCP's in-memory ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` round trip works (each rank gets and sets its
own), and takes no step of its own on these optimizers.
"""
from __future__ import annotations

import io
import logging
import os
import re
from pathlib import Path

import torch

from . import comm
from .contract import rank_stamp
from .ddp import is_prepared, reshard
from .sharding import is_sharded, local
from .topology import MeshTopology, whole_group

__all__ = ["save_optimizer", "load_optimizer", "optimizer_file", "save_sharded", "load_sharded", "replica_mean",
           "mean_state_dict"]

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
    _refuse_sharded(optimizer, "save")
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
    if (directory / ".metadata").is_file():
        return (f"{path} is missing: {directory} holds a sharded checkpoint (slamb.save_sharded, "
                "torch.distributed.checkpoint): load it with slamb.load_sharded(model, optimizer, directory) into "
                "an FSDP2/HSDP run (slamb.shard_model), or start the optimizer afresh and load only the model")
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
    _refuse_sharded(optimizer, "load")
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


# -- FSDP2 / HSDP: torch.distributed.checkpoint ------------------------------------------------------------

DCP_FORMAT = 1
_META = "slamb"  # the checkpoint's description, one object for every rank
_log = logging.getLogger(__name__)


def _blob(obj) -> bytes:
    """``obj`` as one DCP entry: DCP would flatten a dict into an entry per leaf."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data):
    return torch.load(io.BytesIO(data), weights_only=True) if isinstance(data, bytes) else None


def _sharded_topology(optimizer, verb: str) -> MeshTopology:
    topology = getattr(optimizer, "shards", None)
    if not isinstance(topology, MeshTopology):
        fn = "save_optimizer" if verb == "save" else "load_optimizer"
        raise ValueError(f"slamb.{verb}_sharded: {type(optimizer).__name__}'s parameters are not sharded (FSDP2): "
                         f"{verb} its state with slamb.{fn}(optimizer, directory)")
    return topology


def _refuse_sharded(optimizer, verb: str) -> None:
    if isinstance(getattr(optimizer, "shards", None), MeshTopology):
        raise ValueError(f"slamb.{verb}_optimizer: {type(optimizer).__name__}'s state is sharded (FSDP2/HSDP): "
                         f"{verb} it with slamb.{verb}_sharded(model, optimizer, directory)")


def _copies(optimizer, topology: MeshTopology) -> int:
    """How many different states the replicas hold: SLAMB's differ between syncs (one per replica), a
    data-parallel optimizer's are the same (one, written once)."""
    return topology.n_replicas if getattr(optimizer, "params_differ", False) else 1


def _shard_mesh(topology: MeshTopology):
    """The 1-D mesh of this rank's replica: a replica's state is a DTensor sharded over it."""
    if topology.mesh.ndim == 1:
        return topology.mesh
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(topology.shard, topology.mesh.device_type)


def _shard_of(t: torch.Tensor, whole: torch.Size, mesh):
    """``t`` (this rank's dim-0 shard, torch.chunk's cut) as a DTensor of shape ``whole`` over ``mesh``."""
    from torch.distributed.tensor import DTensor, Shard
    stride = [1] * len(whole)
    for i in range(len(whole) - 2, -1, -1):
        stride[i] = stride[i + 1] * whole[i + 1]
    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=whole, stride=tuple(stride))


def _param_names(model, optimizer) -> list[str]:
    reshard(model)  # the optimizer's DTensors are the model's parameters again after an evaluation's forward
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in names for p in params):
        raise ValueError("slamb.save_sharded / load_sharded: the optimizer holds parameters that are not the model's: "
                         "pass the model whose parameters the optimizer was built on")
    return [names[id(p)] for p in params]


def _dcp_entries(model, optimizer, sd: dict, topology, names) -> tuple[dict, dict]:
    """``(model, optimizer state)`` of this rank as DCP entries: what is sharded as a parameter is a DTensor of
    the whole tensor's shape over the replica's shard mesh, everything else as is. ``sd``: the optimizer's
    state dict."""
    mesh = _shard_mesh(topology)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    entries = {k: _shard_of(local(v).detach(), v.shape, mesh) if is_sharded(v) else v
               for k, v in model.state_dict().items()}
    state = {}
    for i, (name, p) in enumerate(zip(names, params)):
        mine = local(p).shape
        # LAMB's moments are DTensors over the parameters' mesh, SLAMB's views of its flat buffers: both the shard
        state[name] = {k: _shard_of(local(v), p.shape, mesh)
                       if torch.is_tensor(v) and v.dim() and local(v).shape == mine else v
                       for k, v in sd["state"].get(i, {}).items()}
    return entries, {n: s for n, s in state.items() if s}


def _os_error_behind(err: BaseException) -> OSError | None:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _dcp_writer(directory):
    """DCP's file writer, raising a failed file's own ``OSError``. ``torch.save`` streaming onto a full disk
    raises "unexpected pos 704 vs 598" with the ENOSPC only as its context, and DCP pickles a rank's error to
    the others, which drops the context: every rank would learn a short write of no cause."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        def write_data(self, plan, planner):
            try:
                return super().write_data(plan, planner)
            except Exception as err:
                found = _os_error_behind(err)
                if found is None or found is err:
                    raise
                raise found from None

    # a directory's checkpoint written over, as save_sharded always has: FileSystemWriter's default (True through
    # torch 2.15) is announced to become False, under which a second save into one directory would raise
    return Writer(directory, overwrite=True)


def save_sharded(model, optimizer, directory) -> None:
    """Save an FSDP2/HSDP ``model`` and its SLAMB or LAMB ``optimizer`` with ``torch.distributed.checkpoint``.

    Collective: every rank calls it. Each rank writes its own shard of the parameters and of the state
    (moments, SLAMB's mask ages), as DTensors of the whole tensors' shapes, so nothing is gathered to one
    rank and a different shard count can load them. SLAMB's replicas differ between syncs: each replica's
    parameters and state are saved apart (``replica{r}.*``); a data-parallel optimizer's once. The step,
    the mask (seed, compression ratio, variant) and the parameter groups are saved once (entry ``slamb``).
    A failed write raises DCP's ``CheckpointException`` on every rank, holding each failed rank's ``OSError``
    (a full disk: ``errno.ENOSPC``). A checkpoint already in ``directory`` is written over.
    """
    import torch.distributed.checkpoint as dcp

    topology = _sharded_topology(optimizer, "save")
    names = _param_names(model, optimizer)
    copies = _copies(optimizer, topology)
    sd = optimizer.state_dict()
    entries, state = _dcp_entries(model, optimizer, sd, topology, names)
    key = getattr(optimizer, "state_key", "")
    extra = {k: v for k, v in sd.get(key, {}).items() if k not in ("ledger", "rank", "world_size")}
    groups = [{**{k: v for k, v in g.items() if k != key}, "params": [names[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    meta = {"format": DCP_FORMAT, "optimizer": type(optimizer).__name__, "n_replicas": topology.n_replicas,
            "n_shards": topology.n_shards, "copies": copies, "extra": extra, "param_groups": groups}
    r, n = comm.rank(), comm.world_size()
    ledger = getattr(optimizer, "ledger", None)
    payload = {_META: _blob(meta),
               f"replica{topology.replica if copies > 1 else 0}": {"model": entries, "optim": state}}
    if ledger is not None:  # the bytes each rank sent: its own (uneven shards send different numbers)
        payload[f"ledger.rank{r}-of-{n}"] = _blob(ledger.state_dict())
    dcp.save(payload, storage_writer=_dcp_writer(str(directory)))


def _read_metadata(directory):
    from torch.distributed.checkpoint import FileSystemReader
    directory = Path(directory)
    if not (directory / ".metadata").is_file():
        if any(directory.glob("optimizer*.pt")):
            raise FileNotFoundError(f"{directory} holds a DDP optimizer state (slamb.save_optimizer), not a sharded "
                                    "checkpoint: load it with slamb.load_optimizer into an unsharded (DDP) run, or "
                                    "start the optimizer afresh and load only the model")
        raise FileNotFoundError(f"no sharded checkpoint in {directory} (no .metadata): save it with "
                                "slamb.save_sharded(model, optimizer, directory) on every rank")
    return FileSystemReader(str(directory)).read_metadata().state_dict_metadata


def _template(saved, like: torch.Tensor | None, mesh):
    """Where DCP loads the entry ``saved`` (its metadata): this rank's shard of it where ``like`` (the
    parameter) is sharded and of its shape, else the whole tensor; an object as itself."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    if not isinstance(saved, TensorStorageMetadata):
        return None
    dtype = saved.properties.dtype
    if like is not None and is_sharded(like) and len(saved.size) and tuple(saved.size) == tuple(like.shape):
        return _shard_of(torch.empty(local(like).shape, dtype=dtype, device=local(like).device), like.shape, mesh)
    return torch.empty(saved.size, dtype=dtype, device=local(like).device if like is not None else "cpu")


def replica_mean(values: list, what: str):
    """The replicas' mean of a float state; a counter (the mask ages, the step) must be the same in every
    replica. ``what`` names the entry in the refusal of a counter that differs."""
    values = [local(v) if torch.is_tensor(v) else v for v in values]
    first = values[0]
    if len(values) == 1:
        return first
    if torch.is_tensor(first) and first.is_floating_point():
        return sum(values[1:], first.clone()) / len(values)
    if not all(torch.equal(v, first) if torch.is_tensor(v) else v == first for v in values):
        raise ValueError(f"{what} differs between the saved replicas, so it has no mean: the checkpoint was not "
                         "written by one run")
    return first


def mean_state_dict(state_dicts: list[dict], optimizer) -> dict:
    """What ``optimizer`` resumes from on another world size, given the ``state_dict()`` of each saved rank (of a
    DDP run): the mean over them of every float state (SLAMB's moments), the counters (step, mask ages) as saved,
    as :func:`load_sharded` starts a new replica count; stamped with this rank, whose own state it becomes. An
    optimizer whose state is the same on every rank needs one rank's, which is returned as it is."""
    first = state_dicts[0]
    state = {i: {k: replica_mean([sd["state"][i][k] for sd in state_dicts], f"optimizer state {i}.{k}") for k in s}
             for i, s in first["state"].items()}
    key = getattr(optimizer, "state_key", "")
    restamped = {key: {**first[key], **rank_stamp(optimizer.process_group)}} if key in first else {}
    return {**first, "state": state, **restamped}


def _elastic_line(meta: dict, topology: MeshTopology, state: dict, name: str) -> str:
    """What a load onto another replica count starts every replica from, at which step. ``state``: the loaded
    per-parameter state (LAMB counts its steps per parameter, SLAMB once, in ``meta``)."""
    step = meta["extra"].get("step")
    if step is None:
        step = max((int(s["step"]) for s in state.values() if "step" in s), default=0)
    if meta["copies"] == 1:  # a data-parallel optimizer's replicas, or a single saved one: the same state
        start = "the saved parameters and optimizer state"
    else:
        start = "the mean of the saved replicas' parameters and moments"
    ages = ", with their mask ages" if any("staleness" in s for s in state.values()) else ""
    return (f"{meta['n_replicas']} saved replicas -> {topology.n_replicas}: every replica starts from {start}{ages} "
            f"({name}, step {step})")


@torch.no_grad()
def load_sharded(model, optimizer, directory) -> None:
    """Load what :func:`save_sharded` wrote into an FSDP2/HSDP ``model`` and its ``optimizer``.

    Collective: every rank calls it, after building the model and the optimizer as the run was saved
    (the same parameters, the same optimizer and settings), sharded on any mesh, and after
    :func:`slamb.wrap_model` (which starts every replica from replica 0's shards: a load before it is refused):

    * the same replica count: each replica resumes its own parameters and state, bit for bit;
    * another shard count: DCP reshards each saved tensor onto the new shards;
    * another replica count (elastic, R -> R'): every new replica starts from the MEAN over the R saved
      replicas of the parameters and of the first and second moments, with the saved mask ages (the
      same in every replica: the masks are) and step; logged in one line. For a data-parallel optimizer,
      whose replicas are the same, that is the saved state itself.

    The communication ledger resumes where each rank left it when the world is the same, else it is kept.
    Buffers (not sharded by FSDP2) are saved as one rank of each replica holds them.
    """
    import torch.distributed.checkpoint as dcp

    topology = _sharded_topology(optimizer, "load")
    if not is_prepared(optimizer):
        raise RuntimeError("slamb.load_sharded before slamb.wrap_model, which starts every replica from replica 0's "
                           "shards and would overwrite what the other replicas load: call model = "
                           "slamb.wrap_model(model, optimizer) first, then slamb.load_sharded(model, optimizer, "
                           "directory)")
    names = _param_names(model, optimizer)
    saved_md = _read_metadata(directory)
    head = {_META: None}
    dcp.load(head, checkpoint_id=str(directory))
    meta = _unblob(head[_META])
    if not (isinstance(meta, dict) and meta.get("format") == DCP_FORMAT):
        raise ValueError(f"{directory}: not a checkpoint written by slamb.save_sharded")
    name = type(optimizer).__name__
    if meta["optimizer"] != name:
        raise ValueError(f"{directory}: holds the state of {meta['optimizer']}, this optimizer is {name}: construct "
                         f"a {meta['optimizer']} to resume from it")
    copies = meta["copies"]
    same = copies == 1 or copies == topology.n_replicas
    sources = [topology.replica if copies > 1 else 0] if same else list(range(copies))

    mesh = _shard_mesh(topology)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    model_sd = model.state_dict()
    prefix = f"replica{sources[0]}.optim."  # every replica holds the same entries
    by_param = [fqn[len(prefix):].rpartition(".")[::2] for fqn in saved_md if fqn.startswith(prefix)]  # (name, key)
    index = {n: i for i, n in enumerate(names)}
    absent = [k for k in model_sd if f"replica{sources[0]}.model.{k}" not in saved_md]
    if absent:
        raise ValueError(f"{directory}: holds no entry for the model's {', '.join(absent[:4])}"
                         f"{' ...' if len(absent) > 4 else ''}: build the model the run was saved with")
    wanted = {}
    for c in sources:
        wanted[f"replica{c}"] = {
            "model": {k: _template(saved_md.get(f"replica{c}.model.{k}"), v, mesh) for k, v in model_sd.items()},
            "optim": {},
        }
        for pname, k in by_param:
            if pname not in index:
                raise ValueError(f"{directory}: holds optimizer state for {pname!r}, which this model does not have: "
                                 "build the model the run was saved with")
            entry = saved_md[f"replica{c}.optim.{pname}.{k}"]
            wanted[f"replica{c}"]["optim"].setdefault(pname, {})[k] = _template(entry, params[index[pname]], mesh)
    ledger_key = f"ledger.rank{comm.rank()}-of-{comm.world_size()}"
    if ledger_key in saved_md:
        wanted[ledger_key] = None
    dcp.load(wanted, checkpoint_id=str(directory))

    for k, v in model_sd.items():
        local(v).copy_(replica_mean([wanted[f"replica{c}"]["model"][k] for c in sources], k))
    state = {}
    for pname, k in by_param:
        state.setdefault(index[pname], {})[k] = replica_mean(
            [wanted[f"replica{c}"]["optim"][pname][k] for c in sources], f"{pname}.{k}")
    if meta["n_replicas"] != topology.n_replicas and comm.rank() == 0:
        _log.warning("slamb.load_sharded: %s", _elastic_line(meta, topology, state, name))
    groups = [{**g, "params": [index[p] for p in g["params"]]} for g in meta["param_groups"]]
    sd = {"state": state, "param_groups": groups}
    key = getattr(optimizer, "state_key", "")
    ledger = getattr(optimizer, "ledger", None)
    if ledger is not None and ledger_key in saved_md:
        ledger.load_state_dict(_unblob(wanted[ledger_key]))
    if key:  # the optimizer's own stamp: the state was mapped onto this rank's shards above
        sd[key] = {**meta["extra"], **rank_stamp(optimizer.process_group),
                   "ledger": ledger.state_dict() if ledger is not None else {}}
    optimizer.load_state_dict(sd)
