"""`tiercache serve`: the gRPC cache server engine replicas share, with its flags."""
from __future__ import annotations

import argparse

from tiercache.cli.options import add_auth_token_flag, add_listen_flags, finite, port, positive, seconds, size
from tiercache.errors import ConfigError

DEFAULT_DISK_CAPACITY = 100 << 30


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("serve", help="run the gRPC cache server that engine replicas share")
    add_listen_flags(v, 7070)
    v.add_argument("--data-port", type=int, default=0,
                   help="TCP port of the data channel that carries chunk bytes beside gRPC (0: any free port, "
                        "advertised in Health; -1: none, bytes go over gRPC)")
    v.add_argument("--capacity", type=size, default=8 << 30, help="memory for chunks, e.g. 8GiB")
    _add_policy_flags(v)
    _add_storage_flags(v)
    add_auth_token_flag(v, "require 'authorization: Bearer <token>' on every call")
    _add_limit_flags(v)
    v.add_argument("--grace", type=finite, default=5.0, help="seconds running calls get at shutdown")
    v.add_argument("--metrics-port", type=port, default=0, help="serve Prometheus metrics on this port")
    v.add_argument("--log-format", choices=["json", "text"], default="json")
    v.set_defaults(func=cmd_serve)


def _add_policy_flags(v: argparse.ArgumentParser) -> None:
    """What the server keeps, and for how long."""
    v.add_argument("--eviction", default=None, help="eviction policy of memory and disk (default: lfu-da)")
    v.add_argument("--admission", default=None,
                   help="which chunks a full store takes, by what every client asked for: adaptive-sighting "
                        "(default), second-sighting, frequency or always (anything while there is room)")
    v.add_argument("--retention", type=float, default=0.0, metavar="SECONDS",
                   help="keep a chunk at most this long after it came, in memory and on disk (0: no limit); "
                        "a tenant with its own store may set its own (retention in the tenants file)")
    v.add_argument("--namespace-retention", action="append", default=[], metavar="NAMESPACE_HEX=SECONDS",
                   help="keep one namespace's chunks (a storage digest) at most this long, in every tenant's "
                        "store (repeatable; a tenant's namespace_retention overrides it)")
    v.add_argument("--audit-log", metavar="FILE", default="",
                   help="also append the audit trail (purges and expiries per tenant, as JSON lines, which the "
                        "log has too) to this file, created mode 600")


def _add_storage_flags(v: argparse.ArgumentParser) -> None:
    """Where the chunks live besides the server's memory."""
    v.add_argument("--shm-dir", metavar="DIR", default="",
                   help="keep the memory tier as chunk files in this tmpfs directory (e.g. /dev/shm/tiercache), "
                        "which clients on this host read and write directly")
    v.add_argument("--disk", metavar="DIR", default="",
                   help="spill evicted chunks to files here (kept across restarts)")
    v.add_argument("--disk-capacity", type=size, default=None,
                   help="bytes of chunk files, e.g. 100GiB (default 100GiB; with --disk only)")


def _add_limit_flags(v: argparse.ArgumentParser) -> None:
    """How much one client, and all of them at once, may ask of the server."""
    v.add_argument("--max-message", type=size, default=128 << 20, help="largest chunk message accepted, e.g. 128MiB")
    v.add_argument("--workers", type=positive, default=8, help="RPC handler threads (two are kept from streams, "
                                                              "for health and lookups)")
    v.add_argument("--read-timeout", type=seconds(0.001), default=10.0,
                   help="seconds a client may leave a request (or a gRPC stream) without progress before it is "
                        "dropped")
    v.add_argument("--idle-timeout", type=seconds(0.001), default=60.0,
                   help="seconds a data-channel connection may sit idle between requests")
    v.add_argument("--max-value", type=size, default=0,
                   help="largest chunk value accepted (default: 256MiB, at most --capacity)")
    v.add_argument("--max-inflight", type=size, default=0,
                   help="bytes being received from all clients at once, reserved before they arrive "
                        "(default: four of the largest values, at most --capacity); memory stays within "
                        "--capacity + this + a constant")
    v.add_argument("--cpu-cores", type=finite, default=0.0,
                   help="the CPU the server's tenants share: while several are active each may use an equal "
                        "part of this many cores (0: every core the server may run on)")


def cmd_serve(args: argparse.Namespace) -> int:
    from tiercache.policies import DEFAULT_ADMISSION, DEFAULT_EVICTION
    from tiercache.server.app import ServeConfig, run

    config = ServeConfig(host=args.host, port=args.port, data_port=args.data_port, capacity=args.capacity,
                         eviction=args.eviction or DEFAULT_EVICTION, admission=args.admission or DEFAULT_ADMISSION,
                         retention=args.retention,
                         namespace_retention=tuple(args.namespace_retention),
                         disk=args.disk, disk_capacity=_disk_capacity(args), shm_dir=args.shm_dir,
                         auth_token_file=args.auth_token_file,
                         max_message=args.max_message, workers=args.workers, grace=args.grace,
                         max_value=args.max_value, max_inflight=args.max_inflight,
                         read_timeout=args.read_timeout, idle_timeout=args.idle_timeout,
                         metrics_port=args.metrics_port, audit_log=args.audit_log, cpu_cores=args.cpu_cores)
    return run(config, args.log_format)


def _disk_capacity(args: argparse.Namespace) -> int:
    if args.disk_capacity is None:
        return DEFAULT_DISK_CAPACITY
    if not args.disk:
        raise ConfigError("--disk-capacity", args.disk_capacity, "has no disk to bound: give --disk DIR too")
    return args.disk_capacity
