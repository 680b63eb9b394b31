"""colossalai.launch and launch_from_torch: the process group from torchrun's (or `tiers launch`'s) environment, the
device of this local rank, and the seed."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from engine.compat.colossalai.unsupported import refuse
from engine.process_exit import destroy_group_at_exit


def set_seed(seed: int) -> None:
    """Python's, numpy's and torch's generators seeded alike (ColossalAI's colossalai.utils.set_seed)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def launch(rank: int, world_size: int, host: str, port: int, backend: str = "nccl", local_rank: int | None = None,
           seed: int = 1024, verbose: bool = True) -> None:
    """The default process group over tcp://host:port. As in ColossalAI, `backend` gives way to the device's own
    (nccl on CUDA, gloo on CPU), and the device is this local rank's."""
    del backend, verbose  # ColossalAI's launch takes the accelerator's backend whatever is passed
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        address = f"[{host}]" if ":" in host else host
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                                world_size=world_size)
        destroy_group_at_exit()
    if cuda:
        torch.cuda.set_device(local_rank if local_rank is not None else rank % torch.cuda.device_count())
    set_seed(seed)


def launch_from_torch(config=None, backend: str = "nccl", seed: int = 1024, verbose: bool = True) -> None:
    """launch() from RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `config` is the argument of
    ColossalAI before 0.3.8 (`launch_from_torch(config={})`): an empty one is accepted; the legacy parallel
    settings a non-empty one holds are not read here and are refused; a backend name in its place is 0.5's first
    positional argument."""
    if isinstance(config, str) and config in ("nccl", "gloo", "hccl", "mpi", "cpu:gloo,cuda:nccl"):
        config, backend = None, config
    if config:
        refuse("launch_from_torch(config=...) with settings (ColossalAI's legacy parallel context)",
               "give the parallel sizes to a Booster plugin (e.g. HybridParallelPlugin(tp_size=2, pp_size=1)), or "
               "a legacy 2D / 2.5D / 3D tensor section to initialize's config as tensor_parallel {size, mode, depth}")
    try:
        rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as e:
        raise RuntimeError(f"launch_from_torch: {e} is not set; start the script with torchrun or `tiers launch "
                           "--as-colossalai`, which set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
                           "MASTER_PORT") from None
    launch(rank, world_size, host, port, backend, local_rank, seed, verbose)
