"""The compiled step of ``LAMB(fused=True)`` and ``SLAMB(fused=True)``: two passes over flat buffers (SLAMB: and
its age's between them).

The fused optimizers keep the parameters, the gradients and the state in flat buffers over a layout
aligned to ``BLOCK`` entries (:class:`slamb.optim.flat.FlatLayout`, :class:`FlatStep`): every tensor
starts at a multiple of ``BLOCK`` and its padding is 0 in every buffer, so a buffer reshaped to
(blocks, BLOCK) has each block inside one tensor. Each pass is one compiled graph over those
(blocks, BLOCK) views whatever the number of tensors: per-tensor scalars arrive in a small table
(tensors, columns), gathered to one row per block through ``block_of`` (the tensor of each block, a
constant index; :meth:`FlatStep.per_block`), and per-tensor sums are the graph's per-block sums, added
up per tensor by one segment reduction over the blocks (:meth:`FlatStep.sums`). So a step is two graph calls
(SLAMB: three) and a constant number of small eager ops, and a graph's code, hence inductor's compile time, does not grow with the
number of tensors (only its shapes change). An earlier form, one graph with a loop over every tensor,
took 325 s (LAMB) and 1,202 s (SLAMB v2) to compile for ResNet-110's 329 tensors.

Pass 1, :func:`moments_pass`: the moments (m = m + (1-b1)(g - m), v = b2 v + (1-b2) g^2, written back)
and, per block, the sums of squares of the parameter and of the direction u = c m / (sqrt(v) + eps) +
wd p that the trust ratios need. With SLAMB's age the sums are split between the entries the step
averages (S: marked ``SELECTED`` beforehand, or every entry of an always-averaged tensor, its ``dense``
column) and the others. :func:`age_pass` then advances the age (step 6: 0 where averaged, else one
more). SLAMB's exchange
ends before pass 1: where it wrote the ranks' averages into m (the ``written`` column), pass 1 keeps them
in S instead of its own update, so the sums of S are those of the averaged momentum.

Pass 2, :func:`update_pass`: p -= clamp(A + B r, lo, hi) (E0 + E1 r) u, with u recomputed from m, v, p
(recomputing costs the same traffic as writing it in pass 1 and reading it back, and keeps no scratch)
and r = b3^age (1 without an age buffer). Both passes compute in the moments' dtype (fp32 under bf16
and fp16 parameters, :mod:`slamb.optim.precision`): such a parameter is rounded once, when written.
LAMB, SLAMB v1 and v2 differ only in the per-tensor A, B, lo, hi, E0, E1 (see each optimizer).

Every scalar arrives in the table (a tensor, so a new lr or t reuses the graphs): a scalar expression
traced into a graph (b1^t, a trust ratio) is evaluated inside the innermost loop of the generated code,
once per vector of elements, which made an earlier compiled step 7-47x slower than the memory traffic it
needs. Reading p, g, m, v and writing m, v in pass 1 and reading p, m, v and writing p in pass 2 moves 10
fp32 words per parameter (SLAMB: 12 with its age, read in each pass and written in its own) against
Adam's 7.

SLAMB's age is the int16 counter of every path (the state and the checkpoint format), handed to the
graphs as fp16 of the same bits: inductor's CPU code vectorizes 16-bit floats but not 16-bit integers.
:func:`age_of` reads the counter from those bits with integer arithmetic on their exact fp32, and
:func:`next_age` advances it with float arithmetic alone, exactly for every age up to ``MAX_AGE`` (the largest int16 whose bits are a finite fp16), so
r = b3^age is exact to fp32's rounding for every beta3 in [0, 1) wherever the counter is; the mark
``SELECTED`` (int16 -1) reads as a NaN.

Where ``torch.compile`` fails, a warning says so once and the optimizer takes its multi-tensor path: at
once where the failing graph was the step's first, else from the next step, the rest of this one running
the same functions eagerly (the graphs' numbers, at eager speed).
"""
from __future__ import annotations

import types
import warnings

import torch

