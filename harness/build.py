"""Building a job from its config: settings checks, the optimizer, the launch from Hydra."""
from __future__ import annotations

import difflib
import inspect
import math
import os
import re
import sys
from pathlib import Path

import torch

from slamb import registry
from slamb.contract import GRADIENT_ALLREDUCE
from slamb.optim.slamb import SLAMB
from slamb.optim.checks import check_choice, check_count
from .accumulate import accumulation_steps, split_batch
from .amp import PRECISIONS
from .checkpoint import Checkpointer, fixed_world, lookup, run_inputs
from . import fault_tolerance as fault_tolerance_module
from . import identity
from .distributed import (WorkerError, check_device, cpu_fallback_notice, launch, local_workers,
                          planned_world_size)
from .parallel import PARALLELISMS, check_parallelism
from .replica import current as current_replica
from .schedules import SCHEDULE_SETTINGS
from .settings import check_schedule, covers

RESUME = ("auto", "never")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# every trainer setting, with its default: a key not in it is refused (a misspelt override would be ignored)
TRAINER_DEFAULTS = CONFIGS / "trainer" / "default.yaml"
# what a command line may add (+key=value) beside a pipeline's own optional settings and the schedule's: the
# optimizer's settings (its constructor refuses one it lacks) and the labels that file a run (free-form)
ADDABLE = ("optimizer", "paper", "study")
# optimizer config keys the harness consumes; every other key is a setting of the optimizer class
HARNESS_KEYS = ("name", "weight_decay", "no_decay", "decay_all")


def unknown_setting(key: str, value, known) -> ValueError:
    """The refusal of setting ``key``: the nearest of ``known`` (the names beside it) and all of them."""
    prefix, _, name = key.rpartition(".")
    near = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {prefix + '.' if prefix else ''}{near[0]}?)" if near else ""
    return ValueError(f"unknown setting {key}={value!r}{hint}; known: {sorted(known)}")


def check_known(node: dict, known: dict, prefix: str) -> None:
    """Refuse keys of ``node`` that ``known`` (the defaults) lacks: a misspelt ``+trainer.*`` would be ignored."""
    for key, value in node.items():
        if key not in known:
            raise unknown_setting(f"{prefix}{key}", value, known)
        if isinstance(value, dict) and isinstance(known[key], dict):
            check_known(value, known[key], f"{prefix}{key}.")


def added_settings(overrides) -> list[str]:
    """The keys a command line's overrides add (``+key=value``; not ``++``, which may set an existing one, nor a
    config group's option, ``+mixin=...``)."""
    keys = [line.split("=", 1)[0][1:] for line in overrides if line.startswith("+") and not line.startswith("++")]
    return [k for k in keys if not (CONFIGS / k.split("@", 1)[0]).is_dir() and not k.startswith("hydra.")]


def check_added(cfg: dict, added, optional=()) -> None:
    """Refuse the settings a command line adds (:func:`added_settings`) that nothing reads: ``+data.augmnt=false``
    was ignored, and augmentation stayed on. ``optional``: the pipeline's settings that its config leaves out."""
    readable = (*ADDABLE, *optional, *(f"schedule.{k}" for names in SCHEDULE_SETTINGS.values() for k in names))
    for key in added:
        if covers(readable, key):
            continue
        parent, node = "", cfg
        for name in key.split("."):  # down to the first level that the addition made
            full = f"{parent}{name}"
            known = {k for k in node if not covers(added, f"{parent}{k}")}
            known |= {r[len(parent):].split(".")[0] for r in readable if r.startswith(parent)}
            if name not in known:
                raise unknown_setting(full, lookup(cfg, full), known)
            parent, node = f"{full}.", node[name]


