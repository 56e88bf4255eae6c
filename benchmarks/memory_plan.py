"""The memory plan's prediction against XLA's measurement, one engine mode per process.

    .venv/bin/python benchmarks/memory_plan.py                 # every mode, SmolLM2 at its defaults
    .venv/bin/python benchmarks/memory_plan.py bf16 "tp=3"     # some of them

Each mode starts `LLM("smollm2-135m", **mode)` with every other setting at its default (the
tensor-parallel ones on forced host devices), generates a few tokens, and reports the dry run's
predicted activation peak (what `jaxserve compile --dry-run` prints), the peak XLA measured over
every compiled executable, their ratio, the KV blocks planned and kept, whether weights + KV +
measured peak fit the budget, the process's resident memory once serving and at its peak (XLA's
compiles included), and the time to start. Prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MODES = {
    "default (f32)": {},
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "tp=2": dict(tensor_parallel_size=2),
    "tp=3": dict(tensor_parallel_size=3),
    "tp=2 bf16": dict(tensor_parallel_size=2, dtype="bfloat16"),
    "int8": dict(quantization="int8"),
    "w8a8": dict(quantization="w8a8"),
    "bf16 KV cache": dict(kv_cache_dtype="bfloat16"),
    "scan on": dict(scan_layers=True),
    "scan off": dict(scan_layers=False),
    "ngram speculation": dict(speculative_config=NGRAM),
    "structured outputs": dict(),  # the same executables; the request carries a JSON schema
    "multi-step decode (8)": dict(num_scheduler_steps=8),
}


def _rss() -> int:
    """The process's resident bytes now (after start-up and a request: the serving footprint)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(name: str) -> dict:
    import resource

    from runtime import LLM, SamplingParams
    from runtime.core.sampling_params import StructuredOutputsParams

    t0 = time.perf_counter()
    llm = LLM("smollm2-135m", **MODES[name])
    start = time.perf_counter() - t0
    so = None
    if name == "structured outputs":
        so = StructuredOutputsParams(json={"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"]})
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=16, structured_outputs=so))[0].outputs[0].text
    m = llm.plan.memory
    return {"predicted": m.peak_activation_bytes, "measured": m.measured_peak_bytes,
            "planned": m.planned_kv_blocks, "blocks": m.num_kv_blocks,
            "fits": m.weight_bytes + m.kv_cache_bytes + m.measured_peak_bytes <= m.budget_bytes,
            "budget": m.budget_bytes, "weights": m.weight_bytes, "kv": m.kv_cache_bytes,
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss": _rss(), "start_s": start,
            "text": out, "table": m.table()}


def main(argv: list[str]) -> int:
    names = argv or list(MODES)
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    rows = ["| mode | predicted peak MiB | measured peak MiB | predicted / measured | KV blocks planned -> kept "
            "| weights + KV + peak <= budget | RSS serving MiB | max RSS MiB | start s |", "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        tp = MODES[name].get("tensor_parallel_size", 1)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        if tp > 1:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={tp}".strip()
        proc = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                              env=env, cwd=ROOT)
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
            rows.append(f"| {name} | failed | | | | | | | |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"## {name}\n{r['table']}\ntext: {r['text']!r}\n", file=sys.stderr, flush=True)
        rows.append(f"| {name} | {mib(r['predicted'])} | {mib(r['measured'])} | {r['predicted'] / r['measured']:.2f} "
                    f"| {r['planned']} -> {r['blocks']} | {'yes' if r['fits'] else 'NO'} | {mib(r['rss'])} | {mib(r['maxrss'])} "
                    f"| {r['start_s']:.0f} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(ROOT))
        import logging

        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(child(sys.argv[2])))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
