"""SLAMB and LAMB on FSDP2's sharded parameters equal the unsharded runs.

4 gloo processes: HSDP SLAMB on 2 replicas x 2 shards is SLAMB(hierarchy="node") on 2 nodes x 2 (DDP) and
flat SLAMB on 2 workers whose gradient is each group's mean; FSDP LAMB on 4 shards is DDP LAMB on 4 ranks.
The fused paths (``fused=True``) likewise: HSDP fused SLAMB is flat fused SLAMB, FSDP and HSDP fused LAMB are
DDP fused LAMB, with the multi-tensor paths' masks and bytes.
The model has an unevenly sharded weight (17 rows over 2 shards), a small 2-D always-averaged weight (3 rows)
and 1-D tensors. float64 parameters, so that the momentum's rounding to the wire (fp32, fp16) is the same in
every run; the remaining differences are the order of the norms' sums (a shard's partial sums).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import slamb
from slamb import comm
from tests import distributed

pytestmark = pytest.mark.multiprocess

R, S = 2, 2  # replicas x shards (HSDP); nodes x local ranks (hierarchical)
STEPS = 6
SYNC = 2  # parameter syncs after steps 1, 3, 5; the replicas differ after step 6
CONFIGS = {f"{v}-{name}": dict(variant=v, comm_dtype=dtype)
           for v in ("v1", "v2") for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16))}
# int8 quantises blocks of each rank's packed entries: not the unsharded run's numbers, but its masks
MASK_ONLY = {f"{v}-int8": dict(variant=v, comm_dtype=torch.int8) for v in ("v1", "v2")}
# the fused passes, against the flat fused run and the multi-tensor HSDP run of the same settings
FUSED = {f"{v}-{name}-fused": dict(variant=v, comm_dtype=dtype, fused=True)
         for v, name, dtype in (("v1", "fp32", torch.float32), ("v2", "fp16", torch.float16))}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 17), torch.nn.LayerNorm(17), torch.nn.Tanh(),  # 17 x 6: uneven over 2 shards
        torch.nn.Linear(17, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),  # 3 x 16 = 48 < min_compress_numel: a 2-D always-averaged tensor, 2 + 1 rows
    ).double()


def batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


def loss_of(model, rank, t):
    x, y = batch(rank, t)
    return torch.nn.functional.mse_loss(model(x), y)


def slamb_settings(cfg):
    return dict(lr=0.02, weight_decay=0.01, compress_ratio=0.3, sync_interval=SYNC, min_compress_numel=64,
                beta3=0.9, seed=3, **cfg)


def hsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))


class Traffic:
    """The bytes each collective is handed, by (collective, ranks of its group): what crosses which mesh
    dimension, FSDP's own collectives included."""

    # by torch's newer names; where they are missing (torch 2.11) slamb.comm calls the older ones, counted under
    # the newer names
    NAMES = {"all_reduce": "all_reduce", "all_to_all_single": "all_to_all_single", "broadcast": "broadcast",
             **{new: new if hasattr(dist, new) else old for new, old in (
                 ("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor"))}}

    def __init__(self):
        self.bytes: dict[tuple, int] = {}
        self.saved = {}

    def _wrap(self, name, fn, tensor_arg):
        def counted(*args, **kwargs):
            t = args[tensor_arg] if len(args) > tensor_arg else next(
                kwargs[k] for k in ("input_tensor", "input", "tensor") if k in kwargs)
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            self.bytes[name, ranks] = self.bytes.get((name, ranks), 0) + t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted

    def __enter__(self):
        for name, attr in self.NAMES.items():
            self.saved[attr] = getattr(dist, attr)
            setattr(dist, attr, self._wrap(name, self.saved[attr], 1 if name.endswith("_single") else 0))
        return self

    def __exit__(self, *exc):
        for attr, fn in self.saved.items():
            setattr(dist, attr, fn)


