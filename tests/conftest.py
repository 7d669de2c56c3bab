"""Shared fixtures: small KV geometries and a ready offload stack on CPU."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tiercache.config import TierCacheConfig
from tiercache.connectors.reference import ReferenceConnector
from tiercache.contracts.keys import BlockHasher, KVGeometry, Namespace
from tiercache.pool import BlockManager, BlockPool, PagedKVCache

SMALL = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
BLOCK = 4
CHUNK = 16  # 4 blocks a chunk


class Stack:
    """A paged pool, its block manager and an offload stack over it: one scheduler side and one worker side
    per rank (``num_ranks`` simulated ranks, each holding its share of the KV heads), in this process."""

    def __init__(self, num_blocks: int = 64, cpu_chunks: int = 8, geometry: KVGeometry = SMALL,
                 chunk_tokens: int = CHUNK, num_ranks: int = 1, **cfg) -> None:
        self.geometry = geometry
        self.kv = PagedKVCache(geometry, num_blocks, BLOCK, "cpu", num_shards=num_ranks)
        self.pool = BlockPool(num_blocks)
        self.blocks = BlockManager(self.pool, BLOCK)
        chunk_bytes = (chunk_tokens // BLOCK) * self.kv.block_bytes
        cfg.setdefault("cpu", {})
        cfg["cpu"] = {"capacity": cpu_chunks * chunk_bytes, "prefault": False, **cfg["cpu"]}
        keys = {"block_size": BLOCK, "chunk_tokens": chunk_tokens, **cfg.pop("keys", {})}
        config = TierCacheConfig().replace(keys=keys, **cfg)
        self.config = config
        self.namespace = Namespace("test-model", geometry, BLOCK)
        self.offload = ReferenceConnector(config, self.namespace, self.kv)
        self.manager = self.offload.scheduler.manager
        self.cpu = self.manager.l1
        self.slab = self.offload.workers[0].stack.slab      # rank 0's L1 bytes
        self.hasher = BlockHasher(self.namespace)

    @property
    def pool_tensor(self) -> torch.Tensor:
        return self.kv.kv

    def transport(self, name: str, rank: int = 0):
        """Rank ``rank``'s transport of lower tier ``name`` (its files, its connections)."""
        return self.offload.workers[rank].stack.transports[name]

    def lower(self, name: str):
        """The scheduler's index of lower tier ``name``."""
        return self.manager.by_name[name]

    def run(self, plans):
        """Run plans on every rank, wait, apply: the jobs' outcomes."""
        return self.offload.run(plans if isinstance(plans, (list, tuple)) else [plans])

    def fill(self, req: str, block_ids: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for part in self.kv.parts:
            for b in block_ids:
                part[:, :, b].copy_(torch.randn(part[:, :, b].shape, generator=g))

    def close(self) -> None:
        self.offload.close()


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


def eventually(predicate, seconds: float = 10.0, what: str = "the condition") -> None:
    """Poll ``predicate`` until it holds (a tier coming back is noticed by a background probe)."""
    import time
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not hold within {seconds} s"
        time.sleep(0.05)


def wait_for_redis(port: int, proc, log_path, seconds: float = 10.0) -> None:
    """Ping until the server answers; fail fast (with its log) if it exits, or after ``seconds``."""
    import time

    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited: {log_path.read_text()[-500:]}")
        try:
            if client.ping():
                return
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer within {seconds}s")


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(cluster_bus: bool = False) -> int:
    """A free port on every interface, below the kernel's ephemeral range: bind(0) never hands those out, so
    the port stays free until the server it is meant for binds it, whatever else binds ports meanwhile (vLLM's
    own ZeroMQ and torch ports once took a port chosen from that range). With ``cluster_bus`` port + 10000
    is free too, and below the range as well."""
    import random
    import socket
    rng = random.Random()
    top = _ephemeral_low() - (10000 if cluster_bus else 0)
    for _ in range(500):
        port = rng.randrange(10000, top) if top > 11000 else 0     # no room below the range: any free port
        if cluster_bus and port == 0:
            port = rng.randrange(20000, 55000)
        try:
            with socket.socket() as s:
                s.bind(("", port))
                port = s.getsockname()[1]
                if cluster_bus:
                    with socket.socket() as bus:
                        bus.bind(("", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port below the ephemeral range")


class RedisServer:
    """A real redis-server on a free loopback port, stoppable and restartable on that same port."""

    def __init__(self, tmp, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.dir = tmp
        self.extra = extra
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import subprocess
        log = self.dir / f"redis-{self.port}.log"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--logfile", str(log), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_redis(self.port, self.proc, log)

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
    try:
        for i in range(3):
            node_dir = tmp_path / f"node{i}"
            node_dir.mkdir()
            nodes.append(RedisServer(node_dir, port=free_port(cluster_bus=True),
                                     extra=("--cluster-enabled", "yes", "--cluster-config-file",
                                            str(node_dir / "nodes.conf"))))
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        probes = [redis.Redis(port=n.port, socket_timeout=1.0) for n in nodes]
        deadline = time.monotonic() + 20
        while not all(p.cluster("info").get("cluster_state") == "ok" for p in probes):   # every node agrees
            if time.monotonic() > deadline:
                raise RuntimeError("the three-node cluster did not reach cluster_state:ok on every node")
            time.sleep(0.1)
        yield nodes
    finally:
        for n in nodes:
            n.stop()


class CacheServerProcess:
    """A real `tiercache serve` in a subprocess on a free loopback port, stoppable and restartable there."""

    def __init__(self, tmp, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = tmp
        self.flags = flags
        self.proc = None
        self.log_path = tmp / f"serve-{self.port}.log"
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        import subprocess
        import sys
        import time

        import grpc
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache.cli", "serve", "--port", str(self.port), "--grace", "1", *self.flags],
            stdout=subprocess.DEVNULL, stderr=open(self.log_path, "a"))
        channel = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(channel).result(timeout=20)
        except grpc.FutureTimeoutError:
            self.proc.kill()
            raise RuntimeError(f"tiercache serve did not start:\n{self.log_path.read_text()}") from None
        finally:
            channel.close()
        time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, graceful: bool = False) -> int:
        """SIGTERM and wait (graceful) or SIGKILL; returns the exit status."""
        if self.proc is None:
            return 0
        if graceful:
            self.proc.terminate()
        else:
            self.proc.kill()
        code = self.proc.wait(timeout=30)
        self.proc = None
        return code


@pytest.fixture
def cache_server(tmp_path):
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    server = CacheServerProcess(tmp_path, "--capacity", "64MiB")
    yield server
    server.stop()


TOKEN = "s3cret"


@pytest.fixture
def token_server(tmp_path):
    """`tiercache serve` that requires ``TOKEN`` on every call (read from ``tmp_path / "token"``)."""
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    (tmp_path / "token").write_text(TOKEN + "\n")
    server = CacheServerProcess(tmp_path, "--auth-token-file", str(tmp_path / "token"))
    yield server
    server.stop()


@contextmanager
def engine_after_remote_outage(offload_cfg, stop_server):
    """Engine 1 computes a shared prefix; engine 2 hits it through the remote tier; then the server dies
    (``stop_server``) and engine 2 must keep producing the tokens a cache-less engine produces. Yields engine 2."""
    from tests.support.engine_runs import run_sequential, shared_prompts
    from tiercache.engine import EngineConfig, LLMEngine

    prompts = shared_prompts(n=4)
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False)) as plain:
        expect = [s.output_token_ids for s in run_sequential(plain, prompts)]
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=offload_cfg) as one:
        assert [s.output_token_ids for s in run_sequential(one, prompts[:1])] == expect[:1]
    with LLMEngine(engine_cfg=EngineConfig(enable_prefix_caching=False), offload=offload_cfg) as two:
        seqs = run_sequential(two, prompts[1:2])
        assert seqs[0].output_token_ids == expect[1]
        assert seqs[0].metrics.external_hit_tokens == 192           # the first engine's prefix, via the remote tier
        stop_server()                                                # the server dies mid-run
        seqs = run_sequential(two, prompts[2:])
        assert [s.output_token_ids for s in seqs] == expect[2:]      # hits from L1, misses from the server
        yield two


# The project's shared trace (../shared/data), or the same trace committed gzip-compressed beside the tests, so
# that the acceptance points measured on it run wherever the repository is checked out.
SHARED_TRACE = next((p for p in (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl",
    Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz",
) if p.exists()), Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz")


@pytest.fixture(scope="session")
def shared_trace():
    """The shared Mooncake trace, loaded once (always present: a copy is committed under tests/data)."""
    from tiercache.bench.trace import load_trace
    return load_trace(SHARED_TRACE)
