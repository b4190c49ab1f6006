"""slamb.integrations.huggingface.SLAMBTrainer: 2 workers on a recording process group, different data per rank."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests import integration_support as support  # noqa: E402

pytestmark = pytest.mark.multiprocess  # the framework runs in 2 gloo worker processes

STEPS, SAVE_AT = 6, 3


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x, labels):
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(8, 4, generator=g))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


SETTINGS = dict(lr=0.02, compress_ratio=0.25, min_compress_numel=16, sync_interval=4, nonfinite="skip")
OTHERS = dict(dgc=dict(lr=0.1, density=0.25), onebit_lamb=dict(lr=0.02, freeze_step=2), jointspar=dict(lr=0.1))


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in getattr(model, "module", model).parameters()])


def train_worker(rank, n, plain, out_dir, resume, overflow_at, name="slamb", evaluate=False, max_grad_norm=0.0):
    from transformers import Trainer, TrainingArguments

    import slamb
    from slamb.integrations.huggingface import SLAMBTrainer

    torch.manual_seed(0)
    model = Tiny()
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=STEPS, save_steps=SAVE_AT,
                             save_strategy="steps" if out_dir else "no", logging_steps=1000, use_cpu=True,
                             report_to=[], learning_rate=0.02, lr_scheduler_type="constant",
                             max_grad_norm=max_grad_norm,
                             disable_tqdm=True, seed=0, per_device_eval_batch_size=8)
    out = {}

    if plain:
        opt = slamb.create_optimizer("slamb", model, **SETTINGS)
        opt.allow_same_gradients = True  # the plain Trainer's all-reduce, measured on purpose (else refused)
        trainer = Trainer(model=model, args=args, train_dataset=Pairs(), optimizers=(opt, None))
    elif out_dir is None:
        opt = slamb.create_optimizer(name, model, **(SETTINGS if name == "slamb" else OTHERS[name]))
        trainer = SLAMBTrainer(model=model, args=args, train_dataset=Pairs(), optimizers=(opt, None))
    else:  # built from settings, as a config would
        opt = None
        trainer = SLAMBTrainer(model=model, args=args, train_dataset=Pairs(), optimizer_name="slamb",
                               optimizer_settings={k: v for k, v in SETTINGS.items() if k != "lr"})
    if overflow_at is not None:
        # accelerate makes a scaler for fp16 only on accelerators; this is the one it would make
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        compute_loss = trainer.compute_loss

        def overflowing(model, inputs, *a, **k):
            loss = compute_loss(model, inputs, *a, **k)
            return loss * float("inf") if rank == 1 and trainer.state.global_step == overflow_at else loss

        trainer.compute_loss = overflowing
    probe = support.StepProbe(opt) if opt is not None else None
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{SAVE_AT}") if resume else None)
    base = slamb.integrations.huggingface.unwrap_optimizer(trainer.optimizer)
    out.update(params=_params(trainer.model), stats=base.comm_stats(), steps=getattr(base, "_step", None))
    if probe is not None:
        out.update(probe.intervals())
    if evaluate:
        out["eval_loss"] = trainer.evaluate(eval_dataset=Pairs(16))["eval_loss"]
        out["after_eval"] = _params(trainer.model)
        out["predictions"] = torch.as_tensor(trainer.predict(Pairs(16)).predictions)
        out["after_predict"] = _params(trainer.model)
    if overflow_at is not None:
        out["skipped"] = trainer.accelerator.scaler.skipped_steps
    if out_dir is not None and not resume:
        from safetensors.torch import load_file

        saved = load_file(os.path.join(out_dir, f"checkpoint-{SAVE_AT}", "model.safetensors"))
        local = torch.load(os.path.join(out_dir, f"checkpoint-{SAVE_AT}", f"model.rank{rank}-of-{n}.pt"))
        out.update(saved=torch.cat([saved[k].reshape(-1) for k in local]),
                   local_at_save=torch.cat([v.reshape(-1) for v in local.values()]))
    return out


def _run(plain=False, out_dir=None, resume=False, overflow_at=None, name="slamb", evaluate=False, max_grad_norm=0.0):
    return support.run(train_worker, 2, plain, out_dir, resume, overflow_at, name, evaluate, max_grad_norm)


def test_slamb_gradients_stay_local_and_the_ledger_is_every_byte_sent():
    plain, ours = _run(plain=True), _run()
    for step, (g0, g1) in enumerate(zip(ours[0]["grads"], ours[1]["grads"])):
        assert not torch.equal(g0, g1), f"step {step}: the ranks' gradients were averaged"
    grad_bytes = sum(p.numel() * 4 for p in Tiny().parameters())
    for r in ours:
        # the first interval also holds DDP's one-off broadcast of its rebuilt bucket order
        assert r["sent"][1:] == r["ledger"][1:], (r["sent"], r["ledger"])
        assert "grads" not in r["stats"]["total"]
    used_map = 4 * len(list(Tiny().parameters()))  # find_unused_parameters=True, Trainer's default
    for r in plain:  # the Trainer's own DDP all-reduces every gradient on top of SLAMB's exchange
        assert [s - l for s, l in zip(r["sent"][1:], r["ledger"][1:])] == [grad_bytes + used_map] * (STEPS - 2)
    print(f"\nTrainer bytes/step/rank: plain {plain[0]['sent'][1:]} vs SLAMBTrainer {ours[0]['sent'][1:]}")


@pytest.mark.parametrize("name", ["dgc", "jointspar"])
def test_every_optimizer_that_communicates_itself_sends_only_its_ledger(name):
    for r in _run(name=name):
        assert r["sent"][1:] == r["ledger"][1:], (name, r["sent"], r["ledger"])


def test_resume_from_checkpoint_ends_bit_exactly_and_save_model_is_the_average():
    with tempfile.TemporaryDirectory() as d:
        full = _run(out_dir=d)
        resumed = _run(out_dir=d, resume=True)
    for f, r in zip(full, resumed):
        assert torch.equal(f["params"], r["params"])
        assert f["steps"] == r["steps"] == STEPS
    assert not torch.equal(full[0]["local_at_save"], full[1]["local_at_save"])  # the ranks had drifted apart
    assert torch.equal(full[0]["saved"], (full[0]["local_at_save"] + full[1]["local_at_save"]) / 2)


def test_evaluate_and_predict_score_the_ranks_average_and_leave_each_rank_its_own():
    res = _run(evaluate=True)
    assert not torch.equal(res[0]["params"], res[1]["params"])  # the ranks had drifted apart
    for r in res:
        assert torch.equal(r["after_eval"], r["params"]) and torch.equal(r["after_predict"], r["params"])
    model = Tiny()
    torch.nn.utils.vector_to_parameters((res[0]["params"] + res[1]["params"]) / 2, model.parameters())
    data = Pairs(16)
    with torch.no_grad():
        expected = model(data.x, data.y)
    for r in res:
        assert r["eval_loss"] == pytest.approx(expected["loss"].item(), rel=1e-6)
        torch.testing.assert_close(r["predictions"], expected["logits"])


def refused_worker(rank, n):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU case, on any machine
    from transformers import TrainingArguments

    from slamb.integrations.huggingface import SLAMBTrainer

    args = TrainingArguments(output_dir="unused", report_to=[], max_steps=1)  # no use_cpu=True
    return support.refusal(lambda: SLAMBTrainer(model=Tiny(), args=args, train_dataset=Pairs(),
                                                optimizer_settings=SETTINGS))


def test_a_trainer_that_sees_one_of_the_ranks_launched_is_refused():
    support.assert_refused_in_one_line(refused_worker, "TrainingArguments(use_cpu=True)")


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    res = _run(overflow_at=2)
    assert [r["skipped"] for r in res] == [1, 1]
    assert [r["steps"] for r in res] == [STEPS - 1] * 2


def test_max_grad_norm_clips_each_ranks_own_gradient_and_sends_nothing():
    """What TrainingArguments' max_grad_norm means under SLAMB (docs/integrations.md): each rank's local gradient is
    scaled to the bound by its own norm (the ranks' norms are not averaged first), and no byte is sent for it."""
    bound = 1e-3  # below every local gradient's norm: every step is clipped
    res = _run(max_grad_norm=bound)
    for r in res:
        norms = [float(g.norm()) for g in r["grads"]]
        assert norms == pytest.approx([bound] * STEPS, rel=1e-4), norms
        assert r["sent"][1:] == r["ledger"][1:], (r["sent"], r["ledger"])
    assert not any(torch.allclose(a, b) for a, b in zip(res[0]["grads"], res[1]["grads"]))


def plain_checkpoint_worker(rank, n, out_dir):
    """A plain Trainer's checkpoint of a SLAMB run, resumed by SLAMBTrainer; and a SLAMBTrainer given
    TrainingArguments(optim=...). The error each raises."""
    from transformers import Trainer, TrainingArguments

    import slamb
    from slamb.integrations.huggingface import SLAMBTrainer

    def trainer(cls, **more):
        torch.manual_seed(0)
        model = Tiny()
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=SAVE_AT,
                                 save_steps=SAVE_AT, use_cpu=True, report_to=[], disable_tqdm=True, **more)
        opt = slamb.create_optimizer("slamb", model, **SETTINGS)
        opt.allow_same_gradients = cls is Trainer  # the plain Trainer's checkpoint, made on purpose (else refused)
        return cls(model=model, args=args, train_dataset=Pairs(), optimizers=(opt, None))

    def error(call):
        try:
            call()
        except (ValueError, FileNotFoundError) as e:
            return str(e)
        return None

    trainer(Trainer).train()
    checkpoint = os.path.join(out_dir, f"checkpoint-{SAVE_AT}")
    return {"resume": error(lambda: trainer(SLAMBTrainer).train(resume_from_checkpoint=checkpoint)),
            "optim": error(lambda: trainer(SLAMBTrainer, optim="adafactor")),
            "optim_args": error(lambda: trainer(SLAMBTrainer, optim_args="beta1=0.9"))}


def test_a_plain_trainers_checkpoint_and_an_optim_setting_are_refused_in_one_line_naming_them():
    with tempfile.TemporaryDirectory() as d:
        res = support.run(plain_checkpoint_worker, 2, d)
    for rank, r in enumerate(res):
        expected = {"resume": ["saved by a plain transformers.Trainer", "rank 0's SLAMB state (optimizer.pt)",
                               f"optimizer.rank{rank}-of-2.pt", "resume from a checkpoint SLAMBTrainer saved"],
                    "optim": ["optim='adafactor'", "optimizer_name='slamb'", "leave optim"],
                    "optim_args": ["optim_args='beta1=0.9'", "leave optim"]}
        for case, words in expected.items():
            assert r[case] is not None and "\n" not in r[case], (case, r[case])
            assert all(w in r[case] for w in words), (case, r[case])
    print("\n".join(res[0].values()))
