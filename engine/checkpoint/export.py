"""Whole-model exports: `tiers convert` (a checkpoint to one fp32 state dict) and engine.save_16bit_model.

Note [consolidating a checkpoint]
`tiers convert CKPT OUT` writes the model's state dict — every key of `module.state_dict()` (the
unsplit model's under a pipeline; split into files in the model's order), with whole
(tensor-parallel pieces joined, pipeline stages merged) values, fp32 for parameters — as safetensors:
OUT/model.safetensors, or with --max-shard-size OUT/model-0000k-of-0000n.safetensors plus
model.safetensors.index.json (Hugging Face's layout, so `from_pretrained` can read it). It streams:
one parameter is read at a time (memory-mapped slices of the rank files), and values are kept
only until the output piece they belong to is written, so memory holds at most one output piece
and one parameter. Tied weights are written under each key (safetensors stores no aliases). An adapter-only
checkpoint (saved with exclude_frozen_parameters) holds no whole model and is refused.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from engine.checkpoint.files import CheckpointError, fsync_path, write_error, write_text
from engine.checkpoint.reader import Checkpoint, PieceReader, read_latest

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def resolve(path: str, tag: str | None) -> str:
    """A checkpoint directory: `path` itself when it holds a manifest, else path/tag or path/<latest>."""
    if tag is None and os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    tag = tag or read_latest(path)
    if tag is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor a directory with a 'latest' file; pass the "
                              "checkpoint's own directory, or --tag")
    return os.path.join(path, tag)


def consolidate(checkpoint_dir: str, out_dir: str, max_shard_bytes: int | None = None) -> list[str]:
    """Note [consolidating a checkpoint]; returns the files written (names in out_dir)."""
    checkpoint = Checkpoint(checkpoint_dir)
    if checkpoint.excluded_frozen:
        raise CheckpointError(f"{checkpoint_dir} was saved with exclude_frozen_parameters: it holds no frozen "
                              f"parameter ({len(checkpoint.excluded_frozen)} left out, e.g. "
                              f"{sorted(checkpoint.excluded_frozen)[0]!r}), so it is no whole model to convert; save "
                              "one with save_checkpoint(...) or take the adapters from "
                              "engine.full_state_dict(trainable_only=True)")
    reader = PieceReader(checkpoint)
    manifest = checkpoint.manifest
    aliases = manifest["aliases"]
    os.makedirs(out_dir, exist_ok=True)
    pieces: list[list[str]] = []  # keys per output file
    written: list[str] = []
    piece: dict[str, torch.Tensor] = {}
    piece_bytes = 0
    total = 0

    def flush() -> None:
        nonlocal piece, piece_bytes
        if piece:
            name = f".part-{len(written):05d}.safetensors"
            _write(out_dir, name, piece)
            written.append(name)
            pieces.append(list(piece))
        piece, piece_bytes = {}, 0

    for key in manifest["state_dict_keys"]:
        source = aliases.get(key, key)
        value = reader.whole(source, "param") if checkpoint.has_param(source) else reader.whole_extra(source)
        nbytes = value.numel() * value.element_size()
        if max_shard_bytes is not None and piece and piece_bytes + nbytes > max_shard_bytes:
            flush()
        piece[key] = value.contiguous()
        piece_bytes += nbytes
        total += nbytes
    flush()
    reader.close()
    names = [SINGLE] if len(written) == 1 else [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
                                                for i in range(len(written))]
    try:
        for tmp, name in zip(written, names):
            os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, name))
        if len(names) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {key: name for name, keys in zip(names, pieces) for key in keys}}
            write_text(os.path.join(out_dir, INDEX), json.dumps(index, indent=2) + "\n")
        fsync_path(out_dir)
    except OSError as e:
        raise write_error(out_dir, e) from e
    return names


def write_state_dict(out_dir: str, name: str, state: dict[str, torch.Tensor]) -> str:
    """One safetensors file written atomically (a temporary name renamed); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = f".{name}.tmp"
    _write(out_dir, tmp, state)
    path = os.path.join(out_dir, name)
    try:
        os.replace(os.path.join(out_dir, tmp), path)
        fsync_path(out_dir)
    except OSError as e:
        raise write_error(path, e) from e
    return path


def _write(out_dir: str, name: str, tensors: dict[str, torch.Tensor]) -> None:
    path = os.path.join(out_dir, name)
    try:
        # a tied weight appears under two keys: safetensors stores no aliases, so each key gets its own copy
        seen: set[int] = set()
        unique = {}
        for key, t in tensors.items():
            ptr = t.untyped_storage().data_ptr()
            unique[key] = t.clone() if ptr in seen else t.contiguous()
            seen.add(ptr)
        save_file(unique, path, metadata={"format": "pt"})
        fsync_path(path)
    except OSError as e:
        _remove(path)
        raise write_error(path, e) from e


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
