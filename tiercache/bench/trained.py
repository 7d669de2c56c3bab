"""A reference-engine model trained for a few minutes on a synthetic corpus, for `bench codecs`' accuracy runs.

Random weights give near-uniform next-token distributions that hide what a
lossy KV codec changes, so `tiercache bench codecs` runs on a model that
has learnt something: the reference engine's default Llama shape, trained
with transformers' LlamaForCausalLM on byte tokens of a synthetic language —
words drawn from a sparse bigram chain, sentences, and documents that repeat
their own earlier sentences (so predictions lean on attention over the cached
prefix, the KV a codec touches). The checkpoint is a Hugging Face directory
that the reference engine (``model_path``) and vLLM both load; it is cached
under ``$XDG_CACHE_HOME/tiercache/models`` by a digest of everything that
shapes it. Runs in the benchmark's process, on CPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tiercache.engine.config import ModelConfig

BOS, EOS = 256, 257


@dataclass(frozen=True, slots=True)
class TrainSpec:
    steps: int = 300
    seq_len: int = 320       # the accuracy prompts and their answers fit (positions it never saw stay out)
    batch: int = 4
    lr: float = 3e-3
    seed: int = 0
    words: int = 400

    def digest(self, cfg: ModelConfig) -> str:
        text = json.dumps({"train": asdict(self), "model": asdict(cfg), "v": 1}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class SyntheticLanguage:
    """Documents of sentences over a made-up vocabulary: each word has a few likely successors, and a
    document repeats some of its own sentences later on."""

    def __init__(self, seed: int = 0, words: int = 400) -> None:
        rng = random.Random(seed)
        letters = "abcdefghijklmnopqrstuvwxyz"
        self.words = list(dict.fromkeys("".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))
                                        for _ in range(words * 2)))[:words]
        self.next = [[rng.randrange(len(self.words)) for _ in range(4)] for _ in self.words]
        self.rng = rng

    def sentence(self) -> str:
        w = self.rng.randrange(len(self.words))
        out = []
        for _ in range(self.rng.randint(5, 12)):
            out.append(self.words[w])
            w = self.next[w][min(3, int(self.rng.expovariate(1.2)))] if self.rng.random() < 0.9 \
                else self.rng.randrange(len(self.words))
        return " ".join(out).capitalize() + ". "

    def document(self, nbytes: int) -> list[int]:
        said: list[str] = []
        text = ""
        while len(text) < nbytes:
            s = self.rng.choice(said) if said and self.rng.random() < 0.35 else self.sentence()
            said.append(s)
            text += s
        return [BOS, *text.encode()[:nbytes - 1]]


def _hf_config(cfg: ModelConfig):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                       rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position,
                       tie_word_embeddings=cfg.tie_embeddings, bos_token_id=BOS, eos_token_id=EOS,
                       torch_dtype="float32")


def train(path: Path, cfg: ModelConfig, spec: TrainSpec, progress=None) -> dict:
    """Train and save a checkpoint at ``path``; returns what the training did."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_hf_config(cfg))
    model.train()
    language = SyntheticLanguage(spec.seed, spec.words)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=spec.steps, pct_start=0.1)
    start, losses = time.perf_counter(), []
    for _ in range(spec.steps):
        batch = torch.tensor([language.document(spec.seq_len) for _ in range(spec.batch)])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None:
            progress()
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    info = {"steps": spec.steps, "seconds": round(time.perf_counter() - start, 1),
            "loss_first": round(sum(losses[:10]) / 10, 3), "loss_last": round(sum(losses[-10:]) / 10, 3),
            "spec": asdict(spec)}
    (tmp / "training.json").write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)
    return info


def trained_model(cfg: ModelConfig | None = None, spec: TrainSpec | None = None, cache: str | None = None,
                  progress=None) -> tuple[Path, dict]:
    """The cached checkpoint for (cfg, spec), trained first if there is none: (its directory, training info)."""
    cfg, spec = cfg or ModelConfig(), spec or TrainSpec()
    root = Path(cache or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiercache" / "models"
    path = root / f"synthetic-{spec.digest(cfg)}"
    if not (path / "training.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        train(path, cfg, spec, progress)
    return path, json.loads((path / "training.json").read_text())
