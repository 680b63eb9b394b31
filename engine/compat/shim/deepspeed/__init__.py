"""`import deepspeed` answered by the compat layer, for processes `tiers launch --as-deepspeed` starts.

Note [the deepspeed shim]
The launcher puts engine/compat/shim first on the children's PYTHONPATH (never on the tests' or the package's
path, never in site-packages), so a DeepSpeed script's own imports run unchanged. This package replaces itself in
sys.modules with engine.compat.deepspeed and registers every submodule of it under its DeepSpeed name
(`deepspeed.comm` is engine.compat.deepspeed.comm, the same module object), so no module of the compat layer is
imported twice under two names (two copies would hold two states, e.g. checkpointing's configuration). A
DeepSpeed submodule the compat layer lacks is a ModuleNotFoundError naming it.
"""

import importlib
import pkgutil
import sys

_COMPAT = "engine.compat.deepspeed"


def _alias_compat_layer() -> None:
    if __name__ != "deepspeed":
        raise ImportError(f"{__name__} is the `deepspeed` shim of `tiers launch --as-deepspeed`; import "
                          "engine.compat.deepspeed instead")
    compat = importlib.import_module(_COMPAT)
    sys.modules["deepspeed"] = compat
    for info in pkgutil.walk_packages(compat.__path__, prefix=_COMPAT + "."):
        module = importlib.import_module(info.name)
        sys.modules["deepspeed" + info.name[len(_COMPAT):]] = module


_alias_compat_layer()
