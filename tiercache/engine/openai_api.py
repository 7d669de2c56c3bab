"""An OpenAI-compatible HTTP server in front of the reference engine: `tiercache api` (one replica of a fleet).

Two owners, one way. `EngineLoop` is the only thread that touches the
engine: it takes new requests off a queue, steps the engine while any
request is unfinished (continuous batching: requests join between steps),
and hands each request's new tokens, then its end, to that request's
`asyncio.Queue` on the event loop. The aiohttp handlers (`build_app`) only
parse, check and answer: ``POST /v1/completions``, ``POST
/v1/chat/completions`` (both streamed as server-sent events on request),
``GET /v1/models`` and ``GET /health``.

``usage.prompt_tokens_details.cached_tokens`` is what the cache saved: the
prompt tokens the engine's own pool (L0) held plus those loaded from
tiercache's tiers, as vLLM reports it. Errors are answered the way the
OpenAI API answers them — a status code and ``{"error": {"message", "type",
"param", "code"}}`` naming what is wrong — never a traceback.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tiercache.engine.llm import LLMEngine
from tiercache.engine.sequence import SamplingParams, Sequence
from tiercache.fleet.descriptor import EventEndpoints, ReplicaDescriptor, shared_tiers_of
from tiercache.tier_events import TierEvent

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tiercache-reference"
OPENAI_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "user", "assistant", "tool")
EVENTS_HEARTBEAT_S = 1.0
UNFINISHED = "\ufffd"    # what a tokenizer decodes a character cut short (a byte tokenizer mid-UTF-8) to
CLIENT_CHECK_S = 0.5     # how often a non-streamed request's handler looks whether its client is still there


class KVEventSink(Protocol):
    """Where the engine loop sends KV events (`tiercache.fleet.replica_events.ReplicaEvents`)."""

    def publish_changes(self, events: list[TierEvent]) -> int: ...

    def publish_held(self, held: list[TierEvent]) -> int: ...


class Encodes(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict]) -> list[int]: ...


class ApiError(Exception):
    """One request's mistake, answered as the OpenAI API answers it."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class Generation:
    """One request on its way through the engine; the engine thread writes `events`, the handler reads them."""
    prompt: list[int]
    params: SamplingParams
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cache_salt: str = ""
    continues: bool = False
    seq: Sequence | None = None
    sent: int = 0          # output tokens handed to the handler so far

    def emit(self, kind: str, value: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class EngineLoop:
    """The engine's one thread: requests in through `submit`, tokens out through each `Generation`, and —
    with a publisher — the KV events of every step out through it (`publish_held` starts a subscriber again
    from everything held)."""

    def __init__(self, engine: LLMEngine, publisher: KVEventSink | None = None) -> None:
        self.engine = engine
        self.publisher = publisher
        if publisher is not None:
            engine.watch_kv_events()
        self._published = 0.0
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = queue.SimpleQueue()
        self._new: queue.SimpleQueue[Generation] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._running: dict[str, Generation] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tiercache-engine", daemon=True)
        self._thread.start()

    @property
    def queued_requests(self) -> int:
        return self._new.qsize() + len(self._running)

    def submit(self, generation: Generation) -> None:
        self._new.put(generation)
        self._wake.set()

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine's thread between two steps; its result through the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def publish_held(self) -> int:
        """Engine thread: publish what changed, then `AllBlocksCleared` and every block and chunk held now, in
        one batch — a subscriber that lost events is whole again from this batch on. Its sequence number."""
        assert self.publisher is not None
        self._publish()
        return self.publisher.publish_held(self.engine.held_kv())

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop:
            self._run_calls()
            self._admit()
            if not self.engine.has_unfinished():
                self.engine.apply_purges()         # idle: a purge still reaches this engine's tiers now
                self._publish()
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            finished = {seq.seq_id for seq in self.engine.step()}
            self._publish()
            for seq_id, generation in list(self._running.items()):
                self._hand_over(generation, seq_id in finished)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn())
            except Exception as err:          # handed to the caller, who answers for it
                future.set_exception(err)

    def _publish(self) -> None:
        """Publish what changed; when nothing did for a while, an empty batch, so that a subscriber that lost
        the last batch sees the gap in the numbering without waiting for the next change."""
        if self.publisher is not None:
            events = self.engine.take_kv_events()
            now = time.monotonic()
            if events or now - self._published > EVENTS_HEARTBEAT_S:
                self.publisher.publish_changes(events)
                self._published = now

    def _admit(self) -> None:
        while True:
            try:
                generation = self._new.get_nowait()
            except queue.Empty:
                return
            try:
                generation.seq = self.engine.add_request(generation.prompt, generation.params,
                                                         cache_salt=generation.cache_salt,
                                                         continues=generation.continues)
            except ValueError as err:       # too long for the model or the pool, token ids out of range
                generation.emit("error", ApiError(str(err), "prompt"))
                continue
            self._running[generation.seq.seq_id] = generation

    def _hand_over(self, generation: Generation, finished: bool) -> None:
        seq = generation.seq
        tokens = seq.output_token_ids
        if len(tokens) > generation.sent:
            generation.emit("tokens", tokens[generation.sent:])
            generation.sent = len(tokens)
        if finished:
            del self._running[seq.seq_id]
            out = self.engine.output(seq)
            stopped = bool(tokens) and tokens[-1] == self.engine.tokenizer.eos_token_id and \
                not generation.params.ignore_eos
            generation.emit("done", Usage(len(out.prompt_token_ids), len(tokens),
                                          out.l0_hit_tokens + out.external_hit_tokens,
                                          "stop" if stopped else "length"))


