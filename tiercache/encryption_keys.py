"""A tenant's encryption keys file (``format.encryption_keys_file``), read at start and watched for rotations.

Either side. The file lists keys by id, one of them marked ``active`` (README,
"Data lifecycle"): ``ID HEX64 [active]`` per line, ``#`` comments. A rotation
is an edit of the file — a new key marked active, an old one kept for its
grace, later removed — and reaches a running engine without a restart: every
`ChunkSealer` reloads it through `KeysFile.changed` (at most once a second, a
``stat`` when nothing changed), and the scheduler side's `KeysAudit` records
each change in the engine's audit trail — once per engine, whichever of its
processes sealed first. A file that turns unreadable or malformed keeps the
keys in use, and says so once per version of the file.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from tiercache.audit import AuditTrail
from tiercache.config import read_secret
from tiercache.errors import ConfigError
from tiercache.wire import chunk_format

FIELD = "format.encryption_keys_file"


@dataclass(frozen=True, slots=True)
class KeySet:
    keys: dict[int, bytes]
    active: int

    def described(self) -> dict[str, object]:
        """What an audit line says of it: ids only, never a key."""
        return {"active": self.active, "readable": sorted(self.keys)}


def read_keys(path: str, field_name: str = FIELD) -> KeySet:
    """A keys file's keys; a `ConfigError` naming the file and the line otherwise."""
    keys: dict[int, bytes] = {}
    active = []
    for number, line in enumerate(read_secret(path, field_name).splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{field_name} ({path}, line {number})"
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != "active") or not words[0].isdigit():
            raise ConfigError(where, f"{len(words)} words", "must be 'ID HEX64' or 'ID HEX64 active'")
        key_id = int(words[0])
        try:
            key = bytes.fromhex(words[1])
        except ValueError:
            raise ConfigError(where, f"key {key_id}", "is not hexadecimal") from None
        if key_id in keys:
            raise ConfigError(where, f"key {key_id}", "is listed twice")
        if not 0 < key_id < 1 << 32 or len(key) != 32:
            raise ConfigError(where, f"key {key_id}", "needs an id from 1 to 2^32 - 1 and 32 bytes (64 hex digits) "
                                                      f"for AES-256, has {len(key)} bytes")
        keys[key_id] = key
        if len(words) == 3:
            active.append(key_id)
    if len(active) != 1:
        raise ConfigError(field_name, path, f"must mark exactly one key 'active' (marks {len(active)})")
    return KeySet(keys, active[0])


def _version(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class KeysFile:
    """One keys file and the version of it last read (thread safe)."""

    def __init__(self, path: str, field_name: str = FIELD) -> None:
        self.path = path
        self.field_name = field_name
        self._lock = threading.Lock()
        self._version = _version(path)
        self.current = read_keys(path, field_name)

    def changed(self) -> tuple[dict[int, bytes], int] | None:
        """The keys and active id when the file changed since last read; None when it did not. A changed
        file that cannot be used raises `ConfigError` once, and is not read again until it changes again."""
        with self._lock:
            version = _version(self.path)
            if version == self._version:
                return None
            self._version = version
            keys = read_keys(self.path, self.field_name)
            if keys == self.current:
                return None
            self.current = keys
            return keys.keys, keys.active


class KeysAudit:
    """Scheduler side: records the engine's keys at start and each change of its keys file after, polled
    once per scheduler step (a clock read) and reading the file at most once per ``chunk_format.KEYS_CHECK_S``."""

    def __init__(self, path: str, audit: AuditTrail) -> None:
        self._file = KeysFile(path)
        self._audit = audit
        self._next_check = time.monotonic() + chunk_format.KEYS_CHECK_S
        keys = self._file.current
        audit.record("keys_loaded", f"encryption at rest: writing under key {keys.active}, reading keys "
                                    f"{sorted(keys.keys)}", keys_file=path, **keys.described())

    def poll(self) -> None:
        if time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + chunk_format.KEYS_CHECK_S
        before = self._file.current
        try:
            if self._file.changed() is None:
                return
        except ConfigError as err:
            self._audit.record("keys_reload_failed", f"encryption keys unchanged: {err}",
                               keys_file=self._file.path, reason=str(err), active=before.active)
            return
        after = self._file.current
        retired = sorted(set(before.keys) - set(after.keys))
        added = sorted(set(after.keys) - set(before.keys))
        replaced = sorted(i for i in set(after.keys) & set(before.keys) if after.keys[i] != before.keys[i])
        self._audit.record("key_rotation", f"encryption keys changed: writing under key {after.active} (was "
                                           f"{before.active}), added {added}, retired {retired}, replaced {replaced}",
                           keys_file=self._file.path, previous_active=before.active, added=added, retired=retired,
                           replaced=replaced, **after.described())
