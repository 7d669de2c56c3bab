"""Tiny models with random weights from a fixed seed and a small trained tokenizer, saved for vLLM (no hub).

One builder per model family the connector is tested on: a Llama (full attention), a Gemma 3 (sliding
window beside full attention), a Qwen3-Next (gated-delta-net linear attention beside full attention) and a
DeepSeek-V2 (MLA). Each is small enough to load in seconds on a CPU and keeps what makes its family's KV
what it is: the window pattern, the linear-attention state, the latent sizes vLLM's MLA backend accepts.
"""
from pathlib import Path


def _save_tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = [f"tiered kv cache block {i} offload prefix reuse layer head token {i * 7}" for i in range(200)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def _save(path: Path, model_class, config) -> Path:
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_llama(path: Path, num_kv_heads: int = 2) -> Path:
    """Two KV heads by default, so that at TP=2 each rank holds a head of its own (not a replica)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _save_tokenizer(path)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    return _save(path, LlamaForCausalLM, config)


def make_tiny_gemma3(path: Path, sliding_window: int = 128) -> Path:
    """Gemma 3's text model: three sliding-window layers to one of full attention (its 5:1 pattern, shortened),
    a window of ``sliding_window`` tokens."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fast = _save_tokenizer(path)
    layer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    config = Gemma3TextConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              max_position_embeddings=4096, sliding_window=sliding_window, layer_types=layer_types,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    config.architectures = ["Gemma3ForCausalLM"]
    return _save(path, Gemma3ForCausalLM, config)


def make_tiny_qwen3_next(path: Path) -> Path:
    """Qwen3-Next: gated-delta-net linear attention in three layers of four, full attention in the fourth, and
    a small mixture of experts."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fast = _save_tokenizer(path)
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    config = Qwen3NextConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, layer_types=layer_types,
                             linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                             linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1,
                             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    config.architectures = ["Qwen3NextForCausalLM"]
    return _save(path, Qwen3NextForCausalLM, config)


def make_tiny_deepseek_v2(path: Path) -> Path:
    """DeepSeek-V2 with MLA at the latent sizes vLLM's CPU MLA backend accepts (``kv_lora_rank`` 512,
    ``qk_rope_head_dim`` 64: a 576-wide latent), two layers, a small mixture of experts in the second; bf16,
    which vLLM's CPU MoE kernels need (as Qwen3-Next's linear-attention kernels do)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    fast = _save_tokenizer(path)
    config = DeepseekV2Config(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
                              qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                              first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096,
                              bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    config.architectures = ["DeepseekV2ForCausalLM"]
    return _save(path, DeepseekV2ForCausalLM, config)


MAKERS = {"llama": make_tiny_llama, "gemma3": make_tiny_gemma3, "qwen3_next": make_tiny_qwen3_next,
          "deepseek_v2": make_tiny_deepseek_v2}
