"""Whether the overrides of a per-paper script leave its experiments' recipes as they are.

    python -m harness.recipe ROOT EXPERIMENT [EXPERIMENT ...] -- [OVERRIDES ...]

``ROOT`` is the pipeline's config (``cifar10``, ``swin``, ``bert``, ``squad``). Prints nothing when, with the
overrides, every experiment computes what its recipe computes: the run's settings less the operational ones,
the labels, the inputs (:data:`harness.settings.NOT_COMPUTED`: ``data.dir``, ``model.dir``,
``trainer.resume``, ...), the seed and the run's ``name`` are the experiment's own. Otherwise the run is at
another size (a smoke run: a smaller model, fewer epochs or steps, other workers, less data, ...): it prints ``smoke-<digest>``, the digest of the
settings that differ, and lists them on stderr in one line. The scripts put such a run's directories under
that name and its tables outside ``results/`` (scripts/cifar10_resnet110.sh and the others), so that it never
takes a recipe run's directory or page, and two sizes never share one. Overrides Hydra cannot compose (a
misspelt setting, an unknown option) are refused in one line naming the setting and its choices, exit status 2.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from .settings import INPUT_KEYS, effective_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def computed(cfg: dict) -> dict:
    """The settings of a resolved config that say what its run computes at what size: all but the operational
    ones, the labels, the inputs (judged by content: :mod:`harness.identity`), the ``name`` derived from the
    rest, and the seed (a recipe is run at several)."""
    return effective_config(cfg, drop=(*INPUT_KEYS, "name", "seed"))


def _compose(root: str, overrides, throw_on_missing: bool = False) -> dict:
    """``root``'s config composed with ``overrides`` and resolved: inside a pipeline's ``@hydra.main`` on the
    Hydra it runs, elsewhere on the repository's configs."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    def resolved():
        return OmegaConf.to_container(compose(root, list(overrides)), resolve=True,
                                      throw_on_missing=throw_on_missing)

    if GlobalHydra.instance().is_initialized():
        return resolved()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return resolved()


def differences(recipe: dict, run: dict) -> dict[str, tuple]:
    """``{setting: (recipe's value, the run's)}`` where two :func:`computed` settings differ."""
    return {k: (recipe.get(k), run.get(k)) for k in sorted(recipe.keys() | run.keys()) if recipe.get(k) != run.get(k)}


def departures(root: str, experiment: str, overrides) -> dict[str, tuple]:
    """``{setting: (recipe's value, this run's)}`` for every computed setting the overrides change; an override that
    sweeps (``optimizer.beta3=0.9,0.99``, a ``--multirun``'s) sizes each of its runs alike, and each run records its
    own departures when it starts (:func:`against_recipe`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    # Hydra's own settings (the run directory, the launcher) change where and how a run goes, not what it computes
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    parsed = OverridesParser.create().parse_overrides(overrides)
    overrides = [o for o, parsed_o in zip(overrides, parsed) if not parsed_o.is_sweep_override()]
    return differences(*(computed(composed(root, experiment, extra)) for extra in ([], overrides)))


def against_recipe(cfg: dict) -> dict:
    """Where a run composed by a pipeline's ``@hydra.main`` (``cfg``, resolved) stands against its experiment's
    recipe: ``{"experiment", "departures": {setting: [recipe's, the run's]}}``; without an experiment, against
    the pipeline's own defaults. Recorded in the run's ``identity.json`` (:mod:`harness.identity`)."""
    from hydra.core.hydra_config import HydraConfig

    runtime = HydraConfig.get()
    experiment = runtime.runtime.choices.get("experiment")
    recipe = computed(_compose(runtime.job.config_name, [f"experiment={experiment}"] if experiment else []))
    return {"experiment": experiment,
            "departures": {k: list(v) for k, v in differences(recipe, computed(cfg)).items()}}


def swept(study: str | None) -> tuple[str, ...]:
    """The settings the sweep ``study`` (``configs/sweep/<study>.yaml``: its ``study`` label) varies: the departures
    from its recipe that its runs are made of."""
    import yaml

    for path in sorted((CONFIGS / "sweep").glob("*.yaml")):
        sweep = yaml.safe_load(path.read_text()) or {}
        if study is not None and sweep.get("study") == study:
            return tuple(sweep["hydra"]["sweeper"]["params"])
    return ()


def size_name(root: str, experiments, overrides) -> tuple[str, dict]:
    """``("", {})`` for the recipes' size, else ``("smoke-<digest>", the departures)``; the digest is of the
    settings' new values, so the experiments of one command share it."""
    changed = {}
    for experiment in experiments:
        changed.update(departures(root, experiment, overrides))
    if not changed:
        return "", {}
    text = "\n".join(f"{k}={new!r}" for k, (_, new) in sorted(changed.items()))
    return f"smoke-{hashlib.sha256(text.encode()).hexdigest()[:8]}", changed


def composed(root: str, experiment: str, overrides, throw_on_missing: bool = False) -> dict:
    """The resolved config of ``experiment`` with ``overrides`` (Hydra's own settings left out)."""
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    return _compose(root, [f"experiment={experiment}", *overrides], throw_on_missing)


def main(argv=None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from .build import composition_error

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    (root, *experiments), overrides = argv[:cut], argv[cut + 1:]
    try:
        name, changed = size_name(root, experiments, overrides)
    except (HydraException, OmegaConfBaseException) as e:  # before any run starts: one line, a usage error
        print(composition_error(e), file=sys.stderr)
        return 2
    if name:
        print(f"{name}: not the recipe's size (" + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new)
                                                              in changed.items()) + ")", file=sys.stderr)
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
