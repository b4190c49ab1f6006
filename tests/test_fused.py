"""``fused=True``: SLAMB's and LAMB's steps as the two compiled passes of ``slamb.optim.fused``, against
the paths that run eagerly. The models are the small ones of tests/test_slamb.py (compressed, small always-averaged
and 1-D tensors in two parameter groups of different hyper-parameters), in float32, so the compiled
graphs are few and quick to build."""
from __future__ import annotations

import io
import re
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slamb
from tests import distributed
from tests.test_gpu_paths import host_reads
from tests.test_slamb import grad_of, init_params, make_optimizer

STEPS = 6
CONFIGS = [
    dict(variant="v1"),
    dict(variant="v2"),
    dict(variant="v1", mask="bernoulli"),
    dict(variant="v2", mask="cyclic", comm_dtype=torch.float16),
    dict(variant="v2", group_beta3=0.0),  # r = 0^age: 1 where averaged now, else 0
]


def advance(params, opt, steps, rank=0):
    for t in steps:
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach().double(), rank, t, i).float()
        opt.step()


def fresh(group_beta3=None, **kw):
    params = [torch.nn.Parameter(p.float()) for p in init_params()]
    opt = make_optimizer(params, compress_ratio=0.3, sync_interval=4, **kw)
    for g in opt.param_groups if group_beta3 is not None else ():
        g["beta3"] = group_beta3
    return params, opt


# on two ranks also the 8-bit exchange, whose blocks of 256 packed entries each get a scale: the fused step
# must pack the entries in the same order
TWO_RANK_CONFIGS = CONFIGS + [dict(variant="v1", comm_dtype=torch.int8)]


def paths_worker(rank, world):
    out = []
    for cfg in TWO_RANK_CONFIGS:
        run = {}
        for path, kw in (("reference", dict(foreach=False)), ("fused", dict(fused=True))):
            params, opt = fresh(**cfg, **kw)
            advance(params, opt, range(1, STEPS + 1), rank)
            run[path] = [p.detach().clone() for p in params]
            run[path + "_bytes"] = opt.comm_stats()["total"]["momentum"]["payload"]
        out.append(run)
    return out


@pytest.mark.multiprocess
def test_fused_equals_the_reference_on_two_ranks():
    res = distributed.run(paths_worker, 2)
    for rank, runs in enumerate(res):
        for cfg, run in zip(TWO_RANK_CONFIGS, runs):
            for i, (a, b) in enumerate(zip(run["fused"], run["reference"])):
                where = f"{cfg} rank {rank} tensor {i}"
                if "comm_dtype" in cfg:
                    # an fp32 rounding apart before the exchange can round to fp16 values an fp16 ulp
                    # (5e-4 relative) apart: a few entries differ by that, times the learning rate
                    off = ~torch.isclose(a, b, rtol=1e-5, atol=1e-6)
                    assert off.float().mean() < 1e-3, where
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=where)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=where)
            assert run["fused_bytes"] == run["reference_bytes"]
    start = [p.float() for p in init_params()]
    assert all(not torch.equal(a, b) for a, b in zip(res[0][0]["fused"], start))  # every tensor moved
    assert not torch.equal(res[0][0]["fused"][0], res[1][0]["fused"][0])  # ranks drift between syncs


def test_changed_hyper_parameters_reuse_the_compiled_graph():
    from torch._dynamo.utils import counters

    params, opt = fresh(variant="v2", fused=True)
    advance(params, opt, [1])
    graphs = counters["stats"]["unique_graphs"]
    for t in range(2, 6):
        for g in opt.param_groups:
            g["lr"] *= 0.7
            g["weight_decay"] += 0.01
        advance(params, opt, [t])
    assert counters["stats"]["unique_graphs"] == graphs  # t, lr and wd changed every step

    ref_params, ref = fresh(variant="v2", foreach=False)
    advance(ref_params, ref, [1])
    for t in range(2, 6):
        for g in ref.param_groups:
            g["lr"] *= 0.7
            g["weight_decay"] += 0.01
        advance(ref_params, ref, [t])
    for a, b in zip(params, ref_params):  # and the new values were used
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_resume_with_fused_is_bit_exact(variant):
    params, opt = fresh(variant=variant, fused=True)
    advance(params, opt, range(1, 9))
    straight = [p.detach().clone() for p in params]

    params, opt = fresh(variant=variant, fused=True)
    advance(params, opt, range(1, 5))
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    params, opt = fresh(variant=variant, fused=True)
    with torch.no_grad():
        for p, s in zip(params, saved["model"]):
            p.copy_(s)
    opt.load_state_dict(saved["optim"])
    advance(params, opt, range(5, 9))
    for a, b in zip(params, straight):
        assert torch.equal(a, b)


