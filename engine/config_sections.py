"""The typed config: one frozen dataclass per section of the JSON, with DeepSpeed's key names and defaults and each
value's bounds (engine/config_schema.py reads a dict into them), and the batch sizes resolved over the ranks that see
different samples. `engine.config.load_config` builds a `Config`; engine/config_checks.py checks its combinations.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Literal

from engine.config_deepspeed import AutotuningConfig, TorchAutocastConfig
from engine.config_schema import ConfigError, bounded, section, to_dict

Auto = Literal["auto"]


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "Adam"
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    type: str = ""
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    loss_scale: float = bounded(0.0, min=0)
    initial_scale_power: int = bounded(16, min=0, max=127)
    loss_scale_window: int = bounded(1000, min=1)
    hysteresis: int = bounded(2, min=1)
    consecutive_hysteresis: bool = False
    auto_cast: bool = False
    min_loss_scale: float = bounded(1.0, gt=0)
    # Tiers' key: the dynamic scale never grows past it (0: no cap), as ColossalAI's max_scale
    max_loss_scale: float = bounded(0.0, min=0)


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = False
    # skip a step whose gradients hold inf/nan, as fp16 does (DeepSpeed's default is true since 0.19.3; Tiers keeps
    # false, see docs/migrating-from-deepspeed.md)
    check_grad_overflow: bool = False
    # DeepSpeed's low-precision masters (Note [bf16 master weights]): the bf16 weights and gradients are the masters,
    # and with bf16_optimizer_states the Adam moments are bf16 too
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    # Tiers' key: bf16 masters rounded stochastically after each update (Note [keyed stochastic rounding])
    stochastic_rounding: bool = False


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    device: Literal["none", "cpu", "nvme"] | None = "none"
    nvme_path: str | None = None
    pin_memory: bool | None = None  # None: pinned where CUDA is (DeepSpeed's default is true)
    ratio: float = bounded(1.0, min=0.0, max=1.0)
    buffer_count: int = bounded(4, min=1)
    fast_init: bool = False
    # Tiers' own: update each gradient shard as soon as it is reduced (Note [stepping in backward])
    step_in_backward: bool = False


@dataclass(frozen=True)
class OffloadParamConfig:
    device: Literal["none", "cpu", "nvme"] | None = "none"
    nvme_path: str | None = None
    pin_memory: bool | None = None  # None: pinned where CUDA is
    buffer_count: int = bounded(5, min=1)
    buffer_size: int = bounded(100_000_000, min=1)
    max_in_cpu: int = bounded(1_000_000_000, min=0)
    # Tiers' own: train_batch runs a step's micro-batches block by block (Note [layer-major accumulation])
    layer_major: bool = False


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = bounded(0, min=0, max=3)
    # "auto": derived from the model (DeepSpeed/HF convention); for now the default
    reduce_bucket_size: int | Auto = bounded(500_000_000, min=1)
    allgather_bucket_size: int | Auto = bounded(500_000_000, min=1)
    overlap_comm: bool | None = None  # None: true for stage 3, as DeepSpeed
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    ignore_unused_parameters: bool = True
    load_from_fp32_weights: bool = True
    stage3_prefetch_bucket_size: int | Auto = bounded(50_000_000, min=0)
    stage3_param_persistence_threshold: int | Auto = bounded(100_000, min=0)
    stage3_max_live_parameters: int = bounded(1_000_000_000, min=0)
    stage3_max_reuse_distance: int = bounded(1_000_000_000, min=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    offload_optimizer: OffloadOptimizerConfig = section(OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = section(OffloadParamConfig)
    sub_group_size: int = bounded(1_000_000_000, min=1)
    chunk_size: int | None = bounded(None, min=1)  # Tiers: the most elements a chunk holds (Note [chunk packing])
    placement: Literal["static", "auto"] = "static"  # Tiers
    quantize_frozen: Literal["none", "int8"] = "none"  # Tiers: frozen linear weights (Note [int8 frozen chunks])
    # MiCS / HSDP: ranks of dp × sp that one shard group spans; -1: all of them (Note [hybrid sharding])
    mics_shard_size: int = bounded(-1, min=-1)

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


@dataclass(frozen=True)
class AioConfig:
    block_size: int = bounded(1_048_576, min=1)
    queue_depth: int = bounded(8, min=1)
    single_submit: bool = False
    overlap_events: bool = True
    thread_count: int | None = bounded(None, min=1)
    intra_op_parallelism: int | None = bounded(None, min=1)  # DeepSpeed's newer name

    @property
    def threads(self) -> int:
        return self.intra_op_parallelism or self.thread_count or 1


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    enabled: bool = False  # Tiers
    modules: list[str] | None = None  # Tiers
    every_n: int = bounded(1, min=1)  # Tiers
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = bounded(None, min=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class ParallelWriteConfig:
    pipeline_stage: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    tag_validation: Literal["Ignore", "Warn", "Fail", "ignore", "warn", "fail"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = section(ParallelWriteConfig)
    async_save: bool = False  # Tiers: write files in the background (Note [asynchronous save])
    timeout_s: float = bounded(300.0, gt=0)  # Tiers: how long a save waits for every rank to call it


@dataclass(frozen=True)
class TensorBoardConfig:
    enabled: bool = False
    output_path: str = ""
    job_name: str = "TiersJob"

    @property
    def log_dir(self) -> str:
        return os.path.join(self.output_path or "runs", self.job_name)


@dataclass(frozen=True)
class TensorParallelConfig:
    size: int = bounded(1, min=1)
    mode: Literal["1d", "2d", "2.5d", "3d"] = "1d"  # Note [tensor-parallel grids]
    depth: int = bounded(1, min=1)  # 2.5d: the q×q grids side by side (size = depth × q²)
    plan: str | dict = "auto"
    sequence_parallel: bool = False  # Note [Megatron sequence parallelism]


@dataclass(frozen=True)
class PipelineConfig:
    """Note [pipeline stages of an unmodified model]: `stages` pipeline ranks, each holding a contiguous run of
    the model's blocks (`virtual_stages` runs per rank under "interleaved"); one optimizer step takes
    gradient_accumulation_steps micro-batches through the schedule (DeepSpeed's convention)."""

    stages: int = bounded(1, min=1)
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"] = "1f1b"
    virtual_stages: int = bounded(1, min=1)
    partition: str | list[str] = "parameters"
    timeout_s: float = bounded(600.0, gt=0)

    @property
    def enabled(self) -> bool:
        return self.stages > 1


@dataclass(frozen=True)
class SequenceParallelConfig:
    """Note [sequence parallelism]: each sample's sequence split over `size` ranks; attention over the whole
    sequence by "ulysses" (heads split around it), "ring" (keys and values passed around), or "auto"."""

    size: int = bounded(1, min=1)
    mode: Literal["ulysses", "ring", "auto"] = "auto"

    @property
    def enabled(self) -> bool:
        return self.size > 1


@dataclass(frozen=True)
class MoEConfig:
    """Note [expert parallelism]: the experts of every MoE layer split over `expert_parallel_size` ranks of the
    data-parallel group; `capacity_factor` null routes every token (dropless), a number caps each expert's tokens
    at capacity_factor × k × tokens / experts (DeepSpeed's capacity mode); `aux_loss_coef` null keeps the model's
    own coefficient, `z_loss_coef` adds the router z-loss."""

    expert_parallel_size: int = bounded(1, min=1)
    capacity_factor: float | None = bounded(None, gt=0)
    min_capacity: int = bounded(4, min=0)
    aux_loss_coef: float | None = bounded(None, min=0)
    z_loss_coef: float = bounded(0.0, min=0)

    @property
    def enabled(self) -> bool:
        return self.expert_parallel_size > 1

    @property
    def routes_model_experts(self) -> bool:
        """A model's own (Hugging Face) expert modules are dispatched by Tiers: any key of this section set."""
        return self != MoEConfig()


@dataclass(frozen=True)
class MemoryConfig:
    device_budget: int | str | None = None
    cpu_budget: int | str | None = None
    # Tiers' own: with placement "auto", device memory kept free (None: 5% of it; Note [measured placement])
    device_margin: int | str | None = None

    def budget_bytes(self, key: str) -> int | None:
        """`device_budget` / `cpu_budget` / `device_margin` in bytes: an int, or a string like "8GB" (10^9) or
        "8GiB" (2^30)."""
        return parse_byte_size(getattr(self, key), f"memory.{key}")


_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_byte_size(value: int | str | None, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if match is None or match.group(2).upper() not in _BYTE_UNITS:
        raise ConfigError(f"{key}: {json.dumps(value)} is not a size; give bytes as an integer, or a string such as "
                          f"\"8GB\" (10^9 bytes) or \"8GiB\" (2^30 bytes)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


@dataclass(frozen=True)
class Config:
    train_batch_size: int | Auto | None = bounded(None, min=1)
    train_micro_batch_size_per_gpu: int | Auto | None = bounded(None, min=1)
    gradient_accumulation_steps: int | Auto | None = bounded(None, min=1)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = bounded(0.0, min=0)
    # where DeepSpeed divides by the data-parallel size around the gradient sum (Note [gradient averaging order])
    prescale_gradients: bool = False
    gradient_predivide_factor: float = bounded(1.0, gt=0)
    fp16: FP16Config = section(FP16Config)
    bf16: BF16Config = section(BF16Config)
    torch_autocast: TorchAutocastConfig = section(TorchAutocastConfig)
    zero_optimization: ZeroConfig = section(ZeroConfig)
    aio: AioConfig = section(AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = section(ActivationCheckpointingConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    tensorboard: TensorBoardConfig = section(TensorBoardConfig)
    steps_per_print: int = bounded(10, min=1)
    wall_clock_breakdown: bool = False
    zero_allow_untested_optimizer: bool = False
    tensor_parallel: TensorParallelConfig = section(TensorParallelConfig)
    pipeline: PipelineConfig = section(PipelineConfig)
    sequence_parallel: SequenceParallelConfig = section(SequenceParallelConfig)
    moe: MoEConfig = section(MoEConfig)
    memory: MemoryConfig = section(MemoryConfig)
    seed: int | None = None
    autotuning: AutotuningConfig = section(AutotuningConfig)  # read by `tiers tune`
    dataloader_drop_last: bool = False  # the loader deepspeed.initialize(training_data=...) returns (engine.compat)

    def batch_sizes(self, dp_world_size: int) -> BatchSizes:
        return resolve_batch_sizes(
            _given(self.train_batch_size),
            _given(self.train_micro_batch_size_per_gpu),
            _given(self.gradient_accumulation_steps),
            dp_world_size,
        )

    def to_dict(self) -> dict:
        return to_dict(self)


def _given(value: int | str | None) -> int | None:
    return None if value in (None, "auto") else value


def resolve_batch_sizes(total: int | None, micro: int | None, accum: int | None, dp: int) -> BatchSizes:
    """train_batch_size = micro × accumulation × dp; any two give the third (DeepSpeed's rule)."""
    rule = "train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × data-parallel size"
    shown = (f"train_batch_size={total}, train_micro_batch_size_per_gpu={micro}, "
             f"gradient_accumulation_steps={accum}, data-parallel size={dp}")
    if total is None and micro is None:
        raise ConfigError(f"batch size: set train_batch_size or train_micro_batch_size_per_gpu (got {shown}); {rule}.")
    if total is not None and micro is not None and accum is not None:
        if total != micro * accum * dp:
            raise ConfigError(f"batch size: inconsistent values {shown}: "
                              f"{micro}×{accum}×{dp} = {micro * accum * dp} ≠ {total}; {rule}.")
    elif total is not None and micro is not None:
        accum, rem = divmod(total, micro * dp)
        if rem or accum == 0:
            raise ConfigError(f"batch size: {shown}: "
                              f"train_batch_size is not a multiple of micro × dp = {micro * dp}; {rule}.")
    elif total is not None:
        accum = accum or 1
        micro, rem = divmod(total, accum * dp)
        if rem or micro == 0:
            raise ConfigError(f"batch size: {shown}: "
                              f"train_batch_size is not a multiple of accumulation × dp = {accum * dp}; {rule}.")
    else:
        accum = accum or 1
        total = micro * accum * dp
    return BatchSizes(total, micro, accum)
