"""docs/design.md indexes every design note where it is written, and every note the code cites exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("engine", "offload", "scripts")
# a note is written where its name stands alone on a line ("Note [name]" in a docstring, "# Note [name]" in
# comments); it is cited anywhere else, inside a sentence that may wrap the name over lines of a comment or of
# concatenated string literals
DEFINITION = re.compile(r'^\s*(?:#\s*|""")?Note \[([^\]]+)\]\s*$')
CITATION = re.compile(r"Note \[([^\]]+)\]")


def _one_line(name: str) -> str:
    name = re.sub(r'\s*"\s*\n\s*"\s*', " ", name)  # "... a "\n "checkpoint ..." (string literals joined)
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", name).strip()  # wrapped comment or docstring lines
INDEX_ENTRY = re.compile(r"^- Note \[([^\]]+)\] → `([^`]+)`", re.MULTILINE)


def _python_files():
    for top in SOURCES:
        yield from sorted((ROOT / top).rglob("*.py"))


def _definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _python_files():
        for line in path.read_text(encoding="utf-8").splitlines():
            match = DEFINITION.match(line)
            if match:
                found.setdefault(match.group(1), []).append(str(path.relative_to(ROOT)))
    return found


def test_every_note_is_written_once():
    twice = {name: files for name, files in _definitions().items() if len(files) > 1}
    assert not twice, f"notes written in more than one place: {twice}"


def test_every_cited_note_is_written_somewhere():
    written = set(_definitions())
    cited = {_one_line(name): str(path.relative_to(ROOT)) for path in _python_files()
             for name in CITATION.findall(path.read_text(encoding="utf-8"))}
    missing = {name: where for name, where in cited.items() if name not in written}
    assert not missing, f"notes cited but written nowhere (name: a file citing it): {missing}"


def test_design_md_indexes_every_note_by_its_file():
    index = dict(INDEX_ENTRY.findall((ROOT / "docs" / "design.md").read_text(encoding="utf-8")))
    written = {name: files[0] for name, files in _definitions().items()}
    assert index == written, (
        f"docs/design.md's index is stale: missing {sorted(set(written) - set(index))}, "
        f"not in the code {sorted(set(index) - set(written))}, "
        f"in another file {sorted(n for n in set(index) & set(written) if index[n] != written[n])}")
