"""The memory manager's decisions: which chunk to evict, which to prefetch, and the tier a chunk moves to next.

The ChunkManager executes these decisions (allocates, copies, swaps, waits); nothing here moves a byte.

Note [eviction order]
With a trace being followed, the victim is the resident chunk whose next use is farthest away
(Belady's OPT: optimal for a known future), counting into the next iteration since iterations
repeat; a chunk the trace never uses again goes first. Ties (several never used again) go to
the least recently used. Without a trace (warm-up, or after a divergence: Note [trace and
divergence]) the victim is the least recently used chunk. A prefetch may only evict a chunk
whose next use comes after the prefetched chunk's own: otherwise it would make things worse.

Note [prefetch reach]
A manager's `prefetch_depth` is how many chunks it keeps on their way ahead of use, not how many trace positions
it looks at: the chunks already where the trace wants them are passed over. Between two reads from NVMe a trace
holds accesses to chunks in memory (a stepped tensor's gradient, made in backward, sits between its states and
its values), and a look-ahead of a few positions would start each read only when it is already due. The scan
goes on until `depth` chunks are on their way, one fails to find room (later ones are needed even later), or the
chunks wanted on a tier before the next one already fill its budget (room for it would mean evicting a chunk
needed sooner), and never past one trace length. A prefetch leaves free the room of the chunks that hold nothing
and are used on its tier before it (a gradient made in backward): it would otherwise fill the room they are
made in on access, which then waits for a write to NVMe to drain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from offload.chunk import Chunk, Location
from offload.tracer import Access, Trace, TracePhase, Tracer

if TYPE_CHECKING:
    from offload.residency import ChunkEntry

_RANK = {Location.DEVICE: 0, Location.CPU: 1, Location.NVME: 2}  # tiers from the top (fastest) down


def is_above(tier: Location, other: Location) -> bool:
    """Whether `tier` is nearer the compute device than `other` (DEVICE above CPU above NVME)."""
    return _RANK[tier] < _RANK[other]


def next_tier(here: Location, target: Location) -> Location:
    """The adjacent tier a chunk on `here` moves to next on its way to `target`: chunks move one tier at a time."""
    if is_above(target, here):
        return {Location.NVME: Location.CPU, Location.CPU: Location.DEVICE}[here]
    return here.below


def worth_prefetching(here: Location, target: Location) -> bool:
    """Whether a prefetch toward `target` has something to bring: not for a RELEASED chunk (access allocates it)
    nor for one already on `target` or above it (prefetching only ever moves chunks up)."""
    return here is not Location.RELEASED and is_above(target, here)


def choose_victim(candidates: Iterable[int], last_used: dict[int, int], trace: Trace | None, now: int,
                  only_if_used_after: float = float("-inf")) -> int | None:
    """The chunk to evict among `candidates` (Note [eviction order]); None if none qualifies.

    `trace` is None when not following one. Only chunks next used after `only_if_used_after`
    qualify (a prefetch passes its own next use; a demand access leaves it: anything goes).
    """
    best, best_key = None, None
    for chunk in candidates:
        next_use = trace.next_use(chunk, now) if trace is not None else float("inf")
        if next_use <= only_if_used_after:
            continue
        key = (next_use, -last_used.get(chunk, -1))  # farthest next use, then least recently used
        if best_key is None or key > best_key:
            best, best_key = chunk, key
    return best


def first_uses(trace: Trace, now: int) -> Iterator[tuple[int, Access]]:
    """The accesses after position `now` over one trace length (cyclically), the first of each chunk only."""
    seen: set[int] = set()
    for position in range(now + 1, now + 1 + len(trace)):
        access = trace[position]
        if access.chunk not in seen:
            seen.add(access.chunk)
            yield position, access


class PlacementPolicy:
    """A ChunkManager's eviction and prefetch decisions, from its tracer and the order chunks were used in.

    It keeps the recency of use (the manager reports every access to `used`) and reads the trace only
    while the tracer follows one (Note [trace and divergence]); it moves nothing.
    """

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self._last_used: dict[int, int] = {}
        self._clock = 0

    def used(self, chunk: int) -> None:
        """Records an access to `chunk` (the least recently used chunk is the victim without a trace)."""
        self._clock += 1
        self._last_used[chunk] = self._clock

    def victim(self, resident: Iterable[ChunkEntry], protect: set[int],
               only_if_used_after: float | None = None) -> int | None:
        """The chunk to evict among those `resident` on a tier (Note [eviction order]), or None: one that is
        not in COMPUTE, not moving and not in `protect`; for a prefetch (`only_if_used_after` its position),
        only one needed after the prefetched chunk."""
        candidates = [e.id for e in resident if e.transfer is None and not e.chunk.pinned and e.id not in protect]
        following = self.tracer.phase is TracePhase.FOLLOWING
        return choose_victim(candidates, self._last_used, self.tracer.trace if following else None,
                             self.tracer.position - 1,
                             float("-inf") if only_if_used_after is None else only_if_used_after)

    def to_prefetch(self, now: int, depth: int, chunk_of: Callable[[int], Chunk],
                    budget: Callable[[Location], float]) -> Iterator[tuple[int, int, Location, dict[Location, int]]]:
        """Up to `depth` chunks worth prefetching, in the order the trace uses them after position `now`, as (trace
        position, chunk id, tier it is wanted on, bytes to leave free per tier for the chunks made there before
        it) (Note [prefetch reach]). Lazy: each chunk is judged when reached, after the prefetches before it
        (which may have evicted it) were started."""
        wanted: dict[Location, int] = {}  # bytes of the chunks met so far, by the tier they are wanted on
        made: dict[Location, int] = {}  # of those, the ones holding nothing, made on access
        for position, access in first_uses(self.tracer.trace, now):
            if depth <= 0:
                return
            chunk = chunk_of(access.chunk)
            wanted[access.location] = wanted.get(access.location, 0) + chunk.nbytes
            if wanted[access.location] > budget(access.location):
                return  # room for it means evicting a chunk needed sooner
            if chunk.location is Location.RELEASED:
                made[access.location] = made.get(access.location, 0) + chunk.nbytes
            elif not chunk.pinned and worth_prefetching(chunk.location, access.location):
                depth -= 1
                yield position, access.chunk, access.location, dict(made)
