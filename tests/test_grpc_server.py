"""`tiercache serve` in a real subprocess and the gRPC client tier: sharing, isolation, limits, auth, faults."""
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.conftest import TOKEN, CacheServerProcess, Stack, eventually, free_port  # noqa: E402
from tests.support.grpc_clients import NS, Client, chunks, healthy, raw_call  # noqa: E402
from tests.support.stack_ops import load, lookup, put  # noqa: E402
from tiercache.contracts.keys import BlockHash, KVGeometry  # noqa: E402
from tiercache.contracts.plan import Failure  # noqa: E402
from tiercache.tiers.grpc_index import GrpcIndex  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta  # noqa: E402
from tiercache.wire.grpc_messages import (  # noqa: E402
    WireError,
    encode_chunk,
    parse_chunk,
    read_chunk,
    split_chunk,
)


def make(server, **grpc_cfg) -> Stack:
    return Stack(num_blocks=64, cpu_chunks=2,
                 grpc={"enabled": True, "address": server.address, "retry_interval": 0.2, "timeout": 1.0, **grpc_cfg})


# -- protocol ----------------------------------------------------------------

def test_committed_stubs_match_the_proto(tmp_path):
    grpc_tools = pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed (pip install -e '.[dev]')")
    from grpc_tools import protoc
    root = Path(__file__).resolve().parents[1]
    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{root / 'proto'}", f"-I{include}", f"--python_out={tmp_path}",
                      f"--pyi_out={tmp_path}", str(root / "proto" / "tiercache.proto")])
    assert rc == 0
    import tiercache.wire
    installed = Path(tiercache.wire.__file__).parent     # the tree's, or the wheel's where CI installs it
    for name in ("tiercache_pb2.py", "tiercache_pb2.pyi"):
        assert (tmp_path / name).read_text() == (installed / name).read_text(), \
            f"{name} is stale: regenerate it (see proto/README.md)"


def test_the_hand_built_chunk_is_protobufs_chunk_both_ways():
    header, payload = b"h" * 124, bytes(range(256)) * 1000
    wire = encode_chunk(NS, b"k" * 32, header, payload)
    msg = pb.Chunk.FromString(wire)
    assert (msg.namespace, msg.key, msg.value) == (NS, b"k" * 32, header + payload)
    assert wire == msg.SerializeToString()
    theirs = pb.Chunk(namespace=NS, key=b"q" * 16, value=b"v" * 300).SerializeToString() + b"\x28\x07"  # + field 5
    view = parse_chunk(theirs)
    assert (view.namespace, view.key, bytes(view.value)) == (NS, b"q" * 16, b"v" * 300)
    assert parse_chunk(encode_chunk(NS, b"k")).value.nbytes == 0
    parts = list(split_chunk(NS, b"k" * 32, header, payload, part_bytes=100_000))   # 256,124 bytes: three messages
    msgs = [pb.Chunk.FromString(m) for m in parts]
    assert len(parts) == 3 and msgs[0].value_len == len(header) + len(payload)
    assert (msgs[1].namespace, msgs[1].key, msgs[1].value_len) == (b"", b"", 0)
    assert b"".join(m.value for m in msgs) == header + payload
    head, pieces, raw = read_chunk(iter(parts))
    assert head.total == len(header) + len(payload) and raw == parts
    with pytest.raises(WireError, match="ended"):
        read_chunk(iter(parts[:2]))


# -- the client tier over a real server ---------------------------------------

