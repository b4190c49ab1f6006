"""Which coordinates SLAMB averages at a step: the two policies of the
reference code, and the per-tensor view of one step's draw.

A policy draws over the *compressible* coordinates only (those of the tensors
that are not always averaged, concatenated in layout order) and returns their
sorted positions. A draw is a pure function of (seed, step, compression ratio,
layout), so every rank draws the same one without sending indices, a resumed
run draws the same ones as the uninterrupted run, and torch's global RNG is
never touched. Positions, not a boolean mask, because everything a step does
with the selection (pack, scatter, the selected norms) costs O(k N) that way.
"""
from __future__ import annotations

import math

import torch

MASK_POLICIES = ("cyclic", "bernoulli")

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over the seed space


def step_seed(seed: int, step: int) -> int:
    return (seed * _MIX + step) % (2**63 - 1)


def num_chunks(numel: int, compress_ratio: float) -> tuple[int, int]:
    """(chunk size, number of chunks) when cutting ``numel`` coordinates into
    ``int(1/k)`` chunks the way ``torch.chunk`` does (equal chunks of
    ``ceil(numel/C)``, the last one shorter, possibly fewer than C)."""
    c = max(1, int(1.0 / compress_ratio))
    size = math.ceil(numel / c)
    return size, math.ceil(numel / size)


class CyclicMask:
    """v1: one fixed random permutation of all coordinates, drawn from the seed
    on the CPU (the same on every device type), cut into ``int(1/k)`` chunks;
    step t averages chunk ``t mod C``, so every coordinate is averaged exactly
    once every C steps. A change of k re-cuts the same permutation.

    Each chunk is kept sorted, as the gaps between its positions in int16
    (int32 when a gap does not fit): half a word per coordinate, where the
    permutation itself would take one, and a step's positions are one cumsum."""

    def __init__(self, numel: int, seed: int, device: torch.device):
        self.numel, self.seed, self.device = numel, seed, device
        self._cut: tuple[int, int] | None = None

    def _recut(self, size: int, chunks: int) -> None:
        self.gaps = self.starts = None  # the old cut's memory goes before the new one is built
        perm = torch.randperm(self.numel, generator=torch.Generator().manual_seed(self.seed))
        full = (chunks - 1) * size
        ordered = torch.cat([perm[:full].view(chunks - 1, size).sort(dim=1).values.view(-1),
                             perm[full:].sort().values])
        del perm
        gaps = torch.diff(ordered, prepend=ordered[:1])
        gaps[::size] = 0  # a chunk's first position is kept whole in ``starts``
        small = int(gaps.max()) < 2**15
        self.gaps = gaps.to(torch.int16 if small else torch.int32).to(self.device)
        self.starts = ordered[::size].clone().to(self.device)  # a copy: a view would keep all of it alive
        self._cut = (size, chunks)

    def __call__(self, step: int, compress_ratio: float) -> torch.Tensor:
        size, chunks = num_chunks(self.numel, compress_ratio)
        if self._cut != (size, chunks):
            self._recut(size, chunks)
        j = step % chunks
        return self.gaps[j * size:(j + 1) * size].cumsum(0, dtype=torch.int64).add_(self.starts[j])


class BernoulliMask:
    """v2: each coordinate independently with probability k, from a generator
    re-seeded with (seed, step) on the parameters' device. Drawn as the gaps
    of a Bernoulli process (geometric, from 53-bit uniforms): k N random numbers
    instead of N. Masks agree across ranks of one job; a CPU and a CUDA run draw
    different (equally valid) masks."""

    def __init__(self, numel: int, seed: int, device: torch.device):
        self.numel, self.seed, self.device = numel, seed, device
        self.gen = torch.Generator(device=device)

    def __call__(self, step: int, compress_ratio: float) -> torch.Tensor:
        if compress_ratio >= 1.0:
            return torch.arange(self.numel, device=self.device)
        self.gen.manual_seed(step_seed(self.seed, step))
        log_q = math.log1p(-compress_ratio)
        mean = self.numel * compress_ratio
        batch = int(mean + 8 * math.sqrt(mean) + 64)  # one batch covers the layout but once in ~1e15
        parts, end = [], -1.0
        while end < self.numel - 1:
            u = torch.rand(batch, generator=self.gen, dtype=torch.float64, device=self.device)
            # P(gap = g) = (1-k)^(g-1) k for g >= 1; 1 - u is in (0, 1], so the log is finite
            pos = torch.rsub(u, 1.0).log_().div_(log_q).floor_().add_(1.0).cumsum_(0).add_(end)
            parts.append(pos)
            end = float(pos[-1])
        pos = torch.cat(parts) if len(parts) > 1 else parts[0]
        return pos[: int(torch.searchsorted(pos, float(self.numel)))].long()


def make_mask(policy: str, numel: int, seed: int, device: torch.device):
    return {"cyclic": CyclicMask, "bernoulli": BernoulliMask}[policy](numel, seed, device)


class Selection:
    """One step's selection over a layout: every coordinate of the always-averaged
    tensors, and the drawn positions of the others, split per tensor.

    ``local[i]`` is None for an always-averaged tensor, else the sorted
    positions (in the flattened tensor) of its selected coordinates.
    """

    def __init__(self, layout, dense: list[bool], drawn: torch.Tensor):
        self.layout, self.dense = layout, dense
        sizes = [0 if d else n for d, n in zip(dense, layout.numels)]
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)
        # drawn positions are in the concatenation of the compressible tensors
        cut = torch.searchsorted(drawn, torch.tensor(starts, device=drawn.device)).tolist()
        self.local = [None if d else drawn[cut[i]:cut[i + 1]] - starts[i] for i, d in enumerate(dense)]
        self.counts = [n if d else cut[i + 1] - cut[i] for i, (d, n) in enumerate(zip(dense, layout.numels))]
        self.numel = sum(self.counts)

    def take(self, tensors, ids=None) -> list[torch.Tensor]:
        """The selected entries of each tensor (parameters ``ids`` of the layout, default all), flattened.

        An always-averaged tensor comes back as a view of itself: do not write to the result.
        """
        ids = range(len(tensors)) if ids is None else ids
        return [t.reshape(-1) if self.local[i] is None else t.reshape(-1).index_select(0, self.local[i])
                for i, t in zip(ids, tensors)]

    def put_(self, tensors, values, ids=None) -> None:
        """Write each tensor's selected entries back from ``values`` (as :meth:`take` returns them)."""
        ids = range(len(tensors)) if ids is None else ids
        for i, t, v in zip(ids, tensors, values):
            if self.local[i] is None:
                t.copy_(v.view(t.shape))
            else:
                t.view(-1).index_copy_(0, self.local[i], v)

    def fill_(self, tensors, value: float, ids=None) -> None:
        ids = range(len(tensors)) if ids is None else ids
        for i, t in zip(ids, tensors):
            if self.local[i] is None:
                t.fill_(value)
            else:
                t.view(-1).index_fill_(0, self.local[i], value)

    def bool_mask(self) -> torch.Tensor:
        """The flat bool mask over the layout."""
        mask = torch.zeros(self.layout.numel, dtype=torch.bool, device=self.layout.device)
        self.fill_(self.layout.views(mask), True)
        return mask
