"""Cross-entropy over logits whose vocabulary is split across the tensor-parallel ranks.

Each rank holds logits[..., start:end] (a column-parallel lm_head without gather_output). The
full logits are never built: the ranks all-reduce, per token, the maximum (for a stable softmax),
the sum of exponentials and the target's logit (from the rank whose range holds the target), three
numbers per token instead of V/tp. The gradient is computed locally: softmax minus the one-hot
target, on this rank's slice.
"""

from __future__ import annotations

import torch

from engine.comm import all_reduce_max, all_reduce_sum
from engine.tensor_parallel.mappings import TPGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, ignore_index):
        width = logits.shape[-1]
        start = tp.rank * width
        ctx.dtype = logits.dtype
        logits = logits.float()
        top = logits.max(dim=-1).values
        all_reduce_max(top, tp.group, tp.counter)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        mine = (target >= start) & (target < start + width)
        local = (target - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        both = torch.stack([sum_exp, picked])  # one all-reduce for the two sums
        all_reduce_sum(both, tp.group, tp.counter, async_op=False)
        sum_exp, picked = both[0], both[1]
        valid = target != ignore_index
        count = valid.sum().clamp(min=1)
        losses = (sum_exp.log() - picked).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine & valid, valid, count)
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, local, hit, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.to(g.dtype).unsqueeze(-1))
        g.mul_((valid.to(g.dtype) / count * grad).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TPGroup,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `target` ([N...] token ids over the whole vocabulary) under `logits` ([N..., V/tp],
    this rank's slice of the vocabulary, rank r holding [r·V/tp, (r+1)·V/tp)); targets equal to
    ignore_index are left out of the mean. The same value on every tp rank."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: the logits must have one "
                         "more (vocabulary) dimension than the target")
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), tp, ignore_index)
