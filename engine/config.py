"""JSON config → typed sections, with DeepSpeed's key names and defaults and strict validation.

`load_config(path_or_dict)` reads DeepSpeed's spellings first (Note [reading a DeepSpeed config]), then checks
every key (unknown keys are errors naming the key path and the closest valid key; a top-level key that is no near
miss of a known one is a warning, as DeepSpeed ignores it) and every value (type and range). Features Tiers does
not have are accepted only at their "off" values; anything else says "not supported yet" naming the feature.
Batch sizes are resolved against the data-parallel world size by `Config.batch_sizes(dp)`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.config_checks import check_config
from engine.config_deepspeed import AutotuningConfig, TorchAutocastConfig, from_deepspeed
from engine.config_schema import ConfigError, bounded, closest, parse_section, section, to_dict, unknown_key_error
from engine.optimizers import params as optimizer_params

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
    mode: Literal["1d", "2d"] = "1d"
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


_OPTIMIZER_PARAMS: dict[str, dict[str, Any]] = {
    "adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": True,
             "torch_adam": False, "bias_correction": True, "amsgrad": False},
    "adamw": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": False,
              "bias_correction": True, "amsgrad": False},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
}
# DeepSpeed's optimizer names Tiers lacks (DeepSpeed also takes any torch.optim class by name: refused alike)
_OPTIMIZER_PARAMS.update(optimizer_params.OPTIMIZER_PARAMS)
_UNSUPPORTED_OPTIMIZERS = tuple({"onebitadam", "zerooneadam", "onebitlamb", "lamb", "lion", "adagrad", "muadam",
                                 "muadamw", "musgd", "muon"}
                                - set(optimizer_params.OPTIMIZER_PARAMS))
OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", **optimizer_params.OPTIMIZER_NAMES}


def _validate_optimizer(opt: OptimizerConfig) -> OptimizerConfig:
    name = opt.type.lower()  # (DeepSpeed's OnebitAdam / OnebitLamb spellings too)
    if name in _UNSUPPORTED_OPTIMIZERS or (name not in _OPTIMIZER_PARAMS and _is_torch_optimizer(opt.type)):
        raise ConfigError(f"optimizer.type: '{opt.type}' is not supported yet; "
                          f"use one of {', '.join(OPTIMIZER_NAMES.values())}.")
    if name not in _OPTIMIZER_PARAMS:
        guess = closest(opt.type, OPTIMIZER_NAMES.values())
        hint = f" Did you mean '{guess}'?" if guess else ""
        raise ConfigError(f"optimizer.type: unknown optimizer '{opt.type}'.{hint} "
                          f"Allowed: {', '.join(OPTIMIZER_NAMES.values())} (case-insensitive).")
    allowed = _OPTIMIZER_PARAMS[name]
    params = dict(allowed)
    for key, value in opt.params.items():
        if key not in allowed:
            raise unknown_key_error("optimizer.params", key, allowed)
        default = allowed[key]
        path = f"optimizer.params.{key}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{path}: {value!r} is not allowed; expected true/false.")
        elif isinstance(default, list):
            if not (isinstance(value, (list, tuple)) and len(value) == 2
                    and all(_is_number(v) and 0 <= v < 1 for v in value)):
                raise ConfigError(f"{path}: {value!r} is not allowed; "
                                  "expected two numbers in [0, 1), e.g. [0.9, 0.999].")
            value = [float(v) for v in value]
        elif isinstance(default, str) or isinstance(default, int) and not isinstance(default, bool):
            if type(value) is not type(default) or isinstance(value, int) and value < 0:
                kind = "a string" if isinstance(default, str) else "a whole number >= 0"
                raise ConfigError(f"{path}: {value!r} is not allowed; expected {kind}.")
        elif not _is_number(value) or value < 0:
            raise ConfigError(f"{path}: {value!r} is not allowed; expected a number >= 0.")
        params[key] = value
    if (refused := optimizer_params.check_optimizer_params(name, params)) is not None:
        raise ConfigError(refused)
    if params.get("amsgrad"):
        raise ConfigError("optimizer.params.amsgrad: true is not supported "
                          "(DeepSpeed's Adam has no AMSGrad either); remove it.")
    return OptimizerConfig(type=OPTIMIZER_NAMES[name], params=params)


def _is_torch_optimizer(name: str) -> bool:
    import torch

    return isinstance(getattr(torch.optim, name, None), type)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_scheduler(sched: SchedulerConfig) -> SchedulerConfig:
    """Names and required keys here; values by a dry build on a throwaway optimizer (lr_schedules checks them)."""
    import torch

    from engine.lr_schedules import build_lr_scheduler

    params = dict(sched.params)
    start = params.pop("last_batch_iteration", -1)  # DeepSpeed's constructor argument; -1 = a fresh run
    if start != -1:
        raise ConfigError(f"scheduler.params.last_batch_iteration: {json.dumps(start)} is not supported yet; "
                          "remove it (-1, a fresh start, is the only value accepted) and resume from a checkpoint")
    from engine.lr_schedules import REQUIRED, SCHEDULE_PARAMS

    if sched.type not in SCHEDULE_PARAMS:
        guess = closest(sched.type, SCHEDULE_PARAMS)
        hint = f" Did you mean '{guess}'?" if guess else ""
        raise ConfigError(f"scheduler.type: unknown schedule '{sched.type}'.{hint} "
                          f"Allowed: {', '.join(SCHEDULE_PARAMS)}.")
    allowed = SCHEDULE_PARAMS[sched.type]
    for key in params:
        if key not in allowed:
            raise unknown_key_error("scheduler.params", key, allowed)
    missing = [k for k, d in allowed.items() if d is REQUIRED and k not in params]
    if missing:
        raise ConfigError(f"scheduler.params: {sched.type} requires {', '.join(repr(m) for m in missing)}.")
    try:  # values (types, ranges, choices)
        build_lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), sched.type, params)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return SchedulerConfig(type=sched.type, params=params)


def load_config(source: str | os.PathLike | dict | Config) -> Config:
    """Reads and validates a config from a JSON file path, a dict, or returns a Config as is."""
    if isinstance(source, Config):
        return source
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {os.fspath(source)!r}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{os.fspath(source)}: not valid JSON: {e}") from None
    elif isinstance(source, dict):
        raw = source
    else:
        raise ConfigError(f"config must be a JSON file path, a dict or a Config, got {type(source).__name__}.")
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a JSON object at the top level, got {type(raw).__name__}.")
    aio = raw.get("aio")
    if (isinstance(aio, dict) and None not in (aio.get("thread_count"), aio.get("intra_op_parallelism"))
            and aio["thread_count"] != aio["intra_op_parallelism"]):
        raise ConfigError("aio: thread_count and intra_op_parallelism are the same setting "
                          "(DeepSpeed renamed it); give one.")
    raw = _with_autotp_size(_with_sequence_parallel_size(raw))
    cfg = parse_section(Config, from_deepspeed(raw, {f.name for f in dataclasses.fields(Config)}))
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one.")
    if cfg.optimizer is not None:
        cfg = _replace(cfg, optimizer=_validate_optimizer(cfg.optimizer))
    if cfg.scheduler is not None:
        cfg = _replace(cfg, scheduler=_validate_scheduler(cfg.scheduler))
    check_config(cfg)
    if (_given(cfg.gradient_accumulation_steps) is not None and _given(cfg.train_batch_size) is None
            and _given(cfg.train_micro_batch_size_per_gpu) is None):
        raise ConfigError("batch size: gradient_accumulation_steps alone is not enough; "
                          "also set train_batch_size or train_micro_batch_size_per_gpu.")
    return cfg


def _with_sequence_parallel_size(raw: dict) -> dict:
    """DeepSpeed's top-level `sequence_parallel_size` is `sequence_parallel.size`."""
    if "sequence_parallel_size" not in raw:
        return raw
    raw = dict(raw)
    size = raw.pop("sequence_parallel_size")
    section_ = dict(raw.get("sequence_parallel") or {})
    if "size" in section_ and section_["size"] != size:
        raise ConfigError(f"sequence_parallel_size ({size}) and sequence_parallel.size ({section_['size']}) are the "
                          "same setting and differ; give one")
    section_["size"] = size
    raw["sequence_parallel"] = section_
    return raw


