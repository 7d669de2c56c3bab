"""Model weights: a deterministic seeded initialisation, or a local Hugging Face Llama directory.

Nothing is downloaded. A directory holds ``config.json`` (a LlamaConfig) and
``*.safetensors`` files with Hugging Face parameter names.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tiercache.engine.config import ModelConfig
from tiercache.engine.model import LlamaModel
from tiercache.errors import ConfigError

LOGIT_STD = 8.0  # seeded models get peaked logits, so greedy choices are robust to float rounding


def seeded_model(cfg: ModelConfig, seed: int = 0) -> LlamaModel:
    """Random weights from a fixed seed: identical in every process and on every machine."""
    model = LlamaModel(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("gate_proj.bias"):      # a linear-attention layer's gates start mostly open
                p.fill_(2.0)
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=g) * (LOGIT_STD / math.sqrt(cfg.hidden_size)))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model.to(getattr(torch, cfg.dtype)).eval()


def config_from_hf(path: Path, dtype: str = "float32") -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError("model_path", str(path), f"no readable config.json: {err}") from None
    try:
        heads = raw["num_attention_heads"]
        return ModelConfig(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position=raw.get("max_position_embeddings", 4096),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=dtype,
        )
    except KeyError as err:
        raise ConfigError("model_path", str(path), f"config.json lacks {err.args[0]!r}") from None


def _hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def load_hf_model(path: str | Path, dtype: str = "float32") -> LlamaModel:
    from safetensors.torch import load_file

    path = Path(path)
    cfg = config_from_hf(path, dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError("model_path", str(path), "no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    model = LlamaModel(cfg)
    params = dict(model.named_parameters())
    missing = [n for n in params if _hf_name(n) not in tensors and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if missing:
        raise ConfigError("model_path", str(path), f"checkpoint lacks {', '.join(_hf_name(n) for n in missing[:4])}")
    with torch.no_grad():
        for name, p in params.items():
            src = tensors.get(_hf_name(name))
            if src is None:
                continue
            if tuple(src.shape) != tuple(p.shape):
                raise ConfigError("model_path", str(path), f"{_hf_name(name)} has shape {tuple(src.shape)}, "
                                  f"config implies {tuple(p.shape)}")
            p.copy_(src)
    return model.to(getattr(torch, dtype)).eval()


def save_hf_model(model: LlamaModel, path: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` that `load_hf_model` (and transformers) can read."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position, "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu", "torch_dtype": c.dtype, "bos_token_id": 256, "eos_token_id": 257,
    }, indent=2))
    state = {_hf_name(n): p.detach().contiguous() for n, p in model.named_parameters()}
    if c.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
