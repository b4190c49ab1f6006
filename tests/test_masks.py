"""The masks (slamb/optim/masks.py): a pure function of (seed, step, k, position) on every device, eager or
compiled, with the statistics of the draw they stand for; ranks whose masks differ are refused."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import slamb
from slamb.optim import masks
from tests import distributed

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def reference_bernoulli(numel, seed, step, k):
    """The v2 mask written out independently: numpy uint32 arithmetic (wrapping multiplies), the
    exact geometric gap by binary search over the thresholds."""
    n = min(int(numel * k + 12 * math.sqrt(numel * k) + 64), numel)

    def lowbias32(x):
        x = x.astype(np.uint32)
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x21F0AAAD)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x735A2D97)
        x ^= x >> np.uint32(15)
        return x

    key = masks._splitmix64(masks.step_seed(seed, step)) >> 32
    with np.errstate(over="ignore"):
        x = lowbias32(lowbias32(np.arange(n, dtype=np.uint64)) ^ np.uint32(key)).astype(np.int64)
    t = np.array(masks.geometric_thresholds(k), dtype=np.int64)
    gaps = len(t) - np.searchsorted(t[::-1], x, side="right")  # #{j : T_j > x}
    pos = np.cumsum(gaps) - 1
    return pos[pos < numel]


@pytest.mark.parametrize("k", [0.3, 0.1, 0.01, 2e-4])
def test_bernoulli_mask_is_the_integer_function_of_seed_step_and_k(k):
    numel = 400_000
    mask = masks.BernoulliMask(numel, 7, torch.device("cpu"))
    for step in (1, 2, 1000):
        got = mask(step, k)
        got = got[got < numel].numpy()
        np.testing.assert_array_equal(got, reference_bernoulli(numel, 7, step, k))


def test_gap_estimate_is_exact_at_every_threshold():
    """The float estimate is corrected by integer comparisons: at x = T_j and T_j - 1 (where rounding
    could put it either side) the gap is the exact count #{j : T_j > x}."""
    for k in (0.5, 0.1, 0.003, 2e-4):
        mask = masks.BernoulliMask(10_000, 0, torch.device("cpu"))
        mask._prepare(k)
        t = torch.tensor(masks.geometric_thresholds(k))
        x = torch.cat([t[1:], t[1:] - 1, torch.tensor([0, 1, 2**32 - 1])])
        x = x[(x >= 0) & (x < 2**32)]
        exact = len(t) - torch.searchsorted(t.flip(0), x, right=True)  # #{j : T_j > x}
        got = torch.cat([mask._gaps_(part.clone()) for part in x.split(mask._scratch[0].numel())])
        assert torch.equal(got, exact)


def test_bernoulli_statistics():
    """Each position with probability k, independently of its neighbours and of other steps."""
    numel, k = 2_000_000, 0.1
    mask = masks.BernoulliMask(numel, 3, torch.device("cpu"))
    a = torch.zeros(numel, dtype=torch.bool)
    b = torch.zeros(numel, dtype=torch.bool)
    pa, pb = mask(5, k), mask(6, k)
    a[pa[pa < numel]] = True
    b[pb[pb < numel]] = True
    sigma = math.sqrt(k * (1 - k) / numel)
    assert abs(a.double().mean().item() - k) < 5 * sigma
    assert abs((a & b).double().mean().item() - k * k) < 5 * math.sqrt(k * k / numel)  # steps independent
    assert abs((a[1:] & a[:-1]).double().mean().item() - k * k) < 5 * math.sqrt(k * k / numel)  # neighbours
    gaps = torch.diff(pa[pa < numel]).double()
    # geometric: mean 1/k, variance (1-k)/k^2
    assert abs(gaps.mean().item() - 1 / k) < 5 * math.sqrt((1 - k) / k**2 / gaps.numel())
    assert abs(gaps.var().item() / ((1 - k) / k**2) - 1) < 0.02


def test_mask_does_not_depend_on_generator_state_or_chunking(monkeypatch):
    numel, k = 300_000, 0.2
    first = masks.BernoulliMask(numel, 11, torch.device("cpu"))(4, k)
    torch.manual_seed(123)
    torch.rand(1000)
    monkeypatch.setattr(masks, "_CHUNK", 1 << 12)  # another chunking of the same counters
    again = masks.BernoulliMask(numel, 11, torch.device("cpu"))
    again(9, 0.5)  # another k and step first: cached state must not leak into the next draw
    assert torch.equal(again(4, k), first)
    assert not torch.equal(masks.BernoulliMask(numel, 12, torch.device("cpu"))(4, k)[:100], first[:100])


