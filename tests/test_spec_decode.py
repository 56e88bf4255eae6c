"""Speculative decoding's parts: SpeculativeConfig, the n-gram proposer, and the rejection sampler
(greedy against a plain per-row reference; sampled rows against softmax(logits / T) statistically)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import scipy.stats

import jax
import jax.numpy as jnp

from models.engine_config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from runtime.core.spec_decode import NgramProposer, make_proposer
from runtime.worker.rejection_sampler import rejection_sample

_rs = jax.jit(rejection_sample)


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


# ---------------------------------------------------------------- rejection sampler: greedy


def greedy_reference(logits, drafts, n):
    out = []
    for i in range(n):
        best = int(np.argmax(logits[i]))
        if drafts[i] != best:
            return out + [best], i
        out.append(int(drafts[i]))
    return out + [int(np.argmax(logits[n]))], n


def keys_for(r, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), r)


@pytest.mark.parametrize("R, K, V", [(1, 1, 5), (4, 3, 17), (7, 5, 64), (16, 8, 300)])
@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_matches_reference(R, K, V, mixed):
    rng = np.random.default_rng(R * 100 + K)
    logits = rng.normal(size=(R, K + 1, V)).astype(np.float32)
    argmax = logits.argmax(-1)
    # Drafts: mostly the argmax (long acceptance runs), sometimes not.
    drafts = np.where(rng.random((R, K)) < 0.7, argmax[:, :K], rng.integers(0, V, (R, K))).astype(np.int32)
    num_draft = rng.integers(0, K + 1, R).astype(np.int32)
    num_draft[-1] = K
    num_draft[0] = 0 if R > 1 else num_draft[0]  # one row without drafts (when there are two rows)
    drafts[-1] = argmax[-1, :K]  # one row accepts everything and takes the bonus
    temperature = np.zeros(R, np.float32)
    if mixed:
        temperature[1::2] = 0.8  # sampled rows beside greedy ones
    out, n_acc = _rs(logits, drafts, num_draft, temperature, keys_for(R))
    out, n_acc = np.asarray(out), np.asarray(n_acc)
    assert out.shape == (R, K + 1) and out.dtype == np.int32 and n_acc.dtype == np.int32
    for r in range(R):
        if temperature[r] > 0:
            # structure only: accepted drafts, one token, then -1
            a = n_acc[r]
            assert 0 <= a <= num_draft[r]
            assert out[r, :a].tolist() == drafts[r, :a].tolist()
            assert 0 <= out[r, a] < V and (out[r, a + 1:] == -1).all()
            continue
        want, a = greedy_reference(logits[r], drafts[r], num_draft[r])
        assert n_acc[r] == a
        assert out[r].tolist() == want + [-1] * (K + 1 - len(want))
    assert n_acc[-1] == K or temperature[-1] > 0
    assert n_acc[0] == 0 or R == 1


def test_greedy_ignores_drafts_beyond_num_draft():
    logits = np.zeros((1, 4, 6), np.float32)
    logits[0, :, 2] = 1.0
    logits[0, 2, 2], logits[0, 2, 5] = 0.0, 1.0
    drafts = np.array([[2, 2, 2]], np.int32)  # the third would be rejected, but only two count
    out, n = _rs(logits, drafts, np.array([2], np.int32), np.zeros(1, np.float32), keys_for(1))
    assert np.asarray(out).tolist() == [[2, 2, 5, -1]] and int(n[0]) == 2


# ---------------------------------------------------------------- rejection sampler: distribution

N = 20000


def softmax(x, t):
    z = np.exp((x - x.max()) / t)
    return z / z.sum()


def check_distribution(samples, p, label):
    """Chi-square at the 0.1% level (cells expecting < 5 pooled) and every frequency within 4.5 sigma."""
    n = len(samples)
    assert n > 500, label
    counts = np.bincount(samples, minlength=len(p))
    assert len(counts) == len(p), label
    expected = n * p
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    assert chi2 < scipy.stats.chi2.ppf(0.999, len(exp) - 1), (label, chi2, counts / n, p)
    assert (np.abs(counts / n - p) <= 4.5 * np.sqrt(p * (1 - p) / n) + 1e-3).all(), (label, counts / n, p)


V8_LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5],
                      [0.2, -1.0, 1.8, 0.7, 0.0, 1.1, -0.3, 0.4],
                      [1.0, 0.0, -2.0, 0.5, 2.5, 0.1, 0.0, -0.5]], np.float32)


@pytest.mark.parametrize("T", [0.7, 1.0, 1.5])
@pytest.mark.parametrize("drafts", [(0, 2), (7, 5), (5, 1), (4, 3)])  # likely, fairly likely, unlikely
def test_sampled_distribution(T, drafts):
    logits = np.broadcast_to(V8_LOGITS, (N, 3, 8))
    d = np.broadcast_to(np.array(drafts, np.int32), (N, 2))
    keys = keys_for(N, seed=int(T * 10) + drafts[0])
    out, n_acc = _rs(logits, d, np.full(N, 2, np.int32), np.full(N, T, np.float32), keys)
    out, n_acc = np.asarray(out), np.asarray(n_acc)
    p = [softmax(V8_LOGITS[i], T) for i in range(3)]
    check_distribution(out[:, 0], p[0], "first token")
    # Acceptance rate of the first draft is p(d).
    acc0 = (n_acc >= 1).mean()
    assert abs(acc0 - p[0][drafts[0]]) < 5 * np.sqrt(0.25 / N)
    # Given the first draft was accepted, the second token is distributed as p at position 1.
    first_ok = out[:, 0] == drafts[0]
    assert (first_ok == (n_acc >= 1)).all()
    if first_ok.sum() > 500:
        check_distribution(out[first_ok, 1], p[1], "second token")
    # And given both were accepted, the bonus token follows p at position 2.
    both = n_acc == 2
    if both.sum() > 500:
        check_distribution(out[both, 2], p[2], "bonus token")
    assert (out[~first_ok, 1:] == -1).all()


def test_sampled_bonus_and_no_draft_rows():
    # num_draft 0: the one output token is a plain sample from p at position 0.
    logits = np.broadcast_to(V8_LOGITS, (N, 3, 8))
    d = np.zeros((N, 2), np.int32)
    out, n_acc = _rs(logits, d, np.zeros(N, np.int32), np.full(N, 1.0, np.float32), keys_for(N, 3))
    out = np.asarray(out)
    assert (np.asarray(n_acc) == 0).all() and (out[:, 1:] == -1).all()
    check_distribution(out[:, 0], softmax(V8_LOGITS[0], 1.0), "no-draft token")
    # num_draft 1 with K = 2: the bonus comes from position 1, not 2.
    d[:, 0] = 0
    out, n_acc = _rs(logits, d, np.ones(N, np.int32), np.full(N, 1.0, np.float32), keys_for(N, 4))
    out, n_acc = np.asarray(out), np.asarray(n_acc)
    assert n_acc.max() == 1 and (out[:, 2] == -1).all()
    check_distribution(out[n_acc == 1, 1], softmax(V8_LOGITS[1], 1.0), "bonus after one draft")


def test_draft_model_q_probs_distribution():
    """The q_probs path: drafts sampled from a draft distribution q still give p exactly."""
    rng = np.random.default_rng(5)
    q = rng.dirichlet(np.ones(8), size=2).astype(np.float32)  # [K, V]
    kd, ks = jax.random.split(jax.random.PRNGKey(9))
    draw = jax.vmap(lambda kk: jax.random.categorical(kk, jnp.log(q), axis=-1))
    drafts = np.asarray(draw(jax.random.split(kd, N))).astype(np.int32)  # [N, 2], each row drawn from q
    logits = np.broadcast_to(V8_LOGITS, (N, 3, 8))
    out, n_acc = _rs(logits, drafts, np.full(N, 2, np.int32), np.full(N, 1.0, np.float32),
                     jax.random.split(ks, N), np.broadcast_to(q, (N, 2, 8)))
    out, n_acc = np.asarray(out), np.asarray(n_acc)
    check_distribution(out[:, 0], softmax(V8_LOGITS[0], 1.0), "first token (draft model)")
    ok = n_acc >= 1
    check_distribution(out[ok, 1], softmax(V8_LOGITS[1], 1.0), "second token (draft model)")


def test_per_row_keys_make_rows_independent_of_the_batch():
    logits = np.broadcast_to(V8_LOGITS, (6, 3, 8)).copy()
    d = np.full((6, 2), 0, np.int32)
    keys = keys_for(6, 11)
    out, _ = _rs(logits, d, np.full(6, 2, np.int32), np.full(6, 1.0, np.float32), keys)
    sub, _ = _rs(logits[2:4], d[2:4], np.full(2, 2, np.int32), np.full(2, 1.0, np.float32), keys[2:4])
    assert np.asarray(out)[2:4].tolist() == np.asarray(sub).tolist()
