"""The jitted sampler against plain expectations on small vocabularies."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from runtime.worker.sampler import build_inputs, sample_rows
from runtime.core.sampling_params import SamplingParams
from tolerances import SAME_MATH_F32, SAMPLING_FREQUENCY

V = 32
_sample = jax.jit(sample_rows)  # the engine traces it into its step executable


def sample(logits, si):
    return _sample(logits, si.arrays())


def draw(logits, params_list, histories=None, counters=None, seeds=None, bitmask=None):
    logits = np.asarray(logits, np.float32)
    rows = []
    for i, p in enumerate(params_list):
        hist = (histories or [[]] * len(params_list))[i]
        rows.append((p, (seeds or [i] * len(params_list))[i], (counters or [0] * len(params_list))[i],
                     hist, len(hist)))
    si = build_inputs(rows, logits.shape[0], 64, lambda p: [2], vocab_size=logits.shape[1], bitmask=bitmask)
    tokens, chosen, top_ids, top_lp = sample(logits, si)
    return np.asarray(tokens), np.asarray(chosen), np.asarray(top_ids), np.asarray(top_lp)


def rand_logits(n, seed=0):
    return np.random.default_rng(seed).normal(size=(n, V)).astype(np.float32) * 3


def test_greedy_is_argmax_and_logprobs_are_raw():
    lg = rand_logits(4)
    # One row asking for top logprobs computes them for the step; the others ignore theirs.
    params = [SamplingParams(temperature=0, logprobs=5)] + [SamplingParams(temperature=0)] * 3
    tokens, chosen, top_ids, top_lp = draw(lg, params)
    assert (tokens == lg.argmax(-1)).all()
    ref = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
    np.testing.assert_allclose(chosen, ref[np.arange(4), tokens], **SAME_MATH_F32)
    np.testing.assert_array_equal(top_ids[:, 0], tokens)
    np.testing.assert_allclose(top_lp[:, :5], -np.sort(-ref, axis=-1)[:, :5], **SAME_MATH_F32)
    # No row asks: the top-20 search is skipped (zeros); the chosen logprobs are still reported.
    tokens2, chosen2, top_ids2, top_lp2 = draw(lg, [SamplingParams(temperature=0, logprobs=0)] * 4)
    np.testing.assert_array_equal(tokens2, tokens)
    np.testing.assert_allclose(chosen2, chosen, **SAME_MATH_F32)
    assert not top_ids2.any() and not top_lp2.any()
    # No row reports logprobs at all: the log-sum-exp is skipped too, and the tokens stay the same.
    tokens3, chosen3, top_ids3, top_lp3 = draw(lg, [SamplingParams(temperature=0)] * 4)
    np.testing.assert_array_equal(tokens3, tokens)
    assert not chosen3.any() and not top_ids3.any() and not top_lp3.any()


@pytest.mark.parametrize("vocab", [32, 128, 300, 49152])
def test_two_stage_argmax_matches_numpy(vocab):
    """Greedy's argmax goes through tiles of 128 logits: first index of the maximum, also for ties
    across tiles, a vocabulary off the tile size (padded with -inf), and all -inf but one."""
    rng = np.random.default_rng(vocab)
    lg = rng.integers(-3, 4, size=(6, vocab)).astype(np.float32)  # many ties
    lg[1] = -np.inf
    lg[1, vocab - 1] = 0.0
    lg[2, :] = 1.0
    tokens = draw(lg, [SamplingParams(temperature=0)] * 6)[0]
    np.testing.assert_array_equal(tokens, lg.argmax(-1))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1),
                                    SamplingParams(temperature=1.0, top_p=1e-6),
                                    SamplingParams(temperature=1.0, min_p=1.0)])
def test_filters_that_leave_one_token_pick_the_argmax(params):
    lg = rand_logits(4, 1)
    tokens, *_ = draw(lg, [params] * 4, seeds=[1, 2, 3, 4])
    assert (tokens == lg.argmax(-1)).all()


def test_top_k_and_top_p_keep_only_the_allowed_set():
    lg = rand_logits(1, 2)
    order = np.argsort(-lg[0])
    for c in range(60):
        t, *_ = draw(lg, [SamplingParams(temperature=1.0, top_k=3)], counters=[c])
        assert t[0] in order[:3]
    p = np.exp(lg[0] - lg[0].max())
    p /= p.sum()
    nucleus = order[:np.searchsorted(np.cumsum(p[order]), 0.5) + 1]
    for c in range(60):
        t, *_ = draw(lg, [SamplingParams(temperature=1.0, top_p=0.5)], counters=[c])
        assert t[0] in nucleus


def test_seeded_samples_follow_the_softmax():
    lg = np.zeros((1, V), np.float32)
    lg[0, :4] = np.log([0.4, 0.3, 0.2, 0.1])
    lg[0, 4:] = -1e9
    counts = np.zeros(4)
    for c in range(600):
        t, *_ = draw(lg, [SamplingParams(temperature=1.0, seed=5)], counters=[c])
        counts[t[0]] += 1
    np.testing.assert_allclose(counts / counts.sum(), [0.4, 0.3, 0.2, 0.1], **SAMPLING_FREQUENCY)
    again = [draw(lg, [SamplingParams(temperature=1.0)], counters=[7], seeds=[9])[0][0] for _ in range(3)]
    assert len(set(again)) == 1


def test_penalties_and_logit_bias():
    lg = np.zeros((1, V), np.float32)
    lg[0, 3], lg[0, 4] = 5.0, 4.0
    greedy = lambda **kw: draw(lg, [SamplingParams(temperature=0, **kw)], histories=[[3, 3]])[0][0]
    assert greedy() == 3
    assert greedy(repetition_penalty=2.0) == 4  # 5 / 2 < 4
    # History [3, 3] is all prompt here (prompt_len = 2): presence/frequency see no outputs.
    assert greedy(presence_penalty=2.0) == 3
    # Prompt [7], outputs [3, 3]: the frequency penalty counts the two outputs.
    si_rows = [(SamplingParams(temperature=0, frequency_penalty=1.0), 0, 2, [7, 3, 3], 1)]
    tokens, *_ = sample(lg, build_inputs(si_rows, 1, 64, lambda p: [], vocab_size=V))
    assert int(np.asarray(tokens)[0]) == 4  # 5 - 2 * 1.0 < 4
    assert draw(lg, [SamplingParams(temperature=0, logit_bias={9: 100.0})])[0][0] == 9


def test_min_tokens_bans_stop_ids():
    lg = np.zeros((1, V), np.float32)
    lg[0, 2] = 10.0  # the stop id the helper passes (2)
    p = SamplingParams(temperature=0, min_tokens=3)
    assert draw(lg, [p], counters=[0])[0][0] != 2
    assert draw(lg, [p], counters=[3])[0][0] == 2


# ---- grammar bitmasks (structured outputs) -------------------------------------------------------

def mask_of(allowed_rows, vocab):
    """int32 bitmask rows from lists of allowed ids (None: everything allowed)."""
    from runtime.core.structured_output import allocate_bitmask

    bm = allocate_bitmask(len(allowed_rows), vocab)
    for r, allowed in enumerate(allowed_rows):
        if allowed is not None:
            bm[r] = 0
            for t in allowed:
                bm[r].view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))
    return bm


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bitmask_allows_only_its_tokens(temperature):
    vocab = 70  # three words, the last one partly padding
    lg = np.random.default_rng(0).normal(size=(4, vocab)).astype(np.float32) * 3
    allowed = [[5, 33, 69], None, [64], [0, 1, 2, 3]]
    bm = mask_of(allowed, vocab)
    params = [SamplingParams(temperature=temperature, logprobs=5)] * 4
    free = draw(lg, params, seeds=[0] * 4)
    for seed in range(20):
        tokens, chosen, top_ids, top_lp = draw(lg, params, seeds=[seed] * 4, bitmask=bm)
        for r, a in enumerate(allowed):
            if a is not None:
                assert tokens[r] in a
                # vLLM: logprobs of the masked distribution (renormalized over the allowed ids)
                lse = np.log(np.exp(lg[r, a] - lg[r, a].max()).sum()) + lg[r, a].max()
                np.testing.assert_allclose(chosen[r], lg[r, tokens[r]] - lse, **SAME_MATH_F32)
                assert set(top_ids[r][:len(a)]) == set(a) and np.isneginf(top_lp[r][len(a):]).all()
        if seed == 0:  # the unconstrained row is untouched by its neighbours' masks
            np.testing.assert_array_equal(tokens[1], free[0][1])
            np.testing.assert_array_equal(chosen[1], free[1][1])
            np.testing.assert_array_equal(top_lp[1], free[3][1])


def test_bitmask_beats_min_tokens_and_bias():
    """A constrained row keeps its stop ids under min_tokens (the grammar decides), and a logit bias
    cannot revive a masked token."""
    from runtime.core.sampling_params import StructuredOutputsParams

    lg = np.zeros((1, V), np.float32)
    so = StructuredOutputsParams(regex="x")
    p = SamplingParams(temperature=0, min_tokens=3, logit_bias={7: 100.0}, structured_outputs=so)
    assert draw(lg, [p], bitmask=mask_of([[2]], V))[0][0] == 2  # 2: the helper's stop id
    assert draw(lg, [p], bitmask=mask_of([[2, 9]], V))[0][0] == 2
    lg[0, 9] = 1.0
    assert draw(lg, [p], bitmask=mask_of([[2, 9]], V))[0][0] == 9


def test_unconstrained_steps_share_one_device_mask():
    a = build_inputs([], 4, 64, lambda p: [], vocab_size=100)
    b = build_inputs([], 4, 64, lambda p: [], vocab_size=100)
    assert isinstance(a.bitmask, jax.Array) and a.bitmask is b.bitmask and not a.constrained
    assert a.bitmask.shape == (4, 4) and (np.asarray(a.bitmask) == -1).all()
    with pytest.raises(ValueError, match="bitmask must be"):
        build_inputs([], 4, 64, lambda p: [], vocab_size=100, bitmask=np.zeros((4, 3), np.int32))


def test_no_conditional_copies_the_logits():
    """The compiled sampler copies a [S, V] array only for the logit-bias scatter, which writes into
    its copy: its conditionals return per-row results. (A `cond` that hands the logits back
    untouched must copy them: 6-7 ms each at 64 x 49,152 on CPU.)"""
    n, v = 8, 4096
    si = build_inputs([(SamplingParams(temperature=0), 0, 0, [], 0)] * n, n, 64, lambda p: [2], vocab_size=v)
    logits = jax.ShapeDtypeStruct((n, v), np.float32)
    lines = jax.jit(sample_rows).lower(logits, si.arrays()).compile().as_text().splitlines()
    copies = [ln.split("=")[0].strip() for ln in lines if " copy(" in ln and f"f32[{n},{v}]" in ln.split("copy(")[0]]
    for name in copies:
        users = [ln for ln in lines if f"{name}," in ln or f"{name})" in ln]
        assert users and all("scatter" in u for u in users), (name, users)


def _primitives(jaxpr, out=None) -> set[str]:
    """Every primitive in a jaxpr and the jaxprs nested in its equations (jit, cond branches...)."""
    out = set() if out is None else out
    for e in jaxpr.eqns:
        out.add(e.primitive.name)
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives(inner, out)
    return out


def test_top_k_and_top_p_sort_nothing_and_only_bisect_when_asked():
    """Sorting 64 rows of SmolLM2's 49,152 logits took 1.4 s on the CPU. `_filter` sorts nothing:
    top-k/top-p bisect for their thresholds in loops under a `cond` that only a row asking for
    either takes, so plain temperature sampling and min-p skip them."""
    from runtime.worker.sampler import _filter

    n = 4
    jaxpr = jax.make_jaxpr(_filter)(np.zeros((n, V), np.float32), np.zeros(n, np.int32),
                                    np.ones(n, np.float32), np.zeros(n, np.float32)).jaxpr
    outside = set()
    for e in jaxpr.eqns:
        if e.primitive.name != "cond":
            _primitives(type("J", (), {"eqns": [e]})(), outside)
    loops = {"while", "scan"}  # fori_loop's, by its trip count
    assert not loops & outside and loops & _primitives(jaxpr)
    assert "sort" not in _primitives(jaxpr)


def test_the_draw_is_traced_twice_not_once_per_condition():
    """The sampler compiles into every bucket's step: the filters and the draw appear in the
    traced sampler twice (with and without penalties), not once per combination of the grammar
    mask, logit bias and penalty conditions."""
    from runtime.worker.sampler import input_specs, sample_rows

    n = 4
    specs = input_specs(n, 16, V)
    jaxpr = jax.make_jaxpr(sample_rows)(jax.ShapeDtypeStruct((n, V), jnp.float32), specs).jaxpr

    def count(jaxpr, name):
        total = 0
        for e in jaxpr.eqns:
            total += e.primitive.name == name
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        total += count(inner, name)
        return total

    # Per draw: the bisections for top-k and top-p (two fori_loops, `scan` or `while`).
    assert count(jaxpr, "while") + count(jaxpr, "scan") == 2 * 2


def _nucleus_reference(logits, top_k, top_p):
    """Top-k then top-p as numpy, over each row's fully sorted vocabulary: which logits survive."""
    out = np.ones(logits.shape, bool)
    for i, row in enumerate(logits.astype(np.float64)):
        v = len(row)
        k = min(top_k[i], v) if top_k[i] > 0 else v
        desc = np.sort(row)[::-1]
        kth = desc[k - 1]
        kept = np.where(np.arange(v) < k, desc, -np.inf)
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        keep = (np.cumsum(probs) - probs) < top_p[i]
        cutoff = np.min(np.where(keep, kept, np.inf)) if top_p[i] < 1 else -np.inf
        out[i] = row >= max(kth, cutoff)
    return out


