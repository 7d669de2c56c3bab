"""Assemble the offload stack for one engine from the config tree.

Runs once at start on whichever side owns the engine's L0. A component that
cannot be built fails loudly with the config field that chose it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiercache.chunk_format import ChunkFormat, ChunkMeta
from tiercache.config import TierCacheConfig, read_secret
from tiercache.errors import ConfigError, RegistryError
from tiercache.keys import BlockHash, Namespace
from tiercache.manager import CacheManager
from tiercache.policies import admission_policies, eviction_policies
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.pool.layer_tensors import LayerTensorsKV
from tiercache.registry import Registry
from tiercache.tiers.base import LowerTier, Tier
from tiercache.tiers.cpu import CpuTier
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.handlers import CpuLowerHandlers, DeviceCpuHandlers, LayerTensorsHandlers

log = logging.getLogger(__name__)


def _pin(setting: str) -> bool:
    return setting == "on" or (setting == "auto" and torch.cuda.is_available())


def _named(registry, name: str, field: str):
    try:
        return registry.get(name)
    except RegistryError as err:
        raise ConfigError(field, name, str(err)) from None


@dataclass
class OffloadStack:
    manager: CacheManager
    engine: TransferEngine
    tiers: list[Tier]

    def close(self, flush_timeout: float = 60.0) -> None:
        """Settle in-flight work, write L1's dirty chunks down (write-back), stop the transfer threads."""
        m = self.manager
        try:
            m.submit(m.take_background())
            m.submit(m.flush_down())
            m.drain(flush_timeout)
        except TimeoutError:
            log.warning("offload stack closed with %d transfers still running", m.num_in_flight)
        finally:
            self.engine.close()
            for tier in self.tiers:
                tier.close()


# Lower tiers in hierarchy order (fastest first); each is built when its config section says ``enabled``,
# given the digest its chunks are filed under (`Namespace.storage_digest`).
LowerTierBuilder = Callable[[TierCacheConfig, bytes], LowerTier]
LOWER_TIER_ORDER = ("disk", "redis", "grpc")
lower_tiers: Registry[LowerTierBuilder] = Registry("lower tier")


@lower_tiers.register("disk")
def _disk_tier(config: TierCacheConfig, storage: bytes) -> LowerTier:
    from tiercache.tiers.disk import DiskTier

    d = config.disk
    fmt = ChunkFormat(config.format.codec, config.format.checksum)
    try:
        return DiskTier(d.path, d.capacity, storage, fmt, eviction=d.eviction, fsync=d.fsync,
                        o_direct=d.o_direct)
    except OSError as err:
        field = "disk.o_direct" if "O_DIRECT" in str(err) else "disk.path"
        raise ConfigError(field, d.o_direct if field == "disk.o_direct" else d.path,
                          f"cannot use directory: {err.strerror}") from None


@lower_tiers.register("redis")
def _redis_tier(config: TierCacheConfig, storage: bytes) -> LowerTier:
    from tiercache.tiers.redis import RedisTier

    r = config.redis
    fmt = ChunkFormat(config.format.codec, config.format.checksum)
    try:
        return RedisTier(r.url, storage, fmt, ttl_s=r.ttl, timeout_s=r.timeout, lookup_timeout_s=r.lookup_timeout,
                         retry_interval_s=r.retry_interval, cluster=r.cluster)
    except ImportError:
        raise ConfigError("redis.enabled", True, "the redis package is missing: pip install 'tiercache[redis]'") from None
    except Exception as err:  # redis-py raises several types for a bad URL or an unreachable cluster
        if isinstance(err, ConfigError):
            raise
        raise ConfigError("redis.url", r.url, f"cannot connect: {err}") from None


@lower_tiers.register("grpc")
def _grpc_tier(config: TierCacheConfig, storage: bytes) -> LowerTier:
    from tiercache.tiers.grpc_client import GrpcTier

    g = config.grpc
    token = read_secret(g.auth_token_file, "grpc.auth_token_file") if g.auth_token_file else None
    fmt = ChunkFormat(config.format.codec, config.format.checksum)
    tier = GrpcTier(g.address, storage, fmt, auth_token=token, timeout_s=g.timeout, lookup_timeout_s=g.lookup_timeout,
                    retry_interval_s=g.retry_interval, max_message_bytes=g.max_message, local=g.local,
                    bulk=g.bulk)
    health = tier.check_health()   # None: down at start, an outage (probed in the background), not a config error
    if health is not None and health.max_message_bytes and health.max_message_bytes < g.max_message:
        tier.max_message_bytes = health.max_message_bytes
    return tier


def build_offload_stack(config: TierCacheConfig, kv: PagedKVCache | LayerTensorsKV, namespace: Namespace) -> OffloadStack:
    """The stack over L0 ``kv``: tiercache's own paged pool, or an engine's per-layer tensors (vLLM)."""
    if kv.block_size != config.keys.block_size:
        raise ConfigError("keys.block_size", config.keys.block_size, f"the KV pool uses blocks of {kv.block_size}")
    if not config.cpu.enabled:
        raise ConfigError("cpu.enabled", False, "L1 stages every transfer to and from L0; run without the connector instead")
    _named(eviction_policies, config.cpu.eviction, "cpu.eviction")
    _named(eviction_policies, config.disk.eviction, "disk.eviction")
    admission_cls = _named(admission_policies, config.disk.admission, "disk.admission")
    try:
        ChunkFormat(config.format.codec, config.format.checksum)
    except RegistryError as err:
        raise ConfigError("format", f"{config.format.codec}/{config.format.checksum}", str(err)) from None

    bpc = config.keys.blocks_per_chunk
    slot_bytes = bpc * kv.block_bytes
    if config.cpu.capacity < slot_bytes:
        raise ConfigError("cpu.capacity", config.cpu.capacity, f"holds no chunk of {slot_bytes} bytes")
    cpu = CpuTier(config.cpu.capacity, slot_bytes, eviction=config.cpu.eviction,
                  pin_memory=_pin(config.cpu.pin_memory), prefault=config.cpu.prefault)
    enabled = [name for name in LOWER_TIER_ORDER if getattr(config, name).enabled]
    digest = namespace.storage_digest(config.keys.chunk_tokens)
    lower = [lower_tiers.get(name)(config, digest) for name in enabled]

    engine = TransferEngine(workers=config.transfer.workers, limits=config.transfer.link_limits())
    handlers = LayerTensorsHandlers if isinstance(kv, LayerTensorsKV) else DeviceCpuHandlers
    handlers(kv, cpu, bpc).register(engine)

    def chunk_meta(key: BlockHash, chunk_blocks: int) -> ChunkMeta:
        return ChunkMeta(digest, key, chunk_blocks * kv.block_size, kv.geometry.dtype, kv.chunk_shape(chunk_blocks))

    for tier in lower:
        CpuLowerHandlers(cpu, tier, chunk_meta).register(engine)
    manager = CacheManager(
        cpu, engine, config.keys.block_size, bpc, kv.block_bytes, lower=lower,
        store_partial_chunks=config.keys.store_partial_chunks, write_mode=[getattr(config, name).write_mode for name in enabled],
        admission=admission_cls(config.disk.min_hits),
    )
    return OffloadStack(manager, engine, [cpu, *lower])
