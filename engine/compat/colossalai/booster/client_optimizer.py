"""The optimizer a ColossalAI script builds before boost(), as the engine's own: an Adam family optimizer (torch's
Adam or AdamW, HybridAdam, CPUAdam, FusedAdam) becomes the config's `optimizer` section with its param groups as
model_parameters, so that the plugin may shard and offload its states; any other optimizer is passed as it is
(the engine rebuilds it over its shards, and refuses offloading it)."""

from __future__ import annotations

import torch

from engine.compat.colossalai.unsupported import refuse

_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay", False))


def as_config_optimizer(optimizer: torch.optim.Optimizer,
                        model: torch.nn.Module) -> tuple[dict, list[dict] | None] | None:
    """(the config's optimizer section, its param groups: None where one group holds every parameter of `model`
    with the section's settings, which tensor parallelism needs, as it replaces the parameters) for an Adam family
    optimizer, else None."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    name = type(optimizer).__name__
    for flag in ("amsgrad", "maximize"):
        if optimizer.defaults.get(flag):
            refuse(f"{name}({flag}=True)", f"use {name} without {flag}")
    if any(optimizer.state.values()):
        raise ValueError(f"boost(optimizer=...): the {name} already holds state (it has stepped); pass a freshly "
                         "built optimizer and load states with booster.load_optimizer")
    first = optimizer.param_groups[0]
    params = {"lr": first["lr"], "betas": list(first["betas"]), "eps": first["eps"],
              "weight_decay": first["weight_decay"], "adam_w_mode": _decoupled(optimizer)}
    groups = [{"params": list(g["params"]), **{k: (list(g[k]) if k == "betas" else g[k]) for k in _GROUP_KEYS}}
              for g in optimizer.param_groups]
    everything = {id(p) for p in model.parameters() if p.requires_grad}
    if len(groups) == 1 and {id(p) for p in groups[0]["params"]} == everything:
        return {"type": "Adam", "params": params}, None
    return {"type": "Adam", "params": params}, groups
