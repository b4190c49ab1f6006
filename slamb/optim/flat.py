"""A fixed flat layout of a list of parameters.

Optimizers that exchange a packed subset of their state keep that state in
one flat buffer per quantity and hand per-parameter views to
``optimizer.state`` (so ``state_dict()`` holds everything). The layout also
turns per-tensor scalars into per-element vectors and back, which is how the
layer-wise trust ratios are computed without a Python loop over layers.
"""
from __future__ import annotations

import torch

from .. import comm
from ..sharding import is_sharded, local, shard_offsets
from .precision import state_dtype


def params_with_grad(optimizer) -> list[int]:
    """Indices (in the optimizer's parameter order, as in ``state_dict()``) of parameters with a gradient."""
    return [i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]) if p.grad is not None]


def param_labels(optimizer, ids: list[int]) -> list[str]:
    """Names for error messages: torch's named parameter groups where given, else the index."""
    everything = [(n, p) for g in optimizer.param_groups
                  for n, p in zip(g.get("param_names", [None] * len(g["params"])), g["params"])]
    return [f"{everything[i][0] or f'param[{i}]'} {tuple(everything[i][1].shape)}" for i in ids]


# the integer type of each element size: a tensor's bits read as integers
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sum(tensors) -> torch.Tensor:
    """The sum of ``tensors``' bit patterns read as integers (a 0-d int64, wrapping): the same on ranks holding
    the same values whatever order the reduction takes (a float sum's last bits depend on its threads), and
    different, but for a coincidence, where any value differs."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for t in tensors:
        t = t.detach().contiguous()
        total += t.view(_BITS[t.element_size()]).sum(dtype=torch.int64)
    return total


SAME_GRADIENTS = ("every rank holds the same gradients at the first step: they were averaged across the ranks before "
                  "it (torch's DistributedDataParallel around the model, or a framework's trainer), an all-reduce of "
                  "every gradient beside the optimizer's own exchange; wrap the model with model = "
                  "slamb.wrap_model(model, optimizer) instead, which keeps them local (a framework's trainer: "
                  "slamb.integrations' SLAMBTrainer, prepare or SLAMBStrategy), or, where every rank computes the "
                  "same gradients on purpose, set optimizer.allow_same_gradients = True")


def check_layouts_agree(layouts, *, ledger, group, who: str, start=None, grads=None) -> None:
    """Every rank must lay out the same tensors, or a packed entry means different things on each; and at a
    run's first step every rank must hold the same ``start`` parameters (where given: DDP's broadcast at
    :func:`slamb.wrap_model` gives every rank rank 0's). ``grads`` (where given, on every rank): the layout's
    gradients on this rank (None for one it has none of), which must differ from another rank's where any is
    there, since an optimizer that keeps each rank's own (SLAMB) otherwise runs beside an all-reduce of them
    (:data:`SAME_GRADIENTS`). All in one all-gather."""
    n = comm.world_size(group)
    live = [lay for lay in layouts if lay is not None]
    if n == 1 or not live:
        return
    sig = []
    for lay in layouts:
        numels = lay.numels if lay is not None else []
        sig += [sum(numels), len(numels), sum((i + 1) * k for i, k in enumerate(numels)) % (2**31)]
    mine = torch.tensor(sig, dtype=torch.long, device=live[0].device)
    if start is not None:
        mine = torch.cat([mine, bit_sum(start).view(1)])
    if grads is not None:  # 0 where no rank has a gradient yet (a layout fixed before the first step)
        grads = [local(g) for g in grads if g is not None]
        mine = torch.cat([mine, bit_sum(grads).view(1) if grads else mine.new_zeros(1)])
    everyone = torch.empty(n * mine.numel(), dtype=torch.long, device=live[0].device)
    comm.all_gather_into_tensor(everyone, mine, kind="control", ledger=ledger, group=group)
    rows = everyone.view(n, -1)
    if grads is not None:
        if bool((rows == mine).all()) and int(mine[-1]) != 0:
            raise RuntimeError(f"{who}: {SAME_GRADIENTS}")
        rows, mine = rows[:, :-1], mine[:-1]
    if bool((rows == mine).all()):
        return
    if not bool((rows[:, :len(sig)] == mine[:len(sig)]).all()):
        raise RuntimeError(
            f"{who}: the ranks disagree on the parameters with gradients at the first step (numel, tensors, "
            f"checksum per rank: {rows[:, :len(sig)].tolist()}); every rank must build the same model and "
            "compute gradients for the same parameters"
        )
    others = [i for i, bits in enumerate(rows[:, -1].tolist()) if bits != int(rows[0, -1])]
    raise RuntimeError(
        f"{who}: the ranks start from different parameters (those of worker(s) {others} differ from worker 0's): "
        "call model = slamb.wrap_model(model, optimizer) before the first step, which starts every rank from rank "
        "0's, or build the model from the same seed on every rank"
    )


class FlatLayout:
    """``keys``: the optimizer's parameters (the state's keys); ``params``: the tensors the buffers lay out
    and the step computes on, this rank's shards of sharded (FSDP2) parameters, else the parameters
    themselves (``sharded``: whether they are shards); ``global_numels`` and ``global_offsets``: each whole
    tensor's size and where the shard starts in it (:func:`slamb.sharding.shard_offsets`).

    ``align``: each tensor starts at a multiple of this many entries (``offsets``: the starts, then the
    buffer's end; ``ends``: where each tensor's entries end). The fused step's layout is aligned to its
    block size (:data:`slamb.optim.fused.BLOCK`) so that a buffer reshaped to (blocks, BLOCK) never has a
    block of two tensors; the padding entries are 0 in every buffer, so they add nothing to a sum and 0 to
    a parameter. Everything else addresses a tensor's entries through ``offsets``, ``ends`` or
    :meth:`views`, and works on either layout."""

    def __init__(self, params: list[torch.Tensor], group_index: list[int], align: int = 1):
        if not params:
            raise ValueError("no parameter has a gradient: nothing to optimize")
        self.keys = params
        self.sharded = any(map(is_sharded, params))
        self.global_numels, self.global_offsets = (list(x) for x in zip(*map(shard_offsets, params)))
        params = [local(p) for p in params]
        devices = {p.device for p in params}
        dtypes = {p.dtype for p in params}
        if len(devices) > 1 or len(dtypes) > 1:
            raise ValueError(
                f"parameters span devices {sorted(map(str, devices))} and dtypes {sorted(map(str, dtypes))}; "
                "a flat-state optimizer needs one device and one dtype: create one optimizer per device/dtype"
            )
        self.params = params
        self.group_of = list(group_index)
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.state_dtype = state_dtype(self.dtype)  # of the buffers: fp32 under bf16 and fp16 parameters
        self.numels = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        self.align = align
        self.offsets, self.ends = [0], []
        for n in self.numels:
            self.ends.append(self.offsets[-1] + n)
            self.offsets.append(-(-self.ends[-1] // align) * align)
        self.numel = self.offsets[-1]
        # groups are contiguous runs of the layout: (group index, first param, end param)
        self.groups: list[tuple[int, int, int]] = []
        for i, g in enumerate(group_index):
            if self.groups and self.groups[-1][0] == g:
                self.groups[-1] = (g, self.groups[-1][1], i + 1)
            else:
                self.groups.append((g, i, i + 1))

    @classmethod
    def of(cls, optimizer, ids: list[int], align: int = 1, **extra) -> "FlatLayout":
        """The layout of the optimizer's parameters ``ids`` (indices in its parameter order); ``extra``: what a
        subclass's layout takes besides."""
        everything = [(gi, p) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]]
        return cls([everything[i][1] for i in ids], [everything[i][0] for i in ids], align, **extra)

    def adopt(self, state: dict, key: str, fill: float = 0.0, per_tensor: bool = False,
              dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """One flat buffer for ``state[p][key]`` of every parameter, which then holds views of it.

        Values already in ``state`` (a loaded checkpoint, a layout before it grew) are carried over, else ``fill``.
        ``per_tensor``: one scalar per parameter (0-d views) instead of one per element.
        ``dtype``: of the buffer, when not ``state_dtype`` (a counter); ``device``: when not the parameters'.
        """
        flat = torch.full((len(self.params) if per_tensor else self.numel,), fill,
                          dtype=dtype or self.state_dtype, device=device or self.device)
        views = flat.unbind() if per_tensor else self.views(flat)
        for p, view in zip(self.keys, views):
            if key in state[p]:  # per parameter: a grown layout keeps the state of those it had (a shard's: its own)
                view.copy_(local(state[p][key]))
            state[p][key] = view
        return flat

    def zeros(self, dtype=None) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=dtype or self.state_dtype, device=self.device)

    def views(self, buf: torch.Tensor, lo: int = 0, hi: int | None = None) -> list[torch.Tensor]:
        """Shaped per-parameter views of ``buf``, a buffer over parameters ``lo:hi``."""
        hi = len(self.params) if hi is None else hi
        base = self.offsets[lo]
        return [buf[self.offsets[i] - base:self.ends[i] - base].view(self.shapes[i]) for i in range(lo, hi)]

    def span(self, lo: int, hi: int) -> slice:
        """Parameters ``lo:hi`` in a flat buffer, with their padding."""
        return slice(self.offsets[lo], self.offsets[hi])

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def unpadded(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf``, a buffer over the layout, without its padding: the tensors' entries end to end."""
        return buf if self.align == 1 else self.flatten(self.views(buf))

    def segment_norms(self, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """L2 norm of each parameter's segment of ``flat`` (a buffer over parameters ``lo:hi`` of an unaligned
        layout)."""
        parts = list(torch.split(flat, self.numels[lo:hi]))
        return torch.stack(torch._foreach_norm(parts))

    def expand(self, per_tensor: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Per-element vector over parameters ``lo:hi`` holding each parameter's scalar (padding uninitialised)."""
        out = torch.empty(self.offsets[hi] - self.offsets[lo], dtype=per_tensor.dtype, device=self.device)
        views = self.views(out, lo, hi)
        # a broadcast copy per segment: no host read, and no per-coordinate index as repeat_interleave builds
        torch._foreach_copy_(views, [s.expand(v.shape) for s, v in zip(per_tensor.unbind(), views)])
        return out
