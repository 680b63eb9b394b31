"""`zero_init`: build a model without materializing its full parameters on any rank.

Note [zero_init]
    with zero_init():
        model = Build()                 # every parameter is recorded, none holds memory
    engine = initialize(model, config)  # each rank materializes its shards of rank 0's model

Inside the block, every parameter a module registers is swapped for a meta-device parameter of
the same shape (torch's module parameter-registration hook; the real tensor the module made is
dropped at once, and `torch.empty` never touched its memory) that reports the CPU as its device
(engine/zero/unbuilt.py: libraries that ask a model's device inside the block, such as
`kernelize` at the end of `from_pretrained`, refuse the meta device). A TorchFunctionMode records each
call that writes into such a parameter — `nn.init.*_` functions, in-place tensor methods
(`normal_`, `fill_`, `mul_`, ...), `copy_` and `__setitem__`, through the parameter itself, its
`.data` or a view — together with the global RNG state just before it, and then runs the same
call on a throw-away real tensor of the parameter's size, so the RNG advances exactly as in a
normal construction (what runs after the block sees the same random numbers).
`initialize` then materializes one parameter at a time: it replays, on a real tensor, the
parameter's live calls (from the last one that overwrote all of it: earlier values are dead), each
with an RNG state set first, hands the result to the chunks (stage 3 keeps this rank's shard of it,
other stages the whole of it) and frees it. The values are bit-identical to a normal construction
under that seed, and the working set is the largest single parameter.
When the block ends, each meta parameter becomes an Unbuilt one in place (engine/zero/unbuilt.py: its
shape and dtype, the CPU as its device, no values; computing with it raises): code between the block
and initialize that places new tensors by a parameter's device (PEFT moves its adapters to their base
layer's) keeps their values. A parameter made after the block with its values (PEFT's adapters) goes
into the chunks with those values, rank 0's on every rank (`ChunkLoading.load_loose`).
A parameter created with its values (`Parameter(torch.ones(n))`) keeps that real tensor as its
initial value until a later call overwrites all of it; a loaded weight that is a view of a mapped
file keeps only where its bytes lie (Note [streamed weights]). A write this cannot replay — one whose
other arguments are meta tensors (values computed on the meta device) — raises at once, naming
the parameter, rather than producing different weights.
The ranks may seed differently (DeepSpeed's zero.Init does not ask them not to); each ends with the
shards of rank 0's model, and no rank holds a full model:
- rank 0 broadcasts each parameter's name, shape, dtype and number of live calls; where a rank's
  names, shapes or dtypes differ it built another model, and every rank raises;
- where some rank recorded other RNG states than rank 0 (one fingerprint each), rank 0 broadcasts
  its states before the live calls (5 KB each, no parameter values) and every rank replays its own
  calls with them: the same code on the same shapes draws rank 0's numbers;
- what the RNG states do not decide (an initial value made with random numbers outside the
  recorded calls, `Parameter(torch.randn(n))`; a tensor argument, `copy_(torch.randn(n))`; a rank
  that made other calls) is found by checking, not by reasoning about the calls: each rank hashes
  every value it built (XXH3-64), and a parameter whose hash differs from rank 0's on some rank is
  broadcast whole from rank 0, one at a time, each rank keeping its shard.
With the same seed everywhere, only the layout, one fingerprint and one hash per parameter move.
Under a pipeline every rank built the whole model, and keeps only its stages' parameters (Note [pipeline stages
of an unmodified model]): the placeholders of the others go with their modules, never built. All ranks (pipeline
× data parallel) agree over the whole model's layout and RNG states as above, so every stage, and both holders of
a parameter two stages share, get rank 0's numbers; each rank then builds only the parameters it holds. Rank 0
does not build the other stages' parameters, so their values cannot be checked against its own; what decides them
besides the RNG states is checked instead: each rank hashes every parameter's recipe (its live calls, their
non-tensor arguments as written, the bytes of their tensor arguments and of the initial value they start from:
no value is built), and a parameter whose recipe differs from rank 0's on some rank is built by rank 0 and
broadcast from it. The same recipe under rank 0's RNG states gives rank 0's values; where the ranks building a
parameter still disagree, the lowest of them broadcasts it.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map

from engine.comm import CommCounter, all_reduce_max, broadcast_from
from engine.config import load_config
from engine.zero.unbuilt import Computed, Recorded, Unbuilt, recorded_parameter, unbuilt_parameter
from engine.zero.weight_files import FileRange, mapped_file_range
from offload.nvme import checksum  # the project's one XXH3-64

logger = logging.getLogger(__name__)

# calls that overwrite every element of the tensor they are given without reading it
_OVERWRITES = {
    torch.nn.init.uniform_, torch.nn.init.normal_, torch.nn.init.trunc_normal_, torch.nn.init.constant_,
    torch.nn.init.ones_, torch.nn.init.zeros_, torch.nn.init.eye_, torch.nn.init.dirac_,
    torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.kaiming_uniform_,
    torch.nn.init.kaiming_normal_, torch.nn.init.orthogonal_, torch.nn.init.sparse_,
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.fill_, torch.Tensor.zero_, torch.Tensor.random_,
    torch.Tensor.bernoulli_, torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_, torch.Tensor.copy_,
}


@dataclass
class _Write:
    """One recorded write into a parameter: the call, the written tensor's geometry in its parameter,
    and the RNG state before it."""

    func: Callable
    args: tuple
    kwargs: dict
    geometry: tuple  # (shape, stride, storage_offset) of the written tensor
    rng_state: torch.Tensor
    whole: bool  # overwrites every element of the parameter


@dataclass
class _Record:
    """A meta parameter's history: an initial real value (or None) and its writes in order."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    initial: torch.Tensor | None
    writes: list[_Write] = field(default_factory=list)
    file: FileRange | None = None  # where the initial value's bytes lie in a file (Note [streamed weights])


