"""The local data path: `tiercache serve --shm-dir` keeps its memory tier as chunk files that co-located
clients read and hand in themselves, with gRPC for everything else (a real server in a subprocess)."""

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")

from tests.conftest import CacheServerProcess, eventually  # noqa: E402
from tests.support.grpc_clients import NS, Client, chunks, raw_call  # noqa: E402
from tiercache.contracts.plan import Failure  # noqa: E402
from tiercache.wire import tiercache_pb2 as pb  # noqa: E402
from tiercache.wire.chunk_files import chunk_path  # noqa: E402
from tiercache.wire.chunk_format import HEADER_BYTES  # noqa: E402


def stats(server) -> pb.StatsReply:
    return pb.StatsReply.FromString(raw_call(server, "Stats", b""))


def read_all(tier, items):
    bufs = [memoryview(bytearray(len(raw))) for _, raw in items]
    got = tier.read_chunks_into([(m.key, b) for (m, _), b in zip(items, bufs)])
    return got, [bytes(b) for b in bufs]


def test_a_colocated_client_moves_chunks_as_files_and_grpc_clients_see_them(tmp_path):
    shm = tmp_path / "shm"
    server = CacheServerProcess(tmp_path, "--capacity", "8MiB", "--shm-dir", str(shm))
    local, remote = Client(server.address, NS), Client(server.address, NS, local="off")
    try:
        mine, theirs = chunks(3, seed=1), chunks(2, seed=2)
        assert local.write_chunks(mine) == ()
        assert remote.write_chunks(theirs) == ()                       # streamed Put: the server writes the files
        for meta, raw in mine + theirs:
            data = chunk_path(shm / NS.hex(), meta.key).read_bytes()   # in place, in the stored chunk format
            assert data[HEADER_BYTES:] == raw
        assert not list((shm / NS.hex() / "incoming").iterdir())      # every handed-in file was adopted
        keys = [m.key for m, _ in mine + theirs]
        assert local.contains(keys) == 5 and remote.contains(keys) == 5
        for tier in (local, remote):
            got, data = read_all(tier, mine + theirs)
            assert got == [len(raw) for _, raw in mine + theirs]
            assert data == [raw for _, raw in mine + theirs]
        s = stats(server)
        assert s.counters["local_get_hits"] == 5                       # the local reads were reported (Touch)
        assert s.counters["put_stored"] == 5 and s.tiers[0].chunks == 5
        assert local.write_chunks(mine[:1]) == () and stats(server).counters["put_present"] == 1
    finally:
        local.close()
        remote.close()
        server.stop()


def test_local_chunks_spill_to_disk_are_fetched_over_grpc_and_survive_a_restart(tmp_path):
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    server = CacheServerProcess(tmp_path, "--capacity", "300KiB", "--shm-dir", str(shm), "--disk", str(disk))
    tier = Client(server.address, NS, retry_interval_s=0.2)
    try:
        items = chunks(8)                                 # 8 x 64 KiB: 4 fit in the shared memory, 4 spill
        assert tier.write_chunks(items) == ()
        memory, on_disk = stats(server).tiers
        assert memory.used_bytes <= 300 << 10 and on_disk.chunks >= 4
        in_files = sum(chunk_path(shm / NS.hex(), m.key).exists() for m, _ in items)
        assert 0 < in_files <= 4
        got, data = read_all(tier, items)                 # files where they are, the rest through Get
        assert got == [len(raw) for _, raw in items] and data == [raw for _, raw in items]
        assert server.stop(graceful=True) == 0
        server.start()                                    # a new instance: the client asks again
        whole = [len(raw) for _, raw in items]
        eventually(lambda: read_all(tier, items)[0] == whole, 10, "reads from the new instance")
        got, data = read_all(tier, items)
        assert got == [len(raw) for _, raw in items] and data == [raw for _, raw in items]
    finally:
        tier.close()
        server.stop()


