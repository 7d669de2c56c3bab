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

from tiercache.wire.chunk_files import SUFFIX, TEMP_SUFFIX

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
                stem = f.name.removesuffix(TEMP_SUFFIX)
                if f.is_file() and stem.endswith(SUFFIX) and _HEX.fullmatch(stem.removesuffix(SUFFIX)):
                    yield digest, f


def _walk(root: Path, remove: bool) -> tuple[CacheDirUsage, set[Path]]:
    """What the layout's files under ``root`` hold, and the directories they lie in; with ``remove``, each
    file is deleted as it is counted (one walk)."""
    digests, dirs, chunks, temps, nbytes = set(), set(), 0, 0, 0
    for digest, f in list(_chunk_files(root)):
        digests.add(digest)
        dirs.update((digest, f.parent))
        temp = f.name.endswith(TEMP_SUFFIX)
        temps += temp
        chunks += not temp
        nbytes += f.stat().st_size
        if remove:
            f.unlink(missing_ok=True)
    return CacheDirUsage(str(root), len(digests), chunks, temps, nbytes), dirs


def usage(root: Path) -> CacheDirUsage:
    return _walk(root, remove=False)[0]


def clear(root: Path) -> CacheDirUsage:
    """Remove every chunk and temp file of the layout, then the directories they leave empty; returns what
    was removed. Run it while no engine uses the directory (a running engine's index would still list them)."""
    removed, dirs = _walk(root, remove=True)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):     # not empty: something else lives there
            d.rmdir()
    return removed
