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
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from tiercache.engine.llm import LLMEngine
from tiercache.engine.sequence import SamplingParams, Sequence

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tiercache-reference"
OPENAI_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "user", "assistant", "tool")
UNFINISHED = "\ufffd"    # what a tokenizer decodes a character cut short (a byte tokenizer mid-UTF-8) to


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
    """The engine's one thread: requests in through `submit`, tokens out through each `Generation`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
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

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop:
            self._admit()
            if not self.engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            finished = {seq.seq_id for seq in self.engine.step()}
            for seq_id, generation in list(self._running.items()):
                self._hand_over(generation, seq_id in finished)

    def _admit(self) -> None:
        while True:
            try:
                generation = self._new.get_nowait()
            except queue.Empty:
                return
            try:
                generation.seq = self.engine.add_request(generation.prompt, generation.params)
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
    """What the handlers share: the engine loop, the model's name and its tokenizer."""
    loop: EngineLoop
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))

    def encode(self, text: str) -> list[int]:
        return self.loop.engine.tokenizer.encode(text)

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


def _completion_prompt(server: ApiServer, body: dict) -> list[int]:
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


def _chat_prompt(server: ApiServer, body: dict) -> list[int]:
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
    return server.encode(chat_template(messages))


async def _body(request) -> dict:
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


async def _generate(server: ApiServer, prompt: list[int], params: SamplingParams, request, stream: bool,
                    include_usage: bool, chunk: Callable[[str, str | None], dict],
                    whole: Callable[[str, Usage], dict]):
    from aiohttp import web

    generation = Generation(prompt, params, asyncio.Queue(), asyncio.get_running_loop())
    server.loop.submit(generation)
    kind, value = await generation.events.get()
    if kind == "error":
        raise value
    if not stream:
        tokens: list[int] = []
        while kind != "done":
            tokens += value
            kind, value = await generation.events.get()
        return web.json_response(whole(server.decode(tokens), value))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    tokens, said = [], ""
    while kind != "done":
        tokens += value
        text = server.decode(tokens).rstrip(UNFINISHED)   # a character cut short may still end differently
        if len(text) > len(said):
            await response.write(_event(chunk(text[len(said):], None)))
            said = text
        kind, value = await generation.events.get()
    final = chunk(server.decode(tokens)[len(said):], value.finish_reason)
    await response.write(_event(final))
    if include_usage:
        await response.write(_event({**chunk("", None), "choices": [], "usage": value.as_dict()}))
    await response.write(b"data: [DONE]\n\n")
    return response


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


async def _request(server: ApiServer, request, prompt_of: Callable[[ApiServer, dict], list[int]],
                   id_prefix: str) -> tuple[list[int], SamplingParams, bool, bool, dict]:
    """A generation request checked whole before it reaches the engine: its prompt, sampling, streaming, and
    the head every answer to it carries (id, creation time, model)."""
    body = await _body(request)
    _check_model(server, body)
    prompt, params = prompt_of(server, body), _params(body)
    stream, include_usage = _stream_options(body)
    head = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model_name}
    return prompt, params, stream, include_usage, head


def build_app(server: ApiServer):
    """The aiohttp application: OpenAI routes, errors as the OpenAI API answers them."""
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
            log.exception("tiercache api: %s %s failed", request.method, request.path)
            error = ApiError("the server failed to answer this request", status=500, kind="internal_server_error")
            return web.json_response(error.body(), status=500)

    async def completions(request):
        prompt, params, stream, include_usage, head = await _request(server, request, _completion_prompt, "cmpl")
        head["object"] = "text_completion"

        def chunk(text: str, finish: str | None) -> dict:
            return {**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        def whole(text: str, usage: Usage) -> dict:
            return {**chunk(text, usage.finish_reason), "usage": usage.as_dict()}
        return await _generate(server, prompt, params, request, stream, include_usage, chunk, whole)

    async def chat_completions(request):
        prompt, params, stream, include_usage, head = await _request(server, request, _chat_prompt, "chatcmpl")
        head["object"] = "chat.completion.chunk"

        def chunk(text: str, finish: str | None) -> dict:
            return {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                         "logprobs": None, "finish_reason": finish}]}

        def whole(text: str, usage: Usage) -> dict:
            return {**head, "object": "chat.completion", "usage": usage.as_dict(),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": usage.finish_reason}]}
        return await _generate(server, prompt, params, request, stream, include_usage, chunk, whole)

    async def models(request):
        return web.json_response({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "tiercache"}]})

    async def health(request):
        return web.json_response({"status": "ok", "queued_requests": server.loop.queued_requests})

    app = web.Application(middlewares=[errors])
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def serve(engine: LLMEngine, host: str, port: int, model_name: str = DEFAULT_MODEL_NAME,
          ready: Callable[[int], None] | None = None) -> None:
    """Serve until interrupted (SIGINT, SIGTERM); ``ready`` gets the port listened on (0 picks a free one)."""
    from aiohttp import web

    loop = EngineLoop(engine)
    server = ApiServer(loop, model_name)

    async def main() -> None:
        runner = web.AppRunner(build_app(server), handle_signals=True)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        if ready is not None:
            ready(runner.addresses[0][1])
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        with contextlib.suppress(KeyboardInterrupt, web.GracefulExit):    # SIGINT, SIGTERM: a clean stop
            asyncio.run(main())
    finally:
        loop.close()
