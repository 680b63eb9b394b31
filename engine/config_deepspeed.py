"""DeepSpeed's spellings and keys, brought to the typed config's terms before it is parsed.

Note [reading a DeepSpeed config]
`load_config` passes the raw JSON through `from_deepspeed` first, which
1. renames DeepSpeed's aliases to the names the typed sections use (`bfloat16` → `bf16`, the `zero_optimization`
   names without their `stage3_` prefix, `cpu_offload: true` → `offload_optimizer.device: "cpu"`, ...);
2. takes `"auto"` inside `zero_optimization` and its offload sections as the default (DeepSpeed's own models drop
   "auto" there); any other `"auto"` must be filled by an integration (HF Trainer, accelerate) unless the batch keys
   determine it, and is otherwise an error listing every such key;
3. removes the keys of DeepSpeed features Tiers does not have when they hold their off value (or, for a knob that
   changes only speed or logging, any value), and refuses them naming the feature otherwise;
4. warns about top-level keys DeepSpeed itself never reads (it ignores them); a near miss of a known key stays an
   error naming the key, so a typo never silently drops a setting.
The table of every key and its fate is in docs/migrating-from-deepspeed.md.

Note [gradient averaging order]
Tiers scales the loss by 1/(accumulation × data-parallel size) before backward, so every rank's gradients are
divided by the data-parallel size before they are summed, at every ZeRO stage: the order DeepSpeed's
`prescale_gradients: true` selects. DeepSpeed's default divides after the sum, and `gradient_predivide_factor` f
splits the division (by f before, by dp/f after). All of these give the same mean; they differ in where 16-bit
rounding happens, not in what is trained. So both keys are accepted with any value at every stage (DeepSpeed refuses
them at stage 2 and 3 with reduce_scatter, where its reduction cannot place the division) and carried in the config.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

from engine.config_schema import ConfigError, bounded, closest

ANY = object()  # a knob of speed or logging only: every value trains the same, so every value is accepted
AUTO_FILLERS = ("the Hugging Face Trainer (TrainingArguments(deepspeed=...)) and accelerate fill \"auto\" from their "
                "own arguments before the config reaches initialize; run through one of them, or give numbers")
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Tiers' own "auto" values (a mode, not a number to fill)
TIERS_AUTO_PATHS = frozenset({"tensor_parallel.plan", "sequence_parallel.mode"})
# top-level keys DeepSpeed never reads, seen in real configs (DeepSpeed ignores unknown top-level keys)
UNREAD_TOP_LEVEL = ("cuda_visible_devices", "data_parallel_size")
NEVER_PRINT = 2**63 - 1  # steps_per_print: Infinity (accelerate writes it): never


@dataclass(frozen=True)
class TorchAutocastConfig:
    """DeepSpeed's `torch_autocast`: the forward under torch.autocast(dtype) with fp32 parameters, gradients and
    optimizer. DeepSpeed reduces the gradients of `lower_precision_safe_modules` (default: Linear and Conv) in the
    autocast dtype; Tiers reduces every gradient in fp32 (the chunks stay fp32, the list splits no chunk), so the
    list is accepted and the result differs from DeepSpeed's by that reduction's rounding only."""

    enabled: bool = False
    # None (DeepSpeed's default): torch's per-device autocast dtype, float16 on CUDA
    dtype: Literal["bfloat16", "float16", "bf16", "fp16", "torch.bfloat16", "torch.float16", "half"] | None = None
    lower_precision_safe_modules: list[str] | None = None

    @property
    def is_bf16(self) -> bool:
        return self.dtype is not None and "b" in self.dtype


@dataclass(frozen=True)
class AutotuningConfig:
    """DeepSpeed's `autotuning` section, read by `tiers tune` (DeepSpeed runs autotuning from its launcher, not its
    engine, so initialize only accepts it). Note [tuning]."""

    enabled: bool = False
    fast: bool = True
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    start_profile_step: int = bounded(3, min=0)
    end_profile_step: int = bounded(5, min=1)
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: int = bounded(5, min=1)
    tuner_num_trials: int = bounded(50, min=1)
    min_train_micro_batch_size_per_gpu: int = bounded(1, min=1)
    max_train_micro_batch_size_per_gpu: int = bounded(1024, min=1)
    num_tuning_micro_batch_sizes: int = bounded(3, min=1)
    min_train_batch_size: int = bounded(1, min=1)
    max_train_batch_size: int | None = bounded(None, min=1)
    mp_size: int = bounded(1, min=1)
    # where DeepSpeed's autotuner writes and how it runs the user's script: tiers tune runs its own trials
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    metric_path: str | None = None
    arg_mappings: dict | None = None
    model_info: dict | None = None
    model_info_path: str | None = None


def _off(*values: Any) -> tuple:
    return values


# zero_optimization keys without a Tiers field: (accepted values or ANY, the feature / why)
_ZERO_KEYS: dict[str, tuple[Any, str]] = {
    "use_multi_rank_bucket_allreduce": (ANY, "how buckets are all-reduced; the sums are the same"),
    "elastic_checkpoint": (ANY, "every Tiers checkpoint loads under any layout already"),
    "memory_efficient_linear": (ANY, "a stage-3 linear that saves no gathered weight; Tiers releases by chunk"),
    "log_trace_cache_warnings": (ANY, "logging"),
    "enable_sanity_checks": (ANY, "debug assertions of DeepSpeed's internals"),
    "stage3_module_granularity_threshold": (ANY, "how stage 3 groups fetches; Tiers fetches by chunk"),
    "stage3_use_all_reduce_for_fetch_params": (ANY, "how stage 3 fetches; the values fetched are the same"),
    "stage3_allgather_sequential": (ANY, "how stage 3 fetches; the values fetched are the same"),
    "stage3_model_persistence_threshold": (ANY, "how many small parameters stay gathered (memory, not results)"),
    "cpu_offload_use_pin_memory": (ANY, "deprecated in DeepSpeed, where it has no effect either"),
    "mics_hierarchical_params_gather": (ANY, "how MiCS gathers across nodes; the values gathered are the same"),
    "legacy_stage1": (_off(False), "DeepSpeed's legacy ZeRO-1 implementation"),
    "zero_hpz_partition_size": (_off(0, 1), "ZeRO++ hierarchical partitioning (hpZ)"),
    "zero_quantized_weights": (_off(False), "ZeRO++ quantized weight all-gather (qwZ)"),
    "zero_quantized_nontrainable_weights": (_off(False), "ZeRO++ quantized frozen weights"),
    "zero_quantized_gradients": (_off(False), "ZeRO++ quantized gradient reduction (qgZ)"),
    "zeropp_loco_param": (_off(None), "LoCo-ZeRO++ error feedback"),
    "pipeline_loading_checkpoint": (_off(False), "stage-3 checkpoint loading in pipeline mode"),
    "override_module_apply": (_off(True), "stage 3 without gathering inside module.apply"),
    "save_muon_momentum_buffer_in_memory": (_off(False), "the Muon optimizer"),
    "leaf_module": (_off({}), "ZeRO-3 leaf modules"),
    "zenflow": (_off(None), "ZenFlow (stall-free offloaded updates)"),
}
_OFFLOAD_OPTIMIZER_KEYS: dict[str, tuple[Any, str]] = {
    "pipeline_read": (ANY, "overlapping NVMe reads with the step (speed)"),
    "pipeline_write": (ANY, "overlapping NVMe writes with the step (speed)"),
    "cpuadam_cores_perc": (ANY, "CPU cores for SuperOffload's CPU Adam"),
    "super_offload": (_off(False), "SuperOffload (Superchip CPU offload)"),
}
_SECTION_KEYS: dict[str, dict[str, tuple[Any, str]]] = {
    "fp16": {"fp16_master_weights_and_grads": (_off(False), "fp16 master weights and gradients (Tiers keeps fp32 "
                                                             "masters)")},
    "bf16": {"immediate_grad_update": (_off(False), "accumulating each micro-batch's bf16 gradients into fp32 (Tiers "
                                                    "accumulates them in bf16, as DeepSpeed's default does)")},
    "aio": {"use_gds": (_off(False), "GPUDirect Storage")},
    "checkpoint": {"checkpoint_serialization": (ANY, "torch.save's format; Tiers writes safetensors"),
                   "writer": (_off(None), "DeepSpeed's FastPersist checkpoint writer")},
    "tensor_parallel": {"preset_model": (_off(None), "AutoTP's preset model plans")},
    "optimizer": {"legacy_fusion": (ANY, "fusing fp16 unscaling into the step (speed)")},
    # DeepSpeed's PipelineModule options (Tiers splits an unmodified model by this section's stages instead)
    "pipeline": {key: (ANY, "PipelineModule's own options") for key in (
        "seed_layers", "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned", "use_reentrant")},
}
_TOP_LEVEL_KEYS: dict[str, tuple[Any, str]] = {
    "sparse_gradients": (_off(False), "sparse embedding gradients"),
    "disable_allgather": (_off(False), "skipping ZeRO's all-gather"),
    "communication_data_type": (_off(None), "a gradient-reduction dtype other than the gradients'"),
    "gradient_allreduce_op": (_off("mean"), "summed (not averaged) gradients"),
    "managed_gradient_accumulation": (_off(True), "gradient accumulation left to the user"),
    "graph_harvesting": (_off(False), "CUDA-graph capture of the step"),
    "use_data_before_expert_parallelism": (_off(False), "DeepSpeed's data-before-expert rank order"),
    "memory_breakdown": (ANY, "logging"),
    "dump_state": (ANY, "logging"),
    "log_level": (ANY, "logging"),
    "timers": (ANY, "logging"),
    "vocabulary_size": (ANY, "DeepSpeed only warns about its alignment"),
    "zero_force_ds_cpu_optimizer": (ANY, "Tiers steps offloaded states with its own CPU optimizer always"),
    "datastates_ckpt": (_off(False, None), "DataStates checkpointing"),
    "seq_parallel_communication_data_type": (ANY, "the dtype of sequence-parallel all-to-alls; Tiers sends the "
                                                  "activations in their own dtype (rounding-level difference)"),
}
# DeepSpeed sections off unless "enabled": true
_ENABLED_SECTIONS = (
    "amp", "flops_profiler", "comms_logger", "wandb", "csv_monitor", "comet", "curriculum_learning", "elasticity",
    "hybrid_engine", "eigenvalue", "progressive_layer_drop", "quantize_training", "nebula", "expert_parallel",
)
# DeepSpeed sections whose presence turns a feature on: accepted holding these defaults only
_PRESENCE_SECTIONS: dict[str, dict[str, Any]] = {
    "sparse_attention": {}, "weight_quantization": {},
    "data_types": {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None},
}
_ZERO_RENAMES = {  # DeepSpeed's pydantic aliases: the name without stage3_, and the fp16 spelling
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}


def from_deepspeed(raw: dict, known_top_level: set[str], warn: Callable[[str], None] | None = None) -> dict:
    """Note [reading a DeepSpeed config]: `raw` in the typed sections' terms (a new dict; `raw` is not changed).
    known_top_level: the typed config's top-level keys."""
    warn = warn or logging.getLogger(__name__).warning
    raw = _renamed(dict(raw))
    if isinstance(raw.get("autotuning"), dict) and raw["autotuning"].get("enabled"):
        _say_tiers_tune_reads_autotuning()
    _drop_param_offload_below_stage_3(raw, warn)
    _check_auto(raw)
    raw = _without_foreign_keys(raw)
    valid = known_top_level | set(_TOP_LEVEL_KEYS) | set(_ENABLED_SECTIONS) | set(_PRESENCE_SECTIONS)
    valid |= {"compression_training", "data_efficiency", "compile", "bfloat16", "sequence_parallel_size"}
    for key in [k for k in raw if k not in known_top_level]:
        if key in UNREAD_TOP_LEVEL or closest(key, valid) is None:
            warn(f"config: top-level key '{key}' is not read (DeepSpeed ignores it too); remove it to silence this")
            del raw[key]
    return raw


