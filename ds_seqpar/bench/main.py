"""``ds-seqpar bench [SUITE] [options]``: one command over the suites (docs/benchmarks.md), each a module of
bench/ with ``main(argv) -> int``, listed once in suites.py (``--list`` prints them); attention is the
default. A new suite is its module and one line in suites.SUITES. The old spellings (``--packed``,
``--window``, ``--hybrid``, ``--trainer`` anywhere on the line) still work and print one deprecation line.
"""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

from .suites import DEFAULT, SUITES, listing

OLD_FLAGS = {f"--{suite}": suite for suite in ("packed", "window", "hybrid", "trainer")}


def suite_of(argv: List[str]):
    """(suite, its arguments): the first argument when it names a suite; an old flag anywhere (with a
    deprecation line); else the default suite."""
    if argv[:1] and argv[0] in SUITES:
        return argv[0], argv[1:]
    for flag, suite in OLD_FLAGS.items():
        if flag in argv:
            print(f"ds-seqpar bench: {flag} is deprecated; use `ds-seqpar bench {suite} ...`", file=sys.stderr)
            return suite, [a for a in argv if a != flag]
    return DEFAULT, argv


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--list"]:
        print(listing())
        return 0
    suite, argv = suite_of(argv)
    return importlib.import_module(f"{__package__}.{suite}").main(argv)


if __name__ == "__main__":
    sys.exit(main())
