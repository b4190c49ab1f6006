"""The memory model's constants and its activation terms, shared by the unsharded (:mod:`bench.memory`) and
the sharded (:mod:`bench.memory_sharded`) pages."""
from __future__ import annotations

GPU_BYTES = 80e9  # an 80 GB A100 or H100 (81,920 MiB; the rest is left for the context and fragmentation)
GPUS_PER_NODE = 8
WORD = 4
AUTOCAST_COPY = 2  # bytes per parameter: autocast's fp16 copy of each fp32 weight, forward to end of backward


def dropout_mask_bytes(hidden: int, layers: int) -> int:
    """Per token: CUDA's fused dropout keeps a one-byte mask per element, after the embeddings and after each
    layer's attention and feed-forward outputs (attention's own dropout is a seed in the flash kernel)."""
    return (2 * layers + 1) * hidden


def per_token_bytes(fit: dict, hidden: int, layers: int, cuda_dropout: bool = True) -> float:
    """The fit's bytes per token, with CUDA's dropout masks unless ``cuda_dropout`` is False (as measured)."""
    return (layers * (fit["a"] * hidden + fit["c"]) + fit["f"] * hidden + fit["g"]
            + (dropout_mask_bytes(hidden, layers) if cuda_dropout else 0))


def activations(fit: dict, hidden: int, layers: int, micro_batch: int) -> float:
    """Activation bytes of a micro-batch of sequences of the fit's length."""
    return micro_batch * fit["seq"] * per_token_bytes(fit, hidden, layers)
