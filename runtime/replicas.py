"""Data-parallel replicas behind a cache-aware router: `jaxserve serve --data-parallel-size N`.

    jaxserve serve --model smollm2-135m --data-parallel-size 2 --port 8000

starts N engine replicas, each a `python -m runtime.serve` process of its own on 127.0.0.1 with
its own devices (on CPU: its share of this process's cores, by CPU affinity; on GPU: its own
CUDA_VISIBLE_DEVICES slice of tensor_parallel_size devices), and SGLang's router
(`sglang-router`, a Rust binary from PyPI) on --host:--port in front of them. The router's
cache-aware policy keeps a radix tree of the text each replica has served and sends a request to
the replica holding its longest prefix (so that replica's prefix cache hits), unless the replicas'
loads are too far apart; `--router-policy round_robin` is the baseline it is measured against
(docs/benchmarks/2026-12-06-issue52-scale-out.md). This module is only the glue: processes, ports, the worker list.

Faults: a replica whose process exits is taken out of the router's rotation at once (the router's
worker API), restarted on its port, and put back once its /health answers; its in-flight requests
fail (the router answers them with an error), the other replicas keep serving. SIGTERM (or SIGINT)
drains every replica (each refuses new requests and finishes its own, as a single server does),
then stops the router; exit status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from runtime.errors import UserError

log = logging.getLogger("runtime.replicas")

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
START_TIMEOUT_S = 1800.0  # a replica's start: loading and compiling
RESTART_BACKOFF_S = 5.0  # a replica that exits sooner after its start waits this long to be restarted


@dataclass
class Replica:
    index: int
    port: int
    cores: list[int] | None
    env: dict
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cores = self.cores

        def pin():  # the child's own cores before it starts JAX (XLA sizes its thread pools from them)
            die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        log_file = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log_file, stderr=subprocess.STDOUT,
                                     preexec_fn=pin, start_new_session=True)
        log_file.close()
        self.started_at = time.monotonic()
        log.info("replica %d: pid %d on %s%s", self.index, self.proc.pid, self.url,
                 f", cores {cores}" if cores else "")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the thread that started it ends (Linux), so that a
    launcher killed outright leaves no replica or router behind. Children are started from the
    launcher's main thread only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_cores(n: int) -> list[list[int] | None]:
    """This process's cores in n equal, disjoint shares (None each where there are fewer cores than replicas)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        log.warning("%d replicas on %d cores: they share them", n, len(cores))
        return [None] * n
    k = len(cores) // n
    return [cores[i * k:(i + 1) * k] for i in range(n)]


def replica_envs(n: int, tp: int) -> list[dict]:
    """Each replica's environment: on GPU (CUDA_VISIBLE_DEVICES or /dev/nvidia0 present, and
    JAX_PLATFORMS not cpu) its own tp devices."""
    base = dict(os.environ)
    gpu = base.get("JAX_PLATFORMS", "").lower() not in ("cpu",) and (
        "CUDA_VISIBLE_DEVICES" in base or Path("/dev/nvidia0").exists())
    if not gpu:
        return [dict(base) for _ in range(n)]
    visible = base.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(n * tp)]
    if len(ids) < n * tp:
        raise UserError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs, "
                        f"{len(ids)} are visible")
    return [dict(base, CUDA_VISIBLE_DEVICES=",".join(ids[i * tp:(i + 1) * tp])) for i in range(n)]


