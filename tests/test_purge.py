"""Purges (`tiercache purge`, the server's ``Purge``): a prompt and every chunk after it, a tenant, an age — out
of the server's memory and disk, disk directories, and the L1 and disk of engines that are running."""
import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace

import pytest

from tests.conftest import CacheServerProcess
from tiercache.contracts.keys import BlockHash, chunk_keys
from tiercache.contracts.purge import PurgeOrder, chain_closure
from tiercache.purging import REDIS_KEY
from tiercache.server.tiers import DiskChunks, MemoryChunks
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.support.grpc_clients import Client  # noqa: E402

NS = bytes(range(16))
TOKENS = {"acme": "acme-token-0123456789", "initech": "initech-token-0123456789", "ops": "ops-token-0123456789"}


def key(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(32, b"."))


def chain(names: str, parent: str | None = None, nbytes: int = 1 << 15):
    """Chunks named by the letters of ``names``, each the parent of the next (the first's: ``parent``)."""
    out, prev = [], parent
    for name in names:
        raw = bytes([ord(name)]) * nbytes
        out.append((ChunkMeta(NS, key(name), 16, "uint8", (nbytes,), key(prev) if prev else None, time.time()), raw))
        prev = name
    return out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # the test's clients poll for purges without an engine to apply them: a purge need not wait for them
    wait = ("--wait", "0.1") if args[0] == "purge" and "--server" in args and "--wait" not in args else ()
    return subprocess.run([sys.executable, "-m", "tiercache.cli", *args, *wait], capture_output=True, text=True,
                          timeout=120)


# -- the contract ---------------------------------------------------------------------------------------------
def test_a_chain_closure_takes_every_branch_after_a_root_and_nothing_before_it():
    links = [(b"b", b"a"), (b"c", b"b"), (b"d", b"c"), (b"x", b"b"), (b"y", b"x"), (b"q", b"p")]
    assert chain_closure([b"b"], links) == {b"b", b"c", b"d", b"x", b"y"}
    assert chain_closure([b"z"], links) == {b"z"}
    with pytest.raises(ValueError, match="names what goes"):
        PurgeOrder()


def test_a_late_purge_takes_only_what_was_stored_before_it_was_made():
    chosen = PurgeOrder(everything=True, issued_at=100.0).selector()
    assert chosen(b"k", 99.0) and chosen(b"k", 0.0) and not chosen(b"k", 101.0)   # 0: being written, taken


def test_a_pinned_or_reserved_chunk_is_unreadable_at_once_and_goes_when_let_go(tmp_path):
    memory = MemoryChunks(1 << 20)
    assert memory.add(b"read", b"x" * 100) and memory.add(b"idle", b"y" * 100)
    memory.pin([b"read"])
    keys, nbytes = memory.purge(lambda k, at: True)
    assert sorted(keys) == [b"idle", b"read"] and nbytes == 200
    assert not memory.has(b"read") and memory.contains([b"read"]) == 0 and b"read" in memory.entries
    memory.unpin([b"read"])
    assert memory.entries == {} and memory.used_bytes == 0

    disk = DiskChunks(tmp_path / "disk", 1 << 20)
    k = NS + key("w")
    assert disk.reserve(k, 100)                       # a write in flight
    disk.purge(lambda k, at: True)
    disk.path(k).parent.mkdir(parents=True, exist_ok=True)
    disk.path(k).write_bytes(b"z" * 100)
    disk.publish([k])                                 # lands after the purge: dropped, its file removed
    assert not disk.has(k) and not disk.path(k).exists() and disk.used_bytes == 0


# -- the server -------------------------------------------------------------------------------------------------
@pytest.fixture
def tenant_server(tmp_path):
    tenants = tmp_path / "tenants.toml"
    # acme: a store of its own, memory for a few chunks, so its chains run on from memory into its disk
    tenants.write_text(f'[tenants.acme]\ntoken = "{TOKENS["acme"]}"\npurge = true\nmemory = "160KiB"\n'
                       f'disk = "16MiB"\n'
                       f'[tenants.initech]\ntoken = "{TOKENS["initech"]}"\n'
                       f'[tenants.ops]\ntoken = "{TOKENS["ops"]}"\nadmin = true\npurge = true\n')
    for name, token in TOKENS.items():
        (tmp_path / f"{name}.token").write_text(token)
    from tests.conftest import free_port

    metrics = free_port()
    server = CacheServerProcess(tmp_path, "--capacity", "4MiB", "--disk", str(tmp_path / "serve-disk"),
                                "--disk-capacity", "64MiB", "--auth-token-file", str(tenants), "--log-format", "json",
                                "--metrics-port", str(metrics))
    server.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    yield server
    server.stop()


