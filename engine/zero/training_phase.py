"""Which part of a training step runs: the one state enum of the ZeRO group (the runtime and the gatherer).

The runtime's phase (Note [step phases]) says which of forward, backward and the update is running, and entering
one while another runs raises; the stage-3 gatherer's pass (Note [gathering around modules]) is the same enum,
IDLE between passes (or for a module called outside the engine), never STEP. A chunk's own phase is ChunkPhase
(Note [chunk phases]).
The group's other training state is not this enum's, for it varies independently of it: `GradientsHeld` (runtime)
says what the gradient chunks hold (LOCAL, REDUCED, PARTLY_REDUCED) and lasts from a backward until the update or
zero_grad, whatever phase runs; `inside_no_sync` and `accumulating_locally` are scopes the caller enters (they nest,
and each has its own rule: no_sync is refused under stage 2 and makes step() refuse, accumulate_locally is for a
pipeline and the update reduces what it held back), deciding whether a coming backward reduces; a scope does not
say what the chunks hold (no_sync entered after a synchronized backward finds them REDUCED). TensorBackwardState
(engine/tensor_backward.py) refines BACKWARD for a backward started on a tensor: whether autograd's hooks entered
the phase and whether a parameter gradient arrived yet.
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
