"""1-bit LAMB and its error-compensated 1-bit all-reduce, on CPU/gloo with 2-3 processes."""
from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import slamb
from bert.train import initial_model, train
from harness import DistEnv, continue_optimizer
from slamb.compression.onebit import (ErrorFeedback, chunk_size, compress, compressed_allreduce, decompress,
                                      pack_bits, unpack_bits)
from slamb.optim.onebit_lamb import OnebitLamb
from tests.distributed import run
from tests.test_bert_pretrain import SEQ2, tiny_cfg, tiny_data  # noqa: F401  (tiny_data: a fixture)

FREEZE, STEPS, SAVE_AT = 8, 32, 20


def _model(seed: int = 0, width: int = 24) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 10*24+24 + 24*24+24 + 24*3+3 = 939 entries: not a multiple of 8n, so the padding is exercised
    return torch.nn.Sequential(torch.nn.Linear(10, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 3))


def _data(n: int = 128):
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(n, 10, generator=gen)
    w = torch.randn(10, 3, generator=gen)
    return x, torch.sin(x @ w)


def _shard(rank: int, world: int):
    x, y = _data()
    return x[rank::world], y[rank::world]


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train_steps(ddp, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


# -- bit packing and the compressor (one process) ------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 15, 16, 17, 1003])
def test_pack_bits_round_trip_with_padding_matches_numpy(numel):
    bits = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel / 8)
    assert np.array_equal(packed.numpy(), np.packbits(bits.numpy()))  # MSB first, zero padding
    assert torch.equal(unpack_bits(packed, numel), bits)
    padded = unpack_bits(packed, 8 * packed.numel())
    assert not padded[numel:].any()
    with pytest.raises(ValueError, match="cannot unpack"):
        unpack_bits(packed, 8 * packed.numel() + 1)


def test_compress_keeps_row_norm_and_sign():
    x = torch.tensor([[3.0, -4.0, 0.0, 0.0], [1.0, -1.0, 2.0, 0.0]])
    counts = torch.tensor([2, 4])  # row 0 has two padding entries
    bits, scales = compress(x, counts)
    assert torch.allclose(scales, torch.tensor([5 / math.sqrt(2), math.sqrt(6) / 2]))
    out = decompress(bits, scales, torch.float32)
    assert torch.equal(out.sign(), torch.tensor([[1.0, -1, 1, 1], [1, -1, 1, 1]]))  # zero -> +scale
    assert torch.allclose(out[0, :2].norm(), x[0].norm()) and torch.allclose(out[1].norm(), x[1].norm())


def test_chunking_pads_to_whole_bytes_per_rank():
    assert [chunk_size(d, 3) for d in (1, 24, 25, 939)] == [8, 8, 16, 320]
    mem = ErrorFeedback(939, 3, 2)
    assert mem.padded == 960 and mem.counts.tolist() == [320, 320, 299] and mem.server_count == 299
    with pytest.raises(ValueError, match="world size"):
        compressed_allreduce(torch.zeros(939), mem, ledger=None)  # built for 3 ranks, called with 1


# -- the compressed all-reduce tracks the dense mean ------------------------------------------------


