"""docs/integrations.md: each framework's example, extracted from the page and run as written on the CPU with
its CPU command (2 gloo processes). Each prints the held-out loss of the ranks' average, on every rank."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "integrations.md"

pytestmark = pytest.mark.multiprocess  # each example starts 2 worker processes


def examples() -> dict[str, tuple[str, str]]:
    """``{file name: (its code, its CPU command)}``: each ```python block that opens with ``# <name>.py``, and the
    line of a ```bash block that runs it with the comment ``# CPU``."""
    text = PAGE.read_text()
    code = {m[1]: m[0] for m in re.findall(r"```python\n(# (\w+\.py)\n.*?)```", text, re.S)}
    commands = {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            name = next((w for w in command.split() if w in code), None)
            if name and comment.strip().startswith("CPU"):
                commands[name] = command.strip()
    return {name: (code[name], commands.get(name)) for name in code}


def test_the_page_has_one_runnable_example_per_framework_each_with_its_cpu_command():
    found = examples()
    assert sorted(found) == ["accelerate_example.py", "hf_example.py", "lightning_example.py"]
    assert all(command for _, command in found.values()), found


@pytest.mark.parametrize("name", ["hf_example.py", "accelerate_example.py", "lightning_example.py"])
def test_the_example_runs_as_written_on_the_cpu(tmp_path, name):
    pytest.importorskip({"hf_example.py": "transformers", "accelerate_example.py": "accelerate",
                         "lightning_example.py": "lightning"}[name])
    code, command = examples()[name]
    (tmp_path / name).write_text(code)
    argv = command.split()
    # the launchers of this interpreter's environment, as a shell with it activated would find them
    argv[0] = sys.executable if argv[0] == "python" else str(Path(sys.executable).with_name(argv[0]))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = dict(re.findall(r"rank (\d): \w+_loss (\d+\.\d{4})", done.stdout))  # the ranks' prints may interleave
    assert sorted(losses) == ["0", "1"], done.stdout[-3000:]
    assert losses["0"] == losses["1"]  # the ranks' average, scored on every rank
    assert 0 < float(losses["0"]) < 1.386  # below chance (ln 4): it trained
    assert any((tmp_path / "final").iterdir())
