"""``tiercache purge``: take KV out of a deployment — a tenant's, a namespace's, a prompt's, or by age.

What it reaches (docs/architecture.md, "Purge"):
- a `tiercache serve` (``--server``): its ``Purge`` call takes the chunks out of the server's memory and
  disk, and the server passes the purge on to every engine under it, whose client tier polls for purges and
  applies them to the engine's L1 and local disk; the call answers once those engines have (or its wait
  is over) and says how many did;
- a Redis (``--redis``): the purge is announced in the stream ``tiercache-purges``, which every engine
  reading that Redis polls and applies to its own L1 and disk, as under a server; once they have, the values
  of the tier's layout it selects are unlinked, found by ``SCAN`` and their headers (parent, first store
  time; a value whose header cannot be read goes with any purge by age);
- disk tier directories (``--disk-path``): the files themselves, temp files included, for an engine that is
  stopped or has no shared server (a running engine that indexed a removed file finds it gone: a miss).

A prompt is named by its text (``--prompt``), a chat (``--messages``) or token ids (``--tokens``), hashed as
the engine that served it does (``--replica``: a running `tiercache api`'s URL, or a replica descriptor file
— the one a vLLM connector writes with ``router_descriptor``, completed by ``--model``, ``--tokenizer`` and
``--chat-template``), or by chunk keys (``--keys``). Everything stored after the prompt's chunks in any
request goes too: a later chunk's KV encodes the earlier tokens.
"""
from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.contracts.purge import (
    DEFAULT_WAIT_S,
    POLL_INTERVAL_S,
    WATCHER_TTL_S,
    PurgeOrder,
    PurgeReport,
    repeat_passes,
)
from tiercache.errors import ChunkFormatError, ConfigError
from tiercache.tiers.purge_watch import REDIS_APPLIED, REDIS_KEEP, REDIS_STREAM, redis_now, stream_id
from tiercache.wire import tiercache_pb2 as pb
from tiercache.wire.chunk_format import HEADER_BYTES, read_header


@dataclass(frozen=True, slots=True)
class PromptSource:
    """How the engine that served a prompt names its chunks, and the prompt."""
    replica: str                    # URL of a `tiercache api`, or a descriptor JSON file
    text: str | None = None
    messages_file: str | None = None
    tokens: tuple[int, ...] | None = None
    model: str = ""
    tokenizer: str = ""
    chat_template: str = ""
    cache_salt: str = ""
    keep_first: int = 0             # leading tokens not purged (a shared system prompt)


@dataclass(slots=True)
class PurgeResult:
    """What a purge took, per place ("server/memory", "redis", "disk:/path"), and the engines it reached."""
    report: PurgeReport = field(default_factory=PurgeReport)
    engines_applied: int = 0
    engines_pending: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        r = self.report
        return {"tiers": {name: {"chunks": c, "bytes": b} for name, (c, b) in r.tiers.items()},
                "chunks": r.chunks, "bytes": r.nbytes,
                "engines": {"applied": self.engines_applied, "pending": self.engines_pending},
                "seconds": round(self.seconds, 3)}


