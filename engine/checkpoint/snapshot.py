"""What one rank puts in a checkpoint: its tensors (chunk shards, optimizer states, extras, RNG) and a JSON record."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint.encoding import encode_spec, json_options, json_state
from engine.checkpoint.live_states import extra_entries
from engine.checkpoint.training_state import TrainingState
from engine.placement import Placement
from engine.tensor_parallel.rng import Stream
from engine.zero.chunk_state import ShardPlace


@dataclass
class RankSnapshot:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    record: dict = field(default_factory=dict)  # JSON: who wrote it, what it holds


def take_snapshot(run: TrainingState, placements: dict[str, Placement], copy: bool,
                  exclude_frozen: bool = False) -> RankSnapshot:
    """This rank's part of a checkpoint (Note [checkpoint layout]). copy=False keeps in-memory tensors as they are
    (a synchronous save writes them before training goes on); anything read from a chunk manager, a stage-3 shard
    view or the device is copied to CPU memory either way. exclude_frozen: frozen parameters are left out (their
    keys recorded as excluded; a load keeps the live values: Note [frozen chunks])."""
    mesh, chunked, states = run.mesh, run.chunked, run.live_states(placements)
    snap = RankSnapshot()
    snap.record = {"rank": mesh.world.rank, "cut_size": max((p.cut_size for p in placements.values()), default=1)}

    def keep(t: torch.Tensor, transient: bool) -> torch.Tensor:
        t = t.detach()
        return t.to("cpu", copy=True) if copy or transient or t.device.type != "cpu" else t

    tensor_states: list[str] = []
    scalar_states: list[str] = []
    saved_chunks: list[dict] = []
    offloaded_values = states.values_offloaded
    for i in range(len(states)):
        home = _saved_home(mesh, states.place(i))
        if home is None:
            continue
        saved = {"index": i, "numel": states.chunk_numel(i), "home": home[0], "shard": home[1]}
        if home[1] == 0:  # the chunk's members, once: by the rank saving its shard 0
            members = states.members(i)
            saved.update(cut_rank=_cut_rank(placements, members), members=[m.record() for m in members])
        saved_chunks.append(saved)
        with states.values(i, writes=False) as values:
            snap.tensors[f"chunk.{i}.param"] = keep(values, offloaded_values)
        with states.optimizer_state(i, writes=False) as state:
            for name, t in state.items():
                snap.tensors[f"chunk.{i}.optim.{name}"] = keep(t, states.offloaded)
                names = scalar_states if t.dim() == 0 else tensor_states
                if name not in names:
                    names.append(name)
    snap.record["chunks"] = saved_chunks
    # states of fewer or more entries than elements (Note [block-wise optimizer states]): how many per element
    entries = {name: str(ratio) for i in range(len(states))
               for name, (ratio, _) in (states.state_entries(i) or {}).items() if ratio != 1}
    snap.record["optimizer_states"] = {"tensor_states": tensor_states, "scalar_states": scalar_states,
                                       **({"entries": entries} if entries else {})}
    snap.record["keys"] = run.features.model_keys(list(run.module.state_dict(keep_vars=True)))  # the whole model's
    frozen = {} if exclude_frozen else run.frozen_values(keep=mesh.zero.rank == 0)  # (gathered on every rank: stage 3)
    if mesh.zero.rank == 0:
        extras, aliases = extra_entries(run.module, chunked)
        frozen_ids = {id(p) for s in chunked.frozen_states for p in s.params} if exclude_frozen else set()
        snap.record["excluded_frozen"] = sorted(k for k, t in extras.items() if id(t) in frozen_ids)
        extras = {k: t for k, t in extras.items() if id(t) not in frozen_ids}
        for key, t in extras.items():
            snap.tensors[f"extra.{key}"] = frozen[id(t)] if id(t) in frozen else keep(t, False)
        snap.record["extras"] = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                                     "cut_rank": placements[k].cut_rank if k in placements else 0}
                                 for k, t in extras.items()}
        snap.record["aliases"] = aliases
        # how the tensor-parallel ranks cut each tensor this stage holds (Note [placements])
        snap.record["tp_specs"] = {name: encode_spec(p.cut) for name, p in placements.items() if p.cut is not None}
        # per part of the model (Feature.stage): each part's optimizer has the param groups of the parameters it holds
        scheduler = run.lr_scheduler
        snap.record["part"] = {"index": run.features.stage()[0], "of": run.features.stage()[1],
                               "param_groups": [json_options(g) for g in run.optimizer.param_groups],
                               "lr_scheduler": None if scheduler is None else json_state("lr_scheduler",
                                                                                         scheduler.state_dict())}
    _rng(run, snap)
    return snap


def _saved_home(mesh, place: ShardPlace) -> tuple[int, int] | None:
    """(the global rank holding shard 0 of the chunk placed at `place`, this rank's shard) when this rank saves
    its part of that chunk; None when another rank saves the same values. A sharded chunk's shards are saved by the
    first copy (Note [hybrid sharding]: the other copies hold the same); a whole one by the first rank of the group
    it is reduced over (its own group, or the ZeRO group)."""
    if place.count > 1:
        group = place.group_or(mesh.shard.group)
        return (_global_rank(group, 0), place.rank) if mesh.in_first_copy else None
    group = place.group_or(mesh.zero.group)
    return (mesh.world.rank, 0) if _group_rank(group) == 0 else None


def _global_rank(group, rank: int) -> int:
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, rank) if dist.is_initialized() \
        else rank


def _group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _cut_rank(placements: dict[str, Placement], members: list) -> int:
    """The tensor-parallel piece a chunk's members are (every member of one rank's chunk is the same piece)."""
    return next((placements[m.name].cut_rank for m in members if m.name in placements), 0)


def _rng(run: TrainingState, snap: RankSnapshot) -> None:
    """Every generator a training step draws from, per rank: torch's CPU and device generators, the tensor-parallel
    per-rank stream (Note [tensor-parallel RNG]), Python's and NumPy's (a user's data pipeline may use them). The
    tensors are fresh (get_rng_state copies; the streams swap states, never mutate them): no copy is needed."""
    snap.tensors["rng.cpu"] = torch.get_rng_state()
    device = run.mesh.device
    if device.type == "cuda":
        snap.tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    for streams in run.features.generators():  # (one set: its keys are "rng.tp_sharded.<k>")
        live, saved, stack = streams.snapshot()
        if live is not Stream.REPLICATED or stack:
            raise RuntimeError("save_checkpoint was called inside a forward (a tensor-parallel RNG stream is switched "
                               "in); call it between steps")
        for k, state in enumerate(saved[Stream.SHARDED]):
            snap.tensors[f"rng.tp_sharded.{k}"] = state
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    snap.record["rng"] = {"python": [version, list(internal), gauss],
                          "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def restore_rng(run: TrainingState, tensor_of, record: dict) -> None:
    """The inverse of _rng, from this rank's own file of a checkpoint saved by the same world."""
    torch.set_rng_state(tensor_of("rng.cpu"))
    device = run.mesh.device
    if device.type == "cuda":
        torch.cuda.set_rng_state(tensor_of("rng.cuda"), device)
    for streams in run.features.generators():
        live, saved, stack = streams.snapshot()
        count = len(saved[Stream.SHARDED])
        streams.restore((live, {**saved, Stream.SHARDED: [tensor_of(f"rng.tp_sharded.{k}") for k in range(count)]},
                         stack))
    version, internal, gauss = record["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = record["rng"]["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
