"""What the framework integration tests share: workers whose process group counts every byte.

The workers join a ``"recording"`` process group: gloo underneath, with every
collective's input bytes counted on the way in. That sees what Python-level
wrappers cannot, the C++ all-reduce of DDP's reducer included, so the tests
compare all the traffic of a step, the framework's own, with SLAMB's ledger.
"""
from __future__ import annotations

import os
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from harness.distributed import free_port, shutdown
from harness.local import spawn


def _nbytes(tensors) -> int:
    flat = []
    for t in tensors:
        flat.extend(t if isinstance(t, (list, tuple)) else [t])
    return sum(t.numel() * t.element_size() for t in flat)


BACKENDS: list = []  # this process's recording backends: the default group's and every subgroup's


class RecordingBackend(C10dBackend):
    """gloo, with the bytes each collective is handed counted per operation (this rank's input, the
    ledger's ``payload``)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.sent: Counter = Counter()
        BACKENDS.append(self)

    def getBackendName(self):
        return "recording"

    def allreduce(self, tensors, opts):
        self.sent["all_reduce"] += _nbytes(tensors)
        return self.inner.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        self.sent["all_reduce"] += _nbytes(tensors)
        return self.inner.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors, opts):
        self.sent["broadcast"] += _nbytes(tensors)  # on every rank, as the ledger counts it
        return self.inner.broadcast(tensors, opts)

    def allgather(self, outputs, inputs, opts):
        self.sent["all_gather"] += _nbytes(inputs)
        return self.inner.allgather(outputs, inputs, opts)

    def _allgather_base(self, output, input, opts):
        self.sent["all_gather"] += _nbytes([input])
        return self.inner._allgather_base(output, input, opts)

    def all_gather_single(self, output, input, opts):
        self.sent["all_gather"] += _nbytes([input])
        return self.inner.all_gather_single(output, input, opts)

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        self.sent["all_to_all"] += _nbytes([input])
        return self.inner.alltoall_base(output, input, output_splits, input_splits, opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        self.sent["all_to_all"] += _nbytes([input])
        return self.inner.all_to_all_single(output, input, output_splits, input_splits, opts)

    def reduce_scatter_single(self, output, input, opts):
        self.sent["reduce_scatter"] += _nbytes([input])
        return self.inner.reduce_scatter_single(output, input, opts)

    def reduce(self, tensors, opts):
        self.sent["reduce"] += _nbytes(tensors)
        return self.inner.reduce(tensors, opts)

    def gather(self, outputs, inputs, opts):
        self.sent["gather"] += _nbytes(inputs)
        return self.inner.gather(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        self.sent["scatter"] += _nbytes(inputs)
        return self.inner.scatter(outputs, inputs, opts)

    def barrier(self, opts):
        return self.inner.barrier(opts)


def sent_bytes() -> int:
    """The bytes this rank has handed to collectives of the default group so far."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return sum(backend.sent.values())


def sent_by_op() -> Counter:
    """The bytes this rank has handed to collectives of every group so far, by operation."""
    return sum((b.sent for b in BACKENDS), Counter())


def _entry(rank, fn, world_size, port, outdir, args):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
                      OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    dist.Backend.register_backend("recording", RecordingBackend, devices=["cpu"])
    dist.init_process_group("recording", init_method=f"file://{os.path.join(outdir, 'rendezvous')}",
                            rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(outdir, f"{rank}.pt"))
    finally:
        shutdown()


def run(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` in ``world_size`` processes on a recording process group; results by rank."""
    with tempfile.TemporaryDirectory() as outdir:
        spawn(_entry, (fn, world_size, free_port(), outdir, args), world_size, fn.__module__)
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


class StepProbe:
    """Per optimizer step: the gradients ``step()`` sees and the bytes sent since the previous step.

    Bytes are read in a pre-hook on the (unwrapped) optimizer's ``step``, so
    an interval holds one step's traffic whatever the loop's order (backward
    before ``step()``, or inside it through a closure as in Lightning).
    Gradients are read in a post-hook: after the closure has run.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.grads: list[torch.Tensor] = []
        self.marks: list[int] = []
        self.ledger: list[int] = []
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, opt, args, kwargs):
        self.marks.append(sent_bytes())
        self.ledger.append(opt.ledger.summary()["total"]["all"]["payload"])

    def _post(self, opt, args, kwargs):
        self.grads.append(torch.cat([p.grad.reshape(-1).clone() for g in opt.param_groups for p in g["params"]
                                     if p.grad is not None]))

    def intervals(self) -> dict:
        """Bytes sent and bytes in the ledger between consecutive step pre-hooks (one fewer than the steps)."""
        diff = lambda xs: [b - a for a, b in zip(xs, xs[1:])]  # noqa: E731
        return {"grads": self.grads, "sent": diff(self.marks), "ledger": diff(self.ledger)}


def refusal(build) -> str:
    """On a worker: the error ``build()`` (a framework's set-up) raises, or "built"."""
    try:
        build()
    except RuntimeError as e:
        return str(e)
    return "built"


def assert_refused_in_one_line(worker, fix: str) -> None:
    """Each rank of a 2-process launch whose framework sees one process refuses, in one line naming ``fix``."""
    for message in run(worker, 2):
        assert "runs 1 process(es) of the 2 launched" in message and fix in message
        assert "\n" not in message
