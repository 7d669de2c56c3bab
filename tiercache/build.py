"""Assemble both sides of the offload stack from the config tree.

- `check_config`: every choice by name (policies, codecs, tiers) resolved
  and every lower tier's settings checked, before any work starts; errors
  name the config field.
- `build_worker_side` (each rank, once its KV is registered): the rank's L1
  slab (its share of ``cpu.capacity``), its transports, its transfer engine
  and the handlers that move its bytes, keyed by tier names.
- `build_scheduler_side` (the engine's scheduler, once every rank has
  reported): the tier indexes — L1 with the slots every rank has, disk sized
  per rank and rebuilt from what every rank found — and the `CacheManager`.

Lower tiers come from a registry, in hierarchy order (fastest first); each
knows how to build its index and its transport. A tier that cannot be built
fails loudly with the config field that chose it.
"""
from __future__ import annotations

import importlib.util
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiercache.audit import AuditTrail
from tiercache.codecs import codecs
from tiercache.config import TierCacheConfig, read_secret, read_token
from tiercache.contracts.connector import WorkerHandshake
from tiercache.contracts.keys import BlockHash, KVShard, Namespace
from tiercache.contracts.layout import ChunkLayout
from tiercache.encryption_keys import FIELD, KeysAudit, KeysFile
from tiercache.errors import ConfigError, RegistryError
from tiercache.machine import physical_memory
from tiercache.manager import CacheManager
from tiercache.policies import (
    NOT_AN_ENTRY_GUARD,
    GuardedTier,
    admission_for,
    admission_policies,
    eviction_policies,
    guards_entry,
)
from tiercache.pool.group_pages import GroupPagesKV
from tiercache.pool.kv_cache import PagedKVCache
from tiercache.pool.layer_tensors import LayerTensorsKV
from tiercache.registry import Registry
from tiercache.tiers.base import LowerIndex, Transport
from tiercache.tiers.cpu import CpuIndex
from tiercache.tiers.slab import HostSlab
from tiercache.transfer.engine import TransferEngine
from tiercache.transfer.handlers import CpuLowerHandlers, DeviceCpuHandlers, GroupPagesHandlers, LayerTensorsHandlers
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta, ChunkSealer, ChunkSigner
from tiercache.wire.codec_pipeline import CodecThreads

log = logging.getLogger(__name__)

L1 = "cpu"


def _pin(setting: str) -> bool:
    return setting == "on" or (setting == "auto" and torch.cuda.is_available())


def _named(registry, name: str, field: str):
    try:
        return registry.get(name)
    except RegistryError as err:
        raise ConfigError(field, name, str(err)) from None


def read_sealer(path: str) -> ChunkSealer:
    """A sealer under a tenant's keys file, taking the file's rotations while it runs; a `ConfigError`
    naming the file and the line when it cannot be used now."""
    keys_file = KeysFile(path)
    try:
        return ChunkSealer(keys_file.current.keys, keys_file.current.active, reload=keys_file.changed)
    except ValueError as err:
        raise ConfigError(FIELD, path, str(err)) from None


def chunk_format(config: TierCacheConfig) -> ChunkFormat:
    signer = None
    if config.format.encryption_keys_file:
        if config.format.signing_key_file:
            raise ConfigError("format.signing_key_file", config.format.signing_key_file,
                              "set it or format.encryption_keys_file, not both: encrypted chunks are "
                              "authenticated already")
        signer = read_sealer(config.format.encryption_keys_file)
    elif config.format.signing_key_file:
        try:
            signer = ChunkSigner(read_secret(config.format.signing_key_file, "format.signing_key_file").encode())
        except ValueError as err:
            raise ConfigError("format.signing_key_file", config.format.signing_key_file, str(err)) from None
    try:
        return ChunkFormat(config.format.codec, config.format.checksum, signer)
    except RegistryError as err:
        raise ConfigError("format", f"{config.format.codec}/{config.format.checksum}", str(err)) from None


