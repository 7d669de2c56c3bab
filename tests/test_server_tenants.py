"""Tenants of a real `tiercache serve`: each token's chunks in a store of its own, rights per token, grants to
read another tenant's chunks, quotas; over gRPC streams and the data channel."""
import subprocess
import sys

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.conftest import CacheServerProcess  # noqa: E402
from tests.support.grpc_clients import NS, Client, chunks, raw_call  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.chunk_format import ChunkFormat  # noqa: E402
from tiercache.wire.grpc_messages import AUTH_HEADER, split_chunk  # noqa: E402

TOKENS = {"acme": "acme-token-0123456789", "rival": "rival-token-0123456789", "public": "public-token-012345678",
          "reader": "reader-token-012345678"}


def tenants_file(tmp_path, quota: str = "") -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(f'''
[tenants.acme]
token = "{TOKENS["acme"]}"
reads_from = ["public"]
{quota}
[tenants.rival]
token = "{TOKENS["rival"]}"
[tenants.public]
token = "{TOKENS["public"]}"
[tenants.reader]
token = "{TOKENS["reader"]}"
write = false
delete = false
stats = false
''')
    return str(path)


@pytest.fixture
def tenant_server(tmp_path):
    server = CacheServerProcess(tmp_path, "--capacity", "16MiB", "--auth-token-file", tenants_file(tmp_path),
                                "--log-format", "text")
    yield server
    server.stop()


def as_(server, tenant: str, bulk: str = "auto") -> Client:
    return Client(server.address, NS, auth_token=TOKENS[tenant], bulk=bulk)


def metadata(tenant: str):
    return ((AUTH_HEADER, f"Bearer {TOKENS[tenant]}"),)


def read(client: Client, items) -> list:
    bufs = [memoryview(bytearray(len(raw))) for _, raw in items]
    got = client.read_chunks_into([(m.key, b) for (m, _), b in zip(items, bufs)])
    return [bytes(b) if isinstance(g, int) else g for g, b in zip(got, bufs)]


@pytest.mark.parametrize("bulk", ["auto", "off"])
def test_a_tenant_never_sees_reads_deletes_or_overwrites_another_tenants_chunks(tenant_server, bulk):
    acme, rival = as_(tenant_server, "acme", bulk), as_(tenant_server, "rival", bulk)
    try:
        mine = chunks(3, seed=1)
        keys = [m.key for m, _ in mine]
        assert acme.write_chunks(mine) == () and acme.contains(keys) == 3
        assert rival.contains(keys) == 0                                  # same namespace digest, other store
        assert all(not isinstance(g, bytes) for g in read(rival, mine))
        rival.delete(keys)
        assert acme.contains(keys) == 3
        # The rival plants chunks with a correct header and checksum under acme's namespace and keys: they land
        # in its own store, and acme goes on reading its own bytes.
        forged = [(m, bytes(len(raw))) for m, raw in mine]
        assert rival.write_chunks(forged) == ()
        assert read(acme, mine) == [raw for _, raw in mine]
        assert read(rival, mine) == [raw for _, raw in forged]
    finally:
        acme.close()
        rival.close()


def test_a_granted_tenant_reads_a_shared_prefix_but_cannot_delete_or_replace_it(tenant_server):
    public, acme, rival = (as_(tenant_server, t) for t in ("public", "acme", "rival"))
    try:
        prompt = chunks(2, seed=2)                   # a system prompt, published by its owner
        own = chunks(2, seed=3)                      # acme's turn after it
        assert public.write_chunks(prompt) == () and acme.write_chunks(own) == ()
        both = prompt + own
        assert acme.contains([m.key for m, _ in both]) == 4      # the prefix from public, the rest its own
        assert read(acme, prompt) == [raw for _, raw in prompt]
        assert rival.contains([m.key for m, _ in prompt]) == 0   # not granted
        acme.delete([m.key for m, _ in prompt])                  # deletes in its own store only
        assert public.contains([m.key for m, _ in prompt]) == 2
        assert read(acme, prompt) == [raw for _, raw in prompt]
    finally:
        for c in (public, acme, rival):
            c.close()


