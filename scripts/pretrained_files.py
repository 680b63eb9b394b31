"""Random Llama-shaped checkpoints on disk, written as transformers writes them (config.json, bf16 safetensors
shards and model.safetensors.index.json), for the benchmarks that load pretrained weights without downloading any.

The values are sensible for training: weights ~ N(0, 0.02), norms 1 (each weight a window of one pool of 16 M
normal draws at a random offset: drawing 7 B normals one by one takes about 5 minutes here). No model is built:
the shapes come from a meta-device model, and one shard's tensors are in memory at a time.
"""

from __future__ import annotations

import json
import os
import time

import torch
import transformers
from safetensors.torch import save_file

PRESETS = {  # Llama-shaped: hidden, intermediate, layers, heads, key/value heads (32 k vocabulary)
    "tiny": (64, 160, 2, 4, 2),
    "1b": (2048, 5632, 22, 32, 4),  # TinyLlama 1.1 B
    "7b": (4096, 11008, 32, 32, 32),  # Llama 2 7 B
}


POOL = 1 << 24


def llama_config(preset: str, vocab: int = 32000) -> transformers.LlamaConfig:
    hidden, intermediate, layers, heads, kv_heads = PRESETS[preset]
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                    num_hidden_layers=layers, num_attention_heads=heads,
                                    num_key_value_heads=kv_heads, max_position_embeddings=4096,
                                    tie_word_embeddings=False, dtype="bfloat16")


def tensor_shapes(config: transformers.LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The state dict's keys and shapes, from a model on the meta device (a tied weight once)."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    seen, shapes = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            shapes[name] = tuple(t.shape)
    return shapes


def write_random_llama(directory: str, config: transformers.LlamaConfig, shard_bytes: int = 2 << 30,
                       seed: int = 0) -> int:
    """Writes the checkpoint into `directory` unless it is there already (same config); returns its tensor bytes."""
    shapes = tensor_shapes(config)
    total = sum(2 * _numel(s) for s in shapes.values())
    index_path = os.path.join(directory, "model.safetensors.index.json")
    config_path = os.path.join(directory, "config.json")
    if os.path.exists(index_path) and os.path.exists(config_path):
        with open(config_path) as f:
            if transformers.LlamaConfig(**json.load(f)).to_dict() == config.to_dict():
                return total
    os.makedirs(directory, exist_ok=True)
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        if current and size + 2 * _numel(shape) > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += 2 * _numel(shape)
    groups.append(current)
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=generator) * 0.02).to(torch.bfloat16)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _random(n, shapes[n], pool, generator) for n in names}
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        del tensors
    with open(index_path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config.save_pretrained(directory)
    return total


def prepared_checkpoint(root: str, preset: str) -> tuple[str, int]:
    """The preset's checkpoint under `root` (written unless there already) and its tensor bytes; says how long the
    writing took."""
    path = os.path.join(root, f"llama-{preset}-bf16")
    started = time.perf_counter()
    nbytes = write_random_llama(path, llama_config(preset))
    print(f"checkpoint {path}: {nbytes / 1e9:.2f} GB of bf16 tensors ({time.perf_counter() - started:.0f} s)",
          flush=True)
    return path, nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _random(name: str, shape: tuple[int, ...], pool: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    out = torch.empty(_numel(shape), dtype=torch.bfloat16)
    done = 0
    while done < out.numel():  # windows of the pool at random offsets
        start = int(torch.randint(0, POOL // 2, (1,), generator=generator))
        n = min(out.numel() - done, POOL - start)
        out[done:done + n] = pool[start:start + n]
        done += n
    return out.view(shape)
