"""colossalai.cluster.DistCoordinator: this process's rank facts and the master-only helpers scripts use."""

from __future__ import annotations

import contextlib
import functools
import os

import torch.distributed as dist


class DistCoordinator:
    """Rank, world size and local rank of the default group (the group must be started: launch_from_torch)."""

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError("DistCoordinator needs the process group: call colossalai.launch_from_torch() first")
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._local_rank = int(os.environ.get("LOCAL_RANK", -1))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def is_master(self, process_group=None) -> bool:
        return dist.get_rank(process_group) == 0

    def is_node_master(self) -> bool:
        return self._local_rank == 0

    def is_last_process(self, process_group=None) -> bool:
        return dist.get_rank(process_group) == dist.get_world_size(process_group) - 1

    def print_on_master(self, msg: str, process_group=None) -> None:
        if self.is_master(process_group):
            print(msg)

    def print_on_node_master(self, msg: str) -> None:
        if self.is_node_master():
            print(msg)

    def block_all(self, process_group=None) -> None:
        dist.barrier(group=process_group)

    @contextlib.contextmanager
    def priority_execution(self, executor_rank: int = 0, process_group=None):
        """The body runs on `executor_rank` first (e.g. a download), then on the others."""
        first = dist.get_rank(process_group) == executor_rank
        if not first:
            self.block_all(process_group)
        yield
        if first:
            self.block_all(process_group)

    def on_master_only(self, process_group=None):
        master = self.is_master(process_group)

        def decorator(fn):
            @functools.wraps(fn)
            def wrapped(*args, **kwargs):
                return fn(*args, **kwargs) if master else None
            return wrapped
        return decorator

    def destroy(self, process_group=None) -> None:
        dist.destroy_process_group(process_group)
