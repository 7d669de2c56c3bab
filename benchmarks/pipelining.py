"""Time to first token on a full L1 hit, with and without layerwise pipelining, side by side.

    python benchmarks/pipelining.py [--layers 16] [--prefix 2048] [--requests 9]

A 16-layer model with 8 KV heads of dim 64 (64 KiB of KV per token, fp32) so that
loading a 2K-token prefix (128 MiB) costs about as much as computing the
request's few new tokens. Two engines — loads whole (all layers before layer 0
runs) and layerwise (layer l computes while l+1 copies) — take turns on the same
prompts; medians are reported.
"""
from __future__ import annotations

import argparse
import random
import statistics

from tiercache.config import TierCacheConfig
from tiercache.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=16)
    p.add_argument("--requests", type=int, default=9)
    p.add_argument("--compute-threads", type=int, default=0,
                   help="torch threads for the forward (0: torch's default); 1 leaves a core to the copies")
    args = p.parse_args()
    if args.compute_threads:
        import torch
        torch.set_num_threads(args.compute_threads)
    model = ModelConfig(num_layers=args.layers, hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=64,
                        intermediate_size=512)
    engine_cfg = EngineConfig(enable_prefix_caching=False, num_blocks=-(-(args.prefix + args.suffix + 8) // 16) * 2)
    rng = random.Random(0)
    prefix = [256] + [rng.randrange(32, 127) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(32, 127) for _ in range(args.suffix)] for _ in range(args.requests + 1)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engines = {}
    for layerwise in (False, True):
        cfg = TierCacheConfig().replace(cpu={"capacity": "1GiB"},
                                        transfer={"layerwise": layerwise, "inline_host_copies": "off"})
        engines[layerwise] = LLMEngine(model_cfg=model, engine_cfg=engine_cfg, offload=cfg)
    ttft: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[list[int]]] = {False: [], True: []}
    try:
        for i, prompt in enumerate(prompts):
            for layerwise in ((False, True) if i % 2 else (True, False)):
                engine = engines[layerwise]
                seq = engine.add_request(prompt, params)
                engine.run()
                if i:   # request 0 fills L1; the rest are full hits
                    assert seq.metrics.external_hit_tokens >= args.prefix - 16
                    ttft[layerwise].append(seq.metrics.ttft)
                    outputs[layerwise].append(seq.output_token_ids)
    finally:
        for engine in engines.values():
            engine.close()
    whole, layered = statistics.median(ttft[False]) * 1e3, statistics.median(ttft[True]) * 1e3
    kv_mib = (args.prefix * args.layers * 2 * 8 * 64 * 4) / 2**20
    print(f"{args.layers} layers, {args.prefix}-token hit ({kv_mib:.0f} MiB of KV from L1), "
          f"{args.suffix} new tokens, median of {args.requests}")
    print(f"TTFT whole-load  p50 {whole:7.2f} ms")
    print(f"TTFT layerwise   p50 {layered:7.2f} ms   ({whole / layered:.2f}x)")
    print(f"outputs identical: {outputs[False] == outputs[True]}")


if __name__ == "__main__":
    main()
