"""The documents stay true: the configuration page is the flag table's, and every relative link in
the README, the guides and the results pages points at a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_is_generated_from_the_flag_table():
    from config.doc import markdown

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == markdown(), "docs/configuration.md is stale: python -m config.doc > docs/configuration.md"


def test_every_flag_and_field_is_on_the_configuration_page():
    import dataclasses

    from config.flags import _ENGINE_FLAGS
    from config.engine_config import EngineConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    for field in dataclasses.fields(EngineConfig):
        assert f"| `{field.name}` |" in page, field.name
    for _, flags, _, vllm in _ENGINE_FLAGS:
        assert all(f"`{f}`" in page for f in flags) and vllm


DOCS = ["README.md", "BENCHMARKS.md", "benchmarks/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (but - and _), spaces to dashes,
    a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text).splitlines():
        m = re.match(r"^#{1,6} (.*)$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_follow_githubs_rule():
    text = "# A `flag`: here (x, y)\n## Same\n## Same\n```\n# not a heading\n```\n"
    assert anchors(text) == {"a-flag-here-x-y", "same", "same-1"}


def test_every_relative_link_resolves():
    bad = []
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        for m in LINK.finditer(_prose(text)):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z]+:", target):  # http(s):, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{doc}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                bad.append(f"{doc}: {target} (no such heading)")
    assert not bad, "broken links:\n" + "\n".join(bad)


GUIDES = ("serving", "offline", "compiler", "models", "cpu", "gpu", "scaling", "vllm-compat", "configuration",
          "server-flags", "adding-a-model", "contributing", "tools")


def test_the_readme_is_a_first_visit():
    """Its first screen is for a user: what it is, the two commands and what they cost; the test
    loops and how the golden data are made live in docs/contributing.md."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for guide in GUIDES:
        assert f"(docs/{guide}.md)" in text, f"the README does not link docs/{guide}.md"
    first_screen = "\n".join(text.splitlines()[:30])
    assert "bash scripts/serve.sh" in first_screen and "bash scripts/test.sh" in first_screen
    assert ".venv/bin/jaxserve" in text and "source .venv/bin/activate" in text
    contributing = (ROOT / "docs" / "contributing.md").read_text()
    assert "tests/data/golden" in contributing and "tests/data/make_golden.py" in contributing
    assert all(f"`{mark}`" in contributing for mark in ("slow", "smoke"))


def test_every_guide_starts_with_what_the_reader_can_do():
    for guide in (*GUIDES, "benchmarks/README"):
        lines = (ROOT / "docs" / f"{guide}.md").read_text().splitlines()
        assert lines[0].startswith("# ") and lines[2].startswith("After reading this "), guide
    assert (ROOT / "docs" / "ARCHITECTURE.md").is_file()


