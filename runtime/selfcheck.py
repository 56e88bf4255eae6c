"""`python -m runtime.selfcheck`: `jaxserve selfcheck` (runtime/tools/selfcheck.py), under the name the documents use."""

import sys

from runtime.tools.selfcheck import main

if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
