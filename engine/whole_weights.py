"""Whole weights from chunks: the full state dict, and parameters gathered for user code."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from engine.comm import CommCounter, all_gather_into, broadcast_from
from engine.mesh import Mesh
from engine.zero.chunked_params import ChunkedParams
from engine.zero.param_gather import ParamGatherer


def check_loadable(given: dict, expected: dict, strict: bool) -> None:
    """nn.Module.load_state_dict's key and shape errors, raised before it copies any tensor (it copies the matching
    ones first, which would leave the parameters and their fp32 masters apart)."""
    mismatched = [f"{k}: {tuple(v.shape)} given, {tuple(expected[k].shape)} in the model"
                  for k, v in given.items() if k in expected and torch.is_tensor(v) and v.shape != expected[k].shape]
    missing, unexpected = sorted(expected.keys() - given.keys()), sorted(given.keys() - expected.keys())
    if mismatched or (strict and (missing or unexpected)):
        raise RuntimeError(f"load_state_dict: nothing was loaded; size mismatch {mismatched}, missing keys "
                           f"{missing if strict else []}, unexpected keys {unexpected if strict else []}")


def full_state_dict(module: nn.Module, chunked: ChunkedParams, gatherer: ParamGatherer,
                    group: dist.ProcessGroup | None, counter: CommCounter,
                    keep: bool, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
    """`module.state_dict()`'s keys with whole values copied to CPU (None where not `keep`). Parameters
    are read from their chunks one chunk at a time: their fp32 masters under bf16 / fp16 (Note [master
    weights]), gathered under stage 3 (Note [sharded parameters]), frozen ones too (Note [frozen chunks]); every
    rank must call this. trainable_only: the keys of parameters that train only (no frozen chunk is gathered)."""
    entries = module.state_dict(keep_vars=True)  # the tensors themselves: no read of released chunks
    if trainable_only:
        entries = {k: t for k, t in entries.items() if isinstance(t, nn.Parameter) and t.requires_grad}
    chunk_of = (chunked.param_chunk_index() if chunked.gathers_params
                else chunked.chunk_index() if chunked.has_masters else {})
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


def join_stages(local: dict[str, torch.Tensor], keys: tuple[str, ...], mesh: Mesh, counter: CommCounter,
                keep: bool) -> dict[str, torch.Tensor] | None:
    """Under a pipeline: the whole model's state dict, keyed and ordered as the unsplit model's (`keys`), from each
    pipeline rank's `local` one (its holder's keys: a tied weight comes from each stage under its own key). Each
    pipeline rank broadcasts its entries over its pipeline group in turn; with `keep` False on every rank of that
    group (rank0_only elsewhere than rank 0's group) nothing is sent."""
    group, device = mesh.pp.group, mesh.device
    if not keep and (mesh.zero.rank, mesh.tp.rank) != (0, 0):
        return None  # global rank 0's pipeline group is the one at dp rank 0, tp rank 0
    out = dict(local)
    for src in range(mesh.pp.size):
        mine = src == mesh.pp.rank
        header = [[(k, tuple(t.shape), t.dtype) for k, t in local.items()] if mine else None]
        dist.broadcast_object_list(header, group=group, group_src=src, device=device)
        for key, shape, dtype in header[0]:
            t = local[key].to(device, copy=True) if mine else torch.empty(shape, dtype=dtype, device=device)
            broadcast_from(t, src, group, counter)
            if keep and not mine:
                out.setdefault(key, t.to("cpu"))
    # in the unsplit model's order; then what a feature joined before this one added (other ep ranks' experts)
    return {**{key: out[key] for key in keys}, **out} if keep else None


def chunked_keys(module: nn.Module, chunked: ChunkedParams, mesh: Mesh) -> set[str]:
    """The state-dict keys of parameters held in chunks (trainable), of every pipeline stage's model."""
    index = chunked.chunk_index()
    keys = {key for key, t in module.state_dict(keep_vars=True).items() if id(t) in index}
    if mesh.pp.size == 1:
        return keys
    every: list = [None] * mesh.pp.size
    dist.all_gather_object(every, keys, group=mesh.pp.group)
    return set().union(*every)


@contextlib.contextmanager
def _chunk_values(chunked: ChunkedParams, gatherer: ParamGatherer, index: int,
                  group: dist.ProcessGroup | None, counter: CommCounter):
    """For the block: a function giving a parameter of chunk `index` its whole values."""
    if not chunked.has_masters or chunked.all_states[index].frozen:  # a frozen chunk has no master
        with gatherer.gathered([index]):
            yield lambda p: p.detach()
        return
    with chunked.masters.master(index, writes=False) as shard:  # this rank's fp32 master (all of it unsharded)
        full = shard
        place = chunked.states[index].place
        if place.count > 1:
            full = torch.empty(shard.numel() * place.count, dtype=shard.dtype, device=shard.device)
            all_gather_into(full, shard, place.group_or(group), counter, async_op=False)
        yield lambda p: chunked.master_values(p, full)


def _modifier(place, modifier_rank: int, group: dist.ProcessGroup | None) -> tuple[int, dist.ProcessGroup | None]:
    """(the group rank whose values win, the group) for a tensor reduced over `place`'s group: the data-parallel
    group and `modifier_rank`; an expert chunk's own group (Note [expert parallelism]) and its member in the
    modifier's place there (the ranks of ep rank e's group are e, e + ep, ...: group rank modifier_rank // ep)."""
    if place is None or place.group is None:
        return modifier_rank, group
    ep = dist.get_world_size(group) // dist.get_world_size(place.group)
    return modifier_rank // ep, place.group


@contextlib.contextmanager
def gathered_parameters(params: list[nn.Parameter], chunked: ChunkedParams, gatherer: ParamGatherer,
                        group: dist.ProcessGroup | None, counter: CommCounter, modifier_rank: int | None,
                        distributed: bool):
    """Engine.gathered_parameters: the chunks of `params` held gathered through the block; with
    `modifier_rank`, that rank's values of them reach every rank (and their masters) on exit."""
    index = chunked.param_chunk_index()  # frozen parameters too (Note [frozen chunks])
    chunk_of = index if chunked.gathers_params else {}
    chunks = sorted({chunk_of[id(p)] for p in params if id(p) in chunk_of})
    whole = [p for p in params if id(p) not in chunk_of]
    with gatherer.gathered(chunks) if chunks else contextlib.nullcontext():
        yield params
        if modifier_rank is not None:
            with torch.no_grad():
                for p in whole if distributed else []:
                    place = chunked.all_states[index[id(p)]].place if id(p) in index else None
                    broadcast_from(p.data, *_modifier(place, modifier_rank, group), counter)
                payloads = chunked.param_payloads()
                for c in chunks:
                    if distributed:
                        broadcast_from(payloads[c], *_modifier(chunked.all_states[c].place, modifier_rank, group),
                                       counter)
                    chunked.sharded_params.refresh_shard(c)  # one rank paging too: the shard keeps the edit
    if modifier_rank is not None:
        chunked.resync_masters(params)
