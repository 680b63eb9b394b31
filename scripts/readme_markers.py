"""The generated parts of the README and docs: a document's text between a pair of marker comments, replaced, and
the command line of a script that renders one."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


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


def marked_main(argv: list[str] | None, description: str, script: str, render: Callable[[], str],
                current: Callable[[Path], tuple[str, str]], errors: tuple[type[Exception], ...]) -> int:
    """The command line of a script that renders one marked README part: print it, --write it, or --check it
    (exit 1 when stale); the script's own errors (and MarkerError) exit 2."""
    parser = argparse.ArgumentParser(description=description)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="README", help="rewrite the table there")
    action.add_argument("--check", type=Path, metavar="README", help="exit 1 when the table there is stale")
    args = parser.parse_args(argv)
    try:
        if args.write:
            _, fresh = current(args.write)
            args.write.write_text(fresh, encoding="utf-8")
        elif args.check:
            text, fresh = current(args.check)
            if text != fresh:
                print(f"stale: run {script} --write {args.check}", file=sys.stderr)
                return 1
        else:
            print(render())
    except (*errors, MarkerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