def _clients(server):
    return {name: Client(server.address, NS, auth_token=token) for name, token in TOKENS.items()}


def test_a_purge_by_prompt_takes_every_chunk_after_it_in_memory_and_on_disk_and_nothing_of_another_tenant(
        tenant_server, tmp_path):
    clients = _clients(tenant_server)
    try:
        main, branch, other = chain("abcdef"), chain("xy", parent="c"), chain("pq")
        for name in ("acme", "initech"):
            assert clients[name].write_chunks(main + branch + other) == ()
        out = run_cli("purge", "--server", tenant_server.address, "--auth-token-file", str(tmp_path / "acme.token"),
                      "--keys", key("c").hex())
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["chunks"] == 6 and set(report["tiers"]) == {"server/memory", "server/disk"}
        assert all(t["chunks"] for t in report["tiers"].values())       # the chains ran on into the disk
        acme, initech = clients["acme"], clients["initech"]
        assert acme.contains([key(n) for n in "abcdef"]) == 2
        assert all(acme.contains([key(n)]) == 0 for n in "cdefxy")
        assert acme.contains([key("p"), key("q")]) == 2
        assert initech.contains([key(n) for n in "abcdef"]) == 6 and initech.contains([key("x"), key("y")]) == 2
    finally:
        for c in clients.values():
            c.close()
    audit = [json.loads(line) for line in tenant_server.log().splitlines() if line.startswith("{")]
    purges = [e for e in audit if e.get("event") == "purge"]
    assert len(purges) == 1 and purges[0]["tenant"] == "acme" and purges[0]["selectors"]["roots"] == 1


def test_purges_need_their_right_and_bad_ones_are_one_clear_line(tenant_server, tmp_path):
    clients = _clients(tenant_server)
    try:
        for name in ("acme", "initech"):
            assert clients[name].write_chunks(chain("ab")) == ()
        server = ("--server", tenant_server.address)

        def purge_as(who: str, *args: str):
            return run_cli("purge", *server, "--auth-token-file", str(tmp_path / f"{who}.token"), *args)

        for who, args, words in (("initech", ("--everything",), "PERMISSION_DENIED: tenant 'initech' may not purge"),
                                 ("acme", ("--everything", "--tenant", "initech"), "that takes admin"),
                                 ("ops", ("--everything", "--tenant", "nobody"), "there is no tenant 'nobody'")):
            out = purge_as(who, *args)
            assert out.returncode == 1 and words in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
        out = run_cli("purge", *server, "--everything", "--namespace", "abc")
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--namespace" in out.stderr
        assert clients["initech"].contains([key("a"), key("b")]) == 2      # nothing was taken
        out = purge_as("ops", "--everything", "--tenant", "initech")         # an admin with the right
        assert out.returncode == 0 and json.loads(out.stdout)["chunks"] == 2, out.stderr
        assert clients["initech"].contains([key("a")]) == 0 and clients["acme"].contains([key("a"), key("b")]) == 2

        def stats_as(who: str) -> dict:
            got = run_cli("stats", *server, "--auth-token-file", str(tmp_path / f"{who}.token"))
            assert got.returncode == 0, got.stderr
            return json.loads(got.stdout)["counters"]
        assert stats_as("ops")["purges"] == 1 and stats_as("ops")["purged_chunks"] == 2
        assert "purges" not in stats_as("acme") and "purges" not in stats_as("initech")   # the server's, not theirs
        import urllib.request
        with urllib.request.urlopen(tenant_server.metrics_url, timeout=10) as reply:     # the operator's view
            scraped = reply.read().decode()
        assert 'tiercache_server_tenant_purges_total{tenant="initech"} 1.0' in scraped
        assert 'tiercache_server_tenant_purged_chunks_total{tenant="initech"} 2.0' in scraped
        assert 'tiercache_server_tenant_purges_total{tenant="acme"} 0.0' in scraped
        assert 'tiercache_audit_events_total{event="purge",tenant="initech"} 1.0' in scraped
        assert 'tiercache_audit_chunks_total{event="purge",tenant="initech"} 2.0' in scraped
        per_tier = [line for line in scraped.splitlines() if line.startswith('tiercache_tier_purged_total{tier="pool/')]
        assert sum(float(line.split()[-1]) for line in per_tier) == 2
    finally:
        for c in clients.values():
            c.close()