@pytest.mark.parametrize("vocab", [37, 1000])
def test_top_k_and_top_p_by_bisection_match_the_full_sort(vocab):
    """The thresholds found by bisection keep the same logits as a full sort: rows of peaked and
    flat logits, top-k small, large and past the vocabulary, wide and narrow nuclei, ties at the
    top, masked logits, and rows asking for neither beside rows asking for both."""
    from runtime.worker.sampler import _filter

    rng = np.random.default_rng(vocab)
    scale = np.array([8.0, 8.0, 0.3, 0.3, 8.0, 0.3, 3.0, 1.0, 8.0, 0.3, 1.0], np.float32)[:, None]
    logits = (rng.standard_normal((11, vocab)) * scale).astype(np.float32)
    logits[9, :3] = logits[9].max() + 1.0  # ties at the top
    logits[6, vocab // 3:] = -np.inf  # masked out (a grammar's bitmask, a logit bias)
    top_k = np.array([0, 5, 0, 16, 17, 0, vocab - 1, 0, 40, 1, vocab + 5], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.95, 0.7, 1.0, 0.8, 0.999, 1.0, 0.3, 1.0], np.float32)
    f = jax.jit(lambda l, k, p: _filter(l, k, p, np.zeros(len(k), np.float32)))
    for rows in (slice(None), [1, 8], [0, 2, 7], [5, 10]):  # both, top-k alone, top-p alone, neither
        got = np.isfinite(np.asarray(f(logits[rows], top_k[rows], top_p[rows])))
        np.testing.assert_array_equal(got, _nucleus_reference(logits[rows], top_k[rows], top_p[rows]))


