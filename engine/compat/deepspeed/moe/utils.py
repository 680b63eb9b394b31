"""deepspeed.moe.utils: expert parameters in param groups of their own, as DeepSpeed builds them for its
optimizers (Tiers reduces and shards expert chunks over their group whatever the groups, Note [expert
parallelism]; the groups keep their options)."""

from __future__ import annotations

from torch import nn


def is_moe_param(param: nn.Parameter) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size: int = 178956971) -> list:
    """Each group's expert parameters moved to a group per expert group name, with the group's options and
    `moe: True`, `name: <group name>` (at most max_group_size elements each), after the groups they came from.
    Every group needs a `name`, as in DeepSpeed."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups must be a dict, a list or a tuple of dicts, got {type(param_groups).__name__}")
    moe_groups: list[dict] = []
    for group in param_groups:
        params = list(group["params"])
        by_name: dict[str, list[nn.Parameter]] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name, members in by_name.items():
            moe_groups.extend(_bounded({**group, "name": name, "moe": True}, members, max_group_size))
    param_groups.extend(moe_groups)
    return param_groups


def _bounded(options: dict, params: list[nn.Parameter], max_numel: int) -> list[dict]:
    groups, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > max_numel:
            groups.append({**options, "params": current})
            current, size = [], 0
        current.append(p)
        size += p.numel()
    return groups + ([{**options, "params": current}] if current else [])
