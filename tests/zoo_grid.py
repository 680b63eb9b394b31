"""The zoo's grid as data: every architecture of tests/hf_zoo.py under every strategy of tests/zoo_cells.py trains
equal to one process, except the cells below, each refused with its reason (tests/test_hf_zoo.py holds every cell to
this; scripts/zoo_grid.py renders it into docs/parallelism.md)."""

from __future__ import annotations

# reason -> (what the refusal's message says, a regex; the reason in words for the docs)
REASONS = {
    "fused_qkv_sliced": (r"indexing into the split dim",
                         "a fused q/k/v projection sliced by index (`qkv[..., :q]`): the derivation does not carry a "
                         "split through it; give `tensor_parallel.plan` by hand"),
    "linear_subclass": (r"FalconLinear: subclasses of nn.Linear",
                        "Falcon's layers are `FalconLinear`, an nn.Linear subclass with a forward of its own: the "
                        "derivation traces it as its ops and replaces none; give `tensor_parallel.plan` by hand"),
    "norm_over_heads": (r"mean reduces over the split dim",
                        "OLMoE: its q/k norms run over every head at once, which a rank holding some heads cannot "
                        "compute, so attention stays whole, and its MLPs are experts (3-D tensors, no linear layers): "
                        "no pair of linear layers is left to split; use expert parallelism"),
    "alibi_mask": (r"ALiBi position biases",
                   "ALiBi biases travel in the attention mask, which is not split with the sequence"),
    "own_attention": (r"ran no attention Tiers splits",
                      "the model computes its attention by hand (BLOOM's ALiBi attention), not through "
                      "transformers' attention interface"),
    "softcap_ring": (r"softcapping\), which ring attention does not",
                     "logit softcapping under ring attention (Ulysses runs it)"),
}

# (architecture, strategy) -> reason
REFUSED = {
    ("phi3", "tp_auto"): "fused_qkv_sliced",
    ("falcon", "tp_auto"): "linear_subclass",
    ("falcon_alibi", "tp_auto"): "linear_subclass",
    ("olmoe", "tp_auto"): "norm_over_heads",
    ("falcon_alibi", "ulysses"): "alibi_mask",
    ("falcon_alibi", "ring"): "alibi_mask",
    ("bloom", "ulysses"): "own_attention",
    ("bloom", "ring"): "own_attention",
    ("gemma2", "ring"): "softcap_ring",
}
