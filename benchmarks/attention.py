"""The reference engine's attention against the way it was computed before, side by side on one thread.

    python benchmarks/attention.py [--reps 7]

Before (session 26 and earlier): each KV head's keys and values repeated for its query heads
(``repeat_interleave``) and one ``scaled_dot_product_attention`` call per tile of query rows with a boolean
causal mask over the whole context. Now (`tiercache.engine.model._attend`): a KV head's query heads stacked into
one matrix product against its keys, and only the columns a query may not see yet masked. Prints, per shape, the
median milliseconds of each (alternated, ``--reps`` each) and their ratio; then the reference engine end to end
(embedded model, torch on one thread): a cold 2,000-token prompt, and a 330-token turn after it (its first 2,000
tokens hit in L0), with either function in the model.
"""
import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from tiercache.engine import EngineConfig, SamplingParams, model
from tiercache.engine.llm import LLM

SHAPES = {                      # (context, new rows): the embedded model's 8 query heads over 2 KV heads of 32
    "turn: 330 after 2,000": (2330, 330),
    "prefill: 2,048": (2048, 2048),
    "question: 64 after 4,096": (4160, 64),
    "decode: 1 after 2,048": (2049, 1),
}


def repeated_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The engine's attention before this change (same arguments and result as `model._attend`)."""
    new, heads, _ = q.shape
    ctx, kv_heads, _ = keys.shape
    group = heads // kv_heads
    keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
    values = values.transpose(0, 1).repeat_interleave(group, dim=0)
    out = torch.empty_like(q)
    tile = max(1, model.ATTN_TILE_BYTES // (ctx * heads * q.element_size()))
    for lo in range(0, new, tile):
        hi = min(new, lo + tile)
        mask = torch.ones(hi - lo, ctx, dtype=torch.bool).tril(diagonal=ctx - new + lo) if new > 1 else None
        out[lo:hi] = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), keys, values,
                                                    attn_mask=mask).transpose(0, 1)
    return out


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernels(reps: int) -> None:
    print("| shape | before ms | now ms | now / before |")
    print("| --- | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(0)
    for name, (ctx, new) in SHAPES.items():
        q = torch.randn(new, 8, 32, generator=g)
        keys, values = torch.randn(2, ctx, 2, 32, generator=g)
        assert torch.allclose(model._attend(q, keys, values), repeated_sdpa(q, keys, values), atol=1e-5)
        before, now = [], []
        for _ in range(reps):                        # alternated, so a noisy stretch hits both
            before.append(median_ms(lambda: repeated_sdpa(q, keys, values), 1))
            now.append(median_ms(lambda: model._attend(q, keys, values), 1))
        b, n = statistics.median(before), statistics.median(now)
        print(f"| {name} | {b:.2f} | {n:.2f} | {n / b:.2f} |", flush=True)


def engine(reps: int) -> None:
    llm = LLM(engine_cfg=EngineConfig(num_blocks=2048))
    params = SamplingParams(max_tokens=1)
    rng = random.Random(0)
    implementations = {"before": repeated_sdpa, "now": model._attend}
    results: dict[str, dict[str, list[float]]] = {k: {"cold": [], "turn": []} for k in implementations}
    llm.generate([[rng.randrange(1, 250) for _ in range(64)]], params)
    try:
        for _ in range(reps):
            for label, fn in implementations.items():
                model._attend = fn
                history = [rng.randrange(1, 250) for _ in range(2000)]
                start = time.perf_counter()
                llm.generate([history], params)
                results[label]["cold"].append(time.perf_counter() - start)
                turn = history + [rng.randrange(1, 250) for _ in range(330)]
                start = time.perf_counter()
                out = llm.generate([turn], params)[0]
                results[label]["turn"].append(time.perf_counter() - start)
                assert out.l0_hit_tokens == 2000
    finally:
        model._attend = implementations["now"]
        llm.close()
    print()
    print("| engine, one thread | before ms | now ms | now / before |")
    print("| --- | ---: | ---: | ---: |")
    for what, label in (("cold", "cold prompt of 2,000 tokens"), ("turn", "330-token turn after it (L0 hit)")):
        b = statistics.median(results["before"][what]) * 1e3
        n = statistics.median(results["now"][what]) * 1e3
        print(f"| {label} | {b:.1f} | {n:.1f} | {n / b:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    kernels(args.reps)
    engine(args.reps)


if __name__ == "__main__":
    main()
