"""Every Hydra config of every pipeline composes and builds its optimizer; the paper rows hold the
reference settings; one spelling of batch sizes and checkpoint cadence; the documented commands compose."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cifar10.model import build_model
from harness import build_optimizer, check_trainer
from harness.schedules import build_lr_scheduler
from harness.settings import INPUT_KEYS, NOT_COMPUTED, OPERATIONAL_KEYS, covers
from slamb import registry
from slamb.schedules import CIFAR10_COMPRESSION_WARMUP, compression_ratio

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# experiment folder -> the pipeline's root config (configs/<root>.yaml) and module
PIPELINES = {"cifar10": ("cifar10", "cifar10"), "swin_b": ("swin", "swin"), "bert": ("bert", "bert"),
             "squad": ("squad", "squad_finetune")}
# experiment folders holding rows of several pipelines (make study): the row name's prefix picks the pipeline
MIXED = {"study": {"digits": "cifar10", "bert": "bert"}}
EXPERIMENTS = sorted(f"{p.parent.name}/{p.stem}" for p in (CONFIGS / "experiment").glob("*/*.yaml"))
ROOTS = sorted(root for root, _ in PIPELINES.values())
OPTIMIZERS = sorted(p.stem for p in (CONFIGS / "optimizer").glob("*.yaml"))
SWEEPS = sorted(p.stem for p in (CONFIGS / "sweep").glob("*.yaml"))
# a small model of each pipeline for building optimizers (the optimizer config is what is checked)
SMALL_MODEL = {"swin": ["model=swin_tiny_test"], "bert": ["model=bert_tiny"], "squad": []}
BATCH_KEYS = {"micro_batch", "global_batch", "eval_batch"}


def compose_root(root: str, *overrides, hydra_cfg=False):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(root, overrides=list(overrides), return_hydra_config=hydra_cfg)
    return cfg if hydra_cfg else OmegaConf.to_container(cfg, resolve=True)


def compose_cfg(*overrides, hydra_cfg=False):
    """The CIFAR-10 pipeline's config (configs/cifar10.yaml) with ``overrides``."""
    return compose_root("cifar10", *overrides, hydra_cfg=hydra_cfg)


def small_model(root: str, cfg: dict) -> torch.nn.Module:
    if root == "cifar10":
        return build_model(cfg["model"])
    if root == "swin":
        from swin.model import build_model as build_swin

        return build_swin(cfg["model"])
    from bert.model import build_model as build_bert

    return build_bert(compose_root("bert", "model=bert_tiny")["model"] if root == "squad" else cfg["model"])


def experiment_root(experiment: str) -> str:
    folder, row = experiment.split("/")
    return MIXED[folder][row.split("_")[0]] if folder in MIXED else PIPELINES[folder][0]


def check_weight_decay(model: torch.nn.Module, opt, ocfg: dict) -> None:
    """decay_all: one group decaying every parameter; otherwise biases, norms and no_decay names at 0."""
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == ocfg["weight_decay"] for p in g["params"]}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if ocfg.get("decay_all"):
        assert len(opt.param_groups) == 1 and decayed == {id(p) for _, p in params}
    elif ocfg["weight_decay"]:
        for name, p in params:
            exempt = p.dim() <= 1 or any(key in name for key in ocfg.get("no_decay") or ())
            assert (id(p) in decayed) != exempt, name


# ----------------------------------------------------------------------------- layout and spelling


def test_experiment_folders_are_the_pipelines():
    assert sorted(p.name for p in (CONFIGS / "experiment").iterdir()) == sorted([*PIPELINES, *MIXED])
    assert not list((CONFIGS / "experiment").glob("*.yaml"))  # rows live in their pipeline's folder
    for root in ROOTS:
        own = yaml.safe_load((CONFIGS / f"{root}.yaml").read_text())
        assert "hydra" not in own and "logger" not in own  # the shared hydra/ and logger/ groups
        assert {"hydra": "default", "logger": "default"}.items() <= {
            k: v for d in own["defaults"] if isinstance(d, dict) for k, v in d.items()}.items()


