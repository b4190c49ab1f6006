"""The per-paper scripts (scripts/*.sh) and their SLURM batch files (scripts/slurm/), run as a user runs them:
a mistake is one line and exit status 2 before any run starts, leaving no folder behind; every phase is
checked before the first; relative paths are the caller's; BERT's phase 2 continues this command's phase 1;
each batch file runs its experiment as SLURM tasks (2 nodes x 2 on this machine, through a stand-in srun
that starts the tasks of a step with SLURM's environment) and renders the tables once."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bert.tiny import write_tiny
from cifar10.data import write_digits
from harness.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"cifar10_resnet110": ["sgd", "lamb", "slamb"], "swin_b_imagenet": ["adamw", "lamb", "slamb"],
           "bert_pretrain": ["lamb", "onebit_lamb", "slamb"], "squad_finetune": ["lamb", "onebit_lamb", "slamb"]}
# the positional arguments a script takes before its overrides
LEAD = {"swin_b_imagenet": ["1", "--"]}
CIFAR_TINY = ["model=resnet8", "model.width=4", "epochs=1", "data.micro_batch=8"]
BERT_TINY = ["model=bert_tiny", "steps=2", "schedule.warmup_steps=1", "data.global_batch=8", "data.micro_batch=2"]

pytestmark = pytest.mark.multiprocess


def run(command: list[str], cwd=ROOT, timeout: int = 900, **extra) -> subprocess.CompletedProcess:
    """A script as a user starts it, with the tests' interpreter as its Python."""
    env = {**os.environ, "PY": sys.executable, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra}
    for key in [k for k, v in extra.items() if v is None]:
        del env[key]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def script(name: str, *args: str, **env) -> subprocess.CompletedProcess:
    return run([str(ROOT / "scripts" / f"{name}.sh"), *LEAD.get(name, []), *args], **env)


def refused(done: subprocess.CompletedProcess) -> str:
    """The one line of a command refused as a usage error."""
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("data")
    bert = write_tiny(root / "bert", heldout=0.2)  # the phases' lengths, 128 and 512
    return {"digits": write_digits(root / "digits", 64, 32), "bert": bert, "root": root}


def bert_env(data, tmp_path, **extra) -> dict:
    return {"PHASE1_DATA": str(data["bert"][128]), "PHASE2_DATA": str(data["bert"][512]),
            "RUNS": str(tmp_path / "runs"), "TABLES": str(tmp_path / "tables"), **extra}


# ------------------------------------------------------------------------------------- mistakes, one line each

@pytest.mark.parametrize("name", SCRIPTS)
def test_help_says_what_the_script_takes(name):
    done = script(name, "--help")
    assert done.returncode == 0 and "ROWS" in done.stdout and "RUNS" in done.stdout and "TABLES" in done.stdout
    assert all(row in done.stdout for row in SCRIPTS[name])


@pytest.mark.parametrize("rows, says", [("slam", "no row 'slam'"), ("", "ROWS is empty"),
                                         ("slamb lam", "no row 'lam'")])
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_wrong_rows_is_one_line_naming_the_choices(name, rows, says, tmp_path):
    # before: ROWS=slam a 60-line traceback from Hydra, ROWS= every row run
    line = refused(script(name, ROWS=rows, RUNS=str(tmp_path / "runs"), TABLES=str(tmp_path / "tables")))
    assert says in line and all(row in line for row in SCRIPTS[name]), line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tables").exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_misspelt_override_is_one_line_naming_the_setting(name, tmp_path):
    # before: Hydra's ConfigCompositionException, 66 lines from harness/recipe.py. SQuAD's rows fine-tune with
    # AdamW (the row names the pre-training's optimizer), which has no compress_ratio
    setting, near = ("optimizer.weight_decy", "weight_decay") if name == "squad_finetune" else \
        ("optimizer.compres_ratio", "compress_ratio")
    line = refused(script(name, f"{setting}=0.05", ROWS="slamb", RUNS=str(tmp_path / "runs")))
    assert setting in line and f"did you mean optimizer.{near}?" in line and "known: [" in line, line
    assert not (tmp_path / "runs").exists()


