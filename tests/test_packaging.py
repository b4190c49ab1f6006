"""The wheel is the library only: ``pip install slamb`` brings the optimizers, not the experiments."""
from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

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
    assert {r.split("=")[0].split(">")[0].strip() for r in required} == {"torch", "numpy"}
    # the library imports nothing beyond those, except each framework integration its framework, which the
    # `integrations` extra declares (torchft: the `ft` extra)
    extras = [r.split(";")[0].strip() for r in meta.get_all("Requires-Dist")
              if 'extra == "integrations"' in r or 'extra == "ft"' in r]
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
    assert {"transformers", "accelerate", "lightning", "torchft"} <= declared


def test_the_library_requires_a_torch_range_not_a_pin(wheel):
    """``pip install slamb`` keeps a user's torch where it is in the tested range; torchvision is the
    pipelines' (timm's models), not the library's."""
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(
        next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))))
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    (torch_req,) = [r for r in reqs if r.name == "torch" and r.marker is None]
    assert [s.operator for s in torch_req.specifier] == [">="]
    floor = next(iter(torch_req.specifier)).version
    assert not any(r.name == "torchvision" and r.marker is None for r in reqs)
    assert any(r.name == "torchvision" and r.marker.evaluate({"extra": "vision"}) for r in reqs if r.marker)
    # the README names the oldest torch the library's tests pass on: the same as the requirement's floor, which
    # make test-compat installs
    assert f"torch {floor}" in (ROOT / "README.md").read_text()
    (oldest,) = re.findall(r"^TORCH_OLDEST\s*:=\s*(\S+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert Version(oldest) == Version(floor), (oldest, floor)
    # the exact versions the checkout installs fall in the library's ranges
    pins = {Requirement(line).name: Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")}
    assert all([s.operator for s in r.specifier] == ["=="] for r in pins.values())
    for r in reqs:
        if r.marker is None:
            assert r.specifier.contains(next(iter(pins[r.name].specifier)).version), (r, pins[r.name])
    assert {"torch", "torchvision", "numpy", "timm", "pytest"} <= set(pins)
    # the newest torch the README names is the one make test-newest installs, in the range and past the pin
    (newest,) = re.findall(r"^TORCH_NEWEST\s*:=\s*(\S+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert f"torch {newest}" in (ROOT / "README.md").read_text()
    (pinned,) = pins["torch"].specifier
    assert torch_req.specifier.contains(newest) and Version(newest) > Version(pinned.version), (newest, pinned)


def test_the_makefile_installs_the_constraints_and_reinstalls_when_they_change(tmp_path):
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    stamp = tmp_path / ".venv" / ".installed"
    stamp.parent.mkdir()
    stamp.touch()
    later = max((tmp_path / n).stat().st_mtime for n in ("Makefile", "pyproject.toml", "constraints.txt")) + 10
    os.utime(stamp, (later, later))

    def dry_run(*args):  # what `make` would do for the venv, without doing it
        return subprocess.run(["make", "-n", *args, ".venv/.installed"], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout

    assert "pip install" not in dry_run()  # up to date
    for changed in ("constraints.txt", "pyproject.toml"):
        assert "pip install -q -c constraints.txt -e '.[all]'" in dry_run("-W", changed), changed


def test_a_process_that_shards_nothing_does_not_import_dtensor():
    """torch.distributed.tensor costs ``import slamb`` about 1.5 s on 2 cores (7.1 s -> 5.1 s with the harness):
    the library and the pipelines leave it to FSDP2 and DCP, which import it where a run shards or checkpoints
    (a DTensor exists only once it is imported, which slamb.sharding.is_sharded relies on)."""
    code = ("import sys, slamb, harness, cifar10.train, bert.train, swin.train, squad_finetune.train; "
            "print('torch.distributed.tensor' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]