def lossy_codec(config: TierCacheConfig) -> str:
    """The name of the tiers' codec if it is lossy (it goes into the storage digest), else ""."""
    codec = _named(codecs, config.format.codec, "format.codec")
    return codec.name if codec.lossy else ""


class LowerTier(ABC):
    """How one kind of lower tier is built on each side (registered by name in `lower_tiers`)."""

    @staticmethod
    def check(config: TierCacheConfig) -> None:
        """Raise `ConfigError` for settings that cannot work, before anything is built (none by default)."""

    @staticmethod
    @abstractmethod
    def index(config: TierCacheConfig, capacity_bytes: int) -> LowerIndex:
        """The scheduler side's index of this tier."""

    @staticmethod
    @abstractmethod
    def transport(config: TierCacheConfig, storage: bytes, writer: bool, codec: CodecThreads | None) -> Transport:
        """One rank's transport, its codec work on ``codec`` (the worker's codec threads, or None: in line)."""


LOWER_TIER_ORDER = ("disk", "redis", "grpc")
lower_tiers: Registry[type[LowerTier]] = Registry("lower tier")


@lower_tiers.register("disk")
class DiskTierBuilder(LowerTier):
    @staticmethod
    def index(config: TierCacheConfig, capacity_bytes: int) -> LowerIndex:
        from tiercache.tiers.disk import DiskIndex

        try:
            return DiskIndex(capacity_bytes, chunk_format(config), eviction=config.disk.eviction,
                             retention_s=config.disk.retention)
        except ValueError as err:
            raise ConfigError("disk.capacity", config.disk.capacity, str(err)) from None

    @staticmethod
    def transport(config: TierCacheConfig, storage: bytes, writer: bool, codec: CodecThreads | None) -> Transport:
        from tiercache.tiers.disk import DiskTransport

        d = config.disk
        try:
            return DiskTransport(d.path, storage, chunk_format(config), fsync=d.fsync, o_direct=d.o_direct,
                                 writer=writer, codec_threads=codec)
        except OSError as err:
            field = "disk.o_direct" if "O_DIRECT" in str(err) else "disk.path"
            raise ConfigError(field, d.o_direct if field == "disk.o_direct" else d.path,
                              f"cannot use directory: {err.strerror}") from None


def _redis_call(config: TierCacheConfig, build):
    try:
        return build()
    except ImportError:
        raise ConfigError(
            "redis.enabled", True, "the redis package is missing: pip install 'tiercache[redis]'"
        ) from None
    except ConfigError:
        raise
    except Exception as err:  # redis-py raises several types for a bad URL or an unreachable cluster
        raise ConfigError("redis.url", config.redis.url, f"cannot connect: {err}") from None


@lower_tiers.register("redis")
class RedisTierBuilder(LowerTier):
    @staticmethod
    def index(config: TierCacheConfig, capacity_bytes: int) -> LowerIndex:
        from tiercache.tiers.redis import RedisIndex

        r = config.redis
        return _redis_call(
            config,
            lambda: RedisIndex(
                r.url,
                chunk_format(config),
                lookup_timeout_s=min(r.lookup_timeout, r.timeout),
                retry_interval_s=r.retry_interval,
                cluster=r.cluster,
                admission=r.admission,
            ),
        )

    @staticmethod
    def transport(config: TierCacheConfig, storage: bytes, writer: bool, codec: CodecThreads | None) -> Transport:
        from tiercache.tiers.redis import RedisTransport

        r = config.redis
        transport = _redis_call(config, lambda: RedisTransport(r.url, storage, chunk_format(config),
                                                               ttl_s=r.expiry, renew_on_read=not r.retention,
                                                               timeout_s=r.timeout, retry_interval_s=r.retry_interval,
                                                               cluster=r.cluster, writer=writer,
                                                               codec_threads=codec, admission=r.admission))
        transport.check_health()
        return transport


def _grpc_token(config: TierCacheConfig) -> str | None:
    g = config.grpc
    return read_token(g.auth_token_file, "grpc.auth_token_file") if g.auth_token_file else None


