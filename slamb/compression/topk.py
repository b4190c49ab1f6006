"""Approximate top-k selection by a sampled threshold (Lin et al., DGC, ICLR 2018).

An exact ``torch.topk`` over every element of a large gradient is slow on
accelerators; DGC instead estimates the k-th largest magnitude from a strided
sample of ``|x|``, keeps every element at or above it, and corrects the
threshold when the count lands outside ``[lower * k, upper * k]``.

The functions here know nothing of optimizers or communication: they take
non-negative importances (``x.abs()``) laid out as consecutive segments of one
flat tensor (one segment per parameter tensor) and return a selection mask.
Segments are processed together so that each correction pass costs one host
synchronisation for all of them, not one per tensor.

Free choices, each named:

* the sample is ``x[start::stride]`` with a random ``start`` drawn from the
  caller's ``torch.Generator`` (never the global RNG) and an odd ``stride``, so
  that rows or channels whose length is a power of two are not sampled in the
  same column every time; it holds at least ``sample_ratio`` of the elements
  (>= 1%) and enough elements that its own top-k has ``MIN_SAMPLE_TOPK``
  entries, which keeps the first estimate from resting on one or two values;
* a count above ``upper * k`` raises the threshold by the factor ``upper``, a
  count below ``lower * k`` lowers it by ``lower`` (DGC's steps); once one
  threshold that gave too many and one that gave too few are known, the next
  is their geometric mean (bisection), which converges where fixed steps
  would oscillate;
* exact zeros are never selected by a threshold (sending them changes
  nothing): a segment with fewer non-zeros than ``lower * k`` sends all of
  them and is accepted as is;
* a segment still outside the bounds after ``max_iters`` corrections (ties,
  say) falls back to an exact ``torch.topk``;
* a segment with ``k >= numel`` selects every element.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ..optim.checks import check_count, check_range

__all__ = ["MIN_SAMPLE_TOPK", "Selection", "num_selected", "sample_stride", "sampled_topk_mask", "sampled_topk"]

MIN_SAMPLE_TOPK = 16


@dataclasses.dataclass
class Selection:
    """What :func:`sampled_topk_mask` chose: ``mask`` over the flat input, and per segment
    the number selected, the threshold used (0.0 where all or an exact top-k was taken)
    and whether the exact fallback ran; ``passes`` counts threshold passes over the data."""

    mask: torch.Tensor
    counts: list[int]
    thresholds: list[float]
    exact: list[bool]
    passes: int


def num_selected(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` elements at ``density``: ``ceil(density * numel)``, at least 1."""
    check_range("density", density, 0.0, 1.0, lo_open=True)
    return max(1, min(numel, math.ceil(density * numel)))


