"""/v1/completions: prompts (text or token ids), completion choices with echo and logprobs, and completion
stream chunks. A mixin of `Server` (serving.py), which supplies the shared plumbing through `self`."""

from __future__ import annotations

import dataclasses
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from runtime.entrypoints.openai.protocol import (ChoiceState, CompletionRequest, Prepared, bad_request,
                                                 completion_logprobs)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class CompletionServing:
    """Server's /v1/completions handler and its completion-specific parts."""

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, self.prepare_completion, chat=False)

    def prepare_completion(self, r: CompletionRequest, arrival: float) -> Prepared:
        model = self.check_model(r.model)
        if r.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
        if r.best_of is not None and r.best_of != r.n:
            raise bad_request("best_of must equal n (beam search and best-of are not supported)", "best_of",
                              "unsupported_parameter")
        prompts = r.prompt
        if prompts is None:
            raise bad_request("prompt is required", "prompt", "missing_required_parameter")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and _is_int(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                              "token id lists, and not empty", "prompt", "invalid_type")
        cap = self.loop.capacity
        if cap is not None and len(prompts) > cap:
            raise bad_request(f"the request has {len(prompts)} prompts; this server admits at most {cap} at once "
                              f"(max_num_seqs + max_queue)", "prompt", "too_many_prompts")
        encoded: list[list[int]] = []
        texts: list[str | None] = []
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise bad_request("the prompt is empty", "prompt", "empty_prompt")
                ids = self.encode(p, add_special_tokens=True)  # the tokenizer's own rule: Gemma's <bos>
                kept = self.truncate(ids, r)
                encoded.append(kept)
                texts.append(p if len(kept) == len(ids) else None)  # echo decodes what was kept
            elif isinstance(p, list) and all(_is_int(t) for t in p):
                # Their vocabulary is the engine's to check (RequestError, param prompt).
                encoded.append(self.truncate([int(t) for t in p], r))
                texts.append(None)
            else:
                raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list "
                                  "of token id lists", "prompt", "invalid_type")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if r.max_tokens is None else r.max_tokens
        lp = r.logprobs
        plp = r.prompt_logprobs if r.prompt_logprobs is not None else (lp if r.echo and lp is not None else None)
        base = self.sampling_params(r, max_tokens=max_tokens, logprobs=lp, prompt_logprobs=plp)
        include_usage, continuous = self._stream_flags(r)
        rid = f"cmpl-{uuid.uuid4().hex}"
        items = [(f"{rid}-{i}", ids, dataclasses.replace(base)) for i, ids in enumerate(encoded)]
        return Prepared(rid, int(time.time()), model, items, texts, r.n, r.stream, include_usage, continuous,
                         arrival, {"echo": r.echo, "logprobs": lp, "prompt_logprobs": r.prompt_logprobs,
                                   "return_token_ids": r.return_token_ids,
                                   "token_ids_as_names": r.return_tokens_as_token_ids})

    def _completion_choice(self, prep, i, out, c, choice_index, reason, stop_reason) -> dict:
        text = c.text if c is not None else ""
        token_ids = c.token_ids if c is not None else []
        prompt_ids = prep.items[i][1]
        echo = prep.extra["echo"]
        prefix = ""
        if echo:
            prefix = prep.prompt_texts[i] if prep.prompt_texts[i] is not None else self.tokenizer.decode(prompt_ids)
        logprobs = None
        if prep.extra["logprobs"] is not None:
            offset = 0
            tokens_part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if echo:
                plps = (out.prompt_logprobs if out is not None else None) or [None] * len(prompt_ids)
                plps = list(plps) + [None] * (len(prompt_ids) - len(plps))
                tokens_part, offset = completion_logprobs(self._names(prep), prompt_ids, plps, 0)
            gen, _ = completion_logprobs(self._names(prep), token_ids, (c.logprobs or []) if c else [], offset)
            logprobs = {k: tokens_part[k] + gen[k] for k in gen}
        # vLLM's choices always carry prompt_logprobs (null unless asked for).
        plps = out.prompt_logprobs if prep.extra.get("prompt_logprobs") is not None and out is not None else None
        return {"index": choice_index, "text": prefix + text, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason, "prompt_logprobs": self._prompt_logprobs(plps)}

    def _stream_completion_choice(self, prep: Prepared, idx: int, ci: int, c, st: ChoiceState, first: bool,
                                 delta_text: str, new_ids, new_lps, chunk, num_out: dict, out=None):
        """The SSE chunks for one new output of choice `ci` (see `_stream`). As in vLLM, a choice's
        first chunk carries the prompt's logprobs when they were asked for (null otherwise)."""
        want_ids = prep.extra.get("return_token_ids", False)
        num_out[ci] = len(c.token_ids)
        text = delta_text
        lp = None
        if first and prep.extra["echo"]:
            ptxt = prep.prompt_texts[idx]
            text = (ptxt if ptxt is not None else self.tokenizer.decode(prep.items[idx][1])) + text
        if prep.extra["logprobs"] is not None:
            lp, st.text_offset = completion_logprobs(self._names(prep), new_ids, new_lps or [],
                                                     st.text_offset)
        ch = {"index": ci, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
              "stop_reason": c.stop_reason, "prompt_logprobs": None}
        if first and prep.extra.get("prompt_logprobs") is not None and out is not None:
            ch["prompt_logprobs"] = self._prompt_logprobs(out.prompt_logprobs)
        if want_ids:
            if first:  # vLLM: a choice's first chunk carries its prompt's ids
                ch["prompt_token_ids"] = prep.items[idx][1]
            ch["token_ids"] = list(new_ids)
        yield chunk([ch])
