"""engine.load_checkpoint: a checkpoint's states into this engine, whatever layout saved it.

Loading is planned before anything changes (Note [reading a checkpoint anywhere]): every rank
checks the names and shapes it needs and verifies the files it will read, the ranks agree that all
of them succeeded, and only then is state overwritten — a damaged file fails the load on every
rank with the engine untouched. The values are written into this rank's stepped range of each
chunk (fp32: the masters under bf16 / fp16), the optimizer states beside them, and the full chunks
are all-gathered as after an update; so the same layout reads back bit for bit what it wrote.
"""

from __future__ import annotations

import math
import os
import warnings
from fractions import Fraction

import torch

from engine.checkpoint.encoding import TENSOR_REF, decode_client_state, restore_options
from engine.checkpoint.files import CheckpointError, CheckpointIntegrityError
from engine.checkpoint.live_states import Member, extra_entries
from engine.checkpoint.reader import Checkpoint, Piece, PieceReader, read_latest
from engine.checkpoint.saver import Control, _optimizer_name
from engine.checkpoint.snapshot import restore_rng
from engine.checkpoint.training_state import TrainingState
from engine.placement import Placement
from engine.zero.chunked_params import REBUILD_TO_CHANGE_WHAT_TRAINS as _REBUILD


class LoadPlan:
    """What this rank reads for each of its chunks and extras, checked against the checkpoint."""

    def __init__(self, run: TrainingState, checkpoint: Checkpoint, with_optimizer: bool):
        self.run, self.checkpoint = run, checkpoint
        self.placements = run.placements()  # Note [placements]
        self.states = run.live_states(self.placements)
        self.with_optimizer = with_optimizer and bool(checkpoint.tensor_states or checkpoint.scalar_states)
        if self.with_optimizer:
            live = _optimizer_name(run.optimizer)
            if live != checkpoint.layout["optimizer"]:
                raise CheckpointError(f"{checkpoint.directory} holds {checkpoint.layout['optimizer']} states and this "
                                      f"engine's optimizer is {live}; use the same optimizer, or load with "
                                      "load_optimizer_states=False")
        self.members: list[list[tuple[Member, int, int]]] = []  # per chunk: (member, lo, hi) in chunk elements
        live_names = set()
        for j in range(len(self.states)):
            for m in self.states.members(j):
                live_names.add(m.name)
                self._check_shape(m.name, m.whole_shape)
            self.members.append(self.states.stepped_members(j))
        extras, _ = extra_entries(run.module, run.chunked)
        # left out of an adapter-only save (exclude_frozen_parameters): the live frozen values stay
        self.extras = extras = {k: t for k, t in extras.items() if k not in checkpoint.excluded_frozen}
        if checkpoint.excluded_frozen:
            warnings.warn(f"load_checkpoint: {checkpoint.directory} was saved with exclude_frozen_parameters; its "
                          f"{len(checkpoint.excluded_frozen)} frozen parameters keep this engine's values, so build it "
                          "on the same pretrained base as the engine that saved it", stacklevel=2)
        self._check_trainability(live_names, set(extras))
        self._check_names("parameter", live_names, set(checkpoint.param_names()))
        self._check_names("buffer or frozen parameter", set(extras), set(checkpoint.extras[0]))
        self._check_names("state-dict key", set(run.features.model_keys(list(run.module.state_dict(keep_vars=True)))),
                          set(checkpoint.manifest["state_dict_keys"]))
        # per chunk: its tensor states by name, (entries per element, dtype) (Note [block-wise optimizer states])
        self.kinds: list[dict[str, tuple[Fraction, torch.dtype]]] = []
        if self.with_optimizer:
            self.kinds = self._state_kinds()
        self.files = self._files()

    def _state_kinds(self) -> list[dict[str, tuple[Fraction, torch.dtype]]]:
        """Each chunk's tensor states as the live optimizer keeps them, checked against the checkpoint's."""
        ckpt, states = self.checkpoint, self.states
        told = [states.state_entries(j) for j in range(len(states))]
        saved = {k: (Fraction(1), torch.float32) for k in ckpt.tensor_states}
        kinds = [t if t is not None else saved for t in told]
        live = set().union(*kinds) if kinds else set()
        scalars = set(ckpt.scalar_states)
        if states.offloaded and len(states):
            with states.optimizer_state(0, writes=False) as state:
                scalars = {k for k, v in state.items() if v.dim() == 0}
        if live != set(ckpt.tensor_states) or scalars != set(ckpt.scalar_states):
            raise CheckpointError(f"{ckpt.directory} holds the optimizer states "
                                  f"{ckpt.tensor_states + ckpt.scalar_states} and this optimizer keeps "
                                  f"{sorted(live | scalars)}; use the same optimizer, or load with "
                                  "load_optimizer_states=False")
        for name, (ratio, _) in {k: v for t in kinds for k, v in t.items()}.items():
            if ckpt.state_entries.get(name, Fraction(1)) != ratio:
                raise CheckpointError(f"{ckpt.directory} holds {ckpt.state_entries.get(name, 1)} entries of the "
                                      f"optimizer state {name} per parameter element and this optimizer {ratio} "
                                      "(another block_size); use the same optimizer params, or load with "
                                      "load_optimizer_states=False")
        return kinds

    def _check_trainability(self, trainable: set[str], extras: set[str]) -> None:
        """Note [frozen chunks]: a parameter that trains here and was frozen when saved (or the other way round) is
        laid out differently (a chunk member with optimizer states, or a whole extra): refused, naming the way."""
        saved_params, saved_extras = set(self.checkpoint.param_names()), set(self.checkpoint.extras[0])
        unfrozen, frozen = sorted(trainable & saved_extras), sorted(extras & saved_params)
        if unfrozen or frozen:
            raise CheckpointError(
                f"{self.checkpoint.directory} was saved with other parameters frozen: trainable here but frozen in the "
                f"checkpoint: {unfrozen[:5] or 'none'}; frozen here but trainable in the checkpoint: "
                f"{frozen[:5] or 'none'}. A checkpoint loads into an engine training the same parameters; to change "
                f"what trains: {_REBUILD}")

    def _check_names(self, what: str, live: set[str], saved: set[str]) -> None:
        """`live` against the checkpoint's `saved`, less the names other ranks hold (another stage's, experts)."""
        held_elsewhere = self.run.features.held_elsewhere
        missing = sorted(live - saved)
        unexpected = sorted(n for n in saved - live if not held_elsewhere(n))
        if missing or unexpected:
            raise CheckpointError(
                f"{self.checkpoint.directory} does not fit this model: {what}s missing from the checkpoint: "
                f"{missing[:5] or 'none'}; in the checkpoint but not in the model: {unexpected[:5] or 'none'}. Build "
                "the same model (and tensor-parallel plan) that saved it")

    def direct(self, name: str) -> Placement | None:
        """The saved piece `name`'s live placement reads as it is (Note [reading a checkpoint anywhere]): one cut
        the same way; None when the cuts differ (read whole, cut as this rank cuts it)."""
        live = self.placements[name]
        saved = self.checkpoint.piece_like(live)
        return saved if saved.cut_key() == live.cut_key() else None

    def _check_shape(self, name: str, live_shape: tuple[int, ...]) -> None:
        ckpt = self.checkpoint
        if not ckpt.has_param(name):
            return  # reported by _check_names
        same = self.direct(name)
        if same is not None:
            saved = ckpt.local_shape(name, same.cut_rank)
        else:  # the whole tensor's shape from the saved pieces (meta tensors: no data), cut as this run cuts it
            pieces = [torch.empty(ckpt.local_shape(name, p.cut_rank), device="meta") for p in ckpt.pieces_of_cut(name)]
            whole = ckpt.cuts[name].join(pieces) if name in ckpt.cuts else pieces[0]
            try:
                saved = tuple(self.placements[name].take(whole).shape)
            except ValueError as e:
                raise CheckpointError(f"{ckpt.directory}: {e}") from None
        if tuple(saved) != tuple(live_shape):
            raise CheckpointError(f"{ckpt.directory}: parameter {name} has shape {tuple(saved)} in the checkpoint (as "
                                  f"this rank cuts it) and {tuple(live_shape)} in the model; build the same model")

    def _kinds(self, j: int) -> list[str]:
        return ["param"] + (list(self.kinds[j]) if self.with_optimizer else [])

    def _ratio(self, j: int, kind: str) -> Fraction:
        return self.kinds[j][kind][0] if kind != "param" else Fraction(1)

    def _sources(self, name: str) -> list[Placement]:
        """The saved cut pieces `name` is read from: its own, or every one."""
        same = self.direct(name)
        return [same] if same is not None else self.checkpoint.pieces_of_cut(name)

    def _ranges(self, m: Member, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(saved cut piece, start, stop) of the elements chunk range [lo, hi) of `m` is read from: its own range of
        the piece cut alike, or the whole of every saved cut piece."""
        same, ckpt = self.direct(m.name), self.checkpoint
        if same is not None:
            return [(same.cut_rank, *m.span(lo, hi))]
        return [(s.cut_rank, 0, math.prod(ckpt.local_shape(m.name, s.cut_rank))) for s in self._sources(m.name)]

    def _files(self) -> set[str]:
        ckpt, files = self.checkpoint, set()
        for j, mine in enumerate(self.members):
            for m, lo, hi in mine:
                for kind in self._kinds(j):
                    files.update(p.file for piece, a, b in self._ranges(m, lo, hi)
                                 for p in ckpt.pieces(m.name, kind, piece, a, b, self._ratio(j, kind)))
        for j in range(len(self.states)) if self.with_optimizer else ():
            first = self.states.members(j)[0].name
            files.update(ckpt.scalar_piece(first, s, self.scalar_source(first)).file for s in ckpt.scalar_states)
        files.update(ckpt.extra_piece(key, s.cut_rank).file for key in self.extras for s in self._sources(key))
        return files

    def scalar_source(self, name: str) -> int:
        """The saved cut piece whose chunk holding `name` gives the chunk's scalar states (any has them)."""
        return self.checkpoint.piece_like(self.placements[name]).cut_rank

    # ---- execution ---------------------------------------------------------------------------
    def execute(self, reader: PieceReader) -> None:
        ckpt, states = self.checkpoint, self.states
        cache: dict[tuple[str, str], torch.Tensor] = {}

        def read(name: str, kind: str, a: int, b: int, out: torch.Tensor, ratio: Fraction = Fraction(1)) -> None:
            same = self.direct(name)
            if same is not None:
                reader.into(ckpt.pieces(name, kind, same.cut_rank, a, b, ratio), out)
                return
            if ratio != 1:  # (block-wise states are refused with tensor parallelism)
                raise CheckpointError(f"{ckpt.directory}: the optimizer state {kind} of {name} is block-wise and was "
                                      "cut otherwise; load it under the tensor-parallel layout that saved it")
            if (name, kind) not in cache:
                cache.clear()  # one parameter at a time
                cache[(name, kind)] = self.placements[name].take(reader.whole(name, kind)).reshape(-1)
            out.copy_(cache[(name, kind)][a:b])

        loaded_states: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for j, mine in enumerate(self.members):
                start, n = states.stepped_range(j)
                with states.values(j, writes=True) as values:
                    values.zero_()  # the padding
                    for m, lo, hi in mine:
                        read(m.name, "param", *m.span(lo, hi), values.narrow(0, lo - start, hi - lo))
                if self.with_optimizer:
                    loaded_states[j] = self._optimizer_state(j, mine, start, n, read, reader)
            if self.with_optimizer and not states.offloaded:
                states.install_optimizer_states(loaded_states)
            rounded: dict[tuple[torch.dtype, torch.dtype], int] = {}  # (saved, live) dtype -> frozen parameters
            in_chunks = self.run.chunked.param_chunk_index()
            _requantized_rows(self.run.chunked.all_states)  # counted from here on
            for key, tensor in self.extras.items():
                same = self.direct(key)
                if same is not None:
                    value = reader.tensor(ckpt.extra_piece(key, same.cut_rank))
                else:
                    value = self.placements[key].take(reader.whole_extra(key))
                if id(tensor) in in_chunks and value.dtype.itemsize > tensor.dtype.itemsize:
                    rounded[(value.dtype, tensor.dtype)] = rounded.get((value.dtype, tensor.dtype), 0) + 1
                self.run.load_extra(tensor, value)  # a frozen parameter into its chunk (Note [frozen chunks])
            _warn_rounded(ckpt.directory, rounded)
            _warn_requantized(ckpt.directory, self.run.chunked.all_states)
            self.run.chunked.sharded_params.settle_frozen()
            states.finish_loading()

    def _optimizer_state(self, j: int, mine, start: int, n: int, read, reader: PieceReader) -> dict[str, torch.Tensor]:
        ckpt, states = self.checkpoint, self.states
        first = states.members(j)[0].name  # also when this rank's range of the chunk is only padding
        scalars = {s: reader.tensor(ckpt.scalar_piece(first, s, self.scalar_source(first))) for s in ckpt.scalar_states}
        def into(tensor: torch.Tensor, kind: str, ratio: Fraction) -> None:  # entries of elements [lo, hi)
            for m, lo, hi in mine:
                read(m.name, kind, *m.span(lo, hi), tensor.narrow(0, int((lo - start) * ratio), int((hi - lo) * ratio)),
                     ratio)

        if states.offloaded:  # written in place, wherever the chunk lives
            with states.optimizer_state(j, writes=True) as live:
                for kind, (ratio, _) in self.kinds[j].items():
                    live[kind].zero_()
                    into(live[kind], kind, ratio)
                for s, value in scalars.items():
                    live[s].copy_(value)
            return {}
        out = {}
        for kind, (ratio, dtype) in self.kinds[j].items():
            out[kind] = torch.zeros(int(n * ratio), dtype=dtype)
            into(out[kind], kind, ratio)
        return {**out, **scalars}


def load_checkpoint(run: TrainingState, control: Control, load_dir: str, tag: str | None, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, load_module_only: bool):
    """Returns (the checkpoint's path, its client_state), or (None, None) when load_dir has no `latest`."""
    load_dir = os.path.abspath(load_dir)
    if tag is None:
        found = None
        if control.rank == 0:
            try:
                found = ("ok", read_latest(load_dir))
            except (CheckpointError, OSError) as e:
                found = ("error", str(e))
        status, value = control.gather(found)[0]
        if status == "error":
            raise CheckpointError(value)
        if value is None:
            warnings.warn(f"load_checkpoint: {load_dir} has no '{'latest'}' file, so nothing was loaded; pass a tag to "
                          "load a particular checkpoint", stacklevel=3)
            return None, None
        tag = value
    directory = os.path.join(load_dir, str(tag))
    with_optimizer = load_optimizer_states and not load_module_only
    error, plan, reader = None, None, None
    try:
        checkpoint = Checkpoint(directory)
        plan = LoadPlan(run, checkpoint, with_optimizer)
        stage = _stage_entries(run, checkpoint, not load_module_only and load_optimizer_states,
                               not load_module_only and load_lr_scheduler_states)
        reader = PieceReader(checkpoint)
        own = checkpoint.rank_file(run.mesh.world.rank) if _same_world(run, checkpoint) else None
        reader.verify(plan.files | ({own} if own and not load_module_only else set()) | _client_files(checkpoint))
    except (CheckpointError, OSError) as e:
        error = (type(e).__name__, f"rank {control.rank}: {e}" if control.world > 1 else str(e))
    _agree(control, error)
    try:  # planned and verified: a failure now is unexpected, and the ranks still agree before any collective
        plan.execute(reader)
        if not load_module_only:
            _restore_training_state(run, checkpoint, reader, stage, own)
        error = None
    except Exception as e:
        error = (type(e).__name__, f"rank {control.rank}: loading {directory} failed part-way ({e}); the engine's "
                                   "state is partly overwritten: build the engine again before training")
    _agree(control, error)
    run.gather_updated_params()  # the full chunks from the loaded shards, as after an update
    manifest = checkpoint.manifest
    client = decode_client_state(manifest["client_state"],
                                 lambda key: reader.tensor(Piece(checkpoint.rank_file(0), key, 0, 0, 0)))
    reader.close()
    return directory, client


def _agree(control: Control, error: tuple[str, str] | None) -> None:
    """Every rank raises the first rank's failure, as its type (a damaged file: CheckpointIntegrityError)."""
    errors = [e for e in control.gather(error) if e]
    if errors:
        kind, message = errors[0]
        raise (CheckpointIntegrityError if kind == CheckpointIntegrityError.__name__ else CheckpointError)(message)


def _same_world(run: TrainingState, checkpoint: Checkpoint) -> bool:
    """The same ranks on the same kind of device: each rank can take its own generators back."""
    mesh = run.mesh
    return checkpoint.same_world(mesh.sizes(), mesh.device.type)


def _client_files(checkpoint: Checkpoint) -> set[str]:
    return {checkpoint.rank_file(0)} if _has_tensor_refs(checkpoint.manifest["client_state"]) else set()


def _has_tensor_refs(value) -> bool:
    if isinstance(value, dict):
        return TENSOR_REF in value or any(_has_tensor_refs(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_tensor_refs(v) for v in value)
    return False


def _stage_entries(run: TrainingState, checkpoint: Checkpoint, optimizer_states: bool,
                   scheduler_states: bool) -> dict:
    """The param groups' options and the scheduler's state this rank restores (None: not restored). A pipeline
    stage's optimizer has the param groups of the parameters it holds, so the checkpoint keeps them per stage:
    under the same number of stages each rank takes its own stage's; otherwise every saved stage must agree."""
    stage, stages = run.features.stage()
    out = {"param_groups": None, "lr_scheduler": None}
    saved_stages = len(checkpoint.stages("param_groups"))
    for key, wanted in (("param_groups", optimizer_states), ("lr_scheduler", scheduler_states)):
        entries = checkpoint.stages(key)
        if not wanted:
            continue
        if len(entries) == stages:
            out[key] = entries[stage]
        elif all(e == entries[0] for e in entries):
            out[key] = entries[0]
        else:
            raise CheckpointError(
                f"{checkpoint.directory}: its {len(entries)} pipeline stages saved different {key} (param "
                f"groups that only some stages hold), which cannot be divided among {stages} stages yet; load "
                f"it under pipeline.stages {len(entries)}, or pass load_optimizer_states=False and "
                "load_lr_scheduler_states=False")
    saved, live = out["param_groups"], run.optimizer.param_groups
    if saved is None or len(saved) == len(live):
        return out
    if all(g == saved[0] for g in saved):  # one set of options (one group regrouped): every live group takes it
        out["param_groups"] = [saved[0]] * len(live)
        return out
    if max(saved_stages, stages) > 1:
        raise CheckpointError(
            f"{checkpoint.directory}: this pipeline stage's optimizer has {len(live)} param groups and the checkpoint "
            f"{len(saved)} with different options, so which is which is unknown; load it under the pipeline.stages "
            f"it was saved with ({saved_stages}), or pass load_optimizer_states=False")
    raise CheckpointError(
        f"{checkpoint.directory}: the optimizer has {len(live)} param groups and the checkpoint {len(saved)} with "
        "different options (a ZeRO stage, persistence threshold, precision or optimizer other than the saving run's "
        "groups its parameters otherwise), so which is which is unknown; load it under the settings it was saved "
        "with, or pass load_optimizer_states=False")


def _restore_training_state(run: TrainingState, checkpoint: Checkpoint, reader: PieceReader, stage: dict,
                            own: str | None) -> None:
    manifest = checkpoint.manifest
    counters = manifest["engine"]
    run.progress.global_step, run.progress.micro_step = counters["global_step"], counters["micro_step"]
    run.progress.skipped_steps = counters["skipped_steps"]
    run.loss_scaler.load_state_dict(manifest["loss_scaler"])
    for group, saved in zip(run.optimizer.param_groups, stage["param_groups"] or []):
        restore_options(group, saved)
    if stage["lr_scheduler"] is not None and run.lr_scheduler is not None:
        run.lr_scheduler.load_state_dict(stage["lr_scheduler"])
    if own is not None:  # the same world: each rank's own generators (another world starts its streams afresh)
        record = manifest["ranks"][run.mesh.world.rank]
        restore_rng(run, lambda key: reader.tensor(Piece(own, key, 0, 0, 0)), record)


def _warn_rounded(directory, rounded: dict[tuple[torch.dtype, torch.dtype], int]) -> None:
    """Note [frozen chunks]: frozen chunks hold the compute dtype, so wider saved frozen values are rounded; say so."""
    for (saved, live), count in rounded.items():
        warnings.warn(f"load_checkpoint: {count} frozen parameters of {directory} were saved in {saved} and are "
                      f"loaded rounded to {live}: frozen parameters are kept in the compute dtype (bf16 / fp16), "
                      "as the trainable ones' working copies are", stacklevel=3)


def _requantized_rows(states) -> int:
    """Rows of int8 chunks quantized again since the last call (Note [int8 frozen chunks]); the counts restart."""
    rows = 0
    for state in states:
        if state.int8 is not None:
            rows, state.int8.requantized_rows = rows + state.int8.requantized_rows, 0
    return rows


def _warn_requantized(directory, states) -> None:
    """Note [int8 frozen chunks]: frozen values loaded into int8 chunks that no scale reproduces were quantized
    again, and differ from the saved ones; say so."""
    rows = _requantized_rows(states)
    if rows:
        warnings.warn(f"load_checkpoint: {rows} rows of int8 frozen weights (quantize_frozen \"int8\") in "
                      f"{directory} are no int8 image of this engine's scales and were quantized again, so they "
                      "differ from the saved ones by up to a rounding step; build the engine from the same "
                      "pretrained weights as the saving run to resume exactly", stacklevel=3)
