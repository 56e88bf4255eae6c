"""Data-parallel replicas behind a cache-aware front: `jaxserve serve --data-parallel-size N`.

    jaxserve serve --model smollm2-135m --data-parallel-size 2 --port 8000

starts N engine replicas, each a `python -m runtime.serve` process of its own on 127.0.0.1 with
its own devices (on CPU: its share of this process's cores, by CPU affinity; on GPU: its own
CUDA_VISIBLE_DEVICES slice of tensor_parallel_size devices), and in this process the front
(runtime/distributed/front.py) on --host:--port, which answers as a single server does and sends each
request to the replica that served the longest prefix of its prompt (so that replica's prefix
cache hits), unless the replicas' loads are too far apart; `--router-policy round_robin` is the
baseline it is measured against (docs/benchmarks/2026-12-06-scale-out.md). This module
is the glue: processes, ports, logs, restarts.

Secrets and logs: the API key reaches the replicas in their environment (JAXSERVE_API_KEY), never
on a command line. The replicas' output goes to this process's stderr, each line prefixed with
`replica I |`; `--replica-log-dir [DIR]` writes it to files instead, in DIR or in
$XDG_STATE_HOME/jaxserve/replicas-PORT (~/.local/state), a directory of mode 0700.

Faults: a replica whose process exits is taken out of the front's rotation at once, restarted on
its port, and put back once its /health answers; a request it had not begun to answer is sent
once more by the front, to a live replica, and a stream it had begun ends with an error event;
the other replicas keep serving. SIGTERM (or SIGINT) drains every replica (each refuses new
requests and finishes its own, as a single server does), then stops the front; exit status 0.
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
from dataclasses import dataclass
from pathlib import Path

import httpx

from runtime.errors import UserError
from runtime.distributed.front import POLICIES, Upstream

log = logging.getLogger("runtime.replicas")

START_TIMEOUT_S = 1800.0  # a replica's start: loading and compiling
RESTART_BACKOFF_S = 5.0  # a replica that exits sooner after its start waits this long to be restarted


@dataclass
class Replica:
    index: int
    port: int
    cores: list[int] | None
    env: dict
    argv: list[str]
    log: "LogSink"
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cores = self.cores

        def pin():  # the child's own cores before it starts JAX (XLA sizes its thread pools from them)
            die_with_parent()
            if cores:
                os.sched_setaffinity(0, cores)

        self.proc = self.log.popen(self.argv, env=self.env, preexec_fn=pin)
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
    launcher killed outright leaves no replica behind. Children are started from the
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


def on_gpu(env) -> bool:
    """Whether the replicas run on GPUs: CUDA_VISIBLE_DEVICES or /dev/nvidia0 present, and JAX_PLATFORMS not cpu."""
    return env.get("JAX_PLATFORMS", "").lower() not in ("cpu",) and (
        "CUDA_VISIBLE_DEVICES" in env or Path("/dev/nvidia0").exists())


def cpu_memory_share(n: int, tp: int, device_memory: int | None, environ=os.environ) -> list[str]:
    """The flags that give each of n CPU replicas its share of the host's memory (per device, of its
    tp): they start at once, and each would otherwise plan for all the memory the host has available.
    Nothing on GPUs (each replica measures its own), where the user gave --device-memory, or where
    the host cannot be read."""
    from config.host_memory import read_host_memory

    if on_gpu(environ) or device_memory is not None or (host := read_host_memory()) is None:
        return []
    return ["--device-memory", f"{host // (n * tp)}B"]


def replica_envs(n: int, tp: int) -> list[dict]:
    """Each replica's environment: on GPU (on_gpu) its own tp devices."""
    base = dict(os.environ)
    if not on_gpu(base):
        return [dict(base) for _ in range(n)]
    visible = base.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(n * tp)]
    if len(ids) < n * tp:
        raise UserError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs, "
                        f"{len(ids)} are visible")
    return [dict(base, CUDA_VISIBLE_DEVICES=",".join(ids[i * tp:(i + 1) * tp])) for i in range(n)]


