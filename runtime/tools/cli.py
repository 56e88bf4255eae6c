"""jaxserve: one command line with vLLM's shape.

    jaxserve serve --model smollm2-135m            # OpenAI-compatible server
    jaxserve compile --model smollm2-135m --out plans/smollm2
    jaxserve bench --model smollm2-135m            # offline; `bench serve` / `bench soak` online
    jaxserve dump --model llama-2-70b --stats      # the IR after the passes, and the memory plan
    jaxserve selfcheck --quick
    jaxserve kv-table
    jaxserve env                                   # versions, devices, caches (for bug reports)

Each subcommand runs the module's own main (`python -m runtime.serve` and the others keep
working) with the same engine flags and units. A mistake gives one `error:` line and exit code 2;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from config.flags import PROG_ENV
from runtime.entrypoints.args import ArgumentParser, quiet_tpu_probe  # noqa: F401 (runtime.serve imports it from here)
from runtime.errors import run_main

# name -> (module whose main(argv) runs it: the `python -m` name its errors are shown under, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("runtime.serve", "start the OpenAI-compatible HTTP server (python -m runtime.serve)"),
    "compile": ("runtime.compile", "compile a model into a plan directory, or --dry-run its memory plan"),
    "bench": ("runtime.bench", "offline throughput by scheduling policy; `bench serve` and `bench soak` "
                         "against a server"),
    "dump": ("ir.dump", "print the IR after each compiler pass and the memory plan (no weights)"),
    "selfcheck": ("runtime.selfcheck", "devices, kernels vs references, a tiny model, a throughput probe"),
    "kv-table": ("models.kv_table", "KV-cache bytes per preset and sequence length"),
    "env": ("runtime.tools.collect_env", "versions, devices, caches and settings for a bug report"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="jaxserve", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return ap


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("jaxserve")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def serve(argv: list[str]) -> int:
    """Checks the model or plan, the engine args and the port, then runs the server."""
    from runtime import serve as server

    return server.main(argv)  # it runs the pre-flight checks itself


def dispatch(argv: list[str]) -> int:
    ap = build_parser()
    if not argv or argv[0] not in COMMANDS:
        ap.parse_args(argv)  # --help, --version, or an unknown command (argparse's error, exit 2)
        ap.print_help()
        return 0 if not argv else 2
    name, rest = argv[0], argv[1:]
    module = COMMANDS[name][0]
    shown = os.environ.get(PROG_ENV)
    if (shown or "").partition("=")[0] != module:  # scripts/serve.sh names itself
        os.environ[PROG_ENV] = f"{module}=jaxserve {name}"  # errors name `jaxserve serve`, not `python -m ...`
    try:
        if name == "serve":
            return serve(rest)
        return importlib.import_module(module).main(rest) or 0  # lazily: selfcheck and serve pull in a lot
    finally:
        if shown is None:
            os.environ.pop(PROG_ENV, None)
        else:
            os.environ[PROG_ENV] = shown


def main(argv=None) -> int:
    """`jaxserve COMMAND ...` (the console script); errors as one line, exit 2."""
    return run_main(dispatch, argv)  # it takes `--debug` off the command line wherever it is


if __name__ == "__main__":
    sys.exit(main())
