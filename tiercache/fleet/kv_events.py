"""KV events on the wire, as vLLM publishes them: one format for vLLM's own publisher and the reference engine's.

A publisher sends each batch of events on a ZeroMQ PUB socket as three frames
— topic, an 8-byte big-endian sequence number, the msgpack-encoded
`KVEventBatch` — and keeps the last batches for replay: a subscriber that
sees a gap sends the first sequence number it misses to the ROUTER socket and
gets the kept batches from there on, then an end marker (sequence -1). This
is vLLM's `ZmqEventPublisher` protocol (``kv_events_config``), so the router
reads a `vllm serve` and a `tiercache api` alike; the structs below decode
vLLM's messages (unknown fields are ignored) without importing vLLM.

Media, as vLLM names them: ``GPU`` is an engine's own pool (L0, wherever the
pool lives); tiercache's tiers publish ``CPU``, ``DISK`` and ``REMOTE``.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_ENGINE = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (msgspec tags each with its class name, as vLLM does)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Any]                 # bytes (tiercache, vLLM's sha256 hashes) or int (vLLM's builtin hash)
    parent_block_hash: Any | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None          # required, as vLLM's decoder requires them (None is sent, not omitted)
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None     # per block: (lora name, mm pairs, cache_salt, ...) — untagged
    group_idx: int | None = None            # vLLM's KV cache group (hybrid models have several)
    kv_cache_spec_kind: str | None = None   # that group's kind, as vLLM names it ("sliding_window", "mamba", ...)
    kv_cache_spec_sliding_window: int | None = None   # a sliding-window group's window, in tokens


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher's whole cache is gone (and, from a tiercache replica, what follows in the batch is
    everything it holds)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """One batch; `msgspec.DecodeError` (a `ValueError`) for anything that is not one."""
    return _decoder.decode(payload)


class EventPublisher:
    """Publishes batches (PUB) and answers replays (ROUTER) for one engine.

    `publish` is called by the engine's one thread and never blocks (PUB drops
    at its high-water mark, and the replay buffer is how a subscriber gets
    what it dropped). Replays are answered by a thread of this publisher's own
    with a socket of its own; the buffer between the two is guarded by a lock.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, replay_port: int = 0, topic: str = "",
                 buffer_batches: int = 10_000) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint = self._bind(self._pub, host, port)
            self.replay_endpoint = self._bind(self._replay, host, replay_port)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._topic = topic.encode()
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, name="tiercache-kv-replay", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock, host: str, port: int) -> str:
        import zmq

        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            sock.bind_to_random_port(f"tcp://{host}")
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def publish(self, events: list[KVCacheEvent]) -> int:
        """Send one batch; its sequence number."""
        payload = encode(KVEventBatch(ts=time.time(), events=events))
        with self._lock:
            seq = next(self._seq)
            self._buffer.append((seq, payload))
            self._send(seq, payload)
        return seq

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def _serve_replays(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                kept = [(seq, payload) for seq, payload in self._buffer if seq >= first]
            for seq, payload in kept:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)
