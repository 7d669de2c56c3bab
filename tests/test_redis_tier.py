"""L3 on a real redis-server: shared chunks, verification, namespaces, and outages that become misses.

The tier is two objects: `RedisIndex` (the scheduler's lookups, on a thread of their own) and one
`RedisTransport` per rank (the values); the stack tests drive both through the manager and the ranks.
"""

import redis
import torch

from tests.conftest import BLOCK, CHUNK, Stack, eventually
from tests.support.stack_ops import load, lookup, put
from tiercache.contracts.plan import Failure
from tiercache.tiers.redis import RedisIndex, RedisTransport

BPC = CHUNK // BLOCK


def make(server, **redis_cfg) -> Stack:
    return Stack(num_blocks=64, cpu_chunks=2,
                 redis={"enabled": True, "url": server.url, "retry_interval": 0.2, "timeout": 0.5, **redis_cfg})


def test_chunks_go_down_to_redis_and_come_back_bit_exact(redis_server):
    s = make(redis_server)
    try:
        a, a_kv = put(s, "a", seed=1)                 # write-through: L1 and Redis
        s.offload.drain()
        remote = s.lower("redis")
        keys = s.manager.lookup(a).runs[0].keys
        assert remote.present(keys) == 2 and remote.counters.stored == 2
        s.cpu.delete(list(keys))                      # only Redis has them now
        assert s.manager.lookup(a).pending            # the scheduler does not wait for Redis: ask again...
        assert [r.tier for r in lookup(s, a).runs] == ["redis"]   # ...and the answer is in
        assert torch.equal(load(s, a), a_kv)          # promoted into L1, then loaded
        assert remote.counters.loaded == 2
    finally:
        s.close()


def test_a_second_replica_shares_the_prefix(redis_server):
    first, second = make(redis_server), make(redis_server)
    try:
        a, a_kv = put(first, "a", seed=1)
        first.offload.drain()
        assert torch.equal(load(second, a), a_kv)     # computed by the first, served to the second
    finally:
        first.close()
        second.close()


def test_corrupt_or_foreign_values_are_misses_and_are_deleted(redis_server):
    s = make(redis_server)
    client = redis.Redis.from_url(redis_server.url)
    try:
        a, _ = put(s, "a", seed=1)
        s.offload.drain()
        remote = s.lower("redis")
        keys = s.manager.lookup(a).runs[0].keys
        rkey = s.transport("redis")._rkey(keys[0])
        value = bytearray(client.get(rkey))
        value[-1] ^= 0xFF
        client.set(rkey, bytes(value))
        s.cpu.delete(list(keys))
        remote.watch_removals()
        assert load(s, a) is None                     # never served
        assert remote.counters.integrity_failures >= 1 and not client.exists(rkey)   # deleted by the rank
        assert remote.take_removed() == [keys[0]]     # a KV event can say it left
        other = RedisIndex(redis_server.url)           # another namespace sees nothing
        other.attach([b"x" * 16])
        assert other.present(list(keys)) == 0
        other.close()
    finally:
        s.close()


def test_deployments_with_other_chunk_sizes_never_read_each_others_chunks(redis_server):
    """A chunk's key is its last block's hash: one prompt's 32-token chunk and its second 16-token chunk
    share one. Filed under a namespace that names the chunk size, each deployment keeps and loads its own
    (before, the second store was refused as present and the load deleted the other's chunk as foreign)."""
    big = Stack(num_blocks=64, cpu_chunks=2, chunk_tokens=2 * CHUNK,
                redis={"enabled": True, "url": redis_server.url, "retry_interval": 0.2, "timeout": 0.5})
    small = make(redis_server)
    try:
        a, a_kv = put(big, "a", seed=1)
        big.offload.drain()
        assert put(small, "a", seed=1)[1].equal(a_kv)                 # the same prompt, the same KV
        small.offload.drain()
        for s in (big, small):
            s.cpu.delete(list(s.manager.lookup(a).runs[0].keys))      # only Redis has them now
            assert torch.equal(load(s, a), a_kv)
            remote = s.lower("redis")
            assert remote.counters.integrity_failures == 0 and remote.counters.load_misses == 0
    finally:
        big.close()
        small.close()


