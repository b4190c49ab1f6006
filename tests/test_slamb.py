"""SLAMB against an independent per-element implementation of the spec, across ranks.

The simulation below is written from docs/algorithm.md alone (numpy, float64,
all n workers in one process); the optimizer runs in real gloo processes in
float64, so the two agree to ~1e-12 and any departure from the spec shows.
"""
from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch

import slamb
from tests import distributed

SHAPES = [(100, 120), (20, 30), (30,), (60, 160)]  # compressed, small dense, 1-D, compressed
GROUPS = [  # per-group settings the optimizer must honour
    dict(idx=[0, 2], lr=0.01, betas=(0.9, 0.999), weight_decay=0.01, beta3=0.9),
    dict(idx=[1, 3], lr=0.02, betas=(0.8, 0.99), weight_decay=0.0, beta3=0.7),
]
T = 9000
STEPS = 11


def init_params():
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(s, generator=gen, dtype=torch.float64) * 0.5 for s in SHAPES]


def grad_of(p, rank, step, i):
    """A gradient that depends on the parameter (so drift between syncs matters) and on the rank."""
    gen = torch.Generator().manual_seed(100_000 * rank + 100 * step + i)
    return 0.1 * p + torch.randn(p.shape, generator=gen, dtype=torch.float64)


def make_optimizer(params, **kw):
    groups = [{"params": [params[i] for i in g["idx"]], **{k: v for k, v in g.items() if k != "idx"}}
              for g in GROUPS]
    return slamb.SLAMB(groups, min_compress_numel=T, **kw)


def layout_order():
    return [i for g in GROUPS for i in g["idx"]]


# ----------------------------------------------------------------------------- workers


def trajectory_worker(rank, world, configs):
    out = []
    for cfg in configs:
        params = [torch.nn.Parameter(p) for p in init_params()]
        opt = make_optimizer(params, **cfg)
        steps = []
        for t in range(1, STEPS + 1):
            for i, p in enumerate(params):
                p.grad = grad_of(p.detach(), rank, t, i)
            opt.step()
            steps.append({
                "params": [p.detach().clone() for p in params],
                "mask": opt.last_sync_mask().clone(),
                "bytes": {k: v["payload"] for k, v in opt.comm_stats()["last_step"].items()},
            })
        out.append(steps)
    return out


# ----------------------------------------------------------------------------- the spec


def spec_run(variant, n, masks, lr_scale=1.0, eps=1e-6, c_min=0.01, c_max=1000.0):
    """All n workers of SLAMB, element by element as the spec states it. Returns params[step][rank]."""
    order = layout_order()
    sizes = [int(np.prod(SHAPES[i])) for i in order]
    offsets = np.cumsum([0] + sizes)
    group_of = {i: g for g in GROUPS for i in g["idx"]}
    p = [[x.numpy().copy() for x in init_params()] for _ in range(n)]
    m = [[np.zeros(s) for s in SHAPES] for _ in range(n)]
    v = [[np.zeros(s) for s in SHAPES] for _ in range(n)]
    age = [[np.zeros(s) if variant == "v1" else np.ones(s) for s in SHAPES] for _ in range(n)]
    history = []
    for t in range(1, STEPS + 1):
        flat_mask = masks[t - 1].numpy()
        sel = {}
        for k, i in enumerate(order):
            sel[i] = flat_mask[offsets[k]:offsets[k + 1]].reshape(SHAPES[i])
            if len(SHAPES[i]) == 1 or sizes[k] < T:
                assert sel[i].all(), "dense tensors must always be averaged"
        for w in range(n):
            for i in range(len(SHAPES)):
                b1, b2 = group_of[i]["betas"]
                g = grad_of(torch.from_numpy(p[w][i]), w, t, i).numpy()
                m[w][i] = b1 * m[w][i] + (1 - b1) * g
                v[w][i] = b2 * v[w][i] + (1 - b2) * g * g
        for i in range(len(SHAPES)):
            avg = sum(m[w][i] for w in range(n)) / n
            for w in range(n):
                m[w][i] = np.where(sel[i], avg, m[w][i])
        for w in range(n):
            for i in range(len(SHAPES)):
                grp = group_of[i]
                lr, wd, b3 = grp["lr"] * lr_scale, grp["weight_decay"], grp["beta3"]
                b1, b2 = grp["betas"]
                P, M, V, S = p[w][i], m[w][i], v[w][i], sel[i]
                if variant == "v1":
                    age[w][i] = (age[w][i] + 1) * (~S)
                    r = b3 ** age[w][i]
                    u = (M / (1 - b1**t)) / (np.sqrt(V / (1 - b2**t)) + eps) + wd * P
                    if P.ndim == 1:
                        pn, un = np.linalg.norm(P), np.linalg.norm(u)
                        p[w][i] = P - lr * (pn / un if pn > 0 and un > 0 else 1.0) * u
                        continue

                    def phi(mask):
                        pn, un = np.linalg.norm(P[mask]), np.linalg.norm(u[mask])
                        return pn / un if pn > 0 and un > 0 else 1.0

                    trust = np.clip(r * phi(S) + (1 - r) * phi(~S), c_min, c_max)
                    eta = r * lr + (1 - r) * lr / math.sqrt(n)
                    p[w][i] = P - trust * eta * u
                else:
                    age[w][i] = np.where(S, 1.0, b3 * age[w][i])
                    r = age[w][i]
                    a = (M / (np.sqrt(V) + eps)) * (math.sqrt(1 - b2**t) / (1 - b1**t))

                    def ratio(mask, default):
                        pn, an = np.linalg.norm(P[mask]), np.linalg.norm(a[mask])
                        return pn / an if pn > 0 and an > 0 else default

                    phi_s = np.clip(ratio(r == 1, 1.0), c_min, c_max)
                    phi_l = np.clip(ratio(r < 1, 0.0), 0.0, c_max)
                    u = a + wd * P
                    p[w][i] = P - (lr * phi_s * r * u + (lr / math.sqrt(n)) * phi_l * (1 - r) * u)
        if (t - 1) % SYNC == 0:
            for i in range(len(SHAPES)):
                avg = sum(p[w][i] for w in range(n)) / n
                for w in range(n):
                    p[w][i] = avg.copy()
        history.append([[x.copy() for x in p[w]] for w in range(n)])
    return history


