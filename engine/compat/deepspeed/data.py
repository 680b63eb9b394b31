"""The loader deepspeed.initialize(training_data=...) returns, with DeepSpeed's semantics.

DeepSpeed samples with a DistributedSampler over the data-parallel ranks (shuffled, seed 0, padded to equal
parts), batches of train_micro_batch_size_per_gpu, `dataloader_drop_last` from the config; each new pass over the
loader is the sampler's next epoch unless the caller set one (set_epoch). The batches, and so training, are the
same as DeepSpeed's; worker processes are not started (num_workers 0: the batches do not depend on them).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class _EpochSampler(DistributedSampler):
    """Records whether the caller set the epoch since the last pass."""

    set_by_caller = False

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.set_by_caller = True


class DeepSpeedDataLoader:
    def __init__(self, dataset, batch_size: int, dp_world_size: int, dp_rank: int, collate_fn=None,
                 drop_last: bool = False):
        self.dataset, self.batch_size, self.collate_fn, self.drop_last = dataset, batch_size, collate_fn, drop_last
        # DeepSpeed samples distributed whenever it has a local rank (under any launcher, one process too)
        self.data_sampler = _EpochSampler(dataset, num_replicas=dp_world_size, rank=dp_rank)
        self._started = False
        count = len(self.data_sampler)
        self.len = count // batch_size if drop_last else math.ceil(count / batch_size)
        self._batches = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self):
        sampler = self.data_sampler
        if isinstance(sampler, _EpochSampler):  # a new pass is the next epoch, unless the caller set one
            if self._started and not sampler.set_by_caller:
                sampler.set_epoch(sampler.epoch + 1)
            sampler.set_by_caller = False
        self._started = True
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, collate_fn=self.collate_fn,
                            drop_last=self.drop_last, pin_memory=torch.cuda.is_available())
        self._batches = iter(loader)
        return self

    def __next__(self):
        if self._batches is None:
            iter(self)
        return next(self._batches)