def test_one_spelling_for_batch_sizes_and_checkpoint_cadence():
    for path in (CONFIGS / "data").glob("*.yaml"):
        keys = {k for k in yaml.safe_load(path.read_text()) if "batch" in k}
        assert keys and keys <= BATCH_KEYS, path.name
    for root in ROOTS:
        cfg = compose_root(root)
        assert set(cfg["trainer"]["checkpoint"]) == {"enabled", "every", "keep"}
        assert cfg["data"].keys() & BATCH_KEYS
    assert compose_root("bert")["trainer"]["checkpoint"]["every"] == 100  # steps


# ------------------------------------------------------------------------ every config composes and builds


@pytest.mark.parametrize("root, experiment", [(r, None) for r in ROOTS] + [(experiment_root(e), e) for e in EXPERIMENTS])
def test_every_config_composes_and_builds_its_optimizer(root, experiment):
    overrides = [f"experiment={experiment}"] if experiment else []
    hcfg = compose_root(root, *overrides, hydra_cfg=True)
    cfg = compose_root(root, *overrides, *SMALL_MODEL.get(root, []))
    check_trainer(cfg["trainer"])
    assert hcfg.hydra.run.dir == f"runs/{hcfg.name}/"  # experiment stays out of the run directory's name
    model = small_model(root, cfg)
    opt = build_optimizer(model, cfg["optimizer"])
    assert type(opt) is registry.optimizer_class(cfg["optimizer"]["name"])
    assert opt.param_groups[0]["lr"] == cfg["optimizer"]["lr"]
    check_weight_decay(model, opt, cfg["optimizer"])
    steps_per_epoch, total = (1, cfg["steps"]) if root == "bert" else (10, 10 * cfg["epochs"])
    sched = build_lr_scheduler(opt, cfg["schedule"], steps_per_epoch, total)
    assert all(0 <= m(s) <= 1 for m in sched.lr_lambdas for s in (0, total // 2, total - 1))
    if experiment and experiment != "squad/tiny":
        assert cfg["paper"]["row"] and cfg["paper"]["table"]


GROUP_ROOT = {"resnet": "cifar10", "cifar10": "cifar10", "digits": "cifar10", "swin": "swin", "imagenet": "swin",
              "bert": "bert", "squad": "squad"}
GROUP_FILES = sorted(f"{p.parent.name}={p.stem}" for group in ("model", "data") for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.parametrize("choice", GROUP_FILES)
def test_every_model_and_data_config_composes_in_its_pipeline(choice):
    group, name = choice.split("=")
    root = next(r for prefix, r in GROUP_ROOT.items() if name.startswith(prefix))
    assert compose_root(root, choice)[group] == yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text())


@pytest.mark.e2e
def test_every_row_has_its_own_run_directory():
    names = {}
    for e in EXPERIMENTS:
        root = experiment_root(e)
        names.setdefault(compose_root(root, f"experiment={e}")["name"], []).append(e)
    assert not {n: es for n, es in names.items() if len(es) > 1}
    assert {"cifar10_resnet110_slamb", "demo_digits_slamb", "swin_b_slamb", "bert_phase2_slamb",
            "bert_phase1_onebit_lamb_ee", "squad_slamb"} <= set(names)


def test_run_directory_name_leaves_out_exactly_the_settings_that_do_not_change_what_is_computed():
    """Hydra's exclude_keys are resolved from harness.settings.NOT_COMPUTED, subtrees included; every
    other override names the run."""
    left_out = ["experiment=cifar10/slamb", "logger.project=x", "trainer.checkpoint.every=2", "trainer.device=cpu",
                "data.dir=/data/a", "+data.workers=0", "paper.row=x", "+study.grid=y"]
    kept = ["optimizer.lr=0.1", "seed=3", "trainer.precision=bf16"]
    hcfg = compose_root("cifar10", *left_out, *kept, hydra_cfg=True)
    assert hcfg.hydra.job.override_dirname == ",".join(sorted(kept))
    assert all(covers(NOT_COMPUTED, line.split("=")[0].lstrip("+")) for line in left_out)
    assert not any(covers(NOT_COMPUTED, line.split("=")[0]) for line in kept)
    assert set(OPERATIONAL_KEYS) | set(INPUT_KEYS) == set(NOT_COMPUTED)


# ------------------------------------------------------------------------------------ optimizers


def test_every_registry_optimizer_has_a_config():
    assert set(OPTIMIZERS) == set(registry.OPTIMIZERS)


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if registry.OPTIMIZERS[n][0].startswith("slamb.")])
def test_library_optimizer_configs_hold_every_setting(name):
    """Every constructor setting of the package's optimizers can be overridden (optimizer.<setting>=...)."""
    keys = set(yaml.safe_load((CONFIGS / "optimizer" / f"{name}.yaml").read_text())) - {"name"}
    assert keys == set(registry.optimizer_settings(name)) - {"process_group", "ledger"}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_config_builds_with_its_settings(name):
    cfg = compose_cfg(f"optimizer={name}", "model=resnet8", "optimizer.decay_all=false")
    opt = build_optimizer(build_model(cfg["model"]), cfg["optimizer"])
    assert type(opt) is registry.optimizer_class(name)
    assert opt.param_groups[0]["lr"] == cfg["optimizer"]["lr"]
    assert opt.param_groups[0]["weight_decay"] == cfg["optimizer"]["weight_decay"]
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups[1:])  # biases and BN weights
    assert hasattr(opt, "ledger") and "total" in opt.comm_stats()