SYNC = 4
N = 4
CONFIGS = [
    dict(variant="v1", compress_ratio=0.25, sync_interval=SYNC, foreach=True),
    dict(variant="v1", compress_ratio=0.25, sync_interval=SYNC, foreach=False),
    dict(variant="v2", compress_ratio=0.3, sync_interval=SYNC, foreach=True),
    dict(variant="v2", compress_ratio=0.3, sync_interval=SYNC, foreach=False),
    dict(variant="v2", compress_ratio=0.1, sync_interval=SYNC, comm_dtype=torch.float16),
    dict(variant="v2", compress_ratio=0.25, sync_interval=SYNC, mask="cyclic"),
]


@pytest.fixture(scope="module")
def runs():
    """configs x ranks x steps, from one 4-process gloo job."""
    by_rank = distributed.run(trajectory_worker, N, CONFIGS)
    return [[by_rank[r][c] for r in range(N)] for c in range(len(CONFIGS))]


def dense_flags():
    order = layout_order()
    return torch.cat([torch.full((int(np.prod(SHAPES[i])),), bool(len(SHAPES[i]) == 1 or np.prod(SHAPES[i]) < T))
                      for i in order])


def to_layout(params_by_shape_index):
    return [params_by_shape_index[i] for i in range(len(SHAPES))]


@pytest.mark.parametrize("c", [0, 1, 2, 3, 5])
@pytest.mark.multiprocess
def test_matches_per_element_spec(runs, c):
    run, cfg = runs[c], CONFIGS[c]
    variant = cfg["variant"]
    masks = [step["mask"] for step in run[0]]
    expected = spec_run(variant, N, masks)
    for t in range(STEPS):
        for w in range(N):
            for i in range(len(SHAPES)):
                np.testing.assert_allclose(run[w][t]["params"][i].numpy(), expected[t][w][i],
                                           rtol=1e-9, atol=1e-11,
                                           err_msg=f"{cfg} step {t + 1} rank {w} tensor {SHAPES[i]}")


@pytest.mark.multiprocess
def test_fast_path_equals_reference_path(runs):
    for fast, ref in ((0, 1), (2, 3)):
        for w in range(N):
            for t in range(STEPS):
                for a, b in zip(runs[fast][w][t]["params"], runs[ref][w][t]["params"]):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.multiprocess
