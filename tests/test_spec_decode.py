"""Speculative decoding's host parts: SpeculativeConfig and the n-gram proposer. Verification in the
engine is tested in test_spec_decode_engine.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from config.engine_config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from runtime.core.spec_decode import NgramProposer, make_proposer


# ---------------------------------------------------------------- config


def test_config_vllm_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = SpeculativeConfig.from_dict(json.dumps({"method": "ngram", "num_speculative_tokens": 5,
                                                "prompt_lookup_min": 1, "prompt_lookup_max": 4}))
    assert c.to_dict() == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 1}
    assert SpeculativeConfig.from_dict(None) is None and SpeculativeConfig.from_dict("") is None
    assert SpeculativeConfig.from_dict(c) is c
    assert isinstance(make_proposer(c), NgramProposer)


@pytest.mark.parametrize("d, field", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method"),
    ({"method": 1, "num_speculative_tokens": 3}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": MAX_NUM_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": "4"}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 10 ** 6}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": -1}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "ngram_size": 2}, "ngram_size"),
    ('{"method": "ngram", "num_speculative_tokens": 3', "JSON"),
    ("[1, 2]", "object"),
])
def test_config_rejects(d, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(d)


def test_config_names_unsupported_method():
    with pytest.raises(ValueError, match="'eagle' is not supported.*'ngram'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="'draft_model' is planned"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=3)


def test_step_rows_hold_a_whole_draft():
    """A verify step lays k drafts out as k+1 rows: the bucket table holds them even for one
    sequence; wider batches share their max_num_seqs rows with drafts."""
    from config.engine_config import EngineConfig
    from runtime.core.buckets import BucketTable

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    assert EngineConfig(max_num_seqs=1).max_step_rows == 1
    assert EngineConfig(max_num_seqs=1, speculative_config=spec).max_step_rows == 5
    assert EngineConfig(max_num_seqs=16, speculative_config=spec).max_step_rows == 16
    assert EngineConfig(max_num_seqs=2, max_num_batched_tokens=4, speculative_config=spec).max_step_rows == 4
    for n in (1, 4):
        table = BucketTable.for_engine(EngineConfig(max_num_seqs=n, speculative_config=spec))
        assert table.pick(5, 5) == (8, 5) and table.pick(1, 1) == (1, 1)
        assert len(table.pairs()) == len(BucketTable.for_engine(EngineConfig(max_num_seqs=n)).pairs())


# ---------------------------------------------------------------- n-gram proposer


def brute_force(tokens, k, lo, hi):
    """The definition, literally: longest n first, most recent earlier occurrence."""
    L = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n:]
        for s in range(L - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_ngram_match_found():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]


def test_ngram_prefers_longest_n():
    # "3" alone last occurred before 7, but "2 3" occurred before 4: the longer match wins.
    p = NgramProposer(1, 3)
    assert p.propose([2, 3, 4, 5, 3, 7, 8, 2, 3], 2) == [4, 5]
    # With max n = 1 only the single-token match counts: its most recent occurrence is before 7.
    assert NgramProposer(1, 1).propose([2, 3, 4, 5, 3, 7, 8, 2, 3], 2) == [7, 8]


def test_ngram_most_recent_occurrence():
    assert NgramProposer(2, 2).propose([1, 2, 10, 11, 1, 2, 20, 21, 5, 1, 2], 2) == [20, 21]


def test_ngram_no_match():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4], 3) == []
    assert p.propose([], 3) == []
    assert p.propose([7], 3) == []
    assert p.propose([1, 2, 1], 0) == []


def test_ngram_k_truncated_at_sequence_end():
    # The most recent earlier "5 5" ends one before the last token: only the last token follows it.
    assert NgramProposer(2, 2).propose([5, 5, 5, 5], 4) == [5]
    assert NgramProposer(1, 2).propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]


def test_ngram_min_max_bounds():
    seq = [4, 9, 1, 2, 3, 8, 8, 2, 3]  # "2 3" recurs; "1 2 3" does not
    assert NgramProposer(3, 4).propose(seq, 2) == []  # needs n >= 3
    assert NgramProposer(2, 4).propose(seq, 2) == [8, 8]
    assert NgramProposer(1, 1).propose([1, 2, 3, 1], 2) == [2, 3]
    # n larger than the sequence allows falls back to the longest that fits
    assert NgramProposer(1, 8).propose([6, 6], 3) == [6]


def test_ngram_matches_brute_force_and_accepts_arrays():
    rng = np.random.default_rng(0)
    for _ in range(300):
        L = int(rng.integers(0, 40))
        toks = rng.integers(0, 4, size=L).tolist()
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 6))
        k = int(rng.integers(1, 6))
        want = brute_force(toks, k, lo, hi)
        assert NgramProposer(lo, hi).propose(toks, k) == want, (toks, k, lo, hi)
        assert NgramProposer(lo, hi).propose(np.asarray(toks, np.int32), k) == want


def test_ngram_fast_on_long_sequences():
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 50, size=4000).tolist()  # a small vocabulary: many candidate matches
    p = NgramProposer(1, 5)
    p.propose(toks, 4)
    t0 = time.perf_counter()
    for _ in range(50):
        p.propose(toks, 4)
    assert (time.perf_counter() - t0) / 50 < 0.005
