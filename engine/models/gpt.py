"""A small, readable GPT language model in the style of nanoGPT.

The model is byte-level by default (``vocab_size=256``) so that it can be
trained on any text without a tokenizer.  It depends on nothing but torch.

Layout (top to bottom)::

    GPTConfig              hyper-parameters
    CausalSelfAttention    fused qkv projection + scaled_dot_product_attention
    MLP                    c_fc (4x) -> GELU -> c_proj
    Block                  x + attn(ln_1(x)); x + mlp(ln_2(x))
    GPT                    embeddings -> blocks -> ln_f -> lm_head
    PRESETS / gpt_from_preset
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig",
    "CausalSelfAttention",
    "MLP",
    "Block",
    "GPT",
    "PRESETS",
    "preset_config",
    "gpt_from_preset",
    "gpt_tiny",
    "gpt_small",
    "gpt_bench30m",
]


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level
    block_size: int = 128  # maximum sequence length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # bias in Linear layers and LayerNorms
    tie_weights: bool = True  # lm_head.weight is wte.weight

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # One fused projection for query, key and value.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # widths from the module, not from x: under tensor parallelism this rank computes n_head / tp
        # heads of n_embd / tp features (engine.tensor_parallel adjusts both)
        B, T, _ = x.shape
        C = self.n_embd
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=None,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        cfg = self.config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.tie_weights()
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``wte.weight``."""
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style initialisation; deterministic under ``torch.manual_seed``.

        Linear/Embedding weights ~ N(0, 0.02), biases zero, LayerNorm weight one,
        and the residual output projections (``c_proj``) ~ N(0, 0.02/sqrt(2*n_layer)).
        """
        std = 0.02
        proj_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head and self.config.tie_weights:
                    continue  # shares wte.weight, initialised with the embedding
                module_std = proj_std if name.endswith("c_proj") else std
                nn.init.normal_(module.weight, mean=0.0, std=module_std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                if module.weight is not None:
                    nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # --------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """Return logits ``[B, T, vocab]``, or the mean cross-entropy loss if ``labels``.

        ``labels`` are next-token targets with the same shape as ``input_ids``
        (already shifted by the caller); positions equal to -100 are ignored.
        ``position_ids`` (default 0 .. T-1) are the tokens' positions, as under
        sequence parallelism, where a rank holds a part of the sequence.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}"
            )
        pos = torch.arange(T, device=input_ids.device) if position_ids is None else position_ids
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = self.lm_head(x)
        if labels is None:
            return logits
        if labels.shape != logits.shape[:-1]:  # (under 2D TP: the ids are a batch block, the logits gathered)
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must match the logits' [batch, seq] {tuple(logits.shape[:-1])}"
            )
        return F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            labels.reshape(-1),
            ignore_index=-100,
        )

    # ----------------------------------------------------------------- utils
    def num_parameters(self) -> int:
        """Number of unique parameters (a tied weight is counted once)."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():  # parameters() already de-duplicates; be explicit
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
        return total


# --------------------------------------------------------------------- presets
PRESETS: dict[str, dict] = {
    # For unit tests: fast on CPU.
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=32),
    # The GPTConfig defaults.
    "small": dict(),
    # ~29.9M parameters with vocab 256 (head_dim 64); for benchmarks.
    "bench30m": dict(n_layer=6, n_head=10, n_embd=640, block_size=256),
}


def preset_config(name: str, **overrides) -> GPTConfig:
    """The GPTConfig of preset ``name`` with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose from {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown GPTConfig field(s) {unknown}; valid: {sorted(fields)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


def gpt_from_preset(name: str, **overrides) -> GPT:
    """Build a GPT from a named preset ("tiny", "small", "bench30m")."""
    return GPT(preset_config(name, **overrides))


# No-argument factories, for tools that take a model as `module:factory`
# (`tiers estimate --model engine.models:gpt_small`).
def gpt_tiny() -> GPT:
    return gpt_from_preset("tiny")


def gpt_small() -> GPT:
    return gpt_from_preset("small")


def gpt_bench30m() -> GPT:
    return gpt_from_preset("bench30m")
