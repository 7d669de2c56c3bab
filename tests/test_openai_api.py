"""`tiercache api`: the reference engine behind the OpenAI API, in its own process, asked with the `openai` client."""
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install 'tiercache[api]')")
openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install 'tiercache[dev]')")

MODEL = "tiercache-reference"
PROMPT = "A prefix every request repeats, so the engine's own cache holds it the second time. " * 4


@pytest.fixture(scope="module")
def api():
    """`tiercache api` on a free port; its first line says where."""
    proc = subprocess.Popen([sys.executable, "-m", "tiercache.cli", "api", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("tiercache api:"), line + proc.stderr.read()
        base = line.split(" on ")[1].strip()
        yield base, openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def _post(base: str, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_completions_match_the_library_and_report_the_cached_prefix(api):
    from tiercache.engine import LLM, SamplingParams
    _, client = api
    with LLM() as llm:
        (expected,) = llm.generate([PROMPT], SamplingParams(max_tokens=8))
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert first.choices[0].text == again.choices[0].text == expected.text
    assert first.choices[0].finish_reason == "length"
    prompt_tokens = len(expected.prompt_token_ids)
    assert first.usage.prompt_tokens == prompt_tokens and first.usage.completion_tokens == 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == prompt_tokens // 16 * 16   # every full block


def test_a_stream_says_what_the_whole_answer_says(api):
    _, client = api
    whole = client.completions.create(model=MODEL, prompt=PROMPT + "stream", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT + "stream", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    assert [m.id for m in client.models.list()] == [MODEL]


def test_requests_side_by_side_are_batched_and_each_gets_its_own_answer(api):
    from concurrent.futures import ThreadPoolExecutor
    _, client = api
    prompts = [f"request {i}: " + PROMPT for i in range(4)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                                                     temperature=0).choices[0].text, prompts))
    assert together == alone


def test_mistakes_are_answered_as_the_openai_api_answers_them(api):
    base, client = api
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="another-model", prompt="x")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert err.value.body["param"] == "max_tokens" and "positive" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x" * 40_000, max_tokens=4)   # past the model's positions
    assert err.value.body["param"] == "prompt" and "max_position" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    assert err.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", extra_body={"kv_transfer_params": {"continues": "yes"}})
    assert err.value.body["param"] == "kv_transfer_params.continues"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", extra_body={"session_id": 7})
    assert err.value.body["param"] == "session_id"
    for said in ({"kv_transfer_params": {"continues": True}}, {"session_id": "chat-1"}):
        done = client.completions.create(model=MODEL, prompt="a turn", max_tokens=2, extra_body=said)
        assert done.usage.completion_tokens == 2               # the hint is taken, the answer unchanged
    status, body = _post(base, "/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    status, body = _post(base, "/no-such-route", b"{}")
    assert status == 404 and "error" in body
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).usage.completion_tokens == 2


def test_a_port_in_use_is_one_line_before_any_work():
    import socket
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "api", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--port" in proc.stderr and "Traceback" not in proc.stderr


def test_a_request_continues_when_it_has_a_session_or_says_so():
    from tiercache.engine.openai_api import continues_of
    assert not continues_of({}) and not continues_of({"kv_transfer_params": {"do_remote_prefill": True}})
    assert continues_of({"session_id": "chat-1"})
    assert continues_of({}, {"X-Session-ID": "chat-1"})
    assert continues_of({"kv_transfer_params": {"continues": True}})
    assert not continues_of({"kv_transfer_params": {"continues": False}}, {})


def _scrape(base: str) -> dict[str, float]:
    """Every sample of the server's /metrics by name (labels' values in braces); a missing one is a KeyError."""
    parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client is not installed")
    with urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_the_engine_s_busy_time_and_what_it_holds(api):
    base, client = api
    before = _scrape(base)
    client.completions.create(model=MODEL, prompt=PROMPT + "metrics", max_tokens=4, temperature=0)
    after = _scrape(base)
    assert after["tiercache_engine_steps_total"] >= before["tiercache_engine_steps_total"] + 4   # prefill + decodes
    assert after["tiercache_engine_busy_seconds_total"] > before["tiercache_engine_busy_seconds_total"]
    assert after["tiercache_engine_load_seconds_total"] <= after["tiercache_engine_busy_seconds_total"]
    assert after["tiercache_engine_requests_running"] == after["tiercache_engine_requests_waiting"] == 0
    assert after["tiercache_blocks{evictable}"] > 0                # the prompt's blocks, kept for reuse


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_stops_the_engine_computing_for_it(api, stream):
    """A request whose client closes the connection — streamed, after its first event (the server's next write
    fails), or whole, before any answer (its handler looks at the connection while it waits): the engine ends
    the sequence at its next token instead of decoding its 2,000 tokens for nobody (far fewer engine steps than
    that pass before nothing runs)."""
    import http.client
    import time

    base, _ = api
    host, port = base.removeprefix("http://").removesuffix("/v1").split(":")
    before = _scrape(base)["tiercache_engine_steps_total"]
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": PROMPT + f"leaving {stream}",
                                                        "max_tokens": 2000, "temperature": 0, "stream": stream}),
                 {"Content-Type": "application/json"})
    if stream:
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
        response.close()                                               # the client leaves
    else:
        deadline = time.monotonic() + 60
        while not _scrape(base)["tiercache_engine_requests_running"]:  # the engine has it
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
    conn.close()                                                       # the client leaves
    deadline = time.monotonic() + 120
    while (now := _scrape(base))["tiercache_engine_requests_running"] or now["tiercache_engine_requests_waiting"]:
        assert time.monotonic() < deadline, "the engine kept the request running"
        time.sleep(0.05)
    assert _scrape(base)["tiercache_engine_steps_total"] - before < 1000
