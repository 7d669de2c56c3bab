"""Does lz4 (or byte-plane shuffle + lz4) pay for itself on KV-like data?

    python benchmarks/codec_bench.py [--mib 32] [--reps 5]

Encodes and decodes one chunk-sized buffer of Gaussian values (how K and V
activations are distributed) in bf16 and fp32 with each codec, and reports the
size ratio and throughput beside a plain copy of the same bytes.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiercache.codecs import codecs
from tiercache.wire.chunk_format import ChunkFormat, ChunkMeta, decode


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    print(f"{'dtype':<9} {'codec':<12} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'copy GB/s':>9}")
    for dtype in ("bfloat16", "float32"):
        t = torch.randn((args.mib << 20) // (2 if dtype == "bfloat16" else 4)).to(getattr(torch, dtype))
        raw = t.view(torch.uint8).numpy().tobytes()
        meta = ChunkMeta(b"n" * 16, b"k" * 32, 256, dtype, tuple(t.shape))
        for name in codecs.names():
            fmt = ChunkFormat(name)
            enc, dec, cp = [], [], []
            for _ in range(args.reps):
                s = time.perf_counter()
                blob = fmt.encode(meta, raw)
                enc.append(time.perf_counter() - s)
                s = time.perf_counter()
                decode(blob)
                dec.append(time.perf_counter() - s)
                s = time.perf_counter()
                bytearray(raw)
                cp.append(time.perf_counter() - s)
            n = len(raw)
            print(f"{dtype:<9} {name:<12} {n / len(blob):>6.3f} {n / statistics.median(enc) / 1e9:>9.2f} "
                  f"{n / statistics.median(dec) / 1e9:>9.2f} {n / statistics.median(cp) / 1e9:>9.2f}")


if __name__ == "__main__":
    main()
