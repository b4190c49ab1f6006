"""The arithmetic the LAMB-type optimizers share: Adam's moments and
direction, its bias corrections folded into one scalar, and the trust-ratio
guard."""
from __future__ import annotations

import math

import torch


def safe_ratio(num: torch.Tensor, den: torch.Tensor, default: float) -> torch.Tensor:
    """``num / den`` where both are positive, ``default`` elsewhere (LAMB's trust-ratio guard)."""
    ok = (num > 0) & (den > 0)
    return torch.where(ok, num / torch.where(ok, den, 1.0), torch.full_like(num, default))


def adam_moments_(ms, vs, grads, b1: float, b2: float, *, foreach: bool) -> None:
    """m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, in place, for lists of tensors."""
    if foreach:
        torch._foreach_lerp_(ms, grads, 1 - b1)  # one pass where mul_ + add_ take two
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
    else:  # the per-tensor reference path
        for m, v, g in zip(ms, vs, grads):
            m.mul_(b1).add_(g * (1 - b1))
            v.mul_(b2).add_(g * g * (1 - b2))


def adam_direction_(m: torch.Tensor, v: torch.Tensor, eps: float, *, out: torch.Tensor) -> torch.Tensor:
    """out = m / (sqrt(v) + eps), computed in ``out``: no model-sized temporary."""
    torch.sqrt(v, out=out).add_(eps)
    return torch.div(m, out, out=out)


def bias_folding(t: int, b1: float, b2: float, eps: float) -> tuple[float, float]:
    """(c, eps') with m_hat / (sqrt(v_hat) + eps) = c * m / (sqrt(v) + eps'), Adam's bias corrections
    folded into one scalar: no pass over the moments to divide them."""
    return math.sqrt(1 - b2**t) / (1 - b1**t), eps * math.sqrt(1 - b2**t)