def test_an_outage_is_a_run_of_misses_and_the_tier_recovers(redis_server):
    s = make(redis_server)
    try:
        a, a_kv = put(s, "a", seed=1)
        s.offload.drain()
        keys = s.manager.lookup(a).runs[0].keys
        redis_server.stop()
        s.cpu.delete(list(keys))
        assert lookup(s, a).num_hit_blocks == 0                  # down: a miss, not an exception
        b, _ = put(s, "b", seed=2)                               # stores still work (L1); none go to Redis
        s.offload.drain()
        remote, values = s.lower("redis"), s.transport("redis")
        assert remote.stats()["errors"] >= 1 and not remote.available and remote.counters.store_rejected == 2
        assert (remote.stats()["available"], remote.stats()["outages"]) == (0, 1)   # a gauge to alert on
        bufs = [memoryview(bytearray(1 << 20)) for _ in keys]
        assert values.read_chunks_into(list(zip(keys, bufs))) == [Failure.UNAVAILABLE] * len(keys)
        assert not values.available                              # the rank found it down too
        remote.complete_load(list(keys), {k: Failure.UNAVAILABLE for k in keys})   # a promotion that found it down
        assert remote.counters.load_misses == len(keys) and remote.counters.integrity_failures == 0
        redis_server.start()                                     # an empty server on the same port
        # a PING every retry_interval brings it back, on the scheduler's side and on the rank's alike
        eventually(lambda: remote.available and values.available, 5, "recovery")
        c, c_kv = put(s, "c", seed=3)
        s.offload.drain()
        assert remote.present(s.manager.lookup(c).runs[0].keys) == 2   # recovered without a restart
    finally:
        s.close()


def test_redis_config_errors_name_the_field():
    import pytest

    from tiercache.config import load_config
    from tiercache.errors import ConfigError
    with pytest.raises(ConfigError, match="redis.url"):
        load_config(env={}, overrides=["redis.url=http://example"])
    with pytest.raises(ConfigError, match="redis.ttl"):
        load_config(env={}, overrides=["redis.ttl=-1"])


def test_two_engines_share_prefixes_through_redis_and_survive_its_death(redis_server):
    from tests.conftest import engine_after_remote_outage
    from tests.support.engine_runs import offload

    cfg = offload(redis={"enabled": True, "url": redis_server.url, "retry_interval": 0.2, "timeout": 0.5})
    with engine_after_remote_outage(cfg, redis_server.stop):
        pass   # every check is the helper's: hits through Redis, then identical tokens with Redis gone


def test_bench_tiers_redis_reports_ratios_against_raw_pipelines(redis_server, tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "tiers", "--tiers", "redis", "--redis-url",
                           redis_server.url, "--shape", "small", "--total-mib", "8", "--reps", "2", "--quiet",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())["tiers"]["redis"]
    assert r["put_gbps"] > 0 and r["raw_put_gbps"] > 0 and r["get_ratio"] > 0
    assert r["put_ratio"] == round(r["put_ratio"], 3)


def test_a_three_node_cluster_serves_chunks_across_slots(redis_cluster):
    url = f"redis://127.0.0.1:{redis_cluster[0].port}/0"
    s = Stack(num_blocks=64, cpu_chunks=4,
              redis={"enabled": True, "url": url, "cluster": True, "timeout": 2.0, "ttl": 100})
    try:
        a, a_kv = put(s, "a", seed=1, chunks=3)
        s.offload.drain()
        remote, values = s.lower("redis"), s.transport("redis")
        keys = s.manager.lookup(a).runs[0].keys
        assert remote.present(keys) == 3
        nodes = [redis.Redis(port=n.port) for n in redis_cluster]
        per_node = [node.keys(b"tiercache:*") for node in nodes]
        assert sum(map(len, per_node)) == 3          # each chunk lives on exactly the node that owns its slot
        for node, rkeys in zip(nodes, per_node):
            for rkey in rkeys:
                node.expire(rkey, 5)                 # as if written long ago
        s.cpu.delete(list(keys))
        assert torch.equal(load(s, a), a_kv)
        assert remote.counters.loaded == 3
        assert all(node.ttl(rkey) > 90 for node, rkeys in zip(nodes, per_node) for rkey in rkeys)   # read: renewed
        node, rkey = next((n, k[0]) for n, k in zip(nodes, per_node) if k)
        value = bytearray(node.get(rkey))
        value[-1] ^= 0xFF
        node.set(rkey, bytes(value))                 # damaged on its node: a miss, counted and deleted
        bufs = [memoryview(bytearray(1 << 20)) for _ in keys]
        got = values.read_chunks_into(list(zip(keys, bufs)))
        assert got.count(Failure.CORRUPT) == 1
        remote.complete_load(list(keys), {k: n for k, n in zip(keys, got) if isinstance(n, Failure)})
        assert remote.counters.integrity_failures == 1
        values.delete_chunks(remote.take_deletes())     # what a rank does with the delete plan
        assert not node.exists(rkey)
    finally:
        s.close()