def test_a_purge_by_age_takes_what_is_older_and_keeps_what_is_newer(tenant_server, tmp_path):
    from tiercache.purging import purge

    clients = _clients(tenant_server)
    try:
        acme = clients["acme"]
        assert acme.write_chunks(chain("ab")) == ()
        time.sleep(0.5)
        between = time.time()
        time.sleep(0.5)
        assert acme.write_chunks(chain("pq")) == ()
        # in this process: the age is measured from now, not from when a CLI process has started
        report = purge(PurgeOrder(stored_before=between), tenant_server.address, TOKENS["acme"], wait_s=0.1)
        assert report.as_dict()["chunks"] == 2
        assert acme.contains([key("a")]) == 0 and acme.contains([key("p"), key("q")]) == 2
    finally:
        for c in clients.values():
            c.close()


def test_a_purge_racing_writes_of_the_same_chain_leaves_nothing_written_before_it(tmp_path):
    """Writers keep storing one chain while a purge of it runs: whatever the server holds afterwards was
    written after the purge was made (its file times say so), never a chunk that was there before it."""
    shm = tmp_path / "serve-memory"
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB", "--shm-dir", str(shm))
    writers = [Client(server.address, NS, local="off") for _ in range(3)]   # the server writes every file
    stop = threading.Event()

    def write(client: Client, seed: int) -> None:
        while not stop.is_set():
            client.write_chunks(chain("abcdefgh"[seed:] + "abcdefgh"[:seed]))
            client.delete([key(n) for n in "abcdefgh"])

    threads = [threading.Thread(target=write, args=(c, i)) for i, c in enumerate(writers)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.3)
        from tiercache.purging import purge
        made = time.time()
        purge(PurgeOrder(everything=True), server.address, wait_s=0.1)
        stop.set()
        for t in threads:
            t.join()
        left = [f for f in shm.rglob("*.chunk") if f.parent.name != "incoming"]
        assert all(f.stat().st_mtime >= made for f in left), [(f.name, made - f.stat().st_mtime) for f in left]
    finally:
        stop.set()
        for c in writers:
            c.close()
        server.stop()


# -- engines under the server -------------------------------------------------------------------------------------
def test_two_running_engines_apply_a_purge_to_their_own_tiers_and_their_next_request_is_cold(tmp_path):
    """Two reference engines share a prefix through `tiercache serve` and keep it in their own L1 and disk;
    a purge of it reaches all of that while they run, and their next request for it computes it again."""
    from tests.support.engine_runs import offload, run_sequential, shared_prompts
    from tiercache.engine import EngineConfig, LLMEngine
    from tiercache.purging import purge

    shm = tmp_path / "serve-memory"
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB", "--shm-dir", str(shm),
                                "--audit-log", str(tmp_path / "serve.audit"))
    engines_audit = tmp_path / "engines.audit"         # one file for both engines: whole lines, never torn

    def config(i: int):
        return offload(grpc={"enabled": True, "address": server.address},
                       disk={"enabled": True, "path": str(tmp_path / f"disk{i}"), "write_mode": "write-through"},
                       audit={"log_file": str(engines_audit), "tenant": f"engine{i}"})

    prompts = shared_prompts(n=4, suffix=80)     # three chunks shared, a fourth each prompt's own
    cfg = EngineConfig(enable_prefix_caching=False)
    try:
        with LLMEngine(engine_cfg=cfg) as plain:
            expect = [s.output_token_ids for s in run_sequential(plain, prompts)]
        with LLMEngine(engine_cfg=cfg, offload=config(1)) as one, LLMEngine(engine_cfg=cfg, offload=config(2)) as two:
            first = run_sequential(one, prompts[:1])[0]
            second = run_sequential(two, prompts[1:2])[0]
            assert second.metrics.external_hit_tokens == 192          # the shared chunks, from the server
            engines = (one, two)
            for e in engines:                      # the copies down to disk land
                for _ in range(3):
                    e.step()
            shared = chunk_keys(first.block_hashes, 4)[:3]
            # the shared prefix and every chunk after it: in both engines' L1 and disks, and the server
            purged = {*shared, chunk_keys(first.block_hashes, 4)[3], chunk_keys(second.block_hashes, 4)[3]}
            managers = [e.connector.scheduler.manager for e in engines]
            for m in managers:
                assert all(purged & set(t.held_keys()) for t in (m.l1, m.by_name["disk"]))

            def files() -> set[str]:                 # the chunk files of both engines' disks and the server
                return {f.stem for d in ("disk1", "disk2", "serve-memory") for f in (tmp_path / d).rglob("*.chunk")}
            names = {k.hex() for k in purged}
            assert names <= files()

            result = {}
            purging = threading.Thread(target=lambda: result.update(r=purge(PurgeOrder(roots=shared[:1]),
                                                                              server.address, wait_s=20)))
            purging.start()
            while purging.is_alive():              # the engines keep stepping, idle
                for e in engines:
                    e.step()
            report = result["r"]
            assert (report.engines_applied, report.engines_pending) == (2, 0), asdict(report)
            for m in managers:
                for tier in (m.l1, m.by_name["disk"]):
                    assert not purged & set(tier.entries), tier.name
            for e in engines:                      # the disk deletes run
                for _ in range(3):
                    e.step()
            assert not names & files()
            # the next request of each, asked of every tier before either computes anything: cold, and right
            from tiercache.engine import SamplingParams
            seqs = [e.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
                    for e, p in ((one, prompts[2]), (two, prompts[3]))]
            while any(e.has_unfinished() for e in engines):
                for e in engines:
                    e.step()
            assert [s.metrics.external_hit_tokens for s in seqs] == [0, 0]
            assert [s.output_token_ids for s in seqs] == expect[2:]
    finally:
        server.stop()
    # audited: the server's purge, and each engine's application of it with what it took from its own tiers
    served = [json.loads(line) for line in (tmp_path / "serve.audit").read_text().splitlines()]
    assert [(e["event"], e["tenant"], e["chunks"]) for e in served] == [("purge", "default", report.report.chunks)]
    applied = [json.loads(line) for line in engines_audit.read_text().splitlines()]
    assert sorted(e["tenant"] for e in applied if e["event"] == "purge_applied") == ["engine1", "engine2"]
    assert all(e["chunks"] >= 4 and e["tiers"]["cpu"][0] and e["tiers"]["disk"][0] for e in applied)


