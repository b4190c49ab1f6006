"""The global batch of a recipe from any number of workers.

The recipes fix the global batch (BERT phase 1: 65,536 sequences); a job has
``world_size`` workers that each fit ``micro_batch`` sequences per
forward/backward, so each optimizer step runs
``global_batch / (world_size * micro_batch)`` micro-batches per worker, with
the gradient communication on the last one only
(:func:`harness.amp.accumulation_context`).
"""
from __future__ import annotations

from slamb.optim.checks import check_count


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per worker and optimizer step; a clear error when the batch does not divide."""
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch)):
        check_count(f"data.{name}", value)
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ValueError(
            f"data.global_batch={global_batch} is not a multiple of data.micro_batch={micro_batch} x "
            f"{world_size} workers = {per_step}: choose a micro-batch (or worker count) whose product divides it"
        )
    return global_batch // per_step


def split_batch(global_batch: int, world_size: int) -> int:
    """Each worker's equal share of a global batch taken in one micro-batch (SQuAD fine-tuning)."""
    if global_batch < world_size or global_batch % world_size:
        raise ValueError(f"data.global_batch={global_batch} must be a multiple of the {world_size} workers "
                         "(each worker takes an equal share)")
    return global_batch // world_size
