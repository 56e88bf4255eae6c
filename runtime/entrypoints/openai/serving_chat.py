"""/v1/chat/completions: messages through the chat template, chat choices, and chat stream chunks.
A mixin of `Server` (serving.py), which supplies the shared plumbing through `self`."""

from __future__ import annotations

import dataclasses
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from runtime.core.sampling_params import MAX_LOGPROBS
from runtime.core.sampling_params import RequestError
from runtime.entrypoints.openai.admission import chat_messages
from runtime.entrypoints.openai.chat_tools import (ChatOutput, OutputSpec, check_tools, choice_mode, delta_from_events,
                                                   message_from_events, reasoning_fields, tool_names)
from runtime.entrypoints.openai.protocol import (ChatCompletionRequest, ChoiceState, Prepared, bad_request,
                                                 chat_logprobs)


class ChatServing:
    """Server's /v1/chat/completions handler and its chat-specific parts."""

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, self.prepare_chat, chat=True)

    def prepare_chat(self, r: ChatCompletionRequest, arrival: float) -> Prepared:
        model = self.check_model(r.model)
        spec = self.output_spec(r)
        messages = chat_messages(r.messages, self.cfg)
        kwargs = {**(self.cfg.default_chat_template_kwargs or {}), **(r.chat_template_kwargs or {})}
        text = self._chat_text(messages, r.add_generation_prompt, kwargs, r.continue_final_message, r.tools)
        ids = self.truncate(self.encode(text), r)
        if spec is not None:
            spec.prompt, spec.template_kwargs = text, kwargs
        # vLLM: the reply's role is the last message's when no generation prompt opens a new turn, and
        # echo repeats the last message's content when that message has the reply's role.
        role = "assistant" if r.add_generation_prompt else messages[-1]["role"]
        echo = messages[-1]["content"] if r.echo and messages[-1]["role"] == role else ""
        if r.top_logprobs is not None and not r.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {r.top_logprobs}", "top_logprobs")
        max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        param = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{param} must be at least 1, got {max_tokens}", param)
        if max_tokens is None:
            max_tokens = max(self.max_model_len - len(ids), 1)  # the rest of the context
        lp = (r.top_logprobs or 0) if r.logprobs else None
        params = self.sampling_params(r, max_tokens=max_tokens, logprobs=lp, prompt_logprobs=r.prompt_logprobs)
        if spec is not None and params.structured_outputs is not None:
            params.structured_outputs = dataclasses.replace(params.structured_outputs,
                                                            reasoning=spec.constraint_after_reasoning())
        include_usage, continuous = self._stream_flags(r)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return Prepared(rid, int(time.time()), model, [(f"{rid}-0", ids, params)], [None], r.n, r.stream,
                         include_usage, continuous, arrival, {"top_logprobs": r.top_logprobs or 0,
                                                              "return_token_ids": r.return_token_ids,
                                                              "token_ids_as_names": r.return_tokens_as_token_ids,
                                                              "role": role, "echo": echo, "output": spec})

    def output_spec(self, r: ChatCompletionRequest) -> OutputSpec | None:
        """How this request's outputs are read (tool calls, reasoning), or None for plain content.
        tool_choice "auto" needs the server's --enable-auto-tool-choice and --tool-call-parser, as in
        vLLM; with tools and no tool_choice, it is auto where they are set, else none."""
        try:
            tools = check_tools(r.tools) if r.tools is not None else None
            mode, named = choice_mode(tools, r.tool_choice)
        except RequestError as e:
            raise bad_request(e.message, e.param, e.code) from None
        auto_ok = self.cfg.enable_auto_tool_choice and self.cfg.tool_call_parser
        if mode == "auto" and not auto_ok:
            if r.tool_choice is None:
                mode = "none"
            else:
                raise bad_request('tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                                  'and --tool-call-parser', "tool_choice")
        spec = OutputSpec(mode, named, self.cfg.tool_call_parser, tool_names(tools), r.parallel_tool_calls is not False,
                          self.cfg.reasoning_parser)
        return None if spec.plain else spec

    def _chat_ids(self, messages, add_generation_prompt=True, kwargs=None, continue_final=False) -> list[int]:
        return self.encode(self._chat_text(messages, add_generation_prompt, kwargs, continue_final))

    def _chat_text(self, messages, add_generation_prompt=True, kwargs=None, continue_final=False, tools=None) -> str:
        """The templated prompt. `continue_final`: the last message stays open (its end-of-turn and
        anything after it are cut), so the model continues it (HF's continue_final_message). `kwargs`
        (chat_template_kwargs) go to the template and override add_generation_prompt, as in vLLM.
        `tools` go to the template as HF's apply_chat_template passes them (a template may ignore them).
        The server's --chat-template, where given, replaces the model's."""
        kwargs = {"add_generation_prompt": add_generation_prompt, **(kwargs or {})}
        if tools is not None:
            kwargs["tools"] = tools
        if continue_final and kwargs["add_generation_prompt"]:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true (set "
                              "add_generation_prompt to false)", "continue_final_message")
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.cfg.chat_template, **kwargs)
        except Exception as e:
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None
        self.check_prompt_chars(len(text), "messages")  # what the template added counts too, before tokenizing
        if continue_final:
            final = messages[-1]["content"]
            for part in (final, final.strip()):
                at = text.rfind(part) if part else -1
                if at >= 0:
                    text = text[:at + len(part)]
                    break
            else:
                raise bad_request("continue_final_message needs a last message whose content the chat template "
                                  "renders", "continue_final_message")
        return text

    def _chat_choice(self, prep, c, choice_index, reason, stop_reason) -> dict:
        logprobs = None
        if c is not None and c.logprobs is not None:
            logprobs = {"content": chat_logprobs(self._names(prep), c.token_ids, c.logprobs,
                                                 prep.extra["top_logprobs"])}
        spec = prep.extra.get("output")
        if spec is None:
            message = {"role": prep.extra["role"], "content": prep.extra["echo"] + (c.text if c else ""),
                       "tool_calls": []}
        else:
            out = ChatOutput(spec)
            events = (out.feed(c.text) if c else []) + out.finish()
            message, num_calls = message_from_events(events, prep.extra["role"], prep.extra["echo"])
            if spec.reasoning_parser:
                message |= reasoning_fields(events)
            if num_calls and reason == "stop":
                reason = "tool_calls"
            self._count_tool_output(spec, out)
        return {"index": choice_index, "message": message, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason}

    def _count_tool_output(self, spec: OutputSpec, out: ChatOutput) -> None:
        outcome = out.outcome()
        if outcome is not None:
            self.loop.metrics.tool_outputs.labels(self.model_name, spec.mode, outcome).inc()

    def _stream_chat_choice(self, prep: Prepared, idx: int, ci: int, c, st: ChoiceState, first: bool,
                            delta_text: str, new_ids, new_lps, chunk, num_out: dict, out=None):
        """The SSE chunks for one new output of choice `ci` (see `_stream`)."""
        want_ids = prep.extra.get("return_token_ids", False)
        lp = ({"content": chat_logprobs(self._names(prep), new_ids, new_lps, prep.extra["top_logprobs"])}
              if new_lps is not None else None)
        if first:  # the role chunk counts no completion tokens yet (vLLM)
            top = {"prompt_token_ids": prep.items[0][1]} if want_ids and ci == 0 else {}
            yield chunk([{"index": ci, "delta": {"role": prep.extra["role"], "content": ""},
                          "logprobs": None, "finish_reason": None}], **top)
            if prep.extra["echo"]:
                yield chunk([{"index": ci, "delta": {"content": prep.extra["echo"]}, "logprobs": None,
                              "finish_reason": None}])
        num_out[ci] = len(c.token_ids)
        spec, reason = prep.extra.get("output"), c.finish_reason
        if spec is None:
            deltas = [{"content": delta_text}] if delta_text else []
        else:  # tool calls and reasoning split from the text as it comes
            if st.output is None:
                st.output = ChatOutput(spec)
            events = st.output.feed(delta_text) + (st.output.finish() if reason else [])
            deltas = delta_from_events(events, st.output.num_calls)
            if reason == "stop" and st.output.num_calls:
                reason = "tool_calls"
            if reason:
                self._count_tool_output(spec, st.output)
        if not deltas and (lp is not None or (want_ids and new_ids)):
            deltas = [{"content": ""}]
        for k, delta in enumerate(deltas):
            # The last chunk carries the finish reason (no empty chunk after it), the first the
            # logprobs and token ids.
            ch = {"index": ci, "delta": delta, "logprobs": lp if k == 0 else None,
                  "finish_reason": reason if k == len(deltas) - 1 else None}
            if reason and k == len(deltas) - 1:
                ch["stop_reason"] = c.stop_reason
            if want_ids:
                ch["token_ids"] = list(new_ids) if k == 0 else []
            yield chunk([ch])
        if not deltas and reason:  # nothing left to send but the reason
            yield chunk([self._finish_delta(True, ci, reason, c.stop_reason)])