@lower_tiers.register("grpc")
class GrpcTierBuilder(LowerTier):
    @staticmethod
    def check(config: TierCacheConfig) -> None:
        if importlib.util.find_spec("grpc") is None:
            raise ConfigError("grpc.enabled", True, "grpcio is missing: pip install 'tiercache[grpc]'")
        _grpc_token(config)

    @staticmethod
    def index(config: TierCacheConfig, capacity_bytes: int) -> LowerIndex:
        from tiercache.tiers.grpc_index import GrpcIndex

        g = config.grpc
        index = GrpcIndex(g.address, chunk_format(config), auth_token=_grpc_token(config),
                          lookup_timeout_s=min(g.lookup_timeout, g.timeout), retry_interval_s=g.retry_interval,
                          max_message_bytes=g.max_message, local=g.local, bulk=g.bulk)
        index.check_health()   # down at start: an outage (probed in the background), not a config error
        return index

    @staticmethod
    def transport(config: TierCacheConfig, storage: bytes, writer: bool, codec: CodecThreads | None) -> Transport:
        from tiercache.tiers.grpc_client import GrpcTransport

        g = config.grpc
        transport = GrpcTransport(
            g.address,
            storage,
            chunk_format(config),
            auth_token=_grpc_token(config),
            timeout_s=g.timeout,
            retry_interval_s=g.retry_interval,
            max_message_bytes=g.max_message,
            local=g.local,
            bulk=g.bulk,
            writer=writer,
            probe_timeout_s=g.lookup_timeout,
            codec_threads=codec,
        )
        transport.check_health()
        return transport


def enabled_lower_tiers(config: TierCacheConfig) -> list[str]:
    return [name for name in LOWER_TIER_ORDER if getattr(config, name).enabled]


def check_config(config: TierCacheConfig) -> None:
    """Every named choice resolved and every enabled tier's settings checked; raises `ConfigError`."""
    if not config.cpu.enabled:
        raise ConfigError(
            "cpu.enabled", False, "L1 stages every transfer to and from L0; run without the connector instead"
        )
    _named(eviction_policies, config.cpu.eviction, "cpu.eviction")
    _named(eviction_policies, config.disk.eviction, "disk.eviction")
    _named(admission_policies, config.disk.admission, "disk.admission")
    _named(admission_policies, config.cpu.admission, "cpu.admission")
    if not guards_entry(config.cpu.admission):
        raise ConfigError("cpu.admission", config.cpu.admission, NOT_AN_ENTRY_GUARD)
    chunk_format(config)
    if config.audit.log_file:
        _audit_trail(config).close()     # the file can be appended to (or made), before any side starts
    for name in enabled_lower_tiers(config):
        _named(lower_tiers, name, f"{name}.enabled").check(config)


# -- worker side -------------------------------------------------------------------------------------------

@dataclass
class WorkerStack:
    """One rank's bytes and the machinery that moves them."""
    shard: KVShard
    storage: bytes
    slab: HostSlab
    engine: TransferEngine
    transports: dict[str, Transport]
    handshake: WorkerHandshake
    codec: CodecThreads | None      # the transports' codec threads (format.codec, transfer.codec_threads)

    def close(self) -> None:
        self.engine.close()
        for transport in self.transports.values():
            transport.close()
        if self.codec is not None:
            self.codec.close()


def _chunk_layouts(kv: PagedKVCache | LayerTensorsKV | GroupPagesKV):
    """How a chunk of ``n`` blocks of ``kv`` is laid out, as a function of ``n``."""
    if isinstance(kv, GroupPagesKV):
        return kv.groups.layout
    return lambda n: ChunkLayout(kv.geometry.dtype, kv.chunk_shape(n))


_HANDLERS = {PagedKVCache: DeviceCpuHandlers, LayerTensorsKV: LayerTensorsHandlers, GroupPagesKV: GroupPagesHandlers}