# The block of the aligned layout: the unit of the per-block sums. Larger blocks waste more padding on small
# tensors (ResNet-110's 329 tensors: 2.5% of its 1.7M entries at 256) and leave more to each block's
# sequential sum; smaller ones make the per-block outputs and their segment sum larger (1/BLOCK of the
# buffer per sum). 256 is a multiple of every CPU and GPU vector width; on ResNet-110's shapes (2-core CPU)
# fused LAMB took 3.3, 3.2 and 3.1 ms and fused SLAMB v2 7.2, 5.9 and 6.6 ms at 128, 256 and 512.
BLOCK = 256
# pass 1's per-tensor columns, and pass 2's
# wd_norm: the weight decay inside the direction whose norm a trust ratio takes (SLAMB v2: none);
# dense: every entry is averaged (an always-averaged tensor); written: the exchange wrote the averages into m
MOMENT_COLUMNS = ("one_minus_b1", "b2", "one_minus_b2", "c", "eps", "wd_norm", "dense", "written")
UPDATE_COLUMNS = ("c", "eps", "wd", "log2_b3", "a", "b", "lo", "hi", "e0", "e1")
# log2(b3) for b3 = 0: r = 2^(age log2_b3) is then 1 at age 0 and 0 after, as 0^age
LOG2_ZERO = -1.0e4
# the age's cap on every path: 0x7BFF, fp16's largest finite number's bits (the next, 0x7C00, is inf)
MAX_AGE = 0x7BFF
# the int16 age that marks the entries averaged at this step (set before pass 1, 0 after it): fp16 NaN bits
SELECTED = -1


# fp32's exponent bias less fp16's, in place in an fp32 word shifted right by 13 (fp16's mantissa is fp32's
# top 10 bits): a normal fp16 of bits a converts exactly to the fp32 of bits (a + _REBIAS) << 13
_REBIAS = (127 - 15) << 10
# the fp16 whose bits are MAX_AGE (65504)
_MAX_AGE_VALUE = float(torch.tensor(MAX_AGE, dtype=torch.int16).view(torch.float16))


def age_of(bits: torch.Tensor) -> torch.Tensor:
    """The int16 counters whose bits ``bits`` (fp16) holds, as fp32 (NaN at ``SELECTED``), with integer
    arithmetic on the exact fp32 of each fp16 (no transcendental function: a log2 and an exp2 per entry made
    BERT-Base's pass 1 several times slower). A counter a of 1024 or more is a normal fp16, whose fp32 has
    the bits (a + ``_REBIAS``) << 13; one below is the subnormal a 2^-24. Checked for every counter."""
    f = bits.to(torch.float32)
    normal = (torch.bitwise_right_shift(f.view(torch.int32), 13) - _REBIAS).to(torch.float32)
    return torch.where(f >= 2.0 ** -14, normal, f * 2.0 ** 24)


def next_age(f: torch.Tensor) -> torch.Tensor:
    """The fp16 (as fp32) whose bits are one more than those of ``f`` (fp32 of an fp16 counter's bits, not
    NaN), held at ``MAX_AGE``: the next fp16 above f, by float arithmetic alone. f plus a delta in (ulp/2,
    3 ulp/2) of fp16's spacing at f rounds to f + ulp when converted to fp16: f (2^-11 + 2^-20) is such a
    delta for a normal f (ulp = 2^(e-10) for f in [2^e, 2^(e+1)); the product is exact in fp32 and the
    sum's rounding in fp32, at 2^-13 ulp, cannot leave the interval), 0.75 2^-24 for a subnormal one (ulp =
    2^-24). Checked for every counter. Reinterpreting the bits (``view(torch.int32)``) instead costs a
    store and a reload per vector in inductor's CPU code: the age's own pass took 9x as long."""
    step = torch.maximum(f * (2.0 ** -11 + 2.0 ** -20), torch.full_like(f, 0.75 * 2.0 ** -24))
    return torch.where(f >= _MAX_AGE_VALUE, f, f + step)


def _direction(p, m, v, c, eps, wd):
    return c * m / (v.sqrt() + eps) + wd * p


def _columns(table):
    """The columns of a per-block table, one (blocks, 1) tensor each."""
    return table.unsqueeze(2).unbind(1)


