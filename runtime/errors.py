"""User errors on the command line: one line that says what is wrong and how to fix it, exit 2.

A `UserError` is a mistake the person at the keyboard can fix (a model that does not exist, a
busy port, a plan that does not fit). `run_main` prints it as `error: ...` with no traceback;
`--debug` (anywhere on the command line) or JAXSERVE_DEBUG=1 re-raises it with the traceback.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

USER_ERROR_EXIT = 2  # argparse's exit code for a bad command line


class UserError(Exception):
    """A mistake in what the user asked for; the message names it and the fix."""


def split_debug(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """(debug?, argv without `--debug`); JAXSERVE_DEBUG=1 also turns debugging on."""
    argv = list(argv)
    debug = os.environ.get("JAXSERVE_DEBUG", "").lower() in ("1", "true", "yes", "on")
    if "--" in argv:  # everything after `--` belongs to the command
        head, tail = argv[:argv.index("--")], argv[argv.index("--"):]
    else:
        head, tail = argv, []
    if "--debug" in head:
        debug = True
        head = [a for a in head if a != "--debug"]
    return debug, head + tail


def run_main(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Runs `main(argv)`; a UserError becomes one `error:` line on stderr and exit code 2."""
    debug, argv = split_debug(sys.argv[1:] if argv is None else argv)
    try:
        return int(main(argv) or 0)
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
