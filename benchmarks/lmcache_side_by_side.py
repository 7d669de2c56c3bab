"""tiercache's remote tiers beside LMCache 0.5.6's remote connectors, on the same chunks, in one run.

`tiercache serve` + the gRPC tier against LMCache's `lm://` server and
connector: bytes on the server's data channel (``grpc``), on gRPC streams
alone (``grpc-stream``), and through the co-located shared-memory path
(``grpc-shm``: `tiercache serve --shm-dir`); with ``--redis-port``, tiercache's Redis tier against LMCache's
`redis://` connector on the same redis-server.

LMCache pins protobuf < 7 (tiercache's stubs need 7.35+), so it runs in its
own virtualenv; this script (tiercache's Python) starts LMCache's server and
`benchmarks/lmcache_lm_client.py` with that virtualenv's Python, then
`tiercache bench tiers --tiers grpc` (then ``grpc-stream``, ``grpc-shm``) on
chunks of the same shape (llama-8b, 256 tokens, bf16, 32 MiB), in the order
LMCache, tiercache, LMCache; medians.

    python -m venv --system-site-packages /tmp/lmcvenv
    /tmp/lmcvenv/bin/pip install --no-deps lmcache==0.5.6
    /tmp/lmcvenv/bin/pip install "protobuf<7,>=6.31.1" "numpy<=2.2.6" msgspec sortedcontainers py-cpuinfo aiofile
    python benchmarks/lmcache_side_by_side.py --lmcache-python /tmp/lmcvenv/bin/python --chunks 32 --reps 5 \
        [--redis-port 6379]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lmcache_client(python: str, port: int, chunks: int, reps: int, kind: str) -> dict:
    proc = subprocess.run([python, str(HERE / "lmcache_lm_client.py"), "127.0.0.1", str(port), str(chunks),
                           str(reps), kind], capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"LMCache client failed:\n{proc.stderr[-3000:]}")
    return json.loads(line)


def lmcache_run(python: str, chunks: int, reps: int) -> dict:
    port = free_port()
    server = subprocess.Popen([python, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("LMCache's server did not start") from None
                time.sleep(0.2)
        return lmcache_client(python, port, chunks, reps, "lm")
    finally:
        server.terminate()
        server.wait(timeout=30)


def tiercache_run(tier: str, chunks: int, reps: int, *extra: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tiers.json"
        subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "tiers", "--tiers", tier, "--shape",
                        "llama-8b", "--total-mib", str(chunks * 32), "--reps", str(reps), "--quiet", "--json",
                        str(out), *extra], check=True, timeout=1800)
        return json.loads(out.read_text())["tiers"][tier]


def compare(name: str, lmcache: list[dict], tc: dict) -> dict:
    """Ratios to LMCache, and the same for the tier's raw baseline (its transport with nothing of ours:
    for ``grpc`` bare TCP on as many connections): the ceiling any client on that transport had."""
    nbytes = lmcache[0]["bytes"]
    put = nbytes / statistics.median([t for r in lmcache for t in r["put"]]) / 1e9
    get = nbytes / statistics.median([t for r in lmcache for t in r["get"]]) / 1e9
    return {f"lmcache_{name}_put_gbps": round(put, 3), f"lmcache_{name}_get_gbps": round(get, 3),
            "tiercache_put_gbps": tc["put_gbps"], "tiercache_get_gbps": tc["get_gbps"],
            "put_vs_lmcache": round(tc["put_gbps"] / put, 3), "get_vs_lmcache": round(tc["get_gbps"] / get, 3),
            "raw_put_vs_lmcache": round(tc["raw_put_gbps"] / put, 3),
            "raw_get_vs_lmcache": round(tc["raw_get_gbps"] / get, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lmcache-python", required=True, help="Python of a virtualenv with lmcache==0.5.6")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--redis-port", type=int, help="also compare the Redis tiers on this loopback redis-server")
    ap.add_argument("--skip-lm", action="store_true", help="compare only the Redis tiers")
    args = ap.parse_args()
    py, n, reps = args.lmcache_python, args.chunks, args.reps
    report: dict = {"chunks": n, "chunk_bytes": 32 << 20, "reps": reps}
    if not args.skip_lm:
        lm = [lmcache_run(py, n, reps)]
        ours = {kind: tiercache_run(kind, n, reps) for kind in ("grpc", "grpc-stream", "grpc-shm")}
        lm.append(lmcache_run(py, n, reps))
        for kind, tc in ours.items():
            report[f"{kind.replace('-', '_')}_vs_lm"] = compare("lm", lm, tc)
    if args.redis_port:
        lr = [lmcache_client(py, args.redis_port, n, reps, "redis")]
        tr = tiercache_run("redis", n, reps, "--redis-url", f"redis://127.0.0.1:{args.redis_port}/0")
        lr.append(lmcache_client(py, args.redis_port, n, reps, "redis"))
        report["redis_vs_redis"] = compare("redis", lr, tr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
