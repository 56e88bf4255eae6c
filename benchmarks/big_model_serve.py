"""A server on a user-sized model, as a user meets it: start to /health, peak RSS while loading and
while serving, batch-1 decode, 16 concurrent streams, and the first token of a 512-token prompt,
with one streamed client for any OpenAI-compatible server (ours, or llama.cpp's llama-server on the
same file).

    python -m models.synthetic_gguf --shape llama-3.2-1b --type q4_k_m --out /tmp/llama-1b-q4_k_m.gguf
    python benchmarks/big_model_serve.py --port 8011 -- \\
        .venv/bin/jaxserve serve --model /tmp/llama-1b-q4_k_m.gguf --port 8011 --max-num-seqs 16 --max-model-len 1024
    python benchmarks/big_model_serve.py --port 8012 -- \\
        llama-server -m /tmp/llama-1b-q4_k_m.gguf --port 8012 -np 16 -c 16384 -t 2

Each request is a /v1/completions stream of a text prompt with `ignore_eos`, so every run makes
exactly the tokens asked for; tok/s counts the streamed tokens (usage) over the wall time from the
request to the last event. Medians of `--repeats`. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge each boxing match "
         "near old stone bridges under grey autumn skies").split()


def prompt_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words))


class RssWatch:
    """The peak RSS of a process and its children (sampled every 50 ms, and VmHWM of each)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _pids(self) -> list[int]:
        out = [self.pid]
        try:
            out += [int(p) for p in open(f"/proc/{self.pid}/task/{self.pid}/children").read().split()]
        except OSError:
            pass
        return out

    @staticmethod
    def _kib(pid: int, key: str) -> int:
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith(key):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def sample(self) -> int:
        now = sum(self._kib(p, "VmRSS:") for p in self._pids())
        hwm = max(self._kib(p, "VmHWM:") for p in self._pids())
        self.peak = max(self.peak, now, hwm)
        return self.peak

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self.thread.join()
        return self.sample()


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("choices") and obj["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    return {"ttft": ttft, "seconds": time.perf_counter() - t0, "tokens": tokens}


async def measure(url: str, repeats: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await stream(client, prompt_of(16, 0), 8)  # warm
        single = [await stream(client, prompt_of(16, i), 128) for i in range(repeats)]
        many = []
        for rep in range(repeats):
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(stream(client, prompt_of(16, 100 * rep + i), 64) for i in range(16)))
            many.append({"tok_s": sum(o["tokens"] for o in outs) / (time.perf_counter() - t0),
                         "ttft_p50": statistics.median(o["ttft"] for o in outs)})
        long_prompt = [await stream(client, prompt_of(400, 50 + i), 1) for i in range(repeats)]  # ~512 tokens
    return {"batch1_tok_s": statistics.median(o["tokens"] / o["seconds"] for o in single),
            "streams16_tok_s": statistics.median(m["tok_s"] for m in many),
            "streams16_ttft_p50_s": statistics.median(m["ttft_p50"] for m in many),
            "ttft_512_s": statistics.median(o["ttft"] for o in long_prompt)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=900)
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]
    url = f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    watch = RssWatch(proc.pid)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}):\n{''.join(stderr[-20:])}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > args.start_timeout:
                raise SystemExit("the server did not start in time")
            time.sleep(0.1)
        start_s = time.perf_counter() - t0
        load_peak = watch.sample()
        result = asyncio.run(measure(url, args.repeats))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    serve_peak = watch.stop()
    plan = [line.strip() for line in stderr if line.strip().startswith(("- weights", "= KV cache", "- peak", "total"))]
    print(json.dumps({"command": " ".join(cmd), "cpu": os.uname().machine, "start_to_health_s": round(start_s, 1),
                      "peak_rss_loading_mib": round(load_peak / 1024), "peak_rss_mib": round(serve_peak / 1024),
                      **{k: round(v, 3) for k, v in result.items()}, "plan": plan}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
