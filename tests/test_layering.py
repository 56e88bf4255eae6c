"""The layering (docs/ARCHITECTURE.md, "Rules for contributors"), checked from the source: what
each folder may import, and no import cycles.

Every project module is parsed with `ast` (nothing is imported), and every import counts: at
module level or inside a function, `import x`, `from x import y`, and imports by name:
`importlib.import_module("runtime.x")`; an f-string such as `f"runtime.tools.bench_{name}"` stands for
every module whose name starts with its constant head; and a module that imports by a computed
name (runtime.tools.cli's command table) imports every project module it names in a string.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ir", "passes", "models", "pallas_kernels", "config", "runtime")

# What each folder may import (a folder may always import itself).
ALLOWED = {
    "ir": set(),
    "passes": {"ir", "config"},
    "models": {"ir", "config"},
    "pallas_kernels": set(),
    # The engine's settings and flag table: the flags' checks look up a model's presets and files.
    "config": {"ir", "models"},
    "runtime": {"ir", "passes", "models", "pallas_kernels", "config"},
}
# The one exception: ir/dump.py, the command-line face, may import models, passes and the flags.
EXCEPTIONS = {"ir.dump": {"models", "passes", "config"}}
IMPORT_BY_NAME = {"import_module", "run_module", "__import__"}


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


MODULES = module_files()


def _project_module(name: str) -> str | None:
    """The longest project module that `name` is or lies in (`ir.graph.Node` -> `ir.graph`)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in MODULES:
            return candidate
    return None


def _named_imports(call: ast.Call, tree: ast.AST) -> list[str]:
    func = call.func
    fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if fname not in IMPORT_BY_NAME or not call.args:
        return []
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = arg.values[0].value
        return [m for m in MODULES if m.startswith(head)]
    # A computed name (e.g. COMMANDS[name][0]): any project module this file names may be it.
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in MODULES]


