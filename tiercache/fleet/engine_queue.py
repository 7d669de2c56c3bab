"""What a replica says its engine is working on, read from its own Prometheus ``/metrics``: the requests running
and waiting there — the ones no router of ours sent included (a second router beside this one, clients that call
the replica directly), which the router's own counts cannot see.

Known exposition names, per engine (samples of one name are summed: vLLM labels them by engine and model):
``tiercache api`` publishes ``tiercache_engine_requests_running`` / ``_waiting``, ``vllm serve``
``vllm:num_requests_running`` / ``vllm:num_requests_waiting``. A line scan, not a full parse: vLLM's exposition
carries dozens of histograms, and the router reads it every health interval.
"""
from __future__ import annotations

from dataclasses import dataclass

QUEUE_GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("tiercache_engine_requests_running", "vllm:num_requests_running"),
    "waiting": ("tiercache_engine_requests_waiting", "vllm:num_requests_waiting"),
}
_FIELD_OF = {name: field for field, names in QUEUE_GAUGES.items() for name in names}


@dataclass(frozen=True, slots=True)
class EngineQueue:
    running: int
    waiting: int

    @property
    def requests(self) -> int:
        return self.running + self.waiting


def engine_queue(exposition: str) -> EngineQueue | None:
    """The requests running and waiting in a replica's engine, from its Prometheus text; None when it publishes
    neither gauge (an engine this module does not know) or a value is not a count."""
    found = {"running": 0.0, "waiting": 0.0}
    seen = False
    for line in exposition.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or space < 0 <= brace else space
        field = _FIELD_OF.get(line[:end])
        if field is None:
            continue
        rest = line[line.rindex("}") + 1:] if end == brace else line[end:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            return None
        if not 0 <= value < 1e9:
            return None
        found[field] += value
        seen = True
    return EngineQueue(int(found["running"]), int(found["waiting"])) if seen else None
