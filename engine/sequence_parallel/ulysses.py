"""Ulysses sequence parallelism: attention heads, not the sequence, are split across ranks around attention.

Note [Ulysses attention]
Each of S ranks holds a contiguous 1/S of the sequence for every head. An all-to-all turns that into
the whole sequence for 1/S of the heads; attention runs locally (causal, over the full sequence, the
device's own scaled_dot_product_attention); a second all-to-all turns the output back into the
sequence split. Each all-to-all moves (S-1)/S of a rank's q, k, v or output, so the bytes per link
stay O(T/S) as S grows (DeepSpeed-Ulysses). Heads must divide by S; keys and values with fewer heads
than that (GQA) are repeated up to the query heads first, so they split like the queries. The
backward of an all-to-all is the opposite all-to-all.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.comm import CommCounter


def _all_to_all(x: torch.Tensor, group, counter: CommCounter | None) -> torch.Tensor:
    """x's first dimension, one slice per rank of `group`, exchanged: slice j goes to rank j, and slice j of the
    result is what rank j sent."""
    x = x.contiguous()
    if counter is not None:
        counter.all_to_all_bytes += x.numel() * x.element_size()
    out = torch.empty_like(x)  # (after contiguous: empty_like keeps a permuted tensor's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """sequence_to_heads (to_heads) or heads_to_sequence; the backward of either is the other."""

    @staticmethod
    def forward(ctx, x, group, size, counter, to_heads: bool):
        ctx.group, ctx.size, ctx.counter, ctx.to_heads = group, size, counter, to_heads
        return (sequence_to_heads if to_heads else heads_to_sequence)(x, group, size, counter)

    @staticmethod
    def backward(ctx, grad):
        back = heads_to_sequence if ctx.to_heads else sequence_to_heads
        return back(grad, ctx.group, ctx.size, ctx.counter), None, None, None, None


def sequence_to_heads(x: torch.Tensor, group, size: int, counter: CommCounter | None = None) -> torch.Tensor:
    """[B, H, T/S, D] (a sequence slice, every head) -> [B, H/S, T, D] (every position, a slice of the heads)."""
    b, h, t, d = x.shape
    parts = x.reshape(b, size, h // size, t, d).permute(1, 0, 2, 3, 4)  # [S (to), B, H/S, T/S, D]
    received = _all_to_all(parts, group, counter)  # [S (from: its sequence slice), B, H/S, T/S, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def heads_to_sequence(x: torch.Tensor, group, size: int, counter: CommCounter | None = None) -> torch.Tensor:
    """The inverse of sequence_to_heads."""
    b, h_part, t_all, d = x.shape
    t = t_all // size
    parts = x.reshape(b, h_part, size, t, d).permute(2, 0, 1, 3, 4)  # [S (to: its sequence slice), B, H/S, T/S, D]
    received = _all_to_all(parts, group, counter)  # [S (from: its head slice), B, H/S, T/S, D]
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * h_part, t, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                      scale: float | None = None, is_causal: bool = True,
                      counter: CommCounter | None = None) -> torch.Tensor:
    """Attention over the whole sequence for this rank's contiguous slice of it ([B, H, T/S, D] each), heads split
    over the ranks of `group` around it (Note [Ulysses attention]); counter: where all-to-all bytes are counted."""
    size = dist.get_world_size(group)
    heads = q.shape[1]
    if heads % size:
        raise ValueError(f"Ulysses splits the {heads} attention heads over {size} sequence-parallel ranks, and {size} "
                         f"does not divide {heads}; use sequence_parallel.mode \"ring\", or a size dividing {heads}")
    if k.shape[1] != heads:  # GQA: repeat the key/value heads up to the query heads, so they split alike
        if heads % k.shape[1]:
            raise ValueError(f"{heads} query heads do not divide into {k.shape[1]} key/value heads")
        k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (_Exchange.apply(t, group, size, counter, True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    return _Exchange.apply(out, group, size, counter, False)
