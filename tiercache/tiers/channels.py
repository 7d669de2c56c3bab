"""One interface for every way a remote tier moves chunk values: `ValueChannel` (worker side).

A value channel is one path between this rank's L1 slots and a remote
store: Redis over a raw socket or redis-py's pipeline, `tiercache serve`'s
shared-memory directory, its data channel, its gRPC streams. A channel only
moves bytes and says, per chunk, what happened; the remote transport that
holds it (`tiercache.tiers.remote.RemoteTransport`) owns everything around
that — the order of its channels, the fallback from one to the next, the
outage and its probe, the one error path. So a new path (a new store, an
encrypting wrapper) is one class in one file.

The contract every channel keeps:

- ``put(batch)`` stores the chunks of an `OutgoingBatch`, encoding them
  through ``batch.encoded()`` (again on each try: an encoding is consumed as
  it is sent), and returns the keys it did not store, with why.
- ``get(items, receive)`` takes each present value in through ``receive``
  (`RemoteTransport.receive`: verified, decoded, into the item's buffer) and
  answers per item its raw length, a `Failure`, or `ELSEWHERE` — this
  channel cannot see that chunk, the next one may (a file not in the shared
  directory, which the server may still hold on its disk).
- It raises `ChannelBusy` when it cannot serve this batch now but the next
  channel may (a data port at its connection cap): every item moves on.
- It raises one of its transport's ``transport_errors`` when the store is unreachable
  or broke the protocol: the transport marks the tier down, and the items not
  yet settled are `Failure.UNAVAILABLE`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from tiercache.codecs import Buffer
from tiercache.contracts.keys import BlockHash
from tiercache.contracts.plan import Failure, KeyFailures
from tiercache.wire.chunk_format import ChunkMeta
from tiercache.wire.codec_pipeline import CodecPipeline, Encoded
from tiercache.wire.values import ValueSource


class _Elsewhere:
    def __repr__(self) -> str:
        return "ELSEWHERE"


ELSEWHERE: Final = _Elsewhere()     # `get`'s answer for a chunk this channel cannot see: ask the next channel

ReadOutcome = int | Failure | _Elsewhere   # `get`'s answer per item: the raw length read, why not, or ELSEWHERE
Receive = Callable[[ValueSource, int, BlockHash, memoryview], "int | Failure"]


class ChannelBusy(Exception):
    """This channel cannot serve the batch now; the next channel may (the tier is not down)."""


@dataclass(slots=True)
class OutgoingBatch:
    """One batch of chunks to store, with the codec work that turns each into its stored form.

    ``refused`` holds, after each encoding, the chunks the codec refused (inf
    or nan KV): they fail alone, and a channel that declared a count of
    chunks before sending withdraws them (`Encoded.refused`)."""
    items: Sequence[tuple[ChunkMeta, Buffer]]
    codec: CodecPipeline
    refused: list[tuple[BlockHash, Failure]] = field(default_factory=list)

    def encoded(self) -> Iterator[Encoded]:
        """A fresh encoding of every chunk, in order (the next ones encoded while this one is sent)."""
        self.refused.clear()
        return self.codec.encoded(self.items, self.refused)

    def sent(self) -> Iterator[Encoded]:
        """`encoded` without the refused chunks, for a channel that sends only what it stores."""
        return (chunk for chunk in self.encoded() if chunk.refused is None)

    @property
    def nbytes(self) -> int:
        return sum(len(memoryview(raw).cast("B")) for _, raw in self.items)

    def all_failed(self, why: Failure) -> KeyFailures:
        return tuple((meta.key, why) for meta, _ in self.items)

    def failures(self, rejected: Sequence[BlockHash]) -> KeyFailures:
        """The chunks the codec refused in the latest encoding, and those the store ``rejected``."""
        withdrawn = {key for key, _ in self.refused}
        return tuple(self.refused) + tuple((key, Failure.IO) for key in rejected if key not in withdrawn)


class ValueChannel(ABC):
    """One path for a remote tier's chunk values (see the module's docstring for the contract)."""

    name: str = "values"       # as log lines name the path: "the data channel", "gRPC streams", ...

    @abstractmethod
    def put(self, batch: OutgoingBatch) -> KeyFailures:
        """Store ``batch``; the keys not stored, and why. Raises `ChannelBusy`, or the transport's errors."""

    @abstractmethod
    def get(self, items: Sequence[tuple[BlockHash, memoryview]], receive: Receive) -> list[ReadOutcome]:
        """Each item's raw length, `Failure` or `ELSEWHERE`. Raises `ChannelBusy`, or the transport's errors."""
