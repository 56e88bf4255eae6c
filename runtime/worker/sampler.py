"""The batched sampler, jitted and on device: grammar masks, penalties, temperature, top-k/top-p/min-p,
seeds, logprobs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

from runtime.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

NUM_TOP_LOGPROBS = MAX_LOGPROBS


@dataclass
class SamplerInputs:
    """Host-side per-row arrays for one step, padded to the bucket's sequence count."""

    temperature: np.ndarray  # f32 [S]
    top_k: np.ndarray  # i32 [S], 0 = off
    top_p: np.ndarray  # f32 [S]
    min_p: np.ndarray  # f32 [S]
    seeds: np.ndarray  # u32 [S]
    counters: np.ndarray  # i32 [S]: output index of the token being sampled
    bias_ids: np.ndarray  # i32 [S, K], -1 = none
    bias_vals: np.ndarray  # f32 [S, K]
    rep_penalty: np.ndarray  # f32 [S]
    pres_penalty: np.ndarray  # f32 [S]
    freq_penalty: np.ndarray  # f32 [S]
    history: np.ndarray  # i32 [S, max_model_len]: prompt then output ids, -1 pad (filled if penalties)
    prompt_lens: np.ndarray  # i32 [S]
    penalties: bool
    # i32 [S, ceil(V/32)], bit t%32 of word t//32 set where token t is allowed (structured outputs);
    # with no constrained row, one cached all-allowed array already on the device.
    bitmask: np.ndarray | jax.Array
    constrained: bool
    top_logprobs: bool = False  # some row asks for its top logprobs (SamplingParams.logprobs > 0)
    logprobs: bool = False  # some row reports logprobs (SamplingParams.logprobs is not None)

    def arrays(self) -> dict[str, np.ndarray]:
        """The step executable's sampling inputs."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "seeds": self.seeds, "counters": self.counters,
                "bias_ids": self.bias_ids, "bias_vals": self.bias_vals, "rep_penalty": self.rep_penalty,
                "pres_penalty": self.pres_penalty, "freq_penalty": self.freq_penalty,
                "history": self.history, "prompt_lens": self.prompt_lens,
                "penalize": np.asarray(self.penalties), "bitmask": self.bitmask,
                "constrained": np.asarray(self.constrained), "top_logprobs": np.asarray(self.top_logprobs),
                "logprobs": np.asarray(self.logprobs)}


def input_specs(num_rows: int, max_model_len: int, vocab_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of `SamplerInputs.arrays()` for a bucket of `num_rows` rows."""
    dummy = build_inputs([], num_rows, max_model_len, lambda p: [], vocab_size=vocab_size)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in dummy.arrays().items()}


def _apply_penalties(logits, history, prompt_lens, rep, pres, freq):
    s, v = logits.shape
    rows = jnp.arange(s)[:, None]
    valid = history >= 0
    ids = jnp.where(valid, history, 0)
    is_out = valid & (jnp.arange(history.shape[1])[None, :] >= prompt_lens[:, None])
    counts = jnp.zeros((s, v), jnp.float32).at[rows, ids].add(is_out.astype(jnp.float32))
    seen = jnp.zeros((s, v), jnp.bool_).at[rows, ids].max(valid)
    # Repetition penalty (CTRL / HF / vLLM): over prompt and output tokens.
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep[:, None], logits * rep[:, None]), logits)
    # Presence and frequency penalties (OpenAI): over output tokens only.
    return logits - freq[:, None] * counts - pres[:, None] * (counts > 0)


def _apply_bitmask(logits, bitmask):
    """Disallowed tokens -> -inf: bit (t % 32) of word t // 32 of a row's bitmask allows token t."""
    s, v = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(s, -1)[:, :v].astype(jnp.bool_)
    return jnp.where(allowed, logits, -jnp.inf)


