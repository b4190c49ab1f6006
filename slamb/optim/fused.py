"""The compiled step of ``LAMB(fused=True)`` and ``SLAMB(fused=True)``: two passes over the tensors.

Pass 1, :func:`moments_pass`: the moments (m = m + (1-b1)(g - m), v = b2 v + (1-b2) g^2, written back)
and, per tensor, the sums of squares of the parameter and of the direction
u = c m / (sqrt(v) + eps) + wd p that the trust ratios need. With SLAMB's age (fp16, see ``MAX_AGE``)
the sums are split between the entries the step averages (marked ``SELECTED`` beforehand) and the
others, and the age advances (step 6: 0 where averaged, else one more).

Pass 2, :func:`update_pass`: p -= clamp(A + B r, lo, hi) (E0 + E1 r) u, with u recomputed from m, v, p
(recomputing costs the same traffic as writing it in pass 1 and reading it back, and keeps no scratch)
and r = b3^age (1 without an age buffer). Both passes compute in the moments' dtype (fp32 under bf16
and fp16 parameters, :mod:`slamb.optim.precision`): such a parameter is rounded once, when written.
LAMB, SLAMB v1 and v2 differ only in the per-tensor A, B, lo, hi, E0, E1 (see each optimizer).

Every scalar arrives in a small per-tensor table (a tensor, so a new lr or t reuses the graphs): a
scalar expression traced into a graph (b1^t, a trust ratio) is evaluated inside the innermost loop of
the generated code, once per vector of elements, which made an earlier compiled step 7-47x slower than
the memory traffic it needs. Reading p, g, m, v and writing m, v in pass 1 and reading p, m, v and
writing p in pass 2 moves 10 fp32 words per parameter (SLAMB: about 11.5 with its age) against
Adam's 7.

Graphs cover runs of at most ``CHUNK`` tensors of one parameter group: inductor's compile time grows
faster than linearly with a graph's size, and runs of the same shapes (a network's repeated blocks)
share one graph. Where ``torch.compile`` fails, a warning says so once and the optimizer takes its
multi-tensor path: at once where the failing graph was the step's first, else from the next step,
the rest of this one running the same functions eagerly (the graphs' numbers, at eager speed).
"""
from __future__ import annotations

import types
import warnings

import torch

CHUNK = 12
# pass 1's per-tensor columns, and pass 2's
# wd_norm: the weight decay inside the direction whose norm a trust ratio takes (SLAMB v2: none)
MOMENT_COLUMNS = ("one_minus_b1", "b2", "one_minus_b2", "c", "eps", "wd_norm")
UPDATE_COLUMNS = ("c", "eps", "wd", "log2_b3", "a", "b", "lo", "hi", "e0", "e1")
# log2(b3) for b3 = 0: r = 2^(age log2_b3) is then 1 at age 0 and 0 after, as 0^age
LOG2_ZERO = -1.0e4
# SLAMB's age in this path: fp16 (half a word, as the int16 counter of the other paths; inductor's CPU
# code vectorizes 16-bit floats but not 16-bit integers), whose integers are exact up to 2048, where it
# stops: r = b3^min(age, 2048), which is b3^age to fp32's rounding (an error below 2^-24) for
# b3 <= MAX_BETA3. SLAMB refuses fused=True with a larger beta3.
MAX_AGE = 2048
MAX_BETA3 = 2.0 ** (-24 / MAX_AGE)
# the age that marks the entries averaged at this step (set before pass 1, 0 after it)
SELECTED = -1.0


def runs(bounds) -> list[tuple[int, int]]:
    """(first, end) of the compiled runs covering each (first, end) of ``bounds``."""
    return [(a, min(a + CHUNK, hi)) for lo, hi in bounds for a in range(lo, hi, CHUNK)]


def _direction(p, m, v, c, eps, wd):
    return c * m / (v.sqrt() + eps) + wd * p


def moments_pass(params, grads, ms, vs, ages, table):
    """Pass 1 over a run; ``table``: the run's rows of ``MOMENT_COLUMNS``. Returns per tensor
    [|p|^2, |u|^2], or with ``ages`` [|p_S|^2, |p_L|^2, |u_S|^2, |u_L|^2] (S: the entries marked
    ``SELECTED``)."""
    sums = []
    for i, (p, g, m, v) in enumerate(zip(params, grads, ms, vs)):
        b1c, b2, b2c, c, eps, wd = table[i].unbind()
        p, g = p.to(m.dtype), g.to(m.dtype)  # bf16 and fp16 tensors: fp32 arithmetic, fp32 sums
        m_new = m + b1c * (g - m)
        v_new = b2 * v + b2c * (g * g)
        m.copy_(m_new)
        v.copy_(v_new)
        pp, uu = p * p, _direction(p, m_new, v_new, c, eps, wd).square()
        if ages is None:
            sums.append(torch.stack([pp.sum(), uu.sum()]))
            continue
        age = ages[i].to(torch.float32)
        sel = age == SELECTED
        ages[i].copy_(torch.where(sel, 0.0, torch.clamp(age + 1, max=MAX_AGE)).to(ages[i].dtype))
        sums.append(torch.stack([torch.where(sel, pp, 0).sum(), torch.where(sel, 0, pp).sum(),
                                 torch.where(sel, uu, 0).sum(), torch.where(sel, 0, uu).sum()]))
    return torch.stack(sums)


def update_pass(params, ms, vs, ages, table):
    """Pass 2 over a run; ``table``: the run's rows of ``UPDATE_COLUMNS``."""
    for i, (p, m, v) in enumerate(zip(params, ms, vs)):
        c, eps, wd, log2_b3, a, b, lo, hi, e0, e1 = table[i].unbind()
        w = p.to(m.dtype)  # a bf16 or fp16 parameter: its new value in fp32, rounded once
        u = _direction(w, m, v, c, eps, wd)
        if ages is None:
            p.copy_(w - (a + b).clamp(lo, hi) * (e0 + e1) * u)
            continue
        r = torch.exp2(ages[i].to(torch.float32) * log2_b3)  # b3^age
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


class CompileFailed(RuntimeError):
    """``torch.compile`` failed in a step's first graph, before any tensor changed."""


class Passes:
    """One optimizer's compiled graphs: one per pass and distinct run of shapes, compiled at first use."""

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

    def __call__(self, fn, params, *args):
        """``fn(params, *args)`` over one run: compiled, or eagerly where compiling failed (this step's rest)."""
        key = (fn, tuple(p.shape for p in params))
        touched, self._touched = self._touched, True
        if self.failed is not None:
            return fn(params, *args)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = compile_once(fn)
        if key in self.compiled:
            return graph(params, *args)
        try:  # the compile runs in the first call, before the graph touches any tensor
            out = graph(params, *args)
        except Exception as e:
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"{self.who}(fused=True): torch.compile failed ({self.failed}); this optimizer runs the "
                          "multi-tensor path instead (the same numbers, more kernel launches). Install a C++ "
                          "compiler (CPU) or Triton (GPU), or construct it with fused=False.", stacklevel=4)
            if not touched:
                raise CompileFailed(self.failed) from e
            return fn(params, *args)
        self.compiled.add(key)
        return out


def table(rows: list[list[float]], index: torch.Tensor, device) -> torch.Tensor:
    """Per-tensor rows from per-group ``rows`` (``index``: each tensor's group), staged to ``device`` without
    waiting for it."""
    host = torch.tensor(rows, dtype=torch.float32)
    if torch.device(device).type == "cuda":  # from pageable memory a non_blocking copy would block the host
        host = host.pin_memory()
    return host.to(device, non_blocking=True)[index]
