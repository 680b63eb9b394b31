"""Ring attention (context parallelism) on any device, CPU included: each rank keeps its queries, and the keys and
values of every rank pass around the ring of sequence-parallel ranks, one block per step.

Note [ring attention]
The sequence is split over S ranks in 2S chunks, zigzag: rank r holds chunks r and 2S-1-r, so that
under a causal mask every rank has the same work (contiguous shards leave the last rank 2S-1 times the
first's). Attention is computed from the tokens' global positions, so any layout works; zigzag is
what `zigzag_positions` gives. Forward: for S steps each rank attends its queries to the block of
keys and values it holds (its own first), keeps each block's output and log-sum-exp, and merges them
in fp32 (out = Σ out_b · exp(lse_b − lse)); meanwhile (asynchronously) the next block travels. Within
a block, queries and keys are cut in pieces (each zigzag chunk is one), and a piece of queries meets
only the pieces of keys it may see: a pair the mask hides whole is never computed, a pair wholly
visible runs torch's CPU flash-attention kernel without a mask and a piece against itself with its
causal mask (the kernel returns the log-sum-exp the merges need); under zigzag every rank then
computes 2S + 1 chunk pairs per layer (contiguous parts: 4r + 3 for rank r). Other overlaps, and
other devices, are computed in explicit fp32, with autocast off inside the blocks: under bf16/fp16
autocast its matmuls would round the scores before the softmax, and the forward's log-sum-exp would
disagree with the backward's recomputed scores. The output and gradients return in q's dtype.
Backward is exact, as flash attention's: with the final output O and log-sum-exp L kept, each
block's probabilities are recomputed as exp(q·kᵀ·scale − L), dV_b = Pᵀ·dO,
dS = P ⊙ (dO·Vᵀ − rowsum(dO ⊙ O)), dQ += dS·K·scale, dK_b = dSᵀ·Q·scale (on CPU the flash
kernel's backward, given O and L, computes the same); the blocks travel the ring again, each
carrying the dK and dV summed so far, and after S steps one more hop brings them home to the rank
that owns that block.
A sliding window (a key `window` or more positions before its query hidden too) only hides more pairs: a piece
pair wholly outside it is skipped, one wholly inside it is computed as before, and the rest are masked by position.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.comm import CommCounter
from engine.sequence_parallel.attending import Attending


def zigzag_positions(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` of `size` holds under the zigzag split of `seq_len`."""
    if seq_len % (2 * size):
        raise ValueError(f"ring attention splits the sequence into 2 × {size} equal chunks; a sequence of {seq_len} "
                         f"tokens does not divide by {2 * size}: pad it to a multiple of {2 * size}")
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


