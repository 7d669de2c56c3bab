"""How long a purge takes over about 1 GB spread across every tier: a server's memory and disk, Redis, a disk
tier's directory.

    python benchmarks/purge_time.py --repeats 3

Each repeat fills the tiers anew with chains of 1 MiB chunks (16 chunks a conversation, each chunk's parent in
its header, as engines write them): 256 MiB into a `tiercache serve --capacity 256MiB --disk DIR` (so half of
what it gets lies in memory and half spilled to its disk: 512 MiB sent), 256 MiB into a `redis-server`, 256 MiB
into a disk directory. Then two purges, timed as `tiercache purge` runs them (`tiercache.purging.purge`):
- by prompt: the first chunk of every fourth conversation (each with everything after it): a quarter goes;
- everything that is left.
Each purge's seconds, chunks and bytes per tier; medians over the repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiercache.bench.remote import RedisServer, Subprocess  # noqa: E402
from tiercache.contracts.keys import BlockHash  # noqa: E402
from tiercache.contracts.purge import PurgeOrder  # noqa: E402
from tiercache.purging import purge  # noqa: E402
from tiercache.tiers.disk import DiskTransport  # noqa: E402
from tiercache.tiers.grpc_client import GrpcTransport  # noqa: E402
from tiercache.tiers.redis import RedisTransport  # noqa: E402
from tiercache.wire.chunk_format import ChunkMeta  # noqa: E402

NS = bytes(range(16))
CHUNK = 1 << 20
PER_CONVERSATION = 16


def conversations(tier: str, nbytes: int):
    """Chains of chunks for one tier, ``nbytes`` in all: (first keys, [(meta, raw)])."""
    raw = bytes(range(256)) * (CHUNK // 256)
    firsts, items = [], []
    for c in range(nbytes // (CHUNK * PER_CONVERSATION)):
        parent = None
        for i in range(PER_CONVERSATION):
            key = BlockHash(f"{tier}-{c}-{i}".encode().ljust(32, b"."))
            items.append((ChunkMeta(NS, key, 16, "uint8", (CHUNK,), parent), raw))
            if parent is None:
                firsts.append(key)
            parent = key
    return firsts, items


def fill(transport, items) -> None:
    for i in range(0, len(items), 32):
        failed = transport.write_chunks(items[i:i + 32])
        if failed:
            raise RuntimeError(f"{transport.name}: {len(failed)} chunks not written: {failed[0]}")


def one_repeat(per_tier: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tiercache-purge-") as tmp:
        server = Subprocess("tiercache.cli", "serve", "--capacity", f"{per_tier}", "--disk", f"{tmp}/serve-disk",
                            "--disk-capacity", f"{4 * per_tier}")
        redis_server = RedisServer(4 * per_tier)
        try:
            grpc_tier = GrpcTransport(server.address, NS, timeout_s=30)
            redis_tier = RedisTransport(redis_server.url, NS, timeout_s=30)
            disk_tier = DiskTransport(f"{tmp}/l2", NS)
            firsts = []
            for name, transport, nbytes in (("grpc", grpc_tier, 2 * per_tier), ("redis", redis_tier, per_tier),
                                            ("disk", disk_tier, per_tier)):
                f, items = conversations(name, nbytes)
                fill(transport, items)
                firsts += f[::4]
            for t in (grpc_tier, redis_tier, disk_tier):
                t.close()
            where = {"server": server.address, "redis_url": redis_server.url, "disk_paths": (str(Path(tmp) / "l2"),)}
            out = {}
            for label, order in (("prompt", PurgeOrder(roots=tuple(firsts))),
                                 ("everything", PurgeOrder(everything=True))):
                started = time.perf_counter()
                result = purge(order, wait_s=0.1, **where)
                out[label] = {"seconds": time.perf_counter() - started, **result.as_dict()}
            return out
        finally:
            server.close()
            redis_server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-tier-mib", type=int, default=256, help="MiB per tier (the server gets twice)")
    parser.add_argument("--json", help="write every repeat here")
    args = parser.parse_args()
    runs = [one_repeat(args.per_tier_mib << 20) for _ in range(args.repeats)]
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print("| purge | chunks | GB | seconds (median) | GB/s | per tier (chunks) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for label in ("prompt", "everything"):
        secs = statistics.median(r[label]["seconds"] for r in runs)
        last = runs[-1][label]
        tiers = ", ".join(f"{name.split(':')[0]} {t['chunks']}" for name, t in last["tiers"].items())
        gb = last["bytes"] / 1e9
        print(f"| {label} | {last['chunks']} | {gb:.2f} | {secs:.3f} | {gb / secs:.1f} | {tiers} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
