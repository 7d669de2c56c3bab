"""Sighting admission at the Redis tier's door, its state kept in Redis: what every replica asked for.

Redis runs no code of ours between calls, so the door's state lives in Redis itself and both halves of each
engine consult it, one script call each. Two doors (``redis.admission``):

- ``adaptive-sighting`` (`AdaptiveSightings`, the default): `AdaptiveSightingAdmit`'s rule — second-sighting
  while it pays, everything while it does not. `AdaptiveSightings.record` (scheduler side, queued on
  `RedisIndex`'s lookup thread) tells Redis the chunk keys of each request an engine admits: each is counted
  in the history, and those in the sample (the same 64-bit xxh3 hash and threshold as the Python rule, decided
  here) go through shadow LRU tiers in Redis — a scaled copy of this engine's L1 (one per engine, it expires
  an hour after the engine's last request), and under it the two shared copies of the tier, one taking
  everything L1 spills, one on a second sighting — whose duel (a saturating counter of the difference of
  their misses, in Redis) says which rule the door follows. Every replica's demand reaches the duel.
- ``second-sighting`` (`Sightings`): `RedisIndex`'s lookups count the keys of their runs (``sight``, after
  a lookup's answer) and the door takes a chunk asked for twice.

The history is two hashes, generations (each key by its first 8 bytes: a collision admits a chunk early, never
refuses one): once the current one holds a bound of keys — ``GHOST_FACTOR / 2`` times the tier's chunks, or,
while the tier's size is unknown, times as many keys as Redis holds (``DBSIZE``, within `MIN_GENERATION` and
``MAX_GHOST_KEYS / 2``) — it replaces the previous one. So a key is remembered for one to two generations.
Shadows are sorted sets ordered by a logical clock, trimmed to their slots on every call: the door's memory is
bounded by construction, as the Python rule's is in an engine.

`Sightings.admitted` (worker side, `RedisTransport.write_chunks`, before a batch is sent): the chunks Redis
has room for (no ``maxmemory``, or as many as fit between ``used_memory`` and it) go in unasked, from the
batch's head; after them, unless the duel says everything, a chunk goes in when it was sighted twice — any
replica's — and its parent was not refused in the same batch (a chain from its head: a tail without its head
is never hit). Refused chunks are never sent. It also files the tier's size in chunks (``maxmemory`` over the
batch's largest value), from which a door not told the tier's size sizes its shadows.

On a cluster every key shares one hash tag (one slot, so one node), and that node's memory and key count stand
for the cluster's. A Redis that refuses scripts leaves the door open (everything admitted), with a warning.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from tiercache.contracts.connector import RequestState
from tiercache.contracts.keys import BlockHash
from tiercache.log_limits import ThrottledLog
from tiercache.policies import admission as rule
from tiercache.policies.admission import GuardedTier
from tiercache.wire.chunk_format import ChunkMeta

log = logging.getLogger(__name__)

TAG = b"{tiercache-sightings}"                       # one hash tag: one slot
GENERATIONS = (TAG + b":now", TAG + b":before")
STATE = TAG + b":duel"           # a hash: duel (the picky shadow's misses less the other's), picky (1: the door
#                                  follows second-sighting), clock (the shadows' logical time), chunks (the tier's)
SHADOWS = (TAG + b":always", TAG + b":picky")
L1_SHADOW = TAG + b":l1:"        # + an engine's id
L1_SHADOW_TTL_S = 3600
MIN_GENERATION = 4096          # keys a generation holds at least, however few Redis holds
FIELD_BYTES = 8                # of a chunk key, as the history and the shadows name it

# ARGV[1]: the generation's bound (0: from DBSIZE); the rest as each script says
_HISTORY = f"""
local function history(first, last)
  local bound = tonumber(ARGV[1])
  if bound == 0 then
    local keys = {rule.GHOST_FACTOR // 2} * redis.call('DBSIZE')
    bound = math.max({MIN_GENERATION}, math.min({rule.MAX_GHOST_KEYS // 2}, keys))
  end
  for i = first, last do redis.call('HINCRBY', KEYS[1], ARGV[i], 1) end
  if redis.call('HLEN', KEYS[1]) >= bound then redis.call('RENAME', KEYS[1], KEYS[2]) end
end
"""

# KEYS: the current and the previous generation; ARGV: the bound, then the keys sighted (each once)
SIGHT = _HISTORY + "history(2, #ARGV)\nreturn 0\n"

# KEYS: the generations, the duel's state, the shadow L1, the two shadow tiers; ARGV: the bound, L1's slots, the
# tiers' slots, how many keys the request asked for (each once), those keys, then those of them in the sample.
# The reply: whether the door follows second-sighting, and the tier's chunks as `admitted` filed them
RECORD = _HISTORY + f"""
local l1_slots, slots, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
history(5, 4 + n)
local state, l1, always, picky = KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local clock = tonumber(redis.call('HGET', state, 'clock')) or 0
local duel = tonumber(redis.call('HGET', state, 'duel')) or 0
local mode = tonumber(redis.call('HGET', state, 'picky')) or 0
if slots > 0 then                                       -- 0: the tier's size is unknown, no shadow is touched
  redis.call('ZREMRANGEBYRANK', l1, 0, -l1_slots - 1)    -- shadows resized: their least recent leave
  redis.call('ZREMRANGEBYRANK', always, 0, -slots - 1)
  redis.call('ZREMRANGEBYRANK', picky, 0, -slots - 1)
end
local function use(z, f)
  clock = clock + 1
  redis.call('ZADD', z, string.format('%.0f', clock), f)
end
local function hit(z, f)
  if redis.call('ZSCORE', z, f) then use(z, f) return true end
  return false
end
local function store(z, cap, f)                          -- the key that leaves to make room, if any
  if cap == 0 then return f end
  use(z, f)
  if redis.call('ZCARD', z) > cap then return redis.call('ZPOPMIN', z)[1] end
  return nil
end
local function seen(f)
  return (tonumber(redis.call('HGET', KEYS[1], f)) or 0) + (tonumber(redis.call('HGET', KEYS[2], f)) or 0)
end
local run_always, run_picky = true, true                -- a hit is a leading run
for i = 5 + n, #ARGV do
  local f = ARGV[i]
  if not hit(l1, f) then
    run_always = hit(always, f) and run_always
    run_picky = hit(picky, f) and run_picky
    duel = duel + (run_always and 1 or 0) - (run_picky and 1 or 0)
    duel = math.max(-{rule.DUEL_BOUND}, math.min({rule.DUEL_BOUND}, duel))
    if math.abs(duel) >= {rule.DUEL_SWITCH} then mode = (duel > 0) and 0 or 1 end
    local spilled = store(l1, l1_slots, f)
    if spilled then
      if not redis.call('ZSCORE', always, spilled) then store(always, slots, spilled) end
      if not redis.call('ZSCORE', picky, spilled) and (redis.call('ZCARD', picky) < slots or seen(spilled) >= 2) then
        store(picky, slots, spilled)
      end
    end
  end
end
redis.call('HSET', state, 'clock', string.format('%.0f', clock), 'duel', duel, 'picky', mode)
redis.call('EXPIRE', l1, {L1_SHADOW_TTL_S})
return {{mode, tonumber(redis.call('HGET', state, 'chunks')) or 0}}
"""

# KEYS: the generations; ARGV: the bound, then keys of a request that comes back: each counts as sighted twice
RETAIN = _HISTORY + """
for i = 2, #ARGV do
  if (tonumber(redis.call('HGET', KEYS[1], ARGV[i])) or 0) < 2 then redis.call('HSET', KEYS[1], ARGV[i], 2) end
end
history(2, 1)
return 0
"""

# KEYS: the generations and the duel's state; ARGV: the bytes of the batch's largest chunk, then its chunk keys.
# The reply: how many chunks Redis has room for (all of them while the duel says everything), then (when not
# for all) each chunk's sightings
ADMIT = """
local info = redis.call('INFO', 'memory')
local limit = tonumber(string.match(info, 'maxmemory:(%d+)'))
local free = limit - tonumber(string.match(info, 'used_memory:(%d+)'))
local out = {#ARGV - 1}
if limit > 0 then
  out[1] = math.max(0, math.floor(free / tonumber(ARGV[1])))
  local chunks = tostring(math.floor(limit / tonumber(ARGV[1])))
  if KEYS[3] and redis.call('HGET', KEYS[3], 'chunks') ~= chunks then redis.call('HSET', KEYS[3], 'chunks', chunks) end
end
if KEYS[3] and redis.call('HGET', KEYS[3], 'picky') ~= '1' then out[1] = #ARGV - 1 end
if out[1] >= #ARGV - 1 then return out end
for i = 2, #ARGV do
  out[i] = (tonumber(redis.call('HGET', KEYS[1], ARGV[i])) or 0) + (tonumber(redis.call('HGET', KEYS[2], ARGV[i])) or 0)
end
return out
"""


def field(key: BlockHash) -> bytes:
    return bytes(key[:FIELD_BYTES])


@dataclass(frozen=True, slots=True)
class ShadowShape:
    """`AdaptiveSightingAdmit`'s shadows for a tier (`shadow_shape`): L1's slots, each tier copy's, the sampled
    keys' bound (a key whose 64-bit xxh3 is below it is sampled) and the history's generation size."""

    l1_slots: int
    slots: int
    sample_below: int
    generation: int


def shadow_shape(tier: GuardedTier) -> ShadowShape:
    """The shadows `AdaptiveSightingAdmit.size_for` builds for ``tier``, and half its history: the same sizes."""
    chunks = max(1, tier.chunks)
    slots = min(chunks, rule.MAX_SHADOW_SLOTS, max(rule.SHADOW_SLOTS, chunks // rule.SHADOW_SHARE))
    return ShadowShape(l1_slots=min(rule.MAX_SHADOW_SLOTS, tier.l1_chunks * slots // chunks), slots=slots,
                       sample_below=(1 << 64) * slots // chunks,
                       generation=max(1, min(rule.MAX_GHOST_KEYS, rule.GHOST_FACTOR * chunks) // 2))


class Sightings:
    """The ``second-sighting`` door: its history counts lookups (`sight`), over one redis-py client (a cluster
    client too)."""

    counts_requests = False          # `sight` is told lookups' runs; `record` and `retain` are not this door's
    ranks = 1                        # writing ranks: a chunk is one value per rank
    _door_keys: tuple[bytes, ...] = GENERATIONS

    def __init__(self, client) -> None:
        import redis

        self._sight = client.register_script(SIGHT)
        self._admit = client.register_script(ADMIT)
        self._refused_scripts = redis.exceptions.ResponseError   # NOSCRIPT is the script object's to retry
        self._warn = ThrottledLog(log)

    def _run(self, what: str, script, keys: Sequence[bytes], args: list) -> object | None:
        """``script``'s reply, or None (with a warning) where Redis refuses it. Transport errors propagate."""
        try:
            return script(keys=keys, args=args)
        except self._refused_scripts as err:
            self._warn.warning(what, "redis tier: %s not run (%s); the door stays open", what, err)
            return None

    def size_for(self, tier: GuardedTier) -> None:
        """The tier and the L1 above it, as the engine knows them; this door's history follows ``DBSIZE``."""

    def record(self, keys: Sequence[BlockHash]) -> None:
        """A request an engine admitted; this door counts lookups, not requests."""

    def retain(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """The engine's hint on a request; this door takes none."""

    def sight(self, keys: Sequence[BlockHash]) -> None:
        """A lookup asked for ``keys``: one sighting each."""
        if keys:
            self._run("sightings", self._sight, GENERATIONS, [0, *dict.fromkeys(map(field, keys))])

    def admitted(self, chunks: Sequence[ChunkMeta]) -> list[bool]:
        """Whether each of a batch's chunks goes in (see the module's docstring). Transport errors propagate."""
        reply = self._run("admission", self._admit, self._door_keys,
                          [max(c.raw_len for c in chunks), *(field(c.key) for c in chunks)])
        if reply is None:
            return [True] * len(chunks)
        room, *seen = reply
        refused: set[BlockHash] = set()
        for chunk, n in zip(chunks[room:], seen[room:]):
            if n < 2 or chunk.parent in refused:
                refused.add(chunk.key)
        return [c.key not in refused for c in chunks]


class AdaptiveSightings(Sightings):
    """The ``adaptive-sighting`` door (see the module's docstring). One per engine: its shadow L1 is this
    engine's. ``l1_chunks``: the engine's L1, in chunks; ``tier_chunks``: Redis's, in chunks of every rank (0:
    ``maxmemory`` over a chunk's value, as `admitted` files it, over ``ranks`` — until then, or without a
    ``maxmemory``, the door has room and no duel is run)."""

    counts_requests = True
    _door_keys = (*GENERATIONS, STATE)

    def __init__(self, client, l1_chunks: int = 0, tier_chunks: int = 0) -> None:
        super().__init__(client)
        self._record = client.register_script(RECORD)
        self._retain = client.register_script(RETAIN)
        self._keys = (*GENERATIONS, STATE, L1_SHADOW + uuid.uuid4().hex.encode(), *SHADOWS)
        self.l1_chunks = l1_chunks
        self.tier_chunks = tier_chunks       # as told; else as Redis last said
        self._filed_chunks = 0
        self.admits_all = True               # as the duel said at the last `record`

    def size_for(self, tier: GuardedTier) -> None:
        self.l1_chunks, self.tier_chunks = tier.l1_chunks, tier.chunks

    @property
    def shape(self) -> ShadowShape | None:
        """The shadows' sizes now, or None while the tier's size is unknown."""
        chunks = self.tier_chunks or self._filed_chunks // max(1, self.ranks)
        return shadow_shape(GuardedTier(chunks, self.l1_chunks)) if chunks else None

    def sight(self, keys: Sequence[BlockHash]) -> None:
        """Lookups are not counted: `record` counts requests."""

    def record(self, keys: Sequence[BlockHash]) -> None:
        """An engine admitted a request wanting chunks ``keys`` (head first): one sighting each, and the sampled
        ones through the shadows. Transport errors propagate."""
        unique = dict.fromkeys(keys)
        if not unique:
            return
        shape = self.shape
        fields = [field(k) for k in unique]
        if shape is None:
            args = [0, 0, 0, len(fields), *fields]
        else:
            below = shape.sample_below
            sampled = [f for k, f in zip(unique, fields) if xxhash.xxh3_64_intdigest(k) < below]
            args = [shape.generation, shape.l1_slots, shape.slots, len(fields), *fields, *sampled]
        reply = self._run("sightings", self._record, self._keys, args)
        if reply is not None:
            picky, self._filed_chunks = (int(x) for x in reply)
            self.admits_all = not picky

    def retain(self, keys: Sequence[BlockHash], state: RequestState) -> None:
        """A request that comes back (preempted, or a conversation that continues): its chunks count as sighted
        twice, as `SecondSightingAdmit.retain` counts them. Transport errors propagate."""
        if keys and state in (RequestState.PREEMPTED, RequestState.CONTINUES):
            shape = self.shape
            self._run("sightings", self._retain, GENERATIONS,
                      [shape.generation if shape else 0, *dict.fromkeys(map(field, keys))])
