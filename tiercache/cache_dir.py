"""What a disk tier keeps in its directory, and emptying it (``tiercache cache info | clear``).

A disk tier (L2) lays its chunks out as ``<path>/<storage digest hex>/<key[:2]>/<key hex>.chunk`` (see
`tiercache.wire.chunk_files`), plus ``.tmp`` files a writer left half-written. Only files of that layout
are counted or removed: a directory that holds anything else keeps it.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from tiercache.wire.chunk_files import SUFFIX

_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True, slots=True)
class CacheDirUsage:
    path: str
    digests: int          # storage digests (a model, layout, chunk size and rank share each)
    chunks: int
    temp_files: int
    bytes: int


def _chunk_files(root: Path):
    """Every chunk or temp file of the disk-tier layout under ``root``."""
    if not root.is_dir():
        return
    for digest in root.iterdir():
        if not (digest.is_dir() and _HEX.fullmatch(digest.name)):
            continue
        for shard in digest.iterdir():
            if not (shard.is_dir() and len(shard.name) == 2 and _HEX.fullmatch(shard.name)):
                continue
            for f in shard.iterdir():
                stem = f.name.removesuffix(".tmp")
                if f.is_file() and stem.endswith(SUFFIX) and _HEX.fullmatch(stem.removesuffix(SUFFIX)):
                    yield digest, f


def usage(root: Path) -> CacheDirUsage:
    digests, chunks, temps, nbytes = set(), 0, 0, 0
    for digest, f in _chunk_files(root):
        digests.add(digest.name)
        temps += f.name.endswith(".tmp")
        chunks += not f.name.endswith(".tmp")
        nbytes += f.stat().st_size
    return CacheDirUsage(str(root), len(digests), chunks, temps, nbytes)


def clear(root: Path) -> CacheDirUsage:
    """Remove every chunk and temp file of the layout, then the directories they leave empty; returns what
    was removed. Run it while no engine uses the directory (a running engine's index would still list them)."""
    removed = usage(root)
    dirs = set()
    for digest, f in list(_chunk_files(root)):
        f.unlink(missing_ok=True)
        dirs.update((f.parent, digest))
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):     # not empty: something else lives there
            d.rmdir()
    return removed
