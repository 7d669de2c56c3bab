"""Replicas (`tiercache api --kv-events`) and routers (`tiercache route`) as the processes users run."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

MODEL = "tiercache-reference"
START_TIMEOUT_S = 120


@dataclass
class Process:
    proc: subprocess.Popen
    url: str
    args: list[str]

    def stop(self, kill: bool = False) -> None:
        """Stop it; a process that does not stop on SIGTERM within 30 s fails the test (after a SIGKILL)."""
        if self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"{' '.join(self.args[:1])} did not stop on SIGTERM within 30 s") from None


def _start(args: list[str], prefix: str, core: int | None = None) -> Process:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cores = os.sched_getaffinity(0)
    pin = None
    if core is not None and len(cores) > 1:
        chosen = sorted(cores)[core % len(cores)]
        pin = lambda: os.sched_setaffinity(0, {chosen})    # noqa: E731 — one core each, as replicas are run
    proc = subprocess.Popen([sys.executable, "-m", "tiercache.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=pin)
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(prefix):
        proc.kill()
        raise AssertionError(f"{' '.join(args)} did not start: {line}{proc.stderr.read()}")
    return Process(proc, line.split("http://", 1)[1].split("/v1")[0].split()[0], args)


def start_replica(core: int, port: int = 0, tiers: str = "cpu", *extra: str) -> Process:
    process = _start(["api", "--port", str(port), "--kv-events", "--tiers", tiers, "--l0-blocks", "256",
                      "--set", "cpu.capacity=256MiB", "--set", "cpu.prefault=false", *extra], "tiercache api:", core)
    process.url = "http://" + process.url
    return process


def start_router(replicas: list[str], *extra: str) -> Process:
    args = ["route", "--port", "0", "--health-interval", "0.5"]
    for url in replicas:
        args += ["--replica", url]
    process = _start([*args, *extra], "tiercache route:")
    process.url = "http://" + process.url
    return process


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