def moments_pass(p, g, m, v, age, table):
    """Pass 1 over (blocks, BLOCK) views; ``table``: a row of ``MOMENT_COLUMNS`` per block
    (:meth:`FlatStep.per_block`). Returns per block [|p|^2, |u|^2], or with ``age`` (fp16 bits of the int16
    counters, read for the marks alone) [|p_S|^2, |p_L|^2, |u_S|^2, |u_L|^2]."""
    b1c, b2, b2c, c, eps, wd, dense, written = _columns(table)
    p, g = p.to(m.dtype), g.to(m.dtype)  # bf16 and fp16 tensors: fp32 arithmetic, fp32 sums
    m_new = m + b1c * (g - m)
    v_new = b2 * v + b2c * (g * g)
    if age is not None:
        sel = _averaged(age, dense)
        m_new = torch.where(sel & (written > 0), m, m_new)  # the ranks' average, written by the exchange
    m.copy_(m_new)
    v.copy_(v_new)
    pp, uu = p * p, _direction(p, m_new, v_new, c, eps, wd).square()
    if age is None:
        return torch.stack([pp.sum(1), uu.sum(1)], 1)
    return torch.stack([torch.where(sel, pp, 0).sum(1), torch.where(sel, 0, pp).sum(1),
                        torch.where(sel, uu, 0).sum(1), torch.where(sel, 0, uu).sum(1)], 1)


def _averaged(age, dense):
    """The entries averaged at this step: marked ``SELECTED`` (a NaN: a compare, where isnan is not
    vectorized), or of an always-averaged tensor."""
    f = age.to(torch.float32)
    return (f != f) | (dense > 0)


def age_pass(age, table):
    """Step 6 over the (blocks, BLOCK) view of the age's fp16 bits, between the passes: 0 where averaged,
    else one more, held at ``MAX_AGE``; ``table``: pass 1's. A pass of its own rather than a write in pass 1:
    inductor's CPU code writes a 16-bit output of a kernel whose vectors are 16 fp32 wide (pass 1's) with
    masked half-width stores, and through a model-sized temporary where the kernel also reduces; that made
    BERT-Base's pass 1 2.7x as long (163 ms against 60, 2-core CPU) for the half word per parameter that
    this pass reads again."""
    dense = _columns(table)[MOMENT_COLUMNS.index("dense")]
    age.copy_(torch.where(_averaged(age, dense), 0.0, next_age(age.to(torch.float32))).to(torch.float16))


def update_pass(p, m, v, age, table):
    """Pass 2 over (blocks, BLOCK) views; ``table``: a row of ``UPDATE_COLUMNS`` per block."""
    c, eps, wd, log2_b3, a, b, lo, hi, e0, e1 = _columns(table)
    w = p.to(m.dtype)  # a bf16 or fp16 parameter: its new value in fp32, rounded once
    u = _direction(w, m, v, c, eps, wd)
    if age is None:
        p.copy_(w - (a + b).clamp(lo, hi) * (e0 + e1) * u)
        return
    r = torch.exp2(age_of(age) * log2_b3)  # b3^age
    p.copy_(w - (a + b * r).clamp(lo, hi) * (e0 + e1 * r) * u)


# Inductor settings that make a graph's numbers a function of its code and shapes alone: no on-device
# benchmarking that picks a reduction's configuration in each process (the replicas of a fused LAMB under
# DDP would drift apart bit by bit), and no reduction split by the GPU's multiprocessor count (a resume on
# another GPU model would not be bit-exact). What stays: a CPU's reductions follow its thread count.
DETERMINISTIC = {"deterministic": True, "split_reductions": False}


def compile_options() -> dict:
    """:data:`DETERMINISTIC`, less the settings the installed torch does not have."""
    import torch._inductor.config as inductor

    return {k: v for k, v in DETERMINISTIC.items() if hasattr(inductor, k)}


def compile_once(fn):
    """``torch.compile`` (``dynamic=False``, :func:`compile_options`) of ``fn`` as a function of its own code
    object: dynamo's recompile limit counts the graphs of one code object (closures of one function share
    it), so each layout or run of shapes needs its own."""
    def bound(*args):
        return fn(*args)
    own = types.FunctionType(bound.__code__.replace(), bound.__globals__, fn.__name__, None, bound.__closure__)
    return torch.compile(own, dynamic=False, options=compile_options())


def _shapes(args) -> tuple:
    """What a graph is keyed by: its tensors' shapes and dtypes (nested in lists), its other arguments."""
    return tuple(_shapes(a) if isinstance(a, (list, tuple)) else (tuple(a.shape), a.dtype) if torch.is_tensor(a)
                 else a for a in args)


