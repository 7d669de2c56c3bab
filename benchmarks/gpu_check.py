"""GPU check: CUDA gather/scatter kernels against the torch reference, and their D2H/H2D throughput
beside a plain pinned ``cudaMemcpy`` of the same bytes. Finishes in a few minutes on an H200.

    python benchmarks/gpu_check.py [--total-mib 1024] [--reps 5] [--json out.json]

Needs a CUDA device and cupy (``pip install -e '.[cuda]'``); prints why and exits 2 otherwise.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from tiercache.bench.tiers import BLOCK_SIZE, SHAPES
from tiercache.kernels import torch_ops

BPC = 16   # 256-token chunks


def timed(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def check_shape(name: str, total_bytes: int, reps: int) -> dict:
    from tiercache.kernels.cuda import CudaBlockCopier

    geo = SHAPES[name]
    dtype = getattr(torch, geo.dtype)
    row = BLOCK_SIZE * geo.num_kv_heads * geo.head_dim * torch.empty((), dtype=dtype).element_size()
    chunk_bytes = geo.num_layers * 2 * BPC * row
    chunks = max(2, total_bytes // chunk_bytes)
    blocks = chunks * BPC
    pool = torch.randn(geo.num_layers, 2, blocks, BLOCK_SIZE, geo.num_kv_heads, geo.head_dim,
                       device="cuda").to(dtype)
    ids = list(range(blocks))
    random.Random(0).shuffle(ids)
    per_chunk = [ids[c * BPC:(c + 1) * BPC] for c in range(chunks)]
    nbytes = chunks * chunk_bytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copier = CudaBlockCopier(pool.device)

    # Correctness: kernel gather == torch gather (on a CPU copy); kernel scatter restores the pool.
    copier.gather_chunks(pool, per_chunk, host)
    reference = torch.empty_like(host)
    torch_ops.gather_chunks(pool.cpu(), per_chunk, reference)
    gather_ok = torch.equal(host, reference)
    target = torch.zeros_like(pool)
    copier.scatter_chunks(target, per_chunk, host)
    scatter_ok = torch.equal(target, pool)

    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h_kernel = timed(lambda: copier.gather_chunks(pool, per_chunk, host), reps)
    d2h_memcpy = timed(lambda: host.copy_(flat, non_blocking=True), reps)
    h2d_kernel = timed(lambda: copier.scatter_chunks(pool, per_chunk, host), reps)
    h2d_memcpy = timed(lambda: flat.copy_(host, non_blocking=True), reps)
    gb = nbytes / 1e9
    return {
        "shape": name, "chunk_bytes": chunk_bytes, "chunks": chunks, "bytes": nbytes,
        "gather_matches_torch": gather_ok, "scatter_matches_torch": scatter_ok,
        "d2h_kernel_gbps": round(gb / d2h_kernel, 2), "d2h_memcpy_gbps": round(gb / d2h_memcpy, 2),
        "d2h_ratio": round(d2h_memcpy / d2h_kernel, 3),
        "h2d_kernel_gbps": round(gb / h2d_kernel, 2), "h2d_memcpy_gbps": round(gb / h2d_memcpy, 2),
        "h2d_ratio": round(h2d_memcpy / h2d_kernel, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("gpu_check: cupy is not installed (pip install -e '.[cuda]')", file=sys.stderr)
        return 2
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "results": [check_shape(s, args.total_mib << 20, args.reps) for s in ("llama-8b", "small")],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    ok = all(r["gather_matches_torch"] and r["scatter_matches_torch"] for r in report["results"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