@pytest.mark.parametrize("override, attr, value", [
    ("optimizer.mask=bernoulli", "mask_policy", "bernoulli"),
    ("optimizer.comm_dtype=float16", "comm_dtype", torch.float16),
    ("optimizer.overlap=true", "overlap", True),
    ("optimizer.foreach=false", "foreach", False),
    ("optimizer.nonfinite=skip", "nonfinite", "skip"),
    ("optimizer.comm_dtype=int8", "comm_dtype", torch.int8),
    ("optimizer.hierarchy=node", "hierarchy", "node"),
])
def test_slamb_settings_can_be_overridden(override, attr, value):
    cfg = compose_cfg("experiment=cifar10/slamb", "model=resnet8", override)
    opt = build_optimizer(build_model(cfg["model"]), cfg["optimizer"])
    assert getattr(opt, attr) == value and opt.variant == "v1"


# ------------------------------------------------------------------------------- docs/recipes.md

# settings docs/recipes.md states as the recipes' (pipeline, experiment, setting, the value as written there)
RECIPE_CLAIMS = [("cifar10", "cifar10/sgd", "optimizer.decay_all", "true"),
                 ("swin", "swin_b/slamb", "trainer.precision", "fp16"),
                 ("bert", "bert/phase1_lamb", "data.pattern", '"*training*.hdf5"'),
                 ("bert", "bert/phase1_onebit_lamb", "clip_grad", "1.0")]


@pytest.mark.parametrize("root, experiment, key, text", RECIPE_CLAIMS)
def test_recipes_page_states_the_configs_settings(root, experiment, key, text):
    page = (ROOT / "docs" / "recipes.md").read_text()
    assert f"`{key}: {text}`" in page and "`configs` branch" not in page
    value = compose_root(root, f"experiment={experiment}")
    for part in key.split("."):
        value = value[part]
    assert value == yaml.safe_load(text)


# ------------------------------------------------------------------------------- the CIFAR-10 rows


def test_cifar10_rows_hold_the_reference_settings():
    rows = {r: compose_cfg(f"experiment=cifar10/{r}") for r in ("sgd", "lamb", "slamb")}
    for cfg in rows.values():
        assert sum(p.numel() for p in build_model(cfg["model"]).parameters()) == 1_727_962  # 1.7M
        assert (cfg["model"]["depth"], cfg["trainer"]["nproc_per_node"], cfg["data"]["micro_batch"],
                cfg["epochs"]) == (110, 4, 256, 200)
        assert cfg["schedule"] == {"name": "multistep", "milestones": [100, 150], "gamma": 0.1}
        assert (cfg["optimizer"]["weight_decay"], cfg["optimizer"]["decay_all"]) == (1e-4, True)
    assert (rows["sgd"]["optimizer"]["lr"], rows["sgd"]["optimizer"]["momentum"]) == (0.03, 0.9)
    assert rows["lamb"]["optimizer"]["lr"] == 0.01
    s = rows["slamb"]["optimizer"]
    assert (s["lr"], s["variant"], s["compress_ratio"], s["beta3"], s["sync_interval"]) == (0.01, "v1", 0.1, 0.99, 50)
    opt = build_optimizer(build_model(rows["slamb"]["model"]), s)
    assert (opt.variant, opt.mask_policy, opt.sync_interval, opt.min_compress_numel) == ("v1", "cyclic", 50, 9000)
    ks = []
    for epoch in range(20):
        opt.begin_epoch(epoch)
        ks.append(opt.compress_ratio)
    assert ks == [0.5, 0.5, 0.2] + [0.1] * 17
    assert [compression_ratio(e, 0.002, "cifar10") for e in (0, 9, 12, 14, 16, 40)] == [0.5, 0.01, 0.006, 0.003,
                                                                                      0.002, 0.002]
    assert len(CIFAR10_COMPRESSION_WARMUP) == 17


