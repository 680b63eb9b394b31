"""Whole optimizer states by parameter name (Note [whole optimizer states]) to and from ColossalAI's numbering: the
parameters of the optimizer the script built, group by group, counted from 0 (torch's `state_dict()` numbering), and
the groups' options (lr, betas, eps, weight_decay)."""

from __future__ import annotations

import torch

OPTIONS = ("lr", "betas", "eps", "weight_decay")


def _options(engine_groups: list[dict], index: int, count: int, fallback: dict) -> dict:
    """Client group `index`'s current options: an option every engine group holds alike, else the engine group at
    the same place where the engine keeps as many groups, else the option as the script gave it."""
    out = {}
    for key in OPTIONS:
        values = [g[key] for g in engine_groups if key in g]
        if values and all(v == values[0] for v in values):
            out[key] = values[0]
        elif len(engine_groups) == count and key in engine_groups[index]:
            out[key] = engine_groups[index][key]
        elif key in fallback:
            out[key] = fallback[key]
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def colossalai_states(whole: dict[str, dict[str, torch.Tensor]], optimizer) -> tuple[dict, list[dict]]:
    """(states by id, param groups) of a torch optimizer's state_dict(), from whole states by name."""
    state, groups, next_id = {}, [], 0
    count = len(optimizer.client_groups)
    for index, (names, given) in enumerate(optimizer.client_groups):
        ids = list(range(next_id, next_id + len(names)))
        groups.append({**given, **_options(optimizer.param_groups, index, count, given), "params": ids})
        for pid, name in zip(ids, names):
            if name in whole:  # a parameter the engine does not train has no states
                state[pid] = {k: v.float() if v.dim() == 0 else v for k, v in whole[name].items()}
        next_id += len(names)
    return state, groups


def tiers_states(state: dict, groups: list[dict], optimizer) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
    """(whole states by name, options for each of the engine's param groups) from a ColossalAI optimizer file."""
    names = [name for group_names, _ in optimizer.client_groups for name in group_names]
    saved_ids = [pid for group in groups for pid in group["params"]]
    if len(saved_ids) != len(names):
        raise ValueError(f"load_optimizer: the file's param groups hold {len(saved_ids)} parameters and this optimizer "
                         f"{len(names)}; load a file saved from the same model and optimizer")
    name_of = dict(zip(saved_ids, names))
    whole = {name_of[pid]: {k: v if torch.is_tensor(v) else torch.tensor(float(v)) for k, v in states.items()}
             for pid, states in state.items()}
    engine_groups = optimizer.param_groups
    options = []
    for index in range(len(engine_groups)):
        chosen = {}
        for key in OPTIONS:
            values = [g[key] for g in groups if key in g]
            if len(groups) == len(engine_groups) and key in groups[index]:
                chosen[key] = groups[index][key]
            elif values and all(v == values[0] for v in values):
                chosen[key] = values[0]
            elif values:
                raise ValueError(f"load_optimizer: the file's {len(groups)} param groups hold different {key} values "
                                 f"and this engine groups its parameters into {len(engine_groups)}; save and load "
                                 "with the same optimizer groups, or one value of it")
        options.append({k: tuple(v) if k == "betas" else v for k, v in chosen.items()})
    return whole, options