class CompileFailed(RuntimeError):
    """``torch.compile`` failed in a step's first graph, before any tensor changed."""


class Passes:
    """One optimizer's compiled graphs: one per function and distinct shapes of its tensors, compiled at first
    use."""

    def __init__(self, who: str):
        self.who = who
        self.graphs: dict = {}
        self.compiled: set = set()
        self.failed: str | None = None  # why torch.compile failed: the optimizer then runs its multi-tensor path
        self._touched = False  # whether this step has changed a tensor
        self._indices: dict = {}

    def index(self, ids: list[int], device) -> torch.Tensor:
        """``ids`` as a tensor on ``device``, copied once per distinct list rather than every step."""
        key = (tuple(ids), str(device))
        if key not in self._indices:
            self._indices[key] = torch.tensor(ids, device=device)
        return self._indices[key]

    def begin_step(self) -> None:
        self._touched = False

    def __call__(self, fn, *args):
        """``fn(*args)``: compiled, or eagerly where compiling failed (this step's rest)."""
        key = (fn, _shapes(args))
        touched, self._touched = self._touched, True
        if self.failed is not None:
            return fn(*args)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = compile_once(fn)
        if key in self.compiled:
            return graph(*args)
        try:  # the compile runs in the first call, before the graph touches any tensor
            out = graph(*args)
        except Exception as e:
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"{self.who}(fused=True): torch.compile failed ({self.failed}); this optimizer runs the "
                          "multi-tensor path instead (the same numbers, more kernel launches). Install a C++ "
                          "compiler (CPU) or Triton (GPU), or construct it with fused=False.", stacklevel=4)
            if not touched:
                raise CompileFailed(self.failed) from e
            return fn(*args)
        self.compiled.add(key)
        return out


def table(rows: list[list[float]], index: torch.Tensor, device) -> torch.Tensor:
    """Per-tensor rows from per-group ``rows`` (``index``: each tensor's group), staged to ``device`` without
    waiting for it."""
    host = torch.tensor(rows, dtype=torch.float32)
    if torch.device(device).type == "cuda":  # from pageable memory a non_blocking copy would block the host
        host = host.pin_memory()
    return host.to(device, non_blocking=True)[index]