def test_damaged_files_and_bad_adopts_are_misses_and_clean_errors(tmp_path):
    shm = tmp_path / "shm"
    server = CacheServerProcess(tmp_path, "--capacity", "8MiB", "--shm-dir", str(shm))
    tier = Client(server.address, NS)
    try:
        items = chunks(2)
        assert tier.write_chunks(items) == ()
        path = chunk_path(shm / NS.hex(), items[0][0].key)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF                                  # payload damage: only the reader's checksum sees it
        path.write_bytes(bytes(data))
        got, _ = read_all(tier, items)
        assert got == [Failure.CORRUPT, 1 << 16]          # never served
        incoming = shm / NS.hex() / "incoming"
        (incoming / ("0" * 32 + ".tmp")).write_bytes(b"not a chunk")
        (incoming / ("1" * 32 + ".tmp")).write_bytes(path.read_bytes())   # a chunk under another key
        request = pb.AdoptRequest(namespace=NS, keys=[b"k" * 32, items[1][0].key],
                                  files=["0" * 32 + ".tmp", "1" * 32 + ".tmp"])
        reply = pb.PutReply.FromString(raw_call(server, "Adopt", request.SerializeToString()))
        assert list(reply.rejected) == [b"k" * 32, items[1][0].key] and reply.stored == 0
        assert not list(incoming.iterdir())               # rejected files are deleted
        assert "adopt_rejected" in server.log()
        for files in (["../../etc/passwd"], ["a.tmp"]):   # names outside the incoming directory's pattern
            with pytest.raises(grpc.RpcError) as err:
                raw_call(server, "Adopt", pb.AdoptRequest(namespace=NS, keys=[b"k" * 32], files=files)
                         .SerializeToString())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (shm / ".instance").write_text("another host's directory")
        blind = Client(server.address, NS)              # a client that does not see the server's directory
        got, data = read_all(blind, items[1:])
        assert got == [1 << 16] and data == [items[1][1]]  # over gRPC
        assert blind.transport._known_paths.local is None
        blind.close()
    finally:
        tier.close()
        server.stop()


def test_without_shm_dir_the_server_offers_no_local_path(cache_server):
    assert pb.LocalReply.FromString(raw_call(cache_server, "Local", b"")).directory == ""
    with pytest.raises(grpc.RpcError) as err:
        raw_call(cache_server, "Adopt", pb.AdoptRequest(namespace=NS, keys=[b"k" * 32], files=["0" * 32 + ".tmp"])
                 .SerializeToString())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    tier = Client(cache_server.address, NS)
    items = chunks(2)
    assert tier.write_chunks(items) == ()
    got, data = read_all(tier, items)
    assert got == [1 << 16] * 2 and tier.transport._known_paths.local is None
    tier.close()


def test_the_shared_memory_tier_is_rebuilt_from_its_files_and_trimmed_to_its_capacity(tmp_path):
    from tiercache.server.store import ChunkStore, PutOutcome, StoreConfig
    from tiercache.wire.chunk_format import ChunkFormat
    from tiercache.wire.grpc_messages import split_chunk
    shm = str(tmp_path / "shm")
    store = ChunkStore(StoreConfig(8 << 20, shm_path=shm))
    items = chunks(4)
    for meta, raw in items:
        header, payload = ChunkFormat().encode_parts(meta, raw)
        assert store.put(NS, meta.key, list(split_chunk(NS, meta.key, header, memoryview(payload)))) \
            is PutOutcome.STORED
    smaller = ChunkStore(StoreConfig(150 << 10, shm_path=shm))      # a restart with room for two of them
    assert smaller.memory.num_chunks == 2 and smaller.memory.used_bytes <= 150 << 10
    assert sum(smaller.contains(NS, [m.key]) for m, _ in items) == 2
    assert smaller.shm.instance != store.shm.instance                # a fresh token at every start


def test_the_shared_memory_directory_is_private_to_the_servers_user(tmp_path):
    import stat

    from tiercache.server.store import ChunkStore, StoreConfig
    shm = tmp_path / "shm"
    ChunkStore(StoreConfig(1 << 20, shm_path=str(shm)))
    assert stat.S_IMODE(shm.stat().st_mode) == 0o700