@pytest.mark.parametrize("bulk", ["auto", "off"])   # bytes on the data channel, or on gRPC streams
def test_put_contains_get_round_trip_and_namespaces_never_meet(cache_server, bulk):
    tier = Client(cache_server.address, NS, bulk=bulk)
    items = chunks(3)
    assert tier.write_chunks(items) == ()
    keys = [m.key for m, _ in items]
    assert tier.contains(keys) == 3
    assert tier.contains([keys[0], BlockHash(b"z" * 32), keys[2]]) == 1    # a leading run, like every tier
    bufs = [memoryview(bytearray(len(raw))) for _, raw in items]
    assert tier.read_chunks_into(list(zip(keys, bufs))) == [len(raw) for _, raw in items]
    assert all(bytes(b) == raw for b, (_, raw) in zip(bufs, items))
    other = Client(cache_server.address, b"\xff" * 16)
    assert other.contains(keys) == 0
    assert other.read_chunks_into([(keys[0], bufs[0])]) == [Failure.MISS]
    tier.delete(keys[:1])
    assert tier.contains(keys) == 0
    assert tier.read_chunks_into([(keys[0], bufs[0])]) == [Failure.MISS]      # gone between a lookup and its load
    tier.complete_load(keys[:1], {keys[0]: Failure.MISS})
    assert (tier.counters.load_misses, tier.counters.integrity_failures) == (1, 0)
    stats = pb.StatsReply.FromString(raw_call(cache_server, "Stats", b""))
    assert stats.namespaces == 1 and stats.tiers[0].chunks == 2
    on_channel = 3 if bulk == "auto" else 0
    assert stats.counters["data_put_chunks"] == on_channel and stats.counters["data_get_chunks"] == on_channel


def test_chunks_go_to_the_server_and_come_back_bit_exact(cache_server):
    s = make(cache_server)
    try:
        a, a_kv = put(s, "a", seed=1)                  # write-through: L1 and the server
        s.offload.drain()
        remote = s.lower("grpc")
        keys = s.manager.lookup(a).runs[0].keys
        assert remote.present(keys) == 2 and remote.counters.stored == 2
        s.cpu.delete(list(keys))
        assert [r.tier for r in lookup(s, a).runs] == ["grpc"]
        assert torch.equal(load(s, a), a_kv)
        assert remote.counters.loaded == 2
    finally:
        s.close()


def test_the_server_bounds_memory_and_spills_to_disk_across_a_restart(tmp_path):
    disk = tmp_path / "server-l2"
    server = CacheServerProcess(tmp_path, "--capacity", "300KiB", "--disk", str(disk), "--disk-capacity", "10MiB")
    try:
        tier = Client(server.address, NS)
        items = chunks(8)                               # 8 x 64 KiB: 4 fit in memory, the rest spill
        assert tier.write_chunks(items) == ()
        stats = pb.StatsReply.FromString(raw_call(server, "Stats", b""))
        memory, on_disk = stats.tiers
        assert memory.used_bytes <= 300 << 10 and on_disk.chunks >= 4
        keys = [m.key for m, _ in items]
        assert tier.contains(keys) == 8
        assert server.stop(graceful=True) == 0          # SIGTERM: memory is flushed to disk
        assert '"event": "stopped"' in server.log()
        server.start()
        bufs = [memoryview(bytearray(len(raw))) for _, raw in items]
        assert tier.contains(keys) in (0, 8)            # the first call may find the channel reconnecting
        eventually(lambda: tier.contains(keys) == 8, 10, "the restarted server's chunks")
        assert tier.read_chunks_into(list(zip(keys, bufs))) == [len(raw) for _, raw in items]
        assert all(bytes(b) == raw for b, (_, raw) in zip(bufs, items))
    finally:
        server.stop()


