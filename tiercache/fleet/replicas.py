"""The router's replicas: where each is, what it holds, what it is doing (router side, one event loop).

A `Replica` owns its index (written only by its `EventFollower` task) and
its load counters (written only by the proxy as requests pass). `Fleet`
owns the set: replicas join (their descriptor read, their events followed),
leave, fail health checks — a replica that does not answer within one
health interval, or refuses a connection, is down: it takes no requests
and its entries are dropped until it answers again (a new ``instance`` in
its descriptor — a restart — starts its index again).

A replica without a descriptor (a plain ``vllm serve``) is routed to by load
alone until it has one.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from tiercache.config import read_listing
from tiercache.engine.openai_api import ApiError, chat_template
from tiercache.errors import ConfigError, RegistryError
from tiercache.fleet.descriptor import GivenDescriptor, ReplicaDescriptor
from tiercache.fleet.engine_queue import EngineQueue, engine_queue
from tiercache.fleet.prefix_index import CachedTokens, KeyScheme, PromptKeys, ReplicaIndex, key_schemes
from tiercache.fleet.routing import Candidate, ReplicaRates
from tiercache.fleet.subscriber import EventFollower
from tiercache.fleet.vllm_keys import VllmKeys  # noqa: F401 — registers the "vllm" key scheme

log = logging.getLogger(__name__)

RUNNING_DECAY = 0.95     # a busy first token's weight in the running-request cost, per first token timed since
PREFILL_DECAY = 0.9      # an idle first token's weight in the prefill fit, per first token timed since
MIN_SPREAD = 0.05        # how far from proportional (1 - cos²) the two costs must have varied to be told apart


class PromptEncoder:
    """Tokenizes and applies the chat template exactly as one model's replicas do: the reference engine's
    (``tiercache``: its tokenizer, its chat format), or a Hugging Face model's (``hf``: the model directory's
    tokenizer and its own Jinja chat template through `transformers`, as vLLM applies them — special tokens
    added to a completion's prompt, none added to a rendered chat, whose template has them)."""

    def __init__(self, tokenizer: str, template: str) -> None:
        from tiercache.engine.tokenizer import ByteTokenizer, HFTokenizer

        self.template = template
        if template == "tiercache":
            self.tokenizer = ByteTokenizer() if tokenizer == "bytes" else HFTokenizer(tokenizer)
        elif template == "hf":
            self.tokenizer = _hf_tokenizer(tokenizer)
        else:
            raise ConfigError("chat_template", template, "known: tiercache (the reference engine's), hf (the "
                                                         "model's own, as vLLM applies it)")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if self.template == "tiercache":
            return self.encode(chat_template(messages))
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except ValueError as err:          # the model has no chat template
            raise ApiError(f"chat completions are not available for this model: {err}", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)


def _hf_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("tokenizer", path, "the 'hf' chat template needs transformers: pip install "
                                             "transformers") from None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError("tokenizer", path, f"cannot load the model's tokenizer: {err}") from None


SHARE_WINDOW_S = 30.0     # how long a prompt token sent to a replica counts toward its share (1/e after this)


@dataclass(slots=True)
class DecayingSum:
    """A sum whose terms fade with age: one added ``age`` seconds ago counts ``exp(-age / window_s)``."""
    window_s: float = SHARE_WINDOW_S
    value: float = 0.0
    at: float = 0.0

    def add(self, amount: float, now: float) -> None:
        self.value = self.read(now) + amount
        self.at = now

    def read(self, now: float) -> float:
        return self.value * math.exp(-max(now - self.at, 0.0) / self.window_s) if self.value else 0.0


