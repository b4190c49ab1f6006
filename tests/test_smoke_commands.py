"""The README's "Smoke-test each script" commands, run exactly as documented from the repository root (they
write under its git-ignored smoke/, emptied first): each per-paper script at its smoke size exits 0, each of its
runs ends with its summary line, which its train.log holds too, its tables go where TABLES says, and the
committed results/ stay as they were."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.loop import summary_line
from harness.recipe import size_name

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Smoke-test each script"
SCRIPTS = ["cifar10_resnet110", "swin_b_imagenet", "bert_pretrain", "squad_finetune"]


def smoke_commands() -> list[str]:
    """The commands of the section's shell block, one per line (continued lines joined)."""
    section = (ROOT / "README.md").read_text().split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def git_status(*paths: str) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *paths], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


def test_the_section_gives_one_command_per_script():
    assert [re.search(r"scripts/(\w+)\.sh", c)[1] for c in smoke_commands()] == SCRIPTS


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", smoke_commands(), ids=SCRIPTS)
def test_each_smoke_command_runs_as_documented(command):
    shutil.rmtree(ROOT / "smoke", ignore_errors=True)
    before, results = git_status(), git_status("results")
    # `python` and the scripts' interpreter: the one running the tests (the README's activated environment)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PY": sys.executable, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("run ")]
    assert lines
    for line in lines:
        run_dir = ROOT / re.match(r"run (\S+): ", line)[1]
        assert any(part.startswith("smoke-") for part in run_dir.relative_to(ROOT / "smoke" / "runs").parts)
        assert re.fullmatch(re.escape(summary_line(json.loads((run_dir / "metrics.json").read_text())))
                            + r" of a \d+\.\d s command", line)
        assert line in (run_dir / "train.log").read_text().splitlines()
    assert list((ROOT / "smoke" / "tables").glob("*.md"))
    if "cifar10_resnet110.sh" in command:  # ResNet-110, 1 worker, 1 epoch of 64 digits: never beside the paper's 93.21
        page = (ROOT / "smoke" / "tables" / "cifar10_resnet110.md").read_text()
        assert "published top-1 |" not in page.split("Not the paper's setting")[0]
        assert re.search(r"Not the paper's setting \(1 epoch of 200; 1 worker per node of 4; .*data: "
                         r"scikit-learn's 8x8 digits in the CIFAR-10 layout \(64 training / 32 test images, 10 classes\), "
                         r"not CIFAR-10, digest [0-9a-f]{12}\)", page)
        assert "- data: scikit-learn's 8x8 digits in the CIFAR-10 layout (64 training / 32 test images" in page
    assert git_status("results") == results
    assert git_status() == before  # nothing else written outside smoke/ either


@pytest.mark.parametrize("root, experiments, overrides", [
    ("cifar10", ["cifar10/sgd", "cifar10/slamb"], ["data.dir=/elsewhere", "trainer.nproc_per_node=4",
                                                   "trainer.progress=false", "hydra.run.dir=/x"]),
    ("bert", ["bert/phase1_lamb", "bert/phase2_lamb"], ["trainer.nproc_per_node=8", "init_from=/x/model",
                                                        "trainer.checkpoint.every=50"]),
])
def test_inputs_and_operational_settings_keep_the_recipes_size(root, experiments, overrides):
    assert size_name(root, experiments, overrides) == ("", {})


def test_another_size_is_named_by_the_settings_it_changes():
    name, changed = size_name("cifar10", ["cifar10/sgd", "cifar10/slamb"], ["model=resnet8", "epochs=1"])
    assert re.fullmatch(r"smoke-[0-9a-f]{8}", name)
    assert changed["epochs"] == (200, 1) and changed["model.depth"] == (110, 8)
    assert size_name("cifar10", ["cifar10/lamb"], ["epochs=1", "model=resnet8", "trainer.progress=false"])[0] == name
    assert size_name("cifar10", ["cifar10/lamb"], ["model=resnet8", "epochs=2"])[0] != name