@pytest.mark.parametrize("k", [0.5, 0.1, 0.01, 0.001])
def test_compiled_bernoulli_draw_is_the_eager_draw(k, monkeypatch):
    """A fused optimizer's draw (one compiled kernel per chunk: inductor's int64 hash, float estimate and
    comparisons) gives the eager draw's positions bit for bit, and the numpy reference's, over several
    chunks (the last one partial: no length a multiple of the chunk) and seeds, steps and layouts."""
    from torch._dynamo.utils import counters

    from slamb.optim import fused

    breaks = sum(counters["graph_break"].values())
    monkeypatch.setattr(masks, "_CHUNK", 3000)  # 4 or 5 chunks a draw, each chunk length compiled once
    passes = fused.Passes("SLAMB")
    for numel, seed in ((int(10_007 / k), 7), (int(13_001 / k), 11)):
        cpu = torch.device("cpu")
        eager, compiled = masks.BernoulliMask(numel, seed, cpu), masks.BernoulliMask(numel, seed, cpu, passes)
        for step in (1, 2, 1000):
            got = compiled(step, k)
            assert torch.equal(got, eager(step, k)), (numel, seed, step)
        np.testing.assert_array_equal(got[got < numel].numpy(), reference_bernoulli(numel, seed, 1000, k))
    assert passes.failed is None and {key[0] for key in passes.compiled} == {masks._draw_graph}
    assert len(passes.compiled) == 3  # the full chunk's graph and each layout's last chunk's
    assert sum(counters["graph_break"].values()) == breaks  # each a whole graph: one kernel, then the cumsum


def test_mask_is_the_same_on_the_meta_device_shapes():
    """The meta device imitates a non-CPU device: the draw runs without touching a generator and
    takes the same number of gaps, so every device type packs the same count."""
    cpu = masks.BernoulliMask(100_000, 0, torch.device("cpu"))(3, 0.1)
    meta = masks.BernoulliMask(100_000, 0, torch.device("meta"))(3, 0.1)
    assert meta.shape == cpu.shape and meta.dtype == cpu.dtype


def test_cyclic_mask_is_unchanged():
    """v1's permutation comes from torch's CPU generator seeded with the seed, as before."""
    numel, k = 50_000, 0.25
    perm = torch.randperm(numel, generator=torch.Generator().manual_seed(5))
    chunks = [c.sort().values for c in perm.chunk(4)]
    mask = masks.CyclicMask(numel, 5, torch.device("cpu"))
    for step in range(6):
        assert torch.equal(mask(step, k), chunks[step % 4])


def count_worker(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 100)
    for p in model.parameters():
        p.grad = torch.full_like(p, rank + 1.0)  # each rank its own (the same on every rank would be refused first)
    opt = slamb.SLAMB(model.parameters(), compress_ratio=0.1, min_compress_numel=1000, seed=rank)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.multiprocess
def test_ranks_with_other_masks_are_refused_at_the_first_step():
    errors = distributed.run(count_worker, 2)
    assert all(e is not None and "select different numbers of momentum entries" in e for e in errors)


# ----------------------------------------------------------------------------- on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["cyclic", "bernoulli"])
def test_mask_positions_on_cuda_equal_the_cpus(policy):
    """The masks are functions of (seed, step, k, position) on every device: over 24M coordinates the
    positions CUDA draws are the CPU's, so ranks on different devices pack the same entries."""
    numel = 24_000_000
    cls = masks.CyclicMask if policy == "cyclic" else masks.BernoulliMask
    cpu, cuda = cls(numel, 3, CPU), cls(numel, 3, CUDA)
    for step, k in ((1, 0.1), (2, 0.1), (57, 0.01), (1000, 0.003)):
        a, b = cpu(step, k), cuda(step, k)
        assert b.device.type == "cuda"
        assert a.numel() > 0.5 * k * numel
        assert torch.equal(b.cpu(), a), (policy, step, k)


@pytest.mark.gpu
def test_compiled_bernoulli_draw_on_cuda_equals_the_cpus():
    """A fused optimizer's draw, one Triton kernel per chunk (the int64 hash, the float estimate, the integer
    comparisons), gives the eager CPU draw's positions, over one chunk and several (k = 0.5: 3 chunks)."""
    from slamb.optim import fused

    numel = 24_000_000
    cpu, cuda = masks.BernoulliMask(numel, 3, CPU), masks.BernoulliMask(numel, 3, CUDA, fused.Passes("SLAMB"))
    for step, k in ((1, 0.1), (2, 0.1), (3, 0.5), (57, 0.01), (1000, 0.003)):
        assert torch.equal(cuda(step, k).cpu(), cpu(step, k)), (step, k)
    assert cuda.passes.failed is None and len(cuda.passes.compiled) == 5


@pytest.mark.gpu
def test_the_draw_below_k_1e_3_on_cuda_equals_the_cpus():
    """Below k = 1e-3 the draw's estimate is float64 (float32's error would reach a gap): at k = 5e-4, eager and
    compiled (one Triton kernel per chunk) on CUDA, the CPU's positions."""
    from slamb.optim import fused

    numel, k = 24_000_000, 5e-4
    cpu = masks.BernoulliMask(numel, 5, CPU)
    eager, compiled = masks.BernoulliMask(numel, 5, CUDA), masks.BernoulliMask(numel, 5, CUDA, fused.Passes("SLAMB"))
    for step in (1, 2, 1000):
        want = cpu(step, k)
        assert want.numel() > 0.5 * k * numel
        assert torch.equal(eager(step, k).cpu(), want), step
        assert torch.equal(compiled(step, k).cpu(), want), step
    assert compiled.passes.failed is None and compiled._dtype == torch.float64
