"""The data lifecycle's audit trail: purges, expiries and key rotations, per tenant.

Either side, and the server. KV is user data (README, "Data lifecycle"), so
what takes it out of a deployment, and which keys seal it, is evidence an
operator may be asked for. An `AuditTrail` is owned by what makes those
events — an engine's cache manager (purges it applies, chunks its tiers'
retention removed, its keys file changing) and `tiercache serve` (purges it
made, its stores' expiries) — and each event is:

- one JSON line appended to the trail's file (``audit.log_file``, ``serve
  --audit-log``): ``ts``, ``event``, ``tenant``, ``pid`` and the event's own
  fields; one ``write`` with ``O_APPEND`` per line, so the processes of one
  engine (vLLM's scheduler and workers) can share a file without tearing
  lines. A file that cannot be written is a warning and a count, never an
  error in the engine;
- a log record through ``logging`` with the same fields as ``extra`` (the
  server's JSON log carries them);
- counted per tenant and event — events, chunks and bytes — for Prometheus
  (``tiercache_audit_events_total{tenant,event}`` and its ``_chunks``,
  ``_bytes``).

No line carries a key, a prompt or a chunk's payload: a purge's selectors are
the first root's key and counts, a rotation names key ids.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
EVENTS = ("purge", "purge_applied", "expired", "keys_loaded", "key_rotation", "keys_reload_failed")


class AuditTrail:
    """Appends audit events as JSON lines and counts them per (tenant, event); thread safe."""

    def __init__(self, path: str = "", tenant: str = "") -> None:
        self.path = path
        self.tenant = tenant or DEFAULT_TENANT
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], Counter[str]] = {}
        self.write_failures = 0
        self._fd = -1
        if path:
            # an audit file holds tenants' names and key ids: readable by its owner only
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def record(self, event: str, message: str, *, tenant: str = "", chunks: int = 0, nbytes: int = 0,
               **fields: object) -> None:
        """One event: ``message`` to the log, the JSON line to the file, and its counts."""
        if event not in EVENTS:
            raise ValueError(f"unknown audit event {event!r} (one of {', '.join(EVENTS)})")
        whose = tenant or self.tenant
        line = {"ts": round(time.time(), 6), "event": event, "tenant": whose, "pid": os.getpid(), **fields}
        if chunks or event in ("purge", "purge_applied", "expired"):
            line.update(chunks=chunks, bytes=nbytes)
        with self._lock:
            counts = self._counts.setdefault((whose, event), Counter())
            counts.update(events=1, chunks=chunks, bytes=nbytes)
            if self._fd >= 0:
                try:
                    os.write(self._fd, (json.dumps(line, default=str, sort_keys=False) + "\n").encode())
                except OSError as err:
                    self.write_failures += 1
                    log.warning("audit: cannot append to %s: %s", self.path, err.strerror)
        log.info(message, extra={k: v for k, v in line.items() if k != "ts"})

    def counts(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tenant, per event: events, chunks and bytes recorded since start."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        with self._lock:
            for (tenant, event), counts in sorted(self._counts.items()):
                out.setdefault(tenant, {})[event] = {k: counts[k] for k in ("events", "chunks", "bytes")}
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