def read_descriptor(src: PromptSource):
    """The replica descriptor a prompt is hashed by (flags fill what a connector's file leaves out)."""
    from tiercache.fleet.descriptor import ReplicaDescriptor

    where = src.replica
    try:
        if where.startswith(("http://", "https://")):
            with urllib.request.urlopen(where.rstrip("/") + "/tiercache/replica", timeout=10) as reply:
                data = json.load(reply)
        else:
            data = json.loads(Path(where).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError("--replica", where, f"cannot read a replica descriptor: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError("--replica", where, "is not a replica descriptor (a JSON object)")
    if src.model and data.get("model") and data["model"] != src.model:
        raise ConfigError("--model", src.model, f"the replica at {where} serves {data['model']!r}: a prompt for "
                                                "another model names other chunks")
    given = {"model": src.model, "tokenizer": src.tokenizer, "chat_template": src.chat_template}
    data = {"instance": "purge", **data, **{k: v for k, v in given.items() if v and k not in data}}
    if "model" not in data:
        raise ConfigError("--model", "", f"the descriptor {where} names no model: give --model")
    return ReplicaDescriptor.from_dict(data, "--replica")


def prompt_keys(src: PromptSource) -> tuple[bytes, ...]:
    """The chunk keys of the prompt from ``keep_first`` tokens on, as its replica's tiers name them."""
    from tiercache.fleet.prefix_index import key_schemes
    from tiercache.fleet.replicas import PromptEncoder

    descriptor = read_descriptor(src)
    if not descriptor.chunk_tokens:
        raise ConfigError("--replica", src.replica, "names an engine without tiers: nothing of it to purge")
    if src.tokens is not None:
        tokens = list(src.tokens)
    else:
        encoder = PromptEncoder(descriptor.tokenizer, descriptor.chat_template)
        if src.messages_file:
            try:
                messages = json.loads(Path(src.messages_file).read_text())
            except (OSError, ValueError) as err:
                raise ConfigError("--messages", src.messages_file, f"cannot read: {err}") from None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ConfigError("--messages", src.messages_file, "must be a JSON list of chat messages")
            tokens = encoder.encode_chat(messages)
        else:
            tokens = encoder.encode(src.text or "")
    keys = key_schemes.get(descriptor.key_scheme)(descriptor).keys(tokens, src.cache_salt).chunk_keys
    if not keys:
        raise ConfigError("--prompt", f"{len(tokens)} tokens", f"is shorter than one chunk "
                                                              f"({descriptor.chunk_tokens} tokens): nothing is stored")
    skip = src.keep_first // descriptor.chunk_tokens        # whole chunks inside the kept tokens stay
    if skip >= len(keys):
        raise ConfigError("--keep-first", src.keep_first, f"keeps every chunk of the prompt ({len(keys)})")
    return tuple(keys[skip:])


def parse_hex_list(text: str, flag: str, size: int) -> tuple[bytes, ...]:
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            value = bytes.fromhex(item)
        except ValueError:
            raise ConfigError(flag, item, "is not hex") from None
        if len(value) != size:
            raise ConfigError(flag, item, f"must be {size} bytes ({2 * size} hex digits)")
        out.append(value)
    if not out:
        raise ConfigError(flag, text, "names nothing")
    return tuple(out)


def purge_server(address: str, token: str | None, order: PurgeOrder, tenant: str, wait_s: float,
                 result: PurgeResult, timeout_s: float = 120.0) -> None:
    """One ``Purge`` call; a refusal raises `PurgeRefused` with the server's status and words."""
    import grpc

    from tiercache.wire.grpc_messages import AUTH_HEADER, method

    spec = pb.PurgeSpec(namespaces=order.namespaces, roots=order.roots, stored_before=order.stored_before or 0.0,
                        everything=order.everything)
    request = pb.PurgeRequest(spec=spec, tenant=tenant, wait_s=wait_s)
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method("Purge"), lambda b: b, lambda b: b)
        try:
            raw = call(request.SerializeToString(), timeout=timeout_s,
                       metadata=((AUTH_HEADER, f"Bearer {token}"),) if token else ())
        except grpc.RpcError as err:
            raise PurgeRefused(f"{address}: {err.code().name}: {err.details()}") from None
    reply = pb.PurgeReply.FromString(raw)
    for t in reply.tiers:
        result.report.add(f"server/{t.name}", t.chunks, t.bytes)
    result.engines_applied += reply.engines_applied
    result.engines_pending += reply.engines_pending


class PurgeRefused(Exception):
    """A server refused the purge (no right, unknown tenant, bad request): its status and words."""


REDIS_KEY = re.compile(rb"tiercache:([0-9a-f]{32}):([0-9a-f]{64})")    # `tiercache.tiers.redis.redis_key`
REDIS_BATCH = 1000


def purge_redis(url: str, order: PurgeOrder, result: PurgeResult, cluster: bool = False, wait_s: float = 0.0) -> None:
    """Announce the purge to the engines reading this Redis (the stream ``tiercache-purges``), wait until those
    that polled within the last few seconds applied it to their L1 and disks (or ``wait_s`` passed), then
    unlink the values it selects (keys of the tier's layout only; parents and store times from the values'
    headers, one pipelined ``GETRANGE`` each). Deleting after the engines applied it leaves none of them a copy to write
    back; passes repeat while they find something, so a write already on its way is taken as well."""
    import redis

    from tiercache.tiers.redis import fast_client

    client = fast_client(url, cluster, socket_timeout=30, socket_connect_timeout=5)
    try:
        position = _announce(client, order)
        applied, pending = _wait_for_engines(client, position, wait_s or DEFAULT_WAIT_S)
        removed, nbytes = repeat_passes(lambda: _redis_pass(client, order))
    except redis.exceptions.RedisError as err:
        raise PurgeRefused(f"{url}: {type(err).__name__}: {err}") from None
    finally:
        client.close()
    result.report.add("redis", removed, nbytes)
    result.engines_applied += applied
    result.engines_pending += pending


def _announce(client, order: PurgeOrder) -> tuple[int, int]:
    spec = pb.PurgeSpec(namespaces=order.namespaces, roots=order.roots, stored_before=order.stored_before or 0.0,
                        everything=order.everything)
    entry = client.xadd(REDIS_STREAM, {"spec": spec.SerializeToString(), "at": f"{redis_now(client):.6f}"},
                        maxlen=REDIS_KEEP, approximate=True)
    return stream_id(entry)


def _wait_for_engines(client, position: tuple[int, int], wait_s: float) -> tuple[int, int]:
    """(applied, pending) among the engines that polled the stream within ``WATCHER_TTL_S``; entries of engines
    gone for an hour are dropped."""
    give_up = time.monotonic() + wait_s
    while True:
        now = redis_now(client)
        done = pending = 0
        for watcher, value in client.hgetall(REDIS_APPLIED).items():
            at, _, seen = value.decode().partition(" ")
            age = now - float(seen or 0)
            if age > 3600:
                client.hdel(REDIS_APPLIED, watcher)
            elif age < WATCHER_TTL_S:
                if stream_id(at) >= position:
                    done += 1
                else:
                    pending += 1
        if not pending or time.monotonic() >= give_up:
            return done, pending
        time.sleep(POLL_INTERVAL_S / 5)


def _redis_pass(client, order: PurgeOrder) -> tuple[int, int]:
    patterns = [b"tiercache:%s:*" % n.hex().encode() for n in order.namespaces] or [b"tiercache:*"]
    found: list[tuple[bytes, bytes]] = []          # (Redis key, chunk key)
    for pattern in patterns:
        for name in client.scan_iter(match=pattern, count=REDIS_BATCH):
            m = REDIS_KEY.fullmatch(name)
            if m:
                found.append((name, bytes.fromhex(m.group(2).decode())))
    links, born = [], {}
    if order.roots or order.stored_before is not None:      # a prompt's chains and ages are in the headers
        for batch in _batches(found):
            pipe = client.pipeline(transaction=False)
            for name, _ in batch:
                pipe.getrange(name, 0, HEADER_BYTES - 1)
            for (name, chunk), header in zip(batch, pipe.execute(raise_on_error=False)):
                with contextlib.suppress(ChunkFormatError, TypeError):
                    meta = read_header(header)[0]
                    links.append((chunk, meta.parent))
                    born[name] = meta.stored_at
    chosen = order.selector(links)
    doomed = [name for name, chunk in found if chosen(chunk, born.get(name, 0.0))]
    removed = nbytes = 0
    for batch in _batches(doomed):
        pipe = client.pipeline(transaction=False)
        for name in batch:
            pipe.strlen(name)
            pipe.unlink(name)
        replies = pipe.execute(raise_on_error=False)
        for size, gone in zip(replies[::2], replies[1::2]):
            if gone == 1:
                removed += 1
                nbytes += size if isinstance(size, int) else 0
    return removed, nbytes


def _batches(items: list, n: int = REDIS_BATCH):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def purge(order: PurgeOrder, server: str = "", token: str | None = None, tenant: str = "", wait_s: float = 0.0,
          disk_paths: tuple[str, ...] = (), redis_url: str = "", redis_cluster: bool = False) -> PurgeResult:
    """Purge every place named; the server first (it passes the purge on to the engines under it)."""
    from tiercache import cache_dir

    result = PurgeResult()
    started = time.perf_counter()
    if server:
        purge_server(server, token, order, tenant, wait_s, result)
    if redis_url:
        purge_redis(redis_url, order, result, redis_cluster, wait_s)
    for path in disk_paths:
        files, nbytes = cache_dir.purge(Path(path), order)
        result.report.add(f"disk:{path}", files, nbytes)
    result.seconds = time.perf_counter() - started
    return result

