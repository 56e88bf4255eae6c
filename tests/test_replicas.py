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

from runtime.front import BALANCE_ABS, Router, Upstream, merge_metrics, prefix_blocks
from runtime.replicas import REPLICA_FLAGS, LogSink, make_private_dir, split_cores, strip_args


def test_replica_command_line_drops_the_launchers_flags_and_the_key():
    argv = ["--model", "m", "--data-parallel-size", "2", "--port=8000", "--host", "0.0.0.0", "--router-policy",
            "round_robin", "--max-num-seqs", "4", "--replica-log-dir=/tmp/x", "--api-key", "sk-1"]
    assert strip_args(argv, REPLICA_FLAGS) == ["--model", "m", "--max-num-seqs", "4"]
    # --replica-log-dir's value is optional; --api-key may be abbreviated as argparse allows
    argv = ["--replica-log-dir", "--model", "m", "--api-k=sk-2", "--replica-log-dir", "/tmp/y", "--api", "sk-3"]
    assert strip_args(argv, REPLICA_FLAGS, {"--model"}) == ["--model", "m"]


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
