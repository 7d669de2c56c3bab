"""`tiercache bench route` as users run it: a small workload through real fleets, and a bench stopped midway
that leaves no replica of its fleet behind."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.shaping import why_no_shaped_loopback

pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install 'tiercache[fleet]')")
pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'tiercache[fleet]')")
pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'tiercache[fleet]')")
pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (pip install 'tiercache[metrics]')")

BENCH = [sys.executable, "-m", "tiercache.cli", "bench", "route", "--replicas", "2", "--shared", "no",
         "--overhead-pairs", "0", "--quiet"]


def _children(pid: int) -> set[int]:
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except FileNotFoundError:
        return set()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow      # two fleets of two replicas and a router
def test_bench_route_replays_the_workload_through_each_policy_and_reports_the_fleet(tmp_path):
    out = tmp_path / "route.json"
    subprocess.run([*BENCH, "--policies", "round-robin,expected-ttft", "--conversations", "4", "--max-turns", "2",
                    "--rate", "4", "--json", str(out)], check=True, timeout=240, capture_output=True)
    from tiercache.bench.route import RouteWorkload, conversations
    turns = sum(len(c.questions) for c in conversations(RouteWorkload(conversations=4, max_turns=2, rate=4)))
    report = json.loads(out.read_text())
    runs = {r["policy"]: r for r in report["runs"]}
    assert set(runs) == {"round-robin", "expected-ttft"}
    for run in runs.values():
        assert run["replicas"] == 2 and run["requests"] == turns     # every turn answered, none lost
        replicas = run["per_replica"].values()
        assert len(replicas) == 2 and sum(r["prompt_tokens"] for r in replicas) > 0
        assert run["load_imbalance"] >= 1.0 and 0 <= run["prediction_error"] <= 1
        assert 0 < run["ttft_ms_p50"] <= run["ttft_ms_p99"]
        # each replica's engine computed for part of the run (its /metrics' busy seconds over the run's time; the
        # two readings around the run take a few ms more than the run itself)
        assert 0 < run["busy_mean"] <= run["busy_max"] <= 1.05 and run["engine_ms_per_request"] > 0
        assert run["engine_steps_per_request"] > 0 and run["engine_ms_per_step"] > 0
        assert run["engine_steps_per_request"] * run["engine_ms_per_step"] == pytest.approx(
            run["engine_ms_per_request"], rel=0.02)                   # the cost per request, split (rounded)
        assert 0 <= run["engine_load_ms_per_request"] <= run["engine_ms_per_request"]   # loading: part of it
        # CPU per request of the replicas' processes (more than their engines' busy time: the transfer threads and
        # the HTTP server are in it) and the router's; chunks loaded per request from each replica's tiers
        assert run["cpu_ms_per_request"]["replicas"] > 0 and run["cpu_ms_per_request"]["router"] > 0
        assert "server" not in run["cpu_ms_per_request"]                # no shared server in this fleet
        assert run["replica_threads_cpu_ms_per_request"]["tiercache-engine"] > 0      # the engine's own thread
        assert set(run["loaded_chunks_per_request"]) == {"cpu"} and run["loaded_chunks_per_request"]["cpu"] >= 0
        assert 0 < run["later_half_ttft_ms_p50"] <= run["later_half_ttft_ms_p99"] <= round(max(   # as reported
            r["ttft_s"] * 1e3 for r in run["records"]), 2)
        records = run["records"]                  # each answer, where the router sent it and what it expected
        assert len(records) == turns and {r["replica"] for r in records} <= set(run["per_replica"])
        assert all(r["expected_ttft_ms"] > 0 and r["predicted_cached_tokens"] <= r["prompt_tokens"]
                   for r in records)
    assert len({r["replica"] for r in runs["round-robin"]["records"]}) == 2    # in turn: both replicas named
    # expected-ttft names the rule behind each choice (X-Tiercache-Route-Reason); round-robin has none to name
    assert {r["reason"] for r in runs["expected-ttft"]["records"]} <= {"fastest", "tie", "hotspot", "share"}
    assert "fastest" in {r["reason"] for r in runs["expected-ttft"]["records"]}
    assert {r["reason"] for r in runs["round-robin"]["records"]} == {""}
    assert sum(runs["expected-ttft"]["reasons"].values()) == turns and runs["round-robin"]["reasons"] == {}
    for run in runs.values():             # a move is a later turn: at most one per turn after each first
        assert 0 <= run["moved"] <= turns - 4
        assert (run["moved_ttft_ms_max"] > 0) == (run["moved"] > 0)


def test_a_move_is_a_turn_sent_away_from_its_conversations_previous_replica():
    from tiercache.bench.route import Request, moved

    def sent(conversation: int, turn: int, replica: str) -> Request:
        return Request(conversation, turn, float(turn), 0.1, 0.2, 100, 0, replica=replica)
    records = [sent(0, 0, "a"), sent(1, 0, "b"), sent(0, 1, "a"), sent(1, 1, "a"), sent(0, 2, "b"), sent(1, 2, "a")]
    assert [(r.conversation, r.turn) for r in moved(records)] == [(1, 1), (0, 2)]
    assert moved(records[:2]) == []                       # first turns go somewhere: none of them is a move


@pytest.mark.slow      # starts a fleet
def test_a_bench_stopped_with_sigterm_stops_the_fleet_it_started(tmp_path):
    bench = subprocess.Popen([*BENCH, "--policies", "round-robin", "--conversations", "200", "--rate", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(_children(bench.pid)) < 3:          # two replicas and the router
            assert bench.poll() is None and time.monotonic() < deadline, "the bench did not start its fleet"
            time.sleep(0.2)
        started = _children(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if _alive(pid)]
    finally:
        for pid in _children(bench.pid) | started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        bench.kill()


def test_a_bad_replica_setting_is_one_line_before_any_replica_starts():
    for value, named in (("keys.chunk_tokens=65", "keys.chunk_tokens"), ("keys.chunk_tokenz=64", "keys.chunk_tokenz"),
                         ("nonsense", "--replica-set")):
        proc = subprocess.run([*BENCH, "--replica-set", value], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_replica_settings_reach_every_replica_of_the_fleet():
    """`--replica-set` starts each replica with the field set: here its chunk size, which the replica's descriptor
    (what the router reads) reports."""
    import urllib.request

    from tiercache.bench.route import start_fleet
    fleet = start_fleet(2, "round-robin", False, ("keys.chunk_tokens=64",))
    try:
        for replica in fleet.replicas:
            with urllib.request.urlopen(f"{replica.url}/tiercache/replica", timeout=30) as resp:
                assert json.loads(resp.read())["chunk_tokens"] == 64
    finally:
        fleet.stop()


@pytest.mark.slow
def test_shaped_links_runs_the_fleet_and_its_shared_server_behind_a_shaped_loopback(tmp_path):
    """benchmarks/shaped_links.py --bench route: the router, the replicas and their shared server in a network
    namespace whose loopback is shaped; the summary has each policy of the fleet, its p50 against round-robin's
    in the same run, and the KV the replicas loaded from the server crossed that loopback."""
    why = why_no_shaped_loopback()
    if why:
        pytest.skip(why)
    out = tmp_path / "shaped.json"
    proc = subprocess.run([sys.executable, "benchmarks/shaped_links.py", "--bench", "route", "--rates", "320mbit",
                           "--burst", "256kb", "--latency", "200ms", "--runs", "1", "--json", str(out),
                           "--", "--replicas", "2", "--shared", "yes", "--policies", "round-robin,expected-ttft",
                           "--conversations", "6", "--max-turns", "2", "--rate", "2", "--overhead-pairs", "0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert (report["burst"], report["latency"]) == ("256kb", "200ms")
    (run,) = report["runs"]["320mbit"]
    assert {r["policy"] for r in run["runs"]} == {"round-robin", "expected-ttft"}
    assert all(r["shared_server"] for r in run["runs"])
    assert any(r["loaded_chunks_per_request"].get("grpc", 0) > 0 for r in run["runs"])
    rows = {r["policy"]: r for r in report["summary"]}
    assert rows["round-robin"]["p50_vs_rr"] == 1.0 and rows["expected-ttft"]["runs"] == 1
    assert rows["expected-ttft"]["p50_vs_rr"] > 0
    assert "| 320mbit | 2 | yes | expected-ttft |" in proc.stdout