@dataclass(frozen=True)
class KeyBlock:
    """A block of keys and values ([B, H, T_b, D]) with the global position of each of its tokens."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor

    def __getitem__(self, keys: slice) -> KeyBlock:
        return KeyBlock(self.k[..., keys, :], self.v[..., keys, :], self.positions[keys])


class Attended(NamedTuple):
    """fp32 output of queries over some keys and its log-sum-exp (rows that saw no key: output 0, lse -inf)."""

    out: torch.Tensor
    lse: torch.Tensor


class _Ring:
    """Passing a block to the next rank of the sequence-parallel group while receiving one from the previous."""

    def __init__(self, group: dist.ProcessGroup | None, counter: CommCounter | None):
        self.group, self.counter = group, counter
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def start(self, tensors: list[torch.Tensor]) -> "_InFlight":
        """Starts sending `tensors` to the next rank and receiving the previous rank's; wait() gives those."""
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        if self.counter is not None:
            self.counter.p2p_bytes += sum(t.numel() * t.element_size() for t in tensors)
        sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return _InFlight(dist.batch_isend_irecv(ops), sent, received)

    def shift(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sends `tensors` to the next rank; returns the previous rank's."""
        return self.start(tensors).wait()


class _InFlight:
    def __init__(self, works, sent, received):
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.sent = None
        return self.received


def _without_autocast(device: torch.device):
    """The block math's fp32 as written: autocast would run its matmuls in bf16/fp16, rounding the scores before
    the softmax and the log-sum-exp the backward recomputes them against (Note [ring attention])."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _block_scores(q, k, q_pos, k_pos, scale, window: int | None = None):
    """fp32 scores of queries against keys, -inf where the causal mask (and the sliding window) hides a key."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    offset = q_pos[:, None] - k_pos[None, :]
    hidden = offset < 0 if window is None else (offset < 0) | (offset >= window)
    return scores.masked_fill(hidden, float("-inf"))


class Meeting(enum.Enum):
    """How a piece of queries meets a piece of keys under the causal mask."""
    ALL = "every key visible to every query"  # the keys come wholly before the queries
    DIAGONAL = "the same positions: causal"
    PARTIAL = "any other overlap: masked by position"


def _pieces(positions: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(start, end, first position, last position) of each run of consecutive positions, cut in pieces of at most
    half the part (a zigzag part's two chunks; a contiguous part's halves)."""
    values = positions.tolist()
    longest = max(1, len(values) // 2)
    starts = [0] + [i for i in range(1, len(values)) if values[i] != values[i - 1] + 1 or i % longest == 0]
    return [(a, b, values[a], values[b - 1]) for a, b in zip(starts, starts[1:] + [len(values)])]


def _meetings(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None):
    """(query slice, key slice, Meeting) of every piece of queries and piece of keys the mask lets meet; a key
    piece wholly after a query piece, or wholly `window` or more positions before it, is skipped."""
    k_pieces = _pieces(k_pos)
    for qa, qb, q_first, q_last in _pieces(q_pos):
        for ka, kb, k_first, k_last in k_pieces:
            if k_first > q_last or (window is not None and q_first - k_last >= window):
                continue
            inside = window is None or q_last - k_first < window
            if k_last <= q_first and inside:
                kind = Meeting.ALL
            elif (k_first, k_last) == (q_first, q_last) and inside:
                kind = Meeting.DIAGONAL
            else:
                kind = Meeting.PARTIAL
            yield slice(qa, qb), slice(ka, kb), kind


def _fused_kernel(q) -> bool:
    """torch's CPU flash-attention kernel returns the log-sum-exp a ring needs; elsewhere the blocks are computed
    in explicit fp32 (CUDA's kernels take other arguments; the explicit path is checked against the kernel on CPU)."""
    return q.device.type == "cpu"


def _meet(q, q_pos, block: KeyBlock, kind: Meeting, how: Attending, fused: bool) -> Attended:
    """Queries against a piece of keys they meet as `kind` says."""
    if kind is not Meeting.PARTIAL and fused:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, block.k, block.v, 0.0, kind is Meeting.DIAGONAL, scale=how.scale)
        return Attended(out.float(), lse.float())
    scores = _block_scores(q, block.k, q_pos, block.positions, how.scale, how.window)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return Attended(torch.matmul(probs, block.v.float()), lse)


def merge(out, lse, out_b, lse_b) -> Attended:
    """Two partial attentions of the same queries over disjoint keys, merged in fp32 by their log-sum-exps."""
    merged = torch.logaddexp(lse, lse_b)
    keep = torch.exp(lse - merged).nan_to_num(0.0).unsqueeze(-1)
    take = torch.exp(lse_b - merged).nan_to_num(0.0).unsqueeze(-1)
    return Attended(out * keep + out_b * take, merged)


def attend_block(q, q_pos, block: KeyBlock, how: Attending, fused: bool | None = None) -> Attended:
    """Queries `q` (global positions `q_pos`) against one block of keys and values, computed only where pieces of
    queries and keys meet under the causal mask (and `how`'s sliding window; `how.scale` set); `fused`: by torch's
    kernel (default: where it runs)."""
    fused = _fused_kernel(q) if fused is None else fused
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    with _without_autocast(q.device):
        for rows, keys, kind in _meetings(q_pos, block.positions, how.window):
            met = _meet(q[..., rows, :], q_pos[rows], block[keys], kind, how, fused)
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], *met)
    return Attended(out, lse)


