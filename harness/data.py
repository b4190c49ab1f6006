"""Index batches of each rank's shard: the sampling every pipeline shares."""
from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

from .distributed import DistEnv


class ShardedBatches:
    """This rank's batches of sample indices for an epoch, in ``DistributedSampler`` order.

    Every rank gets the same number of full batches (``drop_last``), so no
    rank ever waits in a collective for a batch its peers do not have.
    ``epoch(e, start=b)`` calls ``set_epoch(e)`` and starts at batch ``b``
    (mid-epoch resume sees the same remaining batches as the uninterrupted run).
    """

    def __init__(self, num_samples: int, batch_size: int, env: DistEnv, *, seed: int, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"invalid batch size {batch_size}: must be >= 1 (data.micro_batch)")
        self.sampler = DistributedSampler(range(num_samples), num_replicas=env.world_size, rank=env.rank,
                                          shuffle=shuffle, seed=seed, drop_last=True)
        self.batch_size = batch_size
        if len(self) == 0:
            raise ValueError(
                f"{num_samples} samples cannot give every one of {env.world_size} workers a full batch of "
                f"{batch_size}: lower data.micro_batch or the number of workers"
            )

    def __len__(self) -> int:
        return self.sampler.num_samples // self.batch_size

    def epoch(self, epoch: int, start: int = 0):
        self.sampler.set_epoch(epoch)
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        for b in range(start, len(self)):
            yield order[b * self.batch_size:(b + 1) * self.batch_size]


def eval_shard(num_samples: int, env: DistEnv) -> torch.Tensor:
    """Indices this rank evaluates: a strided shard, no padding, so summed counts are exact."""
    return torch.arange(env.rank, num_samples, env.world_size)
