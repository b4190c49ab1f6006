"""Collectives over torch.distributed that keep an exact byte ledger.

Every optimizer of the package communicates only through these functions, so
that the volumes it reports are the volumes it handed to the collectives, by
kind ("grads", "momentum", "params", ...), and comparable across optimizers.

Two figures are kept per rank:

* payload: the bytes of the tensor this rank hands to the collective
  (``numel * element_size`` of its input);
* wire: the bytes this rank puts on the network when the collective runs the
  bandwidth-optimal ring algorithm: all-reduce ``2 (n-1)/n * payload``,
  reduce-scatter and all-to-all ``(n-1)/n * payload``, all-gather
  ``(n-1) * payload``, broadcast ``payload``.

Nothing is recorded when the world has one rank: no collective runs then.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = [
    "CommLedger",
    "world_size",
    "rank",
    "wire_factor",
    "all_reduce_sum_",
    "all_reduce_mean_",
    "MeanWork",
    "all_gather_into_tensor",
    "all_to_all_single",
    "broadcast_",
    "agree_any",
    "agree_max",
]


def world_size(group: dist.ProcessGroup | None = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def wire_factor(op: str, n: int) -> float:
    """Bytes a rank sends per payload byte under the ring algorithm of ``op``."""
    if n <= 1:
        return 0.0
    factors = {
        "all_reduce": 2.0 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "all_gather": float(n - 1),
        "broadcast": 1.0,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(factors)}")
    return factors[op]


@dataclasses.dataclass
class Tally:
    payload: int = 0
    wire: float = 0.0
    calls: int = 0

    def add(self, other: "Tally") -> None:
        self.payload += other.payload
        self.wire += other.wire
        self.calls += other.calls


class CommLedger:
    """Bytes handed to collectives by this rank, by kind, per step and in total.

    The optimizer that owns the ledger calls :meth:`end_step` at the end of
    each ``step()``; whatever was recorded since the previous call (DDP's
    gradient buckets during backward included) belongs to that step.
    """

    def __init__(self) -> None:
        self.total: dict[str, Tally] = defaultdict(Tally)
        self.current: dict[str, Tally] = defaultdict(Tally)
        self.last_step: dict[str, Tally] = {}
        self.steps = 0

    def record(self, kind: str, op: str, payload_bytes: int, n: int) -> None:
        if n <= 1:
            return
        tally = self.current[kind]
        tally.payload += int(payload_bytes)
        tally.wire += payload_bytes * wire_factor(op, n)
        tally.calls += 1

    def end_step(self) -> None:
        for kind, tally in self.current.items():
            self.total[kind].add(tally)
        self.last_step = dict(self.current)
        self.current = defaultdict(Tally)
        self.steps += 1

    def summary(self) -> dict:
        """Plain numbers: payload/wire bytes and calls by kind, per last step and in total."""

        def flat(tallies: dict[str, Tally]) -> dict:
            out = {k: dataclasses.asdict(v) for k, v in sorted(tallies.items())}
            out["all"] = {
                "payload": sum(v.payload for v in tallies.values()),
                "wire": sum(v.wire for v in tallies.values()),
                "calls": sum(v.calls for v in tallies.values()),
            }
            return out

        total = dict(self.total)
        for kind, tally in self.current.items():  # recorded but not yet closed by a step
            merged = dataclasses.replace(total.get(kind, Tally()))
            merged.add(tally)
            total[kind] = merged
        return {"steps": self.steps, "last_step": flat(self.last_step), "total": flat(total)}

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "total": {k: dataclasses.asdict(v) for k, v in self.total.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.total = defaultdict(Tally, {k: Tally(**v) for k, v in state["total"].items()})
        self.current = defaultdict(Tally)
        self.last_step = {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce_sum_(tensor, *, kind: str, ledger: CommLedger | None, group=None, async_op=False):
    """In-place sum over ranks. Returns the work handle when ``async_op``."""
    n = world_size(group)
    if n == 1:
        return None
    if ledger is not None:
        ledger.record(kind, "all_reduce", _nbytes(tensor), n)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class MeanWork:
    """An all-reduce mean in flight: :meth:`wait` returns the averaged tensor."""

    def __init__(self, tensor: torch.Tensor, work=None, divide_by: int | None = None):
        self.tensor, self.work, self.divide_by = tensor, work, divide_by

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.divide_by is not None:
                self.tensor.div_(self.divide_by)
        return self.tensor


def all_reduce_mean_(tensor: torch.Tensor, *, kind: str, ledger: CommLedger | None, group=None,
                     async_op: bool = False):
    """In-place mean over ranks; with ``async_op`` a :class:`MeanWork` to ``wait()`` on.

    Full-precision tensors are summed then divided (the sum is exact to the
    last bit on every rank, so the mean is too). Half-precision tensors are
    divided first, so the sum of n workers cannot overflow fp16's range.
    """
    n = world_size(group)
    if n == 1:
        return MeanWork(tensor) if async_op else tensor
    low_precision = tensor.dtype in (torch.float16, torch.bfloat16)
    if low_precision:
        tensor.div_(n)
    work = all_reduce_sum_(tensor, kind=kind, ledger=ledger, group=group, async_op=async_op)
    divide_by = None if low_precision else n
    if async_op:
        return MeanWork(tensor, work, divide_by)
    if divide_by is not None:
        tensor.div_(divide_by)
    return tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, kind: str, ledger, group=None):
    """``output`` (n * input.numel()) receives every rank's ``input`` in rank order."""
    n = world_size(group)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return output
    if ledger is not None:
        ledger.record(kind, "all_gather", _nbytes(input), n)
    dist.all_gather_single(output, input, group=group)
    return output


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *, kind: str, ledger, group=None):
    """Equal split: rank j receives the j-th of n equal chunks of every rank's ``input``."""
    n = world_size(group)
    if n == 1:
        output.copy_(input)
        return output
    if ledger is not None:
        ledger.record(kind, "all_to_all", _nbytes(input), n)
    dist.all_to_all_single(output, input, group=group)
    return output


def broadcast_(tensor: torch.Tensor, src: int = 0, *, kind: str, ledger, group=None):
    n = world_size(group)
    if n == 1:
        return tensor
    if ledger is not None:
        ledger.record(kind, "broadcast", _nbytes(tensor), n)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def agree_max(values: torch.Tensor, *, ledger, group=None) -> torch.Tensor:
    """The element-wise maximum over the ranks of ``values`` (a float32 copy, the same on every rank).

    The one place where rank-local conditions become a collective decision,
    so that no rank ever skips a collective alone.
    """
    x = values.detach().reshape(-1).to(torch.float32, copy=True)
    n = world_size(group)
    if n > 1:
        if ledger is not None:
            ledger.record("control", "all_reduce", _nbytes(x), n)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def agree_any(flag: torch.Tensor, *, ledger, group=None) -> bool:
    """True on every rank when ``flag`` (a 0-d bool/number tensor) is set on any rank."""
    return bool(agree_max(flag.reshape(1), ledger=ledger, group=group).item() > 0)
