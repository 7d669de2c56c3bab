"""tiercache's offload connector wired for the bundled reference engine.

The engine runs scheduler and worker in one process, so both sides share one
`OffloadStack`; the engine still talks to them only through the connector API
(`tiercache.connector.api`) and never imports a tier.
"""
from __future__ import annotations

from tiercache.build import build_offload_stack
from tiercache.config import TierCacheConfig
from tiercache.connector.offload import OffloadScheduler, OffloadWorker
from tiercache.keys import Namespace
from tiercache.pool.kv_cache import PagedKVCache


class ReferenceConnector:
    def __init__(self, config: TierCacheConfig, namespace: Namespace, kv: PagedKVCache) -> None:
        self.stack = build_offload_stack(config, kv, namespace)
        self.scheduler = OffloadScheduler(self.stack, kv.block_size, swap_salt=namespace.digest())
        inline = config.transfer.inline_host_copies
        inline_copies = inline == "on" or (inline == "auto" and kv.device.type == "cpu")
        self.worker = OffloadWorker(self.stack, layerwise=config.transfer.layerwise, inline=inline_copies)

    def close(self) -> None:
        self.stack.close()
