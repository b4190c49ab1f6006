"""SLURM and submitit: the launcher configs compose, a task reads its rank and master address from
SLURM's environment (or fails loudly), and the tiny CIFAR-10 job runs on 2 workers under submitit's local
executor and as 2 SLURM tasks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cifar10.data import write_digits
from harness.distributed import first_host, free_port, launch, resolve_worker, slurm_env
from tests.test_cifar10 import TINY, env
from tests.test_configs import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
SLURM_TASK = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_NODELIST": "gpu[07-08],cpu3", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "4242"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_digits(tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py", 160, 40)


def _world_and_cfg(cfg, run_dir):
    return os.environ.get("WORLD_SIZE", "1"), cfg


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[07-09,12],cpu3", "gpu07"), ("n[1-2]-ib", "n1-ib"), ("localhost", "localhost"), ("a01,a02", "a01"),
    ("rack[3-4]-n[05-06]", "rack3-n05"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_task_environment_becomes_torch_distributed_environment():
    assert slurm_env(SLURM_TASK) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                                     "GROUP_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": "24242"}
    preset = slurm_env({**SLURM_TASK, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})  # set by the user: kept
    assert (preset["MASTER_ADDR"], preset["MASTER_PORT"]) == ("head", "1234")


@pytest.mark.multiprocess
def test_a_slurm_step_without_rank_information_fails_loudly(monkeypatch):
    partial = {k: v for k, v in SLURM_TASK.items() if k not in ("SLURM_LOCALID", "SLURM_NODELIST")}
    with pytest.raises(RuntimeError, match=r"SLURM step of 8 tasks without \['SLURM_LOCALID', 'SLURM_NODELIST'\].*srun"):
        slurm_env(partial)
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", *SLURM_TASK):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    with pytest.raises(RuntimeError, match=r"without \['SLURM_LOCALID', 'SLURM_NODELIST', 'SLURM_JOB_ID'\]"):
        launch(_world_and_cfg, {}, "/nonexistent", nproc_per_node=1)


@pytest.mark.multiprocess
def test_workers_are_named_by_module_path():
    assert launch("tests.test_slurm:_world_and_cfg", {"x": 1}, "/nonexistent") == ("1", {"x": 1})
    assert resolve_worker(_world_and_cfg) is _world_and_cfg
    with pytest.raises(ValueError, match=r"invalid worker 'tests.test_slurm:nothing'"):
        resolve_worker("tests.test_slurm:nothing")


@pytest.mark.parametrize("launcher, target", [("slurm", "SlurmLauncher"), ("local", "LocalLauncher")])
def test_launcher_configs_compose(launcher, target):
    cfg = compose_cfg("experiment=cifar10/slamb", f"hydra/launcher={launcher}", "trainer.nproc_per_node=8",
                      hydra_cfg=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    if launcher == "slurm":  # one task and one GPU per worker
        assert (cfg.hydra.launcher.tasks_per_node, cfg.hydra.launcher.gpus_per_node) == (8, 8)
    else:  # one task that starts the trainer.nproc_per_node workers
        assert cfg.hydra.launcher.tasks_per_node == 1


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.multiprocess
def test_two_workers_under_submitit_local(tiny_dir, tmp_path):
    """The job runs in a process submitit started (its __main__ is submitit's), whose 2 workers import train."""
    args = [*TINY, "epochs=1", f"data.dir={tiny_dir}", "hydra/launcher=local", f"hydra.sweep.dir={tmp_path}",
            "hydra.sweep.subdir=job"]
    done = subprocess.run([sys.executable, "-m", "cifar10.train", "--multirun", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=600, check=False)
    logs = "".join(p.read_text() for p in tmp_path.glob(".submitit/*/*.err"))
    assert done.returncode == 0 and "PicklingError" not in logs, done.stderr[-3000:] + logs[-3000:]
    s = summary(tmp_path / "job")
    assert (s["world_size"], s["steps"], s["global_batch"]) == (2, 5, 32)


@pytest.mark.multiprocess
def test_two_slurm_tasks_join_one_job(tiny_dir, tmp_path):
    """Two processes with the environment srun gives two tasks on one node: one job of world size 2."""
    args = [*TINY, "epochs=1", f"data.dir={tiny_dir}", f"hydra.run.dir={tmp_path}"]
    slurm = {"SLURM_NTASKS": "2", "SLURM_NODELIST": "localhost", "SLURM_JOB_ID": "7", "SLURM_NODEID": "0",
             "SLURM_TASKS_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    tasks = [subprocess.Popen([sys.executable, "-m", "cifar10.train", *args], cwd=ROOT, text=True,
                              env=env(**slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    outputs = [t.communicate(timeout=600)[0] for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    s = summary(tmp_path)
    assert (s["world_size"], s["steps"], s["global_batch"]) == (2, 5, 32)
    assert "epoch=1" in outputs[0] and "epoch=1" not in outputs[1]  # rank 0 logs
