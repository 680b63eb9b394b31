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
`plan: "auto"` picks the built-in plan by model class; for another class a plan is derived from the
model's forward (1D: Note [derived tensor-parallel plans]; 2D: Note [derived 2D plans]), which the
built-in plans agree with.
2D styles (mode "2d", Note [2D tensor parallelism]; every activation is split [batch/q, seq,
hidden/q], so every module holding parameters must get one, and no module is replicated):
  linear_2d              SUMMA linear (nn.Linear or Conv1D)
  linear_2d_qkv          the same for a fused q/k/v projection (whole heads per hidden block)
  norm_2d                nn.LayerNorm, nn.RMSNorm or a Hugging Face *RMSNorm
  embedding_2d           token embedding
  position_embedding_2d  position embedding (the same layer: ids [seq] or [1, seq] broadcast over the batch)
  classifier_2d          output layer, logits of this rank's batch block (engine.tensor_parallel.cross_entropy)
  classifier_2d_gather   the same, batch gathered back (a model that computes its own loss)
The 2D styles and plans serve 2.5D and 3D as they are (Note [tensor-parallel grids]): the layers ask their grid
for the matmul and the cuts, and a plan's widths are divided by the grid's hidden split (q, or q² in 3D).
Under 2D every dropout draws from the per-rank stream: every activation between layers is split.
(The logits a classifier_2d layer returns are whole along the row; a dropout on them would draw
different masks on the row's ranks. No built-in model has one.) The model's per-sample inputs (token
ids, attention_mask, position ids) are cut to the batch blocks before its forward (Note [2D batch inputs]).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from engine.tensor_parallel.derive import derive_plan
from engine.tensor_parallel.derive.given_plan import partial_gradients_of
from engine.tensor_parallel.derive.plan_2d import derive_plan_2d
from engine.tensor_parallel.inputs_2d import BatchInputs2D
from engine.tensor_parallel.layers_1d import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from engine.tensor_parallel.layers_2d import Classifier2D, Embedding2D, Grid, Linear2D, Norm2D
from engine.tensor_parallel.mappings import PartialGradientSum, TPGroup
from engine.tensor_parallel.rng import RNGStreams, Stream
from engine.tensor_parallel.sequence_1d import SequenceRegions, SequenceShards

STYLES = {"1d": ("colwise", "colwise_qkv", "colwise_gather", "rowwise", "vocab", "replicate"),
          "2d": ("linear_2d", "linear_2d_qkv", "norm_2d", "embedding_2d", "position_embedding_2d", "classifier_2d",
                 "classifier_2d_gather")}


@dataclass(frozen=True)
class Plan:
    name: str
    styles: dict[str, str]  # glob -> style, in priority order
    # the attributes to set to their per-rank values (computed, and checked, before anything changes)
    adjust: Callable[[nn.Module, int], list] | None = field(default=None, compare=False)
    rng: dict[str, Stream] = field(default_factory=dict)  # glob -> dropout stream (Note [tensor-parallel RNG])
    mode: str = "1d"
    sequence: SequenceRegions | None = None  # Note [Megatron sequence parallelism]; built-in 1D plans only
    # parameters left whole whose gradient each tp rank computes a part of (Note [partial gradients of whole
    # parameters], [partial gradients under a given plan]); 1D only
    partial_gradients: tuple[str, ...] = ()


def _divide(owner: str, attr: str, value: int, parts: int) -> int:
    if value % parts:
        raise ValueError(f"{owner}.{attr} = {value} does not split into {parts} tensor-parallel parts (the "
                         f"tensor_parallel.size in 1D, the grid side q in 2D and 2.5D, q² in 3D); choose a size "
                         f"that divides it")
    return value // parts


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
    "GPT": Plan("example GPT", {"wte": "vocab", "blocks.*.attn.c_attn": "colwise_qkv",
                                "blocks.*.attn.c_proj": "rowwise",
                                "blocks.*.mlp.c_fc": "colwise", "blocks.*.mlp.c_proj": "rowwise",
                                "lm_head": "colwise_gather", "wpe": "replicate"}, _adjust_example_gpt,
                {"blocks.*.attn": Stream.SHARDED, "blocks.*.attn.resid_dropout": Stream.REPLICATED},
                sequence=SequenceRegions(("blocks.*.attn", "blocks.*.mlp"), ("wpe",), ("ln_f",))),
    "GPT2LMHeadModel": Plan("Hugging Face GPT-2", {
        "transformer.wte": "vocab", "transformer.wpe": "replicate", "transformer.h.*.attn.c_attn": "colwise_qkv",
        "transformer.h.*.attn.c_proj": "rowwise", "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise", "lm_head": "colwise_gather"}, _adjust_gpt2,
        {"transformer.h.*.attn": Stream.SHARDED, "transformer.h.*.attn.resid_dropout": Stream.REPLICATED},
        sequence=SequenceRegions(("transformer.h.*.attn", "transformer.h.*.mlp"), ("transformer.wpe",),
                                 ("transformer.ln_f",))),
    "LlamaForCausalLM": Plan("Hugging Face Llama", {
        "model.embed_tokens": "vocab", "model.layers.*.self_attn.[qkv]_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather"}, _adjust_llama, {"model.layers.*.self_attn": Stream.SHARDED},
        sequence=SequenceRegions(("model.layers.*.self_attn", "model.layers.*.mlp"), (), ("model.norm",))),
}