def test_masks_agree_across_ranks_and_hold_dense_tensors(runs):
    dense = dense_flags()
    for run in runs:
        for t in range(STEPS):
            for w in range(1, N):
                assert torch.equal(run[w][t]["mask"], run[0][t]["mask"])
            assert run[0][t]["mask"][dense].all()


@pytest.mark.multiprocess
def test_cyclic_mask_averages_each_coordinate_once_per_period(runs):
    compressed = ~dense_flags()
    for c in (0, 5):  # k = 0.25: period 4
        masks = torch.stack([s["mask"] for s in runs[c][0]]).long()
        for start in range(0, STEPS - 3):
            counts = masks[start:start + 4, compressed].sum(0)
            assert torch.equal(counts, torch.ones_like(counts))


@pytest.mark.multiprocess
def test_bernoulli_mask_fraction_is_close_to_k(runs):
    compressed = ~dense_flags()
    for c, k in ((2, 0.3), (4, 0.1)):
        fractions = torch.stack([s["mask"][compressed].double().mean() for s in runs[c][0]])
        n_coord = int(compressed.sum())
        sigma = math.sqrt(k * (1 - k) / n_coord)
        assert (fractions - k).abs().max() < 5 * sigma
        assert fractions.std() > 0  # a fresh draw every step
        masks = torch.stack([s["mask"][compressed] for s in runs[c][0]])
        assert not torch.equal(masks[0], masks[1])


@pytest.mark.multiprocess
def test_sync_steps_make_ranks_bitwise_identical_and_they_drift_between(runs):
    for run in runs:
        for t in range(1, STEPS + 1):
            same = all(torch.equal(run[w][t - 1]["params"][i], run[0][t - 1]["params"][i])
                       for w in range(1, N) for i in range(len(SHAPES)))
            assert same == ((t - 1) % SYNC == 0), f"step {t}"


@pytest.mark.multiprocess
def test_ledger_bytes_follow_the_formula(runs):
    total = sum(int(np.prod(s)) for s in SHAPES)
    for run, cfg in zip(runs, CONFIGS):
        size = 2 if cfg.get("comm_dtype") == torch.float16 else 8
        for w in range(N):
            for t in range(1, STEPS + 1):
                step = run[w][t - 1]
                dense = dense_flags()  # the always-averaged tensors' part, then the sampled entries
                assert step["bytes"]["momentum_dense"] == int(dense.sum()) * size
                assert step["bytes"]["momentum"] == int(step["mask"][~dense].sum()) * size
                assert step["bytes"].get("params", 0) == (total * 8 if (t - 1) % SYNC == 0 else 0)
                # the non-finite agreement: one float per step (+ the layout, start, gradient and mask-count
                # checks at step 1), and with fp16 the agreed scale of the exchange: one float
                fp16 = 4 if cfg.get("comm_dtype") == torch.float16 else 0
                assert step["bytes"]["control"] == 4 + fp16 + (5 * 8 + 8 if t == 1 else 0)


@pytest.mark.multiprocess
def test_fp16_exchange_is_the_spec_up_to_fp16_rounding(runs):
    run = runs[4]
    expected = spec_run("v2", N, [step["mask"] for step in run[0]])
    worst = max(float(np.max(np.abs(run[w][t]["params"][i].numpy() - expected[t][w][i])))
                for t in range(STEPS) for w in range(N) for i in range(len(SHAPES)))
    assert 1e-9 < worst < 1e-3  # rounded (so fp16 was really sent), and only by rounding


# ----------------------------------------------------------------------------- single process


def test_step_leaves_global_rng_untouched():
    for variant in ("v1", "v2"):
        params = [torch.nn.Parameter(p.float()) for p in init_params()]
        opt = make_optimizer(params, variant=variant)
        cpu = torch.get_rng_state()
        for t in range(3):
            for i, p in enumerate(params):
                p.grad = grad_of(p.detach().double(), 0, t, i).float()
            opt.step()
        assert torch.equal(torch.get_rng_state(), cpu)


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("per_tensor_add", [True, False])
def test_both_scaled_additions_of_the_flat_path_equal_the_reference(variant, per_tensor_add, monkeypatch):
    """The flat path adds its per-tensor multiples one tensor at a time on the CPU and with two multi-tensor
    ops on other devices: both agree with the per-tensor reference (c_max = 0.5 makes v1 clamp some tensors)."""
    from slamb.optim import slamb_update as module

    monkeypatch.setattr(module, "_PER_TENSOR_ADD", {"cpu"} if per_tensor_add else set())
    runs = []
    for foreach in (True, False):
        params = [torch.nn.Parameter(p) for p in init_params()]
        opt = make_optimizer(params, variant=variant, compress_ratio=0.3, c_max=0.5, foreach=foreach)
        for t in range(1, 6):
            for i, p in enumerate(params):
                p.grad = grad_of(p.detach(), 0, t, i)
            opt.step()
        runs.append(params)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert not torch.equal(runs[0][0], init_params()[0])


