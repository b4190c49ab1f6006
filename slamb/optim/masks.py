"""Which coordinates SLAMB averages at a step: the two policies of the
reference code. A mask is a pure function of (seed, step, compression ratio,
layout), so every rank draws the same one without sending indices, a resumed
run draws the same ones as the uninterrupted run, and torch's global RNG is
never touched."""
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
    """v1: one fixed random permutation of all coordinates, drawn once from the
    seed (on the CPU, so it is the same on every device type), cut into
    ``int(1/k)`` chunks; step t averages chunk ``t mod C``. Every coordinate is
    averaged exactly once every C steps. A change of k re-cuts the same
    permutation. Costs one int32 per coordinate."""

    def __init__(self, numel: int, seed: int, device: torch.device):
        gen = torch.Generator().manual_seed(seed)
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        self.perm = torch.randperm(numel, generator=gen, dtype=index_dtype).to(device)

    def __call__(self, step: int, compress_ratio: float) -> torch.Tensor:
        numel = self.perm.numel()
        size, chunks = num_chunks(numel, compress_ratio)
        j = step % chunks
        mask = torch.zeros(numel, dtype=torch.bool, device=self.perm.device)
        mask[self.perm[j * size:(j + 1) * size].long()] = True
        return mask


class BernoulliMask:
    """v2: each coordinate independently with probability k, from a generator
    re-seeded with (seed, step) on the parameters' device. Masks agree across
    ranks of one job; a CPU and a CUDA run draw different (equally valid) masks."""

    def __init__(self, numel: int, seed: int, device: torch.device):
        self.numel = numel
        self.seed = seed
        self.gen = torch.Generator(device=device)
        self.device = device

    def __call__(self, step: int, compress_ratio: float) -> torch.Tensor:
        self.gen.manual_seed(step_seed(self.seed, step))
        return torch.rand(self.numel, generator=self.gen, device=self.device) < compress_ratio


def make_mask(policy: str, numel: int, seed: int, device: torch.device):
    return {"cyclic": CyclicMask, "bernoulli": BernoulliMask}[policy](numel, seed, device)
