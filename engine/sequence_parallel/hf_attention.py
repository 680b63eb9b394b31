"""A Hugging Face model's attention over a split sequence, through transformers' own attention interface.

Note [Hugging Face attention under sequence parallelism]
A transformers model calls its attention by name (`config._attn_implementation`: "sdpa", "eager", ...) through
`AttentionInterface`, passing what each layer needs besides q, k and v: its scaling, its sliding window (None for a
full-attention layer: per-layer attention types, config.layer_types), Gemma's logit softcapping, dropout. Under
sequence parallelism the model is switched to an implementation registered for its split (`InterfaceAttention`),
which runs Ulysses or ring attention over the group with exactly those per-layer semantics on the tokens' global
positions.
Intercepting F.scaled_dot_product_attention instead would miss what a layer does not pass to it: an eager model
(Gemma2's softcapping) never calls it, and a sliding window shorter than the sequence but not than a rank's part is
dropped by the model's own mask builder, which sees the part's length. An implementation transformers has no mask
function for gets no mask (masking_utils: custom attention builds its own), so the model builds none: the causal
mask and the window are applied here, by global position. What it cannot honour is refused by name at the first
forward, before any gradient: a mask tensor, attention dropout, attention sinks, non-causal attention, softcapping
under ring. A model whose forward runs no attention through the interface (one that computes its own, as BLOOM's
ALiBi attention does) is refused after that forward (Note [sequence parallelism]).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch import nn

# what an attention call may be given that changes which keys a query sees, and that Tiers does not split
_REFUSED = {"s_aux": "attention sinks", "sinks": "attention sinks", "cu_seq_lens_q": "packed-sequence offsets",
            "cu_seq_lens_k": "packed-sequence offsets", "position_bias": "a position bias"}
_names = itertools.count()
_UNSAID = object()  # an attention call that passes no sliding_window


def refuse_alibi(model: nn.Module) -> None:
    """ALiBi biases are carried by the mask, which the interface leaves to the implementation: refused."""
    if getattr(model.config, "alibi", False):
        raise ValueError(f"sequence parallelism: {type(model).__name__} adds ALiBi position biases to its attention "
                         "through its mask, which Tiers does not split with the sequence; use sequence_parallel.size "
                         "1, or a model with rotary positions (config.alibi False)")


class InterfaceAttention:
    """The implementation one SequenceSplit registers in transformers' AttentionInterface (it holds the split
    weakly: the registry is transformers' own, and keeps it until engine.close). The model's text config names it
    only while the engine's forward (or a checkpoint's recompute) runs: any other call computes as before."""

    def __init__(self, split, model: nn.Module):
        from transformers import AttentionInterface

        self._split = weakref.ref(split)
        self.name = f"tiers_sequence_parallel_{next(_names)}"
        self.config = model.config.get_text_config()  # the decoder's (its layers hold the same object)
        self._saved: list[str | None] = []  # the implementation each active() entry found
        AttentionInterface.register(self.name, self)

    @contextlib.contextmanager
    def active(self):
        """The model's attention through this implementation inside (nested entries keep it)."""
        self._saved.append(self.config._attn_implementation_internal)
        self.config._attn_implementation_internal = self.name  # (not the setter: it would recurse into sub-configs)
        try:
            yield
        finally:
            self.config._attn_implementation_internal = self._saved.pop()

    def uninstall(self) -> None:
        """Out of transformers' registry (engine.close)."""
        from transformers import AttentionInterface

        AttentionInterface._global_mapping.pop(self.name, None)

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None | object = _UNSAID, softcap: float | None = None, **kwargs):
        split = self._split()
        if split is None:
            raise RuntimeError(f"{type(module).__name__} runs its attention over a sequence split by an engine that "
                               "is gone; run the model through its engine, or set its attn_implementation back")
        where = type(module).__name__
        if query.shape[2] != key.shape[2]:
            raise ValueError(f"sequence parallelism: {where} attends {query.shape[2]} queries to {key.shape[2]} keys "
                             "(a key/value cache); the engine's forward runs whole sequences: pass use_cache=False")
        if attention_mask is not None:
            raise ValueError(f"sequence parallelism: {where} was given an attention mask, which cannot be split with "
                             "the sequence (padding or packed documents); give full-length sequences without one")
        if dropout and module.training:
            raise ValueError(f"sequence parallelism: {where} applies attention dropout ({dropout}), which is not "
                             "supported over a split sequence; set the model's attention dropout to 0")
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            raise ValueError(f"sequence parallelism: {where} is not causal; sequence parallelism runs causal "
                             "language-model attention only")
        refused = sorted(k for k, v in kwargs.items() if k in _REFUSED and v is not None)
        if refused:
            raise ValueError(f"sequence parallelism: {where} passes {refused[0]} to its attention "
                             f"({_REFUSED[refused[0]]}), which Tiers does not split; use sequence_parallel.size 1")
        window = layer_window(module) if sliding_window is _UNSAID else sliding_window
        out = split.attend(query, key, value, scaling, window or None, softcap, where)
        return out.transpose(1, 2).contiguous(), None


def layer_window(module: nn.Module) -> int | None:
    """The sliding window of an attention layer that does not pass one to its attention (Qwen2-MoE and PhiMoE leave
    it to the mask): its own `sliding_window`, else its type in config.layer_types, else the window a config class
    that declares one gives every layer (PhiMoE's mask builder takes it); a layer type other than full or sliding
    attention is refused. A `sliding_window` a config merely carries (a key left in a Llama config.json) is none."""
    own = getattr(module, "sliding_window", None)
    if own:
        return own
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if types:
        if index is None:
            return None
        kind = types[index]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"sequence parallelism: {type(module).__name__} (layer {index}) is a {kind!r} layer; "
                             "Tiers splits full and sliding-window attention only; use sequence_parallel.size 1")
        return getattr(config, "sliding_window", None) if kind == "sliding_attention" else None
    declared = "sliding_window" in getattr(type(config), "__dataclass_fields__", {})
    return getattr(config, "sliding_window", None) if declared else None
