"""torch optimizers built from the config's `optimizer` section, over chunk payloads."""

from __future__ import annotations

import torch

from engine.config import OptimizerConfig


def build_optimizer(config: OptimizerConfig, param_groups: list[dict]) -> torch.optim.Optimizer:
    """DeepSpeed's meanings: "Adam" is AdamW unless adam_w_mode is false; torch_adam picks torch's
    unfused implementation. Otherwise Adam/AdamW use torch's fused kernels (CPU and CUDA).

    `param_groups` are torch param-group dicts; options set in a group override the config's.
    """
    p = config.params
    if config.type in ("Adam", "AdamW"):
        decoupled = config.type == "AdamW" or p["adam_w_mode"]
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        impl = {"foreach": False} if p["torch_adam"] else {"fused": _fused_ok(param_groups)}
        return cls(param_groups, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                   weight_decay=p["weight_decay"], **impl)
    if config.type == "SGD":
        return torch.optim.SGD(param_groups, lr=p["lr"], momentum=p["momentum"], dampening=p["dampening"],
                               weight_decay=p["weight_decay"], nesterov=p["nesterov"])
    raise ValueError(f"optimizer.type: {config.type!r} has no builder")  # config validation prevents this


def _fused_ok(param_groups: list[dict]) -> bool:
    """torch's fused Adam takes floating tensors on CPU or CUDA."""
    tensors = [t for g in param_groups for t in g["params"]]
    return all(t.device.type in ("cpu", "cuda") and t.is_floating_point() for t in tensors)
