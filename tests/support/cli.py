"""The `tiercache` command in a process of its own."""
import subprocess
import sys


def tiercache(*args: str) -> subprocess.CompletedProcess:
    """The command in a process of its own. The timeout only ends a hang: a machine busy with other work
    (both cores, several times over) stretches a demo several-fold."""
    return subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True, timeout=900)
