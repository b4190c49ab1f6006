"""SLAMB's ledger measures both parts of its momentum exchange, in every comm_dtype, plain, overlapped and across
nodes: the sampled entries as kind "momentum", the always-averaged tensors as "momentum_dense", each the bytes of
its own entries (int8: its values and scales), and the ledger's kinds add up to the bytes a recording process
group saw handed to every collective."""
from __future__ import annotations

import pytest
import torch

import slamb
from slamb import comm
from slamb.optim.slamb_update import always_averaged
from tests import integration_support as support
from tests.test_slamb import OverlapNet

pytestmark = pytest.mark.multiprocess

DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
T = 9000  # SLAMB's default min_compress_numel: OverlapNet's b.weight (4,800) and the biases are always averaged
L = 2  # processes per node in the hierarchical run
STEPS = 3


def train(rank, steps=STEPS, **settings) -> tuple[list[dict], list[bool], list[int]]:
    """Per step: the bytes the recording group saw, the ledger's step, the mask, the overlapped buckets;
    and per parameter (layout order) whether it is always averaged, and its numel."""
    torch.manual_seed(0)
    model = OverlapNet()
    opt = slamb.SLAMB(model.parameters(), lr=0.01, compress_ratio=0.2, sync_interval=2, min_compress_numel=T,
                      **settings)
    ddp = slamb.wrap_model(model, opt, bucket_cap_mb=0.05)  # several buckets: several overlapped exchanges
    out = []
    for t in range(1, steps + 1):
        x = torch.randn(8, 100, generator=torch.Generator().manual_seed(1000 * rank + t))
        opt.zero_grad(set_to_none=True)
        loss = ddp(x).square().mean()
        # from backward on: DDP's forward at step 2 broadcasts its rebuilt bucket order, no optimizer's byte
        before = support.sent_by_op()
        loss.backward()
        buckets = list(opt.exchange.pending)
        by_positions = sum(e.sent.positions is not None for e in opt.exchange.pending.values())
        opt.step()
        sent = support.sent_by_op()
        out.append({"sent": sum(sent.values()) - sum(before.values()), "ledger": opt.comm_stats()["last_step"],
                    "mask": opt.last_sync_mask(), "buckets": buckets, "by_positions": by_positions})
    params = list(opt._layout.params)
    return out, [always_averaged(p, T) for p in params], [p.numel() for p in params]


# (overlap, fused): the fused step packs the same buffer by layout positions, or per bucket when overlapped
PATHS = ((False, False), (True, False), (False, True), (True, True))


def flat_worker(rank, world):
    return {(variant, name, overlap, fused): train(rank, variant=variant, comm_dtype=dtype, overlap=overlap,
                                                   fused=fused)
            for variant in ("v1", "v2") for name, dtype in DTYPES.items() for overlap, fused in PATHS}


def counts(mask: torch.Tensor, numels: list[int]) -> list[int]:
    """Entries of each parameter the step's mask selected."""
    return [int(part.sum()) for part in mask.split(numels)]


def exchange_bytes(dtype, n: int, entries: int) -> int:
    """Bytes one rank hands to the collectives of a mean of ``entries`` values in ``dtype``: an all-reduce of
    them, or for int8 the all-to-all of n padded chunks and the all-gather of its own, each with a float32
    scale per block."""
    if entries == 0:
        return 0
    if dtype == torch.int8:
        c, b = comm.int8_layout(entries, n)
        return (n * c + c) + 4 * (n * c + c) // b
    return entries * torch.empty(0, dtype=dtype or torch.float32).element_size()


def check_adds_up(step: dict) -> None:
    kinds = {k: v["payload"] for k, v in step["ledger"].items() if k != "all"}
    assert sum(kinds.values()) == step["ledger"]["all"]["payload"] == step["sent"] > 0, (kinds, step["sent"])


def test_momentum_and_momentum_dense_are_the_bytes_each_part_packed_and_every_byte_is_in_the_ledger():
    n = 2
    res = support.run(flat_worker, n)
    for r in res:
        for (variant, name, overlap, fused), (steps, dense, numels) in r.items():
            assert any(dense) and not all(dense)
            for t, step in enumerate(steps, start=1):
                check_adds_up(step)
                selected = counts(step["mask"], numels)
                # the exchanges of the step: one per DDP bucket when overlapped (from step 2, once the
                # layout exists), else one over every parameter
                groups = step["buckets"] or [range(len(numels))]
                assert sorted(i for g in groups for i in g) == list(range(len(numels)))
                if overlap and t > 1:
                    assert len(groups) > 1
                    # fused: every bucket's parameters are consecutive in the layout, so each gathers by positions
                    assert step["by_positions"] == (len(groups) if fused else 0)
                want = {part: sum(exchange_bytes(DTYPES[name], n, sum(selected[i] for i in g if dense[i] == is_dense))
                                  for g in groups)
                        for part, is_dense in (("momentum_dense", True), ("momentum", False))}
                got = {part: step["ledger"][part]["payload"] for part in want}
                assert got == want, (variant, name, overlap, fused, t)
                if DTYPES[name] != torch.int8:  # nothing padded: each part is its entries
                    size = torch.empty(0, dtype=DTYPES[name] or torch.float32).element_size()
                    assert got["momentum_dense"] == sum(m for m, d in zip(numels, dense) if d) * size
                    assert got["momentum"] == sum(s for s, d in zip(selected, dense) if not d) * size
                    assert 0 < got["momentum"] < 0.3 * sum(m for m, d in zip(numels, dense) if not d) * size
                assert "scales" not in step["ledger"]  # int8's scales are in the parts they scale
                assert "control" in step["ledger"] and ((t - 1) % 2 == 0) == ("params" in step["ledger"])  # H = 2


def hierarchy_worker(rank, world):
    return {(name, overlap, fused): train(rank, hierarchy="node", local_world_size=L, comm_dtype=DTYPES[name],
                                          overlap=overlap, fused=fused)
            for name, overlap, fused in (("fp32", False, False), ("int8", False, False), ("fp16", True, False),
                                         ("int8", False, True))}


def test_hierarchical_parts_cross_the_nodes_each_padded_on_its_own():
    res = support.run(hierarchy_worker, 2 * L)
    nodes = 2
    for r in res:
        for (name, _, _), (steps, dense, numels) in r.items():
            for t, step in enumerate(steps, start=1):
                check_adds_up(step)
                selected = counts(step["mask"], numels)
                groups = step["buckets"] or [range(len(numels))]
                for part, is_dense in (("momentum_dense", True), ("momentum", False)):
                    # each local rank carries 1/L of each part over the nodes, then the node gathers them (float32)
                    widths = [-(-sum(selected[i] for i in g if dense[i] == is_dense) // L) for g in groups]
                    levels = step["ledger"][part]["levels"]
                    assert levels["inter"]["payload"] == sum(exchange_bytes(DTYPES[name], nodes, w) for w in widths)
                    assert levels["intra"]["payload"] == 4 * sum(widths)
                    assert step["ledger"][part]["payload"] == levels["inter"]["payload"] + levels["intra"]["payload"]
