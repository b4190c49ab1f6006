"""DiLoCo (slamb.optim.diloco): H = 1 with inner SGD, outer lr 1 and no outer momentum is data-parallel
SGD; the outer step is torch's Nesterov SGD on the averaged parameter change; one parameter all-reduce
every H steps and nothing else; the ranks agree after each outer step; a checkpoint resumes bit for bit."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from slamb import LAMB, DistributedOptimizer, create_optimizer, wrap_model

from .distributed import run


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, t: int):
    g = torch.Generator().manual_seed(1000 * rank + t)  # each rank its own data
    return torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)


def loss_fn(net, rank, t):
    x, y = batch(rank, t)
    return nn.functional.cross_entropy(net(x), y)


def train(rank, name, settings, steps, *, model=None, opt=None, net=None, start=0):
    model = model or make_model()
    opt = opt or create_optimizer(name, model, weight_decay=0.01, **settings)
    net = net or wrap_model(model, opt)
    history = []
    for t in range(start, start + steps):
        loss_fn(net, rank, t).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = opt.comm_stats()["last_step"]
        history.append({"params": [p.detach().clone() for p in model.parameters()],
                        "bytes": {k: v["payload"] for k, v in last.items()}})
    return model, opt, history


def sgd_worker(rank, world):
    _, _, sgd = train(rank, "sgd", dict(lr=0.1, momentum=0.0), 5)
    degenerate = dict(inner="sgd", lr=0.1, sync_interval=1, outer_lr=1.0, outer_momentum=0.0)
    _, _, diloco = train(rank, "diloco", degenerate, 5)
    return sgd, diloco


@pytest.mark.multiprocess
def test_h1_inner_sgd_outer_lr_1_no_momentum_equals_data_parallel_sgd():
    for sgd, diloco in run(sgd_worker, 2):
        for t in range(5):
            for a, b in zip(diloco[t]["params"], sgd[t]["params"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert sgd[-1]["params"][0].ne(make_model()[0].weight).any()  # it moved


H, OUTER = 3, dict(outer_lr=0.7, outer_momentum=0.9)


def outer_worker(rank, world, inner):
    """DiLoCo beside the algorithm written out with torch's AdamW, all_reduce and SGD(nesterov=True)."""
    import torch.distributed as dist

    settings = dict(inner=inner, lr=0.01, sync_interval=H, **OUTER)
    model, opt, hist = train(rank, "diloco", settings, 2 * H + 1)
    ref = make_model()
    anchor = [p.detach().clone().requires_grad_() for p in ref.parameters()]
    outer = torch.optim.SGD(anchor, lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True)
    inner_opt = (torch.optim.AdamW if inner == "adamw" else LAMB)(
        [{"params": [ref[0].weight, ref[2].weight], "weight_decay": 0.01},
         {"params": [ref[0].bias, ref[2].bias], "weight_decay": 0.0}], lr=0.01, eps=1e-8)
    expected = []
    for t in range(2 * H + 1):
        loss_fn(ref, rank, t).backward()
        inner_opt.step()
        inner_opt.zero_grad(set_to_none=True)
        if (t + 1) % H == 0:
            with torch.no_grad():
                for a, p in zip(anchor, ref.parameters()):
                    avg = p.detach().clone()
                    dist.all_reduce(avg)
                    a.grad = a - avg / world
                outer.step()
                for a, p in zip(anchor, ref.parameters()):
                    p.copy_(a)
        expected.append([p.detach().clone() for p in ref.parameters()])
    return hist, expected, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("inner", ["adamw", "lamb"])
@pytest.mark.multiprocess
def test_outer_nesterov_step_bytes_and_rank_agreement(inner):
    res = run(outer_worker, 2, inner)
    for hist, expected, numel in res:
        for t in range(2 * H + 1):
            for a, b in zip(hist[t]["params"], expected[t]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            sync = (t + 1) % H == 0  # one parameter all-reduce every H steps, nothing in between
            assert hist[t]["bytes"] == ({"params": 4 * numel, "all": 4 * numel} if sync else {"all": 0})
    for t in range(2 * H + 1):
        same = all(torch.equal(a, b) for a, b in zip(res[0][0][t]["params"], res[1][0][t]["params"]))
        assert same == ((t + 1) % H == 0)  # the ranks meet at each outer step and drift apart in between


RESUME = dict(lr=0.01, sync_interval=H, **OUTER)


def resume_worker(rank, world):
    _, _, straight = train(rank, "diloco", RESUME, 8)
    model, opt, _ = train(rank, "diloco", RESUME, 4)  # mid-interval: anchor, outer momentum, local drift
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model = make_model()
    opt = create_optimizer("diloco", model, weight_decay=0.01, **RESUME)
    net = wrap_model(model, opt)  # DDP broadcasts rank 0's parameters: each rank's own come after
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    _, opt, resumed = train(rank, "diloco", RESUME, 4, model=model, opt=opt, net=net, start=4)
    mine = [p.detach().clone() for p in model.parameters()]
    opt.average_parameters()
    return straight, resumed, mine, [p.detach().clone() for p in model.parameters()], opt.comm_stats()


@pytest.mark.multiprocess
def test_checkpoint_round_trip_resumes_bit_exactly_and_average_parameters():
    res = run(resume_worker, 2)
    for straight, resumed, *_ in res:
        for t in range(4):
            for a, b in zip(straight[4 + t]["params"], resumed[t]["params"]):
                assert torch.equal(a, b)
            assert straight[4 + t]["bytes"] == resumed[t]["bytes"]
    (_, _, mine0, avg0, stats), (_, _, mine1, avg1, _) = res
    assert any(not torch.equal(a, b) for a, b in zip(mine0, mine1))  # 8 steps: 2 past the last outer step
    for a, b, x, y in zip(avg0, avg1, mine0, mine1):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, (x + y) / 2)
    assert stats["total"]["params"]["calls"] == 8 // H + 1  # two outer steps and the average


@pytest.mark.parametrize("setting, message", [
    (dict(inner="adam"), r"invalid inner='adam': must be one of \['adamw', 'lamb', 'sgd'\]"),
    (dict(sync_interval=0), r"invalid sync_interval=0: must be an integer >= 1"),
    (dict(outer_lr=0.0), r"invalid outer_lr=0.0: must be a number in \(0.0, inf\)"),
    (dict(outer_momentum=1.0), r"invalid outer_momentum=1.0: must be a number in \[0.0, 1.0\)"),
    (dict(betas=(0.9,)), r"invalid betas=\(0.9,\): must be a pair"),
])
def test_invalid_settings_fail_in_one_line(setting, message):
    with pytest.raises(ValueError, match=message) as info:
        create_optimizer("diloco", make_model(), **setting)
    assert "\n" not in str(info.value)


def test_contract_and_scheduler_act_on_the_inner_rate():
    opt = create_optimizer("diloco", make_model(), lr=0.01, weight_decay=0.1)
    assert isinstance(opt, DistributedOptimizer)
    assert (opt.communication, opt.params_differ, opt.per_rank_state) == ("optimizer_hook", True, True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.inner.param_groups] == [0.005, 0.005] and opt.outer_lr == 0.7
