"""Incremental detokenization and stop strings across token boundaries, with the real tokenizer."""

from __future__ import annotations

import pytest

from runtime.core import detokenizer


@pytest.fixture(scope="module")
def tok():
    from models.tokenizer import Tokenizer
    from models.weights import find_smollm2_gguf, read_gguf_index

    fields, _ = read_gguf_index(find_smollm2_gguf())
    return Tokenizer.from_gguf_fields(fields)


TEXTS = [
    "Emoji 🧑‍🚀 and 👍🏽 split across byte tokens.",
    "中文字符和日本語のテキスト、한국어도。",
    "Accents: naïve café déjà vu — “quotes” … ∑∫√",
    "def f(x):\n    return x ** 2  # 🐍\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_are_valid_utf8_and_concatenate_to_the_full_text(tok, text):
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids))), \
        "the text should contain a character split across tokens"
    state = detokenizer.new_state()
    pieces = []
    for i in range(1, len(ids) + 1):
        piece = detokenizer.step(tok, ids[:i], state, skip_special_tokens=True)
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # never a lone surrogate or broken character
        pieces.append(piece)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text


def test_stop_string_spanning_tokens_is_found_and_held_back(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text)
    state = detokenizer.new_state()
    out = ""
    stop = "ta gam"  # starts inside one token and ends inside another
    found = None
    for i in range(1, len(ids) + 1):
        new = detokenizer.step(tok, ids[:i], state, skip_special_tokens=True)
        out += new
        hit = detokenizer.find_stop(out, len(new), [stop])
        if hit:
            found = hit
            break
        # Whatever could still grow into the stop string is not shown yet.
        shown = out[:len(out) - detokenizer.holdback(out, [stop])]
        assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop)))
    assert found is not None and out[:found[0]] == "alpha be"


def test_holdback():
    assert detokenizer.holdback("hello wor", ["world"]) == 3
    assert detokenizer.holdback("hello", ["xyz"]) == 0
    assert detokenizer.find_stop("abc STOP def", 8, ["STOP"]) == (4, "STOP")


def test_flush_gives_the_held_back_tail_as_the_decoder_renders_it():
    """A sequence that ends inside a character split across tokens: `step` holds its first byte
    back (a later token could complete it); once none can, `flush` gives it as the decoder renders
    it (U+FFFD), so the text is what decoding the ids gives (issue 48)."""
    from conftest import tiny_bpe_tokenizer

    tok = tiny_bpe_tokenizer()
    ids = tok.encode("a\u00e9")[:-1]  # "a" and the first of the two bytes of "é"
    state = detokenizer.new_state()
    text = "".join(detokenizer.step(tok, ids[:i], state, True) for i in range(1, len(ids) + 1))
    assert text == "a"
    text += detokenizer.flush(tok, ids, state, True)
    assert text == tok.decode(ids) == "a\ufffd"
    assert detokenizer.flush(tok, ids, state, True) == ""  # nothing twice
    done = detokenizer.new_state()
    whole = "".join(detokenizer.step(tok, tok.encode("ab")[:i], done, True) for i in (1, 2))
    assert whole == "ab" and detokenizer.flush(tok, tok.encode("ab"), done, True) == ""
