"""The order in which a pass demands parameter chunks, recorded once and followed by later passes.

Note [gather trace]
The first pass of each kind (forward, backward) records the order in which it demands chunks.
Later passes follow that record: while every demand matches the record's next entry, the gatherer
may start gathering the chunks the record says come next (Note [gathering around modules]). A
demand that does not match (a module skipped, called twice, or in another order) stops following
for the rest of the pass: chunks are then gathered on demand only, so a result never depends on the
trace. A pass that did not match the record replaces it (re-tracing). Every decision is a function
of the sequence of demands alone, so ranks running the same control flow make the same decisions
and issue the same collectives in the same order.
"""

from __future__ import annotations


class GatherTrace:
    """One pass kind's recorded demand order."""

    def __init__(self) -> None:
        self.recorded: list[int] | None = None
        self.divergences = 0  # passes that did not follow the record
        self._current: list[int] = []
        self._position = 0
        self._following = False

    def begin(self) -> None:
        self._current = []
        self._position = 0
        self._following = self.recorded is not None

    def demand(self, chunk: int) -> None:
        self._current.append(chunk)
        if not self._following:
            return
        if self._position < len(self.recorded) and self.recorded[self._position] == chunk:
            self._position += 1
        else:
            self._following = False

    def upcoming(self) -> list[int]:
        """The chunks the record says come next; none once the pass has left the record."""
        return self.recorded[self._position:] if self._following else []

    def end(self) -> None:
        if self._current == self.recorded or not self._current:
            return
        if self.recorded is not None:
            self.divergences += 1
        self.recorded = self._current
        self._following = False
