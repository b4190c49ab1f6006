"""Test tiers, derived from what a test does so that a new test lands in the right one.

* ``multiprocess``: starts worker processes (the local gloo launcher, torchrun,
  the pipelines' elastic launcher, or any subprocess);
* ``e2e``: runs a whole pipeline (a ``train`` entry, a demo, a bench) end to end;
* ``netns``: builds network namespaces (root only; skipped with the reason elsewhere);
* ``gpu``: needs a CUDA device (skipped where none is present, as in CI).

``make test`` runs every tier; ``make test-quick`` (``-m "not multiprocess and
not e2e"``) is the quick subset for the edit-test loop.
"""
from __future__ import annotations

import inspect
import re
import textwrap

import pytest
import torch

# what a test's body (or a module-level helper it calls) contains when it starts processes / runs a pipeline
MULTIPROCESS = re.compile(r"distributed\.run\(|(?<![\w.])run\(|run_local\(|subprocess\.|mp\.spawn\(|torchrun|launch\(")
E2E = re.compile(r"\btrain\(|\bmain\(|demo|scripts/study|bench\.|netbench|run_job\(|compose_and_run")


def _reachable_source(funcs, module, depth: int = 3) -> str:
    """The sources of ``funcs`` plus those of the module-level functions they name, to ``depth`` calls."""
    seen, todo, text = set(), list(funcs), []
    for _ in range(depth):
        nxt = []
        for f in todo:
            if f in seen:
                continue
            seen.add(f)
            try:
                src = textwrap.dedent(inspect.getsource(f))
            except (OSError, TypeError):
                continue
            text.append(src)
            for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", src)):
                obj = getattr(module, name, None)
                if inspect.isfunction(obj) and obj.__module__ == module.__name__:
                    nxt.append(obj)
        todo = nxt
    return "\n".join(text)


def pytest_collection_modifyitems(config, items):
    for item in items:
        func, module = getattr(item, "function", None), getattr(item, "module", None)
        if func is None or module is None:
            continue
        fixtures = [defs[-1].func for name, defs in item._fixtureinfo.name2fixturedefs.items()
                    if defs and getattr(defs[-1].func, "__module__", None) == module.__name__]
        src = _reachable_source([func, *fixtures], module)
        if MULTIPROCESS.search(src):
            item.add_marker(pytest.mark.multiprocess)
        if E2E.search(src):
            item.add_marker(pytest.mark.e2e)
        if any("network namespaces" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.netns)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
