"""Which part of a training step runs: the one state enum of the ZeRO group (the runtime and the gatherer).

The runtime's phase (Note [step phases]) says which of forward, backward and the update is running, and entering
one while another runs raises; the stage-3 gatherer's pass (Note [gathering around modules]) is the same enum,
IDLE between passes (or for a module called outside the engine), never STEP. A chunk's own phase is ChunkPhase
(Note [chunk phases]).
"""

from __future__ import annotations

import enum


class TrainingPhase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


LEGAL_MOVES = {
    TrainingPhase.IDLE: {TrainingPhase.FORWARD, TrainingPhase.BACKWARD, TrainingPhase.STEP},
    TrainingPhase.FORWARD: {TrainingPhase.IDLE},
    TrainingPhase.BACKWARD: {TrainingPhase.IDLE},
    TrainingPhase.STEP: {TrainingPhase.IDLE},
}
