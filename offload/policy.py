"""Which chunk to evict and which to prefetch, from the trace (Belady/OPT) or, without one, by recency.

Note [eviction order]
With a trace being followed, the victim is the resident chunk whose next use is farthest away
(Belady's OPT: optimal for a known future), counting into the next iteration since iterations
repeat; a chunk the trace never uses again goes first. Ties (several never used again) go to
the least recently used. Without a trace (warm-up, or after a divergence: Note [trace and
divergence]) the victim is the least recently used chunk. A prefetch may only evict a chunk
whose next use comes after the prefetched chunk's own: otherwise it would make things worse.
"""

from __future__ import annotations

from typing import Iterable

from offload.tracer import Access, Trace


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


def upcoming(trace: Trace, now: int, depth: int) -> list[tuple[int, Access]]:
    """The next `depth` accesses after position `now` (cyclically), first occurrence of each chunk only."""
    seen: set[int] = set()
    out = []
    for position in range(now + 1, now + 1 + min(depth, len(trace))):
        access = trace[position]
        if access.chunk not in seen:
            seen.add(access.chunk)
            out.append((position, access))
    return out
