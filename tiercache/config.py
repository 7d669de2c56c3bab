"""The typed configuration tree and its loaders.

One frozen dataclass per section; values are validated in ``__post_init__``
and every error names its dotted field (``cpu.capacity``). Sources merge in
this order, later winning: defaults < YAML/TOML file < ``TIERCACHE_*``
environment variables (``TIERCACHE_CPU__CAPACITY=8GiB``) < CLI overrides
(``--set cpu.capacity=8GiB``).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercache.errors import ConfigError
from tiercache.policies.admission import DEFAULT_ADMISSION, admission_policies, guards_entry
from tiercache.policies.eviction import DEFAULT_EVICTION, eviction_policies

if TYPE_CHECKING:
    from tiercache.contracts.plan import LinkLimits

ENV_PREFIX = "TIERCACHE_"
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, field_name: str = "size") -> int:
    """Parse ``8GiB``, ``512MB``, ``1.5GiB`` or an integer into bytes."""
    if isinstance(value, bool):
        raise ConfigError(field_name, value, "expected a size such as 512MiB")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(field_name, value, "expected a size such as 512MiB, 8GiB or 1000000")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _size(default: int, doc: str) -> Any:
    return field(default=default, metadata={"size": True, "doc": doc})


def _opt(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def _check(cond: bool, name: str, value: object, reason: str) -> None:
    if not cond:
        raise ConfigError(name, value, reason)


PARTIAL_CHUNKS = ("continuing", "all", "off")
RESUME_POINTS = ("junctions", "every-chunk")


@dataclass(frozen=True, slots=True)
class KeysConfig:
    block_size: int = _opt(16, "tokens per L0 block (and per hash-chain link)")
    chunk_tokens: int = _opt(256, "tokens per offloaded chunk; a multiple of block_size")
    hash: str = _opt("sha256", "block hash function: sha256 | blake3 | xxh3_128 (unsafe for multi-tenant)")
    tenant_salt: str = _opt("", "mixed into the namespace digest so tenants never share keys")
    partial_chunks: str = _opt("continuing", "which finished requests store their partial last chunk, found by "
                                              "the next request that runs past it (a conversation's next turn, on "
                                              "any replica that reads the tier): continuing (those with a session "
                                              "or said to continue) | all | off (lookups stop at whole chunks)")
    resume_points: str = _opt("junctions", "where a model with sliding-window or recurrent-state layers stores what "
                                           "a resume needs beside its chunks: junctions (the last chunk each step "
                                           "stores, and the end of the prefix the tiers held when the request "
                                           "looked up) | every-chunk; a recurrent state only where a step ended")

    def __post_init__(self) -> None:
        from tiercache.contracts.keys import hash_functions

        _check(self.block_size > 0, "block_size", self.block_size, "must be positive")
        _check(self.chunk_tokens > 0 and self.chunk_tokens % self.block_size == 0, "chunk_tokens",
               self.chunk_tokens, f"must be a positive multiple of block_size ({self.block_size})")
        _check(self.hash in hash_functions, "hash", self.hash, f"expected one of {', '.join(hash_functions.names())}")
        _check(self.partial_chunks in PARTIAL_CHUNKS, "partial_chunks", self.partial_chunks,
               f"expected one of {', '.join(PARTIAL_CHUNKS)}")
        _check(self.resume_points in RESUME_POINTS, "resume_points", self.resume_points,
               f"expected one of {', '.join(RESUME_POINTS)}")

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class DevicePoolConfig:
    device: str = _opt("auto", "where L0 lives: auto (cuda when present) | cpu | cuda | cuda:N")

    def __post_init__(self) -> None:
        _check(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "device", self.device,
               "expected auto, cpu, cuda or cuda:N")


MAX_TIMEOUT_S = 86400.0       # a day: beyond it a timeout is a typo, and socket and gRPC deadlines overflow


@dataclass(frozen=True, slots=True)
class CpuTierConfig:
    enabled: bool = _opt(True, "keep an L1 tier in (pinned) host memory")
    capacity: int = _size(1 << 30, "bytes of host memory for L1 chunks")
    eviction: str = _opt(DEFAULT_EVICTION, "eviction policy: " + " | ".join(eviction_policies.names()))
    prefault: bool = _opt(True, "touch every page of the L1 buffer at start")
    pin_memory: str = _opt("auto", "auto (when CUDA is present) | on | off")
    shutdown_write_down: float = _opt(60.0, "seconds a clean shutdown may spend writing the chunks only L1 holds to "
                                            "the write-back tier, so a restart finds them (0: none)")
    retention: float = _opt(0.0, "seconds a chunk stays in L1 after it was stored: older ones are never served and "
                                 "are removed (0: no limit)")
    admission: str = _opt("always", "which chunks the engine stores are taken into L1: "
                          + " | ".join(n for n in admission_policies.names() if guards_entry(n))
                          + " (a chain up to its first refused chunk; the sighting rules take anything while L1 "
                            "has room)")
    min_hits: int = _opt(1, "frequency: requests beyond the first that must have wanted a chunk")

    def __post_init__(self) -> None:
        _check(self.capacity > 0, "capacity", self.capacity, "must be positive")
        _check(self.min_hits >= 0, "min_hits", self.min_hits, "must be >= 0")
        _check(0 <= self.shutdown_write_down <= MAX_TIMEOUT_S, "shutdown_write_down", self.shutdown_write_down,
               f"must be in [0, {MAX_TIMEOUT_S:g}] seconds")
        _check(self.pin_memory in ("auto", "on", "off"), "pin_memory", self.pin_memory, "expected auto, on or off")
        _check(self.retention >= 0, "retention", self.retention, "must be 0 (no limit) or positive seconds")


PROMOTIONS = ("copy", "move")      # what a promotion does to the write-back tier's copy (`disk.promotion`)


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    enabled: bool = _opt(False, "keep an L2 tier of chunk files on a local disk")
    path: str = _opt("", "directory for chunk files (created if missing); required when enabled")
    capacity: int = _size(10 << 30, "bytes of chunk files, headers included")
    eviction: str = _opt(DEFAULT_EVICTION, "eviction policy: " + " | ".join(eviction_policies.names()))
    fsync: bool = _opt(False, "fdatasync each chunk before it becomes visible (durability across power loss)")
    o_direct: bool = _opt(False, "read and write chunk files with O_DIRECT (bypass the page cache)")
    write_mode: str = _opt("write-back", "write-back (spill what L1 evicts) | write-through (copy every store down)")
    admission: str = _opt(DEFAULT_ADMISSION, "which chunks leaving L1 are written down: "
                          + " | ".join(admission_policies.names())
                          + " (the sighting rules take anything while the tier has room)")
    promotion: str = _opt("copy", "under write-back, a chunk promoted from here into L1: copy (it stays here too) | "
                                  "move (it leaves; written again when L1 evicts it: more hits from the same disk, "
                                  "more writes)")
    retention: float = _opt(0.0, "seconds a chunk file is kept after it was written (its file's time, so across "
                                 "restarts): older ones are never served and are deleted (0: no limit)")
    min_hits: int = _opt(1, "min-hits: L1 hits a chunk needs; frequency: requests beyond the first that wanted it")

    def __post_init__(self) -> None:
        _check(not self.enabled or bool(self.path), "path", self.path, "required when disk.enabled is true")
        _check(self.capacity > 0, "capacity", self.capacity, "must be positive")
        _check(self.write_mode in ("write-back", "write-through"), "write_mode", self.write_mode,
               "expected write-back or write-through")
        _check(self.promotion in PROMOTIONS, "promotion", self.promotion, "expected " + " or ".join(PROMOTIONS))
        _check(self.min_hits >= 0, "min_hits", self.min_hits, "must be >= 0")
        _check(self.retention >= 0, "retention", self.retention, "must be 0 (no limit) or positive seconds")


REDIS_ADMISSIONS = ("adaptive-sighting", "second-sighting", "always")   # `redis.admission`: its state is in Redis


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    enabled: bool = _opt(False, "keep an L3 tier in Redis / Valkey, shared by every replica")
    url: str = _opt("redis://127.0.0.1:6379/0", "redis://, rediss:// or unix:// URL (any node, with cluster)")
    cluster: bool = _opt(False, "talk to a Redis Cluster through redis-py's cluster client")
    ttl: int = _opt(0, "seconds a chunk lives in Redis after it was last written or read (0: until Redis "
                       "evicts it)")
    retention: int = _opt(0, "seconds a chunk lives in Redis after it was written, reads or not (0: no limit); "
                             "with it a read no longer renews the ttl")
    timeout: float = _opt(2.0, "seconds a Redis call may take before the tier counts as down")
    lookup_timeout: float = _opt(0.25, "seconds a lookup (on the engine's scheduling path) may take before the "
                                       "tier counts as down")
    retry_interval: float = _opt(1.0, "seconds between background probes of a down tier")
    write_mode: str = _opt("write-through", "write-through (every stored chunk, so replicas see it) | write-back")
    admission: str = _opt(DEFAULT_ADMISSION, "which chunks Redis takes while it is full (anything while it is "
                                             "under its maxmemory): adaptive-sighting (second-sighting while it "
                                             "pays, everything while not, judged on every replica's requests) | "
                                             "second-sighting (those lookups asked for twice, any replica's) | "
                                             "always; the history is kept in Redis itself")

    @property
    def expiry(self) -> int:
        """Seconds a written value is set to live (0: no expiry): the ttl, within the retention."""
        return min((s for s in (self.ttl, self.retention) if s), default=0)

    def __post_init__(self) -> None:
        _check(self.url.split("://")[0] in ("redis", "rediss", "unix"), "url", self.url,
               "expected a redis://, rediss:// or unix:// URL")
        _check(0 <= self.ttl < 1 << 31, "ttl", self.ttl, "must be 0..2147483647 seconds")
        _check(0 <= self.retention < 1 << 31, "retention", self.retention, "must be 0..2147483647 seconds")
        _check(self.admission in REDIS_ADMISSIONS, "admission", self.admission,
               "expected " + " or ".join(REDIS_ADMISSIONS))
        _remote_checks(self)


MAX_RETRY_INTERVAL_S = 3600.0


def _remote_checks(cfg: Any) -> None:
    _check(0 < cfg.timeout <= MAX_TIMEOUT_S, "timeout", cfg.timeout, f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
    _check(0 < cfg.lookup_timeout <= MAX_TIMEOUT_S, "lookup_timeout", cfg.lookup_timeout,
           f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
    _check(0 <= cfg.retry_interval <= MAX_RETRY_INTERVAL_S, "retry_interval", cfg.retry_interval,
           f"must be in [0, {MAX_RETRY_INTERVAL_S:g}] seconds")
    _check(cfg.write_mode in ("write-back", "write-through"), "write_mode", cfg.write_mode,
           "expected write-back or write-through")


@dataclass(frozen=True, slots=True)
class GrpcTierConfig:
    enabled: bool = _opt(False, "keep an L3 tier on a `tiercache serve` server, shared by every replica")
    address: str = _opt("127.0.0.1:7070", "host:port of the server")
    auth_token_file: str = _opt("", "file holding the server's auth token (empty: no token)")
    timeout: float = _opt(2.0, "seconds a call may take (plus transfer time) before the tier counts as down")
    lookup_timeout: float = _opt(0.25, "seconds a lookup (on the engine's scheduling path) may take before the "
                                       "tier counts as down")
    retry_interval: float = _opt(1.0, "seconds between background probes of a down tier")
    max_message: int = _size(128 << 20, "largest chunk message; match the server's --max-message")
    write_mode: str = _opt("write-through", "write-through (every stored chunk, so replicas see it) | write-back")
    local: str = _opt("auto", "auto: read and write the server's memory tier as files when it offers them "
                              "(tiercache serve --shm-dir) and this host sees them | off")
    bulk: str = _opt("auto", "auto: move chunk bytes over the server's data channel when it has one "
                             "(tiercache serve --data-port) | off: gRPC streams")

    def __post_init__(self) -> None:
        _check(self.local in ("auto", "off"), "local", self.local, "expected auto or off")
        _check(self.bulk in ("auto", "off"), "bulk", self.bulk, "expected auto or off")
        _check(is_host_port(self.address), "address", self.address, "expected host:port")
        _check(
            1 << 16 <= self.max_message <= 1 << 30, "max_message", self.max_message, "must be between 64 KiB and 1 GiB"
        )
        _remote_checks(self)


@dataclass(frozen=True, slots=True)
class FormatConfig:
    codec: str = _opt("raw", "payload codec for every tier below L1: raw | lz4 | lz4-shuffle | int8 | fp8-e4m3 "
                           "(the last two quantize KV to a byte per value: lossy, so off by default)")
    checksum: str = _opt("xxh3_64", "payload checksum: xxh3_64 | crc32")
    signing_key_file: str = _opt("", "file holding a secret (16+ bytes) shared by one tenant's engines: every "
                                     "L2/L3 chunk is signed with it (HMAC-SHA256), and chunks not signed with "
                                     "it are misses")
    encryption_keys_file: str = _opt("", "file of one tenant's AES-256 keys, held by its engines only: a line "
                                         "'ID HEX64' per key, the one to write with ending in 'active'; every "
                                         "L2/L3 chunk is encrypted (AES-256-GCM, the header authenticated), and "
                                         "chunks not encrypted under one of these keys are misses")


@dataclass(frozen=True, slots=True)
class AuditConfig:
    log_file: str = _opt("", "append one JSON line per purge applied, retention expiry and key rotation to this "
                             "file (the processes of an engine share it; created mode 600)")
    tenant: str = _opt("", "the tenant this engine serves, named in its audit lines and audit counters "
                           "(default: 'default')")

    def __post_init__(self) -> None:
        _check(self.tenant == "" or re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.tenant) is not None, "tenant",
               self.tenant, "expected 1-64 letters, digits, '_', '.' or '-'")


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Transfer threads, layerwise loading, and limits per link (rates in bytes/s; 0 = unlimited)."""
    workers: int = _opt(2, "transfer jobs run at once")
    codec_threads: int = _opt(2, "threads encoding and decoding chunks (format.codec) beside the transfers' I/O, "
                                 "each keeping to one core; 0: in line on the transfer threads")
    layerwise: bool = _opt(True, "loads land layer by layer, so layer l computes while l+1 copies")
    inline_host_copies: str = _opt(
        "auto", "L0<->L1 copies on the engine's thread: auto (when L0 is on the CPU) | on | off"
    )
    device_host_rate: int = _size(0, "device<->host (PCIe) bytes/s")
    device_host_burst: int = _size(0, "device<->host bucket size (0: 0.1 s at the rate)")
    device_host_max_in_flight: int = _size(0, "device<->host bytes running at once")
    device_host_max_queued_stores: int = _size(0, "device<->host store bytes waiting before stores are dropped")
    host_disk_rate: int = _size(0, "host<->disk bytes/s")
    host_disk_burst: int = _size(0, "host<->disk bucket size")
    host_disk_max_in_flight: int = _size(0, "host<->disk bytes running at once")
    host_disk_max_queued_stores: int = _size(0, "host<->disk store bytes waiting before stores are dropped")
    host_network_rate: int = _size(0, "host<->network bytes/s")
    host_network_burst: int = _size(0, "host<->network bucket size")
    host_network_max_in_flight: int = _size(0, "host<->network bytes running at once")
    host_network_max_queued_stores: int = _size(0, "host<->network store bytes waiting before stores are dropped")

    def __post_init__(self) -> None:
        _check(1 <= self.workers <= 64, "workers", self.workers, "must be between 1 and 64")
        _check(0 <= self.codec_threads <= 64, "codec_threads", self.codec_threads, "must be between 0 and 64")
        _check(self.inline_host_copies in ("auto", "on", "off"), "inline_host_copies", self.inline_host_copies,
               "expected auto, on or off")
        for f in dataclasses.fields(self):
            if f.metadata.get("size"):
                _check(getattr(self, f.name) >= 0, f.name, getattr(self, f.name), "must be >= 0")

    def link_limits(self) -> dict[str, LinkLimits]:
        from tiercache.contracts.plan import LinkLimits
        return {
            link: LinkLimits(getattr(self, f"{link}_rate"), getattr(self, f"{link}_burst"),
                             getattr(self, f"{link}_max_in_flight"), getattr(self, f"{link}_max_queued_stores"))
            for link in ("device_host", "host_disk", "host_network")
        }


