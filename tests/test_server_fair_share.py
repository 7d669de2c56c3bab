"""What a silent or greedy client costs the others on a shared `tiercache serve`: their stores still land, and
every store an engine plans ends in a counted outcome.

Real parts, each in a process of its own: the server, a hostile client (`python -m tiercache.bench.hostile`,
at the lowest CPU priority: a hostile client runs on a machine of its own, and here its own work would only
take the engine's cores), and a reference engine in the test's process that stores a workload through the
server (write-through) and drains. The checks are counts, never times: the suite passes with every core busy.
"""
import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

pytestmark = pytest.mark.slow     # real servers and engines under attack: seconds each

from tests.conftest import CacheServerProcess, free_port  # noqa: E402
from tests.support.grpc_clients import raw_call  # noqa: E402
from tiercache.bench.demo import run_workload  # noqa: E402
from tiercache.bench.workloads import WorkloadSpec  # noqa: E402
from tiercache.config import TierCacheConfig  # noqa: E402
from tiercache.engine import EngineConfig  # noqa: E402
from tiercache.index.tier_index import DROP_REASONS  # noqa: E402
from tiercache.server.cpu_shares import BURST_S, MAX_DEBT_S  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402

TENANTS = ("acme", "rival", "ops")
SPEC = WorkloadSpec("multi-turn", requests=36, prefix_tokens=256, suffix_tokens=32, output_tokens=4, turns=3)


def tenants_file(tmp_path):
    tokens = {name: f"{name}-token-0123456789" for name in TENANTS}
    path = tmp_path / "tenants.toml"
    path.write_text("".join(f'[tenants.{n}]\ntoken = "{t}"\n' for n, t in tokens.items()) + "admin = true\n")
    for name, token in tokens.items():
        (tmp_path / f"{name}.token").write_text(token)
    return path


def serve(tmp_path) -> CacheServerProcess:
    return CacheServerProcess(tmp_path, "--capacity", "64MiB", "--max-message", "8MiB", "--read-timeout", "30",
                              "--auth-token-file", str(tenants_file(tmp_path)))


def store_through(server, tmp_path) -> dict:
    """Tenant acme's engine stores `SPEC` through ``server`` and drains: its gRPC tier's counts."""
    cfg = TierCacheConfig().replace(keys={"block_size": 16, "chunk_tokens": 64},
                                    cpu={"capacity": "2MiB", "prefault": False},
                                    grpc={"enabled": True, "address": server.address, "write_mode": "write-through",
                                          "timeout": 5.0, "auth_token_file": str(tmp_path / "acme.token")})
    run = run_workload(SPEC, EngineConfig(num_blocks=64), cfg, drain=True)
    return run.stats["connector"]["tiers"]["grpc"]


def hostile(server, tmp_path, whose: str, kinds: str, *flags: str) -> subprocess.Popen:
    port = pb.HealthReply.FromString(raw_call(server, "Health", b"")).data_port
    proc = subprocess.Popen([sys.executable, "-m", "tiercache.bench.hostile", "--address", server.address,
                             "--data-port", str(port), "--token-file", str(tmp_path / f"{whose}.token"),
                             "--max-message", str(8 << 20), "--kinds", kinds, "--calls-per-round", "100",
                             "--round-pause", "0.5", *flags],
                            stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(19))
    assert proc.stdout.readline().strip() == "started"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the hostile client did not stop on SIGTERM within 60 s") from None


def server_counters(server, tmp_path) -> dict:
    token = (tmp_path / "ops.token").read_text()
    reply = raw_call(server, "Stats", b"", metadata=(("authorization", f"Bearer {token}"),))
    return dict(pb.StatsReply.FromString(reply).counters)


def assert_every_store_counted(tier: dict) -> None:
    """store_planned = stored + rejected + dropped by each reason + failed: no store ends unaccounted for."""
    dropped = sum(tier[f"store_dropped_{reason}"] for reason in DROP_REASONS)
    assert tier["store_planned"] == tier["stored"] + tier["store_rejected"] + dropped + tier["store_failed"], tier


@contextlib.contextmanager
def attacked(server: CacheServerProcess, tmp_path, whose: str, kinds: str, *flags: str):
    """``server`` while ``kinds`` of hostile clients run as ``whose`` (given time to take what they can and go
    silent past every threshold); both stopped on leaving."""
    proc = None
    try:
        proc = hostile(server, tmp_path, whose, kinds, *flags)
        time.sleep(1.5)
        yield server
    finally:
        try:
            if proc is not None:
                stop(proc)
        finally:
            server.stop()


def under_attack(tmp_path, whose: str, kinds: str, *flags: str) -> tuple[dict, dict]:
    """Acme's engine storing through a fresh server while ``kinds`` of hostile clients run as ``whose``:
    (its gRPC tier's counts, the server's counters)."""
    with attacked(serve(tmp_path), tmp_path, whose, kinds, *flags) as server:
        return store_through(server, tmp_path), server_counters(server, tmp_path)


