"""From sampled tokens to what the user gets: each token appended to its sequence, logprobs, the
stop checks (EOS, stop ids, stop strings, a completed grammar, length), incremental
detokenization, and the RequestOutput snapshots the engine emits."""

from __future__ import annotations

import logging

import numpy as np

from runtime.core import detokenizer
from runtime.core.scheduler import Scheduler
from runtime.core.sequence import Request, Sequence
from runtime.engine.outputs import CompletionOutput, RequestOutput

log = logging.getLogger("runtime.engine.llm_engine")

# Async scheduling: the place of a token that a running step is still sampling (LLMEngine._commit).
PENDING = -1


class OutputProcessor:
    """Owns the token counters; the engine calls it from its step thread only."""

    def __init__(self, scheduler: Scheduler, tokenizer, eos_ids: set[int], max_model_len: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def append(self, seq: Sequence, tok: int, lp: float, top_ids, top_lp) -> None:
        """A sampled token (its logprob and the top ones) joins `seq`, or fills the place async
        scheduling held for it; then the stop checks, which may finish the sequence."""
        p = seq.request.params
        if seq.matcher is not None and not seq.matcher.accept_token(tok):
            # The mask should make this impossible; end this sequence, not the engine.
            why = seq.matcher.error or f"token {tok} is not allowed by the grammar"
            seq.request.error, seq.finish_reason = f"structured output failed: {why}", "error"
            log.error("request %s: %s", seq.request.request_id, seq.request.error)
            return self.scheduler.finish(seq)
        if seq.token_ids[-1] == PENDING:  # async scheduling held its place (LLMEngine._commit)
            seq.token_ids[-1] = tok
        else:
            seq.token_ids.append(tok)
        self.generation_tokens_total += 1
        if seq.num_output_tokens == 1 and seq.index == 0:
            self.prompt_tokens_total += seq.prompt_len
        seq.cumulative_logprob += lp
        if p.logprobs is not None:
            d = {tok: lp}
            for a, b in zip(top_ids[:p.logprobs], top_lp[:p.logprobs]):
                d.setdefault(int(a), float(b))
            seq.logprobs.append(d)
        n_out = seq.num_output_tokens
        reason, stop_reason = None, None
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in self.eos_ids:
                reason = "stop"
            elif tok in p.stop_token_ids:
                reason, stop_reason = "stop", tok
        if self.tokenizer is not None and p.detokenize:
            if seq.detok_state is None:
                seq.detok_state = detokenizer.new_state()
            new_text = detokenizer.step(self.tokenizer, seq.output_token_ids, seq.detok_state,
                                        p.skip_special_tokens)
            seq.text += new_text
            if p.stop and reason is None and new_text and n_out >= p.min_tokens:
                hit = detokenizer.find_stop(seq.text, len(new_text), p.stop)
                if hit is not None:
                    i, s = hit
                    seq.text = seq.text[:i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
                    reason, stop_reason = "stop", s
        if reason is None and seq.matcher is not None and seq.matcher.is_terminated():
            reason = "stop"  # the grammar is complete (its last token may be a stop id or not)
        if reason is None and (n_out >= p.max_tokens or len(seq) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if seq.detok_state is not None and not isinstance(stop_reason, str):  # a stop string cut the text
                seq.text += detokenizer.flush(self.tokenizer, seq.output_token_ids, seq.detok_state,
                                              p.skip_special_tokens)
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    def request_output(self, req: Request) -> RequestOutput:
        """What the user sees of `req` now; an unfinished sample's text holds back a possible
        stop string's prefix."""
        outs = []
        for s in sorted(req.seqs, key=lambda s: s.index):
            text = s.text
            if not s.is_finished and req.params.stop:
                hb = detokenizer.holdback(text, req.params.stop)
                text = text[:len(text) - hb] if hb else text
            outs.append(CompletionOutput(
                s.index, text, list(s.output_token_ids),
                s.cumulative_logprob if req.params.logprobs is not None else None,
                list(s.logprobs) if req.params.logprobs is not None else None,
                s.finish_reason, s.stop_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outs,
                             req.is_finished or req.aborted, req.metrics, req.seqs[0].num_cached_tokens,
                             error=req.error, trace=req.trace.to_dict(req) if req.trace is not None else None)

    def prompt_logprobs(self, scheduled, offsets: dict[int, int], hidden, head) -> None:
        """Prompt logprobs of the step's prefill chunks (`scheduled`, before their tokens count
        as computed): `hidden` [T, H] are the step's final hidden states, `offsets` each chunk's
        first row, and `head(rows, targets)` the model's LM head -> (target logprobs, top ids,
        top logprobs)."""
        for sc in scheduled:
            seq, req = sc.seq, sc.seq.request
            start = seq.num_computed_tokens
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]  # the first prompt token has no logprob
            if start > 0 and len(req.prompt_logprobs) < start + 1:
                # Prefix-cached tokens were never run (the block manager gives such requests no hits).
                req.prompt_logprobs += [None] * (start + 1 - len(req.prompt_logprobs))
            # Row j predicts token start + j + 1, for the tokens inside the prompt; a preempted
            # sequence's recompute runs positions whose logprobs are already there.
            n = min(sc.num_new_tokens, seq.prompt_len - 1 - start)
            if n <= 0 or len(req.prompt_logprobs) >= start + 1 + n:
                continue
            o = offsets[seq.seq_id]
            targets = np.asarray(seq.token_ids[start + 1:start + 1 + n], np.int32)
            lp, ids, top = head(hidden[o:o + n], targets)
            k = req.params.prompt_logprobs
            for j in range(len(req.prompt_logprobs) - start - 1, n):
                d = {int(targets[j]): float(lp[j])}
                for a, b in zip(ids[j][:k], top[j][:k]):
                    d.setdefault(int(a), float(b))
                req.prompt_logprobs.append(d)