def build_worker_side(config: TierCacheConfig, kv: PagedKVCache | LayerTensorsKV | GroupPagesKV,
                      namespace: Namespace, shard: KVShard, copies_in_step: bool) -> WorkerStack:
    """This rank's stack over its L0 ``kv``: tiercache's own paged pool, an engine's per-layer tensors, or the
    pages of an engine's KV-cache groups."""
    check_config(config)
    if kv.block_size != config.keys.block_size:
        raise ConfigError("keys.block_size", config.keys.block_size, f"the KV pool uses blocks of {kv.block_size}")
    groups = kv.groups if isinstance(kv, GroupPagesKV) else None
    if groups is not None and lossy_codec(config):
        raise ConfigError("format.codec", config.format.codec, "is lossy; a model with KV-cache groups of several "
                          "kinds is stored raw (a lossless codec works)")
    layout_of = _chunk_layouts(kv)
    block_bytes = layout_of(1).raw_len
    slot_bytes = groups.slot_bytes if groups is not None else layout_of(config.keys.blocks_per_chunk).raw_len
    if config.cpu.capacity > physical_memory():
        raise ConfigError("cpu.capacity", config.cpu.capacity,
                          f"is more than this machine's memory ({physical_memory()} B); L1 is allocated up front")
    share = config.cpu.capacity // shard.num_ranks
    num_slots = share // slot_bytes
    if num_slots < 1:
        raise ConfigError("cpu.capacity", config.cpu.capacity,
                          f"gives each of {shard.num_ranks} ranks {share} B, less than one chunk of {slot_bytes} B")
    slab = HostSlab(num_slots, slot_bytes, pin_memory=_pin(config.cpu.pin_memory), prefault=config.cpu.prefault)
    storage = namespace.storage_digest(config.keys.chunk_tokens, shard, lossy_codec(config))
    transports: dict[str, Transport] = {}
    tiers = enabled_lower_tiers(config)
    codec = CodecThreads(config.transfer.codec_threads, f"tiercache-codec-r{shard.rank}") \
        if tiers and config.format.codec != "raw" and config.transfer.codec_threads else None
    try:
        for name in tiers:
            transports[name] = lower_tiers.get(name).transport(config, storage, shard.writer, codec)
    except BaseException:
        for transport in transports.values():
            transport.close()
        if codec is not None:
            codec.close()
        raise
    engine = TransferEngine(workers=config.transfer.workers, limits=config.transfer.link_limits(),
                            name=f"tiercache-xfer-r{shard.rank}")
    _HANDLERS[type(kv)](kv, slab, config.keys.blocks_per_chunk, L1).register(engine)

    def chunk_meta(key: BlockHash, chunk_blocks: int, parent: BlockHash | None = None,
                   stored_at: float = 0.0) -> ChunkMeta:
        layout = layout_of(chunk_blocks)
        return ChunkMeta(storage, key, chunk_blocks * kv.block_size, layout.dtype, layout.shape, parent, stored_at)

    for transport in transports.values():
        CpuLowerHandlers(slab, transport, chunk_meta, L1).register(engine)
    stored = {}
    for name, transport in transports.items():
        scan = transport.scan() if shard.writer else None
        if scan is not None:
            stored[name] = scan
    handshake = WorkerHandshake(shard.rank, shard.num_ranks, block_bytes, num_slots, storage, shard.writer,
                                stored, copies_in_step, layout_of(1), groups)
    log.info("tiercache rank %d/%d: L1 %d slots of %d B (%d B of cpu.capacity %d B), tiers %s", shard.rank,
             shard.num_ranks, num_slots, slot_bytes, num_slots * slot_bytes, config.cpu.capacity,
             [L1, *transports])
    return WorkerStack(shard, storage, slab, engine, transports, handshake, codec)


# -- scheduler side ----------------------------------------------------------------------------------------

