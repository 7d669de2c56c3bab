"""What a disk tier keeps in its directory, emptying it (``tiercache cache info | clear``), and purging from it.

A disk tier (L2) lays its chunks out as ``<path>/<storage digest hex>/<key[:2]>/<key hex>.chunk`` (see
`tiercache.wire.chunk_files`), plus ``.tmp`` files a writer left half-written. Only files of that layout
are counted or removed: a directory that holds anything else keeps it.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from tiercache.contracts.purge import PurgeOrder, repeat_passes
from tiercache.errors import ChunkFormatError
from tiercache.wire.chunk_files import SUFFIX, TEMP_SUFFIX
from tiercache.wire.chunk_format import HEADER_BYTES, read_header

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


def purge(root: Path, order: PurgeOrder) -> tuple[int, int]:
    """Remove the chunk files ``order`` selects (and temp files of selected keys: half-written chunks hold KV
    too); returns (files, bytes). A chunk's parent and first store time are in its header (a file whose
    header says no time ages from its file's time); a file whose header cannot be read is taken by a purge
    of everything or by age only. A running engine that indexed a removed file finds it gone: a miss. Passes
    repeat while they find something, so a temp file renamed into place meanwhile is taken as well."""
    return repeat_passes(lambda: _purge_pass(root, order))


def _key_of(f: Path) -> bytes:
    return bytes.fromhex(f.name.removesuffix(TEMP_SUFFIX).removesuffix(SUFFIX))


def _purge_pass(root: Path, order: PurgeOrder) -> tuple[int, int]:
    files = [f for digest, f in _chunk_files(root)
             if not order.namespaces or bytes.fromhex(digest.name) in order.namespaces]
    links, born = [], {}
    if order.roots or order.stored_before is not None:     # a prompt's chains and ages are in the headers
        for f in files:
            if f.name.endswith(TEMP_SUFFIX):
                continue
            with contextlib.suppress(OSError, ChunkFormatError), open(f, "rb") as fh:
                meta = read_header(fh.read(HEADER_BYTES))[0]
                links.append((_key_of(f), meta.parent))
                born[f] = meta.stored_at
    chosen = order.selector(links)
    removed = nbytes = 0
    for f in files:
        try:
            st = f.stat()
            if chosen(_key_of(f), born.get(f) or st.st_mtime):
                f.unlink()
                removed += 1
                nbytes += st.st_size
        except FileNotFoundError:            # renamed into place or removed meanwhile: the next pass sees it
            continue
    return removed, nbytes
