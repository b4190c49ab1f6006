"""A run's settings: which of them define what it computes, and the checks every pipeline shares.

:data:`NOT_COMPUTED` is the one list of settings that stay out of a run's identity, each with its
kind:

* ``operational``: how the run is operated (progress bar, resume, restarts, threads, device,
  checkpointing, logger, loader workers and prefetch, the phase timer's device syncs); two runs
  that differ only in these compute the same thing (:data:`OPERATIONAL_KEYS`);
* ``label``: what names the run or files it (the ``experiment`` and ``sweep`` config groups,
  which set ``name`` and the settings themselves; the tables' ``paper`` and ``study`` entries),
  also left out of what a run computes;
* ``input``: what the run reads (data, held-out data, the model and optimizer state it starts from).
  They change what is computed, but a dataset can move and the experiment that picks a model names the
  run: they stay out of the run directory's name and are checked on resume instead (:data:`INPUT_KEYS`,
  :func:`harness.checkpoint.run_inputs`).

A key covers its subtree (``logger`` covers ``logger.wandb``). From this list come: the settings
compared to decide that two runs are one configuration (:func:`effective_config`, for the tables
and for a finished run found again), the inputs recorded in checkpoints, and the overrides Hydra
leaves out of the run directory's name (the ``run_dir_excluded`` resolver, named in
``configs/hydra/default.yaml``).
"""
from __future__ import annotations

from pathlib import PurePath

from omegaconf import OmegaConf

from slamb.optim.checks import check_count

from .schedules import warmup_steps

OPERATIONAL, LABEL, INPUT = "operational", "label", "input"
NOT_COMPUTED = {
    "trainer.progress": OPERATIONAL, "trainer.resume": OPERATIONAL, "trainer.max_restarts": OPERATIONAL,
    "trainer.threads_per_worker": OPERATIONAL, "trainer.device": OPERATIONAL, "trainer.checkpoint": OPERATIONAL,
    "trainer.timeout_s": OPERATIONAL, "trainer.cudnn_benchmark": OPERATIONAL,
    "logger": OPERATIONAL, "data.workers": OPERATIONAL, "data.prefetch": OPERATIONAL,
    "time_breakdown": OPERATIONAL,
    "experiment": LABEL, "sweep": LABEL, "paper": LABEL, "study": LABEL,
    "data.dir": INPUT, "data.train_file": INPUT, "data.dev_file": INPUT, "model.dir": INPUT, "init_from": INPUT,
    "init_optimizer_from": INPUT, "validation.dir": INPUT,
}
# what two runs may differ in and still be one configuration
OPERATIONAL_KEYS = tuple(k for k, kind in NOT_COMPUTED.items() if kind in (OPERATIONAL, LABEL))
INPUT_KEYS = tuple(k for k, kind in NOT_COMPUTED.items() if kind == INPUT)
# settings added after runs were recorded, with the value those runs computed with: a saved config or
# checkpoint without one is the same configuration as a config that sets it to this value (their resume and
# their finished runs are found again, rather than refused or trained over)
ADDED_SETTINGS = {"trainer.parallelism": "ddp", "trainer.shard_size": None}
# settings whose value is a length that must be at least 1 (an empty schedule trains nothing)
SCHEDULE_KEYS = ("epochs", "steps", "log_every", "trainer.checkpoint.every")


def covers(keys, key: str) -> bool:
    """Whether ``key`` is one of ``keys`` or lies in the subtree of one."""
    return any(key == k or key.startswith(k + ".") for k in keys)


def lookup(cfg, dotted: str, default=None):
    """``cfg["a"]["b"]`` for ``"a.b"`` in a dict or DictConfig, ``default`` where a level is missing."""
    node = cfg
    for key in dotted.split("."):
        if not hasattr(node, "get"):
            return default
        node = node.get(key, default)
    return node


def check_schedule(cfg) -> None:
    """Clear errors for an empty schedule (``epochs=0``) and a warm-up the run never finishes, before any
    worker starts."""
    for key in SCHEDULE_KEYS:
        value = lookup(cfg, key)
        if value is not None:
            check_count(key, value, f" (an empty schedule trains nothing); set {key} to 1 or more")
    check_warmup(cfg)


