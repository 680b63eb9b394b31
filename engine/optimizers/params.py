"""The config params of the optimizers in this package, with DeepSpeed's defaults, and the values refused."""

from __future__ import annotations

from typing import Any

_ADAM_LIKE = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
              "eps_inside_sqrt": False, "max_grad_norm": 0.0, "amsgrad": False}
_COMPRESSED = {"cuda_aware": False, "comm_backend_name": "nccl"}

# lower-case optimizer.type -> params and defaults (DeepSpeed's)
OPTIMIZER_PARAMS: dict[str, dict[str, Any]] = {
    "lamb": {**_ADAM_LIKE, "max_coeff": 10.0, "min_coeff": 0.01},
    "onebitadam": {**_ADAM_LIKE, **_COMPRESSED, "freeze_step": 100000},
    "zerooneadam": {**_ADAM_LIKE, **_COMPRESSED, "var_freeze_step": 100000, "var_update_scaler": 16,
                    "local_step_scaler": 32678, "local_step_clipper": 16},
    "onebitlamb": {**_ADAM_LIKE, **_COMPRESSED, "freeze_step": 100000, "max_coeff": 10.0, "min_coeff": 0.01,
                   "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
}
# torchao's and bitsandbytes' low-bit Adam names (Note [block-wise optimizer states]): torchao's defaults
_LOW_BIT = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "amsgrad": False, "compile": False}
OPTIMIZER_PARAMS.update({
    "adamw8bit": {**_LOW_BIT, "weight_decay": 1e-2, "block_size": 256},
    "adam8bit": {**_LOW_BIT, "weight_decay": 0.0, "block_size": 256},
    "adamw4bit": {**_LOW_BIT, "weight_decay": 1e-2, "block_size": 128},
    "adam4bit": {**_LOW_BIT, "weight_decay": 0.0, "block_size": 128},
})
OPTIMIZER_NAMES = {"lamb": "Lamb", "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb",
                   "adamw8bit": "AdamW8bit", "adam8bit": "Adam8bit", "adamw4bit": "AdamW4bit", "adam4bit": "Adam4bit"}
# name -> (bits per moment element, decoupled weight decay)
LOW_BIT_OPTIMIZERS = {"AdamW8bit": (8, True), "Adam8bit": (8, False), "AdamW4bit": (4, True), "Adam4bit": (4, False)}
# the optimizers that average over the data-parallel group themselves (Note [optimizers that communicate])
COMPRESSED_OPTIMIZERS = frozenset({"OneBitAdam", "ZeroOneAdam", "OneBitLamb"})
# intervals and counts that must be at least 1
_POSITIVE = ("var_update_scaler", "local_step_scaler", "local_step_clipper")
# params DeepSpeed's compressed optimizers take and never read: accepted at their defaults only
_IGNORED_BY_DEEPSPEED = {"eps_inside_sqrt": False, "max_grad_norm": 0.0}


def check_optimizer_params(name: str, params: dict) -> str | None:
    """What is refused in the (validated, defaults filled) params of optimizer `name`, or None."""
    if name not in OPTIMIZER_PARAMS:
        return None
    if OPTIMIZER_NAMES[name] in COMPRESSED_OPTIMIZERS:
        for key, default in _IGNORED_BY_DEEPSPEED.items():
            if params[key] != default:
                return (f"optimizer.params.{key}: {params[key]!r} — DeepSpeed's {OPTIMIZER_NAMES[name]} never reads "
                        f"it (its update would not be what the config says); remove it")
    if OPTIMIZER_NAMES[name] in LOW_BIT_OPTIMIZERS and (params["block_size"] < 8 or params["block_size"] % 8):
        return (f"optimizer.params.block_size: {params['block_size']} is not allowed; expected a multiple of 8 "
                "elements (torchao's defaults: 256 for 8-bit states, 128 for 4-bit)")
    for key in _POSITIVE:
        if key in params and params[key] < 1:
            return f"optimizer.params.{key}: {params[key]} is not allowed; expected a whole number >= 1"
    if params.get("max_grad_norm", 0.0) > 0:
        return ("optimizer.params.max_grad_norm: DeepSpeed's engine never hands this optimizer the gradient norm "
                "it would clip by; use the top-level gradient_clipping instead, and remove max_grad_norm")
    if params.get("amsgrad"):
        return "optimizer.params.amsgrad: true is not supported by this optimizer (nor by DeepSpeed's); remove it"
    if params.get("coeff_beta", 0.0) >= 1:
        return f"optimizer.params.coeff_beta: {params['coeff_beta']} is not allowed; expected a number in [0, 1)"
    if params.get("factor_min", 0.0) > params.get("factor_max", 1.0):
        return (f"optimizer.params.factor_min: {params['factor_min']} is above factor_max {params['factor_max']}; "
                "the factor is clamped to [factor_min, factor_max]")
    if params.get("min_coeff", 0.0) > params.get("max_coeff", 1.0):
        return (f"optimizer.params.min_coeff: {params['min_coeff']} is above max_coeff {params['max_coeff']}; "
                "the trust ratio is clamped to [min_coeff, max_coeff]")
    return None
