"""Models with no built-in tensor-parallel plan, written the way users write them, for the derived plans
(Note [derived tensor-parallel plans])."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class FusedQKVAttention(nn.Module):
    """nanoGPT's attention with the heads reshaped by -1 (the head count is not read in forward)."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, merge_by_width: bool = False):
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.n_embd, self.head_dim = n_embd, n_embd // n_head
        self.merge_by_width = merge_by_width  # the nanoGPT merge view(B, T, C), C read from the input
        causal = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("causal", causal.view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.causal[:, :, :T, :T] == 0, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous()
        return self.proj(y.view(B, T, C) if self.merge_by_width else y.view(B, T, -1))


class UserBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, merge_by_width: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = FusedQKVAttention(n_embd, n_head, block_size, merge_by_width)
        self.fc, self.out = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class UserGPT(nn.Module):
    """A user's GPT: fused qkv, tied lm_head, the loss computed inside forward."""

    def __init__(self, vocab: int = 256, n_embd: int = 64, n_head: int = 4, n_layer: int = 2, block_size: int = 32,
                 merge_by_width: bool = False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(UserBlock(n_embd, n_head, block_size, merge_by_width) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1))


def user_gpt(seed: int = 0, **kwargs) -> UserGPT:
    torch.manual_seed(seed)
    return UserGPT(**kwargs)


def mlp(seed: int = 0, width: int = 16, hidden: int = 64, out: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, out))


def bert(seed: int = 0):
    """Hugging Face BERT (an encoder: bidirectional attention, a padding mask, post-norm, an MLM head)."""
    import transformers
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
