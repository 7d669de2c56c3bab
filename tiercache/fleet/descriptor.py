"""What a replica tells a router about itself: how to hash a prompt as it does, and where its KV events are.

Plain data on both sides: `tiercache api` answers it at ``GET /tiercache/replica``; `tiercache route` reads
it when a replica joins and again at every health check (a new ``instance`` is a restarted replica: its
index is started again). With the chain's seed, block size and hash function the router computes the same
block hashes and chunk keys the replica's pool and tiers hold — an exact prediction, not a guess from text.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
    hash: str = "sha256"
    seed: str = ""              # hex: where the replica's chains start (before a request's cache_salt)
    tokenizer: str = "bytes"    # "bytes", or the tokenizer.json the replica loaded
    chat_template: str = "tiercache"
    media: tuple[str, ...] = ()  # the media it publishes events for: GPU (its pool), CPU, DISK, REMOTE
    shared_tiers: tuple[str, ...] = ()  # the remote tiers it reads (grpc://host:port, the Redis URL): what any
                                        # replica with the same chains stores there, this one can load
    events: EventEndpoints | None = None
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
        if descriptor.version != DESCRIPTOR_VERSION:
            raise ConfigError(f"{source}.version", descriptor.version,
                              f"this router reads version {DESCRIPTOR_VERSION}")
        return descriptor
