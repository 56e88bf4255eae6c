"""One engine across several processes (multi-host tensor parallelism): `jax.distributed` and the
control channel over which rank 0 sends every device call to the other ranks.

    rank 0 (the leader)                          ranks 1..N-1 (followers)
    scheduler, LLMEngine, HTTP server            a ModelRunner only: no scheduler that could drift
    runner.execute(bucket, inputs, sampling) ──► the same call on the same host arrays, first
       (one frame per call, over TCP)              └─ the step's collectives (gloo on CPU) join
    watchdog ◄── an ack per call once it ran on the follower; EOF when the follower's process dies

Each process calls `jax.distributed.initialize` before it touches a device, so `jax.devices()`
lists every process's devices and the `tp` mesh spans them; each process puts only its own
shards of the weights and KV pools (runtime.worker.sharding). The ModelRunner calls that run a
computation on the global mesh (a step, multi-step decode, a block copy, prompt logprobs, the LM
head) are sent to the followers before rank 0 runs them (ModelRunner.mirror), in order, so every
rank runs the same executables on the same arrays. Outputs are replicated: rank 0 reads its own.

The control channel is a TCP connection from each follower to rank 0 on the port after
--dist-init-addr's. Per step it costs an encode, one send per follower and a decode: measured
against JAX's key-value store and multihost_utils.broadcast_one_to_all in docs/benchmarks/2026-12-06-scale-out.md
(benchmarks/dist_broadcast.py).

Start-up: every rank joins `jax.distributed`, the followers connect and prove their rank: rank 0
sends each connection a random challenge and counts it as rank r only once it answers with r and
HMAC-SHA256(secret, challenge, its own nonce, r) (the secret: --dist-secret, $JAXSERVE_DIST_SECRET
or a private file; join.py), within join.HELLO_TIMEOUT_S; rank 0 answers with its own HMAC, so a
follower knows it reached rank 0. Connections are served at once, so a stranger that connects
first (silent, garbage, a forged hello) is refused and logged with its address, and the real rank
joins. Rank 0 listens (the coordinator, the control port) on --dist-init-addr's host or
--dist-bind-host only. The channel is authenticated, not encrypted: docs/scaling.md. Each
rank loads its plan; the followers send the plan's identity (model, hashes of the program and
the weights) and rank 0 refuses a rank whose plan differs from its own, naming both; every rank
compiles (the same warm-up, so a warm-up run's collectives pair up); the followers report their
KV pool's block count, which must equal rank 0's; then rank 0 serves.

Faults: a follower whose process dies closes its connection (and fails the step's collective);
one that hangs stops acknowledging calls, and rank 0 gives up on it after `timeout_s`. Either
way rank 0 calls its `on_fault` (the server fails every running request and exits with status
1; LLM.generate raises RankFailure and the process exits soon after, as JAX's coordination
service would end it anyway). A follower exits when rank 0 says stop (status 0) or when rank 0
disappears (status 1).
"""

from __future__ import annotations

import argparse
import collections
import errno
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

import jax

from runtime.errors import UserError
from runtime.distributed.join import (CONNECT_TIMEOUT_S, SECRET_ENV, Admission, RankFailure,  # noqa: F401
                                      _handshake_frame, _Handshake, _host_port, _nonce, _proof, _same_proof,
                                      _secret_hint, bind_address, free_port_pair, load_secret,
                                      with_suppressed_oserror)
from runtime.distributed.wire import Decoder, Encoder, encode, recv_frame, recv_raw  # noqa: F401 (re-exported)

log = logging.getLogger("runtime.distributed")

DEFAULT_TIMEOUT_S = 30.0  # a call a follower has not finished by then: it is hung
START_TIMEOUT_S = 1800.0  # loading, compiling: a big model's start takes minutes
FAULT_EXIT_STATUS = 1
# The ModelRunner methods a follower runs when rank 0 sends them (nothing else can be called).
MIRRORED_METHODS = ("execute", "execute_multi_step", "copy_blocks", "prompt_logprobs", "lm_head")


# ====================================================================== settings