def imports_of(module: str) -> dict[str, int]:
    """Project modules that `module` imports -> the first line that does."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        target = _project_module(name)
        if target is not None and target != module:
            found.setdefault(target, line)

    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from runtime import kernels` imports runtime.worker.kernels
                sub = f"{source}.{alias.name}"
                add(sub if sub in MODULES else source, node.lineno)
        elif isinstance(node, ast.Call):
            for name in _named_imports(node, tree):
                add(name, node.lineno)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


# runtime/'s rooms (docs/ARCHITECTURE.md), and which other rooms each may import: the engine knows
# nothing of how it is served; the distributed pieces serve through the HTTP layer; only the tools
# and the `python -m` names at the top may import the tools.
RUNTIME_ROOMS = {
    "core": set(),
    "worker": {"core"},
    "engine": {"core", "worker"},
    "entrypoints": {"core", "worker", "engine", "distributed"},
    "distributed": {"entrypoints"},
    "tools": {"core", "worker", "engine", "entrypoints", "distributed"},
}
# What may stand loose in runtime/: the package, its errors, and the `python -m` names users and
# the documents rely on (each a few lines that call a room's main).
RUNTIME_LOOSE = {"__init__", "errors", "serve", "compile", "bench", "selfcheck"}


def test_runtime_is_in_rooms():
    loose = {p.stem for p in (ROOT / "runtime").glob("*.py")}
    assert loose == RUNTIME_LOOSE and len(loose) <= 8, f"runtime/'s loose files: {sorted(loose)}"
    rooms = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(RUNTIME_ROOMS), f"runtime/'s rooms: {sorted(rooms)}"
    for name in RUNTIME_LOOSE - {"__init__", "errors"}:
        assert len((ROOT / "runtime" / f"{name}.py").read_text().splitlines()) <= 20, f"runtime/{name}.py is a name, not code"


def test_runtime_rooms_import_what_the_map_allows():
    bad = []
    for module, deps in sorted(GRAPH.items()):
        parts = module.split(".")
        if parts[0] != "runtime" or len(parts) < 3 or parts[1] not in RUNTIME_ROOMS:
            continue
        for dep, line in sorted(deps.items()):
            dparts = dep.split(".")
            if dparts[0] != "runtime" or len(dparts) < 2 or dparts[1] in (parts[1], "errors"):
                continue
            if parts[1] == "tools" and len(dparts) == 2 and dparts[1] in RUNTIME_LOOSE:
                continue  # the `python -m` names the jaxserve command runs
            if dparts[1] not in RUNTIME_ROOMS[parts[1]]:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {dep}")
    assert not bad, "imports across runtime/'s rooms that its map forbids:\n" + "\n".join(bad)


def test_every_folder_is_found():
    assert {m.split(".")[0] for m in MODULES} == set(PACKAGES)
    assert "ir.graph" in MODULES and "runtime.engine.llm_engine" in MODULES


def test_folders_import_only_what_design_allows():
    bad = []
    for module, deps in sorted(GRAPH.items()):
        folder = module.split(".")[0]
        allowed = ALLOWED[folder] | EXCEPTIONS.get(module, set()) | {folder}
        for dep, line in sorted(deps.items()):
            if dep.split(".")[0] not in allowed:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {dep}")
    assert not bad, "imports the layering forbids (docs/ARCHITECTURE.md):\n" + "\n".join(bad)


# The worker runs what the compiler made: it may read a pass's result (the memory plan it is sized
# by), never a pass's constants or rewrites. Constants that a pass and the worker must agree on
# (the XLA lowering's tiling: ir/tiling.py) live under ir/, which both may import.
WORKER_MAY_TAKE_FROM_PASSES = {"passes.plan_memory": {"MemoryPlan"}}


def test_the_worker_takes_only_results_from_passes():
    bad = []
    for module, path in sorted(MODULES.items()):
        if not module.startswith("runtime.worker"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}"
                        for a in node.names if a.name.split(".")[0] == "passes"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "passes":
                allowed = WORKER_MAY_TAKE_FROM_PASSES.get(node.module, set())
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                        for a in node.names if a.name not in allowed]
    assert not bad, ("runtime/worker takes a pass's constants or code (put shared constants under ir/, "
                     "as ir/tiling.py does):\n" + "\n".join(bad))


def test_no_private_name_crosses_a_folder():
    """A name with a leading underscore is its folder's own: another folder asks for a public one
    (protocol.py once took models.tokenizer's _bytes_to_unicode; it now asks Tokenizer.token_bytes)."""
    bad = []
    for module, path in sorted(MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                    and node.module.split(".")[0] in PACKAGES and node.module.split(".")[0] != module.split(".")[0]:
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names taken across folders:\n" + "\n".join(bad)


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_find_cycles_finds_one():
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


# Cycles known and waiting for a one-line fix in a file another change holds; each entry must
# still be a cycle (delete it when the cycle is gone).
KNOWN_CYCLES: dict[tuple[str, str], str] = {}  # (module, module) -> why it is tolerated for now


def test_no_import_cycles():
    # A package's __init__ that re-exports its submodules is no cycle: `from runtime.x import y`
    # runs runtime/__init__ first, but the edge that matters is to runtime.x.
    found = find_cycles(GRAPH)
    stale = [c for c in KNOWN_CYCLES if list(c) not in found]
    assert not stale, f"no longer cycles, delete them from KNOWN_CYCLES: {stale}"
    cycles = [c for c in found if tuple(c) not in KNOWN_CYCLES]
    lines = []
    for cycle in cycles:
        members = set(cycle)
        edges = [f"  {m} -> {d} ({MODULES[m].relative_to(ROOT)}:{line})"
                 for m in cycle for d, line in sorted(GRAPH[m].items()) if d in members]
        lines.append(" <-> ".join(cycle) + "\n" + "\n".join(edges))
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def _third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_runtime_core_is_host_only():
    """runtime/core/ (scheduler, block manager, sequences, params) is plain Python: no jax, and nothing
    from the project outside runtime.core but the engine settings (config.engine_config), so its
    tests run in milliseconds without a device."""
    bad = []
    for module, path in sorted(MODULES.items()):
        if not module.startswith("runtime.core"):
            continue
        jaxy = _third_party_imports(path) & {"jax", "jaxlib", "flax", "orbax"}
        if jaxy:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(jaxy)}")
        bad += [f"{path.relative_to(ROOT)}:{line} imports {dep}" for dep, line in GRAPH[module].items()
                if not dep.startswith("runtime.core") and dep != "config.engine_config"]
    assert not bad, "runtime/core must stay host-only:\n" + "\n".join(bad)


MAX_PRODUCT_FILE_LINES = 600


def test_no_product_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_PRODUCT_FILE_LINES}
    assert not long, f"split these files (limit {MAX_PRODUCT_FILE_LINES} lines): {long}"
