import numpy as np
import pytest

from conftest import golden_arrays, golden_prompts
from models.tokenizer import Tokenizer
from models.weights import find_smollm2_gguf, read_gguf_index

PROMPTS = golden_prompts()

VARIED_TEXTS = [
    "Hello, world!",
    "x  1", "a   12", "Shopping list:\n1. 12 eggs\n2. 3 apples", "1234567890 3.14159 1e-5 ١٢٣ ½",
    "héllo ñandú 世界 Привет мир", "🤗🚀 emoji 👍🏽 family 👨‍👩‍👧", "\u00a0nbsp\u200bzero-width",
    "def f(x):\n    return [i**2 for i in range(x)]  # squares\n",
    "  \n\n\t  a  b\r\n", "   leading", "trailing   ", "tabs\t\tand\nnewlines\n\n\n",
    "I'm you'll WE'RE they've", "<|im_start|>user\nhi<|im_end|>\n", "<repo_name>x<filename>y",
    "",
]


@pytest.fixture(scope="module")
def gguf_fields():
    return read_gguf_index(find_smollm2_gguf())[0]


@pytest.fixture(scope="module")
def tok(gguf_fields):
    return Tokenizer.from_gguf_fields(gguf_fields)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """The tokenizer transformers builds from the GGUF, saved as tokenizer.json + tokenizer_config.json."""
    transformers = pytest.importorskip("transformers")
    gguf = find_smollm2_gguf()
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(str(out))
    return hf, out


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_golden_prompt_ids(tok, prompt):
    golden = golden_arrays(prompt["name"])["prompt_ids"].tolist()
    if prompt["kind"] == "chat":
        rendered = tok.apply_chat_template(prompt["messages"], add_generation_prompt=True)
        assert rendered == prompt["rendered_text"]
        assert tok.encode_chat(prompt["messages"]) == golden
    assert tok.encode(prompt["rendered_text"]) == golden
    assert len(golden) == prompt["n_prompt"]
    assert tok.decode(golden) == prompt["rendered_text"]


def test_special_tokens(tok):
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.stop_token_ids == {0, 2}
    assert tok.vocab_size == 49152
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(216) == "Ġ"
    # special tokens written in text are parsed whole; add_special_tokens adds nothing (add_bos_token=False)
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_decode_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == text[: -len("<|im_start|>assistant\n")]
    ids = tok.encode_chat(msgs)
    assert ids[0] == 1 and ids.count(2) == 4 and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> "ass" "istant" "\n"
    assert ids == tok.encode(text)


