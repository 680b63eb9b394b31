"""Models with mixture-of-experts layers for the MoE tests: Hugging Face Mixtral and Qwen2-MoE built from configs
(5.x fused expert tensors), and a user model written around engine.moe.MoE (DeepSpeed's API)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe import MoE

VOCAB, SEQ = 256, 16


def mixtral(seed: int = 0, **overrides) -> nn.Module:
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                     num_local_experts=4, num_experts_per_tok=2, **overrides)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg)


def qwen_moe(seed: int = 0) -> nn.Module:
    import transformers

    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=SEQ, num_experts=4,
                                      num_experts_per_tok=2, decoder_sparse_step=1)
    torch.manual_seed(seed)
    return transformers.Qwen2MoeForCausalLM(cfg)


def hf_loss(model_or_engine, x: torch.Tensor) -> torch.Tensor:
    return model_or_engine(input_ids=x, labels=x, use_cache=False).loss


class Expert(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class UserMoEModel(nn.Module):
    """A user's model: embedding, one MoE layer with a residual, a head; the loss (with the layer's l_aux times
    `aux_weight`, as DeepSpeed users add it) computed inside forward. `positive`: the MoE layer sees positive
    inputs only, so a gate row of negative weights is never chosen."""

    def __init__(self, hidden: int = 16, num_experts: int = 4, k: int = 2, aux_weight: float = 0.01,
                 positive: bool = False, seed: int = 0, **moe_args):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, hidden)
        moe_args.setdefault("top2_2nd_expert_sampling", False)  # random: each rank would draw other noise
        self.moe = MoE(hidden, Expert(hidden), num_experts=num_experts, k=k, **moe_args)
        self.head = nn.Linear(hidden, VOCAB)
        self.aux_weight, self.positive = aux_weight, positive

    def forward(self, x, labels):
        h = self.embed(x)
        if self.positive:
            h = F.relu(h) + 0.1
        out, l_aux, _ = self.moe(h)
        logits = self.head(h + out)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss + self.aux_weight * l_aux


def user_loss(model_or_engine, x: torch.Tensor) -> torch.Tensor:
    return model_or_engine(x, x)


def never_route_to(model: UserMoEModel, experts: list[int]) -> None:
    """The gate rows of `experts` strongly negative: with positive inputs, no token ever chooses them."""
    with torch.no_grad():
        model.moe.gate.wg.weight.abs_()
        model.moe.gate.wg.weight[experts] = -10.0
