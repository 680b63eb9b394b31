"""Mixture of experts with expert parallelism (Note [expert parallelism]): engine.moe.MoE for user models, and the
experts of Hugging Face MoE models placed by their own EP plan."""

from engine.moe.layer import MoE, TopKGate

__all__ = ["MoE", "TopKGate"]