class LogSink:
    """Where a child's output goes: this process's stderr, each line prefixed with `name | `, or,
    with a log directory, a file of mode 0600 in it."""

    _lock = threading.Lock()

    def __init__(self, name: str, log_dir: Path | None):
        self.name = name
        self.path = log_dir / f"{name.replace(' ', '')}.log" if log_dir is not None else None

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        if self.path is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                return subprocess.Popen(argv, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
            finally:
                os.close(fd)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                **kwargs)
        threading.Thread(target=self._pump, args=(proc.stdout,), name=f"log-{self.name}", daemon=True).start()
        return proc

    def _pump(self, pipe) -> None:
        prefix = f"{self.name} | "
        with pipe:
            for line in iter(pipe.readline, b""):
                with self._lock:
                    try:
                        sys.stderr.write(prefix + line.decode("utf-8", "replace").rstrip("\n") + "\n")
                        sys.stderr.flush()
                    except (OSError, ValueError):  # our stderr is gone: keep draining the child's pipe
                        pass

    def where(self) -> str:
        return str(self.path) if self.path is not None else f"the lines prefixed '{self.name} |' above"


def default_log_dir(port: int) -> Path:
    """$XDG_STATE_HOME/jaxserve/replicas-PORT (~/.local/state/...): logs are state, not cache."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "jaxserve" / f"replicas-{port}"


def make_private_dir(path: Path) -> Path:
    """`path` and its missing parents, the last of mode 0700 (logs hold prompts and outputs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not path.is_dir():
            raise UserError(f"--replica-log-dir {path}: exists and is not a directory") from None
    return path


def start_front(cfg, live, every, host: str, port: int, first_replica: str, policy: str = "cache_aware"):
    """The front (runtime.distributed.front) on host:port in a thread of this process: (Front, ServerThread).
    Without served model names in `cfg`, it names the model as the first replica's /v1/models does
    (a --plan's own name)."""
    from runtime.entrypoints.openai.http_server import ServerThread
    from runtime.distributed.front import Front, build_front_app

    if not cfg.served_model_names:
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        models = httpx.get(first_replica + "/v1/models", headers=headers, timeout=30).json()
        cfg.served_model_names = [m["id"] for m in models["data"]]
    front = Front(cfg, live, every, policy)
    return front, ServerThread(build_front_app(front), host=host, port=port, log_level="warning").start()


class ReplicaSet:
    """N replicas and the front; `run()` until SIGTERM."""

    def __init__(self, serve_argv: list[str], n: int, *, host: str, port: int, policy: str, tp: int,
                 log_dir: Path | None, shutdown_grace_s: float, front_config):
        """`front_config`: the front's ServerConfig (its API key is the replicas' too)."""
        self.n, self.host, self.port, self.policy = n, host, port, policy
        self.shutdown_grace_s = shutdown_grace_s
        self.front_config = front_config
        api_key = front_config.api_key
        cores = split_cores(n)
        envs = replica_envs(n, tp)
        self.replicas = []
        for i in range(n):
            p = free_port()
            argv = [sys.executable, "-m", "runtime.serve", *serve_argv, "--host", "127.0.0.1", "--port", str(p)]
            env = dict(envs[i], JAXSERVE_API_KEY=api_key) if api_key else envs[i]
            self.replicas.append(Replica(i, p, cores[i], env, argv, LogSink(f"replica {i}", log_dir)))
        self.serving: set[int] = set()  # the replicas in the front's rotation
        self.front = None
        self.front_thread = None
        self._stopping = threading.Event()

    # ------------------------------------------------------------ start

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        self._wait_healthy(self.replicas)
        self.serving = {r.index for r in self.replicas}
        self._start_front()

    def _start_front(self) -> None:
        def live() -> list:
            return [Upstream(r.index, r.url) for r in self.replicas
                    if r.index in self.serving and r.proc is not None and r.proc.poll() is None]

        self.front, self.front_thread = start_front(
            self.front_config, live, lambda: [Upstream(r.index, r.url) for r in self.replicas], self.host,
            self.port, first_replica=self.replicas[0].url, policy=self.policy)
        log.info("front (%s routing) on http://%s:%d over %d replicas", self.policy, self.host, self.port, self.n)

    def _wait_healthy(self, replicas) -> None:
        t0 = time.monotonic()
        waiting = list(replicas)
        while waiting:
            for r in list(waiting):
                if r.proc.poll() is not None:
                    raise RuntimeError(f"replica {r.index} exited with status {r.proc.returncode} while starting; "
                                       f"see {r.log.where()}")
                if r.healthy():
                    waiting.remove(r)
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise RuntimeError(f"replicas {[r.index for r in waiting]} did not start in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)

    # ------------------------------------------------------------ faults

    def _restart(self, r: Replica) -> threading.Thread:
        """Out of rotation and started again (this thread: the children die with it, see
        die_with_parent); back in rotation from a thread of its own once healthy."""
        log.error("replica %d (pid %d) exited with status %s: out of rotation, restarting", r.index, r.proc.pid,
                  r.proc.returncode)
        self.serving.discard(r.index)
        self.front.router.forget(r.index)  # its prefix cache is gone with it
        r.restarts += 1
        r.start()

        def back():
            try:
                self._wait_healthy([r])
            except RuntimeError as e:
                log.error("replica %d did not come back: %s", r.index, e)
                return
            if not self._stopping.is_set():
                self.serving.add(r.index)
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
                if r.proc.poll() is not None and not self._stopping.is_set():
                    self.serving.discard(r.index)  # out of the front's rotation at once
                    if time.monotonic() - r.started_at > RESTART_BACKOFF_S:  # no tight crash loop
                        coming_back[r.index] = self._restart(r)
            self._stopping.wait(0.25)

    # ------------------------------------------------------------ stop

    def stop(self) -> None:
        """Refuses new requests at the front (503, as a draining server), drains every replica
        (SIGTERM: each finishes its requests within its grace), then stops the front."""
        self._stopping.set()
        if self.front is not None:
            self.front.draining = True
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
        if self.front_thread is not None:
            self.front_thread.stop()
        log.info("every replica and the front stopped")


def strip_args(argv: list[str], names: dict[str, bool | None], options: set[str] = frozenset()) -> list[str]:
    """argv without the flags in `names` (flag -> takes a value: True, False, or None for an optional
    one), in either --flag v or --flag=v form, or abbreviated as argparse allows (a prefix of one of
    `names` that is none of the parser's `options`)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        flag = a.split("=", 1)[0]
        i += 1
        if flag not in names and flag.startswith("--") and flag not in options:
            full = [n for n in names if n.startswith(flag)]
            flag = full[0] if len(full) == 1 else flag
        if flag not in names:
            out.append(a)
        elif "=" not in a and i < len(argv) and (names[flag] or (names[flag] is None
                                                                  and not argv[i].startswith("-"))):
            i += 1  # its value
    return out


# The launcher's own flags, and --api-key (the replicas take it from their environment, not their
# command line, where `ps` shows it).
REPLICA_FLAGS = {"--data-parallel-size": True, "--router-policy": True, "--host": True, "--port": True,
                 "--replica-log-dir": None, "--api-key": True}


def main(argv: list[str], args, options: set[str] = frozenset()) -> int:
    """`serve --data-parallel-size N`: argv is the server's command line, args its parse, options
    every option string of its parser."""
    from runtime.entrypoints.args import check_port

    if args.nnodes > 1:
        raise UserError("--data-parallel-size with --nnodes is not supported: run the multi-process "
                        "engine's ranks yourself, one replica at a time")
    from runtime.entrypoints.openai.serving import ServerConfig

    check_port(args.host, args.port)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health poll
    log_dir = None
    if args.replica_log_dir is not None:
        log_dir = make_private_dir(Path(args.replica_log_dir) if args.replica_log_dir else default_log_dir(args.port))
    # The front answers as the replicas' server would: its limits on connections and bodies too.
    front = ServerConfig(list(args.served_model_name or []), args.api_key, max_body_bytes=args.max_body_bytes,
                         header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                         keep_alive_timeout_s=args.keep_alive_timeout_s, max_connections=args.max_connections)
    serve_argv = strip_args(argv, REPLICA_FLAGS, options) + cpu_memory_share(args.data_parallel_size, args.tensor_parallel_size,
                                                                       args.device_memory)
    rs = ReplicaSet(serve_argv, args.data_parallel_size, host=args.host,
                    port=args.port, policy=args.router_policy, tp=args.tensor_parallel_size, log_dir=log_dir,
                    shutdown_grace_s=args.shutdown_grace_s, front_config=front)
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
        log.info("serving on http://%s:%d: %d replicas (their logs %s)", args.host, args.port, rs.n,
                 f"in {log_dir}" if log_dir else "above, each line prefixed 'replica I |'")
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
    g = ap.add_argument_group("data-parallel replicas behind a cache-aware front")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="start this many engine replicas (one process each, its own devices or cores) behind "
                        "one front on --host:--port that routes each request to the replica caching the "
                        "longest prefix of its prompt")
    g.add_argument("--router-policy", default="cache_aware", choices=POLICIES,
                   help="how the front picks a replica (cache_aware: the longest cached prefix, within a load "
                        "balance)")
    g.add_argument("--replica-log-dir", default=None, nargs="?", const="", metavar="DIR",
                   help="write the replicas' output to files in DIR (made with mode 0700), or "
                        "with no DIR in $XDG_STATE_HOME/jaxserve/replicas-PORT (~/.local/state); default: this "
                        "process's stderr, each line prefixed 'replica I |'")
