"""SLAMB (and every optimizer of the registry) inside the frameworks users train with.

One module per framework, each importing its framework only when used:

* :mod:`slamb.integrations.huggingface`: ``SLAMBTrainer``, a ``transformers.Trainer``;
* :mod:`slamb.integrations.lightning`: ``SLAMBStrategy``, a Lightning ``DDPStrategy``;
* :mod:`slamb.integrations.accelerate`: ``prepare(accelerator, model, optimizer, ...)``.

Each does what :func:`slamb.wrap_model` does for a plain loop, inside the
framework's own DDP: the optimizer's communication hook (SLAMB sends no
gradients), one optimizer state per rank in the framework's checkpoints, the
ranks' average as the saved model, and a loss scaler whose overflow decision
every rank shares.
"""