def test_fused_step_reads_less_from_the_host(monkeypatch):
    """The foreach path reads its trust-ratio scalars to the host; the fused one keeps them on the device
    and sends its hyper-parameters there instead (one non-blocking copy)."""
    counts = {}
    for path, kw in (("foreach", {}), ("fused", dict(fused=True))):
        params, opt = fresh(variant="v2", nonfinite="ignore", **kw)
        advance(params, opt, [1, 2])
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach().double(), 0, 3, i).float()
        counts[path] = host_reads(opt.step, monkeypatch)
    assert counts["foreach"] == {"tolist": 2, "scalar": 1}
    assert counts["fused"] == {"tolist": 1, "scalar": 1, "from_host": 1}


def fused_worker(rank, world):
    """Two steps on two ranks with the host reads of the second counted (its exchange included)."""
    import pytest as _pytest

    params, opt = fresh(variant="v1", nonfinite="ignore", fused=True)
    advance(params, opt, [1, 2], rank)
    for i, p in enumerate(params):
        p.grad = grad_of(p.detach().double(), rank, 3, i).float()
    with _pytest.MonkeyPatch.context() as m:
        return host_reads(opt.step, m)


@pytest.mark.multiprocess
def test_fused_step_with_an_exchange_copies_nothing_from_the_host():
    for counts in distributed.run(fused_worker, 2):
        assert counts == {"tolist": 1, "scalar": 1, "from_host": 1}


def test_a_failing_compiler_warns_once_and_runs_the_multi_tensor_path(monkeypatch):
    def broken(fn, **kw):
        def raise_(*args, **kwargs):
            raise RuntimeError("no C++ compiler found")
        return raise_

    for variant in ("v1", "v2"):
        runs = {}
        for path, kw in (("foreach", {}), ("fused", dict(fused=True))):
            params, opt = fresh(variant=variant, **kw)
            with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m.setattr(torch, "compile", broken)
                advance(params, opt, range(1, 4))
            runs[path] = (params, [str(w.message) for w in caught if "fused=True" in str(w.message)], opt)
        assert len(runs["fused"][1]) == 1 and "no C++ compiler found" in runs["fused"][1][0]
        assert runs["fused"][2].fused is False  # it said so, and runs the multi-tensor path
        assert runs["fused"][2].fused_fallback == "RuntimeError: no C++ compiler found"  # and keeps saying so
        assert runs["foreach"][2].fused_fallback is None
        for a, b in zip(runs["fused"][0], runs["foreach"][0]):
            assert torch.equal(a, b)
        ages = [[s["staleness"] for s in r[2].state_dict()["state"].values()] for r in (runs["fused"], runs["foreach"])]
        assert all(torch.equal(a, b) for a, b in zip(*ages))

    params, opt = fresh_lamb(fused=True)
    ref_params, ref = fresh_lamb()
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.setattr(torch, "compile", broken)
        advance(params, opt, range(1, 4))
    advance(ref_params, ref, range(1, 4))
    assert len([w for w in caught if "LAMB(fused=True)" in str(w.message)]) == 1
    assert opt.fused_fallback == "RuntimeError: no C++ compiler found" and ref.fused_fallback is None
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("build", [lambda: fresh_lamb(fused=True), lambda: fresh(variant="v1", fused=True),
                                   lambda: fresh(variant="v2", fused=True)], ids=["lamb", "slamb_v1", "slamb_v2"])
