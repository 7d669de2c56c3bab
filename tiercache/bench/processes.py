"""A fleet as users run it, in processes of its own: replicas (`tiercache api --kv-events`), a router
(`tiercache route`) and a shared `tiercache serve`, each started from the CLI and ready when it says where
it listens. Used by `bench route` and by the router's tests."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

START_TIMEOUT_S = 120


@dataclass
class Launched:
    proc: subprocess.Popen
    url: str            # http://host:port for the API servers, host:port for `serve`
    args: list[str]

    def stop(self, kill: bool = False) -> None:
        """Stop it; one that ignores SIGTERM for 30 s is killed, and that is an error."""
        if self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise RuntimeError(f"tiercache {self.args[0]} did not stop on SIGTERM within 30 s") from None


def _http_address(line: str) -> str:
    return "http://" + line.split("://", 1)[1].split("/v1")[0].split()[0]


def _serve_address(line: str) -> str:
    said = json.loads(line)
    return f"{said['host']}:{said['port']}"


def launch(args: list[str], ready_prefix: str, core: int | None = None,
           address_of: Callable[[str], str] = _http_address) -> Launched:
    """``tiercache ARGS`` in a process of its own (one OpenMP thread; pinned to one core of this process's
    set when ``core`` is given and there are several), ready once it printed its address."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cores = sorted(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-m", "tiercache.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        if core is not None and len(cores) > 1:
            # Pinned from here, not by a preexec_fn: that runs Python in the forked child of a process with
            # threads (at-fork hooks included), which can abort it. The child is still starting its interpreter:
            # every thread it starts later inherits the mask.
            os.sched_setaffinity(proc.pid, {cores[core % len(cores)]})
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
    except BaseException:         # stopped while it starts (SIGTERM, Ctrl-C): nobody else knows of it yet
        proc.kill()
        proc.wait()
        raise
    if not line.startswith(ready_prefix):
        proc.kill()
        raise RuntimeError(f"tiercache {' '.join(args)} did not start: {line}{proc.stderr.read()[-2000:]}")
    proc.stderr.close()       # nobody reads it from here on: a full pipe must not stall the process
    proc.stderr = None
    return Launched(proc, address_of(line), args)


def start_replica(core: int | None, port: int = 0, tiers: str = "cpu", cpu_capacity: str = "256MiB",
                  l0_blocks: int = 256, *extra: str) -> Launched:
    return launch(["api", "--port", str(port), "--kv-events", "--tiers", tiers, "--l0-blocks", str(l0_blocks),
                   "--set", f"cpu.capacity={cpu_capacity}", "--set", "cpu.prefault=false", *extra],
                  "tiercache api:", core)


def start_router(replicas: list[str], *extra: str, health_interval: float = 0.5) -> Launched:
    args = ["route", "--port", "0", "--health-interval", str(health_interval)]
    for url in replicas:
        args += ["--replica", url]
    return launch([*args, *extra], "tiercache route:")


def start_server(capacity: str = "1GiB") -> Launched:
    return launch(["serve", "--port", "0", "--capacity", capacity], '{"event": "listening"',
                  address_of=_serve_address)