def test_template_helpers_and_sandbox(tok):
    import jinja2

    t = Tokenizer(tok.backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                  chat_template="{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
                                "{{ bos_token }}{{ messages[0] | tojson }}")
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_start|>{"role": "user", "content": "é"}'
    with pytest.raises(jinja2.exceptions.TemplateError, match="no messages"):
        t.apply_chat_template([])
    evil = Tokenizer(tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([{"role": "user", "content": "x"}])


def test_split_digits_option(gguf_fields, tok):
    digits = Tokenizer.from_gguf_fields(gguf_fields, split_digits=True)
    # transformers' GGUF tokenizer (our default, and the golden data) keeps "  1" -> "Ġ", "Ġ1";
    # SmolLM2's original tokenizer.json splits digits first, so the two spaces merge.
    assert tok.encode("x  1") == [104, 216, 216, 33]
    assert digits.encode("x  1") == [104, 256, 33]
    assert digits.encode("12 eggs") == tok.encode("12 eggs")


def test_unsupported_gguf_tokenizer(gguf_fields):
    with pytest.raises(ValueError, match="'rwkv' is not supported"):
        Tokenizer.from_gguf_fields(dict(gguf_fields, **{"tokenizer.ggml.model": "rwkv"}))


def test_matches_transformers_and_tokenizer_json(tok, hf_tokenizer_dir):
    hf, folder = hf_tokenizer_dir
    from_json = Tokenizer.from_file(folder / "tokenizer.json")
    assert Tokenizer.from_file(folder).vocab_size == from_json.vocab_size
    assert from_json.bos_token_id == 1 and from_json.eos_token_id == 2 and from_json.stop_token_ids == {0, 2}
    for text in VARIED_TEXTS + [p["rendered_text"] for p in PROMPTS]:
        want = hf.encode(text, add_special_tokens=False)
        assert tok.encode(text) == want, text
        assert from_json.encode(text) == want, text
        assert from_json.decode(want) == hf.decode(want)
    chat = next(p for p in PROMPTS if p["kind"] == "chat")
    assert from_json.apply_chat_template(chat["messages"]) == chat["rendered_text"]
    assert hf.apply_chat_template(chat["messages"], tokenize=False, add_generation_prompt=True) == chat["rendered_text"]


def test_from_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_file(tmp_path)


def test_token_bytes_maps_byte_level_pieces_back():
    from conftest import tiny_bpe_tokenizer

    t = tiny_bpe_tokenizer()
    e_acute = "é".encode()  # two bytes, two byte-level tokens: each is half a character
    ids = t.encode("é ab")
    assert [t.token_bytes(i) for i in ids[:2]] == [e_acute[:1], e_acute[1:]]
    assert t.decode(ids[:1]) == "\ufffd"  # what the text alone would give for half a character
    assert b"".join(t.token_bytes(i) for i in ids) == "é ab".encode()
    assert t.token_bytes(t.token_to_id("<eos>")) == b"<eos>"  # not in the byte alphabet: its text

    from runtime.entrypoints.openai.protocol import Detok  # the logprobs' "bytes" ask the tokenizer

    assert Detok(t).bytes(ids[0]) == list(e_acute[:1]) and Detok(t).text(ids[0]) == "\ufffd"


def _tiny_spm_fields():
    """GGUF metadata of a tiny SentencePiece BPE vocabulary in Gemma's layout: control tokens, pieces
    with U+2581 for a space, a run-of-spaces token stored as real spaces, and the 256 byte tokens."""
    pieces = ["\u2581", "a", "b", "c", "ab", "\u2581ab", "abc", "\u2581c", "  "]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n"] + pieces
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2, 3, 3, 4] + [1] * len(pieces) + [6] * 256
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def test_gguf_sentencepiece_tokenizer():
    """SentencePiece BPE from GGUF metadata (Gemma): merges by file order, spaces as U+2581, bytes
    for what the vocabulary lacks, bos added, <end_of_turn> a stop token, Gemma's chat format."""
    from models.tokenizer import Tokenizer

    fields = _tiny_spm_fields()
    tok = Tokenizer.from_gguf_fields(fields)
    ids = tok.encode("ab abc  é\n", add_special_tokens=True)
    spelled = [tok.id_to_token(i) for i in ids]
    assert spelled == ["<bos>", "ab", "\u2581ab", "c", "\u2581\u2581", "<0xC3>", "<0xA9>", "\n"]
    assert tok.decode(ids, skip_special_tokens=True) == "ab abc  é\n"
    assert tok.stop_token_ids == {1, 5}
    chat = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": " hi "},
                                    {"role": "assistant", "content": "yo"}])
    assert chat == ("<bos><start_of_turn>user\nS\n\nhi<end_of_turn>\n<start_of_turn>model\nyo<end_of_turn>\n"
                    "<start_of_turn>model\n")
    assert tok.encode(chat)[:2] == [2, 4]  # the template writes <bos>; encoding adds none
    # The logprobs' bytes: a byte token is its byte, a piece its text with U+2581 as a space.
    assert [tok.token_bytes(i) for i in ids[1:]] == [b"ab", b" ab", b"c", b"  ", b"\xc3", b"\xa9", b"\n"]
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == "ab abc  é\n".encode()


def test_text_prompts_get_the_tokenizers_bos():
    """A text prompt to LLM.generate, /v1/completions and /tokenize starts with the <bos> that a
    Gemma-style tokenizer adds (HF's tokenizer(text), vLLM): served without it, gemma-3-270m answered
    "The capital of France is" with " France. The The The". A chat prompt's template writes its own."""
    import dataclasses

    import httpx

    from conftest import tiny_llm
    from models.config import get_preset
    from models.tokenizer import Tokenizer
    from runtime import SamplingParams
    from runtime.serve import ServerThread, build_app

    tok = Tokenizer.from_gguf_fields(_tiny_spm_fields())
    cfg = dataclasses.replace(get_preset("tiny"), vocab_size=tok.vocab_size, bos_token_id=2, eos_token_id=1)
    llm = tiny_llm(config=cfg, tokenizer=tok, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                   num_kv_blocks=16)
    want = tok.encode("ab abc", add_special_tokens=True)
    assert want[0] == 2 and tok.encode("ab abc")[0] != 2
    assert llm.generate(["ab abc"], SamplingParams(max_tokens=1))[0].prompt_token_ids == want
    with ServerThread(build_app(llm.engine, served_model_names=["m"], log_stats_interval=0)) as st, \
            httpx.Client(base_url=st.url, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "ab abc", "max_tokens": 1,
                                             "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        assert c.post("/tokenize", json={"prompt": "ab abc"}).json()["tokens"] == want
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "ab"}]}).json()["tokens"]
        assert chat.count(2) == 1 and chat[0] == 2  # the template's <bos>, not a second one
