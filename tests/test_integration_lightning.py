"""slamb.integrations.lightning.SLAMBStrategy: 2 workers on a recording process group, different data per rank."""
from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning")

from tests import integration_support as support  # noqa: E402

pytestmark = pytest.mark.multiprocess  # the framework runs in 2 gloo worker processes

STEPS_PER_EPOCH, EPOCHS = 3, 2
STEPS = STEPS_PER_EPOCH * EPOCHS
SETTINGS = dict(lr=0.02, compress_ratio=0.25, min_compress_numel=16, sync_interval=4, nonfinite="skip")
OTHERS = dict(dgc=dict(lr=0.1, density=0.25), onebit_lamb=dict(lr=0.02, freeze_step=2), jointspar=dict(lr=0.1))


def _val_data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 8, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(8, 4, generator=g)))


def train_worker(rank, n, plain, ckpt_dir, resume, overflow_at, name="slamb", epochs=EPOCHS, save_last=None,
                 evaluate=False):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    import slamb
    from slamb.integrations.lightning import SLAMBStrategy

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            return loss * float("inf") if rank == 1 and self.trainer.global_step == overflow_at else loss

        def on_validation_start(self):  # the module's hook runs before the strategy's: the rank's own copy
            self.own_at_validation.append(params(self))
            self.validation_losses.append([])

        def validation_step(self, batch, batch_idx):
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            self.validation_losses[-1].append(loss.item())
            self.log("loss", loss)  # the rank's own batch (sync_dist's mean reduces a long on this backend)

        def test_step(self, batch, batch_idx):
            self.log("loss", F.mse_loss(self.net(batch[0]), batch[1]))

        def predict_step(self, batch, batch_idx):
            return batch[0], self.net(batch[0])

        def configure_optimizers(self):
            opt = slamb.create_optimizer(name, self, **(SETTINGS if name == "slamb" else OTHERS[name]))
            opt.allow_same_gradients = plain  # DDPStrategy's all-reduce, measured on purpose (else refused)
            self.probe = support.StepProbe(opt)
            return opt

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(n * STEPS_PER_EPOCH * 4, 8, generator=g)
            data = torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(8, 4, generator=g)))
            return torch.utils.data.DataLoader(data, batch_size=4)  # Lightning's sampler: each rank its own

    def params(module):
        return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])

    torch.manual_seed(0)
    model = Tiny()
    model.own_at_validation, model.validation_losses = [], []
    # on evaluation, the checkpoint is saved in on_validation_end: the strategy's evaluation hooks bracket it
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_last=save_last,
                                 save_on_train_epoch_end=not evaluate)] if ckpt_dir else []
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))] \
        if overflow_at is not None else []
    strategy = DDPStrategy() if plain else SLAMBStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=n, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=bool(ckpt_dir), callbacks=callbacks, plugins=plugins,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    ckpt = os.path.join(ckpt_dir, resume if isinstance(resume, str) else f"epoch=0-step={STEPS_PER_EPOCH}.ckpt") \
        if resume else None
    val = torch.utils.data.DataLoader(_val_data(), batch_size=4)
    trainer.fit(model, ckpt_path=ckpt, val_dataloaders=val if evaluate else None)
    base = model.probe.optimizer
    out = dict(params=params(model), stats=base.comm_stats(), steps=getattr(base, "_step", None),
               **model.probe.intervals())
    if evaluate:
        out.update(own_at_validation=model.own_at_validation, validation_losses=model.validation_losses)
        out["validated"] = trainer.validate(model, val, verbose=False)[0]["loss"]
        out["after_validate"] = params(model)
        out["tested"] = trainer.test(model, val, verbose=False)[0]["loss"]
        out["after_test"] = params(model)
        out["predicted"] = trainer.predict(model, val)
        out["after_predict"] = params(model)
    if overflow_at is not None:
        out["skipped"] = trainer.strategy.precision_plugin.scaler.skipped_steps
    if ckpt_dir and not resume:
        path = os.path.join(ckpt_dir, f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
        out["saved"] = torch.load(path, weights_only=False)["state_dict"]
        out["local_at_save"] = torch.load(os.path.join(f"{path}.ranks", f"model.rank{rank}-of-{n}.pt"))
    return out


def _run(plain=False, ckpt_dir=None, resume=False, overflow_at=None, name="slamb", epochs=EPOCHS, save_last=None,
         evaluate=False):
    return support.run(train_worker, 2, plain, ckpt_dir, resume, overflow_at, name, epochs, save_last, evaluate)


def _averaged_net(flat_params_by_rank):
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    torch.nn.utils.vector_to_parameters(sum(flat_params_by_rank) / len(flat_params_by_rank), net.parameters())
    return net


def test_slamb_gradients_stay_local_and_the_ledger_is_every_byte_sent():
    plain, ours = _run(plain=True), _run()
    for step, (g0, g1) in enumerate(zip(ours[0]["grads"], ours[1]["grads"])):
        assert not torch.equal(g0, g1), f"step {step}: the ranks' gradients were averaged"
    grad_bytes = 4 * (8 * 16 + 16 + 16 * 4 + 4)
    sigterm_flag = 8  # Lightning broadcasts rank 0's SIGTERM flag (one int64) every batch, whatever the optimizer
    for r in ours:
        # Lightning runs forward and backward inside step() (a closure), so DDP's one-off broadcast of its
        # rebuilt bucket order, at the second forward, falls in the second interval
        assert [s - l for s, l in zip(r["sent"][2:], r["ledger"][2:])] == [sigterm_flag] * (STEPS - 3)
        assert "grads" not in r["stats"]["total"]
    for r in plain:  # DDPStrategy's DDP all-reduces every gradient on CPU (its comm hook is CUDA-only)
        assert [s - l for s, l in zip(r["sent"][2:], r["ledger"][2:])] == [grad_bytes + sigterm_flag] * (STEPS - 3)
    print(f"\nLightning bytes/step/rank: DDPStrategy {plain[0]['sent'][2:]} vs SLAMBStrategy {ours[0]['sent'][2:]}")


@pytest.mark.parametrize("name", ["dgc", "jointspar"])
def test_every_optimizer_that_communicates_itself_sends_only_its_ledger_and_the_sigterm_flag(name):
    for r in _run(name=name):
        extra = [s - l for s, l in zip(r["sent"][2:], r["ledger"][2:])]
        assert extra == [8] * (STEPS - 3), (name, r["sent"], r["ledger"])  # 8: Lightning's SIGTERM flag


def test_resume_from_checkpoint_ends_bit_exactly_and_the_checkpoint_holds_the_average():
    with tempfile.TemporaryDirectory() as d:
        full = _run(ckpt_dir=d)
        resumed = _run(ckpt_dir=d, resume=True)
    for f, r in zip(full, resumed):
        assert torch.equal(f["params"], r["params"])
        assert f["steps"] == r["steps"] == STEPS
    own = [r["local_at_save"] for r in full]
    assert not all(torch.equal(own[0][k], own[1][k]) for k in own[0])  # the ranks had drifted apart
    for k in own[0]:  # the checkpoint's state_dict is the ranks' average, not rank 0's copy
        assert torch.equal(full[0]["saved"][k], (own[0][k] + own[1][k]) / 2), k


def test_resume_from_the_link_of_save_last_link_ends_where_the_uninterrupted_run_ends():
    with tempfile.TemporaryDirectory() as d:
        full = _run()
        _run(ckpt_dir=d, epochs=1, save_last="link")
        assert os.path.islink(os.path.join(d, "last.ckpt"))
        resumed = _run(ckpt_dir=d, resume="last.ckpt")
    for f, r in zip(full, resumed):
        assert torch.equal(f["params"], r["params"])
        assert f["steps"] == r["steps"] == STEPS


def test_validation_test_and_predict_score_the_ranks_average_and_leave_each_rank_its_own():
    with tempfile.TemporaryDirectory() as d:
        res = _run(ckpt_dir=d, evaluate=True)
        first = os.path.join(d, f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
        saved = torch.load(first, weights_only=False)["state_dict"]
        own_saved = [torch.load(os.path.join(f"{first}.ranks", f"model.rank{r}-of-2.pt")) for r in range(2)]
    x, y = _val_data().tensors
    final = [r["params"] for r in res]
    assert not torch.equal(*final)  # the ranks had drifted apart
    with torch.no_grad():
        expected = F.mse_loss(_averaged_net(final)(x), y).item()
        for r in res:
            assert torch.equal(r["after_validate"], r["params"]) and torch.equal(r["after_test"], r["params"])
            assert torch.equal(r["after_predict"], r["params"])
            for batch_x, out in r["predicted"]:
                torch.testing.assert_close(out, _averaged_net(final)(batch_x))
        # one batch of 4 per rank: the mean of the ranks' losses is the loss over the 8 samples
        assert sum(r["validated"] for r in res) / 2 == pytest.approx(expected, rel=1e-6)
        assert sum(r["tested"] for r in res) / 2 == pytest.approx(expected, rel=1e-6)
        # the validation inside fit: each epoch scores the ranks' average of that time
        for epoch in range(EPOCHS):
            own = [r["own_at_validation"][epoch] for r in res]
            assert not torch.equal(*own)
            scored = sum(r["validation_losses"][epoch][0] for r in res) / 2
            assert scored == pytest.approx(F.mse_loss(_averaged_net(own)(x), y).item(), rel=1e-6)
    # the checkpoint saved in on_validation_end holds each rank's own copy beside the ranks' average
    for r, own in zip(res, own_saved):
        assert torch.equal(torch.cat([v.reshape(-1) for v in own.values()]), r["own_at_validation"][0])
    assert torch.equal(torch.cat([v.reshape(-1) for v in saved.values()]),
                       (res[0]["own_at_validation"][0] + res[1]["own_at_validation"][0]) / 2)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    res = _run(overflow_at=2)
    assert [r["skipped"] for r in res] == [1, 1]
    assert [r["steps"] for r in res] == [STEPS - 1] * 2


def refused_worker(rank, n, devices):
    """torch.distributed set up outside Lightning (as ``mp.spawn`` or a launcher it does not detect would),
    with a Trainer whose ``devices`` does not count the ranks."""
    import lightning as L

    import slamb
    from slamb.integrations.lightning import SLAMBStrategy

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 4)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return slamb.create_optimizer("slamb", self, **SETTINGS)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_val_data(), batch_size=4)

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=SLAMBStrategy(), max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return support.refusal(lambda: trainer.fit(Tiny()))


def test_a_trainer_that_sees_one_of_the_ranks_launched_is_refused():
    # before: rank 1 died of an IndexError (its LOCAL_RANK past Lightning's one device), rank 0 of gloo's
    # "Connection closed by peer"; with LOCAL_RANK unset, each rank trained alone on all the data, silently
    support.assert_refused_in_one_line(functools.partial(refused_worker, devices=1), 'accelerator="cpu", devices=2')


def test_a_trainer_that_counts_more_ranks_than_torch_distributed_has_is_refused():
    for message in support.run(refused_worker, 2, 4):
        assert "Lightning runs 4 processes, torch.distributed has 2" in message and "devices=2" in message, message
        assert "\n" not in message