def undisturbed(tmp_path) -> dict:
    server = serve(tmp_path)
    try:
        return store_through(server, tmp_path)
    finally:
        server.stop()


def test_two_silent_connections_of_the_engines_own_tenant_holding_the_budget_keep_its_stores_landing(tmp_path):
    """Two data-channel PUTs of acme's own token declare 32 MiB each — the whole 64 MiB in-flight budget — send
    1 MiB and go silent, and declare again on a new connection whenever the server ends one. Acme's engine
    stores what it stores on an undisturbed server, 90 % of it at least: each silent holder over its
    connection's share is taken back once the engine's connection waits, and a tenant taken back from takes
    no more than its shares while the engine is active, so the holders cannot take the room back between
    the engine's values. Every store the engine planned is counted."""
    quiet = undisturbed(tmp_path)
    tier, counters = under_attack(tmp_path, "acme", "silent_puts", "--silent-puts", "2", "--silent-value-mib", "32")
    print(f"stored {tier['stored']} of {quiet['stored']} undisturbed; taken back "
          f"{counters['inflight_taken_back']}, answered busy {counters.get('data_put_busy', 0)}")
    assert tier["stored"] >= 0.9 * quiet["stored"], (quiet, tier)
    assert tier["store_failed"] == 0 and tier["errors"] == 0, tier
    assert counters["inflight_taken_back"] >= 1
    assert_every_store_counted(quiet)
    assert_every_store_counted(tier)


@pytest.mark.parametrize("kinds", ["maximal_reads", "maximal_calls", "silent_puts"])
def test_another_tenant_reading_or_holding_as_much_as_it_can_leaves_every_store_landing(tmp_path, kinds):
    """Tenant rival, in a process of its own, reads chunks of the largest message size back as fast as it
    can over the data channel and gRPC streams (``maximal_reads``), sends rounds of concurrent maximal calls
    (``maximal_calls``), or holds the in-flight budget with silent PUTs (``silent_puts``). Acme's
    write-through stores all land: nothing failed, nothing dropped, and the counts add up."""
    tier, counters = under_attack(tmp_path, "rival", kinds)
    assert tier["store_planned"] > 0 and tier["stored"] == tier["store_planned"], tier
    assert tier["store_failed"] == 0 and tier["errors"] == 0, tier
    assert_every_store_counted(tier)
    assert counters.get("handler_faults", 0) == 0


def tenant_cpu_seconds(metrics_port: int) -> dict[str, float]:
    """The server's CPU seconds charged to each tenant, as Prometheus scrapes them."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in
            re.finditer(r'^tiercache_server_tenant_cpu_seconds_total\{tenant="([^"]+)"\} (\S+)$', text, re.M)}


def test_a_rival_reading_as_fast_as_it_can_is_held_to_its_share_of_the_servers_cpu(tmp_path):
    """``--cpu-cores 0.2``: while tenant acme asks for something every 50 ms, the two active tenants may use
    0.1 of a core each. Tenant rival reads maximal chunks as fast as it can over the data channel and gRPC
    streams. Over 8 s, the server's CPU charged to rival — its threads' time and its part of gRPC's by the
    bytes it moved — stays within its share of that time, plus the burst and debt a tenant may run up and
    the pieces of work already begun (unshared, the reads take several times that); rival was made to wait,
    and every one of acme's calls was answered."""
    metrics = free_port()
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB", "--max-message", "8MiB", "--read-timeout", "30",
                                "--auth-token-file", str(tenants_file(tmp_path)), "--cpu-cores", "0.2",
                                "--metrics-port", str(metrics))
    acme = (("authorization", f"Bearer {(tmp_path / 'acme.token').read_text()}"),)
    lookup = pb.ContainsRequest(namespace=bytes(16), keys=[bytes(32)]).SerializeToString()
    with attacked(server, tmp_path, "rival", "maximal_reads"):
        before, start, answered = tenant_cpu_seconds(metrics), time.monotonic(), 0
        while time.monotonic() - start < 8.0:
            answered += pb.ContainsReply.FromString(raw_call(server, "Contains", lookup, metadata=acme)).present == 0
            time.sleep(0.05)
        elapsed, after = time.monotonic() - start, tenant_cpu_seconds(metrics)
        counters = server_counters(server, tmp_path)
    rival = after["rival"] - before.get("rival", 0.0)
    print(f"rival charged {rival:.2f} s of CPU in {elapsed:.1f} s; waited {counters['cpu_waits']} times, "
          f"{counters['cpu_waited_ms']} ms; acme {answered} calls answered")
    assert 0 < rival <= 0.1 * elapsed + BURST_S + MAX_DEBT_S + 0.5, (rival, elapsed)
    assert counters["cpu_waits"] > 0 and answered >= 8.0 / 0.5