@pytest.mark.parametrize("row", ["sgd", "lamb", "slamb", "demo_slamb"])
@pytest.mark.e2e
def test_cifar10_rows_decay_every_parameter(row):
    """As the reference code (every optimizer over model.parameters(), wd 1e-4): with zero gradients one
    step shrinks every parameter, biases and BatchNorm weights included; without decay_all those stay."""
    moved = {}
    for decay_all in (True, False):
        cfg = compose_cfg(f"experiment=cifar10/{row}", "model=resnet8", f"optimizer.decay_all={decay_all}")
        model = build_model(cfg["model"])
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0)
                p.grad = torch.zeros_like(p)
        build_optimizer(model, cfg["optimizer"]).step()
        moved[decay_all] = {n: bool((p < 1).all()) for n, p in model.named_parameters()}
    assert all(moved[True].values())
    one_dim = {n for n, p in build_model(cfg["model"]).named_parameters() if p.dim() == 1}
    assert one_dim and not any(moved[False][n] for n in one_dim)  # biases and BN weights: not decayed


# ------------------------------------------------------------------------------------ sweeps, names


@pytest.mark.parametrize("sweep", SWEEPS)
@pytest.mark.parametrize("experiment", ["cifar10/slamb", "swin_b/slamb", "bert/phase1_slamb"])
def test_sweeps_compose_over_slamb_settings(sweep, experiment):
    cfg = compose_root(experiment_root(experiment), f"experiment={experiment}", f"sweep={sweep}", hydra_cfg=True)
    params = cfg.hydra.sweeper.params
    assert params and cfg.study == sweep
    for key, values in params.items():
        assert key.startswith("optimizer.") and key.split(".")[1] in registry.optimizer_settings("slamb")
        assert len(values.split(",")) >= 3


@pytest.mark.multiprocess
def test_run_directory_is_named_by_the_overrides():
    """Deterministic (no timestamp): rerunning a command finds its checkpoint, torchrun ranks agree."""
    cfg = compose_cfg("experiment=cifar10/slamb", hydra_cfg=True)
    assert cfg.hydra.run.dir == "runs/cifar10_resnet110_slamb/"
    cfg = compose_cfg("experiment=cifar10/slamb", "seed=3", "optimizer.beta3=0.9", "trainer.progress=false",
                      "data.dir=/x", "logger=wandb", hydra_cfg=True)
    assert cfg.hydra.run.dir == "runs/cifar10_resnet110_slamb/optimizer.beta3=0.9,seed=3"
    assert cfg.logger.wandb is True


def documented_commands() -> list[tuple[str, list[str]]]:
    """(root, overrides) of every ``-m <pipeline>.train`` command in the README, the docs and the train.py
    docstrings."""
    modules = {module: root for root, module in PIPELINES.values()}
    texts = ([(ROOT / "README.md").read_text()] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
             + [(ROOT / m / "train.py").read_text().split('"""')[1] for m in modules])
    commands = []
    for text in texts:
        for line in re.sub(r"\\\n\s*", " ", text).splitlines():
            m = re.search(r"-m (\w+)\.train\b(.*)", line)
            if m and m.group(1) in modules:
                args = shlex.split(m.group(2).split("#")[0].replace("`", ""))
                commands.append((modules[m.group(1)], [a for a in args if "=" in a and not a.startswith("-")]))
    return commands


def first_job(override: str) -> str:
    """A --multirun comma list's first value (a list in brackets is one value)."""
    key, value = override.split("=", 1)
    return f"{key}={value if value.startswith('[') else value.split(',')[0]}"


def test_documented_commands_compose():
    commands = documented_commands()
    assert len({r for r, _ in commands}) == 4 and len(commands) >= 15
    for root, overrides in commands:
        compose_root(root, *map(first_job, overrides))


# ------------------------------------------------------------------------------- settings errors


