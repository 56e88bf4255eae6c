"""Who may join a multi-process engine (runtime.distributed.multiprocess): the launch's secret,
the challenge each connection to rank 0's control port must answer, and the address rank 0
listens on.

Rank 0 sends each connection a random challenge; a follower answers, within HELLO_TIMEOUT_S,
with its rank, a nonce of its own and an HMAC-SHA256 over both under the secret; rank 0 answers
with its own HMAC, so the follower knows it reached rank 0. Rank 0 serves every connection in
its handshake at once (a silent stranger holds nobody up), closes and logs one that fails it, and
never lets it take a rank's place.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.distributed.wire import Decoder, encode, recv_frame, split_frame
from runtime.errors import UserError

log = logging.getLogger("runtime.distributed")

CONNECT_TIMEOUT_S = 120.0
HELLO_TIMEOUT_S = 10.0  # a connection to the control port that has not proved its rank by then is closed
HANDSHAKE_MAX_BYTES = 1024  # a challenge, hello or welcome frame is about 200 bytes
MAX_PENDING = 32  # connections in their handshake at once; more are closed at accept
SECRET_ENV = "JAXSERVE_DIST_SECRET"


class RankFailure(RuntimeError):
    """A rank of a multi-process engine died, hung, or broke off: the engine cannot go on."""


def default_secret_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "jaxserve" / "dist-secret"


def load_secret(cfg) -> tuple[bytes, str]:
    """This launch's secret and where it came from (for messages): --dist-secret, else
    $JAXSERVE_DIST_SECRET, else default_secret_path(), made (0600, 32 random bytes) if missing."""
    if cfg.secret is not None:
        return str(cfg.secret).strip().encode(), "--dist-secret"
    env = os.environ.get(SECRET_ENV)
    if env is not None:
        if not env.strip():
            raise UserError(f"${SECRET_ENV} is set but empty")
        return env.strip().encode(), f"${SECRET_ENV}"
    path = default_secret_path()
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:  # whole or not at all; a rank that made it first wins and both read its secret
            os.link(tmp, path)
            log.info("made this user's multi-process secret %s", path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    with open(path) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise UserError(f"{path} (the multi-process secret) must be this user's and private (mode 600), "
                            f"it is mode {st.st_mode & 0o777:o} of uid {st.st_uid}: chmod 600 it, or give "
                            f"the secret in ${SECRET_ENV}")
        text = f.read().strip()
    if not text:
        raise UserError(f"{path} (the multi-process secret) is empty: remove it (a new one is made) or set "
                        f"${SECRET_ENV}")
    return text.encode(), str(path)


def _proof(secret: bytes, label: str, leader_nonce: bytes, follower_nonce: bytes, rank: int) -> str:
    msg = b"|".join([b"jaxserve-dist-v1", label.encode(), leader_nonce, follower_nonce, str(rank).encode()])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _nonce(value) -> bytes | None:
    """A 32-byte nonce from its hex, or None for anything else."""
    if not isinstance(value, str) or len(value) != 64:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def _secret_hint(source: str, whose: str = "this rank's") -> str:
    """What a secret mismatch's message says: where `whose` secret came from, and what to do."""
    from_file = source not in ("--dist-secret", f"${SECRET_ENV}")
    if from_file and whose != "this rank's":  # a stranger may read it: no path
        source = "its default file"
    return (f"every rank must be given the same secret (${SECRET_ENV}, or --dist-secret); {whose} came from "
            f"{source}" + (" (made on first use, one per machine and user: ranks on other machines need the "
                           "secret given)" if from_file else ""))


def _same_proof(got, want: str) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got.encode(), want.encode())


