"""One engine across several processes (runtime.distributed): the wire format, the control
channel's start-up checks and watchdog over real sockets, and real pairs of `python -m
runtime.serve` / `LLM(...)` processes at tp=2 on loopback (gloo joins them), against tp=1.

Each process pair compiles the tiny model's buckets on its own (JAX writes its persistent
cache from rank 0 only, and on CPU rank 1's cache key differs): a minute or more on a busy
2-core machine, so the pairs are `slow`. Every child process has a deadline and is killed in
`finally`; no test waits on a child without one.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import numpy as np
import pytest

from conftest import ROOT

from runtime.distributed.multiprocess import (SECRET_ENV, DistributedConfig, Follower, Leader, RankFailure, _mismatch,
                                 free_port_pair, load_secret)
from runtime.distributed.wire import Decoder, Encoder, encode, recv_frame
from runtime.errors import UserError

TINY = ["--model", "tiny", "--tensor-parallel-size", "2", "--max-model-len", "64", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "16"]
TINY_ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
START_S = 420  # a pair's start: rank 1 compiles every bucket
# The longest pairs (SmolLM2 at tp=2: 5.5 min on a loaded 2-core box; a second tiny pair for the
# hung rank, whose watchdog the in-process tests cover over real sockets) run only when asked:
# CI's 90 minutes are nearly spent by the rest of the suite.
long_test = pytest.mark.skipif(os.environ.get("JAXSERVE_LONG_TESTS") != "1",
                               reason="JAXSERVE_LONG_TESTS=1 runs it (minutes of compiling)")


@pytest.fixture(autouse=True)
def _state_dir(tmp_path_factory, monkeypatch):
    """The ranks of a test (threads or child processes) share the default secret file, made under a
    temporary state dir, not the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.getbasetemp() / "state"))
    monkeypatch.delenv(SECRET_ENV, raising=False)


# ====================================================================== wire format and settings


def _roundtrip(enc: Encoder, dec: Decoder, **fields):
    frame = enc.frame("call", **fields)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        return recv_frame(b, dec), len(frame)


def test_frames_round_trip_and_constants_go_once():
    import jax

    constant = np.full((4, 8), -1, np.int32)
    constant.flags.writeable = False
    on_device = jax.device_put(np.arange(6, dtype=np.int32))
    fields = dict(bucket=(16, 4), inputs={"tokens": np.arange(16, dtype=np.int32), "mask": np.ones((2, 3), bool),
                                          "scalar": np.float32(2.5), "empty": np.zeros((0, 3))},
                  sampling={"history": constant, "bitmask": on_device}, copies=[(1, 2), (3, 4)], none=None)
    enc, dec = Encoder(refs=True), Decoder()
    (kind, first), n_first = _roundtrip(enc, dec, **fields)
    (_, second), n_second = _roundtrip(enc, dec, **fields)
    assert kind == "call"
    for got in (first, second):
        assert got["bucket"] == (16, 4) and got["copies"] == [(1, 2), (3, 4)] and got["none"] is None
        for k, v in fields["inputs"].items():
            assert got["inputs"][k].dtype == np.asarray(v).dtype
            np.testing.assert_array_equal(got["inputs"][k], v)
        assert got["inputs"]["scalar"].shape == ()
        np.testing.assert_array_equal(got["sampling"]["history"], constant)
        assert isinstance(got["sampling"]["bitmask"], jax.Array)  # back on the device
        np.testing.assert_array_equal(np.asarray(got["sampling"]["bitmask"]), np.arange(6))
    assert second["sampling"]["history"] is first["sampling"]["history"]
    assert n_second < n_first - constant.nbytes - 6 * 4 + 64  # the constants' bytes went once
    with pytest.raises(TypeError, match="cannot send a object"):
        Encoder().frame("call", x=object())


