"""Tensor-parallel plans: which module becomes which parallel layer, applied to an unmodified model.

Note [tensor-parallel plans]
A plan maps module-name globs (fnmatch, matched against names from model.named_modules()) to a
style; the first glob that matches a module wins. Styles:
  colwise         column-parallel linear, output left split (feeds a rowwise layer)
  colwise_qkv     the same for a fused q/k/v projection: each of the 3 blocks split, so a rank
                  keeps whole heads of q, k and v
  colwise_gather  column-parallel linear whose output is all-gathered (an lm_head whose model
                  computes its own loss on the full logits)
  rowwise         row-parallel linear, input split, outputs all-reduced
  vocab           vocab-parallel embedding
  replicate       left whole on every tp rank (also what a user plan does with unnamed modules)
Linear layers may be nn.Linear or Hugging Face's Conv1D (weight stored [in, out]). A module
replaced keeps its name, so state-dict keys stay those of the original model. A built-in plan may
also adjust attributes the model's forward reads (head counts, widths) to their per-rank values,
and names the modules whose dropout acts on split activations (Note [tensor-parallel RNG]); a user
plan replaces layers only.
`plan: "auto"` picks the built-in plan by model class; an unknown class is an error naming the
first layer it could not place.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from engine.tensor_parallel.layers_1d import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.rng import RNGStreams, Stream

STYLES = ("colwise", "colwise_qkv", "colwise_gather", "rowwise", "vocab", "replicate")


@dataclass(frozen=True)
class Plan:
    name: str
    styles: dict[str, str]  # glob -> style, in priority order
    # the attributes to set to their per-rank values (computed, and checked, before anything changes)
    adjust: Callable[[nn.Module, int], list] | None = field(default=None, compare=False)
    rng: dict[str, Stream] = field(default_factory=dict)  # glob -> dropout stream (Note [tensor-parallel RNG])


def _divide(owner: str, attr: str, value: int, tp: int) -> int:
    if value % tp:
        raise ValueError(f"{owner}.{attr} = {value} is not divisible by tensor_parallel.size {tp}; choose a size "
                         f"that divides it")
    return value // tp


Change = tuple[nn.Module, str, int]  # (module, attribute, its per-rank value)


def _adjust_example_gpt(model: nn.Module, tp: int) -> list[Change]:
    return [(module, attr, _divide(name, attr, getattr(module, attr), tp))
            for name, module in model.named_modules() if type(module).__name__ == "CausalSelfAttention"
            for attr in ("n_head", "n_embd")]


def _adjust_gpt2(model: nn.Module, tp: int) -> list[Change]:
    return [(module, attr, _divide(name, attr, getattr(module, attr), tp))
            for name, module in model.named_modules() if type(module).__name__ == "GPT2Attention"
            for attr in ("num_heads", "embed_dim", "split_size")]


def _adjust_llama(model: nn.Module, tp: int) -> list[Change]:
    """LlamaAttention reads only head_dim and num_key_value_groups, which stay; the head counts must split."""
    for name, module in model.named_modules():
        if type(module).__name__ == "LlamaAttention":
            _divide(name, "config.num_attention_heads", module.config.num_attention_heads, tp)
            _divide(name, "config.num_key_value_heads", module.config.num_key_value_heads, tp)
    return []


BUILT_IN = {
    "GPT": Plan("example GPT", {"wte": "vocab", "blocks.*.attn.c_attn": "colwise_qkv", "blocks.*.attn.c_proj": "rowwise",
                                "blocks.*.mlp.c_fc": "colwise", "blocks.*.mlp.c_proj": "rowwise",
                                "lm_head": "colwise_gather", "wpe": "replicate"}, _adjust_example_gpt,
                {"blocks.*.attn": Stream.SHARDED, "blocks.*.attn.resid_dropout": Stream.REPLICATED}),
    "GPT2LMHeadModel": Plan("Hugging Face GPT-2", {
        "transformer.wte": "vocab", "transformer.wpe": "replicate", "transformer.h.*.attn.c_attn": "colwise_qkv",
        "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise_gather"}, _adjust_gpt2,
        {"transformer.h.*.attn": Stream.SHARDED, "transformer.h.*.attn.resid_dropout": Stream.REPLICATED}),
    "LlamaForCausalLM": Plan("Hugging Face Llama", {
        "model.embed_tokens": "vocab", "model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather"}, _adjust_llama, {"model.layers.*.self_attn": Stream.SHARDED}),
}


def resolve_plan(model: nn.Module, plan: str | dict) -> Plan:
    """The config's `tensor_parallel.plan`: "auto", a built-in plan's model class name, or {glob: style}."""
    if isinstance(plan, dict):
        bad = {glob: style for glob, style in plan.items() if style not in STYLES}
        if bad:
            glob, style = next(iter(bad.items()))
            raise ValueError(f"tensor_parallel.plan[{glob!r}]: unknown style {style!r}; choose from {', '.join(STYLES)}")
        return Plan("user plan", dict(plan))
    key = type(model).__name__ if plan == "auto" else plan
    if key in BUILT_IN:
        return BUILT_IN[key]
    if plan != "auto":
        raise ValueError(f"tensor_parallel.plan: no built-in plan {plan!r}; choose from \"auto\", "
                         f"{', '.join(repr(k) for k in BUILT_IN)}, or give {{module-name glob: style}}")
    first = next((name for name, m in model.named_modules() if _is_linear(m) or isinstance(m, nn.Embedding)), None)
    raise ValueError(f"tensor_parallel.plan \"auto\" has no built-in plan for {type(model).__name__} (built in: "
                     f"{', '.join(BUILT_IN)}), so it cannot place module {first!r}; give tensor_parallel.plan as "
                     f"{{module-name glob: style}} with styles {', '.join(STYLES)}")


def apply_plan(model: nn.Module, plan: Plan, tp: TPGroup, streams: RNGStreams | None = None) -> dict[str, object]:
    """Replaces the planned modules in place and puts the plan's modules on their dropout streams; returns
    {parameter name: ShardSpec} for the sharded parameters."""
    changes = plan.adjust(model, tp.size) if plan.adjust is not None else []  # raises before any change
    shared: dict = {}  # tied weights: sharded once (see layers_1d._shared_or_sharded)
    replaced = {}
    for name, module in list(model.named_modules()):
        style = next((s for glob, s in plan.styles.items() if fnmatch.fnmatchcase(name, glob)), None)
        if style is None or style == "replicate":
            continue
        replaced[name] = _parallel_layer(name, module, style, tp, shared)
    for name, layer in replaced.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    for module, attr, value in changes:
        setattr(module, attr, value)
    if streams is not None:
        for name, module in model.named_modules():
            stream = next((s for glob, s in plan.rng.items() if fnmatch.fnmatchcase(name, glob)), None)
            if stream is not None:
                streams.attach(module, stream)
    specs = {}
    for name, layer in replaced.items():
        for pname, spec in (("weight", layer.weight_spec), ("bias", getattr(layer, "bias_spec", None))):
            if spec is not None and getattr(layer, pname, None) is not None:
                specs[f"{name}.{pname}"] = spec
    return specs


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _parallel_layer(name: str, module: nn.Module, style: str, tp: TPGroup, shared: dict) -> nn.Module:
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"tensor_parallel.plan: style \"vocab\" is for nn.Embedding, but {name!r} is a "
                             f"{type(module).__name__}")
        return VocabParallelEmbedding.from_module(module, tp, name, shared)
    if not _is_linear(module):
        raise ValueError(f"tensor_parallel.plan: style {style!r} is for nn.Linear or Conv1D, but {name!r} is a "
                         f"{type(module).__name__}")
    transposed = not isinstance(module, nn.Linear)  # Conv1D keeps its weight as [in, out]
    if style == "rowwise":
        return RowParallelLinear.from_module(module, tp, name, transposed=transposed, shared=shared)
    return ColumnParallelLinear.from_module(module, tp, name, transposed=transposed,
                                            parts=3 if style == "colwise_qkv" else 1,
                                            gather_output=style == "colwise_gather", shared=shared)
