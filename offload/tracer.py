"""The warm-up trace: which chunk each access asked for, where, when, and the non-chunk memory then.

Note [trace and divergence]
Training repeats the same sequence of chunk accesses every iteration. The first iteration
(warm-up) is recorded: for each access, the chunk, the tier it was wanted on, the time since the
iteration began and the memory in use that is not chunk payloads (activations, workspace:
device memory on CUDA, the process RSS on CPU). Later iterations *follow* the trace: the
manager evicts by next use in it (offload/policy.py) and prefetches the chunks it lists next.
Every access is compared with the trace entry it should be. The first mismatch (a module
skipped, called twice, reordered, an iteration longer or shorter) is a divergence: the tracer
switches to RECORDING for the rest of the iteration — the manager then works on demand, with LRU
eviction and no prefetch, so a wrong guess can cost time but never a result — and at the end of
the iteration the recording replaces the trace. Data is always made resident by `access`
itself; the trace only decides what to move early and what to evict. The caller marks iteration
ends (`ChunkManager.end_iteration`); without them the recording would grow without bound.
"""

from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass
from typing import Callable

from offload.chunk import Location


class TracePhase(enum.Enum):
    RECORDING = "recording"  # warm-up, or re-tracing after a divergence: on demand, LRU eviction
    FOLLOWING = "following"  # a trace exists and this iteration matched it so far: OPT eviction, prefetch


@dataclass(frozen=True)
class Access:
    chunk: int
    location: Location
    seconds: float  # since the iteration began
    non_chunk_bytes: int


class Trace:
    """One recorded iteration; positions repeat cyclically (iteration k+1 starts where k ended)."""

    def __init__(self, accesses: list[Access]):
        self.accesses = tuple(accesses)
        self._positions: dict[int, list[int]] = {}
        for i, a in enumerate(self.accesses):
            self._positions.setdefault(a.chunk, []).append(i)

    def __len__(self) -> int:
        return len(self.accesses)

    def __getitem__(self, position: int) -> Access:
        return self.accesses[position % len(self.accesses)]

    def next_use(self, chunk: int, after: int) -> float:
        """The first position > `after` that accesses `chunk`, counting on into the next iteration; inf if never."""
        positions = self._positions.get(chunk)
        if not positions:
            return float("inf")
        i = bisect.bisect_right(positions, after)
        return positions[i] if i < len(positions) else positions[0] + len(self.accesses)

    @property
    def peak_non_chunk_bytes(self) -> int:
        return max((a.non_chunk_bytes for a in self.accesses), default=0)


class Tracer:
    """Records iterations and tells whether the current one still follows the trace."""

    def __init__(self, non_chunk_bytes: Callable[[], int]):
        self._non_chunk_bytes = non_chunk_bytes
        self.trace: Trace | None = None
        self.phase = TracePhase.RECORDING
        self.position = 0  # accesses so far in this iteration
        self.divergences = 0
        self.iterations = 0
        self._recording: list[Access] = []
        self._start = time.perf_counter()

    def on_access(self, chunk: int, location: Location) -> TracePhase:
        """Records one access; returns the phase it was made in (FOLLOWING: it matched the trace)."""
        if self.phase is TracePhase.FOLLOWING:
            expected = self.trace.accesses[self.position] if self.position < len(self.trace) else None
            if expected is not None and expected.chunk == chunk and expected.location is location:
                self._recording.append(expected)  # same access: keep its warm-up timing and memory
                self.position += 1
                return TracePhase.FOLLOWING
            self.phase = TracePhase.RECORDING
            self.divergences += 1
        seconds = time.perf_counter() - self._start
        self._recording.append(Access(chunk, location, seconds, self._non_chunk_bytes()))
        self.position += 1
        return TracePhase.RECORDING

    def end_iteration(self) -> None:
        """Closes an iteration: a recorded (or diverged, or shorter) one becomes the trace."""
        if self.phase is TracePhase.FOLLOWING and self.position != len(self.trace):
            self.divergences += 1  # ended early: the trace's tail did not happen
            self.phase = TracePhase.RECORDING
        if self.phase is TracePhase.RECORDING and self._recording:
            self.trace = Trace(self._recording)
        if self.trace is not None:
            self.phase = TracePhase.FOLLOWING
        self.iterations += 1
        self.position = 0
        self._recording = []
        self._start = time.perf_counter()
