"""A DeepSpeed-style config completed from what Lightning's Trainer or Fabric was told (Note [Lightning's arguments
in the config])."""

from __future__ import annotations

import os

from engine.config import load_layout_sections
from engine.config_checks import check_framework_run
from engine.integrations.config_dict import read_config

AUTO = "auto"
# Lightning's precision flag -> the config section an "auto" enabled value follows
PRECISION_SECTIONS = {"32-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


def precision_flag(plugin, plain: tuple[type, ...], strategy: str) -> str:
    """The precision flag of Lightning's plugin, which the config's precision sections carry out (the engine casts,
    autocasts and scales); `plain`: the Trainer's or Fabric's Precision and MixedPrecision, the only plugins whose
    flag says all they do."""
    if type(plugin) not in plain:
        raise ValueError(f"{strategy} with the precision plugin {type(plugin).__name__} is not built; use "
                         "precision=\"bf16-mixed\", \"16-mixed\" or \"32-true\" (the config's bf16/fp16 decide)")
    return plugin.precision


def lightning_config(config: str | os.PathLike | dict, *, precision: str, accumulation: int | None = None,
                     clipping: float | None = None, micro_batch: int | None = None) -> dict:
    """Note [Lightning's arguments in the config]
    The Trainer's (or Fabric's) arguments are written into the config where it leaves them out or says "auto", and a
    config value that contradicts them is refused, so the engine trains as the arguments say:
    - gradient_accumulation_steps from accumulate_grad_batches (Fabric has none: the config's, default 1);
    - gradient_clipping from gradient_clip_val (a config's number wins over an unset value, as in DeepSpeed);
    - train_micro_batch_size_per_gpu from the training loader's batch size (Fabric: 1 unless the config derives it
      from train_batch_size); it counts samples for throughput and checks train_batch_size;
    - precision: "bf16-mixed" is DDP's, fp32 weights and a forward under bf16 autocast, which the config's
      torch_autocast section gives; a config whose bf16 or fp16 section says "auto" follows the flag instead (bf16
      weights and gradients with fp32 masters, as DeepSpeed's Lightning strategy does), as does one that enables
      bf16 itself. "16-mixed" (autocast with torch's GradScaler) has no engine equivalent: it needs the config's
      own fp16 section (DeepSpeed's loss scaling). "32-true" leaves the config's sections as they are. "-true"
      half precisions and 64-bit are refused.
    Tensor, pipeline and sequence parallelism are refused: Lightning's sampler gives every process other samples."""
    config = read_config(config)
    problems: list[str] = []
    _settle(config, "gradient_accumulation_steps", accumulation, "accumulate_grad_batches", problems)
    _settle(config, "gradient_clipping", clipping, "gradient_clip_val", problems, unset=0.0)
    _settle(config, "train_micro_batch_size_per_gpu", micro_batch, "the training data loader's batch_size", problems,
            unset=None if isinstance(config.get("train_batch_size"), int) else 1)
    if config.get("train_batch_size") == AUTO:
        del config["train_batch_size"]  # derived from the micro-batch, the accumulation and the processes
    _settle_precision(config, precision, problems)
    if problems:
        raise ValueError("TiersStrategy: the config contradicts Lightning's arguments: " + "; ".join(problems))
    check_framework_run(load_layout_sections(config), "TiersStrategy", "Lightning's sampler", "Lightning runs")
    return config


def _settle(config: dict, key: str, value, source: str, problems: list[str], unset=None) -> None:
    """config[key] from the framework's `value` (None: the framework sets none, so `unset` fills an absent or "auto"
    key, or nothing when `unset` is None)."""
    current = config.get(key, AUTO)
    if value is None:
        if current == AUTO and unset is not None:
            config[key] = unset
        elif current == AUTO and key in config:
            del config[key]
        return
    if current == AUTO:
        config[key] = value
    elif current != value:
        problems.append(f"{key} is {current!r} in the config but {source} gives {value!r}; set one of them (the "
                        f"config's to \"auto\")")


def _settle_precision(config: dict, precision: str, problems: list[str]) -> None:
    if precision not in PRECISION_SECTIONS:
        problems.append(f"precision={precision!r} is not built under TiersStrategy; use \"bf16-mixed\" (or "
                        "\"16-mixed\" with the config's fp16 section), or \"32-true\" with the config's own bf16/fp16 "
                        "section")
        return
    wanted = PRECISION_SECTIONS[precision]
    for name in ("bf16", "fp16"):
        section = config.get(name)
        if isinstance(section, dict) and section.get("enabled") == AUTO:
            section["enabled"] = name == wanted
    enabled = [name for name in ("bf16", "fp16") if (config.get(name) or {}).get("enabled") is True]
    if wanted is None or enabled == [wanted]:
        return
    if enabled:
        problems.append(f"precision={precision!r} but the config enables {enabled[0]}")
    elif wanted == "fp16":
        problems.append("precision='16-mixed' (autocast with torch's GradScaler) has no engine equivalent; enable the "
                        "config's fp16 section (DeepSpeed's fp16: fp16 weights, fp32 masters, its loss scaling), or "
                        "use \"bf16-mixed\"")
    else:
        autocast = config.setdefault("torch_autocast", {})
        dtype = autocast.get("dtype", "bfloat16")
        if autocast.get("enabled") is False or dtype not in ("bfloat16", "bf16", "torch.bfloat16"):
            problems.append(f"precision='bf16-mixed' but the config's torch_autocast is {autocast}")
        autocast.update(enabled=True, dtype="bfloat16")
