"""deepspeed.utils: the logger, RepeatingLoader, log_dist and safe_get_full_fp32_param; the other helpers are
refused by name."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from engine import whole_weights
from engine.compat.deepspeed.unsupported import refuse

logger = logging.getLogger("DeepSpeed")


class RepeatingLoader:
    """Iterates `loader` forever: a new pass starts where the last one ended (DeepSpeed's)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Logs on the given ranks (default 0; -1 in `ranks`: every rank)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = [0] if ranks is None else list(ranks)
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's whole fp32 values (its master under bf16 / fp16, gathered under ZeRO-3) as a new tensor;
    every rank must call it for the same parameters. None for a parameter no engine trains, as DeepSpeed."""
    engine = getattr(param, "tiers_engine", lambda: None)()
    if engine is None or id(param) not in engine.chunked.chunk_index():
        return None
    chunked = engine.chunked
    if chunked.masters is None and engine.gatherer is None:
        return param.detach().float().clone()
    index = chunked.chunk_index()[id(param)]
    with whole_weights._chunk_values(chunked, engine.gatherer, index, engine.dp_group, engine.comm) as values:
        return values(param).float().clone()


def __getattr__(name: str):
    if name in ("safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_fp32_param",
                "safe_get_local_grad", "safe_get_local_fp32_param", "safe_get_local_optimizer_state"):
        refuse(f"deepspeed.utils.{name}", "engine.gathered_parameters / engine.full_state_dict for values, and "
               "a checkpoint (`tiers convert`) for optimizer states")
    if name == "set_z3_leaf_modules":
        refuse("deepspeed.utils.set_z3_leaf_modules", "the config's `moe` section, which has Tiers place and "
               "dispatch a Hugging Face model's experts under every ZeRO stage (docs/parallelism.md)")
    refuse(f"deepspeed.utils.{name}", "the helpers listed in docs/migrating-from-deepspeed.md")
