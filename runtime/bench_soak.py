"""Soak test of a running server: steady load for a while, then checks that nothing leaked or degraded.

    jaxserve bench soak --url http://127.0.0.1:8000 --duration-s 600 --request-rate 4
    python -m runtime.bench soak --url http://127.0.0.1:8000 --duration-s 60 --max-output-len 16

Sends `jaxserve bench serve`'s workload (seeded token-id prompts, `ignore_eos`, streaming) in rounds
of --round-prompts requests with Poisson arrivals at --request-rate, a new seed each round, until
--duration-s has passed. Then it waits for the server to go idle and checks:

- no request failed;
- /health still answers 200;
- `recompiles_total` did not move (every step stayed in the bucket table);
- nothing is left running or waiting, and no KV block is still in use (`vllm:kv_cache_usage_perc`
  is 0: nothing leaked);
- the last round's median end-to-end latency is within --max-slowdown times the first round's
  (plus --latency-slack-ms, so that jitter on millisecond latencies is not a finding).

One line per round, one line per check; exit 0 when every check passes, 1 when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from dataclasses import dataclass

from runtime.args import ArgumentParser
from runtime.bench_serve import WORKLOADS, make_workload, run_async, server_info

IDLE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def metric(text: str, name: str) -> float | None:
    """The sum over label sets of one sample in Prometheus text (None if the server has no such metric)."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in values) if values else None


def _get(url: str, path: str, api_key: str | None, timeout: float = 30.0):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(url.rstrip("/") + path, headers=headers, timeout=timeout)


def wait_idle(url: str, api_key: str | None, timeout_s: float) -> tuple[bool, str]:
    """Polls /metrics until nothing runs or waits; (went idle?, the last /metrics text)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _get(url, "/metrics", api_key).text
        idle = all(metric(text, m) == 0 for m in IDLE_METRICS[:2])
        if idle or time.monotonic() > deadline:
            return idle, text
        time.sleep(0.2)


def soak(url: str, *, duration_s: float, request_rate: float, round_prompts: int, seed: int = 0,
         workload: str = "mixed", api_key: str | None = None, model: str | None = None,
         max_input_len: int | None = None, max_output_len: int | None = None, max_slowdown: float = 2.0,
         latency_slack_ms: float = 100.0, idle_timeout_s: float = 60.0, log=print) -> list[Check]:
    """Runs the load, then the checks (see the module docstring)."""
    info = server_info(url, api_key)
    model = model or info["id"]
    before = _get(url, "/metrics", api_key).text
    rounds = []
    t0 = time.monotonic()
    while not rounds or time.monotonic() - t0 < duration_s:
        work = make_workload(workload, round_prompts, seed + len(rounds), int(info.get("max_model_len") or 2048),
                             int(info.get("vocab_size") or 32000), max_input_len, max_output_len)
        r = asyncio.run(run_async(url, model, work, request_rate, seed=seed + len(rounds), api_key=api_key))
        rounds.append(r)
        log(f"round {len(rounds):>3} at {time.monotonic() - t0:7.1f}s: {r.completed}/{r.num_prompts} ok, "
            f"{r.output_throughput:8.1f} out tok/s, E2E p50 {r.e2e_ms['median']:8.0f} ms, "
            f"p99 {r.e2e_ms['p99']:8.0f} ms" + (f", errors: {'; '.join(r.errors)}" if r.errors else ""))
    idle, after = wait_idle(url, api_key, idle_timeout_s)
    failed = sum(r.failed for r in rounds)
    health = _get(url, "/health", api_key).status_code
    recompiles = [metric(t, "recompiles_total") for t in (before, after)]
    left = {m: metric(after, m) for m in IDLE_METRICS}
    first, last = rounds[0].e2e_ms["median"], rounds[-1].e2e_ms["median"]
    total = sum(r.num_prompts for r in rounds)
    return [
        Check("requests", failed == 0, f"{total - failed}/{total} finished in {len(rounds)} rounds"),
        Check("health", health == 200, f"/health answered {health}"),
        Check("recompiles", None not in recompiles and recompiles[0] == recompiles[1],
              f"recompiles_total {recompiles[0]} -> {recompiles[1]}"),
        Check("idle", idle and left["vllm:kv_cache_usage_perc"] == 0,
              ", ".join(f"{m.split(':')[-1]} {v}" for m, v in left.items())),
        Check("latency", last <= max_slowdown * first + latency_slack_ms,
              f"E2E p50 first round {first:.0f} ms, last {last:.0f} ms "
              f"(limit {max_slowdown}x + {latency_slack_ms:g} ms)"),
    ]


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m runtime.bench soak", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--duration-s", type=float, default=600.0, help="keep starting rounds for this long")
    ap.add_argument("--request-rate", type=float, default=4.0, help="mean arrivals per second, Poisson")
    ap.add_argument("--round-prompts", type=int, default=32, help="requests per round")
    ap.add_argument("--seed", type=int, default=0, help="round i uses seed + i")
    ap.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    ap.add_argument("--max-input-len", type=int, default=None, help="truncate prompts")
    ap.add_argument("--max-output-len", type=int, default=None, help="cap output lengths")
    ap.add_argument("--max-slowdown", type=float, default=2.0,
                    help="fail when the last round's median latency exceeds the first's by this factor")
    ap.add_argument("--latency-slack-ms", type=float, default=100.0,
                    help="latency difference that never counts as a slowdown")
    ap.add_argument("--idle-timeout-s", type=float, default=60.0, help="how long the server may take to drain")
    args = ap.parse_args(argv)
    checks = soak(args.url, duration_s=args.duration_s, request_rate=args.request_rate,
                  round_prompts=args.round_prompts, seed=args.seed, workload=args.workload,
                  api_key=args.api_key, model=args.model, max_input_len=args.max_input_len,
                  max_output_len=args.max_output_len, max_slowdown=args.max_slowdown,
                  latency_slack_ms=args.latency_slack_ms, idle_timeout_s=args.idle_timeout_s)
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<11} {c.detail}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