def check_warmup(cfg) -> None:
    """The LR warm-up of ``schedule`` ends within the run: ``warmup_fraction`` in [0, 1); where the run counts
    optimizer steps (BERT's ``steps``), ``warmup_steps`` (or the fraction's steps) below them; Swin's
    ``warmup_epochs`` below ``epochs``. The schedules refuse these too, but in the workers, once the data is
    loaded: an epoch-counted run's steps are known only then, and its ``warmup_steps`` are checked there."""
    schedule, steps, epochs = cfg.get("schedule") or {}, cfg.get("steps"), cfg.get("epochs")
    name, fraction, warmup = schedule.get("name"), schedule.get("warmup_fraction"), schedule.get("warmup_steps")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 <= fraction < 1):
        raise ValueError(f"invalid schedule.warmup_fraction={fraction!r}: must be a share of the steps in [0, 1); "
                         "set schedule.warmup_fraction=0.1, say")
    if warmup is not None:
        check_count("schedule.warmup_steps", warmup, minimum=0)
    if name in ("warmup_poly", "warmup_exp") and steps is not None and warmup_steps(schedule, steps) >= steps:
        setting = (f"schedule.warmup_steps={warmup}" if warmup is not None
                   else f"schedule.warmup_fraction={fraction} ({warmup_steps(schedule, steps)} steps)")
        raise ValueError(f"invalid {setting}: the warm-up must end before the run's steps={steps} do; set "
                         f"schedule.warmup_steps to at most {steps - 1}")
    warmup = schedule.get("warmup_epochs")
    if name == "warmup_cosine" and epochs is not None and not (
            isinstance(warmup, (int, float)) and not isinstance(warmup, bool) and 0 <= warmup < epochs):
        raise ValueError(f"invalid schedule.warmup_epochs={warmup!r}: the warm-up must end before the run's "
                         f"epochs={epochs} do; set schedule.warmup_epochs to at most {epochs - 1}")


def flatten(cfg: dict, prefix: str = "") -> dict:
    """``{"a.b": value}`` for every leaf of a nested dict (lists are leaves, as tuples)."""
    out = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


def with_added_settings(flat: dict) -> dict:
    """Flattened settings with the :data:`ADDED_SETTINGS` they lack, at their earlier runs' values."""
    return {**ADDED_SETTINGS, **flat}


def effective_config(cfg: dict, drop: tuple[str, ...] = ()) -> dict:
    """The flattened settings of ``cfg`` that determine what a run computes (less those under ``drop``)."""
    skip = OPERATIONAL_KEYS + tuple(drop)
    return {k: v for k, v in with_added_settings(flatten(cfg)).items() if not covers(skip, k)}


def same_configuration(a: dict, b: dict) -> bool:
    return effective_config(a) == effective_config(b)


def run_dir_excluded(overrides) -> list[str]:
    """The keys of ``overrides`` (Hydra's ``key=value`` lines) that :data:`NOT_COMPUTED` covers.

    Hydra's ``override_dirname.exclude_keys`` matches keys exactly; given the job's own overrides,
    this list covers subtrees too (``logger.project=x`` stays out because ``logger`` does).
    """
    keys = [line.split("=", 1)[0].lstrip("+~").split("@", 1)[0] for line in overrides]
    return [k for k in keys if covers(NOT_COMPUTED, k)]


# the pipelines import the harness before Hydra composes their config, which names these resolvers
OmegaConf.register_new_resolver(
    "run_dir_excluded", lambda overrides: run_dir_excluded(
        OmegaConf.to_container(overrides, resolve=False) if OmegaConf.is_config(overrides) else overrides),
    replace=True)
# `${parent:${init_from}}`: the run directory whose exported model a phase starts from (BERT's 1-bit LAMB phase 2
# continues that run's optimizer), so that one setting names both and they cannot come from two runs
OmegaConf.register_new_resolver("parent", lambda path: None if path is None else str(PurePath(path).parent),
                                replace=True)
