"""`python -m runtime.compile`: `jaxserve compile` (runtime/tools/compile.py), under the name the documents use."""

import sys

from runtime.tools.compile import main

if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