@dataclass(slots=True)
class PrefillFit:
    """A replica's prefill cost learned from its idle first tokens: seconds ≈ ``tokens / prefill +
    tokens·(context + tokens/2) · attention_s`` (`ReplicaRates.prefill_s`), fitted by least squares of the
    relative error over the recent first tokens, each weighing `PREFILL_DECAY` times less per first token timed
    since. The error is relative because a timing's noise is: a core shared with a busy neighbour stretches a
    long prefill by as many percent as a short one, and absolute least squares would let a few slow long
    prompts pull the fit off every short turn.

    Both parts are taken once they have been told apart: the first tokens timed have varied in how much of
    their time is attention (a short turn after a long history, a long prompt after none) and the fit finds
    both positive. Until then the cost is one rate per token, the timings' weighted ratio — a replica's very
    first timing replaces the configured guess outright (a guess several times off would otherwise weigh on a
    fresh fleet's opening seconds, exactly when moving a conversation away from its history looks cheap)."""
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)    # decayed Σ of t², tp, p², t, p: t, p the
                                                                     # two parts' features over the seconds
    measured: int = 0

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        t, p = tokens / seconds, tokens * (context + tokens / 2) / seconds     # relative: each timing / y
        for i, v in enumerate((t * t, t * p, p * p, t, p)):
            self.sums[i] = self.sums[i] * PREFILL_DECAY + v
        self.measured += 1

    def rates(self, rates: ReplicaRates) -> ReplicaRates:
        """``rates`` with the fitted prefill cost (unchanged before the first timing)."""
        if not self.measured:
            return rates
        tt, tp, pp, t_sum, p_sum = self.sums     # normal equations of Σ (t·per_token + p·per_pair - 1)²
        det = tt * pp - tp * tp
        if det > MIN_SPREAD * tt * pp:
            per_token, per_pair = (pp * t_sum - tp * p_sum) / det, (tt * p_sum - tp * t_sum) / det
            if per_token > 0 and per_pair > 0:
                return replace(rates, prefill=1 / per_token, attention_s=per_pair)
        return replace(rates, prefill=tt / t_sum, attention_s=0.0)


@dataclass(slots=True)
class RunningCost:
    """What each request already running on a replica adds to a new one's wait (`ReplicaRates.per_request_s`),
    learned from its busy first tokens: the time to first token past the request's own prefill and loads as
    estimated and past the prefill still pending ahead of it when it was sent (`ReplicaLoad.waiting_prefill_s`),
    over the requests running then — a least-squares slope through zero, each first token weighing
    `RUNNING_DECAY` times less per first token timed since. Running requests decode between the steps that
    prefill a new one, and their steps are not free: the cost a replica shows is learned rather than taken
    from the configured guess, which does not know the engine or its load."""
    excess: float = 0.0      # decayed Σ excess·running
    spread: float = 0.0      # decayed Σ running²
    measured: int = 0

    def observe(self, excess_s: float, running: int) -> None:
        if running <= 0:
            return
        self.excess = self.excess * RUNNING_DECAY + excess_s * running
        self.spread = self.spread * RUNNING_DECAY + running * running
        self.measured += 1

    def rates(self, rates: ReplicaRates) -> ReplicaRates:
        """``rates`` with the learned cost of a running request (unchanged before the first timing; never < 0)."""
        if not self.measured:
            return rates
        return replace(rates, per_request_s=max(self.excess / self.spread, 0.0))


@dataclass(slots=True)
class ReplicaLoad:
    """What the router has sent a replica and not seen finish. The prefill still ahead of a new request is what
    was estimated for the requests not past their first token, less the time the replica has worked on them
    since (`waiting_prefill_s`): counting a running prefill's whole estimate until its first token would
    overstate a busy replica's queue, and a conversation would leave its history for an idle replica more often
    than that pays."""
    in_flight: int = 0
    pending_prefill: int = 0
    pending_prefill_s: float = 0.0  # their prefill as estimated when routed
    worked_s: float = 0.0           # of that, done by `worked_at`: the replica works on it while there is any
    worked_at: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    recent_tokens: DecayingSum = field(default_factory=DecayingSum)   # prompt tokens sent lately: its share
    failures: int = 0
    predicted_cached: int = 0       # over requests whose replica reported cached tokens
    reported_cached: int = 0
    prediction_error: int = 0       # sum of |predicted - reported|
    reported_prompt: int = 0
    foreign: int = 0                # requests the replica reported beyond those in flight from here (its /metrics
    foreign_waiting: int = 0        # at the last health check), and how many of them had not started
    mean_prefill_s: float = 0.0     # the prefill estimates sent here, averaged (recent ones weigh more): what a
                                    # foreign request waiting there is taken to cost
    engine_requests: int = -1       # what the replica last reported its engine holds (-1: it reports nothing)

    def reported(self, queue: EngineQueue | None, own: int) -> None:
        """What the replica says its engine holds (None: it did not say); ``own``: at most how many of those
        this router sent (in flight when it asked, and sent while it waited for the answer). Any beyond came
        from elsewhere — a second router, a client calling the replica directly."""
        if queue is None:
            self.engine_requests, self.foreign, self.foreign_waiting = -1, 0, 0
            return
        self.engine_requests = queue.requests
        self.foreign = max(queue.requests - own, 0)
        self.foreign_waiting = min(queue.waiting, self.foreign)

    def foreign_prefill_s(self) -> float:
        """Seconds of prefill ahead of a new request from foreign requests not yet started there."""
        return self.foreign_waiting * self.mean_prefill_s

    def _work(self, now: float) -> None:
        """Credit the time since the last change as work on the pending prefills (none is banked while idle)."""
        if self.pending_prefill_s > self.worked_s:
            self.worked_s = min(self.pending_prefill_s, self.worked_s + max(now - self.worked_at, 0.0))
        self.worked_at = now

    def sent(self, uncached: int, prefill_s: float, prompt_tokens: int, now: float) -> None:
        """A request routed here: ``uncached`` tokens to compute, estimated at ``prefill_s``."""
        self._work(now)
        self.in_flight += 1
        self.pending_prefill += uncached
        self.pending_prefill_s += prefill_s
        self.mean_prefill_s = prefill_s if not self.requests else 0.9 * self.mean_prefill_s + 0.1 * prefill_s
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.recent_tokens.add(prompt_tokens, now)

    def prefilled(self, uncached: int, prefill_s: float, now: float) -> None:
        """A request's prefill is over (its first token came, or it failed before one): its estimate leaves the
        pending work, and the work credited to the pending prefills is taken as having been its first."""
        self._work(now)
        self.pending_prefill -= uncached
        self.pending_prefill_s -= prefill_s
        self.worked_s = max(self.worked_s - prefill_s, 0.0)

    def finished(self, uncached: int, prefill_s: float, now: float) -> None:
        """A request is over: ``uncached`` and ``prefill_s`` are what is left of it (zero past its first token)."""
        self.in_flight -= 1
        self.prefilled(uncached, prefill_s, now)
        if not self.in_flight:                     # no drift: nothing is pending
            self.pending_prefill, self.pending_prefill_s, self.worked_s = 0, 0.0, 0.0

    def waiting_prefill_s(self, now: float) -> float:
        """Seconds of prefill still ahead of a request sent now."""
        self._work(now)
        return max(self.pending_prefill_s - self.worked_s, 0.0)