@pytest.mark.parametrize("kw, message", [
    (dict(nnodes=0), "--nnodes must be a positive integer"),
    (dict(nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1234"), r"--node-rank must be in \[0, 2\)"),
    (dict(nnodes=2, node_rank=1), "--nnodes > 1 needs --dist-init-addr HOST:PORT"),
    (dict(nnodes=2, dist_init_addr="127.0.0.1"), "--dist-init-addr must be HOST:PORT"),
    (dict(nnodes=2, dist_init_addr="127.0.0.1:65535"), "PORT in \\[1, 65534\\]"),
    (dict(nnodes=2, dist_init_addr="h:1", timeout_s=0), "--dist-timeout-s must be positive"),
    (dict(nnodes=2, dist_init_addr="h:1", secret=" "), "--dist-secret is empty"),
    (dict(nnodes=2, dist_init_addr="h:1", bind_host=""), "--dist-bind-host is empty"),
])
def test_bad_settings_are_one_line(kw, message):
    with pytest.raises(UserError, match=message):
        DistributedConfig(**kw)


def test_llm_keywords_and_the_secret_stay_out_of_the_repr():
    kw = dict(nnodes=2, node_rank=1, dist_init_addr="h:1", dist_secret="s3cret", dist_bind_host="0.0.0.0",
              max_num_seqs=2)
    cfg = DistributedConfig.pop_from(kw)
    assert kw == {"max_num_seqs": 2} and (cfg.secret, cfg.bind_host) == ("s3cret", "0.0.0.0")
    assert "s3cret" not in repr(cfg)


def test_mismatch_names_both_ranks_and_the_differing_flags():
    ours = {"model": "tiny", "name": "tiny", "program": "aaaa", "weights": "bbbb",
            "engine": {"max_num_seqs": 2, "tensor_parallel_size": 2}}
    assert _mismatch(1, dict(ours), ours) is None
    theirs = dict(ours, model="plans/other", program="cccc", engine={"max_num_seqs": 4, "tensor_parallel_size": 2})
    why = _mismatch(1, theirs, ours)
    assert "rank 1 was started with 'plans/other' (tiny, tp=2, plan cccc" in why
    assert "rank 0 with 'tiny' (tiny, tp=2, plan aaaa" in why
    assert "max_num_seqs: 4 here, 2 on rank 0" in why


# ====================================================================== the control channel, in-process


class _StubRunner:
    """A follower's runner that records what it ran (and may stall); the channel around it is real."""

    num_blocks = 7

    def __init__(self, stall_s: float = 0.0):
        self.calls, self.stall_s = [], stall_s

    def execute(self, bucket, inputs, sampling=None):
        time.sleep(self.stall_s)
        self.calls.append((bucket, {k: v.copy() for k, v in inputs.items()}))


def _channel(timeout_s: float = 30.0):
    """A Leader and a Follower of one 2-rank group joined over a real loopback socket (no jax.distributed)."""
    cfg = DistributedConfig(2, 0, f"127.0.0.1:{free_port_pair()}", timeout_s)
    leader = Leader(cfg)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("f", Follower(DistributedConfig(2, 1, cfg.dist_init_addr))))
    t.start()
    leader.accept(timeout=20)
    t.join(20)
    return leader, box["f"]


IDENTITY = {"model": "tiny", "name": "tiny", "program": "p1", "weights": "w1", "engine": {"max_num_seqs": 2}}


def _start(leader, follower, runner):
    """Both sides of the start-up exchange; the follower then serves `runner` on a thread."""
    errors = []

    def follow():
        try:
            follower.introduce(IDENTITY)
            follower.ready(runner)
            follower.serve(runner)
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    leader.check_peers(IDENTITY)

    class LeaderRunner:
        num_blocks = runner.num_blocks
        mirror = None

    lr = LeaderRunner()
    leader.start(lr)
    return t, errors, lr


def test_calls_reach_the_follower_in_order_and_stop_ends_it():
    leader, follower = _channel()
    runner = _StubRunner()
    t, errors, lr = _start(leader, follower, runner)
    assert lr.mirror is leader
    for i in range(3):
        leader.call("execute", ((8, 2), {"tokens": np.full(8, i, np.int32)}), {})
    assert leader.stop(timeout=10)
    t.join(10)
    assert not errors and not t.is_alive()
    assert [b for b, _ in runner.calls] == [(8, 2)] * 3
    assert [int(x["tokens"][0]) for _, x in runner.calls] == [0, 1, 2]
    assert leader.fault is None


def test_a_follower_with_another_plan_is_refused_naming_both():
    leader, follower = _channel()
    got = []
    t = threading.Thread(target=lambda: got.append(_catch(lambda: follower.introduce(
        dict(IDENTITY, model="plans/x", program="p2", engine={"max_num_seqs": 4})))))
    t.start()
    with pytest.raises(UserError, match=r"rank 1 was started with 'plans/x' .* rank 0 with 'tiny'"):
        leader.check_peers(IDENTITY)
    t.join(10)
    assert isinstance(got[0], UserError) and "max_num_seqs: 4 here, 2 on rank 0" in str(got[0])


def test_a_follower_that_fails_to_start_is_reported():
    leader, follower = _channel()
    follower.fail(FileNotFoundError("no such model: nope.gguf"))
    with pytest.raises(UserError, match="rank 1 could not start: FileNotFoundError: no such model: nope.gguf"):
        leader.check_peers(IDENTITY)


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


def test_watchdog_faults_on_a_hung_follower():
    leader, follower = _channel(timeout_s=1.0)
    faults = []
    leader.on_fault = faults.append
    t, errors, _ = _start(leader, follower, _StubRunner(stall_s=4.0))
    t0 = time.monotonic()
    leader.call("execute", ((8, 2), {"tokens": np.zeros(8, np.int32)}), {})
    while not faults and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert faults and "rank 1 has not finished call 1 (execute) in 1 s: it is hung" in faults[0]
    assert 0.9 < time.monotonic() - t0 < 5
    with pytest.raises(RankFailure, match="hung"):  # the engine's next call fails at once
        leader.call("execute", ((8, 2), {"tokens": np.zeros(8, np.int32)}), {})
    follower.sock.close()


def test_watchdog_faults_when_a_follower_goes_away():
    leader, follower = _channel()
    faults = []
    leader.on_fault = faults.append
    t, errors, _ = _start(leader, follower, _StubRunner())
    follower.sock.shutdown(socket.SHUT_RDWR)  # what the kernel does for a killed process
    t0 = time.monotonic()
    while not faults and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert faults == ["rank 1 exited: its control connection closed"]


# ====================================================================== who may join, and where rank 0 listens


def test_the_secret_comes_from_the_flag_the_environment_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    cfg = DistributedConfig(2, 0, "127.0.0.1:1234")
    secret, source = load_secret(cfg)
    path = tmp_path / "jaxserve" / "dist-secret"
    assert source == str(path) and re.fullmatch(rb"[0-9a-f]{64}", secret)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert load_secret(cfg) == (secret, source)  # made once, then read
    monkeypatch.setenv(SECRET_ENV, " from-env ")
    assert load_secret(cfg) == (b"from-env", "$JAXSERVE_DIST_SECRET")
    assert load_secret(DistributedConfig(2, 0, "127.0.0.1:1234", secret="flag")) == (b"flag", "--dist-secret")
    monkeypatch.setenv(SECRET_ENV, "")
    with pytest.raises(UserError, match=r"\$JAXSERVE_DIST_SECRET is set but empty"):
        load_secret(cfg)
    monkeypatch.delenv(SECRET_ENV)
    path.chmod(0o644)
    with pytest.raises(UserError, match=r"must be this user's and private \(mode 600\), it is mode 644"):
        load_secret(cfg)


def _accept_in_thread(leader: Leader, **kw):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("error", _catch(lambda: leader.accept(**kw))), daemon=True)
    t.start()
    return t, box