@functools.cache  # once per process, not once per load
def _say_tiers_tune_reads_autotuning() -> None:
    logging.getLogger(__name__).info("config: the autotuning section is read by `tiers tune` (DeepSpeed too runs "
                                     "autotuning from its launcher, not its engine); this run trains the config as "
                                     "it is")


def _renamed(raw: dict) -> dict:
    if "bfloat16" in raw:
        if "bf16" in raw and raw["bf16"] != raw["bfloat16"]:
            raise ConfigError("bfloat16 and bf16 are the same section (bfloat16 is DeepSpeed's old name) and differ; "
                              "give bf16 only")
        raw["bf16"] = raw.pop("bfloat16")
    spp = raw.get("steps_per_print", 0)
    if spp is None or isinstance(spp, float) and math.isinf(spp):  # null: DeepSpeed's own default, never
        raw["steps_per_print"] = NEVER_PRINT
    pipeline = raw.get("pipeline")
    if isinstance(pipeline, dict):  # DeepSpeed's defaults for PipelineModule: here, Tiers' own defaults
        defaults = (("stages", "auto"), ("partition", "best"))
        raw["pipeline"] = {k: v for k, v in pipeline.items() if (k, v) not in defaults}
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's oldest format: true is stage 1
        raw["zero_optimization"] = {"stage": 1} if zero else {}
    elif isinstance(zero, dict):
        raw["zero_optimization"] = _zero_renamed(dict(zero))
    return raw


