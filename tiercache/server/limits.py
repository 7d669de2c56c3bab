"""What bounds `tiercache serve` against its clients, whatever they send or withhold.

- **Memory.** A chunk's bytes are admitted before they are received: its
  declared length must be within ``max_value_bytes`` and is reserved from one
  server-wide budget of bytes in flight (``max_inflight_bytes``) — received
  but not yet stored — and released once the store has taken or refused it.
  A client that declares a huge value, or many clients that declare values
  and then go silent, hold at most that budget; nothing is allocated for them
  beyond it. The budget is divided fairly, per tenant and per connection,
  and a silent holder past its share is taken back when others need room
  (`tiercache.server.fair.InflightBytes`). Stored chunks are bounded by
  ``--capacity`` (and ``--disk-capacity``). gRPC messages are received only
  under a slot: a unary call's request (and ``Get``'s) under one of
  ``max_requests`` request slots, a ``Put`` stream's messages under one of
  ``max_streams`` stream slots (`tiercache.server.service`); gRPC refuses a
  message over ``--max-message`` from its length prefix; a call that holds no
  slot yet holds gRPC's initial receive window (64 KiB: the window does not
  grow with the bandwidth gRPC estimates), and gRPC admits at most ``MAX_CALLS``
  calls, ``MAX_CALLS_PER_CONNECTION`` on one connection. So the server's memory
  stays within `memory_bound`: capacity + in-flight budget + a message per slot
  + a window per call + a constant, logged at start — provided a finished
  call's memory is given back, which takes grpc.aio's reads and writes
  shielded from cancellation (`tiercache.server.rpc_calls`) and the cyclic
  garbage collector run on a clock (`tiercache.server.collector`).
- **Time.** Every read from a client has a deadline of the server's own:
  ``read_timeout_s`` for any progress within a request, ``idle_timeout_s``
  between requests on the data channel, and a value must arrive at
  ``min_rate_bytes_s`` or faster. gRPC streams (``Put``, ``Get``) that have
  waited on their client for ``read_timeout_s`` are cancelled by a watchdog
  (`StreamWatch`; the server's own work on a stream never counts).
- **Slots.** gRPC runs as an asyncio server (`tiercache.server.app`): a
  unary call's request is read on its event loop and only then is its work
  handed to a handler thread, so a call whose request never comes holds no
  thread — it holds a request slot, which a newcomer takes from it once it
  has been silent for ``REQUEST_SILENT_S``. At most ``max_streams`` gRPC
  streams at once — a Put's messages are read in its handler thread — fewer
  than the handler threads, so ``Health``, ``Contains`` and the other unary
  calls always find a thread. Request and stream slots are shared fairly
  among tenants (`StreamWatch`); a call that finds none free within its
  tenant's share is refused with ``RESOURCE_EXHAUSTED``;
  data-channel connections at most ``max_connections`` in all and
  ``max_connections_per_peer`` from one host, the oldest idle one of the
  tenant holding the most dropped to make room, a client refused only when
  every connection is busy. Connections still to say their hello hold no
  thread and at most a hello's bytes (their accept thread reads them all),
  ``max_connections`` of them at most (`tiercache.server.data_server`).
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

IDLE_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 10.0
MIN_RATE_BYTES_S = 8 << 20          # the slowest a value may arrive: its deadline is the read timeout plus its
                                    # length at this rate
RESERVED_HANDLERS = 2               # gRPC handler threads no stream may take
MIN_REQUESTS = 16                   # request slots (unary calls received or being worked on), at least
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_PEER = 64
MAX_CALLS = 1024                    # concurrent gRPC calls; a call no handler reads yet holds its state and
                                    # at most one receive window
MAX_CALLS_PER_CONNECTION = 128      # HTTP/2 streams one connection may have open
ADMIT_WAIT_S = 0.5                  # how long a value waits for room in the in-flight budget (well within a
                                    # client's own timeout) before it is refused as busy


# What `memory_bound` counts beyond the chunks and the in-flight budget
MESSAGE_COPIES = 3          # a message being read lives as gRPC's slices and as the bytes made of them; a Get's
                            # message being sent, once more in gRPC's send buffer
CALL_BYTES = 96 << 10       # a call waiting: gRPC's initial receive window (64 KiB) and the call's state
CONNECTION_BYTES = 64 << 10  # a data-channel connection's own buffers
BASE_BYTES = 192 << 20      # the interpreter, gRPC's threads and the allocator's slack


def memory_bound(limits: "ServerLimits", capacity: int, max_message: int) -> int:
    """The most memory `tiercache serve` takes whatever its clients send: the stored chunks (``capacity``),
    the values being received (``max_inflight_bytes``), a message per request and stream slot (a message is
    received only under a slot), every call gRPC admits waiting with one receive window, every data-channel
    connection, and the base. The test of the server's memory samples RSS against it."""
    slots = (limits.max_requests + limits.max_streams) * MESSAGE_COPIES * max_message
    return (capacity + limits.max_inflight_bytes + slots + MAX_CALLS * CALL_BYTES
            + limits.max_connections * CONNECTION_BYTES + BASE_BYTES)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_value_bytes: int
    max_inflight_bytes: int
    max_streams: int
    max_requests: int
    read_timeout_s: float = READ_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    min_rate_bytes_s: float = MIN_RATE_BYTES_S
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER
    admit_wait_s: float = ADMIT_WAIT_S

    @classmethod
    def for_server(cls, capacity: int, workers: int, max_value_bytes: int = 0, max_inflight_bytes: int = 0,
                   **overrides) -> "ServerLimits":
        """Defaults that follow the server's size: a value at most 256 MiB and the capacity; in flight, room
        for four of the largest values, at most the capacity (never less than one value)."""
        value = max_value_bytes or min(256 << 20, capacity)
        inflight = max_inflight_bytes or max(value, min(4 * value, capacity))
        return cls(value, inflight, max(1, workers - RESERVED_HANDLERS), max(MIN_REQUESTS, 2 * workers), **overrides)

    def value_deadline_s(self, nbytes: int) -> float:
        """Seconds a value of ``nbytes`` may take to arrive."""
        return self.read_timeout_s + nbytes / self.min_rate_bytes_s


