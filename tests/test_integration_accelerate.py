"""slamb.integrations.accelerate.prepare: 2 workers on a recording process group, different data per rank."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

from tests import integration_support as support  # noqa: E402

pytestmark = pytest.mark.multiprocess  # the framework runs in 2 gloo worker processes

STEPS, SAVE_AT = 6, 3


def _setup(rank, *, name="slamb", seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    settings = dict(slamb=dict(compress_ratio=0.25, min_compress_numel=16, sync_interval=4, nonfinite="skip"),
                    onebit_lamb=dict(freeze_step=2), dgc=dict(density=0.25), jointspar=dict())[name]
    import slamb

    opt = slamb.create_optimizer(name, model, lr=0.02 if name != "dgc" else 0.1, **settings)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * STEPS * 4 * 2, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(8, 4, generator=g)))
    # accelerate's sampler gives each rank its own batches
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    return model, opt, loader


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in getattr(model, "module", model).parameters()])


def train_worker(rank, n, plain, name, ckpt, resume, overflow_at, export=None):
    from accelerate import Accelerator

    import slamb.integrations.accelerate as integration
    from slamb.integrations.support import unwrap_optimizer

    model, opt, loader = _setup(rank, name=name)
    accelerator = Accelerator(cpu=True)
    if overflow_at is not None:
        # accelerate makes a scaler for fp16 only on accelerators; this is the one it would make
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    if plain:
        opt.allow_same_gradients = True  # accelerate's own all-reduce, measured on purpose (else refused)
        model, opt, loader = accelerator.prepare(model, opt, loader)
    else:
        model, opt, loader = integration.prepare(accelerator, model, opt, loader)
    base = unwrap_optimizer(opt)
    probe = support.StepProbe(base)
    start = 0
    if resume:
        accelerator.load_state(ckpt)
        start = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT)
    out = {"skipped": []}
    for step, (x, y) in enumerate(loader, start):
        if step == STEPS:
            break
        base.begin_step()
        loss = F.mse_loss(model(x), y)
        if step == overflow_at and rank == 1:
            loss = loss * float("inf")
        accelerator.backward(loss)
        opt.step()
        out["skipped"].append(bool(opt.step_was_skipped))
        opt.zero_grad()
        if ckpt is not None and not resume and step + 1 == SAVE_AT:
            out["at_save"] = {k: v.clone() for k, v in model.module.state_dict().items()}
            accelerator.save_state(ckpt)
    out.update(probe.intervals(), params=_params(model), stats=base.comm_stats())
    if export is not None:
        x, y = _eval_data()
        with integration.averaged(model):
            out["eval_loss"] = F.mse_loss(model(x), y).item()
        out["after_eval"] = _params(model)
        integration.save_model(accelerator, model, export)
        out["after_save"] = _params(model)
    return out


def _eval_data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 8, generator=g)
    return x, torch.tanh(x @ torch.randn(8, 4, generator=g))


def _run(plain=False, name="slamb", ckpt=None, resume=False, overflow_at=None, export=None):
    return support.run(train_worker, 2, plain, name, ckpt, resume, overflow_at, export)


def _no_gradient_traffic(res):
    for r in res:
        # the first interval also holds DDP's one-off broadcast of its rebuilt bucket order
        assert r["sent"][1:] == r["ledger"][1:], (r["sent"], r["ledger"])
        assert "grads" not in r["stats"]["total"]


def test_slamb_gradients_stay_local_and_the_ledger_is_every_byte_sent():
    plain, ours = _run(plain=True), _run()
    for step, (g0, g1) in enumerate(zip(ours[0]["grads"], ours[1]["grads"])):
        assert not torch.equal(g0, g1), f"step {step}: the ranks' gradients were averaged"
    _no_gradient_traffic(ours)
    grad_bytes = sum(p.numel() * 4 for p in _setup(0)[0].parameters())
    for r in plain:  # accelerate's own DDP all-reduces every gradient on top of SLAMB's exchange
        assert [s - l for s, l in zip(r["sent"][1:], r["ledger"][1:])] == [grad_bytes] * (STEPS - 2)
    print(f"\naccelerate bytes/step/rank: plain {plain[0]['sent'][1:]} vs prepare {ours[0]['sent'][1:]}")


@pytest.mark.parametrize("name", ["dgc", "onebit_lamb", "jointspar"])
def test_every_optimizer_that_communicates_itself_sends_only_its_ledger(name):
    res = _run(name=name)
    for r in res:
        assert r["sent"][1:] == r["ledger"][1:], (name, r["sent"], r["ledger"])


def test_resume_from_save_state_ends_bit_exactly_and_the_saved_model_is_the_average():
    with tempfile.TemporaryDirectory() as d:
        full = _run(ckpt=os.path.join(d, "ckpt"))
        resumed = _run(ckpt=os.path.join(d, "ckpt"), resume=True)
        from safetensors.torch import load_file

        saved = load_file(os.path.join(d, "ckpt", "model.safetensors"))
        saved = {k.removeprefix("module."): v for k, v in saved.items()}
    for f, r in zip(full, resumed):
        assert torch.equal(f["params"], r["params"])
    own = [r["at_save"] for r in full]
    assert not all(torch.equal(own[0][k], own[1][k]) for k in own[0])  # the ranks had drifted apart
    for k in own[0]:  # the saved model is the ranks' average, not rank 0's copy
        assert torch.equal(saved[k], (own[0][k] + own[1][k]) / 2), k


def test_evaluation_and_save_model_see_the_ranks_average_and_leave_each_rank_its_own():
    with tempfile.TemporaryDirectory() as d:
        res = _run(export=d)
        from safetensors.torch import load_file

        saved = load_file(os.path.join(d, "model.safetensors"))
    assert not torch.equal(res[0]["params"], res[1]["params"])  # the ranks had drifted apart
    for r in res:
        assert torch.equal(r["after_eval"], r["params"]) and torch.equal(r["after_save"], r["params"])
    average = (res[0]["params"] + res[1]["params"]) / 2
    model = _setup(0)[0]
    torch.nn.utils.vector_to_parameters(average, model.parameters())
    assert torch.equal(torch.cat([saved[k].reshape(-1) for k, _ in model.named_parameters()]), average)
    x, y = _eval_data()
    expected = F.mse_loss(model(x), y).item()
    assert [r["eval_loss"] for r in res] == pytest.approx([expected] * 2, rel=1e-6)


def plain_save_state_worker(rank, n, ckpt):
    """accelerate's own save_state of a SLAMB run prepared by accelerator.prepare, loaded after the integration's
    prepare: the error it raises."""
    from accelerate import Accelerator

    import slamb.integrations.accelerate as integration

    accelerator = Accelerator(cpu=True)
    model, opt, loader = _setup(rank)
    opt.allow_same_gradients = True  # the plain prepare's checkpoint, made on purpose (else refused)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in list(loader)[:2]:
        accelerator.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    accelerator.save_state(ckpt)
    accelerator = Accelerator(cpu=True)
    integration.prepare(accelerator, *_setup(rank))
    try:
        accelerator.load_state(ckpt)
    except FileNotFoundError as e:
        return str(e)
    return None


def test_a_checkpoint_of_plain_prepare_is_refused_in_one_line_naming_it():
    with tempfile.TemporaryDirectory() as d:
        res = support.run(plain_save_state_worker, 2, os.path.join(d, "ckpt"))
    print(res[0])
    for rank, message in enumerate(res):
        assert message is not None and "\n" not in message, message
        for words in ("saved by accelerator.save_state after a plain accelerator.prepare",
                      "rank 0's SLAMB state (optimizer.bin)", f"optimizer.rank{rank}-of-2.pt",
                      "resume from a checkpoint slamb.integrations.accelerate.prepare saved"):
            assert words in message, message


def refused_worker(rank, n):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU case, on any machine
    from accelerate import Accelerator

    import slamb.integrations.accelerate as integration

    return support.refusal(lambda: integration.prepare(Accelerator(), *_setup(rank)))


def test_prepare_refuses_an_accelerator_that_sees_one_of_the_ranks_launched():
    support.assert_refused_in_one_line(refused_worker, "Accelerator(cpu=True)")


def test_the_scaler_becomes_rank_agreed_with_every_setting_and_state_of_the_installed_gradscaler():
    from slamb import RankAgreedGradScaler
    from slamb.integrations.support import rank_agreed_scaler

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    agreed = rank_agreed_scaler(scaler, "cpu")
    assert isinstance(agreed, RankAgreedGradScaler) and agreed.is_enabled()
    assert {k: v for k, v in agreed.state_dict().items() if k != "skipped_steps"} == scaler.state_dict()
    assert (agreed.get_scale(), agreed.get_growth_factor(), agreed.get_backoff_factor(),
            agreed.get_growth_interval()) == (8.0, 3.0, 0.25, 7)
    assert not rank_agreed_scaler(torch.amp.GradScaler("cpu", enabled=False), "cpu").is_enabled()
    assert rank_agreed_scaler(agreed, "cpu") is agreed and rank_agreed_scaler(None, "cpu") is None


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    res = _run(overflow_at=2)
    assert [r["skipped"] for r in res] == [[False, False, True, False, False, False]] * 2
    assert res[0]["stats"]["steps"] == res[1]["stats"]["steps"]


@pytest.mark.multiprocess
def test_the_integrations_package_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, slamb.integrations, slamb.integrations.support; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
