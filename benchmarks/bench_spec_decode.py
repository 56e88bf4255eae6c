"""Speculative decoding (n-gram prompt lookup) against plain decoding on SmolLM2-135M, greedy, in one
process: two engines over the same weights, runs interleaved, medians of the decode rates.

    .venv/bin/python benchmarks/bench_spec_decode.py [--rounds 3] [--k 4] [--max-tokens 128]
    .venv/bin/python benchmarks/bench_spec_decode.py --max-num-seqs 1 --max-tokens 96 --cases copy

Cases: batch 1 on a repetitive prompt (asking the model to repeat a long list), and 16 mixed prompts
(the golden prompts and chat questions); `--cases copy` runs issue 48's four copy-heavy prompts at
batch 1 instead (a list to continue, a code edit, a passage to quote, a question on a document).
Prints one JSON line per case with both rates, the speed-up, the drafted and accepted tokens and the
acceptance rate; checks that the outputs are identical. Run on a quiet machine (uptime < 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.weights import load_model  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from config.engine_config import EngineConfig  # noqa: E402
from runtime.entrypoints.llm import LLM  # noqa: E402
from runtime.engine.plan import compile_plan  # noqa: E402

ITEMS = ("apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, "
         "orange, papaya, quince, raspberry, strawberry, tangerine, ugli fruit, vanilla bean, watermelon")
# SmolLM2-135M copies a numbered list it is asked to copy (asked to repeat a comma list, it chats instead).
REPEAT = [{"role": "user", "content": "Copy the following text exactly:\n" + "\n".join(
    f"{i}. {w}" for i, w in enumerate(ITEMS.split(", "), 1))}]
# Issue 48's copy-heavy prompts: text (a raw prompt) or chat messages. SmolLM2-135M continues the
# list and copies most of the function, the passage and the document (then drifts; all of it counts).
COPY_LIST = ("Repeat this list exactly: " + ", ".join(f"item{i}" for i in range(40)) + ". List: "
             + ", ".join(f"item{i}" for i in range(12)))
CODE = 'def greet(name):\n    message = "Hello, " + name + "!"\n    print(message)\n    return message\n'
EDIT_CODE = [{"role": "user", "content": "Rewrite this Python code, changing only the greeting word from Hello to "
                                         "Hi:\n\n```python\n" + CODE + "```"}]
PASSAGE = ("The Amazon rainforest covers much of the Amazon basin of South America. This basin encompasses "
           "seven million square kilometres, of which five and a half million square kilometres are covered by "
           "the rainforest. The majority of the forest is contained within Brazil, with 60% of the rainforest, "
           "followed by Peru with 13%, and Colombia with 10%.")
QUOTE = 'Passage: "' + PASSAGE + '"\n\nThe passage, quoted in full: "'
DOCUMENT = ("Return policy. Items bought online can be returned within 30 days of delivery for a full refund. "
            "Items must be unused and in their original packaging. Sale items can be exchanged but not refunded. "
            "To start a return, log in to your account, open the order, and choose Return items. "
            "Refunds are paid to the original payment method within 5 business days of receiving the item.")
ASK_DOCUMENT = [{"role": "user", "content": "Document:\n" + DOCUMENT + "\n\nQuestion: How do I start a return, "
                                            "and when is the refund paid? Answer using the document's own words."}]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
             "List five prime numbers.", "How do I reverse a list in Python?", "What is 17 times 23?",
             "Name three planets.", "Give me a tip for better sleep.", "What does HTTP stand for?",
             "Summarize the plot of Hamlet in two sentences.", "Translate 'good morning' into Spanish.",
             "Why is the sky blue?"]


def engines(k: int, max_num_seqs: int):
    cfg, weights, tok = load_model("smollm2-135m")
    base = dict(max_model_len=1024, max_num_seqs=max_num_seqs, max_num_batched_tokens=256, num_kv_blocks=1200)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    out = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": spec})):
        plan = compile_plan(None, EngineConfig(**base, **extra), weights=weights, config=cfg, tokenizer=tok)
        out[name] = LLM.from_plan(plan)
    return out, tok


def run(llm, prompts, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(t) for t in toks) / dt, toks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="of both engines (1: a batch-1 engine)")
    ap.add_argument("--cases", choices=("default", "copy"), default="default")
    args = ap.parse_args()
    llms, tok = engines(args.k, args.max_num_seqs)
    chat = lambda m: tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))  # noqa: E731
    if args.cases == "copy":
        cases = {"list to continue": [COPY_LIST], "code edit": [chat(EDIT_CODE)], "passage to quote": [QUOTE],
                 "question on a document": [chat(ASK_DOCUMENT)]}
    else:
        golden = [p["rendered_text"] for p in json.loads((ROOT.parent / "shared" / "golden" / "prompts.json").read_text())]
        mixed = ([tok.encode(g) for g in golden] + [chat([{"role": "user", "content": q}]) for q in QUESTIONS])[:16]
        cases = {"batch 1, repetitive prompt": [chat(REPEAT)], "16 mixed prompts": mixed}
    for name, prompts in cases.items():
        for llm in llms.values():  # warm: every bucket this case touches has run once
            run(llm, prompts, args.max_tokens)
        rates = {k: [] for k in llms}
        outputs = {}
        spec = llms["ngram"].engine
        before = spec.stats()
        for _ in range(args.rounds):
            for k, llm in llms.items():
                rate, outputs[k] = run(llm, prompts, args.max_tokens)
                rates[k].append(rate)
        after = spec.stats()
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(json.dumps({"case": name, "plain_tok_s": round(med["plain"], 1), "ngram_tok_s": round(med["ngram"], 1),
                          "speedup": round(med["ngram"] / med["plain"], 3),
                          "output_tokens": sum(map(len, outputs["ngram"])), "drafted_tokens": drafted // args.rounds,
                          "accepted_tokens": accepted // args.rounds,
                          "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                          "identical_outputs": outputs["plain"] == outputs["ngram"],
                          "rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                          "max_num_seqs": args.max_num_seqs, "load_avg_1m": os.getloadavg()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
