"""Attention over a sequence split across ranks equals causal attention over the full sequence in one process, forward
and backward (fp32 1e-5): ring attention (Note [ring attention]: each rank's queries, keys and values passed around
the ring, zigzag layout) and Ulysses (Note [Ulysses attention]: heads split around attention, contiguous layout);
with a sliding window shorter than the sequence (and than a rank's part), and Ulysses with logit softcapping, as
Hugging Face's models compute them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.sequence_parallel import Attending, ring_attention, ulysses_attention, zigzag_positions
from tests.distributed import run_distributed
from tests.reference import FP32_RTOL

B, H, T, D = 2, 4, 24, 8


def full_inputs(kv_heads: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, kv_heads, T, D, generator=g), torch.randn(B, kv_heads, T, D, generator=g)
    return q, k, v, torch.randn(B, H, T, D, generator=g)


def _worker(rank, world, kv_heads, mode, window=None, softcap=None):
    q, k, v, grad = full_inputs(kv_heads)
    if mode == "ring":
        pos = zigzag_positions(T, rank, world)
    else:  # Ulysses, and ring on contiguous parts (its key runs then meet only earlier ranks' queries)
        pos = torch.arange(rank * T // world, (rank + 1) * T // world)
        mode = "ring" if mode == "ring_contiguous" else mode
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    how = Attending(window=window, softcap=softcap)
    out = ring_attention(*mine, pos, None, how) if mode == "ring" else ulysses_attention(*mine, None, how)
    out.backward(grad[:, :, pos])
    return pos, out.detach(), [t.grad for t in mine]


@pytest.mark.parametrize("mode,world,kv_heads", [("ring", 2, H), ("ring", 4, H), ("ring", 2, 2), ("ulysses", 2, H),
                                                 ("ulysses", 4, H), ("ulysses", 4, 2), ("ring_contiguous", 4, H)])
def test_split_sequence_attention_equals_full_causal_attention_forward_and_backward(mode, world, kv_heads):
    q, k, v, grad = full_inputs(kv_heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    q_, k_, v_ = leaves
    repeat = H // kv_heads
    out = F.scaled_dot_product_attention(q_, k_.repeat_interleave(repeat, 1), v_.repeat_interleave(repeat, 1),
                                         is_causal=True)
    out.backward(grad)
    for pos, got, grads in run_distributed(_worker, world, args=(kv_heads, mode), timeout_s=120):
        torch.testing.assert_close(got, out.detach()[:, :, pos], rtol=FP32_RTOL, atol=1e-6)
        for name, g, ref in zip("qkv", grads, leaves):
            torch.testing.assert_close(g, ref.grad[:, :, pos], rtol=FP32_RTOL, atol=1e-6, msg=name)


def eager_reference(q, k, v, window: int | None, softcap: float | None) -> torch.Tensor:
    """Hugging Face's eager attention: scores, softcap, the sliding-window causal mask, softmax."""
    scores = q @ k.transpose(2, 3) * D ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    offset = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    visible = (offset >= 0) & (offset < (window or T))
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("mode,world,window,softcap", [
    ("ring", 2, 5, None), ("ring", 4, 7, None), ("ring", 4, 1, None), ("ring_contiguous", 4, 4, None),
    ("ulysses", 2, 5, None), ("ulysses", 2, None, 2.0), ("ulysses", 4, 7, 2.0)])
