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
from fractions import Fraction

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


_M32 = 2**32 - 1
_M64 = 2**64 - 1
_CHUNK = 1 << 22  # gaps computed per pass: bounds the scratch (80 MB) whatever the model's size


def _splitmix64(x: int) -> int:
    """Steele et al.'s SplitMix64 finaliser, on Python ints (exact on every host)."""
    x = (x + _MIX) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32 family: xorshift-multiply, a bijection of [0, 2^32)),
    in place on an int64 tensor of values in [0, 2^32). Both multipliers are below 2^31, so every
    product is below 2^63: exact int64 arithmetic, the same bits on every device."""
    for shift, mul in ((16, 0x21F0AAAD), (15, 0x735A2D97), (15, None)):
        x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=tmp))
        if mul is not None:
            x.mul_(mul).bitwise_and_(_M32)
    return x


def geometric_thresholds(compress_ratio: float) -> list[int]:
    """T_j = floor(2^32 (1-k)^j) for j = 0, 1, ... while it is >= 1 (descending, T_0 = 2^32).

    For x uniform on [0, 2^32), #{j : T_j > x} is a gap of a Bernoulli(k) process:
    P(gap > j) = P(x < T_j) = (1-k)^j. Computed on Python ints (2^-64 fixed point, one
    floor per power): the same table on every host; log(2^32) / -log(1-k) + 1 entries."""
    q = math.floor((1 - Fraction(compress_ratio)) * 2**64)
    table, power = [], 2**64
    while power >> 32:
        table.append(power >> 32)
        power = power * q >> 64
    return table


def _gaps_(x: torch.Tensor, scratch, below, above, inv_log_q: float, shift: float) -> torch.Tensor:
    """x, hashes uniform on [0, 2^32), replaced by their gaps #{j : T_j > x} (:class:`BernoulliMask`'s
    ``_table`` for k: the thresholds as lookups by the estimate g, and the estimate's two constants).
    ``scratch``: two int64 buffers and one of the estimate's float dtype, each of x's length."""
    g, t, f = scratch
    f.copy_(x).add_(1).log_().mul_(inv_log_q).add_(shift)  # log(x + 1): Sleef's log1p took 2x as long
    g.copy_(f)  # truncation toward zero: the floor, as f > -1
    g.add_(torch.index_select(below, 0, g, out=t) > x)  # one too small: T[g] > x
    g.add_(torch.index_select(above, 0, g, out=t) <= x, alpha=-1)  # one too large: T[g - 1] <= x
    return x.copy_(g)


def _draw_(x: torch.Tensor, counters: torch.Tensor, key, scratch, *table) -> torch.Tensor:
    """x = the gaps of the hashes of ``counters`` (the hashed positions) under ``key`` (:func:`_gaps_`)."""
    mix32_(torch.bitwise_xor(counters, key, out=x), scratch[0])
    return _gaps_(x, scratch, *table)


def _draw_graph(tensors, key: torch.Tensor, dtype: torch.dtype, inv_log_q: float, shift: float) -> torch.Tensor:
    """:func:`_draw_` of ``tensors`` = (x, counters, below, above) in buffers of its own (``dtype``: the
    estimate's), the form that :class:`slamb.optim.fused.Passes` compiles: inside one kernel those buffers
    are registers, not memory, so the hash, the estimate and both comparisons read a counter and write a
    gap, once. The kernel runs the int64 operations (no overflow) that decide every gap eagerly, so its
    positions are the same bits. ``key``: a 0-d CPU tensor, which the kernel takes as a scalar argument, so
    that a new step reuses the graph (a Python int would be traced into it as a constant)."""
    x, counters, below, above = tensors
    scratch = [torch.empty_like(x), torch.empty_like(x), torch.empty(x.shape, dtype=dtype, device=x.device)]
    return _draw_(x, counters, key, scratch, below, above, inv_log_q, shift)


class CyclicMask:
    """v1: one fixed random permutation of all coordinates, drawn from the seed
    on the CPU (the same on every device type), cut into ``int(1/k)`` chunks;
    step t averages chunk ``t mod C``, so every coordinate is averaged exactly
    once every C steps. A change of k re-cuts the same permutation.

    Each chunk is kept sorted, as the gaps between its positions in int16
    (int32 when a gap does not fit): half a word per coordinate, where the
    permutation itself would take one, and a step's positions are one cumsum, in place in int64 (exact;
    a float64 buffer kept between draws and converted after took 1.5x as long on a 2-core CPU, and held
    k N doubles between steps, when activations peak).
    ``keep`` (sorted ``[lo, hi, lo, hi, ...]`` spans: a shard's coordinates in the whole model's) keeps
    only the positions inside them: a shard holds half a word per coordinate of its own, not of the model."""

    def __init__(self, numel: int, seed: int, device: torch.device, keep: torch.Tensor | None = None):
        self.numel, self.seed, self.device = numel, seed, device
        self.keep = keep
        self._cut: tuple[int, int] | None = None

    def _recut(self, size: int, chunks: int) -> None:
        self.gaps = self.starts = None  # the old cut's memory goes before the new one is built
        perm = torch.randperm(self.numel, generator=torch.Generator().manual_seed(self.seed))
        gaps, starts, self.cuts = [], [], [0]
        for j in range(chunks):
            ordered = perm[j * size:(j + 1) * size].sort().values
            if self.keep is not None:
                ordered = ordered[torch.searchsorted(self.keep, ordered, right=True) % 2 == 1]
            gaps.append(torch.diff(ordered, prepend=ordered[:1]))  # a chunk's first position is kept in ``starts``
            starts.append(int(ordered[0]) if ordered.numel() else 0)
            self.cuts.append(self.cuts[-1] + ordered.numel())
        del perm
        gaps = torch.cat(gaps)
        small = gaps.numel() == 0 or int(gaps.max()) < 2**15
        self.gaps = gaps.to(torch.int16 if small else torch.int32).to(self.device)
        self.starts = torch.tensor(starts, dtype=torch.int64, device=self.device)
        self._cut = (size, chunks)

    def __call__(self, step: int, compress_ratio: float) -> torch.Tensor:
        size, chunks = num_chunks(self.numel, compress_ratio)
        if self._cut != (size, chunks):
            self._recut(size, chunks)
        j = step % chunks
        gaps = self.gaps[self.cuts[j]:self.cuts[j + 1]]
        return gaps.to(torch.int64).cumsum_(0).add_(self.starts[j])


class BernoulliMask:
    """v2: each coordinate independently with probability k, a pure function of
    (seed, step, k, position): the same positions on every device type and model.

    Drawn as the gaps of a Bernoulli process, k N of them rather than N coin
    flips: gap i is the geometric variate of a 32-bit hash x of (seed, step, i),
    #{j : T_j > x} with the integer thresholds of :func:`geometric_thresholds`.
    It is estimated by inversion in floating point, off by at most one (the
    float error is below 1e-2 of a gap), then made exact by two comparisons
    with the thresholds. The hash and the comparisons are integer arithmetic
    (int64, no overflow), so neither float rounding nor a device generator
    decides anything: a CPU, an A100 and an H100 draw the same positions, and
    the draw reads nothing back to the host. The hash of the counter i alone
    is kept between draws; a step keys it and hashes once more.

    A draw takes mean + 12 standard deviations + 64 gaps: they reach past the
    layout's end but with probability below 1e-30 (were they not to, the last
    coordinates would not be selected at that step). The positions come back
    sorted, the last ones possibly past the end: :class:`Selection` cuts them.

    ``passes`` (a fused optimizer's :class:`slamb.optim.fused.Passes`): the gaps are drawn by one compiled
    kernel per chunk (:func:`_draw_graph`), the same bits as the eager draw; a compile that fails warns
    once, as the optimizer's passes do, and raises ``fused.CompileFailed`` where nothing of the step ran
    yet (the optimizer then sets ``passes`` to None: the eager draw from then on).
    """

    def __init__(self, numel: int, seed: int, device: torch.device, passes=None):
        self.numel, self.seed, self.device, self.passes = numel, seed, device, passes
        self._k: float | None = None
        self._counters = torch.empty(0, dtype=torch.int64, device=device)  # the hash of i, for i < 2^32
        self._scratch: list[torch.Tensor] = []
        # the compiled draw's key: refilled on the host, so that a step neither recompiles nor copies to the device
        self._key = torch.zeros((), dtype=torch.int64)

    def _prepare(self, compress_ratio: float) -> int:
        """The thresholds and hashed counters for k; returns the number of gaps a draw takes."""
        mean = self.numel * compress_ratio
        batch = min(int(mean + 12 * math.sqrt(mean) + 64), self.numel)  # gaps are >= 1: numel always reach
        if self._k != compress_ratio:
            t = geometric_thresholds(compress_ratio)
            # T[g] and T[g - 1] as lookups by g in 0..len(t) + 1, the estimate's range: T is 2^33 (> any x)
            # before its start and 0 past its end
            self._below = torch.tensor(t + [0, 0], dtype=torch.int64, device=self.device)
            self._above = torch.tensor([2**33] + t + [0], dtype=torch.int64, device=self.device)
            inv_log_q = 1.0 / math.log1p(-compress_ratio)
            # g = floor(log((x + 1) / 2^32) / log(1 - k)) + 1 = log(x + 1) inv_log_q + shift, give or take one
            self._table = (self._below, self._above, inv_log_q, 1.0 - 32 * math.log(2) * inv_log_q)
            # the estimate's error is about 1e-6 / k gaps in float32: float64 below k = 1e-3
            self._dtype = torch.float32 if compress_ratio >= 1e-3 else torch.float64
            self._k = compress_ratio
        have, need = self._counters.numel(), min(batch, 2**32)
        if have < need:
            new = torch.arange(have, need, dtype=torch.int64, device=self.device)
            self._counters = torch.cat([self._counters, mix32_(new, torch.empty_like(new))])
        n = min(batch, _CHUNK)
        if self.passes is not None:  # the compiled kernel keeps its scratch in registers
            self._scratch = []
        elif not self._scratch or self._scratch[0].numel() < n or self._scratch[2].dtype != self._dtype:
            self._scratch = [torch.empty(n, dtype=d, device=self.device) for d in (torch.int64, torch.int64, self._dtype)]
        return batch

    def _gaps_(self, x: torch.Tensor) -> torch.Tensor:
        """x, hashes uniform on [0, 2^32), replaced by their gaps #{j : T_j > x}."""
        return _gaps_(x, [s[:x.numel()] for s in self._scratch], *self._table)

    def __call__(self, step: int, compress_ratio: float) -> torch.Tensor:
        if compress_ratio >= 1.0:
            return torch.arange(self.numel, device=self.device)
        batch = self._prepare(compress_ratio)
        out = torch.empty(batch, dtype=torch.int64, device=self.device)
        seed = step_seed(self.seed, step)
        for lo in range(0, batch, _CHUNK):  # chunks never straddle a multiple of 2^32
            hi = min(lo + _CHUNK, batch)
            # counters past 2^32 reuse the hashes of i mod 2^32 under a key of their own
            key = _splitmix64(seed ^ (lo >> 32)) >> 32
            c, x = lo & _M32, out[lo:hi]
            counters = self._counters[c:c + hi - lo]
            if self.passes is not None:
                self.passes(_draw_graph, [x, counters, *self._table[:2]], self._key.fill_(key), self._dtype,
                            *self._table[2:])
            else:
                _draw_(x, counters, key, [s[:hi - lo] for s in self._scratch], *self._table)
        out[:1].sub_(1)  # positions are the gaps' running sums less one: the first gap less one
        return out.cumsum_(0)


def make_mask(policy: str, numel: int, seed: int, device: torch.device, keep: torch.Tensor | None = None,
              passes=None):
    """``keep``: the spans a shard holds (:class:`CyclicMask`); a Bernoulli draw is a run of gaps over every
    coordinate, so it draws the whole model's and :class:`Selection` cuts the shard's out. ``passes``: a fused
    optimizer's compiled passes, which draw the Bernoulli gaps (:class:`BernoulliMask`)."""
    if policy == "cyclic":
        return CyclicMask(numel, seed, device, keep)
    return BernoulliMask(numel, seed, device, passes)


class Selection:
    """One step's selection over a layout: every coordinate of the always-averaged
    tensors, and the drawn positions of the others, split per tensor.

    ``local[i]`` is None for an always-averaged tensor, else the sorted
    positions (in the flattened tensor) of its selected coordinates. They are cut at their first use:
    the fused step reads the counts and :meth:`layout_positions` alone (unless an exchange overlapped with
    backward takes the per-tensor view), so its step costs the same ops whatever the number of tensors.
    """

    def __init__(self, layout, dense: list[bool], drawn: torch.Tensor, bounds: torch.Tensor | None = None):
        self.layout, self.dense, self.drawn = layout, dense, drawn
        if bounds is None:  # ``Selection.bounds(layout, dense)``, made once by a caller that draws every step
            bounds = Selection.bounds(layout, dense)
        # drawn positions are in the concatenation of the compressible tensors (those past its end are
        # dropped); the one read to the host of a draw: the per-tensor counts
        # each tensor's run in the draw, [cuts[2 i], cuts[2 i + 1]): on the device, and on the host (``cut``)
        self.cuts = torch.searchsorted(drawn, bounds)
        self.cut = cut = self.cuts.tolist()
        self._local: list | None = None
        self._packed: torch.Tensor | None = None  # layout_positions(runs, with_dense=True), kept for the step
        self.counts = [n if d else cut[2 * i + 1] - cut[2 * i] for i, (d, n) in enumerate(zip(dense, layout.numels))]
        self.numel = sum(self.counts)
        self.compressed = [i for i, d in enumerate(dense) if not d]

    @property
    def local(self) -> list:
        if self._local is None:
            cut = self.cut
            self._local = [None if d else self.drawn[cut[2 * i]:cut[2 * i + 1]] - lo
                           for i, (d, (lo, _)) in enumerate(zip(self.dense, Selection.spans(self.layout, self.dense)))]
        return self._local

    def layout_positions(self, runs: "LayoutRuns", with_dense: bool = False) -> torch.Tensor:
        """The drawn positions of the compressed tensors in the flat layout, in a few ops whatever the number
        of tensors; ``with_dense``: after every entry of the always-averaged tensors, the order in which step 4
        packs the momentum (:func:`slamb.optim.exchange.packing`). The draw's positions are sorted, so each
        tensor's are a run as long as its count, starting at its cut of the draw (on the device; an empty run for
        an always-averaged tensor), moved by that tensor's shift (``runs``: the layout's :class:`LayoutRuns`).
        The shift of every position is :func:`run_shifts` of the tensors' runs; an always-averaged tensor's
        entries are consecutive positions from its offset. A repeat of the shifts by the counts gathers a
        shift per position through an index as long (BERT-Base: 82 ms against 32 on a 2-core CPU); a search of
        each position among the tensors' spans took 3x as long again.

        The positions with the always-averaged entries are kept for the step (the exchange's gather and scatter
        and the marks read them); without them they are made for the one call."""
        if self._packed is not None:
            return self._packed if with_dense else self._packed[runs.n_dense:]
        n = sum(self.counts[i] for i in self.compressed)
        drawn, starts = self._own_runs()
        if not with_dense:
            return run_shifts(n, starts, runs.steps).add_(drawn[:n])
        nd = runs.n_dense
        out = run_shifts(nd + n, torch.cat([runs.dense_at, starts + nd]), runs.packed_steps)
        out[:nd].add_(torch.arange(nd, device=out.device))
        out[nd:].add_(drawn[:n])
        self._packed = out
        return out

    def _own_runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn positions of the layout's tensors end to end, and where each tensor's run starts among them.
        A shard's Bernoulli draw is the whole model's (:func:`make_mask`): the other shards' positions lie
        between its tensors' runs, and one gather drops them, its index the positions moved by their run's
        shift (:func:`run_shifts`). The runs' places and shifts are computed on the device from the cuts there:
        made on the host, they were two copies to the device a step, each waiting for the host."""
        cut = self.cut
        starts, ends = cut[0::2], cut[1::2]
        if starts[0] == 0 and starts[1:] == ends[:-1]:  # the runs are end to end: a whole model's draw
            return self.drawn, self.cuts[::2]
        lo, lengths = self.cuts[0::2], self.cuts[1::2] - self.cuts[0::2]
        where = lengths.cumsum(0).sub_(lengths)  # each run's start once the runs are end to end
        shifts = lo - where
        steps = torch.diff(shifts, prepend=shifts.new_zeros(1))
        n = sum(e - s for s, e in zip(starts, ends))
        index = run_shifts(n, where, steps).add_(torch.arange(n, device=where.device))
        return self.drawn.index_select(0, index), where

    @staticmethod
    def spans(layout, dense: list[bool]) -> list[tuple[int, int]]:
        """Each tensor's (start, end) in the concatenation of the compressible tensors, the coordinates a policy
        draws over: the WHOLE tensors' (a sharded parameter's global numel), each tensor's span being its
        local entries (the shard at its global offset); empty for an always-averaged tensor."""
        spans, start = [], 0
        for d, n, whole, offset in zip(dense, layout.numels, layout.global_numels, layout.global_offsets):
            spans.append((start, start) if d else (start + offset, start + offset + n))
            start += 0 if d else whole
        return spans

    @staticmethod
    def bounds(layout, dense: list[bool]) -> torch.Tensor:
        """:meth:`spans` flattened, on the layout's device: the values a draw is cut at."""
        return torch.tensor([x for span in Selection.spans(layout, dense) for x in span], dtype=torch.long,
                            device=layout.device)

    def dense_runs(self) -> list[tuple[int, int]]:
        """(start, end) in the flat layout of each run of consecutive always-averaged tensors, with their padding."""
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
        """The flat bool mask over the layout's entries (without its padding)."""
        mask = torch.zeros(self.layout.numel, dtype=torch.bool, device=self.layout.device)
        self.fill_(mask, True)
        return self.layout.unpadded(mask)


