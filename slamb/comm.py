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
  ``(n-1) * payload``, broadcast ``payload``, a point-to-point send (a
  joining replica's state, kind ``"heal"``) ``payload``.

Nothing is recorded when the world has one rank: no collective runs then.

Every collective also accepts a :class:`slamb.topology.NodeTopology` as its
group: a node is then one worker (see that module), a mean runs over the
inter-node groups and then inside the node, and each record carries its level
(``"inter"``, ``"intra"``, or ``"world"`` for a collective over every rank),
kept beside the totals as ``levels`` in :meth:`CommLedger.summary`.

A :class:`slamb.topology.MeshTopology` (FSDP2's sharded parameters) is accepted likewise: a worker is
a replica, and each rank reduces with the ranks holding its shard (level ``"replicate"``).

A :class:`Collectives` group runs every collective itself: torchft's manager
(:mod:`slamb.integrations.torchft`), whose members change between steps and
whose failed collectives return instead of hanging.

``comm_dtype=torch.int8`` in :func:`all_reduce_mean_`: a quantised
reduce-scatter then all-gather, one float32 scale per block of 256 entries
(see :func:`int8_mean_`).

A packed buffer may carry several kinds: ``kind`` is then a tuple of runs
``((kind, entries), ...)`` in buffer order, and each collective records, per
kind, the bytes of that kind's entries it is handed (one record per kind, so
a collective carrying two kinds is a call of each). Padding a collective adds
belongs to the run it pads (:func:`_over_nodes`, :func:`all_reduce_mean_`).
"""
from __future__ import annotations

import abc
import dataclasses
import math
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from .topology import MeshTopology, NodeTopology

# The kinds the ledger keeps bytes apart by: CommLedger.record refuses any other, and a reader (the tables,
# the demos, the benches) names a kind by its constant here.
KINDS = (
    "grads",  # gradients: DDP's all-reduce, a dense optimizer's, the averaging inside a node
    "momentum",  # SLAMB's sampled momentum entries
    "momentum_dense",  # SLAMB's always-averaged tensors, packed beside the sampled entries
    "momentum_1bit",  # 1-bit LAMB's compressed momentum
    "scales",  # the scales of compressed values (1-bit LAMB, int8)
    "params",  # parameter syncs and broadcasts
    "control",  # small agreements: scales, flags, counts
    "norms",  # the per-shard sums of squares of the trust ratios (FSDP2)
    "residual",  # DGC's residuals averaged at a density change
    "sparse_values",  # DGC's selected gradient entries
    "sparse_indices",  # and their indices
    "powersgd_p",  # PowerSGD's factors
    "powersgd_q",
    "heal",  # a joining replica's state (torchft)
    "eval",  # the ranks' models averaged for an evaluation
    "fsdp_all_gather",  # FSDP2's own collectives: what sharding costs whatever the optimizer
    "fsdp_reduce_scatter",
)
(GRADS, MOMENTUM, MOMENTUM_DENSE, MOMENTUM_1BIT, SCALES, PARAMS, CONTROL, NORMS, RESIDUAL, SPARSE_VALUES,
 SPARSE_INDICES, POWERSGD_P, POWERSGD_Q, HEAL, EVAL, FSDP_ALL_GATHER, FSDP_REDUCE_SCATTER) = KINDS

# a collective's kind, or the kinds of a packed buffer's runs in order: ((kind, entries), ...)
Kind = str | tuple[tuple[str, int], ...]

# newer torch names all_gather_into_tensor all_gather_single (reduce_scatter_tensor reduce_scatter_single) and
# warns on the old names; 2.11 has only the old ones. Looked up at each call, as torch's own callers do, so
# a wrapper installed on torch.distributed (a profiler, a test's byte counter) sees these calls too.
def _all_gather_single(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


__all__ = [
    "CommLedger",
    "Collectives",
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
    "int8_mean_",
    "int8_layout",
    "at_level",
]


class Collectives(abc.ABC):
    """A group that runs its own collectives; the functions of this module hand it each one over it.

    Its size and rank may change between steps (the members of a fault-tolerant job), never within one.
    ``op`` is a ``torch.distributed.ReduceOp``; with ``async_op`` a call returns a handle whose ``wait()``
    completes it, else it returns once done.
    """

    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def rank(self) -> int: ...

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op, async_op: bool = False): ...

    @abc.abstractmethod
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False): ...

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


# The handles of the last collectives over CPU tensors (gloo). A gloo worker thread that drops the last reference
# to a finished collective frees its tensors there, and freeing a tensor Python has seen takes the GIL: once the
# interpreter has begun to finalize, that aborts the process ("terminate called without an active exception"). A
# rank whose last act is a collective (the ranks' average saved or scored before exit) would exit into that race
# with the worker thread; held here, the last collectives are freed by the main thread. Two: gloo's worker threads
# by default. What they hold (at most two of the averaging's buckets) stays allocated until later collectives
# replace them; device tensors are not held, so no accelerator memory is.
_LAST_WORKS: deque = deque(maxlen=2)


def _issued(work, tensor: torch.Tensor, async_op: bool):
    """``work``, the handle of a collective over ``tensor`` just issued with ``async_op=True``, kept; waited on
    unless ``async_op`` (then returned for the caller to wait on)."""
    if work is None:  # this rank is not in the group
        return None
    if tensor.device.type == "cpu":
        _LAST_WORKS.append(work)
    if async_op:
        return work
    work.wait()
    return None


def _all_reduce(tensor, op, group, async_op=False):
    if isinstance(group, Collectives):
        return group.all_reduce(tensor, op, async_op)
    return _issued(dist.all_reduce(tensor, op=op, group=group, async_op=True), tensor, async_op)


def world_size(group: dist.ProcessGroup | NodeTopology | MeshTopology | Collectives | None = None) -> int:
    """Ranks of ``group``; nodes of a :class:`NodeTopology`, replicas of a :class:`MeshTopology`."""
    if isinstance(group, Collectives):
        return group.size()
    if isinstance(group, NodeTopology):
        return group.n_nodes
    if isinstance(group, MeshTopology):
        return group.n_replicas
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | NodeTopology | MeshTopology | Collectives | None = None) -> int:
    """This rank in ``group``; its node in a :class:`NodeTopology`, its replica in a :class:`MeshTopology`."""
    if isinstance(group, Collectives):
        return group.rank()
    if isinstance(group, NodeTopology):
        return group.node
    if isinstance(group, MeshTopology):
        return group.replica
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
        "send": 1.0,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(factors)}")
    return factors[op]


@dataclasses.dataclass
class Tally:
    payload: int = 0
    wire: float = 0.0
    calls: int = 0
    levels: dict = dataclasses.field(default_factory=dict)  # level -> {"payload", "wire", "calls"} of those

    def add(self, other: "Tally") -> None:
        self.payload += other.payload
        self.wire += other.wire
        self.calls += other.calls
        for level, part in other.levels.items():
            mine = self.levels.setdefault(level, {"payload": 0, "wire": 0.0, "calls": 0})
            for key in mine:
                mine[key] += part[key]

    def as_dict(self) -> dict:
        out = {"payload": self.payload, "wire": self.wire, "calls": self.calls}
        if self.levels:
            out["levels"] = {k: dict(v) for k, v in sorted(self.levels.items())}
        return out


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

    def record(self, kind: str, op: str, payload_bytes: int, n: int, level: str | None = None) -> None:
        """``kind``: one of :data:`KINDS`. ``level``: where the collective runs (``"intra"``/``"inter"`` node,
        ``"world"``), kept apart too."""
        if kind not in KINDS:
            raise ValueError(f"unknown ledger kind {kind!r}: must be one of {list(KINDS)} (slamb.comm.KINDS)")
        if n <= 1:
            return
        one = Tally(int(payload_bytes), payload_bytes * wire_factor(op, n), 1)
        if level is not None:
            one.levels[level] = {"payload": one.payload, "wire": one.wire, "calls": 1}
        self.current[kind].add(one)

    def end_step(self) -> None:
        for kind, tally in self.current.items():
            self.total[kind].add(tally)
        self.last_step = dict(self.current)
        self.current = defaultdict(Tally)
        self.steps += 1

    def summary(self) -> dict:
        """Plain numbers: payload/wire bytes and calls by kind, per last step and in total."""

        def flat(tallies: dict[str, Tally]) -> dict:
            out = {k: v.as_dict() for k, v in sorted(tallies.items())}
            everything = Tally()
            for v in tallies.values():
                everything.add(v)
            out["all"] = everything.as_dict()
            return out

        total = {}
        for tallies in (self.total, self.current):  # the open step's records count in the total
            for kind, tally in tallies.items():
                total.setdefault(kind, Tally()).add(tally)
        return {"steps": self.steps, "last_step": flat(self.last_step), "total": flat(total)}

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "total": {k: v.as_dict() for k, v in self.total.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.total = defaultdict(Tally)
        for k, v in state["total"].items():
            self.total[k].add(Tally(v["payload"], v["wire"], v["calls"], v.get("levels", {})))
        self.current = defaultdict(Tally)
        self.last_step = {}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _runs(kind: Kind, numel: int) -> list[tuple[str, int]]:
    """``kind`` as runs ``[(kind, entries), ...]`` covering ``numel`` entries; empty runs dropped (all but one
    when every run is empty: the collective still runs and counts as a call)."""
    if isinstance(kind, str):
        return [(kind, numel)]
    runs = [(k, int(c)) for k, c in kind]
    if sum(c for _, c in runs) != numel:
        raise ValueError(f"kind runs {runs} cover {sum(c for _, c in runs)} entries, the tensor has {numel}")
    return [r for r in runs if r[1]] or runs[:1]


def _record(ledger, kind: Kind, op: str, t: torch.Tensor, n: int) -> None:
    """Record the bytes of ``t`` handed to ``op``, by the kinds of its entries."""
    if ledger is not None:
        for k, count in _runs(kind, t.numel()):
            ledger.record(k, op, count * t.element_size(), n)


class _AtLevel:
    """A ledger whose records carry ``level``."""

    def __init__(self, ledger: CommLedger, level: str):
        self.ledger, self.level = ledger, level

    def record(self, kind: str, op: str, payload_bytes: int, n: int) -> None:
        self.ledger.record(kind, op, payload_bytes, n, level=self.level)


def at_level(ledger: CommLedger | None, level: str):
    """``ledger`` recording at ``level`` (None stays None)."""
    return None if ledger is None else _AtLevel(getattr(ledger, "ledger", ledger), level)


def _plain(group, ledger):
    """A collective over every rank of ``group``: the process group, and the ledger at level "world"."""
    if isinstance(group, (NodeTopology, MeshTopology)):
        return group.group, at_level(ledger, "world")
    return group, ledger


def _replicas(group, ledger):
    """A collective among the workers of a :class:`MeshTopology`: each rank with the ranks holding its shard
    (level "replicate"); call it once ``world_size(group) > 1``."""
    if isinstance(group, MeshTopology):
        return group.replicate, at_level(ledger, "replicate")
    return group, ledger


def all_reduce_sum_(tensor, *, kind: Kind, ledger: CommLedger | None, group=None, async_op=False):
    """In-place sum over ranks (nodes of a topology). Returns the work handle when ``async_op``."""
    if isinstance(group, NodeTopology):
        return _over_nodes(tensor, group, kind, ledger, async_op,
                           lambda chunk, kinds, led: MeanWork(chunk, all_reduce_sum_(chunk, kind=kinds, ledger=led,
                                                                                     group=group.inter, async_op=True)))
    n = world_size(group)
    if n == 1:
        return None
    group, ledger = _replicas(group, ledger)
    _record(ledger, kind, "all_reduce", tensor, n)
    return _all_reduce(tensor, dist.ReduceOp.SUM, group, async_op)


class _Works:
    """Several collectives in flight, waited on together."""

    def __init__(self, *works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class MeanWork:
    """An all-reduce mean in flight: :meth:`wait` returns the averaged tensor.

    ``finish``: what completes it once ``work`` is done (a second collective: the all-gather of a
    quantised or hierarchical exchange), writing the result into ``tensor``.
    """

    def __init__(self, tensor: torch.Tensor, work=None, divide_by: int | None = None,
                 wire: torch.Tensor | None = None, unscale: torch.Tensor | None = None, finish=None):
        self.tensor, self.work, self.divide_by = tensor, work, divide_by
        self.wire, self.unscale = wire, unscale  # the tensor sent in another dtype, and its scale's inverse
        self.finish = finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.wire is not None:
                self.tensor.copy_(self.wire)
                self.wire = None
            if self.unscale is not None:
                self.tensor.mul_(self.unscale)
            if self.divide_by is not None:
                self.tensor.div_(self.divide_by)
            if self.finish is not None:
                self.finish()
                self.finish = None
        return self.tensor


def _over_nodes(tensor: torch.Tensor, topo: NodeTopology, kind: Kind, ledger, async_op: bool, reduce):
    """Reduce ``tensor`` (identical on the L ranks of each node) over the nodes: local rank l reduces the
    l-th of L chunks over its inter-node group (``reduce(chunk, chunk_kind, ledger)``: a :class:`MeanWork`),
    then the node's ranks all-gather the reduced chunks. Every rank ends with the same bytes (each chunk comes
    from one inter-node collective, whose ranks all receive the same result).

    Each run of ``kind`` is cut into L zero-padded pieces of its own and chunk l is the l-th piece of every
    run: a run's padding is sent as that run's kind. A single kind is one run (chunk l: entries l c .. (l+1) c)."""
    if topo.n_nodes == 1 or tensor.numel() == 0:
        return MeanWork(tensor) if async_op else tensor
    runs, local = _runs(kind, tensor.numel()), topo.local_world_size
    widths = [-(-count // local) for _, count in runs]
    padded = tensor.new_zeros(local, sum(widths))  # row l: local rank l's chunk
    cols = [0]
    for (_, count), w, part in zip(runs, widths, tensor.reshape(-1).split([c for _, c in runs])):
        piece = tensor.new_zeros(local * w)
        piece[:count] = part
        padded[:, cols[-1]:cols[-1] + w] = piece.view(local, w)
        cols.append(cols[-1] + w)
    chunk = padded[topo.local_rank]
    chunk_kind = kind if isinstance(kind, str) else tuple((k, w) for (k, _), w in zip(runs, widths))
    inner = reduce(chunk, chunk_kind, at_level(ledger, "inter"))

    def gather() -> None:
        whole = all_gather_into_tensor(padded.new_empty(padded.numel()), chunk, kind=chunk_kind,
                                       ledger=at_level(ledger, "intra"), group=topo.intra).view_as(padded)
        parts = [whole[:, lo:hi].reshape(-1)[:count] for (_, count), lo, hi in zip(runs, cols, cols[1:])]
        tensor.copy_((parts[0] if len(parts) == 1 else torch.cat(parts)).view_as(tensor))

    work = MeanWork(tensor, inner, finish=gather)
    return work if async_op else work.wait()


# fp16's largest finite value: a sum of n terms each at most this / n cannot overflow
_FP16_MAX = 65504.0


def fp16_scale(peak: torch.Tensor, n: int) -> torch.Tensor:
    """The power of two that brings ``peak``, the largest |entry| of any rank, to at most 65504 / n:
    n fp16 terms then sum without overflow, and every term sits as high in fp16's range as that
    allows, so small entries do not fall into its subnormals or to zero. On the device: no host read."""
    # 2^-100 keeps an all-zero tensor finite; the exponent stays well inside float32's range
    e = torch.floor(math.log2(_FP16_MAX / n) - torch.log2(peak.to(torch.float32).clamp_min(2.0**-100)))
    return torch.exp2(e)


_INT8_MAX = 127
# entries per int8 scale: a packed momentum vector concatenates tensors whose magnitudes differ by decades,
# and one scale over a whole chunk would round the entries of the small ones to zero; 4 scale bytes per
# 256 values cost 1.6% more bytes
INT8_BLOCK = 256


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of the 2-D ``x`` as int8 and its float32 scale ``max|row| / 127`` (round to nearest:
    an entry is off by at most half its row's scale; an all-zero row has scale 0)."""
    scales = x.abs().amax(dim=1).to(torch.float32) / _INT8_MAX
    q = torch.round(x.to(torch.float32) / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    return q.to(torch.int8), scales


def int8_layout(numel: int, n: int, block: int = INT8_BLOCK) -> tuple[int, int]:
    """``(c, b)``: entries per rank's chunk and per scale; ``c = ceil(numel / n)`` rounded up to whole
    blocks of ``b = min(block, ceil(numel / n))`` entries."""
    b = max(1, min(block, -(-numel // n)))
    return b * -(-numel // (n * b)), b


def int8_mean_(tensor: torch.Tensor, *, kind: str, ledger: CommLedger | None, group=None,
               async_op: bool = False, scale_kind: str = "scales", block: int = INT8_BLOCK):
    """In-place mean over ranks sent as int8, as the 1-bit all-reduce of :mod:`slamb.compression.onebit`
    is built with int8 values in place of signs: the D entries are cut into n chunks of c entries
    (:func:`int8_layout`, zero-padded), each quantised in blocks of b entries with one float32 scale per
    block; an all-to-all hands rank j chunk j of every rank (``n c`` bytes, kind ``kind``; ``4 n c / b``
    bytes of scales, kind ``scale_kind``); rank j dequantises and averages them, requantises the average
    per block, and an all-gather (``c`` bytes and ``4 c / b`` of scales) gives every rank every chunk.
    Every rank decodes the same bytes: the result is identical on all of them.

    Per entry the error is at most ``mean_i(s_i) / 2 + s' / 2``, with ``s_i`` rank i's scale of the
    entry's block (``max|x_i| / 127`` over it) and ``s'`` the scale of the averaged block.
    """
    n = world_size(group)
    if n == 1:
        return MeanWork(tensor) if async_op else tensor
    numel = tensor.numel()
    c, b = int8_layout(numel, n, block)
    x = torch.zeros(n * c, dtype=torch.float32, device=tensor.device)
    x[:numel] = tensor.reshape(-1)
    q, scales = quantize_int8(x.view(-1, b))  # rows: n chunks of c / b blocks each, in order
    recv, recv_scales = torch.empty_like(q), torch.empty_like(scales)
    works = _Works(all_to_all_single(recv.view(-1), q.view(-1), kind=kind, ledger=ledger, group=group, async_op=True),
                   all_to_all_single(recv_scales, scales, kind=scale_kind, ledger=ledger, group=group, async_op=True))

    def finish() -> None:
        decoded = recv.to(torch.float32).mul_(recv_scales.unsqueeze(1))  # n ranks x c / b blocks, b each
        mean = decoded.view(n, c).sum(0).div_(n)
        mine, my_scales = quantize_int8(mean.view(-1, b))
        values, all_scales = torch.empty_like(q), torch.empty_like(scales)
        all_gather_into_tensor(values.view(-1), mine.view(-1), kind=kind, ledger=ledger, group=group)
        all_gather_into_tensor(all_scales, my_scales, kind=scale_kind, ledger=ledger, group=group)
        out = values.to(torch.float32).mul_(all_scales.unsqueeze(1))
        tensor.copy_(out.view(-1)[:numel].view_as(tensor))

    work = MeanWork(tensor, works, finish=finish)
    return work if async_op else work.wait()


def all_reduce_mean_(tensor: torch.Tensor, *, kind: Kind, ledger: CommLedger | None, group=None,
                     async_op: bool = False, comm_dtype: torch.dtype | None = None):
    """In-place mean over ranks (nodes of a topology); with ``async_op`` a :class:`MeanWork` to ``wait()`` on.

    Full-precision tensors are summed then divided (the sum is exact to the
    last bit on every rank, so the mean is too). Half-precision tensors are
    divided first, so the sum of n workers cannot overflow fp16's range.

    ``comm_dtype``: send ``tensor`` (full precision) in that dtype and write the mean back into
    it. float16 is scaled first by a power of two (:func:`fp16_scale`) of the largest |entry| of any
    rank (one more 4-byte all-reduce, kind ``"control"``), so that its error stays at fp16's rounding
    at any n where dividing by n first would flush small values to zero; bfloat16 has float32's
    range and is summed as it is; int8 is :func:`int8_mean_` (quantised per chunk).
    """
    if isinstance(group, NodeTopology):
        return _over_nodes(tensor, group, kind, ledger, async_op,
                           lambda chunk, kinds, led: all_reduce_mean_(chunk, kind=kinds, ledger=led, group=group.inter,
                                                                      async_op=True, comm_dtype=comm_dtype))
    n = world_size(group)
    if n == 1:
        return MeanWork(tensor) if async_op else tensor
    group, ledger = _replicas(group, ledger)
    if comm_dtype == torch.int8 and not isinstance(kind, str):
        # one int8 mean per run, its scales of its kind: in one quantised buffer a block straddling two runs
        # has one scale for both and the chunk padding belongs to neither, so no split of those bytes would be
        # measured; apart, each run's values, scales and padding are its own (more calls, a few bytes more)
        runs = _runs(kind, tensor.numel())
        parts = tensor.view(-1).split([c for _, c in runs])
        works = [int8_mean_(part, kind=k, scale_kind=k, ledger=ledger, group=group, async_op=True)
                 for (k, _), part in zip(runs, parts)]
        mean = MeanWork(tensor, _Works(*works))
        return mean if async_op else mean.wait()
    if comm_dtype == torch.int8:
        return int8_mean_(tensor, kind=kind, ledger=ledger, group=group, async_op=async_op)
    if comm_dtype is not None and comm_dtype != tensor.dtype:
        unscale = None
        if comm_dtype == torch.float16 and tensor.numel():
            peak = agree_max(tensor.abs().amax(), ledger=ledger, group=group)  # the ranks agree on one scale
            scale = fp16_scale(peak, n)
            wire, unscale = (tensor * scale).to(comm_dtype), scale.reciprocal_()
        else:
            wire = tensor.to(comm_dtype)
        work = all_reduce_sum_(wire, kind=kind, ledger=ledger, group=group, async_op=True)
        mean = MeanWork(tensor, work, n, wire, unscale)
        return mean if async_op else mean.wait()
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


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, *, kind: Kind, ledger, group=None):
    """``output`` (n * input.numel()) receives every rank's ``input`` in rank order (one per node, in
    node order, over this rank's inter-node group of a topology)."""
    if isinstance(group, NodeTopology):
        group, ledger = group.inter, at_level(ledger, "inter")
    n = world_size(group)
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return output
    group, ledger = _replicas(group, ledger)
    _record(ledger, kind, "all_gather", input, n)
    if isinstance(group, Collectives):
        group.all_gather_into_tensor(output, input)
    else:
        _issued(_all_gather_single(output, input, group=group, async_op=True), output, False)
    return output


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *, kind: Kind, ledger, group=None,
                      async_op: bool = False):
    """Equal split: rank j receives the j-th of n equal chunks of every rank's ``input`` (node j of a
    topology, over the inter-node group). With ``async_op`` the work handle, else ``output``."""
    if isinstance(group, NodeTopology):
        group, ledger = group.inter, at_level(ledger, "inter")
    n = world_size(group)
    if n == 1:
        output.copy_(input)
        return MeanWork(output) if async_op else output
    group, ledger = _replicas(group, ledger)
    _record(ledger, kind, "all_to_all", input, n)
    if isinstance(group, Collectives):
        work = group.all_to_all_single(output, input, async_op)
    else:
        work = _issued(dist.all_to_all_single(output, input, group=group, async_op=True), output, async_op)
    return work if async_op else output


def broadcast_(tensor: torch.Tensor, src: int = 0, *, kind: Kind, ledger, group=None):
    """``src``'s ``tensor`` on every rank (every rank of a topology; ``src`` a global rank, a :class:`Collectives`
    group's own rank)."""
    group, ledger = _plain(group, ledger)
    n = world_size(group)
    if n == 1:
        return tensor
    _record(ledger, kind, "broadcast", tensor, n)
    if isinstance(group, Collectives):
        group.broadcast(tensor, src)
    else:
        _issued(dist.broadcast(tensor, src=src, group=group, async_op=True), tensor, False)
    return tensor


def agree_max(values: torch.Tensor, *, ledger, group=None) -> torch.Tensor:
    """The element-wise maximum over the ranks of ``values`` (a float32 copy, the same on every rank).

    The one place where rank-local conditions become a collective decision,
    so that no rank ever skips a collective alone. Over every rank of a topology.
    """
    group, ledger = _plain(group, ledger)
    x = values.detach().reshape(-1).to(torch.float32, copy=True)
    n = world_size(group)
    if n > 1:
        if ledger is not None:
            ledger.record("control", "all_reduce", _nbytes(x), n)
        _all_reduce(x, dist.ReduceOp.MAX, group)
    return x


def agree_any(flag: torch.Tensor, *, ledger, group=None) -> bool:
    """True on every rank when ``flag`` (a 0-d bool/number tensor) is set on any rank."""
    return bool(agree_max(flag.reshape(1), ledger=ledger, group=group).item() > 0)
