"""Loopback links of a given speed for a test: a network namespace whose loopback the kernel shapes
(`benchmarks/shaped_links.py`)."""
import os
import shutil
import subprocess


def why_no_shaped_loopback() -> str | None:
    """Why a network namespace with a shaped loopback cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (a network namespace and tc)"
    if not all(shutil.which(t) for t in ("unshare", "tc", "ip")):
        return "unshare, tc or ip is not installed"
    probe = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root tbf rate "
                            "1gbit burst 1mb latency 20ms"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot shape a namespace's loopback: {probe.stderr.strip()}"
