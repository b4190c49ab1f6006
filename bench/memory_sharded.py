"""Per-GPU memory under FSDP2 and HSDP: the sharded rows of ``bench.memory``'s page.

Modelled from what the optimizers allocate, not run at these sizes; ``tests/test_bench_memory_sharded.py``
holds the model against the bytes the real optimizers keep on FSDP2 shards in a gloo group. Per rank of a
shard group of S ranks (HSDP's replicas each hold the same; the replica count changes nothing here):

* FSDP2 cuts dim 0 of every parameter into S chunks as ``torch.chunk`` does
  (:func:`slamb.sharding.chunk_rows`) and pads each rank's storage to the first chunk's rows: rank 0 holds
  the most, and is the rank reported. Parameters and gradients fp32, 4 bytes per padded local entry.
* Optimizer state per local entry: LAMB and torch's AdamW keep ``exp_avg`` and ``exp_avg_sq`` in
  :func:`slamb.optim.precision.state_dtype` (fp32) as the parameter's shard, and a 4-byte ``step`` per
  tensor; SLAMB keeps flat ``exp_avg``, ``exp_avg_sq`` (fp32) and the age (int16) over its local entries
  (``FlatLayout.adopt``), 10 bytes, nothing per tensor.
* SLAMB's scratch: the multi-tensor path's two fp32 update buffers per local entry, and the mask's buffers.
  The fused path (``fused=True``) keeps its state over an aligned layout (each tensor's shard padded to
  ``fused.BLOCK`` entries) and, as scratch, flat copies of the shard's parameters and gradients (fp32, over
  the same layout: FSDP2's shards are copied in and back at each step), an int64 per block (the block's
  tensor), the padding's zeros (the largest pad) and no draw scratch (v2's draw is compiled). v2's Bernoulli
  draw is a run of gaps over the WHOLE model's compressible coordinates on every shard (a run cannot start
  mid-way), so its hashed counters (int64, one per gap a draw takes: k N of the whole model, plus 12
  standard deviations) and its three chunk buffers do not shard: they are counted from the real
  :class:`~slamb.optim.masks.BernoulliMask` built on the meta device. v1's cyclic cut keeps a shard's own
  coordinates: int16 gaps, int32 where the shard's coordinates have a hole of 2^15 or more between two of
  its spans (the gap across it needs it; inside a span a gap of 2^15 has probability (1 - k)^(2^15)), an
  int64 start per chunk (a draw's positions are made afresh in the step).
* FSDP2's transients, per unit (``slamb.shard_model``: one per transformer layer, the root taking the
  embeddings and heads), with ``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``: the
  unit being computed and the next one, prefetched, all-gathered in fp16 (2 bytes per entry each), and the
  unit's gradient before its reduce-scatter, fp16 and its fp32 copy for the reduce-scatter (6 bytes); the
  root's parameters stay gathered from the start of forward to its backward, the last (FSDP2 does not
  reshard the root after forward). The peak is the larger of a layer's backward beside the root's
  gathered parameters, 2 R + (2 + 2 + 6) B, and the root's own backward, (2 + 6) R.
* Activations are not sharded: each rank runs its own micro-batch, as under DDP (``bench.memory``'s fit).
"""
from __future__ import annotations

import inspect
import math
import re

import torch

from bench.memory_model import AUTOCAST_COPY, GPU_BYTES, GPUS_PER_NODE, WORD, activations, per_token_bytes
from slamb.optim.fused import BLOCK
from slamb.optim.masks import BernoulliMask, num_chunks
from slamb.optim.slamb import SLAMB
from slamb.optim.slamb_update import always_averaged
from slamb.sharding import chunk_rows

SHARD_SIZES = (1, 8, 64)
# the rows of bench.memory that take FSDP2's sharded parameters (registry name, settings), and torch's AdamW
ROWS = {"slamb_v2": ("slamb", {"variant": "v2"}), "slamb_v1": ("slamb", {"variant": "v1"}),
        "slamb_v2_fused": ("slamb", {"variant": "v2", "fused": True}),
        "slamb_v1_fused": ("slamb", {"variant": "v1", "fused": True}),
        "lamb": ("lamb", {}), "adamw": ("adamw", {})}