class InitRecording:
    """The writes recorded for the meta parameters of models built in a `zero_init` block."""

    def __init__(self) -> None:
        self.records: dict[int, _Record] = {}  # storage key -> record
        self.built_elements = 0  # elements of the values `materialize` made so far on this rank
        self.read_bytes = 0  # bytes read from weight files so far on this rank (Note [streamed weights])
        self.warned_in_memory = False
        self._built: list[nn.Parameter] = []  # the meta parameters made in the block, until `seal`
        self._sealed: dict[int, tuple[nn.Parameter, _Record]] = {}  # id -> the Unbuilt parameter and its record

    def add(self, meta: nn.Parameter, record: _Record) -> None:
        self.records[_storage_key(meta)] = record
        self._built.append(meta)

    def knows(self, p: torch.Tensor) -> bool:
        if isinstance(p, Unbuilt):
            return id(p) in self._sealed and self._sealed[id(p)][0] is p
        return (p.is_meta or isinstance(p, Recorded)) and _storage_key(p) in self.records

    def _record(self, p: torch.Tensor) -> _Record:
        return self._sealed[id(p)][1] if isinstance(p, Unbuilt) else self.records[_storage_key(p)]

    def shape(self, p: torch.Tensor) -> torch.Size:
        return self._record(p).shape

    def seal(self) -> None:
        """At the block's end: each meta parameter becomes an Unbuilt one, in place (engine/zero/unbuilt.py); from
        here on the records are found through those parameters."""
        for p in self._built:
            record = self.records[_storage_key(p)]
            attributes = {k: v for k, v in p.__dict__.items() if k != "meta"}  # Recorded's own
            if weakref.getweakrefcount(p):
                raise RuntimeError(f"zero_init: parameter {record.name} is held by a weak reference made inside the "
                                   "block, so it cannot become a placeholder in place; take the weak reference after "
                                   "initialize()")
            torch.utils.swap_tensors(p, unbuilt_parameter(record.shape, record.dtype, record.name, p.requires_grad))
            p.__dict__.update(attributes)
            self._sealed[id(p)] = (p, record)
        self._built, self.records = [], {}  # a freed meta storage's address may come again: no lookups by it

    def release(self) -> None:
        """After initialize materialized every parameter: what the records hold (initial values, memory-mapped
        views of weight files) goes now, not at the next garbage collection (the parameters refer back here)."""
        self._sealed, self.records = {}, {}

    def live_writes(self, p: torch.Tensor) -> list[_Write]:
        """The writes that decide `p`'s values: from the last one that overwrote all of it (earlier values are dead),
        or all of them, applied to its initial value."""
        writes = self._record(p).writes
        last_whole = max((i for i, w in enumerate(writes) if w.whole), default=0)
        return writes[last_whole:]

    def file_source(self, p: torch.Tensor) -> FileRange | None:
        """Where `p`'s values lie in a weight file, when nothing written since decides them (Note [streamed
        weights])."""
        record = self._record(p)
        return record.file if not self.live_writes(p) else None

    def assign_file(self, p: torch.Tensor, source: FileRange) -> None:
        """`p`'s values are those in `source` (initialize's weights=): what was recorded for it is dead."""
        record = self._record(p)
        record.file, record.initial, record.writes = source, None, []

    def materialize(self, p: torch.Tensor, rng_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`p`'s values as a normal construction would have made them: a new tensor on the CPU, where the writes
        were recorded (their RNG states are the CPU generator's). rng_states: the state before each live write,
        in place of those recorded here (rank 0's, Note [zero_init])."""
        record = self._record(p)
        writes = self.live_writes(p)
        starts_whole = bool(writes) and writes[0].whole
        if not starts_whole and record.initial is None and record.file is None:
            raise RuntimeError(f"zero_init: parameter {record.name} {tuple(record.shape)} was never initialized (it "
                               "was created with torch.empty and nothing wrote to it), so it has no values to rebuild")
        value = (torch.empty(record.shape, dtype=record.dtype) if starts_whole
                 else self._initial_value(record))
        states = rng_states if rng_states is not None else [w.rng_state for w in writes]
        saved = torch.get_rng_state()
        try:
            for write, state in zip(writes, states, strict=True):
                torch.set_rng_state(state)
                target = value.as_strided(*write.geometry)
                args, kwargs = tree_map(lambda a, target=target: target if a is _TARGET else a,
                                        (write.args, write.kwargs))
                with torch.no_grad():
                    write.func(*args, **kwargs)
        finally:
            torch.set_rng_state(saved)
        self.built_elements += value.numel()
        return value

    def _initial_value(self, record: _Record) -> torch.Tensor:
        """A new CPU tensor of the record's initial value (read from its file where it has one: the mapped view
        is not touched, Note [streamed weights])."""
        if record.file is None:
            return record.initial.to("cpu", copy=True)
        self.read_bytes += record.file.nbytes
        return record.file.read().view(record.shape).to(record.dtype)

    def recipe(self, p: torch.Tensor) -> int:
        """A hash of what decides `p`'s values besides the RNG states: its live writes (function, written geometry,
        arguments: tensors by their bytes) and the initial value they start from, if any (Note [zero_init])."""
        record = self._record(p)
        writes = self.live_writes(p)
        parts = [repr((tuple(record.shape), str(record.dtype))).encode()]
        if not (writes and writes[0].whole) and record.file is not None:  # its layout, not its bytes
            parts.append(repr(("file",) + record.file.identity()).encode())
        elif not (writes and writes[0].whole) and record.initial is not None:
            parts.append(_tensor_bytes(record.initial))
        for write in writes:
            parts.append(repr((_name(write.func), write.geometry, write.whole)).encode())
            for leaf in tree_flatten((write.args, write.kwargs))[0]:
                parts.append(_tensor_bytes(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf).encode())
        return checksum(b"".join(parts)) - 2**63


class _Target:
    """Stands for the written tensor in a recorded call's arguments."""

    def __repr__(self) -> str:
        return "<written tensor>"  # the same on every rank (a recipe's part)


_TARGET = _Target()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return repr((tuple(t.shape), str(t.dtype))).encode() + t.view(-1).view(torch.uint8).numpy().tobytes()


def _storage_key(t: torch.Tensor) -> int:
    return (t.meta if isinstance(t, Recorded) else t).untyped_storage()._cdata


class _RecordWrites(TorchFunctionMode):
    def __init__(self, recording: InitRecording):
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        out = kwargs.get("out")
        target = out if isinstance(out, torch.Tensor) else tensors[0] if tensors else None
        if target is None or not self.recording.knows(target) or not _writes(func):
            return func(*args, **kwargs)
        record = self.recording.records[_storage_key(target)]
        others = [t for t in tensors[1:] if t.is_meta or isinstance(t, (Recorded, Computed))]
        if others:
            raise RuntimeError(f"zero_init cannot rebuild parameter {record.name}: {_name(func)} writes into it values "
                               "computed from parameters built inside the block, which have none yet; build this "
                               "model without zero_init, or initialize the parameter from its own RNG draws "
                               "(torch.nn.init.normal_, uniform_, ...) or from real tensors")
        geometry = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
        whole = func in _OVERWRITES and geometry == (tuple(record.shape), _contiguous_strides(record.shape), 0)
        stored_args, stored_kwargs = tree_map(lambda a: _TARGET if a is target else a, (args, kwargs))
        record.writes.append(_Write(func, stored_args, stored_kwargs, geometry, torch.get_rng_state(), whole))
        if whole:
            record.initial = record.file = None  # its earlier values are dead
        # the same call on a throw-away tensor: the RNG advances as in a normal construction
        scratch = torch.empty(record.shape, dtype=record.dtype).as_strided(*geometry)
        real_args, real_kwargs = tree_map(lambda a: scratch if a is _TARGET else a, (stored_args, stored_kwargs))
        with torch.no_grad():
            func(*real_args, **real_kwargs)
        return func(*args, **kwargs)  # the meta tensor's own metadata effects


def _writes(func) -> bool:
    name = getattr(func, "__name__", "")
    return func in _OVERWRITES or name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


def _name(func) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """A contiguous tensor's strides (from a meta tensor: no memory)."""
    return torch.empty(shape, device="meta").stride()


@contextlib.contextmanager
def zero_init(config=None):
    """Models built inside get meta-device parameters whose initialization is recorded (Note [zero_init]);
    `initialize` materializes them shard by shard. `config` (optional, as DeepSpeed's zero.Init takes
    it) is validated here; the one given to initialize decides the sharding."""
    if config is not None:
        load_config(config)
    recording = InitRecording()

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None):
        if param is None or param.is_meta or isinstance(param, (Recorded, Unbuilt)):
            return None  # a tied parameter registered again, or one a zero_init block made already
        meta = recorded_parameter(torch.empty_like(param, device="meta"), param.requires_grad)
        meta.__dict__.update(param.__dict__)  # marks loaders set (transformers' _is_hf_initialized: not re-initialized)
        initial = param.detach()  # its values if it was made with them (torch.ones); dropped at a whole write
        file = mapped_file_range(initial)  # a view of a mapped weight file: its bytes stay unread
        record = _Record(f"{type(module).__name__}.{name}", param.shape, param.dtype, None if file else initial,
                         file=file)
        recording.add(meta, record)
        if record.file is None and getattr(param, "_is_hf_initialized", False):
            _warn_in_memory(recording, record.name)
        meta.tiers_zero_init = recording  # initialize() finds the recording through the parameters
        return meta

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        with _RecordWrites(recording):
            yield recording
    finally:
        handle.remove()
    recording.seal()  # not after an error in the block: that error is the one to see


def _warn_in_memory(recording: InitRecording, name: str) -> None:
    if not recording.warned_in_memory:
        recording.warned_in_memory = True
        logger.warning("zero_init: a loaded weight (%s, maybe more) came as a tensor in memory, not a view of its "
                       "file (the loader converted its dtype or layout), so it is held whole until initialize; "
                       "load in the checkpoint's own dtype (from_pretrained's dtype='auto') to stream it "
                       "(Note [streamed weights])", name)


def zero_init_recording(model: nn.Module) -> InitRecording | None:
    """What `zero_init` recorded while the model was built (None for a model with no parameter it recorded); raises
    for a meta parameter it did not build."""
    recording = next((p.tiers_zero_init for p in model.parameters() if hasattr(p, "tiers_zero_init")), None)
    strays = [n for n, p in model.named_parameters() if p.is_meta and not (recording and recording.knows(p))]
    if strays:
        raise ValueError(f"parameter {strays[0]!r} is on the meta device but was not built inside engine.zero_init(); "
                         "build the model inside `with zero_init():`, or give it real weights before initialize()")
    others = [n for n, p in model.named_parameters() if isinstance(p, Unbuilt) and not recording.knows(p)]
    if others:
        raise ValueError(f"parameter {others[0]!r} was built in another zero_init block than the rest of the model; "
                         "build the whole model inside one `with zero_init():`")
    if recording is None or not any(recording.knows(p) for p in model.parameters()):
        return None
    return recording


def zero_init_placeholders(model: nn.Module,
                           device: torch.device) -> tuple[InitRecording | None, dict[int, torch.Tensor]]:
    """Swaps each meta parameter of a model built under `zero_init` for a real Parameter on `device` that holds
    no memory (its storage is freed as soon as it is made, one at a time: Note [a bounded start]; the chunks take
    its place next, and a parameter outside chunks (an integer one, or a trainable one left out of the param
    groups) gets its values as a new tensor); returns the recording and id(new parameter) -> its meta parameter.
    (None, {}) for a model without meta parameters."""
    recording = zero_init_recording(model)
    if recording is None:
        return None, {}
    metas = {id(p): p for p in model.parameters() if recording.knows(p)}
    replacement: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):  # tied parameters: one replacement for all their places
            if p is not None and id(p) in metas:
                if id(p) not in replacement:
                    placeholder = torch.empty(recording.shape(p), dtype=p.dtype, device=device)
                    placeholder.untyped_storage().resize_(0)
                    replacement[id(p)] = nn.Parameter(placeholder, requires_grad=p.requires_grad)
                module._parameters[name] = replacement[id(p)]
    return recording, {id(new): metas[old] for old, new in replacement.items()}


def materialize_parameters(model: nn.Module, chunked, recording: InitRecording, meta_of: dict[int, torch.Tensor],
                           device: torch.device, group: dist.ProcessGroup | None, comm: CommCounter,
                           names: dict[int, str] | None = None) -> None:
    """Note [zero_init]: rank 0's values of each placeholder `model` holds, one parameter at a time, into the chunks
    (this rank's shard under stage 3; frozen ones too: Note [frozen chunks]) or, for a parameter outside chunks,
    into the parameter itself.
    names: id(placeholder) -> its name, for every placeholder of the whole model, when `model` holds only a part
    of it (a pipeline stage); the ranks of `group` agree over all of them."""
    held = {id(meta_of[id(p)]): p for p in model.parameters() if id(p) in meta_of}  # a tied parameter once
    entries = ([(n, meta_of[id(p)]) for n, p in model.named_parameters() if id(p) in meta_of] if names is None
               else [(names[pid], meta) for pid, meta in meta_of.items()])
    metas = [meta for _, meta in entries]
    ranks = _RankZero(device, group, comm) if _distributed(group) else None
    rng_states = ranks.rng_states(recording, entries, metas) if ranks else [None] * len(entries)
    chunked_ids = set(chunked.param_chunk_index())  # trainable and frozen (Note [frozen chunks])

    def load(p: nn.Parameter, value: torch.Tensor) -> None:
        if id(p) in chunked_ids:
            chunked.load(p, value)
        else:
            p.data = value

    def read(p: nn.Parameter, source: FileRange) -> None:  # Note [streamed weights]: this rank's part only
        if id(p) in chunked_ids:
            recording.read_bytes += chunked.load_file(p, source)
        else:
            recording.read_bytes += source.nbytes
            p.data = source.read().view(source.shape).to(device=device, dtype=p.dtype)

    checksums: list[int | None] = []
    with torch.no_grad():
        for meta, states in zip(metas, rng_states):
            p = held.get(id(meta))
            if p is None:  # another pipeline stage's: never built here
                checksums.append(None)
                continue
            source = recording.file_source(meta)
            if source is not None:  # the ranks agreed over its file layout in the recipes
                checksums.append(0)
                read(p, source)
                continue
            value = recording.materialize(meta, states)
            checksums.append(_checksum(value) if ranks else 0)
            load(p, value.to(device))
        for i, source in ranks.differing(checksums) if ranks else []:  # values not rebuilt from RNG states alone
            value = ranks.value(recording, metas[i], source)
            if id(metas[i]) in held:
                load(held[id(metas[i])], value)
        chunked.finish_loading(group)
    recording.release()


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


_LOWEST = -(2**63)  # below every checksum


def _checksum(value: torch.Tensor) -> int:
    """XXH3-64 of the tensor's bytes, as a signed int64."""
    return checksum(value.detach().contiguous().view(-1).view(torch.uint8).numpy()) - 2**63


class _RankZero:
    """Brings rank 0's construction to every rank of `group` (Note [zero_init]); collectives on `device` (NCCL)."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None, comm: CommCounter):
        self.device, self.group, self.comm = device, group, comm
        self.rank = dist.get_rank(group)
        self.foreign: list[bool] = []  # per parameter: its recipe here differs from rank 0's

    def rng_states(self, recording: InitRecording, named: list, metas: list) -> list[list[torch.Tensor]]:
        """Per parameter, rank 0's RNG states before its live writes (this rank's own where it made another number
        of them: its values then differ, and `differing` finds them). Raises on every rank when a rank built a
        different model."""
        own = [[w.rng_state for w in recording.live_writes(m)] for m in metas]
        zero_counts, same_states = self._agree(recording, named, own)
        if same_states:
            return own  # the same seed everywhere: nothing to send
        flat = [s for states in own for s in states]
        width = torch.get_rng_state().numel()
        states = (torch.stack(flat) if self.rank == 0 and flat
                  else torch.empty(sum(zero_counts), width, dtype=torch.uint8)).to(self.device)
        broadcast_from(states, 0, self.group, self.comm)
        zero = states.cpu().split(zero_counts)
        # rows cloned: torch.set_rng_state crashes on a view that starts inside its storage (torch 2.13)
        return [[r.clone() for r in z] if len(z) == len(o) else o for z, o in zip(zero, own)]

    def _agree(self, recording: InitRecording, named: list,
               own: list[list[torch.Tensor]]) -> tuple[list[int], bool]:
        """Rank 0's number of live writes per parameter, and whether every rank recorded rank 0's RNG states; notes
        the parameters whose recipe differs from rank 0's here (`foreign`); raises on every rank when one built a
        different model (other names, shapes, dtypes)."""
        recipes = [recording.recipe(p) for _, p in named]
        layout = [(n, tuple(recording.shape(p)), str(p.dtype), p.requires_grad, r, len(s))
                  for (n, p), r, s in zip(named, recipes, own)]
        fingerprint = checksum(b"".join(s.numpy().tobytes() for states in own for s in states))
        plan = [(layout, fingerprint)]
        with record_function("tiers.comm.broadcast"):
            dist.broadcast_object_list(plan, group=self.group, group_src=0, device=self.device)
        zero_layout, zero_fingerprint = plan[0]
        self.foreign = [r != entry[4] for r, entry in zip(recipes, zero_layout)]
        difference = _model_difference(layout, zero_layout)
        flags = torch.tensor([self.rank + 1 if difference else 0, int(fingerprint != zero_fingerprint)],
                             device=self.device)
        all_reduce_max(flags, self.group, self.comm)
        culprit, states_differ = (int(f) for f in flags.tolist())
        if culprit:
            raise RuntimeError(_different_models_message(self.rank, culprit - 1, difference))
        return [entry[-1] for entry in zero_layout], not states_differ

    def differing(self, checksums: list[int | None]) -> list[tuple[int, int]]:
        """(index, source) of the parameters whose recipe differs from rank 0's on some rank (source: rank 0, which
        may not hold them), then of those whose values differ between the ranks building them (None: not built
        here), with the lowest of those ranks as the source; the same list on every rank."""
        size = dist.get_world_size(self.group)
        built = [c is not None for c in checksums]
        # per parameter: the largest checksum built, and size - the lowest rank building it
        ours = torch.tensor([[c, size - self.rank] if c is not None else [_LOWEST, 0] for c in checksums],
                            dtype=torch.int64).reshape(-1, 2)
        highest = ours.to(self.device)
        all_reduce_max(highest, self.group, self.comm)
        highest = highest.cpu()
        below = torch.tensor([[b and c != h, f] for c, b, h, f in zip(checksums, built, highest[:, 0].tolist(),
                                                                        self.foreign)],
                             dtype=torch.int64, device=self.device).reshape(-1, 2)
        all_reduce_max(below, self.group, self.comm)
        below = below.cpu()
        return [(i, 0 if below[i, 1] else size - int(highest[i, 1]))
                for i in below.any(dim=1).nonzero().flatten().tolist()]

    def value(self, recording: InitRecording, meta: torch.Tensor, source: int = 0) -> torch.Tensor:
        """The values of one parameter as group rank `source` builds it, broadcast from it."""
        value = (recording.materialize(meta).to(self.device) if self.rank == source
                 else torch.empty(recording.shape(meta), dtype=meta.dtype, device=self.device))
        broadcast_from(value, source, self.group, self.comm)
        return value


def _model_difference(mine: list[tuple], zero: list[tuple]) -> str | None:
    """How this rank's parameters (name, shape, dtype, requires_grad) differ from rank 0's; None where they agree."""
    for a, b in zip(mine, zero):
        if a[:4] != b[:4]:
            return f"parameter {a[0]!r} {a[1]} {a[2]} requires_grad={a[3]} here, {b[0]!r} {b[1]} {b[2]} " \
                   f"requires_grad={b[3]} on rank 0"
    if len(mine) != len(zero):
        return f"{len(mine)} parameters here, {len(zero)} on rank 0"
    return None


def _different_models_message(rank: int, culprit: int, difference: str | None) -> str:
    what = f"this rank ({rank}) built a different model from rank 0's: {difference}" if difference else \
        f"rank {culprit} built a different model from rank 0's (its error names the parameter)"
    return (f"zero_init: {what}; build the same model on every rank under `with zero_init():` (the seeds may "
            "differ: every rank gets rank 0's weights)")
