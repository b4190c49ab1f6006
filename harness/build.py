"""Building a job from its config: settings checks, the optimizer, the launch from Hydra."""
from __future__ import annotations

import torch

from slamb import registry
from slamb.optim._common import check_choice
from .amp import PRECISIONS
from .distributed import launch

RESUME = ("auto", "never")
# optimizer config keys the harness consumes; every other key is a setting of the optimizer class
HARNESS_KEYS = ("name", "weight_decay", "no_decay", "decay_all")


def check_trainer(t) -> None:
    """Clear errors for trainer settings, before any worker starts."""
    n = t["nproc_per_node"]
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        raise ValueError(f"invalid trainer.nproc_per_node={n!r}: must be an integer >= 1 (local workers)")
    r = t["max_restarts"]
    if not (isinstance(r, int) and r >= 0):
        raise ValueError(f"invalid trainer.max_restarts={r!r}: must be an integer >= 0")
    check_choice("trainer.precision", t["precision"], PRECISIONS)
    check_choice("trainer.resume", t["resume"], RESUME)
    try:
        torch.device(t["device"]) if t["device"] != "auto" else None
    except RuntimeError as e:
        raise ValueError(f"invalid trainer.device={t['device']!r}: use auto, cpu, cuda, ... ({e})") from None
    every = t["checkpoint"]["every"]
    if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        raise ValueError(f"invalid trainer.checkpoint.every={every!r}: must be an integer >= 1 (epochs, or BERT's steps)")


def optimizer_kwargs(ocfg) -> dict:
    """The keyword settings of ``create_optimizer`` from an optimizer config (dtype names -> torch dtypes)."""
    settings = {k: v for k, v in dict(ocfg).items() if k not in HARNESS_KEYS}
    for key, value in settings.items():
        if key.endswith("dtype") and isinstance(value, str):
            dtype = getattr(torch, value, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"invalid optimizer.{key}={value!r}: must name a torch dtype (float16, bfloat16)")
            settings[key] = dtype
        elif isinstance(value, list):
            settings[key] = tuple(value)
    return settings


def build_optimizer(model: torch.nn.Module, ocfg):
    """``create_optimizer`` from an optimizer config node (see ``configs/optimizer/``).

    ``decay_all``: one group, weight decay on every parameter (the CIFAR-10 reference code) instead of
    exempting biases, norms and ``no_decay`` names.
    """
    decay_all = ocfg.get("decay_all", False)
    check_choice("optimizer.decay_all", decay_all, (False, True))
    params = [p for p in model.parameters() if p.requires_grad] if decay_all else model
    return registry.create_optimizer(ocfg["name"], params, weight_decay=ocfg.get("weight_decay", 0.0),
                                     no_decay=tuple(ocfg.get("no_decay") or ()), **optimizer_kwargs(ocfg))


def run_from_hydra(worker, cfg):
    """The body of every pipeline's ``@hydra.main``: check, resolve, start the workers, return rank 0's result.

    ``worker``: the pipeline's ``train`` by name (``"cifar10.train:train"``), so that workers started by
    spawn or submitit import it instead of unpickling a function of ``__main__``.

    The job's run directory is Hydra's output directory, locked while the job writes it. With
    ``trainer.resume=never`` an existing checkpoint there is discarded first; a run that already
    finished with this configuration returns its summary without training.
    """
    import os

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from .checkpoint import prepare_run
    from .distributed import started_externally
    from .run import RunLock

    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    check_trainer(container["trainer"])
    run_dir = HydraConfig.get().runtime.output_dir
    local = not started_externally()
    with RunLock(run_dir, hold=local or os.environ.get("RANK") == "0"):
        finished = prepare_run(container, run_dir, clear=local)
        if finished is not None:
            return finished
        return launch(worker, container, run_dir, nproc_per_node=container["trainer"]["nproc_per_node"],
                      max_restarts=container["trainer"]["max_restarts"])
