"""bench.memory's sharded rows: the model of what the optimizers hold per FSDP2 shard against the bytes the
real optimizers hold on 2 gloo ranks, its parts against the real classes, and the committed page's
numbers (the BERT-XL headline among them) against the model."""
from __future__ import annotations

import math
import re

import pytest
import torch

import slamb
from bench import memory
from bench import memory_sharded as ms
from slamb.optim.masks import BernoulliMask
from slamb.sharding import chunk_rows
from tests import distributed

MIN_COMPRESS = 64
# per tensor, the step's bookkeeping (SLAMB's bounds, flags and indices, the fused path's per-tensor shifts, block
# counts and table index besides; LAMB's none): not modelled, and bounded here so that nothing model-sized hides
# in it
BOOKKEEPING = 96


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 17), torch.nn.LayerNorm(17),  # 17 rows: uneven over 2 shards
        torch.nn.Linear(17, 4000),  # 68,000 entries: a shard leaves a hole of 34,000 > 2^15 in v1's cut
        torch.nn.Linear(4000, 3))  # 3 rows: 2 + 1


def held(rank, world):
    """Per row of :data:`ms.ROWS`: the bytes its optimizer holds on this rank after 3 steps on FSDP2 shards
    (``memory.counted_bytes``: state and scratch, each storage once, the local shards'), and what the mask
    keeps that the model takes at its expected size (v1's chunk buffer)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for row, (name, row_settings) in ms.ROWS.items():
        variant = row_settings.get("variant")
        settings = dict(row_settings, min_compress_numel=MIN_COMPRESS) if variant else {}
        model = slamb.shard_model(make_model(), init_device_mesh("cpu", (world,)), blocks=(torch.nn.Linear,))
        opt = slamb.create_optimizer(name, model.parameters(), lr=1e-3, **settings)
        if name != "adamw":  # torch's AdamW takes FSDP's own reduction: no wrap_model
            model = slamb.wrap_model(model, opt)
        for t in range(3):
            opt.zero_grad()
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + t))).sum().backward()
            opt.step()
        params = list(model.parameters())
        mask = getattr(opt, "_mask_fn", None)
        out[row] = {**memory.counted_bytes(opt, params), "shapes": [tuple(p.shape) for p in params],
                    "local": [p.to_local().numel() for p in params],
                    "gap_bytes": mask.gaps.element_size() if variant == "v1" else None}
    return out


@pytest.fixture(scope="module")
def runs():
    return distributed.run(held, 2)


@pytest.mark.multiprocess  # 2 gloo processes
def test_state_held_per_shard_is_the_models_exactly(runs):
    for rank, got in enumerate(runs):
        for row, h in got.items():
            shapes = h["shapes"]
            assert h["local"] == ms.local_numels(shapes, 2, rank)  # FSDP2's cut is torch.chunk's
            want = ms.optimizer_bytes(row, shapes, 2, rank, dict(min_compress_numel=MIN_COMPRESS))
            print(f"rank {rank} {row}: state held {h['state']:,} B, modelled {want['state']:,} B; scratch held "
                  f"{h['scratch']:,} B, modelled {want['scratch']:,} B")
            assert h["state"] == want["state"], (rank, row)
            scratch = h["scratch"]
            if h["gap_bytes"] is not None:  # v1
                assert h["gap_bytes"] == 4  # the hole after the 4000-row weight's shard: int32 gaps, as modelled
            assert 0 <= scratch - want["scratch"] <= BOOKKEEPING * len(shapes), (rank, row)
    # the ranks hold different amounts (17 and 3 rows over 2): rank 0 the most, as the page reports
    assert runs[0]["slamb_v2"]["state"] > runs[1]["slamb_v2"]["state"]


def test_chunk_rows_is_torch_chunks_cut():
    for rows in (0, 1, 3, 17, 64, 100):
        for shards in (1, 2, 3, 8, 64):
            chunks = torch.arange(rows).chunk(shards) if rows else ()
            for index in range(shards):
                start, n = chunk_rows(rows, shards, index)
                real = chunks[index] if index < len(chunks) else torch.empty(0)
                assert n == real.numel() and (n == 0 or start == int(real[0]))


def test_bernoulli_buffers_are_the_real_masks_and_do_not_shard():
    numel, k = 300_000, 0.1
    mask = BernoulliMask(numel, 0, torch.device("cpu"))
    mask(1, k)
    real = sum(t.numel() * t.element_size() for t in (mask._counters, *mask._scratch, mask._below, mask._above))
    assert ms.bernoulli_bytes(numel, k) == real
    # v2's mask is drawn over the whole model on every shard: the same bytes at every shard size
    shapes = [(3000, 1000)]
    by_shard = [ms.optimizer_bytes("slamb_v2", shapes, s)["scratch"] - 8 * sum(ms.local_numels(shapes, s, 0))
                for s in (1, 8, 64)]
    assert by_shard[0] == by_shard[1] == by_shard[2] == ms.bernoulli_bytes(3_000_000, 0.1)


def test_cyclic_gaps_widen_where_a_shard_leaves_a_hole():
    shapes = [(400, 100), (400, 100)]  # 40,000 entries each
    compressed = [True, True]
    assert ms._largest_hole(shapes, compressed, 1, 0) == 0
    assert ms._largest_hole(shapes, compressed, 2, 0) == 20_000  # < 2^15: int16
    assert ms._largest_hole(shapes, compressed, 8, 0) == 35_000  # >= 2^15: int32
    mine = 50 * 100 * 2
    assert ms.cyclic_bytes(shapes, compressed, 8, 0, 0.1) == 4 * mine + 8 * 10


def test_fsdp_transient_and_per_gpu_arithmetic():
    named = [("embeddings.word.weight", (1000, 10)),
             ("encoder.layer.0.dense.weight", (40, 10)), ("encoder.layer.0.dense.bias", (40,)),
             ("encoder.layer.1.dense.weight", (40, 10)), ("encoder.layer.1.dense.bias", (40,)), ("head.bias", (10,))]
    assert ms.units(named) == {"root": 10_010, "encoder.layer.0": 440, "encoder.layer.1": 440}
    # the root's backward (fp16 gathered + fp16 grad + fp32 copy) beats a layer's beside the gathered root
    assert ms.fsdp_transient(named) == max(2 * 10_010 + 10 * 440, 8 * 10_010) == 80_080
    b = ms.per_gpu("lamb", named, 8, acts=1000.0)
    padded = 125 * 10 + 2 * (5 * 10 + 5) + 2  # ceil(rows / 8) rows each
    assert (b["params"], b["grads"]) == (4 * padded, 4 * padded)
    assert b["state"] == 8 * padded + 4 * len(named)  # rank 0 holds full chunks
    assert b["resident"] == b["params"] + b["grads"] + b["state"] + b["scratch"]
    assert b["peak"] == b["resident"] + 80_080 + 1000.0 and b["fits"]


def _cells(page: str, model: str) -> dict[tuple[str, int], list[float]]:
    section = page.split("## Sharded", 1)[1].split(f"### {model} ", 1)[1].split("###", 1)[0]
    out = {}
    for line in section.splitlines():
        parts = [c.strip() for c in line.strip("|").split("|")]
        if len(parts) == 12 and parts[0] in ms.ROWS:
            out[parts[0], int(parts[1])] = [float(c) for c in parts[2:10]]
    return out


def test_committed_page_has_the_sharded_rows_and_the_headline_follows_from_them():
    page = memory.OUT.read_text()
    models = memory.sharded_models()
    for model, m in models.items():
        cells = _cells(page, model)
        assert set(cells) == {(row, s) for row in ms.ROWS for s in ms.SHARD_SIZES}
        for (row, shards), got in cells.items():
            b = ms.per_gpu(row, m["named_shapes"], shards)
            want = [b[k] / 1e9 for k in ("params", "grads", "state", "scratch", "resident", "transient")]
            assert got[:6] == pytest.approx([round(w, 1) for w in want], abs=0.051), (model, row, shards)
    xl = _cells(page, ms.HEADLINE["model"])
    want = ms.headline(models)
    line = next(line for line in page.splitlines() if "BERT-XL SLAMB at shard size 8" in line)
    got = {row: float(gb) for row, gb in re.findall(r"(slamb_v\d) ([\d.]+) GB", line)}
    assert got == pytest.approx({row: round(v / 1e9, 2) for row, v in want.items()}, abs=0.0051)
    assert [xl[row, ms.HEADLINE["shard"]][4] for row in ms.HEADLINE["rows"]] == pytest.approx(
        [got[row] for row in ms.HEADLINE["rows"]], abs=0.051)  # the table's rows say the same
