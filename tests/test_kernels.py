"""bench.kernels: what one step launches, counted from the profiler; the fused steps launch the same whatever
the number of tensors."""
from __future__ import annotations

import pytest
import torch

import slamb
from bench.kernels import kernels_per_step
from tests import distributed


def test_the_counts_of_known_ops():
    """A foreach op over 5 tensors is one host op and 5 kernels on a CPU; a view is a host op and no kernel;
    a compiled function is one host op (its call) and one kernel."""
    xs = [torch.ones(3) for _ in range(5)]
    assert kernels_per_step(lambda: (torch._foreach_add_(xs, 1.0), xs[0].view(3, 1))) == \
        {"host_ops": 2, "graph_calls": 0, "kernels": 5}
    double = torch.compile(lambda x: x * 2 + 1, dynamic=False)
    double(xs[0])
    assert kernels_per_step(lambda: double(xs[0])) == {"host_ops": 1, "graph_calls": 1, "kernels": 1}


def model(n: int, rank: int = 0) -> list[torch.nn.Parameter]:
    """n tensors, half compressed (2-D, 60 entries) and half always averaged (1-D), with gradients (the ranks'
    own: the same parameters, other gradients)."""
    gen = torch.Generator().manual_seed(n)
    params = [torch.nn.Parameter(torch.randn((30, 2) if i % 2 else (30,), generator=gen)) for i in range(n)]
    gen.manual_seed(1000 * rank + n)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


BUILDS = {
    "lamb_fused": lambda p: slamb.LAMB(p, lr=1e-2, weight_decay=0.01, fused=True),
    "slamb_v1_fused": lambda p: slamb.SLAMB(p, variant="v1", fused=True, min_compress_numel=50, compress_ratio=0.3),
    "slamb_v2_fused": lambda p: slamb.SLAMB(p, variant="v2", fused=True, min_compress_numel=50, compress_ratio=0.3),
    "lamb": lambda p: slamb.LAMB(p, lr=1e-2, weight_decay=0.01),
}


def counted(name: str, n: int, rank: int = 0) -> dict:
    opt = BUILDS[name](model(n, rank))
    for _ in range(3):  # compiled, and past the first steps' checks
        opt.step()
    return kernels_per_step(opt.step)


@pytest.mark.parametrize("name, graphs", [("lamb_fused", 2), ("slamb_v1_fused", 3), ("slamb_v2_fused", 4)])
def test_a_fused_step_launches_the_same_kernels_for_10_and_100_tensors(name, graphs):
    """Two passes over the flat buffers (SLAMB: and the age's; v2: and its compiled mask draw), and the same eager
    ops around them, the non-finite screen included: the step's kernels do not grow with the number of tensors."""
    few, many = counted(name, 10), counted(name, 100)
    assert few["graph_calls"] == many["graph_calls"] == graphs
    assert few["host_ops"] == many["host_ops"]
    assert few["kernels"] == many["kernels"]


def counted_on_ranks(rank, world):
    return {name: [counted(name, n, rank) for n in (10, 100)] for name in ("slamb_v1_fused", "slamb_v2_fused")}


@pytest.mark.multiprocess
def test_a_fused_step_with_its_exchange_launches_the_same_kernels_for_10_and_100_tensors():
    """On two ranks the step also gathers the selected momentum, all-reduces it and scatters the averages back:
    by layout positions, so that too is the same ops whatever the number of tensors."""
    for counts in distributed.run(counted_on_ranks, 2):
        for name, (few, many) in counts.items():
            assert few == many, name


def test_the_multi_tensor_step_dispatches_more_ops_with_more_tensors():
    """The count can see per-tensor work: the multi-tensor LAMB launches kernels per tensor."""
    few, many = counted("lamb", 10), counted("lamb", 100)
    assert many["kernels"] - few["kernels"] >= 90 * 5
