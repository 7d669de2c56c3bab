"""`tiercache cache`: what the disk tier's directory keeps, or empty it, with its flags."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tiercache.cli.common import default_disk_path
from tiercache.cli.options import add_config_flags
from tiercache.config import load_config
from tiercache.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    ca = sub.add_parser("cache", help="the disk tier's directory: what it keeps (info), or empty it (clear)")
    ca.add_argument("action", choices=["info", "clear"])
    ca.add_argument("--disk-path", help="the disk tier's directory (default: disk.path, else ~/.cache/tiercache/l2, "
                                        "where `tiercache demo` keeps it)")
    add_config_flags(ca)
    ca.set_defaults(func=cmd_cache)


def cmd_cache(args: argparse.Namespace) -> int:
    from tiercache import cache_dir

    cfg = load_config(args.config, overrides=args.set)
    root = Path(args.disk_path or cfg.disk.path or default_disk_path())
    if root.exists() and not root.is_dir():
        raise ConfigError("--disk-path", str(root), "is not a directory")
    if args.action == "info":
        u = cache_dir.usage(root)
        print(json.dumps({"path": u.path, "chunks": u.chunks, "bytes": u.bytes, "storage_digests": u.digests,
                          "temp_files": u.temp_files}, indent=2))
    else:
        u = cache_dir.clear(root)
        print(f"tiercache: removed {u.chunks} chunk files ({u.bytes / 2**20:.1f} MiB) and {u.temp_files} temp files "
              f"from {u.path}", file=sys.stderr)
    return 0