def test_bert_refuses_phase_2_data_before_phase_1_trains(data, tmp_path):
    # before: phase 1 trained, then phase 2 was refused ("holds sequences of length 128, the run expects 512")
    line = refused(script("bert_pretrain", *BERT_TINY, "trainer.nproc_per_node=1",
                          **bert_env(data, tmp_path, ROWS="slamb", PHASE2_DATA=str(data["bert"][128]))))
    assert "bert/phase2_slamb" in line and "data.seq_len" in line, line
    assert not (tmp_path / "runs").exists()


def test_bert_refuses_one_data_folder_for_both_phases(data, tmp_path):
    line = refused(script("bert_pretrain", f"data.dir={data['bert'][128]}", **bert_env(data, tmp_path)))
    assert "PHASE1_DATA and PHASE2_DATA" in line


def test_bert_refuses_missing_held_out_shards(data, tmp_path):
    line = refused(script("bert_pretrain", *BERT_TINY, "trainer.nproc_per_node=1",
                          **bert_env(data, tmp_path, ROWS="lamb", PHASE1_VALID=str(tmp_path))))
    assert "validation.dir" in line and "bert/phase1_lamb" in line, line


def test_a_refused_setting_leaves_no_folder(data, tmp_path):
    # before: Hydra made the run directory, the pipeline refused the setting, the empty folders stayed
    line = refused(script("cifar10_resnet110", f"data.dir={data['digits']}", *CIFAR_TINY, "optimizer.lr=-1",
                          ROWS="slamb", RUNS=str(tmp_path / "runs")))
    assert "optimizer.lr" in line
    assert not (tmp_path / "runs").exists()


def test_a_pipeline_refusing_a_setting_removes_the_folder_hydra_made(data, tmp_path):
    done = run([sys.executable, "-m", "cifar10.train", "experiment=cifar10/slamb", f"data.dir={data['digits']}",
                *CIFAR_TINY, "optimizer.lr=-1", "hydra.run.dir=runs_refused/a/b"], cwd=tmp_path,
               PYTHONPATH=str(ROOT))
    assert refused(done).startswith("error: invalid lr=-1")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("node_rank, renders", [("0", True), ("1", False)])
def test_bert_on_several_nodes_renders_the_tables_on_node_0_only(data, tmp_path, node_rank, renders):
    """NNODES=2: every node runs the script, torchrun starting its workers. A stand-in interpreter answers for
    torchrun and make_tables.py (what the script starts on this node is the point) and runs the rest: the
    checks of every run, for a world of 2 x 1 workers. Before, every node wrote the tables."""
    py = tmp_path / "python"
    py.write_text(f"""#!/usr/bin/env bash
case "$*" in
    "-m torch.distributed.run "*) echo "torchrun $*"; exit 0 ;;
    "scripts/make_tables.py "*) echo "make_tables $*"; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    py.chmod(0o755)
    done = script("bert_pretrain", *BERT_TINY, "trainer.nproc_per_node=1", PY=str(py), NNODES="2",
                  NODE_RANK=node_rank, NPROC_PER_NODE="1", MASTER_ADDR="localhost",
                  **bert_env(data, tmp_path, ROWS="onebit_lamb"))
    assert done.returncode == 0, done.stderr[-3000:]
    started = [line.split()[0] for line in done.stdout.splitlines() if line.startswith(("torchrun", "make_tables"))]
    assert started == ["torchrun", "torchrun", *(["make_tables"] if renders else [])], done.stdout
    phase2 = [line for line in done.stdout.splitlines() if "experiment=bert/phase2_onebit_lamb" in line][0]
    assert f"init_from={tmp_path / 'runs'}/" in phase2  # this command's phase 1, under RUNS


# ------------------------------------------------------------------------------------- paths, a run from elsewhere

def test_relative_paths_are_the_callers(data, tmp_path):
    """From another directory, a relative data.dir and RUNS are that directory's (before: the repository's)."""
    shutil.copytree(data["digits"], tmp_path / "digits")
    done = script("cifar10_resnet110", "data.dir=digits", *CIFAR_TINY, "trainer.nproc_per_node=1", ROWS="lamb",
                  RUNS="runs", TABLES="tables", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = next((tmp_path / "runs").rglob("metrics.json"))
    assert json.loads(summary.read_text())["steps"] > 0
    assert list((tmp_path / "tables").glob("*.md"))
    assert not (ROOT / "digits").exists() and not (ROOT / "tables").exists()


# ------------------------------------------------------------------------------------- SLURM: 2 nodes x 2 tasks

@pytest.fixture(scope="module")
def slurm_data(data) -> dict:
    from squad_finetune.tiny import main as write_squad
    from swin.tiny import write_tiny_imagenet

    root = data["root"]
    write_squad([str(root / "squad"), "--random-bert", str(root / "squad" / "bert")])
    return {**data, "imagenet": write_tiny_imagenet(root / "imagenet"), "squad": root / "squad"}


def batch_args(name: str, d: dict) -> tuple[list[str], dict]:
    """A smoke run of each batch file's experiment: its overrides and environment."""
    if name == "cifar10_resnet110":
        return [f"data.dir={d['digits']}", *CIFAR_TINY], {}
    if name == "swin_b_imagenet":
        return [f"data.dir={d['imagenet']}", "model=swin_tiny_test", "epochs=1", "schedule.warmup_epochs=0",
                "data.micro_batch=4", "data.global_batch=16", "data.eval_batch=4", "data.workers=0"], {}
    if name == "bert_pretrain":
        return BERT_TINY, {"PHASE1_DATA": str(d["bert"][128]), "PHASE2_DATA": str(d["bert"][512])}
    squad = d["squad"]
    return ["data=squad_tiny", f"data.train_file={squad / 'train-v1.1.json'}", f"data.dev_file={squad / 'dev-v1.1.json'}",
            f"model.dir={squad / 'bert'}", "data.max_train_examples=16", "data.max_dev_examples=16",
            "data.global_batch=8", "epochs=1"], {}


