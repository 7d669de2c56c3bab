"""`tiercache bench codecs`: what each chunk codec costs and what the lossy ones change.

- `bench_speed`: bytes per chunk against raw, encode and decode GB/s (of raw bytes, medians) on KV of a
  realistic shape, beside this machine's disk write (fdatasync) and read rates of the same chunks,
  timed in the same run.
- `kv_error`: reconstruction error (relative L2 and max abs, per layer) on the KV the trained model
  computed for the accuracy prompts.
- `bench_accuracy`: on the reference engine with a trained model (`tiercache.bench.trained`), greedy
  outputs when every prompt's prefix comes back from disk through the codec, against a run without
  tiers: first token and whole sequence identical (%), |Δ logprob| of the chosen tokens, KL of the
  next-token distributions (over each request's steps up to its first difference).
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tiercache.bench.disk import drop_page_cache, time_file_reads, time_file_writes
from tiercache.bench.tiers import SHAPES
from tiercache.codecs import codecs
from tiercache.config import TierCacheConfig
from tiercache.contracts.layout import ChunkLayout
from tiercache.engine import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from tiercache.wire.chunk_format import ChunkFormat

BLOCK = 16


def realistic_kv(shape: str, chunk_tokens: int, seed: int = 0) -> torch.Tensor:
    """One chunk ``[layers, k/v, blocks, tokens, heads, head_dim]`` with K's per-channel spread (a few
    channels an order of magnitude above the rest, as RoPE'd keys have) and plain Gaussian V."""
    geo = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((geo.num_layers, 2, chunk_tokens // BLOCK, BLOCK, geo.num_kv_heads, geo.head_dim), generator=g)
    spread = torch.exp(torch.randn((geo.num_layers, geo.num_kv_heads, geo.head_dim), generator=g) * 0.5)
    spread[..., :4] *= 10
    kv[:, 0] *= spread[:, None, None]
    return kv.to(getattr(torch, geo.dtype))


def _median(f, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _disk_rates(raw: memoryview, copies: int, reps: int, directory: str | None) -> tuple[float, float, bool]:
    """Write (with fdatasync) and read back ``copies`` files of ``raw``: GB/s each, medians of ``reps``, and
    whether the reads were cold (the page cache dropped before each, where that is permitted)."""
    root = Path(tempfile.mkdtemp(prefix="tiercache-codecs-", dir=directory))
    paths = [root / f"{i}.bin" for i in range(copies)]
    sink = memoryview(bytearray(len(raw)))
    try:
        nbytes = len(raw) * copies
        write_s = statistics.median(time_file_writes(paths, [raw] * copies, fsync=True) for _ in range(reps))
        reads, cold = [], False
        for _ in range(reps):
            cold = drop_page_cache()
            reads.append(time_file_reads(paths, sink))
        return nbytes / write_s / 1e9, nbytes / statistics.median(reads) / 1e9, cold
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
        root.rmdir()


def bench_speed(shape: str = "llama-8b", chunk_tokens: int = 256, reps: int = 5, names: list[str] | None = None,
                directory: str | None = None, progress=None) -> dict:
    kv = realistic_kv(shape, chunk_tokens)
    layout = ChunkLayout(SHAPES[shape].dtype, tuple(kv.shape))
    raw = memoryview(kv.view(-1).view(torch.uint8).numpy())
    out = memoryview(bytearray(layout.raw_len))
    disk_write, disk_read, cold = _disk_rates(raw, 4, reps, directory)
    rows = []
    for name in names or codecs.names():
        codec = ChunkFormat(name).codec_for(layout)
        payload = codec.encode(raw, layout)
        size = len(memoryview(payload).cast("B"))
        encode = _median(lambda: codec.encode(raw, layout), reps)
        decode = _median(lambda: codec.decode_into(memoryview(payload).cast("B"), layout, out), reps)
        rows.append({"codec": name, "lossy": codecs.get(name).lossy, "chunk_bytes": layout.raw_len,
                     "payload_bytes": size, "ratio": round(size / layout.raw_len, 4),
                     "encode_gbps": round(layout.raw_len / encode / 1e9, 2),
                     "decode_gbps": round(layout.raw_len / decode / 1e9, 2),
                     "encode_vs_disk_write": round(layout.raw_len / encode / 1e9 / disk_write, 2),
                     "decode_vs_disk_read": round(layout.raw_len / decode / 1e9 / disk_read, 2)})
        if progress is not None:
            progress()
    return {"shape": shape, "dtype": layout.dtype, "chunk_tokens": chunk_tokens, "chunk_shape": list(layout.shape),
            "disk_write_gbps": round(disk_write, 2), "disk_read_gbps": round(disk_read, 2),
            "disk_reads": "cold (page cache dropped)" if cold else "page cache (dropping it is not permitted here)",
            "codecs": rows}


def kv_error(kv: torch.Tensor, names: list[str]) -> list[dict]:
    """Round-trip error per codec and layer on ``kv`` (``[layers, k/v, blocks, tokens, heads, dim]``)."""
    dtype = str(kv.dtype).removeprefix("torch.")
    layout = ChunkLayout(dtype, tuple(kv.shape))
    raw = memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy())
    rows = []
    for name in names:
        codec = ChunkFormat(name).codec_for(layout)
        out = bytearray(layout.raw_len)
        codec.decode_into(memoryview(codec.encode(raw, layout)).cast("B"), layout, memoryview(out))
        back = torch.frombuffer(out, dtype=torch.uint8).view(kv.dtype).view(kv.shape).float()
        diff, ref = back - kv.float(), kv.float()
        for layer in range(kv.shape[0]):
            for plane, label in enumerate("KV"):
                d, r = diff[layer, plane], ref[layer, plane]
                rows.append({"codec": name, "layer": layer, "kv": label,
                             "rel_l2": round(float(d.norm() / r.norm().clamp_min(1e-30)), 5),
                             "max_abs": round(float(d.abs().max()), 5), "max_ref": round(float(r.abs().max()), 3)})
    return rows


def accuracy_prompts(docs: int = 4, requests: int = 16, prefix_bytes: int = 256, suffix_bytes: int = 32,
                     seed: int = 1) -> list[list[int]]:
    """The ``docs`` workload's shape (several documents, questions coming back to them) in the trained
    model's own language."""
    from tiercache.bench.trained import SyntheticLanguage

    language = SyntheticLanguage(seed=0)          # the words the model learnt; other documents than it saw
    language.rng = random.Random(seed)
    texts = [language.document(prefix_bytes) for _ in range(docs)]
    prompts = []
    for i in range(requests):
        question = language.sentence().encode()[:suffix_bytes]
        prompts.append(texts[i % docs] + list(question))
    return prompts


def _generate(model_path: Path, dtype: str, prompts: list[list[int]], max_tokens: int,
              offload: TierCacheConfig | None) -> tuple[list, dict]:
    """(per request: tokens, log-softmax per step, external hit tokens), connector stats."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with LLMEngine(model_cfg=ModelConfig(dtype=dtype), engine_cfg=EngineConfig(enable_prefix_caching=False),
                   offload=offload, model_path=str(model_path), record_logits=True) as engine:
        out = []
        for p in prompts:
            seq = engine.add_request(p, params)
            engine.run()
            logprobs = torch.stack([torch.log_softmax(x.float(), -1) for x in seq.logits])
            out.append((list(seq.output_token_ids), logprobs, seq.metrics.external_hit_tokens))
        stats = engine.stats().get("connector", {})
        return out, stats


def bench_accuracy(model_path: Path, names: list[str], dtype: str = "bfloat16", max_tokens: int = 16,
                   prompts: list[list[int]] | None = None, directory: str | None = None, progress=None) -> dict:
    prompts = prompts or accuracy_prompts()
    base, _ = _generate(model_path, dtype, prompts, max_tokens, None)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix="tiercache-codecs-", dir=directory) as tmp:
            cfg = TierCacheConfig().replace(keys={"block_size": BLOCK, "chunk_tokens": 64},
                                            cpu={"capacity": "64MiB", "prefault": False}, format={"codec": name},
                                            disk={"enabled": True, "path": tmp, "write_mode": "write-through"})
            _generate(model_path, dtype, prompts, max_tokens, cfg)          # stores every prefix down to disk
            runs, stats = _generate(model_path, dtype, prompts, max_tokens, cfg)   # a fresh engine loads them
        rows.append(compare(name, base, runs, stats))
        if progress is not None:
            progress()
    return {"model": str(model_path), "dtype": dtype, "requests": len(prompts), "max_tokens": max_tokens,
            "prompt_tokens": statistics.mean(len(p) for p in prompts), "results": rows}


def compare(name: str, base: list, runs: list, stats: dict) -> dict:
    """How far ``runs`` (per request: tokens, log-softmax per step, hit tokens) are from ``base``: identical
    first tokens and sequences, and — over each request's steps up to its first differing token, where both
    saw the same context — |Δ logprob| of the base's token and KL(base ‖ run)."""
    first = same = 0
    dlogp: list[float] = []
    kl: list[float] = []
    for (want, lp_want, _), (got, lp_got, _) in zip(base, runs):
        first += want[0] == got[0]
        same += want == got
        upto = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want) - 1) + 1
        for step in range(upto):                  # the same context in both runs up to the first difference
            dlogp.append(abs(float(lp_want[step, want[step]] - lp_got[step, want[step]])))
            p = lp_want[step].exp()
            kl.append(float((p * (lp_want[step] - lp_got[step])).sum()))
    n = len(base)
    disk = stats.get("tiers", {}).get("disk", {})
    return {"codec": name, "first_token_identical_pct": round(100 * first / n, 2),
            "sequence_identical_pct": round(100 * same / n, 2),
            "mean_abs_dlogprob": round(statistics.mean(dlogp), 5), "max_abs_dlogprob": round(max(dlogp), 5),
            "mean_kl_nats": round(statistics.mean(kl), 6), "steps_compared": len(kl),
            "hit_tokens_per_request": round(statistics.mean(h for *_, h in runs), 1),
            "disk_chunks_loaded": disk.get("loaded", 0)}