BUILT_IN_2D = {
    "GPT": Plan("example GPT", {
        "wte": "embedding_2d", "wpe": "position_embedding_2d", "blocks.*.ln_[12]": "norm_2d", "ln_f": "norm_2d",
        "blocks.*.attn.c_attn": "linear_2d_qkv", "blocks.*.attn.c_proj": "linear_2d", "blocks.*.mlp.c_fc": "linear_2d",
        "blocks.*.mlp.c_proj": "linear_2d", "lm_head": "classifier_2d_gather"}, _adjust_example_gpt, mode="2d"),
    "GPT2LMHeadModel": Plan("Hugging Face GPT-2", {
        "transformer.wte": "embedding_2d", "transformer.wpe": "position_embedding_2d",
        "transformer.h.*.ln_[12]": "norm_2d", "transformer.ln_f": "norm_2d",
        "transformer.h.*.attn.c_attn": "linear_2d_qkv", "transformer.h.*.attn.c_proj": "linear_2d",
        "transformer.h.*.mlp.c_fc": "linear_2d", "transformer.h.*.mlp.c_proj": "linear_2d",
        "lm_head": "classifier_2d_gather"}, _adjust_gpt2, mode="2d"),
    "LlamaForCausalLM": Plan("Hugging Face Llama", {
        "model.embed_tokens": "embedding_2d", "model.layers.*.self_attn.[qkvo]_proj": "linear_2d",
        "model.layers.*.mlp.*_proj": "linear_2d", "model.layers.*_layernorm": "norm_2d", "model.norm": "norm_2d",
        "lm_head": "classifier_2d_gather"}, _adjust_llama, mode="2d"),
}


