"""What a replica tells a router about itself: how to hash a prompt as it does, and where its KV events are.

Plain data on both sides: `tiercache api` answers it at ``GET /tiercache/replica``; `tiercache route` reads
it when a replica joins and again at every health check (a new ``instance`` is a restarted replica: its
index is started again). With the chain's seed, block size and hash function the router computes the same
block hashes and chunk keys the replica's pool and tiers hold — an exact prediction, not a guess from text.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tiercache.errors import ConfigError

DESCRIPTOR_VERSION = 1


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    endpoint: str               # ZeroMQ PUB, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str        # ZeroMQ ROUTER answering replays
    topic: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaDescriptor:
    model: str                  # the served model name requests carry
    instance: str               # one per process: changes when the replica restarts
    key_scheme: str             # how the router hashes for it (a name in `fleet.key_schemes`)
    block_size: int             # tokens per block of the engine's pool
    chunk_tokens: int           # tokens per chunk of its tiers (0: no tiers)
    partial_chunks: bool = False  # its lookups end on a shorter chunk some request stored (keys.partial_chunks)
    resume_points: bool = False   # its hits end at a chunk with a resume point beside it (a model with sliding
                                  # windows or recurrent states: `contracts.groups`)
    hash: str = "sha256"
    seed: str = ""              # hex: where the replica's chains start (before a request's cache_salt)
    tokenizer: str = "bytes"    # "bytes", or the tokenizer.json the replica loaded
    chat_template: str = "tiercache"
    media: tuple[str, ...] = ()  # the media it publishes events for: GPU (its pool), CPU, DISK, REMOTE
    shared_tiers: tuple[str, ...] = ()  # the remote tiers it reads (grpc://host:port, the Redis URL): what any
                                        # replica with the same chains stores there, this one can load
    events: EventEndpoints | None = None
    load_tokens_per_s: dict = field(default_factory=dict)   # its own loads per tier medium (`fleet.load_rates`)
    prefill_tokens_per_s: float = 0.0            # its prefill, timed before serving (0: not timed):
    prefill_attention_s_per_pair: float = 0.0    # the two parts of `routing.ReplicaRates.prefill_s`
    version: int = DESCRIPTOR_VERSION
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object, source: str) -> ReplicaDescriptor:
        """Checked whole; a `ConfigError` naming ``source`` and the field otherwise."""
        if not isinstance(data, dict):
            raise ConfigError(source, type(data).__name__, "a replica descriptor is a JSON object")
        data = dict(data)
        events = data.pop("events", None)
        try:
            if events is not None:
                events = EventEndpoints(**events)
            descriptor = cls(events=events, **{k: tuple(v) if k in ("media", "shared_tiers") else v
                                               for k, v in data.items()})
        except TypeError as err:
            raise ConfigError(source, "descriptor", f"not a replica descriptor ({err})") from None
        for name in ("block_size", "chunk_tokens"):
            value = getattr(descriptor, name)
            if not isinstance(value, int) or value < 0 or (name == "block_size" and value == 0):
                raise ConfigError(f"{source}.{name}", value, "must be a positive integer")
        for name in ("prefill_tokens_per_s", "prefill_attention_s_per_pair"):
            value = getattr(descriptor, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"{source}.{name}", value, "must be a number ≥ 0 (0: not measured)")
        if descriptor.version != DESCRIPTOR_VERSION:
            raise ConfigError(f"{source}.version", descriptor.version,
                              f"this router reads version {DESCRIPTOR_VERSION}")
        return descriptor


def shared_tiers_of(config) -> tuple[str, ...]:
    """The remote tiers a tiercache config reads — what every replica with the same chains and one of these
    tiers can load from the others' stores (``config``: a `TierCacheConfig`)."""
    return tuple(name for on, name in ((config.grpc.enabled, f"grpc://{config.grpc.address}"),
                                       (config.redis.enabled, config.redis.url)) if on)


@dataclass(frozen=True, slots=True)
class GivenDescriptor:
    """A descriptor given to the router for a replica that serves none itself (``vllm serve``): the fields of
    the router's replicas file, over the file a tiercache connector under that replica writes at start
    (``router_descriptor`` in its extra config: its chains' seed, chunk size, tiers and a new ``instance``
    per start) when there is one. Read again at every health check, so a restarted replica's new file is
    followed."""
    fields: dict
    file: str = ""
    source: str = "descriptor"

    def read(self) -> ReplicaDescriptor | None:
        """The descriptor; None while the connector's file is not written yet (the replica still starting)."""
        merged: dict = {"instance": "given", "chunk_tokens": 0}
        if self.file:
            try:
                written = json.loads(Path(self.file).read_text())
            except FileNotFoundError:
                return None
            except (OSError, ValueError) as err:
                raise ConfigError(f"{self.source}.descriptor_file", self.file, f"cannot read: {err}") from None
            if not isinstance(written, dict):
                raise ConfigError(f"{self.source}.descriptor_file", self.file, "is not a JSON object")
            merged |= written
        return ReplicaDescriptor.from_dict(merged | self.fields, f"{self.source}.descriptor")
