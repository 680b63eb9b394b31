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


class ExpertMLP(nn.Module):
    """A 4.x-style gated expert (w1, w3 in; w2 out)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nn.Module):
    """The layout transformers 4.x gave Mixtral's MoE block (named as its class is): a bias-free gate, experts in a
    ModuleList, softmax / top-k / renormalize routing, the experts called one by one in the block's own loop, and
    (output, router_logits) returned. Checked against transformers 4.57.1's own class outside the test suite."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k, self.num_experts, self.jitter_noise = top_k, num_experts, 0.0
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([ExpertMLP(hidden, inner) for _ in range(num_experts)])

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        router_logits = self.gate(x)
        weights, chosen = torch.topk(F.softmax(router_logits, dim=1, dtype=torch.float), self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.reshape(batch, seq, hidden), router_logits


class ModuleListMoEModel(nn.Module):
    """A small decoder-free model around two 4.x-style blocks, its loss (with a Switch-style load-balancing term
    from the blocks' router logits, as the 4.x models compute it) inside forward."""

    def __init__(self, hidden: int = 16, num_experts: int = 4, top_k: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(2)])
        self.blocks = nn.ModuleList([MixtralSparseMoeBlock(hidden, 2 * hidden, num_experts, top_k) for _ in range(2)])
        self.head = nn.Linear(hidden, VOCAB)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x, labels):
        h = self.embed(x)
        aux = 0.0
        for norm, block in zip(self.norms, self.blocks):
            out, logits = block(norm(h))
            h = h + out
            probs = F.softmax(logits, dim=-1)
            chosen = F.one_hot(torch.topk(probs, self.top_k, dim=-1).indices, self.num_experts).float().sum(1)
            aux = aux + self.num_experts * (chosen.mean(0) * probs.mean(0)).sum()
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)) + 0.01 * aux


class MoEBlock(nn.Module):
    """Causal self-attention (F.scaled_dot_product_attention, the call sequence parallelism routes) and an
    engine.moe.MoE feed-forward, each with a residual."""

    HEAD_DIM = 8

    def __init__(self, hidden: int, num_experts: int, k: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.moe = MoE(hidden, Expert(hidden), num_experts=num_experts, k=k, drop_tokens=False,
                       top2_2nd_expert_sampling=False)

    def forward(self, h):
        batch, seq, _ = h.shape
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # a colwise_qkv plan leaves this rank's heads of each
        heads = q.shape[-1] // self.HEAD_DIM
        q, k, v = (t.reshape(batch, seq, heads, self.HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(batch, seq, heads * self.HEAD_DIM))
        out, _, _ = self.moe(self.norm(h))
        return h + out


class MoEGPT(nn.Module):
    """A tiny GPT-like user model: token and position embeddings, `layers` MoEBlocks, a head; the loss computed
    inside forward on labels given already shifted (router losses come from the config's moe.aux_loss_coef)."""

    def __init__(self, hidden: int = 16, layers: int = 2, num_experts: int = 4, k: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.blocks = nn.ModuleList([MoEBlock(hidden, num_experts, k) for _ in range(layers)])
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, labels, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        h = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
