"""Where a quantized put's time goes: each chunk's encode and send, on a loopback shaped to a NIC's rate.

    sudo python benchmarks/put_timeline.py --rate 5gbit --runs 3 -- --tiers grpc --codecs int8 \
        --total-mib 512 --reps 3

Runs `tiercache bench tiers` (flags after ``--``, one tier and one codec) in a network namespace of its own
whose loopback is shaped by ``tc tbf`` (`shaped_links.in_shaped_namespace`, beside this file), with the
codec pipeline's two steps timed: the encode work on the codec threads (each call `CodecThreads` runs) and
each chunk's send on a transfer thread (from the moment the writer takes the chunk to the moment it asks
for the next one). For the last put of each run it reports the put's wall time, how long the link had no
chunk to send at the start (the pipeline fill: the first encode) and later (sends waiting for encodes), the
link's busy time, and the codec threads' work per chunk and encode rate beside the sends. Needs root (a
network namespace and tc).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from shaped_links import in_shaped_namespace  # beside this file: the script's directory is on sys.path


def traced_bench(bench_args: list[str], out: Path) -> None:
    """Inside the namespace: the benchmark with its encodes, sends and puts timed; the spans go to ``out``."""
    from tiercache.bench.filled import FilledStack
    from tiercache.cli import main
    from tiercache.wire.codec_pipeline import CodecPipeline, CodecThreads

    spans: list[tuple[str, str, float, float]] = []       # kind, thread, start, end (s)
    submit, encoded, write_down = CodecThreads.submit, CodecPipeline.encoded, FilledStack.write_down

    def timed_submit(self, fn, *args):
        def timed():
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spans.append(("codec", threading.current_thread().name, start, time.perf_counter()))
        return submit(self, timed)

    def timed_encoded(self, items, refused):
        for chunk in encoded(self, items, refused):
            start = time.perf_counter()
            yield chunk
            spans.append(("send", threading.current_thread().name, start, time.perf_counter()))

    def timed_write_down(self):
        start = time.perf_counter()
        try:
            return write_down(self)
        finally:
            spans.append(("put", "main", start, time.perf_counter()))

    CodecThreads.submit, CodecPipeline.encoded, FilledStack.write_down = timed_submit, timed_encoded, timed_write_down
    main(["bench", "tiers", *bench_args, "--quiet", "--json", str(out.with_suffix(".bench.json"))])
    bench = json.loads(out.with_suffix(".bench.json").read_text())
    chunk_bytes = next(iter(bench["tiers"].values()))["chunk_bytes"]      # one shape: the same for any tier
    out.write_text(json.dumps({"spans": spans, "chunk_bytes": chunk_bytes}))


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def last_put(report: dict) -> dict:
    spans, chunk_bytes = report["spans"], report["chunk_bytes"]
    put = [s for s in spans if s[0] == "put"][-1]
    start, end = put[2], put[3]
    inside = [s for s in spans if s[0] != "put" and start <= s[2] <= end]
    sends = [(a, b) for kind, _, a, b in inside if kind == "send"]
    codec = [(a, b) for kind, _, a, b in inside if kind == "codec"]
    wall, busy = end - start, union(sends)
    fill = min(a for a, _ in sends) - start
    return {"put_ms": wall * 1e3, "fill_ms": fill * 1e3, "link_idle_after_fill_ms": (wall - fill - busy) * 1e3,
            "link_busy_ms": busy * 1e3, "chunks": len(sends),
            # codec threads' time over the put, all threads added up, per chunk
            "codec_ms_per_chunk": sum(b - a for a, b in codec) / len(sends) * 1e3,
            # raw bytes encoded over the span from the first codec work's start to the last one's end
            "codec_threads_gbps": len(sends) * chunk_bytes / (max(b for _, b in codec) - min(a for a, _ in codec))
            / 1e9,
            "codec_threads": len({t for kind, t, _, _ in inside if kind == "codec"})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="5gbit", help="the loopback's rate in tc's units (5gbit, 800mbit, ...)")
    p.add_argument("--runs", type=int, default=3, help="fresh benchmark runs (medians are reported)")
    p.add_argument("--inside", help=argparse.SUPPRESS)    # set on the re-run inside the namespace: where to write
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `tiercache bench tiers` flags")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.inside:
        traced_bench(bench_args, Path(args.inside))
        return
    if os.geteuid() != 0 or any(shutil.which(t) is None for t in ("unshare", "tc", "ip")):
        sys.exit("put_timeline: needs root, unshare, tc and ip (a network namespace with a shaped loopback)")
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="tiercache-timeline-") as tmp:
            out = Path(tmp) / "spans.json"
            done = in_shaped_namespace(args.rate, [sys.executable, __file__, "--inside", str(out), "--", *bench_args])
            if done.returncode != 0 or not out.exists():
                sys.exit(f"put_timeline: run {run + 1} failed: {(done.stderr or done.stdout).strip()[-400:]}")
            rows.append(last_put(json.loads(out.read_text())))
        print(f"run {run + 1}/{args.runs}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1].items()), file=sys.stderr)
    print(json.dumps({k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}, indent=1))


if __name__ == "__main__":
    main()
