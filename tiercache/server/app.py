"""Run `tiercache serve`: build the store and the gRPC server, log as JSON lines, stop cleanly on SIGTERM.

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, the server stops
taking calls and gives running ones ``grace`` seconds, then chunks held only
in memory are written to the disk tier (when there is one), so a restarted
server starts warm.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from tiercache.audit import AuditTrail
from tiercache.errors import ConfigError, RegistryError
from tiercache.machine import physical_memory
from tiercache.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION, eviction_policies
from tiercache.server.admission import check_admission
from tiercache.server.collector import Collector
from tiercache.server.cpu_shares import CpuShares
from tiercache.server.data_server import DataServer
from tiercache.server.fair import InflightBytes
from tiercache.server.limits import (
    IDLE_TIMEOUT_S,
    MAX_CALLS,
    MAX_CALLS_PER_CONNECTION,
    READ_TIMEOUT_S,
    ServerLimits,
    memory_bound,
)
from tiercache.server.service import CacheService
from tiercache.server.store import StoreConfig, StoreDirectoryError
from tiercache.server.tenants import Tenancy, load_tenants, namespace_retentions

log = logging.getLogger("tiercache.server")

MAX_MESSAGE_LIMIT = 1 << 30   # gRPC's message limits are 32-bit


def _can_listen(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now, as gRPC binds it (``SO_REUSEADDR``, no ``SO_REUSEPORT``); port 0
    always can."""
    if port == 0:
        return True
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 7070
    capacity: int = 8 << 30
    eviction: str = DEFAULT_EVICTION
    admission: str = DEFAULT_ADMISSION
    disk: str = ""
    disk_capacity: int = 100 << 30
    shm_dir: str = ""
    data_port: int = 0          # 0: any free port; -1: no data channel
    auth_token_file: str = ""
    max_message: int = 128 << 20
    workers: int = 8
    max_value: int = 0          # 0: the default of `ServerLimits.for_server`
    max_inflight: int = 0
    read_timeout: float = READ_TIMEOUT_S
    idle_timeout: float = IDLE_TIMEOUT_S
    grace: float = 5.0
    metrics_port: int = 0
    retention: float = 0.0      # seconds a chunk is kept after it came (0: no limit); tenants may set their own
    namespace_retention: tuple[str, ...] = ()   # "NAMESPACE_HEX=SECONDS": one namespace's own, in every store
    audit_log: str = ""         # a file the audit trail's JSON lines are appended to (they are in the log too)
    cpu_cores: float = 0.0      # the CPU the tenants share (0: every core this process may run on)

    def namespace_retentions(self) -> dict[bytes, float]:
        """``--namespace-retention`` checked (a `ConfigError` naming it otherwise)."""
        given = {}
        for item in self.namespace_retention:
            hex_ns, sep, seconds = item.partition("=")
            try:
                given[hex_ns] = float(seconds) if sep else None
            except ValueError:
                given[hex_ns] = None
            if given[hex_ns] is None:
                raise ConfigError("--namespace-retention", item, "expected NAMESPACE_HEX=SECONDS")
        return namespace_retentions(given, "--namespace-retention")

    def __post_init__(self) -> None:
        if self.retention < 0:
            raise ConfigError("--retention", self.retention, "must be 0 (no limit) or positive seconds")
        self.namespace_retentions()
        if not 0 <= self.port < 65536:
            raise ConfigError("--port", self.port, "must be 0..65535 (0: any free port)")
        if not -1 <= self.data_port < 65536:
            raise ConfigError("--data-port", self.data_port, "must be 0..65535 (0: any free port), or -1 for none")
        if self.capacity <= 0:
            raise ConfigError("--capacity", self.capacity, "must be positive")
        if self.capacity > physical_memory():
            raise ConfigError("--capacity", self.capacity, f"is more than this machine's memory "
                                                           f"({physical_memory()} B)")
        if self.disk and self.disk_capacity <= 0:
            raise ConfigError("--disk-capacity", self.disk_capacity, "must be positive")
        if self.shm_dir and self.disk and Path(self.shm_dir).resolve() == Path(self.disk).resolve():
            raise ConfigError("--shm-dir", self.shm_dir, "must not be the --disk directory")
        if not 1 << 16 <= self.max_message <= MAX_MESSAGE_LIMIT:
            raise ConfigError("--max-message", self.max_message, "must be between 64 KiB and 1 GiB")
        if self.workers < 1:
            raise ConfigError("--workers", self.workers, "must be at least 1")
        if not 0 <= self.max_value <= self.capacity:
            raise ConfigError("--max-value", self.max_value, "must be at most --capacity")
        if self.max_inflight and self.max_inflight < self.limits().max_value_bytes:
            raise ConfigError("--max-inflight", self.max_inflight, "must hold at least one value (--max-value)")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError("--metrics-port", self.metrics_port, "must be 0..65535")
        for flag, value in (("--read-timeout", self.read_timeout), ("--idle-timeout", self.idle_timeout)):
            if not (math.isfinite(value) and 0 < value <= 86400):
                raise ConfigError(flag, value, "must be a number of seconds in (0, 86400]")
        if not math.isfinite(self.cpu_cores) or self.cpu_cores < 0:
            raise ConfigError("--cpu-cores", self.cpu_cores, "must be 0 (every core it may run on) or a positive "
                                                             "number of cores")
        if not math.isfinite(self.grace) or self.grace < 0:
            raise ConfigError("--grace", self.grace, "must be a finite number of seconds >= 0")
        try:
            socket.getaddrinfo(self.host, None)
        except OSError as err:
            raise ConfigError("--host", self.host, f"does not resolve: {err.strerror}") from None
        try:
            eviction_policies.get(self.eviction)
        except RegistryError as err:
            raise ConfigError("--eviction", self.eviction, str(err)) from None
        check_admission(self.admission)

    def cores(self) -> float:
        """The CPU the tenants share: ``--cpu-cores``, or every core this process may run on."""
        return self.cpu_cores or len(os.sched_getaffinity(0))

    def limits(self) -> ServerLimits:
        return ServerLimits.for_server(self.capacity, self.workers, self.max_value, self.max_inflight,
                                       read_timeout_s=self.read_timeout, idle_timeout_s=self.idle_timeout)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""
    _standard = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in self._standard})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str = "json", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLogFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)




