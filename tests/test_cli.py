"""The command line: the tier benchmark's JSON, and clean errors for bad input."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import tiercache  # noqa: E402


@pytest.fixture(autouse=True)
def _cache_home(tmp_path, monkeypatch):
    """The demo's disk tier lives under the user's cache directory: a fresh one per test."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_bench_tiers_cpu_writes_the_json_report(tmp_path):
    out = tmp_path / "out.json"
    proc = tiercache("bench", "tiers", "--tiers", "cpu,disk", "--shape", "small", "--total-mib", "16",
                     "--reps", "2", "--quiet", "--json", str(out), "--out", str(tmp_path / "rep"),
                     "--disk-path", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    cpu = report["tiers"]["cpu"]
    for key in ("put_gbps", "get_gbps", "raw_gbps", "put_ratio", "get_ratio"):
        assert cpu[key] > 0
    assert cpu["put_ratio"] == pytest.approx(cpu["put_gbps"] / cpu["raw_gbps"], rel=0.01)   # from unrounded rates
    assert cpu["chunk_bytes"] == 256 * 4 * 2 * 2 * 64 * 4 // 1  # 256 tokens × 4 layers × K,V × 2 heads × 64 × fp32
    assert {r.get("block_layout") for r in report["runs"]} == {"allocated", "scattered", None}
    disk = report["tiers"]["disk"]
    assert disk["put_gbps"] > 0 and disk["get_ratio"] > 0 and disk["reads"]
    assert "put/raw" in proc.stdout
    assert (tmp_path / "rep" / "tiers.png").read_bytes()[:4] == b"\x89PNG"
    assert "raw put GB/s" in (tmp_path / "rep" / "tiers.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1800)   # two demo processes, each up to its own 900 s hang guard
def test_the_default_demo_serves_hits_from_l1_and_disk_and_the_next_process_from_disk(tmp_path):
    """`tiercache demo` as the README runs it: L0 and L1 sized below the workload, so prefixes come back from
    L1 and from the disk tier under the user's cache directory; a second, shorter run in a new process starts
    with hits from disk."""
    first = tiercache("demo", "--quiet", "--out", str(tmp_path / "one"))
    assert first.returncode == 0, first.stderr
    assert str(tmp_path / "cache" / "tiercache" / "l2") in first.stderr
    report = json.loads((tmp_path / "one" / "demo.json").read_text())
    assert report["outputs_match"] is True
    by = report["by_source"]
    assert by["cpu"]["requests"] > 0 and by["disk"]["requests"] > 0
    assert by["cpu"]["hit_tokens"] > 0 and by["disk"]["hit_tokens"] > 0 and by["disk"]["load_gbps"] > 0
    assert report["hit_tokens_by_tier"]["tiers"] > report["hit_tokens_by_tier"]["l0"]
    for row in ("cpu", "disk"):
        assert row in first.stdout
    assert (tmp_path / "one" / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert "load GB/s" in (tmp_path / "one" / "demo.md").read_text()

    # the next process: the same documents (the first is the same whatever the count), two requests
    second = tiercache("demo", "--quiet", "--requests", "2", "--json", str(tmp_path / "two.json"))
    assert second.returncode == 0, second.stderr
    again = json.loads((tmp_path / "two.json").read_text())
    assert again["outputs_match"] is True
    assert again["request_sources"][0] == "disk"          # the very first request: from the last run's disk
    assert again["by_source"]["cold"]["requests"] == 0


def test_demo_writes_the_report_and_outputs_match(tmp_path):
    out = tmp_path / "demo.json"
    proc = tiercache("demo", "--workload", "shared-prefix", "--requests", "4", "--prefix-tokens", "256",
                     "--output-tokens", "4", "--quiet", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    for key in ("workload", "requests", "ttft_cold_ms_p50", "ttft_warm_ms_p50", "speedup_p50", "token_hit_ratio",
                "request_hit_ratio", "prefill_tokens_saved", "outputs_match"):
        assert key in report
    assert report["outputs_match"] is True and report["requests"] == 4
    assert report["request_hit_ratio"] == 0.75 and report["prefill_tokens_saved"] == 3 * 256


@pytest.mark.parametrize("workload", ["multi-turn", "long-doc"])
def test_demo_other_workloads(tmp_path, workload):
    out = tmp_path / "demo.json"
    proc = tiercache("demo", "--workload", workload, "--requests", "4", "--prefix-tokens", "128", "--output-tokens",
                     "3", "--tiers", "cpu", "--no-prefix-caching", "--quiet", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["outputs_match"] is True and report["hit_tokens_by_tier"]["l0"] == 0
    assert report["hit_tokens_by_tier"]["tiers"] > 0


def test_generate_prints_text():
    """The seeded model's tokens are any byte: the text comes out as one line of printable characters (control
    bytes escaped), and the summary is a line of its own."""
    proc = tiercache("generate", "--prompt", "Hello", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout[:-1].isprintable(), repr(proc.stdout)
    assert proc.stderr.startswith("[16 tokens") and "seeded weights" in proc.stderr
    proc = tiercache("generate", "--prompt", "x" * 40_000, "--max-tokens", "4")
    assert proc.returncode == 2 and "max_position" in proc.stderr and "Traceback" not in proc.stderr
    proc = tiercache("generate", "--prompt", "Hello", "--max-tokens", "0")
    assert proc.returncode == 2 and "--max-tokens" in proc.stderr


@pytest.mark.slow
def test_demo_with_disk_twice_the_second_process_hits_the_disk(tmp_path):
    """Process 1 computes and (on exit) writes L1 down to disk; process 2 starts empty and loads from disk."""
    args = ["demo", "--tiers", "cpu,disk", "--disk-path", str(tmp_path / "l2"), "--requests", "3",
            "--prefix-tokens", "256", "--output-tokens", "3", "--quiet"]
    first = tiercache(*args, "--json", str(tmp_path / "1.json"))
    assert first.returncode == 0, first.stderr
    assert json.loads((tmp_path / "1.json").read_text())["chunks_loaded_by_tier"]["disk"] == 0
    second = tiercache(*args, "--json", str(tmp_path / "2.json"))
    assert second.returncode == 0, second.stderr
    report = json.loads((tmp_path / "2.json").read_text())
    assert report["outputs_match"] is True
    assert report["chunks_loaded_by_tier"]["disk"] > 0
    assert report["hit_tokens_by_tier"]["tiers"] >= 256


@pytest.mark.slow
def test_bench_engine_writes_reports_and_every_setup_matches_the_baseline(tmp_path):
    out = tmp_path / "eng"
    proc = tiercache("bench", "engine", "--workloads", "shared-prefix,no-reuse", "--setups", "none,cpu,cpu+disk",
                     "--requests", "3", "--prefix-tokens", "256", "--output-tokens", "2", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "engine.json").read_text())
    rows = {(r["workload"], r["setup"]): r for r in report["results"]}
    assert len(rows) == 8 and all(r["outputs_match_baseline"] for r in rows.values())
    assert rows[("shared-prefix", "cpu")]["prefill_tokens_saved"] == 2 * 256
    assert rows[("no-reuse", "cpu")]["token_hit_ratio"] == 0
    assert set(report["store_overhead_ttft_ratio_no_reuse"]) == {"none", "cpu", "cpu+disk"}
    assert (out / "engine.png").read_bytes()[:4] == b"\x89PNG" and "TTFT p50" in (out / "engine.md").read_text()
    proc = tiercache("bench", "engine", "--setups", "cpu+tape")
    assert proc.returncode == 2 and "cpu+tape" in proc.stderr


@pytest.mark.slow      # three engines under memory pressure
@pytest.mark.timeout(900)   # one process under its own 900 s hang guard (support/cli.py)
def test_bench_engine_preemption_runs_the_modes_side_by_side_under_pressure_with_equal_outputs(tmp_path):
    out = tmp_path / "pre"
    proc = tiercache("bench", "engine", "--preemption", "recompute,swap,auto", "--pressure", "short", "--reps", "1",
                     "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = {r["mode"]: r for r in json.loads((out / "engine.json").read_text())["results"]}
    assert set(rows) == {"recompute", "swap", "auto"} and all(r["outputs_match"] for r in rows.values())
    assert all(r["preemptions"] > 0 for r in rows.values())           # the pool was too small: it preempted
    assert rows["recompute"]["swap_outs"] == 0 < rows["swap"]["swap_outs"]
    assert "preemption" in (out / "engine.md").read_text()
    for args, wrong in ((("--preemption", "sometimes"), "sometimes"),
                        (("--preemption", "auto", "--pressure", "huge"), "huge")):
        proc = tiercache("bench", "engine", *args)
        assert proc.returncode == 2 and wrong in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_bench_tiers_redis_starts_its_own_server_when_given_none(tmp_path):
    proc = tiercache("bench", "tiers", "--tiers", "redis", "--shape", "small", "--total-mib", "4", "--reps", "1",
                     "--quiet", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    redis = json.loads((tmp_path / "r.json").read_text())["tiers"]["redis"]
    assert redis["put_gbps"] > 0 and redis["get_gbps"] > 0


@pytest.mark.slow
def test_bench_tiers_redis_without_a_server_is_one_line(tmp_path):
    bare = {**os.environ, "PATH": str(Path(sys.executable).parent)}     # no redis-server on it
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "tiers", "--tiers", "cpu,redis"],
                          capture_output=True, text=True, timeout=120, env=bare)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--redis-url" in proc.stderr and "redis-server" in proc.stderr
    proc = tiercache("bench", "tiers", "--tiers", "cpu,redis", "--redis-url", "redis://127.0.0.1:1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "redis://127.0.0.1:1" in proc.stderr


@pytest.mark.slow
def test_cache_info_and_clear_take_the_demos_disk_tier_back_out(tmp_path):
    """The demo says where its disk tier lives, how big it may grow and how to empty it; `cache clear` removes
    the chunk files (nothing else in the directory) and the next demo starts cold."""
    first = tiercache(
        "demo", "--quiet", "--requests", "2", "--prefix-tokens", "512", "--json", str(tmp_path / "1.json")
    )
    assert first.returncode == 0, first.stderr
    l2 = tmp_path / "cache" / "tiercache" / "l2"
    assert f"disk tier (L2) in {l2}, up to 10.0 GiB" in first.stderr and "tiercache cache clear" in first.stderr
    info = json.loads(tiercache("cache", "info").stdout)
    assert info["path"] == str(l2) and info["chunks"] > 0 and info["bytes"] > 0
    (l2 / "notes.txt").write_text("mine")
    cleared = tiercache("cache", "clear")
    assert cleared.returncode == 0 and f"removed {info['chunks']} chunk files" in cleared.stderr
    assert json.loads(tiercache("cache", "info").stdout)["chunks"] == 0
    assert (l2 / "notes.txt").read_text() == "mine"
    again = tiercache(
        "demo", "--quiet", "--requests", "2", "--prefix-tokens", "512", "--json", str(tmp_path / "2.json")
    )
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "2.json").read_text())["request_sources"][0] == "cold"


def test_demo_prints_where_its_metrics_are_served():
    proc = tiercache("demo", "--quiet", "--requests", "1", "--prefix-tokens", "256", "--tiers", "cpu",
                     "--metrics-port", "0")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "Prometheus metrics" in ln)
    port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
    assert port > 0 and line.split(" on ")[1].startswith(f"http://127.0.0.1:{port}/metrics")
