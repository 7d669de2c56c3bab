"""Weights from a local Hugging Face directory and a local tokenizer.json; nothing is downloaded."""
import json

import pytest
import torch

from tiercache.engine import LLM, EngineConfig, ModelConfig, SamplingParams
from tiercache.engine.weights import load_hf_model, save_hf_model, seeded_model
from tiercache.errors import ConfigError

SMALL = ModelConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128)


def test_seeded_weights_are_identical_across_instances():
    a, b = seeded_model(SMALL, seed=3), seeded_model(SMALL, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = seeded_model(SMALL, seed=4)
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)


def test_saved_checkpoint_loads_and_generates_the_same(tmp_path):
    model = seeded_model(SMALL, seed=11)
    save_hf_model(model, tmp_path / "m")
    loaded = load_hf_model(tmp_path / "m")
    assert all(torch.equal(x, y) for x, y in zip(model.parameters(), loaded.parameters()))

    prompt = list(range(40))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with LLM(model_cfg=SMALL, engine_cfg=EngineConfig(seed=11)) as seeded:
        (want,) = seeded.generate([prompt], params)
    with LLM(model_path=str(tmp_path / "m")) as from_disk:
        (got,) = from_disk.generate([prompt], params)
        assert from_disk.namespace.model == "m"   # a checkpoint's keys never collide with the seeded model's
    assert got.token_ids == want.token_ids


def test_broken_checkpoints_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_model(tmp_path)
    save_hf_model(seeded_model(SMALL), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["hidden_size"] = 32
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="shape"):
        load_hf_model(tmp_path / "m")


def test_local_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cache keeps the prefix", "the prefix hits the cache"] * 50,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=64)
    with LLM(model_cfg=cfg, tokenizer=str(tmp_path)) as engine:
        (out,) = engine.generate(["the cache keeps the prefix"], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3 and isinstance(out.text, str)
    with pytest.raises(ConfigError, match="tokenizer"):
        LLM(model_cfg=cfg, tokenizer=str(tmp_path / "missing.json"))
