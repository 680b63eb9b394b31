"""A checkpoint's manifest as placements (Note [reading a checkpoint anywhere]): every saved chunk with the files of
its shards, where each saved cut piece of each tensor lies in those chunks, the file of each extra entry, and the
options of each part of the model. Built from the manifest of any format version; the reader works from these
alone."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SavedChunk:
    key: str  # the prefix of its tensors in the files ("chunk.<i>")
    numel: int
    files: tuple[str, ...]  # the file holding each of its shards, in shard order (one: saved whole)


@dataclass(frozen=True)
class Location:
    chunk: int  # the saved chunk (an index into SavedTables.chunks)
    offset: int
    shape: tuple[int, ...]  # what this chunk holds of it
    base: int = 0  # the element of the whole (cut) tensor it starts at (a fused expert tensor's slice)
    whole: tuple[int, ...] | None = None  # the whole tensor's shape; None: `shape`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def whole_shape(self) -> tuple[int, ...]:
        return self.whole if self.whole is not None else self.shape


@dataclass
class SavedTables:
    chunks: list[SavedChunk] = field(default_factory=list)
    locations: dict[int, dict[str, list[Location]]] = field(default_factory=dict)  # cut rank -> name -> where
    extras: dict[int, dict[str, str]] = field(default_factory=dict)  # cut rank -> key -> the file holding it
    parts: dict[str, list] = field(default_factory=dict)  # "param_groups" / "lr_scheduler" -> each part's
    cut_size: int = 1  # the tensor-parallel pieces a cut tensor was saved in
    sizes: dict[str, int] = field(default_factory=dict)  # the saving mesh's sizes that decide each rank's job

    def add_chunk(self, chunk: SavedChunk, cut_rank: int, members: list) -> None:
        """A saved chunk and its members ([name, offset, shape] and, for a slice, [base, whole shape]); a member
        whose elements another saved chunk already holds (a tied weight two parts saved) is read from that one."""
        self.chunks.append(chunk)
        found = self.locations.setdefault(cut_rank, {})
        for name, offset, shape, *extent in members:
            base, whole = (extent[0], tuple(extent[1])) if extent else (0, None)
            loc = Location(len(self.chunks) - 1, offset, tuple(shape), base, whole)
            held = found.setdefault(name, [])
            if not any(h.base < loc.base + loc.numel and loc.base < h.base + h.numel for h in held):
                held.append(loc)
                held.sort(key=lambda h: h.base)

    def cover_cut_ranks(self) -> SavedTables:
        """Every cut rank has its (maybe empty) tables."""
        for rank in range(self.cut_size):
            self.locations.setdefault(rank, {})
            self.extras.setdefault(rank, {})
        return self

    def add_extras(self, cut_rank: int, keys, file: str) -> None:
        """Extra entries saved in `file`; a key saved twice (by two parts of the model) is read from the first."""
        held = self.extras.setdefault(cut_rank, {})
        for key in keys:
            held.setdefault(key, file)
