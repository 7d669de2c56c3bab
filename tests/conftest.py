"""Shared fixtures: small KV geometries and a ready offload stack on CPU."""
from __future__ import annotations

import pytest
import torch

from tiercache.build import build_offload_stack
from tiercache.config import TierCacheConfig
from tiercache.keys import BlockHasher, KVGeometry, Namespace
from tiercache.pool import BlockManager, BlockPool, PagedKVCache

SMALL = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
BLOCK = 4
CHUNK = 16  # 4 blocks a chunk


class Stack:
    """A paged pool, its block manager and an offload stack over it."""

    def __init__(self, num_blocks: int = 64, cpu_chunks: int = 8, geometry: KVGeometry = SMALL, **cfg) -> None:
        self.geometry = geometry
        self.kv = PagedKVCache(geometry, num_blocks, BLOCK, "cpu")
        self.pool = BlockPool(num_blocks)
        self.blocks = BlockManager(self.pool, BLOCK)
        chunk_bytes = (CHUNK // BLOCK) * self.kv.block_bytes
        config = TierCacheConfig().replace(
            keys={"block_size": BLOCK, "chunk_tokens": CHUNK},
            cpu={"capacity": cpu_chunks * chunk_bytes, "prefault": False},
            **cfg,
        )
        self.config = config
        self.namespace = Namespace("test-model", geometry, BLOCK)
        self.offload = build_offload_stack(config, self.kv, self.namespace)
        self.manager = self.offload.manager
        self.cpu = self.offload.tiers[0]
        self.hasher = BlockHasher(self.namespace)

    def fill(self, req: str, block_ids: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for b in block_ids:
            self.kv.kv[:, :, b].copy_(torch.randn(self.kv.kv[:, :, b].shape, generator=g))

    def close(self) -> None:
        self.offload.close()


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


class RedisServer:
    """A real redis-server on a free loopback port, stoppable and restartable on that same port."""

    def __init__(self, tmp) -> None:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tmp
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import subprocess
        import time

        import redis
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    import shutil
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    """Three redis-server nodes with cluster mode on, joined by redis-cli --cluster create."""
    import shutil
    import subprocess
    import time

    import redis
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not installed (.ci/run installs them)")
    nodes = []
    for i in range(3):
        node_dir = tmp_path / f"node{i}"
        node_dir.mkdir()
        server = RedisServer.__new__(RedisServer)
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            server.port = s.getsockname()[1]
        server.dir = node_dir
        server.proc = subprocess.Popen(
            ["redis-server", "--port", str(server.port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(node_dir / "nodes.conf"), "--save", "", "--appendonly", "no",
             "--dir", str(node_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        nodes.append(server)
    try:
        for n in nodes:
            client = redis.Redis(port=n.port, socket_connect_timeout=0.2)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        probe = redis.Redis(port=nodes[0].port)
        for _ in range(100):
            if probe.cluster("info").get("cluster_state") == "ok":
                break
            time.sleep(0.1)
        yield nodes
    finally:
        for n in nodes:
            n.stop()