def _drop_param_offload_below_stage_3(raw: dict, warn: Callable[[str], None]) -> None:
    """DeepSpeed reads offload_param at stage 3 only (DeepSpeed-Chat's and OpenRLHF's configs set it at every stage):
    below, the parameters stay on the device, there and here."""
    zero = raw.get("zero_optimization")
    param = zero.get("offload_param") if isinstance(zero, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(param, dict) and param.get("device") in ("cpu", "nvme") and isinstance(stage, int) and stage < 3:
        warn(f"config: zero_optimization.offload_param is read at stage 3 only (DeepSpeed ignores it at stage {stage} "
             "too); the parameters stay on the device")
        raw["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_param"}


def _zero_renamed(zero: dict) -> dict:
    for old, new in _ZERO_RENAMES.items():
        if old in zero:
            value = zero.pop(old)
            if new in zero and zero[new] != value:
                raise ConfigError(f"zero_optimization.{old} and zero_optimization.{new} are the same setting and "
                                  "differ; give one")
            zero[new] = value
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        value = zero.pop(old)
        if not isinstance(value, bool):
            raise ConfigError(f"zero_optimization.{old}: {json.dumps(value)} is not allowed; expected true/false")
        if value and new in zero:
            raise ConfigError(f"zero_optimization.{old} is DeepSpeed's old spelling of {new}.device \"cpu\"; give "
                              f"{new} only")
        if value:
            zero[new] = {"device": "cpu"}
    for key in [k for k, v in zero.items() if v == "auto" and k not in _ZERO_AUTO_DERIVED]:
        del zero[key]  # DeepSpeed takes the default
    for name in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(name), dict):
            zero[name] = {k: v for k, v in zero[name].items() if v != "auto"}
    return zero


