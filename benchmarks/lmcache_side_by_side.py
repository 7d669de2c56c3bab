"""tiercache's gRPC tier and `tiercache serve` beside LMCache 0.5.6's `lm://` server, on the same chunks, in one run.

LMCache pins protobuf < 7 (tiercache's stubs need 7.35+), so it runs in its
own virtualenv; this script (tiercache's Python) starts LMCache's server and
`benchmarks/lmcache_lm_client.py` with that virtualenv's Python, then
`tiercache bench tiers --tiers grpc` on chunks of the same shape (llama-8b,
256 tokens, bf16, 32 MiB), in the order LMCache, tiercache, LMCache; medians.

    python -m venv --system-site-packages /tmp/lmcvenv
    /tmp/lmcvenv/bin/pip install --no-deps lmcache==0.5.6
    /tmp/lmcvenv/bin/pip install "protobuf<7,>=6.31.1" "numpy<=2.2.6" msgspec sortedcontainers py-cpuinfo aiofile
    python benchmarks/lmcache_side_by_side.py --lmcache-python /tmp/lmcvenv/bin/python --chunks 32 --reps 5
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
        proc = subprocess.run([python, str(HERE / "lmcache_lm_client.py"), "127.0.0.1", str(port), str(chunks),
                               str(reps)], capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"LMCache client failed:\n{proc.stderr[-3000:]}")
        return json.loads(line)
    finally:
        server.terminate()
        server.wait(timeout=30)


def tiercache_run(chunks: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "grpc.json"
        subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "tiers", "--tiers", "grpc", "--shape",
                        "llama-8b", "--total-mib", str(chunks * 32), "--reps", str(reps), "--quiet", "--json",
                        str(out)], check=True, timeout=1800)
        return json.loads(out.read_text())["tiers"]["grpc"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lmcache-python", required=True, help="Python of a virtualenv with lmcache==0.5.6")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    runs = [lmcache_run(args.lmcache_python, args.chunks, args.reps)]
    tc = tiercache_run(args.chunks, args.reps)
    runs.append(lmcache_run(args.lmcache_python, args.chunks, args.reps))
    nbytes = runs[0]["bytes"]
    lm_put = nbytes / statistics.median(runs[0]["put"] + runs[1]["put"]) / 1e9
    lm_get = nbytes / statistics.median(runs[0]["get"] + runs[1]["get"]) / 1e9
    report = {
        "chunk_bytes": runs[0]["chunk_bytes"], "chunks": args.chunks, "reps": args.reps,
        "lmcache_lm_put_gbps": round(lm_put, 3), "lmcache_lm_get_gbps": round(lm_get, 3),
        "tiercache_grpc_put_gbps": tc["put_gbps"], "tiercache_grpc_get_gbps": tc["get_gbps"],
        "put_vs_lmcache": round(tc["put_gbps"] / lm_put, 3), "get_vs_lmcache": round(tc["get_gbps"] / lm_get, 3),
        "tiercache_raw_grpc": {"put_gbps": tc["raw_put_gbps"], "get_gbps": tc["raw_get_gbps"]},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
