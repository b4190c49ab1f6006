"""slamb.integrations.lightning.SLAMBStrategy: 2 workers on a recording process group, different data per rank."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning")

from tests import integration_support as support  # noqa: E402

STEPS_PER_EPOCH, EPOCHS = 3, 2
STEPS = STEPS_PER_EPOCH * EPOCHS
SETTINGS = dict(lr=0.02, compress_ratio=0.25, min_compress_numel=16, sync_interval=4, nonfinite="skip")
OTHERS = dict(dgc=dict(lr=0.1, density=0.25), onebit_lamb=dict(lr=0.02, freeze_step=2), jointspar=dict(lr=0.1))


def train_worker(rank, n, plain, ckpt_dir, resume, overflow_at, name="slamb"):
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

        def configure_optimizers(self):
            opt = slamb.create_optimizer(name, self, **(SETTINGS if name == "slamb" else OTHERS[name]))
            self.probe = support.StepProbe(opt)
            return opt

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(n * STEPS_PER_EPOCH * 4, 8, generator=g)
            data = torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(8, 4, generator=g)))
            return torch.utils.data.DataLoader(data, batch_size=4)  # Lightning's sampler: each rank its own

    torch.manual_seed(0)
    model = Tiny()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1)] if ckpt_dir else []
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))] \
        if overflow_at is not None else []
    strategy = DDPStrategy() if plain else SLAMBStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=n, strategy=strategy, max_epochs=EPOCHS, logger=False,
                        enable_checkpointing=bool(ckpt_dir), callbacks=callbacks, plugins=plugins,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    ckpt = os.path.join(ckpt_dir, f"epoch=0-step={STEPS_PER_EPOCH}.ckpt") if resume else None
    trainer.fit(model, ckpt_path=ckpt)
    base = model.probe.optimizer
    out = dict(params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]), stats=base.comm_stats(),
               steps=getattr(base, "_step", None), **model.probe.intervals())
    if overflow_at is not None:
        out["skipped"] = trainer.strategy.precision_plugin.scaler.skipped_steps
    if ckpt_dir and not resume:
        path = os.path.join(ckpt_dir, f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
        out["saved"] = torch.load(path, weights_only=False)["state_dict"]
        out["local_at_save"] = torch.load(os.path.join(f"{path}.ranks", f"model.rank{rank}-of-{n}.pt"))
    return out


def _run(plain=False, ckpt_dir=None, resume=False, overflow_at=None, name="slamb"):
    return support.run(train_worker, 2, plain, ckpt_dir, resume, overflow_at, name)


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


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    res = _run(overflow_at=2)
    assert [r["skipped"] for r in res] == [1, 1]
    assert [r["steps"] for r in res] == [STEPS - 1] * 2
