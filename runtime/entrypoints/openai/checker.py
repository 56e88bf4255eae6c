"""Body checkers: a few small processes that run `admission.admit` on large request bodies before
the server does, so that a large bad body (100,000 choices, 125,000 messages: 1-4 MB of JSON whose
parse holds a GIL for ~60 ms) is refused without the server parsing it, and the server's GIL stays
free for normal requests. A body they pass is parsed by the server as usual.

The child is `python -c "...checker import main; main()"`: it imports json, pydantic and the
protocol models (0.2 s), no jax. Over its stdin and stdout: it writes READY once; then for each
body the server writes a frame (!II: header and body lengths, then a JSON header {"model": the
request model's name, "limits": the LIMIT_FIELDS values}, then the raw body) and the child answers
a length-prefixed JSON object, {"ok": true} or {"status", "message", "type", "param", "code"}. It
exits when its stdin closes (the server stopped or died).

Server side, `BodyChecker` keeps `size` children (at a lower CPU priority, CHECKER_NICE) and as many
threads that talk to them (writing and waiting on a pipe release the GIL). A child that dies or
does not answer within `timeout_s` is killed and started again, with one log line; that body is
checked in the server. A child that cannot start (exits with an error before it is ready: a broken
environment) gives its slot up; with none left every body is checked in the server (one log line)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from runtime.entrypoints.openai.admission import LIMIT_FIELDS, admit
from runtime.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                 DetokenizeRequest, TokenizeRequest)

log = logging.getLogger("runtime.serve")

DEFAULT_BODY_CHECKERS = 2  # processes; more bulk bodies than this wait for one
CHECK_TIMEOUT_S = 10.0  # to get a body's answer (json.loads of 4 MB takes ~0.1 s)
READY = b"R"
# The children's scheduling priority below the server's: where cores are few, a flood of large
# bodies slows its own checks (each parse takes 20-100 ms of CPU), not the server's normal requests.
CHECKER_NICE = 10
PIPE_BYTES = 1 << 20  # the pipe buffer asked for (Linux's default cap): 4 writes for a 4 MB body
_FRAME = struct.Struct("!II")
_LEN = struct.Struct("!I")
_ROOT = str(Path(__file__).resolve().parents[3])  # the checkout holding `runtime`, for the child's path
CHILD = "from runtime.entrypoints.openai.checker import main; main()"


# ====================================================================== the child


MODELS = {m.__name__: m for m in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)}


def main() -> None:
    with contextlib.suppress(OSError):
        os.nice(CHECKER_NICE)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # the pipe carries frames only
    out.write(READY)
    out.flush()
    with contextlib.suppress(BrokenPipeError):  # the server went away mid-answer
        while True:
            head = inp.read(_FRAME.size)
            if len(head) < _FRAME.size:
                return  # the server closed the pipe
            nh, nb = _FRAME.unpack(head)
            header = json.loads(inp.read(nh))
            data = json.dumps(answer(inp.read(nb), header["model"], header["limits"])).encode()
            out.write(_LEN.pack(len(data)) + data)
            out.flush()


def answer(raw: bytes, model: str, limits: dict) -> dict:
    """A body's answer: {"ok": True}, or the refusal's status and OpenAI error fields."""
    model_cls = MODELS.get(model)
    if model_cls is not None:
        try:
            admit(raw, model_cls, SimpleNamespace(**limits))
        except APIError as e:
            return {"status": e.status, **e.body()["error"]}
        except Exception:  # noqa: BLE001 - not a refusal: the server's own parse decides
            pass
    return {"ok": True}


# ====================================================================== the server's side


class _Dead(Exception):
    """The child closed its pipe, or did not answer in time."""


class _Child:
    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        # Its own session: a Ctrl-C at the server's terminal is the server's to handle.
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, start_new_session=True, bufsize=0)
        self.ready = False
        self.win, self.rout = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(self.win, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(self.win, False)  # writes wait in select, within the deadline

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, header: bytes, raw: bytes, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        if not self.ready:
            if self._read(1, deadline) != READY:
                raise _Dead("it did not start")
            self.ready = True
        self._write(_FRAME.pack(len(header), len(raw)) + header, deadline)
        self._write(raw, deadline)
        (n,) = _LEN.unpack(self._read(_LEN.size, deadline))
        return json.loads(self._read(n, deadline))

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            if not select.select([], [self.win], [], max(deadline - time.monotonic(), 0))[1]:
                raise _Dead("it took no input in time")
            try:
                view = view[os.write(self.win, view):]
            except BlockingIOError:
                continue
            except OSError as e:  # EPIPE: it exited
                raise _Dead(str(e)) from None

    def _read(self, n: int, deadline: float) -> bytes:
        buf = b""
        while len(buf) < n:
            if not select.select([self.rout], [], [], max(deadline - time.monotonic(), 0))[0]:
                raise _Dead("it did not answer in time")
            chunk = os.read(self.rout, n - len(buf))
            if not chunk:
                raise _Dead("it exited")
            buf += chunk
        return buf

    def end(self, wait_s: float) -> int:
        """Stops it (SIGTERM, then SIGKILL after `wait_s`) and reaps it: its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