def test_compress_ratio_one_with_identical_data_equals_lamb():
    torch.manual_seed(0)
    for variant, wd in (("v1", 0.01), ("v2", 0.0)):
        a = [torch.nn.Parameter(p.clone()) for p in init_params()]
        b = [torch.nn.Parameter(p.clone()) for p in init_params()]
        opt_s = slamb.SLAMB(a, lr=0.01, weight_decay=wd, compress_ratio=1.0, variant=variant,
                            c_min=0.0, c_max=1e9, eps=1e-12)
        opt_l = slamb.LAMB(b, lr=0.01, weight_decay=wd, eps=1e-12)
        for t in range(8):
            for i, (pa, pb) in enumerate(zip(a, b)):
                pa.grad = grad_of(pa.detach(), 0, t, i)
                pb.grad = grad_of(pb.detach(), 0, t, i)
            opt_s.step()
            opt_l.step()
        for pa, pb in zip(a, b):
            if variant == "v1":  # the same formula, so equal up to the order of float operations
                torch.testing.assert_close(pa, pb, rtol=1e-12, atol=1e-14)
            else:  # v2 puts eps inside the bias correction: eps / sqrt(1 - b2^t) instead of eps
                torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-8)


def test_compress_ratio_can_change_between_steps():
    params = [torch.nn.Parameter(p) for p in init_params()]
    opt = make_optimizer(params, variant="v1", compress_ratio=0.5)
    compressed = ~dense_flags()
    fractions = []
    for t, k in enumerate((0.5, 0.5, 0.2, 0.1, 0.1)):
        opt.compress_ratio = k
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach(), 0, t, i)
        opt.step()
        fractions.append(float(opt.last_sync_mask()[compressed].double().mean()))
    np.testing.assert_allclose(fractions, [0.5, 0.5, 0.2, 0.1, 0.1], atol=0.01)
    with pytest.raises(ValueError, match="compress_ratio"):
        opt.compress_ratio = 0.0


