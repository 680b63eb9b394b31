"""A committed checkpoint read under any layout: where each parameter's elements are, and reading them.

Note [reading a checkpoint anywhere]
Loading works from placements (Note [placements]): every tensor this rank holds has a live placement,
and every saved tensor is a set of saved cut pieces, each with a placement of its own. A cut piece (the
whole tensor when it was not cut) is addressed by its name, its cut rank and a range of its flattened
elements; the manifest's chunk lists turn that into pieces of files (Note [checkpoint layout]): the
pipeline rank and chunk holding it, its offset, and the data-parallel shards of the chunk the range
crosses, so a range is read from whichever saved chunks cover it — a pipeline stage's names wherever
they were saved, a fused expert tensor's range from the ep ranks that held it — under any layout.
For each live placement: when the saved piece of the same cut rank was cut the same way (equal cut
keys; both uncut included), its elements are read directly; otherwise every saved cut piece is read,
joined into the whole tensor (Spec.join) and cut as the live placement cuts it (Placement.take), one
tensor at a time. The manifest's layout fields ("tp", "ep", version 2's per-stage sections, "tp_specs")
are read in one place, Checkpoint's constructor, which turns them into the saved placements, so a
checkpoint of either version loads the same way. A reader first *plans* — lists the pieces it will
read, hence the files to verify — and only then reads, so every file is checked before any state is
changed.
Experts (Note [expert parallelism], layout "ep" > 1) are found by global expert id: an expert chunk lists each
ep rank's members ("ep_members"), is sharded over its own group ("shards" ways; shard d of ep rank e is in the file
of data-parallel rank d·ep + e), and a fused expert tensor's member covers elements [base, base + its numel) of the
whole tensor (experts first), so a parameter may have one location per ep rank.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from fractions import Fraction

import torch

from engine.checkpoint.encoding import decode_spec
from engine.checkpoint.files import CheckpointError, CheckpointIntegrityError, FileRecord, open_tensors, verify
from engine.comm import shard_range
from engine.placement import Placement

FORMAT = "tiers-checkpoint"
VERSION = 1
PIPELINE_VERSION = 2  # per-stage sections, lists by pipeline rank (Note [checkpoint layout]); pp 1 writes VERSION
MANIFEST = "manifest.json"
LATEST = "latest"


TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # a directory name: no path separators, no leading '.'
_RANK_FILE = re.compile(r"rank[0-9]{5,}\.safetensors")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class Piece:
    file: str
    key: str
    lo: int  # elements [lo, hi) of the stored tensor
    hi: int
    dst: int  # where they go in the requested range


@dataclass(frozen=True)
class Location:
    chunk: int
    offset: int
    shape: tuple[int, ...]  # what this chunk holds of it
    pp: int = 0  # the pipeline rank whose files hold it
    ep: int = -1  # an expert chunk's ep rank; -1: a dense chunk, every ep rank's
    shards: int = 1  # the data-parallel shards of its chunk
    base: int = 0  # the element of the whole tensor it starts at (a fused expert tensor's slice)
    whole: tuple[int, ...] | None = None  # the whole tensor's shape; None: `shape`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def whole_shape(self) -> tuple[int, ...]:
        return self.whole if self.whole is not None else self.shape


def read_latest(directory: str) -> str | None:
    """The tag `latest` names, or None when there is none."""
    path = os.path.join(directory, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    if not TAG.fullmatch(tag):
        raise CheckpointError(f"{path} holds {tag[:80]!r}, not a checkpoint tag; pass the tag to load explicitly")
    return tag


class Checkpoint:
    """One committed checkpoint directory: its manifest, parsed and checked."""

    def __init__(self, directory: str):
        self.directory = directory
        replaced = os.path.join(os.path.dirname(directory), f".{os.path.basename(directory)}.replaced")
        if not os.path.isdir(directory) and os.path.isdir(replaced):  # a crash while a save replaced this tag
            warnings.warn(f"{directory} is missing: a save replacing it was interrupted; loading the previous "
                          f"checkpoint of that tag, {replaced}", stacklevel=3)
            directory = self.directory = replaced
        path = os.path.join(directory, MANIFEST)
        if not os.path.isdir(directory):
            raise CheckpointError(f"no checkpoint at {directory} (no such directory)")
        if not os.path.isfile(path):
            raise CheckpointError(f"{directory} is not a complete checkpoint: it has no {MANIFEST} (a save that was "
                                  "interrupted writes it last); load another tag")
        try:
            with open(path) as f:
                manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointIntegrityError(f"{path} cannot be read as JSON ({e}); "
                                           "the manifest is damaged: load another tag") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a Tiers checkpoint manifest")
        if manifest.get("version") not in (VERSION, PIPELINE_VERSION):
            raise CheckpointError(f"{path} has format version {manifest.get('version')}; this Tiers reads versions "
                                  f"{VERSION} and {PIPELINE_VERSION}")
        self.manifest = manifest
        self.layout = manifest["layout"]
        # the layout's fields, read here only, become the saved pieces' placements (Note [reading a checkpoint
        # anywhere]): "tp" cut pieces of each tensor ("tp_specs"), sections by stage (version 2), expert groups
        self.cut_size = self.layout["tp"]
        self._sections = manifest["version"] == PIPELINE_VERSION
        self.shard_count = self.layout["shard_count"]
        self._expert_groups = self.layout.get("ep", 1)
        self._world = (self.layout["world_size"], self.cut_size, self.layout.get("pp", 1), self.layout.get("device"))
        bad = [f["name"] for f in manifest["files"] if not _RANK_FILE.fullmatch(f["name"])]
        if bad:
            raise CheckpointIntegrityError(f"{path} lists the file {bad[0]!r}, which is not a rank file name; the "
                                           "manifest is damaged or not written by Tiers")
        self.files = {f["name"]: FileRecord(f["name"], f["bytes"], f["sha256"]) for f in manifest["files"]}
        self._file_of = {(f.get("pp_rank", 0), f["dp_rank"], f["tp_rank"]): f["name"] for f in manifest["files"]}
        self._rank_file = {f["rank"]: f["name"] for f in manifest["files"]}
        self.chunk_numels: dict[tuple[int, int], list[int]] = {}  # (pp rank, tp rank) -> its chunks' sizes
        self.locations: dict[int, dict[str, list[Location]]] = {}  # tp rank -> name -> where (every stage's)
        self.extras: dict[int, dict[str, int]] = {}  # tp rank -> key -> the pipeline rank holding it
        self.excluded_frozen = set(manifest.get("excluded_frozen", []))  # saved with exclude_frozen_parameters
        for pp, (chunks_of, extras_of) in enumerate(zip(self.stages("chunks"), self.stages("extras"))):
            for tp, chunks in chunks_of.items():
                tp = int(tp)
                self.chunk_numels[(pp, tp)] = [c["numel"] for c in chunks]
                found = self.locations.setdefault(tp, {})
                for i, c in enumerate(chunks):
                    for location, name in self._chunk_locations(i, c, pp):
                        held = found.setdefault(name, [])
                        if not held or held[0].pp == pp:  # two stages holding one (tied): the first's is read
                            held.append(location)
                for held in found.values():
                    held.sort(key=lambda loc: loc.base)
            for tp, entries in extras_of.items():
                held = self.extras.setdefault(int(tp), {})
                for key in entries:
                    held.setdefault(key, pp)
        self.cuts = {name: decode_spec(spec) for name, spec in manifest["tp_specs"].items()}
        self.tensor_states: list[str] = manifest["optimizer"]["tensor_states"]
        self.scalar_states: list[str] = manifest["optimizer"]["scalar_states"]
        # entries per element of the states that are not one per element (Note [block-wise optimizer states])
        self.state_entries = {k: Fraction(v) for k, v in manifest["optimizer"].get("entries", {}).items()}

    def _chunk_locations(self, index: int, chunk: dict, pp: int):
        """(location, name) of each member of saved chunk `index`: every ep rank's, for an expert chunk."""
        if not chunk.get("expert"):
            for name, offset, shape, *extent in chunk["members"]:
                yield Location(index, offset, tuple(shape), pp, -1, self.shard_count, *_extent(extent)), name
            return
        for ep, members in enumerate(chunk["ep_members"]):
            for name, offset, shape, *extent in members:
                yield Location(index, offset, tuple(shape), pp, ep, chunk["shards"], *_extent(extent)), name

    def stages(self, key: str) -> list:
        """A per-stage manifest entry as a list by pipeline rank (one element when the model was not split)."""
        return self.manifest[key] if self._sections else [self.manifest[key]]

    def placement(self, name: str, index: int) -> Placement:
        """Saved cut piece `index` of tensor `name`: how it was cut, whole after that (all experts, every stage's)."""
        return Placement(name, self.cuts.get(name), index, self.cut_size)

    def piece_like(self, live: Placement) -> Placement:
        """The saved cut piece a rank placed as `live` reads directly when their cuts agree: the same piece."""
        return self.placement(live.name, live.cut_rank if live.cut_rank < self.cut_size else 0)

    def pieces_of_cut(self, name: str) -> list[Placement]:
        """Every saved cut piece of `name`, in cut rank order (one when it was not cut)."""
        return [self.placement(name, t) for t in range(self.cut_size if name in self.cuts else 1)]

    # ---- planning ---------------------------------------------------------------------------
    def has_param(self, name: str) -> bool:
        return name in self.locations[0]

    def param_names(self) -> list[str]:
        return list(self.locations[0])

    def local_shape(self, name: str, tp_rank: int) -> tuple[int, ...]:
        """The shape of saved cut piece `tp_rank` of parameter `name`."""
        return self.locations[tp_rank][name][0].whole_shape

    def _file(self, loc: Location, shard: int, tp_rank: int) -> str:
        """The file holding shard `shard` of the chunk at `loc` (a chunk of its own group: that group's)."""
        dp = shard if loc.ep < 0 else shard * self._expert_groups + loc.ep
        return self._file_of[(loc.pp, dp, tp_rank)]

    def pieces(self, name: str, kind: str, tp_rank: int, start: int, stop: int,
               ratio: Fraction = Fraction(1)) -> list[Piece]:
        """Where elements [start, stop) of saved cut piece `tp_rank` of parameter `name` are stored, from whichever
        saved chunks cover them; kind "param" (fp32 values) or a tensor state name (e.g. "exp_avg"), whose tensors
        hold `ratio` entries per element (the pieces are in entries; the elements lie on whole entries)."""
        key = f"{'param' if kind == 'param' else 'optim.' + kind}"
        out = []
        for loc in self.locations[tp_rank][name]:  # (one per ep rank holding part of a fused expert tensor)
            lo_el, hi_el = max(start, loc.base), min(stop, loc.base + loc.numel)
            if lo_el >= hi_el:
                continue
            numel = self.chunk_numels[(loc.pp, tp_rank)][loc.chunk]
            _, n = shard_range(numel, 0, loc.shards)
            a, b = loc.offset + lo_el - loc.base, loc.offset + hi_el - loc.base
            for d in range(a // n, (b - 1) // n + 1):
                first, _ = shard_range(numel, d, loc.shards)
                lo, hi = max(a, first), min(b, first + n)
                out.append(Piece(self._file(loc, d, tp_rank), f"chunk.{loc.chunk}.{key}", int((lo - first) * ratio),
                                 int((hi - first) * ratio), int((lo - a + lo_el - start) * ratio)))
        return out

    def scalar_piece(self, name: str, state: str, tp_rank: int) -> Piece:
        """Where the scalar optimizer state `state` (e.g. "step") of the chunk holding `name` is (shard 0's copy)."""
        loc = self.locations[tp_rank][name][0]
        return Piece(self._file(loc, 0, tp_rank), f"chunk.{loc.chunk}.optim.{state}", 0, 0, 0)

    def extra_piece(self, key: str, tp_rank: int) -> Piece:
        return Piece(self._file_of[(self.extras[tp_rank][key], 0, tp_rank)], f"extra.{key}", 0, 0, 0)

    def same_world(self, world_size: int, tp_size: int, pp_size: int, device: str) -> bool:
        """Saved by the same ranks in the same grid on the same kind of device (each rank's generators are its own)."""
        return self._world == (world_size, tp_size, pp_size, device)

    def rank_file(self, rank: int) -> str | None:
        return self._rank_file.get(rank)


class PieceReader:
    """Reads planned pieces from a checkpoint's files, each file verified against the manifest before first use."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self._open: dict[str, object] = {}
        self._verified: set[str] = set()

    def verify(self, files) -> None:
        for name in sorted(set(files) - self._verified):
            if name not in self.checkpoint.files:
                raise CheckpointIntegrityError(f"{self.checkpoint.directory}: the manifest lists no file {name}")
            verify(self.checkpoint.directory, self.checkpoint.files[name])
            self._verified.add(name)

    def _handle(self, name: str):
        if name not in self._open:
            self.verify([name])
            self._open[name] = open_tensors(os.path.join(self.checkpoint.directory, name))
        return self._open[name]

    def into(self, pieces: list[Piece], out: torch.Tensor) -> torch.Tensor:
        """Copies the pieces into the 1-D tensor `out` (at their dst offsets)."""
        for p in pieces:
            out.narrow(0, p.dst, p.hi - p.lo).copy_(self._handle(p.file).get_slice(p.key)[p.lo:p.hi])
        return out

    def tensor(self, piece: Piece) -> torch.Tensor:
        """A whole stored tensor (a scalar state, an extra entry, a client tensor), a copy of its own: tensors read
        twice from a memory-mapped file may share memory (one "step" counter read for two chunks would then count
        both chunks' steps)."""
        return self._handle(piece.file).get_tensor(piece.key).clone()

    def local(self, name: str, kind: str, tp_rank: int) -> torch.Tensor:
        """The whole of tp rank `tp_rank`'s piece of parameter `name` (values or one optimizer state), fp32."""
        shape = self.checkpoint.local_shape(name, tp_rank)
        numel = math.prod(shape)
        out = torch.empty(numel, dtype=torch.float32)
        return self.into(self.checkpoint.pieces(name, kind, tp_rank, 0, numel), out).view(shape)

    def whole(self, name: str, kind: str) -> torch.Tensor:
        """Parameter `name` (or one optimizer state of it) whole: its saved cut pieces joined."""
        return _joined([self.local(name, kind, p.cut_rank) for p in self.checkpoint.pieces_of_cut(name)],
                       self.checkpoint.cuts.get(name))

    def whole_extra(self, key: str) -> torch.Tensor:
        ckpt = self.checkpoint
        return _joined([self.tensor(ckpt.extra_piece(key, p.cut_rank)) for p in ckpt.pieces_of_cut(key)],
                       ckpt.cuts.get(key))

    def close(self) -> None:
        self._open.clear()


def _extent(saved: list) -> tuple[int, tuple[int, ...] | None]:
    """A member's optional [base, whole shape] (a fused expert tensor's slice) as Location fields."""
    return (saved[0], tuple(saved[1])) if saved else (0, None)


def _joined(pieces: list[torch.Tensor], cut) -> torch.Tensor:
    """A whole tensor from its cut pieces in cut rank order (one piece: it was not cut)."""
    return cut.join(pieces) if cut is not None else pieces[0]
