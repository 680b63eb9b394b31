"""Hugging Face Trainer over a Tiers engine (Note [the Trainer's loop over an engine]), and a DeepSpeed-style
config's "auto" values filled from TrainingArguments (Note [auto values from the Trainer])."""

from engine.integrations.hf.auto_config import resolve_config
from engine.integrations.hf.trainer import TiersTrainer, TiersTrainerMixin, TiersTrainingArguments

__all__ = ["resolve_config", "TiersTrainer", "TiersTrainerMixin", "TiersTrainingArguments"]
