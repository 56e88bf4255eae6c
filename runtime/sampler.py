"""The batched sampler, jitted and on device: penalties, temperature, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from runtime.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

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
    history: np.ndarray | None  # i32 [S, max_model_len]: prompt then output ids, -1 pad
    prompt_lens: np.ndarray  # i32 [S]
    greedy: bool
    penalties: bool


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


def _filter(logits, top_k, top_p, min_p):
    """Masks logits outside top-k, the top-p nucleus, and below min_p x max prob."""
    v = logits.shape[-1]
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
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    p = jax.nn.softmax(logits, axis=-1)
    pmax = jnp.max(p, axis=-1, keepdims=True)
    return jnp.where(p < min_p[:, None] * pmax, -jnp.inf, logits)


@partial(jax.jit, static_argnames=("greedy", "penalties"))
def sample(logits, temperature, top_k, top_p, min_p, seeds, counters, bias_ids, bias_vals,
           rep, pres, freq, history, prompt_lens, *, greedy: bool, penalties: bool):
    """Returns (token ids [S], their logprobs [S], top ids [S, 20], top logprobs [S, 20]).

    Logprobs are of the model's raw distribution (before penalties and temperature), as vLLM
    reports them by default.
    """
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(raw_logprobs, NUM_TOP_LOGPROBS)
    s = logits.shape[0]
    rows = jnp.arange(s)[:, None]
    l = logits.at[rows, jnp.where(bias_ids >= 0, bias_ids, 0)].add(jnp.where(bias_ids >= 0, bias_vals, 0.0))
    if penalties:
        l = _apply_penalties(l, history, prompt_lens, rep, pres, freq)
    argmax = jnp.argmax(l, axis=-1).astype(jnp.int32)
    if greedy:
        tokens = argmax
    else:
        t = jnp.where(temperature > 0, temperature, 1.0)
        l = _filter(l / t[:, None], top_k, top_p, min_p)
        keys = jax.vmap(lambda sd, c: jax.random.fold_in(jax.random.PRNGKey(sd), c))(seeds, counters)
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(keys, l).astype(jnp.int32)
        tokens = jnp.where(temperature > 0, drawn, argmax)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen, top_ids.astype(jnp.int32), top_lp


def build_inputs(rows: list[tuple[SamplingParams, int, int, list[int], int]], num_rows: int,
                 max_model_len: int, stop_ids_for_min_tokens) -> SamplerInputs:
    """rows: (params, seed, counter, token history, prompt_len) for each real row, in order."""
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
    history = np.full((S, max_model_len), -1, np.int32) if penalties else None
    for i, (p, seed, counter, hist, plen) in enumerate(rows):
        temp[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        seeds[i], counters[i] = seed & 0xFFFFFFFF, counter
        rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        prompt_lens[i] = plen
        bias = dict(p.logit_bias or {})
        if counter < p.min_tokens:
            # min_tokens: stop tokens are banned until enough tokens exist.
            for t in stop_ids_for_min_tokens(p):
                bias[t] = -np.inf
        for j, (tid, val) in enumerate(list(bias.items())[:MAX_LOGIT_BIAS]):
            bias_ids[i, j], bias_vals[i, j] = tid, val
        if penalties:
            h = hist[-max_model_len:]
            history[i, :len(h)] = h
    greedy = all(p.temperature == 0 for p, *_ in rows)
    return SamplerInputs(temp, top_k, top_p, min_p, seeds, counters, bias_ids, bias_vals, rep,
                         pres, freq, history, prompt_lens, greedy, penalties)


def _args(logits, si: SamplerInputs):
    history = si.history if si.history is not None else np.full((len(si.temperature), 1), -1, np.int32)
    return (logits, si.temperature, si.top_k, si.top_p, si.min_p, si.seeds, si.counters,
            si.bias_ids, si.bias_vals, si.rep_penalty, si.pres_penalty, si.freq_penalty, history,
            si.prompt_lens)


class Sampler:
    """Holds one AOT-compiled sampler per (rows, greedy, penalties); compiled at warm-up."""

    def __init__(self, vocab_size: int, max_model_len: int):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.compiled: dict[tuple[int, bool, bool], object] = {}

    def _compile(self, num_rows: int, greedy: bool, penalties: bool):
        key = (num_rows, greedy, penalties)
        if key not in self.compiled:
            hist = self.max_model_len if penalties else 1
            f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
            i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
            args = (f32(num_rows, self.vocab_size), f32(num_rows), i32(num_rows), f32(num_rows),
                    f32(num_rows), jax.ShapeDtypeStruct((num_rows,), jnp.uint32), i32(num_rows),
                    i32(num_rows, MAX_LOGIT_BIAS), f32(num_rows, MAX_LOGIT_BIAS), f32(num_rows),
                    f32(num_rows), f32(num_rows), i32(num_rows, hist), i32(num_rows))
            self.compiled[key] = sample.lower(*args, greedy=greedy, penalties=penalties).compile()
        return self.compiled[key]

    def warmup(self, num_rows: int) -> None:
        for greedy in (True, False):
            for penalties in (False, True):
                self._compile(num_rows, greedy, penalties)

    def __call__(self, logits, si: SamplerInputs):
        fn = self._compile(logits.shape[0], si.greedy, si.penalties)
        return fn(*_args(logits, si))
