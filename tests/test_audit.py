"""The audit trail: JSON lines per event, counted per tenant and event, a file the processes of one engine share
without tearing lines, and bad settings as one clear line before anything starts."""
import json
import multiprocessing

import pytest

from tiercache.audit import AuditTrail
from tiercache.errors import ConfigError


def test_each_event_is_one_json_line_and_counted_per_tenant_and_event(tmp_path):
    path = tmp_path / "audit.jsonl"
    trail = AuditTrail(str(path), tenant="acme")
    trail.record("expired", "tier cpu: 3 chunks past retention removed", chunks=3, tier="cpu")
    trail.record("purge", "purge 1 of tenant initech", tenant="initech", chunks=2, nbytes=4096, seq=1)
    trail.record("expired", "tier disk: 1 chunk past retention removed", chunks=1, tier="disk")
    with pytest.raises(ValueError, match="unknown audit event 'deleted'"):
        trail.record("deleted", "not an audited event")
    trail.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["tenant"], e["chunks"]) for e in lines] == [
        ("expired", "acme", 3), ("purge", "initech", 2), ("expired", "acme", 1)]
    assert lines[1]["bytes"] == 4096 and lines[1]["seq"] == 1 and all("ts" in e and "pid" in e for e in lines)
    assert trail.counts() == {"acme": {"expired": {"events": 2, "chunks": 4, "bytes": 0}},
                              "initech": {"purge": {"events": 1, "chunks": 2, "bytes": 4096}}}
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def _append(path: str, who: int, n: int) -> None:
    trail = AuditTrail(path, tenant=f"rank{who}")
    for i in range(n):
        trail.record("purge_applied", "applied", chunks=i, filler="x" * 2000)
    trail.close()


def test_processes_sharing_one_file_never_tear_a_line(tmp_path):
    """vLLM's scheduler and workers are processes of one engine: each line is one O_APPEND write."""
    path = str(tmp_path / "audit.jsonl")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append, args=(path, who, 300)) for who in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = [json.loads(line) for line in open(path).read().splitlines()]
    assert len(lines) == 900
    assert {e["tenant"]: sorted(x["chunks"] for x in lines if x["tenant"] == e["tenant"]) for e in lines} == {
        f"rank{who}": list(range(300)) for who in range(3)}


def test_an_audit_file_that_cannot_be_opened_is_one_clear_line_before_anything_starts(tmp_path):
    from tests.conftest import Stack
    from tiercache.server.app import CacheServer, ServeConfig

    missing = str(tmp_path / "no-such-dir" / "audit.jsonl")
    with pytest.raises(ConfigError, match="config field 'audit.log_file': cannot append: No such file"):
        Stack(audit={"log_file": missing})
    with pytest.raises(ConfigError, match="flag --audit-log: cannot append: No such file"):
        CacheServer(ServeConfig(port=0, audit_log=missing))
    with pytest.raises(ConfigError, match="config field 'audit.tenant'"):
        Stack(audit={"tenant": "acme corp"})
