"""User errors on the command line: one line that says what is wrong and how to fix it, exit 2.

Defined in config.flags (see there); this is where the runtime imports them from.
"""

from config.flags import USER_ERROR_EXIT, UserError, run_main, split_debug

__all__ = ["USER_ERROR_EXIT", "UserError", "run_main", "split_debug"]
