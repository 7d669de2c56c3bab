"""Second-sighting admission at the Redis tier's door, its history kept in Redis: what every replica asked for.

Redis runs no code of ours between calls, so the history lives in Redis itself and both halves of each engine
consult it, one script call each:

- `Sightings.sight` (scheduler side, on `RedisIndex`'s lookup thread, after a lookup's answer): the chunk keys
  of the lookup's run are counted in a hash (each by its first 8 bytes: a collision admits a chunk early, never
  refuses one). The history is two such hashes, generations: once the current one holds ``GHOST_FACTOR / 2``
  times as many keys as Redis holds (``DBSIZE``, within `MIN_GENERATION` and ``MAX_GHOST_KEYS / 2``), it
  replaces the previous one. So a key is remembered for one to two generations, and the history's memory is
  bounded by construction, as `second-sighting`'s own is in an engine.
- `Sightings.admitted` (worker side, `RedisTransport.write_chunks`, before a batch is sent): the chunks Redis
  has room for (no ``maxmemory``, or as many as fit between ``used_memory`` and it) go in unasked, from the
  batch's head; after them a chunk goes in when lookups asked for it twice — any replica's — and its parent
  was not refused in the same batch (a chain from its head: a tail without its head is never hit). Refused
  chunks are never sent.

On a cluster both hashes share one hash tag (one slot, so one node), and that node's memory and key count stand
for the cluster's. A Redis that refuses scripts leaves the door open (everything admitted), with a warning.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from tiercache.contracts.keys import BlockHash
from tiercache.log_limits import ThrottledLog
from tiercache.policies.admission import GHOST_FACTOR, MAX_GHOST_KEYS
from tiercache.wire.chunk_format import ChunkMeta

log = logging.getLogger(__name__)

GENERATIONS = (b"{tiercache-sightings}:now", b"{tiercache-sightings}:before")   # one hash tag: one slot
MIN_GENERATION = 4096          # keys a generation holds at least, however few Redis holds
FIELD_BYTES = 8                # of a chunk key, as the history names it

# KEYS: the current and the previous generation; ARGV: the keys sighted (each once)
SIGHT = f"""
local bound = math.max({MIN_GENERATION}, math.min({MAX_GHOST_KEYS // 2}, {GHOST_FACTOR // 2} * redis.call('DBSIZE')))
for i = 1, #ARGV do redis.call('HINCRBY', KEYS[1], ARGV[i], 1) end
if redis.call('HLEN', KEYS[1]) >= bound then redis.call('RENAME', KEYS[1], KEYS[2]) end
return 0
"""

# KEYS: as SIGHT's; ARGV: the bytes of the batch's largest chunk, then its chunk keys. The reply: how many chunks
# Redis has room for, then (when not for all) each chunk's sightings
ADMIT = """
local info = redis.call('INFO', 'memory')
local limit = tonumber(string.match(info, 'maxmemory:(%d+)'))
local free = limit - tonumber(string.match(info, 'used_memory:(%d+)'))
local out = {#ARGV - 1}
if limit > 0 then out[1] = math.max(0, math.floor(free / tonumber(ARGV[1]))) end
if out[1] >= #ARGV - 1 then return out end
for i = 2, #ARGV do
  out[i] = (tonumber(redis.call('HGET', KEYS[1], ARGV[i])) or 0) + (tonumber(redis.call('HGET', KEYS[2], ARGV[i])) or 0)
end
return out
"""


def field(key: BlockHash) -> bytes:
    return bytes(key[:FIELD_BYTES])


class Sightings:
    """The Redis tier's sighting history and door, over one redis-py client (a cluster client too)."""

    def __init__(self, client) -> None:
        import redis

        self._sight = client.register_script(SIGHT)
        self._admit = client.register_script(ADMIT)
        self._refused_scripts = redis.exceptions.ResponseError   # NOSCRIPT is the script object's to retry
        self._warn = ThrottledLog(log)

    def sight(self, keys: Sequence[BlockHash]) -> None:
        """A lookup asked for ``keys``: one sighting each. Transport errors propagate."""
        if keys:
            try:
                self._sight(keys=GENERATIONS, args=list(dict.fromkeys(map(field, keys))))
            except self._refused_scripts as err:
                self._warn.warning("sight", "redis tier: sightings not counted (%s)", err)

    def admitted(self, chunks: Sequence[ChunkMeta]) -> list[bool]:
        """Whether each of a batch's chunks goes in (see the module's docstring). Transport errors propagate."""
        try:
            room, *seen = self._admit(keys=GENERATIONS, args=[max(c.raw_len for c in chunks),
                                                              *(field(c.key) for c in chunks)])
        except self._refused_scripts as err:
            self._warn.warning("admit", "redis tier: admission not asked (%s); every chunk is admitted", err)
            return [True] * len(chunks)
        refused: set[BlockHash] = set()
        for chunk, n in zip(chunks[room:], seen[room:]):
            if n < 2 or chunk.parent in refused:
                refused.add(chunk.key)
        return [c.key not in refused for c in chunks]
