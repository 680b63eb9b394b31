"""ColossalAI's model files: a state dict in one file (torch.save, or safetensors), or sharded into a directory of
`pytorch_model-00001.bin` / `model-00001.safetensors` files with ColossalAI's index (`pytorch_model.bin.index.json`
/ `model.safetensors.index.json`: {"metadata": {"total_size": MiB}, "weight_map": {name: file}}); shards hold whole
tensors up to `size_per_shard` MiB (a larger tensor gets a shard of its own). Rank 0 writes; every rank reads."""

from __future__ import annotations

import json
import os
import re

import torch

WEIGHTS_NAME, SAFE_WEIGHTS_NAME = "pytorch_model.bin", "model.safetensors"
MiB = 1024 * 1024


def _shards(state: dict[str, torch.Tensor], size_per_shard: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    held = 0.0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size() / MiB
        if shards[-1] and held + size > size_per_shard:
            shards.append({})
            held = 0.0
        shards[-1][name] = tensor
        held += size
    return shards


def _write(state: dict, path: str, safetensors: bool) -> None:
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(state, path)


def _with_prefix(name: str, prefix: str | None) -> str:
    """ColossalAI's add_prefix: the prefix before the name's last suffix (pytorch_model.<p>.bin)."""
    if not prefix:
        return name
    head, dot, tail = name.rpartition(".")
    return f"{head}.{prefix}{dot}{tail}"


def save_state_dict(state: dict[str, torch.Tensor], checkpoint: str, shard: bool, size_per_shard: int,
                    use_safetensors: bool, prefix: str | None = None) -> None:
    """`state` as ColossalAI's GeneralCheckpointIO writes it (called on the rank that writes)."""
    if not shard:
        if use_safetensors and not checkpoint.endswith(".safetensors"):
            raise ValueError(f"save_model(use_safetensors=True) writes a .safetensors file; {checkpoint!r} is not one")
        _write(state, checkpoint, use_safetensors)
        return
    os.makedirs(checkpoint, exist_ok=True)
    base = SAFE_WEIGHTS_NAME if use_safetensors else WEIGHTS_NAME
    stem, suffix = _with_prefix(base, prefix).rsplit(".", 1)  # pytorch_model.<prefix>-00001.bin, as ColossalAI
    weight_map, total = {}, 0.0
    for i, part in enumerate(_shards(state, size_per_shard)):
        file = f"{stem}-{i + 1:05d}.{suffix}"
        _write(part, os.path.join(checkpoint, file), use_safetensors)
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.numel() * t.element_size() for t in part.values()) / MiB
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(checkpoint, _with_prefix(f"{base}.index.json", prefix)), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2) + "\n")
    _remove_stale(checkpoint, stem, suffix, set(weight_map.values()))


def _remove_stale(directory: str, stem: str, suffix: str, written: set[str]) -> None:
    """Shards of an earlier, larger save into the same directory (ColossalAI's clean_folder does the same)."""
    pattern = re.compile(re.escape(stem) + r"-\d{5}\." + re.escape(suffix))
    for name in os.listdir(directory):
        if pattern.fullmatch(name) and name not in written:
            os.remove(os.path.join(directory, name))


def _read(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _index_in(directory: str) -> str | None:
    found = [f for f in os.listdir(directory) if re.fullmatch(r".*\.index(\..*)?\.json", f)]
    if len(found) > 1:
        raise ValueError(f"{directory} holds {len(found)} index files ({', '.join(sorted(found))}); ColossalAI's "
                         "loader takes a directory with one: save the model and the optimizer to separate directories")
    return os.path.join(directory, found[0]) if found else None


def load_state_dict(checkpoint: str) -> dict[str, torch.Tensor]:
    """A state dict from a file, an index file, or a directory holding one index (or model.safetensors /
    pytorch_model.bin), as ColossalAI's CheckpointIO finds it."""
    index = checkpoint if re.fullmatch(r".*\.index(\..*)?\.json", os.path.basename(checkpoint)) else None
    if index is None and os.path.isdir(checkpoint):
        index = _index_in(checkpoint)
        if index is None:
            whole = [os.path.join(checkpoint, n) for n in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME)]
            found = next((p for p in whole if os.path.exists(p)), None)
            if found is None:
                raise FileNotFoundError(f"{checkpoint}: no index file, {SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME}")
            return _read(found)
    if index is None:
        return _read(checkpoint)
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(weight_map.values())):
        state.update(_read(os.path.join(os.path.dirname(index), file)))
    return state
