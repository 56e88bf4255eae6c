"""Does sampled JSON close? Issue 48's check: seeded samples of a 5-field schema (a string with
maxLength, an integer with a minimum, an array of at most 3 short strings, a boolean, an enum) at
temperatures 0.7-1.0, max_tokens 200, on SmolLM2-135M, with each whitespace rule in one process.

    .venv/bin/python benchmarks/check_json_closes.py [--samples 20]

Whitespace rules: "default" (at most one newline and 16 spaces or tabs between tokens), "compact"
(disable_any_whitespace) and "free" (any whitespace: llguidance's flexible pattern, through the
schema's "x-guidance", which is what the default was before). Prints one JSON line per prompt and rule:
how many samples parse and validate, their finish reasons and their longest token count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

from runtime import LLM, SamplingParams  # noqa: E402

CITY = {"type": "object", "additionalProperties": False,
        "required": ["city", "population", "landmarks", "is_capital", "continent"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer", "minimum": 0},
                       "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                       "is_capital": {"type": "boolean"},
                       "continent": {"enum": ["Africa", "Asia", "Europe", "North America", "South America",
                                              "Oceania"]}}}
PROMPTS = {  # chat messages, or a bare prompt
    "chat 'CITY: LIMA'": [{"role": "user", "content": "CITY: LIMA"}],
    "chat, describe a city": [{"role": "user", "content": "Describe a city as JSON: its name, population, up to "
                                                          "three landmarks, whether it is a capital, and its continent."}],
    "chat, JSON about Lima": [{"role": "user", "content": "Return a JSON object describing Lima."}],
    "bare 'City record (JSON): '": "City record (JSON): ",
}
FREE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]+"}  # llguidance's whitespace_flexible
RULES = {"default": ({}, False), "compact": ({}, True), "free": ({"x-guidance": FREE}, False)}
TEMPERATURES = (0.7, 0.8, 0.9, 1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=20, help="per prompt and rule (seeds 0..N-1)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--unbounded-items", action="store_true",
                    help="landmarks' strings without maxLength: the model may then ramble inside one")
    args = ap.parse_args()
    schema = CITY
    if args.unbounded_items:
        landmarks = {**CITY["properties"]["landmarks"], "items": {"type": "string"}}
        schema = {**CITY, "properties": {**CITY["properties"], "landmarks": landmarks}}
    llm = LLM("smollm2-135m", max_model_len=512, max_num_seqs=args.samples, max_num_batched_tokens=128,
              num_kv_blocks=400)
    for prompt_name, prompt in PROMPTS.items():
        for rule, (extra, compact) in RULES.items():
            so = {"json": {**schema, **extra}, "disable_any_whitespace": compact}
            params = [SamplingParams(temperature=TEMPERATURES[i % len(TEMPERATURES)], seed=i,
                                     max_tokens=args.max_tokens, structured_outputs=so) for i in range(args.samples)]
            if isinstance(prompt, list):
                outs = llm.chat([prompt] * args.samples, params, use_tqdm=False)
            else:
                outs = llm.generate([prompt] * args.samples, params, use_tqdm=False)
            valid, failed = 0, []
            for i, out in enumerate(outs):
                c = out.outputs[0]
                try:
                    jsonschema.validate(json.loads(c.text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    failed.append({"seed": i, "finish_reason": c.finish_reason, "tail": c.text[-40:]})
            print(json.dumps({"prompt": prompt_name, "whitespace": rule, "valid": valid, "samples": args.samples,
                              "finish_reasons": Counter(o.outputs[0].finish_reason for o in outs),
                              "max_output_tokens": max(len(o.outputs[0].token_ids) for o in outs),
                              "failed": failed, "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
