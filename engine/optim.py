"""torch optimizers built from the config's `optimizer` section, over chunk payloads."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from engine.comm import CommCounter
from engine.config_schema import ConfigError
from engine.config_sections import Config, OptimizerConfig
from engine.optimizers.adam import UncorrectedAdam
from engine.optimizers.blockwise_states import BlockwiseStates
from engine.optimizers.compressed import DataParallelGroup
from engine.optimizers.lamb import Lamb
from engine.optimizers.onebit_adam import OneBitAdam
from engine.optimizers.onebit_lamb import OneBitLamb
from engine.optimizers.params import COMPRESSED_OPTIMIZERS, LOW_BIT_OPTIMIZERS
from engine.optimizers.segments import Segments
from engine.optimizers.stochastic_rounding import KeyedBits
from engine.optimizers.tiled_adam import TILE, Arithmetic, TiledAdam, TiledLayout
from engine.optimizers.zero_one_adam import ZeroOneAdam


def build_optimizer(config: OptimizerConfig, param_groups: list[dict], segments: Segments | None = None,
                    data_parallel: DataParallelGroup | None = None,
                    tiled: TiledLayout | None = None) -> torch.optim.Optimizer:
    """DeepSpeed's meanings: "Adam" is AdamW unless adam_w_mode is false; torch_adam picks torch's
    unfused implementation. Otherwise Adam/AdamW use torch's fused kernels (CPU and CUDA);
    bias_correction false takes UncorrectedAdam (DeepSpeed FusedAdam's bias_correction=False).

    `param_groups` are torch param-group dicts; options set in a group override the config's. `segments`: where
    each parameter lies inside the stepped tensors, for optimizers that take per-parameter norms (Lamb) or
    scales (the compressed family); `data_parallel`: the group the compressed family averages over; `tiled`: how
    TiledAdam steps bf16 masters (Adam, AdamW: Note [bf16 master weights]) and the low-bit optimizers' states (Note
    [block-wise optimizer states]; without it, all their moments are plain).
    """
    p = config.params
    if config.type in LOW_BIT_OPTIMIZERS:
        bits, decoupled = LOW_BIT_OPTIMIZERS[config.type]
        blocks = BlockwiseStates(bits, p["block_size"])
        tiled = tiled or TiledLayout(Arithmetic.TORCHAO, torch.float32, blockwise=blocks)
        return TiledAdam(param_groups, tiled, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                         weight_decay=p["weight_decay"], decoupled=decoupled,
                         tile=TILE // p["block_size"] * p["block_size"], compiled=p["compile"])  # whole blocks
    if config.type in ("Adam", "AdamW"):
        decoupled = config.type == "AdamW" or p["adam_w_mode"]
        if tiled is not None:
            return TiledAdam(param_groups, tiled, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                             weight_decay=p["weight_decay"], decoupled=decoupled)
        if not p["bias_correction"]:
            return UncorrectedAdam(param_groups, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                                   weight_decay=p["weight_decay"], decoupled=decoupled)
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        impl = {"foreach": False} if p["torch_adam"] else {"fused": _fused_ok(param_groups)}
        return cls(param_groups, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                   weight_decay=p["weight_decay"], **impl)
    if config.type == "SGD":
        return torch.optim.SGD(param_groups, lr=p["lr"], momentum=p["momentum"], dampening=p["dampening"],
                               weight_decay=p["weight_decay"], nesterov=p["nesterov"])
    if config.type == "Lamb":
        return Lamb(param_groups, lr=p["lr"], bias_correction=p["bias_correction"], betas=tuple(p["betas"]),
                    eps=p["eps"], eps_inside_sqrt=p["eps_inside_sqrt"], weight_decay=p["weight_decay"],
                    max_coeff=p["max_coeff"], min_coeff=p["min_coeff"], segments=segments)
    if config.type in COMPRESSED_OPTIMIZERS:
        return _build_compressed(config, param_groups, segments, data_parallel)
    raise ValueError(f"optimizer.type: {config.type!r} has no builder")  # config validation prevents this


def state_blocks(config: OptimizerConfig | None) -> BlockwiseStates | None:
    """The block-wise format of a low-bit optimizer's moments (Note [block-wise optimizer states]); None: plain."""
    if config is None or config.type not in LOW_BIT_OPTIMIZERS:
        return None
    return BlockwiseStates(LOW_BIT_OPTIMIZERS[config.type][0], config.params["block_size"])


def tiled_layout_of(cfg: Config, chunked) -> TiledLayout | None:
    """How TiledAdam steps the chunks of `chunked`: bf16 masters (Note [bf16 master weights]) and low-bit states
    (Note [block-wise optimizer states]); None: neither (torch's optimizers step them)."""
    quantized = frozenset(id(s.stepped) for g in chunked.groups if g.blockwise for s in g.states)
    return tiled_layout(cfg, quantized, chunked.key_spans)