def resolve_plan(model: nn.Module, plan: str | dict, mode: str = "1d", tp_size: int = 1,
                 batch_parts: int = 1) -> Plan:
    """The config's `tensor_parallel.plan` for `mode` ("1d", or "2d" for every grid): "auto" (the built-in plan for
    the model's class, else one derived from its forward at `tp_size`, Note [derived tensor-parallel plans] /
    [derived 2D plans]; for a grid, `tp_size` is its hidden split and `batch_parts` its batch split), "derived"
    (derived always), a built-in plan's model class name, or {glob: style}."""
    styles, built_in = STYLES[mode], BUILT_IN if mode == "1d" else BUILT_IN_2D
    if isinstance(plan, dict):
        bad = {glob: style for glob, style in plan.items() if style not in styles}
        if bad:
            glob, style = next(iter(bad.items()))
            raise ValueError(f"tensor_parallel.plan[{glob!r}]: style {style!r} is not a {mode} style; choose from "
                             f"{', '.join(styles)}")
        partial = partial_gradients_of(model, plan, tp_size) if mode == "1d" else ()
        return Plan("user plan", dict(plan), mode=mode, partial_gradients=partial)
    derive = derived_plan if mode == "1d" else functools.partial(derived_plan_2d, batch_parts=batch_parts)
    if plan == "derived":  # derived even where a built-in plan exists (to compare them)
        return derive(model, tp_size)
    key = type(model).__name__ if plan == "auto" else plan
    if key in built_in and (mode == "2d" or key == type(model).__name__):
        return built_in[key]
    if key in built_in:  # named for a model of another class
        return dataclasses.replace(built_in[key], partial_gradients=partial_gradients_of(model, built_in[key].styles,
                                                                                         tp_size))
    if plan != "auto":
        raise ValueError(f"tensor_parallel.plan: no built-in {mode} plan {plan!r}; choose from \"auto\", "
                         f"\"derived\", {', '.join(repr(k) for k in built_in)}, or give {{module-name glob: style}}")
    return derive(model, tp_size)


def derived_plan(model: nn.Module, tp_size: int) -> Plan:
    """Note [derived tensor-parallel plans]."""
    derived = derive_plan(model, tp_size)

    def adjust(target: nn.Module, tp: int) -> list[Change]:
        if tp != tp_size:
            raise ValueError(f"a plan derived for tensor_parallel.size {tp_size} applied at size {tp}")
        return [(target.get_submodule(name), attr, value) for name, attr, value in derived.adjustments]
    return Plan(f"plan derived for {type(model).__name__}", derived.styles, adjust, derived.rng,
                partial_gradients=derived.partial_gradients)


def derived_plan_2d(model: nn.Module, width: int, batch_parts: int) -> Plan:
    """Note [derived 2D plans], for a grid splitting the hidden dimension into `width` parts and the batch into
    `batch_parts` (2D: both q)."""
    derived = derive_plan_2d(model, width, batch_parts)

    def adjust(target: nn.Module, side: int) -> list[Change]:
        if side != width:
            raise ValueError(f"a 2D plan derived for a hidden split of {width} applied with one of {side}")
        return [(target.get_submodule(name), attr, value) for name, attr, value in derived.adjustments]
    return Plan(f"2D plan derived for {type(model).__name__}", derived.styles, adjust, mode="2d")


def apply_plan(model: nn.Module, plan: Plan, tp: TPGroup, streams: RNGStreams | None = None,
               mesh: Grid | None = None, sequence: SequenceShards | None = None) -> dict[str, object]:
    """Replaces the planned modules in place and puts the plan's modules on their dropout streams (under 2D or
    sequence parallelism, the whole model on the per-rank stream); returns {parameter name: spec} for the
    sharded parameters. `mesh` is required by a 2D plan; `sequence` splits the activations between the
    tensor-parallel regions along the sequence (Note [Megatron sequence parallelism]). Everything is checked
    before the first change."""
    if (plan.mode == "2d") != (mesh is not None):
        raise ValueError(f"a {plan.mode} plan needs {'a' if plan.mode == '2d' else 'no'} 2D, 2.5D or 3D grid")
    if sequence is not None and plan.sequence is None:
        raise ValueError(f"tensor_parallel.sequence_parallel needs to know where {type(model).__name__}'s "
                         f"attention and MLP take their inputs, which the built-in 1D plans ({', '.join(BUILT_IN)}) "
                         f"say and the {plan.name} does not; use a built-in plan, or turn sequence_parallel off")
    if sequence is not None:
        plan.sequence.check(model)
    changes = plan.adjust(model, mesh.width if mesh else tp.size) if plan.adjust is not None else []
    shared: dict = {}  # tied weights: sharded once (see shards.shared_or_sharded)
    replaced = {}
    for name, module in list(model.named_modules()):
        style = next((s for glob, s in plan.styles.items() if fnmatch.fnmatchcase(name, glob)), None)
        if style is None or style == "replicate":
            continue
        replaced[name] = _parallel_layer(name, module, style, tp, shared) if mesh is None else \
            _layer_2d(name, module, style, mesh, shared)
    if mesh is not None:
        _check_all_placed(model, replaced)
    for name, layer in replaced.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    for module, attr, value in changes:
        setattr(module, attr, value)
    for name in plan.partial_gradients if sequence is None else ():  # (sequence sums every whole parameter's)
        model.get_parameter(name).register_hook(PartialGradientSum(tp))
    if mesh is not None:
        model.register_forward_pre_hook(BatchInputs2D(model, mesh), with_kwargs=True)
    if sequence is not None:
        for layer in replaced.values():
            if not getattr(layer, "gather_output", False):  # the lm_head takes the gathered final norm's output
                layer.sequence = sequence
        sharded = {id(getattr(layer, pname)) for layer in replaced.values()
                   for pname, spec in (("weight", layer.weight_spec), ("bias", getattr(layer, "bias_spec", None)))
                   if spec is not None and getattr(layer, pname, None) is not None}
        sequence.apply(model, plan.sequence, [p for p in model.parameters() if id(p) not in sharded])
    if streams is not None and (mesh is not None or sequence is not None):  # every activation is split
        streams.attach(model, Stream.SHARDED)
    elif streams is not None:
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


