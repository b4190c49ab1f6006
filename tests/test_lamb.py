"""LAMB against timm's public implementation and its own reference path."""
import pytest
import torch
from timm.optim import Lamb as TimmLamb

import slamb
from slamb.optim.lamb import lamb_reference


def make_params(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (16, 8, 3), (5,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


def feed(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = 0.05 * p.detach() + torch.randn(p.shape, generator=gen, dtype=p.dtype)


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_equals_timm_lamb(wd):
    ours, theirs = make_params(), make_params()
    opt = slamb.LAMB(ours, lr=0.02, betas=(0.9, 0.999), eps=1e-6, weight_decay=wd)
    ref = TimmLamb(theirs, lr=0.02, betas=(0.9, 0.999), eps=1e-6, weight_decay=wd,
                   max_grad_norm=None, always_adapt=True, trust_clip=False)
    for t in range(10):
        feed(ours, t)
        feed(theirs, t)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [dict(), dict(bias_correction=False, trust_clamp=(0.01, 0.3)),
                                     dict(weight_decay=0.1, trust_clamp=(0.5, 0.6))])
def test_foreach_equals_reference(options):
    fast, slow = make_params(), make_params()
    opt_fast = slamb.LAMB(fast, lr=0.01, foreach=True, **options)
    opt_slow = slamb.LAMB(slow, lr=0.01, foreach=False, **options)
    for t in range(6):
        feed(fast, t)
        feed(slow, t)
        opt_fast.step()
        opt_slow.step()
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_deepspeed_baseline_options_follow_the_formula():
    """No bias correction and the trust ratio clamped to [0.01, 0.3], checked by hand at step 1."""
    (p,) = make_params()[:1]
    g = torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(3))
    p.grad = g.clone()
    expected = p.detach().clone()
    m, v = 0.1 * g, 0.001 * g * g
    u = m / (v.sqrt() + 1e-6) + 0.01 * expected
    trust = min(max(float(expected.norm() / u.norm()), 0.01), 0.3)
    expected -= 0.5 * trust * u
    slamb.LAMB([p], lr=0.5, weight_decay=0.01, bias_correction=False, trust_clamp=(0.01, 0.3)).step()
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)
    assert trust == 0.3  # the clamp was active, so the check means something


def test_zero_norm_trust_ratio_is_one():
    p = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
    p.grad = torch.ones(4, 4, dtype=torch.float64)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    lamb_reference(p.detach(), p.grad, m, v, t=1, lr=0.1, b1=0.9, b2=0.999, eps=0.0, wd=0.0,
                   bias_correction=True, trust_clamp=None)
    torch.testing.assert_close(p.detach(), torch.full((4, 4), -0.1, dtype=torch.float64))


@pytest.mark.parametrize("foreach", [True, False])
def test_zero_initialised_bias_takes_the_full_step_under_the_clamp(foreach):
    """DeepSpeed's BERT clamp [0.01, 0.3] binds only where both norms are positive: at step 1 a zero
    bias moves by lr * u (trust 1, as DeepSpeed and apex), while the weight's ratio is clamped to 0.3."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=gen, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    weight.grad = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    bias.grad = torch.randn(6, generator=gen, dtype=torch.float64)
    w0 = weight.detach().clone()
    slamb.LAMB([weight, bias], lr=0.5, bias_correction=False, trust_clamp=(0.01, 0.3), foreach=foreach).step()
    u_bias = 0.1 * bias.grad / ((0.001 * bias.grad**2).sqrt() + 1e-6)
    torch.testing.assert_close(bias.detach(), -0.5 * u_bias, rtol=1e-12, atol=1e-12)
    u_weight = 0.1 * weight.grad / ((0.001 * weight.grad**2).sqrt() + 1e-6)
    assert float(w0.norm() / u_weight.norm()) > 0.3  # the clamp binds on the weight
    torch.testing.assert_close(weight.detach(), w0 - 0.5 * 0.3 * u_weight, rtol=1e-12, atol=1e-12)


def test_per_group_learning_rates_and_no_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = slamb.create_optimizer("lamb", model, lr=0.01, weight_decay=0.05)
    decayed, plain = opt.param_groups
    assert [p.dim() for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.05
    assert all(p.dim() == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0
    # with a scheduler the group lr moves and the step follows it: at step 1 the update is linear in lr
    a, b = make_params(), make_params()
    opt_a = slamb.LAMB([{"params": a[:2], "lr": 0.01}, {"params": a[2:], "lr": 0.03}])
    opt_b = slamb.LAMB([{"params": b[:2], "lr": 0.01}, {"params": b[2:], "lr": 0.01}])
    start = [p.detach().clone() for p in a]
    feed(a, 0)
    feed(b, 0)
    opt_a.step()
    opt_b.step()
    for i in range(4):
        scale = 3.0 if i >= 2 else 1.0
        torch.testing.assert_close(a[i] - start[i], scale * (b[i] - start[i]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kwargs,name", [(dict(lr=-0.1), "lr"), (dict(betas=(0.9, 1.0)), "betas"),
                                         (dict(eps=-1.0), "eps"), (dict(weight_decay=-1.0), "weight_decay"),
                                         (dict(trust_clamp=(0.5, 0.1)), "trust_clamp"),
                                         (dict(nonfinite="warn"), "nonfinite")])
def test_invalid_settings(kwargs, name):
    with pytest.raises(ValueError, match=name):
        slamb.LAMB(make_params(), **kwargs)


def test_nonfinite_gradients():
    params = make_params()
    before = [p.detach().clone() for p in params]
    feed(params, 0)
    params[1].grad[0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"\(32,\)"):
        slamb.LAMB(params).step()
    opt = slamb.LAMB(params, nonfinite="skip")
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert not opt.state  # nothing initialised or advanced: the step never happened


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_huge_finite_gradients_are_not_taken_for_nonfinite(dtype):
    """The check screens with the 2-norm, which overflows for finite values near the dtype's maximum:
    those tensors must get the exact check, not a false alarm; a NaN beside them is still found."""
    from slamb.optim.checks import nonfinite_skip

    huge = torch.full((1000,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(huge.float().norm()) or dtype == torch.float16  # the screen alone would flag it
    assert not nonfinite_skip([huge, torch.ones(3, dtype=dtype)], ["a", "b"], "raise", ledger=None, agree=False)
    nan = torch.tensor([1.0, float("nan")], dtype=dtype)
    with pytest.raises(FloatingPointError, match=r"gradients: c\b"):
        nonfinite_skip([huge, torch.ones(3, dtype=dtype), nan], ["a", "b", "c"], "raise", ledger=None,
                       agree=False)
    # a fused optimizer's flat buffer, screened by its sum, which overflows for these too
    flat = torch.cat([huge, torch.ones(3, dtype=dtype)])
    assert not torch.isfinite(flat.sum(dtype=torch.float32)) or dtype == torch.float16
    assert not nonfinite_skip([huge, torch.ones(3, dtype=dtype)], ["a", "b"], "raise", ledger=None, agree=False,
                              screened=[flat])
    with pytest.raises(FloatingPointError, match=r"gradients: c\b"):
        nonfinite_skip([huge, torch.ones(3, dtype=dtype), nan], ["a", "b", "c"], "raise", ledger=None,
                       agree=False, screened=[torch.cat([flat, nan])])