def _ordered(x):
    """f32 -> i32 keys in the same order (negative floats' magnitude bits flipped)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _unordered(key):
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def _largest_true(pred, lo, hi):
    """Per row, the largest i32 t in [lo, hi] with pred(t) true, for pred true up to some t and
    false after it (lo where it is nowhere true): 32 halvings cover any i32 range."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (((lo & 1) + (hi & 1) + 1) >> 1)  # ceil((lo + hi) / 2), no overflow
        ok = pred(mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def _thresholds(logits, k, top_p):
    """Per row, the logit below which top-k (`k` tokens; the vocabulary size for none) and then
    top-p mask, without sorting the vocabulary (a sort of 64 rows of SmolLM2's 49,152 logits took
    1.4 s on the CPU). The k-th logit is the largest t with at least k logits >= t; the nucleus's
    end is the largest t whose logits >= t hold top_p of the mass of top-k's survivors (HF and
    vLLM apply top-k first), so the first token always stays and ties at the edge stay too. Each
    is found by bisection over the logits' bit patterns: 32 passes over the rows, under a `cond`
    that only a row asking for it takes."""
    v = logits.shape[-1]
    keys = _ordered(logits)
    lo, hi = keys.min(axis=-1), keys.max(axis=-1)
    kth = jax.lax.cond(jnp.any(k < v), lambda: _largest_true(lambda t: (keys >= t).sum(-1) >= k, lo, hi),
                       lambda: lo)

    def nucleus():
        probs = jnp.where(keys >= kth[:, None], jnp.exp(logits - logits.max(axis=-1, keepdims=True)), 0.0)
        need = top_p * probs.sum(-1)
        return _largest_true(lambda t: jnp.where(keys >= t, probs, 0.0).sum(-1) >= need, kth, hi)

    cutoff = jax.lax.cond(jnp.any(top_p < 1), nucleus, lambda: kth)
    return _unordered(jnp.where(top_p < 1, jnp.maximum(kth, cutoff), kth))


def _filter(logits, top_k, top_p, min_p):
    """Masks logits outside top-k, the top-p nucleus, and below min_p x max prob. The conditionals
    return a threshold per row, never [rows, vocab]."""
    n, v = logits.shape
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    thr = jax.lax.cond(jnp.any(k < v) | jnp.any(top_p < 1), lambda l: _thresholds(l, k, top_p),
                       lambda l: jnp.full(n, -jnp.inf), logits)
    # min-p: p < min_p * max p is l < max l + log(min_p), whatever top-k/top-p left (the maximum
    # always stays), so no softmax.
    thr = jnp.maximum(thr, jnp.max(logits, axis=-1) + jnp.log(min_p))
    return jnp.where(logits < thr[:, None], -jnp.inf, logits)


def _argmax(logits, tile: int = 128):
    """jnp.argmax over rows (the first index of the maximum), in two stages: the maximum of each
    tile of 128 logits, the first tile holding the row's maximum, then the first index in it.
    XLA:CPU runs argmax's (value, index) reduction over a whole row 2.7x slower (64 x 49,152:
    7.7 against 2.9 ms)."""
    n, v = logits.shape
    pad = (-v) % tile
    if pad:
        logits = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    tiles = logits.reshape(n, (v + pad) // tile, tile)
    best = jnp.argmax(jnp.max(tiles, axis=-1), axis=-1)
    within = jnp.argmax(jnp.take_along_axis(tiles, best[:, None, None], axis=1)[:, 0], axis=-1)
    return (best * tile + within).astype(jnp.int32)


def _cumsum(x):
    """Inclusive cumulative sums along the last axis as a product with a triangular matrix: XLA:CPU
    compiles and runs it faster than its reduce-window cumsum, for the short axes used here."""
    m = x.shape[-1]
    tri = (jnp.arange(m)[:, None] <= jnp.arange(m)[None, :]).astype(x.dtype)
    return jnp.dot(x, tri, precision=jax.lax.Precision.HIGHEST)


def _uniforms(seeds, counters):
    """One uniform in [0, 1) per row: Threefry-2x32 (JAX's counter-based generator) keyed by the
    row's seed, at the row's output index. One hash per row, where fold_in then uniform takes two
    and compiles slower (0.21 against 0.34 s, in every bucket's step)."""
    keys = jnp.stack([seeds, jnp.full_like(seeds, 0x9E3779B9)], axis=-1)
    counts = jnp.stack([counters.astype(jnp.uint32), jnp.zeros_like(seeds)], axis=-1)
    bits = jax.vmap(threefry_2x32)(keys, counts)[:, 0]
    return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def _inverse_cdf(u, logits, tile: int = 128):
    """One draw per row from softmax(logits), by inverse CDF: the first token whose cumulative
    mass passes u [S] (uniform in [0, 1)) times the row's mass. The cumulative sums run over
    tiles of 128 tokens, then within the one tile that holds the crossing. One random number per
    row, not a Gumbel number per token (jax.random.categorical: about 110 ms for 64 x 49,152
    on this CPU, most of it generating 3M random numbers). A token of probability 0 (-inf, masked)
    is never drawn."""
    n, v = logits.shape
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    pad = (-v) % tile
    if pad:
        probs = jnp.pad(probs, ((0, 0), (0, pad)))
    tiles = probs.reshape(n, -1, tile)
    mass = tiles.sum(-1)  # [S, tiles]
    cum = _cumsum(mass)
    target = u * cum[:, -1]

    def first_above(c, weights, target):
        # The first index with a positive weight whose cumulative sum passes the target, or,
        # where rounding left none, the last index with a positive weight.
        above = (c > target[:, None]) & (weights > 0)
        last = weights.shape[-1] - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)
        return jnp.where(jnp.any(above, axis=-1), jnp.argmax(above, axis=-1), last)

    t = first_above(cum, mass, target)
    before = jnp.take_along_axis(cum - mass, t[:, None], axis=-1)[:, 0]
    inside = jnp.take_along_axis(tiles, t[:, None, None], axis=1)[:, 0]  # [S, tile]
    j = first_above(before[:, None] + _cumsum(inside), inside, target)
    # A row with no finite logit (NaN logits) still gets an id inside the vocabulary, not a pad slot.
    return jnp.minimum(t * tile + j, v - 1).astype(jnp.int32)


def sample_rows(logits, s: dict):
    """The sampler, traced into the step executable (one dispatch per step).

    logits [S, V]; `s` holds SamplerInputs' arrays (see `SamplerInputs.arrays`). Returns
    (token ids [S], their logprobs [S], top ids [S, 20], top logprobs [S, 20]). The grammar mask,
    the logit bias and penalty scatters, the draws, the top-k/top-p bisections and the top-20
    logprobs run under `lax.cond`, so a greedy batch that asks for none of them pays for none
    (one argmax), and one executable serves every mix of requests. Without `top_logprobs`, the top rows are zeros; without
    `logprobs` (no row reports any), the chosen logprobs are zeros too.

    Logprobs are of the model's raw distribution (before penalties and temperature), as vLLM
    reports them by default; on a constrained row, after the grammar mask, as in vLLM (whose
    runner masks the logits before its sampler computes raw logprobs): disallowed tokens get
    -inf and the allowed ones are renormalized.

    The conditionals return per-row results, never a [S, V] array: a `cond` whose untaken branch
    hands its operand back must copy it, which cost 6-7 ms per `cond` on a 64-row CPU step.
    """
    n = logits.shape[0]
    rows = jnp.arange(n)[:, None]
    bias_ids, temperature = s["bias_ids"], s["temperature"]

    def draw(l):
        t = jnp.where(temperature > 0, temperature, 1.0)
        l = _filter(l / t[:, None], s["top_k"], s["top_p"], s["min_p"])
        return _inverse_cdf(_uniforms(s["seeds"], s["counters"]), l)

    def pick(l):
        """Greedy rows' argmax and the others' draws: token ids [S]."""
        argmax = _argmax(l)
        return jax.lax.cond(jnp.any(temperature > 0), lambda l: jnp.where(temperature > 0, draw(l), argmax),
                            lambda l: argmax, l)

    def biased(l):
        return l.at[rows, jnp.where(bias_ids >= 0, bias_ids, 0)].add(jnp.where(bias_ids >= 0, s["bias_vals"], 0.0))

    def penalized(l):
        return _apply_penalties(l, s["history"], s["prompt_lens"], s["rep_penalty"], s["pres_penalty"],
                                s["freq_penalty"])

    def masked(l):
        return _apply_bitmask(l, s["bitmask"])

    def general(l):
        """Any step with a constrained, biased, penalized or sampling row. (The all-allowed
        bitmask and empty biases of the other rows change nothing.) `pick` is traced twice here
        and the filters and draw inside it once each, not once per combination of conditions:
        the sampler compiles into every bucket's step."""
        l = biased(masked(l))
        return jax.lax.cond(s["penalize"], lambda l: pick(penalized(l)), pick, l)

    def no_top(l):
        return jnp.zeros((n, NUM_TOP_LOGPROBS), jnp.int32), jnp.zeros((n, NUM_TOP_LOGPROBS), jnp.float32)

    logits = logits.astype(jnp.float32)
    special = s["constrained"] | s["penalize"] | jnp.any(bias_ids >= 0) | jnp.any(temperature > 0)
    tokens = jax.lax.cond(special, general, _argmax, logits)

    def logprobs(l):
        lse = jax.nn.logsumexp(l, axis=-1, keepdims=True)
        chosen = jnp.take_along_axis(l, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
        top_ids, top_lp = jax.lax.cond(
            s["top_logprobs"], lambda l: tuple(reversed(jax.lax.top_k(l - lse, NUM_TOP_LOGPROBS))), no_top, l)
        return chosen, top_ids.astype(jnp.int32), top_lp

    # The log-sum-exp over the vocabulary (7 ms of a 64-row CPU step) only where some row
    # reports logprobs.
    chosen, top_ids, top_lp = jax.lax.cond(
        s["logprobs"], lambda l: jax.lax.cond(s["constrained"], lambda l: logprobs(masked(l)), logprobs, l),
        lambda l: (jnp.zeros(n, jnp.float32), *no_top(l)), logits)
    return tokens, chosen, top_ids, top_lp


def build_inputs(rows: list[tuple[SamplingParams, int, int, list[int], int]], num_rows: int,
                 max_model_len: int, stop_ids_for_min_tokens, *, vocab_size: int,
                 bitmask: np.ndarray | None = None) -> SamplerInputs:
    """rows: (params, seed, counter, token history, prompt_len) for each real row, in order.
    bitmask: the grammar masks, int32 [num_rows, ceil(vocab_size/32)] (structured outputs), or None
    when no row is constrained."""
    S = num_rows
    temp = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    min_p = np.zeros(S, np.float32)
    seeds = np.zeros(S, np.uint32)
    counters = np.zeros(S, np.int32)
    bias_ids = np.full((S, MAX_LOGIT_BIAS), -1, np.int32)
    bias_vals = np.zeros((S, MAX_LOGIT_BIAS), np.float32)
    rep = np.ones(S, np.float32)
    pres = np.zeros(S, np.float32)
    freq = np.zeros(S, np.float32)
    prompt_lens = np.zeros(S, np.int32)
    penalties = any(p.needs_penalties for p, *_ in rows)
    # The penalty history is only read when some row has penalties (lax.cond in sample_rows):
    # otherwise every step shares one read-only all-padding array instead of building [S, L] anew.
    history = np.full((S, max_model_len), -1, np.int32) if penalties else _no_history(S, max_model_len)
    for i, (p, seed, counter, hist, plen) in enumerate(rows):
        temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        seeds[i], counters[i] = seed & 0xFFFFFFFF, counter
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        prompt_lens[i] = plen
        bias = dict(p.logit_bias or {})
        if counter < p.min_tokens and p.structured_outputs is None:
            # min_tokens: stop tokens are banned until enough tokens exist (not on a constrained
            # row: its grammar decides when the end may come).
            for t in stop_ids_for_min_tokens(p):
                bias[t] = -np.inf
        for j, (tid, val) in enumerate(list(bias.items())[:MAX_LOGIT_BIAS]):
            bias_ids[i, j], bias_vals[i, j] = tid, val
        if penalties:
            h = hist[-max_model_len:]
            history[i, :len(h)] = h
    words = (vocab_size + 31) // 32
    if bitmask is not None and bitmask.shape != (S, words):
        raise ValueError(f"bitmask must be [{S}, {words}], got {bitmask.shape}")
    constrained = bitmask is not None
    return SamplerInputs(temp, top_k, top_p, min_p, seeds, counters, bias_ids, bias_vals, rep,
                         pres, freq, history, prompt_lens, penalties,
                         bitmask if constrained else _all_allowed(S, words), constrained,
                         any((p.logprobs or 0) > 0 for p, *_ in rows),
                         any(p.logprobs is not None for p, *_ in rows))


@functools.lru_cache(maxsize=None)
def _no_history(num_rows: int, max_model_len: int) -> np.ndarray:
    history = np.full((num_rows, max_model_len), -1, np.int32)
    history.flags.writeable = False
    return history


@functools.lru_cache(maxsize=None)
def _all_allowed(num_rows: int, num_words: int) -> jax.Array:
    # Put on the device once per row count: an unconstrained step copies no mask from the host.
    # Uncommitted (no device named), so a sharded step may still place it where it needs it.
    return jax.device_put(np.full((num_rows, num_words), -1, np.int32))
