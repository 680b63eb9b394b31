"""Ulysses sequence parallelism: attention heads, not the sequence, are split across ranks around attention.

Note [Ulysses attention]
Each of S ranks holds a contiguous 1/S of the sequence for every head. An all-to-all turns that into
the whole sequence for 1/S of the heads; attention runs locally (causal, over the full sequence, the
device's own scaled_dot_product_attention, or the same math written out where a layer caps its logits;
a sliding window hides keys `window` or more positions back); a second all-to-all turns the output back into the
sequence split. q, k and v travel in one all-to-all (one synchronization instead of three). Each
all-to-all moves (S-1)/S of what a rank sends, so the bytes per link stay O(T/S) as S grows
(DeepSpeed-Ulysses). Heads must divide by S; keys and values with fewer heads
than that (GQA) are repeated up to the query heads first, so they split like the queries. The
backward of an all-to-all is the opposite all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.comm import CommCounter
from engine.sequence_parallel.attending import Attending


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
    """sequence_to_heads (to_heads) or heads_to_sequence of several tensors in one all-to-all; the backward of
    either is the other."""

    @staticmethod
    def forward(ctx, group, size, counter, to_heads: bool, *xs):
        ctx.group, ctx.size, ctx.counter, ctx.to_heads = group, size, counter, to_heads
        return tuple((sequence_to_heads if to_heads else heads_to_sequence)(list(xs), group, size, counter))

    @staticmethod
    def backward(ctx, *grads):
        back = heads_to_sequence if ctx.to_heads else sequence_to_heads
        return (None, None, None, None, *back(list(grads), ctx.group, ctx.size, ctx.counter))


def sequence_to_heads(xs: list[torch.Tensor], group, size: int,
                      counter: CommCounter | None = None) -> list[torch.Tensor]:
    """Each [B, H, T/S, D] (a sequence slice, every head) -> [B, H/S, T, D] (every position, a slice of the heads),
    all of them in one all-to-all."""
    b, h, t, d = xs[0].shape
    parts = torch.stack([x.reshape(b, size, h // size, t, d).permute(1, 0, 2, 3, 4) for x in xs],
                        dim=1)  # [S (to), n, B, H/S, T/S, D]
    received = _all_to_all(parts, group, counter)  # [S (from: its sequence slice), n, B, H/S, T/S, D]
    return [received[:, i].permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d) for i in range(len(xs))]


def heads_to_sequence(xs: list[torch.Tensor], group, size: int,
                      counter: CommCounter | None = None) -> list[torch.Tensor]:
    """The inverse of sequence_to_heads."""
    b, h_part, t_all, d = xs[0].shape
    t = t_all // size
    parts = torch.stack([x.reshape(b, h_part, size, t, d).permute(2, 0, 1, 3, 4) for x in xs],
                        dim=1)  # [S (to: its sequence slice), n, B, H/S, T/S, D]
    received = _all_to_all(parts, group, counter)  # [S (from: its head slice), n, B, H/S, T/S, D]
    return [received[:, i].permute(1, 0, 2, 3, 4).reshape(b, size * h_part, t, d) for i in range(len(xs))]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: Attending) -> torch.Tensor:
    """Causal attention over whole sequences ([B, H, T, D], positions 0..T-1), with `how`'s window, softcap and
    scale (set)."""
    length, scale, window, softcap = q.shape[2], how.scale, how.window, how.softcap
    banded = window is not None and window < length
    if softcap is None and not banded:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    positions = torch.arange(length, device=q.device)
    offset = positions[:, None] - positions[None, :]
    visible = (offset >= 0) & (offset < window) if banded else offset >= 0
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                      how: Attending | None = None, counter: CommCounter | None = None) -> torch.Tensor:
    """Attention over the whole sequence for this rank's contiguous slice of it ([B, H, T/S, D] each), heads split
    over the ranks of `group` around it (Note [Ulysses attention]); how: causal or not, its window, softcap and
    scale (default: causal, none, 1/sqrt of the head size); counter: where all-to-all bytes are counted."""
    how = Attending() if how is None else how
    size = dist.get_world_size(group)
    heads = q.shape[1]
    if heads % size:
        raise ValueError(f"Ulysses splits the {heads} attention heads over {size} sequence-parallel ranks, and {size} "
                         f"does not divide {heads}; use sequence_parallel.mode \"ring\", or a size dividing {heads}")
    if k.shape[1] != heads:  # GQA: repeat the key/value heads up to the query heads, so they split alike
        if heads % k.shape[1]:
            raise ValueError(f"{heads} query heads do not divide into {k.shape[1]} key/value heads")
        k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    how = how.scaled_for(q.shape[-1])
    if q.shape == k.shape == v.shape:  # one all-to-all for the three
        q, k, v = _Exchange.apply(group, size, counter, True, q, k, v)
    else:  # e.g. a value head size other than the query's
        q, k, v = (_Exchange.apply(group, size, counter, True, t)[0] for t in (q, k, v))
    if how.causal:
        out = causal_attention(q, k, v, how)
    elif how.window is None and how.softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, scale=how.scale)
    else:
        raise ValueError("Ulysses attention with a sliding window or softcapping is causal only")
    return _Exchange.apply(group, size, counter, False, out)[0]
