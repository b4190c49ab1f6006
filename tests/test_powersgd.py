"""PowerSGD (slamb.optim.powersgd): torch's powerSGD_hook as a registry optimizer. Full rank equals
all-reduce SGD, the ledger's bytes equal P and Q sizes plus the uncompressed tensors, a checkpoint
resumes bit for bit, the ranks agree after every step, bad settings fail in one line."""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn

from slamb import DistributedOptimizer, create_optimizer, wrap_model

from .distributed import run

STEPS = 6


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def batch(rank: int, t: int):
    g = torch.Generator().manual_seed(1000 * rank + t)  # each rank its own data
    return torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)


def train(rank, name, settings, steps, *, model=None, opt=None, start=0, ddp_kwargs=None):
    model = model or make_model()
    opt = opt or create_optimizer(name, model.parameters(), **settings)
    net = wrap_model(model, opt, **(ddp_kwargs or {}))
    history = []
    for t in range(start, start + steps):
        x, y = batch(rank, t)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append({"params": [p.detach().clone() for p in model.parameters()],
                        "bytes": {k: v["payload"] for k, v in opt.comm_stats()["last_step"].items()},
                        "calls": {k: v["calls"] for k, v in opt.comm_stats()["last_step"].items()}})
    return model, opt, history


def full_rank_worker(rank, world):
    common = dict(lr=0.1, momentum=0.9)
    _, _, sgd = train(rank, "sgd", common, STEPS)
    full = dict(common, matrix_approximation_rank=8, min_compression_rate=0.1, start_powerSGD_iter=2)
    _, _, psgd = train(rank, "powersgd", full, STEPS)
    _, _, low = train(rank, "powersgd", dict(full, matrix_approximation_rank=1), STEPS)
    return sgd, psgd, low


@pytest.mark.multiprocess
def test_full_rank_equals_allreduce_sgd_and_ranks_agree():
    res = run(full_rank_worker, 2)
    for sgd, psgd, low in res:
        for t in range(STEPS):
            for a, b in zip(psgd[t]["params"], sgd[t]["params"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # the equality is not vacuous: every tensor went through P and Q, and rank 1 is far from SGD
        assert psgd[-1]["bytes"]["powersgd_p"] > 0 and psgd[-1]["bytes"]["grads"] == 0
        gap = max((a - b).abs().max().item() for a, b in zip(low[-1]["params"], sgd[-1]["params"]))
        assert gap > 1e-3
    for t in range(STEPS):  # every rank decodes the same P and Q: identical parameters, bit for bit
        for run_ in (1, 2):
            for a, b in zip(res[0][run_][t]["params"], res[1][run_][t]["params"]):
                assert torch.equal(a, b)


def expected_bytes(model, rank: int, min_rate: float) -> dict:
    """PowerSGD's split of each tensor viewed as (shape[0], rest): rank-r factors or the tensor itself."""
    p_numel = q_numel = plain = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            p_numel, q_numel = p_numel + n * r, q_numel + m * r
        else:
            plain += p.numel()
    return {"powersgd_p": 4 * p_numel, "powersgd_q": 4 * q_numel, "grads": 4 * plain}


def bytes_worker(rank, world):
    settings = dict(lr=0.05, matrix_approximation_rank=2, start_powerSGD_iter=3)
    model, _, hist = train(rank, "powersgd", settings, 5)
    return expected_bytes(model, 2, 2.0), sum(4 * p.numel() for p in model.parameters()), hist


@pytest.mark.multiprocess
def test_bytes_per_step_equal_the_formula():
    compressed, whole, hist = run(bytes_worker, 2)[0]
    assert compressed["powersgd_p"] > 0 and compressed["grads"] > 0  # both paths are exercised
    for t in range(3):  # the first start_powerSGD_iter backward passes: the whole gradient, one all-reduce
        assert hist[t]["bytes"] == {"grads": whole, "all": whole}
        assert hist[t]["calls"]["grads"] == 1
    for t in (3, 4):  # then per bucket (one here): the uncompressed tensors, every P, every Q
        assert hist[t]["bytes"] == {**compressed, "all": sum(compressed.values())}
        assert hist[t]["calls"] == {"grads": 1, "powersgd_p": 1, "powersgd_q": 1, "all": 3}


RESUME = dict(lr=0.1, momentum=0.9, matrix_approximation_rank=1, start_powerSGD_iter=2)


def resume_worker(rank, world):
    _, _, straight = train(rank, "powersgd", RESUME, 7)
    model, opt, _ = train(rank, "powersgd", RESUME, 4)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    resumed = {}
    for cap in (None, 1e-6):  # DDP's default buckets, and one bucket per tensor: the state is per parameter
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        model = make_model()
        opt = create_optimizer("powersgd", model.parameters(), **RESUME)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        kwargs = {} if cap is None else {"bucket_cap_mb": cap}
        resumed[cap] = train(rank, "powersgd", RESUME, 3, model=model, opt=opt, start=4, ddp_kwargs=kwargs)[2]
    return saved["opt"]["powersgd"], straight, resumed


@pytest.mark.multiprocess
def test_checkpoint_round_trip_resumes_bit_exactly():
    for saved, straight, resumed in run(resume_worker, 2):
        assert sorted(saved["error"]) == list(range(6)) and saved["q"]  # error feedback and warm start were saved
        for hist in resumed.values():
            for t in range(3):
                for a, b in zip(straight[4 + t]["params"], hist[t]["params"]):
                    assert torch.equal(a, b)
                assert straight[4 + t]["bytes"] == hist[t]["bytes"]


@pytest.mark.parametrize("setting, message", [
    (dict(matrix_approximation_rank=0), r"invalid matrix_approximation_rank=0: must be an integer >= 1"),
    (dict(start_powerSGD_iter=1), r"invalid start_powerSGD_iter=1: must be an integer >= 2 with use_error_feedback"),
    (dict(min_compression_rate=-1.0), r"invalid min_compression_rate=-1.0: must be a number in \[0.0, inf\)"),
    (dict(warm_start="yes"), r"invalid warm_start='yes': must be one of \[True, False\]"),
    (dict(momentum=1.0), r"invalid momentum=1.0: must be a number in \[0.0, 1.0\)"),
])
def test_invalid_settings_fail_in_one_line(setting, message):
    with pytest.raises(ValueError, match=message) as info:
        create_optimizer("powersgd", make_model(), **setting)
    assert "\n" not in str(info.value)


def test_plain_allreduce_settings_need_no_warm_up():
    opt = create_optimizer("powersgd", make_model(), start_powerSGD_iter=0, use_error_feedback=False,
                           warm_start=False)
    assert opt.powersgd.start_powerSGD_iter == 0
    assert isinstance(opt, DistributedOptimizer)
    assert (opt.communication, opt.per_rank_state, opt.params_differ) == ("optimizer_hook", True, False)