INVALID = [
    (dict(lr=-1.0), "lr"), (dict(lr=float("nan")), "lr"),
    (dict(compress_ratio=0.0), "compress_ratio"), (dict(compress_ratio=1.5), "compress_ratio"),
    (dict(beta3=1.0), "beta3"), (dict(beta3=-0.1), "beta3"),
    (dict(sync_interval=0), "sync_interval"), (dict(sync_interval=2.5), "sync_interval"),
    (dict(c_min=2.0, c_max=1.0), "c_min"), (dict(c_max=0.0), "c_max"), (dict(c_min=-1.0), "c_min"),
    (dict(variant="v3"), "variant"), (dict(mask="topk"), "mask"),
    (dict(betas=(1.0, 0.999)), "betas"), (dict(betas=(0.9,)), "betas"), (dict(eps=0.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"), (dict(min_compress_numel=-1), "min_compress_numel"),
    (dict(comm_dtype=torch.int16), "comm_dtype"), (dict(nonfinite="maybe"), "nonfinite"),
    (dict(seed=1.5), "seed"),
]


@pytest.mark.parametrize("kwargs,name", INVALID)
def test_invalid_settings_raise_naming_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        slamb.SLAMB([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_invalid_per_group_setting_raises():
    with pytest.raises(ValueError, match="lr"):
        slamb.SLAMB([{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": -0.1}])


def test_state_dict_holds_everything_and_loads_into_a_fresh_optimizer():
    params = [torch.nn.Parameter(p) for p in init_params()]
    opt = make_optimizer(params, variant="v1", compress_ratio=0.25)
    for t in range(3):
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach(), 0, t, i)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    state = opt.state_dict()["state"]
    assert set(state[0]) == {"exp_avg", "exp_avg_sq", "staleness"}
    assert any(bool((s["staleness"] > 0).any()) for s in state.values())
    # a fresh optimizer has nothing: the loaded one must be step-for-step the same as the original
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make_optimizer(fresh, variant="v1", compress_ratio=0.9)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert opt2.compress_ratio == 0.25
    for t in range(3, 6):
        for i, (p, q) in enumerate(zip(params, fresh)):
            p.grad = grad_of(p.detach(), 0, t, i)
            q.grad = grad_of(q.detach(), 0, t, i)
        opt.step()
        opt2.step()
        assert torch.equal(opt.last_sync_mask(), opt2.last_sync_mask())
    for p, q in zip(params, fresh):
        assert torch.equal(p, q)


@pytest.mark.parametrize("b3", [0.9, 0.0])
def test_v2_state_is_an_int16_age_and_a_float_freshness_checkpoint_loads_converted(b3):
    """m, v and the int16 age: 2.5 words per element. A v2 state saved with the freshness r = b3^age
    itself (float) loads as the same ages, and runs on as the state it was converted from."""
    params = [torch.nn.Parameter(p) for p in init_params()]
    opt = make_optimizer(params, variant="v2", compress_ratio=0.25)
    for g in opt.param_groups:
        g["beta3"] = b3
    for t in range(6):
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach(), 0, t, i)
        opt.step()
    sd = opt.state_dict()
    assert {k: v.dtype for k, v in sd["state"][0].items()} == {"exp_avg": torch.float64, "exp_avg_sq": torch.float64,
                                                               "staleness": torch.int16}
    assert max(int(s["staleness"].max()) for s in sd["state"].values()) >= 3
    old = copy.deepcopy(sd)
    for s in old["state"].values():  # the float freshness the state used to hold
        s["freshness"] = torch.pow(b3, s.pop("staleness").double())
    runs = []
    for state in (sd, old):
        fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt2 = make_optimizer(fresh, variant="v2")
        opt2.load_state_dict(copy.deepcopy(state))
        assert "freshness" not in opt2.state[fresh[0]]
        for t in range(6, 9):
            for i, p in enumerate(fresh):
                p.grad = grad_of(p.detach(), 0, t, i)
            opt2.step()
        # b3 = 0 forgets how long ago (r = 0 for every age > 0): only whether an entry is fresh is kept
        ages = [opt2.state[p]["staleness"].clone() for p in fresh]
        runs.append([a.clamp_max(1) if b3 == 0 else a for a in ages] + fresh)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_loading_a_state_of_another_layout_or_optimizer_raises():
    params = [torch.nn.Parameter(p) for p in init_params()]
    opt = make_optimizer(params)
    for i, p in enumerate(params):
        p.grad = grad_of(p.detach(), 0, 0, i)
    opt.step()
    other = [torch.nn.Parameter(torch.zeros(7)) for _ in SHAPES]
    with pytest.raises(ValueError, match="layout"):
        make_optimizer(other).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="variant"):
        make_optimizer(params, variant="v1").load_state_dict(opt.state_dict())
    lamb = slamb.LAMB(params)
    with pytest.raises(ValueError, match="not a SLAMB state dict"):
        make_optimizer(params).load_state_dict(lamb.state_dict())


def test_first_step_fixes_layout_and_missing_grads_count_as_zero():
    params = [torch.nn.Parameter(p) for p in init_params()]
    opt = make_optimizer(params, variant="v2", compress_ratio=0.5)
    params[1].grad = None  # never had a gradient: not in the layout
    for i in (0, 2, 3):
        params[i].grad = grad_of(params[i].detach(), 0, 0, i)
    before = params[1].detach().clone()
    opt.step()
    assert params[1] not in opt.state or not opt.state[params[1]]
    assert torch.equal(params[1], before)
    assert opt.last_sync_mask().numel() == sum(params[i].numel() for i in (0, 2, 3))
    params[0].grad = None  # in the layout: treated as zero, the step still runs
    m_before = opt.state[params[0]]["exp_avg"].clone()
    opt.step()
    torch.testing.assert_close(opt.state[params[0]]["exp_avg"], 0.9 * m_before)


# ----------------------------------------------------------------------------- multi-rank state


def resume_worker(rank, world, variant):
    def fresh():
        params = [torch.nn.Parameter(p.float()) for p in init_params()]
        return params, make_optimizer(params, variant=variant, compress_ratio=0.25, sync_interval=3)

    def advance(params, opt, steps):
        for t in steps:
            for i, p in enumerate(params):
                p.grad = grad_of(p.detach().double(), rank, t, i).float()
            opt.step()

    params, opt = fresh()
    advance(params, opt, range(1, 11))
    straight = [p.detach().clone() for p in params]

    params, opt = fresh()
    advance(params, opt, range(1, 5))
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "optim": opt.state_dict()}, buf)
    del params, opt
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    params, opt = fresh()
    with torch.no_grad():
        for p, s in zip(params, saved["model"]):
            p.copy_(s)
    opt.load_state_dict(saved["optim"])
    advance(params, opt, range(5, 11))
    resumed = [p.detach().clone() for p in params]
    return {"straight": straight, "resumed": resumed, "state": saved["optim"],
            "bytes": opt.comm_stats()["total"]["momentum"]["payload"]}


def nonfinite_worker(rank, world):
    out = {}
    for policy in ("raise", "skip"):
        params = [torch.nn.Parameter(p.float()) for p in init_params()]
        opt = make_optimizer(params, nonfinite=policy)
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach().double(), rank, 1, i).float()
        opt.step()
        before = [p.detach().clone() for p in params]
        m_before = [opt.state[p]["exp_avg"].clone() for p in params]
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach().double(), rank, 2, i).float()
        if rank == 1:
            params[2].grad[3] = float("nan")
        try:
            opt.step()
            out[policy] = "stepped"
        except FloatingPointError as e:
            out[policy] = str(e)
        out[policy + "_unchanged"] = all(torch.equal(p, b) for p, b in zip(params, before)) and all(
            torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(params, m_before))
        out[policy + "_step"] = opt.state_dict()["slamb"]["step"]
        # the run goes on normally afterwards
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach().double(), rank, 3, i).float()
        opt.step()
        out[policy + "_after"] = opt.state_dict()["slamb"]["step"]
    return out