@dataclass(frozen=True, slots=True)
class TierCacheConfig:
    keys: KeysConfig = field(default_factory=KeysConfig)
    device_pool: DevicePoolConfig = field(default_factory=DevicePoolConfig)
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    grpc: GrpcTierConfig = field(default_factory=GrpcTierConfig)
    format: FormatConfig = field(default_factory=FormatConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)

    def replace(self, **sections: Mapping[str, Any]) -> "TierCacheConfig":
        """A copy with some fields changed: ``cfg.replace(cpu={"capacity": "2GiB"})``."""
        return build_config(_merge(to_dict(self), sections))


def to_dict(cfg: object) -> dict[str, Any]:
    return dataclasses.asdict(cfg)  # type: ignore[arg-type]


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _coerce(name: str, f: dataclasses.Field, typ: Any, value: Any) -> Any:
    if f.metadata.get("size"):
        return parse_size(value, name)
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(name, value, "expected a boolean (true/false)")
    if typ is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(name, value, "expected an integer")
        try:
            return int(str(value), 0) if isinstance(value, str) else int(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(name, value, "expected an integer") from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(name, value, "expected a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(name, value, "expected a number") from None
        if not math.isfinite(number):
            raise ConfigError(name, value, "expected a finite number of seconds")
        return number
    if typ is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(name, value, "expected a string")
        return str(value)
    return value


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or "<root>", data, "expected a table of fields")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(prefix + str(key), data[key], f"unknown field; known: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(prefix + name, fields[name], typ, value)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if err.field.startswith(prefix):
            raise
        raise ConfigError(prefix + err.field, err.value, err.reason) from None


def build_config(data: Mapping[str, Any], cls: type = TierCacheConfig) -> Any:
    return _build(cls, data, "")


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError("--config", str(path), f"cannot read file: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError("--config", str(path), "not a text file (expected YAML or TOML)") from None
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text) or {}
    except Exception as err:  # parser errors differ by format; name the file
        raise ConfigError("--config", str(path), f"not valid {path.suffix or 'YAML'}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", str(path), "top level must be a table of sections")
    return data


def is_host_port(address: str) -> bool:
    """``host:port`` with a port in 1..65535 (``[v6]:port`` too)."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def read_listing(path: str | Path, flag: str, key: str) -> tuple[dict, list]:
    """A YAML (or JSON) file holding a non-empty list under ``key``: the whole mapping and the list; a
    `ConfigError` naming ``flag`` and the file otherwise (the router's tenants and replicas files)."""
    import yaml

    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(flag, source, f"cannot read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(flag, source, f"not YAML or JSON ({str(err).splitlines()[0]})") from None
    entries = data.get(key) if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{source}: {key}", entries, "must be a non-empty list")
    return data, entries


def read_secret(path: str, field_name: str) -> str:
    """The stripped contents of a secret file; a `ConfigError` naming ``field_name`` otherwise."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ConfigError(field_name, path, f"cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(field_name, path, "is not UTF-8 text") from None
    if not secret:
        raise ConfigError(field_name, path, "is empty")
    return secret


def read_token(path: str, field_name: str) -> str:
    """An auth token file: one token of printable ASCII (it travels in a header), nothing else."""
    token = read_secret(path, field_name)
    if not all(33 <= ord(c) < 127 for c in token):
        what = "a tenants file (tiercache serve's); give the file of one tenant's token" \
            if "[tenants" in token else "more than one token, or characters a header cannot carry"
        raise ConfigError(field_name, path, f"holds {what}")
    return token


def _set_dotted(target: dict[str, Any], dotted: str, value: str, origin: str) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(origin, dotted, "expected section.field")
    node = target
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(origin, dotted, "is not a section")
    node[parts[-1]] = value


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``TIERCACHE_CPU__CAPACITY=8GiB`` → ``{"cpu": {"capacity": "8GiB"}}``."""
    out: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        if "__" not in key:
            raise ConfigError(key, value, f"expected {ENV_PREFIX}<SECTION>__<FIELD>, e.g. {ENV_PREFIX}CPU__CAPACITY")
        dotted = key[len(ENV_PREFIX):].lower().replace("__", ".")
        _set_dotted(out, dotted, value, key)
    return out


def cli_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """``["cpu.capacity=8GiB"]`` → ``{"cpu": {"capacity": "8GiB"}}``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        dotted, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError("--set", pair, "expected section.field=value")
        _set_dotted(out, dotted.strip(), value.strip(), "--set")
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
    base: Mapping[str, Any] | None = None,
) -> TierCacheConfig:
    """Defaults < ``base`` (a tool's own defaults, e.g. the demo's) < the file < env < overrides."""
    env = os.environ if env is None else env
    overrides = list(overrides)
    data: dict[str, Any] = _merge({}, base or {})
    if path is not None:
        data = _merge(data, _read_file(Path(path)))
    data = _merge(data, env_overrides(env))
    data = _merge(data, cli_overrides(overrides))
    try:
        return build_config(data)
    except ConfigError as err:
        raise naming_its_variable(err, env, overrides) from None


def naming_its_variable(err: ConfigError, env: Mapping[str, str], overrides: Iterable[str] = ()) -> ConfigError:
    """``err`` saying which ``TIERCACHE_*`` variable set the field it names, when one did (with the value the
    error shows) and no ``--set`` override replaced it: the one line then names both the field and where its
    value came from."""
    try:
        variable = _variable_of(err.field, env_overrides(env), cli_overrides(overrides))
    except ConfigError:         # the environment or an override is itself malformed: that error stands alone
        return err
    if variable is None or err.reason.endswith(f"set by {variable}"):
        return err
    if variable.removeprefix(ENV_PREFIX).lower().replace("__", ".") == err.field \
            and not _same_value(env[variable], err.value):
        return err           # the field's value came from elsewhere (a command's flag)
    return ConfigError(err.field, err.value, f"{err.reason}; set by {variable}")


def _same_value(text: str, value: object) -> bool:
    """Whether ``value`` is what ``text`` reads as: the text itself, a number, or a size in bytes."""
    if str(value) == text:
        return True
    for read in (float, parse_size):
        try:
            if read(text) == value:
                return True
        except (ValueError, ConfigError):
            pass
    return False


def _variable_of(dotted: str, from_env: dict[str, Any], from_cli: dict[str, Any]) -> str | None:
    """The environment variable that set ``dotted`` (a field, or a section holding one), else None."""
    parts = dotted.split(".")
    node: Any = from_env
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    while isinstance(node, dict) and node:          # a section: the first field the environment set in it
        part, node = next(iter(node.items()))
        parts.append(part)
    overridden: Any = from_cli
    for part in parts:
        overridden = overridden.get(part) if isinstance(overridden, dict) else None
    if overridden is not None:
        return None
    return ENV_PREFIX + "__".join(p.upper() for p in parts)