def test_benchmarks_rows_have_date_machine_command_baseline_and_entry():
    """BENCHMARKS.md is current results only: every table has those columns (or says them in its
    rows), and every row links to its dated entry in docs/benchmarks/."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    rows = [l for l in text.splitlines() if l.startswith("| 20")]
    assert len(rows) >= 10
    for row in rows:
        assert re.match(r"^\| 20\d\d-\d\d-\d\d \|", row) and "](docs/benchmarks/" in row, row
    for header in (l for l in text.splitlines() if l.startswith("| date |")):
        assert {"machine", "command"} <= {c.strip() for c in header.split("|")}, header
    assert len(text.splitlines()) < 200  # the history lives in docs/benchmarks/


ISSUE = re.compile(r"\b[Ii]ssues? ?#?\d+|\bissue\d+")


def test_the_pages_name_subjects_not_issue_numbers():
    """A reader does not know the tracker: the README, the guides, the results pages, the history's
    index and its entries' titles and file names say what was done, not which issue asked for it
    (an entry's body keeps its history)."""
    bad = [f"{doc}: {m.group(0)}" for doc in DOCS if not doc.startswith("docs/benchmarks/2")
           for m in ISSUE.finditer((ROOT / doc).read_text())]
    for entry in sorted((ROOT / "docs" / "benchmarks").glob("20*.md")):
        if ISSUE.search(entry.name) or ISSUE.search(entry.read_text().splitlines()[0]):
            bad.append(f"{entry.name}: its name or title")
    assert not bad, "issue numbers:\n" + "\n".join(bad)


FIGURE = re.compile(r"\d[\d.]*(?:-\d[\d.]*)?(?:x\b| s\b| tok/s\b)")
# Tables that quote BENCHMARKS.md's current results: (page, the heading of their section).
QUOTES = (("README.md", "## Results"), ("docs/cpu.md", "## CPU classes and the kernels' target"))


def test_quoted_results_are_the_results_pages_own():
    """A figure has one home, BENCHMARKS.md: the README's results and cpu.md's table of CPU classes
    quote it as it stands there, so a new measurement cannot leave an old one behind elsewhere."""
    bench = (ROOT / "BENCHMARKS.md").read_text()
    missing = []
    for page, heading in QUOTES:
        text = (ROOT / page).read_text()
        section = text[text.index(heading):]
        end = section.find("\n## ", 1)
        section = section if end < 0 else section[:end]
        rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
        assert len(rows) >= 5, page
        missing += [f"{page}: {f}" for row in rows for f in FIGURE.findall(row) if f not in bench]
    assert not missing, "figures BENCHMARKS.md does not have:\n" + "\n".join(missing)


def test_server_flags_page_is_generated_from_the_servers_parser():
    from config.doc import SERVER_PAGE_COMMAND, server_markdown
    from runtime.entrypoints.openai.api_server import parse_args

    page = (ROOT / "docs" / "server-flags.md").read_text()
    assert page == server_markdown(parse_args([])[0]), f"docs/server-flags.md is stale: {SERVER_PAGE_COMMAND}"


# Where the project reads its environment: the product, the scripts, and the tests' own settings.
ENV_SOURCES = ("runtime", "config", "models", "passes", "ir", "pallas_kernels", "scripts", "tests/conftest.py")
ENV_READ = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\s*[(\[]\s*|getenv\(\s*|^\s*[A-Z_]*(?:ENV|ENV_SWITCH|HOME)\w*\s*=\s*)["']([A-Z][A-Z0-9_]+)["']""", re.M)
SHELL_READ = re.compile(r"\$\{([A-Z][A-Z0-9_]*)[:}]")


def _source_files(kinds=(".py", ".sh")):
    """ENV_SOURCES' files, but the table's own (config/doc.py), and every test module."""
    for src in ENV_SOURCES:
        path = ROOT / src
        yield from ([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in kinds
                                                         and p != ROOT / "config" / "doc.py"))
    yield from sorted(p for p in (ROOT / "tests").glob("*.py") if p.name not in ("conftest.py", "test_docs.py"))


def test_every_environment_variable_read_is_on_the_page():
    """The source's reads of the environment (os.environ, getenv, a *_ENV name constant, a shell
    ${NAME:-...}, and any JAXSERVE_* name in Python or shell, tests included) against config.doc's
    ENV_VARS; and no row there that no source names."""
    from config.doc import ENV_VARS

    listed = {name for _, rows in ENV_VARS for name, *_ in rows}
    read: dict[str, str] = {}
    for path in _source_files():
        text = path.read_text()
        names = set(re.findall(r"\bJAXSERVE_[A-Z0-9_]+\b", text))
        if path.parent.name != "tests" or path.name == "conftest.py":
            names |= set(ENV_READ.findall(text)) | (set(SHELL_READ.findall(text)) if path.suffix == ".sh" else set())
        for name in names:
            read.setdefault(name, str(path.relative_to(ROOT)))
    missing = sorted(f"{name} ({where})" for name, where in read.items() if name not in listed)
    assert not missing, "environment variables read but not in config.doc.ENV_VARS:\n" + "\n".join(missing)
    source = "".join(p.read_text() for p in _source_files((".py", ".sh", ".cc")))
    assert not [n for n in listed if n not in source], "ENV_VARS rows that no source reads"