GATHERED = 2  # bytes per entry of an all-gathered unit: MixedPrecisionPolicy(param_dtype=float16)
REDUCED = 4  # bytes per entry of a reduce-scatter's input: reduce_dtype=float32
UNSHARDED_GRAD = GATHERED + REDUCED  # a unit's fp16 gradient and its fp32 copy for the reduce-scatter
# the page's headline: these rows of this model at this shard size (docs/benchmarks.md gives the design's goal)
HEADLINE = {"model": "BERT-XL", "rows": ("slamb_v2", "slamb_v1"), "shard": 8}
# a 7B-parameter BERT: BERT-XL's config (64-dim heads, 4x FFN, its vocabulary) at hidden 4096, 34 layers
BERT_7B = {"hidden_size": 4096, "num_attention_heads": 64, "intermediate_size": 16384, "num_hidden_layers": 34,
           "name": "bert_7b"}  # the config's own name, not a file
_BLOCK = re.compile(r"(.*\.layer\.\d+)\.")  # a transformer layer's parameters: one FSDP2 unit


def slamb_defaults() -> dict:
    """The SLAMB settings the rows use: its defaults (as ``bench.memory``'s measured rows)."""
    sig = inspect.signature(SLAMB.__init__).parameters
    return {k: sig[k].default for k in ("compress_ratio", "min_compress_numel")}


def local_numels(shapes, shards: int, rank: int) -> list[int]:
    """Entries of each tensor on ``rank`` of ``shards``: its dim-0 chunk (FSDP2's cut)."""
    return [chunk_rows(s[0], shards, rank)[1] * math.prod(s[1:]) for s in shapes]


def padded_numels(shapes, shards: int) -> list[int]:
    """Entries of each tensor's storage on every rank: the first chunk's rows (FSDP2 pads to it)."""
    return local_numels(shapes, shards, 0)


def _compressed(shapes, min_compress_numel: int) -> list[bool]:
    return [not always_averaged(torch.empty(s, device="meta"), min_compress_numel) for s in shapes]


def _meta_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bernoulli_bytes(compressible: int, k: float, fused: bool = False) -> int:
    """The bytes v2's mask keeps between draws over ``compressible`` coordinates at ratio ``k``: the real
    mask's buffers, made on the meta device; ``fused``: its compiled draw, which keeps no scratch."""
    mask = BernoulliMask(compressible, 0, torch.device("meta"))
    mask._prepare(k)
    return _meta_bytes([mask._counters, *([] if fused else mask._scratch), mask._below, mask._above])


def _largest_hole(shapes, compressed: list[bool], shards: int, rank: int) -> int:
    """The most coordinates of the compressible concatenation between two consecutive spans of ``rank``'s."""
    spans, start = [], 0
    for s, c in zip(shapes, compressed):
        if c:
            row = math.prod(s[1:])
            first, n = chunk_rows(s[0], shards, rank)
            if n:
                spans.append((start + first * row, start + (first + n) * row))
            start += s[0] * row
    return max((b[0] - a[1] for a, b in zip(spans, spans[1:])), default=0)


def cyclic_bytes(shapes, compressed: list[bool], shards: int, rank: int, k: float) -> int:
    """The bytes v1's mask keeps on ``rank``: its cut of the shard's own coordinates (gaps) and a start per
    chunk."""
    whole = sum(math.prod(s) for s, c in zip(shapes, compressed) if c)
    mine = sum(n for n, c in zip(local_numels(shapes, shards, rank), compressed) if c)
    chunks = num_chunks(whole, k)[1]
    gap = 2 if _largest_hole(shapes, compressed, shards, rank) < 2**15 else 4
    return gap * mine + 8 * chunks


