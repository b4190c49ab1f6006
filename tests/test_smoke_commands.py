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
        assert line == summary_line(json.loads((run_dir / "metrics.json").read_text()))
        assert line in (run_dir / "train.log").read_text().splitlines()
    assert list((ROOT / "smoke" / "tables").glob("*.md"))
    assert git_status("results") == results
    assert git_status() == before  # nothing else written outside smoke/ either