def _read_to_eof(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """What `sock` received until rank 0 closed it (a socket.timeout if it never does)."""
    sock.settimeout(timeout)
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    return got


@pytest.mark.parametrize("how", ["silent", "garbage", "huge frame", "unproved hello", "forged proof"])
def test_a_stranger_that_connects_first_is_refused_and_the_real_rank_joins(how, caplog):
    """Finding 8: whoever reached the control port first and said {"rank": 1} took rank 1's place,
    and one that said nothing held the start. Now each is refused and logged with its address, a
    silent one does not delay the real rank (10 s to say hello), and the start completes."""
    caplog.set_level(logging.INFO, logger="runtime.distributed")
    cfg = DistributedConfig(2, 0, f"127.0.0.1:{free_port_pair()}")
    leader = Leader(cfg)
    t, box = _accept_in_thread(leader, timeout=20)
    stranger = socket.create_connection(cfg.control_address, timeout=5)
    where = "%s:%d" % stranger.getsockname()
    with stranger:
        if how == "garbage":
            stranger.sendall(b"\x00\x00\x00\x05\x00\x00\x00\x00GET / HTTP/1.1\r\n\r\n")
        elif how == "huge frame":  # a frame header that says 4 GiB: refused before anything is allocated
            stranger.sendall(b"\xff" * 8)
        elif how == "unproved hello":  # what the finding's stranger sent (and a rank sent, before proofs)
            stranger.sendall(encode("hello", rank=1))
        elif how == "forged proof":
            kind, challenge = recv_frame(stranger)
            assert kind == "challenge" and len(challenge["nonce"]) == 64
            stranger.sendall(encode("hello", rank=1, nonce="ab" * 32, proof="cd" * 32))
            kind, f = recv_frame(stranger)
            assert kind == "refuse" and "does not match rank 0's secret" in f["message"]
        if how != "silent":
            _read_to_eof(stranger)  # refused: closed
        t0 = time.monotonic()
        follower = Follower(DistributedConfig(2, 1, cfg.dist_init_addr))
        t.join(10)
        assert box["error"] is None and time.monotonic() - t0 < 5
        assert leader.peers[1].getpeername() == follower.sock.getsockname()  # rank 1 is the real one
        if how == "silent":  # still waiting when rank 1 joined; closed once the start went on
            _read_to_eof(stranger)
    why = {"silent": "still in its handshake: the start went on without it",
           "garbage": "bytes that are not a hello", "huge frame": "bytes that are not a hello",
           "unproved hello": "not a hello with a rank, a nonce and a proof",
           "forged proof": "it says it is rank 1, but its proof does not match rank 0's secret"}[how]
    assert re.search(f"control connection from {where}.*{re.escape(why)}", caplog.text), caplog.text
    assert [r.startswith(f"{where}: ") for r in leader.refused] == ([] if how == "silent" else [True])
    runner = _StubRunner()
    ft, errors, _ = _start(leader, follower, runner)
    leader.call("execute", ((8, 2), {"tokens": np.zeros(8, np.int32)}), {})
    assert leader.stop(timeout=10)
    ft.join(10)
    assert not errors and len(runner.calls) == 1


def test_a_connection_silent_past_the_hello_deadline_is_closed(caplog):
    caplog.set_level(logging.INFO, logger="runtime.distributed")
    cfg = DistributedConfig(2, 0, f"127.0.0.1:{free_port_pair()}")
    leader = Leader(cfg)
    t, box = _accept_in_thread(leader, timeout=20, hello_timeout=0.5)
    with socket.create_connection(cfg.control_address, timeout=5) as stranger:
        t0 = time.monotonic()
        assert recv_frame(stranger)[0] == "challenge"
        assert _read_to_eof(stranger) == b""
        assert 0.3 < time.monotonic() - t0 < 3
        where = "%s:%d" % stranger.getsockname()
    assert f"refused a control connection from {where}: no hello within 0.5 s of connecting" in caplog.text
    time.sleep(1.0)  # a rank that comes after rank 0 waited longer than a hello may take has its own 0.5 s
    follower = Follower(DistributedConfig(2, 1, cfg.dist_init_addr))
    t.join(10)
    assert box["error"] is None and set(leader.peers) == {1}
    follower.sock.close()


def test_a_rank_with_another_secret_is_refused_saying_so_on_both_sides(tmp_path, monkeypatch):
    """Two machines, each with its own default secret file (nobody gave one): rank 1 is told that
    the secrets differ and where each came from; rank 0's start fails naming who it refused and why."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "host0"))
    cfg = DistributedConfig(2, 0, f"127.0.0.1:{free_port_pair()}")
    leader = Leader(cfg)
    t, box = _accept_in_thread(leader, timeout=3)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "host1"))
    with pytest.raises(UserError) as e:
        Follower(DistributedConfig(2, 1, cfg.dist_init_addr))
    message = str(e.value)
    assert f"rank 0 ({cfg.dist_init_addr.rsplit(':', 1)[0]}:{cfg.control_address[1]}) refused rank 1: its answer " \
           "to the challenge does not match rank 0's secret" in message
    assert "every rank must be given the same secret ($JAXSERVE_DIST_SECRET, or --dist-secret)" in message
    assert "rank 0's came from its default file (made on first use, one per machine" in message
    assert f"this rank's came from {tmp_path / 'host1' / 'jaxserve' / 'dist-secret'}" in message
    t.join(10)
    assert isinstance(box["error"], RankFailure)
    assert re.fullmatch(r"rank 1 did not join rank 0's control channel \(127\.0\.0\.1:\d+\) within 3 s; rank 0 "
                        r"refused 1 connection\(s\): 127\.0\.0\.1:\d+: it says it is rank 1, but its proof does "
                        r"not match rank 0's secret: a stranger, or a rank given another secret", str(box["error"]))


def test_a_follower_refuses_a_rank0_that_cannot_prove_the_secret():
    port = free_port_pair()
    heard = []

    def impostor():
        with socket.create_server(("127.0.0.1", port + 1)) as srv:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(encode("challenge", nonce="11" * 32))
                heard.append(recv_frame(conn))
                conn.sendall(encode("welcome", proof="00" * 32))
                conn.recv(1)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with pytest.raises(UserError, match="answered as rank 0 but did not prove that it knows this launch's secret"):
        Follower(DistributedConfig(2, 1, f"127.0.0.1:{port}"), timeout=10)
    t.join(5)
    kind, hello = heard[0]
    assert kind == "hello" and hello["rank"] == 1 and len(hello["proof"]) == 64  # the proof, never the secret


def _listening(port: int) -> list[str]:
    """The addresses a TCP socket listens on `port` at, as `ss` shows them (an IPv4-mapped IPv6
    address as its IPv4 one)."""
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout
    hosts = []
    for line in out.splitlines():
        host, _, p = line.split()[3].rpartition(":")
        if p == str(port):
            host = host.strip("[]")
            try:
                mapped = ipaddress.ip_address(host)
                host = str(getattr(mapped, "ipv4_mapped", None) or mapped)
            except ValueError:
                pass  # "*"
            hosts.append(host)
    return hosts


EVERY_INTERFACE = {"0.0.0.0", "*", "::"}  # (gRPC shows 0.0.0.0:PORT as *:PORT, both stacks)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
@pytest.mark.parametrize("bind_host, want", [(None, {"127.0.0.1"}), ("0.0.0.0", EVERY_INTERFACE)])
def test_rank0_listens_only_where_asked(bind_host, want):
    """Finding 9: jax's coordinator listened on every interface ([::]:PORT) whatever
    --dist-init-addr said. Rank 0 of a real jax.distributed start (waiting for rank 1) at
    "localhost:PORT" listens on 127.0.0.1 only, for the coordinator and the control channel;
    --dist-bind-host 0.0.0.0 opens both to every interface."""
    port = free_port_pair()
    script = ("from runtime.distributed.multiprocess import DistributedConfig, join\n"
              f"join(DistributedConfig(2, 0, 'localhost:{port}', bind_host={bind_host!r}))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    p = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while not (_listening(port) and _listening(port + 1)):
            assert p.poll() is None, p.stdout.read().decode()[-3000:]
            assert time.monotonic() - t0 < 60, "rank 0 did not start listening"
            time.sleep(0.2)
        for p_ in (port, port + 1):
            hosts = _listening(p_)
            assert len(hosts) == 1 and hosts[0] in want, (p_, hosts)
    finally:
        _kill([p])


# ====================================================================== real processes


def _serve_pair(tmp_path, *extra: str, rank1_model: list[str] = TINY, wait: bool = True, before_rank1=None):
    """Rank 0 (HTTP) and rank 1 of `python -m runtime.serve` at tp=2 on the tiny model (rank 1 on
    `rank1_model`'s flags); returns (rank 0, rank 1, url, log paths) once /health answers (unless
    `wait` is False). `before_rank1(control port)` runs after rank 0 started, before rank 1 does."""
    port, dist = free_port_pair(), free_port_pair()
    common = ["--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{dist}", "--compilation-cache-dir",
              str(tmp_path.parent / "xla-multihost"), "--log-level", "info", *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    procs = []
    for rank, log in enumerate(logs):
        args = ([sys.executable, "-m", "runtime.serve", *(TINY if rank == 0 else rank1_model), *common,
                 "--node-rank", str(rank)] + (["--port", str(port)] if rank == 0 else []))
        if rank == 1 and before_rank1 is not None:
            try:
                before_rank1(dist + 1)
            except BaseException:
                _kill(procs)
                raise
        with open(log, "w") as f:
            procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    if wait:
        t0 = time.monotonic()
        try:
            while True:
                for p, log in zip(procs, logs):
                    assert p.poll() is None, log.read_text()[-3000:]
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() - t0 < START_S, "the pair did not start"
                time.sleep(0.5)
        except BaseException:
            _kill(procs)
            raise
    return procs[0], procs[1], url, logs


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(30)


def _tp1_tokens(max_tokens: int) -> list[list[int]]:
    from runtime import LLM, SamplingParams

    llm = LLM("tiny", progress=False, **TINY_ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _stream_until_first_token(client: httpx.Client, max_tokens: int):
    """Opens a greedy stream; returns (response context, line iterator) after its first token."""
    cm = client.stream("POST", "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": max_tokens,
                                                        "ignore_eos": True, "temperature": 0, "stream": True})
    r = cm.__enter__()
    lines = r.iter_lines()
    for line in lines:
        if line.startswith("data: {"):
            return cm, lines
    raise AssertionError("the stream ended before its first token")


@pytest.mark.slow
def test_two_ranks_serve_tp1_tokens_and_sigterm_stops_both(tmp_path):
    """2 processes at tp=2 give tp=1's greedy tokens over HTTP; SIGTERM on rank 0 drains a stream
    and stops both ranks with status 0. Two strangers on the control port before rank 1 starts
    (one silent, one saying {"rank": 1}) neither hold the start nor take rank 1's place."""
    want = _tp1_tokens(8)
    strangers = []

    def strangers_first(control_port: int) -> None:
        t0 = time.monotonic()
        while len(strangers) < 2:
            try:
                strangers.append(socket.create_connection(("127.0.0.1", control_port), timeout=5))
            except ConnectionRefusedError:  # rank 0 is not listening yet
                assert time.monotonic() - t0 < 120, "rank 0 did not listen on its control port"
                time.sleep(0.2)
        strangers[1].sendall(encode("hello", rank=1))

    rank0, rank1, url, logs = _serve_pair(tmp_path, before_rank1=strangers_first)
    try:
        silent, hello = ("%s:%d" % s.getsockname() for s in strangers)
        for s in strangers:
            with s:
                assert recv_frame(s)[0] == "challenge" and _read_to_eof(s, 30) == b""  # closed
        log0 = logs[0].read_text()
        assert f"closed a control connection from {silent} still in its handshake: the start went on" in log0
        assert f"refused a control connection from {hello}: it sent 'hello' ['rank'], not a hello" in log0
        assert re.search(r"rank 0: rank 1 joined from 127\.0\.0\.1:\d+", log0)
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert [ch["token_ids"] for ch in r.json()["choices"]] == want
            cm, lines = _stream_until_first_token(c, 40)
            rank0.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
            cm.__exit__(None, None, None)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"  # drained, not cut
        assert rank0.wait(60) == 0 and rank1.wait(60) == 0
        assert "rank 1: rank 0 says stop" in logs[1].read_text()
        assert "every rank stopped" in logs[0].read_text()
    finally:
        _kill([rank0, rank1])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", pytest.param("hung", marks=long_test)])
def test_a_dead_or_hung_follower_fails_requests_and_rank0_exits(tmp_path, how):
    """SIGKILL (the step's collective fails, the connection closes) or SIGSTOP (no ack within
    --dist-timeout-s) on rank 1: the running stream ends with an error, not a hang, and rank 0
    exits with status 1 well within 60 s."""
    rank0, rank1, url, logs = _serve_pair(tmp_path, "--dist-timeout-s", "5")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            cm, lines = _stream_until_first_token(c, 50)
            t0 = time.monotonic()
            rank1.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            rest = [line for line in lines if line]
            cm.__exit__(None, None, None)
        assert time.monotonic() - t0 < 30
        assert rest[-1] == "data: [DONE]"
        assert '"error"' in rest[-2] and "engine" in rest[-2], rest[-3:]
        assert rank0.wait(60) == 1
        assert time.monotonic() - t0 < 60
        log = logs[0].read_text()
        want = "rank 1 exited" if how == "killed" else "rank 1 has not finished call"
        assert want in log and "exiting with status 1" in log
    finally:
        _kill([rank0, rank1])


@pytest.mark.slow
def test_a_rank_with_another_plan_is_refused_at_start(tmp_path):
    """Rank 1 started from a saved plan with another max_num_seqs: both ranks stop at start, before
    compiling, with one message naming both (status 2, a user's mistake)."""
    plan_dir = tmp_path / "plan"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    other = [*TINY[2:], "--max-num-seqs", "4"]  # argparse keeps the last value
    subprocess.run([sys.executable, "-m", "runtime.tools.compile", "--model", "tiny", *other, "--out", str(plan_dir)],
                   cwd=ROOT, env=env, check=True, timeout=300, capture_output=True)
    rank0, rank1, _, logs = _serve_pair(tmp_path, wait=False, rank1_model=["--plan", str(plan_dir)])
    try:
        assert rank0.wait(180) == 2 and rank1.wait(60) == 2
    finally:
        _kill([rank0, rank1])
    for log in logs:
        text = log.read_text()
        assert f"rank 1 was started with '{plan_dir}' (tiny, tp=2, plan" in text, text[-2000:]
        assert "rank 0 with 'tiny' (tiny, tp=2, plan" in text
        assert "max_num_seqs: 4 here, 2 on rank 0" in text
        assert "compile buckets" not in text


def _offline_pair(model: str, engine: dict, prompts: list[list[int]], max_tokens: int) -> tuple[list, str]:
    """Greedy tokens of `prompts` from 2 `LLM(...)` processes at tp=2 (rank 0's), and rank 1's output."""
    dist = free_port_pair()
    script = textwrap.dedent(f"""
        import json, sys
        from runtime import LLM, SamplingParams
        rank = int(sys.argv[1])
        llm = LLM({model!r}, progress=False, tensor_parallel_size=2, nnodes=2, node_rank=rank,
                  dist_init_addr="127.0.0.1:{dist}", **{engine!r})
        if rank == 0:
            outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True))
            print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        else:
            try:
                llm.generate([[1]])
            except RuntimeError as e:
                print("FOLLOWER " + str(e), flush=True)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        _kill(procs)
    assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
    tokens = [line for line in outs[0].splitlines() if line.startswith("TOKENS ")]
    return json.loads(tokens[0][7:]), outs[1]


@pytest.mark.slow
def test_offline_llm_two_ranks_give_tp1_tokens():
    want = _tp1_tokens(8)
    got, follower = _offline_pair("tiny", TINY_ENGINE, PROMPTS, 8)
    assert got == want
    assert "FOLLOWER this LLM is rank 1 of a multi-process engine" in follower


@pytest.mark.slow
@long_test
def test_smollm2_two_ranks_give_golden_tokens():
    """The real model at tp=2 over 2 processes reproduces HF's fp32 greedy tokens."""
    from conftest import golden_arrays, golden_prompts

    names = [p["name"] for p in golden_prompts()]
    prompts = [golden_arrays(n)["prompt_ids"].tolist() for n in names]
    got, _ = _offline_pair("smollm2-135m", dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32,
                                                num_kv_blocks=64), prompts, 32)
    for n, tokens in zip(names, got):
        assert tokens == golden_arrays(n)["gen_ids"].tolist(), n