def router_command(host: str, port: int, urls: list[str], policy: str) -> list[str]:
    """sglang-router's command line. Its own health checks stay on (every 5 s) as a second line of
    defence; retries are off: a request is answered once, by the replica it went to, so a crash
    fails its in-flight requests instead of running them twice."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *urls, "--policy", policy, "--disable-retries", "--health-check-interval-secs", "5",
            "--health-failure-threshold", "2", "--health-success-threshold", "1", "--log-level", "warn",
            "--worker-startup-timeout-secs", "600"]


class ReplicaSet:
    """N replicas and the router; `run()` until SIGTERM."""

    def __init__(self, serve_argv: list[str], n: int, *, host: str, port: int, policy: str, tp: int,
                 log_dir: Path, shutdown_grace_s: float):
        self.n, self.host, self.port, self.policy = n, host, port, policy
        self.log_dir = log_dir
        self.shutdown_grace_s = shutdown_grace_s
        log_dir.mkdir(parents=True, exist_ok=True)
        cores = split_cores(n)
        envs = replica_envs(n, tp)
        self.replicas = []
        for i in range(n):
            p = free_port()
            argv = [sys.executable, "-m", "runtime.serve", *serve_argv, "--host", "127.0.0.1", "--port", str(p)]
            self.replicas.append(Replica(i, p, cores[i], envs[i], argv, log_dir / f"replica{i}.log"))
        self.router: subprocess.Popen | None = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------ start

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        self._wait_healthy(self.replicas)
        cmd = router_command(self.host, self.port, [r.url for r in self.replicas], self.policy)
        with open(self.log_dir / "router.log", "a") as f:
            self.router = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=die_with_parent)
        url = f"http://{'127.0.0.1' if self.host in ('0.0.0.0', '::') else self.host}:{self.port}"
        t0 = time.monotonic()
        while True:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited ({self.router.returncode}); see {self.log_dir / 'router.log'}")
            try:
                if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"the router did not become ready; see {self.log_dir / 'router.log'}")
            time.sleep(0.2)
        self.router_url = url
        log.info("router (%s) on http://%s:%d over %d replicas", self.policy, self.host, self.port, self.n)

    def _wait_healthy(self, replicas) -> None:
        t0 = time.monotonic()
        waiting = list(replicas)
        while waiting:
            for r in list(waiting):
                if r.proc.poll() is not None:
                    raise RuntimeError(f"replica {r.index} exited with status {r.proc.returncode} while starting; "
                                       f"see {r.log_path}")
                if r.healthy():
                    waiting.remove(r)
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"replicas {[r.index for r in waiting]} did not start in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)

    # ------------------------------------------------------------ faults

    def _router_workers(self, action: str, url: str) -> None:
        """The router's worker API: `add` (POST /workers) or `remove` (DELETE /workers/{id}) a replica."""
        try:
            if action == "add":
                r = httpx.post(f"{self.router_url}/workers", json={"url": url}, timeout=30)
            else:
                workers = httpx.get(f"{self.router_url}/workers", timeout=10).json().get("workers", [])
                ids = [w["id"] for w in workers if w.get("url") == url]
                if not ids:
                    return
                r = httpx.delete(f"{self.router_url}/workers/{ids[0]}", timeout=10)
            if r.status_code >= 300:
                log.warning("router: %s %s: HTTP %d %s", action, url, r.status_code, r.text[:200])
        except (httpx.HTTPError, ValueError) as e:
            log.warning("router: %s %s: %s", action, url, e)

    def _restart(self, r: Replica) -> threading.Thread:
        """Out of rotation and started again (this thread: the children die with it, see
        die_with_parent); back in rotation from a thread of its own once healthy."""
        log.error("replica %d (pid %d) exited with status %s: out of rotation, restarting", r.index, r.proc.pid,
                  r.proc.returncode)
        self._router_workers("remove", r.url)
        r.restarts += 1
        r.start()

        def back():
            try:
                self._wait_healthy([r])
            except RuntimeError as e:
                log.error("replica %d did not come back: %s", r.index, e)
                return
            if not self._stopping.is_set():
                self._router_workers("add", r.url)
                log.info("replica %d is back in rotation (restart %d)", r.index, r.restarts)

        t = threading.Thread(target=back, name=f"replica-{r.index}-back", daemon=True)
        t.start()
        return t

    def monitor(self) -> None:
        coming_back: dict[int, threading.Thread] = {}
        while not self._stopping.is_set():
            for r in self.replicas:
                t = coming_back.get(r.index)
                if t is not None and t.is_alive():
                    continue  # starting: _wait_healthy sees it exit again
                if (r.proc.poll() is not None and not self._stopping.is_set()
                        and time.monotonic() - r.started_at > RESTART_BACKOFF_S):  # no tight crash loop
                    coming_back[r.index] = self._restart(r)
            if self.router.poll() is not None and not self._stopping.is_set():
                log.error("the router exited with status %s; stopping", self.router.returncode)
                self.stop()
                raise SystemExit(1)
            self._stopping.wait(0.25)

    # ------------------------------------------------------------ stop

    def stop(self) -> None:
        """Drains every replica (SIGTERM: each finishes its requests within its grace), then stops the router."""
        self._stopping.set()
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_grace_s + 30
        for r in self.replicas:
            if r.proc is None:
                continue
            try:
                r.proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                log.warning("replica %d did not stop in time: killing it", r.index)
                r.proc.kill()
                r.proc.wait(10)
        if self.router is not None and self.router.poll() is None:
            self.router.send_signal(signal.SIGTERM)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(10)
        log.info("every replica and the router stopped")


def strip_args(argv: list[str], names: dict[str, bool]) -> list[str]:
    """argv without the flags in `names` (flag -> takes a value), in either --flag v or --flag=v form."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in names:
            skip = names[flag] and "=" not in a
            continue
        out.append(a)
    return out


REPLICA_FLAGS = {"--data-parallel-size": True, "--router-policy": True, "--host": True, "--port": True,
                 "--replica-log-dir": True}


def main(argv: list[str], args) -> int:
    """`serve --data-parallel-size N`: argv is the server's command line, args its parse."""
    from runtime.args import check_port

    if args.nnodes > 1:
        raise UserError("--data-parallel-size with --nnodes is not supported: run the multi-process "
                        "engine's ranks yourself, one replica at a time")
    check_port(args.host, args.port)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health poll
    log_dir = Path(args.replica_log_dir or Path.cwd() / f"jaxserve-replicas-{args.port}")
    rs = ReplicaSet(strip_args(argv, REPLICA_FLAGS), args.data_parallel_size, host=args.host, port=args.port,
                    policy=args.router_policy, tp=args.tensor_parallel_size, log_dir=log_dir,
                    shutdown_grace_s=args.shutdown_grace_s)
    signals = {"n": 0}
    stopper = threading.Thread(target=rs.stop, daemon=True)

    def on_signal(signum, frame):
        signals["n"] += 1
        if signals["n"] == 1:
            log.info("%s: draining %d replicas", signal.Signals(signum).name, rs.n)
            stopper.start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        rs.start()
        log.info("serving on http://%s:%d: %d replicas (logs in %s)", args.host, args.port, rs.n, log_dir)
        rs.monitor()
    except BaseException:
        stopped_by_signal = rs._stopping.is_set()  # a SIGTERM while starting: the replicas' exits are no error
        rs.stop()
        if stopped_by_signal:
            return 0
        raise
    # stop() runs on the signal's thread; wait for it to finish (its last log line included: the
    # processes can all be gone a moment before it returns).
    while stopper.ident is not None and stopper.is_alive():
        stopper.join(0.1)
    return 0


def add_replica_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("data-parallel replicas behind a router")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="start this many engine replicas (one process each, its own devices or cores) behind "
                        "sglang-router's cache-aware routing on --host:--port")
    g.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="how the router picks a replica (cache_aware: the longest cached prefix, within a load "
                        "balance)")
    g.add_argument("--replica-log-dir", default=None,
                   help="the replicas' and the router's logs (default: ./jaxserve-replicas-PORT)")
