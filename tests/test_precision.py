"""Optimizer state under bf16 parameters, and the split norms of SLAMB's paths.

In bf16 an EMA with beta2 = 0.999 cannot decay: 0.1% per step is below half an ulp. After the
gradient drops 100x at step 10, a v kept in bf16 is 2.7x the exact EMA at step 1,000 (a momentum
near 1 stalls the same way). The state must be fp32 and follow the float64 recursion.
"""
from __future__ import annotations

import io

import pytest
import torch

import slamb
from tests import distributed

STEPS = 1000
DROP = 10  # the gradient is 100x smaller after this step


@pytest.fixture(autouse=True)
def one_thread():
    # 1,000 steps of tensors this small: on a loaded machine, waking the intra-op pool costs more than the step
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def adam_v(v, g, mu):
    return mu * v + (1 - mu) * g * g


def heavy_ball(u, g, mu):
    return mu * u + g


# (optimizer, its settings, the state entry, the recursion it follows in exact arithmetic, its factor)
CASES = {
    "lamb": (slamb.LAMB, {}, "exp_avg_sq", adam_v, 0.999),
    "lamb-reference": (slamb.LAMB, dict(foreach=False), "exp_avg_sq", adam_v, 0.999),
    "lamb-fused": (slamb.LAMB, dict(fused=True), "exp_avg_sq", adam_v, 0.999),
    **{f"slamb-{variant}{name}": (slamb.SLAMB, dict(variant=variant, min_compress_numel=100, **kw), "exp_avg_sq",
                                  adam_v, 0.999)
       for variant in ("v1", "v2")
       for name, kw in (("", {}), ("-reference", dict(foreach=False)), ("-fused", dict(fused=True)))},
    "onebit-warmup": (slamb.OnebitLamb, dict(freeze_step=STEPS + 1), "exp_avg_sq", adam_v, 0.999),
    # after the freeze the fresh v goes on from v with the gradient recovered from m
    **{f"onebit-compression{name}": (slamb.OnebitLamb, dict(freeze_step=5, **kw), "exp_avg_sq_fresh", adam_v, 0.999)
       for name, kw in (("", {}), ("-reference", dict(foreach=False)))},
    "diloco-lamb": (slamb.DiLoCo, dict(inner="lamb", sync_interval=7), "exp_avg_sq", adam_v, 0.999),
    "dgc": (slamb.DGC, dict(momentum=0.99, density=1.0, warmup_densities=()), "momentum", heavy_ball, 0.99),
    **{f"jointspar{name}": (slamb.JointSpar, dict(momentum=0.99, kappa=1.0, p_min=1.0, dist_lr=0.0, **kw),
                            "momentum_buffer", heavy_ball, 0.99)
       for name, kw in (("", {}), ("-reference", dict(foreach=False)))},
    "powersgd": (slamb.PowerSGD, dict(momentum=0.99), "momentum_buffer", heavy_ball, 0.99),
}


@pytest.mark.parametrize("case", list(CASES))
def test_state_of_bf16_parameters_follows_the_exact_recursion(case):
    cls, kw, key, recursion, mu = CASES[case]
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(24, 16, generator=gen) * 0.5).bfloat16())
    bias = torch.nn.Parameter((torch.randn(16, generator=gen) * 0.5).bfloat16())
    opt = cls([weight, bias], lr=1e-4, **kw)
    g0 = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in (weight, bias)]
    exact = [torch.zeros_like(g) for g in g0]
    for t in range(1, STEPS + 1):
        if cls is slamb.JointSpar:
            opt.sample_round()
        for i, p in enumerate((weight, bias)):
            p.grad = (g0[i] * (1.0 if t <= DROP else 0.01)).bfloat16()
            exact[i] = recursion(exact[i], p.grad.double(), mu)
        opt.step()
    for p, want in zip((weight, bias), exact):
        got = opt.state[p][key]
        ratio = got.double() / want
        assert float((ratio - 1).abs().max()) <= 0.05, (case, float(ratio.min()), float(ratio.max()))
        assert got.dtype == torch.float32, case
    assert weight.dtype == torch.bfloat16 and bool(torch.isfinite(weight.float()).all())


