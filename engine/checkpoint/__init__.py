"""Sharded, atomic checkpoints: save and load under any layout, consolidate, export (Notes [checkpoint layout],
[checkpoint commit], [checkpoint integrity], [reading a checkpoint anywhere], [consolidating a checkpoint])."""

from engine.checkpoint.export import consolidate, resolve, write_state_dict
from engine.checkpoint.files import CheckpointError, CheckpointIntegrityError, CheckpointWriteError
from engine.checkpoint.restore import load_checkpoint
from engine.checkpoint.saver import Saver

__all__ = ["CheckpointError", "CheckpointIntegrityError", "CheckpointWriteError", "Saver", "consolidate",
           "load_checkpoint", "resolve", "write_state_dict"]