@dataclass
class Replica:
    name: str
    url: str
    rates: ReplicaRates
    descriptor: ReplicaDescriptor | None = None
    given: GivenDescriptor | None = None     # from the router's replicas file: for one that serves none (vLLM)
    scheme: KeyScheme | None = None
    index: ReplicaIndex = field(default_factory=ReplicaIndex)
    follower: EventFollower | None = None
    task: asyncio.Task | None = None
    up: bool = False
    since: float = field(default_factory=time.monotonic)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    encoder: PromptEncoder | None = None     # tokenizes and templates as this replica does
    prefill: PrefillFit = field(default_factory=PrefillFit)   # its idle first tokens: what its prefill costs
    running: RunningCost = field(default_factory=RunningCost)  # its busy ones: what a running request adds

    def shares_with(self, other: Replica) -> bool:
        """Whether ``other``'s stores to a shared tier are loads for this replica: the same chains, a shared
        tier in common."""
        a, b = self.descriptor, other.descriptor
        return (other is not self and a is not None and b is not None and self.scheme is not None
                and other.scheme is not None and self.scheme.signature == other.scheme.signature
                and bool(set(a.shared_tiers) & set(b.shared_tiers)))

    def candidate(self, keys: PromptKeys | None, num_tokens: int, shared: list[set[bytes]] = ()) -> Candidate:
        cached = (self.index.cached(keys, self.scheme, shared) if keys is not None and self.scheme is not None
                  else CachedTokens(0))
        now = time.monotonic()
        return Candidate(self.name, num_tokens, cached, self.load.in_flight, self.load.pending_prefill,
                         self.load.waiting_prefill_s(now), self.rates, self.load.recent_tokens.read(now),
                         self.load.foreign, self.load.foreign_prefill_s())

    def learn_rates(self, descriptor: ReplicaDescriptor | None) -> None:
        """Take the rates the replica found for itself (its descriptor, at each health check): load rates per
        medium (media it has no rate for keep theirs), and — until the router has timed a first token of its
        own there — the prefill cost it timed before serving, in place of the configured guess."""
        if descriptor is None:
            return
        measured = {m: float(r) for m, r in descriptor.load_tokens_per_s.items()
                    if isinstance(r, (int, float)) and r > 0}
        if measured:
            self.rates = replace(self.rates, load={**self.rates.load, **measured})
        if not self.prefill.measured and descriptor.prefill_tokens_per_s > 0:
            self.rates = replace(self.rates, prefill=float(descriptor.prefill_tokens_per_s),
                                 attention_s=float(descriptor.prefill_attention_s_per_pair))

    def learn_prefill(self, tokens: int, context: int, seconds: float) -> None:
        """A first token timed on an otherwise idle replica: ``tokens`` computed after ``context`` cached
        ones in ``seconds`` (`PrefillFit`)."""
        self.prefill.observe(tokens, context, seconds)
        self.rates = self.prefill.rates(self.rates)

    def learn_running(self, excess_s: float, running: int) -> None:
        """A first token timed with ``running`` requests in flight when it was sent: ``excess_s`` its wait
        beyond its own estimated work and the prefill pending ahead of it (`RunningCost`)."""
        self.running.observe(excess_s, running)
        self.rates = self.running.rates(self.rates)


