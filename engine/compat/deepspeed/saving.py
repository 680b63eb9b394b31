"""The DeepSpeed engine's 16-bit saves: `save_16bit_model` (DeepSpeed's `pytorch_model.bin`, a torch.save of the
state dict) and `_zero3_consolidated_16bit_state_dict` (what accelerate saves under ZeRO-3)."""

from __future__ import annotations

import logging
import os

import torch

from engine import whole_weights
from engine.checkpoint import write_state_dict
from engine.engine import Engine

logger = logging.getLogger("DeepSpeed")


def sixteen_bit_state_dict(engine: Engine, exclude_frozen_parameters: bool = False) -> dict | None:
    """The whole model's state dict, parameters in the compute dtype, on rank 0 (None elsewhere); every rank must
    call it (stage 3 gathers)."""
    state = engine.full_state_dict(rank0_only=True)
    chunked = whole_weights.chunked_keys(engine.module, engine.chunked, engine.mesh)  # every stage's
    if engine.experts is not None:  # and every ep rank's experts
        chunked |= {k for k in state or {} if engine.experts.names_an_expert(k)}
    if state is None:
        return None
    if exclude_frozen_parameters:
        # frozen as the engine laid them out at initialize (Note [frozen chunks]), whatever requires_grad says now;
        # a parameter this rank holds in no chunk (another pipeline stage's) by its flag
        in_chunks, frozen_chunked = engine.chunked.param_chunk_index(), {id(p) for p in engine.chunked.frozen_params}
        frozen = {name for name, p in engine.module.named_parameters()
                  if (id(p) in frozen_chunked if id(p) in in_chunks else not p.requires_grad)}
        state = {k: v for k, v in state.items() if k not in frozen}
    dtype = engine.precision.compute_dtype
    return {k: v.to(dtype) if k in chunked else v for k, v in state.items()}


def consolidated_16bit_state_dict(engine: Engine, exclude_frozen_parameters: bool = False) -> dict | None:
    if engine.config.zero_optimization.stage != 3:
        raise ValueError("_zero3_consolidated_16bit_state_dict requires ZeRO-3 mode (as in DeepSpeed); under "
                         "stages 0-2 the parameters are whole: use engine.module.state_dict()")
    return sixteen_bit_state_dict(engine, exclude_frozen_parameters)


def save_16bit_model(engine: Engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """As DeepSpeed: under ZeRO-3 without stage3_gather_16bit_weights_on_model_save nothing is saved (logged,
    False); else rank 0 writes the file (safetensors for a `.safetensors` name, else torch.save), True."""
    path = os.path.join(save_dir, save_filename)
    zero = engine.config.zero_optimization
    if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        logger.warning(f"Did not save the model {path} because stage3_gather_16bit_weights_on_model_save is False "
                       "(as DeepSpeed); set it to true, or save a checkpoint and run `tiers convert`")
        return False
    state = sixteen_bit_state_dict(engine, exclude_frozen_parameters)
    if state is None:
        return True
    if save_filename.endswith(".safetensors"):
        write_state_dict(save_dir, save_filename, state)
        return True
    os.makedirs(save_dir, exist_ok=True)
    torch.save(state, path)
    return True
