"""`python -m runtime.bench`: `jaxserve bench` (runtime/tools/bench.py), under the name the documents use."""

import sys

from runtime.tools.bench import main

if __name__ == "__main__":
    from runtime.errors import run_main

    sys.exit(run_main(main))
