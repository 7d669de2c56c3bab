"""A `tiercache serve --shm-dir` directory as a client on the server's host sees it (worker side).

The server keeps its memory tier there as chunk files in the L2 layout
(`tiercache.server.tiers.ShmChunks`); this client reads them itself and
writes new chunks into ``<namespace>/incoming/`` for the server to adopt.
`SharedDirectory.open` trusts a directory only when its ``.instance`` file
holds the token the server gave over gRPC — the proof that this host sees
the server's directory, not a stale or foreign one.

Reads verify every chunk (`tiercache.wire.values.receive_value`); a file that is not
there, or that changes while it is read, is `ELSEWHERE` (ask the server over the
network instead) — never a chunk served wrong. Writes create files the
server renames into place, so a file is never modified once readers can see
it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

from tiercache.codecs import Buffer
from tiercache.contracts.keys import BlockHash
from tiercache.tiers.channels import ELSEWHERE, ReadOutcome, Receive
from tiercache.wire.chunk_files import chunk_path, write_all
from tiercache.wire.values import FileSource

log = logging.getLogger(__name__)

INSTANCE_FILE = ".instance"
INCOMING = "incoming"


class SharedDirectory:
    """Worker side: one namespace's part of a co-located server's directory."""

    def __init__(self, root: Path) -> None:
        self.root = root                      # <directory>/<namespace hex>
        self.incoming = root / INCOMING

    @classmethod
    def open(cls, directory: str, instance: str, namespace: bytes) -> SharedDirectory | None:
        """This namespace's part of the server's directory, or None when this host does not see it."""
        path = Path(directory)
        try:
            seen = (path / INSTANCE_FILE).read_text()
        except OSError:
            seen = None
        if seen != instance:
            log.info("the server's directory %s is not this host's: chunks go over the network", path)
            return None
        log.info("chunks move through %s on this host", path)
        return cls(path / namespace.hex())

    def read(self, key: BlockHash, buf: memoryview, receive: Receive) -> ReadOutcome:
        """``receive(source, n, key, buf)`` takes the chunk's file in; `ELSEWHERE` when there is no such file
        (or it went away mid-read)."""
        try:
            f = open(chunk_path(self.root, key), "rb", buffering=0)
        except OSError:
            return ELSEWHERE
        with f:
            try:
                return receive(FileSource(f), os.fstat(f.fileno()).st_size, key, buf)
            except (OSError, ConnectionError):
                return ELSEWHERE

    def write(self, chunks: Iterable[tuple[Buffer, Buffer]]) -> list[str]:
        """Write each (header, payload) as a new file in ``incoming/``; returns their names, for ``Adopt``.
        Raises OSError, leaving none of its files behind."""
        names: list[str] = []
        try:
            self.incoming.mkdir(parents=True, exist_ok=True)
            for header, payload in chunks:
                names.append(f"{secrets.token_hex(16)}.tmp")
                fd = os.open(self.incoming / names[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    write_all(fd, memoryview(header), memoryview(payload).cast("B"))
                finally:
                    os.close(fd)
        except OSError:
            self.discard(names)
            raise
        return names

    def discard(self, names: Sequence[str]) -> None:
        """Remove files of ours the server did not take (a failed ``Adopt``)."""
        for name in names:
            with contextlib.suppress(OSError):
                (self.incoming / name).unlink(missing_ok=True)
