"""The dtypes of optimizer state and arithmetic under bf16 and fp16 parameters.

Every optimizer of the package keeps its state (moments, momenta, residuals, norms) in
:func:`state_dtype`, fp32 at least, and computes an update of bf16 or fp16 parameters in fp32,
rounding the new value once when it is written back. In the parameters' own dtype an EMA with
beta2 = 0.999 cannot decay: 0.1% per step is below half of bf16's ulp (2^-9), so after a
gradient drops 100x, v stays near its old value (2.7x the exact EMA after 1,000 steps, 17x after
3,000) and the step shrinks by the square root of that, silently.
"""
from __future__ import annotations

import torch


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the state of parameters of ``dtype``: fp32 for bf16 and fp16, else their own."""
    return torch.promote_types(dtype, torch.float32)


def working_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor in :func:`state_dtype`: an fp32 copy of a bf16 or fp16 one, else the tensor itself.

    An update computed on these is written back with :func:`write_back_`, one rounding per step."""
    return [t if t.dtype == state_dtype(t.dtype) else t.to(state_dtype(t.dtype)) for t in tensors]


def write_back_(params: list[torch.Tensor], work: list[torch.Tensor]) -> None:
    """Round the updated working copies (:func:`working_copies`) of ``params`` into them."""
    pairs = [(p, w) for p, w in zip(params, work) if w is not p]
    if pairs:
        torch._foreach_copy_([p for p, _ in pairs], [w for _, w in pairs])


def promote_state_(optimizer) -> None:
    """Floating state tensors in :func:`state_dtype` of their parameter's dtype, after
    ``torch.optim.Optimizer.load_state_dict`` (which casts them to the parameter's dtype) or a
    checkpoint saved by a version that kept them in bf16 or fp16."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                state[key] = value.to(state_dtype(p.dtype))