def test_a_graph_that_fails_after_the_steps_first_is_recorded_and_left_at_the_next_step(build, monkeypatch):
    """The update's graph fails to compile after the moments' ran: that step ends eagerly (the graphs' numbers),
    the next ones run the multi-tensor path, and ``fused_fallback`` says why; a compiled run's is None."""
    from slamb.optim import fused

    compile_ = torch.compile

    def update_fails(fn, **kw):
        if fn.__name__ != "update_pass":
            return compile_(fn, **kw)

        def raise_(*args, **kwargs):
            raise RuntimeError("the update does not compile")
        return raise_

    params, opt = build()
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.setattr(torch, "compile", update_fails)
        advance(params, opt, range(1, 2))
        assert opt.fused_fallback == "RuntimeError: the update does not compile"
        calls = []
        m.setattr(fused.Passes, "__call__", lambda self, fn, *args: calls.append(fn) or fn(*args))
        advance(params, opt, range(2, 4))
    assert len([w for w in caught if "the update does not compile" in str(w.message)]) == 1
    assert opt.fused_fallback == "RuntimeError: the update does not compile"
    assert calls == []  # the multi-tensor path: no pass of the fused step
    assert all(torch.isfinite(p).all() for p in params)
    params, opt = build()
    advance(params, opt, range(1, 3))
    assert opt.fused_fallback is None


def test_fused_with_foreach_false_is_refused():
    with pytest.raises(ValueError, match="fused=True with foreach=False"):
        fresh(fused=True, foreach=False)
    with pytest.raises(ValueError, match="fused=True with foreach=False"):
        slamb.LAMB([torch.nn.Parameter(torch.ones(3))], fused=True, foreach=False)


def fresh_lamb(**kw):
    params = [torch.nn.Parameter(p.float()) for p in init_params()]
    return params, slamb.LAMB([{"params": params[:2], "weight_decay": 0.01},
                               {"params": params[2:], "lr": 0.02, "betas": (0.8, 0.99), "bias_correction": False,
                                "trust_clamp": (0.01, 0.3)}], lr=0.01, **kw)


def test_lamb_fused_equals_lamb_foreach():
    runs = {}
    for fused in (False, True):
        params, opt = fresh_lamb(fused=fused)
        advance(params, opt, range(1, STEPS + 1))
        runs[fused] = params
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(runs[True][0], init_params()[0].float())


