"""Soak test of a server: a steady request rate for a while, a row per interval, then checks that
nothing leaked or degraded.

    jaxserve bench soak --duration-min 10 --serve-args "--max-model-len 512"   # starts its own server
    python -m runtime.bench soak --url http://127.0.0.1:8000 --pid 1234 --duration-min 10 --rate 1

Starts one streamed request every 1/--rate seconds (completions and chat in turn) for
--duration-min, against --url (give --pid for the server's RSS and file descriptors) or a
`python -m runtime.serve` it starts with --serve-args. One row per --interval-s (default a minute):
requests sent, ok, failed, end-to-end p50 and p99, and the server's RSS and open file descriptors
(`/proc/PID/status`, `/proc/PID/fd`). Then it waits for the server to go idle and checks:

- no request failed;
- /health still answers 200;
- `recompiles_total` did not move (every step stayed in the bucket table);
- nothing is left running or waiting, and no KV block is still in use (`vllm:kv_cache_usage_perc`
  is 0: nothing leaked);
- the last interval's p99 is within --max-slowdown times the first intervals' (plus
  --latency-slack-ms, so that jitter on millisecond latencies is not a finding);
- RSS grew at most --max-rss-growth-mib and open fds at most --max-fd-growth (with a pid).

PASS/FAIL per check; exit 0 when every check passes, 1 when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

from runtime.entrypoints.args import ArgumentParser
from runtime.tools.bench_serve import _one, _stats_ms, server_info

SOAK_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there", "Water boils at"]
IDLE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakRow:
    """One interval of the soak (requests by start time)."""

    index: int
    sent: int
    ok: int
    failed: int
    p50_ms: float
    p99_ms: float
    rss_mib: float | None  # of the server process, at the end of the interval
    num_fds: int | None
    first_error: str | None = None  # the first failed request's error, as the client saw it


def proc_stats(pid: int) -> tuple[float, int]:
    """(resident set size in MiB, open file descriptors) of a local process, from /proc."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


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


def _payload(i: int, model: str, max_tokens: int, chat: bool) -> tuple[str, dict]:
    """Request i: completions and (with `chat`) chat in turn, streamed (`_one` times the SSE through [DONE])."""
    text = SOAK_PROMPTS[i % len(SOAK_PROMPTS)]
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat and i % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def soak_async(url: str, *, model: str, rate: float, duration_s: float, pid: int | None = None,
                     api_key: str | None = None, max_tokens: int = 16, interval_s: float = 60.0,
                     chat: bool = True, log=print) -> list[SoakRow]:
    """Starts one request every 1/rate seconds for `duration_s`; per interval (by start time): how
    many, failures, end-to-end p50/p99, and the server's RSS and open fds at the interval's end."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    num_rows = max(1, math.ceil(duration_s / interval_s))
    started: list[list[asyncio.Task]] = [[] for _ in range(num_rows)]
    samples: dict[int, tuple[float, int]] = {}

    def row(m: int) -> SoakRow:
        res = [t.result() for t in started[m] if t.done()]
        lat = [r.latency for r in res if r.ok]
        st = _stats_ms(lat)
        rss, fds = samples.get(m, (None, None))
        errors = [r.error for r in res if not r.ok]
        return SoakRow(m + 1, len(started[m]), len(lat), len(errors), st["median"], st["p99"], rss, fds,
                       errors[0] if errors else None)

    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.monotonic()
        i = current = 0
        while True:
            t_next = t0 + i / rate
            if t_next - t0 >= duration_s:
                break
            m = min(int((t_next - t0) // interval_s), num_rows - 1)
            if m > current:  # an interval ended: sample the server, report what has finished
                for done in range(current, m):
                    if pid is not None:
                        samples[done] = proc_stats(pid)
                    log(format_row(row(done), partial=True))
                current = m
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            path, body = _payload(i, model, max_tokens, chat)
            started[m].append(asyncio.create_task(_one(client, url.rstrip("/") + path, body, headers, 0)))
            i += 1
        await asyncio.gather(*[t for ts in started for t in ts])
        if pid is not None:
            samples[current] = proc_stats(pid)
    return [row(m) for m in range(num_rows)]


def format_row(r: SoakRow, partial: bool = False) -> str:
    res = f"{r.rss_mib:.1f}" if r.rss_mib is not None else "-"
    fds = str(r.num_fds) if r.num_fds is not None else "-"
    return (f"| {r.index} | {r.sent} | {r.ok} | {r.failed} | {r.p50_ms:.0f} | {r.p99_ms:.0f} | {res} | {fds} |"
            + ("  (so far)" if partial else ""))


def growth_checks(rows: list[SoakRow], *, max_slowdown: float = 2.0, latency_slack_ms: float = 100.0,
                  max_rss_growth_mib: float = 32.0, max_fd_growth: int = 8) -> list[Check]:
    """Latency, RSS and fd growth from the first interval(s) (warm-up) to the last."""
    first, last = rows[0], rows[-1]
    base = min(r.p99_ms for r in rows[:2])
    checks = [Check("latency", last.p99_ms <= max_slowdown * base + latency_slack_ms,
                    f"p99 first {base:.0f} ms, last {last.p99_ms:.0f} ms "
                    f"(limit {max_slowdown:g}x + {latency_slack_ms:g} ms)")]
    if first.rss_mib is not None and last.rss_mib is not None:
        grew = last.rss_mib - first.rss_mib
        checks.append(Check("rss", grew <= max_rss_growth_mib,
                            f"RSS {first.rss_mib:.1f} -> {last.rss_mib:.1f} MiB (limit +{max_rss_growth_mib:g})"))
    if first.num_fds is not None and last.num_fds is not None:
        checks.append(Check("fds", last.num_fds - first.num_fds <= max_fd_growth,
                            f"open fds {first.num_fds} -> {last.num_fds} (limit +{max_fd_growth})"))
    return checks


def soak(url: str, *, duration_s: float, rate: float, pid: int | None = None, api_key: str | None = None,
         model: str | None = None, max_tokens: int = 16, interval_s: float = 60.0, chat: bool = True,
         max_slowdown: float = 2.0, latency_slack_ms: float = 100.0, max_rss_growth_mib: float = 32.0,
         max_fd_growth: int = 8, idle_timeout_s: float = 60.0, log=print) -> tuple[list[SoakRow], list[Check]]:
    """Runs the load, then the checks (see the module docstring)."""
    model = model or server_info(url, api_key)["id"]
    before = _get(url, "/metrics", api_key).text
    rows = asyncio.run(soak_async(url, model=model, rate=rate, duration_s=duration_s, pid=pid, api_key=api_key,
                                  max_tokens=max_tokens, interval_s=interval_s, chat=chat, log=log))
    idle, after = wait_idle(url, api_key, idle_timeout_s)
    health = _get(url, "/health", api_key).status_code
    recompiles = [metric(t, "recompiles_total") for t in (before, after)]
    left = {m: metric(after, m) for m in IDLE_METRICS}
    sent, failed = sum(r.sent for r in rows), sum(r.failed for r in rows)
    checks = [
        Check("requests", failed == 0 and sent > 0, f"{sent - failed}/{sent} ok" + next(
            (f"; first failure: {r.first_error}" for r in rows if r.first_error), "")),
        Check("health", health == 200, f"/health answered {health}"),
        Check("recompiles", None not in recompiles and recompiles[0] == recompiles[1],
              f"recompiles_total {recompiles[0]} -> {recompiles[1]}"),
        Check("idle", idle and left["vllm:kv_cache_usage_perc"] == 0,
              ", ".join(f"{m.split(':')[-1]} {v}" for m, v in left.items())),
    ]
    return rows, checks + growth_checks(rows, max_slowdown=max_slowdown, latency_slack_ms=latency_slack_ms,
                                        max_rss_growth_mib=max_rss_growth_mib, max_fd_growth=max_fd_growth)


def start_server(serve_args: list[str], log_path: str, timeout_s: float = 600.0):
    """`python -m runtime.serve SERVE_ARGS --port <free>`; returns (process, url) once /health is 200."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log_path, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.serve", *serve_args, "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start within {timeout_s:.0f}s; see {log_path}")
        time.sleep(0.1)  # benchmarks/bench_startup.py times starts with this


