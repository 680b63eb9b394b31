"""`import colossalai` answered by engine.compat.colossalai, for processes `tiers launch --as-colossalai` starts
(Note [the deepspeed shim])."""

from engine.compat.aliasing import alias_compat_layer

alias_compat_layer("colossalai", __name__, "engine.compat.colossalai")
