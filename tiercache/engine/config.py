"""Reference-engine configuration: the model's shape and the engine's limits.

Validated on construction; errors name the field (`ConfigError`).
"""
from __future__ import annotations

from dataclasses import dataclass

from tiercache.engine.preemption import preemption_policies
from tiercache.errors import ConfigError

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-style decoder. The embedded default is small enough to prefill 2K tokens quickly on 2 cores.

    ``layer_types`` makes it hybrid (empty: every layer full attention): ``sliding_attention`` layers attend to
    the last ``sliding_window`` tokens, ``linear_attention`` layers keep a gated linear recurrence's state of
    ``hidden_size`` values instead of KV (`tiercache.engine.model.LinearAttention`)."""
    vocab_size: int = 320
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 688
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 32768
    tie_embeddings: bool = False
    dtype: str = "float32"
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    @property
    def hybrid(self) -> bool:
        return any(t != "full_attention" for t in self.layer_types)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}", getattr(self, name), "must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.num_kv_heads", self.num_kv_heads,
                              f"must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ConfigError("model.head_dim", self.head_dim, "must be even for rotary embeddings")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("model.dtype", self.dtype, "expected float32, bfloat16 or float16")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ConfigError("model.layer_types", self.layer_types,
                              f"expected one of {', '.join(LAYER_TYPES)} for each of the {self.num_layers} layers")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ConfigError("model.sliding_window", self.sliding_window, "must be positive with sliding layers")


# The embedded hybrid model: sliding-window layers, a linear-attention layer and a full-attention one
HYBRID_MODEL = ModelConfig(layer_types=("sliding_attention", "linear_attention", "sliding_attention",
                                        "full_attention"), sliding_window=48)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048     # token budget of one step; longer prefills are chunked
    preemption: str = "recompute"          # recompute | swap (to L1) | auto: by cost (tiercache.engine.preemption)
    enable_prefix_caching: bool = True     # L0 hash hits inside the engine's own pool
    device: str = "cpu"
    seed: int = 0
    tensor_parallel_size: int = 1          # simulated ranks: each holds num_kv_heads / tp of the KV heads and
                                           # runs its own connector worker (own L1 slab, files, connections)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"engine.{name}", getattr(self, name), "must be positive")
        if self.preemption not in preemption_policies:
            raise ConfigError("engine.preemption", self.preemption,
                              f"expected one of {', '.join(preemption_policies.names())}")