def optimizer_bytes(row: str, shapes, shards: int, rank: int = 0, settings: dict | None = None) -> dict:
    """State and scratch bytes of ``row`` (:data:`ROWS`) on ``rank`` of a shard group of ``shards``."""
    name, row_settings = ROWS[row]
    mine = local_numels(shapes, shards, rank)
    numel = sum(mine)
    if name != "slamb":  # exp_avg and exp_avg_sq in fp32, a 4-byte step per tensor
        return {"state": 8 * numel + 4 * len(shapes), "scratch": 0}
    settings = {**slamb_defaults(), **(settings or {})}
    k, compressed = settings["compress_ratio"], _compressed(shapes, settings["min_compress_numel"])
    fused = row_settings.get("fused", False)
    if row_settings["variant"] == "v2":
        mask = bernoulli_bytes(sum(math.prod(s) for s, c in zip(shapes, compressed) if c), k, fused)
    else:
        mask = cyclic_bytes(shapes, compressed, shards, rank, k)
    if not fused:
        return {"state": 10 * numel, "scratch": 8 * numel + mask}
    aligned = [-(-n // BLOCK) * BLOCK for n in mine]
    entries, pad = sum(aligned), max(a - n for a, n in zip(aligned, mine))
    return {"state": 10 * entries, "scratch": 2 * WORD * entries + 8 * (entries // BLOCK) + WORD * pad + mask}


def units(named_shapes) -> dict[str, int]:
    """Entries of each FSDP2 unit: one per transformer layer (``...layer.<i>.``), the root the rest."""
    out: dict[str, int] = {}
    for name, shape in named_shapes:
        m = _BLOCK.match(name)
        key = m.group(1) if m else "root"
        out[key] = out.get(key, 0) + math.prod(shape)
    return out


def fsdp_transient(named_shapes) -> int:
    """FSDP2's peak of gathered parameters and unsharded gradients (the module docstring), whatever the
    shard size: a unit is gathered whole (at shard size 1, FSDP2's all-gather is a copy)."""
    sizes = units(named_shapes)
    root = sizes.pop("root", 0)
    block = max(sizes.values(), default=0)
    return max(GATHERED * root + (2 * GATHERED + UNSHARDED_GRAD) * block, (GATHERED + UNSHARDED_GRAD) * root)


def per_gpu(row: str, named_shapes, shards: int, acts: float = 0.0) -> dict:
    """Bytes on rank 0 of a shard group of ``shards``: resident (parameters, gradients, state and scratch),
    FSDP2's transient, ``acts`` of activations, the peak and whether it fits the GPU."""
    shapes = [s for _, s in named_shapes]
    padded = sum(padded_numels(shapes, shards))
    b = {"params": WORD * padded, "grads": WORD * padded, **optimizer_bytes(row, shapes, shards)}
    b["resident"] = b["params"] + b["grads"] + b["state"] + b["scratch"]
    b["transient"] = fsdp_transient(named_shapes)
    b["activations"] = acts
    b["peak"] = b["resident"] + b["transient"] + acts
    b["fits"] = b["peak"] <= GPU_BYTES
    return b


def largest_micro_batch(row: str, named_shapes, shards: int, per_sequence: float) -> int:
    b = per_gpu(row, named_shapes, shards)
    return max(0, math.floor((GPU_BYTES - b["peak"]) / per_sequence))


def headline(models: dict[str, dict]) -> dict[str, float]:
    """Each of :data:`HEADLINE`'s rows' resident bytes at its shard size."""
    shapes = models[HEADLINE["model"]]["named_shapes"]
    return {row: per_gpu(row, shapes, HEADLINE["shard"])["resident"] for row in HEADLINE["rows"]}


def render(models: dict[str, dict], fit: dict, micro_batch: int, cut_per_param: float) -> list[str]:
    """The page's sharded section. ``models``: name -> {"params", "hidden", "layers", "named_shapes"};
    ``fit``: ``bench.memory``'s activation fit; ``cut_per_param``: v1's host cut per parameter of the whole
    model (measured by ``bench.memory``; it does not shard)."""
    gb = lambda x: f"{x / 1e9:.1f}"  # noqa: E731
    k = slamb_defaults()
    out = ["## Sharded: FSDP2 and HSDP (modelled)", "",
           "Per GPU under FSDP2 (`slamb.shard_model` per transformer layer, the root taking embeddings and heads; "
           "HSDP holds the same per GPU, whatever its replica count), at shard sizes "
           f"{', '.join(map(str, SHARD_SIZES))}. Modelled from what the optimizers allocate (`bench/memory_sharded.py`; "
           "`tests/test_bench_memory_sharded.py` checks the model against the state the real optimizers hold "
           "on FSDP2 shards of 2 gloo ranks, byte for byte): rank 0, which holds the most (FSDP2 cuts dim 0 as "
           "`torch.chunk` and pads every rank to the first chunk). Parameters and gradients fp32, sharded; state: "
           "LAMB and AdamW 8 bytes per local entry and 4 per tensor, SLAMB 10 (m, v fp32, int16 age); SLAMB's "
           "scratch: two fp32 update buffers per local entry and the mask's buffers "
           f"(k = {k['compress_ratio']}, min_compress_numel = {k['min_compress_numel']}, the defaults). v2's "
           "Bernoulli counters are drawn over the whole model on every shard: about "
           f"{8 * k['compress_ratio']:.1f} bytes per parameter of the WHOLE model, which do not shard. v1 keeps "
           "only its shard's cut, int32 gaps once the shard's coordinates have holes of 2^15. FSDP2 with "
           "`MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)`: the transient is a layer being "
           f"computed and the prefetched next one all-gathered in fp16 and the layer's unsharded gradient (fp16 "
           "and its fp32 copy for the reduce-scatter), beside the root's gathered parameters (FSDP2 keeps the "
           "root gathered from forward to its backward), or the root's own backward, whichever is larger; it "
           "does not shrink with the shard size. Activations are not sharded (each rank its own micro-batch; "
           f"micro-batch {micro_batch}, sequence {fit['seq']}, the fit above). Step transients, the CUDA "
           "context, NCCL's buffers and fragmentation are excluded. Fused SLAMB: its state over the aligned "
           f"layout (each tensor's shard padded to {BLOCK} entries) and, as scratch, flat fp32 copies of the "
           "shard's parameters and gradients (FSDP2's shards are copied in and back at each step), an int64 per "
           f"block of {BLOCK} and no draw scratch. 1-bit LAMB refuses FSDP2's sharded parameters "
           "(`slamb.sharding.refuse_sharded`): no row.", "",
           f"**{HEADLINE['model']} SLAMB at shard size {HEADLINE['shard']}, parameters, gradients, state and scratch "
           "per GPU:** " + ", ".join(f"{row} {v / 1e9:.2f} GB" for row, v in headline(models).items()) + ".", ""]
    for model, m in models.items():
        shapes = m["named_shapes"]
        per_seq = fit["seq"] * per_token_bytes(fit, m["hidden"], m["layers"])
        acts = activations(fit, m["hidden"], m["layers"], micro_batch)
        sizes = units(shapes)
        root = sizes.pop("root")
        cut = cut_per_param * m["params"]
        out += [f"### {model} ({m['params'] / 1e6:,.0f}M parameters), GB per GPU", "",
                f"FSDP2 units: {len(sizes)} layers of {max(sizes.values()) / 1e6:.1f}M entries, the root "
                f"{root / 1e6:.1f}M. Activations {acts / 1e9:.1f} GB at micro-batch {micro_batch}. Under autocast "
                f"instead of the mixed-precision policy, autocast's fp16 copies of every layer's weights live "
                f"from forward to their backward: {AUTOCAST_COPY * m['params'] / 1e9:.1f} GB that do not shard. "
                f"Host: v1's cut (a permutation of the whole model's coordinates) takes {cut / 1e9:.1f} GB per "
                f"rank, {GPUS_PER_NODE * cut / 1e9:.0f} GB per node of {GPUS_PER_NODE}, at every shard size.", "",
                "| optimizer | shard size | parameters | gradients | state | scratch | parameters + gradients + "
                f"state + scratch | FSDP2 transient | activations | peak | fits in 80 GB | largest micro-batch |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for row in ROWS:
            for shards in SHARD_SIZES:
                b = per_gpu(row, shapes, shards, acts)
                largest = largest_micro_batch(row, shapes, shards, per_seq)
                cells = " | ".join(gb(b[key]) for key in ("params", "grads", "state", "scratch", "resident",
                                                          "transient", "activations", "peak"))
                out.append(f"| {row} | {shards} | {cells} | {'yes' if b['fits'] else 'no'} | "
                           f"{largest if largest else 'none'} |")
        out.append("")
    return out
