"""DGC (slamb.optim.dgc) and its sampled top-k (slamb.compression.topk): selection bounds, exact mass
conservation, equality with momentum SGD at density 1, the warm-up schedule, the byte ledger, rank agreement."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from slamb import create_optimizer, wrap_model
from slamb.compression.topk import num_selected, sampled_topk, sampled_topk_mask
from slamb.optim.dgc import DEFAULT_WARMUP, DGC

from .distributed import run


def realistic_tensors(seed: int = 0) -> list[torch.Tensor]:
    """Gradient-like tensors: Gaussian, heavy-tailed (Student-t, 2 dof), scale-mixed, and power-of-two shaped."""
    g = torch.Generator().manual_seed(seed)
    student = torch.distributions.StudentT(2.0)
    torch.manual_seed(seed)  # StudentT samples from the global RNG; only the test uses it
    return [
        torch.randn(512, 256, generator=g),
        student.sample((300, 700)),
        torch.randn(64, 64, 3, 3, generator=g) * torch.rand(64, 1, 1, 1, generator=g) * 10,
        torch.randn(1024, 512, generator=g).pow(3),
    ]


# -- the selection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("density", [*DEFAULT_WARMUP, 0.001])
def test_sampled_topk_count_within_bounds_and_selects_the_largest(density):
    xs = realistic_tensors()
    sizes = [x.numel() for x in xs]
    ks = [num_selected(s, density) for s in sizes]
    flat = torch.cat([x.reshape(-1) for x in xs])
    rng_before = torch.get_rng_state()
    sel = sampled_topk_mask(flat.abs(), sizes, ks, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.get_rng_state(), rng_before), "the global RNG must not be touched"
    for seg, m, k, c, exact in zip(flat.abs().split(sizes), sel.mask.split(sizes), ks, sel.counts, sel.exact):
        assert c == int(m.sum())
        assert 0.8 * k <= c <= 1.3 * k, (k, c)
        assert not exact  # these tensors are well behaved: the threshold search must succeed on its own
        assert seg[m].min() >= seg[~m].max()  # a threshold selection: nothing left out is larger


def test_sampled_topk_batched_equals_per_tensor_and_edge_cases():
    xs = realistic_tensors(3)
    sizes, ks = [x.numel() for x in xs], [num_selected(x.numel(), 0.004) for x in xs]
    flat = torch.cat([x.reshape(-1) for x in xs])
    batched = sampled_topk_mask(flat.abs(), sizes, ks, generator=None)
    for seg, m, k in zip(flat.split(sizes), batched.mask.split(sizes), ks):
        assert torch.equal(m.nonzero().view(-1), sampled_topk(seg, k))
    # few non-zeros: all of them go, no zero is sent
    sparse = torch.zeros(10_000)
    sparse[[3, 500, 9000]] = torch.tensor([1.0, -2.0, 3.0])
    assert sampled_topk(sparse, 100).tolist() == [3, 500, 9000]
    # ties defeat any threshold: the exact top-k fallback sends exactly k
    ties = torch.ones(10_000)
    sel = sampled_topk_mask(ties, [10_000], [50], generator=torch.Generator().manual_seed(0))
    assert sel.exact == [True] and sel.counts == [50] and int(sel.mask.sum()) == 50
    # k >= numel sends everything
    assert sampled_topk(torch.randn(5, 2), 10).tolist() == list(range(10))


# -- one worker: the accumulation, the masking, mass conservation, state ---------------------------


@pytest.mark.parametrize("nesterov,fp16", [(False, False), (True, False), (False, True)])
def test_mass_is_conserved_exactly(nesterov, fp16):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(200, 50))
    b = nn.Parameter(torch.randn(50))
    m = 0.9
    opt = DGC([w, b], lr=0.1, momentum=m, nesterov=nesterov, density=0.01, warmup_densities=(),
              fp16_values=fp16)
    u, acc = torch.zeros_like(w), torch.zeros_like(w)
    for step in range(5):
        g = torch.randn_like(w) * (step + 1)
        w.grad, b.grad = g.clone(), torch.randn_like(b)
        # the corrected accumulated gradient, computed as the spec writes it
        if nesterov:
            u_new = (u + g) * m
            full = acc + (u_new + g)
        else:
            u_new = u * m + g
            full = acc + u_new
        w_before = w.detach().clone()
        opt.step()
        ex = opt.last_exchange()
        sent = torch.zeros(w.numel())
        sent[ex["indices"]] = ex["values"].float()
        residual = opt.state[w]["accumulation"]
        assert torch.equal(residual.reshape(-1) + sent, full.reshape(-1)), "sent + residual != accumulation"
        if not fp16:
            assert torch.equal(residual.reshape(-1)[ex["indices"]], torch.zeros(ex["sent"]))
        assert ex["sent"] == sum(ex["counts"]) and 0.8 * ex["k"][0] <= ex["sent"] <= 1.3 * ex["k"][0]
        # momentum factor masking: u is zero exactly where an entry was sent, untouched elsewhere
        sent_mask = torch.zeros(w.numel(), dtype=torch.bool)
        sent_mask[ex["indices"]] = True
        expected_u = torch.where(sent_mask, 0.0, u_new.reshape(-1))
        assert torch.equal(opt.state[w]["momentum"].reshape(-1), expected_u)
        # one worker: the averaged sparse gradient is what was sent, and the update is lr times it
        assert torch.equal(ex["averaged"], sent)
        torch.testing.assert_close(w.detach(), w_before - 0.1 * sent.view_as(w), rtol=0, atol=1e-6)
        u, acc = opt.state[w]["momentum"].clone(), residual.clone()


@pytest.mark.e2e
def test_state_dict_round_trip_resumes_exactly():
    def make():
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(30, 40), nn.ReLU(), nn.Linear(40, 3))
        return model, create_optimizer("dgc", model, lr=0.05, weight_decay=1e-3, density=0.05,
                                       warmup_densities=(0.3,), nesterov=True, momentum=0.9)

    def train(model, opt, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x, y = torch.randn(16, 30, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model, opt = make()
    train(model, opt, 3, 0)
    opt.begin_epoch(1)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, 4, 1)

    model2, opt2 = make()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert opt2.density == 0.05 and opt2.epoch == 1
    train(model2, opt2, 4, 1)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)  # the residuals, momenta and sampling generator all came back
    with pytest.raises(ValueError, match="not a DGC state dict"):
        opt2.load_state_dict({"state": {}, "param_groups": []})


def test_warmup_schedule_is_followed():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(400, 250))
    opt = DGC([w], lr=0.01, momentum=0.9)  # the default schedule
    assert opt.density == 0.25  # epoch 0 before any begin_epoch
    expected = [0.25, 0.063, 0.015, 0.004, 0.001, 0.001, 0.001]
    for epoch, density in enumerate(expected):
        assert opt.begin_epoch(epoch) == density and opt.density == density
        w.grad = torch.randn_like(w)
        opt.step()
        ex = opt.last_exchange()
        k = math.ceil(density * w.numel())
        assert ex["density"] == density and ex["k"] == [k]
        assert 0.8 * k <= ex["sent"] <= 1.3 * k
    custom = DGC([nn.Parameter(torch.zeros(4, 4))], density=0.01, warmup_densities=(0.5,))
    assert [custom.density_at(e) for e in range(3)] == [0.5, 0.01, 0.01]
    assert DGC([nn.Parameter(torch.zeros(4, 4))], density=0.01, warmup_densities=()).density == 0.01
    custom.density = 0.2  # the direct setter, for loops that schedule by step
    assert custom.density == 0.2


def test_invalid_settings_raise_clear_errors():
    p = [nn.Parameter(torch.zeros(3, 3))]
    bad = [
        (dict(density=0.0), "density"),
        (dict(density=1.5), "density"),
        (dict(warmup_densities=(0.5, 2.0)), r"warmup_densities\[1\]"),
        (dict(warmup_densities="0.25"), "warmup_densities"),
        (dict(sample_ratio=0.001), "sample_ratio"),
        (dict(density_bounds=(1.2, 1.3)), r"density_bounds\[0\]"),
        (dict(density_bounds=0.8), "density_bounds"),
        (dict(max_adjust_iters=-1), "max_adjust_iters"),
        (dict(clip_norm=0.0), "clip_norm"),
        (dict(fp16_values="yes"), "fp16_values"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=0.0, nesterov=True), "nesterov"),
        (dict(lr=-0.1), "lr"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(nonfinite="warn"), "nonfinite"),
    ]
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            DGC(p, **kwargs)
    opt = DGC(p)
    with pytest.raises(ValueError, match="density"):
        opt.density = 0
    with pytest.raises(ValueError, match="epoch"):
        opt.begin_epoch(-1)
    with pytest.raises(ValueError, match="unknown setting"):
        create_optimizer("dgc", p, compress_ratio=0.01)
    p[0].grad = torch.full((3, 3), float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
    assert torch.equal(p[0], torch.zeros(3, 3))  # nothing was touched


# -- several workers ----------------------------------------------------------------------------------


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 20, generator=g)
    return x, x[:, :4] * 2 - x[:, 4:8] + 0.1 * torch.randn(32, 4, generator=g)


def _density_one_vs_sgd(rank, world_size):
    out = []
    for nesterov in (False, True):
        model_a, model_b = _mlp(), _mlp()
        sgd = torch.optim.SGD(model_a.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-3)
        dgc = DGC(model_b.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=1e-3,
                  density=1.0, warmup_densities=())
        ddp_a, ddp_b = wrap_model(model_a, sgd), wrap_model(model_b, dgc)
        for step in range(6):
            x, y = _batch(rank, step)
            for ddp, opt in ((ddp_a, sgd), (ddp_b, dgc)):
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
        out.append(([p.detach() for p in model_a.parameters()], [p.detach() for p in model_b.parameters()]))
    return out


@pytest.mark.multiprocess
def test_density_one_equals_momentum_sgd_on_averaged_gradients(two_ranks):
    """Plain and Nesterov, with weight decay, 2 ranks with different data."""
    initial = list(_mlp().parameters())
    for per_rank in (r["sgd"] for r in two_ranks):
        for ref, got in per_rank:
            for a, b in zip(ref, got):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
            assert any((a - p0).abs().max() > 1e-2 for a, p0 in zip(ref, initial))  # training moved them


def _ledger_two_steps(rank, world_size):
    out = {}
    for fp16, int32 in ((False, False), (True, True)):
        model = _mlp()
        opt = DGC(model.parameters(), lr=0.05, density=0.02, warmup_densities=(), fp16_values=fp16,
                  int32_indices=int32)
        ddp = wrap_model(model, opt)
        steps = []
        for step in range(2):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            local_grad = model[0].weight.grad.clone()
            opt.step()
            ex = opt.last_exchange()
            steps.append(dict(stats=opt.comm_stats()["last_step"], padded=ex["padded"],
                              counts=ex["counts_by_rank"], sent=ex["sent"], local_grad=local_grad))
        out[fp16, int32] = steps
    return out, [p.numel() for p in model.parameters() if p.dim() == 1]


@pytest.mark.multiprocess
def test_ledger_bytes_per_step_equal_the_formula(two_ranks):
    """sent values x value size + indices x index size + dense bytes, fp32/int64 and fp16/int32."""
    n = 2
    out = [r["ledger"] for r in two_ranks]
    dense_numel = sum(out[0][1])
    for (fp16, int32), vsize, isize in (((False, False), 4, 8), ((True, True), 2, 4)):
        for rank in range(n):
            for step, s in enumerate(out[rank][0][fp16, int32]):
                counts = [out[r][0][fp16, int32][step]["sent"] for r in range(n)]
                assert s["counts"] == counts and s["padded"] == max(counts)  # all pad to the largest count
                stats = s["stats"]
                assert stats["sparse_values"]["payload"] == max(counts) * vsize
                assert stats["sparse_indices"]["payload"] == max(counts) * isize
                assert stats["grads"]["payload"] == dense_numel * vsize  # the biases, all-reduced
                # 4 B non-finite agreement + 8 B count; at the first step 7 int64 for the layout and start check
                assert stats["control"]["payload"] == 4 + 8 + (7 * 8 if step == 0 else 0)
                assert stats["all"]["payload"] == sum(v["payload"] for k, v in stats.items() if k != "all")
                assert stats["sparse_values"]["wire"] == (n - 1) * max(counts) * vsize
                assert stats["grads"]["wire"] == 2 * (n - 1) / n * dense_numel * vsize
        # DDP sent nothing: each rank's gradient stayed local
        assert not torch.equal(out[0][0][fp16, int32][0]["local_grad"], out[1][0][fp16, int32][0]["local_grad"])


def _train_and_agree(rank, world_size):
    model = _mlp()
    opt = create_optimizer("dgc", model, lr=0.05, momentum=0.9, weight_decay=1e-4, density=0.05,
                           warmup_densities=(0.25,), clip_norm=5.0)
    ddp = wrap_model(model, opt)
    x_eval, y_eval = _batch(99, 0)
    with torch.no_grad():
        loss0 = nn.functional.mse_loss(model(x_eval), y_eval).item()
    exchanges = []
    for step in range(60):
        opt.begin_epoch(step // 20)
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if step in (0, 59):
            ex = opt.last_exchange()
            exchanges.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in ex.items()})
    with torch.no_grad():
        loss1 = nn.functional.mse_loss(model(x_eval), y_eval).item()
    # back to density 1: the pending residuals and local momenta are averaged once, then dense SGD
    opt.density = 1.0
    x, y = _batch(rank, 60)
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    flush = opt.comm_stats()["last_step"]
    sparse_state = [(opt.state[p]["momentum"].clone(), opt.state[p]["accumulation"].clone())
                    for p in model.parameters() if p.dim() > 1]
    return (loss0, loss1, [p.detach().clone() for p in model.parameters()], exchanges, flush, sparse_state,
            sum(p.numel() for p in model.parameters() if p.dim() > 1))


def _clip_one_step(rank, world_size):
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(50, 40))
    opt = DGC([w], lr=1.0, momentum=0.0, density=1.0, warmup_densities=(), clip_norm=2.0)
    g = torch.randn(50, 40, generator=torch.Generator().manual_seed(rank)) * (1 + 3 * rank)
    w.grad = g.clone()
    opt.step()
    return g, -w.detach()


def _scenarios(rank, world_size):
    return dict(sgd=_density_one_vs_sgd(rank, world_size), ledger=_ledger_two_steps(rank, world_size),
                agree=_train_and_agree(rank, world_size), clip=_clip_one_step(rank, world_size))


@pytest.mark.multiprocess
def test_local_clipping_scales_the_threshold_by_one_over_sqrt_n(two_ranks):
    grads = [r["clip"][0] for r in two_ranks]
    limit = 2.0 / math.sqrt(2)
    clipped = [g * min(1.0, limit / (g.norm().item() + 1e-6)) for g in grads]
    assert grads[1].norm() > limit  # the bound bites on at least one rank
    for r in two_ranks:
        torch.testing.assert_close(r["clip"][1], (clipped[0] + clipped[1]) / 2, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def two_ranks():
    """The multi-process scenarios, run in one pair of gloo processes (spawning dominates their cost)."""
    return run(_scenarios, 2)


@pytest.mark.multiprocess
def test_ranks_agree_and_loss_decreases(two_ranks):
    out = [r["agree"] for r in two_ranks]
    (l0, l1, params0, ex0, flush, state0, numel), (_, l1b, params1, ex1, _, state1, _) = out
    assert l1 < 0.5 * l0 and l1 == l1b, (l0, l1, l1b)
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)  # the same averaged sparse update on every rank, bit for bit
    for e0, e1 in zip(ex0, ex1):
        assert torch.equal(e0["averaged"], e1["averaged"])
        expected = torch.zeros(numel)
        for e in (e0, e1):
            expected.index_add_(0, e["indices"], e["values"].float())
        torch.testing.assert_close(e0["averaged"], expected / 2, rtol=0, atol=1e-7)
        assert e0["counts_by_rank"] == [e0["sent"], e1["sent"]]
        assert not torch.equal(e0["indices"], e1["indices"])  # each rank picked from its own accumulation
    assert ex0[0]["density"] == 0.25 and ex0[1]["density"] == 0.05
    assert flush["residual"]["payload"] == 2 * numel * 4 and "sparse_values" not in flush
    for (u0, a0), (u1, a1) in zip(state0, state1):
        assert torch.equal(u0, u1) and not a0.any() and not a1.any()
