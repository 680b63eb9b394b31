"""A Hugging Face 4.x MoE block (experts in an nn.ModuleList), routed as the block routes and dispatched by Tiers.

Note [experts in a module list]
transformers 4.x kept each layer's experts as an nn.ModuleList and routed inside the block's forward, calling
one expert at a time; that loop cannot send tokens to experts held elsewhere, and the 4.x configs name no expert
plan. For the blocks whose routing Tiers knows (by class: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE: softmax in fp32
over the gate's logits, top-k, renormalized always for Mixtral and as `norm_topk_prob` says for the others, cast
to the hidden dtype; Qwen2-MoE's shared expert added through its sigmoid gate; Mixtral's training jitter),
RoutedExpertList takes the block's place under the same name: the gate, the shared expert and this rank's
experts are its children under their own names (experts by global id, as a ModuleDict), so state dicts and
checkpoints keep the model's keys, and it returns what the block returns, (output, router_logits), so the model's
aux loss is computed from the same logits. It is made an instance of the block's class too (a subclass made for
it, `routed_block_class`; nothing of the model's class changes): transformers 4.x collects the router logits for
that loss with hooks on the modules of the block's class. Other 4.x blocks are left alone, and refused when
expert parallelism is asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe.dispatch import ExpertPlacement, ExpertTraffic, capacity_of, dispatch, run_each_expert

# class name -> whether its top-k weights are renormalized regardless of `norm_topk_prob`
KNOWN_BLOCKS = {"MixtralSparseMoeBlock": True, "Qwen2MoeSparseMoeBlock": False, "Qwen3MoeSparseMoeBlock": False,
                "OlmoeSparseMoeBlock": False}


def is_expert_list_block(module: nn.Module) -> bool:
    """A 4.x-style MoE block: a gate and an nn.ModuleList of experts (the class need not be one Tiers knows)."""
    return isinstance(getattr(module, "experts", None), nn.ModuleList) and isinstance(getattr(module, "gate", None),
                                                                                     nn.Linear)


class RoutedExpertList(nn.Module):
    """Note [experts in a module list]: `block` on this rank's experts, with tokens dispatched to them."""

    def __init__(self, block: nn.Module, placement: ExpertPlacement, capacity_factor: float | None,
                 min_capacity: int, name: str):
        nn.Module.__init__(self)  # not the block class's (routed_block_class puts it next in the MRO)
        kind = type(block).__name__
        if kind not in KNOWN_BLOCKS:
            raise ValueError(f"{name} is a {kind} with its experts in a ModuleList, whose routing Tiers does not know "
                             f"(it knows {', '.join(sorted(KNOWN_BLOCKS))}); build the layer with engine.moe.MoE, or "
                             "use transformers 5.x, whose MoE models name their experts in base_model_ep_plan")
        if len(block.experts) != placement.num_experts:
            raise ValueError(f"{name}: {len(block.experts)} experts, placement for {placement.num_experts}")
        self.gate = block.gate
        lo, n = placement.first, placement.local
        self.experts = nn.ModuleDict({str(i): block.experts[i] for i in range(lo, lo + n)})
        self.has_shared = hasattr(block, "shared_expert")
        if self.has_shared:
            self.shared_expert, self.shared_expert_gate = block.shared_expert, block.shared_expert_gate
        self.top_k = block.top_k
        self.normalize = KNOWN_BLOCKS[kind] or bool(getattr(block, "norm_topk_prob", False))
        self.jitter_noise = getattr(block, "jitter_noise", 0.0)
        self.placement, self.kind = placement, kind
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.traffic = ExpertTraffic(placement.num_experts)

    def _run_local(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        return run_each_expert(self.experts.values(), rows, per_expert)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise,
                                                                                    1.0 + self.jitter_noise)
        x = hidden_states.view(-1, hidden)
        router_logits = self.gate(x)
        weights, chosen = torch.topk(F.softmax(router_logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        capacity = capacity_of(x.shape[0], self.top_k, self.placement.num_experts, self.capacity_factor,
                               self.min_capacity)
        out = dispatch(x, chosen, weights, self._run_local, self.placement, capacity, self.traffic)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(batch, seq, hidden), router_logits

    def extra_repr(self) -> str:
        p = self.placement
        return f"{self.kind}, experts {p.first}..{p.first + p.local - 1} of {p.num_experts}"


def routed_block_class(block_class: type) -> type:
    """RoutedExpertList as a subclass of `block_class` as well (its methods first), so that code finding the
    model's MoE blocks by class still finds it (Note [experts in a module list])."""
    return type(f"Routed{block_class.__name__}", (RoutedExpertList, block_class), {})
