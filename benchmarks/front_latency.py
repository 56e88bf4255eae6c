"""What the --data-parallel-size front adds to a request: the same server alone and behind the
front (runtime/distributed/front.py), in this process, alternating, on SmolLM2-135M.

    .venv/bin/python benchmarks/front_latency.py                 # 200 rounds
    .venv/bin/python benchmarks/front_latency.py --rounds 50

Each round sends, to each URL in turn, one request of each kind: a 1-token completion (the
whole answer through the front), a 1-token stream (until [DONE]), and GET /v1/models (no engine
work: the front's own cost, nearly alone). Prints the median and P90 of each, and the medians'
difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    import httpx

    from conftest import SMOL_ARGS, front_over
    from runtime import LLM
    from runtime.serve import ServerThread, build_app

    llm = LLM("smollm2-135m", **SMOL_ARGS)
    app = build_app(llm.engine, served_model_names=["smollm2-135m"], log_stats_interval=0)
    body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    kinds = {
        "completion, 1 token": lambda c: c.post("/v1/completions", json=body),
        "stream, 1 token": lambda c: c.post("/v1/completions", json={**body, "stream": True}),
        "GET /v1/models": lambda c: c.get("/v1/models"),
    }
    times = {(k, w): [] for k in kinds for w in ("server", "front")}
    with ServerThread(app) as st, front_over([st.url], ["smollm2-135m"]) as front_url, \
            httpx.Client(base_url=st.url, timeout=60) as alone, httpx.Client(base_url=front_url, timeout=60) as front:
        for _ in range(3):  # warm both paths
            for fn in kinds.values():
                fn(alone), fn(front)
        for _ in range(args.rounds):
            for kind, fn in kinds.items():
                for who, c in (("server", alone), ("front", front)):
                    t0 = time.perf_counter()
                    r = fn(c)
                    times[kind, who].append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
    import os

    print(f"{args.rounds} rounds, load {os.getloadavg()[0]:.2f}\n")
    print("| request | alone: median (P90) ms | behind the front: median (P90) ms | added (medians) ms |")
    print("|---|---|---|---|")
    for kind in kinds:
        a, f = times[kind, "server"], times[kind, "front"]
        q = lambda xs: statistics.quantiles(xs, n=10)[-1] * 1e3  # noqa: E731
        print(f"| {kind} | {statistics.median(a) * 1e3:.2f} ({q(a):.2f}) | {statistics.median(f) * 1e3:.2f} "
              f"({q(f):.2f}) | {(statistics.median(f) - statistics.median(a)) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
