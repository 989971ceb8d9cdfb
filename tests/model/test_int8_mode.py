"""The int8 compute mode (ops.configure(compute="int8"), `--compute int8`) through the loader and
the model: every quantized linear (the fused decoder layer's included) computes on the int8
kernels (csrc/linear/int8_linear.cpp), and its logits stay within stated tolerances of the exact
mode: on tiny Llamas written in each format the int8 kernels take (and tiny Qwen2s, whose q/k/v
have biases), and on SmolLM2 (the tolerances
are about 3x what was measured: max |delta logit| 0.015 on the tiny models; on SmolLM2's prompts
top-1 logprob 0.19, top-20 0.47, top-1 agreement 11 of 12). A token's logits are the same bits
alone or beside other sequences. Where int8 cannot apply, it says so."""

from __future__ import annotations

import pytest
import torch

from freetoken import ops
from freetoken.engine.generate import build_forward_batch
from freetoken.loader import load_model
from freetoken.model.linear import packed_form
from freetoken.testing.gguf_files import write

pytestmark = pytest.mark.skipif(not ops.int8_matrix_available("Q4_K"), reason="needs freetoken._C")

BLOCK_SIZE = 16
INT8_FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K",
                "IQ4_NL", "IQ4_XS", "q4_k_m"]
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, in a small village,", "Translate to German: I like apples.",
         "Review: the food was cold and the waiter rude. Sentiment:", "2 + 2 =",
         "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n"
         "<|im_start|>assistant\n", "import numpy as np\nx = np."]


def last_logits(loaded, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), vocab]: each prompt's last-position logits, all prompts in one step."""
    kv = loaded.model.make_kv_cache(64, BLOCK_SIZE)
    seqs, next_block = [], 0
    for ids in prompts:
        n = -(-len(ids) // BLOCK_SIZE)
        seqs.append((ids, 0, list(range(next_block, next_block + n))))
        next_block += n
    batch = build_forward_batch(seqs, BLOCK_SIZE)
    return loaded.model.compute_logits(loaded.model.forward(batch, kv))


def random_prompts(n_tokens=(5, 17, 40, 90), vocab: int = 49152) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in n_tokens]


@pytest.mark.parametrize("shape,fmt", [("tiny", f) for f in INT8_FORMATS]
                         + [("tiny-qwen2", f) for f in ("Q4_K", "q4_k_m", "Q8_0", "IQ4_XS")])
def test_tiny_model_int8_is_close_to_exact(tmp_path, shape, fmt, ops_config):
    path = tmp_path / f"{shape}.{fmt}.gguf"
    write(str(path), shape, fmt, seed=3)
    prompts = random_prompts()
    out = {}
    for mode in ("exact", "int8"):
        ops_config(linear="gguf", compute=mode)
        loaded = load_model(path, progress=False, load_tokenizer=False)
        want = "int8" if mode == "int8" else "gguf"
        assert packed_form(loaded.model.layers[0].mlp.down_proj.weight) == want
        assert loaded.model.layers[0].fused is not None
        out[mode] = last_logits(loaded, prompts)
    diff = float((out["int8"] - out["exact"]).abs().max())
    assert 0 < diff < 0.05, (fmt, diff)


def test_smollm2_int8_is_close_to_exact_and_batch_invariant(smollm2_path, ops_config):
    out = {}
    for mode in ("exact", "int8"):
        ops_config(compute=mode)
        loaded = load_model(smollm2_path, progress=False)
        prompts = [loaded.tokenizer.encode(t) for t in TEXTS] + random_prompts()
        out[mode] = last_logits(loaded, prompts).log_softmax(-1)
        if mode == "int8":
            assert packed_form(loaded.model.layers[0].self_attn.qkv_proj.weight) == "int8"
            assert ops.is_int8_matrix(loaded.model.lm_head_packed)  # the tied Q8_0 lm_head
            # one prompt alone, and beside the others: the same bits
            alone = last_logits(loaded, prompts[2:3]).log_softmax(-1)
            assert torch.equal(alone[0], out[mode][2])
    exact, int8 = out["exact"], out["int8"]
    top = exact.topk(20, dim=-1).indices
    delta = (exact.gather(1, top) - int8.gather(1, top)).abs()
    assert float(delta[:, 0].max()) < 0.5, float(delta[:, 0].max())
    assert float(delta.max()) < 1.5, float(delta.max())
    agree = (exact.argmax(-1) == int8.argmax(-1)).float().mean()
    assert agree >= 0.75, float(agree)


@pytest.mark.parametrize("fmt", ["q4_k_m", "Q8_0"])
def test_int8_fused_layers_are_the_python_paths_bits(tmp_path, fmt, ops_config):
    """The fused layer's int8 down projection takes gate_up whole (ops.int8_silu_linear: the
    activation made a row at a time into its quantization); the logits are the Python path's
    (silu_mul, then the linear) bit for bit: a prefill of 44 rows (the AMX loop where the CPU
    has it), decode steps, a mixed step."""
    from test_decoder_layer import both_paths, prefill_then_decode

    path = tmp_path / f"tiny.{fmt}.gguf"
    write(str(path), "tiny", fmt, seed=4)
    ops_config(linear="gguf", compute="int8")
    loaded = load_model(path, progress=False, load_tokenizer=False)
    assert packed_form(loaded.model.layers[0].mlp.down_proj.weight) == "int8"
    on, off = both_paths(loaded.model, prefill_then_decode(4), num_blocks=24)
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_int8_refuses_what_it_cannot_compute(tmp_path, tiny_checkpoint, ops_config):
    ops_config(compute="int8")
    with pytest.raises(ValueError, match="compute int8"):
        load_model(tiny_checkpoint("llama")[0], progress=False, load_tokenizer=False)
    path = tmp_path / "tiny.Q4_K.gguf"
    write(str(path), "tiny", "Q4_K", seed=1)
    with pytest.raises(ValueError, match="compute int8"):
        load_model(path, dtype=torch.bfloat16, progress=False, load_tokenizer=False)
    with pytest.raises(ValueError, match="compute"):
        ops.configure(compute="int4")
    with pytest.raises(ValueError, match="torch twin"):
        ops.configure(backend="torch", compute="int8")
    with pytest.raises(ValueError, match="linear='panels'"):
        ops.configure(linear="panels", compute="int8")


def test_types_without_an_int8_kernel_stay_exact(tmp_path, ops_config, caplog):
    path = tmp_path / "tiny.F16.gguf"
    write(str(path), "tiny", "F16", seed=2)
    ops_config(compute="int8")
    with caplog.at_level("INFO", logger="freetoken.model"):
        loaded = load_model(path, progress=False, load_tokenizer=False)
    assert packed_form(loaded.model.layers[0].mlp.down_proj.weight) == "gguf"
    assert "F16 weights computed exact" in caplog.text
