"""Issue 48's hostile requests against a real server on SmolLM2 (the tests' engine shape): how each
hostile grammar is answered and how long it takes, and a normal 4-token completion's latency
(plus a /tokenize) before and during a burst of four concurrent slow bad requests.

    python benchmarks/bench_hostile.py [--rounds 1] [--body-checkers 2] [--flood 0]

`--rounds 1` is the issue's burst: four concurrent requests, once; more rounds repeat them back to
back. `--flood S`: four clients sending them back to back for S seconds instead, as
tests/test_hostile.py does for 4 s. `--body-checkers 0` checks large bodies in the server process
(as before the checker processes) for a before/after at the same load."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="bursts of four requests, back to back")
    ap.add_argument("--flood", type=float, default=0.0, help="seconds each client sends them back to back")
    ap.add_argument("--body-checkers", type=int, default=2, help="checker processes (0: the server parses all)")
    ap.add_argument("--skip-grammars", action="store_true", help="only the bursts")
    args = ap.parse_args()
    import conftest
    import httpx
    from test_hostile import HOSTILE_GRAMMARS, _latency_during_burst

    from models.weights import load_model
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM
    from runtime.engine.plan import compile_plan
    from runtime.serve import ServerThread, build_app

    conftest.pytest_configure(None)
    config, weights, tok = load_model("smollm2-135m")
    llm = LLM.from_plan(compile_plan(None, EngineConfig(**conftest.SMOL_ARGS), weights=weights, config=config,
                                     tokenizer=tok))
    app = build_app(llm.engine, served_model_names="smollm2-135m", log_stats_interval=0,
                    body_checkers=args.body_checkers)
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=120) as c:
        print("| structured_outputs | status | code | ms | message |\n|---|---|---|---|---|")
        for what, so in [] if args.skip_grammars else HOSTILE_GRAMMARS:
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": "Output:", "max_tokens": 16, "temperature": 0,
                                                "structured_outputs": so})
            ms = (time.perf_counter() - t0) * 1e3
            err = r.json().get("error", {})
            print(f"| {what} | {r.status_code} | {err.get('code')} | {ms:.0f} | {err.get('message', '')[:90]} |")
        p50 = lambda x: x[len(x) // 2]  # noqa: E731
        # "padding": 4 MB bodies that cost nothing to parse: what receiving the bytes alone costs
        for kind in ("choice", "messages", "padding"):
            # --flood 0: each of the four clients sends one request per round
            for _ in range(args.rounds):
                before, during, burst = _latency_during_burst(st.url, kind, seconds=args.flood)
                move = (p50(during) - p50(before)) * 1e3
                print(f"{kind}: {len(burst)} refused ({sorted({b[1] for b in burst})}, slowest "
                      f"{max(b[2] for b in burst) * 1e3:.0f} ms); normal completion + /tokenize p50 "
                      f"{p50(before) * 1e3:.0f} ms before, {p50(during) * 1e3:.0f} ms during ({move:+.0f}; max "
                      f"{during[-1] * 1e3:.0f} ms, {len(during)} samples)")


if __name__ == "__main__":
    main()