def sample_stride(numel: int, k: int, sample_ratio: float) -> int:
    """Stride of the sample for a segment of ``numel`` elements with ``k`` to select.

    The sample ``x[start::stride]`` has at least ``max(sample_ratio * numel,
    MIN_SAMPLE_TOPK * numel / k)`` elements for any ``start < stride``; 1 means
    the whole segment.
    """
    wanted = max(math.ceil(sample_ratio * numel), math.ceil(MIN_SAMPLE_TOPK * numel / k))
    stride = max(1, numel // max(1, wanted))
    if stride > 1 and stride % 2 == 0:
        stride -= 1  # odd, and a shorter stride only adds samples
    return stride


def sampled_topk_mask(
    importance: torch.Tensor,
    sizes: Sequence[int],
    ks: Sequence[int],
    *,
    generator: torch.Generator | None,
    sample_ratio: float = 0.01,
    lower: float = 0.8,
    upper: float = 1.3,
    max_iters: int = 10,
    out: torch.Tensor | None = None,
) -> Selection:
    """Select about ``ks[i]`` of the largest entries of each segment of ``importance``.

    ``importance`` is a flat non-negative tensor (``x.abs()``); segment ``i``
    holds the next ``sizes[i]`` elements. The result's mask selects, in each
    segment, either every element ``>=`` a threshold with a count in
    ``[lower * k, upper * k]``, or exactly the top ``k`` (fallback), or all of
    its non-zeros when it has too few of them. ``generator`` draws the sample
    starts (a CPU generator; ``None`` takes start 0, for deterministic tools).
    ``out`` is an optional bool buffer for the mask.
    """
    if importance.dim() != 1:
        raise ValueError(f"importance must be flat (1-D), got shape {tuple(importance.shape)}")
    if len(sizes) != len(ks) or sum(sizes) != importance.numel():
        raise ValueError(f"sizes (sum {sum(sizes)}, {len(sizes)} segments) and ks ({len(ks)}) must describe "
                         f"the {importance.numel()} elements of importance, one k per segment")
    check_range("sample_ratio", sample_ratio, 0.01, 1.0)
    check_range("lower", lower, 0.0, 1.0, lo_open=True)
    check_range("upper", upper, 1.0)
    check_count("max_iters", max_iters, minimum=0)

    mask = torch.empty(importance.shape, dtype=torch.bool, device=importance.device) if out is None else out
    segments = importance.split(list(sizes))
    masks = mask.split(list(sizes))
    n = len(sizes)
    strides = [sample_stride(s, k, sample_ratio) if k < s else 1 for s, k in zip(sizes, ks)]
    if generator is None:
        starts = [0] * n
    else:
        starts = (torch.rand(n, generator=generator, dtype=torch.float64) * torch.tensor(strides)).long().tolist()

    tiny = torch.finfo(importance.dtype).tiny
    counts, thresholds, exact = [0] * n, [0.0] * n, [False] * n
    estimates, active = [], []
    for i, (seg, s, k) in enumerate(zip(segments, sizes, ks)):
        if k >= s:
            masks[i].fill_(True)
            counts[i] = s
            continue
        sample = seg[starts[i]::strides[i]]
        k_sample = min(sample.numel(), max(1, math.ceil(sample.numel() * k / s)))
        estimates.append(torch.topk(sample, k_sample, sorted=False).values.min())
        active.append(i)
    if active:  # one host sync brings every first estimate over
        for i, t in zip(active, torch.stack(estimates).tolist()):
            thresholds[i] = max(t, tiny)
    too_many = {i: None for i in active}  # highest threshold known to select too many
    too_few = {i: None for i in active}   # lowest threshold known to select too few

    passes = 0
    while active:
        for i in active:
            torch.ge(segments[i], thresholds[i], out=masks[i])
        passes += 1
        found = torch.stack([masks[i].sum() for i in active]).tolist()
        still = []
        for i, c in zip(active, found):
            counts[i] = c
            k, t = ks[i], thresholds[i]
            if lower * k <= c <= upper * k or (c < lower * k and t <= tiny):
                continue
            if passes > max_iters:
                exact[i] = True
                continue
            if c > upper * k:
                too_many[i] = t
                thresholds[i] = math.sqrt(t * too_few[i]) if too_few[i] is not None else t * upper
            else:
                too_few[i] = t
                thresholds[i] = max(math.sqrt(t * too_many[i]) if too_many[i] is not None else t * lower, tiny)
            still.append(i)
        active = still

    for i in (i for i in range(n) if exact[i]):
        masks[i].fill_(False)
        masks[i][torch.topk(segments[i], ks[i], sorted=False).indices] = True
        counts[i], thresholds[i] = ks[i], 0.0
    return Selection(mask, counts, thresholds, exact, passes)


def sampled_topk(x: torch.Tensor, k: int, *, generator: torch.Generator | None = None, **kwargs) -> torch.Tensor:
    """Flat indices (ascending) of about the ``k`` largest-magnitude entries of ``x``.

    One-tensor convenience over :func:`sampled_topk_mask`; ``kwargs`` are its
    ``sample_ratio``, ``lower``, ``upper``, ``max_iters``.
    """
    flat = x.detach().reshape(-1)
    check_count("k", k)
    sel = sampled_topk_mask(flat.abs(), [flat.numel()], [min(k, flat.numel())], generator=generator, **kwargs)
    return sel.mask.nonzero().view(-1)