@pytest.mark.parametrize("override, match", [
    ("+optimizer.betaz=0.5", r"unknown setting\(s\) \['betaz'\] for optimizer 'slamb'; valid: .*beta3"),
    ("optimizer.beta3=1.5", r"invalid beta3=1.5: must be a number in \[0.0, 1.0\)"),
    ("optimizer.comm_dtype=float17", r"invalid optimizer.comm_dtype='float17'"),
    ("optimizer.compression_warmup=bert", r"invalid compression_warmup='bert'"),
    ("optimizer.mask=random", r"invalid mask='random'"),
    ("optimizer.decay_all=maybe", r"invalid optimizer.decay_all='maybe'"),
    ("model.depth=10", r"invalid model.depth=10: must be 6n\+2"),
])
def test_invalid_settings_name_the_setting(override, match):
    cfg = compose_cfg("experiment=cifar10/slamb", override)
    with pytest.raises(ValueError, match=match):
        build_optimizer(build_model(cfg["model"]), cfg["optimizer"])


def test_compression_warmup_needs_a_compressing_optimizer():
    cfg = compose_cfg("experiment=cifar10/sgd", "+optimizer.compression_warmup=cifar10", "model=resnet8")
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['compression_warmup'\] for optimizer 'sgd'"):
        build_optimizer(build_model(cfg["model"]), cfg["optimizer"])


@pytest.mark.parametrize("override, match", [
    ("trainer.precision=fp8", r"invalid trainer.precision='fp8': must be one of \['fp32', 'bf16', 'fp16'\]"),
    ("trainer.nproc_per_node=0", r"invalid trainer.nproc_per_node=0: must be an integer >= 1"),
    ("trainer.resume=maybe", r"invalid trainer.resume='maybe'"),
    ("trainer.device=gpu0", r"invalid trainer.device='gpu0'"),
    ("trainer.checkpoint.every=0", r"invalid trainer.checkpoint.every=0: must be an integer >= 1"),
    ("trainer.tf32=maybe", r"invalid trainer.tf32='maybe': must be true or false"),
    ("trainer.cudnn_benchmark=1", r"invalid trainer.cudnn_benchmark=1: must be true or false"),
])
def test_invalid_trainer_settings(override, match):
    with pytest.raises(ValueError, match=match):
        check_trainer(compose_cfg(override)["trainer"])


@pytest.mark.parametrize("root", ROOTS)
def test_cuda_math_defaults_are_nvidias(root):
    """TF32 everywhere; cuDNN's autotuner where the input shapes are fixed (the vision pipelines)."""
    t = compose_root(root)["trainer"]
    assert t["tf32"] is True and t["cudnn_benchmark"] is (root in ("cifar10", "swin"))
    check_trainer(t)


@pytest.mark.parametrize("row", ["bert_lamb", "bert_onebit_lamb", "bert_slamb"])
def test_the_study_bert_rows_do_not_clip_as_their_page_ran(row):
    # the paper rows' LAMB and 1-bit LAMB clip at 1.0; the study (results/study/) compares the optimizers alone,
    # and its committed page ran every row unclipped
    assert compose_root("bert", f"experiment=study/{row}")["clip_grad"] is None


# --------------------------------------------------- each pipeline's own settings, before any worker starts


def write_bert_shards(folder: Path, n: int = 16, seq_len: int = 32, top_id: int = 87) -> Path:
    """Two shards of BERT pre-training examples whose token ids reach ``top_id``."""
    import numpy as np

    from bert.prepare_data import write_shard

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, top_id + 1, (n, seq_len))
    ids[0, 1] = top_id
    arrays = {"input_ids": ids, "input_mask": np.ones((n, seq_len)), "segment_ids": np.zeros((n, seq_len)),
              "masked_lm_positions": np.tile(np.arange(1, 6), (n, 1)), "masked_lm_ids": ids[:, 1:6],
              "next_sentence_labels": rng.integers(0, 2, n)}
    for i in range(2):
        write_shard(folder / f"part{i}_training.hdf5", arrays)
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    from swin.tiny import write_tiny_imagenet

    root = tmp_path_factory.mktemp("inputs")
    (root / "squad.json").write_text("{}")
    return {"cifar10": ["experiment=cifar10/lamb", f"data.dir={root}"],
            "bert": ["model=bert_tiny", "model.vocab_size=88", f"data.dir={write_bert_shards(root / 'shards')}",
                     "data.seq_len=32", "data.global_batch=64", "data.micro_batch=8", "steps=100",
                     "schedule.warmup_steps=10"],
            "swin": ["model=swin_tiny_test", f"data.dir={write_tiny_imagenet(root / 'imagenet')}", "data.micro_batch=4",
                     "epochs=3", "schedule.warmup_epochs=1"],
            "squad": [f"model.dir={root}", f"data.train_file={root / 'squad.json'}",
                      f"data.dev_file={root / 'squad.json'}"]}


