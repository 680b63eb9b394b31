"""deepspeed.runtime.zero.partition_parameters: ZeroParamStatus, and the ZeRO-3 marks DeepSpeed puts on each
parameter (`ds_id`, `ds_shape`, `ds_numel`, `ds_status`), which RLHF frameworks' save and EMA code read to decide
what to gather.

Note [ds_status of a stage-3 parameter]
Tiers gathers chunks, not parameters, and keeps no per-parameter status. `ds_status` is kept so that it says
AVAILABLE only where the values are readable: a parameter of a persistent chunk (below
stage3_param_persistence_threshold) is AVAILABLE; any other is NOT_AVAILABLE between passes (the gatherer
releases every chunk when a pass ends) and AVAILABLE inside deepspeed.zero.GatheredParameters. Inside a forward
it may say NOT_AVAILABLE of a gathered parameter, which only makes a script gather what is there already.
"""

from __future__ import annotations

import enum

from torch import nn


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # whole values readable
    NOT_AVAILABLE = 2  # this rank holds its shard only
    INFLIGHT = 3  # being gathered


def mark_parameters(engine) -> None:
    """Under ZeRO-3, DeepSpeed's marks on every sharded parameter of `engine` (a Tiers Engine), frozen ones too
    (Note [frozen chunks])."""
    chunked = engine.chunked
    if not chunked.gathers_params:
        return
    chunk_of = chunked.param_chunk_index()
    for ds_id, p in enumerate(chunked.params + chunked.frozen_params):
        p.ds_id, p.ds_shape, p.ds_numel = ds_id, p.shape, p.numel()
        persistent = chunked.all_states[chunk_of[id(p)]].persistent
        p.ds_status = ZeroParamStatus.AVAILABLE if persistent else ZeroParamStatus.NOT_AVAILABLE


def mark_available(params: list[nn.Parameter]) -> list:
    """Inside GatheredParameters: AVAILABLE; returns the statuses to put back on exit."""
    before = [getattr(p, "ds_status", None) for p in params]
    for p in params:
        if hasattr(p, "ds_id"):
            p.ds_status = ZeroParamStatus.AVAILABLE
    return before


def restore(params: list[nn.Parameter], before: list) -> None:
    for p, status in zip(params, before):
        if status is not None:
            p.ds_status = status