@dataclass(frozen=True)
class DistributedConfig:
    """SGLang's names: `--nnodes N --node-rank R --dist-init-addr HOST:PORT`. The control channel
    listens on PORT+1 of HOST, which is rank 0's address; rank 0 binds both ports on HOST (or on
    `bind_host`, --dist-bind-host). `secret` (--dist-secret; else $JAXSERVE_DIST_SECRET, else a
    private file: load_secret) is what each follower proves it knows before it counts as a rank."""

    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    secret: str | None = field(default=None, repr=False)
    bind_host: str | None = None

    def __post_init__(self):
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise UserError(f"--nnodes must be a positive integer, got {self.nnodes!r}")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be in [0, {self.nnodes}) for --nnodes {self.nnodes}, "
                            f"got {self.node_rank!r}")
        if not self.timeout_s > 0:
            raise UserError(f"--dist-timeout-s must be positive, got {self.timeout_s!r}")
        if self.secret is not None and not str(self.secret).strip():
            raise UserError("--dist-secret is empty")
        if self.bind_host is not None and not str(self.bind_host).strip("[] "):
            raise UserError("--dist-bind-host is empty")
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise UserError("--nnodes > 1 needs --dist-init-addr HOST:PORT (rank 0's address, the same "
                                "on every rank)")
            self.address()  # checks it

    @property
    def enabled(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    def address(self) -> tuple[str, int]:
        host, sep, port = str(self.dist_init_addr).rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise UserError(f"--dist-init-addr must be HOST:PORT with PORT in [1, 65534] (PORT+1 is the "
                            f"control channel), got {self.dist_init_addr!r}")
        return host, int(port)

    @property
    def control_address(self) -> tuple[str, int]:
        host, port = self.address()
        return host, port + 1

    @classmethod
    def from_args(cls, args) -> "DistributedConfig":
        return cls(args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout_s,
                   getattr(args, "dist_secret", None), getattr(args, "dist_bind_host", None))

    @classmethod
    def pop_from(cls, kwargs: dict) -> "DistributedConfig":
        """Takes LLM(...)'s keywords nnodes, node_rank, dist_init_addr, dist_timeout_s, dist_secret,
        dist_bind_host out of `kwargs`."""
        return cls(kwargs.pop("nnodes", 1), kwargs.pop("node_rank", 0), kwargs.pop("dist_init_addr", None),
                   kwargs.pop("dist_timeout_s", DEFAULT_TIMEOUT_S), kwargs.pop("dist_secret", None),
                   kwargs.pop("dist_bind_host", None))


def add_distributed_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("several processes, one engine (multi-host tensor parallelism)")
    g.add_argument("--nnodes", type=int, default=1,
                   help="processes that run this engine together; --tensor-parallel-size spans their devices")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this process's rank: 0 schedules and serves HTTP, the others follow it")
    g.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="rank 0's address for jax.distributed, the same on every rank; PORT+1 carries the "
                        "steps' inputs from rank 0 to the others")
    g.add_argument("--dist-timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="rank 0 gives up on a rank that has not finished a step in this long (hung), fails "
                        "the running requests and exits")
    g.add_argument("--dist-secret", default=None, metavar="SECRET",
                   help=f"what every rank proves it knows before rank 0 counts it, the same on every rank "
                        f"(better: ${SECRET_ENV}, which `ps` does not show; default: the file "
                        "$XDG_STATE_HOME/jaxserve/dist-secret, ~/.local/state/jaxserve/dist-secret, made on "
                        "first use: enough for ranks on one machine)")
    g.add_argument("--dist-bind-host", default=None, metavar="HOST",
                   help="rank 0 listens for the other ranks (jax.distributed's coordinator on PORT, the "
                        "control channel on PORT+1) on this address (default: --dist-init-addr's host; "
                        "0.0.0.0: every interface)")


# ====================================================================== joining