@functools.lru_cache(maxsize=8)  # the Leader's socket and jax's coordinator: one look-up, one warning
def bind_address(cfg) -> tuple[int, str]:
    """(address family, IP) rank 0 listens on: --dist-bind-host, else --dist-init-addr's host,
    resolved (an IPv4 address first)."""
    given, port = cfg.address()
    host = str(cfg.bind_host).strip("[] ") if cfg.bind_host else given
    flag = "--dist-bind-host" if cfg.bind_host else "--dist-init-addr's host"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"rank 0 cannot resolve {host!r} ({flag}) to listen on: {e.strerror}") from e
    family, *_, sockaddr = min(infos, key=lambda i: i[0] != socket.AF_INET)
    ip = sockaddr[0]
    if not cfg.bind_host and ipaddress.ip_address(ip).is_loopback and not _is_loopback_name(host):
        log.warning("rank 0 listens on %s only: %r resolves to it here, a loopback address that ranks on other "
                    "machines cannot reach; pass --dist-bind-host with this machine's address (or 0.0.0.0)",
                    ip, host)
    return family, ip


def _is_loopback_name(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host_port(family: int, ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 free on `host`: a --dist-init-addr for ranks on one machine."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((host, p))
                b.bind((host, p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no two adjacent free ports on {host}")


class Admission:
    """Rank 0's side of joining (a mixin of multiprocess.Leader, which sets `cfg`, `_listener`,
    `_secret`, `_secret_source`, `address`, `peers`, `refused` and `_pending`)."""

    def accept(self, timeout: float = CONNECT_TIMEOUT_S, hello_timeout: float = HELLO_TIMEOUT_S) -> None:
        """Waits until every other rank has joined: each connection gets a fresh challenge and has
        `hello_timeout` to answer it with its rank and the proof that it knows the secret. Many
        connections are served at once, so a stranger that stays silent holds nobody up; one that
        fails the handshake is refused (logged with its address, listed in `refused`) and never
        takes a rank's place. RankFailure after `timeout`, naming what was refused."""
        want = set(range(1, self.cfg.nnodes))
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        self._listener.setblocking(False)
        sel.register(self._listener, selectors.EVENT_READ)
        try:
            while set(self.peers) != want:
                now = time.monotonic()
                for sock, h in list(self._pending.items()):
                    if now >= h.deadline:
                        self._refuse(sel, sock, f"no hello within {hello_timeout:g} s of connecting")
                if now >= deadline:
                    raise RankFailure(self._no_show(sorted(want - set(self.peers)), timeout))
                wake = min([deadline, *(h.deadline for h in self._pending.values())])
                for key, _ in sel.select(max(wake - now, 0.0)):
                    if key.fileobj is self._listener:
                        self._admit(sel, time.monotonic() + hello_timeout)  # (select may have waited)
                    else:
                        self._read_hello(sel, key.fileobj, want)
        finally:
            for sock, h in list(self._pending.items()):
                log.warning("rank 0 closed a control connection from %s still in its handshake: the start "
                            "%s without it", h.addr, "went on" if set(self.peers) == want else "stopped")
                sock.close()
            self._pending.clear()
            sel.close()
            self._listener.close()
        self._gone = {r: threading.Event() for r in self.peers}
        self._outstanding = {r: collections.deque() for r in self.peers}
        log.info("rank 0: ranks %s connected", sorted(self.peers))

    def _admit(self, sel, deadline: float) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the next try may do
                log.warning("rank 0 could not accept a control connection: %s", e)
                return
            who = _host_port(sock.family, addr[0], addr[1])
            if len(self._pending) >= MAX_PENDING:
                log.warning("rank 0 refused a control connection from %s: %d others are in their handshake",
                            who, len(self._pending))
                sock.close()
                continue
            h = _Handshake(who, secrets.token_bytes(32), deadline)
            try:
                sock.setblocking(False)
                sock.sendall(encode("challenge", nonce=h.nonce.hex()))  # ~100 bytes: an empty buffer takes it
            except OSError as e:
                log.warning("rank 0 dropped a control connection from %s: %s", who, e)
                sock.close()
                continue
            self._pending[sock] = h
            sel.register(sock, selectors.EVENT_READ)

    def _refuse(self, sel, sock, why: str, tell: str | None = None, secret: bool = False) -> None:
        h = self._pending.pop(sock)
        sel.unregister(sock)
        log.warning("rank 0 refused a control connection from %s: %s", h.addr, why)
        self.refused.append(f"{h.addr}: {why}")
        if tell is not None:
            with_suppressed_oserror(lambda: sock.sendall(encode("refuse", message=tell, secret=secret)))
        sock.close()

    def _read_hello(self, sel, sock, want: set[int]) -> None:
        h = self._pending[sock]
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return self._refuse(sel, sock, f"its connection failed before its hello ({e})")
        if not data:
            return self._refuse(sel, sock, "it closed the connection before its hello")
        h.buf += data
        try:
            frame = split_frame(h.buf, HANDSHAKE_MAX_BYTES)
            if frame is None:
                return
            if frame[2] != len(h.buf):
                raise ValueError("bytes after the frame")
            kind, f = Decoder().decode(frame[0], frame[1])
            if not isinstance(f, dict):
                raise ValueError("not a frame's fields")
        except Exception:  # noqa: BLE001 - whatever it sent, it is not a hello
            return self._refuse(sel, sock, f"it sent {len(h.buf)} bytes that are not a hello "
                                           f"({bytes(h.buf[:16])!r}...)")
        rank, theirs = f.get("rank"), _nonce(f.get("nonce"))
        if kind != "hello" or isinstance(rank, bool) or not isinstance(rank, int) or theirs is None:
            return self._refuse(sel, sock, f"it sent {str(kind)[:20]!r} {list(f)[:5]}, not a hello with a rank, a "
                                "nonce and a proof")
        if not _same_proof(f.get("proof"), _proof(self._secret, "hello", h.nonce, theirs, rank)):
            why = (f"it says it is rank {rank}, but its proof does not match rank 0's secret: a stranger, or a rank "
                   "given another secret")
            return self._refuse(sel, sock, why, tell=f"rank 0 ({self.address}) refused rank {rank}: its answer to the "
                                "challenge does not match rank 0's secret; "
                                + _secret_hint(self._secret_source, whose="rank 0's"), secret=True)
        if rank not in want or rank in self.peers:
            why = (f"rank {rank} is already connected" if rank in self.peers else
                   f"rank {rank} is not a follower rank of --nnodes {self.cfg.nnodes}")
            return self._refuse(sel, sock, why, tell=f"rank 0 ({self.address}) refused rank {rank}: {why}")
        self._pending.pop(sock)
        sel.unregister(sock)
        try:
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(encode("welcome", proof=_proof(self._secret, "welcome", h.nonce, theirs, rank)))
        except OSError as e:
            log.warning("rank 0 lost rank %d's connection from %s as it joined: %s", rank, h.addr, e)
            sock.close()
            return
        self.peers[rank] = sock
        log.info("rank 0: rank %d joined from %s", rank, h.addr)

    def _no_show(self, missing: list[int], timeout: float) -> str:
        message = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not join rank 0's "
                   f"control channel ({self.address}) within {timeout:g} s; ")
        if not self.refused:
            return message + "no other connection came"
        shown = self.refused[-5:]
        more = f" (the last {len(shown)} shown)" if len(self.refused) > len(shown) else ""
        return message + f"rank 0 refused {len(self.refused)} connection(s){more}: " + "; ".join(shown)

@dataclass
class _Handshake:
    """A control connection that has not proved its rank yet."""

    addr: str
    nonce: bytes  # the challenge rank 0 sent it
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


def _handshake_frame(sock: socket.socket) -> tuple[str, dict]:
    kind, f = recv_frame(sock, max_bytes=HANDSHAKE_MAX_BYTES)
    if not isinstance(f, dict):
        raise ValueError("not a frame's fields")
    return kind, f


def with_suppressed_oserror(fn) -> None:
    try:
        fn()
    except OSError:
        pass