# DeepSpeed's AutoTP-training keys beside autotp_size, accepted at their defaults (what they turn on Tiers lacks)
_AUTOTP_OFF_VALUES = {"tp_overlap_comm": False, "keep_module_on_host": False, "replace_with_kernel_inject": False,
                      "injection_policy_tuple": None, "partition_config": None}


def _with_autotp_size(raw: dict) -> dict:
    """DeepSpeed's `tensor_parallel.autotp_size: N` is `tensor_parallel.size: N` with the plan derived
    ("auto", Note [derived tensor-parallel plans]); 0 is off, as in DeepSpeed."""
    section_ = raw.get("tensor_parallel")
    if not isinstance(section_, dict) or not set(section_) & ({"autotp_size"} | set(_AUTOTP_OFF_VALUES)):
        return raw
    section_ = dict(section_)
    for key, off in _AUTOTP_OFF_VALUES.items():
        if key in section_ and section_.pop(key) != off:
            raise ConfigError(f"tensor_parallel.{key}: only {json.dumps(off)} is supported (DeepSpeed's AutoTP option "
                              f"that Tiers does not have); remove the key")
    if "autotp_size" in section_:
        size = section_.pop("autotp_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(f"tensor_parallel.autotp_size: {size!r} is not allowed; expected an integer >= 0")
        if section_.get("size", max(size, 1)) != max(size, 1):
            raise ConfigError(f"tensor_parallel.autotp_size ({size}) and tensor_parallel.size ({section_['size']}) "
                              "are the same setting and differ; give one")
        section_["size"] = max(size, 1)
    return {**raw, "tensor_parallel": section_}


def _replace(cfg: Config, **changes: Any) -> Config:
    return dataclasses.replace(cfg, **changes)



__all__ = ["Config", "ConfigError", "BatchSizes", "load_config", "resolve_batch_sizes"]
