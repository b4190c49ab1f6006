"""Optimizers by name, timm-style: ``create_optimizer("slamb", model, lr=...)``.

Every pipeline creates its optimizer here, so a config names it and nothing
else changes. Passing a model (rather than parameters) puts biases and
normalisation weights (every tensor with ``dim() <= 1``) in a group without
weight decay, as the LAMB/BERT and Swin recipes do.
"""
from __future__ import annotations

import importlib
import inspect

import torch

from .contract import adopt
from .optim.checks import check_lr

# name -> "module:attribute", resolved on first use; extra keyword defaults
OPTIMIZERS: dict[str, tuple[str, dict]] = {
    "sgd": ("torch.optim:SGD", {}),
    "adamw": ("torch.optim:AdamW", {}),
    "lamb": ("slamb.optim.lamb:LAMB", {}),
    "slamb": ("slamb.optim.slamb:SLAMB", {}),
    "onebit_lamb": ("slamb.optim.onebit_lamb:OnebitLamb", {}),
    "dgc": ("slamb.optim.dgc:DGC", {}),
    "jointspar": ("slamb.optim.jointspar:JointSpar", {"lars": False}),
    "jointspar_lars": ("slamb.optim.jointspar:JointSpar", {"lars": True}),
    "powersgd": ("slamb.optim.powersgd:PowerSGD", {}),
    "diloco": ("slamb.optim.diloco:DiLoCo", {}),
}


def optimizer_class(name: str):
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(OPTIMIZERS)}")
    module, attr = OPTIMIZERS[name][0].split(":")
    return getattr(importlib.import_module(module), attr)


def optimizer_settings(name: str) -> list[str]:
    """The keyword settings ``create_optimizer(name, ...)`` accepts."""
    params = inspect.signature(optimizer_class(name).__init__).parameters
    return sorted(k for k in params if k not in ("self", "params") and k not in OPTIMIZERS[name][1])


def check_settings(name: str, settings: dict) -> None:
    """The checks every optimizer gets before it is built: a known name, known settings, a finite lr.

    torch's own optimizers accept ``lr=inf``; a step size beyond :data:`~slamb.optim.checks.MAX_LR`
    only turns the parameters into inf or NaN a step later, far from its cause.
    """
    valid = optimizer_settings(name)
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for optimizer {name!r}; valid: {valid}")
    if "lr" in settings:
        check_lr(settings["lr"])


def param_groups_weight_decay(model: torch.nn.Module, weight_decay: float, no_decay: tuple[str, ...] = ()):
    """Two groups: decayed weights, and biases / norms / 1-D tensors / names in ``no_decay`` at 0."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.dim() <= 1 or name.endswith(".bias") or any(key in name for key in no_decay)
        (rest if skip else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def create_optimizer(name: str, params_or_model, *, weight_decay: float = 0.0,
                     no_decay: tuple[str, ...] = (), **settings):
    """Build optimizer ``name``; unknown names or settings raise ``ValueError`` listing the valid ones.

    The result satisfies :class:`slamb.contract.DistributedOptimizer` (a ``ledger``,
    ``comm_stats()``, ``communication``, ``begin_epoch``/``begin_step``); wrap the
    model with :func:`slamb.wrap_model` to get its DDP communication.
    """
    cls = optimizer_class(name)
    check_settings(name, settings)
    if isinstance(params_or_model, torch.nn.Module):
        params = param_groups_weight_decay(params_or_model, weight_decay, tuple(no_decay))
    else:
        params = params_or_model
    kwargs = {**OPTIMIZERS[name][1], **settings}
    if "weight_decay" in inspect.signature(cls.__init__).parameters:
        kwargs["weight_decay"] = weight_decay
    optimizer = cls(params, **kwargs)
    return adopt(optimizer)