@pytest.mark.parametrize("vocab", [5, 128, 300, 1000])
def test_inverse_cdf_draws_follow_the_softmax_exactly(vocab):
    """Temperature draws go by inverse CDF over tiles of 128 tokens: with evenly spaced u, each
    token is drawn in proportion to its probability (to within 1.5 draws), across tile edges and a
    vocabulary off the tile size; masked (-inf) tokens never, not even at u = 0 or u just below 1."""
    from runtime.worker.sampler import _inverse_cdf

    rng = np.random.default_rng(vocab)
    row = (rng.standard_normal(vocab) * 2).astype(np.float32)
    row[rng.permutation(vocab)[:vocab // 3]] = -np.inf
    row[np.argmax(row)] += 3.0
    n = 4096
    u = np.concatenate([[0.0, np.nextafter(np.float32(1), np.float32(0))], (np.arange(n - 2) + 0.5) / (n - 2)])
    drawn = np.asarray(jax.jit(_inverse_cdf)(u.astype(np.float32), np.tile(row, (n, 1))))
    assert np.isfinite(row[drawn]).all()
    p = np.exp(row.astype(np.float64) - row.max())
    p /= p.sum()
    counts = np.bincount(drawn[2:], minlength=vocab)
    assert np.abs(counts - p * (n - 2)).max() <= 1.5
    # A row with no finite logit still draws an id inside the vocabulary (not the padded tile's).
    dead = np.asarray(jax.jit(_inverse_cdf)(np.array([0.5], np.float32), np.full((1, vocab), -np.inf, np.float32)))
    assert 0 <= dead[0] < vocab


def test_min_p_keeps_what_reaches_its_share_of_the_top_probability():
    from runtime.worker.sampler import _filter

    lg = rand_logits(3, 4)
    min_p = np.array([0.0, 0.001, 0.3], np.float32)
    got = np.isfinite(np.asarray(jax.jit(_filter)(lg, np.zeros(3, np.int32), np.ones(3, np.float32), min_p)))
    p = np.exp(lg.astype(np.float64) - lg.max(-1, keepdims=True))
    np.testing.assert_array_equal(got, p >= min_p[:, None])  # p / max p against min_p
    assert got[0].all() and got[2].sum() < got[1].sum() < V
