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
from typing import Any

from engine.config_checks import check_config
from engine.config_deepspeed import from_deepspeed
from engine.config_schema import ConfigError, closest, parse_section, unknown_key_error
from engine.config_sections import BatchSizes, Config, OptimizerConfig, SchedulerConfig, resolve_batch_sizes
from engine.optimizers import params as optimizer_params

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
    if cfg.optimizer is not None:
        cfg = _replace(cfg, optimizer=_validate_optimizer(cfg.optimizer))
    if cfg.scheduler is not None:
        cfg = _replace(cfg, scheduler=_validate_scheduler(cfg.scheduler))
    check_config(cfg)  # every combination (engine/config_checks.py)
    return cfg


# what a framework integration reads before its own arguments fill the config's other "auto" values: the parallel
# sections, and the ZeRO stage and parameter offload (with DeepSpeed's older spellings of them)
LAYOUT_SECTIONS = ("tensor_parallel", "pipeline", "sequence_parallel", "sequence_parallel_size")
LAYOUT_ZERO_KEYS = ("stage", "offload_param", "cpu_offload_param")


def load_layout_sections(raw: dict) -> Config:
    """The config's parallel sections and its ZeRO stage and parameter offload, typed as load_config reads them
    (DeepSpeed's keys and aliases included), everything else at its default: what an integration must know before
    the framework's arguments fill the rest (the batch sizes, the optimizer's "auto" values). The other keys are
    left to initialize, which checks them and every combination."""
    picked = {k: raw[k] for k in LAYOUT_SECTIONS if k in raw}
    zero = raw.get("zero_optimization")
    if zero is not None:
        picked["zero_optimization"] = {k: zero[k] for k in LAYOUT_ZERO_KEYS if k in zero} if isinstance(
            zero, dict) else zero
    picked = _with_autotp_size(_with_sequence_parallel_size(picked))
    return parse_section(Config, from_deepspeed(picked, {f.name for f in dataclasses.fields(Config)}))


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



__all__ = ["Config", "ConfigError", "BatchSizes", "load_config", "load_layout_sections", "resolve_batch_sizes"]
