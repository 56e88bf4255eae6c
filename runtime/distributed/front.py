"""The front of `jaxserve serve --data-parallel-size N`: the one server on the user's --host:--port,
in the launcher's process, over N replicas (each a `jaxserve serve` on 127.0.0.1).

    client ──► front: the API key, body limits and drain of a single server ──► replica i
                      picks i (cache-aware: the replica that served the longest prefix of this prompt)
               /metrics: every replica's, each sample labelled engine="i" (as vLLM labels its
               data-parallel engines); /health: a live replica's

A client cannot tell it from a single `jaxserve serve`: every path goes to a replica with the
client's own bytes and headers, and comes back with the replica's status, body and headers.

Routing (`--router-policy`, SGLang's cache-aware policy in outline): each replica's index holds
the hashes of the prompt prefixes, in blocks of 64 characters (16 ids for token-id prompts), that
were sent to it, least recently used first out. A request goes to the replica matching the
longest prefix if that covers more than half its blocks, else to the least loaded one (the fewest
requests in flight, then the fewest blocks held); a replica with 32 more requests in flight than the
least loaded is passed over whatever it holds. round_robin, power_of_two and random are the
baselines. sglang-router did this before; it is not used because it re-serializes each request
from its own schema and drops the fields it does not know (vLLM's `structured_outputs`,
`return_token_ids`, `prompt_logprobs` in chats), refuses token-id prompts (422) and adds
`access-control-allow-origin: *` to every answer.

Faults: a request whose replica dies (or answers 5xx) before anything reached the client is sent
once more, to another live replica; a stream that breaks after its first event ends with an error
event and `data: [DONE]`. A stream is answered once the replica's first event arrived, so that a
request waiting in a dead replica's queue can still move.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.entrypoints.openai.http_server import Gate
from runtime.entrypoints.openai.protocol import APIError, dumps
from runtime.entrypoints.openai.translation import error_response
from runtime.entrypoints.openai.serving import (BULK_BODY_BYTES, ServerConfig, _SSEResponse, _until_disconnect,
                                                read_body)

log = logging.getLogger("runtime.front")

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# The paths routed on their prompt, and the field that holds it.
ROUTED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
BLOCK_CHARS = 64  # a prefix block of a text prompt (about 16 tokens)
BLOCK_IDS = 16  # of a token-id prompt
CACHE_THRESHOLD = 0.5  # the share of a prompt's blocks a replica must hold to get it for its cache
BALANCE_ABS = 32  # requests in flight beyond the least loaded replica's: passed over
MAX_BLOCKS = 1 << 16  # per replica's index (4M characters of prompts), least recently used out
# Headers that belong to one hop (and those uvicorn writes itself).
HOP_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-connection", "content-length"}
DROPPED_RESPONSE_HEADERS = HOP_HEADERS | {"date", "server"}
METRICS_LABEL = "engine"
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)


@dataclass(frozen=True)
class Upstream:
    """A replica as the front sees it."""

    index: int
    url: str


class Router:
    """Picks a replica for a request (see the module's doc); `load` counts requests in flight."""

    def __init__(self, policy: str = "cache_aware", seed: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.load: Counter = Counter()
        self.index: dict[int, OrderedDict] = {}
        self._turn = 0
        self._rng = random.Random(seed)

    def least_loaded(self, live: list[Upstream]) -> Upstream:
        return min(live, key=lambda r: (self.load[r.index], r.index))

    def choose(self, live: list[Upstream], blocks: list[int]) -> Upstream:
        if self.policy == "round_robin":
            self._turn += 1
            return live[self._turn % len(live)]
        if self.policy == "random":
            return self._rng.choice(live)
        if self.policy == "power_of_two":
            return self.least_loaded(self._rng.sample(live, min(2, len(live))))
        # A prompt no replica holds goes to the least loaded one, and among those to the one holding
        # the fewest blocks, so that the prefixes spread over the replicas' caches.
        pick = min(live, key=lambda r: (self.load[r.index], len(self.index.get(r.index, ())), r.index))
        if blocks and all(self.load[r.index] - self.load[pick.index] <= BALANCE_ABS for r in live):
            matched, best = max(((self.matched(r.index, blocks), -self.load[r.index], -r.index), r) for r in live)
            if matched[0] > CACHE_THRESHOLD * len(blocks):
                pick = best
        self.remember(pick.index, blocks)
        return pick

    def matched(self, replica: int, blocks: list[int]) -> int:
        held = self.index.get(replica)
        n = 0
        while held and n < len(blocks) and blocks[n] in held:
            n += 1
        return n

    def remember(self, replica: int, blocks: list[int]) -> None:
        held = self.index.setdefault(replica, OrderedDict())
        for b in blocks:
            held[b] = None
            held.move_to_end(b)
        while len(held) > MAX_BLOCKS:
            held.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica that restarted holds nothing in its prefix cache."""
        self.index.pop(replica, None)


def prefix_blocks(path: str, obj) -> list[int]:
    """The chained hashes of a request's prompt prefix, a block at a time (empty if it has none, or
    a batch of prompts, which spreads over the replica's cache anyway)."""
    if not isinstance(obj, dict):
        return []
    v = obj.get(ROUTED[path])
    if path == "/v1/chat/completions":
        if not isinstance(v, list):
            return []
        v = json.dumps(v, ensure_ascii=False, separators=(",", ":"))[:-1]  # a conversation extends it
    elif isinstance(v, list) and len(v) == 1:
        v = v[0]
    if isinstance(v, str):
        size, key = BLOCK_CHARS, v
    elif isinstance(v, list) and v and all(isinstance(t, int) for t in v):
        size, key = BLOCK_IDS, tuple(v)
    else:
        return []
    out, h = [], 0
    for i in range(0, len(key) - size + 1, size):
        h = hash((h, key[i:i + size]))
        out.append(h)
    return out


class Front:
    """The ASGI app's state: `replicas()` lists the replicas in rotation now (not one that died);
    `every()` all of them, for /metrics."""

    def __init__(self, cfg: ServerConfig, replicas: Callable[[], list[Upstream]],
                 every: Callable[[], list[Upstream]] | None = None, policy: str = "cache_aware"):
        self.cfg = cfg
        self.replicas = replicas
        self.every = every or replicas
        self.router = Router(policy)
        self.draining = False  # the gate's 503s, as a single server's
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the serving event loop
            self._client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT, limits=httpx.Limits(
                max_connections=self.cfg.max_connections, max_keepalive_connections=64))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ------------------------------------------------------------ requests

    async def handle(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if method == "GET" and path == "/metrics":
            return await self.metrics()
        if method == "GET" and path == "/health":
            return await self.health()
        body, blocks = b"", []
        if method == "POST" and path in ROUTED:
            body = await read_body(request, self.cfg)  # the server's 415, 413, 408
            blocks = await _blocks(path, body)
        elif method in ("POST", "PUT", "PATCH"):
            body = await read_body(request, self.cfg, json_only=False)
        target = path + (f"?{request.url.query}" if request.url.query else "")
        headers = _request_headers(request)
        return await _until_disconnect(request, self.forward(method, target, body, headers, blocks))

    async def forward(self, method: str, target: str, body: bytes, headers: list, blocks: list[int]) -> Response:
        """To the replica the router picks; once more, to another live replica, when the first
        answer failed before anything was sent to the client."""
        tried: set[int] = set()
        reason, failed = "no replica is serving (they are starting or restarting)", None
        for attempt in (0, 1):
            live = [r for r in self.replicas() if r.index not in tried]
            if not live:
                break
            replica = self.router.choose(live, blocks) if attempt == 0 else self.router.least_loaded(live)
            tried.add(replica.index)
            self.router.load[replica.index] += 1
            out = None
            try:
                out = await self._once(method, replica.url + target, body, headers)
            finally:
                if not isinstance(out, _Streaming):  # a stream's request ends when its response closes
                    self.router.load[replica.index] -= 1
            if isinstance(out, _Streaming):
                return out.response(self.router, replica)
            if not isinstance(out, _Failed):
                return out
            reason, failed = f"replica {replica.index}: {out.reason}", out.response
            if attempt == 0:
                log.warning("%s %s failed before its answer began (%s): sending it once more", method, target,
                            reason)
        if failed is not None:  # the replica's own 5xx
            return failed
        raise APIError(502 if tried else 503, f"no replica could answer: {reason}", code="replica_failed")

    async def _once(self, method: str, url: str, body: bytes, headers: list):
        """One try: a Response, a _Streaming (its first event arrived), or _Failed."""
        client = self.client
        try:
            up = await client.send(client.build_request(method, url, content=body, headers=headers), stream=True)
        except httpx.TransportError as e:
            return _Failed(type(e).__name__ + (f": {e}" if str(e) else ""))
        try:
            if not (up.status_code == 200 and up.headers.get("content-type", "").startswith("text/event-stream")):
                content = await up.aread()
                if up.status_code >= 500:
                    return _Failed(f"HTTP {up.status_code}", _response(up, content))
                return _response(up, content)
            chunks = up.aiter_raw()
            first = b""
            while not first:  # the replica's first event: its request is running
                first = await chunks.__anext__()
            streaming, up = _Streaming(up, chunks, first), None
            return streaming
        except (httpx.TransportError, StopAsyncIteration) as e:
            return _Failed(f"the connection closed before the answer ({type(e).__name__})")
        finally:
            if up is not None:
                await up.aclose()

    # ------------------------------------------------------------ /health, /metrics

    async def health(self) -> Response:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        live = self.replicas()
        if not live:
            raise APIError(503, "no replica is serving (they are starting or restarting)", code="no_replica")
        replica = self.router.least_loaded(live)
        try:
            r = await self.client.get(replica.url + "/health", timeout=10)
        except httpx.TransportError as e:
            raise APIError(503, f"replica {replica.index} did not answer /health ({type(e).__name__})",
                           code="no_replica") from None
        return _response(r, r.content)

    async def metrics(self) -> Response:
        async def one(r: Upstream):
            try:
                resp = await self.client.get(r.url + "/metrics", timeout=10)
                return (r.index, resp.text) if resp.status_code == 200 else None
            except httpx.TransportError:
                return None  # a replica that is restarting: its samples are missing from this scrape

        texts = [t for t in await asyncio.gather(*(one(r) for r in self.every())) if t is not None]
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(merge_metrics(texts).encode(), 200, media_type=CONTENT_TYPE_LATEST)


class _Failed:
    def __init__(self, reason: str, response: Response | None = None):
        self.reason, self.response = reason, response


class _Streaming:
    """An SSE answer whose first event arrived: relayed as it comes; a break ends it with an error event."""

    def __init__(self, up: httpx.Response, chunks, first: bytes):
        self.up, self.chunks, self.first = up, chunks, first

    def response(self, router: Router, replica: Upstream) -> Response:
        up, chunks, first = self.up, self.chunks, self.first

        async def relay():
            tail = first[-64:]
            try:
                yield first
                broke = "closed"
                try:
                    async for chunk in chunks:
                        tail = (tail + chunk)[-64:]
                        yield chunk
                except httpx.TransportError as e:
                    broke = type(e).__name__
                if not tail.rstrip().endswith(b"data: [DONE]"):
                    why = f"replica {replica.index} stopped before the end of this stream ({broke})"
                    log.warning("%s", why)
                    yield b"data: " + dumps(APIError(502, why, code="replica_failed").body()) + b"\n\n"
                    yield b"data: [DONE]\n\n"
            finally:
                await up.aclose()

        def closed():
            router.load[replica.index] -= 1

        return _SSEResponse(relay(), closed)


def _response(up: httpx.Response, content: bytes) -> Response:
    headers = {k: v for k, v in up.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}
    return Response(content, up.status_code, headers=headers)


def _request_headers(request: Request) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in request.scope["headers"] if k.decode("latin-1").lower() not in HOP_HEADERS]
    if request.client is not None:
        out.append((b"x-forwarded-for", request.client[0].encode()))
    return out


async def _blocks(path: str, raw: bytes) -> list[int]:
    """The prompt's prefix blocks; none for a body that is not JSON (its replica says why)."""
    def parse():
        try:
            return prefix_blocks(path, json.loads(raw))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return []

    return parse() if len(raw) < BULK_BODY_BYTES else await asyncio.to_thread(parse)


def merge_metrics(texts: list[tuple[int, str]]) -> str:
    """The replicas' Prometheus texts as one: each family once (its HELP and TYPE from the first
    replica that has it), each sample with `engine="i"` added."""
    families: dict[str, tuple[list[str], list[str]]] = {}

    def family(name: str):
        if name not in families:
            families[name] = ([], [])
        return families[name]

    for index, text in texts:
        current = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                parts = line.split(" ", 3)
                current = family(parts[2])
                if not any(m.startswith(line[:7]) for m in current[0]):
                    current[0].append(line)
            elif line.strip() and not line.startswith("#"):
                if current is None:
                    current = family(line.split("{", 1)[0].split(" ", 1)[0])
                current[1].append(_labelled(line, index))
    out = []
    for meta, samples in families.values():
        out += meta + samples
    return "\n".join(out) + "\n" if out else ""


def _labelled(sample: str, index: int) -> str:
    """`name{a="b"} v` -> `name{engine="i",a="b"} v`; `name v` -> `name{engine="i"} v`."""
    brace, space = sample.find("{"), sample.find(" ")
    label = f'{METRICS_LABEL}="{index}"'
    if 0 <= brace < space or (brace >= 0 and space < 0):
        rest = sample[brace + 1:]
        return f"{sample[:brace]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


def build_front_app(front: Front) -> Starlette:
    """The ASGI app: the single server's gate (API key on the same paths, 503 while draining), then
    `Front.handle` for every path."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await front.aclose()

    async def api_error(request, exc: APIError):  # in Anthropic's shape on /v1/messages, as the replicas answer
        return error_response(exc, request.url.path)

    async def server_error(request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return error_response(APIError(500, f"internal server error: {exc!r}", code="internal_error"),
                              request.url.path)

    app = Starlette(routes=[Route("/{path:path}", front.handle, methods=METHODS)], lifespan=lifespan,
                    exception_handlers={APIError: api_error, Exception: server_error})
    app.add_middleware(Gate, server=front)
    app.state.server = front  # the uvicorn settings (connections, timeouts) come from front.cfg
    return app