def _expiry_sweep(tenancy: Tenancy, audit: AuditTrail):
    """The stores' retention sweep: each tenant's chunks that went are an ``expired`` audit event (a JSON
    line in the log and the audit file) and counted in its tiers' ``expired`` counters."""
    def sweep() -> None:
        for tenant, removed in tenancy.expire().items():
            audit.record("expired", f"expired {removed} chunks of tenant {tenant}", tenant=tenant, chunks=removed)
    return sweep


class CacheServer:
    """A running server: `start`, then `wait` until `stop` (from a signal or another thread)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        tenants = load_tenants(config.auth_token_file)
        try:
            self.audit = AuditTrail(config.audit_log)
        except OSError as err:
            raise ConfigError("--audit-log", config.audit_log, f"cannot append: {err.strerror}") from None
        try:
            self.tenancy = Tenancy(tenants, StoreConfig(config.capacity, config.eviction, config.disk,
                                                        config.disk_capacity, config.shm_dir, config.retention,
                                                        config.namespace_retentions(), config.admission))
        except StoreDirectoryError as err:
            flag = {"shm": "--shm-dir", "disk": "--disk"}[err.tier]
            raise ConfigError(flag, err.path, f"cannot use directory: {err.reason}") from None
        limits = config.limits()
        inflight = InflightBytes(limits.max_inflight_bytes)
        # gRPC's asyncio server reads requests on its event loop and runs the calls' work in the pool: a
        # client that opens calls and never sends their request holds no handler thread
        self._pool = futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="tiercache-rpc")
        cpu = CpuShares(config.cores())
        self.service = CacheService(self.tenancy, config.max_message, limits, inflight, self._pool, cpu, self.audit)
        if not _can_listen(config.host, config.port):      # before gRPC tries: its failed bind logs a line of its own
            raise ConfigError("--port", config.port, f"cannot listen on {config.host}:{config.port} (in use, or "
                                                     "not an address of this host)")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="tiercache-grpc-loop", daemon=True)
        self._loop_thread.start()
        try:
            self._server, self.port = self._on_loop(self._make_server(config))
        except BaseException:
            self._end_loop()
            raise
        if self.port == 0:
            self._end_loop()
            raise ConfigError("--port", config.port, f"cannot listen on {config.host}:{config.port} (in use, or "
                                                     "not an address of this host)")
        self.data: DataServer | None = None
        if config.data_port >= 0:
            try:
                self.data = DataServer(self.tenancy, config.host, config.data_port, limits, inflight, cpu,
                                       counters=self.service.counters)
            except OSError as err:
                self._end_loop()
                raise ConfigError("--data-port", config.data_port,
                                  f"cannot listen on {config.host}:{config.data_port}: {err.strerror}") from None
            self.service.data_port = self.data.port
        self._stopped = threading.Event()
        self._metrics = None
        self._collector = Collector(chores=[_expiry_sweep(self.tenancy, self.audit)])

    async def _make_server(self, config: ServeConfig) -> tuple[grpc.aio.Server, int]:
        limit = config.max_message    # gRPC refuses a larger message from its length prefix, before any handler
        server = grpc.aio.server(
            migration_thread_pool=self._pool, handlers=[self.service.handler()],
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                     ("grpc.so_reuseport", 0),
                     # a stream's receive window stays gRPC's initial one (64 KiB) instead of growing with
                     # the bandwidth-delay product gRPC estimates: a call whose messages no handler reads yet
                     # holds that much, not megabytes
                     ("grpc.http2.bdp_probe", 0),
                     ("grpc.max_concurrent_streams", MAX_CALLS_PER_CONNECTION)],
            maximum_concurrent_rpcs=MAX_CALLS,    # calls in progress, waiting ones included; beyond, refused
        )
        try:
            return server, server.add_insecure_port(f"{config.host}:{config.port}")
        except RuntimeError:    # grpc: "Failed to bind to address"
            return server, 0

    def _on_loop(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _end_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def start(self) -> None:
        if self.config.metrics_port:   # first: a port in use is a config error before anything serves
            from tiercache.metrics import serve_metrics
            try:
                self._metrics = serve_metrics(self.service.stats_dict, self.config.metrics_port, self.config.host)
            except OSError as err:
                raise ConfigError(
                    "--metrics-port", self.config.metrics_port, f"cannot listen: {err.strerror}"
                ) from None
        self._on_loop(self._server.start())
        if self.data is not None:
            self.data.start()
        self._collector.start()
        log.info("serving on %s:%d", self.config.host, self.port,
                 extra={"event": "started", "port": self.port, "data_port": self.service.data_port or None,
                        "capacity": self.config.capacity, "admission": self.config.admission,
                        "disk": self.config.disk or None, "shm_dir": self.config.shm_dir or None,
                        "auth": self.config.auth_token_file != "",
                        "cpu_cores": self.config.cores(),
                        "memory_bound": memory_bound(self.service.limits, self.config.capacity,
                                                     self.config.max_message),
                        "tenants": sorted(self.tenancy.tenants),
                        "chunks_on_disk": sum(s.disk.num_chunks for s in self.tenancy.stores.values() if s.disk)})

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self.service.serving = False
        self._on_loop(self._server.stop(self.config.grace))
        self._end_loop()
        self.service.close()
        if self.data is not None:
            self.data.stop()
        self._collector.stop()
        started = time.monotonic()
        flushed = self.tenancy.flush()
        self.audit.close()
        if self._metrics is not None:
            self._metrics[0].shutdown()
        log.info("stopped", extra={"event": "stopped", "flushed_to_disk": flushed,
                                   "flush_s": round(time.monotonic() - started, 3)})
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()


def run(config: ServeConfig, log_format: str = "json") -> int:
    setup_logging(log_format)
    server = CacheServer(config)

    def on_signal(signum, _frame) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name, extra={"event": "signal"})
        threading.Thread(target=server.stop, name="tiercache-shutdown").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    Collector.freeze()              # this process is the server: what it holds now needs no collecting
    print(json.dumps({"event": "listening", "host": config.host, "port": server.port,
                      "data_port": server.service.data_port or None}), flush=True)
    server.wait()
    return 0
