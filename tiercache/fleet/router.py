"""`tiercache route`: an OpenAI-compatible router that sends each request where its prefix is cheapest to serve.

Router side, one asyncio event loop. A request passes through in one way:
authenticate (`Tenants`: the API key's tenant and its cache salt) → parse
and tokenize as its model's replicas do (their tokenizer, their chat
template) → hash it per replica key scheme → rank the replicas with the
policy (`routing`) over what each holds (`ReplicaIndex`, kept from KV events)
and what it is doing (its `ReplicaLoad`) → forward to the best, streaming the
answer back as it arrives; a replica that cannot be reached before it
answered is marked down and the next one is tried. The router never touches
KV bytes.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), ``POST
/v1/score`` (the ranking alone, for a gateway that proxies itself), and
``GET/POST /admin/replicas``, ``DELETE /admin/replicas/{name}`` (with the
admin key) to change the fleet at run time.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tiercache.engine.openai_api import (
    ApiError,
    Encodes,
    cache_salt_of,
    chat_prompt,
    completion_prompt,
    json_body,
    openai_errors,
    run_event_loop,
    serve_app,
)
from tiercache.errors import ConfigError
from tiercache.fleet.descriptor import GivenDescriptor
from tiercache.fleet.prefix_index import PromptKeys
from tiercache.fleet.replicas import Fleet, Replica, ReplicaEntry
from tiercache.fleet.routing import Policy, Ranked, ReplicaRates, prefer_session_replica, routing_policies
from tiercache.fleet.tenants import RoutedTenant, Tenants, Unauthorized

log = logging.getLogger(__name__)

RESPONSE_HEADERS = ("Content-Type", "Cache-Control")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "expected-ttft"
    health_interval_s: float = 2.0
    prefill_tokens_per_s: float = 20_000.0    # until the replica (its descriptor) or the router times its own
    load_tokens_per_s: tuple[tuple[str, float], ...] = (("CPU", 400_000.0), ("DISK", 150_000.0),
                                                        ("REMOTE", 100_000.0))
    per_request_s: float = 0.002
    attempts: int = 3                         # replicas tried for one request before 503
    admin_key: str = ""
    sticky_sessions: bool = False             # a session's requests stay on the replica that served its last

    def rates(self) -> ReplicaRates:
        return ReplicaRates(self.prefill_tokens_per_s, dict(self.load_tokens_per_s), self.per_request_s)


MAX_SESSIONS = 1 << 16      # sessions remembered for sticky routing, least recently used forgotten first


class Sessions:
    """Which replica served each (tenant, session) last: a bounded map, least recently used forgotten first."""

    def __init__(self, limit: int = MAX_SESSIONS) -> None:
        self.limit = limit
        self._replica: OrderedDict[tuple[str, str], str] = OrderedDict()

    def get(self, key: tuple[str, str]) -> str | None:
        replica = self._replica.get(key)
        if replica is not None:
            self._replica.move_to_end(key)
        return replica

    def put(self, key: tuple[str, str], replica: str) -> None:
        self._replica[key] = replica
        self._replica.move_to_end(key)
        while len(self._replica) > self.limit:
            self._replica.popitem(last=False)

    def __len__(self) -> int:
        return len(self._replica)


def session_of(request, body: dict) -> str | None:
    """The request's session (vLLM's ``session_id`` field, else its ``X-Session-ID`` header), if any."""
    session = body.get("session_id")
    if isinstance(session, str) and session:
        return session
    return request.headers.get("X-Session-ID") or None


@dataclass(frozen=True, slots=True)
class Routed:
    """One request, checked and ranked."""
    tenant: RoutedTenant
    body: dict
    prompt_tokens: int
    ranking: list[Ranked]
    session: tuple[str, str] | None = None    # (tenant, session id) when sessions are sticky
    blocks: dict[str, list[bytes]] = field(default_factory=dict)   # per replica: its pool blocks of the prompt


@dataclass(frozen=True, slots=True)
class WorkAhead:
    """What was ahead of a request on its replica when it was sent: the prefill still pending there, and the
    requests in flight — this router's and those the replica reported beyond them (none: the replica was idle,
    and its first token measures the prefill alone)."""
    prefill_s: float
    running: int


class Router:
    def __init__(self, fleet: Fleet, tenants: Tenants, policy: Policy, config: RouterConfig) -> None:
        self.fleet = fleet
        self.tenants = tenants
        self.policy = policy
        self.config = config
        self.failovers = 0
        self.unrouted = 0
        self.sessions = Sessions()
        self.sticky_routed = 0      # requests sent first to the replica their session was on

    def _encoder(self, replicas: list[Replica]) -> Encodes | None:
        return next((r.encoder for r in replicas if r.encoder is not None), None)

    def route(self, tenant: RoutedTenant, body: dict, prompt_of: Callable[[Encodes, dict], list[int]],
              session: str | None = None) -> Routed:
        """Check, tokenize and rank one request (``body`` gets the tenant's cache salt); with sticky sessions, the
        replica ``session`` was last served by goes first (`prefer_session_replica`)."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError("model must be a string", "model")
        replicas = self.fleet.up(model)
        if not replicas:
            if model is not None and self.fleet.up(None):
                raise ApiError(f"The model `{model}` does not exist.", "model", 404, code="model_not_found")
            raise ApiError("no replica is up", status=503, kind="service_unavailable")
        if tenant.cache_salt:
            body["cache_salt"] = tenant.cache_salt     # the tenant's, whatever the client sent
        salt = cache_salt_of(body)
        encoder = self._encoder(replicas)
        tokens = prompt_of(encoder, body) if encoder is not None else []
        hashed: dict[tuple, PromptKeys] = {}     # replicas that chain alike share one hashing
        candidates, blocks = [], {}
        for replica in replicas:
            prompt = None
            if replica.scheme is not None and tokens:
                signature = replica.scheme.signature
                if signature not in hashed:
                    hashed[signature] = replica.scheme.keys(tokens, salt)
                prompt = hashed[signature]
                blocks[replica.name] = prompt.block_hashes
            shared = [r.index.media.get("REMOTE") for r in replicas if replica.shares_with(r)]
            candidates.append(replica.candidate(prompt, len(tokens), [s for s in shared if s]))
        ranking = self.policy.rank(candidates)
        key = (tenant.name, session) if session and self.config.sticky_sessions else None
        if key is not None:
            ranking = prefer_session_replica(ranking, self.sessions.get(key))
        return Routed(tenant, body, len(tokens), ranking, key, blocks)

    # -- forwarding -----------------------------------------------------------------------------------
    async def forward(self, request, path: str, routed: Routed):
        from aiohttp import ClientConnectionError, ClientPayloadError, web

        for ranked in routed.ranking[:self.config.attempts]:
            replica = self.fleet.replicas.get(ranked.name)
            if replica is None or not replica.up:
                continue
            if routed.session is not None:
                if ranked is routed.ranking[0] and self.sessions.get(routed.session) == replica.name:
                    self.sticky_routed += 1
                self.sessions.put(routed.session, replica.name)
            load = replica.load
            uncached, prefill_s = max(routed.prompt_tokens - ranked.cached_tokens, 0), ranked.prefill_s
            now = time.monotonic()
            ahead = WorkAhead(load.waiting_prefill_s(now) + load.foreign_prefill_s(), load.in_flight + load.foreign)
            load.sent(uncached, prefill_s, routed.prompt_tokens, now)
            blocks = routed.blocks.get(replica.name, ())
            replica.index.hold(blocks)
            started, first = time.perf_counter(), None
            try:
                async with self.fleet.session.post(f"{replica.url}{path}", json=routed.body,
                                                   headers=_forwarded_headers(request)) as resp:
                    if routed.body.get("stream") is True and resp.status == 200:
                        out = web.StreamResponse(status=resp.status, headers=_answer_headers(resp, replica, ranked))
                        if not await _to_client(out.prepare(request)):
                            return out                # the client left: leaving the block drops the replica's answer
                        tail = b""
                        try:
                            async for data in resp.content.iter_any():
                                if first is None:
                                    first = time.perf_counter()
                                    load.prefilled(uncached, prefill_s, time.monotonic())
                                    uncached, prefill_s = 0, 0.0
                                if not await _to_client(out.write(data)):
                                    return out
                                tail = (tail + data)[-8192:]
                        except (ClientConnectionError, ClientPayloadError) as err:
                            # the answer was already streaming: it cannot move; the client sees its stream end
                            load.failures += 1
                            log.warning("tiercache route: %s failed mid-stream (%s)", replica.name, err)
                            self.fleet.mark_down(replica)
                            return out
                        self._record(replica, ranked, _usage_from_stream(tail), first and first - started, ahead)
                        await _to_client(out.write_eof())   # a client that closed after the last event: done
                        return out
                    data = await resp.read()
                    first = time.perf_counter()
                    self._record(replica, ranked, _usage_from_json(data) if resp.status == 200 else None,
                                 None, ahead)
                    return web.Response(body=data, status=resp.status, headers=_answer_headers(resp, replica, ranked))
            except (ClientConnectionError, ClientPayloadError) as err:     # refused, reset, cut before it answered
                load.failures += 1
                self.failovers += 1
                log.warning("tiercache route: %s failed before answering (%s); trying the next replica",
                            replica.name, err)
                self.fleet.mark_down(replica)
            finally:
                load.finished(uncached, prefill_s, time.monotonic())
                replica.index.release(blocks)
        self.unrouted += 1
        raise ApiError("no replica could take the request", status=503, kind="service_unavailable")

    def _record(self, replica: Replica, ranked: Ranked, usage: dict | None, ttft_s: float | None,
                ahead: WorkAhead) -> None:
        if usage is None:
            return
        details = usage.get("prompt_tokens_details") or {}
        reported = details.get("cached_tokens")
        prompt_tokens = usage.get("prompt_tokens")
        if not isinstance(reported, int) or not isinstance(prompt_tokens, int):
            return
        load = replica.load
        load.predicted_cached += ranked.cached_tokens
        load.reported_cached += reported
        load.prediction_error += abs(ranked.cached_tokens - reported)
        load.reported_prompt += prompt_tokens
        if ttft_s is None:
            return
        if not ahead.running:
            # what the cached part took to load, where the router knew which tiers held it (its prediction held)
            loads_s = ranked.load_s if reported == ranked.cached_tokens else 0.0
            replica.learn_prefill(prompt_tokens - reported, reported, ttft_s - loads_s)
        elif reported == ranked.cached_tokens:          # its own work as estimated is what it had to do
            replica.learn_running(ttft_s - ranked.prefill_s - ranked.load_s - ahead.prefill_s, ahead.running)


async def _to_client(write: Awaitable) -> bool:
    """Await a write to the client; False when the client has closed its end. aiohttp raises that as
    `ClientConnectionResetError`, a `ClientConnectionError` like a replica's failures: caught here, it is never
    taken for the replica's, so a client that closes its connection once it has read the last event (the openai
    client does) does not mark a replica that answered in full as down."""
    try:
        await write
    except ConnectionResetError:
        return False
    return True


def _forwarded_headers(request) -> dict[str, str]:
    """What a replica is told beside the body: the request's id and its session (vLLM's ``X-Session-ID``: the
    replica's tiers keep a session's chunks for its next turn)."""
    headers = {"Content-Type": "application/json", "X-Request-Id": request.headers.get("X-Request-Id", "")}
    session = request.headers.get("X-Session-ID")
    if session:
        headers["X-Session-ID"] = session
    return headers


def _answer_headers(resp, replica: Replica, ranked: Ranked) -> dict[str, str]:
    """The replica's content headers, and where the request went and what the router expected of it there (as
    llm-d's and the inference gateway's pickers name the endpoint they chose): a client or a benchmark can
    line up each answer's time to first token with its prediction."""
    headers = {k: resp.headers[k] for k in RESPONSE_HEADERS if k in resp.headers}
    headers["X-Tiercache-Replica"] = replica.name
    headers["X-Tiercache-Expected-TTFT-Ms"] = f"{ranked.expected_ttft_s * 1e3:.1f}"
    if ranked.reason:
        headers["X-Tiercache-Route-Reason"] = ranked.reason
    headers["X-Tiercache-Predicted-Cached-Tokens"] = str(ranked.cached_tokens)
    return headers


def _usage_from_json(data: bytes) -> dict | None:
    with contextlib.suppress(ValueError, AttributeError):
        usage = json.loads(data).get("usage")
        return usage if isinstance(usage, dict) else None
    return None


def _usage_from_stream(tail: bytes) -> dict | None:
    """The usage a stream's last events carry (``stream_options.include_usage``), if any."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = _usage_from_json(line[6:])
            if usage is not None:
                return usage
    return None


def build_app(router: Router):
    """The router's aiohttp application: the OpenAI routes and the ranking, the status routes, the admin routes."""
    from aiohttp import web

    app = web.Application(middlewares=[openai_errors("tiercache route")])
    _add_request_routes(app, router)
    _add_status_routes(app, router)
    _add_admin_routes(app, router)
    return app


def _tenant_of(router: Router, request) -> RoutedTenant:
    """The request's tenant by its API key (401 without a known one, where the router has tenants)."""
    try:
        return router.tenants.authenticate(request.headers.get("Authorization"))
    except Unauthorized as err:
        raise ApiError(str(err), status=401, code="invalid_api_key") from None


def _add_request_routes(app, router: Router) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions`` (routed and forwarded), ``POST /v1/score`` (the
    ranking alone) and ``GET /v1/models``: what a tenant asks, each behind its API key."""
    from aiohttp import web

    async def generate(request, path: str, prompt_of):
        tenant = _tenant_of(router, request)
        body = await json_body(request)
        routed = router.route(tenant, body, prompt_of, session_of(request, body))
        return await router.forward(request, path, routed)

    async def completions(request):
        return await generate(request, "/v1/completions", completion_prompt)

    async def chat_completions(request):
        return await generate(request, "/v1/chat/completions", chat_prompt)

    async def score(request):
        tenant = _tenant_of(router, request)
        body = await json_body(request)
        prompt_of = chat_prompt if "messages" in body else completion_prompt
        routed = router.route(tenant, body, prompt_of, session_of(request, body))
        return web.json_response({"object": "score", "policy": router.config.policy,
                                  "prompt_tokens": routed.prompt_tokens,
                                  "replicas": [r.as_dict() for r in routed.ranking]})

    async def models(request):
        _tenant_of(router, request)
        now = int(time.time())
        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "created": now, "owned_by": "tiercache"} for m in router.fleet.models()]})

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/score", score)
    app.router.add_get("/v1/models", models)


def _add_status_routes(app, router: Router) -> None:
    """``GET /health`` (503 while no replica is up) and ``GET /metrics`` (Prometheus), open to anyone."""
    from aiohttp import web

    async def health(request):
        up = router.fleet.up(None)
        return web.json_response({"status": "ok" if up else "no replica up", "replicas_up": len(up)},
                                 status=200 if up else 503)

    async def metrics(request):
        from prometheus_client import generate_latest

        from tiercache.fleet.router_metrics import registry_for
        return web.Response(body=generate_latest(registry_for(router)),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)


def _check_admin(router: Router, request) -> None:
    """Let the request through only with the router's admin key (403 where the router has none)."""
    import hmac

    key = router.config.admin_key
    given = request.headers.get("Authorization", "").partition(" ")[2].strip()
    if not key:
        raise ApiError("the admin routes are off (start the router with --admin-key)", status=403)
    if not hmac.compare_digest(key.encode(), given.encode()):
        raise ApiError("the admin key is not valid", status=401, code="invalid_api_key")


def _add_admin_routes(app, router: Router) -> None:
    """``GET/POST /admin/replicas`` and ``DELETE /admin/replicas/{name}``: the fleet changed at run time, with
    the admin key."""
    from aiohttp import web

    async def list_replicas(request):
        _check_admin(router, request)
        return web.json_response({"replicas": [_replica_state(r) for r in router.fleet.replicas.values()]})

    async def add_replica(request):
        _check_admin(router, request)
        body = await json_body(request)
        url = body.get("url")
        if not isinstance(url, str):
            raise ApiError("url must be a replica's base URL", "url")
        try:
            fields = body.get("descriptor")
            given = None
            if fields is not None:
                if not isinstance(fields, dict):
                    raise ApiError("descriptor must be an object", "descriptor")
                given = GivenDescriptor(fields, source="descriptor")
                given.read()
            replica = await router.fleet.add(url, given)
        except ConfigError as err:
            raise ApiError(str(err), "descriptor" if "descriptor" in str(err) else "url") from None
        return web.json_response(_replica_state(replica), status=201)

    async def remove_replica(request):
        _check_admin(router, request)
        name = request.match_info["name"]
        if not await router.fleet.remove(name):
            raise ApiError(f"no replica {name!r} in the fleet", status=404)
        return web.json_response({"removed": name})

    app.router.add_get("/admin/replicas", list_replicas)
    app.router.add_post("/admin/replicas", add_replica)
    app.router.add_delete("/admin/replicas/{name}", remove_replica)


def _replica_state(replica: Replica) -> dict:
    d = replica.descriptor
    follower = replica.follower
    return {"name": replica.name, "url": replica.url, "up": replica.up,
            "model": d.model if d else None, "instance": d.instance if d else None,
            "indexed": follower is not None, "index_keys": replica.index.num_keys(),
            "in_flight": replica.load.in_flight, "pending_prefill_tokens": replica.load.pending_prefill,
            "events": follower.counters.as_dict() if follower else None,
            "prefill_tokens_per_s": round(replica.rates.prefill, 1),
            "prefill_attention_ns_per_pair": round(replica.rates.attention_s * 1e9, 3),
            "running_request_ms": round(replica.rates.per_request_s * 1e3, 3),
            "foreign_requests": replica.load.foreign,
            "load_tokens_per_s": {m: round(r, 1) for m, r in replica.rates.load.items()}}


def serve(replicas: list[ReplicaEntry], host: str, port: int, config: RouterConfig, tenants: Tenants,
          ready: Callable[[int], None] | None = None) -> None:
    """Route until interrupted (SIGINT, SIGTERM); ``ready`` gets the port listened on."""
    import aiohttp
    from aiohttp import web

    policy = routing_policies.get(config.policy)()

    async def main() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
            fleet = Fleet(session, config.rates(), config.health_interval_s)
            for entry in replicas:
                await fleet.add(entry.url, entry.descriptor)
            fleet.start()
            try:
                await serve_app(build_app(Router(fleet, tenants, policy, config)), host, port, ready)
            finally:
                await fleet.close()

    with contextlib.suppress(KeyboardInterrupt, web.GracefulExit):
        run_event_loop(main)