def run_shifts(n: int, starts: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The shift of each of ``n`` positions that lie in runs, each run moved by its own shift: the running sum
    of the shifts' steps (each run's shift less the previous run's) placed at the runs' ``starts``
    (nondecreasing; an empty run's step adds up with the next one's): one ``index_add_`` of a value per run,
    exact in int64 on every device, and one ``cumsum_``, whatever the number of runs."""
    out = torch.zeros(n + 1, dtype=torch.long, device=steps.device)  # an empty run may start at n
    return out.index_add_(0, starts, steps).cumsum_(0)[:n]


def run_steps(shifts: list[int], device) -> torch.Tensor:
    """The steps :func:`run_shifts` takes for runs of these ``shifts``: each run's shift less the previous one's."""
    return torch.tensor([b - a for a, b in zip([0] + shifts, shifts)], dtype=torch.long, device=device)


class LayoutRuns:
    """What takes a draw's positions to a flat layout's (:meth:`Selection.layout_positions`), made once per layout
    (a shard's tensors at their places in the whole model's draw, :meth:`Selection.spans`), as :func:`run_shifts`
    takes them: ``steps``, each tensor's shift (its offset in
    the layout less its start among the drawn positions) less the previous tensor's; and for the packed order,
    the always-averaged tensors' entries first (``n_dense`` of them; ``dense_before``: on the host, per tensor,
    how many come before it), each such tensor a run from ``dense_at``, ``packed_steps`` the steps of those
    runs and then of the drawn ones."""

    def __init__(self, layout, dense: list[bool]):
        starts = [start for start, _ in Selection.spans(layout, dense)]
        shifts = [offset - start for offset, start in zip(layout.offsets, starts)]
        self.dense_before = [0]
        for d, n in zip(dense, layout.numels):
            self.dense_before.append(self.dense_before[-1] + (n if d else 0))
        self.n_dense = self.dense_before[-1]
        dense_ids = [i for i, d in enumerate(dense) if d and layout.numels[i]]
        at = [self.dense_before[i] for i in dense_ids]
        dense_shifts = [layout.offsets[i] - a for i, a in zip(dense_ids, at)]
        self.steps = run_steps(shifts, layout.device)
        self.packed_steps = run_steps(dense_shifts + shifts, layout.device)
        self.dense_at = torch.tensor(at, dtype=torch.long, device=layout.device)
