"""A hybrid vLLM replica's pool as the router sees it: which blocks each KV-cache group holds, and the hit
vLLM's hybrid KV-cache manager finds across them (router side).

With several KV-cache groups (full attention beside sliding-window or Mamba layers), vLLM publishes one
``BlockStored`` per group, each tagged with its group and the group's kind (``kv_cache_spec_kind``, and
``kv_cache_spec_sliding_window``). Full attention holds every block of a prefix, so its events name the
blocks (the naming group, `BlockNames`; not always group 0: vLLM may list Mamba groups first); the other
groups keep only some (a sliding window's blocks behind it are freed; a Mamba group in ``align`` mode keeps a
state only where a step ended), and their events carry those blocks' hashes only. A group's block hashes
equal full attention's for the same tokens, so each keeps the names of the blocks it holds by those hashes
(`GroupBlocks`).

A prompt's hit is vLLM's own (`HybridKVCacheCoordinator.find_longest_cache_hit`): the longest prefix every
group can resume from, found by letting each group's rule cut the full-attention run until none cuts further.
The rules are a registry by vLLM's kind name (`hit_rules`): a kind the router does not know cuts nothing.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from tiercache.arith import ceil_div
from tiercache.registry import Registry


class HitRule(ABC):
    """How far a prompt's hit can reach in one kind of group, given what the group holds."""

    @abstractmethod
    def hit(self, blocks: Sequence[bytes], upto: int, held: Collection[bytes], also: Collection[bytes],
            block_size: int, window: int) -> int:
        """The longest hit of at most ``upto`` blocks of ``blocks`` the group can resume from (``also``: blocks
        the router counts as held though no event said so yet)."""


hit_rules: Registry[HitRule] = Registry("vLLM KV-cache group kind")

# groups of these kinds hold every block of a prefix: the first of them names the blocks (`BlockNames`)
NAMING_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention", "chunked_local_attention"})
MAX_PENDING = 1 << 16     # a group's hashes waiting for the naming group's event, at most


class LeadingRun(HitRule):
    """Every block from the first (vLLM's full-attention manager serves chunked local attention too)."""

    def hit(self, blocks, upto, held, also, block_size, window):
        n = 0
        for block in blocks[:upto]:
            if block not in held and block not in also:
                break
            n += 1
        return n


class WindowBehind(HitRule):
    """The blocks a window of ``window`` tokens reads behind the hit's end (``ceil((window - 1) / block
    size)`` of them, all held), searched from the right; short of any, the run from the first block."""

    def hit(self, blocks, upto, held, also, block_size, window):
        needed = max(ceil_div(window - 1, block_size), 1)
        run = 0
        for i in range(upto - 1, -1, -1):
            if blocks[i] in held or blocks[i] in also:
                run += 1
                if run >= needed:
                    return i + run
            else:
                run = 0
        return run


class LastStateHeld(HitRule):
    """The last block whose state the group holds: a recurrent state resumes only where it was kept."""

    def hit(self, blocks, upto, held, also, block_size, window):
        for i in range(upto - 1, -1, -1):
            if blocks[i] in held or blocks[i] in also:
                return i + 1
        return 0


for _kind, _rule in (("full_attention", LeadingRun()), ("mla_attention", LeadingRun()),
                     ("chunked_local_attention", LeadingRun()), ("sink_full_attention", LeadingRun()),
                     ("sliding_window", WindowBehind()), ("sliding_window_mla", WindowBehind()),
                     ("mamba", LastStateHeld())):
    hit_rules.register(_kind, _rule)


@dataclass
class GroupBlocks:
    """One group other than the naming one: its kind, its window, and the router's names of the blocks it
    holds (its own hash → name map, so a block it drops is found though the naming group dropped it first).
    A hash the naming group has not named yet (vLLM publishes its groups' events in group order, and the
    naming group need not be the first) waits in ``pending`` until it is, a bounded number of them."""
    kind: str
    window: int = 0
    names: dict[bytes, bytes] = field(default_factory=dict)
    held: set[bytes] = field(default_factory=set)
    pending: dict[bytes, None] = field(default_factory=dict)

    def store(self, hashes: Sequence[bytes], known: dict[bytes, bytes]) -> None:
        for h in hashes:
            name = known.get(h)
            if name is not None:
                self._hold(h, name)
            else:
                self.pending[h] = None
        while len(self.pending) > MAX_PENDING:
            del self.pending[next(iter(self.pending))]

    def resolve(self, named: dict[bytes, bytes]) -> None:
        """The naming group named ``named`` (hash → name): those of them this group waited for are held."""
        if self.pending:
            for h, name in named.items():
                if self.pending.pop(h, 0) is None:
                    self._hold(h, name)

    def remove(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.pending.pop(h, None)
            name = self.names.pop(h, None)
            if name is not None:
                self.held.discard(name)

    def _hold(self, h: bytes, name: bytes) -> None:
        self.names[h] = name
        self.held.add(name)

    def hit(self, blocks: Sequence[bytes], upto: int, also: Collection[bytes], block_size: int) -> int:
        if self.kind not in hit_rules:
            return upto
        return hit_rules.get(self.kind).hit(blocks, upto, self.held, also, block_size, self.window)


def hybrid_hit(blocks: Sequence[bytes], full_run: int, groups: Sequence[GroupBlocks], also: Collection[bytes],
               block_size: int) -> int:
    """The blocks of ``blocks`` every group can resume from, at most ``full_run`` (full attention's): each
    group's rule cuts the candidate in turn until none cuts it further (the rules never raise it)."""
    n = full_run
    while True:
        cut = n
        for group in groups:
            cut = group.hit(blocks, cut, also, block_size)
        if cut == n:
            return n
        n = cut
