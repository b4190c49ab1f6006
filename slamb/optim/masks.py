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

import numpy as np
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


class _Policy:
    """A float64 buffer kept between draws: positions are computed in it in place, since on the CPU a
    fresh buffer of k N doubles costs more in page faults than the arithmetic done in it (float64:
    exact for positions below 2^53, and torch's float cumsum is faster than its integer one)."""

    def __init__(self, numel: int, seed: int, device: torch.device):
        self.numel, self.seed, self.device = numel, seed, device
        self._buf: torch.Tensor | None = None

    def _scratch(self, n: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < n:
            self._buf = None  # the old buffer goes before the larger one is made
            self._buf = torch.empty(n, dtype=torch.float64, device=self.device)
        return self._buf[:n]


class CyclicMask(_Policy):
    """v1: one fixed random permutation of all coordinates, drawn from the seed
    on the CPU (the same on every device type), cut into ``int(1/k)`` chunks;
    step t averages chunk ``t mod C``, so every coordinate is averaged exactly
    once every C steps. A change of k re-cuts the same permutation.

    Each chunk is kept sorted, as the gaps between its positions in int16
    (int32 when a gap does not fit): half a word per coordinate, where the
    permutation itself would take one, and a step's positions are one cumsum."""

    def __init__(self, numel: int, seed: int, device: torch.device):
        super().__init__(numel, seed, device)
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
        gaps = self.gaps[j * size:(j + 1) * size]
        return self._scratch(gaps.numel()).copy_(gaps).cumsum_(0).add_(self.starts[j]).to(torch.int64)


class BernoulliMask(_Policy):
    """v2: each coordinate independently with probability k, from a generator
    re-seeded with (seed, step). Drawn as the gaps of a Bernoulli process
    (geometric, by inversion of 53-bit uniforms): k N random numbers instead of N.

    On the CPU the uniforms come from numpy's PCG64 (a third of the time of
    torch's Mersenne Twister), on other devices from torch's generator of that
    device (Philox on CUDA), into the kept buffer where every transform runs.
    Masks agree across the ranks of a job; a CPU and a CUDA run draw different
    (equally valid) masks."""

    def __init__(self, numel: int, seed: int, device: torch.device):
        super().__init__(numel, seed, device)
        self.gen = None if device.type == "cpu" else torch.Generator(device=device)

    def _uniforms(self, rng, n: int) -> torch.Tensor:
        """n uniforms on the grid {1, ..., 2^53} / 2^53 (so in (0, 1]: their log is finite)."""
        u = self._scratch(n)
        if rng is None:
            torch.rand(n, generator=self.gen, dtype=torch.float64, device=self.device, out=u)
        else:
            rng.random(n, out=u.numpy())
        return u.add_(2.0**-53)  # [0, 1 - 2^-53] on that grid, shifted up by one step: exact

    def __call__(self, step: int, compress_ratio: float) -> torch.Tensor:
        if compress_ratio >= 1.0:
            return torch.arange(self.numel, device=self.device)
        seed = step_seed(self.seed, step)
        if self.gen is None:
            rng = np.random.Generator(np.random.PCG64(seed))
        else:
            rng = None
            self.gen.manual_seed(seed)
        inv_log_q = 1.0 / math.log1p(-compress_ratio)
        mean = self.numel * compress_ratio
        batch = int(mean + 8 * math.sqrt(mean) + 64)  # one batch covers the layout but once in ~1e15
        parts, end = [], -1.0
        while end < self.numel - 1:
            # P(gap = g) = (1-k)^(g-1) k for g >= 1: gap = floor(log(u) / log(1-k)) + 1
            pos = self._uniforms(rng, batch).log_().mul_(inv_log_q).floor_().add_(1.0).cumsum_(0).add_(end)
            count = int(torch.searchsorted(pos, float(self.numel)))
            parts.append(pos[:count].to(torch.int64))  # before the next batch reuses the buffer
            end = float(pos[-1])
        return torch.cat(parts) if len(parts) > 1 else parts[0]


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
        self.compressed = [i for i, d in enumerate(dense) if not d]

    def dense_runs(self) -> list[tuple[int, int]]:
        """(start, end) in the flat layout of each run of consecutive always-averaged tensors."""
        runs, off = [], self.layout.offsets
        for i, d in enumerate(self.dense):
            if d:
                if runs and runs[-1][1] == off[i]:
                    runs[-1] = (runs[-1][0], off[i + 1])
                else:
                    runs.append((off[i], off[i + 1]))
        return runs

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

    def fill_(self, flat: torch.Tensor, value: float) -> None:
        """Set the selected entries of ``flat``, a buffer over the whole layout, to ``value``.

        Runs of always-averaged tensors are filled as one slice each: a model with many small
        tensors (ResNet's norms and narrow convolutions) would otherwise pay a call per tensor."""
        for lo, hi in self.dense_runs():
            flat[lo:hi].fill_(value)
        off = self.layout.offsets
        for i in self.compressed:
            flat[off[i]:off[i + 1]].index_fill_(0, self.local[i], value)

    def bool_mask(self) -> torch.Tensor:
        """The flat bool mask over the layout."""
        mask = torch.zeros(self.layout.numel, dtype=torch.bool, device=self.layout.device)
        self.fill_(mask, True)
        return mask
