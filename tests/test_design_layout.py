"""docs/design.md's Layout names every module of engine/ and offload/: a module is named under its package's entry
(its file's stem), or under an ancestor package's entry as a dotted path to it or to a package holding it
(`runtime.zero` names every module of engine/compat/deepspeed/runtime/zero/)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def layout_entries(text: str) -> dict[str, set[str]]:
    """Each `package/` entry of the Layout block and the (dotted) names its text mentions."""
    block = text[text.index("## Layout"):].split("```")[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        match = re.match(r"^(\S+/)\s+(.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = entries.get(current, "") + " " + match.group(2)
        elif current is not None and line.startswith(" "):
            entries[current] += " " + line.strip()
    return {package: set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)*", words))
            for package, words in entries.items()}


def unnamed_modules(entries: dict[str, set[str]], modules: list[pathlib.PurePosixPath]) -> list[str]:
    missing = []
    for module in modules:
        parts = [*module.parent.parts, module.stem]
        named = False
        for cut in range(1, len(parts)):  # an ancestor package's entry, and the dotted path below it
            names = entries.get("/".join(parts[:cut]) + "/", set())
            below = parts[cut:]
            if any(".".join(below[:n]) in names for n in range(1, len(below) + 1)
                   if n == len(below) or n >= 2):  # the module itself, or a dotted package path above it
                named = True
                break
        if not named:
            missing.append(str(module))
    return missing


def test_the_layout_names_every_module():
    modules = [pathlib.PurePosixPath(p.relative_to(ROOT).as_posix()) for top in ("engine", "offload")
               for p in sorted((ROOT / top).rglob("*.py")) if p.stem != "__init__"]
    missing = unnamed_modules(layout_entries((ROOT / "docs" / "design.md").read_text(encoding="utf-8")), modules)
    assert not missing, f"name them in docs/design.md's Layout: {missing}"


def test_a_module_the_layout_omits_is_found():
    text = ("## Layout\n```\nengine/zero/   policy, runtime.helpers\nengine/compat/deepspeed/  runtime, runtime.zero\n"
            "```\n")  # a package's bare name ("runtime") names none of its modules
    modules = [pathlib.PurePosixPath(m) for m in ("engine/zero/policy.py", "engine/zero/grad_sync.py",
                                                   "engine/compat/deepspeed/runtime/zero/stage3.py",
                                                   "engine/compat/deepspeed/runtime/engine.py")]
    assert unnamed_modules(layout_entries(text), modules) == ["engine/zero/grad_sync.py",
                                                              "engine/compat/deepspeed/runtime/engine.py"]
