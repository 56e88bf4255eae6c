"""Data-parallel replicas behind the front (runtime.distributed.replicas, runtime.distributed.front): the glue's pieces, the
routing, the front answering as the server does, and a real
`python -m runtime.serve --data-parallel-size 2` on SmolLM2 (two replica processes, one core
each): HF's golden tokens through the front, a crashed replica's queued requests retried on the
other, the replica restarted and put back, and SIGTERM draining all. Every child process has a
deadline and is killed in `finally`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import CACHE_DIR, ROOT, SMOL_ARGS, golden_arrays, golden_prompts

from runtime.distributed.front import BALANCE_ABS, Router, Upstream, merge_metrics, prefix_blocks
from runtime.distributed.replicas import (REPLICA_FLAGS, LogSink, cpu_memory_share, make_private_dir, split_cores,
                                          strip_args)


def test_replica_command_line_drops_the_launchers_flags_and_the_key():
    argv = ["--model", "m", "--data-parallel-size", "2", "--port=8000", "--host", "0.0.0.0", "--router-policy",
            "round_robin", "--max-num-seqs", "4", "--replica-log-dir=/tmp/x", "--api-key", "sk-1"]
    assert strip_args(argv, REPLICA_FLAGS) == ["--model", "m", "--max-num-seqs", "4"]
    # --replica-log-dir's value is optional; --api-key may be abbreviated as argparse allows
    argv = ["--replica-log-dir", "--model", "m", "--api-k=sk-2", "--replica-log-dir", "/tmp/y", "--api", "sk-3"]
    assert strip_args(argv, REPLICA_FLAGS, {"--model"}) == ["--model", "m"]


def test_cpu_replicas_share_the_hosts_memory(monkeypatch):
    """Replicas start at once: each would plan for all the host has available, so each gets its
    share (per device of its tp), unless --device-memory was given; GPU replicas measure their own."""
    import config.host_memory as host_memory
    from config.flags import parse_memory

    monkeypatch.setattr(host_memory, "read_host_memory", lambda: 12 << 30)
    cpu = {"JAX_PLATFORMS": "cpu"}
    flag, size = cpu_memory_share(2, 1, None, cpu)
    assert flag == "--device-memory" and parse_memory(size) == 6 << 30
    assert parse_memory(cpu_memory_share(2, 3, None, cpu)[1]) == 2 << 30
    assert cpu_memory_share(2, 1, 4 << 30, cpu) == []
    assert cpu_memory_share(2, 1, None, {"CUDA_VISIBLE_DEVICES": "0,1"}) == []
    monkeypatch.setattr(host_memory, "read_host_memory", lambda: None)
    assert cpu_memory_share(2, 1, None, cpu) == []


def test_cores_split_evenly_and_disjoint():
    cores = sorted(os.sched_getaffinity(0))
    shares = split_cores(len(cores))
    assert [s for s in shares] == [[c] for c in cores]
    assert split_cores(len(cores) + 1) == [None] * (len(cores) + 1)  # fewer cores than replicas: shared


R0, R1 = Upstream(0, "http://127.0.0.1:1"), Upstream(1, "http://127.0.0.1:2")


def test_cache_aware_routing_follows_the_prefix_within_a_load_balance():
    router = Router("cache_aware")
    system_a, system_b = "You are a pirate. " * 20, "You answer in French. " * 20
    a = prefix_blocks("/v1/completions", {"prompt": system_a + "Where is the gold?"})
    b = prefix_blocks("/v1/completions", {"prompt": system_b + "Quelle heure est-il ?"})
    first_a = router.choose([R0, R1], a)
    router.load[first_a.index] += 1  # in flight: the next new prefix goes to the other replica
    first_b = router.choose([R0, R1], b)
    assert first_b != first_a
    for question in ("What ship?", "Which island?", "How many men?"):  # each user of a system prompt: its replica
        assert router.choose([R0, R1], prefix_blocks("/v1/completions", {"prompt": system_a + question})) == first_a
        assert router.choose([R0, R1], prefix_blocks("/v1/completions", {"prompt": [system_b + question]})) == first_b
    router.load[first_a.index] += BALANCE_ABS + 1  # too far ahead: passed over whatever it holds
    assert router.choose([R0, R1], a) == first_b
    router.load[first_a.index] = 0
    router.forget(first_a.index)  # restarted: it holds nothing, and the prefix went to the other one
    assert router.matched(first_a.index, a) == 0 and router.choose([R0, R1], a) == first_b
    assert router.choose([first_a], a) == first_a  # the only live one


def test_prefix_blocks_of_chats_and_token_ids():
    chat = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Hi"}]
    turn2 = chat + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    one, two = prefix_blocks("/v1/chat/completions", {"messages": chat}), prefix_blocks("/v1/chat/completions",
                                                                                         {"messages": turn2})
    assert len(one) >= 3 and two[:len(one) - 1] == one[:-1]  # the next turn extends the conversation's blocks
    ids = list(range(100))
    assert prefix_blocks("/v1/completions", {"prompt": ids}) == prefix_blocks("/v1/completions", {"prompt": [ids]})
    assert len(prefix_blocks("/v1/completions", {"prompt": ids})) == 100 // 16
    assert prefix_blocks("/v1/completions", {"prompt": [ids, ids]}) == []  # a batch: no one prefix
    assert prefix_blocks("/v1/completions", {"prompt": 3}) == [] and prefix_blocks("/v1/completions", [1]) == []


def test_round_robin_alternates():
    router = Router("round_robin")
    assert [router.choose([R0, R1], []).index for _ in range(4)] in ([1, 0, 1, 0], [0, 1, 0, 1])


def test_metrics_of_replicas_merge_with_an_engine_label():
    a = ('# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n'
         'vllm:num_requests_running{model_name="m"} 2.0\n# HELP up_total Up.\n# TYPE up_total counter\nup_total 1.0\n')
    b = a.replace("2.0", "3.0").replace("up_total 1.0", "up_total 5.0")
    merged = merge_metrics([(0, a), (1, b)])
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(merged)}
    running = {s.labels["engine"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"0": 2.0, "1": 3.0}
    assert all(s.labels["model_name"] == "m" for s in families["vllm:num_requests_running"].samples)
    assert {s.labels["engine"]: s.value for s in families["up"].samples} == {"0": 1.0, "1": 5.0}
    assert merged.count("# HELP vllm:num_requests_running") == 1 and merged.count("# TYPE up_total") == 1


def test_replica_output_goes_to_stderr_prefixed_or_to_a_private_file(tmp_path, capfd):
    code = "import sys; print('hello'); print('oops', file=sys.stderr)"
    proc = LogSink("replica 3", None).popen([sys.executable, "-c", code])
    proc.wait(30)
    time.sleep(0.2)  # the pump thread writes the last line
    err = capfd.readouterr().err
    assert "replica 3 | hello" in err and "replica 3 | oops" in err
    d = make_private_dir(tmp_path / "state" / "jaxserve" / "replicas-8000")
    assert (d.stat().st_mode & 0o777) == 0o700
    sink = LogSink("replica 0", d)
    sink.popen([sys.executable, "-c", code]).wait(30)
    assert sink.path.read_text().split() == ["hello", "oops"] and (sink.path.stat().st_mode & 0o777) == 0o600


def test_bad_data_parallel_size_is_one_line():
    r = subprocess.run([sys.executable, "-m", "runtime.serve", "--model", "tiny", "--data-parallel-size", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: --data-parallel-size must be at least 1, got 0"


def _free_port() -> int:
    from runtime.distributed.replicas import free_port

    return free_port()


def _replica_urls(log: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"replica (\d+): pid \d+ on (http://\S+?),? ", log)][:2]


def _cmdlines() -> list[str]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out.append(open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode("utf-8", "replace"))
            except OSError:
                pass
    return out


@pytest.mark.slow
def test_dp2_front_golden_tokens_retries_crash_recovery_and_sigterm(tmp_path):
    """`serve --data-parallel-size 2` on SmolLM2 with the key in JAXSERVE_API_KEY, run from an empty
    directory: HF's golden tokens through the front; no process shows the key; no file appears in
    the working directory; a replica killed with requests queued on it: they succeed on the other
    replica, and the stream it had begun ends with an error event and [DONE]; the replica comes
    back; SIGTERM drains all."""
    port = _free_port()
    key = "sk-dp2-secret-4242"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = [sys.executable, "-m", "runtime.serve", "--model", "smollm2-135m", "--data-parallel-size", "2",
            "--port", str(port), "--compilation-cache-dir", str(CACHE_DIR), "--shutdown-grace-s", "30"]
    for k, v in SMOL_ARGS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    log_path = tmp_path / "launcher.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXSERVE_API_KEY": key, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as f:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    try:
        t0 = time.monotonic()
        while "serving on" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() - t0 < 900, "the replicas did not start"
            time.sleep(1)
        replicas = _replica_urls(log_path.read_text())
        assert len(replicas) == 2
        assert not [c for c in _cmdlines() if key in c]  # the key is in no process's command line
        assert "replica 0 | " in log_path.read_text() and "replica 1 | " in log_path.read_text()
        with httpx.Client(base_url=url, timeout=120, headers=auth) as c:
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            card = c.get("/v1/models").json()["data"][0]
            assert card["id"] == "smollm2-135m" and card["max_model_len"] == SMOL_ARGS["max_model_len"]
            for p in golden_prompts():  # HF's golden greedy tokens, as text and as token ids
                g = golden_arrays(p["name"])
                for prompt in (p["rendered_text"], g["prompt_ids"].tolist()):
                    r = c.post("/v1/completions", json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 16,
                                                        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                    assert r.status_code == 200, r.text
                    ch = r.json()["choices"][0]
                    assert ch["prompt_token_ids"] == g["prompt_ids"].tolist()
                    assert ch["token_ids"] == g["gen_ids"].tolist()[:16], p["name"]
            metrics = c.get("/metrics").text
            assert 'engine="0"' in metrics and 'engine="1"' in metrics

            # A crash with requests queued: a stream that has begun, then 12 requests with its prefix
            # (cache-aware: the same replica, 16 batch slots: some run, the rest wait).
            prefix = "Tell me a long story about the sea, the ships, the sailors and the storms. " * 4
            body = {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            results: list = []
            with c.stream("POST", "/v1/completions", json={**body, "prompt": prefix + "Begin.", "max_tokens": 400,
                                                           "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                running = [_running(u) for u in replicas]
                victim = replicas[running.index(max(running))]

                def one(i):
                    try:
                        results.append(httpx.post(url + "/v1/completions", headers=auth, timeout=300,
                                                  json={**body, "prompt": prefix + f"Chapter {i}."}))
                    except httpx.HTTPError as e:
                        results.append(e)

                threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
                for t in threads:
                    t.start()
                t1 = time.monotonic()
                while _running(victim, "vllm:num_requests_waiting") + _running(victim) < 8:
                    assert time.monotonic() - t1 < 60, "the requests did not reach the stream's replica"
                    time.sleep(0.05)
                pid = int(re.search(rf"pid (\d+) on {re.escape(victim)}", log_path.read_text()).group(1))
                tk = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                rest = [line for line in lines if line]
            assert time.monotonic() - tk < 30
            assert rest[-1] == "data: [DONE]" and '"replica_failed"' in rest[-2], rest[-3:]
            for t in threads:
                t.join(300)
            assert len(results) == 12
            for r in results:  # each sent once more, to the live replica
                assert isinstance(r, httpx.Response) and r.status_code == 200, r
                assert r.json()["usage"]["completion_tokens"] == 12
            assert "sending it once more" in log_path.read_text()
            t0 = time.monotonic()
            while "back in rotation" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() - t0 < 600, "the replica was not restarted"
                time.sleep(1)
            assert c.get("/health").status_code == 200
        log = log_path.read_text()
        assert "exited with status -9: out of rotation, restarting" in log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert "every replica and the front stopped" in log_path.read_text()
        assert list(cwd.iterdir()) == []  # no log or other file in the working directory
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for line in log_path.read_text().splitlines():  # nothing it started outlives it
            m = re.search(r"pid (\d+) on", line)
            if m:
                _kill_quietly(int(m.group(1)))


def _running(url: str, name: str = "vllm:num_requests_running") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


KEY = "sk-front-1"
MODEL = "smollm2-135m"


def _cases() -> list[tuple[str, str, object, dict]]:
    """(method, path, JSON body or raw bytes, extra headers): shapes a single server answers."""
    chat = [{"role": "user", "content": "What is 2+2?"}]
    return [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 504, 3458], "max_tokens": 3, "temperature": 0}, {}),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [[1, 504], [3458, 314]], "max_tokens": 2,
                                     "temperature": 0}, {}),
        ("POST", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}, {}),
        ("POST", "/v1/chat/completions", {"messages": chat, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                                          "structured_outputs": {"regex": "[0-9]+"}, "prompt_logprobs": 1}, {}),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, {}),
        ("POST", "/v1/completions", b'{"model": "x", "prompt": "hi",', {}),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, {}),
        ("POST", "/v1/completions", {"model": "another-model", "prompt": "hi"}, {}),
        ("POST", "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "text/plain"}),
        ("POST", "/tokenize", {"prompt": "hello world"}, {}),
        ("POST", "/detokenize", {"tokens": [1, 504, 3458]}, {}),
        ("GET", "/version", None, {}),
        ("GET", "/v1/models", None, {}),
        ("GET", "/openapi.json", None, {}),
        ("GET", "/no-such-path", None, {}),
        ("DELETE", "/v1/models", None, {}),
        ("GET", "/v1/models", None, {"Authorization": "Bearer wrong"}),
        ("POST", "/tokenize", {"prompt": "hi"}, {"Authorization": ""}),
        ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}, {"Authorization": f"Basic {KEY}"}),
    ]


def _answer(c: httpx.Client, method: str, path: str, body, headers: dict):
    h = {"Authorization": f"Bearer {KEY}", **headers}
    h = {k: v for k, v in h.items() if v}
    if isinstance(body, bytes):
        r = c.request(method, path, content=body, headers={"Content-Type": "application/json", **h})
    else:
        r = c.request(method, path, json=body, headers=h)
    try:
        got = r.json()
    except ValueError:
        got = r.text
    if isinstance(got, dict):  # this request's own id and time
        got = {k: v for k, v in got.items() if k not in ("id", "created")}
    return r.status_code, r.headers.get("content-type"), r.headers.get("www-authenticate"), got


def test_the_front_answers_every_request_as_the_server_does(smol_llm):
    """The same server alone and behind the front, both with --api-key: the same status, headers
    that matter and body for token-id prompts, a missing model, bad bodies, every endpoint, and
    requests without the key; /health and /metrics need no key on either."""
    from conftest import front_over

    from runtime.serve import ServerThread, build_app

    app = build_app(smol_llm.engine, served_model_names=MODEL, api_key=KEY, log_stats_interval=0)
    with ServerThread(app) as st, front_over([st.url], [MODEL], api_key=KEY) as front_url, \
            httpx.Client(base_url=st.url, timeout=120) as alone, httpx.Client(base_url=front_url, timeout=120) as front:
        for method, path, body, headers in _cases():
            want = _answer(alone, method, path, body, headers)
            assert _answer(front, method, path, body, headers) == want, (method, path, body, headers)
        assert front.get("/health").status_code == 200
        assert front.get("/metrics").status_code == 200 and 'engine="0"' in front.get("/metrics").text
        import openai

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=front_url + "/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=front_url + "/v1", api_key=KEY, max_retries=0)
        assert good.models.list().data[0].id == MODEL
        tokens = good.completions.create(model=MODEL, prompt=[1, 504, 3458], max_tokens=3, temperature=0)
        assert tokens.choices[0].text
    assert not smol_llm.engine.has_unfinished_requests()
