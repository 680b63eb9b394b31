"""DeepSpeed's `autotuning` section, as `tiers tune` reads it.

Note [autotuning section]
DeepSpeed's autotuner (run from its launcher) tries ZeRO stages and micro-batch sizes and keeps the best by a
metric. `tiers tune` reads the same section of the config it starts from:
- `metric`: "throughput" (samples per second: micro batch × accumulation × data-parallel size / step time) or
  "latency" (step time); "flops" is refused (trials measure time and memory, not FLOPs). Without the section the
  tuner keeps its own rule, the shortest step at the config's micro batch.
- micro-batch sizes: `num_tuning_micro_batch_sizes` sizes spread geometrically from
  `min_train_micro_batch_size_per_gpu` to `max_train_micro_batch_size_per_gpu` (the estimate rules out those that do
  not fit); `min_train_batch_size` / `max_train_batch_size` bound each candidate's global batch.
- `start_profile_step` / `end_profile_step`: the warm-up steps and the last timed step of a trial.
- `tuner_type`: "gridsearch" tries the candidates in the estimate's order, "random" in a seeded shuffle;
  "model_based" (DeepSpeed's cost model) is refused. `tuner_num_trials` caps the trials; `tuner_early_stopping`
  stops after that many trials in a row that did not beat the best.
- `mp_size`: a tensor-parallel size to try as well.
The keys that say where DeepSpeed's autotuner writes and how it launches the user's script (`results_dir`,
`exps_dir`, `overwrite`, `metric_path`, `arg_mappings`, `model_info`, `model_info_path`, `fast`) are accepted and
named as unused: `tiers tune` runs its own trials and writes `--out`.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from engine.config import ConfigError, load_config
from engine.config_deepspeed import AutotuningConfig

DEEPSPEED_ONLY = ("results_dir", "exps_dir", "overwrite", "metric_path", "arg_mappings", "model_info",
                  "model_info_path", "fast")


class Metric(enum.Enum):
    LATENCY = "latency"
    THROUGHPUT = "throughput"


@dataclasses.dataclass(frozen=True)
class TuningPlan:
    micro_sizes: tuple[int | None, ...]  # None: the config's own
    metric: Metric = Metric.LATENCY
    warmup: int = 1
    steps: int = 3
    max_trials: int | None = None
    early_stopping: int | None = None
    shuffled: bool = False
    train_batch_bounds: tuple[int, int | None] = (1, None)
    tp_sizes: tuple[int, ...] = ()
    unused: tuple[str, ...] = ()  # DeepSpeed autotuner keys given that tiers tune does not use

    def config_at(self, config: dict, micro: int | None) -> dict:
        """`config` with micro batch `micro` (the global batch follows from it and the accumulation)."""
        if micro is None:
            return config
        out = {k: v for k, v in config.items() if k not in ("train_batch_size", "train_micro_batch_size_per_gpu")}
        if out.get("gradient_accumulation_steps") == "auto":
            out.pop("gradient_accumulation_steps")
        return {**out, "train_micro_batch_size_per_gpu": micro}

    def better(self, samples_per_s: float, step_s: float, best: tuple[float, float] | None) -> bool:
        if best is None:
            return True
        return samples_per_s > best[0] if self.metric is Metric.THROUGHPUT else step_s < best[1]


def tuning_plan(config: dict, steps: int, warmup: int) -> TuningPlan:
    """Note [autotuning section]: the plan of `tiers tune` for `config` (with no autotuning section: the config's
    micro batch, the shortest step, `steps` timed after `warmup`)."""
    if "autotuning" not in config:
        return TuningPlan(micro_sizes=(None,), warmup=warmup, steps=steps)
    at = load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": config["autotuning"]}).autotuning
    if at.metric == "flops":
        raise ConfigError('autotuning.metric: "flops" — tiers tune measures step time and memory, not FLOPs; use '
                          '"throughput" or "latency"')
    if at.tuner_type == "model_based":
        raise ConfigError('autotuning.tuner_type: "model_based" is DeepSpeed\'s cost-model search, which tiers tune '
                          'does not have (its memory estimate rules candidates out first); use "gridsearch" or '
                          '"random"')
    if at.end_profile_step <= at.start_profile_step:
        raise ConfigError(f"autotuning.end_profile_step: {at.end_profile_step} — a trial times the steps after "
                          f"start_profile_step ({at.start_profile_step}) up to end_profile_step; make it larger")
    if at.min_train_micro_batch_size_per_gpu > at.max_train_micro_batch_size_per_gpu:
        raise ConfigError("autotuning.min_train_micro_batch_size_per_gpu: larger than "
                          "max_train_micro_batch_size_per_gpu; swap them")
    defaults = AutotuningConfig()
    return TuningPlan(
        micro_sizes=micro_sizes(at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu,
                                at.num_tuning_micro_batch_sizes),
        metric=Metric(at.metric), warmup=at.start_profile_step, steps=at.end_profile_step - at.start_profile_step,
        max_trials=at.tuner_num_trials, early_stopping=at.tuner_early_stopping, shuffled=at.tuner_type == "random",
        train_batch_bounds=(at.min_train_batch_size, at.max_train_batch_size),
        tp_sizes=(at.mp_size,) if at.mp_size > 1 else (),
        unused=tuple(k for k in DEEPSPEED_ONLY if getattr(at, k) != getattr(defaults, k)))


def micro_sizes(low: int, high: int, count: int) -> tuple[int, ...]:
    """`count` sizes from `low` to `high`, spread geometrically (both ends included when count > 1)."""
    if count == 1 or low == high:
        return (high,)
    ratio = (high / low) ** (1 / (count - 1))
    return tuple(sorted({max(low, min(high, round(low * ratio**i))) for i in range(count)}))


def data_parallel_size(world: int, tp: int, pp: int) -> int:
    return max(world // (tp * pp), 1)


def global_batch(config: dict, dp: int) -> int:
    return load_config(config).batch_sizes(dp).train_batch_size


def samples_per_second(config: dict, dp: int, step_s: float) -> float:
    return global_batch(config, dp) / step_s if step_s > 0 else math.inf