def block_gradients(q, q_pos, block: KeyBlock, how: Attending, grad_out, final: Attended, fused: bool | None = None):
    """This block's share of dQ and its dK, dV (fp32), from the final output and log-sum-exp over every block (as
    flash attention's backward: P = exp(q·kᵀ·scale − lse)), over the same meetings as attend_block."""
    fused = _fused_kernel(q) if fused is None else fused
    out, lse, scale = final.out, final.lse, how.scale
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(block.k.shape, dtype=torch.float32, device=block.k.device)
    dv = torch.zeros(block.v.shape, dtype=torch.float32, device=block.v.device)
    with _without_autocast(q.device):  # the same fp32 as the forward, inside autocast or not
        for rows, keys, kind in _meetings(q_pos, block.positions, how.window):
            q_r, piece, go = q[..., rows, :], block[keys], grad_out[..., rows, :]
            k_r, v_r = piece.k, piece.v
            if kind is not Meeting.PARTIAL and fused:
                grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    go.to(q.dtype), q_r, k_r, v_r, out[..., rows, :].to(q.dtype), lse[..., rows], 0.0,
                    kind is Meeting.DIAGONAL, scale=scale)
                dq_m, dk_m, dv_m = (g.float() for g in grads)
            else:
                q_r, k_r, v_r, go = q_r.float(), k_r.float(), v_r.float(), go.float()
                probs = torch.exp(_block_scores(q_r, k_r, q_pos[rows], piece.positions, scale, how.window)
                                  - lse[..., rows].unsqueeze(-1)).nan_to_num(0.0)
                dv_m = torch.matmul(probs.transpose(-1, -2), go)
                delta = (go * out[..., rows, :]).sum(-1, keepdim=True)
                dscores = probs * (torch.matmul(go, v_r.transpose(-1, -2)) - delta)
                dq_m, dk_m = torch.matmul(dscores, k_r) * scale, torch.matmul(dscores.transpose(-1, -2), q_r) * scale
            dq[..., rows, :] += dq_m
            dk[..., keys, :] += dk_m
            dv[..., keys, :] += dv_m
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's q over every rank's k, v (Note [ring attention]); [B, H, T_local, D]."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group, how: Attending, counter):
        ring = _Ring(group, counter)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        block = [k, v, positions]
        for step in range(ring.size):
            if step + 1 < ring.size:  # the next block travels while this one is computed
                following = ring.start(block)
            out, lse = merge(out, lse, *attend_block(q, positions, KeyBlock(*block), how))
            if step + 1 < ring.size:
                block = following.wait()
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.group, ctx.how, ctx.counter = group, how, counter
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, positions, out, lse = ctx.saved_tensors
        ring, final = _Ring(ctx.group, ctx.counter), Attended(out, lse)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.zeros(k.shape, dtype=torch.float32, device=k.device), torch.zeros(
            v.shape, dtype=torch.float32, device=v.device)
        block = [k, v, positions, dk, dv]
        for step in range(ring.size):
            k_b, v_b, pos_b, dk_b, dv_b = block
            dq_b, dk_own, dv_own = block_gradients(q, positions, KeyBlock(k_b, v_b, pos_b), ctx.how, grad_out, final)
            dq += dq_b
            block = [k_b, v_b, pos_b, dk_b + dk_own, dv_b + dv_own]
            if step + 1 < ring.size:  # one exchange with the gradients (measured: sending the keys and values
                block = ring.shift(block)  # ahead, in a second exchange, cost more than it hid on 2 cores)
        dk_home, dv_home = ring.shift([block[3], block[4]])  # one more hop: every block back to its owner
        return dq.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   group: dist.ProcessGroup | None, how: Attending | None = None,
                   counter: CommCounter | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence for this rank's queries `q` ([B, H, T_local, D]), the keys and
    values of every rank of `group` passing around the ring; `positions`: the global position of each local
    token (zigzag_positions). Keys and values with fewer heads (GQA) are repeated to q's heads. how: the scale and
    sliding window (causal, uncapped: the ring computes no other); counter: where the bytes sent are counted
    (p2p_bytes)."""
    how = Attending() if how is None else how
    if not how.causal or how.softcap is not None:
        raise ValueError(f"ring attention is causal with uncapped logits; {how} asks otherwise: use "
                         "sequence_parallel.mode \"ulysses\"")
    if k.shape[1] != q.shape[1]:
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads do not divide into {k.shape[1]} key/value heads")
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return RingAttention.apply(q, k, v, positions, group, how.scaled_for(q.shape[-1]), counter)