def ddp_worker(rank, world):
    results = {}
    for name in ("slamb", "lamb"):
        torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 2))
        opt = slamb.create_optimizer(name, model, lr=0.01)
        ddp = slamb.wrap_model(model, opt)
        try:
            slamb.wrap_model(ddp, opt)
            results[name + "_rewrap"] = "accepted"
        except ValueError as e:
            results[name + "_rewrap"] = str(e)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(16, 40, generator=gen)
        y = torch.randint(0, 2, (16,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        results[name] = {"grads": grads, "stats": opt.comm_stats()["last_step"],
                         "params": [p.detach().clone() for p in model.parameters()]}
    return results


@pytest.mark.multiprocess
def test_resume_is_bit_exact_and_other_world_size_is_refused():
    for variant in ("v1", "v2"):
        res = distributed.run(resume_worker, 2, variant)
        for r in res:
            for a, b in zip(r["straight"], r["resumed"]):
                assert torch.equal(a, b), variant
        assert res[0]["bytes"] > 0
        # a state saved by rank 0 of a 2-worker job, loaded where there is one worker
        params = [torch.nn.Parameter(p.float()) for p in init_params()]
        with pytest.raises(ValueError, match="world size 2"):
            make_optimizer(params, variant=variant, compress_ratio=0.25).load_state_dict(res[0]["state"])


@pytest.mark.multiprocess
def test_nonfinite_gradients_are_a_joint_decision_that_loses_nothing():
    res = distributed.run(nonfinite_worker, 2)
    for rank, r in enumerate(res):
        assert "non-finite" in r["raise"] and "optimizer state and parameters are untouched" in r["raise"]
        assert ("param[1] (30,)" in r["raise"]) == (rank == 1)  # index in the optimizer's order
        assert r["skip"] == "stepped"
        for policy in ("raise", "skip"):
            assert r[policy + "_unchanged"]
            assert r[policy + "_step"] == 1 and r[policy + "_after"] == 2


@pytest.mark.multiprocess
def test_wrap_model_keeps_slamb_gradients_local_and_records_lamb_allreduce():
    res = distributed.run(ddp_worker, 2)
    numel = 40 * 30 + 30 + 30 * 2 + 2
    # LAMB: averaged gradients (equal on both ranks), D x 4 bytes of "grads"
    for a, b in zip(res[0]["lamb"]["grads"], res[1]["lamb"]["grads"]):
        torch.testing.assert_close(a, b)
    assert res[0]["lamb"]["stats"]["grads"]["payload"] == numel * 4
    for r in res:  # a DDP handed to wrap_model is refused when wrapped, with the fix
        assert all("pass the module it wraps (model.module)" in r[name + "_rewrap"] for name in ("slamb", "lamb"))
    assert torch.equal(res[0]["lamb"]["params"][0], res[1]["lamb"]["params"][0])
    # SLAMB: DDP broadcast rank 0's weights, gradients stay local, no gradient bytes
    assert not torch.equal(res[0]["slamb"]["grads"][0], res[1]["slamb"]["grads"][0])
    assert "grads" not in res[0]["slamb"]["stats"]
    # every tensor is under min_compress_numel: all of the momentum is averaged, in fp32, and nothing sampled
    assert res[0]["slamb"]["stats"]["momentum_dense"]["payload"] == numel * 4
    assert "momentum" not in res[0]["slamb"]["stats"]
    # step 1 is a sync step: parameters agree again
    for a, b in zip(res[0]["slamb"]["params"], res[1]["slamb"]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["slamb", "dgc", "onebit_lamb"])
def test_parameter_groups_cannot_join_after_the_layout_is_fixed(name):
    model = torch.nn.Linear(4, 3)
    opt = slamb.create_optimizer(name, [model.weight])
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    with pytest.raises(RuntimeError, match="fixed at the first step"):
        opt.add_param_group({"params": [model.bias]})


# ----------------------------------------------------------------------------- overlap with backward


class OverlapNet(torch.nn.Module):
    """Compressed and always-averaged tensors, spread over several small DDP buckets."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(100, 120)  # 12,000 weights: compressed
        self.b = torch.nn.Linear(120, 40)   # 4,800: always averaged
        self.c = torch.nn.Linear(40, 300)   # 12,000: compressed

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def overlap_worker(rank, world, variant, fused=False, steps=6):
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = OverlapNet().double()
        opt = slamb.SLAMB(model.parameters(), lr=0.01, weight_decay=0.01, variant=variant, compress_ratio=0.2,
                          sync_interval=4, overlap=overlap, fused=fused)
        ddp = slamb.wrap_model(model, opt, bucket_cap_mb=0.05)  # DDP caps its first bucket at 1 MB: 2 buckets
        launched = []
        for t in range(1, steps + 1):
            gen = torch.Generator().manual_seed(1000 * rank + t)
            x = torch.randn(8, 100, generator=gen, dtype=torch.float64)
            opt.zero_grad()
            ddp(x).square().mean().backward()
            launched.append(list(opt.exchange.pending))  # exchanges already in flight when step() starts
            opt.step()
        out[overlap] = {"params": [p.detach().clone() for p in model.parameters()], "launched": launched,
                        "dense": opt.exchange.next_sel.dense if overlap else None,
                        "momentum": opt.comm_stats()["total"]["momentum"],
                        "momentum_dense": opt.comm_stats()["total"]["momentum_dense"]}
    return out


@pytest.mark.parametrize("variant,world,fused", [("v2", 2, False), ("v1", 4, False), ("v2", 2, True)])
@pytest.mark.multiprocess
def test_overlapped_exchange_equals_the_plain_one(variant, world, fused):
    """Fused, each bucket is gathered by positions (its parameters are consecutive in the layout)."""
    res = distributed.run(overlap_worker, world, variant, fused)
    for r in res:
        plain, overlapped = r[False], r[True]
        for a, b in zip(plain["params"], overlapped["params"]):
            torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15)
        # the first step's buckets come before the layout; from then on every bucket is sent in backward
        assert plain["launched"] == [[]] * 6
        buckets = overlapped["launched"]
        assert buckets[0] == [] and min(len(b) for b in buckets[1:]) >= 2
        # the same bytes, cut into one all-reduce per bucket instead of one per step; each part's calls are
        # the all-reduces that carried some of it
        for part, is_dense in (("momentum", False), ("momentum_dense", True)):
            assert overlapped[part]["payload"] == plain[part]["payload"] > 0
            assert plain[part]["calls"] == 6
            carried = sum(any(overlapped["dense"][i] == is_dense for i in key) for b in buckets[1:] for key in b)
            assert overlapped[part]["calls"] == 1 + carried
    assert not torch.equal(res[0][True]["params"][0], res[1][True]["params"][0])  # ranks drift between syncs
