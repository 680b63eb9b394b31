"""A Lightning checkpoint directory: the engine's checkpoint with Lightning's own state beside it.

Note [Lightning's state beside the engine's checkpoint]
Lightning's part of a checkpoint (loop progress, callbacks, schedulers, hyperparameters; under Fabric the state's
other entries) may hold any picklable value (a scheduler's infinite bound, an OmegaConf config), which an engine
checkpoint's JSON client state cannot. So rank 0 writes it with torch.save to a file named afresh for each save
(written to a temporary name, then renamed), and the engine's checkpoint then commits with that file's name as its
client state: a crash in between leaves the last committed pair, never a new engine checkpoint with an old state
(ModelCheckpoint's `last.ckpt` is saved over and over into one directory). After a synchronous save the files of
earlier saves are removed. A load reads the file the committed checkpoint names.
"""

from __future__ import annotations

import glob
import os
import uuid

import torch

STATE_FILE_KEY = "lightning_state_file"
PREFIX = "lightning-state-"


def save_with_state(engine, directory, state: dict, is_rank0: bool) -> None:
    directory = os.fspath(directory)
    if "://" in directory:
        raise ValueError(f"{directory}: the engine writes its checkpoint to a local or mounted file system; give a "
                         "directory path")
    name = f"{PREFIX}{uuid.uuid4().hex}.pt"  # rank 0's name is the one the checkpoint records
    if is_rank0:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, name)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    engine.save_checkpoint(directory, tag="checkpoint", client_state={STATE_FILE_KEY: name})
    if is_rank0 and not engine.config.checkpoint.async_save:
        for stale in glob.glob(os.path.join(glob.escape(directory), PREFIX + "*")):
            if os.path.basename(stale) != name:
                os.remove(stale)


def load_with_state(engine, directory, weights_only: bool | None = None, **flags) -> dict:
    """Loads the engine's checkpoint in `directory` (flags: engine.load_checkpoint's) and returns the state saved
    beside it."""
    directory = os.fspath(directory)
    loaded, client = engine.load_checkpoint(directory, **flags)
    if loaded is None:
        raise FileNotFoundError(f"{directory} holds no Tiers checkpoint (no `latest`)")
    name = (client or {}).get(STATE_FILE_KEY)
    if name is None:
        raise ValueError(f"{directory}: an engine checkpoint without Lightning's state (saved by engine.save_checkpoint"
                         "); load it with engine.load_checkpoint")
    return torch.load(os.path.join(directory, name), map_location="cpu", weights_only=bool(weights_only))
