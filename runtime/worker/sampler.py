"""The batched sampler, jitted and on device: grammar masks, penalties, temperature, top-k/top-p/min-p,
seeds, logprobs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

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


def _filter(logits, top_k, top_p, min_p):
    """Masks logits outside top-k, the top-p nucleus, and below min_p x max prob.

    Top-k and top-p sort every row's whole vocabulary (about 1.4 s for 64 rows of SmolLM2's 49,152
    on the CPU), so the sort runs only when some row asks for either: plain temperature sampling
    (and min-p) skips it."""
    v = logits.shape[-1]

    def nucleus(logits):
        sorted_desc = -jnp.sort(-logits, axis=-1)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
        kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        sorted_desc = jnp.where(jnp.arange(v)[None, :] < k[:, None], sorted_desc, -jnp.inf)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep_sorted = (cum - probs) < top_p[:, None]
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(logits < cutoff, -jnp.inf, logits)

    logits = jax.lax.cond(jnp.any((top_k > 0) & (top_k < v)) | jnp.any(top_p < 1), nucleus, lambda l: l, logits)
    p = jax.nn.softmax(logits, axis=-1)
    pmax = jnp.max(p, axis=-1, keepdims=True)
    return jnp.where(p < min_p[:, None] * pmax, -jnp.inf, logits)


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


def sample_rows(logits, s: dict):
    """The sampler, traced into the step executable (one dispatch per step).

    logits [S, V]; `s` holds SamplerInputs' arrays (see `SamplerInputs.arrays`). Returns
    (token ids [S], their logprobs [S], top ids [S, 20], top logprobs [S, 20]). The grammar mask,
    the logit bias and penalty scatters, the top-20 logprobs and the top-k/top-p/min-p sort run
    under `lax.cond`, so a greedy batch that asks for none of them pays for none, and one
    executable serves every mix of requests. Without `top_logprobs`, the top rows are zeros; without
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
        keys = jax.vmap(lambda sd, c: jax.random.fold_in(jax.random.PRNGKey(sd), c))(s["seeds"], s["counters"])
        return jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, l).astype(jnp.int32)

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

    def choose(l):
        """The logit bias and penalties where asked, then `pick`."""
        return jax.lax.cond(s["penalize"], lambda l: pick(penalized(biased(l))), lambda l: pick(biased(l)), l)

    def no_top(l):
        return jnp.zeros((n, NUM_TOP_LOGPROBS), jnp.int32), jnp.zeros((n, NUM_TOP_LOGPROBS), jnp.float32)

    def finish(logits):
        tokens = jax.lax.cond(s["penalize"] | jnp.any(bias_ids >= 0), choose, pick, logits)

        def logprobs(l):
            lse = jax.nn.logsumexp(l, axis=-1, keepdims=True)
            chosen = jnp.take_along_axis(l, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
            top_ids, top_lp = jax.lax.cond(
                s["top_logprobs"], lambda l: tuple(reversed(jax.lax.top_k(l - lse, NUM_TOP_LOGPROBS))), no_top, l)
            return chosen, top_ids.astype(jnp.int32), top_lp

        # The log-sum-exp over the vocabulary (7 ms of a 64-row CPU step) only where some row
        # reports logprobs.
        chosen, top_ids, top_lp = jax.lax.cond(s["logprobs"], logprobs,
                                               lambda l: (jnp.zeros(n, jnp.float32), *no_top(l)), logits)
        return tokens, chosen, top_ids, top_lp

    logits = logits.astype(jnp.float32)
    return jax.lax.cond(s["constrained"], lambda l: finish(_apply_bitmask(l, s["bitmask"])), finish, logits)


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