def test_a_step_is_one_graph_per_pass_whatever_the_number_of_tensors():
    """30 tensors of three shapes compile one graph per pass (the moments', the age's, the update's), and v2's
    mask draw one (a single chunk), and match the reference."""
    from torch._dynamo.utils import counters

    runs = {}
    for kw in (dict(fused=True), dict(foreach=False)):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(10, 10 + i % 3, generator=gen)) for i in range(30)]
        opt = slamb.SLAMB(params, lr=0.01, weight_decay=0.01, min_compress_numel=50, compress_ratio=0.3, **kw)
        graphs = counters["stats"]["unique_graphs"]
        for t in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs[kw.get("fused", False)] = (params, counters["stats"]["unique_graphs"] - graphs)
    assert runs[True][1] == 3 + 1 and runs[False][1] == 0
    for a, b in zip(runs[True][0], runs[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_age_reads_and_advances_every_int16_counter_through_fp16_bits_exactly():
    """Every counter 0..MAX_AGE, compiled and eager: fused.age_of reads it from its fp16 bits; fused.age_pass
    (step 6) makes it one more, held at MAX_AGE, where it is not averaged, and 0 where it is: marked SELECTED
    (which age_of reads as NaN) or in an always-averaged tensor's block."""
    from slamb.optim.fused import age_of, age_pass, compile_once

    for read, advance in ((age_of, age_pass), (compile_once(age_of), compile_once(age_pass))):
        assert_every_age_read_and_advanced(read, advance, torch.device("cpu"))


def assert_every_age_read_and_advanced(read, advance, device):
    """``read`` (fused.age_of) and ``advance`` (fused.age_pass), eager or compiled, on every counter on ``device``."""
    from slamb.optim.fused import BLOCK, MAX_AGE, MOMENT_COLUMNS, SELECTED

    counters = torch.arange(MAX_AGE + 1, dtype=torch.int16, device=device)
    advanced = torch.clamp(counters.int() + 1, max=MAX_AGE).to(torch.int16)
    blocks = -(-(MAX_AGE + 1) // BLOCK)
    assert torch.equal(read(counters.view(torch.float16)).cpu(), torch.arange(MAX_AGE + 1, dtype=torch.float32))
    assert torch.isnan(read(torch.tensor([SELECTED], dtype=torch.int16, device=device).view(torch.float16))).all()
    for dense in (0.0, 1.0):
        age = torch.full((blocks * BLOCK,), SELECTED, dtype=torch.int16, device=device)
        age[:MAX_AGE + 1] = counters
        age[MAX_AGE + 1::2] = 7  # the last block: marks and counters side by side
        table = torch.zeros(blocks, len(MOMENT_COLUMNS), device=device)
        table[:, MOMENT_COLUMNS.index("dense")] = dense
        advance(age.view(torch.float16).view(blocks, BLOCK), table)
        if dense:
            assert not age.any()
        else:
            assert torch.equal(age[:MAX_AGE + 1], advanced)
            assert (age[MAX_AGE + 1::2] == 8).all() and not age[MAX_AGE + 2::2].any()


def test_each_compiled_graph_has_its_own_recompile_limit():
    """A model with more distinct runs of shapes than dynamo's recompile limit (8 graphs per code object)
    still compiles every one of them, rather than running the ninth on eagerly."""
    from torch._dynamo.utils import counters

    from slamb.optim.fused import compile_once

    def scaler(k):  # every closure shares the code object of scale
        def scale(x):
            return x * k
        return scale

    graphs = counters["stats"]["unique_graphs"]
    fns = [compile_once(scaler(float(k))) for k in range(10)]
    assert [float(f(torch.ones(3))[0]) for f in fns] == [float(k) for k in range(10)]
    assert counters["stats"]["unique_graphs"] - graphs == 10


def resume_on(paths, saved, params, steps, **kw):
    """Each path's parameters and int16 ages after ``saved`` is loaded into it and ``steps`` run."""
    ends = {}
    for path in paths:
        resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = make_optimizer(resumed, compress_ratio=0.3, sync_interval=4, **kw, **path)
        opt.load_state_dict(saved)
        advance(resumed, opt, steps)
        ends["fused" if path else "foreach"] = (resumed, [s["staleness"] for s in opt.state_dict()["state"].values()])
    return ends


def aged(saved, age):
    """``saved`` with every positive age moved to ``age`` minus it: the entries of a long run."""
    for s in saved["state"].values():
        assert s["staleness"].dtype == torch.int16
        s["staleness"] = torch.where(s["staleness"] > 0, age - s["staleness"], 0).to(torch.int16)
    return saved


@pytest.mark.parametrize("first, then", [(dict(fused=True), {}), ({}, dict(fused=True))])
def test_a_checkpoint_moves_between_the_fused_and_the_multi_tensor_paths(first, then):
    """Both paths keep the int16 age, held at MAX_AGE, in per-parameter views (the fused path's layout padded):
    a checkpoint of either resumes on the other, to fp32 rounding, with the same ages, those at the cap
    included."""
    from slamb.optim.fused import MAX_AGE

    params, opt = fresh(variant="v2", **first)
    advance(params, opt, range(1, 4))
    ends = resume_on((first, then), aged(opt.state_dict(), MAX_AGE - 2), params, range(4, 8))
    for a, b in zip(ends["fused"][0], ends["foreach"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fused_ages, ages = ends["fused"][1], ends["foreach"][1]
    assert max(int(a.max()) for a in ages) == MAX_AGE  # some entries reached the cap ...
    assert all(torch.equal(a, b) for a, b in zip(fused_ages, ages))  # ... on both paths alike


@pytest.mark.parametrize("cfg", [dict(variant="v1", mask="bernoulli"), dict(variant="v2")])
def test_fused_takes_a_beta3_whose_freshness_outlives_2048_steps(cfg):
    """beta3 = 0.999 (the Swin row; 0.999^2048 = 0.13): ages past 2048, the old fp16 age's end, where the
    freshness still weighs, give the multi-tensor path's numbers (v1 with a Bernoulli mask: a cyclic one
    averages every entry every 1/k steps)."""
    params, opt = fresh(group_beta3=0.999, **cfg)
    advance(params, opt, range(1, 4))
    saved = aged(opt.state_dict(), 2046)
    for g in saved["param_groups"]:
        g["beta3"] = 0.999
    ends = resume_on(({}, dict(fused=True)), saved, params, range(4, 12), **cfg)
    fused_ages, ages = ends["fused"][1], ends["foreach"][1]
    assert max(int(a.max()) for a in ages) > 2048 + 4
    assert all(torch.equal(a, b) for a, b in zip(fused_ages, ages))
    for a, b in zip(ends["fused"][0], ends["foreach"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_graphs_are_compiled_with_the_deterministic_inductor_settings(monkeypatch):
    """No per-process autotuning of reductions, no split by the multiprocessor count: the settings that let
    fused replicas and resumes agree bit for bit on GPUs (the installed torch has both)."""
    from slamb.optim import fused

    seen = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or compile_(fn, **kw))
    assert float(fused.compile_once(lambda x: x.sum())(torch.ones(5))) == 5.0
    assert seen == [{"dynamic": False, "options": {"deterministic": True, "split_reductions": False}}]


def fused_replica_worker(rank, world):
    """Fused LAMB under DDP, each rank its own data: the averaged gradients are the same bits on every rank,
    so the compiled step must leave every rank the same parameters."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Tanh(), torch.nn.Linear(400, 10))
    opt = slamb.LAMB(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    net = slamb.wrap_model(model, opt)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        net(torch.randn(16, 300, generator=gen)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multiprocess
def test_fused_lamb_replicas_stay_bit_identical():
    a, b = distributed.run(fused_replica_worker, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("build", [lambda: fresh_lamb(fused=True), lambda: fresh(variant="v1", fused=True),
                                   lambda: fresh(variant="v2", fused=True)], ids=["lamb", "slamb_v1", "slamb_v2"])
def test_the_flat_buffers_hold_the_parameters_and_gradients_with_zero_padding(build):
    """Each parameter is a view of one flat buffer, each tensor starting at a multiple of BLOCK; the gradients
    are pointed at views of a flat one; the padding stays 0 in p, m and v after steps."""
    from slamb.optim.fused import BLOCK

    params, opt = build()
    advance(params, opt, range(1, 4))
    base = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in params)
    assert all(p.storage_offset() % BLOCK == 0 for p in params)
    grads = params[0].grad.untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == grads for p in params)
    flat = torch.tensor([], dtype=params[0].dtype).set_(params[0].untyped_storage())
    state = [opt.state[params[0]][k] for k in ("exp_avg", "exp_avg_sq")]
    for buf in [flat] + [torch.tensor([], dtype=s.dtype).set_(s.untyped_storage()) for s in state]:
        padding = torch.ones(buf.numel(), dtype=torch.bool)
        for p in params:
            padding[p.storage_offset():p.storage_offset() + p.numel()] = False
        assert padding.any() and not buf[padding].any()


def test_gradients_zeroed_in_place_are_not_copied_and_set_to_none_keeps_its_meaning(monkeypatch):
    """After a step, p.grad are views of the flat gradient buffer: zero_grad(set_to_none=False) and backward
    accumulate there and the next step copies nothing; with set_to_none=True a parameter without a gradient
    keeps none, and is not updated. Both give the multi-tensor path's numbers."""
    runs = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        extra = torch.nn.Parameter(torch.ones(5))  # never in the loss: never a gradient
        opt = slamb.LAMB([*model.parameters(), extra], lr=1e-2, weight_decay=0.01, fused=fused)
        gen = torch.Generator().manual_seed(1)
        cats = []
        for t in range(4):
            opt.zero_grad(set_to_none=t >= 2)
            model(torch.randn(3, 8, generator=gen)).square().mean().backward()
            with monkeypatch.context() as m:
                cat = torch.cat
                m.setattr(torch, "cat", lambda *a, **k: cats.append(t) or cat(*a, **k))
                opt.step()
            assert extra.grad is None
        runs[fused] = ([p.detach().clone() for p in model.parameters()], cats)
    fused_cats = runs[True][1]
    assert 1 not in fused_cats and 2 in fused_cats  # the step after an in-place zero_grad copied nothing
    assert torch.equal(extra, torch.ones(5))
    for a, b in zip(runs[True][0], runs[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", ["lamb", "slamb"])
def test_a_parameter_whose_storage_was_replaced_is_adopted_again(make):
    """p.data rebound by the user (as a load with assign=True or a move does) between steps: the next step
    adopts it again, and the run gives the multi-tensor path's numbers."""
    runs = {}
    for fused in (True, False):
        params, opt = fresh_lamb(fused=fused) if make == "lamb" else fresh(variant="v2", fused=fused)
        advance(params, opt, [1, 2])
        with torch.no_grad():
            params[1].data = params[1].detach().clone() * 0.5
        advance(params, opt, [3, 4])
        runs[fused] = params
    assert runs[True][1].untyped_storage().data_ptr() == runs[True][0].untyped_storage().data_ptr()
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", [lambda **kw: fresh_lamb(fused=True, **kw),
                                   lambda **kw: fresh(variant="v2", fused=True, **kw)], ids=["lamb", "slamb"])
def test_fused_nonfinite_gradients_raise_or_skip_before_anything_changes(build):
    """The screen reads the flat gradient buffer; a NaN is still named by its tensor, and nothing changes."""
    for policy in ("raise", "skip"):
        params, opt = build(nonfinite=policy)
        advance(params, opt, [1, 2])
        before = [p.detach().clone() for p in params]
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
        for i, p in enumerate(params):
            p.grad = grad_of(p.detach().double(), 0, 3, i).float()
        params[2].grad.view(-1)[1] = float("nan")
        if policy == "raise":
            with pytest.raises(FloatingPointError, match=re.escape(str(tuple(params[2].shape)))):
                opt.step()
        else:
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert all(torch.equal(v, s[k]) for p, s in zip(params, state) for k, v in opt.state[p].items())


@pytest.mark.parametrize("shapes", [
    [(30, 20), (7,), (50, 3), (9, 9), (200,), (40, 40)],
    # always-averaged tensors first, side by side and last (runs that start where the draw ends); a compressed
    # tensor of two entries, which a draw often skips
    [(5,), (30, 20), (7,), (8,), (2, 1), (50, 3), (200,), (3,)],
])
@pytest.mark.parametrize("shard", [None, (0, 2), (1, 2), (2, 3)])
def test_layout_positions_are_each_tensors_drawn_positions_in_the_aligned_layout(shapes, shard, monkeypatch):
    """Selection.layout_positions (a few ops over the draw) against the per-tensor positions moved by each
    tensor's offset, for both mask policies and several steps: the drawn ones alone (the marks), and after
    every entry of the always-averaged tensors (the exchange's packed order). ``shard``: (index, count), the
    layout of FSDP2's dim-0 shards of those tensors (torch.chunk's cut, some of them empty), whose masks are
    their slices of the whole model's draw. Nothing is copied from the host: a shard's runs are placed on the
    device (two blocking copies a step before)."""
    from slamb.optim.exchange import packing
    from slamb.optim.flat import FlatLayout
    from slamb.optim.fused import BLOCK
    from slamb.optim.masks import LayoutRuns, Selection, make_mask
    from slamb.sharding import chunk_rows

    dense = [len(s) == 1 or s == (9, 9) for s in shapes]
    whole = [torch.zeros(s) for s in shapes]
    cuts = [chunk_rows(s[0], *reversed(shard)) if shard else (0, s[0]) for s in shapes]
    layout = FlatLayout([w.narrow(0, start, rows) for w, (start, rows) in zip(whole, cuts)], [0] * len(shapes),
                        align=BLOCK)
    layout.global_numels = [w.numel() for w in whole]  # as shard_offsets gives them for a DTensor
    layout.global_offsets = [start * w[0].numel() for w, (start, _) in zip(whole, cuts)]
    assert all(o % BLOCK == 0 for o in layout.offsets)
    compressible = sum(layout.global_numels[i] for i, d in enumerate(dense) if not d)
    keep = Selection.bounds(layout, dense) if shard else None
    for policy in ("cyclic", "bernoulli"):
        mask = make_mask(policy, compressible, 0, layout.device, keep)
        for step in range(1, 6):
            sel = Selection(layout, dense, mask(step, 0.3))
            want = torch.cat([sel.local[i] + layout.offsets[i] for i in sel.compressed])
            assert want.numel() > 0
            runs = LayoutRuns(layout, dense)
            got = []
            assert host_reads(lambda: got.append(sel.layout_positions(runs)), monkeypatch) == {}
            assert torch.equal(got[0], want)
            order = packing(sel, range(len(shapes)))[0]
            packed = torch.cat([torch.arange(layout.numels[i]) + layout.offsets[i] if dense[i]
                                else sel.local[i] + layout.offsets[i] for i in order])
            sel = Selection(layout, dense, sel.drawn)  # the packed order first, as a step asks for it
            got = []
            assert host_reads(lambda: got.append(sel.layout_positions(runs, with_dense=True)), monkeypatch) == {}
            assert torch.equal(got[0], packed)
            assert torch.equal(sel.layout_positions(runs), want)  # the tail of the kept ones


class SegmentReductions(TorchDispatchMode):
    """The dimensions of the data of every segment reduction dispatched."""

    def __init__(self):
        super().__init__()
        self.dims = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.segment_reduce.default:
            self.dims.append(args[0].dim())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("build", [lambda: fresh_lamb(fused=True), lambda: fresh(variant="v2", fused=True)],
                         ids=["lamb", "slamb_v2"])
def test_a_fused_step_sums_its_tensors_by_one_dimensional_segment_reductions(build):
    """On CUDA a 2-D segment reduction runs a thread per (segment, column) that adds a segment's blocks one after
    another (BERT-Large's embedding: 122,112); a 1-D one runs CUB's segmented reduction. A step's per-tensor sums
    (2 columns for LAMB, 4 for SLAMB) are 1-D reductions only."""
    params, opt = build()
    advance(params, opt, range(1, 3))
    with SegmentReductions() as seen:
        advance(params, opt, range(3, 4))
    assert seen.dims == [1]


@pytest.mark.parametrize("model", ["bert_base", "bert_large", "bert_xl", "resnet110"])
def test_the_one_dimensional_sums_are_the_two_dimensional_ones_bit_for_bit(model):
    """On the block layout of every model of bench/shapes.py (BERT-XL's: 10.8M blocks), the sums taken column after
    column equal the 2-D segment reduction's bit for bit on the CPU (each adds a segment's blocks in order)."""
    import math

    from bench.shapes import MODELS
    from slamb.optim.fused import BLOCK, tensor_sums

    blocks = torch.tensor([math.ceil(math.prod(s) / BLOCK) for s in MODELS[model]()])
    gen = torch.Generator().manual_seed(0)
    # sums of squares over blocks of a trained model's tensors: positive, across many binades
    per_block = torch.rand(int(blocks.sum()), 2, generator=gen).mul_(40).sub_(30).exp2_()
    want = torch.segment_reduce(per_block.double(), "sum", lengths=blocks, axis=0, unsafe=True).float()
    assert torch.equal(tensor_sums(per_block, blocks), want)
