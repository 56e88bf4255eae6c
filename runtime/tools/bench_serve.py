"""Serving benchmark: Poisson arrivals over real HTTP with streaming, like `vllm bench serve`.

    python -m runtime.bench serve --url http://127.0.0.1:8000 --request-rate 4 --num-prompts 64
    python -m runtime.bench serve --url http://127.0.0.1:8000 --sweep 0.5,1,2,4,inf --plot serve.png

Prompts are the offline benchmark's seeded synthetic workload (random token ids, lognormal lengths),
sent as token-id prompts to /v1/completions with `ignore_eos` so every request produces exactly its
drawn number of tokens. Reports request and token throughput, and TTFT, TPOT (time per output token
after the first), ITL and end-to-end latency as mean, median and P99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from runtime.entrypoints.args import ArgumentParser
from runtime.tools.workload import WORKLOADS, make_workload, shared_prefix_workload

SHARED_PREFIX = "shared-prefix"  # text prompts: 8 long system prompts x users (workload.shared_prefix_workload)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class BenchResult:
    request_rate: float
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2e_ms: dict
    errors: list[str] = field(default_factory=list)
    prefix_cache_hit_rate: float | None = None  # prompt tokens found in the prefix caches (--metrics-url)


def _stats_ms(xs) -> dict:
    if not len(xs):
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(xs, dtype=np.float64) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


async def _one(client, url: str, payload: dict, headers: dict, prompt_len: int) -> RequestResult:
    res = RequestResult(ok=False, prompt_len=prompt_len)
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {body[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])
                    return res
                now = time.perf_counter()
                if obj.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if obj.get("usage"):
                    res.output_len = obj["usage"]["completion_tokens"]
                    res.prompt_len = obj["usage"].get("prompt_tokens", res.prompt_len)
        res.latency = time.perf_counter() - t0
        res.ok = res.ttft > 0
        if not res.ok:
            res.error = "no tokens received"
    except Exception as e:  # a benchmark keeps going and reports failures
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_async(url: str, model: str, workload, request_rate: float, *, seed: int = 0,
                    api_key: str | None = None, max_concurrency: int | None = None,
                    temperature: float = 0.0, progress: bool = False) -> BenchResult:
    """Sends `workload` [(prompt ids, max_tokens)] with Poisson arrivals at `request_rate` (inf: all at once)."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = (np.zeros(len(workload)) if math.isinf(request_rate)
            else rng.exponential(1.0 / request_rate, size=len(workload)))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    done = 0

    async def limited(payload, plen):
        nonlocal done
        if sem is None:
            r = await _one(client, endpoint, payload, headers, plen)
        else:
            async with sem:
                r = await _one(client, endpoint, payload, headers, plen)
        done += 1
        if progress:
            print(f"\r{done}/{len(workload)} requests", end="", file=sys.stderr, flush=True)
        return r

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        tasks = []
        t_start = time.perf_counter()
        for (ids, max_tokens), gap in zip(workload, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            payload = {"model": model, "prompt": ids, "max_tokens": int(max_tokens), "temperature": temperature,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(limited(payload, len(ids) if not isinstance(ids, str) else 0)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
    if progress:
        print(file=sys.stderr)
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return BenchResult(
        request_rate=request_rate, num_prompts=len(workload), completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration, total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration, ttft_ms=_stats_ms([r.ttft for r in ok]),
        tpot_ms=_stats_ms(tpot), itl_ms=_stats_ms([x for r in ok for x in r.itl]),
        e2e_ms=_stats_ms([r.latency for r in ok]), errors=sorted({r.error for r in results if not r.ok})[:5])


def server_info(url: str, api_key: str | None = None) -> dict:
    """The first model of /v1/models: id, max_model_len, vocab_size."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]


def format_result(r: BenchResult) -> str:
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "="),
             f"{'Request rate (req/s):':<40}{r.request_rate:>10}",
             f"{'Successful requests:':<40}{r.completed:>10}",
             f"{'Failed requests:':<40}{r.failed:>10}",
             f"{'Benchmark duration (s):':<40}{r.duration_s:>10.2f}",
             f"{'Total input tokens:':<40}{r.total_input_tokens:>10}",
             f"{'Total generated tokens:':<40}{r.total_output_tokens:>10}",
             f"{'Request throughput (req/s):':<40}{r.request_throughput:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{r.output_throughput:>10.2f}",
             f"{'Total Token throughput (tok/s):':<40}{r.total_token_throughput:>10.2f}"]
    for title, key, d in (("Time to First Token", "TTFT", r.ttft_ms),
                          ("Time per Output Token (excl. 1st token)", "TPOT", r.tpot_ms),
                          ("Inter-token Latency", "ITL", r.itl_ms), ("End-to-end Latency", "E2EL", r.e2e_ms)):
        lines.append(f" {title} ".center(w, "-"))
        lines += [f"{f'Mean {key} (ms):':<40}{d['mean']:>10.2f}", f"{f'Median {key} (ms):':<40}{d['median']:>10.2f}",
                  f"{f'P99 {key} (ms):':<40}{d['p99']:>10.2f}"]
    if r.prefix_cache_hit_rate is not None:
        lines.append(f"{'Prefix cache hit rate:':<40}{r.prefix_cache_hit_rate:>10.1%}")
    lines.append("=" * w)
    if r.errors:
        lines.append("errors: " + "; ".join(r.errors))
    return "\n".join(lines)


def format_sweep(results: list[BenchResult], ttft_slo_ms: float = 2000.0) -> str:
    head = (f"{'rate':>6} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT mean':>10} "
            f"{'TPOT p99':>9} {'E2E p50':>9} {'E2E p99':>9} {'failed':>6}")
    rows = [head]
    for r in results:
        rows.append(f"{r.request_rate:>6} {r.request_throughput:>7.2f} {r.output_throughput:>10.1f} "
                    f"{r.ttft_ms['median']:>9.0f} {r.ttft_ms['p99']:>9.0f} {r.tpot_ms['mean']:>10.1f} "
                    f"{r.tpot_ms['p99']:>9.1f} {r.e2e_ms['median']:>9.0f} {r.e2e_ms['p99']:>9.0f} {r.failed:>6}")
    ok = [r for r in results if r.ttft_ms["p99"] < ttft_slo_ms and r.failed == 0]
    if ok:
        best = max(ok, key=lambda r: r.output_throughput)
        rows.append(f"best rate with P99 TTFT < {ttft_slo_ms / 1000:g}s: {best.request_rate} req/s, "
                    f"{best.output_throughput:.1f} output tok/s")
    else:
        rows.append(f"no rate kept P99 TTFT under {ttft_slo_ms / 1000:g}s")
    return "\n".join(rows)


def plot_sweep(results: list[BenchResult], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.output_throughput for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.plot(x, [r.ttft_ms["median"] / 1000 for r in results], "o-", label="TTFT P50")
    a.plot(x, [r.ttft_ms["p99"] / 1000 for r in results], "s--", label="TTFT P99")
    a.axhline(2.0, color="gray", lw=0.8, ls=":", label="2 s")
    a.set_xlabel("output throughput (tok/s)")
    a.set_ylabel("seconds")
    a.set_title("time to first token")
    b.plot(x, [r.tpot_ms["mean"] for r in results], "o-", label="TPOT mean")
    b.plot(x, [r.tpot_ms["p99"] for r in results], "s--", label="TPOT P99")
    b.set_xlabel("output throughput (tok/s)")
    b.set_ylabel("ms per output token")
    b.set_title("time per output token")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    for r, xi in zip(results, x):
        a.annotate(f"{r.request_rate:g}/s", (xi, r.ttft_ms["p99"] / 1000), fontsize=7, xytext=(3, 3),
                   textcoords="offset points")
    fig.suptitle(title or "latency vs throughput (labels: request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rate(s: str) -> float:
    return float("inf") if s.strip().lower() in ("inf", "infinity") else float(s)


def prefix_cache_counts(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the prefix caches of the servers at `urls`, summed, from their /metrics."""
    import httpx

    hits = queries = 0.0
    for u in urls:
        for line in httpx.get(u.rstrip("/") + "/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("vllm:prefix_cache_hits_total"):
                hits += float(value)
            elif name.startswith("vllm:prefix_cache_queries_total"):
                queries += float(value)
    return hits, queries


def run(url: str, *, request_rates: list[float], num_prompts: int, seed: int = 0, workload: str = "mixed",
        api_key: str | None = None, model: str | None = None, max_concurrency: int | None = None,
        max_input_len: int | None = None, max_output_len: int | None = None, temperature: float = 0.0,
        num_warmups: int = 4, progress: bool = False, metrics_urls: list[str] | None = None,
        num_prefixes: int = 8) -> list[BenchResult]:
    """One benchmark per request rate, each on the same seeded workload. `metrics_urls`: servers
    whose prefix-cache counters give each run's hit rate (the replicas behind a router; default:
    `url` itself)."""
    info = server_info(url, api_key)
    model = model or info["id"]
    if workload == SHARED_PREFIX:
        work = shared_prefix_workload(num_prompts, num_prefixes, seed, output_len=max_output_len or 16)
    else:
        work = make_workload(workload, num_prompts, seed, int(info.get("max_model_len") or 2048),
                             int(info.get("vocab_size") or 32000), max_input_len, max_output_len)
    metrics_urls = metrics_urls or [url]
    # Untimed requests first (like `vllm bench serve`'s test prompt): fail fast on a bad URL or model,
    # and keep first-touch costs of the step shapes out of the first rate's numbers.
    if num_warmups > 0:
        warm = [(ids, min(o, 8)) for ids, o in work[:num_warmups]]
        first = asyncio.run(run_async(url, model, warm, float("inf"), api_key=api_key))
        if first.failed:
            raise RuntimeError(f"the warm-up requests failed: {first.errors}")
    out = []
    for rate in request_rates:
        before = _counts_or_none(metrics_urls)
        r = asyncio.run(run_async(url, model, work, rate, seed=seed, api_key=api_key,
                                  max_concurrency=max_concurrency, temperature=temperature, progress=progress))
        after = _counts_or_none(metrics_urls)
        if before is not None and after is not None and after[1] > before[1]:
            r.prefix_cache_hit_rate = (after[0] - before[0]) / (after[1] - before[1])
        out.append(r)
    return out


def _counts_or_none(urls: list[str]):
    try:
        return prefix_cache_counts(urls)
    except Exception:  # a server without our /metrics (a router's own): no hit rate, the rest stands
        return None


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m runtime.bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--request-rate", type=_rate, default=float("inf"),
                    help="mean arrivals per second, Poisson (inf: all at once)")
    ap.add_argument("--sweep", default=None, help="comma list of request rates, e.g. 0.5,1,2,4,inf")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="seeds both the workload and the arrival times")
    ap.add_argument("--workload", default="mixed", choices=sorted([*WORKLOADS, SHARED_PREFIX]),
                    help=f"{SHARED_PREFIX}: text prompts, --num-prefixes long system prompts shared by the rest, "
                         "interleaved (--max-output-len sets every output, default 16)")
    ap.add_argument("--num-prefixes", type=int, default=8, help=f"system prompts of the {SHARED_PREFIX} workload")
    ap.add_argument("--metrics-url", action="append", default=None,
                    help="a server whose /metrics count prefix-cache hits (repeat for each replica behind a "
                         "router; default: --url)")
    ap.add_argument("--max-input-len", type=int, default=None, help="truncate prompts (smoke tests)")
    ap.add_argument("--max-output-len", type=int, default=None, help="cap output lengths (smoke tests)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-warmups", type=int, default=4,
                    help="untimed requests (the workload's first, outputs capped at 8) sent before measuring")
    ap.add_argument("--plot", default=None, help="with --sweep: latency vs throughput PNG")
    ap.add_argument("--result-json", default=None, help="write the results here")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    rates = [_rate(s) for s in args.sweep.split(",")] if args.sweep else [args.request_rate]
    results = run(args.url, request_rates=rates, num_prompts=args.num_prompts, seed=args.seed,
                  workload=args.workload, api_key=args.api_key, model=args.model,
                  max_concurrency=args.max_concurrency, max_input_len=args.max_input_len,
                  max_output_len=args.max_output_len, temperature=args.temperature,
                  num_warmups=args.num_warmups, progress=args.progress, metrics_urls=args.metrics_url,
                  num_prefixes=args.num_prefixes)
    for r in results:
        print(format_result(r))
    if len(results) > 1:
        print(format_sweep(results))
    if args.plot:
        plot_sweep(results, args.plot, f"{args.workload} workload, {args.num_prompts} prompts, {args.url}")
        print(f"plot written to {args.plot}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1, default=str)
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
