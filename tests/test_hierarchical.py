"""SLAMB(hierarchy="node"): N nodes x L processes are flat SLAMB on N workers whose gradient is the mean of
each node's L gradients; every rank of a node holds the same parameters; the exchange crosses the nodes once,
each local rank carrying 1/L of it."""
from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist

import slamb
from slamb import checkpoint
from slamb.topology import node_topology
from tests import distributed
from tests.test_slamb import SHAPES, SYNC, T, init_params, grad_of, make_optimizer

L = 2  # processes per node; 4 processes = 2 nodes
STEPS = 9


class Quadratic(torch.nn.Module):
    """Parameters whose gradient is test_slamb's grad_of: 0.1 p + noise(rank, step, i)."""

    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(p) for p in init_params())

    def forward(self, noises):
        return sum(0.05 * p.square().sum() + (n * p).sum() for p, n in zip(self.ps, noises))


def noises(rank, t):
    return [grad_of(torch.zeros(s, dtype=torch.float64), rank, t, i) for i, s in enumerate(SHAPES)]


def hierarchical_run(rank, cfg, steps, *, state=None, start=1):
    model = Quadratic()
    opt = make_optimizer(list(model.ps), hierarchy="node", local_world_size=L, **cfg)
    ddp = slamb.wrap_model(model, opt, bucket_cap_mb=0.05)  # several buckets
    if state is not None:
        with torch.no_grad():
            for p, s in zip(model.ps, state["model"]):
                p.copy_(s)
        opt.load_state_dict(state["optim"])
    history = []
    for t in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        ddp(noises(rank, t)).backward()
        opt.step()
        history.append({"params": [p.detach().clone() for p in model.ps],
                        "stats": opt.comm_stats()["last_step"]})
    return model, opt, history


def hierarchy_worker(rank, world, cfg):
    node, local = divmod(rank, L)
    out = {}
    # the flat reference: 2 workers (this local rank's peers on the other nodes), gradient = the node's mean
    peers = [dist.new_group([n * L + j for n in range(world // L)]) for j in range(L)][local]
    params = [torch.nn.Parameter(p) for p in init_params()]
    flat = make_optimizer(params, process_group=peers, **{k: v for k, v in cfg.items() if k != "overlap"})
    out["flat"] = []
    for t in range(1, STEPS + 1):
        for i, p in enumerate(params):
            p.grad = sum(grad_of(p.detach(), node * L + j, t, i) for j in range(L)) / L
        flat.step()
        out["flat"].append({"params": [p.detach().clone() for p in params],
                            "selected": int(flat.last_sync_mask().sum()),
                            "stats": flat.comm_stats()["last_step"]})

    model, opt, out["hier"] = hierarchical_run(rank, cfg, STEPS)
    out["n"] = dist.get_world_size() // L
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.ps}
    out["grad_memory"] = (len(storages), sum(storages.values()), sum(p.grad.nbytes for p in model.ps))

    # checkpoint at step 4, resume on fresh objects, continue to the end
    model, opt, _ = hierarchical_run(rank, cfg, 4)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in model.ps], "optim": opt.state_dict()}, buf)
    out["file"] = checkpoint.optimizer_file(opt, "ckpt").name
    buf.seek(0)
    _, _, rest = hierarchical_run(rank, cfg, STEPS - 4, state=torch.load(buf, weights_only=False), start=5)
    out["resumed"] = rest[-1]["params"]

    try:
        node_topology(local_world_size=3)
    except ValueError as e:
        out["indivisible"] = str(e)
    return out


CONFIGS = {
    "v2": dict(variant="v2", compress_ratio=0.3, sync_interval=SYNC),
    "v1-overlap": dict(variant="v1", compress_ratio=0.25, sync_interval=SYNC, overlap=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request):
    return request.param, distributed.run(hierarchy_worker, 2 * L, CONFIGS[request.param])


@pytest.mark.multiprocess
def test_hierarchical_equals_flat_slamb_on_the_nodes_mean_gradients(runs):
    _, res = runs
    worst = 0.0
    for r in res:
        for h, f in zip(r["hier"], r["flat"]):
            for a, b in zip(h["params"], f["params"]):
                worst = max(worst, float((a - b).abs().max()))
    assert worst < 1e-12, worst  # float64: the same arithmetic up to the order of the sums
    assert res[0]["n"] == 2
    # the nodes drift between syncs (otherwise the comparison above could not tell n = 1 from n = 2)
    assert not torch.equal(res[0]["hier"][2]["params"][0], res[L]["hier"][2]["params"][0])


@pytest.mark.multiprocess
def test_every_rank_of_a_node_holds_the_same_parameters_after_every_step(runs):
    _, res = runs
    for node in range(2):
        for t in range(STEPS):
            for j in range(1, L):
                for a, b in zip(res[node * L]["hier"][t]["params"], res[node * L + j]["hier"][t]["params"]):
                    assert torch.equal(a, b)


@pytest.mark.multiprocess
def test_inter_node_momentum_bytes_are_the_selection_split_over_the_local_ranks(runs):
    name, res = runs
    numel = sum(math.prod(s) for s in SHAPES)
    dense = sum(math.prod(s) for s in SHAPES if len(s) == 1 or math.prod(s) < T)
    for r in res:
        for t, (h, f) in enumerate(zip(r["hier"], r["flat"]), start=1):
            # each part of the exchange is cut into L chunks of its own
            for part, entries in (("momentum_dense", dense), ("momentum", f["selected"] - dense)):
                levels = h["stats"][part]["levels"]
                inter, intra = levels["inter"], levels["intra"]
                assert inter["wire"] == inter["payload"] * 2 * (2 - 1) / 2  # a ring all-reduce over 2 nodes
                assert intra["payload"] == inter["payload"]  # the all-gather of the node's chunks
                if "overlap" in name:  # one exchange per DDP bucket, each padded to L chunks on its own
                    calls = inter["calls"]
                    assert entries * 8 / L <= inter["payload"] <= (entries / L + calls) * 8
                else:
                    assert inter["payload"] == -(-entries // L) * 8  # float64
                assert f["stats"][part]["payload"] == entries * 8
            grads = h["stats"]["grads"]
            assert set(grads["levels"]) == {"intra"} and grads["payload"] == numel * 8
            if (t - 1) % SYNC == 0:
                assert h["stats"]["params"]["levels"]["inter"]["payload"] == -(-numel // L) * 8
            else:
                assert "params" not in h["stats"]


@pytest.mark.multiprocess
def test_resume_continues_bit_for_bit_and_every_rank_keeps_its_own_file(runs):
    _, res = runs
    for r in res:
        for a, b in zip(r["hier"][-1]["params"], r["resumed"]):
            assert torch.equal(a, b)
    assert [r["file"] for r in res] == [f"optimizer.rank{i}-of-4.pt" for i in range(4)]


@pytest.mark.multiprocess
def test_ddp_keeps_no_second_copy_of_the_gradients(runs):
    for r in runs[1]:
        storages, storage_bytes, grad_bytes = r["grad_memory"]
        # the gradients live in DDP's buckets (fewer allocations than tensors) and nothing else holds them
        assert storages < len(SHAPES) and storage_bytes == grad_bytes
    assert "4 ranks do not split into nodes of local_world_size=3" in runs[1][0]["indivisible"]


def test_invalid_hierarchy_is_one_clear_error():
    params = [torch.nn.Parameter(p) for p in init_params()]
    with pytest.raises(ValueError, match="hierarchy"):
        make_optimizer(params, hierarchy="rack")
