"""`jaxserve bench soak` against a stand-in server whose state the test controls: a healthy one
passes every check; a leaked request, a recompile, a dead /health, a failing request or a
server that slows down each fail their check (exit 1)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from runtime.tools import bench_soak


class FakeServer:
    """Just enough of the OpenAI server for the soak: /v1/models, streaming /v1/completions,
    /metrics and /health, with switches for the faults the soak must catch."""

    def __init__(self, *, leak=False, recompile=False, health=200, fail_every=0, slowdown=False):
        from fastapi import FastAPI
        from fastapi.responses import PlainTextResponse, Response, StreamingResponse

        self.running = self.recompiles = self.requests = 0
        app = FastAPI()

        @app.get("/v1/models")
        def models():
            return {"data": [{"id": "fake", "max_model_len": 512, "vocab_size": 1000}]}

        @app.get("/health")
        def health_():
            return Response(status_code=health)

        @app.get("/metrics")
        def metrics():
            return PlainTextResponse(
                f'vllm:num_requests_running{{model_name="fake"}} {self.running}\n'
                f'vllm:num_requests_waiting{{model_name="fake"}} 0\n'
                f'vllm:kv_cache_usage_perc{{model_name="fake"}} {0.25 if self.running else 0.0}\n'
                f"recompiles_total {self.recompiles}\n")

        @app.post("/v1/completions")
        async def completions(body: dict):
            self.requests += 1
            index = self.requests
            if fail_every and index % fail_every == 0:
                return Response(status_code=500, content="boom")
            self.running += 1
            self.recompiles += recompile
            n = body["max_tokens"]

            async def stream():
                for _ in range(n):
                    await asyncio.sleep(0.01 * index if slowdown else 0)  # later requests: slower
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
                yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n"
                yield "data: [DONE]\n\n"
                if not (leak and index == 1):  # the first request never leaves the running batch
                    self.running -= 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        self.app = app

    def __enter__(self):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _soak(srv, duration_s: float = 0.5, **kw) -> dict[str, bench_soak.Check]:
    lines = []
    rows, checks = bench_soak.soak(srv.url, duration_s=duration_s, rate=40.0, max_tokens=3, interval_s=0.25,
                                   chat=False, idle_timeout_s=1.0, log=lines.append, **kw)
    assert rows and all(line.startswith("| ") for line in lines)
    assert sum(r.sent for r in rows) == srv.requests
    return {c.name: c for c in checks}


def test_a_healthy_server_passes_every_check():
    with FakeServer() as srv:
        checks = _soak(srv)
    assert all(c.ok for c in checks.values()), checks
    assert checks["requests"].detail == f"{srv.requests}/{srv.requests} ok"
    assert srv.requests >= 15  # 40 req/s for 0.5 s


@pytest.mark.parametrize("fault, check", [(dict(leak=True), "idle"), (dict(recompile=True), "recompiles"),
                                          (dict(health=503), "health"), (dict(fail_every=3), "requests"),
                                          (dict(slowdown=True), "latency")])
def test_each_fault_fails_its_check(fault, check):
    with FakeServer(**fault) as srv:
        checks = _soak(srv, duration_s=1.0 if check == "latency" else 0.5)
    assert not checks[check].ok, checks[check]
    assert [name for name, c in checks.items() if not c.ok] == [check]
    if check == "requests":  # the report says what the client saw, not only a count
        assert "; first failure: HTTP 500: boom" in checks[check].detail, checks[check].detail


def test_cli_exit_code_and_report(capsys):
    from runtime.tools import cli

    with FakeServer(recompile=True) as srv:
        rc = cli.main(["bench", "soak", "--url", srv.url, "--duration-min", "0.005", "--rate", "20",
                       "--interval-s", "0.1", "--max-tokens", "2", "--completions-only", "--idle-timeout-s", "1"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  recompiles" in out and "PASS  health" in out and "| 1 |" in out