@dataclass(frozen=True, slots=True)
class ReplicaEntry:
    """One replica of a router's replicas file."""
    url: str
    descriptor: GivenDescriptor | None = None


def load_replicas(path: str | Path) -> list[ReplicaEntry]:
    """Read and check a replicas file (YAML or JSON): ``replicas:`` a list of ``{url, descriptor?,
    descriptor_file?}``. A descriptor is given for a replica that serves none itself (``vllm serve``): at least
    ``model``, ``key_scheme``, ``block_size``, ``tokenizer``, ``chat_template`` and ``events``, over what its
    tiercache connector writes to ``descriptor_file`` (`GivenDescriptor`); relative paths are read from the
    file's folder. A `ConfigError` naming the file and the field otherwise."""
    source = str(path)
    _, entries = read_listing(path, "--replicas", "replicas")
    folder = Path(path).parent
    out = []
    for i, entry in enumerate(entries):
        where = f"{source}: replicas[{i}]"
        if (not isinstance(entry, dict) or set(entry) - {"url", "descriptor", "descriptor_file"}
                or not isinstance(entry.get("url"), str)):
            raise ConfigError(where, entry, "must be {url: ..., descriptor: ..., descriptor_file: ...} (the "
                                            "last two optional)")
        fields, file = entry.get("descriptor"), entry.get("descriptor_file")
        given = None
        if fields is not None or file is not None:
            if not isinstance(fields, dict):
                raise ConfigError(f"{where}.descriptor", fields, "must be a mapping")
            if file is not None and not isinstance(file, str):
                raise ConfigError(f"{where}.descriptor_file", file, "must be a path")
            tokenizer = fields.get("tokenizer")
            if isinstance(tokenizer, str) and tokenizer != "bytes":
                fields = {**fields, "tokenizer": str(folder / tokenizer)}
            given = GivenDescriptor(fields, str(folder / file) if file else "", where)
            descriptor = given.read()       # checked now where it can be (the connector's file may come later)
            if descriptor is not None and descriptor.key_scheme not in key_schemes:
                raise ConfigError(f"{where}.descriptor.key_scheme", descriptor.key_scheme,
                                  f"known: {', '.join(key_schemes.names())}")
        out.append(ReplicaEntry(check_url(entry["url"], f"{where}.url"), given))
    return out


