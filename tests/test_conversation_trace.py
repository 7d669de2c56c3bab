"""Generated conversation traces: the Mooncake format, turns that resend their history, determinism, and the
policies that take request-state hints on them."""
import json
import subprocess
import sys

import pytest

from tiercache.bench.conversation_trace import BLOCK_TOKENS, ConversationTraceSpec, generate
from tiercache.bench.trace import TraceRequest, load_trace, replay

SMALL = ConversationTraceSpec(conversations=200, conversation_rate=2.0, think_s=20.0, one_off_rate=1.0, seed=3)


def test_each_turn_resends_its_conversations_history_and_one_offs_share_only_system_prompts():
    records = list(generate(SMALL))
    assert records == list(generate(SMALL))                            # deterministic by seed
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    turns: dict[str, list[dict]] = {}
    for r in records:
        assert set(r) <= {"timestamp", "input_length", "output_length", "hash_ids", "conversation_id"}
        assert len(r["hash_ids"]) == -(-r["input_length"] // BLOCK_TOKENS)
        if "conversation_id" in r:
            turns.setdefault(r["conversation_id"], []).append(r)
    assert len(turns) == SMALL.conversations and any(len(t) > 2 for t in turns.values())
    for history in turns.values():
        for before, after in zip(history, history[1:]):
            full = before["input_length"] // BLOCK_TOKENS          # every full block of the turn before
            assert after["hash_ids"][:full] == before["hash_ids"][:full]
            assert after["input_length"] > before["input_length"] + before["output_length"]
    one_offs = [r for r in records if "conversation_id" not in r]
    assert one_offs
    conversation_blocks = {h for history in turns.values() for r in history for h in r["hash_ids"]}
    system_blocks = {h for history in turns.values() for h in history[0]["hash_ids"][:SMALL.system_tokens
                                                                                      // BLOCK_TOKENS]}
    assert all(set(r["hash_ids"]) & conversation_blocks <= system_blocks for r in one_offs)


@pytest.mark.parametrize("field, value", [("conversations", 0), ("think_s", 0.0), ("mean_turns", 0.5),
                                          ("one_off_system_share", 1.5)])
def test_a_bad_spec_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_share")[0]):
        ConversationTraceSpec(**{field: value})


def test_make_trace_writes_a_trace_bench_trace_reads_with_its_conversations(tmp_path):
    out = tmp_path / "conv.jsonl"
    done = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "make-trace", "--out", str(out),
                           "--conversations", "50", "--seed", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    trace = load_trace(out)
    assert len(trace) == sum(1 for _ in out.open())
    assert {r.conversation for r in trace} - {None} == {json.loads(line).get("conversation_id")
                                                        for line in out.open()} - {None}


def test_make_trace_takes_the_lengths_of_its_prompts(tmp_path):
    """One system prompt of 1024 tokens (two blocks) and no one-offs: every request opens with the same two
    blocks and its third is its conversation's own (the default, 2048 tokens, would share four)."""
    out = tmp_path / "conv.jsonl"
    done = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "make-trace", "--out", str(out),
                           "--conversations", "20", "--one-off-rate", "0", "--system-prompts", "1",
                           "--system-tokens", "1024", "--question-tokens", "600", "--answer-tokens", "20"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    trace = load_trace(out)
    firsts = {r.conversation: r for r in reversed(trace)}       # each conversation's first request
    assert len({r.keys[:2] for r in trace}) == 1
    assert len({r.keys[2] for r in firsts.values()}) == len(firsts) == 20


def test_lfu_da_state_keeps_more_than_lfu_da_and_lru_on_the_shared_trace_and_a_conversation_trace(shared_trace):
    """Measured in benchmarks/RESULTS.md ("Request-state hints"); here at one point each, where the gap is
    widest: the replays send every request's state as the connector does."""
    conversations = [TraceRequest.from_record(r) for r in generate(SMALL)]
    for trace, capacity in ((shared_trace, 1_000_000), (conversations, 100_000)):
        lru, lfu, state = (replay(trace, capacity, p).token_hit_ratio for p in ("lru", "lfu-da", "lfu-da-state"))
        assert state > lfu >= lru * 0.99, (capacity, lru, lfu, state)

