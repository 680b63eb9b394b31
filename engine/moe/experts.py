"""A model's own experts module, run on this rank's experts with the tokens routed to them.

Note [experts of an unmodified model]
Hugging Face 5.x MoE models keep each layer's experts in one module whose parameters are 3-D, experts first
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), called as experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) after the model's own router; the model's config names them in `base_model_ep_plan`
("ep_dispatch_experts" for the module, "grouped_gemm" for its parameters). DispatchedExperts takes that
module's place under the same name: its parameters, registered under their own names (so state dicts and
checkpoints keep the model's keys), are this rank's slice of experts; the original module is kept, unregistered,
and runs the received rows with its own code (`num_experts` set to the local count, each row sent to its local
expert with weight 1, so whichever experts implementation the model's config picks computes them). The router,
its aux loss and everything around the layer stay the model's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.moe.dispatch import ExpertPlacement, ExpertTraffic, capacity_of, dispatch


class DispatchedExperts(nn.Module):
    """Note [experts of an unmodified model]: `experts` on this rank's experts, with tokens dispatched to them."""

    def __init__(self, experts: nn.Module, expert_params: list[str], placement: ExpertPlacement,
                 capacity_factor: float | None, min_capacity: int, name: str):
        super().__init__()
        whole = dict(experts.named_parameters(recurse=False))
        others = sorted(set(n for n, _ in experts.named_parameters()) - set(expert_params))
        if others:
            raise ValueError(f"{name} ({type(experts).__name__}) has parameters {others} that are not split by expert "
                             "in the model's base_model_ep_plan; expert parallelism cannot place them")
        lo, n = placement.first, placement.local
        for key in expert_params:
            p = whole[key]
            if p.dim() == 0 or p.shape[0] != placement.num_experts:
                raise ValueError(f"{name}.{key} has shape {tuple(p.shape)}, not [{placement.num_experts}, ...] "
                                 "(experts first); expert parallelism splits it along its first dimension")
            p.data = p.detach()[lo:lo + n].clone()  # the same parameter (optimizers built over it keep it)
            self.register_parameter(key, p)  # and the original module computes with this rank's slice
        experts.num_experts = n
        self.__dict__["inner"] = experts  # unregistered: its parameters are this module's (their names unchanged)
        self.placement = placement
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.traffic = ExpertTraffic(placement.num_experts)

    def _run_local(self, rows: torch.Tensor, per_expert: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
        ids = torch.repeat_interleave(torch.arange(self.placement.local, device=rows.device), per_expert)[:, None]
        return self.inner(rows, ids, torch.ones(ids.shape, dtype=weight_dtype, device=rows.device))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        capacity = capacity_of(tokens, k, self.placement.num_experts, self.capacity_factor, self.min_capacity)
        return dispatch(hidden_states, top_k_index, top_k_weights,
                        lambda rows, per_expert: self._run_local(rows, per_expert, top_k_weights.dtype),
                        self.placement, capacity, self.traffic)

    def extra_repr(self) -> str:
        p = self.placement
        return f"{type(self.inner).__name__}, experts {p.first}..{p.first + p.local - 1} of {p.num_experts}"