def test_a_sliding_window_and_softcapping_equal_the_eager_attention_of_one_process(mode, world, window, softcap):
    """Windows shorter than a rank's part (ring's zigzag chunks are 24 / 2S tokens), one that hides every earlier
    token, and capped logits."""
    q, k, v, grad = full_inputs(2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = eager_reference(leaves[0], *(t.repeat_interleave(H // 2, 1) for t in leaves[1:]), window, softcap)
    out.backward(grad)
    for pos, got, grads in run_distributed(_worker, world, args=(2, mode, window, softcap), timeout_s=120):
        torch.testing.assert_close(got, out.detach()[:, :, pos], rtol=FP32_RTOL, atol=1e-6)
        for name, g, ref in zip("qkv", grads, leaves):
            torch.testing.assert_close(g, ref.grad[:, :, pos], rtol=FP32_RTOL, atol=1e-6, msg=name)


def test_zigzag_gives_every_rank_equal_causal_work_and_refuses_lengths_it_cannot_split():
    work = []
    for rank in range(4):
        pos = zigzag_positions(32, rank, 4)
        work.append(int((pos[:, None] >= torch.arange(32)[None, :]).sum()))
    assert len(set(work)) == 1  # contiguous shards would give 36, 100, 164, 228 visible pairs
    with pytest.raises(ValueError, match="does not divide by 8: pad it to a multiple of 8"):
        zigzag_positions(30, 0, 4)


def _uneven_heads_worker(rank, world):
    q = torch.zeros(1, 3, 4, 2)
    try:
        ulysses_attention(q, q, q, None)
    except ValueError as e:
        return str(e)
    return ""


def test_ulysses_names_the_fix_when_heads_do_not_divide():
    message = run_distributed(_uneven_heads_worker, 2, timeout_s=60)[0]
    assert "2 does not divide 3; use sequence_parallel.mode \"ring\"" in message


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_explicit_fp32_blocks_equal_torchs_flash_kernel_on_every_meeting(layout):
    """Off CPU the ring computes its blocks in explicit fp32; on CPU it calls the flash kernel. Both, on every
    pair of parts of a 4-rank ring, give the same output, log-sum-exp and gradients."""
    from engine.sequence_parallel.ring_attention import KeyBlock, attend_block, block_gradients

    size, part, how = 4, T // 4, Attending(D ** -0.5)
    parts = [zigzag_positions(T, r, size) if layout == "zigzag" else torch.arange(r * part, (r + 1) * part)
             for r in range(size)]
    q, k, v, grad = full_inputs(H)
    for r in range(size):
        for s in range(size):
            args = (q[:, :, parts[r]], parts[r], KeyBlock(k[:, :, parts[s]], v[:, :, parts[s]], parts[s]), how)
            fused, explicit = attend_block(*args, fused=True), attend_block(*args, fused=False)
            torch.testing.assert_close(fused[0], explicit[0], rtol=FP32_RTOL, atol=1e-6)
            torch.testing.assert_close(fused[1], explicit[1], rtol=FP32_RTOL, atol=1e-6)
            final = fused._replace(lse=fused.lse.clamp_min(-1e30))  # rows that see no key of this block: any finite lse
            grads = [block_gradients(*args, grad[:, :, parts[r]], final, fused=f) for f in (True, False)]
            for a, b in zip(*grads):
                torch.testing.assert_close(a, b, rtol=FP32_RTOL, atol=1e-6)


def _explicit_ring_in_one_process(q, k, v, grad, parts, backward_autocast):
    """Every rank's explicit blocks (fused=False) merged and differentiated as RingAttention does, in one process
    (the forward under the caller's autocast, the backward under autocast or not); returns the fp32 output and dQ,
    dK, dV over the whole sequence, before RingAttention rounds them to q's dtype."""
    from engine.sequence_parallel.ring_attention import Attended, KeyBlock, attend_block, block_gradients, merge

    how, blocks = Attending(D ** -0.5), [KeyBlock(k[:, :, p], v[:, :, p], p) for p in parts]
    out, dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32) for t in (q, q, k, v))
    for r, mine in enumerate(parts):
        o = torch.zeros(q[:, :, mine].shape)
        lse = torch.full(o.shape[:-1], float("-inf"))
        for s in [r] + [s for s in range(len(parts)) if s != r]:  # its own block first, as the ring
            o, lse = merge(o, lse, *attend_block(q[:, :, mine], mine, blocks[s], how, fused=False))
        out[:, :, mine] = o
        for theirs, block in zip(parts, blocks):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=backward_autocast):
                dq_b, dk_b, dv_b = block_gradients(q[:, :, mine], mine, block, how, grad[:, :, mine], Attended(o, lse),
                                                   fused=False)
            dq[:, :, mine] += dq_b
            dk[:, :, theirs] += dk_b
            dv[:, :, theirs] += dv_b
    return out, dq, dk, dv


@pytest.mark.parametrize("backward_autocast", [False, True], ids=["backward_outside", "backward_inside"])
def test_the_explicit_blocks_compute_in_fp32_under_bf16_autocast_forward_and_backward(backward_autocast):
    """Off CPU the ring computes its blocks explicitly (on CPU the flash kernel is the default, so fused=False here).
    Under bf16 autocast those blocks must still be fp32 inside (autocast would round the scores to bf16 before the
    softmax, and the log-sum-exp the backward divides by with them; `loss.backward()` may be called inside autocast
    or after it): bf16 inputs give the fp64 answer to fp32 accuracy, and after RingAttention's rounding to bf16, to
    half a bf16 step. (Before the fix: off by up to 3e-2, 300–5000 times that half step.)"""
    size = 2
    parts = [zigzag_positions(T, r, size) for r in range(size)]
    q, k, v, grad = (t.bfloat16() for t in full_inputs(H))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) * D ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    reference = torch.softmax(scores, dim=-1) @ leaves[2]
    reference.backward(grad.double())
    expected = [reference.detach()] + [t.grad for t in leaves]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _explicit_ring_in_one_process(q, k, v, grad, parts, backward_autocast)
    for name, g, ref in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g.double(), ref, rtol=FP32_RTOL, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        # what RingAttention returns, in q's dtype: off by at most bf16's rounding (2^-8 of the value)
        torch.testing.assert_close(g.bfloat16().double(), ref, rtol=2 ** -8, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