def pipeline_checks(root: str, inputs: dict, *overrides: str) -> None:
    """What ``python -m <root's pipeline> overrides`` checks before any worker starts."""
    import importlib

    from harness.build import added_settings, check_settings

    module = importlib.import_module({"squad": "squad_finetune", "cifar10": "cifar10"}.get(root, root) + ".train")
    cfg = compose_root(root, *inputs[root], "trainer.device=cpu", "trainer.nproc_per_node=2", *overrides)
    check_settings(cfg, shards=root in ("bert", "swin"), check=module.check, added=added_settings(overrides),
                   optional=getattr(module, "OPTIONAL", ()))


@pytest.mark.parametrize("root", ROOTS)
def test_each_pipelines_inputs_pass_its_own_checks(inputs, root):
    pipeline_checks(root, inputs)
    if root == "bert":
        # a setting BERT reads though its config leaves it out (the run it names is checked: none here)
        pipeline_checks(root, inputs, "+init_optimizer_from=null", "+schedule.warmup_fraction=0.1")


@pytest.mark.parametrize("root, override, line", [
    # before, each of these failed or was ignored in the workers: after they started, with exit status 65 or
    # a traceback (the "before" of each is the message the workers gave, or nothing where it was accepted)
    ("cifar10", "trainer.threads_per_worker=0", "invalid trainer.threads_per_worker=0: must be an integer >= 1"),
    ("cifar10", "seed=abc", "invalid seed='abc': must be an integer >= 0 (the initial weights, the data order); "
                            "fix: correct the override"),
    ("cifar10", "model.depth=10", "invalid model.depth=10: must be 6n+2"),
    ("cifar10", "schedule.gamma=0", "invalid schedule.gamma=0: must be a number in (0.0, inf)"),
    ("cifar10", "schedule.milestones=[150,100]", "invalid schedule.milestones=[150, 100]: must be increasing"),
    ("cifar10", "trainer.parallelism=hsdp", "invalid trainer.parallelism=hsdp: this pipeline trains full replicas "
                                            "only"),  # before: first a shard size, then this
    ("cifar10", "+foo=1", "unknown setting foo=1; known: ['data', 'epochs', 'logger', 'model', 'name', "),
    ("cifar10", "+data.augmnt=false", "unknown setting data.augmnt=False (did you mean data.augment?); known: "
                                      "['augment', 'dir', 'eval_batch', 'micro_batch', 'name', 'valid_images', "
                                      "'valid_seed']; fix: drop data.augmnt or correct its name (the pipeline's "
                                      "configs/)"),
    ("cifar10", "+schedule.warmup_fractoin=0.1", "unknown setting schedule.warmup_fractoin=0.1 (did you mean "
                                                 "schedule.warmup_fraction?)"),
    ("bert", "model.num_attention_heads=3", "invalid model.num_attention_heads=3: hidden_size=32 is not a multiple"),
    ("bert", "model.num_hidden_layers=0", "invalid model.num_hidden_layers=0: must be an integer >= 1"),
    ("bert", "model.vocab_size=50", "invalid model.vocab_size=50: {shards}/part0_training.hdf5 holds token id 87; "
                                    "set model.vocab_size=88 or more"),  # before: 71-198 lines from the embedding
    ("bert", "data.seq_len=64", "{shards}/part0_training.hdf5 holds sequences of length 32, the run expects "
                                "data.seq_len=64"),
    ("bert", "loss_scale.growth_factor=0.5", "invalid loss_scale.growth_factor=0.5: must be a number in (1.0, inf)"),
    ("bert", "clip_grad=-1", "invalid clip_grad=-1: must be a number in (0.0, inf)"),
    ("bert", "steps=10", "invalid schedule.warmup_steps=10: the warm-up must end before the run's steps=10 do; set "
                         "schedule.warmup_steps to at most 9"),
    ("bert", "validation.dir=/", "no pre-training shards '*.hdf5' in '/' (validation.dir, "
                                 "validation.pattern)"),  # before: blamed data.pattern
    ("bert", "validation.dir=/nonexistent", "invalid validation.dir='/nonexistent': /nonexistent does not exist"),
    ("bert", "+init_optimizer_fro=/tmp", "unknown setting init_optimizer_fro='/tmp' (did you mean "
                                         "init_optimizer_from?)"),
    ("swin", "model.arch=swin_nonexistent", "invalid model.arch='swin_nonexistent': must name a timm Swin model"),
    ("swin", "model.depths=[1,1,1]", "invalid model.depths=[1, 1, 1] with model.num_heads=[1, 2]"),
    ("swin", "lr_scaling.reference_batch=0", "invalid lr_scaling.reference_batch=0: must be an integer >= 1"),
    ("swin", "accumulation_steps=0", "invalid accumulation_steps=0: must be an integer >= 1"),
    ("swin", "model.num_classes=5", "data.dir={imagenet} has 4 classes but model.num_classes=5"),
    ("swin", "data.micro_batch=3", "data.micro_batch=3 must be even with mixup/cutmix"),
    ("squad", "eval.n_best=0", "invalid eval.n_best=0: must be an integer >= 1"),  # before: after the first epoch
    ("squad", "eval.max_answer_length=0", "invalid eval.max_answer_length=0: must be an integer >= 1"),
    ("squad", "data.doc_stride=500", "invalid data.doc_stride=500: tokens between window starts, from 1 to "
                                     "data.max_length - 4 = 380"),  # before: accepted, the windows just abutted
    ("squad", "trainer.precision=fp16", "invalid trainer.precision='fp16': must be one of ['fp32', 'bf16']"),
    ("squad", "schedule.warmup_fraction=1.5", "invalid schedule.warmup_fraction=1.5: must be a share of the steps in "
                                              "[0, 1)"),
])
def test_a_pipelines_bad_setting_is_refused_in_one_line_before_any_worker(inputs, root, override, line):
    from harness.build import user_error

    with pytest.raises((ValueError, OSError)) as refused:
        pipeline_checks(root, inputs, override)
    got = user_error(refused.value, {"name": "lamb"})
    data_dir = next((a.split("=", 1)[1] for a in inputs[root] if a.startswith("data.dir=")), None)
    line = line.format(shards=data_dir, imagenet=data_dir)
    assert got.startswith(f"error: {line}") and "\n" not in got, got