def model_kv(model_path: Path, dtype: str, prompt: list[int]) -> torch.Tensor:
    """The KV the model computes for ``prompt``, as chunks of whole blocks: ``[layers, 2, blocks, ...]``."""
    with LLMEngine(model_cfg=ModelConfig(dtype=dtype), engine_cfg=EngineConfig(enable_prefix_caching=False),
                   model_path=str(model_path)) as engine:
        seq = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))   # alive after its prefill
        blocks: list[int] = []
        while engine.has_unfinished():
            engine.step()
            if seq.seq_id in engine.blocks.tables:
                blocks = engine.blocks.block_ids(seq.seq_id)
        full = len(prompt) // BLOCK
        return engine.kv.kv[:, :, torch.tensor(blocks[:full])].clone()


def error_summary(rows: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["codec"] for r in rows):
        mine = [r for r in rows if r["codec"] == name]
        for plane in "KV":
            part = [r for r in mine if r["kv"] == plane]
            out.append({"codec": name, "kv": plane, "rel_l2_mean": round(statistics.mean(r["rel_l2"] for r in part), 5),
                        "rel_l2_max": max(r["rel_l2"] for r in part), "max_abs": max(r["max_abs"] for r in part)})
    return out


def bench_codecs(names: list[str], accuracy_codecs: list[str] | None, shape: str, chunk_tokens: int, reps: int,
                 model: str | None, train_steps: int | None, requests: int, max_tokens: int,
                 directory: str | None, progress=None) -> dict:
    """Everything `tiercache bench codecs` reports: speed and bytes, KV error, and (unless
    ``accuracy_codecs`` is None) the accuracy of a model served from each codec's chunks."""
    from tiercache.bench.trained import TrainSpec, trained_model

    lossy = [n for n in names if codecs.get(n).lossy]
    report: dict = {"speed": bench_speed(shape, chunk_tokens, reps, names, directory, progress)}
    report["synthetic_kv_error"] = error_summary(kv_error(realistic_kv(shape, chunk_tokens, seed=1), lossy))
    if accuracy_codecs:
        if model:
            path, info = Path(model), {"source": "local checkpoint"}
        else:
            spec = TrainSpec() if train_steps is None else TrainSpec(steps=train_steps)
            path, info = trained_model(spec=spec, progress=progress)
            info = {"source": "reference model trained on the synthetic corpus (tiercache.bench.trained)", **info}
        prompts = accuracy_prompts(requests=requests)
        report["model"] = {"path": str(path), **info}
        report["model_kv_error"] = kv_error(model_kv(path, "bfloat16", prompts[0]), lossy)
        report["accuracy"] = bench_accuracy(path, accuracy_codecs, "bfloat16", max_tokens, prompts, directory, progress)
    return report
