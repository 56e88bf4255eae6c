"""Speculative decoding's verification, jitted and on device: accept or reject each row's draft tokens
against the target model's logits, keeping the output distribution of plain decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rejection_sample(target_logits, draft_tokens, num_draft, temperature, keys, q_probs=None):
    """Verifies R rows of up to K draft tokens each; static shapes, jittable.

    target_logits f32 [R, K+1, V]: the target model's logits at each draft position and at the
        bonus position after the last draft (top-k/top-p/penalties already applied by the caller).
    draft_tokens i32 [R, K]; num_draft i32 [R] in 0..K: only the first num_draft[r] drafts of row r
        count (the rest may hold anything).
    temperature f32 [R]: 0 = greedy, > 0 = sample from p = softmax(logits / temperature).
    keys: one PRNG key per row, [R] typed keys or [R, 2] uint32 (`jax.random.PRNGKey`s), so a
        request's seed gives the same draws whatever else is in the batch. Greedy rows ignore it.
    q_probs f32 [R, K, V] or None: the draft distribution at each draft position. None means a
        deterministic proposer (n-gram): q is one-hot at the draft token. (A draft model passes
        its probabilities; its drafts must have been sampled from them.)

    Returns (output_tokens i32 [R, K+1], num_accepted i32 [R]): row r holds its num_accepted[r]
    accepted drafts, then one more token, then -1. The extra token is the correction sampled at
    the first rejected position, or the bonus token sampled at position num_draft[r] when every
    draft was accepted; so each row emits num_accepted + 1 tokens.

    Greedy rows accept draft i iff it is the argmax of target_logits[r, i], and the extra token is
    that position's argmax: exactly what greedy decoding without speculation produces.
    Sampled rows use speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft d
    with probability min(1, p(d) / q(d)) (= p(d) for one-hot q); on rejection draw from
    normalize(max(p - q, 0)) (for one-hot q: p with d removed); the bonus is drawn from p. Each
    emitted token is then distributed as sampling from p without speculation.
    """
    logits = target_logits.astype(jnp.float32)
    r, k1, v = logits.shape
    k = k1 - 1
    if k < 1:
        raise ValueError(f"rejection_sample: target_logits {logits.shape} needs K+1 >= 2 positions")
    draft_tokens = draft_tokens.astype(jnp.int32)
    num_draft = num_draft.astype(jnp.int32)
    temperature = temperature.astype(jnp.float32)
    valid = jnp.arange(k)[None, :] < num_draft[:, None]  # [R, K]
    safe_draft = jnp.clip(draft_tokens, 0, v - 1)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, K+1]
    greedy_accept = draft_tokens == argmax[:, :k]

    def at(a, n):  # a[r, n[r], ...] for each row r
        return jnp.take_along_axis(a, n.reshape(n.shape + (1,) * (a.ndim - 1)), axis=1)[:, 0]

    def finish(accept):
        accept = accept & valid
        num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        return num_accepted, num_accepted < num_draft  # the extra token's position, and whether it corrects

    def greedy_only(_):
        num_accepted, _ = finish(greedy_accept)
        return num_accepted, at(argmax, num_accepted)

    def with_sampling(_):
        t = jnp.where(temperature > 0, temperature, 1.0)
        logp = jax.nn.log_softmax(logits / t[:, None, None], axis=-1)  # [R, K+1, V]
        p_draft = jnp.exp(jnp.take_along_axis(logp[:, :k], safe_draft[..., None], axis=-1)[..., 0])  # [R, K]
        if q_probs is None:
            q_draft = jnp.ones_like(p_draft)
        else:
            q_draft = jnp.take_along_axis(q_probs.astype(jnp.float32), safe_draft[..., None], axis=-1)[..., 0]
        row_keys = jax.vmap(jax.random.split)(keys)  # [R, 2, ...]
        u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(row_keys[:, 0])
        sampled_accept = u * q_draft < p_draft  # u < p/q without dividing; min(1, .) is implicit
        accept = jnp.where((temperature > 0)[:, None], sampled_accept, greedy_accept)
        num_accepted, rejected = finish(accept)

        p = jnp.exp(at(logp, num_accepted))  # [R, V]: p at the extra token's position
        rejected_at = jnp.minimum(num_accepted, k - 1)  # the rejected draft's position, if any
        if q_probs is None:
            q = jax.nn.one_hot(at(safe_draft, rejected_at), v, dtype=jnp.float32)
        else:
            q = at(q_probs.astype(jnp.float32), rejected_at)
        residual = jnp.maximum(p - q, 0.0)
        # A rejection has p(d) < q(d) somewhere, so the residual has mass; guard float round-off anyway.
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
        dist = jnp.where(rejected[:, None], residual, p)
        drawn = jax.vmap(jax.random.categorical)(row_keys[:, 1], jnp.log(dist)).astype(jnp.int32)
        return num_accepted, jnp.where(temperature > 0, drawn, at(argmax, num_accepted))

    num_accepted, extra = jax.lax.cond(jnp.any(temperature > 0), with_sampling, greedy_only, None)
    pos = jnp.arange(k1)[None, :]
    drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=-1)
    out = jnp.where(pos < num_accepted[:, None], drafts,
                    jnp.where(pos == num_accepted[:, None], extra[:, None], -1)).astype(jnp.int32)
    return out, num_accepted
