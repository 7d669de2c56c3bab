"""Start `run_vllm.py` on a spec in a fresh process, as users run vLLM (multiprocessing on), with vLLM's
caches and temporary files inside the test's directory."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# vLLMs a test module runs at once: two keep this machine's two cores busy (a third shortened a module run
# alone, not the whole suite's)
AT_ONCE = 2


def run_spec(runs: Path, n: int, spec: dict, tp: int = 1,
             extra_env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """Run launch number ``n`` of ``spec`` under ``runs``: the finished process and the path of what it wrote."""
    runs.mkdir(exist_ok=True)
    spec_path, out = runs / f"spec-{n}.json", runs / f"out-{n}.json"
    spec_path.write_text(json.dumps({**spec, "tp": tp}))
    (runs / "tmp").mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(runs / "cache"),
                    "TMPDIR": str(runs / "tmp"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(extra_env or {})})
    if tp == 2:
        environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"   # one core per rank on this 2-core machine
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_support" / "run_vllm.py"), str(spec_path),
                           str(out)], capture_output=True, text=True, timeout=600, env=environ, cwd=runs)
    return proc, out
