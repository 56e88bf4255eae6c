"""Data-parallel replicas behind sglang-router (runtime.replicas): the glue's pieces, and a real
`python -m runtime.serve --data-parallel-size 2` on SmolLM2 (two replica processes, one core
each, and the router): HF's golden tokens through the router, a crashed replica taken out,
restarted and put back while the other serves, and SIGTERM draining all. Every child process
has a deadline and is killed in `finally`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import CACHE_DIR, ROOT, SMOL_ARGS, golden_arrays, golden_prompts

from runtime.replicas import REPLICA_FLAGS, router_command, split_cores, strip_args


def test_replica_command_line_drops_the_launchers_flags():
    argv = ["--model", "m", "--data-parallel-size", "2", "--port=8000", "--host", "0.0.0.0", "--router-policy",
            "round_robin", "--max-num-seqs", "4", "--replica-log-dir=/tmp/x"]
    assert strip_args(argv, REPLICA_FLAGS) == ["--model", "m", "--max-num-seqs", "4"]


def test_cores_split_evenly_and_disjoint():
    cores = sorted(os.sched_getaffinity(0))
    shares = split_cores(len(cores))
    assert [s for s in shares] == [[c] for c in cores]
    assert split_cores(len(cores) + 1) == [None] * (len(cores) + 1)  # fewer cores than replicas: shared


def test_router_is_cache_aware_without_retries():
    cmd = router_command("127.0.0.1", 9000, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "cache_aware")
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware" and "--disable-retries" in cmd
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://127.0.0.1:1",
                                                                                  "http://127.0.0.1:2"]


def test_bad_data_parallel_size_is_one_line():
    r = subprocess.run([sys.executable, "-m", "runtime.serve", "--model", "tiny", "--data-parallel-size", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: --data-parallel-size must be at least 1, got 0"


def _free_port() -> int:
    from runtime.replicas import free_port

    return free_port()


def _replica_urls(log: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"replica (\d+): pid \d+ on (http://\S+?),? ", log)][:2]


@pytest.mark.slow
def test_dp2_golden_tokens_crash_recovery_and_sigterm(tmp_path):
    port = _free_port()
    args = [sys.executable, "-m", "runtime.serve", "--model", "smollm2-135m", "--data-parallel-size", "2",
            "--port", str(port), "--compilation-cache-dir", str(CACHE_DIR), "--replica-log-dir", str(tmp_path),
            "--shutdown-grace-s", "30"]
    for k, v in SMOL_ARGS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=f,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while "serving on" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() - t0 < 900, "the replicas did not start"
            time.sleep(1)
        replicas = _replica_urls(log_path.read_text())
        assert len(replicas) == 2
        with httpx.Client(base_url=url, timeout=120) as c:
            assert c.get("/v1/models").json()["data"][0]["id"] == "smollm2-135m"  # the router asked /model_info
            # HF's golden greedy tokens, through the router (text prompts: it routes on text).
            for p in golden_prompts():
                g = golden_arrays(p["name"])
                r = c.post("/v1/completions", json={"model": "smollm2-135m", "prompt": p["rendered_text"], "max_tokens": 16, "temperature": 0,
                                                    "ignore_eos": True, "return_token_ids": True})
                assert r.status_code == 200, r.text
                ch = r.json()["choices"][0]
                assert ch["prompt_token_ids"] == g["prompt_ids"].tolist()
                assert ch["token_ids"] == g["gen_ids"].tolist()[:16], p["name"]
            # A crash: the stream on the killed replica ends with an error, not a hang; the other
            # replica keeps serving; the launcher restarts the dead one and the router takes it back.
            with c.stream("POST", "/v1/completions", json={"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 300,
                                                          "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                running = [_running(u) for u in replicas]
                victim = replicas[running.index(max(running))]
                pid = int(re.search(rf"pid (\d+) on {re.escape(victim)}", log_path.read_text()).group(1))
                tk = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                rest = []
                try:  # the router cuts the stream off (or ends it with an error): not a hang
                    rest = [line for line in lines if line]
                except httpx.TransportError:
                    pass
            assert time.monotonic() - tk < 30
            assert not any('"finish_reason":"length"' in x.replace(" ", "") for x in rest), rest[-3:]
            time.sleep(2)  # the launcher saw the exit and took the replica out of the router's rotation
            for _ in range(4):  # the survivor answers while the other restarts
                r = c.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4,
                                                    "temperature": 0})
                assert r.status_code == 200, r.text
            t0 = time.monotonic()
            while "back in rotation" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() - t0 < 600, "the replica was not restarted"
                time.sleep(1)
            workers = c.get("/workers").json()["workers"]
            assert sorted(w["url"] for w in workers) == sorted(replicas) and all(w["is_healthy"] for w in workers)
        log = log_path.read_text()
        assert f"exited with status -9: out of rotation, restarting" in log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert "every replica and the router stopped" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for line in log_path.read_text().splitlines():  # nothing it started outlives it
            m = re.search(r"pid (\d+) on", line)
            if m:
                _kill_quietly(int(m.group(1)))


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
