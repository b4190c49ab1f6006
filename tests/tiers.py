"""Test tiers: explicit marks, checked against what each test does at run time.

* ``multiprocess``: starts worker processes: a ``multiprocessing`` process (the local gloo
  launcher's ``mp.spawn``, the pipelines' elastic launcher, a process pool) or a subprocess that
  runs Python (the interpreter, ``torchrun``); a helper command such as ``git`` or ``ip`` is no worker,
  nor is a process that ``torch.compile`` starts itself (its compile workers, the probe a cold cache runs);
* ``e2e``: runs a whole pipeline (a pipeline's training loop, :class:`harness.loop.Loop`) or a
  bench's ``main`` in the test's own process;
* ``netns``: builds network namespaces (``ip netns add``; root only, skipped with the reason elsewhere);
* ``gpu``: uses a CUDA device in the test's process (skipped where none is present, as in CI); only in the files
  ``make gpu-check`` runs (``bench.gpu_check.TEST_FILES``: collection refuses a gpu test elsewhere).

A test is marked with the tiers it uses (``pytestmark`` where every test of a module uses one).
:func:`pytest_runtest_call` records what the test's set-up and body do and fails a test that used
a tier it is not marked with. What worker processes do is not seen from here: a pipeline run in
workers is covered by the ``multiprocess`` mark of the test that starts them.
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing.process
import os
import re
import subprocess
import sys

import pytest
import torch

from harness.loop import Loop

TIERS = ("multiprocess", "e2e", "netns", "gpu")
BENCH_ENTRIES = ("bench.optimizer_step", "bench.comm_volume", "bench.memory", "bench.netbench", "bench.scaling",
                 "bench.time_to_accuracy", "bench.gpu_check")
_used = pytest.StashKey[set]()


def _argv(args) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args).split()
    return [os.fsdecode(a) for a in args]


# torch.compile's own processes (its compile-worker pool, the vector-ISA probe a cold cache runs) are part of
# compiling, not workers the test starts: a process started from a frame of these packages is not counted
_COMPILER_PACKAGES = ("torch._inductor", "torch._dynamo")


def _started_by_the_compiler() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_COMPILER_PACKAGES):
            return True
        frame = frame.f_back
    return False


def _runs_python(argv: list[str]) -> bool:
    # a program named anywhere in the command line (``ip netns exec NS python ...``), not an option's path
    return any(a == sys.executable or not a.startswith("-") and re.fullmatch(r"python[\d.]*|torchrun",
                                                                            os.path.basename(a)) for a in argv)


def _builds_netns(argv: list[str]) -> bool:
    names = [os.path.basename(a) for a in argv]
    return "ip" in names and any(argv[i:i + 2] == ["netns", "add"] for i in range(len(argv)))


def _cuda_allocations() -> int:
    if not torch.cuda.is_initialized():
        return -1
    return int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))


_recorders: list[set] = []  # the innermost block records (a test that runs tests, as pytester does, sees none of theirs)


def _record(tier: str) -> None:
    if _recorders:
        _recorders[-1].add(tier)


def _popen(init):
    def popen(self, args, *a, **k):
        argv = _argv(args)
        if _runs_python(argv) and not _started_by_the_compiler():
            _record("multiprocess")
        if _builds_netns(argv):
            _record("netns")
        return init(self, args, *a, **k)

    return popen


def _recorded(tier: str, function):
    def recorded(*a, **k):
        _record(tier)
        return function(*a, **k)

    return recorded


def _process_start(start):
    def started(*a, **k):
        if not _started_by_the_compiler():
            _record("multiprocess")
        return start(*a, **k)

    return started


def _patches() -> list[tuple[object, str, object]]:
    patches = [(subprocess.Popen, "__init__", _popen(subprocess.Popen.__init__)),
               (multiprocessing.process.BaseProcess, "start", _process_start(multiprocessing.process.BaseProcess.start)),
               (Loop, "__init__", _recorded("e2e", Loop.__init__))]
    for name in BENCH_ENTRIES:  # imported here: a test's own import of main then gets the recorded one
        module = importlib.import_module(name)
        patches.append((module, "main", _recorded("e2e", module.main)))
    return patches


@contextlib.contextmanager
def recording(used: set):
    """Add to ``used`` the tiers that the code run inside the block uses."""
    saved = []
    if not _recorders:
        patches = _patches()
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
        for obj, attr, new in patches:
            setattr(obj, attr, new)
    _recorders.append(used)
    cuda_before = _cuda_allocations()
    try:
        yield used
    finally:
        if _cuda_allocations() > cuda_before:
            used.add("gpu")
        _recorders.pop()
        for obj, attr, old in saved:
            setattr(obj, attr, old)


def tiers_of(item) -> set[str]:
    return {m.name for m in item.iter_markers() if m.name in TIERS}


def misfiled_gpu_tests(items, files) -> list[str]:
    """The gpu-marked tests of ``items`` outside ``files`` (``bench.gpu_check.TEST_FILES``, the files whose gpu
    tests ``make gpu-check`` runs): tests no GPU run would ever run."""
    return [i.nodeid for i in items if i.get_closest_marker("gpu") and i.nodeid.split("::")[0] not in files]


def pytest_collection_modifyitems(config, items):
    from bench.gpu_check import TEST_FILES

    misfiled = misfiled_gpu_tests(items, TEST_FILES)
    if misfiled:
        raise pytest.UsageError(f"gpu-marked tests outside bench.gpu_check.TEST_FILES, whose gpu tests make gpu-check "
                                f"runs: {', '.join(misfiled)}: add their files to TEST_FILES (and a tier's selection)")
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # module fixtures (a pipeline run shared by a module's tests) run in the set-up of the first test using them
    with recording(item.stash.setdefault(_used, set())):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    used = item.stash.setdefault(_used, set())
    with recording(used):
        result = yield
    unmarked = sorted(used - tiers_of(item))
    if unmarked:
        pytest.fail(f"{item.nodeid} uses the tier(s) {', '.join(unmarked)} without the mark: add "
                    f"{' '.join('@pytest.mark.' + t for t in unmarked)} (or the module's pytestmark); "
                    "see tests/tiers.py", pytrace=False)
    return result
