"""Assemble the offload stack for one engine from the config tree.

Runs once at start on whichever side owns the engine's L0. A component that
cannot be built fails loudly with the config field that chose it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercache.config import TierCacheConfig
from tiercache.errors import ConfigError, RegistryError
from tiercache.manager import CacheManager
from tiercache.policies import eviction_policies
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.tiers.cpu import CpuTier
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.handlers import DeviceCpuHandlers


def _pin(setting: str) -> bool:
    return setting == "on" or (setting == "auto" and torch.cuda.is_available())


@dataclass
class OffloadStack:
    manager: CacheManager
    engine: TransferEngine
    tiers: list[CpuTier]

    def close(self) -> None:
        self.engine.close()


def build_offload_stack(config: TierCacheConfig, kv: PagedKVCache) -> OffloadStack:
    if kv.block_size != config.keys.block_size:
        raise ConfigError("keys.block_size", config.keys.block_size, f"the KV pool uses blocks of {kv.block_size}")
    try:
        eviction_policies.get(config.cpu.eviction)
    except RegistryError as err:
        raise ConfigError("cpu.eviction", config.cpu.eviction, str(err)) from None
    bpc = config.keys.blocks_per_chunk
    tiers: list[CpuTier] = []
    engine = TransferEngine(workers=config.transfer.workers)
    if config.cpu.enabled:
        slot_bytes = bpc * kv.block_bytes
        if config.cpu.capacity < slot_bytes:
            engine.close()
            raise ConfigError("cpu.capacity", config.cpu.capacity, f"holds no chunk of {slot_bytes} bytes")
        cpu = CpuTier(config.cpu.capacity, slot_bytes, eviction=config.cpu.eviction,
                      pin_memory=_pin(config.cpu.pin_memory), prefault=config.cpu.prefault)
        DeviceCpuHandlers(kv, cpu, bpc).register(engine)
        tiers.append(cpu)
    manager = CacheManager(tiers, engine, config.keys.block_size, bpc, kv.block_bytes,
                           store_partial_chunks=config.keys.store_partial_chunks)
    return OffloadStack(manager, engine, tiers)