class StreamWatch:
    """The gRPC streams in progress: admitted up to ``limit`` at once, and cancelled when one has waited on its
    client for ``stall_s`` (a client that opens a ``Put`` and goes silent, or stops reading a ``Get``).

    The rule is the client's progress, not the stream's age: the clock runs only between `waiting` (the
    handler asks the client for its next message, or hands it one to read) and `moved` (it came, or was
    taken). Time the server spends on a stream itself — storing a chunk, waiting for in-flight room,
    reading a value to send — never counts, so a loaded server, whose own work load stretches, does not
    cut the legitimate clients it is slow to serve.

    Slots are shared fairly among tenants. A tenant's share is the slots divided among the tenants holding
    some or asking within ``active_s``, its own counted. A tenant at its share is refused a new slot while
    another tenant is active, even with slots free — they are the other's; alone, it may take all but
    ``headroom``, which stay free for a tenant that comes (its first call never waits on another's).
    When every slot is taken, a newcomer below its share gets one from the tenant holding the most, if that
    tenant is over its share and one of its streams has waited on its client for ``share_silent_s`` — that
    stream is ended. A tenant's streams that keep moving are never cut for another. With ``take_back_own``
    (the request slots, whose one message comes at once from any client that means to send it), a silent
    stream of the newcomer's own tenant, or of one holding as many, is ended for it too.
    """

    def __init__(self, limit: int, stall_s: float, clock: Callable[[], float] = time.monotonic,
                 share_silent_s: float = 1.0, active_s: float = 1.0, take_back_own: bool = False,
                 headroom: int = 0) -> None:
        self.limit = limit
        self.headroom = min(headroom, limit - 1)
        self.take_back_own = take_back_own
        self.stall_s = stall_s
        self.share_silent_s = share_silent_s
        self.active_s = active_s
        self._clock = clock
        self._lock = threading.Lock()
        self._streams: dict[int, list] = {}       # id → [context, waiting on the client since (None: not), tenant]
        self._asked: dict[str, float] = {}        # tenant → its last admit (tenants are the configured few)
        self._ids = iter(range(1 << 62))
        self.cancelled = 0
        self.refused = 0
        self.taken_back = 0                       # silent streams ended to give another tenant its share
        self._stop = threading.Event()
        self._taken: queue.SimpleQueue = queue.SimpleQueue()    # (context, why) taken back, to be ended
        self._thread = threading.Thread(target=self._watch, name="tiercache-stream-watch", daemon=True)
        self._thread.start()

    def admit(self, context, tenant: str = "", count: bool = True) -> int | None:
        """A slot for a new stream of ``tenant``, or None (counted in `refused` unless ``count`` is False:
        a caller that asks again counts its final refusal itself) when its share is taken, or every slot
        is and none can be taken back for it (see the class docstring). ``context`` is the call: anything
        with gRPC's ``abort(code, details)``, which ends it."""
        victim = None
        with self._lock:
            now = self._clock()
            self._asked[tenant] = now
            held, share = self._share(tenant, now)
            if len(self._streams) >= self.limit or held >= share:
                victim = self._take_back_for(tenant, held, share, now)
                if victim is None:
                    self.refused += count
                    return None
            sid = next(self._ids)
            self._streams[sid] = [context, None, tenant]
        if victim is not None:   # ended by the watchdog's thread: admit runs on gRPC's event loop too, and a
            # synchronous handler's context ends its call through that loop — from the loop, that would block it
            self._taken.put((victim, "a silent stream past its tenant's share of the slots, taken for another"))
        return sid

    @property
    def open(self) -> int:
        """Streams holding a slot now."""
        return len(self._streams)

    def _held(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for entry in self._streams.values():
            held[entry[2]] = held.get(entry[2], 0) + 1
        return held

    def _share(self, tenant: str, now: float) -> tuple[int, int]:
        """Under the lock: (slots ``tenant`` holds, its share). Alone, its share is every slot but the
        headroom."""
        held = self._held()
        active = held.keys() | {t for t, at in self._asked.items() if now - at <= self.active_s} | {tenant}
        share = self.limit - self.headroom if len(active) == 1 else max(1, self.limit // len(active))
        return held.get(tenant, 0), share

    def _take_back_for(self, tenant: str, mine: int, share: int, now: float):
        """Under the lock: end (and forget) the longest-silent stream of the tenant most over its share, if
        ``tenant`` is below its own — or, with ``take_back_own``, of any tenant holding at least as many
        slots as ``tenant`` (itself included); returns its context, or None."""
        held = self._held()
        owners = set()
        greedy = max((t for t in held if t != tenant), key=held.__getitem__, default=None)
        if mine < share and greedy is not None and held[greedy] > share:
            owners.add(greedy)
        if self.take_back_own:
            owners |= {t for t, n in held.items() if n >= mine}
        silent = [(entry[1], sid) for sid, entry in self._streams.items()
                  if entry[2] in owners and entry[1] is not None and now - entry[1] >= self.share_silent_s]
        if not silent:
            return None
        _, sid = min(silent)                       # the one silent longest
        self.taken_back += 1
        return self._streams.pop(sid)[0]

    def waiting(self, sid: int) -> None:
        """The handler waits on the client from now (for its next message, or for it to read one)."""
        entry = self._streams.get(sid)
        if entry is not None:
            entry[1] = self._clock()

    def moved(self, sid: int) -> None:
        """The client moved: the handler works on its own time again."""
        entry = self._streams.get(sid)
        if entry is not None:
            entry[1] = None

    def done(self, sid: int) -> None:
        with self._lock:
            self._streams.pop(sid, None)

    def close(self) -> None:
        self._stop.set()
        self._taken.put(None)       # wakes the watchdog from its wait for the next stream to end
        self._thread.join(timeout=2)

    def _watch(self) -> None:
        """End what `admit` took back, as soon as it is queued; every tick, end the streams that stalled."""
        tick = min(1.0, self.stall_s / 4)
        next_tick = time.monotonic() + tick
        while not self._stop.is_set():
            try:
                taken = self._taken.get(timeout=max(0.0, next_tick - time.monotonic()))
                if taken is not None:
                    end_call(*taken)
                continue
            except queue.Empty:
                next_tick = time.monotonic() + tick
            now = self._clock()
            with self._lock:
                stalled = [(sid, e[0]) for sid, e in self._streams.items()
                           if e[1] is not None and now - e[1] > self.stall_s]
                for sid, _ in stalled:
                    del self._streams[sid]
            for _, context in stalled:
                self.cancelled += 1
                end_call(context)


def end_call(context: grpc.ServicerContext, why: str = "the stream stalled past the server's read timeout") -> None:
    """End a call from another thread (a stalled stream, or one whose reservation was taken back). The
    asyncio server's context for a synchronous handler has no ``cancel``; its ``abort`` ends the call (the
    client sees DEADLINE_EXCEEDED, the handler's blocked read raises) and raises here too, which is the
    caller's to swallow."""
    with contextlib.suppress(Exception):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, why)
