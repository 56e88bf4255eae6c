"""Start-up as a user sees it: `python -m runtime.serve` from launch to a 200 on /health.

    .venv/bin/python benchmarks/bench_startup.py [--rounds 2] [-- extra serve flags]

One cold start on an empty cache directory (the compile caches and the GGUF index), then `--rounds` pairs of warm starts on that cache,
alternating the executable store on and off (JAXSERVE_EXECUTABLE_STORE), each start its own
process, each after the load average has settled (`--max-load`). Per start: seconds to /health,
and the server's own "plan ready" and "engine warm" log times. Numbers for docs/benchmarks/
("Start-up"). Run on a quiet machine; one heavy job at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.weights import GGUF_CACHE_ENV  # noqa: E402
from runtime.tools.bench_soak import start_server  # noqa: E402
from runtime.worker.executables import ENV_SWITCH  # noqa: E402


def settle(max_load: float, timeout_s: float = 180.0) -> None:
    """Waits (up to `timeout_s`) for the 1-minute load average to fall under `max_load`: the last
    start's own load must not count against the next one."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < timeout_s:
        time.sleep(5)


def first_requests(url: str) -> dict:
    """Seconds for a short and a long greedy completion, each sent twice (the second time with
    other words, so that no prefix is cached), one at a time, right after /health: what the first
    requests pay for buckets whose executables have not run yet."""
    import httpx

    out = {}
    for name, words in (("short", 20), ("long", 400)):
        times = []
        for word in ("token", "word"):
            body = dict(model="smollm2-135m", prompt=" ".join([word] * words), max_tokens=16, temperature=0)
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            times.append(round(time.perf_counter() - t0, 3))
        out[name] = times
    return out


def start_once(cache: str, store: bool, extra: list[str], max_load: float, requests: bool = False) -> dict:
    settle(max_load)
    os.environ[ENV_SWITCH] = "1" if store else "0"  # the server inherits it
    log_path = Path(cache) / f"serve-{time.time_ns()}.log"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc, url = start_server(["--compilation-cache-dir", cache, *extra], str(log_path), timeout_s=1200.0)
    health_s = time.perf_counter() - t0
    timed = first_requests(url) if requests else None
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = log_path.read_text()

    def logged(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None

    out = dict(store=store, health_s=round(health_s, 1), plan_ready_s=logged(r"plan ready in ([\d.]+)s"),
               engine_warm_s=logged(r"engine warm in ([\d.]+)s"), load_at_start=round(load, 2))
    return out if timed is None else dict(out, first_requests_s=timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="warm pairs (store on, store off)")
    ap.add_argument("--max-load", type=float, default=1.0,
                    help="wait (up to 3 min) for the 1-minute load average to fall under this before each start")
    ap.add_argument("--first-requests", action="store_true",
                    help="after each warm start, time a short and a long completion, each twice")
    ap.add_argument("extra", nargs="*", help="flags passed to runtime.serve (after --)")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="bench_startup_")
    os.environ[GGUF_CACHE_ENV] = str(Path(cache) / "gguf")  # cold means the GGUF index too
    cold = start_once(cache, True, args.extra, args.max_load)
    print(json.dumps(dict(cold=cold)), flush=True)
    warm = []
    for _ in range(args.rounds):
        for store in (True, False):
            warm.append(start_once(cache, store, args.extra, args.max_load, args.first_requests))
            print(json.dumps(warm[-1]), flush=True)
    on = [w["health_s"] for w in warm if w["store"]]
    off = [w["health_s"] for w in warm if not w["store"]]
    print(json.dumps(dict(cache=cache, cold_health_s=cold["health_s"], warm_store_median_s=statistics.median(on),
                          warm_jax_cache_only_median_s=statistics.median(off),
                          ratio=round(statistics.median(off) / statistics.median(on), 2))))


if __name__ == "__main__":
    main()
