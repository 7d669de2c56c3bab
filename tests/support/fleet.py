"""Replicas (`tiercache api --kv-events`) and routers (`tiercache route`) as the processes users run, and the
HTTP calls the router's tests make."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

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
