"""The CIFAR-10 pipeline under ``trainer.fault_tolerance=torchft`` (harness/fault_tolerance.py), as a user runs it:
``python -m cifar10.train ... +mixin=torchft``, whose launcher starts torchft's lighthouse and 3 replica groups of
one gloo worker each on the CPU; a group killed before a step (the fault-injection hook) and relaunched. LAMB's
(data-parallel) steps under a failure: tests/test_torchft.py."""
from __future__ import annotations

import json

import pytest
import torch

from cifar10.data import channel_stats, load_cifar10, write_digits
from cifar10.model import build_model
from cifar10.train import evaluate
from harness.build import check_settings, user_error
from harness.distributed import DistEnv
from tests.test_cifar10 import SLAMB_TINY, TINY, cli, history
from tests.test_configs import compose_cfg, compose_root

pytest.importorskip("torchft")

# TINY's job on 3 replica groups; each epoch is 3 steps of 3 x 16 images
GROUPS = [a for a in TINY if not a.startswith("trainer.nproc_per_node")]
FT = [*GROUPS, "+mixin=torchft", "trainer.replica_groups=3", "trainer.timeout_s=60"]
COMPARED = ("epoch", "step", "train_loss", "train_top1", "test_loss", "test_top1", "lr", "compress_ratio",
            "bytes_cum/momentum", "bytes_cum/momentum_dense", "bytes_cum/params", "bytes_cum/grads")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("digits") / "cifar-10-batches-py", 144, 40)


def rows(run_dir) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in history(run_dir)]


def exported(run_dir) -> dict:
    return torch.load(run_dir / "model" / "model.pt", weights_only=True)


@pytest.mark.parametrize("optimizer", [SLAMB_TINY, ["experiment=cifar10/lamb"]], ids=["slamb", "lamb"])
@pytest.mark.multiprocess
def test_a_torchft_run_computes_what_the_same_job_on_three_workers_computes(data, tmp_path, optimizer):
    common = [*optimizer, "epochs=2", f"data.dir={data.parent}"]
    ft = cli([*common, *FT, f"hydra.run.dir={tmp_path / 'ft'}"])
    assert ft.returncode == 0, ft.stderr[-3000:]
    plain = cli([*common, *GROUPS, "trainer.nproc_per_node=3", "trainer.checkpoint.enabled=false",
                 f"hydra.run.dir={tmp_path / 'plain'}"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    # the same samples per step, the same exchange through the manager, the same averaged model
    a, b = rows(tmp_path / "ft"), rows(tmp_path / "plain")
    assert [r["step"] for r in a] == [3, 6] and [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            assert rb[key] == pytest.approx(value, rel=1e-6), key
    model_a, model_b = exported(tmp_path / "ft"), exported(tmp_path / "plain")
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        torch.testing.assert_close(model_a[key], model_b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.multiprocess
def test_a_killed_group_is_relaunched_and_rejoins_while_the_others_train_on(data, tmp_path):
    run_dir = tmp_path / "run"
    # group 1 dies before step 5 (mid epoch 2); the others fail that step's commit, take it again without it,
    # and go on; the launcher relaunches group 1, which takes a peer's state and joins at a coming step
    done = cli([*SLAMB_TINY, *FT, "epochs=4", f"data.dir={data.parent}", f"hydra.run.dir={run_dir}"],
               extra_env={"SLAMB_FAULT_AT_STEP": "5", "SLAMB_FAULT_RANK": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "[fault injection] rank 1 exits before step 5" in out
    relaunched = [line for line in out.splitlines() if line.startswith("replica group ")]
    assert relaunched == ["replica group 1 failed (replica group 1: exit status 17); relaunched (1 of "
                          "trainer.max_restarts=3): it joins the others at a coming step"], out[-3000:]
    # every epoch once, in order, though the group that wrote the first may not write the others
    lines = history(run_dir)
    assert [(r["epoch"], r["step"]) for r in lines] == [(1, 3), (2, 6), (3, 9), (4, 12)]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["steps"] == 12 and summary["final_test_loss"] == lines[-1]["test_loss"]
    # the export is the run's model: the groups' average the last line scored
    cfg = json.loads((run_dir / "model" / "config.json").read_text())
    model = build_model(cfg)
    model.load_state_dict(exported(run_dir), strict=True)
    test_x, test_y = load_cifar10(data.parent)["test"]
    scored = evaluate(model, test_x, test_y, DistEnv(0, 1, 0, 1, torch.device("cpu")), 64,
                      channel_stats(torch.device("cpu")))
    assert scored["test_loss"] == pytest.approx(summary["final_test_loss"], rel=1e-5)
    assert scored["test_top1"] == summary["final_test_top1"]


def refused(*overrides, root="cifar10", fault_tolerant=True) -> str:
    cfg = compose_root(root, *overrides) if root != "cifar10" else compose_cfg(*overrides)
    with pytest.raises(ValueError) as error:
        check_settings(cfg, fault_tolerant=fault_tolerant)
    return user_error(error.value, cfg["optimizer"])


@pytest.mark.parametrize("overrides, line", [
    (["trainer.nproc_per_node=2"], "error: invalid trainer.fault_tolerance=torchft with trainer.nproc_per_node=2: set "
     "trainer.nproc_per_node=1 (its workers are trainer.replica_groups) (+mixin=torchft sets them)"),
    (["trainer.checkpoint.enabled=true"], "with trainer.checkpoint.enabled=true (its groups hold the run's state and "
     "heal each other): set trainer.checkpoint.enabled=false"),
    (["trainer.precision=fp16"], "set trainer.precision=fp32 or bf16"),
    (["trainer.min_replicas=4"], "error: invalid trainer.min_replicas=4: more than the job's "
     "trainer.replica_groups=3; fix: set trainer.min_replicas to an allowed value"),
    (["trainer.heal=copy"], "error: invalid trainer.heal='copy': must be one of"),
    (["optimizer=dgc"], "with optimizer=dgc: SLAMB, or a data-parallel optimizer (lamb, adamw, sgd), runs "
     "under it; pick one of those"),
    (["optimizer.overlap=true"], "with optimizer.overlap=true: SLAMB runs its collectives through torchft's manager "
     "one at a time; drop the setting"),
])
def test_what_torchft_cannot_run_is_refused_in_one_line_before_any_worker(overrides, line):
    base = [] if overrides[0].startswith("optimizer=") else ["experiment=cifar10/slamb"]
    assert line in refused(*base, "+mixin=torchft", "trainer.replica_groups=3", *overrides)


def test_a_pipeline_without_torchft_refuses_it():
    assert "this pipeline runs without it so far (cifar10.train has it); set trainer.fault_tolerance=none" in \
        refused("experiment=cifar10/slamb", "+mixin=torchft", fault_tolerant=False)


@pytest.mark.multiprocess
def test_a_run_directory_with_another_runs_checkpoints_is_refused(data, tmp_path):
    run_dir = tmp_path / "run"
    common = [*SLAMB_TINY, *GROUPS, "epochs=1", f"data.dir={data.parent}", f"hydra.run.dir={run_dir}"]
    plain = cli([*common, "trainer.nproc_per_node=1", "trainer.checkpoint.enabled=true"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    done = cli([*common, "+mixin=torchft", "trainer.replica_groups=3", "epochs=2"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: invalid trainer.fault_tolerance=torchft in {run_dir}: it holds the "
                                  "checkpoints of a run without it, and a torchft run starts from step 0; set "
                                  "trainer.resume=never"), done.stderr