def tiled_layout(cfg: Config, quantized: frozenset[int], key_spans: Callable[[], dict]) -> TiledLayout | None:
    """tiled_layout_of for stepped tensors given by id: `quantized` keep block-wise moments, `key_spans()` says
    where each one's parameters lie (asked only when the weights are rounded stochastically)."""
    bf16, blocks = cfg.bf16, state_blocks(cfg.optimizer)
    if not bf16.bf16_master_weights_and_grads and blocks is None:
        return None
    rounds = bf16.bf16_master_weights_and_grads and bf16.stochastic_rounding
    moments = torch.bfloat16 if bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states else torch.float32
    return TiledLayout(Arithmetic.TORCHAO if blocks is not None else Arithmetic.TORCH, moments,
                       KeyedBits(cfg.seed or 0) if rounds else None, key_spans() if rounds else {}, blocks, quantized)



def _build_compressed(config: OptimizerConfig, param_groups: list[dict], segments: Segments | None,
                      data_parallel: DataParallelGroup | None) -> torch.optim.Optimizer:
    if data_parallel is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"optimizer.type: {config.type} averages over the data-parallel group itself; build it "
                         "through initialize(), which gives it the group")
    if data_parallel is None:  # one process (the estimator sizing its states): nothing to average with
        data_parallel = DataParallelGroup(None, 0, 1, CommCounter())
    p = config.params
    common = dict(lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"],
                  segments=segments, comm_backend_name=p["comm_backend_name"])
    if config.type == "ZeroOneAdam":
        return ZeroOneAdam(param_groups, data_parallel, var_freeze_step=p["var_freeze_step"],
                           var_update_scaler=p["var_update_scaler"], local_step_scaler=p["local_step_scaler"],
                           local_step_clipper=p["local_step_clipper"], **common)
    if config.type == "OneBitLamb":
        return OneBitLamb(param_groups, data_parallel, freeze_step=p["freeze_step"], max_coeff=p["max_coeff"],
                          min_coeff=p["min_coeff"], coeff_beta=p["coeff_beta"], factor_max=p["factor_max"],
                          factor_min=p["factor_min"], factor_threshold=p["factor_threshold"], **common)
    return OneBitAdam(param_groups, data_parallel, freeze_step=p["freeze_step"], **common)


def check_compressed_run(config, mesh) -> None:
    """The compressed family's limits (Note [optimizers that communicate]): DeepSpeed's, ZeRO stage 0 and plain
    data parallelism, and fp16, whose overflow check would decide skipped steps rank by rank on their own
    gradients."""
    name = config.optimizer.type if config.optimizer is not None else None
    if name not in COMPRESSED_OPTIMIZERS:
        return
    refusals = [
        (config.zero_optimization.stage != 0, "zero_optimization.stage",
         f"{name} runs at ZeRO stage 0 only (as in DeepSpeed); set zero_optimization.stage to 0"),
        (max(mesh.tp.size, mesh.pp.size, mesh.sp.size, mesh.ep.size) > 1, "optimizer.type",
         f"{name} runs with data parallelism only; remove the tensor, pipeline, sequence or expert parallel sizes"),
        (config.fp16.enabled, "fp16.enabled",
         f"{name} after its warmup leaves each rank its own gradients, and fp16's overflow check would decide the "
         "skipped steps rank by rank; use bf16 or fp32"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {why}")


# optimizers that take a norm per parameter, so they must see each parameter whole (Note [lamb trust ratio])
_PER_PARAMETER_NORMS = ("Lamb", "OneBitLamb")


def chunk_segments(config: OptimizerConfig, chunked, offloaded: bool) -> Segments:
    """Where each parameter lies in the chunks the optimizer steps; refuses layouts in which an optimizer that takes
    per-parameter norms would not see each parameter whole (sharded chunks, offloaded pieces)."""
    if config.type in _PER_PARAMETER_NORMS and (chunked.sharded or offloaded):
        where = "sharded across data-parallel ranks" if chunked.sharded else "offloaded in pieces"
        raise ConfigError(f"optimizer.type: {config.type} takes each parameter's norm (its trust ratio), and here the "
                         f"chunks are {where}, so a parameter can be split; use zero_optimization.stage 0 (or one "
                         "data-parallel rank) without offload_optimizer, or Adam/AdamW")
    by_tensor = {}
    for index, state in enumerate(chunked.states):
        by_tensor[id(state.stepped)] = [(slot.offset, slot.numel) for _, slot in chunked.chunk_members(index)]
    return Segments(by_tensor)


def _fused_ok(param_groups: list[dict]) -> bool:
    """torch's fused Adam takes floating tensors on CPU or CUDA."""
    tensors = [t for g in param_groups for t in g["params"]]
    return all(t.device.type in ("cpu", "cuda") and t.is_floating_point() for t in tensors)
