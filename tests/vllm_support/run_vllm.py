"""Run real vLLM (CPU) on token-id prompts, with or without tiercache's connector, and write what happened.

    python tests/vllm_support/run_vllm.py SPEC.json OUT.json

vLLM runs as users run it: engine core and one worker per rank in processes of their own
(multiprocessing at its default), so everything is observed through vLLM's own outward channels —
request outputs, its Prometheus metrics (`LLM.get_metrics`, where the connector's counters appear as
``vllm:tiercache_*``) and its KV-event publisher (ZMQ), as a router would see them.

SPEC: {"model": dir, "tp": 1, "max_tokens": n, "prefix_caching": false, "kv_transfer_config": {...} or null,
       "dtype": "float32" (the default; Qwen3-Next's CPU kernels need "bfloat16"), "max_num_batched_tokens": n,
       "phases": [{"prompts": [[ids...] or {"ids": [...], "cache_salt": s, "continues": b}...], "together": false,
                   "reset_prefix_cache": false, "pause_s": 0}...],
       "events_port": port or null}
(``"prompts"`` alone is one phase of prompts sent one at a time). A phase with ``together`` sends its
prompts as one batch; a prompt with ``continues`` says so in its ``kv_transfer_params`` (a conversation's
turn, whose next resends it); ``reset_prefix_cache`` drops vLLM's own L0 prefix cache before the phase; ``pause_s``
waits that long before it (vLLM steps only while it has requests).
OUT: {"outputs": [[ids...]], "logprobs": [[chosen token's logprob...]], "num_cached_tokens": [n...] (flat, in
prompt order), "metrics": {"hit_tokens": n, "tier/disk/loaded": n, ...} or null, "kv_cache_usage": float,
"phase_ends": [outputs after each phase...], "phase_metrics": [metrics after each phase...],
"stored_events" / "removed_events": [[medium, chunks]...], "event_order": [["stored" | "removed", medium,
chunk key hex...]...]}.
A script, so that vLLM (which starts processes) runs under a __main__ guard.
"""
import json
import sys
import threading
import time


def subscribe(port: int, events: list, stop: threading.Event) -> threading.Thread:
    """Collect every KV event batch vLLM publishes on ``port`` (its ZMQ publisher)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def run() -> None:
        while not stop.is_set():
            if sub.poll(50):
                _, _, payload = sub.recv_multipart()
                events.extend(decoder.decode(payload).events)
        sub.close(linger=0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def tiercache_metrics(llm) -> dict:
    """The connector's counters from vLLM's Prometheus metrics: ``vllm:tiercache_<name>`` as ``name``, per
    tier as ``tier/<tier>/<name>``, per link as ``link/<link>/bytes``."""
    out: dict = {}
    for metric in llm.get_metrics():
        name = metric.name
        if not name.startswith("vllm:tiercache_") or not hasattr(metric, "value"):
            continue
        short = name.removeprefix("vllm:tiercache_").removesuffix("_total")
        if short.startswith("tier_"):
            key = f"tier/{metric.labels['tier']}/{short.removeprefix('tier_')}"
        elif short.startswith("link_"):
            key = f"link/{metric.labels['link']}/{short.removeprefix('link_')}"
        else:
            key = short
        out[key] = out.get(key, 0) + int(metric.value)
    return out


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    spec = json.loads(open(spec_path).read())
    kwargs = {}
    connected = bool(spec.get("kv_transfer_config"))
    if connected:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    events: list = []
    stop = threading.Event()
    subscriber = None
    if spec.get("events_port"):
        kwargs["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": f"tcp://*:{spec['events_port']}"}
        subscriber = subscribe(spec["events_port"], events, stop)
    if spec.get("max_num_batched_tokens"):      # a prefill step ends every this many tokens (chunked prefill)
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    llm = LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
              max_model_len=spec.get("max_model_len", 2048), enable_prefix_caching=spec.get("prefix_caching", False),
              seed=0, max_num_seqs=8, tensor_parallel_size=spec.get("tp", 1), disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=0)
    continuing = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=0,
                                extra_args={"kv_transfer_params": {"continues": True}})
    phases = spec.get("phases") or [{"prompts": spec["prompts"]}]
    outputs, logprobs, cached = [], [], []
    phase_ends, phase_metrics = [], []     # after each phase: outputs so far, the connector's counters so far
    for phase in phases:
        time.sleep(phase.get("pause_s", 0))
        if phase.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        groups = [phase["prompts"]] if phase.get("together") else [[p] for p in phase["prompts"]]
        for group in groups:   # one at a time unless together: each may hit what the ones before stored
            prompts = [{"prompt_token_ids": p} if isinstance(p, list) else
                       {"prompt_token_ids": p["ids"], **({"cache_salt": p["cache_salt"]} if "cache_salt" in p else {})}
                       for p in group]
            per_prompt = [continuing if isinstance(p, dict) and p.get("continues") else params for p in group]
            for out in llm.generate(prompts, per_prompt, use_tqdm=False):
                completion = out.outputs[0]
                outputs.append(list(completion.token_ids))
                logprobs.append([step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs)])
                cached.append(out.num_cached_tokens or 0)
        phase_ends.append(len(outputs))
        phase_metrics.append(tiercache_metrics(llm) if connected else None)
    usage = next((m.value for m in llm.get_metrics() if m.name == "vllm:kv_cache_usage_perc"), None)
    metrics = tiercache_metrics(llm) if connected else None
    if subscriber is not None:
        quiet_since, seen = time.monotonic(), len(events)
        while time.monotonic() - quiet_since < 1.0:        # until the publisher has been quiet for a second
            time.sleep(0.1)
            if len(events) != seen:
                quiet_since, seen = time.monotonic(), len(events)
        stop.set()
        subscriber.join()
    ours = [e for e in events if isinstance(e, (BlockStored, BlockRemoved)) and e.medium in ("CPU", "DISK", "REMOTE")]
    with open(out_path, "w") as f:
        json.dump({"outputs": outputs, "logprobs": logprobs, "num_cached_tokens": cached, "metrics": metrics,
                   "kv_cache_usage": usage, "phase_ends": phase_ends, "phase_metrics": phase_metrics,
                   "stored_events": [[e.medium, len(e.block_hashes)] for e in ours if isinstance(e, BlockStored)],
                   "removed_events": [[e.medium, len(e.block_hashes)] for e in ours if isinstance(e, BlockRemoved)],
                   "event_order": [["stored" if isinstance(e, BlockStored) else "removed", e.medium,
                                    *(bytes(h).hex() for h in e.block_hashes)] for e in ours]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