def _is_transposed_linear(name: str, module: nn.Module, style: str) -> bool:
    """Whether the linear layer a linear style names keeps its weight as [in, out] (Conv1D); refuses others."""
    if not _is_linear(module):
        raise ValueError(f"tensor_parallel.plan: style {style!r} is for nn.Linear or Conv1D, but {name!r} is a "
                         f"{type(module).__name__}")
    return not isinstance(module, nn.Linear)


def _parallel_layer(name: str, module: nn.Module, style: str, tp: TPGroup, shared: dict) -> nn.Module:
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"tensor_parallel.plan: style \"vocab\" is for nn.Embedding, but {name!r} is a "
                             f"{type(module).__name__}")
        return VocabParallelEmbedding.from_module(module, tp, name, shared)
    transposed = _is_transposed_linear(name, module, style)
    if style == "rowwise":
        return RowParallelLinear.from_module(module, tp, name, transposed=transposed, shared=shared)
    return ColumnParallelLinear.from_module(module, tp, name, transposed=transposed,
                                            parts=3 if style == "colwise_qkv" else 1,
                                            gather_output=style == "colwise_gather", shared=shared)


def _check_all_placed(model: nn.Module, replaced: dict[str, nn.Module]) -> None:
    """Under 2D (2.5D, 3D) a layer left whole would meet activations split [batch/q, seq, hidden/q]: refuse it."""
    for name, module in model.named_modules():
        inside = any(name == r or name.startswith(r + ".") for r in replaced)
        if not inside and any(True for _ in module.parameters(recurse=False)):
            raise ValueError(f"tensor_parallel.plan (2d, 2.5d, 3d): module {name!r} ({type(module).__name__}) holds "
                             f"parameters but has no 2D style; on these grids every activation is split by batch and "
                             f"hidden, so give it one of {', '.join(STYLES['2d'])}")


def _layer_2d(name: str, module: nn.Module, style: str, mesh: Grid, shared: dict) -> nn.Module:
    if style in ("embedding_2d", "position_embedding_2d"):
        return Embedding2D.from_module(module, mesh, name, shared=shared)
    if style == "norm_2d":
        return Norm2D.from_module(module, mesh, name)
    transposed = _is_transposed_linear(name, module, style)
    if style.startswith("classifier_2d"):
        return Classifier2D.from_module(module, mesh, name, transposed=transposed,
                                        gather_batch=style == "classifier_2d_gather", shared=shared)
    return Linear2D.from_module(module, mesh, name, transposed=transposed, parts=3 if style == "linear_2d_qkv" else 1,
                                shared=shared)