@pytest.mark.parametrize("bulk", ["auto", "off"])
def test_a_corrupted_chunk_file_on_the_server_is_a_miss(tmp_path, bulk):
    """Payload damage in the server's own file: the server verifies what it reads from its disk (checksum
    included) before serving it or keeping it in memory, so it answers a miss, counts it and deletes the file
    — rather than serving bad bytes to every replica until one of them deletes it."""
    disk = tmp_path / "server-l2"
    server = CacheServerProcess(tmp_path, "--capacity", "100KiB", "--disk", str(disk))
    try:
        tier = Client(server.address, NS, bulk=bulk)
        items = chunks(3)
        assert tier.write_chunks(items) == ()
        server.stop(graceful=True)
        files = sorted(disk.rglob("*.chunk"))
        assert len(files) == 3
        target = next(f for f in files if f.stem == items[0][0].key.hex())
        data = bytearray(target.read_bytes())
        data[-10] ^= 0xFF                                # payload damage: header and length still check out
        target.write_bytes(bytes(data))
        server.start()
        buf = memoryview(bytearray(1 << 16))
        got = []

        def read_with_the_tier_up() -> bool:
            got[:] = tier.read_chunks_into([(items[0][0].key, buf)])
            return tier.available
        eventually(read_with_the_tier_up, 10, "a read with the tier back")
        assert got == [Failure.MISS]
        assert not target.exists() and tier.contains([items[0][0].key]) == 0
        stats = pb.StatsReply.FromString(raw_call(server, "Stats", b""))
        on_disk = next(t for t in stats.tiers if t.name == "disk")
        assert on_disk.counters["integrity_failures"] == 1
        assert tier.read_chunks_into([(items[1][0].key, buf)]) == [1 << 16]
    finally:
        server.stop()


# -- faults ------------------------------------------------------------------

