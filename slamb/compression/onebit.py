"""Error-compensated 1-bit all-reduce (1-bit Adam, Tang et al. 2021; 1-bit LAMB,
Li et al. 2021) over torch.distributed, independent of any optimizer.

Three orthogonal pieces, as in GRACE (Xu et al. 2021):

* compressor: :func:`compress` turns the rows of a 2-D tensor into sign bits
  and one scale per row, ``scale = ||row|| / sqrt(numel)`` (the RMS, so the
  1-bit tensor ``scale * sign`` keeps the row's L2 norm); :func:`pack_bits` /
  :func:`unpack_bits` store 8 signs per byte, most significant bit first
  (``numpy.packbits``' order); a bit is 1 where the value is ``>= 0``, so an
  exact zero is sent as +scale (1 bit cannot represent it; DeepSpeed does the
  same);
* memory: :class:`ErrorFeedback`, the two error buffers of a worker (its own
  compression error over the whole padded vector, and its server error over
  the chunk it reduces), flat and zero on padding;
* communicator: :func:`compressed_allreduce`, a reduce-scatter then an
  all-gather of 1-bit data.

The vector of D entries is padded to ``P = n * c`` with the chunk ``c`` a
multiple of 8, so that every chunk is a whole number of bytes. Rank j is the
"server" of chunk j. One call:

1. worker: ``w = x + worker_error``; per chunk, signs and a scale; the new
   worker error is ``w - scale * sign``;
2. ``all_to_all`` of the packed signs (kind ``kind``, P/8 bytes) and of the
   n chunk scales (kind ``scale_kind``, n float32): rank j receives chunk j
   of every worker;
3. server: ``s = mean_i(scale_i * sign_i) + server_error``; one scale for
   the chunk; the new server error is ``s - scale * sign``;
4. ``all_gather`` of the server's packed signs (P/(8n) bytes) and of its
   scale (one float32); every rank decodes the same P values.

Per call a rank hands P/8 + P/(8n) bytes of signs and 4(n + 1) bytes of
scales to the collectives; on the wire (ring algorithms) that is 2(n-1)/n *
P/8 bytes of signs, i.e. exactly a dense all-reduce of 1 bit per entry, plus
8(n-1) bytes of scales. Every rank decodes identical bytes, so the result is
bitwise identical on all ranks.

Free choices, named:

* the worker sends one scale per chunk (n scales), not one per vector as
  DeepSpeed's ``compressed_allreduce``: each server chunk then keeps its own
  magnitude (lower error) for 4(n - 1) more bytes per call;
* padding is excluded from every scale (the RMS is over the real entries of
  a chunk) and the error buffers are kept zero on it, so padding never leaks
  into the error feedback (DeepSpeed pads with zeros that do);
* error buffers are float32 (float64 for float64 input) whatever the dtype
  of ``x``, so the feedback does not lose what half precision would round off.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..optim.checks import check_count

__all__ = ["pack_bits", "unpack_bits", "compress", "decompress", "chunk_size", "ErrorFeedback",
           "compressed_allreduce"]


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device) -> torch.Tensor:
    """The 8 bit values of a byte, MSB first: made once per device (a host-to-device copy each call otherwise)."""
    device = torch.device(device)
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
    return _BIT_WEIGHTS[device]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 tensor of ``ceil(numel / 8)`` bytes, 8 bits per byte, MSB first; zeros pad the last byte."""
    bits = bits.reshape(-1)
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    # the 8 bits of a byte are distinct powers of two, so their sum is their OR: no carry, no overflow
    return (bits.view(-1, 8).to(torch.uint8) * _bit_weights(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` bits of ``packed`` (as written by :func:`pack_bits`), as a bool tensor."""
    if not 0 <= numel <= 8 * packed.numel():
        raise ValueError(f"cannot unpack {numel} bits from {packed.numel()} bytes")
    bits = torch.bitwise_and(packed.reshape(-1, 1), _bit_weights(packed.device)) != 0
    return bits.view(-1)[:numel]


def compress(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits (bool, shape of ``x``) and one float32 scale per row of the 2-D ``x``.

    ``counts[i]`` is the number of real (non-padding) entries of row i, which
    must be zero on its padding: the scale is ``||row|| / sqrt(counts[i])``
    (0 for a row of padding only).
    """
    norms = torch.linalg.vector_norm(x, dim=1, dtype=torch.float32)
    scales = norms / counts.clamp(min=1).to(torch.float32).sqrt()
    return x >= 0, scales


def decompress(bits: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scales[i] * (+1 | -1)`` for each bit of row i of the 2-D ``bits``."""
    signs = bits.to(dtype).mul_(2).sub_(1)
    return signs.mul_(scales.to(dtype).unsqueeze(1))


def chunk_size(numel: int, world_size: int) -> int:
    """Entries per rank's chunk: ``ceil(numel / n)`` rounded up to whole bytes of bits."""
    return 8 * math.ceil(numel / (8 * world_size)) if numel else 0


def _real_counts(numel: int, world_size: int, chunk: int, device) -> torch.Tensor:
    starts = torch.arange(world_size, device=device) * chunk
    return (numel - starts).clamp(0, chunk)


class ErrorFeedback:
    """The error-feedback memory of one worker for vectors of ``numel`` entries
    over ``world_size`` ranks: ``worker`` (padded, ``n * chunk``) and ``server``
    (``chunk``, the chunk this rank reduces). Both flat, both zero on padding.
    """

    def __init__(self, numel: int, world_size: int, rank: int, *, device=None, dtype=torch.float32):
        check_count("numel", numel)
        if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            raise ValueError(f"invalid world_size={world_size!r}, rank={rank!r}: need 0 <= rank < world_size")
        self.numel, self.world_size, self.rank = numel, world_size, rank
        self.chunk = chunk_size(numel, world_size)
        self.padded = self.chunk * world_size
        self.worker = torch.zeros(self.padded, device=device, dtype=dtype)
        self.server = torch.zeros(self.chunk, device=device, dtype=dtype)
        self.counts = _real_counts(numel, world_size, self.chunk, self.worker.device)
        self.server_count = int(self.counts[rank])

    def reset(self) -> None:
        self.worker.zero_()
        self.server.zero_()

    def state_dict(self) -> dict:
        return {"numel": self.numel, "world_size": self.world_size, "rank": self.rank,
                "worker": self.worker.clone(), "server": self.server.clone()}

    def load_state_dict(self, state: dict) -> None:
        saved = (state["numel"], state["world_size"], state["rank"])
        if saved != (self.numel, self.world_size, self.rank):
            raise ValueError(
                f"error-feedback buffers saved for (numel, world size, rank) = {saved}, this memory is "
                f"{(self.numel, self.world_size, self.rank)}: the chunking depends on all three; resume with "
                "the same world size and rank, or reset the buffers"
            )
        self.worker.copy_(state["worker"])
        self.server.copy_(state["server"])


def _feed_back(error: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, real: int) -> None:
    """``error`` holds the compensated value: make it the compression error, zero on padding."""
    error.view(bits.shape).sub_(decompress(bits, scales, error.dtype))
    error[real:].zero_()


def compressed_allreduce(x: torch.Tensor, memory: ErrorFeedback, *, ledger: comm.CommLedger | None,
                         group=None, kind: str = "momentum_1bit", scale_kind: str = "scales") -> torch.Tensor:
    """Replace ``x`` (any shape, D entries) by the 1-bit, error-compensated
    estimate of its mean over the ranks of ``group``; returns ``x``.

    ``memory`` is updated in place. Sign bytes are recorded in ``ledger`` as
    ``kind``, scales as ``scale_kind``. With one rank nothing is sent and the
    result is ``x`` compressed to 1 bit twice with error feedback (the same
    arithmetic, which is what a single-process test exercises).
    """
    n, r = comm.world_size(group), comm.rank(group)
    if (memory.numel, memory.world_size, memory.rank) != (x.numel(), n, r):
        raise ValueError(
            f"ErrorFeedback built for (numel, world size, rank) = {(memory.numel, memory.world_size, memory.rank)}, "
            f"called with {(x.numel(), n, r)}: build one memory per vector and process group"
        )
    c, work = memory.chunk, memory.worker

    work[:memory.numel].add_(x.reshape(-1))  # compensate; padding stays zero
    bits, scales = compress(work.view(n, c), memory.counts)
    _feed_back(work, bits, scales, memory.numel)
    packed = pack_bits(bits)

    recv = torch.empty_like(packed)
    recv_scales = torch.empty_like(scales)
    comm.all_to_all_single(recv, packed, kind=kind, ledger=ledger, group=group)
    comm.all_to_all_single(recv_scales, scales, kind=scale_kind, ledger=ledger, group=group)

    server = memory.server
    signs = unpack_bits(recv, n * c).view(n, c).to(server.dtype).mul_(2).sub_(1)
    server.add_(recv_scales.to(server.dtype).div_(n) @ signs)  # the mean of the n decoded chunks
    server[memory.server_count:].zero_()
    server_bits, server_scale = compress(server.view(1, c), memory.counts[r:r + 1])
    _feed_back(server, server_bits, server_scale, memory.server_count)

    gathered = torch.empty(n * c // 8, dtype=torch.uint8, device=x.device)
    gathered_scales = torch.empty(n, dtype=torch.float32, device=x.device)
    comm.all_gather_into_tensor(gathered, pack_bits(server_bits), kind=kind, ledger=ledger, group=group)
    comm.all_gather_into_tensor(gathered_scales, server_scale, kind=scale_kind, ledger=ledger, group=group)

    mean = decompress(unpack_bits(gathered, n * c).view(n, c), gathered_scales, x.dtype)
    x.copy_(mean.view(-1)[:memory.numel].view_as(x))
    return x
