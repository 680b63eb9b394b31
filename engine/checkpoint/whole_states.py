"""Optimizer states (and weights) as whole tensors by name, out of a checkpoint and into a live engine.

Note [whole optimizer states]
Other frameworks' optimizer files (ColossalAI's `save_optimizer`, a torch `optimizer.state_dict()`) hold one entry
per parameter: its whole state tensors (Adam's exp_avg, exp_avg_sq) in the parameter's shape and a "step". Tiers
keeps them per chunk, cut by tensor parallelism and sharded by ZeRO. Out: a checkpoint already records every piece
with its placement (Note [checkpoint layout]), so its reader joins each state whole (`read_whole_states`). In: each
rank takes its placement's piece of every whole state and writes the elements of its stepped range of each chunk,
as a checkpoint load does (Note [reading a checkpoint anywhere]); a chunk's scalar states come from its first
member. Whole weights (a state dict) load the same way into a model however its layers are split
(`load_whole_weights`): the parameters into the stepped ranges (the fp32 masters), the buffers and frozen parameters
whole or cut as their placements say, then the chunks gathered as after an update. Every name and shape is checked
before anything is written. A rank holding part of the model (a pipeline stage, some experts) takes the tensors it
holds and leaves the others' to them.
"""

from __future__ import annotations

import torch

from engine.checkpoint.files import CheckpointError
from engine.checkpoint.live_states import extra_entries
from engine.checkpoint.reader import Checkpoint, PieceReader
from engine.checkpoint.training_state import TrainingState

WholeStates = dict[str, dict[str, torch.Tensor]]  # parameter name -> state name -> whole tensor (scalars 0-dim)


def read_whole_states(directory: str) -> WholeStates:
    """Every parameter's optimizer states in the checkpoint at `directory`, whole."""
    checkpoint = Checkpoint(directory)
    reader = PieceReader(checkpoint)
    try:
        out = {}
        for name in checkpoint.param_names():
            first = checkpoint.pieces_of_cut(name)[0].cut_rank
            out[name] = {kind: reader.whole(name, kind).clone() for kind in checkpoint.tensor_states}
            out[name].update({s: reader.tensor(checkpoint.scalar_piece(name, s, first))
                              for s in checkpoint.scalar_states})
        return out
    finally:
        reader.close()


def load_whole_states(run: TrainingState, whole: WholeStates) -> None:
    """`whole` into the live optimizer: this rank's piece of each state, checked first (Note [whole optimizer
    states])."""
    placements = run.placements()
    states = run.live_states(placements)
    tensors = _live_tensor_states(states)
    pieces = _pieces(states, whole, tensors, placements)
    loaded: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for j in range(len(states)):
            start, n = states.stepped_range(j)
            out = {kind: torch.zeros(n) for kind in tensors}
            for m, lo, hi in states.stepped_members(j):
                a, b = m.span(lo, hi)
                for kind in tensors:
                    out[kind][lo - start:hi - start].copy_(pieces[m.name][kind][a:b])
            first = states.members(j)[0].name  # also when this rank's range of the chunk is only padding
            out["step"] = torch.as_tensor(whole[first]["step"], dtype=torch.float32).clone()
            if states.offloaded:  # written in place, wherever the chunk lives
                with states.optimizer_state(j, writes=True) as live:
                    for kind, value in out.items():
                        live[kind].copy_(value)
            else:
                loaded[j] = out
        if not states.offloaded:
            states.install_optimizer_states(loaded)


def _live_tensor_states(states) -> list[str]:
    """The tensor states the live optimizer keeps (fp32, one entry per element: Adam's)."""
    entries = [states.state_entries(j) for j in range(len(states))]
    if any(e is not None and any(ratio != 1 or dtype != torch.float32 for ratio, dtype in e.values())
           for e in entries):
        raise CheckpointError("whole optimizer states load into fp32 states of one entry per element; this optimizer "
                              "keeps block-wise or 16-bit states (an 8/4-bit optimizer, bf16 states): save and load "
                              "a Tiers checkpoint instead")
    return sorted({k for e in entries if e is not None for k in e}) or ["exp_avg", "exp_avg_sq"]


def _pieces(states, whole: WholeStates, tensors: list[str], placements) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's piece of each state of every parameter it holds, flat; every name and shape checked."""
    members = {m.name: m for j in range(len(states)) for m in states.members(j)}
    missing = sorted(set(members) - set(whole))
    if missing:
        raise CheckpointError(f"the optimizer states given hold no entry for {len(missing)} parameter(s) this engine "
                              f"trains: {missing[:5]}; load states saved from the same model")
    out = {}
    for name, m in members.items():
        absent = [k for k in [*tensors, "step"] if k not in whole[name]]
        if absent:
            raise CheckpointError(f"the optimizer states of {name} lack {absent} (they hold {sorted(whole[name])}); "
                                  "load states of the same optimizer")
        out[name] = {}
        for kind in tensors:
            try:
                piece = placements[name].take(whole[name][kind])
            except ValueError as e:
                raise CheckpointError(f"the optimizer state {kind} of {name}: {e}") from None
            if tuple(piece.shape) != m.whole_shape:
                raise CheckpointError(f"the optimizer state {kind} of {name} has shape {tuple(whole[name][kind].shape)}"
                                      f", which does not fit the parameter; load states saved from the same model")
            out[name][kind] = piece.float().reshape(-1)
    return out


def load_whole_weights(run: TrainingState, state: dict[str, torch.Tensor], strict: bool) -> None:
    """A whole model's state dict into the live chunks and extras of this rank, each its placement's piece; keys
    another rank holds (another stage's, other experts) are left to it. strict: every key this rank holds is given,
    and every key given is held by some rank."""
    placements = run.placements()
    states = run.live_states(placements)
    members = {m.name: m for j in range(len(states)) for m in states.members(j)}
    extras, aliases = extra_entries(run.module, run.chunked)  # aliases: a tied weight's other keys, loaded once
    held = set(members) | set(extras)
    missing = sorted(held - set(state) - {aliases.get(k, k) for k in state})
    unexpected = sorted(k for k in set(state) - held - set(aliases) if not run.features.held_elsewhere(k))
    if strict and (missing or unexpected):
        raise ValueError(f"load_model: the state dict does not fit the model: missing {missing[:5] or 'none'}, "
                         f"unexpected {unexpected[:5] or 'none'}; load the same model's weights, or strict=False")
    state = {**{aliases[k]: v for k, v in state.items() if k in aliases and aliases[k] not in state}, **state}
    pieces = {}
    for name in sorted(held & set(state)):
        try:
            piece = placements[name].take(state[name])
        except ValueError as e:
            raise ValueError(f"load_model: {e}") from None
        expected = members[name].whole_shape if name in members else tuple(extras[name].shape)
        if tuple(piece.shape) != tuple(expected):
            raise ValueError(f"load_model: {name} has shape {tuple(state[name].shape)}, which does not fit the model's "
                             f"parameter; load the same model's weights")
        pieces[name] = piece
    with torch.no_grad():
        for j in range(len(states)):
            start, _ = states.stepped_range(j)
            with states.values(j, writes=True) as values:
                for m, lo, hi in states.stepped_members(j):
                    if m.name in pieces:
                        a, b = m.span(lo, hi)
                        values.narrow(0, lo - start, hi - lo).copy_(pieces[m.name].reshape(-1)[a:b])
        for key, tensor in extras.items():
            if key in pieces:
                run.load_extra(tensor, pieces[key])
        run.chunked.sharded_params.settle_frozen()
        states.finish_loading()
    run.gather_updated_params()
