"""Hugging Face Trainer: a DeepSpeed-style config's "auto" values filled from TrainingArguments (Note [auto values
from the Trainer])."""

from engine.integrations.hf.auto_config import resolve_config

__all__ = ["resolve_config"]
