"""Trace replay through the real tier index and policies (metadata only)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiercache.bench.trace import load_trace, replay, replay_belady, replay_hierarchy, unique_chunks
from tiercache.policies import eviction_policies


def write_trace(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def req(ids, length=None):
    return {"timestamp": 0, "input_length": length or 512 * len(ids), "output_length": 1, "hash_ids": ids}


def test_prefix_hits_capped_at_input_length_under_lru(tmp_path):
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [
        req([1, 2]),            # miss, stores 1, 2
        req([1, 2, 3], 1100),   # hits 1, 2 (1024 tokens), stores 3 → evicts the oldest (2 was touched after 1)
        req([1, 9]),            # hits 1
        req([1, 2], 700),       # 1 hits; 2 was evicted → 512 of 700 tokens
    ]))
    r = replay(trace, capacity_tokens=3 * 512, policy="lru")
    assert r.requests == 4 and r.hit_requests == 3
    assert r.hit_tokens == 0 + 1024 + 512 + 512
    assert r.input_tokens == 1024 + 1100 + 1024 + 700


def test_the_replays_tell_an_observer_each_request_s_hit(tmp_path):
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [req([1, 2]), req([1, 2, 3], 1100), req([1, 9]),
                                                          req([1, 2], 700)]))
    seen = []
    replay(trace, 3 * 512, "lru", on_hit=lambda i, n: seen.append((i, n)))
    assert seen == [(0, 0), (1, 2), (2, 1), (3, 1)]       # as in the test above
    seen.clear()
    replay_belady(trace, 3 * 512, on_hit=lambda i, n: seen.append((i, n)))
    assert seen == [(0, 0), (1, 2), (2, 1), (3, 2)]       # Belady never stores 3 or 9: nobody asks again


def test_infinite_capacity_reproduces_the_ceiling_of_the_shared_trace(shared_trace):
    trace = shared_trace
    ceiling = replay(trace, unique_chunks(trace) * 512)
    assert 0.64 < ceiling.token_hit_ratio < 0.66
    small, large = replay(trace, 1_000_000), replay(trace, 3_000_000)
    assert small.token_hit_ratio < large.token_hit_ratio < ceiling.token_hit_ratio


def test_the_offline_reference_keeps_what_comes_back_soonest_and_nothing_that_does_not(tmp_path):
    """Two chunks of room. Chunk 2 is never asked for again, so it is never kept; chunk 3 comes back before
    chunk 1, so both stay; chunk 3's last use frees its room, and 4 (never again) is not kept either."""
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [
        req([1, 2]),     # miss: keeps 1 (asked for again at r2), not 2 (never again)
        req([3]),        # miss: keeps 3 (asked for at r3)
        req([1]),        # hit
        req([3]),        # hit; its last use
        req([4]),        # miss: never again, not kept
        req([1]),        # hit
    ]))
    belady = replay_belady(trace, capacity_tokens=2 * 512)
    assert (belady.hit_requests, belady.hit_tokens) == (3, 3 * 512)
    assert replay(trace, 2 * 512, "lru").hit_requests < belady.hit_requests


def test_the_offline_reference_bounds_every_policy_and_meets_the_ceiling(shared_trace):
    trace = shared_trace[:2000]
    for capacity in (500_000, 2_000_000):
        best = replay_belady(trace, capacity).token_hit_ratio
        for policy in eviction_policies.names():
            assert replay(trace, capacity, policy).token_hit_ratio <= best, (policy, capacity)
    everything = unique_chunks(trace) * 512
    assert replay_belady(trace, everything).hit_tokens == replay(trace, everything).hit_tokens


def test_hierarchy_admission_trades_hits_for_disk_writes(shared_trace):
    trace = shared_trace[:1500]
    always = replay_hierarchy(trace, 500_000, 2_000_000, "always")
    picky = replay_hierarchy(trace, 500_000, 2_000_000, "min-hits", 1)
    l1_only = replay(trace, 500_000)
    assert always.token_hit_ratio > l1_only.token_hit_ratio      # L2 adds hits
    assert always.l2_hit_chunks > 0
    assert picky.l2_written_chunks < always.l2_written_chunks
    assert picky.token_hit_ratio <= always.token_hit_ratio


def test_malformed_traces_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(req([1])) + "\n" + '{"timestamp": 0, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(path)
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "trace", "--trace", str(path), "--quiet"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "bad.jsonl:2" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "trace", "--trace", str(tmp_path / "no"),
                           "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 2 and "No such file" in proc.stderr


