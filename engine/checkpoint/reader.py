"""A committed checkpoint read under any layout: where each parameter's elements are, and reading them.

Note [reading a checkpoint anywhere]
Loading works from placements (Note [placements]): every tensor this rank holds has a live placement,
and every saved tensor is a set of saved cut pieces, each with a placement of its own. A cut piece (the
whole tensor when it was not cut) is addressed by its name, its cut rank and a range of its flattened
elements; the saved chunks (engine/checkpoint_tables.py) turn that into pieces of files: the chunk
holding it, its offset, and the shards of the chunk the range crosses, each in the file the manifest names, so a
range is read from whichever saved chunks cover it — a pipeline stage's names wherever they were saved, a fused
expert tensor's ranges from the chunks of the ep ranks that held them — under any layout.
For each live placement: when the saved piece of the same cut rank was cut the same way (equal cut
keys; both uncut included), its elements are read directly; otherwise every saved cut piece is read,
joined into the whole tensor (Spec.join) and cut as the live placement cuts it (Placement.take), one
tensor at a time. The manifest is read in one place, Checkpoint's constructor, which turns it into SavedTables:
this version's lists as they are, versions 1 and 2's layout fields ("tp", "pp", "ep", per-stage sections,
"ep_members") by engine/compat/checkpoint_formats.py, so a checkpoint of any version loads the same way. A reader
first *plans* — lists the pieces it will read, hence the files to verify — and only then reads, so every file is
checked before any state is changed.
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
from engine.checkpoint_tables import SavedChunk, SavedTables
from engine.comm import shard_range
from engine.compat.checkpoint_formats import legacy_tables
from engine.placement import Placement

FORMAT = "tiers-checkpoint"
VERSION = 3  # every layout: saved chunks with their shards' files, members by placement (Note [checkpoint layout])
READ_VERSIONS = (1, 2, VERSION)  # 1 and 2: engine/compat/checkpoint_formats.py
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
        if manifest.get("version") not in READ_VERSIONS:
            raise CheckpointError(f"{path} has format version {manifest.get('version')}; this Tiers reads versions "
                                  f"{', '.join(map(str, READ_VERSIONS))}")
        self.manifest = manifest
        self.layout = manifest["layout"]
        bad = [f["name"] for f in manifest["files"] if not _RANK_FILE.fullmatch(f["name"])]
        if bad:
            raise CheckpointIntegrityError(f"{path} lists the file {bad[0]!r}, which is not a rank file name; the "
                                           "manifest is damaged or not written by Tiers")
        self.files = {f["name"]: FileRecord(f["name"], f["bytes"], f["sha256"]) for f in manifest["files"]}
        self._rank_file = {f["rank"]: f["name"] for f in manifest["files"]}
        # the saved pieces as placements, from this version's manifest or an earlier one's layout fields
        tables = (_tables(manifest) if manifest["version"] == VERSION else legacy_tables(manifest)).cover_cut_ranks()
        self.tables = tables
        self.cut_size = tables.cut_size
        self.locations = tables.locations  # cut rank -> name -> where (every part's)
        self.extras = tables.extras  # cut rank -> key -> the file holding it
        self.excluded_frozen = set(manifest.get("excluded_frozen", []))  # saved with exclude_frozen_parameters
        self.cuts = {name: decode_spec(spec) for name, spec in manifest["tp_specs"].items()}
        self.tensor_states: list[str] = manifest["optimizer"]["tensor_states"]
        self.scalar_states: list[str] = manifest["optimizer"]["scalar_states"]
        # entries per element of the states that are not one per element (Note [block-wise optimizer states])
        self.state_entries = {k: Fraction(v) for k, v in manifest["optimizer"].get("entries", {}).items()}

    def stages(self, key: str) -> list:
        """A per-part manifest entry ("param_groups", "lr_scheduler") as a list by part of the model (one element
        when the model was not split)."""
        return self.tables.parts[key]

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

    def pieces(self, name: str, kind: str, tp_rank: int, start: int, stop: int,
               ratio: Fraction = Fraction(1)) -> list[Piece]:
        """Where elements [start, stop) of saved cut piece `tp_rank` of parameter `name` are stored, from whichever
        saved chunks cover them; kind "param" (fp32 values) or a tensor state name (e.g. "exp_avg"), whose tensors
        hold `ratio` entries per element (the pieces are in entries; the elements lie on whole entries)."""
        suffix = "param" if kind == "param" else f"optim.{kind}"
        out = []
        for loc in self.locations[tp_rank][name]:  # (one per saved slice: a fused expert tensor's ranges)
            lo_el, hi_el = max(start, loc.base), min(stop, loc.base + loc.numel)
            if lo_el >= hi_el:
                continue
            chunk = self.tables.chunks[loc.chunk]
            shards = len(chunk.files)
            _, n = shard_range(chunk.numel, 0, shards)
            a, b = loc.offset + lo_el - loc.base, loc.offset + hi_el - loc.base
            for d in range(a // n, (b - 1) // n + 1):
                first, _ = shard_range(chunk.numel, d, shards)
                lo, hi = max(a, first), min(b, first + n)
                out.append(Piece(chunk.files[d], f"{chunk.key}.{suffix}", int((lo - first) * ratio),
                                 int((hi - first) * ratio), int((lo - a + lo_el - start) * ratio)))
        return out

    def scalar_piece(self, name: str, state: str, tp_rank: int) -> Piece:
        """Where the scalar optimizer state `state` (e.g. "step") of the chunk holding `name` is (shard 0's copy)."""
        chunk = self.tables.chunks[self.locations[tp_rank][name][0].chunk]
        return Piece(chunk.files[0], f"{chunk.key}.optim.{state}", 0, 0, 0)

    def extra_piece(self, key: str, tp_rank: int) -> Piece:
        return Piece(self.extras[tp_rank][key], f"extra.{key}", 0, 0, 0)

    def same_world(self, sizes: dict[str, int], device: str) -> bool:
        """Saved by the same ranks doing the same jobs (every size the checkpoint recorded) on the same kind of
        device: each rank's generators are its own."""
        saved = self.tables.sizes
        return device == self.layout.get("device") and all(sizes.get(k, 1) == v for k, v in saved.items())

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


def _tables(manifest: dict) -> SavedTables:
    """This version's manifest as SavedTables: its saved chunks, extras and parts are listed as they are."""
    layout = manifest["layout"]
    tables = SavedTables(parts={key: [part[key] for part in manifest["parts"]]
                                for key in ("param_groups", "lr_scheduler")},
                         cut_size=layout["cut_size"], sizes={"world": layout["world_size"], **layout["sizes"]})
    for chunk in manifest["chunks"]:
        tables.add_chunk(SavedChunk(chunk["key"], chunk["numel"], tuple(chunk["files"])), chunk["cut_rank"],
                         chunk["members"])
    for saved in manifest["extras"]:
        for cut_rank in sorted({e["cut_rank"] for e in saved["entries"].values()}):
            tables.add_extras(cut_rank, [k for k, e in saved["entries"].items() if e["cut_rank"] == cut_rank],
                              saved["file"])
    return tables


def _joined(pieces: list[torch.Tensor], cut) -> torch.Tensor:
    """A whole tensor from its cut pieces in cut rank order (one piece: it was not cut)."""
    return cut.join(pieces) if cut is not None else pieces[0]
