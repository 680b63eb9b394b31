"""How a shim package (engine/compat/shim/<name>) answers `import <name>` with a compat layer: it replaces itself in
sys.modules with the layer and registers every submodule of the layer under the framework's name, so that
`deepspeed.comm` is engine.compat.deepspeed.comm, the same module object, and no module of a compat layer is
imported twice under two names (two copies would hold two states). A submodule the layer lacks is a
ModuleNotFoundError naming it (Note [the deepspeed shim])."""

from __future__ import annotations

import importlib
import pkgutil
import sys


def alias_compat_layer(name: str, shim_module: str, compat: str) -> None:
    """Called by the shim package `shim_module` (its __name__): `name` becomes the compat layer `compat`."""
    if shim_module != name:
        raise ImportError(f"{shim_module} is the `{name}` shim of `tiers launch --as-{name}`; import {compat} "
                          "instead")
    layer = importlib.import_module(compat)
    sys.modules[name] = layer
    for info in pkgutil.walk_packages(layer.__path__, prefix=compat + "."):
        sys.modules[name + info.name[len(compat):]] = importlib.import_module(info.name)
