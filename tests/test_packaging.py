"""The wheel is the library only: ``pip install slamb`` brings the optimizers, not the experiments."""
from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    # a copy of the checkout (pip builds in the source tree), the whole repository minus run outputs
    shutil.copytree(ROOT, src, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "runs", "outputs", "multirun", "data", "build",
                                                  "results", "*.egg-info", "__pycache__"))
    # no build isolation: the venv's setuptools builds it, so the test needs no index
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, cwd=out)
    (path,) = out.glob("slamb-*.whl")
    return path


def test_wheel_ships_the_library_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"slamb"}
    for expected in ("slamb/optim/slamb.py", "slamb/comm.py", "slamb/ddp.py", "slamb/registry.py",
                     "slamb/contract.py", "slamb/averaging.py", "slamb/schedules.py"):
        assert expected in names
    assert not any(n.startswith("slamb/experiment") or n == "slamb/scaling.py" for n in names)


def test_wheel_declares_what_the_library_imports(wheel):
    zf = zipfile.ZipFile(wheel)
    (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(zf.read(meta_name))
    required = [r.split(";")[0].strip() for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert {r.split("=")[0].split(">")[0].strip() for r in required} == {"torch", "torchvision", "numpy"}
    # the library imports nothing beyond those, except each framework integration its framework, which the
    # `integrations` extra declares
    extras = [r.split(";")[0].strip() for r in meta.get_all("Requires-Dist") if 'extra == "integrations"' in r]
    declared = {re.split(r"[<>=!~ \[]", r)[0] for r in extras}
    stdlib = set(sys.stdlib_module_names) | {"__future__", "slamb", ""}
    for name in zf.namelist():
        if not name.endswith(".py"):
            continue
        imported = set()
        for line in zf.read(name).decode().splitlines():
            words = line.strip().split()
            if (words[:1] == ["import"] and len(words) >= 2) or (words[:1] == ["from"] and words[2:3] == ["import"]):
                imported.add(words[1].split(".")[0])
        allowed = {"torch", "numpy"} | (declared if name.startswith("slamb/integrations/") else set())
        assert imported - stdlib <= allowed, (name, imported - stdlib - allowed)
    assert {"transformers", "accelerate", "lightning"} <= declared
