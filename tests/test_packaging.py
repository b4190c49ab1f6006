"""The wheel is the library only: ``pip install slamb`` brings the optimizers, not the experiments."""
from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
    # the library's own modules import nothing beyond those (and the standard library)
    third_party = set()
    for name in zf.namelist():
        if name.endswith(".py"):
            for line in zf.read(name).decode().splitlines():
                words = line.split()
                if len(words) >= 2 and words[0] in ("import", "from") and not line.startswith((" ", "\t")):
                    third_party.add(words[1].split(".")[0])
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert third_party - stdlib - {"slamb", ""} <= {"torch", "numpy"}
