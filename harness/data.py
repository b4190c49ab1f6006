"""Index batches of each rank's shard, and each step's micro-batches by step: the sampling every pipeline shares."""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch.utils.data import DistributedSampler

from .distributed import DistEnv


def step_share(micro_batches: int, rank: int, world_size: int) -> range:
    """The micro-batches (numbered 0 .. ``micro_batches`` - 1) of each step that ``rank`` of ``world_size`` takes: an
    equal run of consecutive ones, so a run resumed on a divisor of its first start's workers accumulates what
    they took."""
    if micro_batches % world_size:
        raise ValueError(f"{world_size} workers cannot take an equal share of a step's {micro_batches} "
                         f"micro-batches: run on a divisor of {micro_batches} workers")
    per_worker = micro_batches // world_size
    return range(rank * per_worker, (rank + 1) * per_worker)


def check_micro_batch(samples: int, micro_batch: int, micro_batches: int) -> None:
    """Refuse a ``data.micro_batch`` that ``samples`` training samples cannot fill in every one of a step's
    ``micro_batches`` (one per worker, or more, :class:`ShardedBatches`): the run would take no step. A data set
    counted only as far as needed, or past, passes."""
    each = samples // micro_batches
    if each < micro_batch:
        fix = f"set data.micro_batch to at most {each}, or run on fewer workers" if each else "run on fewer workers"
        raise ValueError(f"invalid data.micro_batch={micro_batch}: the {samples} training samples give each of a "
                         f"step's {micro_batches} micro-batches {each}, not a full batch: no step would be taken; "
                         f"{fix}")


class ShardedBatches:
    """This rank's micro-batches of sample indices for an epoch, in ``DistributedSampler`` order.

    Each step takes ``micro_batches`` micro-batches of ``batch_size`` (default: one per worker), the
    ``DistributedSampler`` shards of that many replicas; each worker takes ``micro_batches / world_size``
    consecutive ones (:attr:`shards`). The samples of step ``b`` are the block ``b`` of the epoch's
    permutation whatever the number of workers, and so are the micro-batches: a run resumed on fewer
    workers (:func:`harness.checkpoint.step_micro_batches`) accumulates the micro-batches its workers
    took before. Every rank gets the same number of full batches (``drop_last``), so no
    rank ever waits in a collective for a batch its peers do not have.
    ``epoch(e, start=b)`` calls ``set_epoch(e)`` and starts at step ``b``
    (mid-epoch resume sees the same remaining batches as the uninterrupted run).
    """

    def __init__(self, num_samples: int, batch_size: int, env: DistEnv, *, seed: int, shuffle: bool = True,
                 micro_batches: int | None = None):
        if batch_size < 1:
            raise ValueError(f"invalid batch size {batch_size}: must be >= 1 (data.micro_batch)")
        self.micro_batches = micro_batches or env.world_size
        self.shards = step_share(self.micro_batches, env.rank, env.world_size)  # the micro-batches this rank takes
        self.samplers = [DistributedSampler(range(num_samples), num_replicas=self.micro_batches, rank=s,
                                            shuffle=shuffle, seed=seed, drop_last=True) for s in self.shards]
        self.batch_size = batch_size
        check_micro_batch(num_samples, batch_size, self.micro_batches)

    def __len__(self) -> int:
        return self.samplers[0].num_samples // self.batch_size

    def epoch(self, epoch: int, start: int = 0):
        """This rank's steps of epoch ``epoch`` from step ``start``: each a ``len(shards) x batch_size`` tensor."""
        for sampler in self.samplers:
            sampler.set_epoch(epoch)
        order = torch.tensor([list(sampler) for sampler in self.samplers], dtype=torch.long)
        for b in range(start, len(self)):
            yield order[:, b * self.batch_size:(b + 1) * self.batch_size]


def eval_shard(num_samples: int, env: DistEnv) -> torch.Tensor:
    """Indices this rank evaluates: a strided shard, no padding, so summed counts are exact."""
    return torch.arange(env.rank, num_samples, env.world_size)


class StepReader:
    """A worker's micro-batches of each step, addressed by the run's step: ``reader(step)`` yields the ``per_step``
    micro-batches of step ``step``, read from ``open_at(step)`` (an iterator of the micro-batches from that step
    on, read ahead as the pipeline reads).

    In a plain run the steps come in order and one iterator serves them all. Under torchft a step that did not
    commit is taken again (its micro-batches kept from its attempt), and a group that joins, or takes a peer's
    state, goes on at another step: an iterator is opened there, and the last one closed where it can be.
    """

    def __init__(self, open_at: Callable[[int], Iterator], per_step: int):
        self.open_at, self.per_step = open_at, per_step
        self.items: Iterator | None = None
        self.next: int | None = None  # the step the iterator is at
        self.kept: tuple[int | None, list] = (None, [])  # the last step read whole, and its micro-batches

    def __call__(self, step: int):
        if self.kept[0] == step:
            yield from self.kept[1]
            return
        if step != self.next:
            self.close()
            self.items = self.open_at(step)
        self.next, taken = None, []  # a step left part way leaves the iterator part way into it
        for _ in range(self.per_step):
            taken.append(next(self.items))
            yield taken[-1]
        self.next, self.kept = step + 1, (step, taken)

    def close(self) -> None:
        if hasattr(self.items, "close"):
            self.items.close()
        self.items = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
