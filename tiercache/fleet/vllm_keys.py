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
from tiercache.fleet.vllm_groups import GroupBlocks, hybrid_hit

ROUTER_SEED = hashlib.sha256(b"tiercache-route/vllm-blocks/v1").digest()


class BlockNames:
    """One vLLM replica's block hashes → the router's names for those blocks (its pool only: ``GPU``)."""

    def __init__(self, scheme: VllmKeys) -> None:
        self.scheme = scheme
        self.names: dict[bytes, bytes] = {}
        self.groups: dict[int, GroupBlocks] = {}    # a hybrid model's groups beyond the first, by vLLM's index
        self.unnamed = 0          # blocks stored that could not be named (counted for /metrics)

    def clear(self) -> None:
        self.names.clear()
        self.groups.clear()

    def stored(self, event: BlockStored) -> list[bytes]:
        """The router's names of the blocks ``event`` stores in the first group, as far as they can be named;
        another group's blocks are kept by that group (`GroupBlocks`), named by the first group's names."""
        if event.group_idx not in (None, 0):
            self._group(event).store([event_key(h) for h in event.block_hashes], self.names)
            return []
        hashes = [event_key(h) for h in event.block_hashes]
        count = self.scheme.nameable(event, len(hashes))
        if event.parent_block_hash is None:
            root = self.scheme.root(event)
        else:
            root = self.names.get(event_key(event.parent_block_hash))
        if root is None:
            count = 0
        names = self.scheme.hasher.hash_blocks(event.token_ids[:count * self.scheme.block_size], parent=root)
        self.names.update(zip(hashes, names))
        self.unnamed += len(hashes) - count
        return names

    def removed(self, event: BlockRemoved) -> list[bytes]:
        if event.group_idx not in (None, 0):
            group = self.groups.get(event.group_idx)
            if group is not None:
                group.remove([event_key(h) for h in event.block_hashes])
            return []
        names = (self.names.pop(event_key(h), None) for h in event.block_hashes)
        return [name for name in names if name is not None]

    def _group(self, event: BlockStored) -> GroupBlocks:
        group = self.groups.get(event.group_idx)
        if group is None:
            group = self.groups[event.group_idx] = GroupBlocks(event.kv_cache_spec_kind or "",
                                                               event.kv_cache_spec_sliding_window or 0)
        return group

    def resumable(self, blocks: Sequence[bytes], full_run: int, also: Collection[bytes]) -> int:
        """Of the first ``full_run`` blocks (the first group's run), those every group can resume from."""
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
        """How many of the event's blocks, from its first, the router can name: whole blocks of text in group
        0, with no extra keys beyond the first block's salt and the adapter's name."""
        if event.group_idx not in (None, 0) or len(event.token_ids) != count * self.block_size:
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
