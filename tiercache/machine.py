"""What this machine (or the container it runs in) can give: memory, for the checks made before anything is
allocated; cores, for a thread whose torch ops should keep to one; and a core's own cache, which the reference
engine's attention sizes its work by."""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")      # cgroup v2: a container's memory limit
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")    # index*/ {level, type, size}: the first core's caches
CORE_CACHE_BYTES = 1 << 20                                  # when the machine does not say: a common L2 size


def physical_memory() -> int:
    """Bytes of memory this process may use at most: the machine's, or its cgroup's limit when lower (a pool
    larger than this cannot be allocated and pre-faulted; a server allowed more would be killed first)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def core_cache_bytes(level: int = 2, caches: Path = CPU_CACHES) -> int:
    """Bytes of one core's level-``level`` data cache (the first core's, from sysfs: ``1024K``), or
    ``CORE_CACHE_BYTES`` where the machine does not say (not Linux, a container without sysfs)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        for index in sorted(caches.glob("index*")):
            if (index / "level").read_text().strip() != str(level):
                continue
            if (index / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            size = (index / "size").read_text().strip()
            if size[:-1].isdigit() and size[-1] in units:
                return int(size[:-1]) * units[size[-1]]
            if size.isdigit():
                return int(size)
    except OSError:
        pass
    return CORE_CACHE_BYTES


def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded into this process (its own copy of libgomp, or libiomp/libomp). Other
    packages bring copies of their own (sentencepiece, which vLLM imports, loads a libgomp before torch's in
    the process map), so one inside torch's package comes first."""
    import torch

    try:
        with open("/proc/self/maps") as maps:
            paths = dict.fromkeys(line.rsplit(None, 1)[-1] for line in maps)
    except OSError:          # no /proc (not Linux): no runtime to find
        return None
    runtimes = [p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))
                and ".so" in os.path.basename(p)]
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    runtimes.sort(key=lambda p: not p.startswith(torch_dir))
    return ctypes.CDLL(runtimes[0]) if runtimes else None


def keep_torch_to_one_core() -> bool:
    """Make the calling thread's torch ops run on one core, leaving every other thread's as they are.

    ``torch.set_num_threads`` is process-wide (and new threads start from it); the size of an OpenMP team is
    the starting thread's own setting, so this sets it for this thread alone, after torch's per-thread set-up
    (which would reset it). False where torch does not run on an OpenMP runtime found here."""
    import torch

    torch.get_num_threads()              # torch's lazy per-thread set-up happens here, not after us
    runtime = _openmp_runtime()
    if runtime is None:
        log.debug("no OpenMP runtime found: this thread's torch ops keep torch's thread count")
        return False
    runtime.omp_set_num_threads(1)
    return torch.get_num_threads() == 1
