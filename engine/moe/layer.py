"""engine.moe.MoE: DeepSpeed's MoE layer (same arguments, same outputs) for user models.

    moe = MoE(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
              use_residual, noisy_gate_policy, drop_tokens, use_rts, ...)
    output, l_aux, exp_counts = moe(hidden_states)

Built whole (all `num_experts` copies of `expert`) so that the model runs as plain PyTorch; initialize() keeps
this rank's experts when moe.expert_parallel_size > 1 (Note [expert parallelism]). The gate is GShard's (as
DeepSpeed's TopKGate): fp32 logits, softmax, top-k; l_aux = E · Σ_e mean_t(p_e) · fraction of first choices on e;
capacity C = max(⌈capacity_factor · k · T / E⌉, min_capacity) per expert when drop_tokens (DeepSpeed's default),
every token routed otherwise. Weights: the top-1 probability for k = 1; the kept choices' probabilities, normalized
over them, for k ≥ 2.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe.aux_losses import AuxLossSink
from engine.moe.dispatch import (
    ExpertPlacement,
    ExpertTraffic,
    capacity_of,
    dispatch,
    order_assignments,
    run_each_expert,
)

_NOISE = (None, "Jitter", "RSample")


def _gumbel_like(x: torch.Tensor) -> torch.Tensor:
    u = torch.rand_like(x).clamp(1e-10, 1 - 1e-10)
    return -torch.log(-torch.log(u))


class FP32Linear(nn.Linear):
    """A linear layer computed in fp32 whatever its weight's and input's dtype (the gate's logits), run as its own
    module so that ZeRO-3 gathers its weight around it (Note [gathering around modules])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class TopKGate(nn.Module):
    """GShard's gate, as DeepSpeed's: `wg` a bias-free linear layer to the experts' logits, computed in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, k: int, noisy_gate_policy: str | None,
                 second_expert_sampling: bool):
        super().__init__()
        self.wg = FP32Linear(hidden_size, num_experts, bias=False)
        self.k, self.num_experts = k, num_experts
        self.noisy_gate_policy, self.second_expert_sampling = noisy_gate_policy, second_expert_sampling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [T, E] fp32, probabilities [T, E], chosen experts [T, k])."""
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = self.wg(x)
        probs = F.softmax(logits, dim=-1)
        noisy = self.training and (self.noisy_gate_policy == "RSample" or
                                   (self.k >= 2 and self.second_expert_sampling))
        if not noisy:
            return logits, probs, torch.topk(probs, self.k, dim=-1).indices
        chooser = logits + _gumbel_like(logits)  # DeepSpeed: noise picks the choices, the weights stay clean
        first = (chooser if self.noisy_gate_policy == "RSample" else logits).argmax(-1, keepdim=True)
        if self.k == 1:
            return logits, probs, first
        rest = torch.topk(chooser.scatter(-1, first, float("-inf")), self.k - 1, dim=-1).indices
        return logits, probs, torch.cat([first, rest], dim=-1)


class MoE(nn.Module):
    """DeepSpeed's deepspeed.moe.layer.MoE on Tiers; forward returns (output, l_aux, exp_counts)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True):
        super().__init__()
        checks = [
            (num_experts < 1 or not 1 <= k <= num_experts, f"num_experts {num_experts} and k {k}: need 1 <= k <= "
             "num_experts"),
            (num_experts % ep_size, f"num_experts {num_experts} is not a multiple of ep_size {ep_size}; use an ep_size "
             "that divides it"),
            (noisy_gate_policy not in _NOISE, f"noisy_gate_policy {noisy_gate_policy!r} is not one of {_NOISE}"),
            (use_tutel, "use_tutel=True: Tutel's kernels are not part of Tiers; set use_tutel=False (the dispatch is "
             "Tiers' own)"),
            (enable_expert_tensor_parallelism, "enable_expert_tensor_parallelism=True: experts split by tensor "
             "parallelism are not built yet; set it to False"),
        ]
        for failed, why in checks:
            if failed:
                raise ValueError(f"engine.moe.MoE: {why}")
        self.num_experts, self.ep_size, self.k = num_experts, ep_size, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.drop_tokens, self.use_rts = min_capacity, drop_tokens, use_rts
        self.gate = TopKGate(hidden_size, num_experts, k, noisy_gate_policy, top2_2nd_expert_sampling)
        self.experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_experts)])
        self.use_residual = use_residual
        if use_residual:  # DeepSpeed's Residual-MoE: a dense copy of the expert, mixed in by learned coefficients
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)
        self.placement = ExpertPlacement(num_experts)
        self.traffic = ExpertTraffic(num_experts)
        self.aux_sink: AuxLossSink | None = None  # set by initialize() with moe.aux_loss_coef / z_loss_coef
        self.aux_loss_coef, self.z_loss_coef = 0.0, 0.0

    def keep_local_experts(self, placement: ExpertPlacement) -> set[int]:
        """Note [expert parallelism]: only experts [first, first + local) stay, under their global ids' names;
        returns the ids of the parameters of the experts dropped here."""
        lo, n = placement.first, placement.local
        kept = {str(i): self.experts[i] for i in range(lo, lo + n)}
        dropped = {id(p) for i, e in enumerate(self.experts) if str(i) not in kept for p in e.parameters()}
        self.experts = nn.ModuleDict(kept)
        self.placement = placement
        return dropped

    def _local_experts(self) -> list[nn.Module]:
        return list(self.experts.values()) if isinstance(self.experts, nn.ModuleDict) else list(self.experts)

    def _run_local(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        return run_each_expert(self._local_experts(), rows, per_expert)

    def _route(self, x: torch.Tensor):
        """(chosen experts [T, k], their weights [T, k], l_aux, z-loss, capacity, priority)."""
        logits, probs, chosen = self.gate(x)
        first = F.one_hot(chosen[:, 0], self.num_experts).float()
        l_aux = (probs.mean(0) * first.mean(0)).sum() * self.num_experts
        z_loss = torch.logsumexp(logits, dim=-1).square().mean()
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        capacity = capacity_of(x.shape[0], self.k, self.num_experts, factor if self.drop_tokens else None,
                               self.min_capacity)
        # DeepSpeed's random token selection (use_rts; top-1 in capacity mode): which tokens an over-full expert
        # keeps is random, not first come
        rts = self.use_rts and self.k == 1 and capacity is not None and self.training
        priority = torch.rand(chosen.numel(), device=chosen.device) if rts else None
        weights = probs.gather(1, chosen)
        if self.k >= 2:
            weights = weights * self._kept_mask(chosen, capacity, priority)
            weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
        return chosen, weights, l_aux, z_loss, capacity, priority

    def _kept_mask(self, chosen: torch.Tensor, capacity: int | None, priority: torch.Tensor | None) -> torch.Tensor:
        """[T, k]: 1 where the choice survives the capacity cut (the same cut dispatch makes)."""
        if capacity is None:
            return torch.ones(chosen.shape, dtype=torch.float32, device=chosen.device)
        order, _ = order_assignments(chosen, self.num_experts, capacity, priority)
        kept = torch.zeros(chosen.numel(), dtype=torch.float32, device=chosen.device)
        kept[order] = 1.0
        return kept.view(chosen.shape[1], chosen.shape[0]).t()

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        if used_token is not None:
            raise ValueError("engine.moe.MoE: used_token masks are not supported yet; pass used_token=None")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        chosen, weights, l_aux, z_loss, capacity, priority = self._route(x)
        out = dispatch(x, chosen, weights, self._run_local, self.placement, capacity, self.traffic, priority)
        if self.use_residual:
            coef = F.softmax(self.coefficient(x), dim=-1)
            out = out * coef[:, 0:1] + self.mlp(x) * coef[:, 1:]
        if self.aux_sink is not None and self.training:
            self.aux_sink.add(self.aux_loss_coef * l_aux + self.z_loss_coef * z_loss)
        exp_counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts).detach()
        return out.reshape(shape), l_aux, exp_counts
