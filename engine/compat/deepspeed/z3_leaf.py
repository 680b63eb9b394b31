"""deepspeed.utils' ZeRO-3 leaf-module helpers: marking modules whose whole subtree's parameters stage 3 gathers
around the module's own forward and backward, with no hooks inside (Note [gathering around modules])."""

from __future__ import annotations

from torch import nn

from engine.zero.param_gather import is_leaf_module

LEAF_FLAG = "_z3_leaf"  # the attribute DeepSpeed sets, which the stage-3 gatherer reads


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` itself is marked a leaf."""
    return is_leaf_module(model)


def z3_leaf_parameter(param: nn.Parameter) -> bool:
    """Whether `param` belongs to a leaf module (DeepSpeed marks them when it wraps a model; Tiers at
    set_z3_leaf_modules)."""
    return getattr(param, "ds_z3_leaf_module", None) is not None


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` marked as leaves."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list[nn.Module]:
    """Marks every module of `model` whose class is listed (a class, or its name or qualified name) as a leaf;
    returns them. Call it before initialize: the gatherer reads the marks when it places its hooks."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list[nn.Module]:
    """Removes the leaf mark from every module of `model` whose class is listed; returns them."""
    return _mark(model, leaf_module_classes, False)


def _mark(model: nn.Module, leaf_module_classes, flag: bool) -> list[nn.Module]:
    wanted = list(leaf_module_classes)
    bad = [c for c in wanted if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {bad!r}")
    engine = next((p.tiers_engine() for p in model.parameters() if hasattr(p, "tiers_engine")), None)
    if engine is not None:
        raise RuntimeError("set_z3_leaf_modules / unset_z3_leaf_modules after deepspeed.initialize has no effect: "
                           "ZeRO-3 places its gather hooks at initialize; mark the modules before calling it")
    marked = [m for m in model.modules() if _listed(type(m), wanted)]
    if not marked:
        raise ValueError(f"no module of the classes {wanted!r} in the model")
    for module in marked:
        setattr(module, LEAF_FLAG, flag)
        for param in module.parameters():
            if flag:
                param.ds_z3_leaf_module = module
            elif hasattr(param, "ds_z3_leaf_module"):
                del param.ds_z3_leaf_module
    return marked


def _listed(cls: type, wanted: list) -> bool:
    """DeepSpeed matches the exact class (not subclasses); a name matches the class name or its qualified name."""
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    return any(cls is w if isinstance(w, type) else w in (cls.__name__, qualified) for w in wanted)