# -- a prompt, as its engine hashed it, out of a disk directory ------------------------------------------------------
def test_a_prompt_is_hashed_as_its_replica_does_and_purged_from_a_disk_directory_temp_files_too(tmp_path):
    from tests.support.engine_runs import offload, run_sequential
    from tiercache.engine import EngineConfig, LLMEngine
    from tiercache.engine.openai_api import descriptor_for
    from tiercache.fleet.descriptor import EventEndpoints

    disk = tmp_path / "disk"
    system = "You are a careful assistant. " * 8
    mine, other = system + "My account number is 1234-5678.", "Quite another conversation, " * 9
    cfg = offload(disk={"enabled": True, "path": str(disk), "write_mode": "write-through"})
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=cfg) as engine:
        seqs = run_sequential(engine, [mine, other])
        for _ in range(3):
            engine.step()
        descriptor = descriptor_for(engine, "tiny", "bytes", EventEndpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"))
    (tmp_path / "replica.json").write_text(json.dumps(descriptor.as_dict()))
    mine_keys, other_keys = (chunk_keys(s.block_hashes, 4) for s in seqs)
    kept = len(system) // 64                          # chunks wholly inside the system prompt
    files = {f.stem: f for f in disk.rglob("*.chunk")}
    assert {k.hex() for k in mine_keys + other_keys} <= set(files)
    half_written = files[mine_keys[-1].hex()].with_name(mine_keys[-1].hex() + ".chunk.tmp")
    half_written.write_bytes(b"TCKV half")            # a writer died mid-chunk: KV all the same
    replica = ("--replica", str(tmp_path / "replica.json"))

    out = run_cli("purge", "--disk-path", str(disk), "--prompt", mine, *replica, "--model", "another")
    assert out.returncode == 2 and "a prompt for another model" in out.stderr and out.stderr.count("\n") == 1
    out = run_cli("purge", "--disk-path", str(disk), "--prompt", mine, *replica, "--keep-first", str(len(system)))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["chunks"] == len(mine_keys) - kept + 1      # and the temp file
    left = {f.name for f in disk.rglob("*.chunk*")}
    assert {f"{k.hex()}.chunk" for k in mine_keys[:kept] + other_keys} <= left       # the system prompt stays
    assert not {f"{k.hex()}.chunk" for k in mine_keys[kept:]} & left and not half_written.exists()


def test_a_purge_reaches_redis_values_by_their_headers(redis_server, tmp_path):
    import redis

    from tiercache.tiers.redis import RedisTransport, redis_key

    tier = RedisTransport(redis_server.url, NS)
    try:
        assert tier.write_chunks(chain("abcdef") + chain("xy", parent="c") + chain("pq")) == ()
    finally:
        tier.close()
    out = run_cli("purge", "--redis", redis_server.url, "--keys", key("c").hex())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tiers"]["redis"]["chunks"] == 6
    left = {k for k in redis.Redis.from_url(redis_server.url).keys("tiercache:*") if REDIS_KEY.fullmatch(k)}
    assert left == {redis_key(NS, key(n)) for n in "abpq"}                 # the keyspace holds nothing of it
    tier = RedisTransport(redis_server.url, NS)
    try:                                                       # stored two minutes ago, as their headers say
        assert tier.write_chunks([(replace(m, stored_at=time.time() - 120), raw) for m, raw in chain("uv")]) == ()
    finally:
        tier.close()
    out = run_cli("purge", "--redis", redis_server.url, "--older-than", "60")
    assert out.returncode == 0 and json.loads(out.stdout)["tiers"]["redis"]["chunks"] == 2, out.stderr
    left = {k for k in redis.Redis.from_url(redis_server.url).keys("tiercache:*") if REDIS_KEY.fullmatch(k)}
    assert left == {redis_key(NS, key(n)) for n in "abpq"}
    out = run_cli("purge", "--redis", "redis://127.0.0.1:1", "--everything")
    assert out.returncode == 1 and "purge refused by redis://127.0.0.1:1" in out.stderr


def test_an_engine_reading_redis_applies_a_purge_announced_there_before_its_values_go(redis_server, tmp_path):
    import redis

    from tests.support.engine_runs import offload, run_sequential, shared_prompts
    from tiercache.engine import EngineConfig, LLMEngine
    from tiercache.purging import purge

    prompts = shared_prompts(n=2, suffix=80)
    cfg = EngineConfig(enable_prefix_caching=False)
    with LLMEngine(engine_cfg=cfg) as plain:
        expect = [s.output_token_ids for s in run_sequential(plain, prompts)]
    tiers = offload(redis={"enabled": True, "url": redis_server.url},
                    disk={"enabled": True, "path": str(tmp_path / "disk"), "write_mode": "write-through"})
    with LLMEngine(engine_cfg=cfg, offload=tiers) as engine:
        first = run_sequential(engine, prompts[:1])[0]
        for _ in range(3):
            engine.step()
        keys = chunk_keys(first.block_hashes, 4)
        manager = engine.connector.scheduler.manager
        assert set(keys) <= set(manager.l1.held_keys()) and manager.by_name["redis"].present(keys) == len(keys)
        result = {}
        purging = threading.Thread(target=lambda: result.update(r=purge(PurgeOrder(roots=keys[:1]),
                                                                          redis_url=redis_server.url, wait_s=20)))
        purging.start()
        while purging.is_alive():
            engine.step()
        report = result["r"]
        assert (report.engines_applied, report.engines_pending) == (1, 0) and report.report.tiers["redis"][0] == 4
        assert not set(keys) & {k for t in (manager.l1, manager.by_name["disk"]) for k in t.entries}
        assert not [k for k in redis.Redis.from_url(redis_server.url).keys("tiercache:*") if REDIS_KEY.fullmatch(k)]
        seq = run_sequential(engine, prompts[1:])[0]
        assert seq.metrics.external_hit_tokens == 0 and seq.output_token_ids == expect[1]


# -- transfers on their way when an engine applies a purge ------------------------------------------------------------
def test_a_store_or_a_copy_down_on_its_way_when_a_purge_is_applied_lands_nowhere(redis_server):
    import redis

    from tests.conftest import CHUNK, Stack

    s = Stack(redis={"enabled": True, "url": redis_server.url})          # L1 and Redis, written through
    values = redis.Redis.from_url(redis_server.url)
    try:
        def compute(req: str, seed: int):
            hashes = s.hasher.hash_blocks([seed * 1000 + t for t in range(2 * CHUNK)])
            s.blocks.allocate(req, 2 * CHUNK)
            ids = s.blocks.block_ids(req)
            s.fill(req, ids, seed)
            return hashes, ids

        hashes, ids = compute("r1", 1)
        store = s.manager.plan_store(hashes, ids)               # L0 → L1, on its way
        s.manager.purge(PurgeOrder(everything=True))
        s.run(store)
        s.offload.drain()
        assert s.cpu.num_chunks == 0 and not [k for k in values.keys("tiercache:*") if REDIS_KEY.fullmatch(k)]

        hashes, ids = compute("r2", 2)
        s.run(s.manager.plan_store(hashes, ids))                 # in L1; its copies to Redis planned
        copies = s.manager.take_background()
        assert copies and s.cpu.num_chunks == 2
        s.manager.purge(PurgeOrder(everything=True))             # while the copies are on their way
        s.run(copies)
        s.offload.drain()                                        # the deletes of what landed meanwhile
        assert s.cpu.num_chunks == 0
        assert not [k for k in values.keys("tiercache:*") if REDIS_KEY.fullmatch(k)]
    finally:
        s.close()


def test_a_chunk_purged_while_the_server_reads_it_from_disk_is_neither_served_nor_promoted(tmp_path):
    from tiercache.server.store import ChunkStore, StoreConfig

    items = chain("ab")
    size = len(ChunkFormat().encode(*items[0]))
    store = ChunkStore(StoreConfig(size, disk_path=str(tmp_path / "disk"), disk_capacity=1 << 20))
    for meta, raw in items:                                   # b pushes a out of memory, onto the disk
        assert store.put(NS, meta.key, ChunkFormat().encode(meta, raw)).value == "stored"
    assert store.disk.has(NS + key("a"))
    read = store._read_file

    def read_then_purged(*args):                              # the purge comes while the file is read
        value = read(*args)
        purging = threading.Thread(target=store.purge, args=(PurgeOrder(everything=True),))
        purging.start()
        purging.join()                                        # the store's lock is free while a file is read
        return value
    store._read_file = read_then_purged
    assert store.get_value(NS, key("a")) is None
    assert not store.memory.entries and not store.disk.entries


def test_purges_are_numbered_per_tenant_and_an_engine_sees_only_its_own_and_its_grants():
    """A tenant learns nothing of another's purges — not even how many there were."""
    from tiercache.server.purge_log import PurgeLog

    log = PurgeLog(keep=2)
    for _ in range(3):
        log.append("acme", PurgeOrder(everything=True))
    assert log.append("initech", PurgeOrder(everything=True)) == 1
    found, lost, latest = log.poll("initech", "w1", ("initech",), (), {}, "")
    assert [(p.tenant, p.seq) for p in found] == [("initech", 1)] and latest == {"initech": 1} and not lost
    assert log.pending("initech", 1) == (0, 1)                       # w1 has it, not yet applied
    log.poll("initech", "w1", ("initech",), (), {"initech": 1}, log.instance)
    assert log.pending("initech", 1) == (1, 0)
    found, lost, latest = log.poll("beta", "w2", ("beta", "acme"), (), {"acme": 0}, log.instance)   # granted acme
    assert lost and [(p.tenant, p.seq) for p in found] == [("acme", 2), ("acme", 3)] and latest == {"acme": 3}


def test_an_idle_tiercache_api_applies_a_purge_of_a_prompt_named_by_its_text(tmp_path):
    """`tiercache purge --prompt TEXT --replica URL` hashes the text as the running `tiercache api` does (its
    descriptor, over HTTP), and the replica — idle — applies the purge before the call returns."""
    openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install 'tiercache[dev]')")
    pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'tiercache[fleet]')")
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB")
    api = subprocess.Popen([sys.executable, "-m", "tiercache.cli", "api", "--port", "0", "--tiers", "cpu,grpc",
                            "--grpc-address", server.address, "--kv-events", "--kv-events-port", "0",
                            "--kv-events-replay-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prompt = "A conversation that must be forgotten, said at length so that it fills whole chunks. " * 12
    try:
        line = api.stdout.readline()
        assert line.startswith("tiercache api:"), line + api.stderr.read()
        base = line.split(" on ")[1].strip()
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        client.completions.create(model="tiercache-reference", prompt=prompt, max_tokens=4, temperature=0)
        out = run_cli("purge", "--server", server.address, "--prompt", prompt, "--replica", base.removesuffix("/v1"),
                      "--model", "tiercache-reference", "--wait", "20")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["tiers"]["server/memory"]["chunks"] >= 1 and report["engines"] == {"applied": 1, "pending": 0}
        stats = json.loads(run_cli("stats", "--server", server.address).stdout)
        assert sum(t["chunks"] for t in stats["tiers"]) == 0
    finally:
        api.terminate()
        api.wait(30)
        server.stop()
