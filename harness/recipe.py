"""Whether the overrides of a per-paper script leave its experiments' recipes as they are.

    python -m harness.recipe ROOT EXPERIMENT [EXPERIMENT ...] -- [OVERRIDES ...]

``ROOT`` is the pipeline's config (``cifar10``, ``swin``, ``bert``, ``squad``). Prints nothing when, with the
overrides, every experiment computes what its recipe computes: the run's settings less the operational ones,
the labels, the inputs (:data:`harness.settings.NOT_COMPUTED`: ``data.dir``, ``model.dir``,
``trainer.resume``, ...) and the run's ``name`` are the experiment's own. Otherwise the run is at another size (a smoke run: a smaller
model, fewer epochs or steps, other workers, less data, ...): it prints ``smoke-<digest>``, the digest of the
settings that differ, and lists them on stderr in one line. The scripts put such a run's directories under
that name and its tables outside ``results/`` (scripts/cifar10_resnet110.sh and the others), so that it never
takes a recipe run's directory or page, and two sizes never share one.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from .settings import INPUT_KEYS, effective_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def departures(root: str, experiment: str, overrides) -> dict[str, tuple]:
    """``{setting: (recipe's value, this run's)}`` for every computed setting the overrides change (the ``name``
    derived from them names the run, it computes nothing)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    # Hydra's own settings (the run directory, the launcher) change where and how a run goes, not what it computes
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        recipe, run = (effective_config(OmegaConf.to_container(compose(root, [f"experiment={experiment}", *extra]),
                                                               resolve=True), drop=(*INPUT_KEYS, "name"))
                       for extra in ([], overrides))
    return {k: (recipe.get(k), run.get(k)) for k in sorted(recipe.keys() | run.keys()) if recipe.get(k) != run.get(k)}


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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    (root, *experiments), overrides = argv[:cut], argv[cut + 1:]
    name, changed = size_name(root, experiments, overrides)
    if name:
        print(f"{name}: not the recipe's size (" + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new)
                                                              in changed.items()) + ")", file=sys.stderr)
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