# zero_optimization keys kept as "auto": the sizes Tiers derives from the model, and Tiers' own placement mode
_ZERO_AUTO_DERIVED = frozenset({"reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                                "stage3_param_persistence_threshold", "placement"})


def _check_auto(raw: dict) -> None:
    """Every "auto" nothing here fills (outside zero_optimization, which takes the defaults): one error naming all."""
    unfilled = [path for path in _auto_paths(raw, "") if path not in TIERS_AUTO_PATHS
                and not path.startswith("zero_optimization.") and path not in BATCH_KEYS]
    unfilled[:0] = undetermined_batch_keys(raw)
    if unfilled:
        raise ConfigError(f"{', '.join(unfilled)}: \"auto\" with nothing to derive it from; {AUTO_FILLERS}.")


def _auto_paths(value: Any, path: str) -> list[str]:
    if value == "auto":
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _auto_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list) and "auto" in value:
        return [path]
    return []


def undetermined_batch_keys(raw: dict) -> list[str]:
    """The batch keys given as "auto" that the others do not determine: two numbers (an absent accumulation counts
    as 1 beside a lone size, DeepSpeed's rule) give the third; fewer leave every "auto" open."""
    values = {k: raw.get(k) for k in BATCH_KEYS}
    numbers = {k for k, v in values.items() if v is not None and v != "auto"}
    total, micro, accumulation = BATCH_KEYS
    if values[accumulation] is None and not {total, micro} <= numbers:
        numbers.add(accumulation)
    if len(numbers) >= 2:
        return []
    return [k for k, v in values.items() if v == "auto"]


def _without_foreign_keys(raw: dict) -> dict:
    """Note [reading a DeepSpeed config] 3."""
    for key, (accepted, feature) in _TOP_LEVEL_KEYS.items():
        if key in raw:
            _accept(key, raw.pop(key), accepted, feature)
    for name, table in _SECTION_KEYS.items():
        if isinstance(raw.get(name), dict) and set(raw[name]) & set(table):
            raw[name] = _section_without(name, dict(raw[name]), table)
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict):
        zero = _section_without("zero_optimization", dict(zero), _ZERO_KEYS)
        if isinstance(zero.get("offload_optimizer"), dict):
            zero["offload_optimizer"] = _section_without("zero_optimization.offload_optimizer",
                                                         dict(zero["offload_optimizer"]), _OFFLOAD_OPTIMIZER_KEYS)
        raw["zero_optimization"] = zero
    for key in _ENABLED_SECTIONS:
        if key in raw:
            value = raw.pop(key)
            if not (value is None or isinstance(value, dict) and value.get("enabled", False) is False):
                raise ConfigError(f"{key}: this DeepSpeed feature is not supported yet by Tiers; remove the '{key}' "
                                  "section or set \"enabled\": false")
    for key, defaults in _PRESENCE_SECTIONS.items():
        if key in raw:
            _accept_presence_section(key, raw.pop(key), defaults)
    for key, find_on in (("compression_training", _compression_on), ("data_efficiency", _data_efficiency_on),
                         ("compile", _compile_on)):
        if key in raw:
            on = find_on(raw.pop(key))
            if on:
                raise ConfigError(f"{on}: this DeepSpeed feature is not supported yet by Tiers; turn it off or remove "
                                  f"the '{key}' section (training without it would not be what the config asks for)")
    return raw


