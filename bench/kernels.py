"""What one optimizer step launches, counted from ``torch.profiler``.

A step's cost on many small tensors is its launches, not its arithmetic: each eager op is a dispatch on
the host (and at least one kernel on a GPU), each compiled graph one call. :func:`kernels_per_step`
profiles one step and counts:

* ``host_ops``: the ops the step dispatches from Python (aten ops not nested in another op) plus its
  compiled graph calls (dynamo's cache lookups, one per call), the count that is constant in the number
  of tensors when the step is (a foreach op counts once, whatever it loops over);
* ``graph_calls``: those compiled graph calls alone;
* ``kernels``: what runs: on a GPU the device kernels the profiler records; on a CPU the compiled graph
  calls plus the innermost ops that compute (aten ops, less those that only make views or allocate, with
  no such op inside them), so a foreach op counts once per tensor it loops over, as its kernels do.

The profiler with CPU activity alone costs a few milliseconds per step: cheap enough for tests. (A
``TorchDispatchMode`` cannot count beside compiled graphs: dynamo runs a graph eagerly under one.)
"""
from __future__ import annotations

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# dynamo's event for each call of a compiled function
GRAPH_CALL = "TorchDynamo Cache Lookup"
# leaf ops that launch no kernel: views, metadata and allocations
NO_KERNEL = {f"aten::{name}" for name in (
    "as_strided", "view", "_reshape_alias", "reshape", "slice", "select", "unsqueeze", "squeeze", "narrow",
    "expand", "detach", "t", "transpose", "permute", "alias", "unbind", "split", "split_with_sizes", "empty",
    "empty_strided", "empty_like", "resolve_conj", "resolve_neg", "promote_types", "lift_fresh",
    "_local_scalar_dense", "is_nonzero", "result_type")}


def _is_op(event) -> bool:
    return event.name.startswith("aten::")


def _computes(event) -> bool:
    return _is_op(event) and event.name not in NO_KERNEL


def _nearest(event, pred):
    """The closest ancestor of ``event`` for which ``pred`` holds, or None."""
    parent = event.cpu_parent
    while parent is not None and not pred(parent):
        parent = parent.cpu_parent
    return parent


def count_events(events) -> dict:
    """``host_ops``, ``graph_calls`` and ``kernels`` (the module docstring) of profiler ``events``."""
    events = list(events)
    graph_calls = sum(e.name == GRAPH_CALL for e in events)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    top = sum(_is_op(e) and _nearest(e, _is_op) is None for e in host)
    # an op that computes through others (a foreach op, linalg_vector_norm through its views) is not a kernel
    # itself: those of its descendants that compute and contain no other are
    compute = [e for e in host if _computes(e)]
    outer = {id(_nearest(e, _computes)) for e in compute}
    leaves = sum(id(e) not in outer for e in compute)
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    return {"host_ops": graph_calls + top, "graph_calls": graph_calls,
            "kernels": len(device) if device else graph_calls + leaves}


def kernels_per_step(step, device: str | torch.device = "cpu") -> dict:
    """:func:`count_events` of one call of ``step`` (an optimizer's ``step``, warmed up and compiled before)."""
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        step()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    return count_events(prof.events())
