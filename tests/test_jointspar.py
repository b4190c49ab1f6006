"""JointSpar / JointSpar-LARS: unbiased layer sampling, the learned distribution
(budget, floor, convergence to the variance-optimal one), what is sent, rank
agreement, equivalence with dense SGD / timm's LARS at full budget, resume."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F

from slamb import wrap_model
from slamb.optim.jointspar import JointSpar, project_capped, update_distribution
from slamb.registry import create_optimizer
from tests.distributed import run

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_model(seed: int, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).to(dtype)


def make_data(seed: int, n: int = 128, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen, dtype=dtype)
    y = (x[:, :1] * 1.5 - x[:, 1:2] + 0.5 * x[:, 2:3] * x[:, 3:4]).to(dtype)
    return x, y


def one_round(opt, model, x, y):
    opt.sample_round()
    loss = F.mse_loss(model(x), y)
    if loss.requires_grad:
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


# -- the distribution -------------------------------------------------------------------------


def test_projection_is_the_exact_kl_projection():
    gen = torch.Generator().manual_seed(0)
    for d, budget, floor in [(30, 7.0, 0.02), (5, 1.0, 0.2), (40, 40.0, 0.5), (12, 1.2, 0.1), (64, 20.0, 0.01)]:
        logw = torch.randn(d, generator=gen, dtype=torch.float64) * 4
        p = project_capped(logw, budget, floor)
        # KKT of min KL(p || w): p = clip(c w, floor, 1) for one c; find c by bisection in log space
        lo, hi = -80.0, 80.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            total = torch.exp(logw - logw.max() + mid).clamp(floor, 1.0).sum()
            lo, hi = (mid, hi) if total < budget else (lo, mid)
        expected = torch.exp(logw - logw.max() + lo).clamp(floor, 1.0)
        assert torch.allclose(p, expected, rtol=0, atol=1e-12)
        assert abs(p.sum().item() - budget) < 1e-12 * d
    # the two degenerate budgets: everything at the floor / at the cap
    logw = torch.randn(9, generator=gen, dtype=torch.float64)
    assert torch.equal(project_capped(logw, 9 * 0.3, 0.3), torch.full((9,), 0.3, dtype=torch.float64))
    assert torch.equal(project_capped(logw, 9.0, 0.3), torch.ones(9, dtype=torch.float64))


def test_budget_floor_and_cap_hold_after_many_updates():
    gen = torch.Generator().manual_seed(1)
    d, kappa, p_min = 40, 0.25, 0.02
    budget = kappa * d
    p = torch.full((d,), kappa, dtype=torch.float64)
    scales = torch.exp(torch.randn(d, generator=gen, dtype=torch.float64) * 3)  # norms over ~6 decades
    unchanged = 0
    for t in range(2000):
        active = torch.rand(d, generator=gen, dtype=torch.float64) < p
        norms = scales * torch.rand(d, generator=gen, dtype=torch.float64)
        if t % 97 == 0:
            norms[:] = 0.0  # nothing observed: p must not move
        before = p
        p = update_distribution(p, active, norms, budget=budget, p_min=p_min, lr=0.05)
        unchanged += bool(torch.equal(p, before))
        assert abs(p.sum().item() - budget) < 1e-9
        assert p.min().item() >= p_min * (1 - 1e-12)
        assert p.max().item() <= 1.0
    assert unchanged >= 2000 // 97  # the rounds without observations (and those with no active layer)
    assert p.max().item() == 1.0 and (p == p_min).any()  # the extremes are reached, not just respected
    # a non-finite observation leaves p as it was
    bad = torch.full((d,), math.nan, dtype=torch.float64)
    assert torch.equal(update_distribution(p, torch.ones(d, dtype=torch.bool), bad, budget=budget, p_min=p_min,
                                           lr=0.05), p)


def test_distribution_converges_to_the_variance_optimal_one():
    """With fixed layer norms a_d, p approaches argmin sum a_d^2/p_d = proj(p ~ a)."""
    gen = torch.Generator().manual_seed(2)
    d, kappa, p_min = 20, 0.25, 0.02
    budget = kappa * d
    a = torch.exp(torch.randn(d, generator=gen, dtype=torch.float64))
    optimum = project_capped(a.log(), budget, p_min)

    def variance(p):
        return (a.square() / p).sum().item()

    p = torch.full((d,), kappa, dtype=torch.float64)
    first = variance(p) / variance(optimum)
    ratios = []
    for _ in range(800):
        active = torch.rand(d, generator=gen, dtype=torch.float64) < p
        noisy = a * (1 + 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)).abs()
        p = update_distribution(p, active, noisy, budget=budget, p_min=p_min, lr=0.01)
        ratios.append(variance(p) / variance(optimum))
    assert first > 1.3
    assert sum(ratios[-200:]) / 200 < 1.03
    assert (p - optimum).abs().max().item() < 0.1


# -- the estimate ---------------------------------------------------------------------------------


def _unbiased_worker(rank, world, draws):
    torch.manual_seed(0)
    model = make_model(0, torch.float64)
    x, y = make_data(100 + rank, 64, torch.float64)
    F.mse_loss(model(x), y).backward()
    local_dense = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    opt = JointSpar(model.parameters(), lr=0.1, momentum=0.0, kappa=0.5, p_min=0.1, dist_lr=0.05, seed=3)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(30):  # learn a non-uniform distribution first
        one_round(opt, model, x, y)
    with torch.no_grad():
        for p, s in zip(model.parameters(), start):
            p.copy_(s)
    opt.dist_lr = 0.0  # then freeze it: the draws below are i.i.d.
    prob = opt.probabilities()
    total = [torch.zeros_like(p) for p in model.parameters()]
    counts = torch.zeros(opt.num_layers)
    for _ in range(draws):
        active = opt.sample_round()
        if active.any():
            F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        counts += active
        for acc, p in zip(total, model.parameters()):
            acc += opt.state[p]["momentum_buffer"]  # momentum 0: the buffer is this round's estimate
        with torch.no_grad():
            for p, s in zip(model.parameters(), start):
                p.copy_(s)
    assert torch.equal(opt.probabilities(), prob)
    return {"dense": local_dense, "mean": [t / draws for t in total], "counts": counts, "prob": prob}


@pytest.mark.multiprocess
def test_sparse_estimate_is_unbiased_2_ranks():
    draws = 400
    out = run(_unbiased_worker, 2, draws)
    for a, b in zip(out[0]["mean"], out[1]["mean"]):
        assert torch.equal(a, b)  # every rank applies the same estimate
    full = [(g0 + g1) / 2 for g0, g1 in zip(out[0]["dense"], out[1]["dense"])]
    prob, counts, mean = out[0]["prob"], out[0]["counts"], out[0]["mean"]
    assert prob.max() - prob.min() > 0.1  # a non-uniform distribution is being tested
    err2, var = 0.0, 0.0
    for d, (g, m) in enumerate(zip(full, mean)):
        p = prob[d].item()
        # all coordinates of a layer share one draw: the mean is exactly (count/(N p)) * g
        assert torch.allclose(m, g * (counts[d].item() / (draws * p)), rtol=1e-9, atol=1e-15)
        # and the count is Binomial(N, p)
        assert abs(counts[d].item() / draws - p) <= 4.5 * math.sqrt(p * (1 - p) / draws)
        err2 += (m - g).square().sum().item()
        var += g.square().sum().item() * (1 - p) / (draws * p)
    # E||mean - g||^2 = sum_d ||g_d||^2 (1 - p_d) / (N p_d): the error is of that size, not larger
    assert err2 <= 9 * var
    total = sum(g.square().sum().item() for g in full)
    assert math.sqrt(err2 / total) < 0.25


# -- what is computed and sent --------------------------------------------------------------------


def _comm_worker(rank, world, rounds):
    model = make_model(rank)  # different initial parameters: the first round broadcasts rank 0's
    x, y = make_data(rank)
    opt = JointSpar(model.parameters(), lr=0.05, kappa=0.4, p_min=0.1, dist_lr=0.02, seed=11)
    assert wrap_model(model, opt) is model  # no DDP: the optimizer does all the communication
    numels = [p.numel() for p in model.parameters()]
    rows = []
    for t in range(rounds):
        active = opt.sample_round()
        for p, on in zip(model.parameters(), active.tolist()):
            assert p.requires_grad == on
        loss = F.mse_loss(model(x), y)
        if loss.requires_grad:
            loss.backward()
        grads_present = [p.grad is not None for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        last = opt.comm_stats()["last_step"]
        rows.append({"active": active, "grads_present": grads_present,
                     "grads_payload": last.get("grads", {}).get("payload", 0),
                     "grads_calls": last.get("grads", {}).get("calls", 0),
                     "params_payload": last.get("params", {}).get("payload", 0),
                     "control_payload": last.get("control", {}).get("payload", 0),
                     "all_payload": last["all"]["payload"]})
    return {"rows": rows, "numels": numels, "params": [p.detach().clone() for p in model.parameters()],
            "total": opt.comm_stats()["total"]}


@pytest.mark.multiprocess
def test_inactive_layers_get_no_gradient_and_send_no_bytes_3_ranks():
    rounds = 25
    out = run(_comm_worker, 3, rounds)
    numels = out[0]["numels"]
    expected_total = 0
    for t in range(rounds):
        row = out[0]["rows"][t]
        for r in range(1, 3):
            assert torch.equal(out[r]["rows"][t]["active"], row["active"])  # the same draw everywhere
        active = row["active"].tolist()
        assert row["grads_present"] == active  # backward produced exactly the active layers' gradients
        sent = 4 * sum(n for n, on in zip(numels, active) if on)
        assert row["grads_payload"] == sent
        assert row["grads_calls"] == (1 if any(active) else 0)  # one packed all-reduce
        # round 1 only: the broadcast of rank 0's parameters and the 3-int64 check of the layers
        params, control = (4 * sum(numels), 3 * 8) if t == 0 else (0, 0)
        assert (row["params_payload"], row["control_payload"]) == (params, control)
        assert row["all_payload"] == sent + params + control  # nothing else
        expected_total += sent
    assert out[0]["total"]["grads"]["payload"] == expected_total
    assert out[0]["total"]["grads"]["wire"] == pytest.approx(expected_total * 2 * 2 / 3)
    assert 0 < expected_total < 4 * sum(numels) * rounds  # sparse: less than dense all-reduce
    for r in range(1, 3):
        for a, b in zip(out[0]["params"], out[r]["params"]):
            assert torch.equal(a, b)


def _train_worker(rank, world, rounds):
    x_all, y_all = make_data(7, 256)
    x, y = x_all[rank::world], y_all[rank::world]  # each rank its own shard
    out = {}
    for variant, settings in [("jointspar", dict(lr=0.05)), ("jointspar_lars", dict(lr=0.05, trust_coeff=0.05))]:
        model = make_model(rank)
        opt = create_optimizer(variant, model, weight_decay=1e-4, kappa=0.5, p_min=0.1, dist_lr=0.02, seed=5,
                               **settings)
        probs, draws, losses = [], [], []
        for _ in range(rounds):
            draws.append(opt.sample_round())
            loss = F.mse_loss(model(x), y)
            if loss.requires_grad:
                loss.backward()
            opt.step()
            opt.zero_grad()
            probs.append(opt.probabilities())
            with torch.no_grad():
                losses.append(F.mse_loss(model(x_all), y_all).item())
        opt.unfreeze()
        assert all(p.requires_grad for p in model.parameters())
        out[variant] = {"draws": torch.stack(draws), "probs": torch.stack(probs), "losses": losses,
                        "budget": opt.budget, "params": [p.detach().clone() for p in model.parameters()],
                        "lars": opt.lars}
    return out


@pytest.mark.multiprocess
def test_both_variants_train_and_ranks_agree_2_ranks():
    rounds = 150
    results = run(_train_worker, 2, rounds)
    for variant in ("jointspar", "jointspar_lars"):
        out = [r[variant] for r in results]
        assert out[0]["lars"] == (variant == "jointspar_lars")
        assert torch.equal(out[0]["draws"], out[1]["draws"])
        assert torch.equal(out[0]["probs"], out[1]["probs"])  # bitwise: p never needs to be sent
        for a, b in zip(out[0]["params"], out[1]["params"]):
            assert torch.equal(a, b)
        assert out[0]["losses"] == out[1]["losses"]
        probs, budget = out[0]["probs"], out[0]["budget"]
        assert torch.allclose(probs.sum(1), torch.full((rounds,), budget, dtype=torch.float64), atol=1e-9)
        assert probs.min() >= 0.1 * (1 - 1e-12) and probs.max() <= 1.0
        assert (probs[-1] - probs[0]).abs().max() > 0.05  # the distribution did adapt
        losses = out[0]["losses"]
        assert losses[-1] < 0.1 * losses[0], variant
        assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10


# -- the update rule ------------------------------------------------------------------------------


def _full_budget_run(opt_factory, steps=8, seed=0):
    model = make_model(seed)
    x, y = make_data(seed)
    opt = opt_factory(model)
    for _ in range(steps):
        if isinstance(opt, JointSpar):
            assert opt.sample_round().all()
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_full_budget_is_sgd_with_momentum():
    ours = _full_budget_run(lambda m: JointSpar(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, kappa=1.0,
                                                p_min=1.0, dist_lr=0.1))
    ref = _full_budget_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3))
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_full_budget_lars_is_timm_lars():
    from timm.optim import Lars

    ours = _full_budget_run(lambda m: JointSpar(m.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3, kappa=1.0,
                                                p_min=1.0, lars=True, trust_coeff=0.02, lars_exclude_1d=False))
    ref = _full_budget_run(lambda m: Lars(m.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coeff=0.02,
                                          eps=0.0, always_adapt=True))
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("lars", [False, True])
def test_fast_path_matches_reference(lars):
    def trajectory(foreach):
        model = make_model(3)
        x, y = make_data(3)
        groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 1e-2},
                  {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0, "lr": 0.02}]
        opt = JointSpar(groups, lr=0.05, momentum=0.9, kappa=0.5, p_min=0.1, dist_lr=0.02, lars=lars,
                        trust_coeff=0.05, seed=9, foreach=foreach)
        for _ in range(20):
            one_round(opt, model, x, y)
        return [p.detach().clone() for p in model.parameters()], opt.probabilities()

    fast, p_fast = trajectory(True)
    ref, p_ref = trajectory(False)
    for a, b in zip(fast, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.allclose(p_fast, p_ref, rtol=1e-6)


def test_inactive_layer_momentum_decays_and_still_moves():
    model = make_model(4)
    x, y = make_data(4)
    opt = JointSpar(model.parameters(), lr=0.05, momentum=0.9, kappa=0.5, p_min=0.1, dist_lr=0.0, seed=1)
    for _ in range(30):
        before = [(p.detach().clone(), opt.state[p]["momentum_buffer"].clone()) for p in model.parameters()
                  if "momentum_buffer" in opt.state[p]]
        if len(before) < opt.num_layers:
            one_round(opt, model, x, y)
            continue
        active = opt.sample_round()
        loss = F.mse_loss(model(x), y)
        if loss.requires_grad:
            loss.backward()
        opt.step()
        opt.zero_grad()
        for p, on, (w0, m0) in zip(model.parameters(), active.tolist(), before):
            if not on:
                m = opt.state[p]["momentum_buffer"]
                assert torch.equal(m, m0 * 0.9)
                assert torch.allclose(p, w0 - 0.05 * m, rtol=0, atol=1e-7)


# -- state, errors, failures ----------------------------------------------------------------------


def test_resume_reproduces_the_uninterrupted_run():
    def build():
        model = make_model(5)
        opt = JointSpar(model.parameters(), lr=0.05, lars=True, trust_coeff=0.05, kappa=0.5, p_min=0.1,
                        dist_lr=0.02, seed=21)
        return model, opt

    x, y = make_data(5)
    model, opt = build()
    for _ in range(6):
        one_round(opt, model, x, y)
    # state_dict() holds references to the live buffers (as torch's optimizers do): copy it
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    for _ in range(6):
        one_round(opt, model, x, y)

    model2, opt2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for _ in range(6):
        one_round(opt2, model2, x, y)
    assert torch.equal(opt.probabilities(), opt2.probabilities())
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_nonfinite_gradients():
    model = make_model(6)
    x, y = make_data(6)
    opt = JointSpar(model.parameters(), lr=0.05, kappa=1.0, p_min=1.0, nonfinite="skip")
    one_round(opt, model, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt.sample_round()
    F.mse_loss(model(x), y).backward()
    next(model.parameters()).grad[0, 0] = math.nan
    opt.step()
    opt.zero_grad()
    for p, b, m in zip(model.parameters(), before, bufs):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["momentum_buffer"], m)
    opt.nonfinite = "raise"
    opt.sample_round()
    F.mse_loss(model(x), y).backward()
    next(model.parameters()).grad[0, 0] = math.inf
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()


@pytest.mark.parametrize("setting, value, match", [
    ("kappa", 0.0, "kappa"), ("kappa", 1.5, "kappa"), ("p_min", 0.0, "p_min"), ("p_min", 0.6, "p_min"),
    ("dist_lr", -0.1, "dist_lr"), ("trust_coeff", 0.0, "trust_coeff"), ("momentum", 1.0, "momentum"),
    ("lr", -0.1, "lr"), ("weight_decay", -1e-4, "weight_decay"), ("lars", "yes", "lars"),
    ("nonfinite", "zero", "nonfinite"), ("seed", 1.5, "seed"),
])
def test_invalid_settings_raise(setting, value, match):
    with pytest.raises(ValueError, match=match):
        JointSpar(make_model(0).parameters(), **{"kappa": 0.5, setting: value})


def test_misuse_is_reported():
    model = make_model(0)
    opt = create_optimizer("jointspar", model, lr=0.1)
    assert opt.lars is False and create_optimizer("jointspar_lars", model).lars is True
    with pytest.raises(RuntimeError, match="sample_round"):
        opt.step()
    with pytest.raises(RuntimeError, match="do not wrap the model in DDP"):
        opt.ddp_comm_hook()
    with pytest.raises(ValueError, match="dist_lr"):
        opt.dist_lr = -1.0
    with pytest.raises(ValueError, match="requires_grad"):
        JointSpar([torch.zeros(3)])
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    with pytest.raises(ValueError, match="unknown setting"):
        create_optimizer("jointspar", model, budget=3)