def test_a_unix_socket_url(tmp_path):
    import shutil

    import pytest

    from tests.conftest import RedisServer
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    sock = tmp_path / "redis.sock"
    server = RedisServer(tmp_path, extra=("--unixsocket", str(sock), "--unixsocketperm", "700"))
    try:
        s = Stack(num_blocks=64, cpu_chunks=2, redis={"enabled": True, "url": f"unix://{sock}"})
        try:
            a, a_kv = put(s, "a", seed=4)
            s.offload.drain()
            keys = s.manager.lookup(a).runs[0].keys
            s.cpu.delete(list(keys))
            assert torch.equal(load(s, a), a_kv)
        finally:
            s.close()
    finally:
        server.stop()


def test_a_tls_server_through_a_rediss_url(tmp_path):
    """rediss:// with the server's CA in the URL; a client that does not trust the certificate sees misses."""
    import shutil
    import subprocess

    import pytest

    from tests.conftest import RedisServer, free_port
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("redis-server or openssl is not installed (.ci/run installs redis-server)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    server = RedisServer(tmp_path, extra=("--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file",
                                          str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"))
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
        s = Stack(num_blocks=64, cpu_chunks=2, redis={"enabled": True, "url": url})
        try:
            a, a_kv = put(s, "a", seed=5)
            s.offload.drain()
            keys = s.manager.lookup(a).runs[0].keys
            s.cpu.delete(list(keys))
            assert torch.equal(load(s, a), a_kv)                     # over TLS and back, bit-exact
        finally:
            s.close()
        tier = RedisTransport(url, b"t" * 16)                        # values larger than the reply buffer
        try:
            chunks = [_chunk(b"t" * 16, i) for i in range(2)]
            bufs = [memoryview(bytearray(1 << 20)) for _ in chunks]
            assert tier.write_chunks(chunks) == ()
            assert tier.read_chunks_into([(m.key, b) for (m, _), b in zip(chunks, bufs)]) == [1 << 20] * 2
            assert all(bytes(b) == raw for b, (_, raw) in zip(bufs, chunks))
        finally:
            tier.close()
        untrusting = RedisIndex(f"rediss://127.0.0.1:{port}/0", lookup_timeout_s=1.0)
        untrusting.attach([b"x" * 16])
        # a miss, and counted: the first lookup's failure, and the connect made at attach if it ran first
        assert untrusting.present(list(keys)) == 0 and untrusting.stats()["errors"] >= 1
        untrusting.close()
    finally:
        server.stop()


def _chunk(ns: bytes, i: int, nbytes: int = 1 << 20):
    import hashlib

    from tiercache.contracts.keys import BlockHash
    from tiercache.wire.chunk_format import ChunkMeta
    key = BlockHash(hashlib.sha256(b"direct%d" % i).digest())
    raw = torch.arange(nbytes // 2, dtype=torch.float16).add_(i).numpy().tobytes()
    return ChunkMeta(ns, key, 256, "float16", (nbytes // 2,)), raw


def test_direct_reads_keep_the_stream_in_step_past_bad_values(redis_server):
    """Loads read values in GETRANGE pieces off the socket into the slots: one batch mixing good raw and lz4 values,
    a foreign namespace's value, a value shorter than a header and a key of the wrong type gives exactly
    the good chunks, bit-exact, and leaves the connection fit for the next pipeline."""
    from tiercache.wire.chunk_format import ChunkFormat
    ns = b"n" * 16
    tier = RedisTransport(redis_server.url, ns)
    lz4 = RedisTransport(redis_server.url, ns, ChunkFormat(codec="lz4"))
    foreign = RedisTransport(redis_server.url, b"f" * 16)
    client = redis.Redis.from_url(redis_server.url)
    try:
        chunks = [_chunk(ns, i) for i in range(6)]
        assert tier.write_chunks([chunks[0], chunks[5]]) == ()
        assert lz4.write_chunks([chunks[4]]) == ()
        meta1, raw1 = chunks[1]
        foreign.write_chunks([(type(meta1)(b"f" * 16, meta1.key, 256, "float16", meta1.shape), raw1)])
        client.set(tier._rkey(meta1.key), client.get(foreign._rkey(meta1.key)))   # right key, wrong namespace
        client.rpush(tier._rkey(chunks[2][0].key), b"not a chunk")                # WRONGTYPE on GET
        client.set(tier._rkey(chunks[3][0].key), b"short")
        bufs = [memoryview(bytearray(1 << 20)) for _ in chunks]

        def getranges() -> int:
            return int(client.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))

        from tiercache.tiers.resp import RANGE_PIECE, RANGE_WINDOW
        pieces = [-(-client.strlen(tier._rkey(m.key)) // RANGE_PIECE) for m, _ in chunks if m.key != chunks[2][0].key]
        for _ in range(2):                                    # twice: the pooled connection is still in step
            before = getranges()
            got = tier.read_chunks_into([(m.key, b) for (m, _), b in zip(chunks, bufs)])
            assert got == [1 << 20, Failure.CORRUPT, Failure.CORRUPT, Failure.CORRUPT, 1 << 20, 1 << 20]
            for i in (0, 4, 5):
                assert bytes(bufs[i]) == chunks[i][1]
            # the foreign value's pieces past those in flight when its header failed are never asked for
            assert getranges() - before == sum(pieces) - (pieces[1] - RANGE_WINDOW)
        assert tier.available and tier.errors == 0
    finally:
        for t in (tier, lz4, foreign):
            t.close()


def test_a_value_changed_between_its_ranges_is_a_miss_and_the_stream_stays_in_step(redis_server, monkeypatch):
    """A load asks each value's STRLEN, then reads it in GETRANGE pieces. Another client that deletes,
    shortens, retypes or rewrites a value in between turns that chunk into a miss; the chunk after them
    arrives bit-exact, and the pooled connection serves the next load. Only a value that failed its own
    checks is an integrity failure and deleted — at once, or on the next read that finds it bad — so
    `SET NX` can store the chunk again."""
    ns = b"c" * 16
    tier = RedisTransport(redis_server.url, ns)
    index = RedisIndex(redis_server.url)
    index.attach([ns])
    client = redis.Redis.from_url(redis_server.url)
    try:
        chunks = [_chunk(ns, 10 + i) for i in range(5)]
        assert tier.write_chunks(chunks) == ()
        rkeys = [tier._rkey(m.key) for m, _ in chunks]
        lengths_read = []
        channel = tier._channels()[0]          # the raw-socket channel of a standalone server
        strlen = channel._strlen

        def strlen_then_meddle(reader, key):
            n = strlen(reader, key)
            lengths_read.append(key)
            if len(lengths_read) == len(chunks):          # every length known, no range asked for yet
                client.delete(rkeys[0])
                client.set(rkeys[1], client.getrange(rkeys[1], 0, 1 << 19))          # shortened mid-piece
                client.delete(rkeys[2])
                client.rpush(rkeys[2], b"a list now")                                # WRONGTYPE per range
                value = bytearray(client.get(rkeys[3]))
                value[-1] ^= 0xFF
                client.set(rkeys[3], bytes(value))                                   # same length, other bytes
            return n

        monkeypatch.setattr(channel, "_strlen", strlen_then_meddle)
        bufs = [memoryview(bytearray(1 << 20)) for _ in chunks]
        keys = [m.key for m, _ in chunks]

        def load() -> list:      # as rank and scheduler do: read, complete with what failed, delete what was bad
            got = tier.read_chunks_into([(m.key, b) for (m, _), b in zip(chunks, bufs)])
            index.complete_load(keys, {k: n for k, n in zip(keys, got) if isinstance(n, Failure)})
            tier.delete_chunks(index.take_deletes())
            return [None if isinstance(n, Failure) else n for n in got]

        assert load() == [None] * 4 + [1 << 20]
        assert bytes(bufs[4]) == chunks[4][1]
        c = index.counters
        assert (c.load_misses, c.integrity_failures) == (3, 1)        # only the rewritten one failed its checksum
        assert [bool(client.exists(k)) for k in rkeys] == [False, True, True, False, True]
        monkeypatch.undo()
        assert load() == [None] * 4 + [1 << 20]                      # the short value and the list are bad now
        assert (c.load_misses, c.integrity_failures) == (5, 3)
        assert not any(client.exists(k) for k in rkeys[:4])
        assert tier.write_chunks(chunks[:4]) == ()
        for b in bufs:
            b[:] = bytes(len(b))
        assert load() == [1 << 20] * 5
        assert all(bytes(b) == raw for b, (_, raw) in zip(bufs, chunks))
        assert tier.available and tier.errors == 0
    finally:
        tier.close()
        index.close()


def test_reply_reader_parses_replies_split_anywhere_and_reports_a_cut_stream():
    import socket
    import threading

    import pytest

    from tiercache.tiers.resp import ProtocolError, ReplyError, ReplyReader
    a, b = socket.socketpair()
    stream = b"$5\r\nhello\r\n$-1\r\n_\r\n-WRONGTYPE nope\r\n$3\r\nab"
    sender = threading.Thread(target=lambda: [a.sendall(stream[i:i + 3]) for i in range(0, len(stream), 3)])
    sender.start()
    reader = ReplyReader(b, line_buffer_bytes=24)             # lines and values straddle refills
    dest = memoryview(bytearray(5))
    assert reader.bulk_length() == 5
    reader.read_into(dest)
    reader.end_of_bulk()
    assert bytes(dest) == b"hello"
    assert reader.bulk_length() is None and reader.bulk_length() is None
    with pytest.raises(ReplyError, match="WRONGTYPE"):
        reader.bulk_length()
    assert reader.bulk_length() == 3
    sender.join()
    a.close()                                                 # the server goes away mid-value
    with pytest.raises(ConnectionError):
        reader.read_into(memoryview(bytearray(3)))
    c, d = socket.socketpair()
    c.sendall(b"+OK\r\n")
    with pytest.raises(ProtocolError):
        ReplyReader(d).bulk_length()
    for s in (b, c, d):
        s.close()


def test_values_are_written_with_the_configured_ttl(redis_server):
    ns = b"t" * 16
    tier = RedisTransport(redis_server.url, ns, ttl_s=100)
    plain = RedisTransport(redis_server.url, ns)
    client = redis.Redis.from_url(redis_server.url)
    try:
        (meta, raw), (meta2, raw2) = _chunk(ns, 1), _chunk(ns, 2)
        assert tier.write_chunks([(meta, raw)]) == () and plain.write_chunks([(meta2, raw2)]) == ()
        assert 0 < client.ttl(tier._rkey(meta.key)) <= 100
        assert client.ttl(plain._rkey(meta2.key)) == -1           # no TTL: kept until maxmemory says
        buf = memoryview(bytearray(len(raw)))
        client.expire(tier._rkey(meta.key), 5)                      # as if written long ago
        assert tier.read_chunks_into([(meta.key, buf)]) == [len(raw)] and bytes(buf) == raw
        assert client.ttl(tier._rkey(meta.key)) > 90                # a read gives it a full TTL again
        assert plain.read_chunks_into([(meta2.key, buf)]) == [len(raw2)]
        assert client.ttl(plain._rkey(meta2.key)) == -1
    finally:
        tier.close()
        plain.close()


def test_a_chunk_already_there_is_kept_not_rewritten(redis_server):
    """Two replicas may store the same chunk with KV that differs in its last bits; the first copy stays
    (a rewrite could tear a ranged read on a third replica), and the second store is not a failure."""
    ns = b"n" * 16
    first, second = RedisTransport(redis_server.url, ns), RedisTransport(redis_server.url, ns, ttl_s=100)
    client = redis.Redis.from_url(redis_server.url)
    try:
        meta, raw = _chunk(ns, 1)
        other = bytes(b ^ 1 for b in raw[:64]) + raw[64:]
        assert first.write_chunks([(meta, raw)]) == ()
        before = client.get(first._rkey(meta.key))
        assert second.write_chunks([(meta, other)]) == ()
        assert client.get(first._rkey(meta.key)) == before and client.ttl(first._rkey(meta.key)) == -1
        buf = memoryview(bytearray(len(raw)))
        assert second.read_chunks_into([(meta.key, buf)]) == [len(raw)] and bytes(buf) == raw
    finally:
        first.close()
        second.close()


def test_a_set_the_server_refuses_fails_that_chunk_only(redis_server):
    ns = b"o" * 16
    tier = RedisTransport(redis_server.url, ns, admission="always")     # every chunk sent: Redis refuses some
    client = redis.Redis.from_url(redis_server.url)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used + (3 << 20)))     # room for about two more 1 MiB chunks
    try:
        items = [_chunk(ns, i) for i in range(6)]
        failed = dict(tier.write_chunks(items))
        assert 0 < len(failed) < 6 and set(failed.values()) == {Failure.IO}   # OOM replies, one per chunk
        assert tier.available and tier.errors == 0            # a refusal is not an outage
        stored = [(m, raw) for m, raw in items if m.key not in failed]
        bufs = [memoryview(bytearray(len(raw))) for _, raw in stored]
        assert tier.read_chunks_into([(m.key, b) for (m, _), b in zip(stored, bufs)]) == [1 << 20] * len(stored)
    finally:
        client.config_set("maxmemory", "0")
        tier.close()


def test_a_server_that_hangs_never_holds_the_scheduler_and_costs_a_rank_one_timeout():
    """A Redis that accepts connections and never answers (a hung process, a blackholed host). The
    scheduler's lookups answer at once — "ask again" while the one query is out on the lookup thread — and
    once it has waited out the short lookup timeout the tier answers misses without touching the network. A
    rank's first read waits out its own timeout, then its reads fail at once; only the outages' threads
    keep knocking."""
    import socket
    import time

    from tiercache.contracts.keys import BlockHash
    hole = socket.create_server(("127.0.0.1", 0), backlog=64)     # connects, never answers
    url = f"redis://127.0.0.1:{hole.getsockname()[1]}/0"
    index = RedisIndex(url, lookup_timeout_s=0.3, retry_interval_s=0.05)
    index.attach([b"h" * 16])
    values = RedisTransport(url, b"h" * 16, timeout_s=0.3, retry_interval_s=0.05)
    keys = [BlockHash(bytes([i]) * 32) for i in range(4)]
    try:
        t = time.monotonic()
        answers = []
        while not answers or answers[-1] is None:
            answers.append(index.contains(keys))
            time.sleep(0.001)
        assert answers[-1] == 0 and answers[0] is None
        assert all(time.perf_counter() >= 0 for _ in answers)
        assert 0.25 < time.monotonic() - t < 2.0                     # the answer took one lookup timeout...
        t = time.monotonic()
        assert values.read_chunks_into([(keys[0], memoryview(bytearray(8)))]) == [Failure.UNAVAILABLE]
        assert 0.25 < time.monotonic() - t < 2.0                     # ...and the rank's first read one timeout
        t = time.monotonic()
        for _ in range(50):
            assert index.contains(keys) == 0
            assert values.read_chunks_into([(keys[0], memoryview(bytearray(8)))]) == [Failure.UNAVAILABLE]
        assert time.monotonic() - t < 2.0       # 100 calls, no network (each call that asked would wait 0.3 s)
        eventually(lambda: index._outage.probes >= 2 and values._outage.probes >= 2, 5, "background probes")
        assert not index.available and index._outage.outages == 1
    finally:
        index.close()
        values.close()
        hole.close()


def test_a_slow_lookup_is_a_miss_and_only_lookups_that_keep_timing_out_take_the_tier_down(redis_server):
    """Redis stopped (SIGSTOP) answers nothing: a lookup past ``lookup_timeout`` is a miss (``lookups_slow``)
    and the tier stays up, as a loaded server may answer the next one in time. `SLOW_LOOKUPS_DOWN` in a row
    are a hung server: an outage, misses without asking, and a background PING that brings the tier back
    once Redis answers again (SIGCONT)."""
    import os
    import signal

    from tiercache.contracts.keys import BlockHash
    from tiercache.tiers.redis import redis_key
    from tiercache.tiers.remote_index import SLOW_LOOKUPS_DOWN

    ns, key = b"s" * 16, BlockHash(b"\x07" * 32)
    redis.Redis.from_url(redis_server.url).set(redis_key(ns, key), b"there")
    index = RedisIndex(redis_server.url, lookup_timeout_s=0.5, retry_interval_s=0.1)
    index.attach([ns])
    pid = redis_server.proc.pid
    try:
        assert index.present([key]) == 1
        os.kill(pid, signal.SIGSTOP)
        for _ in range(SLOW_LOOKUPS_DOWN - 1):
            assert index.present([key]) == 0
        assert index.available and index.stats()["lookups_slow"] == SLOW_LOOKUPS_DOWN - 1
        os.kill(pid, signal.SIGCONT)
        assert index.present([key]) == 1                  # answered in time: the run of slow ones is over
        os.kill(pid, signal.SIGSTOP)
        for _ in range(SLOW_LOOKUPS_DOWN - 1):
            assert index.present([key]) == 0
        assert index.available
        assert index.present([key]) == 0                  # the third in a row
        assert not index.available and index.stats()["outages"] == 1
        assert index.contains([key]) == 0                 # down: a miss at once, without asking
        os.kill(pid, signal.SIGCONT)
        eventually(lambda: index.available, 10, "the background probe bringing the tier back")
        assert index.present([key]) == 1
        assert index.stats()["lookups_slow"] == 2 * SLOW_LOOKUPS_DOWN - 1 and index.stats()["outages"] == 1
    finally:
        os.kill(pid, signal.SIGCONT)
        index.close()


def test_one_bad_value_costs_one_failed_load_not_a_retry_storm(redis_server):
    """A fresh engine asks for a prefix whose first chunk's value in Redis was damaged. The promotion fails
    once (an integrity failure, the value deleted); the index then answers "absent" for that chunk at once
    — it no longer re-plans the same promotion every step while a cached "present" lasts — and the engine
    recomputes, writes the chunk through again, and the next request hits it. Outputs never change."""
    from tests.support.engine_runs import offload, run_sequential, shared_prompts
    from tiercache.contracts.keys import chunk_keys
    from tiercache.engine import EngineConfig, LLMEngine

    cfg = offload(redis={"enabled": True, "url": redis_server.url, "retry_interval": 0.2, "timeout": 2.0})
    prompts = shared_prompts(n=3)
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
        expect = [s.output_token_ids for s in run_sequential(engine, prompts[:1])]
        hashes = engine.hasher.hash_blocks(prompts[0][:len(prompts[0]) // 16 * 16])
    stored = client.keys("tiercache:*")
    first = chunk_keys(hashes, 64 // 16)[0]      # the chain's first chunk: every later lookup asks for it
    (victim,) = [k for k in stored if k.endswith(first.hex().encode())]
    value = bytearray(client.get(victim))
    value[-1] ^= 0xFF
    client.set(victim, bytes(value))
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
        seqs = run_sequential(engine, prompts)
        assert [s.output_token_ids for s in seqs[:1]] == expect
        tier = engine.stats()["connector"]["tiers"]["redis"]
        assert tier["integrity_failures"] == 1 and tier["load_misses"] == 0     # one failed load in all
        assert seqs[0].metrics.external_hit_tokens == 0         # the prefix broke at its first chunk
        assert seqs[2].metrics.external_hit_tokens == 192       # written through again whole, and hit
    assert len(stored) >= 2
