"""docs/integrations.md: each framework's example, extracted from the page and run as written on the CPU with
its CPU command (2 gloo processes, 4 for FSDP2). Each prints the held-out loss of the ranks' average, on every rank.
And the FSDP2 snippet of docs/sharding.md, with SLAMB and with the LAMB its comment names, on 4 gloo processes (HSDP 2 x 2)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import slamb
from tests import distributed

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
    assert sorted(found) == ["accelerate_example.py", "fsdp_example.py", "hf_example.py", "lightning_example.py"]
    assert all(command for _, command in found.values()), found


@pytest.mark.parametrize("name", ["hf_example.py", "accelerate_example.py", "lightning_example.py", "fsdp_example.py"])
def test_the_example_runs_as_written_on_the_cpu(tmp_path, name):
    pytest.importorskip({"hf_example.py": "transformers", "accelerate_example.py": "accelerate",
                         "lightning_example.py": "lightning", "fsdp_example.py": "torch"}[name])
    code, command = examples()[name]
    (tmp_path / name).write_text(code)
    argv = command.split()
    # the launchers of this interpreter's environment, as a shell with it activated would find them
    argv[0] = sys.executable if argv[0] == "python" else str(Path(sys.executable).with_name(argv[0]))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = int(re.search(r"--nproc-per-node (\d+)", command)[1]) if "--nproc-per-node" in command else 2
    losses = dict(re.findall(r"rank (\d): \w+_loss (\d+\.\d{4})", done.stdout))  # the ranks' prints may interleave
    assert sorted(losses) == [str(r) for r in range(ranks)], done.stdout[-3000:]
    assert len(set(losses.values())) == 1  # the ranks' average, scored on every rank
    assert 0 < float(losses["0"]) < 1.386  # below chance (ln 4): it trained
    assert any((tmp_path / "final").iterdir())


def fsdp_snippet() -> str:
    """docs/sharding.md's FSDP2 snippet: the Python block that shards a model."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "sharding.md").read_text(), re.S)
    return next(b for b in blocks if "slamb.shard_model" in b)


class TransformerLayer(torch.nn.Module):  # the snippet's stand-ins
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())

    def forward(self, x):
        return x + self.net(x)


class MyModel(torch.nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(8, 16), TransformerLayer(), TransformerLayer(), torch.nn.Linear(16, 4))


def run_snippet(rank, world, code):
    """``code`` run as a rank of the launched world would run it, on the CPU; the whole parameters it ends with,
    gathered, what it exported (rank 0) and the parameters it started from."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 8, 8, generator=g)
    loader = list(zip(x, x[..., :4].argmax(-1)))  # each rank its own 6 batches of 8
    scope = dict(os=os, torch=torch, slamb=slamb, MyModel=MyModel, TransformerLayer=TransformerLayer, loader=loader,
                 nodes=2, gpus_per_node=world // 2)
    exec(compile(code, "docs/sharding.md", "exec"), scope)
    model = scope["model"]
    slamb.ddp.reshard(model)
    return {"params": [p.full_tensor().detach().clone() for p in model.parameters()], "state": scope["state"],
            "start": list(MyModel().parameters())}


def on_the_cpu(code: str) -> str:
    """The snippet as a CPU run of gloo processes runs it: no CUDA device to bind, the mesh and model on the CPU."""
    lines = [line for line in code.splitlines() if "torch.cuda.set_device" not in line]
    return "\n".join(lines).replace('"cuda"', '"cpu"').replace(".cuda()", "")


@pytest.mark.parametrize("optimizer", ["SLAMB", "LAMB"])
def test_the_fsdp_snippet_runs_with_slamb_and_with_lamb(optimizer):
    code = on_the_cpu(fsdp_snippet())
    if optimizer == "LAMB":  # the line its comment names instead of SLAMB's
        slamb_line = next(line for line in code.splitlines() if line.startswith("opt = slamb.SLAMB("))
        lamb_line = re.search(r"# or: (slamb\.LAMB\(.*\))", code)[1]
        code = code.replace(slamb_line, f"opt = {lamb_line}")
    res = distributed.run(run_snippet, 4, code)
    for r in res:  # every rank holds the run's model: the replicas' average
        assert all(torch.equal(a, b) for a, b in zip(r["params"], res[0]["params"]))
    assert not all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[0]["start"]))  # it trained
    names = [n for n, _ in MyModel().named_parameters()]
    assert list(res[0]["state"]) == names and not any(r["state"] for r in res[1:])
    assert all(torch.equal(res[0]["state"][n], p) for n, p in zip(names, res[0]["params"]))

