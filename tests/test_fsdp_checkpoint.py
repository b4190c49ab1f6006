"""Sharded checkpoints (slamb.save_sharded / load_sharded, torch.distributed.checkpoint) of FSDP2/HSDP runs.

Four launches of gloo processes share one directory of checkpoints: 2 processes save a 1-replica SLAMB run;
4 processes (HSDP 2 x 2, FSDP 4) save and resume SLAMB v1 and v2 and LAMB, load the 1-replica checkpoint into
2 replicas, reshard LAMB, load SLAMB's 2 x 2 into 1 x 4 and meet the DDP checkpoints; 2 processes load the
2 x 2 checkpoints into 1 replica of 2 shards (the replicas' mean) and into 2 replicas of 1 shard (a reshard);
4 new processes resume the 2 x 2 SLAMB runs. What a run loaded is compared with
what the files hold, read back whole in the test process (``dcp_to_torch_save``).
"""
from __future__ import annotations

import contextlib
import errno
import logging
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import slamb
from slamb.checkpoint import _dcp_writer, _shard_mesh, _shard_of, _unblob
from tests import distributed
from tests.disk import as_the_other_ranks_learn_it, disk_with_room
from tests.test_fsdp import hsdp_mesh, loss_of, make_model, slamb_settings

pytestmark = pytest.mark.multiprocess

STEPS, SAVED_AT = 6, 4  # syncs after steps 1, 3, 5 (sync_interval 2): the replicas differ at step 4
BLOCKS = (torch.nn.Linear, torch.nn.LayerNorm)
VARIANTS = ("v1", "v2")


def mesh_of(replicas, shards):
    from torch.distributed.device_mesh import init_device_mesh
    if replicas == 1:
        return init_device_mesh("cpu", (shards,))
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def build(kind, mesh, variant="v2", fused=False):
    """A fresh sharded model and its optimizer, wrapped (which starts every replica from replica 0's shards:
    a checkpoint loads after it)."""
    model = slamb.shard_model(make_model(), mesh, blocks=BLOCKS)
    if kind == "slamb":
        opt = slamb.SLAMB(model.parameters(), **slamb_settings(dict(variant=variant, fused=fused)))
    else:
        opt = slamb.LAMB(model.parameters(), lr=0.02, weight_decay=0.01, trust_clamp=(0.01, 10.0), fused=fused)
    return slamb.wrap_model(model, opt), opt


def train(model, opt, rank, steps):
    for t in steps:
        opt.zero_grad(set_to_none=True)
        loss_of(model, rank, t).backward()
        opt.step()


