"""The generated parts of the README and docs: a document's text between a pair of marker comments, replaced."""

from __future__ import annotations

from pathlib import Path


class MarkerError(Exception):
    """A document without its pair of markers (or with them out of order)."""


def replaced(document: str, markers: tuple[str, str], body: str, path: Path) -> str:
    """`document` with the text between `markers` replaced by `body`."""
    start, end = markers
    if document.count(start) != 1 or document.count(end) != 1 or document.index(start) > document.index(end):
        raise MarkerError(f"{path}: needs one {start} and, after it, one {end}")
    head, rest = document.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"
