"""Which modules activation checkpointing wraps: the config's `modules` and `every_n`, or the model's blocks."""

from __future__ import annotations

import difflib
import fnmatch

from torch import nn

from engine.block_list import find_block_list
from engine.config import ConfigError


def select_modules(model: nn.Module, patterns: list[str] | None, every_n: int) -> list[tuple[str, nn.Module]]:
    """(name, module) of the modules to checkpoint, in model order.

    `patterns`: class names (`"GPT2Block"`) or module-name globs (`"transformer.h.*"`); an entry that is the
    class name of some module in the model is a class name, anything else a glob. None: the model's repeated
    blocks (Note [activation checkpointing]). A module inside another selected one is not selected again
    (the outer recompute runs it anyway). `every_n`: of those, the 1st, (n+1)-th, (2n+1)-th, ...
    """
    named = [(name, m) for name, m in model.named_modules() if name]  # the root is not a block
    chosen = _repeated_blocks(model) if patterns is None else _matching(named, patterns)
    for name, module in chosen:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise ConfigError(f"activation_checkpointing.modules: {name!r} is a {type(module).__name__}, a container "
                              f"whose forward is never called; select its children instead (e.g. \"{name}.*\")")
    outermost, names = [], []
    for name, module in chosen:
        if not any(name.startswith(outer + ".") for outer in names):
            outermost.append((name, module))
            names.append(name)
    return outermost[::every_n]


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the model's block list (engine.block_list.find_block_list)."""
    best = find_block_list(model)
    if best is None:
        raise ConfigError(f"activation_checkpointing.modules: {type(model).__name__} has no nn.ModuleList of "
                          "same-class blocks to checkpoint by default; name the modules to checkpoint, by class name "
                          "or module-name glob (e.g. \"modules\": [\"Block\"] or [\"layers.*\"])")
    prefix = f"{best[0]}." if best[0] else ""
    return [(f"{prefix}{i}", child) for i, child in enumerate(best[1])]


def _matching(named: list[tuple[str, nn.Module]], patterns: list[str]) -> list[tuple[str, nn.Module]]:
    class_names = {type(m).__name__ for _, m in named}
    chosen = {}
    for pattern in patterns:
        if pattern in class_names:
            hits = [(n, m) for n, m in named if type(m).__name__ == pattern]
        else:
            hits = [(n, m) for n, m in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, sorted(class_names) + [n for n, _ in named], n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ConfigError(f"activation_checkpointing.modules: {pattern!r} is neither the class name of a module "
                              f"in the model nor a glob matching a module name{hint}")
        chosen.update(hits)
    order = {n: i for i, (n, _) in enumerate(named)}
    return sorted(chosen.items(), key=lambda item: order[item[0]])