@pytest.mark.parametrize("cls, kw", [(slamb.LAMB, {}), (slamb.LAMB, dict(foreach=False)),
                                     (slamb.SLAMB, dict(variant="v1", min_compress_numel=100)),
                                     (slamb.SLAMB, dict(variant="v2", min_compress_numel=100, foreach=False))])
def test_bf16_update_is_the_fp32_update_rounded_once(cls, kw):
    """With bf16-exact gradients, a bf16 parameter's step is the fp32 step of the same state rounded once."""
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(24, 16, generator=gen).bfloat16()
    grads = [torch.randn(24, 16, generator=gen).bfloat16() for _ in range(5)]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        p = torch.nn.Parameter(init.to(dtype))
        opt = cls([p], lr=1e-2, weight_decay=0.01, **kw)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
            p.data = p.data.bfloat16().to(dtype)  # the fp32 run rounded as a bf16 parameter is
        out.append(p.detach().float())
    assert torch.equal(*out)


@pytest.mark.parametrize("name", ["lamb", "slamb", "onebit_lamb", "dgc", "jointspar", "powersgd", "diloco"])
def test_a_state_saved_in_bf16_loads_promoted_to_fp32(name):
    """Checkpoints of the versions that kept the state in the parameters' dtype still load."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2)).bfloat16()
    kw = dict(lr=1e-3, **({"inner": "lamb"} if name == "diloco" else {}))  # inner AdamW is torch's own
    opt = slamb.create_optimizer(name, model, **kw)

    def step(o):
        if name == "jointspar":
            o.sample_round()
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        o.step()

    for _ in range(2):
        step(opt)
    if name == "jointspar":
        opt.unfreeze()  # the layers of the fresh optimizer are those with requires_grad
    sd = opt.state_dict()
    old = {k: {key: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() and key != "step" else v
               for key, v in s.items()} for k, s in sd["state"].items()}
    buf = io.BytesIO()
    torch.save({**sd, "state": old}, buf)
    buf.seek(0)
    fresh = slamb.create_optimizer(name, model, **kw)
    fresh.load_state_dict(torch.load(buf, weights_only=False))
    floating = [v for s in fresh.state.values() for key, v in s.items()
                if torch.is_tensor(v) and v.is_floating_point() and key != "step"]
    assert floating and all(v.dtype == torch.float32 for v in floating)
    step(fresh)  # and it steps


# -- split norms: SLAMB's paths where the averaged entries dominate the direction ----------------------------

ROWS, COLS = 64, 16
SPLIT_STEPS = 6


def split_worker(rank, world, variant):
    """Each rank's gradient is zero on the other rank's half of the rows (an embedding whose rows one rank's
    data never touches): there m_avg / (sqrt(v_local) + eps) is large and |u_S| near |u|. beta3 = 0.5 gives
    the stale entries' trust ratio, which weighs (1 - r), a share of the step that shows its error."""
    out = {}
    for path, kw in (("reference", dict(foreach=False)), ("foreach", {}), ("fused", dict(fused=True))):
        gen = torch.Generator().manual_seed(3)
        emb = torch.nn.Parameter(torch.randn(ROWS, COLS, generator=gen) * 0.1)
        start = emb.detach().clone()
        opt = slamb.SLAMB([emb], lr=1e-2, variant=variant, compress_ratio=0.25, min_compress_numel=100,
                          sync_interval=1000, weight_decay=0.01, beta3=0.5, **kw)
        mine = torch.zeros(ROWS, 1)
        mine[rank * ROWS // 2:(rank + 1) * ROWS // 2] = 1.0
        for t in range(SPLIT_STEPS):
            g = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(100 * rank + t))
            emb.grad = g * mine
            opt.step()
        out[path] = (emb.detach() - start)[mine.flatten().bool()]
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_split_norms_do_not_cancel_when_the_averaged_entries_dominate(variant):
    for rank, run in enumerate(distributed.run(split_worker, 2, variant)):
        ref = run["reference"]
        for path in ("foreach", "fused"):
            err = float((run[path] - ref).norm() / ref.norm())
            assert err <= 1e-5, (variant, rank, path, err)