def masks_of(opt):
    """The entries averaged at the last step, per parameter (this rank's shard, flattened)."""
    return opt.last_sync_mask().split(opt._layout.numels)


def hsdp_slamb(rank, cfg):
    model = slamb.shard_model(make_model(), hsdp_mesh(), blocks=(torch.nn.Linear, torch.nn.LayerNorm))
    opt = slamb.SLAMB(model.parameters(), **slamb_settings(cfg))
    model = slamb.wrap_model(model, opt)
    stats, masks = [], []
    with Traffic() as traffic:
        for t in range(1, STEPS + 1):
            opt.zero_grad(set_to_none=True)
            loss_of(model, rank, t).backward()
            opt.step()
            stats.append(opt.comm_stats()["last_step"])
            masks.append(masks_of(opt))
    full = [p.full_tensor().detach().clone() for p in model.parameters()]  # this replica's whole parameters
    slamb.average_model(model)  # the run's model: each shard averaged over its replicas
    averaged = [p.full_tensor().detach().clone() for p in model.parameters()]
    mask = opt._mask_fn
    return {"params": full, "averaged": averaged, "stats": stats, "traffic": traffic.bytes, "masks": masks,
            "cut": mask.gaps.numel() if hasattr(mask, "gaps") else None,
            "compressed": sum(n for n, d in zip(opt._layout.numels, opt._layout.dense) if not d),
            "offsets": opt._layout.global_offsets, "compiled": len(opt._fused.passes.compiled) if opt.fused else 0,
            "shapes": [(tuple(p.shape), tuple(p.to_local().shape)) for p in model.parameters()]}


def node_slamb(rank, cfg):
    model = make_model()
    opt = slamb.SLAMB(model.parameters(), hierarchy="node", local_world_size=S, **slamb_settings(cfg))
    ddp = slamb.wrap_model(model, opt)
    for t in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, rank, t).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def flat_slamb(rank, cfg, peers):
    """Flat SLAMB on R workers; worker r's gradient is the mean of its group's S gradients."""
    model = make_model()
    opt = slamb.SLAMB(model.parameters(), process_group=peers, **slamb_settings(cfg))
    replica, masks = rank // S, []
    for t in range(1, STEPS + 1):
        grads = []
        for member in range(replica * S, (replica + 1) * S):
            model.zero_grad(set_to_none=True)
            loss_of(model, member, t).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / S
        opt.step()
        masks.append(masks_of(opt))
    params = [p.detach().clone() for p in model.parameters()]
    opt.average_parameters()
    return params, masks, [p.detach().clone() for p in model.parameters()]


def lamb_run(rank, model, steps=STEPS, fused=False):
    """The whole parameters after ``steps``, the last step's ledger, the run's ledger totals and the bytes
    handed to each collective during the steps."""
    opt = slamb.LAMB(model.parameters(), lr=0.02, weight_decay=0.01, trust_clamp=(0.01, 10.0), fused=fused)
    wrapped = slamb.wrap_model(model, opt)
    with Traffic() as traffic:
        for t in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            loss_of(wrapped, rank, t).backward()
            opt.step()
    assert not fused or (opt.fused and opt._fused.passes.compiled and opt._fused.passes.failed is None)
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [p.detach().clone() for p in params], opt.comm_stats()["last_step"], opt.comm_stats()["total"], \
        traffic.bytes