def test_bench_trace_writes_json_markdown_and_png(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [req([1, 2, 3]), req([1, 2, 4]), req([5]), req([1, 2])])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "trace", "--trace", str(trace),
                           "--capacity-tokens", "1024,4K", "--policy", "lru,fifo", "--out", str(out), "--quiet"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "trace.json").read_text())
    assert report["ceiling_token_hit_ratio"] == pytest.approx(
        (2 * 512 + 2 * 512) / (3 * 512 + 3 * 512 + 512 + 2 * 512), abs=1e-3
    )
    assert {(r["policy"], r["capacity_tokens"]) for r in report["results"]} == {
        ("lru", 1024), ("lru", 4000), ("fifo", 1024), ("fifo", 4000),   # 4K = 4000 tokens
        ("belady (offline)", 1024), ("belady (offline)", 4000)}         # the reference row, always
    assert all(r["vs_lru"] >= 1.0 for r in report["results"] if r["policy"] == "belady (offline)")
    assert "| token hit ratio | vs lru | chunk writes |" in (out / "trace.md").read_text()     # writes beside hits
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_trace_replays_l1_over_l2_and_counts_the_chunks_each_policy_writes(tmp_path):
    """With --l1-tokens each capacity is an L2's under the real cache manager; each row says how many chunks
    the (lowest) tier wrote, and the reference holds L1's and L2's room as one."""
    trace = write_trace(tmp_path / "t.jsonl", [req([1, 2, 3]), req([1, 2, 4]), req([5]), req([1, 2]), req([6])])
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "trace", "--trace", str(trace),
                           "--capacity-tokens", "1024", "--l1-tokens", "1024", "--policy", "lru,lru/reuse-model",
                           "--json", str(out), "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    rows = {r["policy"]: r for r in report["results"]}
    assert report["l1_tokens"] == 1024 and set(rows) == {"lru", "lru/reuse-model", "belady (offline)"}
    assert rows["lru"]["written_chunks"] > 0                          # spills from L1 were written to L2
    assert rows["belady (offline)"]["written_chunks"] < rows["lru"]["written_chunks"]   # one-offs never kept
    assert rows["belady (offline)"]["token_hit_ratio"] >= rows["lru"]["token_hit_ratio"]


def test_a_gzip_compressed_trace_reads_the_same(tmp_path):
    import gzip
    plain = write_trace(tmp_path / "t.jsonl", [req([1, 2], 600), req([1, 2, 3], 1100)])
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_trace(packed) == load_trace(plain) and len(load_trace(packed)) == 2


def test_bench_trace_rows_may_name_an_admission_policy_and_a_wrong_one_is_one_line(tmp_path):
    """``EVICTION+ADMISSION``: on one tier the admission decides what is stored (a chain up to its first refused
    chunk; everything while the tier has room); with --l1-tokens it guards what L1 writes to L2."""
    # a tier of 3 chunks: 1 2 3 go in while there is room; the one-off 9 would evict one of them, and is refused
    trace = write_trace(tmp_path / "t.jsonl", [req([1, 2, 3]), req([9]), req([1, 2, 3])])
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "trace", "--trace", str(trace),
                           "--capacity-tokens", "1536", "--policy", "lru,lru+second-sighting", "--json", str(out),
                           "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert (rows["lru"]["written_chunks"], rows["lru"]["token_hit_ratio"]) == (5, pytest.approx(2 / 7, abs=1e-3))
    assert (rows["lru+second-sighting"]["written_chunks"], rows["lru+second-sighting"]["token_hit_ratio"]) == (
        3, pytest.approx(3 / 7, abs=1e-3))                                # the whole of 1 2 3, the second time
    for policy, words in (("lru+nope", "unknown admission policy ['nope']"), ("nope+always", "unknown policy"),
                          ("lru/nope", "unknown policy"), ("lru/lfu-da", "--policy: L1/L2 names each tier")):
        proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "trace", "--trace", str(trace),
                               "--policy", policy, "--quiet"], capture_output=True, text=True)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bench_trace_guards_l1_with_an_admission_policy_and_refuses_one_that_cannot(tmp_path):
    """--l1-admission: what the engine's stores put into L1 is guarded (`CacheManager.l1_admission`; what it
    refuses is tested on a real stack in test_cpu_tier.py), and the report says by what; a policy that counts
    L1's own hits is one line, before any work."""
    trace = write_trace(tmp_path / "t.jsonl", [req([1]), req([1]), req([9]), req([1])])
    out = tmp_path / "out.json"
    base = [sys.executable, "-m", "tiercache.cli", "bench", "trace", "--trace", str(trace), "--capacity-tokens",
            "512", "--l1-tokens", "512", "--policy", "lru", "--quiet"]
    for admission in ("always", "second-sighting"):
        proc = subprocess.run([*base, "--l1-admission", admission, "--json", str(out)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(out.read_text())
        assert report["l1_admission"] == admission
        hits = {r["policy"]: r["token_hit_ratio"] for r in report["results"]}
        assert hits["lru"] > 0
    proc = subprocess.run([*base, "--l1-admission", "min-hits"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--l1-admission: counts L1's own hits" in proc.stderr, proc.stderr
    one_tier = base[:base.index("--l1-tokens")] + base[base.index("--l1-tokens") + 2:]
    proc = subprocess.run([*one_tier, "--promotion", "move"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--promotion: moves chunks from L2 up into L1" in proc.stderr, proc.stderr
    proc = subprocess.run([*base, "--promotion", "move", "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0 and json.loads(out.read_text())["promotion"] == "move", proc.stderr


def test_the_hierarchy_replay_asks_again_while_promotions_wait_for_room(tmp_path):
    """A prefix held only in L2 and longer than the room L1 can make in one go (its victims are being spilled)
    is promoted over several rounds, as the connector does by asking again: the whole prefix is a hit."""
    one = list(range(24))
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [
        req(one),                                  # into L1 (32 slots)
        req(list(range(100, 132))),                # two other chains push it down into L2
        req(list(range(200, 232))),
        req(one),                                  # in L2 only, and L1's victims all need spilling
    ]))
    r = replay_hierarchy(trace, 32 * 512, 200 * 512, eviction="lru")
    assert r.hit_requests == 1 and r.hit_tokens == 24 * 512      # one round alone: 8 chunks
