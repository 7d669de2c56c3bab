"""What this machine (or the container it runs in) can give: memory, for the checks made before anything is
allocated."""
from __future__ import annotations

import os
from pathlib import Path

CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")      # cgroup v2: a container's memory limit


def physical_memory() -> int:
    """Bytes of memory this process may use at most: the machine's, or its cgroup's limit when lower (a pool
    larger than this cannot be allocated and pre-faulted; a server allowed more would be killed first)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total