def lamb_runs(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    blocks = (torch.nn.Linear, torch.nn.LayerNorm)
    out = {}
    for fused, tag in ((False, ""), (True, "_fused")):
        fsdp, stats, _, _ = lamb_run(rank, slamb.shard_model(make_model(), init_device_mesh("cpu", (world,)),
                                                            blocks=blocks), fused=fused)
        hsdp, _, total, traffic = lamb_run(rank, slamb.shard_model(make_model(), hsdp_mesh(), blocks=blocks),
                                           fused=fused)
        out.update({f"fsdp{tag}": fsdp, f"hsdp{tag}": hsdp, f"ddp{tag}": lamb_run(rank, make_model(), fused=fused)[0],
                    f"norms{tag}": stats.get("norms"), f"hsdp_total{tag}": total, f"hsdp_traffic{tag}": traffic})
    return out


def mixed_precision_runs(rank):
    """HSDP LAMB on fp32 parameters computed in bf16 (FSDP2's ``MixedPrecisionPolicy``) with ``reduce_dtype``
    unset, bf16 and fp32: the ledger's bytes by kind of one step, the bytes handed to the collectives, and the
    entries each reduce-scatter's input holds (every parameter padded to a multiple of the shards, dim 0)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for reduce in (None, torch.bfloat16, torch.float32):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        model = slamb.shard_model(make_model().float(), hsdp_mesh(), blocks=(torch.nn.Linear, torch.nn.LayerNorm),
                                  mp_policy=policy)
        padded = sum(-(-p.shape[0] // S) * S * p.shape[1:].numel() for p in model.parameters())
        opt = slamb.LAMB(model.parameters(), lr=0.02)
        wrapped = slamb.wrap_model(model, opt)
        with Traffic() as traffic:
            x, y = batch(rank, 1)
            torch.nn.functional.mse_loss(wrapped(x.float()).float(), y.float()).backward()
            opt.step()
        out[str(reduce)] = {"kinds": {k: v["payload"] for k, v in opt.comm_stats()["last_step"].items()},
                            "traffic": traffic.bytes, "padded": padded}
    return out


def refusals():
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    model = slamb.shard_model(make_model(), init_device_mesh("cpu", (dist.get_world_size(),)))
    for name in ("dgc", "onebit_lamb", "powersgd", "jointspar", "diloco"):
        try:
            slamb.create_optimizer(name, list(model.parameters()), lr=0.1)
        except ValueError as e:
            out[name] = str(e)
    for kwargs in (dict(overlap=True), dict(foreach=False)):
        try:
            slamb.SLAMB(model.parameters(), **kwargs)
        except ValueError as e:
            out[str(kwargs)] = str(e)
    return out


def worker(rank, world):
    peers = [dist.new_group([r * S + j for r in range(R)]) for j in range(S)][rank % S]
    out = {"slamb": {}, "rank": rank}
    for name, cfg in CONFIGS.items():
        flat, flat_masks, flat_averaged = flat_slamb(rank, cfg, peers)
        out["slamb"][name] = {"hsdp": hsdp_slamb(rank, cfg), "node": node_slamb(rank, cfg), "flat": flat,
                              "flat_masks": flat_masks, "flat_averaged": flat_averaged}
    for name, cfg in MASK_ONLY.items():
        out["slamb"][name] = {"hsdp": hsdp_slamb(rank, cfg), "flat_masks": flat_slamb(rank, cfg, peers)[1]}
    for name, cfg in FUSED.items():
        flat, flat_masks, flat_averaged = flat_slamb(rank, cfg, peers)
        out["slamb"][name] = {"hsdp": hsdp_slamb(rank, cfg), "flat": flat, "flat_masks": flat_masks,
                              "flat_averaged": flat_averaged}
    out["lamb"] = lamb_runs(rank, world)
    out["mixed"] = mixed_precision_runs(rank)
    out["refusals"] = refusals()
    return out


@pytest.fixture(scope="module")
def runs():
    return distributed.run(worker, R * S)


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_hsdp_slamb_equals_hierarchical_and_flat_slamb(runs, config):
    worst = {"node": 0.0, "flat": 0.0}
    for r in runs:
        res = r["slamb"][config]
        for ref in worst:
            worst[ref] = max(worst[ref], max_diff(res["hsdp"]["params"], res[ref]))
    averaged = max(max_diff(r["slamb"][config]["hsdp"]["averaged"], r["slamb"][config]["flat_averaged"]) for r in runs)
    print(f"{config}: max |HSDP - node| = {worst['node']:.3g}, max |HSDP - flat| = {worst['flat']:.3g}, "
          f"averaged models {averaged:.3g}")
    assert worst["node"] < 1e-12 and worst["flat"] < 1e-12 and averaged < 1e-12, (worst, averaged)
    # the replicas differ between syncs (the comparison tells 2 workers from 1), each replica's shards agree
    assert not torch.equal(runs[0]["slamb"][config]["hsdp"]["params"][0], runs[S]["slamb"][config]["hsdp"]["params"][0])
    assert max_diff(runs[0]["slamb"][config]["hsdp"]["params"], runs[1]["slamb"][config]["hsdp"]["params"]) == 0
    shapes = runs[1]["slamb"][config]["hsdp"]["shapes"]
    assert shapes[0] == ((17, 6), (8, 6)) and shapes[-2] == ((3, 16), (1, 16))


@pytest.mark.parametrize("config", list(FUSED))
def test_hsdp_fused_slamb_equals_flat_fused_slamb_with_the_multi_tensor_paths_bytes(runs, config):
    flat = max(max_diff(r["slamb"][config]["hsdp"]["params"], r["slamb"][config]["flat"]) for r in runs)
    averaged = max(max_diff(r["slamb"][config]["hsdp"]["averaged"], r["slamb"][config]["flat_averaged"])
                   for r in runs)
    plain = config.removesuffix("-fused")
    multi = max(max_diff(r["slamb"][config]["hsdp"]["params"], r["slamb"][plain]["hsdp"]["params"]) for r in runs)
    print(f"{config}: max |HSDP fused - flat fused| = {flat:.3g}, averaged models {averaged:.3g}; "
          f"max |HSDP fused - HSDP multi-tensor| = {multi:.3g}")
    assert flat < 1e-12 and averaged < 1e-12, (flat, averaged)
    assert all(r["slamb"][config]["hsdp"]["compiled"] >= 3 for r in runs)  # the passes ran compiled, not eagerly
    assert multi < 1e-6  # the fused passes take their per-tensor scalars in fp32
    assert not torch.equal(runs[0]["slamb"][config]["hsdp"]["params"][0], runs[S]["slamb"][config]["hsdp"]["params"][0])
    for r in runs:  # every kind's bytes at every step, at every level: the multi-tensor path's
        for fused, multi_tensor in zip(r["slamb"][config]["hsdp"]["stats"], r["slamb"][plain]["hsdp"]["stats"]):
            assert set(fused) == set(multi_tensor)
            for kind in fused:
                assert fused[kind]["payload"] == multi_tensor[kind]["payload"] > 0, (kind, fused, multi_tensor)
                assert fused[kind].get("levels") == multi_tensor[kind].get("levels"), kind


@pytest.mark.parametrize("config", [*CONFIGS, *MASK_ONLY, *FUSED])
def test_a_shard_averages_its_slice_of_the_unsharded_models_mask(runs, config):
    for r in runs:
        res = r["slamb"][config]
        hsdp = res["hsdp"]
        for t, (mine, whole) in enumerate(zip(hsdp["masks"], res["flat_masks"]), start=1):
            for i, (m, w, off) in enumerate(zip(mine, whole, hsdp["offsets"])):
                assert torch.equal(m, w[off:off + m.numel()]), (config, r["rank"], t, i)
    if config.startswith("v1"):  # v1's cut keeps a shard's own coordinates only: half a word each
        assert all(r["slamb"][config]["hsdp"]["cut"] == r["slamb"][config]["hsdp"]["compressed"] for r in runs)
    # the compressed tensors' masks select a fraction of the entries, so the slices are not all or nothing
    assert 0 < int(runs[1]["slamb"][config]["hsdp"]["masks"][1][0].sum()) < 8 * 6


@pytest.mark.parametrize("tag", ["", "_fused"])
def test_fsdp_and_hsdp_lamb_equal_ddp_lamb(runs, tag):
    fsdp = max(max_diff(r["lamb"][f"fsdp{tag}"], r["lamb"][f"ddp{tag}"]) for r in runs)
    hsdp = max(max_diff(r["lamb"][f"hsdp{tag}"], r["lamb"][f"ddp{tag}"]) for r in runs)
    print(f"max |FSDP (4 shards) LAMB{tag} - DDP LAMB{tag}| = {fsdp:.3g}, "
          f"max |HSDP (2 x 2) LAMB{tag} - DDP LAMB{tag}| = {hsdp:.3g}")
    assert fsdp < 1e-12 and hsdp < 1e-12
    norms = runs[0]["lamb"][f"norms{tag}"]["levels"]["shard"]
    assert norms["calls"] == 1 and norms["payload"] == 2 * 8 * 8  # one all-reduce per step: (|p|, |u|) per tensor
    if tag:  # the fused path's numbers are the multi-tensor path's, to its fp32 per-tensor scalars
        assert max(max_diff(r["lamb"]["ddp_fused"], r["lamb"]["ddp"]) for r in runs) < 1e-6


def test_hsdp_lamb_ledger_holds_fsdps_collectives_by_mesh_dimension(runs):
    """FSDP's own all-gathers, reduce-scatters and HSDP all-reduce are in LAMB's ledger at the level of the
    mesh dimension they cross, byte for byte what the collectives are handed."""
    for r in runs:
        rank = r["rank"]
        replicas = tuple(rank % S + S * i for i in range(R))
        shard = tuple(range(rank - rank % S, rank - rank % S + S))
        crossed = {}
        for (op, ranks), nbytes in r["lamb"]["hsdp_traffic"].items():
            key = "replicate" if ranks == replicas else "shard" if ranks == shard else "world"
            crossed[key, op] = crossed.get((key, op), 0) + nbytes
        total = r["lamb"]["hsdp_total"]
        level = {lv: sum(v.get("levels", {}).get(lv, {}).get("payload", 0) for k, v in total.items() if k != "all")
                 for lv in ("replicate", "shard")}
        assert crossed["replicate", "all_reduce"] == total["grads"]["levels"]["replicate"]["payload"] \
            == level["replicate"] > 0
        assert crossed["shard", "all_gather_single"] == total["fsdp_all_gather"]["levels"]["shard"]["payload"] > 0
        assert crossed["shard", "reduce_scatter_single"] == total["fsdp_reduce_scatter"]["payload"] > 0
        assert sum(b for (key, _), b in crossed.items() if key == "shard") == level["shard"]


def test_a_mixed_precision_policy_without_reduce_dtype_reduces_in_param_dtype(runs):
    """FSDP2 reduces a bf16-computed model's gradients in bf16 where the policy leaves ``reduce_dtype`` unset,
    on every torch (torch 2.15 alone would reduce them in the parameters' fp32): the reduce-scatters' and the
    replicas' all-reduce bytes are bf16's, as ``reduce_dtype=bfloat16``'s, half of ``reduce_dtype=float32``'s."""
    for r in runs:
        unset, bf16, fp32 = (r["mixed"][str(d)] for d in (None, torch.bfloat16, torch.float32))
        assert unset["kinds"] == bf16["kinds"] and unset["traffic"] == bf16["traffic"], (unset, bf16)
        assert unset["kinds"]["fsdp_reduce_scatter"] == 2 * unset["padded"]
        assert fp32["kinds"]["fsdp_reduce_scatter"] == 2 * unset["kinds"]["fsdp_reduce_scatter"]
        assert fp32["kinds"]["grads"] == 2 * unset["kinds"]["grads"] > 0  # the all-reduce over the replicas
        for kind in ("fsdp_all_gather", "norms"):  # the parameters are gathered in bf16 either way
            assert fp32["kinds"][kind] == unset["kinds"][kind]


def test_shard_model_hands_fully_shard_a_policy_whose_reduce_dtype_is_set(monkeypatch):
    """What each ``fully_shard`` call is given, on any torch (the worker run above tells the bytes only where the
    torch installed would reduce otherwise): an unset ``reduce_dtype`` becomes ``param_dtype``, the policy's other
    fields kept; one the caller set, a policy without ``param_dtype`` and no policy at all go through as given."""
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy as Policy

    given = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, mesh=None, **kwargs: given.append(kwargs))
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    cases = [(Policy(param_dtype=bf16), Policy(param_dtype=bf16, reduce_dtype=bf16)),
             (Policy(param_dtype=fp16, output_dtype=fp32, cast_forward_inputs=False),
              Policy(param_dtype=fp16, reduce_dtype=fp16, output_dtype=fp32, cast_forward_inputs=False)),
             (Policy(param_dtype=bf16, reduce_dtype=fp32), Policy(param_dtype=bf16, reduce_dtype=fp32)),
             (Policy(), Policy())]
    if "param_dtype_override_fn" in Policy.__dataclass_fields__:  # torch 2.15: some parameters keep their dtype
        keep = Policy(param_dtype=bf16, param_dtype_override_fn=lambda p: p.dtype if p.dim() == 1 else None)
        cases.append((keep, keep))
    for policy, expected in cases:
        given.clear()
        slamb.shard_model(make_model(), None, blocks=torch.nn.Linear, mp_policy=policy, reshard_after_forward=False)
        assert len(given) == 4 and all(kw == {"mp_policy": expected, "reshard_after_forward": False}
                                       for kw in given), (policy, given)
    given.clear()
    slamb.shard_model(make_model(), None, blocks=torch.nn.Linear)
    assert given == [{}] * 4


def test_replicate_dimension_carries_exactly_the_ledger(runs):
    for r in runs:
        rank = r["rank"]
        replicas = tuple(rank % S + S * i for i in range(R))
        shard = tuple(range(rank - rank % S, rank - rank % S + S))
        for config, res in r["slamb"].items():  # int8 included
            stats = res["hsdp"]["stats"]
            ledger = {level: sum(s[k].get("levels", {}).get(level, {}).get("payload", 0) for s in stats
                                 for k in s if k != "all")
                      for level in ("replicate", "shard", "world")}
            crossed = {}
            for (op, ranks), nbytes in res["hsdp"]["traffic"].items():
                key = "replicate" if ranks == replicas else "shard" if ranks == shard else "world"
                crossed[key, op] = crossed.get((key, op), 0) + nbytes
            # across the replicas: the exchange and the syncs, nothing else (FSDP's gradient all-reduce is off)
            assert sum(b for (key, _), b in crossed.items() if key == "replicate") == ledger["replicate"], crossed
            # inside the replica: FSDP's all-gathers and reduce-scatters, and the norms (4 per tensor, one call),
            # every one of them in the ledger at level "shard"
            assert {op for key, op in crossed if key == "shard"} == {"all_reduce", "all_gather_single",
                                                                     "reduce_scatter_single"}
            assert sum(b for (key, _), b in crossed.items() if key == "shard") == ledger["shard"], crossed
            assert crossed["shard", "all_reduce"] == STEPS * 4 * 8 * 8
            kinds = ("norms", "fsdp_all_gather", "fsdp_reduce_scatter")
            by_kind = {k: sum(s[k]["levels"]["shard"]["payload"] for s in stats) for k in kinds}
            assert by_kind == dict(zip(kinds, (crossed["shard", op] for op in ("all_reduce", "all_gather_single",
                                                                                "reduce_scatter_single"))))
            assert crossed["world", "all_reduce"] == ledger["world"]  # the step's decision, 4 bytes
            for s in stats:
                assert s["norms"]["calls"] == 1
                assert s["momentum"]["levels"]["replicate"]["calls"] == (1 if "int8" not in config else 4)
            if rank == 0:
                print(f"{config}, rank 0, bytes handed per step (mean of {STEPS}): "
                      + ", ".join(f"{key} {op} {b / STEPS:.0f}" for (key, op), b in sorted(crossed.items())))


def test_other_optimizers_and_paths_refuse_sharded_parameters_in_one_line(runs):
    refused = runs[0]["refusals"]
    for name in ("dgc", "onebit_lamb", "powersgd", "jointspar", "diloco"):
        assert "takes no sharded" in refused[name] and "SLAMB or LAMB" in refused[name], refused
        assert "\n" not in refused[name]
    for kwargs in ("{'overlap': True}", "{'foreach': False}"):
        assert "takes no sharded" in refused[kwargs] and "multi-tensor and fused paths" in refused[kwargs]


def gathers_per_step(rank, world):
    """What each fused step copies into its flat buffers (the gradients, a shard's parameters), by buffer, and
    what it reads from the host or copies from it (:func:`tests.test_gpu_paths.host_reads`), on FSDP2 shards and
    on a DDP replica, both non-finite settings, gradients set to None between steps."""
    from torch.distributed.device_mesh import init_device_mesh

    from slamb.optim.fused import FlatStep
    from tests.test_gpu_paths import host_reads

    copied = []
    real = FlatStep._cat

    def spied(self, tensors, out):
        copied.append("grad" if out is self.grad else "param")
        return real(self, tensors, out)

    FlatStep._cat = spied
    builds = {"slamb": lambda ps, check: slamb.SLAMB(ps, lr=0.02, min_compress_numel=64, fused=True, nonfinite=check),
              "lamb": lambda ps, check: slamb.LAMB(ps, lr=0.02, fused=True, nonfinite=check)}
    out = {}
    for name, build in builds.items():
        for check in ("raise", "ignore"):
            for sharded in (True, False):
                model = make_model()
                if sharded:
                    model = slamb.shard_model(model, init_device_mesh("cpu", (world,)),
                                              blocks=(torch.nn.Linear, torch.nn.LayerNorm))
                opt = build(model.parameters(), check)
                wrapped = slamb.wrap_model(model, opt)
                steps, reads = [], []
                for t in range(1, 4):
                    opt.zero_grad(set_to_none=True)
                    loss_of(wrapped, rank, t).backward()
                    copied.clear()
                    with pytest.MonkeyPatch.context() as m:
                        reads.append(host_reads(opt.step, m))
                    steps.append(sorted(copied))
                out[name, check, sharded] = steps, reads[1:]  # the first step builds the layout
    FlatStep._cat = real
    return out


@pytest.fixture(scope="module")
def gathers():
    return distributed.run(gathers_per_step, 2)


def test_a_fused_step_gathers_its_gradients_once(gathers):
    """The non-finite screen, the exchange and the update read one gather of the gradients: FSDP2's gradient
    shards stay FSDP's tensors (not views of the flat buffer), and each gather of them would copy a word per
    parameter again (SLAMB copied them 3 times a step, LAMB twice). A shard's parameters are copied in once."""
    for rank_out in gathers:
        for (name, check, sharded), (steps, _) in rank_out.items():
            assert steps == [["grad", "param"] if sharded else ["grad"]] * 3, (name, check, sharded, steps)


def test_a_sharded_fused_step_reads_and_copies_from_the_host_what_a_replicas_does(gathers):
    """A shard's step makes the host reads of a DDP replica's step and no more (docs/gpu.md, "Host
    synchronisations"): its draw's runs are placed on the device (two blocking copies to the device before)."""
    for rank_out in gathers:
        for (name, check, sharded), (_, reads) in rank_out.items():
            if sharded:
                assert reads == rank_out[name, check, False][1], (name, check, reads)