def _track_dense_mean(rank, world, numel, calls):
    gen = torch.Generator().manual_seed(1000 + rank)
    # entries of very different magnitudes across the vector: the worst case for one scale per chunk
    x = torch.randn(numel, generator=gen) * torch.logspace(-1, 1, numel)
    dense = x.clone()
    dist.all_reduce(dense)
    dense /= world
    memory = ErrorFeedback(numel, world, rank)
    ledger = slamb.CommLedger()
    total = torch.zeros(numel)
    errors, worker_norm, server_norm = {}, [], []
    for t in range(1, calls + 1):
        out = compressed_allreduce(x.clone(), memory, ledger=ledger)
        total += out
        ledger.end_step()
        worker_norm.append(memory.worker.norm().item())
        server_norm.append(memory.server.norm().item())
        if t in (1, calls // 4, calls // 2, calls):
            errors[t] = ((total / t - dense).norm() / dense.norm()).item()
    # exact bookkeeping of error feedback: T * dense - sum(out) = mean_i(worker error_i) + server errors
    mean_worker = memory.worker.clone()
    dist.all_reduce(mean_worker)
    servers = torch.empty(world * memory.chunk)
    dist.all_gather_into_tensor(servers, memory.server)
    residual = calls * dense - total - (mean_worker / world + servers)[:numel]
    return dict(errors=errors, worker_norm=worker_norm, server_norm=server_norm, x_norm=x.norm().item(),
                dense_norm=dense.norm().item(), residual=residual.abs().max().item(), last=out,
                padding=(memory.worker[numel:].abs().sum().item(), memory.server[memory.server_count:].abs().sum().item()),
                ledger=ledger.summary(), padded=memory.padded)


@pytest.mark.multiprocess
def test_compressed_allreduce_converges_to_dense_mean_like_one_over_t():
    world, numel, calls = 3, 1000, 200
    res = run(_track_dense_mean, world, numel, calls)
    r0 = res[0]
    for r in res[1:]:
        assert torch.equal(r["last"], r0["last"])  # every rank decodes the same bytes
    e = r0["errors"]
    assert e[1] > 0.5  # one 1-bit call is a coarse estimate of the mean ...
    # ... but once the error buffers have filled (within 20 calls here), the running mean's error
    # is their fixed size spread over T calls: it halves when T doubles
    assert 1.7 < e[calls // 4] / e[calls // 2] < 2.3 and 1.7 < e[calls // 2] / e[calls] < 2.3
    assert e[calls] < 0.05
    for r in res:
        assert r["residual"] < 1e-5 * r["dense_norm"] * calls  # float32 round-off only
        # bounded: the buffers plateau (the second half of the calls is no larger than the first)
        half = calls // 2
        assert max(r["worker_norm"][half:]) <= 1.1 * max(r["worker_norm"][:half]) < 10 * r["x_norm"]
        assert max(r["server_norm"][half:]) <= 1.1 * max(r["server_norm"][:half]) < 10 * r["dense_norm"]
        assert r["padding"] == (0.0, 0.0)
    # bytes per call: P/8 signs through all_to_all, P/(8n) through all_gather; n + 1 float32 scales
    padded = r0["padded"]
    assert padded == 1008
    per_call = r0["ledger"]["last_step"]
    assert per_call["momentum_1bit"]["payload"] == padded // 8 + padded // (8 * world)
    assert per_call["momentum_1bit"]["wire"] == pytest.approx(2 * (world - 1) / world * padded / 8)
    assert per_call["scales"]["payload"] == 4 * (world + 1)
    assert per_call["scales"]["wire"] == pytest.approx(8 * (world - 1))


# -- warm-up equals LAMB ------------------------------------------------------------------------------


def _warmup_vs_lamb(rank, world):
    x, y = _shard(rank, world)
    out = []
    for bias_correction, wd in ((False, 0.01), (True, 0.0)):
        settings = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-6, bias_correction=bias_correction)
        models, opts = [_model(), _model()], []
        opts.append(slamb.create_optimizer("onebit_lamb", models[0], weight_decay=wd, freeze_step=100,
                                           min_coeff=0.01, max_coeff=0.3, **settings))
        opts.append(slamb.create_optimizer("lamb", models[1], weight_decay=wd, trust_clamp=(0.01, 0.3), **settings))
        for model, opt in zip(models, opts):
            _train_steps(slamb.wrap_model(model, opt), opt, x, y, 5)
        a, b = _params(models[0]), _params(models[1])
        out.append(dict(diff=(a - b).abs().max().item(), moved=(a - _params(_model())).abs().max().item(),
                        grads=[o.comm_stats()["total"]["grads"]["payload"] for o in opts],
                        coeffs=opts[0].lamb_coeffs()))
    return out


@pytest.mark.multiprocess
def test_warmup_equals_lamb_under_ddp(two_ranks):
    res = [r["warmup"] for r in two_ranks]
    numel = sum(p.numel() for p in _model().parameters())
    for case in res[0]:
        assert case["moved"] > 1e-2
        assert case["diff"] < 1e-6
        assert case["grads"] == [5 * 4 * numel, 5 * 4 * numel]  # the same averaging all-reduce, recorded
        # the EMA of the clamped coefficient after 5 steps: within (1 - 0.9^5) * [min_coeff, max_coeff]
        assert ((case["coeffs"] > 0) & (case["coeffs"] <= 0.3 * (1 - 0.9**5) + 1e-7)).all()
    for case0, case1 in zip(res[0], res[1]):
        assert case0["diff"] == case1["diff"]


# -- the full optimizer, its bytes and its checkpoints (one 2-rank run) ----------------------------


def _full_loss(model) -> float:
    x, y = _data()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def _fresh(state=None, **extra):
    model = _model()
    opt = slamb.create_optimizer("onebit_lamb", model, weight_decay=0.01, lr=0.1, freeze_step=FREEZE,
                                 max_coeff=0.3, eps=1e-6, **extra)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    return model, opt


def _snapshot(model, opt) -> dict:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _train_and_resume(rank, world):
    x, y = _shard(rank, world)
    model, opt = _fresh()
    ddp = slamb.wrap_model(model, opt)
    losses, per_step, saved = [_full_loss(model)], [], None
    for t in range(1, STEPS + 1):
        _train_steps(ddp, opt, x, y, 1)
        losses.append(_full_loss(model))
        per_step.append({k: v for k, v in opt.comm_stats()["last_step"].items()})
        if t == SAVE_AT:
            saved = _snapshot(model, opt)
    final = _params(model)

    resumed_model, resumed = _fresh(saved)
    _train_steps(slamb.wrap_model(resumed_model, resumed), resumed, x, y, STEPS - SAVE_AT)

    reset_model, reset = _fresh(saved, reset_error_on_load=True)
    reset_errors = reset._errors  # None: zero buffers are built at the next exchange
    _train_steps(slamb.wrap_model(reset_model, reset), reset, x, y, STEPS - SAVE_AT)
    return dict(losses=losses, per_step=per_step, final=final, resumed=_params(resumed_model),
                reset=_params(reset_model), reset_errors=reset_errors, reset_loss=_full_loss(reset_model),
                saved_opt=saved["opt"], saved_model=saved["model"],
                saved_errors=saved["opt"]["onebit"]["error_feedback"],
                numel=opt._layout.numel, m=opt._flat["exp_avg"].clone())


def _two_rank_suite(rank, world):
    return dict(warmup=_warmup_vs_lamb(rank, world), train=_train_and_resume(rank, world))


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-process run for every 2-rank test: starting processes is what costs here."""
    return run(_two_rank_suite, 2)


@pytest.fixture(scope="module")
def trained(two_ranks):
    return [r["train"] for r in two_ranks]


@pytest.mark.multiprocess
def test_loss_falls_and_ranks_stay_identical(trained):
    r0, r1 = trained
    losses = r0["losses"]
    assert losses[-1] < 0.5 * losses[0]
    assert losses[-1] < 0.7 * losses[FREEZE]  # the compression stage keeps learning
    every4 = losses[FREEZE::4]
    assert all(b < a for a, b in zip(every4, every4[1:]))
    assert torch.equal(r0["final"], r1["final"])  # every rank applies the same all-reduced momentum
    assert torch.equal(r0["m"], r1["m"])


@pytest.mark.multiprocess
def test_bytes_per_step_warmup_dense_then_one_bit(trained):
    world = 2
    numel = trained[0]["numel"]
    padded = world * chunk_size(numel, world)
    assert (numel, padded) == (939, 944)
    for t, tally in enumerate(trained[0]["per_step"], start=1):
        if t <= FREEZE:
            assert tally["grads"]["payload"] == 4 * numel
            # step 1 also checks once that every rank lays out and starts from the same parameters (4 int64)
            assert set(tally) == ({"grads", "control", "all"} if t == 1 else {"grads", "all"})
            assert t > 1 or tally["control"]["payload"] == 32
        else:
            assert "grads" not in tally  # no gradient all-reduce after freeze_step
            assert tally["momentum_1bit"]["payload"] == padded // 8 + padded // (8 * world)
            assert tally["momentum_1bit"]["wire"] == pytest.approx(2 * (world - 1) / world * padded / 8)
            assert tally["scales"]["payload"] == 4 * (world + 1)
            assert tally["control"]["payload"] == 4  # the rank-agreed non-finite check of local gradients
            assert set(tally) == {"momentum_1bit", "scales", "control", "all"}
    warm, onebit = trained[0]["per_step"][0]["all"]["wire"], trained[0]["per_step"][-1]["all"]["wire"]
    assert warm / onebit > 25  # 32-bit gradients vs 1-bit momentum plus a few scales


@pytest.mark.multiprocess
def test_checkpoint_restores_error_buffers_and_continues_identically(trained):
    for r in trained:
        assert r["saved_errors"] is not None and r["saved_errors"]["worker"].abs().max() > 0
        assert torch.equal(r["resumed"], r["final"])
        # reset (DeepSpeed's choice): buffers start from zero, the run goes on close to, not equal to, the original
        assert r["reset_errors"] is None
        assert not torch.equal(r["reset"], r["final"])
        assert r["reset_loss"] == pytest.approx(r["losses"][-1], rel=0.1)
    assert torch.equal(trained[0]["reset"], trained[1]["reset"])


@pytest.mark.multiprocess
def test_checkpoint_world_size_and_rank_checks(trained):
    saved = trained[1]["saved_opt"]  # rank 1 of 2 workers
    _, strict = _fresh()
    with pytest.raises(ValueError, match="reset_error_on_load=True"):
        strict.load_state_dict(saved)
    # with reset, the state is everyone's: one worker resumes it and keeps learning
    model, opt = _fresh({"model": trained[1]["saved_model"], "opt": saved}, reset_error_on_load=True)
    assert opt.compressing and opt._step == SAVE_AT and opt._errors is None
    assert torch.equal(opt.state[next(iter(model.parameters()))]["exp_avg_sq_fresh"].reshape(-1),
                       saved["state"][0]["exp_avg_sq_fresh"].reshape(-1))
    before = _full_loss(model)
    _train_steps(model, opt, *_data(), 10)
    assert _full_loss(model) < before
    assert opt.comm_stats()["last_step"]["all"]["payload"] == 0  # one worker sends nothing
    with pytest.raises(ValueError, match="another optimizer"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())


# -- one process: reference path, settings --------------------------------------------------------------


def test_reference_path_equals_flat_path_in_both_stages():
    results = []
    for foreach in (True, False):
        model = _model()
        opt = slamb.create_optimizer("onebit_lamb", model, weight_decay=0.05, lr=0.02, freeze_step=4,
                                     bias_correction=True, eps=1e-6, foreach=foreach, factor_threshold=0.3)
        _train_steps(model, opt, *_data(), 12)
        results.append((_params(model), opt.lamb_coeffs().clone(), opt._flat["exp_avg_sq_fresh"].clone()))
    (p0, c0, v0), (p1, c1, v1) = results
    assert torch.allclose(p0, p1, rtol=0, atol=1e-6)
    assert torch.allclose(c0, c1, rtol=1e-5) and torch.allclose(v0, v1, rtol=1e-5)
    assert v0.abs().max() > 0


def test_zero_initialised_bias_takes_the_full_warmup_step():
    """DeepSpeed's OnebitLamb: a zero norm leaves the coefficient at 1, outside the [0.01, 0.3] clamp, and
    that 1 does not enter the coefficient EMA; the weight's coefficient is clamped and enters it."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(6, 4, generator=gen, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    w0 = weight.detach().clone()
    opt = OnebitLamb([weight, bias], lr=0.5, eps=1e-6, max_coeff=0.3, freeze_step=10)
    for p in (weight, bias):
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    opt.step()
    u_weight, u_bias = (0.1 * p.grad / ((0.001 * p.grad**2).sqrt() + 1e-6) for p in (weight, bias))
    assert float(w0.norm() / u_weight.norm()) > 0.3  # the clamp binds on the weight
    torch.testing.assert_close(weight.detach(), w0 - 0.5 * 0.3 * u_weight, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias.detach(), -0.5 * u_bias, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(opt.lamb_coeffs(), torch.tensor([0.1 * 0.3, 0.0], dtype=torch.float64))


def test_freeze_fixes_scaling_and_fresh_v():
    model = _model()
    opt = OnebitLamb(model.parameters(), lr=0.01, freeze_step=3)
    _train_steps(model, opt, *_data(), 3)
    assert opt.compressing
    scaling = opt._scalar["scaling_coeff"]
    rms = torch.stack([opt.state[p]["exp_avg"].norm() / math.sqrt(p.numel()) for p in model.parameters()])
    assert torch.allclose(scaling * rms, rms.mean().expand_as(rms))  # equal magnitudes after scaling
    assert torch.equal(opt._flat["exp_avg_sq_fresh"], opt._flat["exp_avg_sq"])
    frozen_v = opt._flat["exp_avg_sq"].clone()
    _train_steps(model, opt, *_data(), 2)
    assert torch.equal(opt._flat["exp_avg_sq"], frozen_v)  # v stays frozen
    assert not torch.equal(opt._flat["exp_avg_sq_fresh"], frozen_v)
    assert torch.allclose(scaling * rms, rms.mean().expand_as(rms))  # computed once


def test_freeze_under_fp16_parameters_counts_large_tensors():
    """Sizes above fp16's largest value (65,504) must not become inf: the scaling is that of fp32."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 300, generator=gen).half()),
              torch.nn.Parameter(torch.randn(10, generator=gen).half())]
    opt = OnebitLamb(params, lr=1e-3, freeze_step=2)
    for _ in range(2):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 0.01).half()
        opt.step()
    rms = torch.stack([opt.state[p]["exp_avg"].double().norm() / math.sqrt(p.numel()) for p in params])
    expected = rms.mean() / rms
    torch.testing.assert_close(opt._scalar["scaling_coeff"].double(), expected, rtol=2e-3, atol=0)


def test_last_factor_respects_clamps_and_threshold():
    model = _model()
    opt = OnebitLamb(model.parameters(), lr=0.02, freeze_step=2, factor_threshold=0.1, factor_max=1.15)
    previous = torch.ones(len(list(model.parameters())))
    x, y = _data()
    moved = False
    for _ in range(12):
        # gradients larger than during the warm-up: v_fresh grows, the factor wants to fall
        _train_steps(model, opt, x, 5 * y, 1)
        if opt.compressing:
            last = opt._scalar["last_factor"].clone()
            assert (last <= previous * 1.1 + 1e-6).all() and (last >= previous * 0.9 - 1e-6).all()
            assert ((last >= 0.5) & (last <= 1.15)).all()
            moved |= bool((last != previous).any())
            previous = last
    assert moved


def test_nonfinite_skip_does_not_count_the_step():
    model = _model()
    opt = OnebitLamb(model.parameters(), freeze_step=2, nonfinite="skip")
    _train_steps(model, opt, *_data(), 2)
    before = _params(model)
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    assert opt._step == 2 and torch.equal(_params(model), before)
    opt.nonfinite = "raise"
    with pytest.raises(FloatingPointError):
        opt.step()


@pytest.mark.parametrize("setting, value, match", [
    ("freeze_step", 0, "freeze_step"), ("freeze_step", 2.5, "freeze_step"), ("freeze_step", True, "freeze_step"),
    ("coeff_beta", 1.0, "coeff_beta"), ("factor_min", 0.0, "factor_min"), ("factor_max", 0.4, "factor_max"),
    ("factor_threshold", -0.1, "factor_threshold"), ("factor_threshold", 1.0, "factor_threshold"),
    ("min_coeff", -1.0, "min_coeff"), ("max_coeff", 0.001, "max_coeff"), ("lr", -0.1, "lr"),
    ("betas", (0.9, 1.0), "betas"), ("eps", 0.0, "eps"), ("weight_decay", -0.1, "weight_decay"),
    ("bias_correction", "yes", "bias_correction"), ("nonfinite", "warn", "nonfinite"),
    ("reset_error_on_load", 1, "reset_error_on_load"),
])
def test_invalid_settings_raise(setting, value, match):
    with pytest.raises(ValueError, match=match):
        OnebitLamb(_model().parameters(), **{setting: value})


def test_registry_builds_it_with_weight_decay_groups():
    opt = slamb.create_optimizer("onebit_lamb", _model(), weight_decay=0.01, freeze_step=5)
    assert isinstance(opt, OnebitLamb)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    with pytest.raises(ValueError, match="unknown setting"):
        slamb.create_optimizer("onebit_lamb", _model(), compress_ratio=0.1)


# -- BERT phase 2 continues phase 1's optimizer (DeepSpeed's --load_training_checkpoint) ----------------------


def _phases(rank, world, jobs):
    return [train(cfg, run_dir) for cfg, run_dir in jobs]


@pytest.mark.multiprocess
def test_bert_phase2_row_continues_phase1_and_compresses_after_its_rewarmup(tiny_data, tmp_path):
    """Phase 1: 6 steps, freeze_step 3. Phase 2 (the row's config, seq 64): freeze_step 8 = phase 1's 6 + a 2-step
    re-warm-up; its 4 steps send full gradients twice, then 1-bit momentum. A fresh optimizer would stay in
    its warm-up (8 > 4): the row would be LAMB with LAMB's bytes."""
    p1, p2 = tmp_path / "phase1", tmp_path / "phase2"
    phase1 = tiny_cfg(tiny_data, p1, "experiment=bert/phase1_onebit_lamb", "optimizer.lr=0.05",
                      "optimizer.freeze_step=3", "trainer.precision=fp32")
    phase2 = tiny_cfg(tiny_data, p2, "experiment=bert/phase2_onebit_lamb", "optimizer.lr=0.04",
                      "optimizer.freeze_step=8", "trainer.precision=fp32", "steps=4", "log_every=1",
                      f"init_from={p1 / 'model'}", f"init_optimizer_from={p1}", f"data.dir={tiny_data[SEQ2]}",
                      f"data.seq_len={SEQ2}", "data.phase=phase2")
    run(_phases, 2, [(phase1, str(p1)), (phase2, str(p2))])

    rows = [json.loads(line) for line in (p2 / "metrics.jsonl").read_text().splitlines()]
    params = json.loads((p2 / "metrics.json").read_text())["params"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("bytes/grads", 0) for r in rows] == [4 * params, 4 * params, 0, 0]  # the re-warm-up
    assert [r.get("bytes/momentum_1bit", 0) > 0 for r in rows] == [False, False, True, True]
    assert rows[-1]["bytes_cum/grads"] == 2 * 4 * params  # phase 1's 3 warm-up steps are not counted
    latest = json.loads((p2 / "ckpt" / "latest.json").read_text())
    state = torch.load(p2 / "ckpt" / latest["dir"] / "rank0.pt", weights_only=False)["optimizer"]
    assert state["onebit"]["step"] == 6 + 4 and state["onebit"]["freeze_step"] == 8
    assert [g["initial_lr"] for g in state["param_groups"]] == [0.04, 0.04]  # phase 2's settings, not phase 1's

    model = initial_model(OmegaConf.create(phase2))
    opt = slamb.create_optimizer("onebit_lamb", model, weight_decay=0.01, freeze_step=8)
    with pytest.raises(ValueError, match=r"written by 2 workers and this run has 1; .*run with 2 workers"):
        continue_optimizer(opt, p1, DistEnv(0, 1, 0, 1, torch.device("cpu")))
