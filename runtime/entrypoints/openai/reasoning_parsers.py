"""Reasoning in a model's text (vLLM's `--reasoning-parser` names): the thinking between `<think>` and
`</think>` is split from the answer, whole (`split`) or as a stream of deltas (`feed`, then `finish`).

    deepseek_r1  DeepSeek-R1 and its distills: the output is thinking until `</think>`; the opening
                 tag may be in the prompt (the template writes it) or begin the output. An output
                 that never closes the thinking (cut by max_tokens) is all thinking.
    qwen3        Qwen3: thinking only where the output begins with `<think>`, or the prompt left one
                 open; `chat_template_kwargs={"enable_thinking": false}` turns the parser off (the
                 template then writes an empty think block into the prompt, and the output is all
                 answer).

Each parser is one small state machine: before (the output may still open a think block), thinking,
and after. A stream holds back only a tail that may be the start of the tag it waits for.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    """Splits one output into (reasoning, content). `open_in_prompt`: the rendered prompt ends inside
    a think block (its last `<think>` is not closed)."""

    name = ""
    from_start = False  # an output that does not open a think block is thinking all the same

    def __init__(self, open_in_prompt: bool = False):
        self._state = "before"  # the output may still open a think block
        self._untagged = "thinking" if (open_in_prompt or self.from_start) else "after"
        self._held = ""  # text not yet handed out: a tag may begin in it

    @property
    def thinks_untagged(self) -> bool:
        """Whether an output that does not open a think block is thinking (until `</think>`)."""
        return self._untagged == "thinking"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is empty."""
        events = self.feed(text) + self.finish()
        reasoning = "".join(t for kind, t in events if kind == "reasoning")
        content = "".join(t for kind, t in events if kind == "content")
        return reasoning or None, content or None

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """("reasoning" | "content", text) pieces that this delta settles, in order."""
        self._held += delta
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._held:
            text = self._held
            if self._state == "before":
                head = text.lstrip()
                if head.startswith(START):
                    self._held, self._state = head[len(START):], "thinking"
                elif not final and START.startswith(head):  # whitespace, or the tag's beginning: wait
                    break
                else:
                    self._state = self._untagged
            elif self._state == "thinking":
                at = text.find(END)
                if at >= 0:
                    out.append(("reasoning", text[:at]))
                    self._held, self._state = text[at + len(END):], "after_tag"
                    continue
                keep = 0 if final else _tail_prefix(text, END)
                out.append(("reasoning", text[:len(text) - keep]))
                self._held = text[len(text) - keep:]
                break
            elif self._state == "after_tag":  # the answer's leading newlines belong to the tag
                self._held = text.lstrip("\n")
                if self._held:
                    self._state = "after"
            else:
                out.append(("content", text))
                self._held = ""
        return [(k, t) for k, t in out if t]


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    from_start = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


PARSERS = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def _tail_prefix(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a think block (the template opened it for the model)."""
    return prompt.rfind(START) > prompt.rfind(END)


def reasoning_parser(name: str, prompt: str = "", template_kwargs: dict | None = None) -> ReasoningParser | None:
    """A fresh parser for one output of a request (None where the request turned thinking off)."""
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; ours are {', '.join(sorted(PARSERS))}")
    if name == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
        return None
    return PARSERS[name](prompt_opens_thinking(prompt))