def test_rights_and_tokens_are_checked_on_every_call(tenant_server):
    item = chunks(1, seed=4)[0]
    header, payload = ChunkFormat().encode_parts(*item)
    put = list(split_chunk(NS, item[0].key, header, payload))
    contains = pb.ContainsRequest(namespace=NS, keys=[item[0].key]).SerializeToString()
    delete = pb.DeleteRequest(namespace=NS, keys=[item[0].key]).SerializeToString()
    for call, request in [("Put", put), ("Delete", delete), ("Stats", b"")]:
        with pytest.raises(grpc.RpcError) as err:
            raw_call(tenant_server, call, request, metadata("reader"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, call
    assert pb.ContainsReply.FromString(raw_call(tenant_server, "Contains", contains, metadata("reader"))).present == 0
    for call, request in [("Put", put), ("Delete", delete), ("Stats", b""), ("Contains", contains),
                          ("Get", pb.GetRequest(namespace=NS, keys=[item[0].key]).SerializeToString())]:
        with pytest.raises(grpc.RpcError) as err:
            raw_call(tenant_server, call, request, ((AUTH_HEADER, "Bearer not-a-token-of-anyone"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, call
    reader = as_(tenant_server, "reader")
    try:
        assert {why.value for _, why in reader.write_chunks([item])} <= {"io", "unavailable"}
    finally:
        reader.close()


def test_stats_show_a_tenant_only_its_own_chunks(tenant_server):
    acme, rival = as_(tenant_server, "acme"), as_(tenant_server, "rival")
    try:
        items = chunks(2, seed=5)
        assert acme.write_chunks(items) == ()
        read(acme, items)
        own = pb.StatsReply.FromString(raw_call(tenant_server, "Stats", b"", metadata("rival")))
        assert not own.hot_chunks and own.namespaces == 0 and not own.counters
        assert sum(t.chunks for t in own.tiers) == 0 and sum(t.used_bytes for t in own.tiers) == 0
        theirs = pb.StatsReply.FromString(raw_call(tenant_server, "Stats", b"", metadata("acme")))
        assert theirs.namespaces == 1 and len(theirs.hot_chunks) == 2 and sum(t.chunks for t in theirs.tiers) == 2
    finally:
        acme.close()
        rival.close()


def test_nothing_a_tenant_is_told_changes_with_what_another_tenant_does(tenant_server):
    """Whatever acme does — stores, reads, deletes, a call it has no right to — rival's Stats (tiers, counters,
    hot chunks, namespaces) stay as they were, its answers for acme's keys are those for keys nobody has, and
    the error it gets naming acme is the one it gets naming no tenant at all."""
    from google.protobuf.json_format import MessageToDict

    acme, rival = as_(tenant_server, "acme"), as_(tenant_server, "rival")

    def rival_sees() -> dict:
        return MessageToDict(pb.StatsReply.FromString(raw_call(tenant_server, "Stats", b"", metadata("rival"))))

    def refusal(tenant: str) -> str:
        request = pb.PurgeRequest(tenant=tenant, spec=pb.PurgeSpec(everything=True)).SerializeToString()
        with pytest.raises(grpc.RpcError) as err:
            raw_call(tenant_server, "Purge", request, metadata("rival"))
        return f"{err.value.code()}: {err.value.details()}".replace(repr(tenant), "TENANT")

    try:
        own = chunks(2, seed=11)
        assert rival.write_chunks(own) == () and read(rival, own) == [raw for _, raw in own]
        before = rival_sees()
        theirs, nobodys = chunks(4, seed=12), chunks(4, seed=13)
        assert acme.write_chunks(theirs) == ()
        for _ in range(3):
            assert read(acme, theirs) == [raw for _, raw in theirs]
        acme.delete([theirs[0][0].key])
        with pytest.raises(grpc.RpcError):        # acme has no purge right
            raw_call(tenant_server, "Purge", pb.PurgeRequest(spec=pb.PurgeSpec(everything=True)).SerializeToString(),
                     metadata("acme"))
        assert rival_sees() == before
        assert rival.contains([m.key for m, _ in theirs]) == rival.contains([m.key for m, _ in nobodys]) == 0
        assert [type(g) for g in read(rival, theirs)] == [type(g) for g in read(rival, nobodys)]
        assert refusal("acme") == refusal("no-such-tenant")
    finally:
        acme.close()
        rival.close()


def test_a_tenant_with_a_quota_churns_within_it_and_evicts_only_its_own_chunks(tmp_path):
    server = CacheServerProcess(tmp_path, "--capacity", "2MiB", "--auth-token-file",
                                tenants_file(tmp_path, quota='memory = "512KiB"'), "--log-format", "text")
    acme, rival = as_(server, "acme"), as_(server, "rival")
    try:
        kept = chunks(4, seed=6)                     # 4 × 64 KiB, within rival's share
        assert rival.write_chunks(kept) == ()
        for seed in range(10, 20):                  # acme churns through 40 chunks, 2.5 MiB
            acme.write_chunks(chunks(4, seed=seed))
        assert rival.contains([m.key for m, _ in kept]) == 4
        assert read(rival, kept) == [raw for _, raw in kept]
        stats = pb.StatsReply.FromString(raw_call(server, "Stats", b"", metadata("acme")))
        memory = next(t for t in stats.tiers if t.name == "memory")      # acme's own store
        assert memory.capacity_bytes == 512 << 10 and memory.used_bytes <= 512 << 10
        assert memory.counters["evicted"] > 0 and stats.counters      # its own store's counters too
    finally:
        acme.close()
        rival.close()
        server.stop()


@pytest.mark.parametrize("body,reason", [
    ('[tenants.a]\ntoken = "aaaaaaaaaaaaaaaaaaaa"\n[tenants.b]\ntoken = "aaaaaaaaaaaaaaaaaaaa"\n', "same token"),
    ('[tenants.a]\ntoken = "aaaaaaaaaaaaaaaaaaaa"\nreads_from = ["nobody"]\n', "reads_from"),
    ('[tenants.a]\ntoken = "short"\n', "too short"),
    ('[tenants.a]\ntoken = "aaaaaaaaaaaaaaaaaaaa"\nmemory = "1GiB"\n', "quotas"),
    ('[tenants.a]\ntoken = "aaaaaaaaaaaaaaaaaaaa"\nrights = "all"\n', "unknown field"),
])
def test_a_bad_tenants_file_is_one_line(tmp_path, body, reason):
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "serve", "--port", "0", "--capacity", "64MiB",
                           "--auth-token-file", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--auth-token-file" in proc.stderr and reason in proc.stderr and "Traceback" not in proc.stderr


def test_tenants_in_the_shared_pool_keep_apart_across_a_restart_from_disk(tmp_path):
    """Two tenants in the pool write the same namespace and keys with different bytes; the server spills to disk
    and restarts: each gets its own bytes back, checked against the namespace its chunks' headers name."""
    disk = tmp_path / "l2"
    server = CacheServerProcess(tmp_path, "--capacity", "128KiB", "--disk", str(disk), "--auth-token-file",
                                tenants_file(tmp_path), "--log-format", "text")
    try:
        acme, rival = as_(server, "acme", "off"), as_(server, "rival", "off")
        mine, theirs = chunks(3, seed=8), [(m, bytes(reversed(raw))) for m, raw in chunks(3, seed=8)]
        assert acme.write_chunks(mine) == () and rival.write_chunks(theirs) == ()
        acme.close()
        rival.close()
        assert server.stop(graceful=True) == 0
        server.start()
        acme, rival = as_(server, "acme", "off"), as_(server, "rival", "off")
        keys = [m.key for m, _ in mine]
        assert acme.contains(keys) == 3 and rival.contains(keys) == 3
        assert read(acme, mine) == [raw for _, raw in mine]
        assert read(rival, theirs) == [raw for _, raw in theirs]
        stats = pb.StatsReply.FromString(raw_call(server, "Stats", b"", metadata("acme")))
        on_disk = next(t for t in stats.tiers if t.name == "disk")
        assert stats.namespaces == 1 and on_disk.chunks == 3      # its own, known after the restart too
        acme.close()
        rival.close()
    finally:
        server.stop()


def test_the_metrics_endpoint_exports_each_tenant(tmp_path):
    import urllib.request

    from tests.conftest import free_port
    port = free_port()
    server = CacheServerProcess(tmp_path, "--capacity", "2MiB", "--metrics-port", str(port), "--auth-token-file",
                                tenants_file(tmp_path, quota='memory = "512KiB"'), "--log-format", "text")
    try:
        acme, rival = as_(server, "acme"), as_(server, "rival")
        assert acme.write_chunks(chunks(2, seed=30)) == () and rival.write_chunks(chunks(3, seed=31)) == ()
        acme.close()
        rival.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'tiercache_server_tenant_namespaces{tenant="acme"} 1.0' in body
        assert 'tiercache_server_tenant_namespaces{tenant="rival"} 1.0' in body
        assert 'tiercache_server_tenant_namespaces{tenant="public"} 0.0' in body
        assert 'tiercache_server_tenant_used_bytes{tenant="rival"} ' in body
        assert 'tiercache_tier_chunks{tier="acme/memory"} 2.0' in body
        assert 'tiercache_tier_chunks{tier="pool/memory"} 3.0' in body
    finally:
        server.stop()