# the paper's allocation of each experiment: (nodes, GPUs per node)
PAPER_ALLOCATION = {"cifar10_resnet110": (1, 4), "swin_b_imagenet": (16, 8), "bert_pretrain": (16, 8),
                    "squad_finetune": (1, 4)}


def sbatch_options(path: Path) -> dict:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", path.read_text(), re.M))


def test_one_batch_file_per_experiment_at_the_papers_allocation():
    assert sorted(p.stem for p in (ROOT / "scripts" / "slurm").glob("*.sbatch")) == sorted(SCRIPTS)
    for name, (nodes, gpus) in PAPER_ALLOCATION.items():
        o = sbatch_options(ROOT / "scripts" / "slurm" / f"{name}.sbatch")
        assert (int(o["nodes"]), int(o["ntasks-per-node"]), int(o["gpus-per-node"])) == (nodes, gpus, gpus), name


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_batch_file_runs_its_experiment_as_slurm_tasks(name, slurm_data, tmp_path):
    """sbatch on 2 nodes x 2 tasks: the batch script runs once, each run is a step of 4 SLURM tasks (world size
    4), the tables are rendered once. BERT: both phases score the held-out shards, and phase 2 continues the
    optimizer of this command's phase 1 under RUNS (before: runs/'s, whatever RUNS was)."""
    args, env = batch_args(name, slurm_data)
    row = "onebit_lamb" if name == "bert_pretrain" else SCRIPTS[name][-1]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
             "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "localhost", "SLURM_PROCID": "0",
             "SLURM_CPUS_PER_TASK": "1", "SLURM_SUBMIT_DIR": str(ROOT), "MASTER_PORT": str(free_port())}
    done = run(["bash", str(ROOT / "scripts" / "slurm" / f"{name}.sbatch"), *args], ROWS=row,
               RUNS=str(tmp_path / "runs"), TABLES=str(tmp_path / "tables"), **slurm, **env,
               PATH=f"{ROOT / 'tests' / 'fake_slurm'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
                    f"{os.environ['PATH']}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summaries = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("metrics.json")}
    assert summaries and all(s["world_size"] == 4 for s in summaries.values()), summaries.keys()
    tables = [line for line in done.stdout.splitlines() if re.match(r"[\w.]+: \S+\.md", line)]
    assert tables and len(tables) == len(set(tables)), done.stdout  # one task rendered them
    assert list((tmp_path / "tables").glob("*.md"))
    if name == "bert_pretrain":
        phase1 = next(p.parent for p in (tmp_path / "runs").rglob("bert_phase1_onebit_lamb/metrics.json"))
        assert f"optimizer continues from {phase1} at its step 2" in done.stdout
        for phase in ("bert_phase1_onebit_lamb", "bert_phase2_onebit_lamb"):
            assert summaries[phase]["final_val_mlm_loss"] > 0  # the paper's metric, on the held-out shards