def test_malformed_and_oversized_rpcs_get_clean_statuses_and_the_server_stays_up(tmp_path):
    server = CacheServerProcess(tmp_path, "--capacity", "8MiB", "--max-message", "1MiB")
    try:
        with pytest.raises(grpc.RpcError) as err:
            raw_call(server, "Contains", b"\xff\xff\xff")                      # not a ContainsRequest
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            raw_call(server, "Contains", pb.ContainsRequest(namespace=b"short", keys=[b"k"]).SerializeToString())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            raw_call(server, "Put", [encode_chunk(NS, b"k" * 32, b"not a chunk header")])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        meta, raw = chunks(1)[0]
        header, payload = ChunkFormat().encode_parts(meta, raw)
        with pytest.raises(grpc.RpcError) as err:                              # a header naming another namespace
            raw_call(server, "Put", [encode_chunk(b"\x01" * 16, meta.key, header, payload)])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Namespace" in err.value.details()
        header, payload = ChunkFormat().encode_parts(meta, raw)
        first = list(split_chunk(NS, meta.key, header, payload, part_bytes=1 << 14))[0]
        with pytest.raises(grpc.RpcError) as err:                              # a split chunk cut short by another
            raw_call(server, "Put", [first, first])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "before the previous" in err.value.details()
        big_meta = ChunkMeta(NS, meta.key, 16, "float32", ((3 << 20) // 8,))  # 1.5 MiB > --max-message 1MiB
        header, payload = ChunkFormat().encode_parts(big_meta, bytes(big_meta.raw_len))
        with pytest.raises(grpc.RpcError) as err:      # refused by gRPC from its length prefix: never received
            raw_call(server, "Put", [encode_chunk(NS, meta.key, header, payload)])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.value.details()
        assert healthy(server)
        log = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        codes = [r["code"] for r in log if r.get("event") == "rpc_rejected"]
        assert codes.count("INVALID_ARGUMENT") == 5
        tier = Client(server.address, NS, max_message_bytes=8 << 20)
        assert tier.health().max_message_bytes == 1 << 20
    finally:
        server.stop()


def test_a_client_learns_the_servers_message_limit_and_splits_chunks_to_fit(tmp_path):
    server = CacheServerProcess(tmp_path, "--max-message", "64KiB")
    try:
        s = Stack(num_blocks=64, cpu_chunks=2, geometry=KVGeometry(4, 8, 64, "float32"),   # 256 KiB chunks
                  grpc={"enabled": True, "address": server.address, "bulk": "off"})   # on gRPC streams
        try:
            remote, values = s.lower("grpc"), s.transport("grpc")
            assert values.max_message_bytes == 64 << 10 and values.part_bytes < 64 << 10
            a, a_kv = put(s, "a", seed=1)
            s.offload.drain()
            keys = s.manager.lookup(a).runs[0].keys
            assert remote.counters.stored == 2 and remote.counters.errors == 0
            s.cpu.delete(list(keys))
            assert torch.equal(load(s, a), a_kv)             # five pieces a chunk, reassembled bit-exact
        finally:
            s.close()
    finally:
        server.stop()


def test_a_wrong_or_missing_auth_token_is_refused_and_logged(token_server, tmp_path):
    server = token_server
    items = chunks(1)
    good = Client(server.address, NS, auth_token=TOKEN)
    bad = Client(server.address, NS, auth_token="guess", retry_interval_s=0.1)
    assert good.write_chunks(items) == ()
    assert bad.contains([items[0][0].key]) == 0 and bad.index.stats()["errors"] == 1   # a miss, not an exception
    with pytest.raises(grpc.RpcError) as err:
        raw_call(server, "Contains", pb.ContainsRequest(namespace=NS, keys=[b"k"]).SerializeToString())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:              # the right token, but not as `Bearer <token>`
        raw_call(server, "Contains", pb.ContainsRequest(namespace=NS, keys=[b"k"]).SerializeToString(),
                 metadata=(("authorization", TOKEN),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert good.contains([items[0][0].key]) == 1
    assert server.log().count("UNAUTHENTICATED") >= 2
    s = make(server, auth_token_file=str(tmp_path / "token"))
    try:
        remote = s.lower("grpc")            # the config's token file: calls go through (another namespace: a miss)
        assert remote.present([items[0][0].key]) == 0 and remote.stats()["errors"] == 0
    finally:
        s.close()


@pytest.mark.parametrize("bulk", ["auto", "off"])
def test_a_killed_server_is_a_run_of_misses_and_the_tier_recovers_when_it_returns(tmp_path, bulk):
    server = CacheServerProcess(tmp_path)
    s = make(server, bulk=bulk)
    try:
        a, a_kv = put(s, "a", seed=1)
        s.offload.drain()
        keys = s.manager.lookup(a).runs[0].keys
        server.stop()                                              # SIGKILL mid-run
        s.cpu.delete(list(keys))
        t0 = time.monotonic()
        assert lookup(s, a).num_hit_blocks == 0                    # a miss, not an exception
        b, _ = put(s, "b", seed=2)
        s.offload.drain()
        assert time.monotonic() - t0 < 10.0                        # no stall on a dead server
        remote = s.lower("grpc")
        assert remote.stats()["errors"] >= 1
        server.start()                                             # an empty server on the same port
        deadline = time.monotonic() + 10
        while True:
            c, _ = put(s, "c" + str(time.monotonic()), seed=3 + int(time.monotonic() * 1000) % 1000)
            s.offload.drain()
            if remote.present(s.manager.lookup(c).runs[0].keys) == 2:
                break                                              # recovered without restarting the client
            assert time.monotonic() < deadline, "the tier did not recover within 10 s"
            time.sleep(0.2)
    finally:
        s.close()
        server.stop()


def test_serve_flags_are_checked():
    def serve(*flags):
        return subprocess.run([sys.executable, "-m", "tiercache.cli", "serve", *flags],
                              capture_output=True, text=True, timeout=60)
    proc = serve("--capacity", "lots")
    assert proc.returncode == 2 and "--capacity" in proc.stderr
    proc = serve("--eviction", "nope", "--port", "0")
    assert proc.returncode == 2 and "--eviction" in proc.stderr and "Traceback" not in proc.stderr
    proc = serve("--auth-token-file", "/nonexistent/token", "--port", "0")
    assert proc.returncode == 2 and "--auth-token-file" in proc.stderr and "Traceback" not in proc.stderr
    for flag in ("--shm-dir", "--disk"):                   # a directory that cannot be made names its flag
        proc = serve(flag, "/proc/nonexistent/dir", "--port", "0")
        assert proc.returncode == 2 and f"flag {flag}:" in proc.stderr and "Traceback" not in proc.stderr
    proc = serve("--data-port", "70000", "--port", "0")
    assert proc.returncode == 2 and "--data-port" in proc.stderr
    import socket
    with socket.create_server(("127.0.0.1", 0)) as taken:   # a port in use: tiercache's one line, not gRPC's too
        proc = serve("--port", str(taken.getsockname()[1]))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "flag --port: cannot listen" in proc.stderr


def test_grpc_config_errors_name_the_field():
    from tiercache.config import load_config
    from tiercache.errors import ConfigError
    with pytest.raises(ConfigError, match="grpc.address"):
        load_config(env={}, overrides=["grpc.address=nohost"])
    with pytest.raises(ConfigError, match="grpc.write_mode"):
        load_config(env={}, overrides=["grpc.write_mode=sometimes"])


def test_the_metrics_endpoint_exports_the_servers_tiers(tmp_path):
    port = free_port()
    server = CacheServerProcess(tmp_path, "--metrics-port", str(port))
    try:
        client = Client(server.address, NS)
        items = chunks(2)
        client.write_chunks(items)
        keys = [m.key for m, _ in items]
        assert client.contains(keys) == 2 and client.contains([keys[0], b"\xee" * 32, keys[1]]) == 1
        client.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'tiercache_tier_chunks{tier="memory"} 2.0' in body
        assert "tiercache_server_put_stored_total 2.0" in body
        # the memory tier counts the lookups it answered: 2 + 2 keys looked at (the second stops at its miss),
        # 2 + 1 found
        assert 'tiercache_tier_lookups_total{tier="memory"} 2.0' in body
        assert 'tiercache_tier_lookup_keys_total{tier="memory"} 4.0' in body
        assert 'tiercache_tier_hit_keys_total{tier="memory"} 3.0' in body
        assert 'tiercache_tier_key_hit_ratio{tier="memory"} 0.75' in body
    finally:
        server.stop()


@pytest.mark.slow
def test_two_engine_processes_share_prefixes_through_one_server(cache_server, tmp_path):
    """Replica 1 computes and writes through to the server; replica 2, a fresh process, loads the prefix from it."""
    args = [sys.executable, "-m", "tiercache.cli", "demo", "--tiers", "cpu,grpc", "--grpc-address",
            cache_server.address, "--requests", "3", "--prefix-tokens", "256", "--output-tokens", "3", "--quiet"]
    first = subprocess.run([*args, "--json", str(tmp_path / "1.json")], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert json.loads((tmp_path / "1.json").read_text())["chunks_loaded_by_tier"]["grpc"] == 0
    second = subprocess.run([*args, "--json", str(tmp_path / "2.json")], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    report = json.loads((tmp_path / "2.json").read_text())
    assert report["outputs_match"] is True
    assert report["chunks_loaded_by_tier"]["grpc"] > 0
    assert report["hit_tokens_by_tier"]["tiers"] >= 256


def test_an_engine_keeps_generating_identical_tokens_when_the_server_dies(cache_server):
    from tests.conftest import engine_after_remote_outage
    from tests.support.engine_runs import offload, run_sequential, shared_prompts

    cfg = offload(grpc={"enabled": True, "address": cache_server.address, "retry_interval": 0.2, "timeout": 0.5})
    with engine_after_remote_outage(cfg, cache_server.stop) as two:
        cache_server.start()                                         # back: the tier recovers in the same engine
        remote = two.stats()["connector"]["tiers"]["grpc"]
        deadline, seed = time.monotonic() + 10, 1
        while two.stats()["connector"]["tiers"]["grpc"]["stored"] == remote["stored"]:
            assert time.monotonic() < deadline, "stores to the restarted server did not resume within 10 s"
            run_sequential(two, shared_prompts(n=1, seed=seed))      # a new prefix: new chunks to write through
            seed += 1
            time.sleep(0.2)


@pytest.mark.slow
def test_bench_tiers_grpc_reports_ratios_against_bare_transports_and_files(tmp_path):
    out = tmp_path / "g.json"
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "tiers", "--tiers",
                           "grpc,grpc-stream,grpc-shm",
                           "--shape", "small", "--total-mib", "8", "--reps", "2", "--quiet", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tiers = json.loads(out.read_text())["tiers"]
    for name, baseline in (("grpc", "bare TCP"), ("grpc-stream", "bare gRPC"), ("grpc-shm", "file write")):
        r = tiers[name]
        assert r["put_gbps"] > 0 and r["raw_put_gbps"] > 0 and r["get_ratio"] > 0
        assert r["raw_baseline"].startswith(baseline)


@pytest.mark.slow
def test_bench_engine_with_remote_tiers_matches_the_baseline(redis_server, tmp_path):
    out = tmp_path / "eng"
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "engine", "--workloads", "shared-prefix",
                           "--setups", "cpu+redis,cpu+disk+grpc", "--requests", "3", "--prefix-tokens", "256",
                           "--output-tokens", "2", "--quiet", "--out", str(out), "--set",
                           f"redis.url={redis_server.url}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["setup"]: r for r in json.loads((out / "engine.json").read_text())["results"]}
    assert set(rows) == {"baseline (no cache)", "cpu+redis", "cpu+disk+grpc"}
    assert all(r["outputs_match_baseline"] for r in rows.values())
    assert set(rows["cpu+disk+grpc"]["chunks_loaded_by_tier"]) == {"cpu", "disk", "grpc"}


def test_an_engine_starts_while_the_server_is_down_and_picks_it_up_later(tmp_path):
    port = free_port()
    s = Stack(num_blocks=64, cpu_chunks=2,
              grpc={"enabled": True, "address": f"127.0.0.1:{port}", "retry_interval": 0.2, "timeout": 0.5})
    server = None
    try:
        a, _ = put(s, "a", seed=1)                       # stores go on; none go to the absent server
        s.offload.drain()
        assert s.manager.lookup(a).runs[0].tier == "cpu"
        remote = s.lower("grpc")
        assert not remote.available and remote.counters.store_rejected == 2
        server = CacheServerProcess(tmp_path, port=port)
        deadline = time.monotonic() + 10
        while True:
            b, _ = put(s, f"b{time.monotonic()}", seed=2 + int(time.monotonic() * 1000) % 1000)
            s.offload.drain()
            if remote.present(s.manager.lookup(b).runs[0].keys) == 2:
                break
            assert time.monotonic() < deadline, "the tier did not pick the server up within 10 s"
            time.sleep(0.2)
    finally:
        s.close()
        if server is not None:
            server.stop()


def test_a_hung_server_never_holds_the_scheduler_and_then_answers_misses_at_once():
    """A host that accepts connections and never speaks: the scheduler's lookups answer at once ("ask again"
    while the one query waits out its short lookup timeout on the lookup thread), then misses without asking
    while a prober knocks."""
    import socket
    hole = socket.create_server(("127.0.0.1", 0), backlog=64)
    index = GrpcIndex(f"127.0.0.1:{hole.getsockname()[1]}", lookup_timeout_s=1.0, retry_interval_s=0.05)
    index.attach([NS])
    keys = [m.key for m, _ in chunks(2)]
    try:
        t = time.monotonic()
        slowest, answer = 0.0, None
        while answer is None:
            asked = time.monotonic()
            answer = index.contains(keys)
            slowest = max(slowest, time.monotonic() - asked)
            time.sleep(0.001)
        # no call waited out the 1 s lookup timeout (the lookup thread did, once); bounds far from a loaded
        # machine's slowness and far below what a waiting call would take
        assert answer == 0 and slowest < 0.5 and time.monotonic() - t < 5.0
        t = time.monotonic()
        assert all(index.contains(keys) == 0 for _ in range(50)) and time.monotonic() - t < 2.0   # asking: 50 s
        eventually(lambda: index._outage.probes >= 1, 10, "a background probe")
        assert not index.available
    finally:
        index.close()
        hole.close()


def _stats_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache.cli", "stats", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("bulk", ["auto", "off"])
def test_tiercache_stats_names_the_most_read_chunks(cache_server, bulk):
    tier = Client(cache_server.address, NS, bulk=bulk)
    items = chunks(3)
    assert tier.write_chunks(items) == ()
    bufs = [memoryview(bytearray(len(raw))) for _, raw in items]
    for reads in (3, 1):                                  # chunk 0 four times, chunks 1 and 2 once
        for _ in range(reads):
            assert tier.read_chunks_into(list(zip([m.key for m, _ in items], bufs))[:1 if reads == 3 else 3])
    tier.close()
    proc = _stats_cli("--server", cache_server.address)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    hot = stats["hot_chunks"]
    assert (hot[0]["namespace"], hot[0]["key"], hot[0]["hits"]) == (NS.hex(), items[0][0].key.hex(), 4)
    assert sorted(h["hits"] for h in hot) == [1, 1, 4]
    assert stats["counters"]["get_hits"] == 6 and stats["tiers"][0]["chunks"] == 3


def test_tiercache_stats_errors_are_one_line(token_server, tmp_path):
    bad = _stats_cli("--server", "no-port")
    assert bad.returncode == 2 and "--server" in bad.stderr and "Traceback" not in bad.stderr
    refused = _stats_cli("--server", token_server.address)                 # the server wants a token
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "Traceback" not in refused.stderr
    ok = _stats_cli("--server", token_server.address, "--auth-token-file", str(tmp_path / "token"))
    assert ok.returncode == 0 and json.loads(ok.stdout)["hot_chunks"] == []
    tenants = tmp_path / "tenants.toml"                  # the server's tenants file, given where a token goes
    tenants.write_text('[tenants.acme]\ntoken = "0123456789abcdef0123"\n')
    latin1 = tmp_path / "latin1.token"
    latin1.write_bytes("s\xe9cret-token-0123".encode("latin-1"))
    for path, why in ((tenants, "a tenants file"), (latin1, "is not UTF-8 text")):
        wrong = _stats_cli("--server", token_server.address, "--auth-token-file", str(path))
        lines = wrong.stderr.strip().splitlines()
        assert wrong.returncode == 2 and len(lines) == 1, wrong.stderr
        assert "--auth-token-file" in lines[0] and str(path) in lines[0] and why in lines[0]


def test_one_bad_chunk_on_the_server_costs_one_failed_load_not_a_retry_storm(tmp_path):
    """A chunk file damaged on the server's disk while it was down: the server finds it bad when a fresh
    engine's promotion asks for it and answers a miss. That is one failed load: the engine's index then
    answers "absent" for the chunk at once instead of re-planning the promotion every step, the engine
    recomputes and writes the chunk through again, and the next request hits the whole prefix."""
    from tests.support.engine_runs import BLOCK, offload, run_sequential, shared_prompts
    from tiercache.contracts.keys import chunk_keys
    from tiercache.engine import EngineConfig, LLMEngine

    disk = tmp_path / "server-l2"
    server = CacheServerProcess(tmp_path, "--capacity", "8MiB", "--disk", str(disk))   # memory goes down at stop
    cfg = offload(grpc={"enabled": True, "address": server.address, "retry_interval": 0.2, "timeout": 2.0})
    prompts = shared_prompts(n=3)
    try:
        with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
            expect = [s.output_token_ids for s in run_sequential(engine, prompts[:1])]
            hashes = engine.hasher.hash_blocks(prompts[0][:len(prompts[0]) // BLOCK * BLOCK])
        server.stop(graceful=True)
        first = chunk_keys(hashes, 64 // BLOCK)[0]      # the chain's first chunk: every later lookup asks for it
        (victim,) = disk.rglob(f"{first.hex()}.chunk")
        data = bytearray(victim.read_bytes())
        data[-10] ^= 0xFF                                # payload damage: header and length still check out
        victim.write_bytes(bytes(data))
        server.start()
        with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
            eventually(lambda: engine.stats()["connector"]["tiers"]["grpc"]["available"], 10, "the server up")
            seqs = run_sequential(engine, prompts)
            assert [s.output_token_ids for s in seqs[:1]] == expect
            tier = engine.stats()["connector"]["tiers"]["grpc"]
            assert tier["load_misses"] + tier["integrity_failures"] == 1      # one failed load in all
            assert seqs[0].metrics.external_hit_tokens == 0                   # the prefix broke at its first chunk
            assert seqs[2].metrics.external_hit_tokens == 192                 # written through again, and hit
    finally:
        server.stop()


def test_the_shutdown_flush_counts_only_the_chunks_it_wrote(tmp_path, monkeypatch):
    """A disk that fills up while the server writes memory down at shutdown: the count it logs
    (`flushed_to_disk`) is what reached the disk, not what it meant to write."""
    import errno

    import tiercache.server.store as store_module
    from tiercache.server.store import ChunkStore, PutOutcome, StoreConfig
    from tiercache.wire.chunk_format import ChunkFormat
    from tiercache.wire.grpc_messages import split_chunk

    store = ChunkStore(StoreConfig(8 << 20, disk_path=str(tmp_path / "l2"), disk_capacity=64 << 20))
    items = chunks(3)
    for meta, raw in items:
        header, payload = ChunkFormat().encode_parts(meta, raw)
        assert store.put(NS, meta.key, list(split_chunk(NS, meta.key, header, memoryview(payload)))) \
            is PutOutcome.STORED
    real, calls = store_module.write_chunk_file, []

    def fills_after_one(*args, **kwargs):
        calls.append(args[0])
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)
    monkeypatch.setattr(store_module, "write_chunk_file", fills_after_one)
    assert store.flush() == 1 and len(calls) == 3
    assert store.disk.num_chunks == 1


class _Fault(grpc.RpcError):
    """A status the server (or the call's deadline) answers with: a fault injected at the client's
    transport boundary."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _refused_for_room():
    raise _Fault(grpc.StatusCode.RESOURCE_EXHAUSTED, "no request slot free for tenant 'default'; try again")


def _too_slow(*_):
    raise _Fault(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _stored_one(server, seed: int):
    """A client of ``server`` that stored one chunk; with that chunk's keys and its index's real lookup."""
    client = Client(server.address, NS)
    items = chunks(1, seed=seed)
    assert client.write_chunks(items) == ()
    return client, [m.key for m, _ in items], client.index._present


def test_a_lookup_refused_by_a_busy_server_is_a_miss_and_the_tier_stays_up(cache_server):
    """A ``Contains`` the server refused for room says nothing about the server being away: that lookup is a
    miss (counted as busy, not as an error) and the next one asks again — no outage, no probing."""
    client, keys, real = _stored_one(cache_server, seed=8)
    try:
        client.index._present = lambda *a: _refused_for_room()
        assert client.contains(keys) == 0
        client.index._present = real
        assert client.index.available and client.index.stats()["lookups_busy"] == 1
        assert client.index.stats()["errors"] == 0 and client.index.stats()["outages"] == 0
        assert client.contains(keys) == 1
    finally:
        client.close()


def test_a_slow_lookup_is_a_miss_and_only_lookups_that_keep_timing_out_take_the_tier_down(cache_server):
    """A loaded server may answer one lookup past ``lookup_timeout`` and the next in time: that lookup is a
    miss (``lookups_slow``), the tier stays up. `SLOW_LOOKUPS_DOWN` in a row are a hung server: an outage."""
    from tiercache.tiers.remote_index import SLOW_LOOKUPS_DOWN

    client, keys, real = _stored_one(cache_server, seed=9)
    try:
        client.index._present = _too_slow
        for _ in range(SLOW_LOOKUPS_DOWN - 1):
            assert client.contains(keys) == 0
        assert client.index.available and client.index.stats()["lookups_slow"] == SLOW_LOOKUPS_DOWN - 1
        client.index._present = real
        assert client.contains(keys) == 1                 # answered in time: the run of slow ones is over
        client.index._present = _too_slow
        for _ in range(SLOW_LOOKUPS_DOWN - 1):
            assert client.contains(keys) == 0
        assert client.index.available
        assert client.contains(keys) == 0                 # the third in a row
        assert not client.index.available and client.index.stats()["outages"] == 1
    finally:
        client.close()
