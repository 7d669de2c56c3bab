"""The command line: the tier benchmark's JSON, and clean errors for bad input."""
import json
import subprocess
import sys


def tiercache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True, timeout=300)


def test_bench_tiers_cpu_writes_the_json_report(tmp_path):
    out = tmp_path / "out.json"
    proc = tiercache("bench", "tiers", "--tiers", "cpu", "--shape", "small", "--total-mib", "16",
                     "--reps", "2", "--quiet", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    cpu = report["tiers"]["cpu"]
    for key in ("put_gbps", "get_gbps", "raw_gbps", "put_ratio", "get_ratio"):
        assert cpu[key] > 0
    assert cpu["put_ratio"] == round(cpu["put_gbps"] / cpu["raw_gbps"], 3)
    assert cpu["chunk_bytes"] == 256 * 4 * 2 * 2 * 64 * 4 // 1  # 256 tokens × 4 layers × K,V × 2 heads × 64 × fp32
    assert {r["block_layout"] for r in report["runs"]} == {"allocated", "scattered"}
    assert "put/raw" in proc.stdout


def test_bad_flags_are_one_clean_line():
    proc = tiercache("bench", "tiers", "--chunk-tokens", "100")
    assert proc.returncode == 2 and "--chunk-tokens" in proc.stderr and "Traceback" not in proc.stderr
    proc = tiercache("bench", "tiers", "--tiers", "floppy")
    assert proc.returncode == 2 and "floppy" in proc.stderr and "Traceback" not in proc.stderr
    proc = tiercache("bench", "tiers", "--set", "cpu.capacity=huge")
    assert proc.returncode == 2 and "cpu.capacity" in proc.stderr and "Traceback" not in proc.stderr
    proc = tiercache("bench", "tiers", "--total-mib", "-3")
    assert proc.returncode == 2 and "--total-mib" in proc.stderr
