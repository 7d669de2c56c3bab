"""Run real vLLM (CPU) on token-id prompts, with or without tiercache's connector, and write what happened.

    python tests/vllm_support/run_vllm.py SPEC.json OUT.json

SPEC: {"model": dir, "prompts": [[ids...]], "max_tokens": n, "kv_transfer_config": {...} or null}.
OUT: {"outputs": [[ids...]], "logprobs": [[chosen token's logprob...]], "num_cached_tokens": [n...],
"connector": stats or null,
"stored_events" / "removed_events": [[medium, chunks]...] for each BlockStored / BlockRemoved event the connector
emitted, "event_order": [["stored" | "removed", medium, chunk key hex...]...]}.
A script, so that vLLM (which may start processes) runs under a __main__ guard.
"""
import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    spec = json.loads(open(spec_path).read())
    kwargs = {}
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype="float32", enforce_eager=True,
              max_model_len=spec.get("max_model_len", 2048), enable_prefix_caching=False, seed=0,
              max_num_seqs=4, disable_log_stats=not spec.get("log_stats", False), **kwargs)
    events: list = []
    if spec.get("kv_transfer_config"):   # keep a copy of every KV event the connector hands vLLM (or still holds)
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        take = connector.take_events

        def recording_take():
            got = list(take())
            events.extend(got)
            return got
        connector.take_events = recording_take
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=0)
    outputs, logprobs, cached = [], [], []
    for prompt in spec["prompts"]:   # one at a time: each may hit what the ones before stored
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        completion = out.outputs[0]
        outputs.append(list(completion.token_ids))
        logprobs.append([step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs)])
        cached.append(out.num_cached_tokens or 0)
    stats = None
    if spec.get("kv_transfer_config"):
        connector.take_events()
        from tiercache.connectors.vllm import _ENGINES
        (shared,) = _ENGINES.values()
        stats = json.loads(json.dumps(connector.stats(), default=str))
        shared.stack.close()
    with open(out_path, "w") as f:
        json.dump({"outputs": outputs, "logprobs": logprobs, "num_cached_tokens": cached, "connector": stats,
                   "stored_events": [[e.medium, len(e.block_hashes)] for e in events if isinstance(e, BlockStored)],
                   "removed_events": [[e.medium, len(e.block_hashes)] for e in events if isinstance(e, BlockRemoved)],
                   "event_order": [["stored" if isinstance(e, BlockStored) else "removed", e.medium,
                                    *(bytes(h).hex() for h in e.block_hashes)] for e in events]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
