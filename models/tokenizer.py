"""Tokenizer: a `tokenizers` backend plus special tokens and a jinja2 chat template.

Built either from an HF `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`) or from
GGUF metadata (`tokenizer.ggml.*`), reproducing what transformers builds from the same GGUF.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

# Tokens that end a turn or a document in the families we serve; stop ids are these plus eos, if present.
_STOP_TOKEN_STRINGS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "</s>",
                       "<end_of_turn>")
# SentencePiece's word-boundary mark, which stands for a space in its pieces.
_SPM_SPACE = "\u2581"

# GGUF token_type values (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


@lru_cache(maxsize=32)
def compile_chat_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes; HF templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    # Same environment options HF uses, so templates render byte-identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, Mapping):
        return tok.get("content")
    return tok


class Tokenizer:
    """Text <-> ids, special tokens, and chat template rendering."""

    def __init__(self, backend: _Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, extra_stop_token_ids: Iterable[int] = ()):
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        stop = {self.eos_token_id} if self.eos_token_id is not None else set()
        # A stop string counts where it is a special token: Gemma's vocabulary has "</s>" as text.
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        for s in _STOP_TOKEN_STRINGS:
            i = backend.token_to_id(s)
            if i is not None and i in special:
                stop.add(i)
        self.stop_token_ids: set[int] = stop | set(extra_stop_token_ids)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads `tokenizer.json` (a file or its directory), with `tokenizer_config.json`,
        `chat_template.jinja`, `config.json` and `generation_config.json` beside it when present."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer.json not found")
        try:
            backend = _Backend.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path}: cannot load tokenizer: {e}") from None
        folder = path.parent
        tk_cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")

        template = tk_cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()

        bos = _token_content(tk_cfg.get("bos_token"))
        eos = _token_content(tk_cfg.get("eos_token"))
        if bos is None and model_cfg.get("bos_token_id") is not None:
            bos = backend.id_to_token(model_cfg["bos_token_id"])
        eos_ids = gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id"))
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        if eos is None and eos_ids:
            eos = backend.id_to_token(eos_ids[0])
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=template, extra_stop_token_ids=eos_ids)

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], *, split_digits: bool = False) -> "Tokenizer":
        """Builds the tokenizer a GGUF describes: byte-level BPE (`tokenizer.ggml.model == "gpt2"`),
        or SentencePiece BPE with byte fallback ("llama", as Gemma's files have it).

        Matches transformers' GGUF tokenizer: GPT-2 ByteLevel pre-tokenizer, control tokens added as
        special. `split_digits=True` adds the Digits split of SmolLM2's original tokenizer.json (and of
        llama.cpp's "smollm" pre-tokenizer); it differs only on whitespace runs before a digit.
        """
        kind = fields.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_sentencepiece(fields)
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', "
                             "SentencePiece BPE 'llama')")
        tokens: Sequence[str] = fields["tokenizer.ggml.tokens"]
        merges: Sequence[str] = fields.get("tokenizer.ggml.merges") or []
        token_types: Sequence[int] = fields.get("tokenizer.ggml.token_type") or []

        alphabet = bytes_to_unicode()
        letters = set(alphabet.values())
        # A token spelled outside the byte alphabet (rare llama.cpp quirk) is re-spelled byte-wise.
        vocab = {t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = _Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        if split_digits:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)

        # Control tokens are special; a "control" token outside the byte alphabet is a mislabel, skip it.
        special = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_CONTROL and set(t) <= letters]
        if special:
            backend.add_special_tokens(special)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_USER_DEFINED and t in vocab]
        if user:
            backend.add_tokens(user)

        return cls._finish_gguf(backend, fields, tokens, vocab, default_add_bos=False)

    @classmethod
    def _from_gguf_sentencepiece(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """SentencePiece BPE (Gemma's files): spaces become U+2581, unknown characters fall back to
        their UTF-8 bytes (`<0xNN>` tokens). The file lists no merges: they are every split of a
        token into two tokens, best first by the token's place in the file (Gemma's scores do not
        follow its merge order; its file order does), longer left halves first, as transformers
        rebuilds them. Tokens of two or more real spaces are respelled with U+2581, as
        transformers looks them up."""
        tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t
                  for t in fields["tokenizer.ggml.tokens"]]
        token_types: Sequence[int] = fields.get("tokenizer.ggml.token_type") or []
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = []
        for rank, t in enumerate(tokens):
            splits = [(t[:i], t[i:]) for i in range(len(t) - 1, 0, -1) if t[:i] in vocab and t[i:] in vocab]
            merges += [(rank, -len(a), a, b) for a, b in splits]
        merges.sort(key=lambda m: m[:2])
        unk_id = fields.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        backend = _Backend(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in merges], fuse_unk=True,
                                      unk_token=unk, byte_fallback=True))
        backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        if fields.get("tokenizer.ggml.add_space_prefix", False):
            backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), backend.normalizer])
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
        special = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_CONTROL]
        if special:
            backend.add_special_tokens(special)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_USER_DEFINED]
        if user:
            backend.add_tokens(user)
        return cls._finish_gguf(backend, fields, tokens, vocab, default_add_bos=True)

    @classmethod
    def _finish_gguf(cls, backend, fields, tokens, vocab, *, default_add_bos: bool) -> "Tokenizer":
        """The bos/eos handling and chat template every GGUF tokenizer shares. A SentencePiece file
        that says nothing adds bos (llama.cpp's rule); Gemma's files without a chat template get
        Gemma's turn format (GEMMA_CHAT_TEMPLATE)."""

        def tok(key):
            i = fields.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = tok("bos"), tok("eos")
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
        add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
        template = fields.get("tokenizer.chat_template")
        if template is None and str(fields.get("general.architecture", "")).startswith("gemma") \
                and "<start_of_turn>" in vocab:
            template = GEMMA_CHAT_TEMPLATE
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=template)

    # -- ids <-> text ---------------------------------------------------------------------------

    @property
    def backend(self) -> _Backend:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are parsed as such."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for: a byte-level BPE piece mapped back through the byte
        alphabet (so a piece holding part of a UTF-8 character gives those bytes, not U+FFFD); a
        SentencePiece byte token (<0xC3>) its byte, and a SentencePiece piece its text with U+2581 as
        a space; any other token, the UTF-8 of its decoded text."""
        piece = self.id_to_token(token_id) or ""
        if getattr(self._backend.model, "byte_fallback", False):  # SentencePiece BPE (Gemma)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])  # a byte token: one byte of a character
            if token_id not in self._backend.get_added_tokens_decoder():
                return piece.replace(_SPM_SPACE, " ").encode("utf-8")
        inverse = _unicode_to_bytes()
        if all(c in inverse for c in piece):
            return bytes(inverse[c] for c in piece)
        return self.decode([token_id]).encode("utf-8")

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """Renders `messages` with the model's jinja2 chat template, or `chat_template` in its place
        (sandboxed, HF's options: `tools`, `enable_thinking` and other kwargs reach the template)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        context.update(kwargs)
        return compile_chat_template(template).render(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs) -> list[int]:
        """Ids of the rendered chat template (the template writes its own special tokens)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    def save(self, directory: str | os.PathLike) -> None:
        """Writes tokenizer.json + tokenizer_config.json + generation_config.json, for `from_file`."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
        gen = {"eos_token_id": sorted(self.stop_token_ids)}
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=1))

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"stop_token_ids={sorted(self.stop_token_ids)})")


# Gemma's turn format, for Gemma GGUF files that carry no template (google/gemma-3-270m, the base
# model, has none): each message as `<start_of_turn>{role}\n{content}<end_of_turn>\n`, the
# assistant's role named `model`, a system message folded into the first user turn, and `<bos>`
# first (the template writes it; the prompt is encoded without special tokens).
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}
{%- for message in (messages[1:] if system is not none else messages) -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{%- set content = message['content'] if message['content'] is string else message['content'] | map(attribute='text') | join('') -%}
<start_of_turn>{{ role }}
{% if loop.first and system is not none %}{{ system }}

{% endif %}{{ content | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
<start_of_turn>model
{% endif -%}"""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
