"""Where a tier keeps its chunks (`Medium`), and the physical link a copy between two media runs on.

Plain data both sides share: a tier index and a transport each name their medium; the scheduler names the
link (``device_host``, ``host_disk``, ``host_network``) whose limits and queue a planned copy goes through.
"""
from __future__ import annotations

from enum import Enum


class Medium(str, Enum):
    DEVICE = "device"   # L0: the engine's paged pool
    CPU = "cpu"         # L1: (pinned) host memory
    DISK = "disk"       # L2: local NVMe
    REMOTE = "remote"   # L3: Redis or a tiercache server


LINK_NAMES = {
    frozenset((Medium.DEVICE, Medium.CPU)): "device_host",
    frozenset((Medium.CPU, Medium.DISK)): "host_disk",
    frozenset((Medium.CPU, Medium.REMOTE)): "host_network",
}
DELETE_LINKS = {Medium.DISK: "host_disk", Medium.REMOTE: "host_network"}


def link_name(src: Medium, dst: Medium | None) -> str:
    """The physical link a copy between two media (or a delete from ``src``) runs on."""
    if dst is None:
        return DELETE_LINKS[src]
    return LINK_NAMES.get(frozenset((src, dst)), f"{src.value}_{dst.value}")


