"""comm_dtype=torch.int8: the momentum average sent as int8 with one scale per chunk stays within its
quantisation bound of the float32 average, is the same on every rank, and costs the bytes of its formula."""
from __future__ import annotations

import math

import pytest
import torch

import slamb
from slamb import comm
from tests import distributed
from tests.test_hierarchical import L, hierarchical_run
from tests.test_slamb import SYNC, OverlapNet

pytestmark = pytest.mark.multiprocess

N = 4
D = 10_007  # not a multiple of N: the last chunk is padded


def momentum_like(rank: int) -> torch.Tensor:
    """Adam-momentum-shaped values: blocks ("layers") of scales spread over three decades, heavy-tailed
    entries (Student-t, 3 degrees of freedom), a component shared by the workers plus each one's own."""
    shared = torch.Generator().manual_seed(7)
    scales = torch.exp(torch.empty(11).uniform_(math.log(1e-5), math.log(1e-2), generator=shared))
    scale = scales.repeat_interleave(-(-D // 11))[:D]
    t = torch.distributions.StudentT(3.0)
    torch.manual_seed(7)
    common = t.sample((D,))
    torch.manual_seed(100 + rank)
    return scale * (common + 0.5 * t.sample((D,)))


def exchange_worker(rank, world):
    out = {"x": momentum_like(rank)}
    for name, dtype in (("fp32", None), ("fp16", torch.float16), ("int8", torch.int8)):
        ledger = comm.CommLedger()
        out[name] = comm.all_reduce_mean_(out["x"].clone(), kind="momentum", ledger=ledger, comm_dtype=dtype)
        ledger.end_step()
        out[name + "_stats"] = ledger.summary()["last_step"]
    work = comm.all_reduce_mean_(out["x"].clone(), kind="momentum", ledger=None, comm_dtype=torch.int8,
                                 async_op=True)
    out["int8_async"] = work.wait()
    return out


def test_int8_mean_is_within_its_bound_identical_on_every_rank_and_costs_its_formula():
    res = distributed.run(exchange_worker, N)
    xs = torch.stack([r["x"] for r in res])
    exact = xs.double().mean(0)
    b = 256  # entries per scale
    c = b * math.ceil(D / (N * b))  # entries per rank's chunk: whole blocks
    padded = torch.zeros(N, N * c, dtype=torch.float64)
    padded[:, :D] = xs.double()
    # rank i's scale of each block, and (an upper bound on) the scale of the averaged block: its largest
    # entry moved by at most the first rounding, mean_i(s_i) / 2
    s = padded.view(N, -1, b).abs().amax(2) / 127
    mean_padded = torch.zeros(N * c, dtype=torch.float64)
    mean_padded[:D] = exact
    s_avg = (mean_padded.view(-1, b).abs().amax(1) + s.mean(0) / 2) / 127
    bound = (s.mean(0) / 2 + s_avg / 2).repeat_interleave(b)[:D]
    for r in res:
        assert torch.equal(r["int8"], res[0]["int8"]) and torch.equal(r["int8_async"], r["int8"])
        err = (r["int8"].double() - exact).abs()
        assert bool((err <= bound * (1 + 1e-5)).all()), float((err / bound).max())
        # the bound is not loose: some entry comes within a fifth of it
        assert float((err / bound).max()) > 0.2
        stats = r["int8_stats"]
        assert stats["momentum"]["payload"] == N * c + c  # int8 values: the all-to-all, then the all-gather
        assert stats["scales"]["payload"] == 4 * (N * c + c) // b  # a float32 scale per block, both ways
        assert stats["momentum"]["wire"] == N * c * (N - 1) / N + c * (N - 1)
        assert r["fp32_stats"]["momentum"]["payload"] == 4 * D and r["fp16_stats"]["momentum"]["payload"] == 2 * D
    # int8 rounds where fp16 keeps three digits: RMS errors relative to the average's RMS
    rms = exact.square().mean().sqrt()
    rel = {name: float((res[0][name].double() - exact).square().mean().sqrt() / rms) for name in ("fp16", "int8")}
    assert rel["fp16"] < 1e-3 < rel["int8"] < 2e-2, rel


def slamb_worker(rank, world):
    out = {}
    for name, dtype, overlap in (("fp32", None, False), ("int8", torch.int8, False), ("int8-overlap", torch.int8, True)):
        torch.manual_seed(0)
        model = OverlapNet()
        out["init"] = [p.detach().clone() for p in model.parameters()]
        opt = slamb.SLAMB(model.parameters(), lr=0.01, weight_decay=0.01, compress_ratio=0.2, sync_interval=SYNC,
                          comm_dtype=dtype, overlap=overlap)
        ddp = slamb.wrap_model(model, opt, bucket_cap_mb=0.05)
        steps = []
        for t in range(1, 7):
            gen = torch.Generator().manual_seed(1000 * rank + t)
            x = torch.randn(8, 100, generator=gen)
            opt.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            opt.step()
            steps.append({"params": [p.detach().clone() for p in model.parameters()],
                          "selected": int(opt.last_sync_mask().sum()), "stats": opt.comm_stats()["last_step"]})
        out[name] = steps
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        out[name + "_storages"] = len(storages)
    return out


def test_slamb_with_int8_exchange_plain_and_overlapped():
    res = distributed.run(slamb_worker, 2)
    n = 2
    dense = sum(p.numel() for p in OverlapNet().parameters() if p.dim() == 1 or p.numel() < 9000)
    for r in res:
        for t, step in enumerate(r["int8"], start=1):
            # each part its own quantised mean: int8 values and a float32 scale per block, both ways
            for part, entries in (("momentum_dense", dense), ("momentum", step["selected"] - dense)):
                c, b = comm.int8_layout(entries, n)
                assert step["stats"][part]["payload"] == (n * c + c) + 4 * (n * c + c) // b
            assert "scales" not in step["stats"]
        # overlapped: one exchange per DDP bucket, the same entries
        for part in ("momentum", "momentum_dense"):
            total = sum(s["stats"][part]["payload"] for s in r["int8-overlap"])
            plain = sum(s["stats"][part]["payload"] for s in r["int8"])
            assert 0 <= total - plain <= 6 * 3 * (n + 1) * 260  # each bucket pads its own chunks (and scales)
        # against the float32 exchange's run, relative to how far that run moved the parameters
        moved = torch.cat([(a - b).reshape(-1) for a, b in zip(r["fp32"][-1]["params"], r["init"])]).norm()
        for name in ("int8", "int8-overlap"):
            drift = torch.cat([(a - b).reshape(-1) for a, b in zip(r[name][-1]["params"],
                                                                   r["fp32"][-1]["params"])]).norm() / moved
            assert 0 < drift < 0.05, (name, float(drift))
        # the gradients are DDP's buckets (3 buckets for 6 tensors), no second copy
        assert r["int8_storages"] < 6 and r["int8-overlap_storages"] < 6
    for name in ("int8", "int8-overlap"):  # sync steps (1 and 5) leave the ranks identical
        for a, b in zip(res[0][name][4]["params"], res[1][name][4]["params"]):
            assert torch.equal(a, b)
        assert not torch.equal(res[0][name][5]["params"][0], res[1][name][5]["params"][0])


def hierarchy_int8_worker(rank, world):
    return hierarchical_run(rank, dict(variant="v2", compress_ratio=0.3, sync_interval=SYNC,
                                       comm_dtype=torch.int8), 5)[2]


def test_int8_exchange_across_nodes():
    res = distributed.run(hierarchy_int8_worker, 2 * L)
    for node in range(2):
        for t in range(5):
            for a, b in zip(res[node * L][t]["params"], res[node * L + 1][t]["params"]):
                assert torch.equal(a, b)
    for part in ("momentum", "momentum_dense"):
        levels = res[0][1]["stats"][part]["levels"]
        # the int8 exchange runs over the nodes (2 of them) on 1/L of the part's entries; the node gathers float64
        c, b = comm.int8_layout(levels["intra"]["payload"] // 8, 2)
        assert levels["inter"] == {"payload": (2 * c + c) + 4 * 3 * c // b, "wire": (c + 1 * c) + 4 * 2 * c // b,
                                   "calls": 4}
