"""Tensor states inside a chunk, and the chunk state derived from them.

Note [chunk states]
Each tensor in a chunk has one state (PatrickStar's scheme):
  FREE            no payload needed (its values may be dropped or recomputed)
  HOLD            values kept, not in use; may be moved to another tier
  COMPUTE         in use by an operator right now; must stay resident on the compute device
  HOLD_AFTER_FWD  used by this forward, needed again by backward
  HOLD_AFTER_BWD  done for this iteration's backward (e.g. a gradient waiting for its reduction)
The chunk's state is derived: COMPUTE if any tensor is, FREE if all are, otherwise HOLD. A chunk
with a COMPUTE tensor is pinned (never evicted or moved); a FREE chunk may drop its payload.
Only the transitions in _LEGAL are allowed; anything else is a bug in the caller and raises.
"""

from __future__ import annotations

import enum
from typing import Callable, Iterable

from offload.errors import OffloadError


class TensorState(enum.Enum):
    FREE = "free"
    HOLD = "hold"
    COMPUTE = "compute"
    HOLD_AFTER_FWD = "hold_after_fwd"
    HOLD_AFTER_BWD = "hold_after_bwd"


_HOLDS = (TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD)
_LEGAL: dict[TensorState, frozenset[TensorState]] = {
    TensorState.FREE: frozenset({TensorState.HOLD, TensorState.COMPUTE}),
    TensorState.HOLD: frozenset({TensorState.COMPUTE, TensorState.FREE}),
    TensorState.COMPUTE: frozenset({*_HOLDS, TensorState.FREE}),
    TensorState.HOLD_AFTER_FWD: frozenset({TensorState.COMPUTE, TensorState.HOLD, TensorState.FREE}),
    TensorState.HOLD_AFTER_BWD: frozenset({TensorState.COMPUTE, TensorState.HOLD, TensorState.FREE}),
}


class IllegalTransition(OffloadError):
    """A tensor was asked to move between two states that Note [chunk states] does not connect."""


def check_transition(old: TensorState, new: TensorState, what: str | Callable[[], str]) -> TensorState:
    """Returns `new` if `old → new` is legal (a state may always stay as it is), else raises; `what` names the
    tensor (a callable: named only when it raises, off the hot path)."""
    if new is not old and new not in _LEGAL[old]:
        allowed = ", ".join(sorted(s.name for s in _LEGAL[old]))
        what = what() if callable(what) else what
        raise IllegalTransition(f"{what}: {old.name} → {new.name} is not a legal state change "
                                f"(from {old.name}: {allowed}); see Note [chunk states]")
    return new


def chunk_state(states: Iterable[TensorState]) -> TensorState:
    """The chunk's state derived from its tensors' (Note [chunk states])."""
    states = list(states)
    if any(s is TensorState.COMPUTE for s in states):
        return TensorState.COMPUTE
    if all(s is TensorState.FREE for s in states):
        return TensorState.FREE
    return TensorState.HOLD