def shards(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def gathered(model, opt):
    """The whole tensors of this rank's replica, keyed as the checkpoint's entries (gathered: the test's only)."""
    mesh = _shard_mesh(opt.shards)
    out = {f"model.{n}": p.full_tensor().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            v = v.to_local() if hasattr(v, "to_local") else v
            if not v.dim():  # LAMB's step
                out[f"optim.{n}.{k}"] = v.clone()
                continue
            # gloo gathers no int16 (the mask ages): as int32 and back
            whole = _shard_of(v.to(torch.int32) if v.dtype == torch.int16 else v, p.shape, mesh).full_tensor()
            out[f"optim.{n}.{k}"] = whole.to(v.dtype)
    return out


def resume(kind, mesh, rank, path, variant="v2", fused=False):
    """Save at SAVED_AT, go on to STEPS; then fresh objects load the checkpoint and take the same steps."""
    model, opt = build(kind, mesh, variant, fused)
    train(model, opt, rank, range(1, SAVED_AT + 1))
    slamb.save_sharded(model, opt, path)
    saved = gathered(model, opt)
    train(model, opt, rank, range(SAVED_AT + 1, STEPS + 1))
    model2, opt2 = build(kind, mesh, variant, fused)
    slamb.load_sharded(model2, opt2, path)
    train(model2, opt2, rank, range(SAVED_AT + 1, STEPS + 1))
    return {"saved": saved, "uninterrupted": shards(model), "resumed": shards(model2),
            "step": getattr(opt2, "_step", None)}


def loaded(kind, mesh, path, variant="v2", fused=False, rank=None):
    """What loading ``path`` into a fresh run on ``mesh`` gives, gathered; and the warning logged. ``rank``: the
    run then takes the steps after SAVED_AT, and its shards are returned too."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("slamb.checkpoint")
    logger.addHandler(handler)
    try:
        model, opt = build(kind, mesh, variant, fused)
        slamb.load_sharded(model, opt, path)
    finally:
        logger.removeHandler(handler)
    out = {"state": gathered(model, opt), "log": records, "step": getattr(opt, "_step", None),
           "replica": opt.shards.replica}
    if rank is not None:
        train(model, opt, rank, range(SAVED_AT + 1, STEPS + 1))
        out["shards"] = shards(model)
    return out


def errors(rank, world, root):
    """The DDP checkpoints and the sharded ones meet: each refusal's message."""
    out = {}
    ddp_model = make_model()
    ddp = slamb.SLAMB(ddp_model.parameters(), **slamb_settings({}))
    train(slamb.wrap_model(ddp_model, ddp), ddp, rank, range(1, 3))
    slamb.save_optimizer(ddp, root / "ddp")
    sharded_model, sharded = build("slamb", hsdp_mesh())
    for name, call in (("save_optimizer", lambda: slamb.save_optimizer(sharded, root / "x")),
                       ("load_optimizer", lambda: slamb.load_optimizer(sharded, root / "ddp")),
                       ("load_sharded(ddp dir)", lambda: slamb.load_sharded(sharded_model, sharded, root / "ddp")),
                       ("load_sharded(ddp optimizer)", lambda: slamb.load_sharded(ddp_model, ddp, root / "v2")),
                       ("load_optimizer(dcp dir)", lambda: slamb.load_optimizer(ddp, root / "v2")),
                       ("load_state_dict", lambda: sharded.load_state_dict(ddp.state_dict()))):
        try:
            call()
            out[name] = None
        except (ValueError, FileNotFoundError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


@contextlib.contextmanager
def dcp_refusing_to_overwrite():
    """DCP's ``FileSystemWriter`` under the default a torch change announces, ``overwrite=False``: a save into a
    directory that holds a checkpoint raises unless its writer says otherwise."""
    from torch.distributed.checkpoint import FileSystemWriter

    init = FileSystemWriter.__init__

    def announced(self, path, *args, overwrite=False, **kwargs):
        init(self, path, *args, overwrite=overwrite, **kwargs)

    with mock.patch.object(FileSystemWriter, "__init__", announced):
        yield


def one_replica(rank, world, root):
    """1 replica of 2 shards: saves a SLAMB checkpoint for the 1 -> 2 replicas load, into the directory of an
    earlier one, which it writes over (what loads is the later state) under DCP's announced default."""
    model, opt = build("slamb", mesh_of(1, 2))
    train(model, opt, rank, range(1, 3))
    with dcp_refusing_to_overwrite():
        slamb.save_sharded(model, opt, root / "one")
        train(model, opt, rank, range(3, SAVED_AT + 1))
        slamb.save_sharded(model, opt, root / "one")
    return gathered(model, opt)


def two_by_two(rank, world, root):
    out = {v: resume("slamb", hsdp_mesh(), rank, root / v, v) for v in VARIANTS}
    out["lamb-fsdp"] = resume("lamb", mesh_of(1, world), rank, root / "lamb-fsdp")
    out["lamb-hsdp"] = resume("lamb", hsdp_mesh(), rank, root / "lamb-hsdp")
    out["v2-fused"] = resume("slamb", hsdp_mesh(), rank, root / "v2-fused", "v2", fused=True)
    out["lamb-hsdp-fused"] = resume("lamb", hsdp_mesh(), rank, root / "lamb-hsdp-fused", fused=True)
    dist.barrier()
    # a checkpoint moves between the paths: the multi-tensor run's into the fused one, and back
    out["v2 -> fused"] = loaded("slamb", hsdp_mesh(), root / "v2", "v2", fused=True, rank=rank)
    out["v2-fused -> multi-tensor"] = loaded("slamb", hsdp_mesh(), root / "v2-fused", "v2", rank=rank)
    out["lamb -> fused"] = loaded("lamb", hsdp_mesh(), root / "lamb-hsdp", fused=True, rank=rank)
    out["one->two"] = loaded("slamb", hsdp_mesh(), root / "one")
    out["lamb 2->4 shards"] = loaded("lamb", mesh_of(1, world), root / "lamb-hsdp")
    out["v2 (1, 4)"] = loaded("slamb", mesh_of(1, world), root / "v2")  # 2 x 2 -> 1 x 4: the mean, resharded
    out["errors"] = errors(rank, world, root)
    out["rank"] = rank
    return out


def resumed_in_new_processes(rank, world, root):
    out = {}
    for v in VARIANTS:
        model, opt = build("slamb", hsdp_mesh(), v)
        slamb.load_sharded(model, opt, root / v)
        train(model, opt, rank, range(SAVED_AT + 1, STEPS + 1))
        out[v] = shards(model)
    return out


def two_processes(rank, world, root):
    return {f"{v} {shape}": loaded("slamb", mesh_of(*shape), root / v, v)
            for v in VARIANTS for shape in ((1, 2), (2, 1))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    one = distributed.run(one_replica, 2, root)
    four = distributed.run(two_by_two, 4, root)
    two = distributed.run(two_processes, 2, root)
    again = distributed.run(resumed_in_new_processes, 4, root)
    return {"root": root, "one": one, "four": four, "two": two, "again": again}


def saved_files(path):
    """The checkpoint read whole, without processes: ``{replica: {entry: tensor}}`` and its description."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, path.with_suffix(".pt"))
    whole = torch.load(path.with_suffix(".pt"), weights_only=False)
    replicas = {}
    for key, value in whole.items():
        if key.startswith("replica"):
            entries = {f"model.{n}": t for n, t in value["model"].items()}
            entries.update({f"optim.{n}.{k}": t for n, state in value["optim"].items() for k, t in state.items()})
            replicas[int(key[len("replica"):])] = entries
    return replicas, _unblob(whole["slamb"])


@pytest.mark.parametrize("config", [*VARIANTS, "lamb-fsdp", "lamb-hsdp", "v2-fused", "lamb-hsdp-fused"])
def test_a_resumed_run_ends_bit_exactly_where_the_uninterrupted_one_ends(runs, config):
    for r in runs["four"]:
        res = r[config]
        assert all(torch.equal(a, b) for a, b in zip(res["resumed"], res["uninterrupted"])), (config, r["rank"])
        if not config.startswith("lamb"):
            assert res["step"] == STEPS
    if config in VARIANTS:  # and in new processes, where nothing of the saving run's objects is left
        for r, again in zip(runs["four"], runs["again"]):
            assert all(torch.equal(a, b) for a, b in zip(again[config], r[config]["uninterrupted"])), config
    if config in VARIANTS:  # the checkpoint held two different replicas: one copy of them would not resume both
        assert not torch.equal(runs["four"][0][config]["saved"]["optim.0.weight.exp_avg"],
                               runs["four"][2][config]["saved"]["optim.0.weight.exp_avg"])


@pytest.mark.parametrize("loaded, saved", [("v2 -> fused", "v2"), ("v2-fused -> multi-tensor", "v2-fused"),
                                           ("lamb -> fused", "lamb-hsdp")])
def test_a_sharded_checkpoint_moves_between_the_fused_and_the_multi_tensor_paths(runs, loaded, saved):
    """The state loads bit for bit into the other path, whose steps then go on as the saving run's do, to the
    fused passes' fp32 per-tensor scalars."""
    worst = 0.0
    for r in runs["four"]:
        state, want = r[loaded]["state"], r[saved]["saved"]
        assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want), (loaded, r["rank"])
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(r[loaded]["shards"],
                                                                         r[saved]["uninterrupted"])))
    print(f"{loaded}: max |resumed on the other path - uninterrupted| = {worst:.3g}")
    assert 0 < worst < 1e-6


@pytest.mark.parametrize("config", [*VARIANTS, "lamb-hsdp", "v2-fused"])
def test_the_files_hold_each_replica_whole(runs, config):
    replicas, meta = saved_files(runs["root"] / config)
    copies = 1 if config.startswith("lamb") else 2  # LAMB's replicas are the same: written once
    assert sorted(replicas) == list(range(copies)) and meta["copies"] == copies and meta["n_shards"] == 2
    for r in runs["four"]:
        replica = r["rank"] // 2 if copies > 1 else 0
        saved = r[config]["saved"]
        assert saved.keys() == replicas[replica].keys()
        assert all(torch.equal(saved[k], replicas[replica][k]) for k in saved), config


@pytest.mark.parametrize("target", ["v1 (1, 2)", "v2 (1, 2)", "v2 (1, 4)"])
def test_two_replicas_resume_as_one_from_their_mean(runs, target):
    v, shape = target.split(" ", 1)
    replicas, meta = saved_files(runs["root"] / v)
    assert meta["n_replicas"] == 2
    ranks = runs["two"] if shape == "(1, 2)" else runs["four"]
    for r in ranks:
        got = r[target]
        assert got["state"].keys() == replicas[0].keys()
        for k, x in got["state"].items():
            a, b = replicas[0][k], replicas[1][k]
            if k.endswith(".staleness"):  # the mask ages: the same in both replicas, kept
                assert torch.equal(a, b) and torch.equal(x, a), k
            else:
                assert k.startswith("model.") or "exp_avg" in k
                assert torch.equal(x, (a + b) / 2), k
        assert got["step"] == SAVED_AT
    assert len(ranks[0][target]["log"]) == 1 and not any(r[target]["log"] for r in ranks[1:])
    line = ranks[0][target]["log"][0]
    print(line)
    assert "2 saved replicas -> 1" in line and "mean" in line and "\n" not in line
    assert "with their mask ages" in line and line.endswith(f"(SLAMB, step {SAVED_AT})")


def test_lamb_on_another_replica_count_says_what_it_starts_from_and_at_which_step(runs):
    """LAMB's replicas are the same (its checkpoint holds one copy): no mean and no mask ages; its step, counted per
    parameter, in the line."""
    logs = [r["lamb 2->4 shards"]["log"] for r in runs["four"]]
    assert len(logs[0]) == 1 and not any(logs[1:])
    line = logs[0][0]
    print(line)
    assert "2 saved replicas -> 1: every replica starts from the saved parameters and optimizer state" in line
    assert "mask ages" not in line and "mean" not in line and "\n" not in line
    assert line.endswith(f"(LAMB, step {SAVED_AT})")


def test_one_replica_resumes_as_two_each_from_it(runs):
    saved, meta = saved_files(runs["root"] / "one")
    assert meta["n_replicas"] == 1 and list(saved) == [0]
    for r, at_save in zip(runs["four"], runs["one"] * 2):
        got = r["one->two"]
        assert got["state"].keys() == saved[0].keys()
        assert all(torch.equal(got["state"][k], saved[0][k]) for k in saved[0])
        assert all(torch.equal(got["state"][k], at_save[k]) for k in at_save)
        assert got["step"] == SAVED_AT
    assert "1 saved replicas -> 2" in runs["four"][0]["one->two"]["log"][0]


def test_another_shard_count_reshards(runs):
    for v in VARIANTS:  # 2 shards -> 1, each replica its own
        replicas, _ = saved_files(runs["root"] / v)
        for r in runs["two"]:
            got = r[f"{v} (2, 1)"]
            assert not got["log"]
            assert all(torch.equal(x, replicas[got["replica"]][k]) for k, x in got["state"].items())
    replicas, _ = saved_files(runs["root"] / "lamb-hsdp")  # 2 shards -> 4 (the (3, 16) weight: 1, 1, 1, 0 rows)
    for r in runs["four"]:
        got = r["lamb 2->4 shards"]["state"]
        assert got.keys() == replicas[0].keys()
        assert all(torch.equal(x, replicas[0][k]) for k, x in got.items())


def test_ddp_and_sharded_checkpoints_refuse_each_other_in_one_line(runs):
    refused = runs["four"][0]["errors"]
    expect = {"save_optimizer": "slamb.save_sharded", "load_optimizer": "slamb.load_sharded",
              "load_sharded(ddp dir)": "slamb.load_optimizer", "load_sharded(ddp optimizer)": "slamb.load_optimizer",
              "load_optimizer(dcp dir)": "slamb.load_sharded", "load_state_dict": "slamb.load_sharded"}
    for name, hint in expect.items():
        print(f"{name}: {refused[name]}")
        assert refused[name] is not None and hint in refused[name] and "\n" not in refused[name], (name, refused)


# ---------------------------------------------------------------------------------- a full disk


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP's single writer
@pytest.mark.parametrize("room", [100, 4096])
def test_a_full_disk_reaches_every_rank_as_the_files_own_error(tmp_path, room):
    """Before: at 4 kB of room DCP carried torch's "unexpected pos 704 vs 598", whose ENOSPC every other rank
    lost: none could tell a full disk from a broken writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with disk_with_room(room), pytest.raises(CheckpointException) as raised:
        dcp.save({"x": torch.zeros(100_000)}, storage_writer=_dcp_writer(str(tmp_path)), no_dist=True)
    (error, _), = as_the_other_ranks_learn_it(raised.value).failures.values()
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, repr(error)

    with disk_with_room(room), pytest.raises(CheckpointException) as raised:
        dcp.save({"x": torch.zeros(100_000)}, checkpoint_id=str(tmp_path), no_dist=True)  # DCP's own writer
    (error, _), = as_the_other_ranks_learn_it(raised.value).failures.values()
    assert isinstance(error, OSError if room < 600 else RuntimeError), repr(error)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP's single writer
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_checkpoint_is_written_over_whatever_dcps_default(tmp_path):
    """save_sharded's writer sets ``overwrite`` itself: where DCP's own writer refuses a directory holding a
    checkpoint (its announced default), the second save replaces the first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with dcp_refusing_to_overwrite():
        for x in (torch.zeros(4), torch.ones(4)):
            dcp.save({"x": x}, storage_writer=_dcp_writer(str(tmp_path)), no_dist=True)
        with pytest.raises(CheckpointException) as refused:
            dcp.save({"x": torch.full((4,), 2.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    (error, _), = refused.value.failures.values()
    assert "already exists" in str(error), repr(error)
    back = {"x": torch.empty(4)}
    dcp.load(back, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(back["x"], torch.ones(4))
