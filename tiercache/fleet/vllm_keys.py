"""vLLM replicas in the router's index: its blocks named by the router's own chains, learned from its events.

vLLM's block hashes start from a seed the router cannot know (``PYTHONHASHSEED``
unless set, per process) and a hash function of its own, so the router does
not recompute them. It does not need to: every ``BlockStored`` vLLM publishes
carries the blocks' tokens, their parent's hash and their extra keys (the
request's ``cache_salt`` on the first block, a LoRA name on every block). The
router names each block with a chain of its own over the same tokens, started
where a request with that salt and adapter starts (`VllmKeys`), and keeps which
vLLM hash is which of its names (`BlockNames`), so ``BlockRemoved`` finds what
to drop and a prompt's prediction is as exact as for a tiercache replica.

A block the router cannot name — its parent never seen (events lost before the
router joined), multimodal or prompt-embedding extra keys the router never has
for a text prompt — is left out with its descendants: the prediction errs
towards recomputing, never towards a hit that is not there.

A tiercache connector under vLLM publishes its tiers' chunks by tiercache
chunk keys; with the connector's chain seed in the descriptor (``seed``,
``chunk_tokens``) the router computes those as for a tiercache replica.
"""
from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

from tiercache.contracts.keys import BlockHasher, chunk_keys
from tiercache.fleet.descriptor import ReplicaDescriptor
from tiercache.fleet.kv_events import MEDIUM_ENGINE, BlockRemoved, BlockStored
from tiercache.fleet.prefix_index import KeyScheme, PromptKeys, event_key, key_schemes
from tiercache.fleet.vllm_groups import NAMING_KINDS, GroupBlocks, hybrid_hit

ROUTER_SEED = hashlib.sha256(b"tiercache-route/vllm-blocks/v1").digest()


class BlockNames:
    """One vLLM replica's block hashes → the router's names for those blocks (its pool only: ``GPU``).

    The blocks are named from the events of the group that holds every block of a prefix — the first whose
    kind is full attention (or MLA), group 0 where vLLM names no kinds; a hybrid model's other groups keep
    theirs by those names (`GroupBlocks`)."""

    def __init__(self, scheme: VllmKeys) -> None:
        self.scheme = scheme
        self.names: dict[bytes, bytes] = {}
        self.naming_group: int | None = None        # the group whose events name blocks, once seen
        self.groups: dict[int, GroupBlocks] = {}    # a hybrid model's other groups, by vLLM's index
        self.unnamed = 0          # blocks stored that could not be named (counted for /metrics)

    def clear(self) -> None:
        self.names.clear()
        self.groups.clear()

    def stored(self, event: BlockStored) -> list[bytes]:
        """The router's names of the blocks ``event`` stores in the naming group, as far as they can be
        named; another group's blocks are kept by that group, under the names the naming group gives them."""
        hashes = [event_key(h) for h in event.block_hashes]
        if not self._names_blocks(event):
            self._group(event).store(hashes, self.names)
            return []
        count = self.scheme.nameable(event, len(hashes))
        if event.parent_block_hash is None:
            root = self.scheme.root(event)
        else:
            root = self.names.get(event_key(event.parent_block_hash))
        if root is None:
            count = 0
        names = self.scheme.hasher.hash_blocks(event.token_ids[:count * self.scheme.block_size], parent=root)
        named = dict(zip(hashes, names))
        self.names.update(named)
        for group in self.groups.values():
            group.resolve(named)
        self.unnamed += len(hashes) - count
        return names

    def removed(self, event: BlockRemoved) -> list[bytes]:
        hashes = [event_key(h) for h in event.block_hashes]
        if event.group_idx is not None and event.group_idx != self._naming_index():
            group = self.groups.get(event.group_idx)
            if group is not None:
                group.remove(hashes)
            return []
        names = (self.names.pop(h, None) for h in hashes)
        return [name for name in names if name is not None]

    def _naming_index(self) -> int:
        return 0 if self.naming_group is None else self.naming_group

    def _names_blocks(self, event: BlockStored) -> bool:
        """Whether ``event`` is the naming group's (the first group of a naming kind, seen once for all)."""
        if event.group_idx is None:
            return True
        if self.naming_group is None and (event.kv_cache_spec_kind in NAMING_KINDS or
                                          (event.kv_cache_spec_kind is None and event.group_idx == 0)):
            self.naming_group = event.group_idx
        return event.group_idx == self.naming_group

    def _group(self, event: BlockStored) -> GroupBlocks:
        group = self.groups.get(event.group_idx)
        if group is None:
            group = self.groups[event.group_idx] = GroupBlocks(event.kv_cache_spec_kind or "",
                                                               event.kv_cache_spec_sliding_window or 0)
        return group

    def resumable(self, blocks: Sequence[bytes], full_run: int, also: Collection[bytes]) -> int:
        """Of the first ``full_run`` blocks (the naming group's run), those every group can resume from."""
        if not self.groups:
            return full_run
        return hybrid_hit(blocks, full_run, list(self.groups.values()), also, self.scheme.block_size)