def initialize(cfg: DistributedConfig) -> None:
    """jax.distributed.initialize for this rank; before anything touches a device. On CPU the
    processes' collectives go through gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax's coordinator (rank 0's) would listen on every interface ([::]:PORT) unless told where.
    bind = dict(coordinator_bind_address=_host_port(*bind_address(cfg), cfg.address()[1])) if cfg.is_leader else {}
    try:
        jax.distributed.initialize(coordinator_address=cfg.dist_init_addr, num_processes=cfg.nnodes,
                                   process_id=cfg.node_rank, initialization_timeout=int(CONNECT_TIMEOUT_S),
                                   **bind)
    except RuntimeError as e:
        if "should only be called once" not in str(e):
            raise
        if jax.process_count() != cfg.nnodes or jax.process_index() != cfg.node_rank:
            raise UserError(f"jax.distributed is already initialized as rank {jax.process_index()} of "
                            f"{jax.process_count()}, not rank {cfg.node_rank} of {cfg.nnodes}") from e
    log.info("rank %d of %d joined jax.distributed at %s: %d devices in all, %d here", cfg.node_rank,
             cfg.nnodes, cfg.dist_init_addr, jax.device_count(), jax.local_device_count())


def join(cfg: DistributedConfig) -> "Leader | Follower":
    """Joins jax.distributed and the control channel: rank 0 gets a Leader that has heard from every
    other rank, the others a Follower connected to rank 0."""
    if cfg.is_leader:
        leader = Leader(cfg)  # listening before the others can look for it
        initialize(cfg)
        leader.accept()
        return leader
    initialize(cfg)
    return Follower(cfg)


def plan_identity(plan, source) -> dict:
    """What must be the same on every rank: the program (model config, engine args, final graph)
    and the weights, by hash; with the names a message shows."""
    return {"model": str(source), "name": plan.config.name, "program": plan.program_hash(),
            "weights": plan.content_hash(), "engine": plan.engine.to_dict()}


def _describe(ident: dict) -> str:
    tp = ident["engine"].get("tensor_parallel_size")
    return f"{ident['model']!r} ({ident['name']}, tp={tp}, plan {ident['program']}, weights {ident['weights']})"


def _mismatch(rank: int, theirs: dict, ours: dict) -> str | None:
    if theirs["program"] == ours["program"] and theirs["weights"] == ours["weights"]:
        return None
    diff = [f"{k}: {theirs['engine'].get(k)!r} here, {v!r} on rank 0" for k, v in ours["engine"].items()
            if theirs["engine"].get(k) != v]
    why = f"; the engine args differ ({'; '.join(diff)})" if diff else ""
    return (f"rank {rank} was started with {_describe(theirs)}, rank 0 with {_describe(ours)}{why}: every rank "
            "must start with the same --model or --plan and the same engine flags")


# ====================================================================== rank 0


class Leader(Admission):
    """Rank 0's end of the control channel: sends each mirrored call to every follower and watches
    them (acks, EOF, time)."""

    is_leader = True

    def __init__(self, cfg: DistributedConfig):
        self.cfg = cfg
        self._secret, self._secret_source = load_secret(cfg)
        family, ip = bind_address(cfg)
        port = cfg.control_address[1]
        self.address = _host_port(family, ip, port)
        try:
            self._listener = socket.create_server((ip, port), family=family)
        except OSError as e:
            hint = ("pick another --dist-init-addr port" if e.errno == errno.EADDRINUSE else
                    "--dist-init-addr must be rank 0's own address as the other ranks reach it, or pass "
                    "--dist-bind-host (an address of this machine, or 0.0.0.0)")
            raise UserError(f"rank 0 cannot listen on {self.address} for the other ranks (--dist-init-addr's "
                            f"port + 1): {e.strerror}; {hint}") from e
        self.peers: dict[int, socket.socket] = {}
        self.refused: list[str] = []  # "ADDRESS: why", each connection refused during the start
        self._pending: dict[socket.socket, _Handshake] = {}
        self.on_fault = self._default_on_fault
        self.fault: str | None = None
        self._fault_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._seq = 0
        self._outstanding: dict[int, collections.deque] = {}
        self._out_lock = threading.Lock()
        self._stopping = False
        self._gone: dict[int, threading.Event] = {}
        self._watchdog: threading.Thread | None = None
        self._encoder = Encoder(refs=True)
        self.num_calls = 0
        self.send_seconds = 0.0  # encoding and sending, summed over calls (the leader's cost)

    # ------------------------------------------------------------ start-up (accept: join.Admission)

    def _expect(self, rank: int, kind: str, timeout: float = START_TIMEOUT_S) -> dict:
        sock = self.peers[rank]
        sock.settimeout(timeout)
        try:
            got, f = recv_frame(sock)
        except EOFError:
            raise RankFailure(f"rank {rank} exited during start-up (see its log)") from None
        except socket.timeout:
            raise RankFailure(f"rank {rank} sent nothing for {timeout:.0f} s during start-up") from None
        if got == "failed":
            raise UserError(f"rank {rank} could not start: {f['message']}")
        if got != kind:
            raise RankFailure(f"rank {rank} sent {got!r} during start-up, expected {kind!r}")
        return f

    def _send(self, rank: int, kind: str, **fields) -> None:
        with self._send_lock:
            self.peers[rank].sendall(encode(kind, **fields))

    def check_peers(self, identity: dict) -> None:
        """Every follower's plan must be rank 0's; UserError naming both when one is not (that rank
        is told so too and exits)."""
        problems = []
        for rank in sorted(self.peers):
            theirs = self._expect(rank, "identity")["identity"]
            why = _mismatch(rank, theirs, identity)
            if why:
                problems.append(why)
                self._send(rank, "refuse", message=why)
            else:
                self._send(rank, "proceed")
        if problems:
            raise UserError("; ".join(problems))

    def start(self, runner, warm_execute: bool | str = False) -> None:
        """After every rank compiled (ModelRunner.warmup with execute=False: a collective waits
        only so long for its peers, and the ranks finish compiling far apart): checks that every
        follower sized the same KV pool, then mirrors `runner`'s device calls to them, starts
        watching them, and runs each bucket once on every rank if `warm_execute` ("auto":
        where the first runs are slow, as ModelRunner.warmup)."""
        for rank in sorted(self.peers):
            blocks = self._expect(rank, "ready")["num_kv_blocks"]
            if blocks != runner.num_blocks:
                why = (f"rank {rank} sized its KV pool at {blocks} blocks, rank 0 at {runner.num_blocks}: the "
                       "ranks' devices differ in memory; pass the same --num-kv-blocks to every rank")
                for r in self.peers:
                    self._send(r, "refuse", message=why)
                raise UserError(why)
        for rank in self.peers:
            self._send(rank, "serve")
            self.peers[rank].settimeout(None)
        runner.mirror = self
        self._watchdog = threading.Thread(target=self._watch, name="rank-watchdog", daemon=True)
        self._watchdog.start()
        if warm_execute == "auto":
            warm_execute = runner.first_runs_are_slow
        if warm_execute:
            runner.run_each_bucket()
        log.info("rank 0: %d follower rank(s) ready; serving", len(self.peers))

    # ------------------------------------------------------------ serving

    def call(self, method: str, args: tuple, kwargs: dict) -> None:
        """Sends a device call to every follower (the engine thread, before running it itself)."""
        if self.fault is not None:
            raise RankFailure(self.fault)
        t0 = time.perf_counter()
        self._seq += 1
        frame = self._encoder.frame("call", seq=self._seq, method=method, args=args, kwargs=kwargs)
        now = time.monotonic()
        with self._out_lock:
            for q in self._outstanding.values():
                q.append((self._seq, method, now))
        for rank in self.peers:
            try:
                with self._send_lock:
                    self.peers[rank].sendall(frame)
            except OSError as e:
                self._fault(f"rank {rank} is gone: sending it a step failed ({e})")
                raise RankFailure(self.fault) from e
        self.num_calls += 1
        self.send_seconds += time.perf_counter() - t0

    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        for rank, sock in self.peers.items():
            sel.register(sock, selectors.EVENT_READ, rank)
        live = set(self.peers)
        while live and self.fault is None:
            for key, _ in sel.select(timeout=0.25):
                rank = key.data
                try:
                    kind, f = recv_frame(key.fileobj)
                except (EOFError, OSError) as e:
                    sel.unregister(key.fileobj)
                    live.discard(rank)
                    self._gone[rank].set()
                    if not self._stopping:
                        self._fault(f"rank {rank} exited: its control connection closed"
                                    + (f" ({e})" if not isinstance(e, EOFError) else ""))
                    continue
                if kind == "ack":
                    with self._out_lock:
                        q = self._outstanding[rank]
                        while q and q[0][0] <= f["seq"]:
                            q.popleft()
                elif kind == "error":
                    self._fault(f"rank {rank} failed running {f['method']}: {f['message']}")
                elif kind == "bye":  # it stops reading; so does this thread, for its socket
                    sel.unregister(key.fileobj)
                    live.discard(rank)
                    self._gone[rank].set()
            now = time.monotonic()
            with self._out_lock:
                late = [(r, q[0]) for r, q in self._outstanding.items() if q and now - q[0][2] > self.cfg.timeout_s]
            for rank, (seq, method, _) in late:
                self._fault(f"rank {rank} has not finished call {seq} ({method}) in {self.cfg.timeout_s:.0f} s: "
                            "it is hung (--dist-timeout-s)")
        sel.close()

    def _fault(self, message: str) -> None:
        with self._fault_lock:
            if self.fault is not None:
                return
            self.fault = message
        log.error("multi-process engine failure: %s", message)
        try:
            self.on_fault(message)
        except Exception:  # the handler's own failure must not hide the fault
            log.exception("fault handler failed")
            os._exit(FAULT_EXIT_STATUS)

    def _default_on_fault(self, message: str) -> None:
        """Offline (LLM): the running generate() raises RankFailure at its next step; a rank stuck in
        a collective with a dead peer cannot return, so the process exits in a few seconds either way."""
        exit_soon(FAULT_EXIT_STATUS, 5.0, message)

    # ------------------------------------------------------------ stopping

    def abort(self, error: BaseException) -> None:
        """Rank 0 could not start: tells every follower still waiting, so that none waits for it."""
        message = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
        for rank, sock in self.peers.items():
            try:
                self._send(rank, "refuse", message=f"rank 0 could not start: {message}")
                sock.close()
            except OSError:
                pass

    def stop(self, timeout: float = 10.0) -> bool:
        """Tells every follower to stop and waits for each to go; True if all did in time."""
        self._stopping = True
        for rank in self.peers:
            try:
                self._send(rank, "stop")
            except OSError:
                self._gone[rank].set()
        deadline = time.monotonic() + timeout
        if self._watchdog is None:  # stopped before serving: nothing reads their goodbyes
            for rank, sock in self.peers.items():
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    while recv_frame(sock)[0] != "bye":
                        pass
                except (EOFError, OSError):
                    pass
                self._gone[rank].set()
        ok = all(ev.wait(max(deadline - time.monotonic(), 0)) for ev in self._gone.values())
        log.info("rank 0: %s", "every rank stopped" if ok else "some ranks did not confirm the stop in time")
        return ok


def exit_soon(status: int, delay: float, why: str) -> None:
    """Ends the process after `delay` seconds from a daemon thread, whatever the others are doing
    (a thread inside a collective with a dead peer never returns)."""

    def _exit():
        time.sleep(delay)
        log.error("exiting with status %d: %s", status, why)
        logging.shutdown()
        os._exit(status)

    threading.Thread(target=_exit, name="exit-soon", daemon=True).start()


# ====================================================================== ranks 1..N-1


class Follower:
    """A follower's end of the control channel: runs what rank 0 sends on its runner."""

    is_leader = False

    def __init__(self, cfg: DistributedConfig, timeout: float = CONNECT_TIMEOUT_S):
        self.cfg = cfg
        self._secret, self._secret_source = load_secret(cfg)
        host, port = cfg.control_address
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=5)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RankFailure(f"rank {cfg.node_rank} could not reach rank 0's control channel at "
                                      f"{host}:{port} within {timeout:.0f} s ({e})") from e
                time.sleep(0.2)
                continue
            try:
                if self._handshake(f"{host}:{port}", deadline):
                    break
            except BaseException:
                self.sock.close()
                raise
            self.sock.close()  # closed before its challenge (rank 0 busy with others): again
            if time.monotonic() > deadline:
                raise RankFailure(f"rank {cfg.node_rank}: rank 0's control channel at {host}:{port} closed every "
                                  f"connection before its challenge for {timeout:.0f} s")
            time.sleep(0.2)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self._decoder = Decoder()
        self.num_calls = 0
        self.recv_seconds = 0.0  # decoding the calls, summed (waiting for them not counted)

    def _send(self, kind: str, **fields) -> None:
        self.sock.sendall(encode(kind, **fields))

    def _handshake(self, where: str, deadline: float) -> bool:
        """Answers rank 0's challenge with this rank and the proof, and checks rank 0's proof in
        turn; False if the connection closed before the challenge."""
        rank = self.cfg.node_rank
        self.sock.settimeout(max(deadline - time.monotonic(), 1.0))
        try:
            kind, f = _handshake_frame(self.sock)
        except (EOFError, ConnectionError):
            return False
        except socket.timeout:
            raise RankFailure(f"rank {rank}: {where} accepted the connection but sent no challenge: is it rank 0's "
                              "control channel (--dist-init-addr's port + 1)?") from None
        except Exception as e:  # noqa: BLE001 - whatever it sent, it is not a challenge
            raise RankFailure(f"rank {rank}: {where} is not rank 0's control channel: it sent something that is "
                              f"not a challenge ({type(e).__name__}: {e})") from None
        ours = secrets.token_bytes(32)
        theirs = _nonce(f.get("nonce")) if kind == "challenge" else None
        if theirs is None:
            raise RankFailure(f"rank {rank}: {where} is not rank 0's control channel: it sent {kind!r}, not a "
                              "challenge")
        self._send("hello", rank=rank, nonce=ours.hex(), proof=_proof(self._secret, "hello", theirs, ours, rank))
        try:
            kind, f = _handshake_frame(self.sock)
        except Exception as e:  # noqa: BLE001
            raise RankFailure(f"rank {rank}: {where} did not answer this rank's hello "
                              f"({type(e).__name__}{': ' + str(e) if str(e) else ''})") from None
        if kind == "refuse":
            message = str(f.get("message"))
            if f.get("secret"):
                message += f"; this rank's came from {self._secret_source}"
            raise UserError(message)
        if kind != "welcome" or not _same_proof(f.get("proof"), _proof(self._secret, "welcome", theirs, ours, rank)):
            raise UserError(f"rank {rank}: {where} answered as rank 0 but did not prove that it knows this launch's "
                            f"secret (another program on that port?); {_secret_hint(self._secret_source)}")
        self.sock.settimeout(None)
        return True

    def _expect(self, *kinds: str) -> tuple[str, dict]:
        try:
            kind, f = recv_frame(self.sock)
        except EOFError:
            raise RankFailure(f"rank 0 closed the control channel while rank {self.cfg.node_rank} was "
                              "starting (see rank 0's log)") from None
        if kind == "refuse":
            raise UserError(f["message"])
        if kind not in kinds:
            raise RankFailure(f"rank 0 sent {kind!r}, expected {' or '.join(kinds)}")
        return kind, f

    def fail(self, error: BaseException) -> None:
        """Tells rank 0 this rank could not start (rank 0 then stops with this message)."""
        try:
            self._send("failed", message=f"{type(error).__name__}: {error}" if not isinstance(error, UserError)
                       else str(error))
        except OSError:
            pass

    def introduce(self, identity: dict) -> None:
        """Sends this rank's plan identity; UserError if rank 0 refuses it."""
        self._send("identity", identity=identity)
        self._expect("proceed")

    def ready(self, runner) -> None:
        self._send("ready", num_kv_blocks=runner.num_blocks)
        self._expect("serve")

    def serve(self, runner) -> None:
        """Runs rank 0's calls on `runner` until rank 0 says stop; RankFailure when rank 0 is gone."""
        rank = self.cfg.node_rank
        while True:
            try:
                raw = recv_raw(self.sock)
            except (EOFError, OSError) as e:
                raise RankFailure(f"rank 0 closed the control channel without a stop (it exited or crashed); "
                                  f"rank {rank} stops") from e
            t0 = time.perf_counter()
            kind, f = self._decoder.decode(*raw)
            if kind == "stop":
                log.info("rank %d: rank 0 says stop after %d calls", rank, self.num_calls)
                with_suppressed_oserror(lambda: self._send("bye"))
                return
            if kind != "call" or f["method"] not in MIRRORED_METHODS:
                raise RankFailure(f"rank 0 sent {kind!r} {f.get('method', '')!r}: not a call this rank runs")
            self.recv_seconds += time.perf_counter() - t0
            try:
                out = getattr(runner, f["method"])(*f["args"], **f["kwargs"])
                jax.block_until_ready(out)
            except Exception as e:
                with_suppressed_oserror(lambda: self._send("error", seq=f["seq"], method=f["method"],
                                                           message=f"{type(e).__name__}: {e}"))
                raise RankFailure(f"rank {rank} failed running {f['method']} (call {f['seq']}): {e}") from e
            self.num_calls += 1
            with_suppressed_oserror(lambda: self._send("ack", seq=f["seq"]))
