"""`import deepspeed` answered by the compat layer, for processes `tiers launch --as-deepspeed` starts.

Note [the deepspeed shim]
The launcher puts engine/compat/shim first on the children's PYTHONPATH (never on the tests' or the package's
path, never in site-packages), so a DeepSpeed script's own imports run unchanged. This package replaces itself in
sys.modules with engine.compat.deepspeed and registers every submodule of it under its DeepSpeed name
(`deepspeed.comm` is engine.compat.deepspeed.comm, the same module object), so no module of the compat layer is
imported twice under two names (two copies would hold two states, e.g. checkpointing's configuration). A
DeepSpeed submodule the compat layer lacks is a ModuleNotFoundError naming it. The `colossalai` package beside it
does the same for `tiers launch --as-colossalai` (engine.compat.aliasing).
"""

from engine.compat.aliasing import alias_compat_layer

alias_compat_layer("deepspeed", __name__, "engine.compat.deepspeed")