@key_schemes.register("vllm")
class VllmKeys(KeyScheme):
    """A vLLM replica: its pool by the router's names (`BlockNames`), its tiercache tiers by chunk keys."""

    translated_media = frozenset({MEDIUM_ENGINE})

    def __init__(self, descriptor: ReplicaDescriptor) -> None:
        super().__init__(descriptor)
        self.hasher = BlockHasher.from_seed(ROUTER_SEED, descriptor.block_size, "sha256")
        self.tiers = (BlockHasher.from_seed(bytes.fromhex(descriptor.seed), descriptor.block_size, descriptor.hash)
                      if descriptor.seed and descriptor.chunk_tokens else None)

    def keys(self, tokens: list[int], cache_salt: str) -> PromptKeys:
        blocks = self.hasher.hash_blocks(tokens, parent=self.hasher.seed_for(cache_salt))
        if self.tiers is None:
            return PromptKeys(len(tokens), blocks, [])
        chained = self.tiers.hash_blocks(tokens, parent=self.tiers.seed_for(cache_salt))
        return PromptKeys(len(tokens), blocks, chunk_keys(chained, self.blocks_per_chunk, self.partial_chunks), chained)

    def engine_tokens(self, blocks: int, num_tokens: int) -> int:
        """vLLM looks for hits among the blocks before the prompt's last token: whole blocks only."""
        return min(blocks, max(num_tokens - 1, 0) // self.block_size) * self.block_size

    def block_names(self) -> BlockNames:
        return BlockNames(self)

    # -- reading vLLM's events --------------------------------------------------------------------------
    def root(self, event: BlockStored) -> bytes | None:
        """Where the chain of a block without a parent starts: its salt and adapter, from its extra keys."""
        first = _untagged(event, 0)
        if first is None or len(first) > 1 or (first and not isinstance(first[0], str)):
            return None
        return self.hasher.seed_for(first[0] if first else "", event.lora_name or "")

    def nameable(self, event: BlockStored, count: int) -> int:
        """How many of the event's blocks, from its first, the router can name: whole blocks of text (every
        block of its range, as the naming group holds them), with no extra keys beyond the first block's salt
        and the adapter's name."""
        if len(event.token_ids) != count * self.block_size:
            return 0
        start = 1 if event.parent_block_hash is None else 0
        for i in range(start, count):
            keys = _untagged(event, i)
            if keys is None or keys:
                return i
        return count


def _untagged(event: BlockStored, i: int) -> Sequence | None:
    """Block ``i``'s extra keys without the adapter's name (``()`` when none); None when unreadable."""
    extra = event.extra_keys
    keys = extra[i] if extra is not None and i < len(extra) else None
    if keys is None:
        return ()
    if not isinstance(keys, (list, tuple)):
        return None
    keys = list(keys)
    if event.lora_name and keys and keys[0] == event.lora_name:
        keys = keys[1:]
    return keys