def check_url(url: str, source: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ConfigError(source, url, "must be a replica's base URL, e.g. http://127.0.0.1:8000")
    try:
        parts.port
    except ValueError:
        raise ConfigError(source, url, "has an invalid port") from None
    return url.rstrip("/")


class Fleet:
    """The replicas behind one router, and the HTTP session it reaches them with."""

    def __init__(self, session, default_rates: ReplicaRates, health_interval: float) -> None:
        self.session = session
        self.default_rates = default_rates
        self.health_interval = health_interval
        self.replicas: dict[str, Replica] = {}
        self._encoders: dict[tuple[str, str], PromptEncoder] = {}
        self._health: asyncio.Task | None = None

    # -- membership ----------------------------------------------------------------------------------
    async def add(self, url: str, descriptor: GivenDescriptor | None = None) -> Replica:
        """``descriptor``: given for a replica that does not answer ``/tiercache/replica`` (``vllm serve``)."""
        url = check_url(url, "replica")
        name = urlsplit(url).netloc
        if name in self.replicas:
            raise ConfigError("replica", url, "is already in the fleet")
        replica = Replica(name, url, self.default_rates, given=descriptor)
        self.replicas[name] = replica
        await self._check(replica)
        return replica

    async def remove(self, name: str) -> bool:
        replica = self.replicas.pop(name, None)
        if replica is None:
            return False
        await self._down(replica)
        return True

    def up(self, model: str | None) -> list[Replica]:
        return [r for r in self.replicas.values() if r.up and (model is None or r.descriptor is None
                                                                or r.descriptor.model == model)]

    def models(self) -> list[str]:
        return sorted({r.descriptor.model for r in self.replicas.values() if r.up and r.descriptor is not None})

    # -- health --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._health = asyncio.create_task(self._health_loop(), name="tiercache-route-health")

    async def close(self) -> None:
        if self._health is not None:
            self._health.cancel()
        for replica in list(self.replicas.values()):
            await self._down(replica)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))

    async def _check(self, replica: Replica) -> None:
        """Ask the replica's health and descriptor; up with its events followed, or down."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.health_interval)
        try:
            async with self.session.get(f"{replica.url}/health", timeout=timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            descriptor = replica.given.read() if replica.given else await self._descriptor(replica, timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, ConfigError) as err:
            if replica.up:
                log.warning("tiercache route: replica %s is down (%s)", replica.name, err or type(err).__name__)
            await self._down(replica)
            return
        in_flight, sent = replica.load.in_flight, replica.load.requests
        queue = await self._engine_queue(replica, timeout)
        replica.load.reported(queue, in_flight + replica.load.requests - sent)
        if replica.up and _same_instance(replica.descriptor, descriptor) and not _crashed(replica.task):
            replica.learn_rates(descriptor)
            return
        if replica.up:
            log.warning("tiercache route: replica %s restarted", replica.name)
        await self._down(replica)
        self._up(replica, descriptor)

    async def _engine_queue(self, replica: Replica, timeout) -> EngineQueue | None:
        """The requests in the replica's engine by its own /metrics; None when it publishes none the router
        knows, or does not answer in time (a replica is up or down by its /health alone)."""
        import aiohttp

        try:
            async with self.session.get(f"{replica.url}/metrics", timeout=timeout) as resp:
                return engine_queue(await resp.text()) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
            return None

    async def _descriptor(self, replica: Replica, timeout) -> ReplicaDescriptor | None:
        async with self.session.get(f"{replica.url}/tiercache/replica", timeout=timeout) as resp:
            return (ReplicaDescriptor.from_dict(await resp.json(), f"{replica.url}/tiercache/replica")
                    if resp.status == 200 else None)

    def _up(self, replica: Replica, descriptor: ReplicaDescriptor | None) -> None:
        scheme = None
        if descriptor is not None:
            try:
                replica.encoder = self._encoder(descriptor)
                scheme = key_schemes.get(descriptor.key_scheme)
            except (ConfigError, RegistryError) as err:   # checked once, here: load alone, not a 500 per request
                log.warning("tiercache route: replica %s: %s; routed by load alone", replica.name, err)
                descriptor = None
        replica.descriptor, replica.up, replica.since = descriptor, True, time.monotonic()
        replica.learn_rates(descriptor)
        if descriptor is None or descriptor.events is None or scheme is None:
            return
        replica.scheme = scheme(descriptor)
        replica.index.rename(replica.scheme)
        replica.follower = EventFollower(replica.name, descriptor.events, replica.index,
                                         resync=lambda: self._announce(replica))
        replica.task = asyncio.create_task(replica.follower.run(), name=f"tiercache-route-events-{replica.name}")

    def _encoder(self, descriptor: ReplicaDescriptor) -> PromptEncoder:
        spec = (descriptor.tokenizer, descriptor.chat_template)
        if spec not in self._encoders:
            self._encoders[spec] = PromptEncoder(*spec)
        return self._encoders[spec]

    async def _down(self, replica: Replica) -> None:
        replica.up = False
        if replica.task is not None:
            replica.task.cancel()
            await asyncio.gather(replica.task, return_exceptions=True)
        replica.task, replica.follower, replica.scheme, replica.encoder = None, None, None, None
        replica.index.clear()

    def mark_down(self, replica: Replica) -> None:
        """The proxy could not reach it: down now, back when a health check answers."""
        if replica.up:
            log.warning("tiercache route: replica %s refused a request; down until it answers", replica.name)
            replica.up = False
            asyncio.get_running_loop().create_task(self._down(replica))

    async def _announce(self, replica: Replica) -> int | None:
        import aiohttp

        try:
            async with self.session.post(f"{replica.url}/tiercache/kv/announce",
                                         timeout=aiohttp.ClientTimeout(total=self.health_interval * 5)) as resp:
                return int((await resp.json())["seq"]) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
            return None


def _crashed(task: asyncio.Task | None) -> bool:
    """A follower that stopped by itself (an error it could not handle): its index is stale, start it again."""
    if task is None or not task.done():
        return False
    if not task.cancelled() and task.exception() is not None:
        log.error("tiercache route: following a replica's events failed: %r", task.exception())
    return True


def _same_instance(a: ReplicaDescriptor | None, b: ReplicaDescriptor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.instance == b.instance)
