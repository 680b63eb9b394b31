"""ColossalAI's optimizer files: one `optimizer.state_dict()` ({"state": {id: {...}}, "param_groups": [...]}) saved
with torch.save, or sharded into a directory: `pytorch_optim-00001.bin` files each holding {id: {"step", "exp_avg",
"exp_avg_sq"}} (a parameter's states kept together, up to `size_per_shard` MiB a file), the param groups in
`pytorch_optim_group.bin`, and the index `pytorch_optim.bin.index.json` ({"metadata": {"param_groups": file,
"total_size": MiB}, "weight_map": {str(id): file}}). The ids number the parameters of the optimizer the script
built, group by group, as torch does. Rank 0 writes; every rank reads."""

from __future__ import annotations

import json
import os
import re

import torch

from engine.compat.colossalai.booster.checkpoint_io import MiB, _index_in, _remove_stale, _with_prefix

STATES_NAME, STATES_INDEX_NAME, GROUP_FILE_NAME = "pytorch_optim.bin", "pytorch_optim.bin.index.json", \
    "pytorch_optim_group.bin"

StatesById = dict[int, dict[str, torch.Tensor]]


def _size(states: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in states.values() if torch.is_tensor(t)) / MiB


def save_optimizer_file(state: StatesById, param_groups: list[dict], checkpoint: str, shard: bool,
                        size_per_shard: int, prefix: str | None = None) -> None:
    """The states and groups as ColossalAI's optimizer checkpoint IO writes them (called on the rank that writes)."""
    if not shard:
        torch.save({"state": state, "param_groups": param_groups}, checkpoint)
        return
    os.makedirs(checkpoint, exist_ok=True)
    stem, suffix = _with_prefix(STATES_NAME, prefix).rsplit(".", 1)  # pytorch_optim.<prefix>-00001.bin
    shards: list[StatesById] = [{}]
    held = total = 0.0
    for pid, states in state.items():
        size = _size(states)
        if shards[-1] and held + size > size_per_shard:
            shards.append({})
            held = 0.0
        shards[-1][pid] = states
        held, total = held + size, total + size
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"{stem}-{i + 1:05d}.{suffix}"
        torch.save(part, os.path.join(checkpoint, file))
        weight_map.update({str(pid): file for pid in part})
    group_file = _with_prefix(GROUP_FILE_NAME, prefix)
    torch.save(param_groups, os.path.join(checkpoint, group_file))
    index = {"metadata": {"param_groups": group_file, "total_size": total}, "weight_map": weight_map}
    with open(os.path.join(checkpoint, _with_prefix(f"{STATES_NAME}.index.json", prefix)), "w",
              encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2) + "\n")
    _remove_stale(checkpoint, stem, suffix, set(weight_map.values()))


def load_optimizer_file(checkpoint: str) -> tuple[StatesById, list[dict]]:
    """(states by id, param groups) from one file, an index file, or a directory holding one index."""
    index = checkpoint if re.fullmatch(r".*\.index(\..*)?\.json", os.path.basename(checkpoint)) else None
    if index is None and os.path.isdir(checkpoint):
        index = _index_in(checkpoint)
        if index is None:
            raise ValueError(f"{checkpoint}: a directory without an index file (ColossalAI's load_optimizer needs "
                             f"{STATES_INDEX_NAME} in a sharded directory)")
    if index is None:
        whole = torch.load(checkpoint, map_location="cpu", weights_only=False)
        return {int(k): v for k, v in whole["state"].items()}, whole["param_groups"]
    directory = os.path.dirname(index)
    with open(index, encoding="utf-8") as f:
        saved = json.load(f)
    if "param_groups" not in saved.get("metadata", {}):
        raise ValueError(f"{index} is not an optimizer index (its metadata names no param_groups file); pass the "
                         "directory booster.save_optimizer wrote")
    state: StatesById = {}
    for file in sorted(set(saved["weight_map"].values())):
        state.update({int(k): v for k, v in torch.load(os.path.join(directory, file), map_location="cpu",
                                                       weights_only=False).items()})
    groups = torch.load(os.path.join(directory, saved["metadata"]["param_groups"]), map_location="cpu",
                        weights_only=False)
    return state, groups
