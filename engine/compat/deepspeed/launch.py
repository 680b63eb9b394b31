"""deepspeed.add_config_arguments and deepspeed.init_distributed."""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from engine.compat.deepspeed.unsupported import refuse
from engine.process_exit import close_at_exit, destroy_group_at_exit


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: --deepspeed, --deepspeed_config (and the older --deepscale ones)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1):
    """The process group from torchrun's (or `tiers launch`'s) environment: gloo on CPU, nccl on CUDA, unless
    `dist_backend` names one. One process without that environment needs none (Tiers runs without it).
    DeepSpeed scripts never close their engines nor destroy the group: the group started here is destroyed at
    exit (Note [shutting down at exit])."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if "WORLD_SIZE" not in os.environ and rank < 0:
        return  # one process, started without a launcher
    if auto_mpi_discovery and "OMPI_COMM_WORLD_SIZE" in os.environ and "RANK" not in os.environ:
        refuse("init_distributed's MPI discovery (mpirun without torchrun's variables)",
               "torchrun or `tiers launch` (they set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if rank >= 0:
        kwargs.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, init_method=init_method, **kwargs)
    destroy_group_at_exit()


def release_at_exit(engine) -> None:
    """`engine` (a DeepSpeedEngine) is closed and released when the process exits, so that its references hold no
    process group while the group is destroyed (Note [shutting down at exit])."""
    close_at_exit(engine.release)
