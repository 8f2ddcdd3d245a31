"""The ``meshplace`` command's entry point (``[project.scripts]``).

It imports nothing but :mod:`sys` before the command line's own modules (rich, the
argument types, each subcommand's code), so Ctrl-C while those load gets the answer it
gets at any other moment — one line, ``meshplace: interrupted``, and exit status 130 —
rather than Python's traceback from inside an import (:func:`meshplace.cli.main` answers
it from then on).
"""

from __future__ import annotations

import sys


def main() -> int:
    """Run the command line (:func:`meshplace.cli.main`); Ctrl-C while it loads is exit
    130 with one line."""
    try:
        from meshplace.cli import main as run
    except KeyboardInterrupt:
        print("meshplace: interrupted", file=sys.stderr)
        return 130
    return run()
