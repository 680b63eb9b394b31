"""Tokens to their experts and back: dropless or capped routing, over the ranks holding the experts.

Note [expert parallelism]
An MoE layer's experts are split over the ep ranks of an expert-parallel group: rank e holds experts
[e·E/ep, (e+1)·E/ep). Each rank routes its own tokens (the model's router, or engine.moe.MoE's gate), then:
  1. orders its (token, choice) assignments by expert, first choices of every token before any second choice
     (GShard's priority), and in capacity mode keeps each expert's first C = max(⌈cf·k·T/E⌉, min_capacity);
  2. tells every rank how many rows it sends to each of that rank's experts (a small all-to-all of counts);
  3. sends the rows (a variable-split all-to-all: dropless routing sends exactly the assignments, no padding);
  4. the receiving rank regroups the rows by its local expert, runs each expert once on its rows, and
  5. sends the outputs back the same way reversed; each token's output is the weighted sum of its kept
     choices' outputs (a dropped choice adds nothing; the residual carries the token on).
Backward runs the two exchanges in reverse (engine.moe.all_to_all). An expert no token reaches computes
nothing, gets a zero gradient, and every collective still runs on every rank: the exchanges carry empty splits,
and the expert's chunk is reduced like any other (Note [reduction order]). Expert parameters live in chunks of
their own, reduced and sharded over the expert-data-parallel group (Note [one mesh]); dense parameters
over the whole data-parallel group.
With 1D tensor parallelism an MoE layer stays whole on every tp rank (a plan splitting anything inside it is
refused): the tp ranks of one ep position route the same tokens, each over its own ep group, so each holds
the same expert gradients, reduced over edp (which holds no tp rank) and counted 1/tp in the global norm as
any replicated parameter (Note [global norm under tensor parallelism]). With sequence parallelism each rank
routes the tokens of its part of the sequence; the ep group spans sp ranks (or sits inside them), and router
losses are each rank's over its own tokens, weighted as its loss is (Note [sequence parallelism]). In a
pipeline the ep group holds ranks of one stage, which run the same schedule, so their exchanges pair; a
stage's router losses ride on its output into its backward (Note [a pipelined step]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from engine.comm import CommCounter
from engine.moe.all_to_all import exchange_counts, exchange_rows


@dataclass(frozen=True)
class ExpertPlacement:
    """Experts [first, first + local) of `num_experts` live here; the ep ranks of `group` hold the rest."""

    num_experts: int
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if self.num_experts % self.size:
            raise ValueError(f"an MoE layer has {self.num_experts} experts, which moe.expert_parallel_size "
                             f"{self.size} does not divide; use a size that divides {self.num_experts}")

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.local


@dataclass
class ExpertTraffic:
    """What one MoE layer routed since it was last read: kept assignments per (global) expert, assignments
    dropped by capacity (counted while `counting`: the engine's forwards, not a checkpointed block's recompute),
    and the bytes of its token exchanges (all of them, forward and backward)."""

    num_experts: int
    tokens_per_expert: torch.Tensor = None
    dropped: int = 0
    routed: int = 0
    comm: CommCounter = field(default_factory=CommCounter)
    counting: bool = True

    def __post_init__(self):
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64)

    def record(self, kept: torch.Tensor, routed: int) -> None:
        if not self.counting:
            return
        self.tokens_per_expert += kept.cpu()
        self.routed += routed
        self.dropped += routed - int(kept.sum())

    def reset(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped = self.routed = 0
        self.comm = CommCounter()


def capacity_of(tokens: int, k: int, num_experts: int, capacity_factor: float | None, min_capacity: int) -> int | None:
    """Note [expert parallelism]: the most assignments one expert keeps from this rank's `tokens`; None: all."""
    if capacity_factor is None:
        return None
    return max(math.ceil(capacity_factor * k * tokens / num_experts), min_capacity)


def order_assignments(expert_ids: torch.Tensor, num_experts: int, capacity: int | None,
                      priority: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kept assignments as indices into the choice-major flattening of expert_ids [T, k], sorted by expert;
    kept assignments per expert). An expert over capacity keeps its first assignments in choice-major order, or
    those of lowest `priority` (one value per assignment, choice-major) when given."""
    ids = expert_ids.t().reshape(-1)  # choice-major: every token's first choice before any second one
    if priority is None:
        order = torch.argsort(ids, stable=True)
    else:
        by_priority = torch.argsort(priority)
        order = by_priority[torch.argsort(ids[by_priority], stable=True)]
    counts = torch.bincount(ids, minlength=num_experts)
    if capacity is None:
        return order, counts
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(order.numel(), device=order.device) - starts[ids[order]]
    return order[position < capacity], counts.clamp(max=capacity)


def _expert_major(received: torch.Tensor) -> torch.Tensor:
    """received [sources, local experts] row counts, laid out source-major -> the permutation to expert-major."""
    offsets = (torch.cumsum(received.reshape(-1), 0) - received.reshape(-1)).view_as(received)
    counts, starts = received.t().reshape(-1), offsets.t().reshape(-1)
    total = int(counts.sum())
    block_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.repeat_interleave(starts, counts) + torch.arange(total, device=received.device) - block_start


RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows grouped by local expert, rows per expert)


def run_each_expert(experts, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
    """Rows grouped by local expert (per_expert[j] of them for experts[j]) through their experts, one at a time."""
    outs = [expert(part) for expert, part in zip(experts, rows.split(per_expert.tolist()))]
    return torch.cat(outs) if outs else rows


def dispatch(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, run_experts: RunExperts,
             placement: ExpertPlacement, capacity: int | None, traffic: ExpertTraffic,
             priority: torch.Tensor | None = None) -> torch.Tensor:
    """Note [expert parallelism]: hidden [T, H] routed by expert_ids / weights [T, k] -> [T, H], the weighted sum of
    each token's kept experts' outputs."""
    tokens, k = expert_ids.shape
    order, kept = order_assignments(expert_ids, placement.num_experts, capacity, priority)
    traffic.record(kept, tokens * k)
    token = order % tokens
    rows = hidden.index_select(0, token)
    if placement.size == 1:
        out_rows = run_experts(rows, kept)
    else:
        sent = kept.view(placement.size, placement.local)
        received = exchange_counts(sent, placement.group, traffic.comm)  # [source rank, local expert]
        send, recv = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = exchange_rows(rows, send, recv, placement.group, traffic.comm)
        to_experts = _expert_major(received)
        back = torch.empty_like(to_experts)
        back[to_experts] = torch.arange(to_experts.numel(), device=to_experts.device)
        computed = run_experts(arrived.index_select(0, to_experts), received.sum(0))
        out_rows = exchange_rows(computed.index_select(0, back), recv, send, placement.group, traffic.comm)
    choice_weights = weights.t().reshape(-1).index_select(0, order)
    weighted = (out_rows * choice_weights[:, None]).to(hidden.dtype)
    return hidden.new_zeros(tokens, out_rows.shape[-1]).index_add(0, token, weighted)
