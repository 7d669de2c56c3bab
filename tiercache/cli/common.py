"""What several commands do with their parsed flags: build the offload config the tier flags name, check a
port before any work starts, make a report directory ready, write a JSON report.

Every check here raises `ConfigError` naming the flag, which `tiercache.cli.main` prints as one line.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from tiercache.config import TierCacheConfig, load_config
from tiercache.errors import ConfigError


def user_cache_dir() -> Path:
    """Where tiercache keeps a user's files between runs: ``$XDG_CACHE_HOME/tiercache`` (``~/.cache/tiercache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tiercache"


def default_disk_path() -> str:
    return str(user_cache_dir() / "l2")


def offload_config(args: argparse.Namespace, base: dict | None = None) -> TierCacheConfig | None:
    """The config tree with the tiers the flags name; None when no tier is wanted. ``base`` holds the
    command's own defaults, below the config file, the environment and ``--set``."""
    cfg = load_config(args.config, overrides=args.set, base=base)
    if not args.tiers:
        return None
    if "cpu" not in args.tiers:
        raise ConfigError("--tiers", ",".join(args.tiers), "L1 (cpu) stages every lower tier; include cpu")
    disk = {"enabled": "disk" in args.tiers}
    if "disk" in args.tiers:
        disk["path"] = args.disk_path or cfg.disk.path or default_disk_path()
    redis = {"enabled": "redis" in args.tiers}
    if "redis" in args.tiers and args.redis_url:
        redis["url"] = args.redis_url
    grpc = {"enabled": "grpc" in args.tiers}
    if "grpc" in args.tiers and args.grpc_address:
        grpc["address"] = args.grpc_address
    return cfg.replace(disk=disk, redis=redis, grpc=grpc, keys={"block_size": args.block_size})


@contextlib.contextmanager
def named_by_flags(flags: dict[str, str]):
    """An engine setting the command line set by a flag is reported under the flag's name."""
    try:
        yield
    except ConfigError as err:
        if err.field not in flags:
            raise
        raise ConfigError(flags[err.field], err.value, err.reason) from None


def check_listen(host: str, port: int, flag: str) -> None:
    """One line naming ``flag`` when this host cannot listen on ``host:port`` — before any work starts."""
    import socket
    try:
        socket.create_server((host, port)).close()
    except OSError as err:
        raise ConfigError(flag, port, f"cannot listen on {host}:{port} ({err.strerror or err})") from None


def ready_directory(path: str | None, flag: str) -> str | None:
    """A directory made ready before any work starts (created if missing, as the disk tier does), or one line
    naming the flag."""
    if not path:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(flag, path, f"cannot create the directory: {err.strerror}") from None
    if not (Path(path).is_dir() and os.access(path, os.W_OK | os.X_OK)):
        raise ConfigError(flag, path, "is not a writable directory")
    return path


def write_json(path: str | None, data: dict) -> None:
    """``data`` as JSON at ``path`` (``--json``), when one is given."""
    if path:
        from tiercache.bench.report import write_json as write
        write(path, data)


def command_line() -> str:
    """The command as typed, for a report to say what made it."""
    return "tiercache " + " ".join(sys.argv[1:])