def check_trainer(t) -> None:
    """Clear errors for trainer settings, before any worker starts."""
    import yaml

    check_known(t, yaml.safe_load(TRAINER_DEFAULTS.read_text()), "trainer.")
    check_count("trainer.nproc_per_node", t["nproc_per_node"], " (local workers)")
    check_count("trainer.max_restarts", t["max_restarts"], minimum=0)
    if t["threads_per_worker"] is not None:
        check_count("trainer.threads_per_worker", t["threads_per_worker"], " (CPU threads; null: cores / workers)")
    check_choice("trainer.precision", t["precision"], PRECISIONS)
    check_choice("trainer.resume", t["resume"], RESUME)
    check_choice("trainer.parallelism", t["parallelism"], PARALLELISMS)
    for key in ("tf32", "cudnn_benchmark"):
        if not isinstance(t[key], bool):
            raise ValueError(f"invalid trainer.{key}={t[key]!r}: must be true or false")
    try:
        torch.device(t["device"]) if t["device"] != "auto" else None
    except RuntimeError as e:
        raise ValueError(f"invalid trainer.device={t['device']!r}: use auto, cpu, cuda, ... ({e})") from None
    check_count("trainer.checkpoint.every", t["checkpoint"]["every"], " (epochs, or BERT's steps)")
    check_count("trainer.checkpoint.keep", t["checkpoint"]["keep"], " (the last checkpoint resumes the run)")
    check_choice("trainer.checkpoint.enabled", t["checkpoint"]["enabled"], (False, True))
    timeout = t["timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"invalid trainer.timeout_s={timeout!r}: must be a number of seconds > 0 (how long a "
                         "collective waits for a worker before the job fails)")


def check_data(d: dict, world_size: int) -> None:
    """Clear errors for the batch settings a pipeline's data config has, for ``world_size`` workers (Swin's
    ``global_batch`` may be null: workers x micro-batch x ``accumulation_steps``)."""
    for key in ("micro_batch", "eval_batch", "global_batch"):
        if d.get(key) is not None:
            check_count(f"data.{key}", d[key])
    if "augment" in d:
        check_choice("data.augment", d["augment"], (False, True))
    if d.get("global_batch") is None:
        return
    if "micro_batch" in d:  # BERT, Swin: accumulation fills the global batch
        accumulation_steps(d["global_batch"], d["micro_batch"], world_size)
    else:  # SQuAD: one micro-batch per worker and step
        split_batch(d["global_batch"], world_size)


def check_inputs_exist(cfg: dict) -> None:
    """The files and directories a run reads exist: a worker would fail on a missing one at every attempt,
    ``trainer.max_restarts`` times over."""
    for key, path in run_inputs(cfg).items():
        if not os.path.exists(path):
            raise ValueError(f"invalid {key}={lookup(cfg, key)!r}: {path} does not exist")


def optimizer_kwargs(ocfg) -> dict:
    """The keyword settings of ``create_optimizer`` from an optimizer config (dtype names -> torch dtypes)."""
    settings = {k: v for k, v in dict(ocfg).items() if k not in HARNESS_KEYS}
    for key, value in settings.items():
        if key.endswith("dtype") and isinstance(value, str):
            dtype = getattr(torch, value, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"invalid optimizer.{key}={value!r}: must name a torch dtype (float16, bfloat16, int8)")
            settings[key] = dtype
        elif isinstance(value, list):
            settings[key] = tuple(value)
    return settings


def build_optimizer(model: torch.nn.Module, ocfg):
    """``create_optimizer`` from an optimizer config node (see ``configs/optimizer/``).

    ``decay_all``: one group, weight decay on every parameter (the CIFAR-10 reference code) instead of
    exempting biases, norms and ``no_decay`` names. In a worker of a torchft job SLAMB's process group is the
    job's replica groups (:mod:`harness.fault_tolerance`).
    """
    decay_all = ocfg.get("decay_all", False)
    check_choice("optimizer.decay_all", decay_all, (False, True))
    params = [p for p in model.parameters() if p.requires_grad] if decay_all else model
    settings = optimizer_kwargs(ocfg)
    replica = current_replica()
    if replica is not None and issubclass(registry.optimizer_class(ocfg["name"]), SLAMB):
        settings["process_group"] = replica.group  # its collectives through torchft's manager
    return registry.create_optimizer(ocfg["name"], params, weight_decay=ocfg.get("weight_decay", 0.0),
                                     no_decay=tuple(ocfg.get("no_decay") or ()), **settings)


# Per-parameter state that DeepSpeed's OnebitLamb.load_state_dict drops, to re-derive it in the new stage
# (the LAMB coefficients' EMA, the last factor, the momentum scaling); its compression errors are zeroed too.
REDERIVED_ON_CONTINUE = {"onebit": ("lamb_coeff_freeze", "last_factor", "scaling_coeff")}


def optimizer_source(run_dir, world_size: int, env=None) -> Checkpointer:
    """The checkpoints of the run whose optimizer another continues (``init_optimizer_from``), refused where its
    last one cannot be continued: there is none, or ``world_size`` workers did not write it (the state is per
    rank)."""
    ckpt = Checkpointer(run_dir, env)
    latest = ckpt.latest()
    if latest is None:
        raise FileNotFoundError(f"init_optimizer_from={run_dir}: no checkpoint in {ckpt.dir}; point it at the run "
                                "directory of the earlier phase, or set init_optimizer_from=null (a fresh optimizer)")
    if latest["world_size"] != world_size:
        raise ValueError(f"invalid init_optimizer_from={str(run_dir)!r}: its checkpoint was written by "
                         f"{latest['world_size']} workers and this run has {world_size}; per-rank optimizer state "
                         f"cannot be redistributed: run with {latest['world_size']} workers, or "
                         "init_optimizer_from=null")
    return ckpt


def continue_optimizer(optimizer, run_dir, env) -> int:
    """Continue the optimizer of another run (phase 1's, for phase 2) from its last checkpoint, as DeepSpeed's
    ``--load_training_checkpoint``: moments and step counter carry on; this run's settings stay (each group's
    hyperparameters, optimizer-level ones such as ``freeze_step``) and so does its ledger, which counts this
    run's bytes only. Returns the step the optimizer continues from."""
    ckpt = optimizer_source(run_dir, env.world_size, env)
    latest = ckpt.latest()
    state = ckpt.load()[2][0]["optimizer"]
    fresh = optimizer.state_dict()
    for group, ours in zip(state["param_groups"], fresh["param_groups"]):
        group.update({k: v for k, v in ours.items() if k != "params"})
    key = getattr(optimizer, "state_key", None)
    if key:
        settings = inspect.signature(type(optimizer).__init__).parameters
        state[key].update({k: v for k, v in fresh[key].items() if k in settings or k == "ledger"})
        if "error_feedback" in state[key]:
            state[key]["error_feedback"] = None
        for per_param in state["state"].values():
            for name in REDERIVED_ON_CONTINUE.get(key, ()):
                per_param.pop(name, None)
    optimizer.load_state_dict(state)
    return int(state[key]["step"]) if key else int(latest["step"])


def check_optimizer(ocfg, fault_tolerance: str = "none"):
    """Every setting of an optimizer config, checked by building the optimizer on a CPU stand-in (a
    matrix and a bias: both weight-decay groups), which it returns. Construction needs no process group, so
    this runs in the launching process, before any worker starts. ``fault_tolerance``:
    ``trainer.fault_tolerance``, which takes some optimizers only."""
    optimizer = build_optimizer(torch.nn.Linear(2, 2), ocfg)
    if fault_tolerance == "torchft":
        fault_tolerance_module.check_optimizer(optimizer, ocfg["name"])
    return optimizer


def alone_notice(optimizer, name: str, world_size: int) -> str | None:
    """The one-line notice of an optimizer that communicates by its own scheme (SLAMB's sampled momentum, 1-bit
    LAMB's, DGC's, ...) run by one worker: it sends nothing, so a smoke run or a sweep at that size measures
    none of its compression; None where that is not so."""
    if world_size > 1 or optimizer.communication == GRADIENT_ALLREDUCE:
        return None
    return (f"notice: optimizer={name} on one worker sends nothing: its compression is not exercised (a sweep of "
            "its settings measures nothing); trainer.nproc_per_node=2 or more runs it")


def user_error(error: ValueError, ocfg: dict) -> str:
    """One line for a rejected setting: the check's message (the setting, its allowed values) and the fix."""
    message = " ".join(str(error).split())
    name = ocfg.get("name")
    key = re.match(r"invalid ([\w.]+?)(?:\[\d+\])?=", message)
    key = key[1].removeprefix("optimizer.") if key else None
    unknown = re.match(r"unknown setting ([\w.]+)=", message)
    option = re.match(r"unknown option ([\w/]+)=", message)
    if message.startswith("unknown optimizer"):
        fix = "pick optimizer=<one of those> (configs/optimizer/)"
    elif option:
        fix = f"pick {option[1]}=<one of those> (configs/{option[1]}/)"
    elif unknown:
        where = "configs/trainer/default.yaml" if unknown[1].startswith("trainer.") else "the pipeline's configs/"
        fix = f"drop {unknown[1]} or correct its name ({where}); +{unknown[1]}=... adds a setting the pipeline reads"
    elif message.startswith("unknown setting"):
        fix = f"drop the setting or use a valid one (configs/optimizer/{name}.yaml)"
    elif key == "trainer.parallelism" and "sharded" in message:
        fix = ("trainer.parallelism=ddp, or the optimizer and settings the message names (optimizer=slamb or "
               "optimizer=lamb)")
    elif key and key.startswith("trainer."):
        fix = f"set {key} to an allowed value (command line or configs/trainer/default.yaml)"
    elif key and key.startswith("data."):
        fix = f"set {key} to an allowed value (command line or the pipeline's configs/data/*.yaml)"
    elif key and key.startswith("model."):
        fix = f"set {key} to an allowed value (command line or the pipeline's configs/model/*.yaml)"
    elif key in (*registry.optimizer_settings(name), *HARNESS_KEYS):
        fix = f"set optimizer.{key} to an allowed value (command line or configs/optimizer/{name}.yaml)"
    else:
        fix = "correct the override or the experiment's config"
    return f"error: {message}; fix: {fix}"


def check_settings(cfg: dict, *, shards: bool = False, check=None, added=(), optional=(),
                   fault_tolerant: bool = False) -> None:
    """Every check made before any worker starts (``ValueError``, or ``OSError`` for an input that cannot be
    read: one line naming the setting), then the one-line notices on stderr of a ``trainer.device=auto`` that
    falls back to the CPU and of a compressing optimizer on one worker (:func:`alone_notice`; rank 0 only,
    where torchrun or SLURM run this in every worker). ``shards``: the
    pipeline takes ``trainer.parallelism=fsdp|hsdp``; ``check(cfg)``: the pipeline's own checks (its model,
    schedule, data), last; ``added``, ``optional``: :func:`check_added`; ``fault_tolerant``: the pipeline takes
    ``trainer.fault_tolerance=torchft`` (:mod:`harness.fault_tolerance`)."""
    t = cfg["trainer"]
    check_trainer(t)
    check_added(cfg, added, optional)
    fault_tolerance_module.check(cfg, fault_tolerant)
    optimizer = check_optimizer(cfg["optimizer"], t["fault_tolerance"])
    if "seed" in cfg:
        check_count("seed", cfg["seed"], " (the initial weights, the data order)", minimum=0)
    on_cpu = check_device(t["device"], local_workers(t["nproc_per_node"]))
    world_size = planned_world(t)
    alone = alone_notice(optimizer, cfg["optimizer"]["name"], world_size)
    check_data(cfg.get("data") or {}, world_size)
    check_parallelism(cfg, world_size, shards, build_optimizer)
    check_inputs_exist(cfg)
    check_schedule(cfg)  # the run's length before its schedule
    if check is not None:
        check(cfg)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        for notice in (cpu_fallback_notice() if on_cpu else None, alone):
            if notice:
                print(notice, file=sys.stderr, flush=True)


def planned_world(t: dict) -> int:
    """The ranks a job will have: its torchft replica groups' workers, or its workers (:func:`planned_world_size`)."""
    if t["fault_tolerance"] == "torchft":
        return t["replica_groups"] * t["nproc_per_node"]
    return planned_world_size(t["nproc_per_node"])


def remove_empty(run_dir) -> None:
    """Remove the run directory Hydra made for a command refused before it wrote anything there, and the empty
    folders above it inside the working directory: a refused command leaves no empty folders."""
    here, folder = Path.cwd().resolve(), Path(run_dir).resolve()
    while folder != here:
        try:
            folder.rmdir()  # only an empty folder: another job's files, or a lock, keep it
        except OSError:
            return
        folder = folder.parent
        if here not in folder.parents:
            return


def run_from_hydra(worker, cfg, *, shards: bool = False, check=None, optional=(), fault_tolerant: bool = False,
                   inputs=None):
    """The body of every pipeline's ``@hydra.main``: check, resolve, start the workers, return rank 0's result.

    ``worker``: the pipeline's ``train`` by name (``"cifar10.train:train"``), so that workers started by
    spawn or submitit import it instead of unpickling a function of ``__main__``. ``shards``: it takes
    ``trainer.parallelism=fsdp|hsdp`` (:func:`harness.parallel.distribute`); the others refuse them.
    ``check``, ``optional``: the pipeline's own checks and the settings its config leaves out
    (:func:`check_settings`); ``fault_tolerant``: it takes ``trainer.fault_tolerance=torchft``, whose job this
    launches (:func:`harness.fault_tolerance.launch`). Every pipeline splits its steps into micro-batches of its own
    (:class:`harness.ShardedBatches`, BERT's :class:`bert.data.StepStream`), so that a run may resume on another
    number of workers (:func:`harness.checkpoint.check_world_size`), where its optimizer allows it.

    The job's run directory is Hydra's output directory, locked while the job writes it; its console goes to
    ``train.log`` there too, and it ends with the run's one summary line (:func:`harness.loop.summary_line`). With
    ``trainer.resume=never`` an existing checkpoint there is discarded first; a run that already
    finished with this configuration returns its summary without training. A setting the checks
    reject ends the command here, before any worker starts: one line on stderr and exit status 2
    (a usage error, as argparse). A worker error that a restart would meet again (a missing data file,
    a damaged input: :data:`harness.distributed.WILL_RECUR`) ends it at the first attempt, whatever
    ``trainer.max_restarts``: one line and exit status 65; any other, after the restarts, one line and exit
    status 1 (the worker's traceback in the run directory). A run directory another job writes is refused in
    one line and exit status 2: Hydra writes nothing there (``configs/hydra/default.yaml``), nor does the
    command before it holds the lock.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from omegaconf.errors import MissingMandatoryValue

    from .checkpoint import prepare_run
    from .distributed import prestart, started_externally
    from .lock import RunLock, RunLocked
    from .loop import summary_line
    from .recipe import against_recipe
    from .run import ConsoleLog, process_seconds

    _hydra_reports()  # composed: what the job raises, Hydra reports as it would (see command)
    # under torchrun or SLURM every worker runs the checks: the first says what they refuse, once
    writer = not started_externally() or os.environ.get("RANK") == "0"

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:  # a required setting (``???`` in the config) left unset
        if writer:
            print(f"error: {e.full_key} is required and not set; fix: set {e.full_key}=... on the command line (or "
                  "pick an experiment that sets it)", file=sys.stderr, flush=True)
            remove_empty(run_dir)
        sys.exit(2)

    def refuse(error: ValueError):
        if writer:
            print(user_error(error, container["optimizer"]), file=sys.stderr, flush=True)
            remove_empty(run_dir)
        sys.exit(2)

    try:
        local = not started_externally()
        nproc = container["trainer"]["nproc_per_node"]
        # train.log is named once the checks pass and the run directory is this job's; the workers' fork server
        # starts at once, its imports beside the checks (the console's pipe first: the workers write to the server's)
        with ConsoleLog(hold=writer) as console:
            torchft = container["trainer"].get("fault_tolerance") == "torchft"
            if torchft:
                fault_tolerance_module.quiet()
            prestart(worker, container["trainer"].get("replica_groups") if torchft else nproc,
                     *(fault_tolerance_module.PRELOAD if torchft else ()))
            try:
                check_settings(container, shards=shards, check=check, optional=optional,
                               added=added_settings(HydraConfig.get().overrides.task), fault_tolerant=fault_tolerant)
            except (ValueError, OSError) as e:
                refuse(e)
            with RunLock(run_dir, hold=writer):
                console.attach(Path(run_dir) / "train.log")
                try:
                    # what the run reads, by content, and how it departs from its recipe: the run directory's once
                    # it is this job's (a second writer is refused for the lock, not for its data)
                    ran_on = identity.run_identity(inputs(container) if inputs else {},
                                                   against_recipe(container)) if writer else None
                    fault_tolerance_module.check_run_dir(container, run_dir)
                    why_fixed = fixed_world(build_optimizer(torch.nn.Linear(2, 2), container["optimizer"]), None)
                    finished = prepare_run(container, run_dir, clear=local, why_fixed=why_fixed,
                                           world_size=planned_world(container["trainer"]), identity=ran_on)
                # the data; the schedule; the checkpoint's inputs, settings, world size, directory
                except (ValueError, OSError) as e:
                    refuse(e)
                if finished is not None:
                    print(summary_line(finished, process_seconds()), flush=True)
                    return finished
                if ran_on is not None:
                    identity.save(run_dir, ran_on)
                try:
                    if container["trainer"]["fault_tolerance"] == "torchft":
                        summary = fault_tolerance_module.launch(worker, container, run_dir)
                    else:
                        summary = launch(worker, container, run_dir, nproc_per_node=nproc,
                                         max_restarts=container["trainer"]["max_restarts"])
                except WorkerError as e:  # its one line; elastic's report of the failure would add a hundred
                    print(e, file=sys.stderr, flush=True)
                    sys.exit(e.status)
                if writer and isinstance(summary, dict) and "run_dir" in summary:
                    print(summary_line(summary, process_seconds()), flush=True)
                return summary
    except RunLocked as e:  # before Hydra or this command wrote anything into the run directory
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


# the user's HYDRA_FULL_ERROR, while :func:`command` has Hydra raise the errors of its composition
_hydra_full_error: str | None = None


def command(main) -> None:
    """Run a pipeline's ``@hydra.main`` function ``main`` as its command (its ``__main__``). A command line Hydra
    cannot compose ends as a setting the checks refuse does (:func:`run_from_hydra`), in one line naming it and the
    fix, exit status 2, before anything starts: a key the config lacks, set without ``+``, an option no config
    group has (``experiment=``, ``optimizer=``, ...), an override that does not parse. Hydra's own report of them
    takes 6 lines or more, exit status 1.

    Hydra reports an error itself unless ``HYDRA_FULL_ERROR`` is set, then raises it: set here for the composition,
    the user's value back once the job runs (:func:`_hydra_reports`), so that Hydra reports what the job raises
    as it would."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    global _hydra_full_error
    _hydra_full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (ConfigCompositionException, OverrideParseException) as e:
        print(composition_error(e), file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        _hydra_reports()


def _hydra_reports() -> None:
    """``HYDRA_FULL_ERROR`` as the user set it (Hydra reports an error in its own way, or raises it)."""
    if _hydra_full_error is None:
        os.environ.pop("HYDRA_FULL_ERROR", None)
    else:
        os.environ["HYDRA_FULL_ERROR"] = _hydra_full_error


def composition_error(error) -> str:
    """The one line of a command line Hydra could not compose (:func:`command`)."""
    from hydra.errors import MissingConfigException, OverrideParseException

    cause = error.__cause__
    if isinstance(error, MissingConfigException) and error.missing_cfg_file:
        group, _, name = error.missing_cfg_file.partition("/")
        folder = CONFIGS / group
        known = error.options or sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml"))
        near = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {group}={near[0]}?)" if near else ""
        return user_error(ValueError(f"unknown option {group}={name!r}{hint}; known: {known}"), {})
    if cause is not None and getattr(cause, "full_key", None) and getattr(cause, "parent_node", None) is not None:
        added = re.search(r"use \+(\S+?)=(.*)$", str(error), re.M)  # Hydra's hint holds the override's value
        value = added[2] if added else None
        return user_error(unknown_setting(cause.full_key, value, list(cause.parent_node.keys())), {})
    message = " ".join(str(error).split())
    if isinstance(error, OverrideParseException):
        return f"error: an override cannot be read: {message}; fix: correct it (Hydra's override grammar)"
    return f"error: {message}; fix: correct the override or the experiment's config"