def _section_without(path: str, section: dict, table: dict[str, tuple[Any, str]]) -> dict:
    for key, (accepted, feature) in table.items():
        if key in section:
            _accept(f"{path}.{key}", section.pop(key), accepted, feature)
    return section


def _accept(path: str, value: Any, accepted: Any, feature: str) -> None:
    if accepted is ANY or any(value == a and type(value) is type(a) or value == a and _is_number(value, a)
                              for a in accepted):
        return
    allowed = " or ".join(json.dumps(a) for a in accepted)
    raise ConfigError(f"{path}: {json.dumps(value)} turns on {feature}, which is not supported yet by Tiers; remove "
                      f"the key or set it to {allowed}.")


def _is_number(value: Any, other: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, other))


def _accept_presence_section(key: str, value: Any, defaults: dict) -> None:
    if isinstance(value, dict) and all(k in defaults and v == defaults[k] for k, v in value.items()):
        return
    raise ConfigError(f"{key}: {json.dumps(value)} — DeepSpeed turns this feature on by the section's presence, and "
                      f"Tiers does not have it; remove the '{key}' section (training without it would not be what "
                      "the config asks for).")


def _compression_on(section: Any) -> str | None:
    """The first compression technique the section turns on (DeepSpeed: `enabled` in the technique's
    shared_parameters; layer_reduction has its own `enabled`)."""
    if not isinstance(section, dict):
        return "compression_training"
    for name, technique in section.items():
        if not isinstance(technique, dict):
            return f"compression_training.{name}"
        flags = technique.get("shared_parameters", technique)
        if isinstance(flags, dict) and flags.get("enabled", False):
            return f"compression_training.{name}"
    return None


def _data_efficiency_on(section: Any) -> str | None:
    """The deepest data-efficiency feature turned on (every level must say "enabled": true)."""
    return _enabled_path(section, "data_efficiency")


def _enabled_path(section: Any, path: str) -> str | None:
    if not isinstance(section, dict) or not section.get("enabled", False):
        return None
    for key, value in section.items():
        deeper = _enabled_path(value, f"{path}.{key}")
        if deeper:
            return deeper
    # on with every part off trains as without it (random_ltd is data routing's only technique); data sampling on
    # alone replaces the loader's sampler
    return None if path in ("data_efficiency", "data_efficiency.data_routing") else path


def _compile_on(section: Any) -> str | None:
    """compile's settings configure DeepCompile; only `deepcompile: true` turns anything on."""
    if not isinstance(section, dict):
        return "compile"
    return "compile.deepcompile" if section.get("deepcompile", False) else None
