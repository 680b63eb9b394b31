"""deepspeed.utils: the logger, RepeatingLoader, log_dist, safe_get_full_fp32_param, safe_get_full_grad,
safe_get_full_optimizer_state and the ZeRO-3 leaf-module helpers; the other helpers are refused by name."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from engine import whole_weights
from engine.comm import all_gather_into, shard_of
from engine.compat.deepspeed.unsupported import refuse
from engine.compat.deepspeed.z3_leaf import (  # noqa: F401 (deepspeed.utils' names)
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from engine.optimizers.blockwise_states import MOMENTS
from engine.optimizers.tiled_adam import TiledAdam

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
    engine = _engine_of(param)
    if engine is None:
        return None
    chunked = engine.chunked
    if not chunked.has_masters and not chunked.gathers_params:
        return param.detach().float().clone()
    index = chunked.chunk_index()[id(param)]
    with whole_weights._chunk_values(chunked, engine.gatherer, index, engine.mesh.shard.group,
                                     engine.comm) as values:
        return values(param).float().clone()


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The parameter's whole optimizer state `optim_state_key` (e.g. "exp_avg"), gathered from the ranks' shards
    under ZeRO >= 1, as a new fp32 tensor; every rank must call it for the same parameters. None for a parameter
    no engine trains."""
    engine = _engine_of(param)
    if engine is None:
        return None
    if hasattr(engine.optimizer, "manager"):
        refuse("safe_get_full_optimizer_state with an offloaded optimizer", "a checkpoint (its optimizer states "
               "are saved whole per parameter range) and `tiers convert`")
    if param in engine.optimizer.state:  # a client optimizer over the model's own parameters (stage 0, fp32)
        value = engine.optimizer.state[param][optim_state_key]
        return value.detach().float().clone()
    chunked = engine.chunked
    state = chunked.states[chunked.chunk_index()[id(param)]]
    value = _state_value(engine.optimizer, state.stepped, optim_state_key)
    if value.dim() == 0:
        return value.detach().clone()
    return chunked.master_values(param, _whole(value, state.place, engine)).float().clone()


def _state_value(optimizer: torch.optim.Optimizer, stepped: torch.Tensor, key: str) -> torch.Tensor:
    """Optimizer state `key` of a stepped tensor; a block-wise moment dequantized to fp32 (Note [block-wise
    optimizer states])."""
    state = optimizer.state[stepped]
    blocks = optimizer.layout.blockwise if isinstance(optimizer, TiledAdam) else None
    if key in MOMENTS and key not in state and blocks is not None:
        return blocks.moments(state, 0, stepped.numel())[MOMENTS.index(key)].dequantize()
    return state[key]


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's gradient averaged over the data-parallel ranks, as the coming update will use it
    (after backward, before step; divided by the accumulation steps as backward divides it), as a new fp32
    tensor; every rank must call it for the same parameters. bf16 or fp32, gradients not offloaded; None for a
    parameter no engine trains."""
    engine = _engine_of(param)
    if engine is None:
        return None
    chunked = engine.chunked
    if engine.config.fp16.enabled or chunked.grads_managed:
        refuse("safe_get_full_grad under fp16 or with offloaded gradient shards", "engine.get_global_grad_norm() "
               "after step() for the norm, or bf16 / fp32 without offload_optimizer")
    index = chunked.chunk_index()[id(param)]
    state = chunked.states[index]
    if chunked.shards_grads:  # this rank's reduced shard (logically zero while fresh), gathered
        shard = torch.zeros_like(state.grad_shard) if state.grad_fresh else state.grad_shard
        return chunked.master_values(param, _whole(shard, state.place, engine)).float().clone()
    runtime, group = engine.runtime, state.place.group_or(engine.mesh.zero.group)
    if runtime.reduces_grads and runtime.synchronized and runtime.reducer.scatter:  # each rank's shard reduced
        payload = state.grad_chunk.payload
        return chunked.master_values(param, _whole(shard_of(payload, state.place.rank, state.place.count),
                                                   state.place, engine)).float().clone()
    grad = state.grad_view(param).detach().float().clone()
    if runtime.reduces_grads and not runtime.synchronized:  # the update reduces later (each rank's share)
        dist.all_reduce(grad, group=group)
    return grad


def _engine_of(param: nn.Parameter):
    engine = getattr(param, "tiers_engine", lambda: None)()
    return engine if engine is not None and id(param) in engine.chunked.chunk_index() else None


def _whole(value: torch.Tensor, place, engine) -> torch.Tensor:
    """A chunk-long tensor from this rank's shard of it (the shard itself when not sharded)."""
    if place.count == 1:
        return value
    full = torch.empty(value.numel() * place.count, dtype=value.dtype, device=value.device)
    all_gather_into(full, value.detach().contiguous(), place.group_or(engine.mesh.shard.group), engine.comm,
                    async_op=False)
    return full


def __getattr__(name: str):
    if name in ("safe_set_full_fp32_param",
                "safe_get_local_grad", "safe_get_local_fp32_param", "safe_get_local_optimizer_state"):
        refuse(f"deepspeed.utils.{name}", "engine.gathered_parameters / engine.full_state_dict for values, and "
               "a checkpoint (`tiers convert`) for optimizer states")
    refuse(f"deepspeed.utils.{name}", "the helpers listed in docs/migrating-from-deepspeed.md")
