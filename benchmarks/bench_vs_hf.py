"""Our engine against HF transformers on SmolLM2-135M or Gemma 3 270M (f32, greedy, CPU), in one
process: the ratios issues 13 and 50 ask for, each a median over interleaved rounds.

    .venv/bin/python benchmarks/bench_vs_hf.py [--model gemma-3-270m] [--num-seqs 16] [--hf-batch 16] [--hf-threads 1]
                                            [--rounds 3] [--skip-batch] [--matmul-precision bfloat16]
                                            [--quantization w8a8] [--kv-cache-dtype bfloat16]
                                            [--gguf-activations q8]
                                            [--kernel-backend auto|xla|cpp]

- TTFT of a 512-token prompt: ours `LLM.generate(max_tokens=1)`; HF one forward pass + argmax.
- Batch-1 decode rate: 128 tokens after a 32-token prompt (`ignore_eos`); HF `generate()`.
- 64 sequences x 64 tokens (ours, continuous batching) against HF `generate()` on batches of 16;
  new prompts each round, so our prefix cache never hits (--num-seqs, --hf-batch change both).
HF loads SmolLM2 from our weights as a LlamaForCausalLM, and Gemma 3 from the same GGUF file
(`from_pretrained(dir, gguf_file=name)`, its dequantized weights: the same model as ours).
Run on a quiet machine (uptime < 1); prints one JSON line per measurement.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from config.engine_config import GGUF_ACTIVATIONS, KERNEL_BACKENDS, MATMUL_PRECISIONS, QUANTIZATIONS  # noqa: E402
from models.weights import load_model  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from runtime.tools.bench import hf_model  # noqa: E402
from config.engine_config import EngineConfig  # noqa: E402
from runtime.entrypoints.llm import LLM  # noqa: E402
from runtime.engine.plan import compile_plan  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hf_generate(model, prompts: list[list[int]], new: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "gemma-3-270m"])
    ap.add_argument("--num-seqs", type=int, default=64, help="sequences of the batch case")
    ap.add_argument("--hf-batch", type=int, default=16, help="HF generate()'s batch in the batch case")
    ap.add_argument("--hf-threads", type=int, default=None,
                    help="torch.set_num_threads for HF (default: torch's own, one per core). Under load, "
                         "torch's thread team waits at every op for a descheduled thread: Gemma 3 270M's "
                         "batch-1 decode ran 13x slower with 2 threads than with 1 at load 5.6")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-batch", action="store_true", help="skip the 64-sequence case (the slowest)")
    ap.add_argument("--matmul-precision", default="float32", choices=MATMUL_PRECISIONS,
                    help="our engine's matmul_precision (HF stays f32)")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="our engine's quantization (HF stays f32)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="our engine's kv_cache_dtype (HF stays f32)")
    ap.add_argument("--gguf-activations", default="f32", choices=GGUF_ACTIVATIONS,
                    help="our engine's gguf_activations (q8: int8 products on the GGUF blocks; HF stays f32)")
    ap.add_argument("--kernel-backend", default="auto", choices=KERNEL_BACKENDS,
                    help="our engine's kernel_backend (auto: cpp on CPU where g++ builds it)")
    args = ap.parse_args()
    if args.hf_threads is not None:
        torch.set_num_threads(args.hf_threads)
    cfg, weights, tok = load_model(args.model)
    plan = compile_plan(None, EngineConfig(max_model_len=1024, max_num_seqs=args.num_seqs, max_num_batched_tokens=512,
                                           num_kv_blocks=2000, matmul_precision=args.matmul_precision,
                                           quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                           kernel_backend=args.kernel_backend, gguf_activations=args.gguf_activations),
                        weights=weights, config=cfg, tokenizer=tok)
    llm = LLM.from_plan(plan)
    if args.model == "gemma-3-270m":
        from transformers import AutoModelForCausalLM

        from models.weights import find_gemma3_270m_gguf

        path = find_gemma3_270m_gguf()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    else:
        hf = hf_model(cfg, weights)
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(100, 40000, n).tolist()  # noqa: E731
    greedy = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731

    def report(name, ours, theirs, unit, higher_is_better):
        o, h = statistics.median(ours), statistics.median(theirs)
        ratio = h / o if not higher_is_better else o / h
        print(json.dumps({"case": name, "model": args.model, "hf_threads": torch.get_num_threads(),
                          "ours": round(o, 3), "hf": round(h, 3), "unit": unit,
                          "ours_vs_hf": round(ratio, 2), "rounds_ours": [round(x, 3) for x in ours],
                          "rounds_hf": [round(x, 3) for x in theirs], "load_avg_1m": round(os.getloadavg()[0], 2)}),
              flush=True)

    # TTFT, 512-token prompt (a new prompt each time: no prefix-cache hit).
    llm.generate([prompt(512)], greedy(1))
    ours, theirs = [], []
    for _ in range(args.rounds):
        p = prompt(512)
        ours.append(timed(lambda: llm.generate([p], greedy(1))))
        with torch.no_grad():
            theirs.append(timed(lambda: hf(torch.tensor([p])).logits[0, -1].argmax()))
    report("TTFT, 512-token prompt", ours, theirs, "s", higher_is_better=False)

    # Batch-1 decode rate.
    p = prompt(32)
    llm.generate([p], greedy(128))
    ours, theirs = [], []
    for _ in range(args.rounds):
        ttft = timed(lambda: llm.generate([p], greedy(1)))
        ours.append(127 / (timed(lambda: llm.generate([p], greedy(128))) - ttft))
        hf_ttft = timed(lambda: hf_generate(hf, [p], 1))
        theirs.append(127 / (timed(lambda: hf_generate(hf, [p], 128)) - hf_ttft))
    report("batch-1 decode", ours, theirs, "tok/s", higher_is_better=True)

    if not args.skip_batch:
        n, hb = args.num_seqs, args.hf_batch
        llm.generate([prompt(64) for _ in range(n)], greedy(64))
        ours, theirs = [], []
        for _ in range(args.rounds):
            # New prompts each round: a repeated prompt would hit our prefix cache, and HF has none.
            prompts = [prompt(64) for _ in range(n)]
            ours.append(n * 64 / timed(lambda: llm.generate(prompts, greedy(64))))
            theirs.append(n * 64 / timed(lambda: [hf_generate(hf, prompts[i:i + hb], 64) for i in range(0, n, hb)]))
        report(f"{n} sequences x 64 tokens (HF: batches of {hb})", ours, theirs, "tok/s", higher_is_better=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