def _audit_trail(config: TierCacheConfig) -> AuditTrail:
    try:
        return AuditTrail(config.audit.log_file, config.audit.tenant)
    except OSError as err:
        raise ConfigError("audit.log_file", config.audit.log_file, f"cannot append: {err.strerror}") from None


def _audit(config: TierCacheConfig) -> tuple[AuditTrail, list]:
    """The engine's audit trail, and the watch that records its keys file's rotations in it."""
    audit = _audit_trail(config)
    if not config.format.encryption_keys_file:
        return audit, []
    return audit, [KeysAudit(config.format.encryption_keys_file, audit).poll]


def build_scheduler_side(config: TierCacheConfig, handshakes: Sequence[WorkerHandshake]) -> CacheManager:
    """The tier indexes and the manager over every rank: L1 has the slots every rank has; a lower tier's
    capacity is split across the ranks that write it, and a disk index holds what every writer found."""
    check_config(config)
    if not handshakes or len({h.num_ranks for h in handshakes}) != 1 or len(handshakes) != handshakes[0].num_ranks:
        raise ValueError(f"expected one handshake from each rank, got ranks {sorted(h.rank for h in handshakes)}")
    block_bytes = max(h.block_bytes for h in handshakes)
    widest = max(handshakes, key=lambda h: h.slot_bytes(config.keys.blocks_per_chunk))
    slot_bytes = widest.slot_bytes(config.keys.blocks_per_chunk)
    writers = [h for h in handshakes if h.writer]
    l1 = CpuIndex(
        min(h.num_slots for h in handshakes), slot_bytes, eviction=config.cpu.eviction,
        retention_s=config.cpu.retention,
    )
    lower: list[LowerIndex] = []
    audit, chores = _audit(config)
    try:
        for name in enabled_lower_tiers(config):
            capacity = getattr(config, name, None)
            per_rank = getattr(capacity, "capacity", 0) // max(1, len(writers))
            index = lower_tiers.get(name).index(config, per_rank)
            lower.append(index)
            scans = [h.stored[name] for h in writers if name in h.stored]
            if scans and index.rebuild(scans):
                log.warning("tier %s: chunks found on some ranks only (a store died midway) are deleted", name)
            index.attach([h.storage for h in writers])
            index.size_for(GuardedTier(0, l1.slots.num_slots))     # a door the tier keeps (Redis's) models L1
    except BaseException:
        for index in lower:
            index.close()
        audit.close()
        raise
    # it guards the first tier written back to (what L1 spills into); a remote one guards its own door, by what
    # every replica asked of it (the server's store, Redis's sightings)
    guarded = next((t for t in lower if getattr(config, t.name).write_mode == "write-back"), None)
    shape = (GuardedTier(guarded.capacity_bytes // slot_bytes, l1.slots.num_slots)
             if guarded else GuardedTier(1))
    admission = (admission_for(config.disk.admission, config.disk.min_hits, shape)
                 if guarded is None or guarded.indexed else None)
    l1_admission = (admission_for(config.cpu.admission, config.cpu.min_hits, GuardedTier(l1.slots.num_slots))
                    if config.cpu.admission != "always" else None)
    layout = max(handshakes, key=lambda h: h.block_bytes).block_layout
    manager = CacheManager(l1, config.keys.block_size, config.keys.blocks_per_chunk, block_bytes, lower=lower,
                           partial_chunks=config.keys.partial_chunks != "off",
                           write_mode=[getattr(config, t.name).write_mode for t in lower], admission=admission,
                           l1_admission=l1_admission,
                           promotion=getattr(getattr(config, guarded.name), "promotion", "copy") if guarded
                           else "copy",
                           transfer_workers=config.transfer.workers, block_layout=layout, audit=audit,
                           chores=chores, groups=widest.groups)
    log.info("tiercache scheduler: %d ranks, L1 %d slots per rank, tiers %s%s", len(handshakes), l1.slots.num_slots,
             [t.name for t in manager.tiers],
             "".join(f", {t.name} {t.capacity_bytes} B per rank" for t in lower if t.capacity_bytes))
    return manager