def main(argv=None) -> int:
    import shlex
    import signal

    ap = ArgumentParser(prog="python -m runtime.bench soak", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--url", default=None, help="a running server (give --pid for its RSS and fds)")
    src.add_argument("--serve-args", default="", help="start `python -m runtime.serve` with these args "
                     "(quoted, e.g. \"--max-model-len 512 --max-num-seqs 16\"); the default when --url is absent")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's process id")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second, evenly spaced")
    ap.add_argument("--duration-min", type=float, default=10.0)
    ap.add_argument("--interval-s", type=float, default=60.0, help="seconds per row of the report")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--completions-only", action="store_true", help="no chat requests")
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--server-log", default="soak-server.log")
    ap.add_argument("--max-slowdown", type=float, default=2.0,
                    help="fail when the last row's p99 exceeds the first rows' by this factor")
    ap.add_argument("--latency-slack-ms", type=float, default=100.0,
                    help="latency difference that never counts as a slowdown")
    ap.add_argument("--max-rss-growth-mib", type=float, default=32.0)
    ap.add_argument("--max-fd-growth", type=int, default=8)
    ap.add_argument("--idle-timeout-s", type=float, default=60.0, help="how long the server may take to drain")
    ap.add_argument("--json", default=None, help="write the rows and checks here")
    args = ap.parse_args(argv)
    proc = None
    if args.url is None:
        proc, url = start_server(shlex.split(args.serve_args), args.server_log)
        pid = proc.pid
    else:
        url, pid = args.url, args.pid
    try:
        print(f"soak: {args.rate:g} req/s for {args.duration_min:g} min against {url} (server pid {pid})")
        rows, checks = soak(url, duration_s=args.duration_min * 60, rate=args.rate, pid=pid, api_key=args.api_key,
                            model=args.model, max_tokens=args.max_tokens, interval_s=args.interval_s,
                            chat=not args.completions_only, max_slowdown=args.max_slowdown,
                            latency_slack_ms=args.latency_slack_ms, max_rss_growth_mib=args.max_rss_growth_mib,
                            max_fd_growth=args.max_fd_growth, idle_timeout_s=args.idle_timeout_s,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(f"| row ({args.interval_s:g} s) | sent | ok | failed | p50 ms | p99 ms | RSS MiB | open fds |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(format_row(r))
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<11} {c.detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "checks": [asdict(c) for c in checks]}, f, indent=1)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
