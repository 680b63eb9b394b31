"""Whole weights from chunks: the full state dict, and parameters gathered for user code."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import CommCounter, all_gather_into, broadcast_from
from engine.zero.chunked_params import ChunkedParams
from engine.zero.param_gather import ParamGatherer


def full_state_dict(module: nn.Module, chunked: ChunkedParams, gatherer: ParamGatherer | None,
                    group: dist.ProcessGroup | None, counter: CommCounter,
                    keep: bool) -> dict[str, torch.Tensor] | None:
    """`module.state_dict()`'s keys with whole values copied to CPU (None where not `keep`). Parameters
    are read from their chunks one chunk at a time: their fp32 masters under bf16 / fp16 (Note [master
    weights]), gathered under stage 3 (Note [sharded parameters]); every rank must call this."""
    entries = module.state_dict(keep_vars=True)  # the tensors themselves: no read of released chunks
    from_chunks = chunked.masters is not None or gatherer is not None
    chunk_of = chunked.chunk_index() if from_chunks else {}
    by_chunk: dict[int, list[str]] = {}
    out = {}
    for key, tensor in entries.items():
        if id(tensor) in chunk_of:
            by_chunk.setdefault(chunk_of[id(tensor)], []).append(key)
        elif keep:
            out[key] = tensor.detach().to("cpu", copy=True)
    for index in sorted(by_chunk):
        with _chunk_values(chunked, gatherer, index, group, counter) as values_of:
            if keep:
                out.update({key: values_of(entries[key]).to("cpu", copy=True) for key in by_chunk[index]})
    return {key: out[key] for key in entries} if keep else None


@contextlib.contextmanager
def _chunk_values(chunked: ChunkedParams, gatherer: ParamGatherer | None, index: int,
                  group: dist.ProcessGroup | None, counter: CommCounter):
    """For the block: a function giving a parameter of chunk `index` its whole values."""
    if chunked.masters is None:
        with gatherer.gathered([index]):
            yield lambda p: p.detach()
        return
    with chunked.masters.master(index, writes=False) as shard:  # this rank's fp32 master (all of it unsharded)
        full = shard
        if chunked.sharded:
            full = torch.empty(shard.numel() * chunked.shard_count, dtype=shard.dtype, device=shard.device)
            all_gather_into(full, shard, group, counter, async_op=False)
        yield lambda p: chunked.master_values(p, full)


@contextlib.contextmanager
def gathered_parameters(params: list[nn.Parameter], chunked: ChunkedParams, gatherer: ParamGatherer | None,
                        group: dist.ProcessGroup | None, counter: CommCounter, modifier_rank: int | None,
                        distributed: bool):
    """Engine.gathered_parameters: the chunks of `params` held gathered through the block; with
    `modifier_rank`, that rank's values of them reach every rank (and their masters) on exit."""
    chunk_of = chunked.chunk_index() if gatherer is not None else {}
    chunks = sorted({chunk_of[id(p)] for p in params if id(p) in chunk_of})
    whole = [p for p in params if id(p) not in chunk_of]
    with gatherer.gathered(chunks) if chunks else contextlib.nullcontext():
        yield params
        if modifier_rank is not None and distributed:
            with torch.no_grad():
                for p in whole:
                    broadcast_from(p.data, modifier_rank, group, counter)
                payloads = chunked.param_payloads()
                for c in chunks:
                    broadcast_from(payloads[c], modifier_rank, group, counter)
                    chunked.sharded_params.refresh_shard(c)
    if modifier_rank is not None:
        chunked.resync_masters(params)