# ------------------------------------------------------------------------------- the paper's target numbers

def test_the_reproduce_page_gives_every_rows_target_and_its_source():
    """docs/reproduce.md's table names every row of the four experiments with the number its config records
    (paper.top1, paper.f1) and that number's source; a row without one says so rather than a made-up figure."""
    page = (ROOT / "docs" / "reproduce.md").read_text().split("## The paper's target numbers", 1)[1]
    rows = {}
    for line in page.split("\n## ", 1)[0].splitlines():
        m = re.match(r"\|[^|]+\|[^|]*\(`([\w/]+)`\)\s*\|[^|]+\|([^|]+)\|([^|]+)\|$", line)
        if m:
            rows[m[1]] = (m[2].strip(), m[3].strip())
    roots = {"cifar10": "cifar10", "swin_b": "swin", "bert": "bert", "squad": "squad"}
    experiments = [f"{folder}/{p.stem}" for folder in roots
                   for p in sorted((CONFIGS / "experiment" / folder).glob("*.yaml"))
                   if not p.stem.startswith(("demo_", "tiny"))]
    assert sorted(rows) == sorted(experiments)
    sources = ("authors' README", "Liu et al. 2021", "You et al., ICLR 2020")
    for experiment in experiments:
        paper = compose_root(roots[experiment.split("/")[0]], f"experiment={experiment}")["paper"]
        number = paper.get("top1", paper.get("f1"))
        target, source = rows[experiment]
        if number is None:
            assert "not in the repository" in target or "abstract" in source, (experiment, target)
        else:
            assert float(target) == number, experiment
            assert any(s in source and s in paper["source"] for s in sources), (experiment, source)