class FlatStep:
    """The parameters and gradients of a fused optimizer as flat buffers over ``layout`` (aligned to ``BLOCK``),
    and the index that turns per-block sums into per-tensor ones.

    The parameters are adopted: their values are copied into one flat buffer and each ``p.data`` is rebound
    to its view of it, so a pass reads and writes every parameter as one tensor. :meth:`params` checks each
    step (one tuple of data pointers, on the host) that they still are views; where one is not (its storage
    was replaced: ``p.data = ...``, ``load_state_dict(assign=True)``, a ``to()`` that moved it), it adopts
    them again from their current values. The gradients are copied into a flat buffer of the parameters'
    dtype (:meth:`grads`, one ``torch.cat`` with the padding's zeros) and each ``p.grad`` is pointed at its
    view, unless they are views already: gradients zeroed in place (``zero_grad(set_to_none=False)``)
    accumulate into the views and cost no copy; ``set_to_none=True`` (torch's default) keeps its meaning.

    FSDP2's shards are not adopted: FSDP keeps each shard in storage of its own, which its all-gathers read,
    and a parameter rebound to a view of this buffer would not be gathered. On a sharded layout
    :meth:`params` copies the shards in at each step (one ``torch.cat``, as the gradients) and :meth:`store`
    writes the updated values back (one multi-tensor copy): two words of traffic per parameter each way more
    than an adopted layout, and nothing the step reads is stale (a parameter sync or a loaded model writes
    the shards themselves).
    """

    def __init__(self, layout):
        self.layout = layout
        sizes = [(end - start + BLOCK - 1) // BLOCK for start, end in zip(layout.offsets, layout.offsets[1:])]
        self.blocks_per_tensor = torch.tensor(sizes, device=layout.device)
        self.block_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(layout.device)
        self.blocks = layout.numel // BLOCK
        self.grad = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        self._grad_views = layout.views(self.grad)
        self._grad_ptrs = tuple(g.data_ptr() for g in self._grad_views)
        # the gradients (a sharded layout's parameters too) with the padding's zeros between them: one cat
        pads = [start - end for start, end in zip(layout.offsets[1:], layout.ends)]
        zeros = torch.zeros(max(pads, default=0), dtype=layout.dtype, device=layout.device)
        self._pads = [zeros[:n] if n else None for n in pads]
        self._param_ptrs = None
        if layout.sharded:
            self.param = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
            self._param_views = layout.views(self.param)
        else:
            self._adopt()

    def _adopt(self) -> None:
        self.param = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=self.layout.device)
        self._param_views = self.layout.views(self.param)
        for p, view in zip(self.layout.params, self._param_views):
            view.copy_(p.detach())
            p.data = view
        self._param_ptrs = tuple(p.data_ptr() for p in self.layout.params)

    def _cat(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        pieces = [x for t, pad in zip(tensors, self._pads) for x in (t.reshape(-1), pad) if x is not None]
        return torch.cat(pieces, out=out)

    def params(self) -> torch.Tensor:
        """The flat parameter buffer; the parameters adopted again where one no longer is its view, a sharded
        layout's shards copied in."""
        if self.layout.sharded:
            return self._cat([p.detach() for p in self.layout.params], self.param)
        if tuple(p.data_ptr() for p in self.layout.params) != self._param_ptrs:
            self._adopt()
        return self.param

    def store(self) -> None:
        """After the update: a sharded layout's parameters written back into their shards (adopted ones are
        views of the buffer already)."""
        if self.layout.sharded:
            torch._foreach_copy_(self.layout.params, self._param_views)

    @property
    def grad_views(self) -> list[torch.Tensor]:
        """The per-parameter views of the flat gradient buffer, shaped as the layout's tensors."""
        return self._grad_views

    def grads(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The flat gradient buffer holding ``grads`` (the layout's gradients, a missing one as zeros). A step
        gathers once and reads the buffer (or :attr:`grad_views`) after: an adopted layout's gradients become
        the views, but a sharded layout's stay FSDP2's, so each call copies them again."""
        if tuple(g.data_ptr() for g in grads) == self._grad_ptrs:
            return self.grad
        own = [g.data_ptr() == ptr for g, ptr in zip(grads, self._grad_ptrs)]
        if any(own):  # a cat reading its own output is refused: copy only the others
            torch._foreach_copy_([v for v, o in zip(self._grad_views, own) if not o],
                                 [g for g, o in zip(grads, own) if not o])
        else:
            self._cat(grads, self.grad)
        for p, view in zip(self.layout.params, self._grad_views):
            if p.grad is not None:
                p.grad = view
        return self.grad

    def per_block(self, table: torch.Tensor) -> torch.Tensor:
        """A per-tensor table's rows, one per block (1/BLOCK of a buffer per column). Gathered here rather than
        in the graphs: a gather there is an indexed, bounds-checked load of every column inside the innermost
        loop, which made BERT-Base's fused LAMB step 2.2x slower (265 ms against 118 on a 2-core CPU)."""
        return table.index_select(0, self.block_of)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat``, a buffer over the layout, as (blocks, ``BLOCK``)."""
        return flat.view(self.blocks, BLOCK)

    def sums(self, per_block: torch.Tensor) -> torch.Tensor:
        """Per-tensor sums of a pass's (blocks, k) per-block sums (:func:`tensor_sums`)."""
        return tensor_sums(per_block, self.blocks_per_tensor)


def tensor_sums(per_block: torch.Tensor, blocks_per_tensor: torch.Tensor) -> torch.Tensor:
    """Per-tensor sums (tensors, k) of (blocks, k) per-block sums, each tensor a run of ``blocks_per_tensor``
    blocks, added in float64 by a segment reduction: a fixed order on every device, so the replicas of a fused
    LAMB under DDP stay bit-identical on a GPU too (an ``index_add_`` there adds in the order its atomics land).
    One column after another, as k times as many segments of a 1-D tensor: on CUDA a 2-D segment reduction runs
    a thread per (segment, column) that adds its segment's blocks one after another (BERT-Large's embedding:
    122,112), a 1-D one CUB's segmented reduction. On the CPU both add each segment in order: the same bits."""
    k = per_block.shape[1]
    columns = per_block.double().t().reshape(-1)  # column after column
    sums = torch.segment_reduce(columns, "sum", lengths=blocks_per_tensor.repeat(k), unsafe=True)
    return sums.view(k, -1).t().to(per_block.dtype)
