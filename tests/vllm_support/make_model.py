"""A tiny Llama with random weights from a fixed seed and a small trained tokenizer, saved for vLLM (no hub)."""
from pathlib import Path


def make_tiny_llama(path: Path, num_kv_heads: int = 2) -> Path:
    """Two KV heads by default, so that at TP=2 each rank holds a head of its own (not a replica)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = [f"tiered kv cache block {i} offload prefix reuse layer head token {i * 7}" for i in range(200)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path
