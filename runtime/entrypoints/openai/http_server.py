"""The HTTP layer every jaxserve server shares, the single server's and the --data-parallel-size
front's (runtime/distributed/front.py): the gate (API key and drain checks before any handler), uvicorn with
llhttp and the guards it lacks against slow or numerous clients, and a server in a thread."""

from __future__ import annotations

import contextlib
import hmac
import logging
import threading
import time
from http import HTTPStatus

from runtime.entrypoints.openai.protocol import APIError
from runtime.entrypoints.openai.serving import PROTOCOL_ERROR_KEY, ServerConfig, peer
from runtime.entrypoints.openai.translation import error_response

log = logging.getLogger("runtime.serve")

MAX_HEADER_BYTES = 64 << 10  # a request head larger than this gets 431


class Gate:
    """ASGI middleware: API key and shutdown checks before any handler runs. `server`: anything with
    `draining` and a ServerConfig `cfg` (the Server, or the front)."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, server):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            s = self.server
            err = None
            if s.draining and path not in ("/metrics", "/health"):
                err = APIError(503, "the server is shutting down", code="server_shutting_down",
                               headers={"Retry-After": str(s.cfg.retry_after_s)})
            elif s.cfg.api_key and path.startswith(self.PROTECTED):
                auths = [v for k, v in scope["headers"] if k == b"authorization"]
                keys = [v for k, v in scope["headers"] if k == b"x-api-key"]  # Anthropic's clients send this
                if len(auths) > 1 or len(keys) > 1:  # which one a proxy checked is anyone's guess
                    err = APIError(400, "more than one Authorization or x-api-key header", code="invalid_api_key")
                elif not (bearer_matches(auths[0] if auths else b"", s.cfg.api_key)
                          or (keys and hmac.compare_digest(keys[0], s.cfg.api_key.encode()))):
                    err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or "
                                   "'x-api-key: <key>'", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if err is not None:
                await error_response(err, path)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bearer_matches(value: bytes, key: str) -> bool:
    """`Bearer KEY`: the scheme in any case and one or more spaces after it (RFC 9110 11.4); the key
    exactly, trailing whitespace included."""
    scheme, sep, token = value.decode("latin-1").partition(" ")
    return bool(sep) and scheme.lower() == "bearer" and hmac.compare_digest(token.lstrip(" ").encode("latin-1"),
                                                                            key.encode())


class UvicornServer:
    """uvicorn.Server without its own signal handling: SIGTERM/SIGINT drain (see `serve`)."""

    def __new__(cls, config):
        import uvicorn

        class S(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return S(config)


def _guarded_protocol(header_timeout_s: float, max_connections: int):
    """uvicorn's llhttp (httptools) protocol, which holds requests to RFC 9112 where h11 is lenient
    (a body framed by both Transfer-Encoding and Content-Length, the request-smuggling shape; bare-LF
    line endings; bad chunk sizes), plus what it lacks against slow or numerous clients:
    connections past `max_connections` are closed at accept; one that has not sent a full request
    head within `header_timeout_s` (of connecting, or of its previous response) is closed; a head
    over MAX_HEADER_BYTES gets 431. A malformed request is one log line, not a traceback; an
    Authorization value keeps its trailing whitespace, so the key must match exactly."""
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHTTPProtocol(HttpToolsProtocol):
        _header_timer = None
        _in_head = True  # the bytes received now belong to a request head
        _head_bytes = 0  # the URL and headers parsed so far
        _pending_head_bytes = 0  # received while the head is still incomplete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("%d connections open (limit %d): closing a new one", len(self.connections) - 1,
                            max_connections)
                transport.close()
                return
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _header_timeout(self) -> None:
            # A request whose head arrived has a live cycle; its body has the body timeout.
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as e:
                if self._head_bytes > MAX_HEADER_BYTES:  # on_header stopped the parser
                    self._refuse(431, f"the request head is larger than {MAX_HEADER_BYTES} bytes")
                else:
                    self._refuse(400, f"malformed HTTP request: {e}")
                return
            except httptools.HttpParserUpgrade:  # as uvicorn's own
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            if self._in_head:  # still no end of the head (llhttp itself keeps no limit)
                self._pending_head_bytes += len(data)
                if self._pending_head_bytes > MAX_HEADER_BYTES:
                    self._refuse(431, f"the request head is larger than {MAX_HEADER_BYTES} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._pending_head_bytes = True, 0, 0

        def on_url(self, url: bytes) -> None:
            self._head_bytes += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_bytes += len(name) + len(value) + 4
            if self._head_bytes > MAX_HEADER_BYTES:
                raise ValueError("request head too large")  # feed_data raises; data_received answers 431
            super().on_header(name, value)
            if self.headers[-1][0] == b"authorization":
                self.headers[-1] = (b"authorization", value)  # as sent: "Bearer KEY " is not KEY

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def _refuse(self, status: int, reason: str) -> None:
            """One line in the log and an error body, then the connection closes. When the request's
            head had arrived, its handler (reading the body) writes that line, with this reason."""
            cycle = self.cycle
            in_flight = cycle is not None and not cycle.response_complete
            if in_flight:
                cycle.scope[PROTOCOL_ERROR_KEY] = reason
            else:
                log.warning("refused a request from %s: %s", peer(self.client), reason)
            if in_flight and cycle.response_started:  # no second answer after one begun
                self.transport.close()
                return
            body = APIError(status, reason, code="bad_http_request").response().body
            head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n"
            self.transport.write(head % (status, HTTPStatus(status).phrase.encode(), len(body)) + b"\r\n" + body)
            self.transport.close()

    return GuardedHTTPProtocol


def uvicorn_config(app, host: str, port: int, **kwargs):
    import uvicorn

    server = getattr(getattr(app, "state", None), "server", None)
    cfg = server.cfg if server is not None else ServerConfig([])  # another ASGI app: the defaults
    return uvicorn.Config(app, host=host, port=port, lifespan="on", timeout_graceful_shutdown=2,
                          http=_guarded_protocol(cfg.header_timeout_s, cfg.max_connections),
                          limit_concurrency=cfg.max_connections + 1, timeout_keep_alive=cfg.keep_alive_timeout_s,
                          **kwargs)


class ServerThread:
    """Runs an app on uvicorn in a background thread (tests, benchmarks). `url` once `start()` returns."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.host = host
        self.server = UvicornServer(uvicorn_config(app, host, port, log_level=log_level, access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.port: int | None = None

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
