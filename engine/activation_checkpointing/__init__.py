"""Activation checkpointing applied from the config (Note [activation checkpointing])."""

from engine.activation_checkpointing.checkpointer import ActivationCheckpointing
from engine.activation_checkpointing.selection import select_modules

__all__ = ["ActivationCheckpointing", "select_modules"]
