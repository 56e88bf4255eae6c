"""Throughput cost of structured outputs: the same batch with every request free, then with a fraction
of them constrained to a JSON schema (issue 14's target: <= 10% for half constrained).

    python scripts/bench_structured.py --model smollm2-135m --num-prompts 32 --max-tokens 64

Every request ends by max_tokens (free ones ignore EOS; the schema, an array of exactly 60 digits,
is longer than max_tokens), so both runs generate the same number of tokens in the same number of
steps and tok/s compares the step cost alone: the host writing masks and the masked sampler.
Runs alternate (free, constrained, ...) and the median of --repeats is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import LLM, SamplingParams  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 60,
          "maxItems": 60}
TOPICS = ["the sea", "mountains", "a city at night", "an old library", "the first snow", "a robot", "a garden",
          "a long train journey"]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int, float, float]:
    """(seconds, generated tokens, host seconds preparing step inputs (masks included), host seconds
    after the step (matchers accept tokens there))."""
    llm.engine.trace = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    prep = sum(s.prepare_s for s in llm.engine.trace)
    post = sum(s.postprocess_s for s in llm.engine.trace)
    llm.engine.trace = None
    return dt, sum(len(o.outputs[0].token_ids) for o in outs), prep, post


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--structured-fraction", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=512, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=256)
    prompts = [f"Write a short poem about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(args.num_prompts)]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    k = round(args.num_prompts * args.structured_fraction)
    mixed = [constrained if (i * k) // args.num_prompts != ((i + 1) * k) // args.num_prompts else free
             for i in range(args.num_prompts)]  # spread evenly through the batch
    run(llm, prompts[:4], [free, constrained] * 2)  # warm: first executions, grammar compile
    rows = {"free": [], "mixed": []}
    for _ in range(args.repeats):
        for name, params in (("free", [free] * args.num_prompts), ("mixed", mixed)):
            rows[name].append(run(llm, prompts, params))
    base = statistics.median(n / dt for dt, n, *_ in rows["free"])
    print(f"{args.model}: {args.num_prompts} prompts x {args.max_tokens} tokens, max_num_seqs {args.max_num_seqs}, "
          f"{sum(p is constrained for p in mixed)} constrained; median of {args.repeats}")
    for name, rs in rows.items():
        tps = statistics.median(n / dt for dt, n, *_ in rs)
        prep, post = (statistics.median(r[i] for r in rs) for i in (2, 3))
        print(f"  {name:5s}: {tps:8.1f} tok/s ({statistics.median(r[1] for r in rs)} tokens), host prepare "
              f"{prep:.2f} s, postprocess {post:.2f} s, cost {100 * (1 - tps / base):+.1f}%")
    print(f"  recompiles: {llm.engine.stats().num_recompiles}")


if __name__ == "__main__":
    main()
