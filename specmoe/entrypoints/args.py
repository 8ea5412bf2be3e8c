"""argparse helpers shared by the command-line tools."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def comma_list(kind: Callable = str) -> Callable[[str], list]:
    """An argparse `type`: "a,b,c" -> [kind("a"), kind("b"), kind("c")], blanks around items
    and empty items dropped. A bad item is an argparse error that names the whole value (so
    `--ks 2,x` exits 2 with a usage line, not a traceback)."""
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"invalid list {text!r}: expected comma-separated {kind.__name__} values"
            ) from exc
    parse.__name__ = f"comma list of {kind.__name__}"
    return parse
