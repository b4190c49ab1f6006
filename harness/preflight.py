"""Every run of a per-paper script, checked before the first one starts.

    python -m harness.preflight ROOT [--caller DIR] [--world N] --run EXPERIMENT [SETTING ...] [--run ...] \
        -- [OVERRIDES ...]

Each ``--run`` is one run of the script: its experiment and the settings the script gives that run alone (a
phase's data), then the OVERRIDES it gives every run. Each run is composed as its pipeline's command composes
it and checked as :func:`harness.build.run_from_hydra` checks it before any worker starts
(:func:`harness.build.check_settings`: the settings, the data, the inputs), so that phase 2's data is refused
before phase 1 trains. A refusal is one line naming the run and the setting, exit status 2, and nothing is
written. Otherwise the OVERRIDES go to stdout, one a line, with the relative paths of the inputs
(:data:`harness.settings.INPUT_KEYS`) made the caller's: ``--caller`` is the directory the script was started
in, since the script itself runs in the repository. ``--world``: the workers of a job that torchrun starts on
several nodes (under SLURM its environment says).
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys

from .recipe import composed
from .settings import INPUT_KEYS

# each config root's pipeline, whose LAUNCH says how run_from_hydra checks and starts it
PIPELINES = {"cifar10": "cifar10.train", "swin": "swin.train", "bert": "bert.train", "squad": "squad_finetune.train"}


def in_caller(overrides, caller: str) -> list[str]:
    """``overrides`` with each relative input path (``data.dir=smoke/digits``) made the caller's."""
    if os.path.realpath(caller) == os.path.realpath(os.getcwd()):
        return list(overrides)
    out = []
    for line in overrides:
        key, eq, value = line.partition("=")
        if eq and key.lstrip("+~") in INPUT_KEYS and value not in ("", "null") and not os.path.isabs(value) \
                and not value.startswith(("~", "$")):
            line = f"{key}={os.path.normpath(os.path.join(caller, value))}"
        out.append(line)
    return out


def refusal(root: str, experiment: str, overrides) -> str | None:
    """The one line that refuses this run, or None where it passes every check made before its workers start."""
    from hydra.errors import HydraException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from .build import added_settings, check_settings, composition_error, user_error

    try:
        cfg = composed(root, experiment, overrides, throw_on_missing=True)
    except MissingMandatoryValue as e:
        return f"error: {experiment}: {e.full_key} is required and not set; fix: set {e.full_key}=..."
    except (HydraException, OmegaConfBaseException) as e:
        return composition_error(e)
    launch = importlib.import_module(PIPELINES[root]).LAUNCH
    # the notices a check prints (the CPU fallback, one worker) are the run's to print, once
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            check_settings(cfg, added=added_settings(overrides), **launch)
    except (ValueError, OSError) as e:
        return f"error: {experiment}: " + user_error(e, cfg["optimizer"]).removeprefix("error: ")
    return None


def parse(argv) -> tuple[str, dict, list[tuple[str, list[str]]], list[str]]:
    """(root, options, runs as (experiment, settings), overrides) of the command line."""
    cut = argv.index("--") if "--" in argv else len(argv)
    head, overrides = argv[:cut], argv[cut + 1:]
    root, options, runs = head[0], {"caller": os.getcwd(), "world": None}, []
    words = iter(head[1:])
    for word in words:
        if word in ("--caller", "--world"):
            options[word[2:]] = next(words)
        elif word == "--run":
            runs.append((next(words), []))
        else:
            runs[-1][1].append(word)
    return root, options, runs, overrides


def main(argv=None) -> int:
    root, options, runs, overrides = parse(list(sys.argv[1:] if argv is None else argv))
    if root not in PIPELINES:
        print(f"error: unknown pipeline {root!r}; choose from: {', '.join(PIPELINES)}", file=sys.stderr)
        return 2
    if options["world"] is not None:  # as a worker of that job sees it: torchrun's world
        os.environ.update(WORLD_SIZE=options["world"], RANK="0")
    overrides = in_caller(overrides, options["caller"])
    for experiment, settings in runs:
        line = refusal(root, experiment, [*in_caller(settings, options["caller"]), *overrides])
        if line:
            print(line, file=sys.stderr)
            return 2
    print("\n".join(overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