class BodyChecker:
    """`size` checker processes (started by `start`, stopped by `close`) and `check`, which answers a
    body's refusal as an APIError, or None when the body passed or no checker could answer (the
    server then checks it itself). Counters: `checked` (answers), `refused`, `fallbacks`."""

    def __init__(self, size: int = DEFAULT_BODY_CHECKERS, timeout_s: float = CHECK_TIMEOUT_S):
        self.size, self.timeout_s = size, timeout_s
        self.children: list[_Child] = []
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._lock = threading.Lock()
        self._threads: ThreadPoolExecutor | None = None
        self._closed = False
        self.checked = self.refused = self.fallbacks = 0

    def start(self) -> None:
        if self.size < 1 or self._threads is not None:
            return
        self._threads = ThreadPoolExecutor(self.size, thread_name_prefix="body-check")
        for _ in range(self.size):
            self._add()

    def _add(self) -> None:
        try:
            child = _Child()
        except (OSError, ValueError, TypeError) as e:  # no executable, no pipes, no processes left
            self._give_up(f"a body checker process could not start: {e!r}")
            return
        with self._lock:
            if not self._closed:
                self.children.append(child)
        if self._closed:
            child.end(0)
            child.close_pipes()
            return
        self._idle.put(child)

    def _give_up(self, why: str) -> None:
        with self._lock:
            left = len(self.children)
        log.warning("%s; %s", why, f"{left} left" if left else "large bodies are checked in the server from now on")

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [c.pid for c in self.children]

    async def check(self, raw: bytes, model_cls, limits):
        """The APIError refusing `raw` as a `model_cls`, or None (passed, or not checked)."""
        if self._threads is None or self._closed or not self.children:
            return None
        header = json.dumps({"model": model_cls.__name__,
                             "limits": {f: getattr(limits, f) for f in LIMIT_FIELDS}}).encode()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, self._check, header, raw)
        except RuntimeError:  # the threads were shut down: the server is stopping
            return None

    def _check(self, header: bytes, raw: bytes):
        try:
            child = self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            self._count("fallbacks")
            return None
        try:
            reply = child.ask(header, raw, self.timeout_s)
        except (_Dead, OSError, ValueError) as e:
            self._count("fallbacks")
            self._replace(child, e)
            return None
        self._idle.put(child)
        self._count("checked")
        if reply.get("ok"):
            return None
        self._count("refused")
        return APIError(reply["status"], reply["message"], param=reply.get("param"), code=reply.get("code"),
                        type=reply.get("type"))

    def _replace(self, child: _Child, why: Exception) -> None:
        try:
            rc = child.proc.wait(0.2)  # it exited (closed its pipes)
        except subprocess.TimeoutExpired:
            rc = None  # alive but silent
        child.end(0)
        child.close_pipes()
        with self._lock:
            if child in self.children:
                self.children.remove(child)
            if self._closed:
                return
        if not child.ready and rc is not None and rc > 0:  # it could not start: another would fail the same way
            self._give_up(f"the body checker process {child.pid} failed to start ({why}; exit status {rc})")
            return
        log.warning("the body checker process %d stopped (%s; exit status %s): started another; this body is "
                    "checked in the server", child.pid, why, rc)
        self._add()

    def close(self) -> None:
        """Stops the processes; a check in flight gets None (its body is checked in the server)."""
        with self._lock:
            self._closed = True
            children, self.children = self.children, []
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        for child in children:
            child.end(1.0)  # a thread talking to it sees its pipes close, and closes them on its side
        while True:
            try:
                self._idle.get_nowait().close_pipes()  # nobody talks to these
            except queue.Empty:
                break