@dataclass
class ApiServer:
    """What the handlers share: the engine loop, the model's name, its tokenizer and what it tells a router
    about itself (`ReplicaDescriptor`)."""
    loop: EngineLoop
    model_name: str
    descriptor: ReplicaDescriptor | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def encode(self, text: str) -> list[int]:
        return self.loop.engine.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(chat_template(messages))

    def decode(self, tokens: list[int]) -> str:
        return self.loop.engine.tokenizer.decode(tokens)


def _params(body: dict) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", OPENAI_DEFAULT_MAX_TOKENS))
    if max_tokens is None:
        max_tokens = OPENAI_DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature <= 2:
        raise ApiError(f"temperature must be a number from 0 to 2, got {temperature!r}", "temperature")
    seed = body.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ApiError(f"seed must be an integer, got {seed!r}", "seed")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), seed=seed)


def completion_prompt(server: Encodes, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                   # one prompt in a batch of one
    if isinstance(prompt, str) and prompt:
        return server.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError("prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def chat_template(messages: list[dict]) -> str:
    """The reference engine's chat format: each message as ``<|role|>`` and its content on lines of their own,
    then the assistant's turn opened."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def chat_prompt(server: Encodes, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise ApiError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):       # content parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", f"messages[{i}].content")
        messages[i] = {"role": m["role"], "content": content}
    return server.encode_chat(messages)


async def json_body(request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise ApiError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _check_model(server: ApiServer, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != server.model_name:
        raise ApiError(f"The model `{model}` does not exist.", "model", 404, code="model_not_found")


async def _generate(server: ApiServer, checked: Checked, request, chunk: Callable[[str, str | None], dict],
                    whole: Callable[[str, Usage], dict]):
    from aiohttp import web

    stream, include_usage = checked.stream, checked.include_usage
    generation = Generation(checked.prompt, checked.params, asyncio.Queue(), asyncio.get_running_loop(),
                            checked.cache_salt, checked.continues)
    server.loop.submit(generation)
    kind, value = await generation.events.get()
    if kind == "error":
        raise value
    tokens: list[int] = []
    try:
        if not stream:
            while kind != "done":
                tokens += value
                kind, value = await _while_client_waits(generation, request)
            return web.json_response(whole(server.decode(tokens), value))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        said = ""
        while kind != "done":
            tokens += value
            text = server.decode(tokens).rstrip(UNFINISHED)   # a character cut short may still end differently
            if len(text) > len(said):
                await response.write(_event(chunk(text[len(said):], None)))
                said = text
            kind, value = await generation.events.get()
    except (ConnectionError, asyncio.CancelledError):     # the client left: stop computing for it
        seq = generation.seq
        if seq is not None:
            server.loop.call(lambda: server.loop.engine.abort(seq))
        raise
    final = chunk(server.decode(tokens)[len(said):], value.finish_reason)
    await response.write(_event(final))
    if include_usage:
        await response.write(_event({**chunk("", None), "choices": [], "usage": value.as_dict()}))
    await response.write(b"data: [DONE]\n\n")
    return response


async def _while_client_waits(generation: Generation, request) -> tuple[str, object]:
    """The generation's next event, for a handler that writes nothing until the answer is whole: its client's
    connection is looked at before each event and every `CLIENT_CHECK_S` while none comes, and
    `ConnectionResetError` raised once it is gone. (A streamed answer learns it from its next write.)"""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed its connection")
        try:
            return await asyncio.wait_for(generation.events.get(), CLIENT_CHECK_S)
        except asyncio.TimeoutError:
            continue


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(f"stream must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False))


def cache_salt_of(body: dict) -> str:
    """vLLM's request field: prompts with different salts never share cached KV (a router sets one per tenant)."""
    salt = body.get("cache_salt")
    if salt is None:
        return ""
    if not isinstance(salt, str) or not salt:
        raise ApiError("cache_salt must be a non-empty string", "cache_salt")
    return salt


SESSION_HEADER = "X-Session-ID"     # vLLM's header for ``session_id``


def continues_of(body: dict, headers: Mapping[str, str] | None = None) -> bool:
    """Whether a later request will resend this one's tokens (a conversation's next turn), as vLLM's server
    is told: a ``session_id`` (body field or ``X-Session-ID`` header: "stable across multiple requests in the
    same conversation or agent session"), or ``"kv_transfer_params": {"continues": true}``. The tiers' policies
    then keep its chunks for the next turn (`RequestState.CONTINUES`)."""
    session = body.get("session_id")
    if session is not None and (not isinstance(session, str) or not session):
        raise ApiError("session_id must be a non-empty string", "session_id")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ApiError("kv_transfer_params must be an object", "kv_transfer_params")
    continues = (params or {}).get("continues", False)
    if not isinstance(continues, bool):
        raise ApiError(f"kv_transfer_params.continues must be a boolean, got {continues!r}",
                       "kv_transfer_params.continues")
    return bool(session) or bool(headers and headers.get(SESSION_HEADER)) or continues


@dataclass(frozen=True, slots=True)
class Checked:
    """A generation request checked whole before it reaches the engine."""
    prompt: list[int]
    params: SamplingParams
    cache_salt: str
    stream: bool
    include_usage: bool
    head: dict          # what every answer to it carries: id, creation time, model
    continues: bool = False


async def _request(server: ApiServer, request, prompt_of: Callable[[ApiServer, dict], list[int]],
                   id_prefix: str) -> Checked:
    body = await json_body(request)
    _check_model(server, body)
    prompt, params, salt = prompt_of(server, body), _params(body), cache_salt_of(body)
    stream, include_usage = _stream_options(body)
    head = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model_name}
    return Checked(prompt, params, salt, stream, include_usage, head, continues_of(body, request.headers))


async def serve_app(app, host: str, port: int, ready: Callable[[int], None] | None) -> None:
    """Listen (port 0: any free one), tell ``ready`` the port, serve until a signal stops the loop, clean up."""
    from aiohttp import web

    runner = web.AppRunner(app, handle_signals=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        if ready is not None:
            ready(runner.addresses[0][1])
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def run_event_loop(main: Callable[[], Awaitable[None]]) -> None:
    """Run an HTTP server's ``main`` on uvloop when it is installed (the `[fleet]` extra brings it: an HTTP hop
    costs about half as much there), on asyncio's own loop otherwise."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def openai_errors(label: str):
    """aiohttp middleware: every error answered as the OpenAI API answers it, never a traceback."""
    from aiohttp import web

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except ApiError as err:
            return web.json_response(err.body(), status=err.status)
        except web.HTTPException as err:      # unknown route, wrong method: the same error shape
            return web.json_response(ApiError(err.reason, status=err.status).body(), status=err.status)
        except (ConnectionError, asyncio.CancelledError):
            raise                             # the client went away mid-stream: nobody to answer
        except Exception:                     # a bug of ours: logged here, one line to the client
            log.exception("%s: %s %s failed", label, request.method, request.path)
            error = ApiError("the server failed to answer this request", status=500, kind="internal_server_error")
            return web.json_response(error.body(), status=500)
    return errors


def build_app(server: ApiServer):
    """The aiohttp application: OpenAI routes, errors as the OpenAI API answers them."""
    from aiohttp import web

    errors = openai_errors("tiercache api")

    async def completions(request):
        checked = await _request(server, request, completion_prompt, "cmpl")
        head = {**checked.head, "object": "text_completion"}

        def chunk(text: str, finish: str | None) -> dict:
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        def whole(text: str, usage: Usage) -> dict:
            return {**chunk(text, usage.finish_reason), "usage": usage.as_dict()}
        return await _generate(server, checked, request, chunk, whole)

    async def chat_completions(request):
        checked = await _request(server, request, chat_prompt, "chatcmpl")
        head = {**checked.head, "object": "chat.completion.chunk"}

        def chunk(text: str, finish: str | None) -> dict:
            return {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                         "logprobs": None, "finish_reason": finish}]}

        def whole(text: str, usage: Usage) -> dict:
            return {**head, "object": "chat.completion", "usage": usage.as_dict(),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": usage.finish_reason}]}
        return await _generate(server, checked, request, chunk, whole)

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "tiercache"}]})

    async def health(request):
        return web.json_response({"status": "ok", "queued_requests": server.loop.queued_requests})

    async def replica(request):
        if server.descriptor is None:
            raise ApiError("this server publishes no KV events (start it with --kv-events)", status=404)
        return web.json_response(dataclasses.replace(server.descriptor,
                                                     load_tokens_per_s=measured_load_rates(server.loop.engine)
                                                     ).as_dict())

    async def announce(request):
        if server.loop.publisher is None:
            raise ApiError("this server publishes no KV events (start it with --kv-events)", status=404)
        seq = await asyncio.wrap_future(server.loop.call(server.loop.publish_held))
        return web.json_response({"seq": seq})

    async def metrics(request):
        """Prometheus exposition of the engine's stats (`tiercache.metrics`), taken on the engine's thread
        between two steps."""
        try:
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            from tiercache.metrics import registry_for
        except ImportError:
            raise ApiError("/metrics needs prometheus-client, which is not installed: "
                           "pip install 'tiercache[metrics]'", status=501) from None
        snapshot = await asyncio.wrap_future(server.loop.call(server.loop.engine.stats))
        return web.Response(body=generate_latest(registry_for(lambda: snapshot)),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[errors])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/tiercache/replica", replica)
    app.router.add_post("/tiercache/kv/announce", announce)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


@dataclass(frozen=True, slots=True)
class KVEventsOptions:
    """Where a replica publishes its KV events (port 0: any free port; the descriptor says which)."""
    host: str = "127.0.0.1"
    port: int = 0
    replay_port: int = 0


def measured_load_rates(engine: LLMEngine) -> dict[str, float]:
    """Tokens/s the engine has loaded from each tier medium into its pool (rank 0's transfers)."""
    from tiercache.fleet.load_rates import load_tokens_per_s

    if engine.connector is None:
        return {}
    manager = engine.connector.scheduler.manager
    transfers = engine.connector.workers[0].stats()["transfers"]
    return load_tokens_per_s(transfers, manager.l1.name,
                             {t.name: t.medium.value.upper() for t in manager.lower}, engine.hasher.block_size,
                             manager.l1.medium.value.upper())


def descriptor_for(engine: LLMEngine, model_name: str, tokenizer: str, events: EventEndpoints) -> ReplicaDescriptor:
    """What a router needs to hash prompts as ``engine`` does and to follow its KV events, and what its prefill
    costs (`LLMEngine.measure_prefill`: timed here, before the engine serves anything)."""
    prefill = engine.measure_prefill()
    manager = engine.connector.scheduler.manager if engine.connector is not None else None
    chunk_tokens = engine.connector.scheduler.config.keys.chunk_tokens if manager is not None else 0
    media = ("GPU", *(t.medium.value.upper() for t in manager.tiers)) if manager is not None else ("GPU",)
    shared = shared_tiers_of(engine.connector.scheduler.config) if manager is not None else ()
    return ReplicaDescriptor(model=model_name, instance=uuid.uuid4().hex, key_scheme="tiercache",
                             block_size=engine.hasher.block_size, chunk_tokens=chunk_tokens,
                             partial_chunks=manager is not None and manager.partial_chunks,
                             hash=engine.hasher.hash_name, seed=engine.hasher.seed.hex(), tokenizer=tokenizer,
                             media=media, shared_tiers=shared, events=events,
                             prefill_tokens_per_s=round(prefill.tokens_per_s, 1) if prefill else 0.0,
                             prefill_attention_s_per_pair=prefill.attention_s_per_pair if prefill else 0.0)


def serve(engine: LLMEngine, host: str, port: int, model_name: str = DEFAULT_MODEL_NAME,
          ready: Callable[[int], None] | None = None, kv_events: KVEventsOptions | None = None,
          tokenizer: str = "bytes") -> None:
    """Serve until interrupted (SIGINT, SIGTERM); ``ready`` gets the port listened on (0 picks a free one).
    With ``kv_events`` the replica publishes its pool's and tiers' KV events and describes itself to routers
    (``GET /tiercache/replica``)."""
    from aiohttp import web

    publisher, descriptor = None, None
    if kv_events is not None:
        from tiercache.fleet.kv_events import EventPublisher
        from tiercache.fleet.replica_events import ReplicaEvents

        raw = EventPublisher(kv_events.host, kv_events.port, kv_events.replay_port)
        descriptor = descriptor_for(engine, model_name, tokenizer, EventEndpoints(raw.endpoint, raw.replay_endpoint))
        publisher = ReplicaEvents(raw, descriptor.block_size, descriptor.chunk_tokens)
    loop = EngineLoop(engine, publisher)
    server = ApiServer(loop, model_name, descriptor)

    async def main() -> None:
        await serve_app(build_app(server), host, port, ready)

    try:
        with contextlib.suppress(KeyboardInterrupt, web.GracefulExit):    # SIGINT, SIGTERM: a clean stop
            run_event_loop(main)
    finally:
        loop.close()
        if publisher is not None:
            publisher.close()
